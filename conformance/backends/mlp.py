"""Adapters binding the gated-MLP kernels (SwiGLU, GeGLU) of each built-in backend to op names.

A case's inputs are `h` (t, 2i), gate first (layout=fused), or `gate` and `up` (t, i) (layout=split);
each kernel module has a fused entry point that takes h itself, so the halves are views of one
buffer in the kernel too.
"""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance.backends._torch import to_torch


def triton_ops(device: str) -> dict[str, Any]:
    def swiglu(case, inputs, out):
        from kernel_parity.kernels.triton import mlp as k

        y = out.torch("y", device)
        if case.p["layout"] == "fused":
            k.swiglu_fused(to_torch(inputs["h"], device), out=y)
        else:
            k.swiglu(to_torch(inputs["gate"], device), to_torch(inputs["up"], device), out=y)
        return {"y": y}

    def geglu(case, inputs, out):
        from kernel_parity.kernels.triton import mlp as k

        y = out.torch("y", device)
        if case.p["layout"] == "fused":
            k.geglu_fused(to_torch(inputs["h"], device), case.p["approx"], out=y)
        else:
            k.geglu(to_torch(inputs["gate"], device), to_torch(inputs["up"], device), case.p["approx"], out=y)
        return {"y": y}

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu}


def cpu_ops() -> dict[str, Any]:
    def swiglu(case, inputs, out):
        from kernel_parity.kernels.cpu import mlp as k

        y = out.numpy("y")
        if case.p["layout"] == "fused":
            k.swiglu_fused(inputs["h"], out=y)
        else:
            k.swiglu(inputs["gate"], inputs["up"], out=y)
        return {"y": y}

    def geglu(case, inputs, out):
        from kernel_parity.kernels.cpu import mlp as k

        y = out.numpy("y")
        if case.p["layout"] == "fused":
            k.geglu_fused(inputs["h"], case.p["approx"], out=y)
        else:
            k.geglu(inputs["gate"], inputs["up"], case.p["approx"], out=y)
        return {"y": y}

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu}


def torch_ops(device: str) -> dict[str, Any]:
    def _gate_up(case, inputs):
        from kernel_parity.kernels.torch import mlp as k

        if case.p["layout"] == "fused":
            return k.halves(to_torch(inputs["h"], device))
        return to_torch(inputs["gate"], device), to_torch(inputs["up"], device)

    def swiglu(case, inputs, out):
        from kernel_parity.kernels.torch import mlp as k

        y = out.torch("y", device)
        y.copy_(k.swiglu(*_gate_up(case, inputs)))
        return {"y": y}

    def geglu(case, inputs, out):
        from kernel_parity.kernels.torch import mlp as k

        y = out.torch("y", device)
        y.copy_(k.geglu(*_gate_up(case, inputs), case.p["approx"]))
        return {"y": y}

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu}
