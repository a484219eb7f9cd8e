"""Golden softmax, logsumexp and online (streaming) softmax, in float64.

    softmax(x)_j   = exp(x_j - m) / sum_k exp(x_k - m),   m = max_k x_k
    logsumexp(x)   = m + ln sum_k exp(x_k - m)             (natural log)

Conventions (OPS.md, softmax):
- A row whose entries are all -inf has softmax 0 (not NaN) and logsumexp -inf.
- Inputs are finite or -inf; a row holding +inf or NaN gives NaN, as the textbook formula does.
- `online_softmax` is the streaming algorithm (running max m, running sum l, rescaled by
  exp(m_old - m_new) at each tile); it is a golden of the algorithm, and a self-test checks it
  against the textbook `softmax`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def _as_f64(x: NDArray) -> F64:
    return np.asarray(x, dtype=np.float64)


def _safe_max(x: F64, axis: int) -> F64:
    """Row max with -inf rows mapped to 0, so `x - m` never evaluates -inf - -inf."""
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(np.isneginf(m), 0.0, m)


def softmax(x: NDArray, axis: int = -1) -> F64:
    """Softmax along `axis`.

    x: (..., n) float, values finite or -inf
    returns: same shape as x, float64; all -inf rows -> 0
    """
    x = _as_f64(x)
    if x.shape[axis] == 0:
        return np.zeros_like(x)
    with np.errstate(invalid="ignore"):  # +inf - +inf = NaN: a row holding +inf is NaN, as in the textbook
        e = np.exp(x - _safe_max(x, axis))  # exp(-inf) = 0 for masked entries
    s = np.sum(e, axis=axis, keepdims=True)
    y = np.divide(e, s, out=np.zeros_like(e), where=s > 0)  # s == 0 only for an all -inf row
    return np.where(np.isnan(s), np.nan, y)


def logsumexp(x: NDArray, axis: int = -1) -> F64:
    """Natural-log logsumexp along `axis`.

    x: (..., n) float, values finite or -inf
    returns: x.shape without `axis`, float64; all -inf rows (and n == 0) -> -inf
    """
    x = _as_f64(x)
    if x.shape[axis] == 0:
        return np.full(np.delete(x.shape, axis % x.ndim), -np.inf)
    m = _safe_max(x, axis)
    with np.errstate(invalid="ignore"):
        s = np.sum(np.exp(x - m), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):  # ln 0 = -inf is the convention for empty rows
        lse = np.log(s) + m
    return np.squeeze(lse, axis=axis)


def online_softmax(x: NDArray, tile: int, axis: int = -1, absolute: bool = False) -> tuple[F64, F64]:
    """Streaming softmax over tiles of `tile` elements along `axis`.

    Pass 1 keeps a running max m and running sum l; at each tile
        m' = max(m, max tile),  l' = l * exp(m - m') + sum exp(tile - m')
    with exp(-inf - -inf) never evaluated (m' = -inf leaves l = 0). Pass 2 writes exp(x - m) / l.

    x: (..., n) float, values finite or -inf
    tile: tile length >= 1 (the last tile may be partial)
    returns: (y, lse) with y like x and lse = m + ln l of shape x.shape without `axis`;
             all -inf rows -> y = 0, lse = -inf
    absolute: the error model's magnitudes instead (conformance/tolerance.py): y itself (positive, a
    quotient of positive terms: no cancellation, |y| is its own magnitude) and, for lse = m + ln l, the
    root-sum-square of its two addends and of the relative rounding of l, which ln turns into an absolute
    error: sqrt(m^2 + (ln l)^2 + (1 - 1/l)^2). Of l's terms the max's own, exp(0) = 1, is exact in any
    kernel; the others, l - 1 of l, round: 1 - 1/l (~1 on an ordinary row, 0 on a row of one live logit or
    a one-hot one, where lse = m exactly). m and ln l >= 0 have opposite signs where m < 0 (lse near 0 on
    rows of logits near -ln n), so lse can be a cancellation.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    x = np.moveaxis(_as_f64(x), axis, -1)
    n = x.shape[-1]
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    with np.errstate(invalid="ignore"):  # +inf or NaN in a row makes it NaN, as in the textbook
        for start in range(0, n, tile):  # the algorithm under test is the loop over tiles
            t = x[..., start:start + tile]
            m_new = np.maximum(m, np.max(t, axis=-1))
            live = ~np.isneginf(m_new)  # rows that have seen a finite value
            m_safe = np.where(live, m_new, 0.0)
            alpha = np.where(live, np.exp(m - m_safe), 0.0)  # exp(-inf - finite) = 0 on the first live tile
            l = l * alpha + np.sum(np.exp(t - m_safe[..., None]), axis=-1)
            m = m_new
        live = l > 0
        m_safe = np.where(live, m, 0.0)
        y = np.exp(x - m_safe[..., None])
    y = np.divide(y, l[..., None], out=np.zeros_like(y), where=live[..., None])
    with np.errstate(divide="ignore"):
        log_l = np.log(np.where(live, l, 1.0))
        rel = -np.expm1(-log_l)  # 1 - 1/l, the share of l that rounds
        lse = np.where(live, np.sqrt(m_safe * m_safe + log_l * log_l + rel * rel) if absolute else m_safe + log_l,
                       -np.inf)
    bad = np.isnan(l)
    y[bad] = np.nan
    lse[bad] = np.nan
    return np.moveaxis(y, -1, axis), lse


def softmax_backward(x: NDArray, dy: NDArray, axis: int = -1, dlse: NDArray | None = None,
                     absolute: bool = False) -> F64:
    """VJP of softmax (and of the row LSE, for `online_softmax`), written out.

        dx = y * (dy - sum_k dy_k y_k) + dlse * y,    y = softmax(x)

    x: (..., n) float, values finite or -inf; dy: like x, the cotangent of y
    dlse: x.shape without `axis`, the cotangent of logsumexp(x) (None: the LSE is not an output)
    returns: like x, float64. A -inf entry has y = 0 and gets dx = 0; an all -inf row gets 0.
    absolute: the error model's magnitudes instead (conformance/tolerance.py): the root-sum-square of
    the terms dx_j sums, y_j sqrt(dy_j^2 + sum_k (dy_k y_k)^2 + dlse^2) (y, a positive softmax, enters
    with its value). A kernel handed y rounded to its dtype (y_k off by e_k, |e_k| <= eps/2 y_k) computes
    D = sum_k dy_k y_k off by sum_k dy_k e_k, i.e. ~eps/2 sqrt(sum_k (dy_k y_k)^2) at random signs and at
    most sqrt(n) times that, and every dx_j by y_j times it, however far dy_j - D + dlse cancels
    (measured, our C kernel on rows of 2-17 lanes, 20,000 draws: the error is at most 1.21 eps(fp16) and
    1.13 eps(bf16) x max(|dx_j|, this magnitude): y_j's own rounding and the output's are in it too).
    """
    y = softmax(x, axis=axis)
    dy = _as_f64(dy)
    dl = None if dlse is None else np.expand_dims(_as_f64(dlse), axis)
    if absolute:  # sums of squares, sqrt at the end
        d2 = np.sum((dy * y) ** 2, axis=axis, keepdims=True)
        return y * np.sqrt(dy * dy + d2 + (0.0 if dl is None else dl * dl))
    dot = np.sum(dy * y, axis=axis, keepdims=True)
    dx = y * (dy - dot)
    if dl is not None:
        dx = dx + dl * y
    return dx


def online_softmax_backward(x: NDArray, tile: int, dy: NDArray, dlse: NDArray, axis: int = -1,
                            absolute: bool = False) -> F64:
    """VJP of `online_softmax` (outputs y and lse): the streaming form computes the same function,
    so its gradient is `softmax_backward` with the LSE's cotangent. tile: as the forward (unused)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return softmax_backward(x, dy, axis=axis, dlse=dlse, absolute=absolute)
