"""Eager SwiGLU and GeGLU with torch's own ops, in the input's dtype (the noise baseline).

    swiglu(gate, up)        = F.silu(gate) * up
    geglu(gate, up, approx) = F.gelu(gate, approximate="tanh" | "none") * up

What a PyTorch user writes (HF's LlamaMLP: act_fn(gate_proj(x)) * up_proj(x); vLLM's SiluAndMul
forward_native on the halves of the fused projection). In fp16/bf16 torch rounds the activation to
the dtype before the product and rounds again after it: two roundings where a fused kernel does one
(FlashAttention's same-precision reference rounds the same way). "erf" is torch's approximate="none".

Backward (`glu_backward`): torch autograd through the forward in the dtype; on the fused layout the
gradient of h itself (chunk's backward places dgate and dup gate first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_APPROX = {"tanh": "tanh", "erf": "none"}


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.ndim != 2 or up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must be 2-D (t, i) of one shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")


def halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of a fused gate-first projection h (t, 2i)."""
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"a fused gate/up projection h is 2-D with an even width 2i, got shape {tuple(h.shape)}")
    return h.chunk(2, dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(t, i) x (t, i) -> (t, i) in gate.dtype."""
    _check(gate, up)
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor, approx: str = "tanh") -> torch.Tensor:
    """(t, i) x (t, i) -> (t, i) in gate.dtype; approx "tanh" or "erf"."""
    _check(gate, up)
    if approx not in _APPROX:
        raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")
    return F.gelu(gate, approximate=_APPROX[approx]) * up


def glu_backward(op: str, dy: torch.Tensor, *, h: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                 up: torch.Tensor | None = None, approx: str = "tanh") -> tuple[torch.Tensor, ...]:
    """Autograd of swiglu / geglu (`op`) for the cotangent dy (t, i): (dh,) for the fused h (t, 2i),
    else (dgate, dup)."""
    if op not in ("swiglu", "geglu"):
        raise ValueError(f"unknown gated activation {op!r} (swiglu, geglu)")
    leaves = [h.detach().requires_grad_()] if h is not None else [gate.detach().requires_grad_(),
                                                                 up.detach().requires_grad_()]
    with torch.enable_grad():
        g, u = halves(leaves[0]) if h is not None else leaves
        y = swiglu(g, u) if op == "swiglu" else geglu(g, u, approx)
        return tuple(torch.autograd.grad([y], leaves, [dy]))
