"""torch.nn.functional.rms_norm and F.layer_norm as a third-party peer backend, `torch-norm`.

Registered through the `kernel_parity.backends` entry point like any outside plugin. It runs on
the GPU when CUDA is available (torch's CUDA norm kernels), else on the CPU (ATen's CPU kernels;
torch >= 2.8 dispatches F.rms_norm with a weight of the input's dtype to its fused kernel).
These are kernels nobody here wrote; `supports()` says what their public API cannot express:

- no fused residual add: F.rms_norm normalises its input and returns nothing else, so cases
  with `residual = 1` are unsupported (adding x + r here would test this adapter, not torch);
- no statistics: the public functions return y only, so `rstd` (and LayerNorm's `mean`) are
  reported as not provided; y is still judged in those cases;
- Gemma's (1 + w): passed as the weight, computed by this adapter as (1 + w) in float32 and
  rounded once to the weight's storage dtype, as a checkpoint converter folds the offset
  (llama.cpp adds 1 to Gemma's norm weights at conversion). That rounding is the adapter's, and
  the fold is the only way the public API can express the offset;
- aligned rows: torch is called on the real lanes x[:, :n] (a strided view, no copy) and knows
  nothing of the padding; this adapter writes the padding lanes [n, n + pad) of the output as
  zeros itself, so a pass there says nothing about torch (it never sees those lanes).

The backward ops (`norm.rms_norm_backward`, `norm.layer_norm_backward`) are torch autograd of the
same calls on the real lanes: x, w (and b) as leaves, F.rms_norm's / F.layer_norm's own backward
kernels (ATen's, which recompute or save their own statistics: the case's rstd / mean are not
used), the cotangent dy's real lanes. Gemma's fold (1 + w) sits inside the graph, so dw is the
gradient of w itself. The fused residual is unsupported as in the forward; the padding lanes of dx,
dw and db are this adapter's zeros. `parity bench` times the backward alone (`Backend.timed`: the
forward once, untimed, then autograd.grad with retain_graph), not the copies into the harness's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernel_parity.conformance.backends import Backend, NotProvided
from kernel_parity.conformance.backends._torch import autograd_timed, cuda_available, to_torch, torch_available

OPS = ("norm.rms_norm", "norm.layer_norm", "norm.rms_norm_backward", "norm.layer_norm_backward")


@dataclass
class TorchNormBackend(Backend):
    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        import torch.nn.functional as F

        if not hasattr(F, "rms_norm"):
            return "this torch has no torch.nn.functional.rms_norm (added in torch 2.4)"
        return None

    def supports(self, case: Any) -> str | None:
        if case.op not in OPS:
            return f"{self.name} has no kernel for {case.op}"
        if case.dtype not in self.dtypes:
            return f"{self.name} does not support {case.dtype}"
        if case.op in ("norm.rms_norm", "norm.rms_norm_backward") and case.p["residual"]:
            return "F.rms_norm has no fused residual add (it returns y only, never h = x + r)"
        return None

    def run(self, case: Any, inputs: dict, out: Any) -> dict:
        if case.op.endswith("_backward"):
            return self._backward(case, inputs, out)
        import torch
        import torch.nn.functional as F

        p, dev = case.p, self.device
        n, eps = p["n"], float(p["eps"])
        x = to_torch(inputs["x"], dev)[:, :n]
        w = to_torch(inputs["w"], dev)[:n]
        y = out.torch("y", dev)
        if case.op == "norm.rms_norm":
            if p["gemma"]:
                w = (1.0 + w.to(torch.float32)).to(w.dtype)  # the offset folded into the weight
            y[:, :n] = F.rms_norm(x, (n,), w, eps)
            res: dict[str, Any] = {"y": y}
            if p["rstd"]:
                res["rstd"] = NotProvided("F.rms_norm returns no rstd")
        else:
            b = to_torch(inputs["b"], dev)[:n] if p["bias"] else None
            y[:, :n] = F.layer_norm(x, (n,), w, b, eps)
            res = {"y": y}
            if p["stats"]:
                res["mean"] = NotProvided("F.layer_norm returns no mean")
                res["rstd"] = NotProvided("F.layer_norm returns no rstd")
        y[:, n:] = 0  # the adapter's zeros in the padding lanes: torch never sees them
        return res


    def _backward(self, case: Any, inputs: dict, out: Any) -> dict:
        import torch
        import torch.nn.functional as F

        p, dev = case.p, self.device
        n, eps = p["n"], float(p["eps"])
        x = to_torch(inputs["x"], dev)[:, :n].detach().requires_grad_()
        w = to_torch(inputs["w"], dev)[:n].detach().requires_grad_()
        dy = to_torch(inputs["dy"], dev)[:, :n]
        leaves = [x, w]
        with torch.enable_grad():
            if case.op == "norm.rms_norm_backward":
                wf = (1.0 + w.to(torch.float32)).to(w.dtype) if p["gemma"] else w  # the fold, inside the graph
                y = F.rms_norm(x, (n,), wf, eps)
            else:
                b = to_torch(inputs["b"], dev)[:n].detach().requires_grad_() if p["bias"] else None
                leaves += [b] if b is not None else []
                y = F.layer_norm(x, (n,), w, b, eps)
            grads = torch.autograd.grad([y], leaves, [dy])
        res = {"dx": out.torch("dx", dev)}
        res["dx"][:, :n] = grads[0]
        res["dx"][:, n:] = 0  # the adapter's zeros in the padding lanes: torch never sees them
        for name, g in zip(("dw", "db"), grads[1:]):
            res[name] = out.torch(name, dev)
            res[name][:n] = g
            res[name][n:] = 0
        return res


def _make() -> TorchNormBackend:
    device = "cuda" if cuda_available() else "cpu"
    backend = TorchNormBackend(name="torch-norm", device=device, ops={op: None for op in OPS},
                               doc=f"torch.nn.functional.rms_norm / layer_norm on {device}")
    # `parity bench` times the backward alone: the forward once, untimed, then autograd.grad with
    # retain_graph (ATen's fused norm backward kernels), as benchmarks/gpu_layers_bwd.py --direct times torch
    backend.timed = {op: autograd_timed(backend._backward, "F.rms_norm / F.layer_norm's backward alone: the "
                                                           "forward ran once, untimed (autograd.grad, retain_graph)")
                     for op in OPS if op.endswith("_backward")}
    return backend


BACKEND = _make
