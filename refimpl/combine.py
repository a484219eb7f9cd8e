"""Golden split-KV (flash-decoding) merge of partial attention states, in float64.

    M   = max_i LSE_i
    LSE = M + ln sum_i exp(LSE_i - M)
    O   = sum_i exp(LSE_i - LSE) * O_i

Conventions (OPS.md, combine):
- LSE is the natural-log logsumexp of each split's scaled logits. Base-2 peers (FlashInfer)
  multiply by ln 2 before calling this; FA2/FlashMLA's +inf for an empty row maps to -inf.
- An empty split carries LSE = -inf and *any* O (garbage or NaN): its O is never read into
  the result, and -inf - -inf is never evaluated.
- If every split of a row is empty the result is O = 0, LSE = -inf.
- `attention_state` builds one split's state from logits and values (textbook softmax), so
  property tests can check that merging the states of any partition of a row equals
  attending over the whole row.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.softmax import logsumexp, softmax

F64 = NDArray[np.float64]


def lse_combine(o_parts: NDArray, lse_parts: NDArray) -> tuple[F64, F64]:
    """Merge `n` partial states along the leading axis.

    o_parts: (n, ..., d_v) partial outputs, each normalised by its own split's sum
    lse_parts: (n, ...) natural-log LSE of each split, -inf for an empty split
    returns: (o (..., d_v), lse (...)), float64; rows with every split empty -> (0, -inf)
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    if o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(
            f"o_parts shape {o_parts.shape} does not match lse_parts shape {lse_parts.shape} + (d_v,)"
        )
    if lse_parts.shape[0] == 0:
        return np.zeros(o_parts.shape[1:]), np.full(lse_parts.shape[1:], -np.inf)
    live = ~np.isneginf(lse_parts)  # n, ...
    lse = logsumexp(lse_parts, axis=0)  # ...; -inf where every split is empty
    any_live = ~np.isneginf(lse)
    lse_safe = np.where(any_live, lse, 0.0)
    w = np.where(live, np.exp(np.where(live, lse_parts, 0.0) - lse_safe), 0.0)  # n, ...
    o_live = np.where(live[..., None], o_parts, 0.0)  # an empty split's O may be NaN
    o = np.sum(w[..., None] * o_live, axis=0)
    return o, lse


def attention_state(s: NDArray, v: NDArray) -> tuple[F64, F64]:
    """One split's partial state from its logits and values.

    s: (..., k) scaled logits over this split's keys, -inf for masked keys
    v: (..., k, d_v) values
    returns: (o (..., d_v) = softmax(s) @ v, lse (...) = logsumexp(s)); no live key -> (0, -inf)
    """
    p = softmax(s, axis=-1)  # ..., k
    o = np.einsum("...k,...kd->...d", p, np.asarray(v, dtype=np.float64))
    return o, logsumexp(s, axis=-1)


def lse_combine_backward(o_parts: NDArray, lse_parts: NDArray, do: NDArray, dlse: NDArray | None = None,
                         absolute: bool = False) -> tuple[F64, F64]:
    """VJP of `lse_combine`, written out. With w_i = exp(LSE_i - LSE), O = sum_i w_i O_i:

        dO_i   = w_i dO
        dLSE_i = w_i (dO . (O_i - O) + dLSE)

    o_parts: (n, ..., d_v); lse_parts: (n, ...); do: (..., d_v); dlse: (...) or None
    returns: (do_parts (n, ..., d_v), dlse_parts (n, ...)), float64; an empty split (LSE_i = -inf,
    any O_i, NaN included) gets zero gradients, and so does every split of an all-empty row.
    absolute: the error model's magnitudes instead (conformance/tolerance.py): w_i |dO| and
    w_i (|dO| . (|O_i| + |O|) + |dLSE|): dO . (O_i - O) cancels where the splits agree.
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    o, lse = lse_combine(o_parts, lse_parts)
    live = ~np.isneginf(lse_parts)
    lse_safe = np.where(np.isneginf(lse), 0.0, lse)
    w = np.where(live, np.exp(np.where(live, lse_parts, 0.0) - lse_safe), 0.0)  # n, ...
    do = np.asarray(do, dtype=np.float64)
    o_live = np.where(live[..., None], o_parts, 0.0)
    dl = 0.0 if dlse is None else np.asarray(dlse, dtype=np.float64)
    if absolute:
        do, dl = np.abs(do), np.abs(dl)
        dlse_parts = w * (np.sum(do * (np.abs(o_live) + np.abs(o)), axis=-1) + dl)
    else:
        dlse_parts = w * (np.sum(do * (o_live - o), axis=-1) + dl)
    do_parts = w[..., None] * do
    return do_parts, np.where(live, dlse_parts, 0.0)
