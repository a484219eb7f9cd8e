"""Adapters binding each built-in backend's quantized-KV-cache decode kernel to `kvquant.decode_paged`.

- triton: kernels/triton/kvquant_decode.py (flash decoding: codes as 8-bit, scales out of the dots, GQA packed)
- cpu:    kernels/cpu/kvquant_decode.c (fp32 loops, one (sequence, query head) at a time)
- torch:  kernels/torch/kvquant_decode.py (eager: dequantize to fp32, then fp32 attention)
Every kernel writes into the poisoned output buffers; the codes travel in their own dtype (int8 or float8).
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch

OP = "kvquant.decode_paged"
ARGS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "block_table", "seq_lens")


def triton_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_decode import decode_paged

        o, lse = out.torch("o", device), out.torch("lse", device)
        decode_paged(*(to_torch(inputs[k], device) for k in ARGS), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {OP: run}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_decode import decode_paged

        o, lse = out.numpy("o"), out.numpy("lse")
        decode_paged(*(inputs[k] for k in ARGS), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {OP: run}


def torch_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_decode import decode_paged

        o, lse = decode_paged(*(to_torch(inputs[k], device) for k in ARGS))
        return {"o": o, "lse": lse}

    return {OP: run}
