"""Golden gated MLP activations, float64: SwiGLU and GeGLU.

    swiglu: y = silu(g) * u,   silu(g) = g / (1 + exp(-g))
    geglu:  y = gelu(g) * u,   gelu(g) = g Phi(g) (erf), or the tanh approximation
            0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))

Conventions (OPS.md, layers; research/seed-systems.md §1): the gate g and the up projection u come
either as separate tensors or as the halves of one fused projection h = x @ w1^T of width 2I,
gate first (C-Kernel-Engine's "First half: W_gate ... Second half: W_up", vLLM's SiluAndMul,
FlashInfer, ggml): g = h[..., :I], u = h[..., I:]. Everything in float64.

Backward (OPS.md "backward"): with dy the cotangent of y = act(g) u,

    dgate = dy u act'(g),   dup = dy act(g)
    silu'(g)       = s(g) + g s(g) s(-g)                          s = sigmoid
    gelu'(g), erf  = Phi(g) + g phi(g),   phi(g) = exp(-g^2 / 2) / sqrt(2 pi)
    gelu'(g), tanh = s(z) + g s(z) s(-z) z',   z = 2 sqrt(2 / pi) (g + 0.044715 g^3),  z' = dz / dg

The sigmoid's derivative s(z) (1 - s(z)) is taken as s(z) s(-z) = e / (1 + e)^2, e = exp(-|z|):
1 - s(z) cancels for z > 0 (all rounding error past z = 37 in float64), the product form never does.
For the fused layout the gradient of h is [dgate, dup] (gate first).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
GELU_APPROX = ("tanh", "erf")


def split(h: NDArray) -> tuple[F64, F64]:
    """(gate, up) of a fused projection, gate first. h: (..., 2I) -> two (..., I)."""
    h = np.asarray(h, dtype=np.float64)
    if h.shape[-1] % 2:
        raise ValueError(f"a fused gate/up projection has an even width, got {h.shape[-1]}")
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def sigmoid(z: NDArray) -> F64:
    """1 / (1 + exp(-z)), stable for |z| large (no exp overflow): from exp(-|z|)."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(g: NDArray) -> F64:
    """g * sigmoid(g)."""
    g = np.asarray(g, dtype=np.float64)
    return g * sigmoid(g)


def _erf_small(y: F64) -> F64:
    """erf(y) for |y| <= 2: 2/sqrt(pi) exp(-y^2) sum_n 2^n y^(2n+1) / (1 3 5 ... (2n+1)), a series of
    positive terms (no cancellation); 60 terms reach float64 precision at |y| = 2."""
    term = y.copy()
    total = y.copy()
    for n in range(1, 60):  # a fixed, small count: the series, not a loop over elements
        term = term * (2.0 * y * y) / (2 * n + 1)
        total += term
    return 2.0 / math.sqrt(math.pi) * np.exp(-y * y) * total


def _erfc_large(y: F64) -> F64:
    """erfc(y) for y > 2: exp(-y^2)/sqrt(pi) / (y + (1/2)/(y + 1/(y + (3/2)/(y + 2/(y + ...))))),
    the continued fraction evaluated from 120 levels deep (converged to float64 for y > 2)."""
    frac = np.zeros_like(y)
    for k in range(120, 0, -1):
        frac = (k / 2.0) / (y + frac)
    return np.exp(-y * y) / math.sqrt(math.pi) / (y + frac)


def std_normal_cdf(g: NDArray) -> F64:
    """Phi(g) = erfc(-g / sqrt 2) / 2, accurate to ~1e-13 relative in float64 over the whole line
    (the lower tail from erfc's continued fraction, not 1 - erf). Checked against math.erfc."""
    y = np.asarray(g, dtype=np.float64) / math.sqrt(2.0)
    a = np.abs(y)
    erfc_a = np.empty_like(a)
    small = a <= 2.0
    erfc_a[small] = 1.0 - _erf_small(a[small])
    erfc_a[~small] = _erfc_large(a[~small])
    return np.where(y >= 0, 1.0 - 0.5 * erfc_a, 0.5 * erfc_a)


def gelu(g: NDArray, approx: str = "tanh") -> F64:
    """GELU, exact (g Phi(g), "erf") or the tanh approximation (GPT-2, Gemma's gelu_pytorch_tanh).

    The tanh form is evaluated as g sigmoid(2x), x = sqrt(2 / pi) (g + 0.044715 g^3), which is
    0.5 g (1 + tanh(x)) exactly: 1 + tanh(x) itself cancels for g < -3 (at g = -7 it is ~2e-16,
    all rounding error in float64)."""
    g = np.asarray(g, dtype=np.float64)
    if approx == "tanh":
        return g * sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))
    if approx == "erf":
        return g * std_normal_cdf(g)
    raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")


def swiglu(gate: NDArray, up: NDArray) -> F64:
    """silu(gate) * up. gate, up: (..., I) -> (..., I)"""
    return silu(gate) * np.asarray(up, dtype=np.float64)


def geglu(gate: NDArray, up: NDArray, approx: str = "tanh") -> F64:
    """gelu(gate) * up. gate, up: (..., I) -> (..., I)"""
    return gelu(gate, approx) * np.asarray(up, dtype=np.float64)


def sigmoid_grad(z: NDArray) -> F64:
    """s(z) (1 - s(z)) = s(z) s(-z) = e / (1 + e)^2, e = exp(-|z|): no cancellation, no overflow."""
    e = np.exp(-np.abs(np.asarray(z, dtype=np.float64)))
    return e / ((1.0 + e) * (1.0 + e))


def silu_grad(g: NDArray) -> F64:
    """d silu / dg = s(g) + g s(g) s(-g)."""
    g = np.asarray(g, dtype=np.float64)
    return sigmoid(g) + g * sigmoid_grad(g)


def gelu_grad(g: NDArray, approx: str = "tanh") -> F64:
    """d gelu / dg: Phi(g) + g phi(g) ("erf"), or of g s(z) with z = 2 sqrt(2/pi) (g + 0.044715 g^3) ("tanh")."""
    g = np.asarray(g, dtype=np.float64)
    if approx == "tanh":
        k = 2.0 * math.sqrt(2.0 / math.pi)
        z = k * (g + 0.044715 * g ** 3)
        dz = k * (1.0 + 3.0 * 0.044715 * g * g)
        return sigmoid(z) + g * sigmoid_grad(z) * dz
    if approx == "erf":
        return std_normal_cdf(g) + g * np.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")


def _grad_terms(g: F64, act: str, approx: str = "tanh") -> tuple[F64, F64]:
    """The two terms act'(g) sums (`silu_grad`, `gelu_grad`): s(g) and g s(g) s(-g) (silu); Phi(g) and g phi(g)
    (gelu, erf); s(z) and g s(z) s(-z) z' (gelu, tanh). Their signs differ for g < 0: act' crosses zero."""
    if act == "silu":
        return sigmoid(g), g * sigmoid_grad(g)
    if approx == "tanh":
        k = 2.0 * math.sqrt(2.0 / math.pi)
        z = k * (g + 0.044715 * g ** 3)
        return sigmoid(z), g * sigmoid_grad(z) * (k * (1.0 + 3.0 * 0.044715 * g * g))
    if approx == "erf":
        return std_normal_cdf(g), g * np.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")


def _glu_backward(gate: NDArray, up: NDArray, dy: NDArray, act: str, approx: str, absolute: bool) -> dict[str, F64]:
    gate, up, dy = (np.asarray(a, dtype=np.float64) for a in (gate, up, dy))
    fwd = silu(gate) if act == "silu" else gelu(gate, approx)
    if not absolute:
        grad = silu_grad(gate) if act == "silu" else gelu_grad(gate, approx)
        return {"dgate": dy * up * grad, "dup": dy * fwd}
    t1, t2 = _grad_terms(gate, act, approx)
    return {"dgate": np.abs(dy * up) * np.sqrt(t1 * t1 + t2 * t2), "dup": np.abs(dy * fwd)}


def swiglu_backward(gate: NDArray, up: NDArray, dy: NDArray, absolute: bool = False) -> dict[str, F64]:
    """VJP of `swiglu`: dgate = dy up silu'(gate), dup = dy silu(gate). gate, up, dy: (..., I).

    absolute: the error model's magnitudes instead (conformance/tolerance.py): dgate is a product with
    silu'(g) = s(g) + g s(g) s(-g), a sum of two terms of opposite signs for g < 0 that cancel at its root
    g = -1.278 (both ~0.22 there): |dy up| sqrt(s(g)^2 + (g s(g) s(-g))^2), what a kernel's rounding of those
    terms scales with (eps32 |dy up| x ~0.2 where dgate is 0). dup = dy silu(g) is a product: |dup|.
    """
    return _glu_backward(gate, up, dy, "silu", "tanh", absolute)


def geglu_backward(gate: NDArray, up: NDArray, dy: NDArray, approx: str = "tanh",
                   absolute: bool = False) -> dict[str, F64]:
    """VJP of `geglu`: dgate = dy up gelu'(gate), dup = dy gelu(gate). gate, up, dy: (..., I).

    absolute: the error model's magnitudes instead, as `swiglu_backward`'s: gelu'(g) sums Phi(g) and g phi(g)
    (erf) or s(z) and g s(z) s(-z) z' (tanh), which cancel at its root near g = -0.752: dgate -> |dy up|
    sqrt(term1^2 + term2^2); dup = dy gelu(g), a product: |dup|.
    """
    return _glu_backward(gate, up, dy, "gelu", approx, absolute)
