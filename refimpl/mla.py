"""Golden multi-head latent attention (DeepSeek-V2/V3 MLA) decode, float64: FlashMLA's dense and
sparse decode, the naive (decompressed) form, MAX's fused FP8 branch, and (re-exported from
mla_schedule) FlashMLA's split scheduler.

Absorbed form (one KV head; `decode` and `decode_sparse` take h_kv: query head h reads kv head
h // (h_q / h_kv)); cache row j = [c_j (d_c = 512) ; k_pe_j (d_r = 64)], d = 576:
    q_i   = [q_nope,i W_UK ; q_pe,i]                  per query head, (d,)   (`absorb`)
    s_ij  = scale * q_i . row_j
    LSE_i = ln sum_j exp(s_ij)                         natural log, over the visible keys
    O_i   = sum_j exp(s_ij - LSE'_i) row_j[:d_v]       values alias the first d_v dims of the keys;
                                                       LSE' = ln(exp(LSE) + exp(sink_h)) with a sink
Naive form, per head h (W_UK[h], W_UV[h]: (128, 512), DeepSeek's wkv_b.view(h, 256, 512) split):
    k_j^h = [c_j W_UK[h]^T ; k_pe_j] (192),  v_j^h = c_j W_UV[h]^T (128),  q^h = [q_nope ; q_pe]
    O^naive = O^absorbed W_UV[h]^T (`unabsorb`) — the same numbers, up to float64 rounding.

Conventions (OPS.md mla; research/attention-semantics.md sections 1, 2, 4.1, 5):
- Paged cache (FlashMLA): token t of request i is kv_cache[block_table[i, t // page], t % page];
  any page size. Only the rows of visible keys are read: rows past a request's length, table
  entries past its last block (FlashMLA's tests fill them with 2147480000) and NaN there never
  reach the result.
- scale is required (FlashMLA's tests use 576^-0.5, DeepSeek-V3 192^-0.5 mscale^2).
- causal (s_q > 1, multi-token prediction) is bottom-right: row i of request b sees keys
  j <= seqlens[b] - s_q + i (FlashMLA `get_mask_len`, its tests' tril(diagonal=s_k - s_q)).
  With s_q = 1 it is no mask (FlashMLA drops is_causal then).
- A row with no visible key: O = 0, LSE = -inf (FlashMLA returns +inf: adapters convert).
- Sparse decode (FlashMLA `flash_mla_with_kvcache(indices=...)`, tests/ref.py
  `ref_sparse_attn_decode`): indices are flat slots block * page + offset into the cache viewed
  as (num_blocks * page, d); -1 and positions >= topk_length[b] are skipped; no causal mask;
  a slot listed twice is gathered and counted twice (the reference gathers per index).
- Sinks (FlashMLA sparse decode, MAX's combine): a natural-log logit per query head in the
  scaled domain, in the output's denominator only; the returned LSE excludes it; +inf gives O = 0.
  MAX's fused branch also takes one per request (`sink_per="batch"`), shared by its heads.
- MAX's sparse mode of the fused branch (sparse_mla, `d_indices=`): each new token is one query row over
  its listed slots, as sparse decode (-1 and entries past topk_lengths[t] skipped, no causal mask).

Error model (`absolute=True` on decode, decode_sparse and decode_fused_fp8; refimpl/attention.py's, issue 31):
the outputs' magnitudes instead, each the root-sum-square of the magnitudes of the terms it sums:
O_i -> sqrt(sum_j P_ij^2 row_j[:d_v]^2), LSE_i -> sqrt(mx_i^2 + ln(s_i)^2 + 1) (`attention.lse_magnitude`),
and the fused branch's out -> sqrt(sum_c a_c^2 w_nc^2) over its FP8 projection's dequantized terms.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.attention import logit_error_sq, lse_magnitude
from kernel_parity.refimpl.mla_fp8 import as_f64, bmm_fp8, rms_norm, rope_interleaved
from kernel_parity.refimpl.mla_schedule import check_schedule, partitions, schedule, sm_parts
from kernel_parity.refimpl.threads import on_threads

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
__all__ = ["absorb", "unabsorb", "decode", "decode_naive", "decode_sparse", "decode_fused_fp8",
           "schedule", "check_schedule", "partitions", "sm_parts"]


# --------------------------------------------------------------------------- shared pieces

CHUNK = 1 << 24  # gathered float64 cache elements per request chunk in `decode` (128 MiB)

def _rows(kv_cache: NDArray, convert: bool = True, heads: bool = False) -> tuple[F64, int]:
    """Cache (num_blocks, page, [1,] d) as (num_blocks * page, d) float64 rows (in the cache's own dtype
    when not `convert`: the caller widens what it gathers), and the page size; `heads`: a cache
    (num_blocks, page, h_kv, d) of h_kv >= 1 latent heads as (num_blocks * page, h_kv, d) rows."""
    kv = as_f64(kv_cache) if convert else np.asarray(kv_cache)
    if heads:
        if kv.ndim == 3:
            kv = kv[:, :, None]
        if kv.ndim != 4 or kv.shape[2] < 1:
            raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, d), got shape {kv.shape}")
        return kv.reshape(-1, *kv.shape[2:]), kv.shape[1]
    if kv.ndim == 4:
        if kv.shape[2] != 1:
            raise ValueError(f"MLA caches have one KV head, got kv_cache shape {kv.shape}")
        kv = kv[:, :, 0]
    if kv.ndim != 3:
        raise ValueError(f"kv_cache must be (num_blocks, page, [1,] d), got shape {kv.shape}")
    return kv.reshape(-1, kv.shape[-1]), kv.shape[1]


def _slots(block_table: NDArray, lengths: I64, page: int, s_k: int, num_slots: int) -> tuple[I64, NDArray]:
    """(b, s_k) flat cache slot of token j of each request (0 where j >= length) and the valid mask."""
    bt = np.asarray(block_table, dtype=np.int64)
    j = np.arange(s_k)
    valid = j[None, :] < lengths[:, None]
    need = -(-int(lengths.max(initial=0)) // page)
    if need > bt.shape[1]:
        raise ValueError(f"block_table has {bt.shape[1]} blocks per request, seqlens need {need}")
    blk = bt[:, np.minimum(j // page, bt.shape[1] - 1)]  # b, s_k
    slot = np.where(valid, blk * page + j % page, 0)
    if ((slot < 0) | (slot >= num_slots)).any():
        raise ValueError(f"block_table names a block outside the cache ({num_slots // page} blocks)")
    return slot, valid


def _softmax(s: F64, keep: NDArray, sink: NDArray | None) -> tuple[F64, F64, F64]:
    """Weights and LSE of logits s (b, h, s_q, s_k) under keep (b, s_q, s_k); sinks (h,) (per head), an array
    broadcasting to (b, h, s_q) ((b, 1, 1): per request), or None.

    s is overwritten with the weights (every caller passes a fresh product): one exp per logit and no
    temporaries of s's size, which at the models suite's sizes (b 128, h 128, 16K keys) are the golden's
    cost, not its matmuls.
    returns: p (b, h, s_q, s_k) with rows summing to exp(LSE - LSE'), lse (b, h, s_q) without sink, and
    the row max mx (b, h, s_q) (0 for an empty row): LSE = mx + ln(sum_j exp(s_ij - mx))."""
    np.copyto(s, -np.inf, where=~keep[:, None])
    m = np.max(s, axis=-1, keepdims=True)
    m[~np.isfinite(m)] = 0.0  # a row with no visible key: exp(-inf - 0) = 0 below
    s -= m
    np.exp(s, out=s)
    total = np.sum(s, axis=-1)  # b, h, s_q
    with np.errstate(divide="ignore"):
        lse = m[..., 0] + np.log(total)  # -inf for an empty row
    den = total
    if sink is not None:  # exp(LSE') / exp(m); a +inf sink: den inf, O = 0
        with np.errstate(over="ignore"):
            sk = np.asarray(sink, dtype=np.float64)
            den = total + np.exp((sk[None, :, None] if sk.ndim == 1 else sk) - m[..., 0])
    ok = np.isfinite(den) & (den > 0)  # else weights 0: an empty row without sink, a +inf sink or logit
    s /= np.where(ok, den, 1.0)[..., None]
    if not ok.all():
        s[~ok] = 0.0
    return s, lse, m[..., 0]


def _attend_rows(q: F64, kv: F64, keep: NDArray, scale: float, d_v: int,
                 sink: NDArray | None = None, own: bool = False, absolute: bool = False) -> tuple[F64, F64]:
    """Attention of q (b, s_q, h, d) over per-request rows kv (b, s_k, d) (values kv[..., :d_v]).

    keep: (b, s_q, s_k); rows no query keeps are zeroed before any product (they may be NaN),
    in place when `own` (kv is the caller's fresh gather)
    returns: o (b, s_q, h, d_v), lse (b, h, s_q); absolute: their magnitudes (module docstring)"""
    b, s_q, h, d = q.shape
    if own:
        kv[~keep.any(axis=1)] = 0.0
    else:
        kv = np.where(keep.any(axis=1)[..., None], kv, 0.0)
    qr = q.transpose(0, 2, 1, 3).reshape(b, h * s_q, d)
    s = (qr @ kv.transpose(0, 2, 1)).reshape(b, h, s_q, -1)
    s *= float(scale)
    if absolute == COMPUTE:  # sigma^2 before the softmax overwrites s
        s2 = s * s + d * float(scale) ** 2 * (np.square(qr) @ np.square(kv).transpose(0, 2, 1)).reshape(s.shape)
    p, lse, mx = _softmax(s, keep, sink)  # b, h, s_q, s_k
    values = kv[..., :d_v]
    if absolute == COMPUTE:
        return _compute_terms(p.reshape(b, h * s_q, -1), s2.reshape(b, h * s_q, -1), values, h, s_q)
    if absolute:  # the P V sum in squared form (p is this call's own array)
        np.multiply(p, p, out=p)
        values = values * values
    o = (p.reshape(b, h * s_q, -1) @ values).reshape(b, h, s_q, d_v)
    if absolute:
        return np.sqrt(o).transpose(0, 2, 1, 3), lse_magnitude(mx, lse)
    return o.transpose(0, 2, 1, 3), lse


COMPUTE = "compute"  # `absolute=COMPUTE`: the compute-precision terms (conformance/tolerance.py) instead


def _compute_terms(p: F64, s2: F64, values: F64, h: int, s_q: int) -> tuple[F64, F64]:
    """(O's, the LSE's) compute-precision terms of rows p (B, h s_q, s_k) over values (B, s_k, d_v), sigma^2 s2
    of the logits: sqrt(attention.logit_error_sq) (b, s_q, h, d_v) and sqrt(sum_j P_j^2 sigma_j^2) (b, h, s_q)."""
    b = p.shape[0]
    o = p @ values
    e2 = logit_error_sq(p, s2, values, o).reshape(b, h, s_q, -1)
    return np.sqrt(e2).transpose(0, 2, 1, 3), np.sqrt(np.sum(p * p * s2, axis=-1)).reshape(b, h, s_q)


def _decode_keep(lengths: I64, s_q: int, s_k: int, causal: bool, valid: NDArray) -> NDArray:
    """(b, s_q, s_k) visibility: valid keys, and j <= L - s_q + i when causal."""
    keep = np.broadcast_to(valid[:, None, :], (lengths.size, s_q, s_k))
    if causal and s_q > 1:
        diag = lengths[:, None, None] - s_q + np.arange(s_q)[None, :, None]
        keep = keep & (np.arange(s_k)[None, None, :] <= diag)
    return keep


# --------------------------------------------------------------------------- FlashMLA decode

def decode(q: NDArray, kv_cache: NDArray, block_table: NDArray, seqlens: NDArray, scale: float,
           d_v: int = 512, causal: bool = True, absolute: bool = False) -> tuple[F64, F64]:
    """FlashMLA dense decode in the absorbed form (see the module docstring for the formula).

    q: (b, s_q, h_q, d), d = d_c + d_r (576)
    kv_cache: (num_blocks, page, h_kv, d) (or (num_blocks, page, d): h_kv = 1); values are row[:d_v];
        h_q % h_kv == 0 and query head h reads kv head h // (h_q / h_kv) (FlashMLA's k_cache
        [num_blocks, page, h_kv, 576]); DeepSeek's models have h_kv = 1
    block_table: (b, max_blocks) int; seqlens: (b,) int >= 0, cached tokens incl. the s_q new ones
    scale: softmax scale; d_v: value dims (512); causal: bottom-right, for s_q > 1
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q) natural log; empty rows (0, -inf)
    absolute: their magnitudes instead (module docstring; 0 for an empty row)
    """
    q = np.asarray(q, dtype=np.float64)
    rows, page = _rows(kv_cache, convert=False, heads=True)  # gathered per chunk, then widened: no float64 copy
    b, s_q, h_q, d = q.shape
    h_kv = rows.shape[1]
    if rows.shape[2] != d or not 0 < d_v <= d:
        raise ValueError(f"q dim {d}, cache dim {rows.shape[2]} and d_v {d_v} disagree")
    if h_q % h_kv:
        raise ValueError(f"h_q = {h_q} query heads must be a multiple of the cache's h_kv = {h_kv} kv heads")
    g = h_q // h_kv  # query head h reads kv head h // g
    L = np.asarray(seqlens, dtype=np.int64).reshape(b)
    if (L < 0).any():
        raise ValueError(f"seqlens must be >= 0, got {L.min()}")
    bt = np.asarray(block_table)
    o, lse = np.empty((b, s_q, h_q, d_v)), np.empty((b, h_q, s_q))
    step = max(1, CHUNK // (max(int(L.max(initial=0)), 1) * d * h_kv))

    def chunk(i: int) -> None:  # request chunks bound the gathered rows' memory, not a loop per row
        c = slice(i, i + step)
        n, s_k = len(L[c]), max(int(L[c].max(initial=0)), 1)
        slot, valid = _slots(bt[c], L[c], page, s_k, rows.shape[0])
        keep = _decode_keep(L[c], s_q, s_k, causal, valid)
        # (request, kv head) pairs as the batch: each kv head's g query heads over that head's rows
        qg = q[c].reshape(n, s_q, h_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(n * h_kv, s_q, g, d)
        kv = as_f64(rows[slot]).transpose(0, 2, 1, 3).reshape(n * h_kv, s_k, d)
        og, lg = _attend_rows(qg, kv, np.repeat(keep, h_kv, axis=0), scale, d_v, own=True, absolute=absolute)
        o[c] = og.reshape(n, h_kv, s_q, g, d_v).transpose(0, 2, 1, 3, 4).reshape(n, s_q, h_q, d_v)
        lse[c] = lg.reshape(n, h_q, s_q)

    on_threads(chunk, range(0, b, step))
    return o, lse


def absorb(q_nope: NDArray, w_uk: NDArray) -> F64:
    """q_nope W_UK per head.  q_nope: (..., h, dn); w_uk: (h, dn, d_c) -> (..., h, d_c)"""
    return np.einsum("...hd,hdc->...hc", np.asarray(q_nope, dtype=np.float64), as_f64(w_uk))


def unabsorb(o_latent: NDArray, w_uv: NDArray) -> F64:
    """o_latent W_UV^T per head.  o_latent: (..., h, d_c); w_uv: (h, dv, d_c) -> (..., h, dv)"""
    return np.einsum("...hc,hdc->...hd", np.asarray(o_latent, dtype=np.float64), as_f64(w_uv))


def decode_naive(q_nope: NDArray, q_pe: NDArray, kv_cache: NDArray, block_table: NDArray, seqlens: NDArray,
                 w_uk: NDArray, w_uv: NDArray, scale: float, causal: bool = True) -> tuple[F64, F64]:
    """The same attention, decompressed: per-head keys [c W_UK^T ; k_pe], values c W_UV^T.

    q_nope: (b, s_q, h, dn) (128); q_pe: (b, s_q, h, d_r) (64)
    kv_cache, block_table, seqlens, scale, causal: as `decode`; the cache row is [c (d_c) ; k_pe (d_r)]
    w_uk: (h, dn, d_c); w_uv: (h, dv, d_c) (DeepSeek's wkv_b.view(h, dn + dv, d_c) split)
    returns: o (b, s_q, h, dv), lse (b, h, s_q)
    """
    qn, qp = np.asarray(q_nope, dtype=np.float64), np.asarray(q_pe, dtype=np.float64)
    wk, wv = as_f64(w_uk), as_f64(w_uv)
    rows, page = _rows(kv_cache)
    b, s_q, h, dn = qn.shape
    d_c = rows.shape[1] - qp.shape[-1]
    if wk.shape != (h, dn, d_c) or wv.shape[::2] != (h, d_c):
        raise ValueError(f"w_uk {wk.shape} / w_uv {wv.shape} do not fit h={h}, dn={dn}, d_c={d_c}")
    L = np.asarray(seqlens, dtype=np.int64).reshape(b)
    s_k = max(int(L.max(initial=0)), 1)
    slot, valid = _slots(block_table, L, page, s_k, rows.shape[0])
    keep = _decode_keep(L, s_q, s_k, causal, valid)
    kv = np.where(keep.any(axis=1)[..., None], rows[slot], 0.0)  # b, s_k, d
    c, k_pe = kv[..., :d_c], kv[..., d_c:]
    k_nope = np.einsum("bkc,hdc->bhkd", c, wk)  # b, h, s_k, dn
    v = np.einsum("bkc,hdc->bhkd", c, wv)  # b, h, s_k, dv
    s = qn.transpose(0, 2, 1, 3) @ k_nope.transpose(0, 1, 3, 2)  # b, h, s_q, s_k
    s = s + np.einsum("bqhr,bkr->bhqk", qp, k_pe)
    p, lse, _ = _softmax(float(scale) * s, keep, None)
    return (p @ v).transpose(0, 2, 1, 3), lse


def decode_sparse(q: NDArray, kv_cache: NDArray, indices: NDArray, topk_length: NDArray | None, scale: float,
                  d_v: int = 512, *, attn_sink: NDArray | None = None, absolute: bool = False) -> tuple[F64, F64]:
    """FlashMLA sparse decode: each query row attends to the cache slots its indices list.

    q: (b, s_q, h_q, d); kv_cache: (num_blocks, page, h_kv, d) (or (num_blocks, page, d): h_kv = 1),
        viewed as (num_blocks * page, h_kv, d); the dequantized rows (FlashMLA's sparse decode stores
        656-byte FP8 rows: adapters dequantize)
    indices: (b, s_q, h_kv, topk) int (FlashMLA's; or (b, s_q, topk) when h_kv = 1), slot = block_idx * page
        + offset; -1 = padding. Query head h reads kv head k = h // (h_q / h_kv): k's own list
        indices[:, :, k] over k's rows of the slots (h_q % h_kv == 0; DeepSeek's models have h_kv = 1)
    topk_length: (b,) int or None; only the first topk_length[b] entries of request b's lists are used
    attn_sink: (h_q,) or None (see the module docstring)
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q) (without the sink); a row with no used index (0, -inf)
    A slot listed twice counts twice (its weight doubles). Used indices outside [0, num_slots) raise.
    absolute: their magnitudes instead (module docstring; a slot listed twice is two terms)
    """
    q = np.asarray(q, dtype=np.float64)
    rows, _ = _rows(kv_cache, heads=True)  # slots, h_kv, d
    b, s_q, h, d = q.shape
    h_kv = rows.shape[1]
    if rows.shape[2] != d or not 0 < d_v <= d:
        raise ValueError(f"q dim {d}, cache dim {rows.shape[2]} and d_v {d_v} disagree")
    if h % h_kv:
        raise ValueError(f"h_q = {h} query heads must be a multiple of the cache's h_kv = {h_kv} kv heads")
    g = h // h_kv  # query head h reads kv head h // g
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim == 3:
        idx = idx[:, :, None]
    if idx.ndim != 4 or idx.shape[:3] != (b, s_q, h_kv):
        raise ValueError(f"indices {idx.shape} must be (b, s_q, h_kv, topk) = ({b}, {s_q}, {h_kv}, topk)")
    used = idx != -1  # b, s_q, h_kv, topk
    if topk_length is not None:
        used &= np.arange(idx.shape[-1]) < np.asarray(topk_length, dtype=np.int64).reshape(b, 1, 1, 1)
    if ((idx[used] < 0) | (idx[used] >= rows.shape[0])).any():
        raise ValueError(f"indices outside the cache's {rows.shape[0]} slots (and not -1)")
    kv = rows[np.where(used, idx, 0), np.arange(h_kv)[:, None]]  # b, s_q, h_kv, topk, d: kv head k's rows
    kv = np.where(used[..., None], kv, 0.0)
    # (request, kv head) pairs as the batch: kv head k's g query heads over its own list and rows
    kv = kv.transpose(0, 2, 1, 3, 4).reshape(b * h_kv, s_q, -1, d)
    keep = used.transpose(0, 2, 1, 3).reshape(b * h_kv, s_q, -1)
    qg = q.reshape(b, s_q, h_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b * h_kv, s_q, g, d)
    sink = attn_sink
    if sink is not None and h_kv > 1:  # (h_q,) per head: (b h_kv, g, 1), as the pairs
        sink = np.broadcast_to(np.asarray(sink, dtype=np.float64).reshape(1, h_kv, g, 1), (b, h_kv, g, 1))
        sink = sink.reshape(b * h_kv, g, 1)
    s = np.einsum("bqhd,bqkd->bhqk", qg, kv)
    if absolute == COMPUTE:  # sigma^2 of the scaled logits
        s2 = float(scale) ** 2 * (s * s + d * np.einsum("bqhd,bqkd->bhqk", qg * qg, kv * kv))
    p, lse, mx = _softmax(float(scale) * s, keep, sink)

    def heads(og: F64, lg: F64) -> tuple[F64, F64]:
        return (og.reshape(b, h_kv, s_q, g, d_v).transpose(0, 2, 1, 3, 4).reshape(b, s_q, h, d_v),
                lg.reshape(b, h, s_q))

    if absolute == COMPUTE:
        pr, vv = p.transpose(0, 2, 1, 3), kv[..., :d_v]  # B, s_q, g, k: each query row over its own list
        e2 = logit_error_sq(pr, s2.transpose(0, 2, 1, 3), vv, pr @ vv)  # B, s_q, g, d_v
        return heads(np.sqrt(e2), np.sqrt(np.sum(p * p * s2, axis=-1)))
    if absolute:  # the P V sum in squared form
        np.multiply(p, p, out=p)
        return heads(np.sqrt(np.einsum("bhqk,bqkd->bqhd", p, kv[..., :d_v] ** 2)), lse_magnitude(mx, lse))
    return heads(np.einsum("bhqk,bqkd->bqhd", p, kv[..., :d_v]), lse)


# --------------------------------------------------------------------------- MAX fused FP8 branch

def _sparse_list(d_indices: NDArray, stride: int, topk: int, topk_lengths: NDArray, T: int, n_slots: int,
                 what: str = "") -> tuple[I64, NDArray]:
    """(idx (T, topk), used (T, topk)) of a sparse index list: token t's entries d_indices[t * stride:][:topk],
    used where k < topk_lengths[t] and the entry is not -1 (checked inside [0, n_slots))."""
    if topk_lengths is None or not 0 < topk <= stride:
        raise ValueError(f"sparse mode needs {what}topk_lengths and 0 < topk ({topk}) <= indices_stride ({stride})")
    flat = np.asarray(d_indices, dtype=np.int64).reshape(-1)
    if flat.size < T * stride:
        raise ValueError(f"{what}d_indices holds {flat.size} entries, T x indices_stride = {T * stride} needed")
    idx = flat[:T * stride].reshape(T, stride)[:, :topk]
    kl = np.asarray(topk_lengths, dtype=np.int64).reshape(T)
    if ((kl < 0) | (kl > topk)).any():
        raise ValueError(f"{what}topk_lengths must lie in [0, topk = {topk}]")
    used = (idx != -1) & (np.arange(topk)[None, :] < kl[:, None])  # T, topk
    if ((idx[used] < 0) | (idx[used] >= n_slots)).any():
        raise ValueError(f"used {what}d_indices outside the cache's {n_slots} slots (and not -1)")
    return idx, used


def dequantize_latent_rows(codes: NDArray, scales: NDArray, d_c: int = 512, tile: int = 128) -> F64:
    """Rows of an FP8 latent cache, float64 (exact): codes (..., d_c + d_r) e4m3 times their row's scales
    (..., d_c / tile + 1) float32: one per `tile` latent channels, the last for the rope part."""
    c = as_f64(codes)
    widths = [tile] * (d_c // tile) + [c.shape[-1] - d_c]
    return c * np.repeat(np.asarray(scales, dtype=np.float64), widths, axis=-1)


def _sparse_latent(q: F64, rows: F64, d_indices: NDArray, stride: int, topk: int, topk_lengths: NDArray,
                   scale: float, d_c: int, sink: NDArray | None, extra: tuple | None = None) -> F64:
    """o_latent (T, H, d_c) of MAX's sparse mode: token t of q (T, H, d) over rows[slot] for its used slots
    (d_indices[t * stride + k], k < topk_lengths[t], != -1); sink (H,), (T, 1, 1) (per token) or None.
    extra: (extra_rows (n, d) float64 dequantized, extra_d_indices, extra_topk_lengths): the second cache's used
    slots join the keys (same stride and topk), one softmax over both lists."""
    T = q.shape[0]
    idx, used = _sparse_list(d_indices, stride, topk, topk_lengths, T, rows.shape[0])
    kv = np.where(used[..., None], rows[np.where(used, idx, 0)], 0.0)  # T, topk, d: unused rows never read
    if extra is not None:
        e_rows, e_idx, e_len = extra
        e_idx, e_used = _sparse_list(e_idx, stride, topk, e_len, T, e_rows.shape[0], "extra_")
        kv = np.concatenate([kv, np.where(e_used[..., None], e_rows[np.where(e_used, e_idx, 0)], 0.0)], axis=1)
        used = np.concatenate([used, e_used], axis=1)
    s = np.einsum("thd,tkd->thk", q, kv)[:, :, None] * float(scale)  # T, H, 1, keys
    p, _, _ = _softmax(s, used[:, None], sink)
    return np.einsum("thk,tkc->thc", p[:, :, 0], kv[..., :d_c])


def decode_fused_fp8(q: NDArray, input_row_offsets: NDArray, freqs_cis: NDArray, gamma: NDArray, epsilon: float,
                     w_uk: NDArray, w_uk_scale: NDArray, w_uv: NDArray, w_uv_scale: NDArray,
                     kv_cache: NDArray, block_table: NDArray, cache_lengths: NDArray, scale: float, *,
                     attn_sink: NDArray | None = None, causal: bool = True,
                     granularity: tuple[int, int, int] = (1, 128, 128),
                     scale_ub: float = 1200.0, absolute: bool = False, q_inplace: bool = False,
                     sink_per: str = "head", d_indices: NDArray | None = None, indices_stride: int = 0,
                     topk: int = 0, topk_lengths: NDArray | None = None, extra_k: NDArray | None = None,
                     extra_scales: NDArray | None = None, extra_d_indices: NDArray | None = None,
                     extra_topk_lengths: NDArray | None = None, fp8: str = "e4m3",
                     scale_dtype: str = "fp32") -> tuple[F64, F64] | tuple[F64, F64, F64]:
    """MAX's `mla_decode_branch_fp8` (modular/modular max/kernels/src/nn/attention/gpu/mla_graph.mojo).

    q: (T, H, dn + d_r) ragged new tokens, dn = 128 (q_nope), d_r = 64 (q_rope)
    input_row_offsets: (b + 1,) int, request r's tokens are q[off[r]:off[r+1]], n_r = off[r+1] - off[r]
    freqs_cis: (max_seq_len, d_r), row p = [cos p w_0, sin p w_0, cos p w_1, ...] (interleaved)
    gamma: (d_c,) RMSNorm weight (kv_a_proj_layernorm); epsilon: RMSNorm eps
    w_uk: (H, d_c, dn) e4m3; w_uk_scale: (H, d_c / n_g, dn / k_g) (or flattened (H d_c / n_g, dn / k_g))
    w_uv: (H, dv, d_c) e4m3; w_uv_scale: (H, dv / n_g, d_c / k_g) (or flattened)
    kv_cache: (num_blocks, page, d_c + d_r) (or (num_blocks, page, 1, d)), MAX's per-layer latent cache
    block_table: (b, max_blocks) int (MAX's lookup table); cache_lengths: (b,) tokens cached before
        this step (MAX's cache_length); request r's new token t sits at position p = cache_lengths[r] + t
    scale: softmax scale; attn_sink: (H,) or None; causal: key j visible to position p iff j <= p
    sink_per: "head" (attn_sink (H,), one sink per query head) or "batch" (attn_sink (b,): request r's sink,
        shared by all its heads and tokens: MAX's per-batch attention sink)
    granularity: (m, n, k) scale granularity (1, 128, 128); scale_ub: activation amax bound (1200)
    fp8, scale_dtype: MAX's fp8_dtype / fp8_scale_dtype, "e4m3" (float8_e4m3fn) or "e5m2" and "fp32" or "bf16":
        w_uk / w_uv hold codes of that format and scales of that dtype (read as stored), and both
        activations are quantized to them (mla_fp8.quantize_act: a bf16 scale is rounded before its
        reciprocal is taken, so the codes are those of the stored scale)
    d_indices, indices_stride, topk, topk_lengths: MAX's sparse mode (sparse_mla), None for dense.
        d_indices: (>= T * indices_stride,) int, new token t's list at d_indices[t * indices_stride:][:topk],
        flat cache slots block * page + offset (FlashMLA's sparse convention); topk_lengths: (T,) int,
        token t uses its first topk_lengths[t] <= topk <= indices_stride entries, -1 among them padding.
        Step 3 then attends token t over exactly its used slots of the updated cache (no causal mask, no
        block table: the indices choose the keys, a slot listed twice counts twice, as decode_sparse);
        a token with no used slot gets o_latent = 0 (with or without sink), so out = 0.
    extra_k, extra_scales, extra_d_indices, extra_topk_lengths: MAX's second cache of the sparse mode, None
        for none. extra_k: (num_blocks', page, [1,] d) e4m3 codes, extra_scales: (num_blocks' * page,
        d_c / 128 + 1) float32 (`dequantize_latent_rows`: a scale per 128 latent channels, one for the
        rope part, per row); token t's extra list at extra_d_indices[t * indices_stride:][:topk] with
        extra_topk_lengths[t], flat slots of extra_k as d_indices of kv_cache. Its used rows (never written)
        join the main list's keys: one softmax over both, values their first d_c dims.
    returns: out (T, H, dv) float64, cache_after (kv_cache's shape) float64
    absolute: out's magnitudes instead of out, sqrt(sum_c a_c^2 w_nc^2) over step 4's dequantized FP8
    terms (the activation codes of the exact o_latent); cache_after is returned as it is (no model)
    q_inplace: also return q_after (T, H, dn + d_r): q with its rope part rotated at its token's
        position, as MAX's fused_qk_rope leaves q (in place), the nope part unchanged; with
        `absolute`, its magnitudes (mla_fp8.rope_interleaved's model; |q| for the nope part)

    Order, as the kernel runs it:
    1. q_lat = bmm_fp8(q_nope, w_uk): q_nope quantized per (head, token, 128 channels)
       (`mla_fp8.quantize_act`), then the blockwise FP8 batched matmul (transpose_b).
    2. RoPE of q_rope at position p, and in the cache, on the rows of the new tokens only (slot of
       position p of request r): rope part row[d_c:] <- RoPE(row[d_c:], freqs_cis[p]); latent
       row[:d_c] <- RMSNorm(row[:d_c]) * gamma. The rows must hold the raw kv_a_proj output (MAX's
       in-place `fused_rope_rmsnorm_kernel` reads them back); every other row is left untouched
       (NaN stays NaN); earlier tokens' rows are taken as already normalised and rotated.
    3. Attention of [q_lat ; RoPE(q_rope)] (576) over the updated cache, keys j < cache_lengths[r] + n_r
       (causal: j <= p), values row[:d_c]; sink as FlashMLA (module docstring).
    4. out = bmm_fp8(o_latent, w_uv): o_latent quantized per (head, token, 128 channels).
    MAX routes a batch here when every request has at most MLA_DECODE_MAX_SEQ_LEN new tokens (1 in
    2025 releases, 4 or 6 in 2026 ones, for MTP verification); the golden takes any n_r >= 0.
    Not modelled (float64 golden): MAX stores q_lat, the roped q, the attention output and the
    cache in bf16, and its RMSNorm casts x / rms to bf16 before the gamma product; activations are
    quantized here from the float64 values (through float32), in MAX from those bf16 values.
    Newer MAX (2026, `mla_fused_rope_rmsnorm_quantization`) reads the new tokens' latent from a
    separate kv input instead of the cache; the cache_after is the same.
    """
    q = np.asarray(q, dtype=np.float64)
    off = np.asarray(input_row_offsets, dtype=np.int64)
    T, H, dq = q.shape
    f = np.asarray(freqs_cis, dtype=np.float64)
    d_r = f.shape[1]
    dn = dq - d_r
    rows, page = _rows(kv_cache)
    d_c = rows.shape[1] - d_r
    n = np.diff(off)
    b = n.size
    if off[0] != 0 or off[-1] != T or (n < 0).any():
        raise ValueError(f"input_row_offsets {off.tolist()} must rise from 0 to T = {T}")
    cl = np.asarray(cache_lengths, dtype=np.int64).reshape(b)
    L = cl + n  # keys per request after this step
    req = np.repeat(np.arange(b), n)  # T: request of each new token
    pos = cl[req] + np.arange(T) - off[req]  # T: its position
    if T and pos.max() >= f.shape[0]:
        raise ValueError(f"freqs_cis has {f.shape[0]} positions, tokens reach {pos.max()}")
    s_k = max(int(L.max(initial=0)), 1)
    slot, valid = _slots(block_table, L, page, s_k, rows.shape[0])
    new = slot[req, pos]  # T: cache slot of each new token
    if np.unique(new).size != T:
        raise ValueError("two new tokens map to the same cache slot")
    kg = granularity[2]
    q_after = np.concatenate([np.abs(q[..., :dn]) if absolute else q[..., :dn],
                              rope_interleaved(q[..., dn:], f[pos][:, None], absolute=absolute)], axis=-1)
    if T == 0:
        empty = np.zeros((0, H, np.shape(w_uv)[1])), rows.reshape(np.shape(kv_cache)).copy()
        return (*empty, q_after) if q_inplace else empty
    q_lat = bmm_fp8(q[..., :dn].transpose(1, 0, 2), w_uk,
                    np.reshape(np.asarray(w_uk_scale, dtype=np.float32), (H, -1, -(-dn // kg))), granularity,
                    scale_ub, fp8=fp8, scale_dtype=scale_dtype)  # H, T, d_c
    q_full = np.concatenate([q_lat.transpose(1, 0, 2), rope_interleaved(q[..., dn:], f[pos][:, None])], axis=-1)
    after = rows.copy()
    after[new, :d_c] = rms_norm(rows[new, :d_c], gamma, epsilon)
    after[new, d_c:] = rope_interleaved(rows[new, d_c:], f[pos])
    n_max = max(int(n.max(initial=0)), 1)
    ok = np.arange(n_max)[None, :] < n[:, None]  # b, n_max: padded query slots in use
    q_pad = q_full[np.where(ok, off[:-1, None] + np.arange(n_max), 0)]  # b, n_max, H, d
    keep = ok[:, :, None] & valid[:, None, :]
    if causal:
        keep &= np.arange(s_k)[None, None, :] <= cl[:, None, None] + np.arange(n_max)[None, :, None]
    sink = attn_sink
    if sink is not None:
        want = {"head": (H,), "batch": (b,)}.get(sink_per)
        if want is None or np.shape(sink) != want:
            raise ValueError(f"attn_sink of shape {np.shape(sink)} is not sink_per={sink_per!r}'s "
                             f"({H},) per head or ({b},) per request")
        sink = np.asarray(sink, dtype=np.float64).reshape(-1, 1, 1) if sink_per == "batch" else sink
    if d_indices is not None:  # sparse_mla: token t over its own top-k slots
        extra = None
        if extra_k is not None:
            e_rows, _ = _rows(extra_k, convert=False)
            extra = (dequantize_latent_rows(e_rows, np.reshape(extra_scales, (e_rows.shape[0], -1)), d_c),
                     extra_d_indices, extra_topk_lengths)
        o_lat = _sparse_latent(q_full, after, d_indices, indices_stride, topk, topk_lengths, scale, d_c,
                               None if sink is None else (sink[req] if sink_per == "batch" else sink), extra)
    else:
        o_lat, _ = _attend_rows(q_pad, after[slot], keep, scale, d_c, sink)  # b, n_max, H, d_c
        o_lat = o_lat[ok]  # T, H, d_c in token order
    out = bmm_fp8(o_lat.transpose(1, 0, 2), w_uv,
                  np.reshape(np.asarray(w_uv_scale, dtype=np.float32), (H, -1, -(-d_c // kg))), granularity, scale_ub,
                  absolute=absolute, fp8=fp8, scale_dtype=scale_dtype)  # H, T, dv
    if q_inplace:
        return out.transpose(1, 0, 2), after.reshape(np.shape(kv_cache)), q_after
    return out.transpose(1, 0, 2), after.reshape(np.shape(kv_cache))
