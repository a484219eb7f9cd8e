"""Attention backward (dense prefill and packed varlen), FlashAttention-2 style, in Triton.

    Delta_i = sum_c dO_ic O_ic - dL_i                  preprocessing; dL the LSE's cotangent (or 0)
    P_ij    = exp(t_ij - L_i)                          t the (softcapped, masked) logits, L the forward's
                                                       LSE with the sink folded in
    dS_ij   = P_ij (dO_i . v_j - Delta_i) (1 - tanh^2) the last factor with a softcap (t = cap tanh(s / cap))
    dq_i    = scale sum_j dS_ij k_j;   dk_j = scale sum_i dS_ij q_i;   dv_j = sum_i P_ij dO_i
    dsinks_h = -sum_{b, i} exp(S_h - L_i) Delta_i      (dL - D weighted by the sink's probability)

Conventions (OPS.md, backward; golden refimpl/attention_grad.py; masks as kernels/triton/attention.py):
causal bottom_right / top_left per sequence, window (left, right) inclusive on the same diagonal,
causal forcing right = 0; query head h reads kv head h // (h_q // h_kv) and dk / dv of a kv head sum
its query heads; a row with no key and no sink (L = -inf) has P = 0 and zero gradients, never NaN;
keys no row sees get dk = dv = 0; keys past a sequence's length are never loaded.

Algorithm (Dao, "FlashAttention-2", 2023, section 3.2; the Triton fused-attention tutorial's split):
1. preprocessing, one program per (BLOCK_M rows, head, sequence): Delta = rowsum(dO * O) - dL in fp32,
   the LSE in the log2 domain (+inf where it is -inf, so exp2 gives P = 0 without -inf - -inf), and
   with sinks each program's partial sum of -exp(S_h - L_i) Delta_i, which `_dsinks_kernel` adds up
   per head in a fixed order (no atomics: the bits do not depend on scheduling).
2. dk / dv: one program per (BLOCK_N keys, kv head, sequence) holds its K and V tile and fp32 dk, dv
   accumulators, and streams the query tiles of every query head of its group that can see the
   tile (the GQA reduction happens in registers); P^T is recomputed from the LSE (no softmax
   statistics), dv += P^T dO, dS^T = P^T (V dO^T - Delta), dk += dS^T Q. Tiles of rows that see every
   key of the tile run without mask arithmetic, as in the forward.
3. dq: one program per (BLOCK_M rows, head, sequence) streams the key tiles its rows can see (the
   forward's `_window_tiles`) and accumulates dq += dS K in fp32: a second pass instead of atomic adds.
All dots accumulate in fp32 (fp32 inputs: input_precision="ieee"); with 16-bit inputs P and dS are
rounded to the input dtype for the tensor cores, as FlashAttention does; each gradient is rounded
once when stored.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import MAX_HEAD_DIM, _check_common, _check_out, _tanh, _window_tiles
from .softmax import LOG2E

# ((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dk/dv kernel, the same of the dq kernel) by
# (padded head dim, element size): dk/dv holds two (BLOCK_N, d) fp32 accumulators, dq one (BLOCK_M, d).
# (128, 2) was swept on an H100 at b 16, s 4096 (benchmarks/gpu_attention_bwd.py --tune); (64, 2) and (256, 2)
# on an H200 at b 4, s 1024, 32 / 8 heads, causal (reports/baselines/attention-bwd-configs-h200.json): d 64
# 0.238 ms = 1.20x SDPA flash's backward, 0.90x cuDNN's (the old (64, 128, 8, 3) pair 0.285-0.321 ms); d 256
# 1.253 ms = 0.82x flash, 0.57x cuDNN (the old (32, 64, 4, 2) pair 2.265 ms = 0.45x); larger d 256 tiles or a
# third stage exceed shared memory. The rest are unmeasured starting points.
BWD_CONFIGS: dict[tuple[int, int], tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    (16, 2): ((64, 64, 4, 3), (64, 64, 4, 3)), (32, 2): ((64, 64, 4, 3), (64, 64, 4, 3)),
    (64, 2): ((32, 64, 4, 3), (64, 32, 4, 3)), (128, 2): ((64, 128, 8, 2), (128, 64, 8, 2)),
    (256, 2): ((64, 64, 8, 2), (64, 64, 4, 2)),
    (16, 4): ((32, 32, 4, 2), (32, 32, 4, 2)), (32, 4): ((32, 32, 4, 2), (32, 32, 4, 2)),
    (64, 4): ((32, 32, 4, 2), (32, 32, 4, 2)), (128, 4): ((32, 32, 4, 2), (32, 32, 4, 2)),
    (256, 4): ((16, 32, 4, 1), (32, 16, 4, 1)),
}
# The interpreter (CPU tensors) pays per program instance and per loop trip, not per element:
# one large tile for the CI-sized cases.
INTERPRETER_CONFIG = ((64, 64, 4, 1), (64, 64, 4, 1))
PRE_BLOCK_M = 64  # rows per preprocessing program
SINK_BLOCK = 256  # partial sums per step of the dsinks reduction


@triton.jit
def _attention_bwd_preprocess_kernel(
    O_ptr, DO_ptr, Lse_ptr, DLse_ptr, Sinks_ptr, L2_ptr, Delta_ptr, Part_ptr, CuQ_ptr,
    s_q, n_m_blocks, d_v,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls, stride_dlb, stride_dlh, stride_dls, stride_wb, stride_wh, stride_ws,
    HAS_DLSE: tl.constexpr, HAS_SINK: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q0 = 0
    L_q = s_q
    if VARLEN:
        q0 = tl.load(CuQ_ptr + b)
        L_q = tl.load(CuQ_ptr + b + 1) - q0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < L_q
    rows = q0 + offs_m
    mask = mask_m[:, None] & (offs_dv < d_v)[None, :]
    o = tl.load(O_ptr + b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + rows[:, None] * stride_os
                + offs_dv[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO_ptr + b.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dos
                 + offs_dv[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)  # fp32 row sums D_i
    lse = tl.load(Lse_ptr + b.to(tl.int64) * stride_lb + head * stride_lh + rows * stride_ls, mask=mask_m,
                  other=float("-inf"))
    empty = lse == float("-inf")  # no key and no sink: P = 0 below, dL has nothing to act on
    if HAS_DLSE:
        dl = tl.load(DLse_ptr + b.to(tl.int64) * stride_dlb + head * stride_dlh + rows * stride_dls, mask=mask_m,
                     other=0.0)
        delta = delta - tl.where(empty, 0.0, dl)
    l2 = tl.where(empty, float("inf"), lse * LOG2E)
    w_off = b.to(tl.int64) * stride_wb + head * stride_wh + rows * stride_ws
    tl.store(Delta_ptr + w_off, delta, mask=mask_m)
    tl.store(L2_ptr + w_off, l2, mask=mask_m)
    if HAS_SINK:
        p_sink = tl.exp2(tl.load(Sinks_ptr + head) * LOG2E - l2)  # exp(S_h - L_i); 0 where L = -inf
        part = tl.sum(tl.where(mask_m, -p_sink * delta, 0.0), axis=0)
        tl.store(Part_ptr + head * (tl.num_programs(2) * n_m_blocks) + b * n_m_blocks + pid_m, part)


@triton.jit
def _dsinks_kernel(Part_ptr, DSinks_ptr, n_parts, stride_ds, BLOCK: tl.constexpr):
    """dsinks[h] = the sum of head h's preprocessing partials, in a fixed order."""
    head = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(Part_ptr + head * n_parts + offs, mask=offs < n_parts, other=0.0)
    tl.store(DSinks_ptr + head * stride_ds, tl.sum(acc, axis=0))


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q_base, DO_base, W_base, start, end, offs_n, offs_d, offs_dv, L_q, L_k, diag_off,
    left, right, d, d_v, stride_qs, stride_dos, stride_ws, qk_scale, softcap_out,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, L2_ptr, Delta_ptr,
):
    """dk, dv of one key tile over the query tiles [start, end) of one query head (transposed
    orientation: rows of P^T are the tile's keys). MASK=False: every row sees every key of the tile."""
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt_ptrs = Q_base + offs_m[None, :] * stride_qs + offs_d[:, None]  # (BLOCK_D, BLOCK_M): Q^T
        do_ptrs = DO_base + offs_m[:, None] * stride_dos + offs_dv[None, :]
        if MASK:
            mask_m = offs_m < L_q
            qt_mask = mask_m[None, :]
            do_mask = mask_m[:, None]
            if not EVEN_D:
                qt_mask = qt_mask & (offs_d < d)[:, None]
                do_mask = do_mask & (offs_dv < d_v)[None, :]
            qt = tl.load(qt_ptrs, mask=qt_mask, other=0.0)
            do = tl.load(do_ptrs, mask=do_mask, other=0.0)
            l2 = tl.load(L2_ptr + W_base + offs_m * stride_ws, mask=mask_m, other=float("inf"))
            delta = tl.load(Delta_ptr + W_base + offs_m * stride_ws, mask=mask_m, other=0.0)
        else:
            if EVEN_D:
                qt = tl.load(qt_ptrs)
                do = tl.load(do_ptrs)
            else:
                qt = tl.load(qt_ptrs, mask=(offs_d < d)[:, None], other=0.0)
                do = tl.load(do_ptrs, mask=(offs_dv < d_v)[None, :], other=0.0)
            l2 = tl.load(L2_ptr + W_base + offs_m * stride_ws)
            delta = tl.load(Delta_ptr + W_base + offs_m * stride_ws)
        qkt = tl.dot(k, qt, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M), fp32
        if SOFTCAP:
            tc = _tanh(qkt * qk_scale)  # qk_scale = scale / cap
            st = tc * softcap_out  # cap * log2 e: log2-domain logits
        else:
            st = qkt * qk_scale  # scale * log2 e
        if MASK:
            keep = (offs_m < L_q)[None, :] & (offs_n < L_k)[:, None]
            diag = offs_m + diag_off
            if HAS_LEFT:
                keep = keep & (offs_n[:, None] >= diag[None, :] - left)
            if HAS_RIGHT:
                keep = keep & (offs_n[:, None] <= diag[None, :] + right)
            st = tl.where(keep, st, float("-inf"))
        pt = tl.exp2(st - l2[None, :])  # P^T; l2 = +inf on empty rows: 0, never -inf - -inf
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # fp32 accumulator
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M): dP^T
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tc * tc)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, L2_ptr, Delta_ptr, DK_ptr, DV_ptr, CuQ_ptr, CuK_ptr,
    s_q, s_k, group, d, d_v, qk_scale, softcap_out, scale, left, right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_wb, stride_wh, stride_ws,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    q0 = 0
    k0 = 0
    L_q = s_q
    L_k = s_k
    if VARLEN:
        q0 = tl.load(CuQ_ptr + b)
        k0 = tl.load(CuK_ptr + b)
        L_q = tl.load(CuQ_ptr + b + 1) - q0
        L_k = tl.load(CuK_ptr + b + 1) - k0
    n0 = pid_n * BLOCK_N
    if n0 >= L_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < L_k
    k_base = b.to(tl.int64) * stride_kb + k0.to(tl.int64) * stride_ks + kv_head.to(tl.int64) * stride_kh
    v_base = b.to(tl.int64) * stride_vb + k0.to(tl.int64) * stride_vs + kv_head.to(tl.int64) * stride_vh
    # Keys past L_k are never loaded (they may be NaN or another sequence's): masked loads give 0.
    k = tl.load(K_ptr + k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=mask_n[:, None] & (offs_d < d)[None, :], other=0.0)
    v = tl.load(V_ptr + v_base + offs_n[:, None] * stride_vs + offs_dv[None, :],
                mask=mask_n[:, None] & (offs_dv < d_v)[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Rows that see some key of the tile: i + diag_off - left <= j <= i + diag_off + right.
    diag_off = 0 if TOP_LEFT else L_k - L_q
    m_lo = 0
    m_hi = L_q
    if HAS_RIGHT:
        m_lo = tl.maximum(n0 - diag_off - right, 0)
    if HAS_LEFT:
        m_hi = tl.maximum(tl.minimum(m_hi, n0 + BLOCK_N - diag_off + left), 0)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    # Whole row tiles that see every key of a whole key tile run unmasked; a partial key tile
    # (past L_k) runs every row tile masked (full_lo = full_hi past m_hi).
    full_lo = m_lo
    full_hi = (L_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag_off - right, 0), BLOCK_M) * BLOCK_M)
    if HAS_LEFT:
        full_hi = tl.minimum(full_hi, (tl.maximum(n0 + left - diag_off + 1, 0) // BLOCK_M) * BLOCK_M)
    full_hi = tl.maximum(full_hi, full_lo)
    past = tl.cdiv(m_hi, BLOCK_M) * BLOCK_M
    whole = n0 + BLOCK_N <= L_k
    full_lo = tl.where(whole, full_lo, past)
    full_hi = tl.where(whole, full_hi, past)
    for hh in range(0, group):  # the kv head's query heads: dk, dv summed in registers
        head = kv_head * group + hh
        q_base = Q_ptr + b.to(tl.int64) * stride_qb + q0.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
        do_base = DO_ptr + b.to(tl.int64) * stride_dob + q0.to(tl.int64) * stride_dos + head.to(tl.int64) * stride_doh
        w_base = b.to(tl.int64) * stride_wb + head.to(tl.int64) * stride_wh + q0.to(tl.int64) * stride_ws
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, w_base, m_lo, tl.minimum(full_lo, m_hi), offs_n, offs_d,
                             offs_dv, L_q, L_k, diag_off, left, right, d, d_v, stride_qs, stride_dos, stride_ws,
                             qk_scale, softcap_out, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_M,
                             DOT_PRECISION, L2_ptr, Delta_ptr)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, w_base, full_lo, full_hi, offs_n, offs_d,
                             offs_dv, L_q, L_k, diag_off, left, right, d, d_v, stride_qs, stride_dos, stride_ws,
                             qk_scale, softcap_out, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_M,
                             DOT_PRECISION, L2_ptr, Delta_ptr)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, w_base, full_hi, m_hi, offs_n, offs_d,
                             offs_dv, L_q, L_k, diag_off, left, right, d, d_v, stride_qs, stride_dos, stride_ws,
                             qk_scale, softcap_out, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_M,
                             DOT_PRECISION, L2_ptr, Delta_ptr)
    dk = dk * scale
    dk_off = b.to(tl.int64) * stride_dkb + k0.to(tl.int64) * stride_dks + kv_head.to(tl.int64) * stride_dkh
    dv_off = b.to(tl.int64) * stride_dvb + k0.to(tl.int64) * stride_dvs + kv_head.to(tl.int64) * stride_dvh
    tl.store(DK_ptr + dk_off + offs_n[:, None] * stride_dks + offs_d[None, :], dk.to(DK_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (offs_d < d)[None, :])
    tl.store(DV_ptr + dv_off + offs_n[:, None] * stride_dvs + offs_dv[None, :], dv.to(DV_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (offs_dv < d_v)[None, :])


@triton.jit
def _dq_tiles(
    dq, q, do, l2, delta, K_base, V_base, start, end, diag, offs_n, offs_d, offs_dv, L_k, left, right, d, d_v,
    stride_ks, stride_vs, qk_scale, softcap_out,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dq of one row tile over the key tiles [start, end). MASK=False: interior tiles, all kept."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = K_base + tl.cast(start_n, tl.int64) * stride_ks + offs_n[None, :] * stride_ks + offs_d[:, None]
        vt_ptrs = V_base + tl.cast(start_n, tl.int64) * stride_vs + offs_n[None, :] * stride_vs + offs_dv[:, None]
        if MASK:
            kmask = (cols < L_k)[None, :]
            vmask = (cols < L_k)[None, :]
            if not EVEN_D:
                kmask = kmask & (offs_d < d)[:, None]
                vmask = vmask & (offs_dv < d_v)[:, None]
            kt = tl.load(kt_ptrs, mask=kmask, other=0.0)
            vt = tl.load(vt_ptrs, mask=vmask, other=0.0)
        elif EVEN_D:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=(offs_d < d)[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_dv < d_v)[:, None], other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N), fp32
        if SOFTCAP:
            tc = _tanh(qk * qk_scale)
            s = tc * softcap_out
        else:
            s = qk * qk_scale
        if MASK:
            keep = (cols < L_k)[None, :]
            if HAS_LEFT:
                keep = keep & (cols[None, :] >= diag[:, None] - left)
            if HAS_RIGHT:
                keep = keep & (cols[None, :] <= diag[:, None] + right)
            s = tl.where(keep, s, float("-inf"))
        p = tl.exp2(s - l2[:, None])
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tc * tc)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, L2_ptr, Delta_ptr, DQ_ptr, CuQ_ptr, CuK_ptr,
    s_q, s_k, n_m_blocks, group, d, d_v, qk_scale, softcap_out, scale, left, right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_wb, stride_wh, stride_ws, stride_dqb, stride_dqs, stride_dqh,
    TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = n_m_blocks - 1 - tl.program_id(0)  # the heaviest (last, for causal) row tiles first
    head = tl.program_id(1)
    b = tl.program_id(2)
    kv_head = head // group
    q0 = 0
    k0 = 0
    L_q = s_q
    L_k = s_k
    if VARLEN:
        q0 = tl.load(CuQ_ptr + b)
        k0 = tl.load(CuK_ptr + b)
        L_q = tl.load(CuQ_ptr + b + 1) - q0
        L_k = tl.load(CuK_ptr + b + 1) - k0
    m0 = pid_m * BLOCK_M
    if m0 >= L_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < L_q
    rows = q0 + offs_m
    q = tl.load(Q_ptr + b.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qs
                + offs_d[None, :], mask=mask_m[:, None] & (offs_d < d)[None, :], other=0.0)
    do = tl.load(DO_ptr + b.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dos
                 + offs_dv[None, :], mask=mask_m[:, None] & (offs_dv < d_v)[None, :], other=0.0)
    w_off = b.to(tl.int64) * stride_wb + head.to(tl.int64) * stride_wh + rows * stride_ws
    l2 = tl.load(L2_ptr + w_off, mask=mask_m, other=float("inf"))  # +inf: P = 0 on padding rows
    delta = tl.load(Delta_ptr + w_off, mask=mask_m, other=0.0)
    K_base = K_ptr + b.to(tl.int64) * stride_kb + k0.to(tl.int64) * stride_ks + kv_head.to(tl.int64) * stride_kh
    V_base = V_ptr + b.to(tl.int64) * stride_vb + k0.to(tl.int64) * stride_vs + kv_head.to(tl.int64) * stride_vh

    diag_off = 0 if TOP_LEFT else L_k - L_q
    diag = offs_m + diag_off
    lo, hi, full_lo, full_hi = _window_tiles(m0, tl.minimum(m0 + BLOCK_M, L_q) - 1, diag_off, L_k, left, right,
                                             HAS_LEFT, HAS_RIGHT, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_tiles(dq, q, do, l2, delta, K_base, V_base, lo, tl.minimum(full_lo, hi), diag, offs_n, offs_d, offs_dv,
                   L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
                   True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, l2, delta, K_base, V_base, full_lo, full_hi, diag, offs_n, offs_d, offs_dv,
                   L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
                   False, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, l2, delta, K_base, V_base, full_hi, hi, diag, offs_n, offs_d, offs_dv,
                   L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
                   True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)
    dq = dq * scale
    tl.store(DQ_ptr + b.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqs
             + offs_d[None, :], dq.to(DQ_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_d < d)[None, :])


# -- launchers -------------------------------------------------------------------------------------
def _outputs(q, k, v, sinks, out_dq, out_dk, out_dv, out_dsinks) -> dict[str, torch.Tensor]:
    got = {}
    for name, buf, like in (("dq", out_dq, q), ("dk", out_dk, k), ("dv", out_dv, v)):
        got[name] = torch.empty(like.shape, dtype=q.dtype, device=q.device) if buf is None else buf
        _check_out(got[name], like.shape, q.dtype, q.device, f"out_{name}", True)
    if sinks is not None:
        got["dsinks"] = torch.empty(sinks.shape, dtype=torch.float32, device=q.device) if out_dsinks is None else out_dsinks
        _check_out(got["dsinks"], sinks.shape, torch.float32, q.device, "out_dsinks")
    return got


def _check_grad_inputs(q, o, lse, do, dlse, lse_shape, d_v) -> None:
    want = (*q.shape[:-1], d_v)
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a {want} {q.dtype} tensor on {q.device}, got "
                             f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}")
        if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {tuple(t.stride())}")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is None and name == "dlse":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(lse_shape) or t.dtype != torch.float32 \
                or t.device != q.device:
            raise ValueError(f"{name} must be a {tuple(lse_shape)} float32 tensor on {q.device}, got "
                             f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}")


def _configs(q, d, d_v, config):
    if config is not None:
        return config
    if q.device.type == "cpu":
        return INTERPRETER_CONFIG
    block = max(16, triton.next_power_of_2(max(d, d_v)))
    return BWD_CONFIGS[(block, min(q.element_size(), 4))]


def _launch(q, k, v, o, lse, do, dlse, sinks, cu_q, cu_k, grads, b, s_q, s_k, max_q, max_k, strides, *,
            scale, causal, left, right, softcap, config):
    """The three passes (and the dsinks reduction); `strides` hold (b, s, h) of q, k, v, do, lse, dlse,
    dq, dk, dv and o, with 0 batch strides for packed varlen."""
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv, d_v = k.shape[-2], v.shape[-1]
    group = h_q // h_kv
    (sq, sk, sv, sdo, sl, sdl, sdq, sdk, sdv, so) = strides
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    (bm1, bn1, w1, st1), (bm2, bn2, w2, st2) = _configs(q, d, d_v, config)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qk_scale = scale / softcap if softcap else scale * 1.4426950408889634
    softcap_out = softcap * 1.4426950408889634
    if b > 65535 or max(triton.cdiv(max(max_q, 1), PRE_BLOCK_M), triton.cdiv(max(max_k, 1), bn1)) >= 2**31:
        raise ValueError(f"grid ({b} sequences of up to {max_q} queries / {max_k} keys) exceeds CUDA's limits")
    # Workspace: Delta and the log2-domain LSE per row, laid out like lse; the sinks' partial sums.
    work_shape = lse.shape
    delta = torch.empty(work_shape, dtype=torch.float32, device=q.device)
    l2 = torch.empty(work_shape, dtype=torch.float32, device=q.device)
    sw = (0, *delta.stride()) if cu_q is not None else delta.stride()
    n_pre = triton.cdiv(max_q, PRE_BLOCK_M)
    parts = torch.zeros((h_q, max(1, b * n_pre)), dtype=torch.float32, device=q.device)
    flags = dict(TOP_LEFT=causal == "top_left", HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0,
                 VARLEN=cu_q is not None, EVEN_D=block_d == d and block_dv == d_v, BLOCK_D=block_d,
                 BLOCK_DV=block_dv, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    cu_q_arg = cu_q if cu_q is not None else lse
    cu_k_arg = cu_k if cu_k is not None else lse
    if max_q > 0:
        _attention_bwd_preprocess_kernel[(n_pre, h_q, b)](
            o, do, lse, dlse if dlse is not None else lse, sinks if sinks is not None else lse, l2, delta, parts,
            cu_q_arg, s_q, n_pre, d_v, *so, *sdo, *sl, *sdl, *sw,
            HAS_DLSE=dlse is not None, HAS_SINK=sinks is not None, VARLEN=cu_q is not None,
            BLOCK_M=PRE_BLOCK_M, BLOCK_DV=block_dv)
    if max_k > 0:
        _attention_bwd_dkdv_kernel[(triton.cdiv(max_k, bn1), h_kv, b)](
            q, k, v, do, l2, delta, grads["dk"], grads["dv"], cu_q_arg, cu_k_arg,
            s_q, s_k, group, d, d_v, qk_scale, softcap_out, scale, left, right,
            *sq, *sk, *sv, *sdo, *sw, *sdk, *sdv,
            BLOCK_M=bm1, BLOCK_N=bn1, num_warps=w1, num_stages=st1, **flags)
    if max_q > 0:
        n_m = triton.cdiv(max_q, bm2)
        _attention_bwd_dq_kernel[(n_m, h_q, b)](
            q, k, v, do, l2, delta, grads["dq"], cu_q_arg, cu_k_arg,
            s_q, s_k, n_m, group, d, d_v, qk_scale, softcap_out, scale, left, right,
            *sq, *sk, *sv, *sdo, *sw, *sdq,
            BLOCK_M=bm2, BLOCK_N=bn2, num_warps=w2, num_stages=st2, **flags)
    if sinks is not None:
        _dsinks_kernel[(h_q,)](parts, grads["dsinks"], parts.shape[1] if max_q > 0 else 0,
                               grads["dsinks"].stride(0), BLOCK=SINK_BLOCK)


def prefill_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                     do: torch.Tensor, dlse: torch.Tensor | None = None, *, scale: float | None = None,
                     causal: str = "none", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, out_dq: torch.Tensor | None = None,
                     out_dk: torch.Tensor | None = None, out_dv: torch.Tensor | None = None,
                     out_dsinks: torch.Tensor | None = None, config=None) -> dict[str, torch.Tensor]:
    """Gradients of dense attention (kernels/triton/attention.py's `prefill`).

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v) — fp32/fp16/bf16, last-dim stride 1
    o, do: (b, s_q, h_q, d_v) in q's dtype: the forward output and its cotangent
    lse: (b, h_q, s_q) float32, the natural-log LSE *with the sink folded in* (-inf: no key, no sink);
    dlse: its cotangent (same shape, float32) or None
    causal, window, softcap, sinks, scale: the forward's (sinks (h_q,) float32)
    out_*: optional buffers (dq like q, dk like k, dv like v in q's dtype, last-dim stride 1; dsinks (h_q,))
    config: ((BLOCK_M, BLOCK_N, num_warps, num_stages) of dk/dv, the same of dq), for tuning only
    returns {"dq", "dk", "dv"} (and "dsinks" with sinks)
    """
    left, right = _check_common(q, k, v, causal, window, softcap, sinks, h_axis=2, scale=scale,
                                max_head_dim=MAX_HEAD_DIM)
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q (b, s_q, h_q, d), k/v (b, s_k, h_kv, d), got {tuple(q.shape)}, {tuple(k.shape)}")
    b, s_q, h_q, _ = q.shape
    s_k = k.shape[1]
    _check_grad_inputs(q, o, lse, do, dlse, (b, h_q, s_q), v.shape[-1])
    grads = _outputs(q, k, v, sinks, out_dq, out_dk, out_dv, out_dsinks)
    if b == 0 or h_q == 0:
        return grads
    dl = dlse if dlse is not None else lse
    strides = (q.stride()[:3], k.stride()[:3], v.stride()[:3], do.stride()[:3], lse.stride(), dl.stride(),
               grads["dq"].stride()[:3], grads["dk"].stride()[:3], grads["dv"].stride()[:3], o.stride()[:3])
    _launch(q, k, v, o, lse, do, dlse, sinks, None, None, grads, b, s_q, s_k, s_q, s_k, strides, scale=scale,
            causal=causal, left=left, right=right, softcap=float(softcap), config=config)
    return grads


def varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
                    dlse: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, *, scale: float | None = None,
                    causal: str = "none", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, out_dq: torch.Tensor | None = None,
                    out_dk: torch.Tensor | None = None, out_dv: torch.Tensor | None = None,
                    out_dsinks: torch.Tensor | None = None, config=None) -> dict[str, torch.Tensor]:
    """Gradients of packed variable-length attention (`varlen`); masks per sequence.

    q: (total_q, h_q, d); k: (total_k, h_kv, d); v: (total_k, h_kv, d_v); o, do: (total_q, h_q, d_v)
    cu_seqlens_q, cu_seqlens_k: (b + 1,) int32 on q's device, from 0; max_seqlen_q / max_seqlen_k:
    host ints >= every sequence's query / key count (they size the grids)
    lse, dlse: (h_q, total_q) float32 (dlse may be None); otherwise as `prefill_backward`
    returns {"dq", "dk", "dv"} (and "dsinks"); keys of a sequence without queries get zero gradients
    """
    left, right = _check_common(q, k, v, causal, window, softcap, sinks, h_axis=1, scale=scale,
                                max_head_dim=MAX_HEAD_DIM)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"expected q (total_q, h_q, d), k/v (total_k, h_kv, d), got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         f"must both be (b + 1,)")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} must be >= 0")
    total_q, h_q, _ = q.shape
    b = cu_seqlens_q.shape[0] - 1
    _check_grad_inputs(q, o, lse, do, dlse, (h_q, total_q), v.shape[-1])
    grads = _outputs(q, k, v, sinks, out_dq, out_dk, out_dv, out_dsinks)
    if b == 0 or h_q == 0:
        if "dsinks" in grads:
            grads["dsinks"].zero_()
        return grads
    dl = dlse if dlse is not None else lse
    strides = ((0, *q.stride()[:2]), (0, *k.stride()[:2]), (0, *v.stride()[:2]), (0, *do.stride()[:2]),
               (0, *lse.stride()), (0, *dl.stride()), (0, *grads["dq"].stride()[:2]), (0, *grads["dk"].stride()[:2]),
               (0, *grads["dv"].stride()[:2]), (0, *o.stride()[:2]))
    _launch(q, k, v, o, lse, do, dlse, sinks, cu_seqlens_q, cu_seqlens_k, grads, b, 0, 0, int(max_seqlen_q),
            int(max_seqlen_k), strides, scale=scale, causal=causal, left=left, right=right, softcap=float(softcap),
            config=config)
    return grads
