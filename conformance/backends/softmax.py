"""Adapters binding the softmax-family kernels of each built-in backend to op names.

The backward ops hand our Triton and C kernels the forward output y (and the cotangents): dx =
y (dy - sum(dy y) + dlse) needs neither x nor the LSE. The eager baseline differentiates its own
forward from x (autograd), as a PyTorch user's training step does."""

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

    def softmax_backward(case, inputs, out):
        from kernel_parity.kernels.triton import softmax_grad as k

        dx = out.torch("dx", device)
        k.softmax_backward(to_torch(inputs["y"], device), to_torch(inputs["dy"], device), out=dx)
        return {"dx": dx}

    def online_softmax_backward(case, inputs, out):
        from kernel_parity.kernels.triton import softmax_grad as k

        dx = out.torch("dx", device)
        k.online_softmax_backward(to_torch(inputs["y"], device), to_torch(inputs["dy"], device),
                                  to_torch(inputs["dlse"], device), case.p["tile"], out=dx)
        return {"dx": dx}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax,
            "softmax.softmax_backward": softmax_backward, "softmax.online_softmax_backward": online_softmax_backward}


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

    def softmax_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import softmax as k

        dx = out.numpy("dx")
        k.softmax_backward(inputs["y"], inputs["dy"], out=dx)
        return {"dx": dx}

    def online_softmax_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import softmax as k

        dx = out.numpy("dx")
        k.online_softmax_backward(inputs["y"], inputs["dy"], inputs["dlse"], case.p["tile"], out=dx)
        return {"dx": dx}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax,
            "softmax.softmax_backward": softmax_backward, "softmax.online_softmax_backward": online_softmax_backward}


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

    def softmax_backward(case, inputs, out):
        from kernel_parity.kernels.torch import softmax as k

        dx = out.torch("dx", device)
        dx.copy_(k.softmax_backward(to_torch(inputs["x"], device), to_torch(inputs["dy"], device)))
        return {"dx": dx}

    def online_softmax_backward(case, inputs, out):
        from kernel_parity.kernels.torch import softmax as k

        dx = out.torch("dx", device)
        dx.copy_(k.online_softmax_backward(to_torch(inputs["x"], device), case.p["tile"],
                                           to_torch(inputs["dy"], device), to_torch(inputs["dlse"], device)))
        return {"dx": dx}

    return {"softmax.softmax": softmax, "softmax.online_softmax": online_softmax,
            "softmax.softmax_backward": softmax_backward, "softmax.online_softmax_backward": online_softmax_backward}
