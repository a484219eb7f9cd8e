"""Adapters binding the MLA kernels of each built-in backend to `mla.*` ops.

- triton: kernels/triton/mla.py (split-KV decode, the partials merged by the combine kernel) and
          mla_sparse.py (top-k decode)
- cpu:    kernels/cpu/mla.c (dense decode; each cache row read once per request for all query rows)
- torch:  kernels/torch/mla.py (eager, logits and probabilities in the test dtype)
- mla.schedule (FlashMLA's get_mla_metadata): conformance/backends/mla_schedule.py, merged here
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends import mla_schedule as _schedule
from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.mla import (DV, FUSED_SCALE, SCALES, fused_causal, fused_eps, fused_granularity,
                                              fused_sparse_args)


def _fused_args(t: dict, p: dict) -> tuple:
    """decode_fused_fp8's positional arguments (both backends) from the case's tensors and params."""
    return (t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], fused_eps(p), t["w_uk"], t["w_uk_scale"],
            t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"], t["cache_lengths"], FUSED_SCALE)


def _torch_pair(out: Any, device: str, o: Any, lse: Any) -> dict:
    oo, ll = out.torch("o", device), out.torch("lse", device)
    oo.copy_(o)
    ll.copy_(lse)
    return {"o": oo, "lse": ll}


def triton_ops(device: str) -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.triton.mla import mla_decode

        p = case.p
        o, lse = out.torch("o", device), out.torch("lse", device)
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        mla_decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[p["scale"]], d_v=DV,
                   causal=bool(p["causal"]), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def sparse(case, inputs, out):
        from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse

        o, lse = out.torch("o", device), out.torch("lse", device)
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        mla_decode_sparse(t["q"], t["kv_cache"], t["indices"], t["topk_length"], SCALES[case.p["scale"]], d_v=DV,
                          out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def fused_fp8(case, inputs, out):
        from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8

        o = out.torch("out", device)
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        qrope = bool(case.p.get("qrope", 0))  # writes t["kv_cache"], and with qrope t["q"]'s rope part
        mla_decode_fused_fp8(*_fused_args(t, case.p), attn_sink=t.get("attn_sink"), out=o, q_inplace=qrope,
                             sink_per=case.p.get("sink_shape", "head"), **fused_sparse_args(t, case.p))
        return {"out": o, "kv_cache": t["kv_cache"], **({"q": t["q"]} if qrope else {})}

    return {"mla.decode": decode, "mla.decode_sparse": sparse, "mla.decode_fused_fp8": fused_fp8,
            **_schedule.triton_ops(device)}


def triton_supports() -> dict[str, Callable]:
    """The Triton fused FP8 branch quantizes in DeepSeek's groups (1 token x 128 channels, 128 x 128 weight blocks)
    and masks causally (or, sparse, attends each token's index list)."""
    def fused(case) -> str | None:
        if fused_granularity(case.p) != (1, 128, 128):
            return (f"the Triton mla.decode_fused_fp8 kernel takes the (1, 128, 128) scale granularity only "
                    f"(gran={case.p['gran']})")
        if not fused_causal(case.p):
            return f"the Triton mla.decode_fused_fp8 kernel masks causally only (mask={case.p['mask']})"
        return None

    return {"mla.decode_fused_fp8": fused}


def cpu_ops() -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.cpu.mla import mla_decode

        p = case.p
        o, lse = out.numpy("o"), out.numpy("lse")
        mla_decode(inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seqlens"], SCALES[p["scale"]],
                   d_v=DV, causal=bool(p["causal"]), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {"mla.decode": decode, **_schedule.cpu_ops()}


def torch_ops(device: str) -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.torch import mla as k

        p = case.p
        t = {n: to_torch(v, device) for n, v in inputs.items()}
        o, lse = k.decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[p["scale"]], d_v=DV,
                          causal=bool(p["causal"]))
        return _torch_pair(out, device, o, lse)

    def sparse(case, inputs, out):
        from kernel_parity.kernels.torch import mla as k

        t = {n: to_torch(v, device) for n, v in inputs.items()}
        o, lse = k.decode_sparse(t["q"], t["kv_cache"], t["indices"], t["topk_length"], SCALES[case.p["scale"]],
                                 d_v=DV)
        return _torch_pair(out, device, o, lse)

    def fused_fp8(case, inputs, out):
        from kernel_parity.kernels.torch import mla as k

        t = {n: to_torch(v, device) for n, v in inputs.items()}
        qrope = bool(case.p.get("qrope", 0))
        o, cache = k.decode_fused_fp8(*_fused_args(t, case.p), attn_sink=t.get("attn_sink"), inplace=True,
                                      q_inplace=qrope, sink_per=case.p.get("sink_shape", "head"),
                                      granularity=fused_granularity(case.p), causal=fused_causal(case.p),
                                      **fused_sparse_args(t, case.p))
        oo = out.torch("out", device)
        oo.copy_(o)
        return {"out": oo, "kv_cache": cache, **({"q": t["q"]} if qrope else {})}

    return {"mla.decode": decode, "mla.decode_sparse": sparse, "mla.decode_fused_fp8": fused_fp8,
            **_schedule.torch_ops(device)}
