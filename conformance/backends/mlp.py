"""Adapters binding the gated-MLP kernels (SwiGLU, GeGLU) of each built-in backend to op names.

A case's inputs are `h` (t, 2i), gate first (layout=fused), or `gate` and `up` (t, i) (layout=split);
each kernel module has a fused entry point that takes h itself, so the halves are views of one
buffer in the kernel too. The backward ops return dh (t, 2i) for the fused layout (our kernels write
dgate and dup into its two halves) and dgate, dup for the split one.
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

    def backward(op):
        def run(case, inputs, out):
            from kernel_parity.kernels.triton import mlp as k

            approx = case.p.get("approx", "tanh")
            dy = to_torch(inputs["dy"], device)
            if case.p["layout"] == "fused":
                dh = out.torch("dh", device)
                k.glu_backward_fused(op, to_torch(inputs["h"], device), dy, approx, out=dh)
                return {"dh": dh}
            res = {"dgate": out.torch("dgate", device), "dup": out.torch("dup", device)}
            k.glu_backward(op, to_torch(inputs["gate"], device), to_torch(inputs["up"], device), dy, approx,
                           out_dgate=res["dgate"], out_dup=res["dup"])
            return res
        return run

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu,
            "mlp.swiglu_backward": backward("swiglu"), "mlp.geglu_backward": backward("geglu")}


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

    def backward(op):
        def run(case, inputs, out):
            from kernel_parity.kernels.cpu import mlp as k

            approx = case.p.get("approx", "tanh")
            if case.p["layout"] == "fused":
                dh = out.numpy("dh")
                k.glu_backward_fused(op, inputs["h"], inputs["dy"], approx, out=dh)
                return {"dh": dh}
            res = {"dgate": out.numpy("dgate"), "dup": out.numpy("dup")}
            k.glu_backward(op, inputs["gate"], inputs["up"], inputs["dy"], approx, out_dgate=res["dgate"],
                           out_dup=res["dup"])
            return res
        return run

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu,
            "mlp.swiglu_backward": backward("swiglu"), "mlp.geglu_backward": backward("geglu")}


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

    def backward(op):
        def run(case, inputs, out):
            from kernel_parity.kernels.torch import mlp as k

            approx = case.p.get("approx", "tanh")
            t = {name: to_torch(a, device) for name, a in inputs.items()}
            grads = k.glu_backward(op, t["dy"], h=t.get("h"), gate=t.get("gate"), up=t.get("up"), approx=approx)
            names = ("dh",) if case.p["layout"] == "fused" else ("dgate", "dup")
            return {name: out.torch(name, device).copy_(g) for name, g in zip(names, grads)}
        return run

    return {"mlp.swiglu": swiglu, "mlp.geglu": geglu,
            "mlp.swiglu_backward": backward("swiglu"), "mlp.geglu_backward": backward("geglu")}
