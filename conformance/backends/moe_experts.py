"""Adapters binding each built-in backend's fused MoE experts kernel to `moe.experts`.

- triton: kernels/triton/moe_experts.py (sorted token blocks, tl.dot GEMMs, SwiGLU in GEMM1's epilogue)
- cpu:    kernels/cpu/moe_experts.c (a token at a time, fp32)
- torch:  kernels/torch/moe_experts.py (eager, HF Mixtral's loop in the model dtype: the baseline)
Weights pass as arrays, or as dicts of their parts: int4 (qweight, qzeros, scales), block FP8 (codes, scales:
the case's <w>_codes, <w>_bscales) and GGML (fmt: the case's wfmt, blocks: its <w>_ggml); wfmt=fp8 calls the
kernels with act_fp8=True (w8a8).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.moe_experts import fp8_weight, ggml_weight, int4_weight

_WEIGHTS = ("w13", "w2", "ws13", "ws2")


def _weights(inputs, convert, fmt: str) -> dict:
    """{name: dense array, or the int4 / block-FP8 / GGML dict of its parts} of the weights present, each array
    converted (fmt: the case's wfmt, a GGML weight's format)."""
    out = {}
    for n in _WEIGHTS:
        gg = ggml_weight(inputs, n, fmt)
        if gg is not None:
            out[n] = {"fmt": gg["fmt"], "blocks": convert(gg["blocks"])}
            continue
        q = int4_weight(inputs, n) or fp8_weight(inputs, n)
        if q is not None:
            out[n] = {part: convert(a) for part, a in q.items()}
        elif n in inputs:
            out[n] = convert(inputs[n])
    return out


def _torch_args(case, inputs, device: str) -> tuple[list, dict]:
    import torch

    args = [to_torch(inputs["x"], device), to_torch(inputs["ids"], device).to(torch.int32),
            to_torch(inputs["weights"], device)]
    w = _weights(inputs, lambda a: to_torch(a, device), case.p.get("wfmt"))
    return args + [w["w13"], w["w2"]], {"ws13": w.get("ws13"), "ws2": w.get("ws2")}


def _a8(case) -> bool:
    """wfmt=fp8: w8a8 (the activations quantized too)."""
    return case.p.get("wfmt") == "fp8"


def triton_ops(device: str) -> dict[str, Callable]:
    def experts(case, inputs, out):
        from kernel_parity.kernels.triton.moe_experts import experts as kernel

        args, kw = _torch_args(case, inputs, device)
        return {"out": kernel(*args, **kw, act_fp8=_a8(case))}

    return {"moe.experts": experts}


def cpu_ops() -> dict[str, Callable]:
    def experts(case, inputs, out):
        from kernel_parity.kernels.cpu.moe_experts import experts as kernel

        c = {"x": np.ascontiguousarray(inputs["x"]), **_weights(inputs, np.ascontiguousarray, case.p.get("wfmt"))}
        return {"out": kernel(c["x"], np.ascontiguousarray(inputs["ids"], dtype=np.int32),
                              np.ascontiguousarray(inputs["weights"], dtype=np.float32), c["w13"], c["w2"],
                              ws13=c.get("ws13"), ws2=c.get("ws2"), act_fp8=_a8(case))}

    return {"moe.experts": experts}


def torch_ops(device: str) -> dict[str, Callable]:
    def experts(case, inputs, out):
        from kernel_parity.kernels.torch.moe_experts import experts as kernel

        args, kw = _torch_args(case, inputs, device)
        return {"out": kernel(*args, **kw, act_fp8=_a8(case))}

    return {"moe.experts": experts}
