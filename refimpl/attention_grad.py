"""Golden attention backward (VJP) for prefill and varlen, float64, written out by hand.

Forward (refimpl/attention.py), per batch b, query head h, row i, key j:

    s_ij = scale q_i . k_j;   t_ij = cap tanh(s_ij / cap) (softcap) or s_ij;   -inf where masked
    L_i  = ln(sum_j exp(t_ij) + exp(S_h))      the LSE *with* the sink S_h (= the plain LSE without one)
    P_ij = exp(t_ij - L_i);   O_i = sum_j P_ij v_j

The cotangents are dO (of O) and dL (of L, the LSE the forward returns with the sink folded in;
FlashAttention's softmax_lse when there is no sink). FlashAttention-2's decomposition:

    D_i   = sum_c dO_ic O_ic                    (the "preprocessing" row sums)
    dP_ij = dO_i . v_j
    dT_ij = P_ij (dP_ij - D_i + dL_i)           (dL enters because dL_i/dt_ij = P_ij)
    dS_ij = dT_ij (1 - (t_ij / cap)^2)          softcap's derivative (1 - tanh^2); dS = dT without it
    dq_i  = scale sum_j dS_ij k_j
    dk_j  = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dO_i      summed over the query heads of a kv head (GQA)
    dS_h  = sum_i P_sink_i (dL_i - D_i),  P_sink_i = exp(S_h - L_i)      summed over b and i

Conventions: masked (i, j) have P = 0, so keys a row cannot see contribute exactly zero; a fully
masked row (no key, no sink) has P = 0, D = 0 and zero gradients, never NaN; keys past a sequence's
length are never read (they may hold NaN) and get zero gradients. The golden recomputes O and L in
float64 from q, k, v: it is the exact VJP at the inputs, whatever O and L a kernel is handed. With `o`
given, D comes from that O instead (FlashAttention's contract: the backward is handed O, rounded to the
storage dtype): the exact VJP with dL replaced by dL - dO . (O_given - O), which is what a kernel that
reads O computes (a bf16 O shifts D by ~eps_bf16 |dO| |O|, and every dS_ij by P_ij times that).

Memory: the logits of a whole case are b h_q s_q s_k numbers (68 GB in float64 at b 16, s 4096,
32 heads), so both passes run over chunks of (batch x kv head x query heads of its group) whose
logits stay under CHUNK_LOGITS; every quantity is local to one (batch, query head) except dk / dv
(summed over a kv head's query heads) and dsinks (summed over the batch), which the chunks add up.
`forward` is the same forward as refimpl.attention.masked_attention, chunked the same way (the
backward ops' inputs O and L at model sizes).
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.attention import _read_only_kept, _unpack, kv_head_index, mask

F64 = NDArray[np.float64]
CHUNK_LOGITS = 1 << 24  # logits per chunk: ~130 MB per float64 (rows x keys) array, ~1 GB at the peak


def _chunks(b: int, h_kv: int, g: int, s_q: int, s_k: int,
            budget: int = CHUNK_LOGITS) -> Iterator[tuple[slice, slice, slice]]:
    """(batches, kv heads, query heads of each group) blocks covering a case, each with at most
    `budget` logits where one query head alone fits (else one query head per block)."""
    n = max(1, budget // max(1, s_q * s_k))  # query heads per block
    r_step = min(g, n)
    kv_step = max(1, min(h_kv, n // g)) if n >= g else 1
    b_step = max(1, n // (g * h_kv)) if kv_step == h_kv else 1
    for b0 in range(0, b, b_step):
        for k0 in range(0, h_kv, kv_step):
            for r0 in range(0, g, r_step):
                yield (slice(b0, min(b, b0 + b_step)), slice(k0, min(h_kv, k0 + kv_step)),
                       slice(r0, min(g, r0 + r_step)))


def _heads(kv: slice, rows: slice, g: int) -> NDArray[np.int64]:
    """Query heads (grouped order) of kv heads `kv`, rows `rows` of each group: kv-major."""
    return (np.arange(kv.start, kv.stop)[:, None] * g + np.arange(rows.start, rows.stop)[None, :]).reshape(-1)


def _grouped_order(h_q: int, h_kv: int, head_map: str) -> NDArray[np.int64]:
    """Permutation of the query heads that puts them in grouped order (kv head p // g at position p)."""
    return np.argsort(kv_head_index(h_q, h_kv, head_map), kind="stable")


def _block(q: F64, k: F64, keep: NDArray, scale: float, softcap: float, sinks: F64 | None):
    """Logits, LSE (with the sink) and probabilities of one block, its query heads stacked per kv head.

    q: (b, s_q, h_kv, g, d); k: (b, s_k, h_kv, d); keep: (b, s_q, s_k); sinks: (h_kv, g) or None
    returns t (b, h_kv, g, s_q, s_k) (-inf where masked), lse (b, h_kv, g, s_q), p (as t)
    """
    b, s_q, h_kv, g, d = q.shape
    qg = q.transpose(0, 2, 3, 1, 4).reshape(b, h_kv, g * s_q, d)  # the g heads of a kv head: one matmul
    t = (qg @ k.transpose(0, 2, 3, 1)).reshape(b, h_kv, g, s_q, k.shape[1]) * scale  # b, h_kv, g, s_q, s_k
    if softcap:
        t = softcap * np.tanh(t / softcap)
    t = np.where(keep[:, None, None], t, -np.inf)
    m = np.max(t, axis=-1, initial=-np.inf)  # -inf for a row with no key (s_k = 0 too)
    live = np.isfinite(m)
    base = np.where(live, m, 0.0)
    tot = np.sum(np.exp(t - base[..., None]), axis=-1)  # -inf - base: exp gives 0, never -inf - -inf
    with np.errstate(divide="ignore"):
        lse = np.where(live, base + np.log(np.where(live, tot, 1.0)), -np.inf)
    if sinks is not None:
        lse = np.logaddexp(lse, sinks[None, :, :, None])
    p = np.exp(t - np.where(np.isfinite(lse), lse, 0.0)[..., None])  # 0 where masked or the row is empty
    return t, lse, p


def _rows(x: F64) -> F64:
    """(b, h_kv, g, s_q, n) -> (b, h_kv, g s_q, n): a kv head's rows, for one matmul per kv head."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], x.shape[4])


def forward(q: NDArray, k: NDArray, v: NDArray, keep: NDArray, *, scale: float | None = None,
            softcap: float = 0.0, sinks: NDArray | None = None, head_map: str = "grouped",
            budget: int = CHUNK_LOGITS) -> tuple[F64, F64]:
    """O and the LSE with the sink folded in, in bounded memory (the backward ops' forward outputs).

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v); keep: (b, s_q, s_k) bool
    returns o (b, s_q, h_q, d_v), lse (b, h_q, s_q) (= refimpl.attention.masked_attention's o, lse_sink)
    """
    q, k, v, keep, scale, order, g = _prepare(q, k, v, keep, scale, head_map)
    b, s_q, h_q, _ = q.shape
    s_k, h_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    sk = None if sinks is None else np.asarray(sinks, dtype=np.float64)[order]
    o = np.zeros((b, s_q, h_q, d_v))
    lse = np.zeros((b, h_q, s_q))
    for bs, kv, rows in _chunks(b, h_kv, g, s_q, s_k, budget):
        heads = _heads(kv, rows, g)
        gr = rows.stop - rows.start
        qb = q[bs][:, :, heads].reshape(-1, s_q, kv.stop - kv.start, gr, q.shape[3])
        sb = None if sk is None else sk[heads].reshape(-1, gr)
        _, lb, pb = _block(qb, k[bs, :, kv], keep[bs], scale, softcap, sb)
        ob = (_rows(pb) @ v[bs, :, kv].transpose(0, 2, 1, 3)).reshape(*pb.shape[:4], d_v)  # b, h_kv, g, s_q, d_v
        o[bs, :, heads] = ob.transpose(0, 3, 1, 2, 4).reshape(ob.shape[0], s_q, -1, d_v)
        lse[bs, heads] = lb.reshape(lb.shape[0], -1, s_q)
    return _unorder(o, order, axis=2), _unorder(lse, order, axis=1)


def _prepare(q, k, v, keep, scale, head_map):
    """float64 q (heads in grouped order), k and v with unread keys zeroed, the scale, the order, g."""
    q = np.asarray(q, dtype=np.float64)
    h_q, d = q.shape[2], q.shape[3]
    h_kv = np.shape(k)[2]
    order = _grouped_order(h_q, h_kv, head_map)  # validates h_q % h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    keep = np.asarray(keep, dtype=bool)
    return q[:, :, order], _read_only_kept(k, keep), _read_only_kept(v, keep), keep, scale, order, h_q // h_kv


def _unorder(x: F64, order: NDArray[np.int64], axis: int) -> F64:
    """Undo the grouped reordering of the query heads along `axis`."""
    out = np.empty_like(x)
    idx = [slice(None)] * x.ndim
    idx[axis] = order
    out[tuple(idx)] = x
    return out


def masked_attention_backward(q: NDArray, k: NDArray, v: NDArray, keep: NDArray, do: NDArray,
                              dlse: NDArray | None = None, *, o: NDArray | None = None, scale: float | None = None,
                              softcap: float = 0.0, sinks: NDArray | None = None, head_map: str = "grouped",
                              budget: int = CHUNK_LOGITS, absolute: bool = False) -> dict[str, F64]:
    """Gradients of attention under an explicit mask (module docstring).

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v); keep: (b, s_q, s_k) bool
    do: (b, s_q, h_q, d_v) cotangent of O; dlse: (b, h_q, s_q) cotangent of the LSE (with the sink),
    or None (the LSE is not an output)
    o: (b, s_q, h_q, d_v) the forward output D_i = dO_i . O_i is computed from (FlashAttention's contract:
    the backward is handed O, e.g. rounded to the test dtype), or None: the exact O, recomputed here
    (then the result is the exact VJP at q, k, v)
    sinks: (h_q,) sink logits or None; budget: logits per chunk (memory bound, module docstring)
    returns: {"dq": (b, s_q, h_q, d), "dk": (b, s_k, h_kv, d), "dv": (b, s_k, h_kv, d_v),
              "dsinks": (h_q,) when sinks are given}
    absolute: the error model's magnitudes instead (conformance/tolerance.py): per element, the root-sum-square
    of the magnitudes of the terms the golden sums, i.e. this computation in squared form, P from the true
    logits: inputs (q, k, v, dO, O, dL) squared, P -> P^2, scale -> scale^2, the softcap factor squared,
    every sum a sum of those squares, the square root taken at the end:
        m_D,i^2 = sum_c dO_ic^2 O_ic^2,   m_dP,ij^2 = sum_c dO_ic^2 v_jc^2
        m_dT,ij^2 = P_ij^2 (m_dP,ij^2 + m_D,i^2 + dL_i^2) (1 - (t_ij / cap)^2)^2
        dq_ic^2 = scale^2 sum_j m_dT,ij^2 k_jc^2,   dk_jc^2 = scale^2 sum_i m_dT,ij^2 q_ic^2,
        dv_jc^2 = sum_i P_ij^2 dO_ic^2,   dsinks_h^2 = sum_i P_sink,i^2 (dL_i^2 + m_D,i^2)
    (O is the given O, or the recomputed one, an input either way). The standard deviation of the
    independent roundings of the terms: a sum of K random-sign terms has E (sum t)^2 = sum t^2, so dv's
    magnitude is about its own size (cond 1.3-1.4 on the ci cases); where dP - D + dL cancels (one key and
    a sink: every term ~100x the result) it stays that of the terms (issue 31: cond ~1.1e4 on its case).
    dS = P (dP - D) cancels on any input (D is the P-weighted mean of dP): dq and dk of rows with few keys
    keep cond > 2 (median 2.8 on the ci cases' normal inputs; a one-key row's dS is exactly 0).
    """
    sign = 1.0 if absolute else -1.0  # the squared form adds every term's square
    q, k, v, keep, scale, order, g = _prepare(q, k, v, keep, scale, head_map)
    b, s_q, h_q, d = q.shape
    s_k, h_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    sq = _square if absolute else _same
    do = sq(np.asarray(do, dtype=np.float64)[:, :, order])
    o_given = None if o is None else sq(np.asarray(o, dtype=np.float64)[:, :, order])
    dl_all = None if dlse is None else sq(np.asarray(dlse, dtype=np.float64)[:, order])
    sk = None if sinks is None else np.asarray(sinks, dtype=np.float64)[order]
    dq = np.zeros_like(q)
    dk, dv = np.zeros((b, s_k, h_kv, d)), np.zeros((b, s_k, h_kv, d_v))
    dsinks = np.zeros(h_q)
    c = scale * scale if absolute else scale
    for bs, kv, rows in _chunks(b, h_kv, g, s_q, s_k, budget):
        heads = _heads(kv, rows, g)
        nk, gr = kv.stop - kv.start, rows.stop - rows.start
        qb = q[bs][:, :, heads].reshape(-1, s_q, nk, gr, d)
        kb, vb = k[bs, :, kv], v[bs, :, kv]  # b, s_k, nk, d | d_v
        sb = None if sk is None else sk[heads].reshape(nk, gr)
        t, lse, p = _block(qb, kb, keep[bs], scale, softcap, sb)  # b, nk, gr, s_q, s_k
        do_b = do[bs][:, :, heads].reshape(-1, s_q, nk, gr, d_v).transpose(0, 2, 3, 1, 4)  # b, nk, gr, s_q, d_v
        kt, vt = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)  # b, nk, s_k, d | d_v
        if o_given is None:
            o_b = sq((_rows(p) @ vt).reshape(do_b.shape))  # the exact O (signed P and v), then squared
        else:
            o_b = o_given[bs][:, :, heads].reshape(-1, s_q, nk, gr, d_v).transpose(0, 2, 3, 1, 4)
        kt, vt = sq(kt), sq(vt)
        if absolute:
            np.multiply(p, p, out=p)  # P^2 in place: no second logits-sized array
        dl = np.zeros(lse.shape) if dl_all is None else dl_all[bs][:, heads].reshape(lse.shape)
        dl = np.where(np.isfinite(lse), dl, 0.0)  # a row with no key and no sink: its LSE is -inf, no gradient
        big_d = np.sum(do_b * o_b, axis=-1)  # b, nk, gr, s_q
        dp = (_rows(do_b) @ vt.transpose(0, 1, 3, 2)).reshape(p.shape)  # b, nk, gr, s_q, s_k
        dt = p * (dp + sign * big_d[..., None] + dl[..., None])
        if softcap:
            tc = np.where(np.isfinite(t), t, 0.0) / softcap
            dt = dt * sq(1.0 - tc * tc)
        dq_b = c * (_rows(dt) @ kt).reshape(*dt.shape[:4], d)  # b, nk, gr, s_q, d
        dq[bs, :, heads] = dq_b.transpose(0, 3, 1, 2, 4).reshape(dq_b.shape[0], s_q, -1, d)
        # dk, dv: each kv head's sum over its query heads' rows (the GQA reduction) in one matmul
        qr = sq(_rows(qb.transpose(0, 2, 3, 1, 4)))  # b, nk, gr s_q, d
        dk[bs, :, kv] += c * (_rows(dt).transpose(0, 1, 3, 2) @ qr).transpose(0, 2, 1, 3)
        dv[bs, :, kv] += (_rows(p).transpose(0, 1, 3, 2) @ _rows(do_b)).transpose(0, 2, 1, 3)
        if sb is not None:
            p_sink = np.where(np.isfinite(lse), np.exp(sb[None, :, :, None] - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
            dsinks[heads] += np.sum(sq(p_sink) * (dl + sign * big_d), axis=(0, 3)).reshape(-1)
    out = {"dq": _unorder(dq, order, axis=2), "dk": dk, "dv": dv}
    if sinks is not None:
        out["dsinks"] = _unorder(dsinks, order, axis=0)
    return {n: np.sqrt(x) for n, x in out.items()} if absolute else out


def _square(x: F64) -> F64:
    return x * x


def _same(x: F64) -> F64:
    return x


def prefill_backward(q: NDArray, k: NDArray, v: NDArray, do: NDArray, dlse: NDArray | None = None, *,
                     causal: str = "none", window: tuple[int, int] = (-1, -1), q_lens: NDArray | None = None,
                     k_lens: NDArray | None = None, **kw) -> dict[str, F64]:
    """Gradients of dense attention (refimpl.attention.prefill); shapes as `masked_attention_backward`."""
    return masked_attention_backward(q, k, v, _prefill_keep(q, k, causal, window, q_lens, k_lens), do, dlse, **kw)


def _prefill_keep(q, k, causal, window, q_lens, k_lens) -> NDArray:
    b, s_q = np.shape(q)[:2]
    s_k = np.shape(k)[1]
    q_lens = np.full(b, s_q) if q_lens is None else np.asarray(q_lens, dtype=np.int64)
    k_lens = np.full(b, s_k) if k_lens is None else np.asarray(k_lens, dtype=np.int64)
    return mask(s_q, s_k, q_lens, k_lens, causal, window)


def prefill_forward(q: NDArray, k: NDArray, v: NDArray, *, causal: str = "none", window: tuple[int, int] = (-1, -1),
                    q_lens: NDArray | None = None, k_lens: NDArray | None = None, **kw) -> tuple[F64, F64]:
    """(o, lse with the sink) of refimpl.attention.prefill, in bounded memory (`forward`)."""
    return forward(q, k, v, _prefill_keep(q, k, causal, window, q_lens, k_lens), **kw)


def _padded(q, k, v, cu_seqlens_q, cu_seqlens_k, extra_q=()):
    """Packed rows -> padded (b, s, h, d) per sequence: q, k, v (and extra (total_q, h, e) tensors
    aligned with q), the lengths and the row masks."""
    cq, ck = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    s_q, s_k = int(max(lq.max(initial=0), 1)), int(max(lk.max(initial=0), 1))
    q_ok = np.arange(s_q)[None, :] < lq[:, None]
    k_ok = np.arange(s_k)[None, :] < lk[:, None]
    qd = [_unpack(t, cq, q_ok) for t in (q, *extra_q)]
    kd, vd = _unpack(k, ck, k_ok), _unpack(v, ck, k_ok)
    return qd, kd, vd, lq, lk, q_ok, k_ok


def varlen_forward(q: NDArray, k: NDArray, v: NDArray, cu_seqlens_q: NDArray, cu_seqlens_k: NDArray,
                   **kw) -> tuple[F64, F64]:
    """(o (total_q, h_q, d_v), lse with the sink (h_q, total_q)) of refimpl.attention.varlen, chunked."""
    (qd,), kd, vd, lq, lk, q_ok, _ = _padded(q, k, v, cu_seqlens_q, cu_seqlens_k)
    o, lse = prefill_forward(qd, kd, vd, q_lens=lq, k_lens=lk, **kw)
    flat = q_ok.reshape(-1)
    return o.reshape(-1, *o.shape[2:])[flat], lse.transpose(0, 2, 1).reshape(flat.size, -1)[flat].T


def varlen_backward(q: NDArray, k: NDArray, v: NDArray, cu_seqlens_q: NDArray, cu_seqlens_k: NDArray,
                    do: NDArray, dlse: NDArray | None = None, *, o: NDArray | None = None, **kw) -> dict[str, F64]:
    """Gradients of packed variable-length attention (refimpl.attention.varlen).

    q: (total_q, h_q, d); k: (total_k, h_kv, d); v: (total_k, h_kv, d_v); do: (total_q, h_q, d_v);
    dlse: (h_q, total_q) or None; o: (total_q, h_q, d_v) or None, as `masked_attention_backward`.
    returns dq (total_q, h_q, d), dk, dv (total_k, h_kv, d | d_v) (and dsinks (h_q,))
    """
    extra = (do,) + (() if o is None else (o,))  # tensors packed like q: unpacked with it
    if dlse is not None:
        extra += (np.asarray(dlse, dtype=np.float64).T[:, :, None],)
    (qd, dod, *rest), kd, vd, lq, lk, q_ok, k_ok = _padded(q, k, v, cu_seqlens_q, cu_seqlens_k, extra)
    od = rest.pop(0) if o is not None else None
    dl = rest[0][..., 0].transpose(0, 2, 1) if rest else None  # b, h_q, s_q
    g = prefill_backward(qd, kd, vd, dod, dl, o=od, q_lens=lq, k_lens=lk, **kw)
    qf, kf = q_ok.reshape(-1), k_ok.reshape(-1)
    out = {"dq": g["dq"].reshape(-1, *g["dq"].shape[2:])[qf],
           "dk": g["dk"].reshape(-1, *g["dk"].shape[2:])[kf],
           "dv": g["dv"].reshape(-1, *g["dv"].shape[2:])[kf]}
    if "dsinks" in g:
        out["dsinks"] = g["dsinks"]
    return out
