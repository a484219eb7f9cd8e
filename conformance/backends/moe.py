"""Adapters binding each built-in backend's MoE kernels to `moe.*` ops.

- triton: kernels/triton/moe.py (one program per block of tokens, the experts in registers)
- cpu:    kernels/cpu/moe.c (a token at a time, fp32)
- torch:  kernels/torch/moe.py (eager, fp32 scores, stable sorts)
Each kernel returns its experts in rank order; the adapters hand them over in the op's canonical order (ids
ascending per token, conformance/ops/moe_route.py `canonical`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.moe_route import canonical, route_args


def _more(factory: str, *args) -> dict[str, Callable]:
    """The adapters of the family's other ops (conformance/backends/moe_align.py, moe_experts.py, moe_grad.py,
    moe_experts_grad.py, moe_layer.py)."""
    from kernel_parity.conformance.backends import moe_align, moe_experts, moe_experts_grad, moe_grad, moe_layer

    out: dict[str, Callable] = {}
    for module in (moe_align, moe_experts, moe_grad, moe_experts_grad, moe_layer):
        fn = getattr(module, factory, None)
        if fn is not None:
            out.update(fn(*args))
    return out


def _canonical_torch(weights, ids) -> dict:
    import torch

    order = torch.sort(ids.long(), dim=-1, stable=True).indices
    return {"ids": ids.gather(1, order).to(torch.int32), "weights": weights.float().gather(1, order)}


def triton_ops(device: str) -> dict[str, Callable]:
    def route(case, inputs, out):
        from kernel_parity.kernels.triton.moe import route as kernel

        bias = to_torch(inputs["bias"], device) if "bias" in inputs else None
        w, ids = kernel(to_torch(inputs["logits"], device), case.p["k"], bias=bias, **route_args(case.p))
        return _canonical_torch(w, ids)

    return {"moe.route": route, **_more("triton_ops", device)}


def cpu_ops() -> dict[str, Callable]:
    def route(case, inputs, out):
        from kernel_parity.kernels.cpu.moe import route as kernel

        bias = inputs["bias"].astype(np.float32) if "bias" in inputs else None
        logits = np.ascontiguousarray(inputs["logits"].astype(np.float32))  # bf16 / fp16 widen exactly
        w, ids = kernel(logits, case.p["k"], bias=bias, **route_args(case.p))
        return canonical(w, ids)

    return {"moe.route": route, **_more("cpu_ops")}


def torch_ops(device: str) -> dict[str, Callable]:
    def route(case, inputs, out):
        from kernel_parity.kernels.torch.moe import route as kernel

        bias = to_torch(inputs["bias"], device) if "bias" in inputs else None
        w, ids = kernel(to_torch(inputs["logits"], device), case.p["k"], bias=bias, **route_args(case.p))
        return _canonical_torch(w, ids)

    return {"moe.route": route, **_more("torch_ops", device)}
