"""Adapters binding each built-in backend's kernel of `moe.route_backward` (merged by conformance/backends/moe.py).

- triton: kernels/triton/moe_grad.py (one program per block of tokens, the experts in registers)
- cpu:    kernels/cpu/moe_grad.c (a token at a time, fp32)
- torch:  kernels/torch/moe_grad.py (eager: autograd through the router's weights, the ids fixed)
Each takes the case's ids (the golden forward's choice) and grad_w; none re-routes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.moe_route import route_args


def _torch_args(inputs, device):
    bias = to_torch(inputs["bias"], device) if "bias" in inputs else None
    return (to_torch(inputs["logits"], device), to_torch(inputs["ids"], device),
            to_torch(inputs["grad_w"], device)), bias


def triton_ops(device: str) -> dict[str, Callable]:
    def route_backward(case, inputs, out):
        from kernel_parity.kernels.triton.moe_grad import route_backward as kernel

        args, bias = _torch_args(inputs, device)
        return {"grad_logits": kernel(*args, bias=bias, **route_args(case.p))}

    return {"moe.route_backward": route_backward}


def cpu_ops() -> dict[str, Callable]:
    def route_backward(case, inputs, out):
        from kernel_parity.kernels.cpu.moe_grad import route_backward as kernel

        bias = inputs["bias"].astype(np.float32) if "bias" in inputs else None
        logits = np.ascontiguousarray(inputs["logits"].astype(np.float32))  # bf16 / fp16 widen exactly
        g = kernel(logits, np.ascontiguousarray(inputs["ids"], dtype=np.int32),
                   np.ascontiguousarray(inputs["grad_w"], dtype=np.float32), bias=bias, **route_args(case.p))
        return {"grad_logits": g}

    return {"moe.route_backward": route_backward}


def torch_ops(device: str) -> dict[str, Callable]:
    def route_backward(case, inputs, out):
        from kernel_parity.kernels.torch.moe_grad import route_backward as kernel

        args, bias = _torch_args(inputs, device)
        return {"grad_logits": kernel(*args, bias=bias, **route_args(case.p))}

    return {"moe.route_backward": route_backward}
