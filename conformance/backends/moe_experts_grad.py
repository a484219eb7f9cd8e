"""Adapters binding each built-in backend's MoE experts backward to `moe.experts_backward`.

- triton: kernels/triton/moe_experts_grad.py (grouped GEMMs over the sorted token blocks, a per-slot dx buffer)
- cpu:    kernels/cpu/moe_experts_grad.c (an expert at a time, fp32)
- torch:  kernels/torch/moe_experts_grad.py (eager autograd of HF Mixtral's loop in the model dtype: the baseline)
Every kernel writes into the case's (poisoned) output buffers: an element it leaves unwritten is seen.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch

_TENSORS = ("x", "w13", "w2", "dout", "ws13", "ws2")


def _torch_call(module: str, case, inputs, out, device: str) -> dict:
    import importlib

    import torch

    kernel = importlib.import_module(f"kernel_parity.kernels.{module}.moe_experts_grad").experts_backward
    a = {n: to_torch(inputs[n], device) for n in _TENSORS if n in inputs}
    bufs = {n: out.torch(n, device) for n in out.shapes}
    return kernel(a["x"], to_torch(inputs["ids"], device).to(torch.int32), to_torch(inputs["weights"], device),
                  a["w13"], a["w2"], a["dout"], ws13=a.get("ws13"), ws2=a.get("ws2"), out=bufs)


def triton_ops(device: str) -> dict[str, Callable]:
    def experts_backward(case, inputs, out):
        return _torch_call("triton", case, inputs, out, device)

    return {"moe.experts_backward": experts_backward}


def cpu_ops() -> dict[str, Callable]:
    def experts_backward(case, inputs, out):
        from kernel_parity.kernels.cpu.moe_experts_grad import experts_backward as kernel

        a = {n: np.ascontiguousarray(inputs[n]) for n in _TENSORS if n in inputs}
        return kernel(a["x"], np.ascontiguousarray(inputs["ids"], dtype=np.int32),
                      np.ascontiguousarray(inputs["weights"], dtype=np.float32), a["w13"], a["w2"], a["dout"],
                      ws13=a.get("ws13"), ws2=a.get("ws2"), out={n: out.numpy(n) for n in out.shapes})

    return {"moe.experts_backward": experts_backward}


def torch_ops(device: str) -> dict[str, Callable]:
    def experts_backward(case, inputs, out):
        return _torch_call("torch", case, inputs, out, device)

    return {"moe.experts_backward": experts_backward}
