"""Adapters binding each built-in backend's MoE layer to `moe.layer` (merged into the `moe` family's adapters by
conformance/backends/moe.py `_more`).

- triton: kernels/triton/moe_layer.py (a Triton router GEMM, then the Triton route, align and experts kernels)
- cpu:    kernels/cpu/moe_layer.py (moe_layer.c's router GEMM, then moe.c's routing and moe_experts.c's experts)
- torch:  kernels/torch/moe_layer.py (eager, Hugging Face style: fp32 F.linear router, torch.topk, the experts loop)
Each returns its experts in rank order; the adapters hand ids and weights over in the op's canonical order (ids
ascending per token, conformance/ops/moe_route.py `canonical`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.moe_route import canonical, route_args

_WEIGHTS = ("wg", "w13", "w2", "ws13", "ws2")


def _canonical_torch(out, weights, ids) -> dict:
    import torch

    order = torch.sort(ids.long(), dim=-1, stable=True).indices
    return {"out": out, "ids": ids.gather(1, order).to(torch.int32), "weights": weights.float().gather(1, order)}


def _torch_call(kernel, case, inputs, device: str) -> dict:
    w = {n: to_torch(inputs[n], device) for n in _WEIGHTS if n in inputs}
    bias = to_torch(inputs["bias"], device) if "bias" in inputs else None
    out, weights, ids = kernel(to_torch(inputs["x"], device), w["wg"], w["w13"], w["w2"], case.p["k"], bias=bias,
                               ws13=w.get("ws13"), ws2=w.get("ws2"), **route_args(case.p))
    return _canonical_torch(out, weights, ids)


def triton_ops(device: str) -> dict[str, Callable]:
    def layer(case, inputs, out):
        from kernel_parity.kernels.triton.moe_layer import layer as kernel

        return _torch_call(kernel, case, inputs, device)

    return {"moe.layer": layer}


def cpu_ops() -> dict[str, Callable]:
    def layer(case, inputs, out):
        from kernel_parity.kernels.cpu.moe_layer import layer as kernel

        w = {n: np.ascontiguousarray(inputs[n]) for n in _WEIGHTS if n in inputs}
        bias = np.ascontiguousarray(inputs["bias"], dtype=np.float32) if "bias" in inputs else None
        res, weights, ids = kernel(np.ascontiguousarray(inputs["x"]), w["wg"], w["w13"], w["w2"], case.p["k"],
                                   bias=bias, ws13=w.get("ws13"), ws2=w.get("ws2"), **route_args(case.p))
        return {"out": res, **canonical(weights, ids)}

    return {"moe.layer": layer}


def torch_ops(device: str) -> dict[str, Callable]:
    def layer(case, inputs, out):
        from kernel_parity.kernels.torch.moe_layer import layer as kernel

        return _torch_call(kernel, case, inputs, device)

    return {"moe.layer": layer}
