"""Adapters binding the softmax-family kernels of each built-in backend to op names."""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance.backends._torch import to_torch


def triton_ops(device: str) -> dict[str, Any]:
    def softmax(case, inputs, out):
        from kernel_parity.kernels.triton import softmax as k

        y = out.torch("y", device)
        k.softmax(to_torch(inputs["x"], device), out=y)
        return {"y": y}

    def online_softmax(case, inputs, out):
        from kernel_parity.kernels.triton import softmax as k

        y, lse = out.torch("y", device), out.torch("lse", device)
        k.online_softmax(to_torch(inputs["x"], device), case.p["tile"], out=y, out_lse=lse)
        return {"y": y, "lse": lse}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax}


def cpu_ops() -> dict[str, Any]:
    def softmax(case, inputs, out):
        from kernel_parity.kernels.cpu import softmax as k

        y = out.numpy("y")
        k.softmax(inputs["x"], out=y)
        return {"y": y}

    def online_softmax(case, inputs, out):
        from kernel_parity.kernels.cpu import softmax as k

        y, lse = out.numpy("y"), out.numpy("lse")
        k.online_softmax(inputs["x"], case.p["tile"], out=y, out_lse=lse)
        return {"y": y, "lse": lse}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax}


def torch_ops(device: str) -> dict[str, Any]:
    def softmax(case, inputs, out):
        from kernel_parity.kernels.torch import softmax as k

        y = out.torch("y", device)
        y.copy_(k.softmax(to_torch(inputs["x"], device)))
        return {"y": y}

    def online_softmax(case, inputs, out):
        from kernel_parity.kernels.torch import softmax as k

        y, lse = out.torch("y", device), out.torch("lse", device)
        y_, lse_ = k.online_softmax(to_torch(inputs["x"], device), case.p["tile"])
        y.copy_(y_)
        lse.copy_(lse_)
        return {"y": y, "lse": lse}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax}
