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

Backward (OPS.md "backward"; the VJPs written out, vectorised; tests/test_layers_grad_golden.py checks
them against central differences and torch autograd in float64):

    rms_norm_backward:   dx = rstd (g dy - h rstd^2 mean(h g dy)) (+ dh),  dw = sum over rows of dy h rstd
    layer_norm_backward: dx = rstd (d - mean(d) - xhat mean(d xhat)),  d = w dy,  xhat = (x - mean) rstd
                         dw = sum over rows of dy xhat,  db = sum over rows of dy

With the fused residual h = x + r, x and r have the same gradient dx (= dr), which includes the
cotangent dh of the returned h. Gemma's (1 + w) scales dy in dx; dw has the same formula (d(1 + w) /
dw = 1). The padding lanes [n, aw) are constants of the forward: their gradients are exactly zero
and the cotangents' padding lanes are never read. The statistics are recomputed in float64 from the
inputs: the golden is the exact VJP at the inputs, whatever rstd or mean a kernel is handed.
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


_STAT_ROWS = 2048  # rows per pass of the statistics alone: float64 temporaries of a few MB, not ~1 GB


def rms_rstd(x: NDArray, eps: float, *, n: int | None = None, residual: NDArray | None = None) -> F64:
    """rms_norm's rstd alone, the same bits (each row's statistics are its own): (...,) from (..., aw),
    over runs of rows. A backward's inputs need it, not the forward's y."""
    x = np.asarray(x)
    n = x.shape[-1] if n is None else int(n)
    flat = x.reshape(-1, x.shape[-1])
    rf = None if residual is None else np.asarray(residual).reshape(flat.shape)
    out = np.empty(flat.shape[0])
    for i in range(0, flat.shape[0], _STAT_ROWS):
        h = flat[i:i + _STAT_ROWS, :n].astype(np.float64)
        if rf is not None:
            h += rf[i:i + _STAT_ROWS, :n]
        out[i:i + _STAT_ROWS] = 1.0 / np.sqrt(np.mean(h * h, axis=-1) + eps)
    return out.reshape(x.shape[:-1])


def layer_norm_stats(x: NDArray, eps: float, *, n: int | None = None) -> tuple[F64, F64]:
    """layer_norm's (mean, rstd) alone, the same bits, over runs of rows (see rms_rstd)."""
    x = np.asarray(x)
    n = x.shape[-1] if n is None else int(n)
    flat = x.reshape(-1, x.shape[-1])
    mean, rstd = np.empty(flat.shape[0]), np.empty(flat.shape[0])
    for i in range(0, flat.shape[0], _STAT_ROWS):
        real = flat[i:i + _STAT_ROWS, :n].astype(np.float64)
        m = real.mean(axis=-1)
        c = real - m[:, None]
        mean[i:i + _STAT_ROWS] = m
        rstd[i:i + _STAT_ROWS] = 1.0 / np.sqrt(np.mean(c * c, axis=-1) + eps)
    return mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


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


def layer_norm(x: NDArray, w: NDArray | None, b: NDArray | None, eps: float, *, n: int | None = None,
               absolute: bool = False) -> dict[str, F64]:
    """LayerNorm over the last axis: biased variance, eps inside the square root.

    x: (..., aw) float, lanes [n, aw) padding (not read)
    w: (aw,) or (n,) weight or None; b: (aw,) or (n,) bias or None
    returns: {"y": (..., aw) with zeros on lanes [n, aw), "mean": (...,), "rstd": (...,)}
    absolute: the error model's magnitude of y instead (conformance/tolerance.py), {"y": ...} alone:
    y = (x - mean) rstd w + b in the squared form, sqrt(xhat^2 w^2 + b^2): where xhat w and b cancel.
    x - mean is taken as exact (`_centred_sq`: the fp32 centring of rows far from zero is not in the
    model). mean and rstd are left out (judged against |golden| as before): the variance sums positive
    terms, and the mean's fp32 allowance is the accumulation length's.
    """
    x, n = _real(x, n)
    aw = x.shape[-1]
    real = x[..., :n]
    mean = real.mean(axis=-1)  # ...
    c = real - mean[..., None]
    rstd = 1.0 / np.sqrt(np.mean(c * c, axis=-1) + eps)
    gain = _gain(w, n, aw, 0.0)[:n]
    y = np.zeros_like(x)
    if absolute:  # squared form: every factor squared, the two addends of x - mean and b summed in squares
        sq = _centred_sq(real, mean[..., None], c) * (rstd * rstd)[..., None] * (gain * gain)
        if b is not None:
            sq += np.asarray(b, dtype=np.float64)[..., :n] ** 2
        y[..., :n] = np.sqrt(sq)
        return {"y": y}
    y[..., :n] = c * rstd[..., None] * gain
    if b is not None:
        y[..., :n] += np.asarray(b, dtype=np.float64)[..., :n]
    return {"y": y, "mean": mean, "rstd": rstd}


def _centred_sq(real: F64, mean: F64, c: F64) -> F64:
    """The magnitude of x - mean, squared: (x - mean)^2, the contract's exact centring (ours split an fp64 mean
    into hi + lo). A kernel centring with an fp32 mean carries half an ulp of |mean| (~eps32 |mean| rstd in
    xhat on rows far from zero), but x^2 + mean^2 here would be scaled by the output dtype's rtol, not eps32
    (OpSpec.magnitude does not know the compute dtype): fp16 / bf16 `shifted` rows would get bounds of 1-100
    on outputs of size 1, unjudged, and four mutants that centre in fp32 would pass. Until the model carries
    a compute-dtype term, the fp32 centring stays outside it (the torch-norm and liger entries of
    conformance/known_failures.toml)."""
    return c * c


def _dh_of(dh: NDArray | None, residual: NDArray | None) -> F64 | None:
    if dh is not None and residual is None:
        raise ValueError("dh (the cotangent of h = x + r) given without a residual")
    return None if dh is None else np.asarray(dh, dtype=np.float64)


def _weight_grad(w: NDArray | None, terms: F64, n: int) -> F64 | None:
    """sum over every row (all leading axes) of terms (..., n), in w's shape (zeros past n)."""
    if w is None:
        return None
    out = np.zeros(np.shape(w)[-1])
    out[:n] = terms.reshape(-1, n).sum(axis=0)
    return out


def rms_norm_backward(x: NDArray, w: NDArray | None, dy: NDArray, eps: float, *, n: int | None = None,
                      gemma: bool = False, residual: NDArray | None = None, dh: NDArray | None = None,
                      absolute: bool = False) -> dict[str, F64]:
    """VJP of `rms_norm` (module docstring), the statistics recomputed in float64.

    x, residual: (..., aw) as the forward; w: (aw,) or (n,) or None
    dy: (..., aw) cotangent of y (lanes [n, aw) not read); dh: (..., aw) cotangent of h = x + r, or None
    returns: {"dx": (..., aw) the gradient of x (and of r: the same), zeros on lanes [n, aw);
              "dw": w's shape, zeros past n (when w is given)}
    absolute: the error model's magnitudes instead (conformance/tolerance.py): the root-sum-square of the
    terms each output sums, dx = sqrt(rstd^2 ((g dy)^2 + h^2 rstd^4 sum (h g dy)^2 / n^2) + dh^2),
    dw = sqrt(sum over rows of (dy h rstd)^2); rstd and h enter with their values (rstd a well-conditioned
    factor, h = x + r a sum of two stored inputs rounded once, relative to |h|)
    """
    x, n = _real(x, n)
    aw = x.shape[-1]
    dh = _dh_of(dh, residual)
    h = x if residual is None else x + np.asarray(residual, dtype=np.float64)
    real = h[..., :n]
    rstd = 1.0 / np.sqrt(np.mean(real * real, axis=-1) + eps)  # ...
    dyr = np.asarray(dy, dtype=np.float64)[..., :n]
    gdy = dyr * _gain(w, n, aw, 1.0 if gemma else 0.0)[:n]
    dx = np.zeros_like(h)
    out = {"dx": dx}
    if absolute:  # the squared form: every factor squared, sums of squares, one sqrt at the end
        r2 = rstd * rstd
        m2 = np.sum(np.square(real * gdy), axis=-1) / (n * n)  # ...: mean(h g dy)'s magnitude, squared
        sq = r2[..., None] * (gdy * gdy + real * real * (r2 * r2 * m2)[..., None])
        if dh is not None:
            sq += dh[..., :n] ** 2
        dx[..., :n] = np.sqrt(sq)
        dw = _weight_grad(w, np.square(dyr * real) * r2[..., None], n)
        if dw is not None:
            out["dw"] = np.sqrt(dw)
        return out
    m = np.mean(real * gdy, axis=-1)  # ...: mean(h g dy)
    dx[..., :n] = rstd[..., None] * (gdy - real * (rstd * rstd * m)[..., None])
    if dh is not None:
        dx[..., :n] += dh[..., :n]
    dw = _weight_grad(w, dyr * real * rstd[..., None], n)
    if dw is not None:
        out["dw"] = dw
    return out


def layer_norm_backward(x: NDArray, w: NDArray | None, b: NDArray | None, dy: NDArray, eps: float, *,
                        n: int | None = None, absolute: bool = False) -> dict[str, F64]:
    """VJP of `layer_norm` (module docstring), mean and rstd recomputed in float64.

    x: (..., aw); w, b: (aw,) or (n,) or None; dy: (..., aw) cotangent of y (lanes [n, aw) not read)
    returns: {"dx": (..., aw) zeros on lanes [n, aw); "dw": w's shape (when w is given);
              "db": b's shape (when b is given); zeros past n}
    absolute: the error model's magnitudes instead (conformance/tolerance.py): the root-sum-square of the
    terms each output sums, d = dy w, with xhat's magnitude X (`_centred_sq`: |xhat|, the exact centring):
        dx = rstd sqrt(d^2 + sum d^2 / n^2 + max(X^2 sum (d xhat)^2, xhat^2 sum (d X)^2) / n^2)
        dw = sqrt(sum over rows of (dy X)^2),   db = sqrt(sum over rows of dy^2)
    The term xhat_j mean(d xhat) is a product of two factors that both carry xhat's error: its magnitude
    takes one factor's magnitude times the other's value, the larger of the two (the first-order error of
    a product; the product of both magnitudes, X_j sqrt(sum (d X)^2) / n, would be quadratic in |mean|,
    ~1e3 |mean| rstd^2 / sqrt(n) on rows far from zero, where the error is linear in it). Where X = |xhat|
    (rows centred near zero) it is the product of the factors' magnitudes, as everywhere else.
    """
    x, n = _real(x, n)
    aw = x.shape[-1]
    real = x[..., :n]
    mean = real.mean(axis=-1, keepdims=True)
    c = real - mean
    rstd = 1.0 / np.sqrt(np.mean(c * c, axis=-1) + eps)  # ...
    xhat = c * rstd[..., None]
    dyr = np.asarray(dy, dtype=np.float64)[..., :n]
    d = dyr * _gain(w, n, aw, 0.0)[:n]
    dx = np.zeros_like(x)
    out = {"dx": dx}
    if absolute:  # the squared form
        big = _centred_sq(real, mean, c) * (rstd * rstd)[..., None]  # X^2: xhat's magnitude, squared
        d2, xh2 = d * d, xhat * xhat
        nn = float(n * n)
        t = np.maximum(big * (np.sum(d2 * xh2, axis=-1, keepdims=True) / nn),
                       xh2 * (np.sum(d2 * big, axis=-1, keepdims=True) / nn))
        dx[..., :n] = rstd[..., None] * np.sqrt(d2 + np.sum(d2, axis=-1, keepdims=True) / nn + t)
        dw, db = _weight_grad(w, dyr * dyr * big, n), _weight_grad(b, dyr * dyr, n)
        if dw is not None:
            out["dw"] = np.sqrt(dw)
        if db is not None:
            out["db"] = np.sqrt(db)
        return out
    dx[..., :n] = rstd[..., None] * (d - d.mean(axis=-1, keepdims=True)
                                     - xhat * np.mean(d * xhat, axis=-1, keepdims=True))
    dw, db = _weight_grad(w, dyr * xhat, n), _weight_grad(b, dyr, n)
    if dw is not None:
        out["dw"] = dw
    if db is not None:
        out["db"] = db
    return out
