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
float64 from q, k, v: it is the exact VJP at the inputs, whatever O and L a kernel is handed.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.attention import _logits, _read_only_kept, kv_head_index, mask

F64 = NDArray[np.float64]


def _group_sum(x: F64, h_kv: int, head_map: str) -> F64:
    """(b, s_k, h_q, e) per-query-head contributions -> (b, s_k, h_kv, e): each kv head's sum over its
    query heads (the GQA reduction)."""
    b, s_k, h_q, e = x.shape
    if head_map == "grouped":
        return x.reshape(b, s_k, h_kv, h_q // h_kv, e).sum(axis=3)
    out = np.zeros((b, s_k, h_kv, e))
    np.add.at(out, (slice(None), slice(None), kv_head_index(h_q, h_kv, head_map)), x)
    return out


def masked_attention_backward(q: NDArray, k: NDArray, v: NDArray, keep: NDArray, do: NDArray,
                              dlse: NDArray | None = None, *, scale: float | None = None, softcap: float = 0.0,
                              sinks: NDArray | None = None, head_map: str = "grouped") -> dict[str, F64]:
    """Gradients of attention under an explicit mask (module docstring).

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v); keep: (b, s_q, s_k) bool
    do: (b, s_q, h_q, d_v) cotangent of O; dlse: (b, h_q, s_q) cotangent of the LSE (with the sink),
    or None (the LSE is not an output)
    sinks: (h_q,) sink logits or None
    returns: {"dq": (b, s_q, h_q, d), "dk": (b, s_k, h_kv, d), "dv": (b, s_k, h_kv, d_v),
              "dsinks": (h_q,) when sinks are given}
    """
    q = np.asarray(q, dtype=np.float64)
    b, s_q, h_q, d = q.shape
    h_kv = np.shape(k)[2]
    kv_idx = kv_head_index(h_q, h_kv, head_map)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k, v = _read_only_kept(k, keep), _read_only_kept(v, keep)
    t = _logits(q, k, keep, scale, softcap, head_map)  # b, h_q, s_q, s_k (-inf where masked)
    m = np.max(t, axis=-1)  # b, h_q, s_q
    live = np.isfinite(m)
    base = np.where(live, m, 0.0)
    tot = np.sum(np.exp(t - base[..., None]), axis=-1)
    with np.errstate(divide="ignore"):
        lse = np.where(live, base + np.log(np.where(live, tot, 1.0)), -np.inf)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64)[None, :, None]
        lse = np.logaddexp(lse, sk)
    norm = np.where(np.isfinite(lse), lse, 0.0)
    p = np.exp(t - norm[..., None])  # b, h_q, s_q, s_k; 0 where masked or the row is empty
    kq = k[:, :, kv_idx, :].transpose(0, 2, 1, 3)  # b, h_q, s_k, d
    vq = v[:, :, kv_idx, :].transpose(0, 2, 1, 3)  # b, h_q, s_k, d_v
    o = p @ vq  # b, h_q, s_q, d_v
    do_h = np.asarray(do, dtype=np.float64).transpose(0, 2, 1, 3)  # b, h_q, s_q, d_v
    dl = np.zeros((b, h_q, s_q)) if dlse is None else np.asarray(dlse, dtype=np.float64)
    dl = np.where(np.isfinite(lse), dl, 0.0)  # a row with no key and no sink: its LSE is -inf, no gradient
    big_d = np.sum(do_h * o, axis=-1)  # b, h_q, s_q
    dp = do_h @ vq.transpose(0, 1, 3, 2)  # b, h_q, s_q, s_k
    dt = p * (dp - big_d[..., None] + dl[..., None])
    if softcap:
        tc = np.where(np.isfinite(t), t, 0.0) / softcap
        dt = dt * (1.0 - tc * tc)
    dq = scale * (dt @ kq)  # b, h_q, s_q, d
    dk_h = scale * (dt.transpose(0, 1, 3, 2) @ q.transpose(0, 2, 1, 3))  # b, h_q, s_k, d
    dv_h = p.transpose(0, 1, 3, 2) @ do_h  # b, h_q, s_k, d_v
    out = {"dq": dq.transpose(0, 2, 1, 3),
           "dk": _group_sum(dk_h.transpose(0, 2, 1, 3), h_kv, head_map),
           "dv": _group_sum(dv_h.transpose(0, 2, 1, 3), h_kv, head_map)}
    if sinks is not None:
        p_sink = np.where(np.isfinite(lse), np.exp(np.asarray(sinks, dtype=np.float64)[None, :, None] - norm), 0.0)
        out["dsinks"] = np.sum(p_sink * (dl - big_d), axis=(0, 2))
    return out


def prefill_backward(q: NDArray, k: NDArray, v: NDArray, do: NDArray, dlse: NDArray | None = None, *,
                     causal: str = "none", window: tuple[int, int] = (-1, -1), q_lens: NDArray | None = None,
                     k_lens: NDArray | None = None, **kw) -> dict[str, F64]:
    """Gradients of dense attention (refimpl.attention.prefill); shapes as `masked_attention_backward`."""
    b, s_q = np.shape(q)[:2]
    s_k = np.shape(k)[1]
    q_lens = np.full(b, s_q) if q_lens is None else np.asarray(q_lens, dtype=np.int64)
    k_lens = np.full(b, s_k) if k_lens is None else np.asarray(k_lens, dtype=np.int64)
    keep = mask(s_q, s_k, q_lens, k_lens, causal, window)
    return masked_attention_backward(q, k, v, keep, do, dlse, **kw)


def varlen_backward(q: NDArray, k: NDArray, v: NDArray, cu_seqlens_q: NDArray, cu_seqlens_k: NDArray,
                    do: NDArray, dlse: NDArray | None = None, **kw) -> dict[str, F64]:
    """Gradients of packed variable-length attention (refimpl.attention.varlen).

    q: (total_q, h_q, d); k: (total_k, h_kv, d); v: (total_k, h_kv, d_v); do: (total_q, h_q, d_v);
    dlse: (h_q, total_q) or None. returns dq (total_q, h_q, d), dk, dv (total_k, h_kv, d | d_v)
    (and dsinks (h_q,))
    """
    from kernel_parity.refimpl.attention import _unpack

    cq, ck = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    s_q, s_k = int(max(lq.max(initial=0), 1)), int(max(lk.max(initial=0), 1))
    q_ok = np.arange(s_q)[None, :] < lq[:, None]
    k_ok = np.arange(s_k)[None, :] < lk[:, None]
    qd, kd, vd, dod = (_unpack(t, cu, ok) for t, cu, ok in ((q, cq, q_ok), (k, ck, k_ok), (v, ck, k_ok),
                                                             (do, cq, q_ok)))
    dl = None
    if dlse is not None:
        dl_rows = _unpack(np.asarray(dlse, dtype=np.float64).T[:, :, None], cq, q_ok)[..., 0]  # b, s_q, h_q
        dl = dl_rows.transpose(0, 2, 1)
    g = prefill_backward(qd, kd, vd, dod, dl, q_lens=lq, k_lens=lk, **kw)
    qf, kf = q_ok.reshape(-1), k_ok.reshape(-1)
    out = {"dq": g["dq"].reshape(-1, *g["dq"].shape[2:])[qf],
           "dk": g["dk"].reshape(-1, *g["dk"].shape[2:])[kf],
           "dv": g["dv"].reshape(-1, *g["dv"].shape[2:])[kf]}
    if "dsinks" in g:
        out["dsinks"] = g["dsinks"]
    return out
