"""liger-kernel (LinkedIn's Triton kernels for LLM training) as a third-party backend, `liger`.

Registered through the `kernel_parity.backends` entry point like any outside plugin; installed by
the `peers` extra (`pip install 'kernel-parity[peers]'`); runs on a CUDA GPU. Read against
liger-kernel 0.8.5. Each op is called through the public `liger_kernel.ops` names (the active
implementation for the device), one call per case:

- norm.rms_norm: `LigerRMSNormFunction` (`rms_norm_forward` when rstd is an output: the function
  it runs, which also returns rstd), or `LigerFusedAddRMSNormFunction` / `fused_add_rms_norm_forward`
  with the residual (h = x + r is returned as the new residual). offset 0 and casting mode "llama"
  for w, offset 1 and casting mode "gemma" for Gemma's (1 + w): the modes liger's own Llama and
  Gemma modules use ("llama" rounds x * rstd to the dtype before the weight product; "gemma" computes
  everything in fp32).
- norm.layer_norm: `LigerLayerNormFunction` (`layer_norm_forward` with mean / rstd). It always adds a
  bias; without one it gets zeros, as liger's own LigerLayerNorm(bias=False) holds.
- rope.rope: `LigerRopeFunction`, HF's layout: q (1, h, t, d) as a transposed view, rotated in
  place, with a throwaway one-head k; cos and sin (1, t, rot/2) gathered at the token positions
  from the case's table (a gather, exact; fp16 pairs and freqs_cis pairs widened to fp32 exactly),
  `rotary_dim=rot`. Liger computes in cos / sin's dtype, so here in fp32.
- mlp.swiglu: `LigerFusedGateUpSiLUMulFunction` on the fused h, `LigerSiLUMulFunction` on separate
  gate and up (both round silu(g) to the dtype before the product).
- mlp.geglu: `LigerGELUMulFunction` (tanh GELU; on views of the fused h, which liger makes contiguous).
- The backward ops (norm.rms_norm_backward, norm.layer_norm_backward, rope.rope_backward,
  mlp.swiglu_backward, mlp.geglu_backward) go through the same autograd Functions as a training step
  does: the forward on leaf copies of the case's inputs (in_place=False: the cotangent is not
  overwritten), then `torch.autograd.backward` with the case's cotangents, so liger's backward kernels
  run on the tensors its own forward saved. The fused residual RMSNorm gets (dy, dh) for (y, h);
  RoPE's backward is taken through q (its throwaway k gets a zero cotangent).
- Every adapter returns liger's own output tensors (and autograd's .grad), never a copy into the
  harness's buffers, so `parity bench` times liger's call alone, as its own benchmarks do. For the
  backward ops `parity bench` times only the backward (`Backend.timed`): the forward once, untimed,
  then torch.autograd.grad(retain_graph=True), as benchmarks/gpu_layers_bwd.py times it.

What it cannot express is a skip with the reason (`supports`): rows in an aligned width (pad > 0:
liger normalises every lane of the row it is given), rows wider than one Triton block
(next_pow2(n) > 65536), interleaved RoPE pairs, a rotary part at the end of the head, angles built
from theta (liger takes cos / sin tables), the erf GELU, and rope.kv_update.

No Triton interpreter run (verified with liger-kernel 0.8.5 on triton 3.9 without a GPU): scalar
kernel arguments arrive as Python floats, so `eps.to(tl.float32)` and `gate_multiplier.to(...)`
fail (SwiGLU on split inputs, RMSNorm, LayerNorm), and libdevice's tanh returns None (GeGLU); only
the fused-gate SwiGLU and RoPE kernels ran there. So `available()` asks for a CUDA GPU.

Seen on an H100 (liger-kernel 0.8.5, torch 2.11, triton 3.6), against the production limits:
SwiGLU (both layouts) and tanh GeGLU pass every ci shape in fp32 / fp16 / bf16 and the models'
widths, except fp16 GeGLU on `halves` at Gemma-2-9B's width (it rounds gelu(g) to fp16 before the
product: a known failure); RoPE passes all 288 cases it can express; RMSNorm passes without the
residual, and with it in fp32, but in fp16 / bf16 it sums x + r in the storage dtype and normalises
that rounded sum (rstd, an fp32 output, off by ~1e-3 relative; fp16 y off by up to 1.5 ulp: three
roundings); LayerNorm fails the `shifted` rows (x = 1000 + N(0, 1)) in fp32 and fp16 (its mean is
one fp32 sum).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, to_torch, torch_available

OPS = ("norm.rms_norm", "norm.layer_norm", "rope.rope", "mlp.swiglu", "mlp.geglu")
OPS = OPS + tuple(f"{o}_backward" for o in OPS)
MAX_BLOCK = 65536  # liger's calculate_settings: one row in one Triton block of next_pow2(n) <= 65536
INSTALL = "pip install 'kernel-parity[peers]'"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _width_reason(n: int, what: str) -> str | None:
    if _pow2(n) > MAX_BLOCK:
        return f"liger holds a row in one Triton block: next_pow2({what}={n}) > {MAX_BLOCK}"
    return None


@dataclass
class LigerBackend(Backend):
    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        if importlib.util.find_spec("liger_kernel") is None:
            return f"liger-kernel is not installed ({INSTALL})"
        if self.device == "cuda" and not cuda_available():
            return ("liger needs a CUDA GPU (its kernels do not run in the Triton interpreter: float scalar "
                    "arguments arrive as Python floats, libdevice calls return None)")
        return None

    def supports(self, case: Any) -> str | None:
        why = super().supports(case)
        if why:
            return why
        p, op = case.p, case.op.removesuffix("_backward")  # a backward op takes its forward's params
        if op in ("norm.rms_norm", "norm.layer_norm"):
            if p["pad"]:
                return (f"liger normalises every lane of the rows it is given: no real width inside an aligned "
                        f"row (pad={p['pad']})")
            return _width_reason(p["n"], "n")
        if op == "rope.rope":
            if p.get("inplace", 0):
                return ("rope.rope_backward inplace=1 (dx over dy): liger's backward is reached through autograd, "
                        "which hands back its own gradient tensor; no call writes dx into the caller's dy")
            if p["style"] != "half":
                return "liger's RoPE rotates half pairs (i, i + rot/2) (HF's rotate_half), not interleaved pairs"
            if p["rot"] < p["d"] and p["at"] != "first":
                return "liger rotates the leading rot dims of a head (partial rotary at the start only)"
            if p["table"] == "theta":
                return "liger takes cos / sin tables; it builds no angles from theta"
            return None
        if op == "mlp.geglu" and p["approx"] != "tanh":
            return "liger's GELU-mul is the tanh approximation only (no erf GELU)"
        return _width_reason(p["i"], "i")


# -- adapters ---------------------------------------------------------------------------------
def _rms_norm(case, inputs, out):
    import liger_kernel.ops as lk

    p, dev = case.p, out.device
    x, w = to_torch(inputs["x"], dev), to_torch(inputs["w"], dev)
    eps = float(p["eps"])
    offset, mode = (1.0, "gemma") if p["gemma"] else (0.0, "llama")
    res: dict[str, Any] = {}
    rstd = None
    if p["residual"]:
        r = to_torch(inputs["r"], dev)
        if p["rstd"]:
            y, h, rstd = lk.fused_add_rms_norm_forward(x, r, w, eps, offset, mode)[:3]
        else:
            y, h = lk.LigerFusedAddRMSNormFunction.apply(x, r, w, eps, offset, mode)
        res["h"] = h
    elif p["rstd"]:
        y, _, rstd = lk.rms_norm_forward(x, w, eps, offset, mode, None)[:3]
    else:
        y = lk.LigerRMSNormFunction.apply(x, w, eps, offset, mode)
    res["y"] = y
    if rstd is not None:
        res["rstd"] = rstd
    return res


def _layer_norm(case, inputs, out):
    import torch

    import liger_kernel.ops as lk

    p, dev = case.p, out.device
    x, w = to_torch(inputs["x"], dev), to_torch(inputs["w"], dev)
    b = to_torch(inputs["b"], dev) if p["bias"] else torch.zeros_like(w)  # LigerLayerNorm(bias=False)'s zeros
    eps = float(p["eps"])
    res: dict[str, Any] = {}
    if p["stats"]:
        y, _, mean, rstd = lk.layer_norm_forward(x, w, b, eps)[:4]
        res["mean"] = mean
        res["rstd"] = rstd
    else:
        y = lk.LigerLayerNormFunction.apply(x, w, b, eps)
    res["y"] = y
    return res


def _cos_sin_rows(case, inputs, dev) -> tuple[Any, Any]:
    """(cos, sin) (1, t, rot/2) fp32 at each token's position, from the case's table (exact)."""
    import torch

    if "cos" in inputs:
        cos, sin = to_torch(inputs["cos"], dev), to_torch(inputs["sin"], dev)
    else:  # (maxseq, rot/2, 2) pairs: fp16 (cos, sin) or freqs_cis as (real, imag) float32
        table = to_torch(inputs["table"], dev).float()
        cos, sin = table[..., 0], table[..., 1]
    pos = torch.from_numpy(np.asarray(inputs["positions"], dtype=np.int64)).to(dev)
    return cos.float()[pos][None].contiguous(), sin.float()[pos][None].contiguous()


def _rope(case, inputs, out):
    import torch

    import liger_kernel.ops as lk

    p, dev = case.p, out.device
    x = to_torch(inputs["x"], dev)  # t, h, d
    t, _, d = x.shape
    q = x.clone()[None]  # 1, t, h, d: liger rotates its storage in place
    k = torch.zeros((1, t, 1, d), dtype=x.dtype, device=dev)  # liger rotates q and k together
    cos, sin = _cos_sin_rows(case, inputs, dev)
    lk.LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 1, p["rot"])
    return {"y": q[0]}


def _swiglu(case, inputs, out):
    import liger_kernel.ops as lk

    dev = out.device
    if case.p["layout"] == "fused":
        h = to_torch(inputs["h"], dev)
        fused = getattr(lk, "LigerFusedGateUpSiLUMulFunction", None)
        if fused is not None:
            y = fused.apply(h)
        else:  # liger before the fused-gate function: the halves (liger makes them contiguous)
            i = h.shape[1] // 2
            y = lk.LigerSiLUMulFunction.apply(h[:, :i], h[:, i:])
    else:
        y = lk.LigerSiLUMulFunction.apply(to_torch(inputs["gate"], dev), to_torch(inputs["up"], dev))
    return {"y": y}


def _geglu(case, inputs, out):
    import liger_kernel.ops as lk

    dev = out.device
    if case.p["layout"] == "fused":
        h = to_torch(inputs["h"], dev)
        i = h.shape[1] // 2
        gate, up = h[:, :i], h[:, i:]
    else:
        gate, up = to_torch(inputs["gate"], dev), to_torch(inputs["up"], dev)
    return {"y": lk.LigerGELUMulFunction.apply(gate, up)}


# -- backward: liger's autograd Functions, as a training step runs them -------------------------------
def _leaf(a: Any, dev: Any) -> Any:
    return to_torch(a, dev).clone().requires_grad_()


def _norm_mode(p: dict) -> tuple[float, str]:
    return (1.0, "gemma") if p["gemma"] else (0.0, "llama")


# Each backward is a graph builder: (outputs, their cotangents, {gradient name: leaf}). `run` takes the
# gradients as a training step does (autograd.backward, then .grad); `timed` (parity bench) runs the
# forward once and times torch.autograd.grad(retain_graph=True) alone, as benchmarks/gpu_layers_bwd.py
# times liger and eager torch. liger's backward kernels may write into the tensors its forward saved
# (SwiGLU's, RoPE's cotangent): repeated calls then see other values, never other work.
def _rms_norm_graph(case, inputs, dev):
    import torch

    import liger_kernel.ops as lk

    p = case.p
    x, w = _leaf(inputs["x"], dev), _leaf(inputs["w"], dev)
    dy = to_torch(inputs["dy"], dev)
    offset, mode = _norm_mode(p)
    if p["residual"]:
        y, h = lk.LigerFusedAddRMSNormFunction.apply(x, to_torch(inputs["r"], dev), w, float(p["eps"]), offset,
                                                     mode, False)
        dh = to_torch(inputs["dh"], dev) if "dh" in inputs else torch.zeros_like(h)
        return (y, h), (dy, dh), {"dx": x, "dw": w}
    y = lk.LigerRMSNormFunction.apply(x, w, float(p["eps"]), offset, mode, False)
    return (y,), (dy,), {"dx": x, "dw": w}


def _layer_norm_graph(case, inputs, dev):
    import torch

    import liger_kernel.ops as lk

    p = case.p
    x, w = _leaf(inputs["x"], dev), _leaf(inputs["w"], dev)
    b = _leaf(inputs["b"], dev) if p["bias"] else torch.zeros_like(w)
    y = lk.LigerLayerNormFunction.apply(x, w, b, float(p["eps"]))
    return (y,), (to_torch(inputs["dy"], dev),), {"dx": x, "dw": w, **({"db": b} if p["bias"] else {})}


def _rope_graph(case, inputs, dev):
    import torch

    import liger_kernel.ops as lk

    p = case.p
    dy = to_torch(inputs["dy"], dev)  # t, h, d
    t, _, d = dy.shape
    x = torch.zeros_like(dy).requires_grad_()  # RoPE is linear: its backward does not read x
    q = x.clone()[None]  # liger rotates its input's storage in place: a non-leaf copy
    k = torch.zeros((1, t, 1, d), dtype=dy.dtype, device=dev)
    cos, sin = _cos_sin_rows(case, inputs, dev)
    q_out, k_out = lk.LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 1, p["rot"])
    return (q_out, k_out), (dy[None].transpose(1, 2), torch.zeros_like(k_out)), {"dx": x}


def _glu_graph(fn_name: str):
    def graph(case, inputs, dev):
        import liger_kernel.ops as lk

        dy = to_torch(inputs["dy"], dev)
        if case.p["layout"] == "fused":
            h = _leaf(inputs["h"], dev)
            i = h.shape[1] // 2
            fused = getattr(lk, "LigerFusedGateUpSiLUMulFunction", None) if fn_name == "swiglu" else None
            y = fused.apply(h) if fused is not None else _glu(lk, fn_name).apply(h[:, :i], h[:, i:])
            return (y,), (dy,), {"dh": h}
        gate, up = _leaf(inputs["gate"], dev), _leaf(inputs["up"], dev)
        return (_glu(lk, fn_name).apply(gate, up),), (dy,), {"dgate": gate, "dup": up}
    return graph


def _backward(graph):
    """(run, timed) adapters of one backward op from its graph builder."""
    def run(case, inputs, out):
        import torch

        outs, cots, leaves = graph(case, inputs, out.device)
        torch.autograd.backward(outs, cots)
        return {name: leaf.grad for name, leaf in leaves.items()}

    def timed(case, inputs, out):
        import torch

        outs, cots, leaves = graph(case, inputs, out.device)
        wrt = list(leaves.values())
        return (lambda: torch.autograd.grad(outs, wrt, cots, retain_graph=True),
                "liger's backward kernels alone: its forward ran once, untimed (autograd.grad, retain_graph)")
    return run, timed


BACKWARD = {"norm.rms_norm_backward": _backward(_rms_norm_graph),
            "norm.layer_norm_backward": _backward(_layer_norm_graph),
            "rope.rope_backward": _backward(_rope_graph),
            "mlp.swiglu_backward": _backward(_glu_graph("swiglu")),
            "mlp.geglu_backward": _backward(_glu_graph("geglu"))}


def _glu(lk: Any, fn_name: str) -> Any:
    return lk.LigerSiLUMulFunction if fn_name == "swiglu" else lk.LigerGELUMulFunction


def make(device: str = "cuda") -> LigerBackend:
    return LigerBackend(
        name="liger", device=device, dtypes=("fp32", "fp16", "bf16"),
        ops={"norm.rms_norm": _rms_norm, "norm.layer_norm": _layer_norm, "rope.rope": _rope,
             "mlp.swiglu": _swiglu, "mlp.geglu": _geglu, **{op: run for op, (run, _) in BACKWARD.items()}},
        timed={op: timed for op, (_, timed) in BACKWARD.items()},
        doc="liger-kernel's Triton kernels (RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU, forward and backward) on a "
            "CUDA GPU",
    )


BACKEND = make()
