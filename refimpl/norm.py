"""Golden normalisations, float64: RMSNorm (weight w or Gemma's 1 + w, fused residual add, rstd,
padded lanes) and LayerNorm (with and without bias).

    rms_norm:    y = h / sqrt(mean(h^2) + eps) * g,    h = x (+ r),   g = w or (1 + w)
    layer_norm:  y = (x - mean(x)) / sqrt(var(x) + eps) * w (+ b),    var biased (divides by n)

Conventions (OPS.md, layers):
- eps is inside the square root (Llama, Gemma, T5, torch's F.rms_norm / F.layer_norm).
- The statistics run over the *real* width `n`: a row may be stored in an aligned width
  `aw = x.shape[-1] >= n` (C-Kernel-Engine's aligned_embed_dim); lanes [n, aw) are padding, never
  read into the mean or the variance, and written as exact zeros in the output.
- Gemma's offset: the weight is stored as w and applied as (1 + w) (HF GemmaRMSNorm).
- Fused residual add (vLLM's fused_add_rms_norm, Liger's fused_add_rms_norm): h = x + r is both
  an output (the new residual stream) and what is normalised.
- rstd = 1 / sqrt(mean(h^2) + eps) per row (and mean, for LayerNorm): what a backward needs.
Everything is computed in float64 on the inputs as given (the rounded storage values); the
golden never rounds an intermediate.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def _real(x: NDArray, n: int | None) -> tuple[F64, int]:
    x = np.asarray(x, dtype=np.float64)
    aw = x.shape[-1]
    n = aw if n is None else int(n)
    if not 1 <= n <= aw:
        raise ValueError(f"real width n={n} must be in [1, {aw}] (the stored width)")
    return x, n


def _gain(w: NDArray | None, n: int, aw: int, offset: float) -> F64:
    """The (aw,) gain applied to the real lanes (zeros on the padding)."""
    g = np.zeros(aw)
    if w is None:
        g[:n] = 1.0
        return g
    w = np.asarray(w, dtype=np.float64)
    if w.shape[-1] < n:
        raise ValueError(f"weight has {w.shape[-1]} lanes, fewer than the real width n={n}")
    g[:n] = offset + w[..., :n]
    return g


def rms_norm(x: NDArray, w: NDArray | None, eps: float, *, n: int | None = None, gemma: bool = False,
             residual: NDArray | None = None) -> dict[str, F64]:
    """RMSNorm over the last axis, with the fused residual add when `residual` is given.

    x: (..., aw) float, lanes [n, aw) padding (not read)
    w: (aw,) or (n,) float weight, or None (no affine)
    eps: added to mean(h^2) inside the square root
    n: the real width (default aw)
    gemma: apply (1 + w) instead of w
    residual: (..., aw) float or None; when given h = x + residual
    returns: {"y": (..., aw) with zeros on lanes [n, aw), "rstd": (...,), and "h": (..., aw) the
    sum (padding lanes zero) when residual is given}
    """
    x, n = _real(x, n)
    aw = x.shape[-1]
    h = x if residual is None else x + np.asarray(residual, dtype=np.float64)
    real = h[..., :n]
    rstd = 1.0 / np.sqrt(np.mean(real * real, axis=-1) + eps)  # ...
    y = np.zeros_like(h)
    y[..., :n] = real * rstd[..., None] * _gain(w, n, aw, 1.0 if gemma else 0.0)[:n]
    out = {"y": y, "rstd": rstd}
    if residual is not None:
        hs = np.zeros_like(h)
        hs[..., :n] = real
        out["h"] = hs
    return out


def layer_norm(x: NDArray, w: NDArray | None, b: NDArray | None, eps: float, *, n: int | None = None) -> dict[str, F64]:
    """LayerNorm over the last axis: biased variance, eps inside the square root.

    x: (..., aw) float, lanes [n, aw) padding (not read)
    w: (aw,) or (n,) weight or None; b: (aw,) or (n,) bias or None
    returns: {"y": (..., aw) with zeros on lanes [n, aw), "mean": (...,), "rstd": (...,)}
    """
    x, n = _real(x, n)
    aw = x.shape[-1]
    real = x[..., :n]
    mean = real.mean(axis=-1)  # ...
    c = real - mean[..., None]
    rstd = 1.0 / np.sqrt(np.mean(c * c, axis=-1) + eps)
    y = np.zeros_like(x)
    y[..., :n] = c * rstd[..., None] * _gain(w, n, aw, 0.0)[:n]
    if b is not None:
        y[..., :n] += np.asarray(b, dtype=np.float64)[..., :n]
    return {"y": y, "mean": mean, "rstd": rstd}
