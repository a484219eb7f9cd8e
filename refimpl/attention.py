"""Golden attention: prefill, varlen, decode (contiguous and paged), split-KV decode (three
partitions, contiguous or paged), chunked prefill over a cache that holds history, and context attention
that writes the chunk into the cache first (context_kv), float64.

    s_ij = scale * q_i . k_j                        scale default 1/sqrt(d)
    s_ij = cap * tanh(s_ij / cap)                   optional logit softcap (Gemma-2), before the mask
    s_ij = -inf where masked                        causal / window / past the sequence's length
    LSE_i = ln sum_j exp(s_ij)                      natural log; -inf for a fully masked row
    O_i   = sum_j exp(s_ij - LSE'_i) v_j            LSE' = ln(exp(LSE) + exp(S_h)) with a sink, else LSE

Conventions (OPS.md, attention; research/attention-semantics.md):
- Causal alignment is a parameter. bottom_right (default; FlashAttention >= 2.1, FlashInfer,
  FlashMLA, torch causal_lower_right) keeps j <= i + L_k - L_q; top_left (SDPA is_causal) keeps
  j <= i. L_q, L_k are each sequence's own lengths (varlen and decode are aligned per sequence).
  With L_q > L_k, bottom_right leaves the first L_q - L_k rows fully masked.
- Sliding window (left, right), inclusive, FlashAttention's convention, on the same diagonal:
  keep diag - left <= j <= diag + right, diag = i + L_k - L_q (i for top_left); -1 is unbounded;
  causal forces right = 0. A model window W is (W - 1, 0).
- GQA/MQA: query head h reads kv head h // (h_q // h_kv) (`head_map="grouped"`);
  `head_map="tiled"` (h % h_kv, the bug of k.repeat instead of repeat_interleave) exists only so
  a failing kernel can be diagnosed against it.
- Attention sink (gpt-oss): one logit S_h per query head, already in the scaled domain, takes
  probability mass but has no value. `lse` excludes it, `lse_sink` includes it.
- Fully masked row: O = 0, LSE = -inf (lse_sink = S_h with a finite sink).
- Keys at or past a sequence's length are never read into the result: the caches hold NaN
  there, and the golden zeroes them before any product.
- cache_loc (decode, decode_paged, decode_split, chunked_prefill; TensorRT-LLM): sequence b's cache row, or its
  block-table row, is cache_loc[b], not b; the caches / table may hold more rows than the batch.
- d_v may differ from d (DeepSeek's 192 / 128); V may be the first d_v dims of K's own rows
  (FlashMLA's 576 / 512): a layout of the caller's buffers, the same values for the golden.

Error model (`absolute=True` on every golden here; conformance/tolerance.py, issue 31): instead of the
outputs, per element the root-sum-square of the magnitudes of the terms the golden sums, what a correct
kernel's rounding errors scale with (P, a softmax probability, enters with its true value):
    |O_i|  -> sqrt(sum_j P_ij^2 v_j^2)                    the P V sum in squared form; with |O_i| it also
                                                          bounds (to 2x) what P's relative errors e_ij carry
                                                          into O: sum_j P_ij e_ij (v_j - O_i)
    |LSE_i| -> sqrt(mx_i^2 + ln(s_i)^2 + (1 - 1/s_i)^2)   LSE = mx + ln s, mx the row's largest (scaled,
                                                          capped) logit, s = sum_j exp(s_ij - mx) >= 1: the
                                                          two addends, and s's relative error, an absolute
                                                          error of ln s: ~1 (eps) where many keys add up,
                                                          1 - 1/s in general, the share of s that rounds
                                                          (the max key's exp(0) = 1 is exact: 0 for one
                                                          key, whose LSE is its logit); lse_sink: the same
                                                          with the sink as one more logit
A row with no key: 0. A sum of random-sign terms has E (sum t)^2 = sum t^2, so an ordinary O's magnitude
is about its own size; where the values cancel (O ~ 0 from terms of size ~|v|) it stays that of the terms.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.combine import lse_combine
from kernel_parity.refimpl.kvcache import update as cache_update
from kernel_parity.refimpl.threads import on_threads

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
CAUSAL = ("none", "bottom_right", "top_left")


def kv_head_index(h_q: int, h_kv: int, head_map: str = "grouped") -> I64:
    """(h_q,) kv head of each query head; h_q % h_kv == 0 is required."""
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    h = np.arange(h_q)
    if head_map == "grouped":
        return h // (h_q // h_kv)
    if head_map == "tiled":
        return h % h_kv
    raise ValueError(f"head_map must be 'grouped' or 'tiled', got {head_map!r}")


def mask(s_q: int, s_k: int, q_lens: I64, k_lens: I64, causal: str = "none",
         window: tuple[int, int] = (-1, -1)) -> NDArray[np.bool_]:
    """(b, s_q, s_k) True where query i may attend key j.

    q_lens, k_lens: (b,) valid queries / keys per sequence (rows i >= q_len are padding, all False)
    """
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {CAUSAL}, got {causal!r}")
    left, right = window
    if causal != "none":
        right = 0
    i = np.arange(s_q)[None, :, None]
    j = np.arange(s_k)[None, None, :]
    lq = np.asarray(q_lens, dtype=np.int64)[:, None, None]
    lk = np.asarray(k_lens, dtype=np.int64)[:, None, None]
    diag = i if causal == "top_left" else i + lk - lq  # b, s_q, 1
    keep = (i < lq) & (j < lk)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return keep


def attention(q: NDArray, k: NDArray, v: NDArray, *, scale: float | None = None, causal: str = "none",
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: NDArray | None = None,
              q_lens: NDArray | None = None, k_lens: NDArray | None = None,
              head_map: str = "grouped", absolute: bool = False) -> tuple[F64, F64, F64]:
    """Dense attention over padded sequences; returns (o, lse, lse_sink).

    q: (b, s_q, h_q, d)
    k: (b, s_k, h_kv, d)
    v: (b, s_k, h_kv, d_v)
    sinks: (h_q,) sink logits (scaled domain) or None
    q_lens, k_lens: (b,) valid lengths (default s_q, s_k); padding rows give O = 0, LSE = -inf
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q), lse_sink (b, h_q, s_q) (= lse without sinks)
    absolute: their error model's magnitudes instead, in the same shapes (module docstring)
    """
    b, s_q = np.shape(q)[:2]
    s_k = np.shape(k)[1]
    q_lens = np.full(b, s_q) if q_lens is None else np.asarray(q_lens, dtype=np.int64)
    k_lens = np.full(b, s_k) if k_lens is None else np.asarray(k_lens, dtype=np.int64)
    keep = mask(s_q, s_k, q_lens, k_lens, causal, window)
    return masked_attention(q, k, v, keep, scale=scale, softcap=softcap, sinks=sinks, head_map=head_map,
                            absolute=absolute)


def _logits(q: F64, k: F64, keep: NDArray, scale: float, softcap: float, head_map: str) -> F64:
    """(b, h_q, s_q, s_k) scaled, softcapped logits, -inf where not kept.

    With the grouped mapping the g query heads of a kv head are stacked into one matmul against
    that kv head (no copy of K per query head)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if head_map == "grouped":
        g = h_q // h_kv
        qg = q.reshape(b, s_q, h_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, h_kv, g * s_q, d)
        s = (qg @ k.transpose(0, 2, 3, 1)).reshape(b, h_q, s_q, s_k)  # q head kv*g + r
    else:
        kv_idx = kv_head_index(h_q, h_kv, head_map)
        s = q.transpose(0, 2, 1, 3) @ k[:, :, kv_idx, :].transpose(0, 2, 3, 1)  # b, h_q, s_q, s_k
    s = s * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    return np.where(keep[:, None], s, -np.inf)


def _times_v(p: F64, v: F64, head_map: str) -> F64:
    """(b, h_q, s_q, s_k) weights times values (b, s_k, h_kv, d_v) -> (b, s_q, h_q, d_v)."""
    b, h_q, s_q, s_k = p.shape
    h_kv, d_v = v.shape[2], v.shape[3]
    if head_map == "grouped":
        g = h_q // h_kv
        o = p.reshape(b, h_kv, g * s_q, s_k) @ v.transpose(0, 2, 1, 3)  # b, h_kv, g*s_q, d_v
        return o.reshape(b, h_kv, g, s_q, d_v).transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, d_v)
    kv_idx = kv_head_index(h_q, h_kv, head_map)
    return (p @ v[:, :, kv_idx, :].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _stats(s: F64) -> tuple[F64, F64]:
    """Row max (0 where the row is empty) and LSE (-inf where empty) over the last axis."""
    m = np.max(s, axis=-1, keepdims=True)
    live = np.isfinite(m)
    m = np.where(live, m, 0.0)
    tot = np.sum(np.exp(s - m), axis=-1)  # exp(-inf) = 0; -inf - -inf never formed
    with np.errstate(divide="ignore"):
        lse = np.where(live[..., 0], m[..., 0] + np.log(np.where(live[..., 0], tot, 1.0)), -np.inf)
    return m, lse


def lse_magnitude(mx: F64, lse: F64) -> F64:
    """The LSE's magnitude sqrt(mx^2 + ln(s)^2 + (1 - 1/s)^2) per row (module docstring), from the row's
    max logit mx and LSE = mx + ln s; 0 where the row is empty (lse = -inf)."""
    live = np.isfinite(lse)
    mx = np.where(live, mx, 0.0)
    ln_s = np.where(live, lse, 0.0) - mx
    rounds = -np.expm1(-ln_s)  # 1 - 1/s: the share of s that is not the max key's exact exp(0) = 1
    return np.where(live, np.sqrt(mx * mx + ln_s * ln_s + rounds * rounds), 0.0)


def logit_error_sq(p: F64, sigma2: F64, v: F64, o: F64) -> F64:
    """The compute-precision term of a P V sum, squared: sum_j P_j^2 sigma_j^2 (v_j - O)^2 per row and lane.

    A logit's fp32 rounding, ~u32 sigma_j (sigma_j^2 = s_j^2 + the RSS of its terms squared, weighted by the
    roundings behind them), is a relative error of P_j; normalized, dP_j = P_j (ds_j - sum_l P_l ds_l), so O
    moves by sum_j P_j ds_j (v_j - O). p, sigma2: (..., R, J); v: (..., J, d_v); o: (..., R, d_v). Rows of one
    key (v_j = O) and one-hot rows carry nothing. The error model's `<output>@fp32` (conformance/tolerance.py).
    The row's largest P enters as its own term w (v_max - O)^2: expanded through the matmuls, a one-hot row
    of huge logits (sigma^2 ~ 1e24) would leave eps64 sigma^2 v^2 of cancellation instead of 0."""
    w = p * p * sigma2
    j = np.argmax(p, axis=-1)[..., None]  # (..., R, 1)
    w_max = np.take_along_axis(w, j, axis=-1)
    np.put_along_axis(w, j, 0.0, axis=-1)
    e2 = w @ (v * v) - 2.0 * o * (w @ v) + o * o * np.sum(w, axis=-1, keepdims=True)
    np.maximum(e2, 0.0, out=e2)
    return e2 + w_max * np.square(np.take_along_axis(v, j, axis=-2) - o)


def _read_only_kept(x: NDArray, keep: NDArray) -> F64:
    """x (b, s_k, h, d) as float64 with every key no query keeps zeroed (it may hold NaN poison)."""
    read = keep.any(axis=1)[:, :, None, None]  # b, s_k, 1, 1
    return np.where(read, np.asarray(x, dtype=np.float64), 0.0)


def masked_attention(q: NDArray, k: NDArray, v: NDArray, keep: NDArray, *, scale: float | None = None,
                     softcap: float = 0.0, sinks: NDArray | None = None,
                     head_map: str = "grouped", absolute: bool = False) -> tuple[F64, F64, F64]:
    """Attention under an explicit mask; keys no query keeps are never read (they may be NaN).

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v)
    keep: (b, s_q, s_k) bool, True where query i may attend key j
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q), lse_sink (b, h_q, s_q)
    absolute: their magnitudes instead (the error model, module docstring)
    """
    q = np.asarray(q, dtype=np.float64)
    b, s_q, h_q, d = q.shape
    h_kv = np.shape(k)[2]
    kv_head_index(h_q, h_kv, head_map)  # validates h_q % h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k, v = _read_only_kept(k, keep), _read_only_kept(v, keep)
    if head_map == "grouped" and b * h_kv > 1 and b * h_q * s_q * np.shape(k)[1] >= PIECE_LOGITS:
        return _by_pieces(q, k, v, keep, scale, softcap, sinks, absolute)
    return _attend(q, k, v, keep, scale, softcap, sinks, head_map, absolute)


# A (batch, kv head) piece is a whole attention of its own (the grouped mapping reads no other kv
# head), so large goldens run piece by piece on a worker's threads (refimpl/threads.py): the same
# arrays bit for bit (each piece's matmuls and row reductions are the ones of the whole call), and
# at most `threads` pieces' logits in memory instead of all b h_q s_q s_k of them.
PIECE_LOGITS = 1 << 22


def _by_pieces(q: F64, k: F64, v: F64, keep: NDArray, scale: float, softcap: float,
               sinks: NDArray | None, absolute: bool = False) -> tuple[F64, F64, F64]:
    b, s_q, h_q, _ = q.shape
    h_kv, d_v = k.shape[2], v.shape[3]
    g = h_q // h_kv
    o, lse, lse_sink = np.empty((b, s_q, h_q, d_v)), np.empty((b, h_q, s_q)), np.empty((b, h_q, s_q))
    sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)

    def piece(ij: tuple[int, int]) -> None:
        i, j = ij
        hs = slice(j * g, (j + 1) * g)
        o[i:i + 1, :, hs], lse[i:i + 1, hs], lse_sink[i:i + 1, hs] = _attend(
            q[i:i + 1, :, hs], k[i:i + 1, :, j:j + 1], v[i:i + 1, :, j:j + 1], keep[i:i + 1], scale, softcap,
            None if sinks is None else sinks[hs], "grouped", absolute)

    on_threads(piece, [(i, j) for i in range(b) for j in range(h_kv)])
    return o, lse, lse_sink


def _attend(q: F64, k: F64, v: F64, keep: NDArray, scale: float, softcap: float, sinks: NDArray | None,
            head_map: str, absolute: bool = False) -> tuple[F64, F64, F64]:
    s = _logits(q, k, keep, scale, softcap, head_map)
    m, lse = _stats(s)  # b, h_q, s_q
    sk = None if sinks is None else np.asarray(sinks, dtype=np.float64)[None, :, None]
    lse_sink = lse if sk is None else np.logaddexp(lse, sk)
    norm = np.where(np.isfinite(lse_sink), lse_sink, 0.0)[..., None]
    p = np.exp(s - norm)  # a row with no key and no sink: exp(-inf) = 0
    if not absolute:
        return _times_v(p, v, head_map), lse, lse_sink
    np.multiply(p, p, out=p)  # P^2 in place: the squared form's only logits-sized array
    mx = np.where(np.isfinite(lse), m[..., 0], -np.inf)
    mag_sink = lse_magnitude(mx if sk is None else np.maximum(mx, sk), lse_sink)
    return np.sqrt(_times_v(p, v * v, head_map)), lse_magnitude(mx, lse), mag_sink


def prefill(q: NDArray, k: NDArray, v: NDArray, **kw) -> tuple[F64, F64, F64]:
    """Dense batched attention. q: (b, s_q, h_q, d), k/v: (b, s_k, h_kv, d|d_v); see `attention`."""
    return attention(q, k, v, **kw)


def varlen(q: NDArray, k: NDArray, v: NDArray, cu_seqlens_q: NDArray, cu_seqlens_k: NDArray,
           **kw) -> tuple[F64, F64, F64]:
    """Packed variable-length attention (FlashAttention's varlen layout).

    q: (total_q, h_q, d), k: (total_k, h_kv, d), v: (total_k, h_kv, d_v)
    cu_seqlens_q, cu_seqlens_k: (b + 1,) int, starting at 0; sequence i is rows cu[i]:cu[i+1]
    returns: o (total_q, h_q, d_v), lse (h_q, total_q), lse_sink (h_q, total_q)
    Causal alignment and windows use each sequence's own lengths.
    """
    cq, ck = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    b = lq.size
    s_q, s_k = int(max(lq.max(initial=0), 1)), int(max(lk.max(initial=0), 1))
    qi = np.arange(s_q)[None, :]
    ki = np.arange(s_k)[None, :]
    q_ok, k_ok = qi < lq[:, None], ki < lk[:, None]
    qd, kd, vd = (_unpack(t, cu, ok) for t, cu, ok in ((q, cq, q_ok), (k, ck, k_ok), (v, ck, k_ok)))
    o, lse, lse_sink = attention(qd, kd, vd, q_lens=lq, k_lens=lk, **kw)
    flat = q_ok.reshape(-1)
    o_p = o.reshape(b * s_q, *o.shape[2:])[flat]  # total_q, h_q, d_v
    lse_p = lse.transpose(0, 2, 1).reshape(b * s_q, -1)[flat].T  # h_q, total_q
    lse_sink_p = lse_sink.transpose(0, 2, 1).reshape(b * s_q, -1)[flat].T
    return o_p, lse_p, lse_sink_p


def _unpack(x: NDArray, cu: I64, ok: NDArray) -> F64:
    """Packed rows (total, h, d) -> padded (b, s, h, d) float64, zero where `ok` (b, s) is False."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[0] == 0:
        return np.zeros(ok.shape + x.shape[1:])
    rows = np.minimum(cu[:-1, None] + np.arange(ok.shape[1])[None, :], x.shape[0] - 1)  # padding clamps
    return np.where(ok[..., None, None], x[rows], 0.0)


def decode(q: NDArray, k_cache: NDArray, v_cache: NDArray, seqlens: NDArray, *,
           causal: str = "bottom_right", cache_loc: NDArray | None = None, **kw) -> tuple[F64, F64, F64]:
    """Decode over a contiguous cache: the s_q queries are the last s_q tokens of each sequence.

    q: (b, s_q, h_q, d); k_cache: (b, s_max, h_kv, d); v_cache: (b, s_max, h_kv, d_v)
    seqlens: (b,) cached tokens per sequence (0 allowed); slots >= seqlens[b] are never read
    cache_loc: (b,) int, or None: sequence b reads cache row cache_loc[b] (TensorRT-LLM's `cache_loc`;
        the caches then have rows >= b rows, those no sequence maps to never read); None: row b
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q), lse_sink (b, h_q, s_q)
    """
    if cache_loc is not None:
        loc = np.asarray(cache_loc, dtype=np.int64)
        k_cache, v_cache = np.asarray(k_cache)[loc], np.asarray(v_cache)[loc]  # b, s_max, h_kv, d | d_v
    return attention(q, k_cache, v_cache, k_lens=seqlens, causal=causal, **kw)


def gather_pages(cache: NDArray, block_table: NDArray) -> F64:
    """Logical per-sequence cache from pages: token t of sequence b is cache[block_table[b, t // page], t % page].

    cache: (num_blocks, page, h_kv, d); block_table: (b, max_blocks) int
    returns: (b, max_blocks * page, h_kv, d)
    """
    bt = np.asarray(block_table, dtype=np.int64)
    g = np.asarray(cache, dtype=np.float64)[bt]  # b, max_blocks, page, h_kv, d
    return g.reshape(bt.shape[0], bt.shape[1] * cache.shape[1], *cache.shape[2:])


def decode_paged(q: NDArray, k_cache: NDArray, v_cache: NDArray, block_table: NDArray, seqlens: NDArray, *,
                 cache_loc: NDArray | None = None, **kw) -> tuple[F64, F64, F64]:
    """Decode over a paged cache (FlashMLA / vLLM layout).

    q: (b, s_q, h_q, d); k_cache: (num_blocks, page, h_kv, d); v_cache: (num_blocks, page, h_kv, d_v)
    block_table: (b, max_blocks) int32, or (rows, max_blocks) with cache_loc; seqlens: (b,) int32
    cache_loc: (b,) int, or None: sequence b reads its pages through block-table row cache_loc[b]
        (TensorRT-LLM's page_table[cache_loc[b]]); None: row b
    returns: as `decode`
    """
    if cache_loc is not None:
        block_table = np.asarray(block_table)[np.asarray(cache_loc, dtype=np.int64)]  # b, max_blocks
    return decode(q, gather_pages(k_cache, block_table), gather_pages(v_cache, block_table), seqlens, **kw)


def split_bounds(seqlens: NDArray, splits: int, *, block: int | None = None,
                 bounds: NDArray | None = None) -> tuple[I64, I64]:
    """(start, end) of each split's key range per sequence, each (splits, b); three partitions.

    equal (default): split s of sequence b covers [s C_b, min((s + 1) C_b, L_b)), C_b = ceil(L_b / splits):
        every split has work when L_b >= splits; the rest are empty (LSE -inf).
    block: fixed blocks of `block` keys (TensorRT-LLM's multi-block mode: 256, 64 or the page size),
        split s covers [s block, (s + 1) block) cut to [0, L_b); splits * block >= L_b is required.
    bounds: (b, splits + 1) per-request cumulative boundaries (FlashMLA's scheduler), non-decreasing
        from bounds[b, 0] = 0 to bounds[b, splits] >= L_b; split s covers [bounds[b, s], bounds[b, s + 1])
        cut to [0, L_b). A request with fewer splits repeats its last boundary (empty splits).
    Every key of every sequence lies in exactly one split (ValueError when a partition does not cover).
    """
    L = np.asarray(seqlens, dtype=np.int64)
    s = np.arange(splits)[:, None]
    if bounds is not None:
        t = np.asarray(bounds, dtype=np.int64)
        if t.shape != (L.size, splits + 1) or (t[:, 0] != 0).any() or (np.diff(t, axis=1) < 0).any() \
                or (t[:, -1] < L).any():
            raise ValueError(f"bounds {t.shape} must be (b, splits + 1) = ({L.size}, {splits + 1}), non-decreasing "
                             f"from 0 to at least each sequence's length")
        return np.minimum(t[:, :-1].T, L[None, :]), np.minimum(t[:, 1:].T, L[None, :])
    if block is not None:
        if block < 1 or splits * block < L.max(initial=0):
            raise ValueError(f"{splits} splits of block={block} keys do not cover {L.max(initial=0)} keys")
        start = np.minimum(s * block, L[None, :])
        return start, np.minimum(start + block, L[None, :])
    c = -(-L // splits)  # ceil
    start = np.minimum(s * c[None, :], L[None, :])
    return start, np.minimum(start + c[None, :], L[None, :])


def decode_split(q: NDArray, k_cache: NDArray, v_cache: NDArray, seqlens: NDArray, splits: int, *,
                 causal: str = "bottom_right", window: tuple[int, int] = (-1, -1), sinks: NDArray | None = None,
                 scale: float | None = None, softcap: float = 0.0, head_map: str = "grouped",
                 block: int | None = None, bounds: NDArray | None = None, block_table: NDArray | None = None,
                 cache_loc: NDArray | None = None, absolute: bool = False) -> tuple[F64, F64, F64, F64, F64]:
    """Flash decoding: per-split partial states over a contiguous or paged cache, merged with `lse_combine`.

    q, k_cache, v_cache, seqlens: as `decode`; splits: number of key ranges; block / bounds: the
    partition (`split_bounds`: equal counts by default, fixed blocks, or explicit boundaries)
    block_table: (b, max_blocks) int, or None (contiguous caches); with it k_cache, v_cache are pages
        (num_blocks, page, h_kv, d | d_v) and token t of sequence b is cache[block_table[b, t // page], t % page]
        (`gather_pages`), whatever split t falls in: the partition is over logical token positions, so a
        split may start or end inside a page (TensorRT-LLM's 256-key blocks over pages of 16 / 64 are
        page-aligned; equal counts and explicit boundaries in general are not). The same math as the
        contiguous cache the pages gather into.
    cache_loc: (b,) int, or None: sequence b reads cache row / block-table row cache_loc[b] (TensorRT-LLM's
        generate path, as `decode`); None: row b
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q), lse_sink (b, h_q, s_q),
             o_parts (splits, b, s_q, h_q, d_v) (NaN for an empty split: any value is right there),
             lse_parts (splits, b, h_q, s_q) (-inf for an empty split).
    Each split sees its row's mask (causal / window on global positions) cut to its key range;
    the sink enters after the merge, as one more term of the denominator. The logits are computed
    once; each split's statistics come from its slice (gathered into a padded chunk axis).
    absolute: the five outputs' magnitudes instead (module docstring), the merge in squared form too:
    o_parts and lse_parts each split's own, o^2 = sum_s a_s^2 o_parts_s^2 (a_s = exp(lse_s - lse), the
    merge's weights; = sum_j P_j^2 v_j^2 over all keys, as `decode`'s), lse and lse_sink the row's
    (mx over every key); an empty split's are 0.
    """
    q = np.asarray(q, dtype=np.float64)
    b, s_q, h_q, d = q.shape
    if cache_loc is not None and block_table is not None:
        block_table = np.asarray(block_table)[np.asarray(cache_loc, dtype=np.int64)]  # b, max_blocks
    elif cache_loc is not None:
        loc = np.asarray(cache_loc, dtype=np.int64)
        k_cache, v_cache = np.asarray(k_cache)[loc], np.asarray(v_cache)[loc]  # b, s_max, h_kv, d | d_v
    if block_table is not None:
        k_cache, v_cache = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    s_max = np.shape(k_cache)[1]
    L = np.asarray(seqlens, dtype=np.int64)
    keep = mask(s_q, s_max, np.full(b, s_q), L, causal, window)  # b, s_q, s_max
    k, v = _read_only_kept(k_cache, keep), _read_only_kept(v_cache, keep)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s = _logits(q, k, keep, scale, softcap, head_map)  # b, h_q, s_q, s_max
    start, end = split_bounds(L, splits, block=block, bounds=bounds)  # splits, b
    c_max = int(max((end - start).max(initial=0), 1))
    j = start.T[:, :, None] + np.arange(c_max)[None, None, :]  # b, splits, c_max: key index
    ok = j < end.T[:, :, None]
    j = np.where(ok, j, 0)
    idx = j.reshape(b, 1, 1, splits * c_max)
    s_g = np.take_along_axis(s, np.broadcast_to(idx, (b, h_q, s_q, splits * c_max)), axis=-1)
    s_g = np.where(ok.reshape(b, 1, 1, -1), s_g, -np.inf).reshape(b, h_q, s_q, splits, c_max)
    m, lse_p = _stats(s_g)  # lse_p: b, h_q, s_q, splits
    w = np.exp(s_g - np.where(np.isfinite(lse_p), lse_p, 0.0)[..., None])  # normalised per split
    w = w.transpose(0, 1, 3, 2, 4).reshape(b, h_q, splits * s_q, c_max)  # b, h_q, splits*s_q, c_max
    v_g = v[np.arange(b)[:, None, None], j]  # b, splits, c_max, h_kv, d_v
    if absolute:
        return _split_magnitudes(w * w, v_g * v_g, m[..., 0], lse_p, sinks, head_map)
    o_parts = np.stack([_times_v(w.reshape(b, h_q, splits, s_q, c_max)[:, :, sp], v_g[:, sp], head_map)
                        for sp in range(splits)])  # splits, b, s_q, h_q, d_v
    lse_parts = lse_p.transpose(3, 0, 1, 2)  # splits, b, h_q, s_q
    lse_rows = lse_parts.transpose(0, 1, 3, 2)  # splits, b, s_q, h_q: rows aligned with o_parts
    o, lse_bsh = lse_combine(o_parts, lse_rows)
    lse = lse_bsh.transpose(0, 2, 1)  # b, h_q, s_q
    lse_sink = lse
    if sinks is not None:
        lse_sink = np.logaddexp(lse, np.asarray(sinks, dtype=np.float64)[None, :, None])
        fin = np.isfinite(lse_sink)
        f = np.where(fin, np.exp(lse - np.where(fin, lse_sink, 0.0)), 0.0)  # b, h_q, s_q
        o = o * f.transpose(0, 2, 1)[..., None]
    o_parts = np.where(np.isneginf(lse_rows)[..., None], np.nan, o_parts)
    return o, lse, lse_sink, o_parts, lse_parts


def _split_magnitudes(w2: F64, v2: F64, m: F64, lse_p: F64, sinks: NDArray | None,
                      head_map: str) -> tuple[F64, F64, F64, F64, F64]:
    """decode_split's magnitudes from its squared split weights w2 (b, h_q, splits*s_q, c_max), squared
    gathered values v2 (b, splits, c_max, h_kv, d_v), each split's max logit m and LSE (b, h_q, s_q, splits)."""
    b, h_q, s_q, splits = lse_p.shape
    c_max = w2.shape[-1]
    o2_parts = np.stack([_times_v(w2.reshape(b, h_q, splits, s_q, c_max)[:, :, sp], v2[:, sp], head_map)
                         for sp in range(splits)])  # splits, b, s_q, h_q, d_v: sum over the split of w^2 v^2
    live = np.isfinite(lse_p)
    with np.errstate(divide="ignore"):
        lse = np.logaddexp.reduce(lse_p, axis=-1)  # b, h_q, s_q: the merge's LSE (-inf with no key)
    a = np.exp(np.where(live, lse_p - np.where(np.isfinite(lse), lse, 0.0)[..., None], -np.inf))  # merge weights
    a2 = (a * a).transpose(3, 0, 2, 1)[..., None]  # splits, b, s_q, h_q, 1
    o2 = np.sum(a2 * o2_parts, axis=0)  # b, s_q, h_q, d_v
    mx = np.max(np.where(live, m, -np.inf), axis=-1)  # the row's largest logit over every split
    lse_sink, mx_sink = lse, mx
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64)[None, :, None]
        lse_sink, mx_sink = np.logaddexp(lse, sk), np.maximum(mx, sk)
        fin = np.isfinite(lse_sink)
        f = np.where(fin, np.exp(lse - np.where(fin, lse_sink, 0.0)), 0.0)  # b, h_q, s_q
        o2 = o2 * (f * f).transpose(0, 2, 1)[..., None]
    lse_parts = lse_magnitude(m, lse_p).transpose(3, 0, 1, 2)  # splits, b, h_q, s_q
    return (np.sqrt(o2), lse_magnitude(mx, lse), lse_magnitude(mx_sink, lse_sink), np.sqrt(o2_parts),
            lse_parts)


def chunked_prefill(q: NDArray, k_cache: NDArray, v_cache: NDArray, cu_seqlens_q: NDArray, hist: NDArray,
                    block_table: NDArray | None = None, *, causal: str = "bottom_right",
                    cache_loc: NDArray | None = None, **kw) -> tuple[F64, F64, F64]:
    """Chunked prefill: packed query chunks over a cache that already holds each sequence's history.

    q: (total_q, h_q, d) packed chunks; sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    k_cache, v_cache: (b, s_max, h_kv, d | d_v) contiguous, or (num_blocks, page, h_kv, d | d_v) pages
        through block_table (b, max_blocks); each holds hist_b + L_q,b keys of sequence b (its history,
        then the chunk's own keys); slots past them are never read
    cu_seqlens_q: (b + 1,) int from 0; hist: (b,) int, tokens before the chunk (0: no history)
    cache_loc: (b,) int, or None: sequence b reads cache row / block-table row cache_loc[b]
        (TensorRT-LLM's `cache_loc`, as `decode`); None: row b
    returns: o (total_q, h_q, d_v), lse (h_q, total_q), lse_sink (h_q, total_q)
    Query i of sequence b sits at absolute position hist_b + i: bottom_right (the default) keeps keys
    j <= hist_b + i, the alignment of `mask` with L_k = hist_b + L_q; windows use the same diagonal.
    A sequence with no queries contributes no rows.
    """
    cq = np.asarray(cu_seqlens_q, dtype=np.int64)
    lq = np.diff(cq)
    lk = np.asarray(hist, dtype=np.int64) + lq
    if cache_loc is not None:
        loc = np.asarray(cache_loc, dtype=np.int64)
        if block_table is not None:
            block_table = np.asarray(block_table)[loc]  # b, max_blocks
        else:
            k_cache, v_cache = np.asarray(k_cache)[loc], np.asarray(v_cache)[loc]  # b, s_max, h_kv, d | d_v
    if block_table is not None:
        k_cache, v_cache = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    q_ok = np.arange(int(max(lq.max(initial=0), 1)))[None, :] < lq[:, None]  # b, s_q
    qd = _unpack(q, cq, q_ok)
    o, lse, lse_sink = attention(qd, k_cache, v_cache, q_lens=lq, k_lens=lk, causal=causal, **kw)
    flat = q_ok.reshape(-1)
    o_p = o.reshape(-1, *o.shape[2:])[flat]  # total_q, h_q, d_v
    lse_p, lse_sink_p = (x.transpose(0, 2, 1).reshape(flat.size, -1)[flat].T for x in (lse, lse_sink))
    return o_p, lse_p, lse_sink_p



def context_kv(q: NDArray, k: NDArray, v: NDArray, k_cache: NDArray, v_cache: NDArray, cu_seqlens: NDArray,
               input_pos: NDArray, block_table: NDArray | None = None,
               **kw) -> tuple[F64, F64, F64, NDArray, NDArray]:
    """Context attention that writes the cache (TensorRT-LLM's context_attention_kv): the chunk's K/V
    appended to each sequence's cache, and its queries attending history + chunk, causal bottom-right.

    q: (total, h_q, d), k: (total, h_kv, d), v: (total, h_kv, d_v) packed new tokens; sequence b's are
        rows cu_seqlens[b]:cu_seqlens[b + 1] (TensorRT-LLM's seq_start = cu_seqlens[:-1], seq_len its diff)
    k_cache, v_cache: (b, s_max, h_kv, d | d_v) contiguous, or (num_blocks, page, h_kv, d | d_v) pages
        through block_table (b, max_blocks); slots 0 .. input_pos_b - 1 hold sequence b's history
    cu_seqlens: (b + 1,) int from 0; input_pos: (b,) int, tokens cached before the chunk (0: none)
    returns: o (total, h_q, d_v), lse (h_q, total), lse_sink (h_q, total), and the caches after the write
    Composition of the two goldens it fuses: kvcache.update (ragged: seq_start, seq_len) writes token t of
    sequence b at position input_pos_b + t (through the block table when paged; every other slot keeps its
    bits), then chunked_prefill over the written caches with hist = input_pos: query i of sequence b at
    position input_pos_b + i sees keys j <= input_pos_b + i, the history from the cache and the chunk's own
    keys as written. A sequence of length 0 writes nothing and has no rows. `kw` as chunked_prefill's.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    rag = dict(block_table=block_table, seq_len=np.diff(cu), seq_start=cu[:-1])
    k_out, v_out = cache_update(k_cache, k, input_pos, **rag), cache_update(v_cache, v, input_pos, **rag)
    o, lse, lse_sink = chunked_prefill(q, k_out, v_out, cu, input_pos, block_table, **kw)
    return o, lse, lse_sink, k_out, v_out

# Backward (VJP) goldens live beside the forward ones, in their own module (refimpl/attention_grad.py),
# and are part of this family's namespace: attention.prefill_backward's golden is refimpl.attention.prefill_backward.
# Resolved on first use (PEP 562): attention_grad imports this module, so an import here would fail
# whenever attention_grad is the module imported first.
_BACKWARD = ("prefill_backward", "varlen_backward")


def __getattr__(name: str):
    if name in _BACKWARD:
        from kernel_parity.refimpl import attention_grad

        return getattr(attention_grad, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
