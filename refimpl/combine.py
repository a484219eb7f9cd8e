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


def lse_combine(o_parts: NDArray, lse_parts: NDArray, absolute: bool = False) -> tuple[F64, F64]:
    """Merge `n` partial states along the leading axis.

    o_parts: (n, ..., d_v) partial outputs, each normalised by its own split's sum
    lse_parts: (n, ...) natural-log LSE of each split, -inf for an empty split
    returns: (o (..., d_v), lse (...)), float64; rows with every split empty -> (0, -inf)
    absolute: the error model's magnitudes instead (conformance/tolerance.py), root-sum-squares of the
    terms each output sums: o = sum_i w_i O_i -> sqrt(sum_i w_i^2 O_i^2) (the weights w_i = exp(LSE_i -
    LSE), positive and well-conditioned, with their values; O_i of different signs cancel), and
    LSE = M + ln s (s = sum_i exp(LSE_i - M) >= 1) -> sqrt(M^2 + (ln s)^2 + (1 - 1/s)^2), the last the
    relative rounding of s, which ln turns into an absolute error (the max split's term, exp(0) = 1, is
    exact: only the other s - 1 of s round; 0 for one live split, where LSE = M). An all-empty row keeps
    (0, -inf).
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
    w = np.exp(np.where(live, lse_parts - lse_safe, -np.inf))  # n, ...; an empty split's exp(-inf) = 0
    o_live = np.where(live[..., None], o_parts, 0.0)  # an empty split's O may be NaN
    if not absolute:
        return np.sum(w[..., None] * o_live, axis=0), lse
    o_mag = np.sqrt(np.sum((w[..., None] * o_live) ** 2, axis=0))
    m = np.max(lse_parts, axis=0)  # ...: M (-inf on an all-empty row, NaN where an LSE_i is)
    m_safe = np.where(any_live, m, 0.0)
    log_s = lse_safe - m_safe  # ln s = LSE - M, >= 0
    rel = -np.expm1(-log_s)  # 1 - 1/s, the share of s that rounds
    return o_mag, np.where(any_live, np.sqrt(m_safe * m_safe + log_s * log_s + rel * rel), lse)


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
    absolute: the error model's magnitudes instead (conformance/tolerance.py), root-sum-squares of the terms.
    dO . (O_i - O) is the sum (1 - w_i) dO . O_i - sum_{j != i} w_j dO . O_j (O = sum_j w_j O_j, sum_j w_j = 1):

        dLSE_i -> w_i sqrt(sum_d dO_d^2 ((1 - w_i)^2 O_id^2 + sum_{j != i} w_j^2 O_jd^2) + sum_j (w_j a_j)^2
                           + dLSE^2)

    (w, positive and well-conditioned, with its values). Written as O_i - O, the dominant split of every row
    (w_i near 1, O near O_i) would be a cancellation on any input; in this form only the splits' own dots
    cancel. It is what the rounding of a kernel that forms dO . O from its split dots (abar = sum_j w_j a_j,
    a_j = dO . O_j) scales with: a_i's error enters a_i - abar times 1 - w_i. Each weight carries the
    rounding of its exp (a GPU's exp2 is approximate, ~2^-22 relative) into abar's term w_j a_j, which no
    a_i cancels: sum_j (w_j a_j)^2 joins the sum of squares (measured on an H200: fp32 dLSE of the dominant
    split off by 1.9e-6 = 1.5 eps32 x |a_i| where the form without it allowed 1.1e-6). A kernel that reads
    the merged O rounded to its dtype instead carries eps/2 |dO . O|, which this does not cover.
    dO_i = w_i dO, a product: |w_i dO|.
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    o, lse = lse_combine(o_parts, lse_parts)
    live = ~np.isneginf(lse_parts)
    lse_safe = np.where(np.isneginf(lse), 0.0, lse)
    w = np.exp(np.where(live, lse_parts - lse_safe, -np.inf))  # n, ...; an empty split's exp(-inf) = 0
    do = np.asarray(do, dtype=np.float64)
    o_live = np.where(live[..., None], o_parts, 0.0)
    dl = 0.0 if dlse is None else np.asarray(dlse, dtype=np.float64)
    if absolute:  # sums of squares, sqrt at the end
        t = np.sum((do * o_live) ** 2, axis=-1)  # n, ...: sum_d dO_d^2 O_id^2
        q = w * w * t  # n, ...: the squared terms w_j dO . O_j
        zero = np.zeros_like(q[:1])
        before = np.concatenate([zero, np.cumsum(q, axis=0)[:-1]], axis=0)  # n, ...: sum over j < i
        after = np.concatenate([np.flip(np.cumsum(np.flip(q, axis=0), axis=0), axis=0)[1:], zero], axis=0)  # j > i
        a = np.sum(do * o_live, axis=-1)  # n, ...: the split dots a_j = dO . O_j
        wa = np.sum((w * a) ** 2, axis=0)  # ...: sum_j (w_j a_j)^2, the terms of abar with the rounding of w_j
        dlse_parts = w * np.sqrt((1.0 - w) ** 2 * t + before + after + wa + dl * dl)
        do = np.abs(do)
    else:
        dlse_parts = w * (np.sum(do * (o_live - o), axis=-1) + dl)
    do_parts = w[..., None] * do
    return do_parts, np.where(live, dlse_parts, 0.0)
