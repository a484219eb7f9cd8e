"""Adapters binding each built-in backend's quantized-KV-cache decode kernels to `kvquant.decode` and
`kvquant.decode_split`.

- triton: kernels/triton/kvquant_split.py (flash decoding: codes as 8-bit, scales out of the dots, GQA and the
  s_q queries packed into the dots' rows; kernels/triton/kvquant_decode.py's `_attend`)
- cpu:    kernels/cpu/kvquant_split.c (fp32 loops, one (sequence, query, head, split) at a time)
- torch:  kernels/torch/kvquant_split.py (eager: dequantize to fp32, then kernels/torch/attention.py)
Every kernel writes into the poisoned output buffers but the eager one; the codes travel in their own dtype.
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch

DECODE, SPLIT = "kvquant.decode", "kvquant.decode_split"
ARGS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seqlens")
SPLIT_OUTS = ("o", "lse", "o_parts", "lse_parts")


def _part(case, inputs, convert) -> dict:
    """The partition's keywords (block / bounds; none for equal counts)."""
    if case.p.get("part") == "block":
        return {"block": case.p["blk"]}
    if case.p.get("part") == "bounds":
        return {"bounds": convert(inputs["split_bounds"])}
    return {}


def triton_ops(device: str) -> dict[str, Callable]:
    def run_decode(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_split import decode

        o, lse = out.torch("o", device), out.torch("lse", device)
        decode(*(to_torch(inputs[k], device) for k in ARGS), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def run_split(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_split import decode_split

        o, lse, o_parts, lse_parts = (out.torch(k, device) for k in SPLIT_OUTS)
        bt = to_torch(inputs["block_table"], device) if "block_table" in inputs else None
        decode_split(*(to_torch(inputs[k], device) for k in ARGS), case.p["splits"], block_table=bt, out=o,
                     out_lse=lse, out_o_parts=o_parts, out_lse_parts=lse_parts,
                     **_part(case, inputs, lambda a: to_torch(a, device)))
        return {"o": o, "lse": lse, "o_parts": o_parts, "lse_parts": lse_parts}

    return {DECODE: run_decode, SPLIT: run_split}


def cpu_ops() -> dict[str, Callable]:
    def run_decode(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_split import decode

        o, lse = out.numpy("o"), out.numpy("lse")
        decode(*(inputs[k] for k in ARGS), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def run_split(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_split import decode_split

        o, lse, o_parts, lse_parts = (out.numpy(k) for k in SPLIT_OUTS)
        decode_split(*(inputs[k] for k in ARGS), case.p["splits"], block_table=inputs.get("block_table"), out=o,
                     out_lse=lse, out_o_parts=o_parts, out_lse_parts=lse_parts, **_part(case, inputs, lambda a: a))
        return {"o": o, "lse": lse, "o_parts": o_parts, "lse_parts": lse_parts}

    return {DECODE: run_decode, SPLIT: run_split}


def torch_ops(device: str) -> dict[str, Callable]:
    def run_decode(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_split import decode

        o, lse = decode(*(to_torch(inputs[k], device) for k in ARGS))
        return {"o": o, "lse": lse}

    def run_split(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_split import decode_split

        bt = to_torch(inputs["block_table"], device) if "block_table" in inputs else None
        res = decode_split(*(to_torch(inputs[k], device) for k in ARGS), case.p["splits"], block_table=bt,
                           **_part(case, inputs, lambda a: to_torch(a, device)))
        return dict(zip(SPLIT_OUTS, res))

    return {DECODE: run_decode, SPLIT: run_split}
