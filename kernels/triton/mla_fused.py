"""MAX's fused FP8 MLA decode branch (`mla_decode_branch_fp8`), in Triton.

    q_lat  = bmm_fp8(q_nope, W_UK)                     per head: (T, dn) x (d_c, dn)^T
    row    <- [RMSNorm(row[:d_c]) * gamma ; RoPE(row[d_c:], f[p])]    the new tokens' cache rows, in place
    q      = [q_lat ; RoPE(q_rope, f[p])]              (T, H, d_c + d_r)
    o_lat  = softmax(scale q rows^T, causal j <= p) rows[:, :d_c]     per request, over the updated cache
    out    = bmm_fp8(o_lat, W_UV)                      per head: (T, d_c) x (dv, d_c)^T
    bmm_fp8(a, w): s = min(amax_G, 1200) / 448, qa = e4m3(clamp(a * (1 / s), +-448)), G = (1 token x 128
                   channels) of one head; C = sum_kb dot(qa, w)[kb] s_a[kb] s_w[n // 128, kb]
                   (MAX's fp8_dtype / fp8_scale_dtype from w_uk's / w_uk_scale's dtypes: e5m2 codes at 57344;
                   bf16 scales: amax and s rounded to bf16, 1 / s from the rounded s)

Conventions (golden refimpl.mla.decode_fused_fp8, helpers refimpl/mla_fp8.py): q (T, H, dn + d_r) holds
the ragged new tokens, request r's at input_row_offsets[r]:[r + 1]; request r's token t sits at
position p = cache_lengths[r] + t, in the cache slot block_table[r, p // page], p % page, whose row
holds the raw kv_a_proj output on entry; freqs_cis row p = [cos p w_0, sin p w_0, cos p w_1, ...]
and RoPE rotates interleaved pairs (x[2i], x[2i+1]); RMSNorm is x / sqrt(mean x^2 + eps) * gamma;
an all-zero activation group has scale 0 and codes 0 (MAX's zero reciprocal); the sink is a
natural-log logit per head (or per request: sink_per="batch") in the scaled domain, in the
denominator only (+inf: O = 0).

Four launches:
1. `_mla_fused_rope_norm_kernel`, one program per new token: RMSNorm + RoPE of its cache row
   (written back in the cache dtype) and RoPE of its q_rope, all heads.
2. `_mla_fused_bmm_fp8_kernel` for q_lat: each program quantizes its (BLOCK_M tokens x 128)
   activation tiles in registers (the group is one token's 128 channels, so no second pass) and
   runs the e4m3 dot of each 128-channel K block, promoted into an fp32 accumulator with
   s_a x s_w (DeepGEMM's per-block promotion: Hopper's fp8 accumulation never spans one block).
3. `_mla_fused_attend_kernel`, one program per (request, block of (token, head) rows): the online
   softmax of kernels/triton/mla.py (FlashAttention-2, log2 domain), every query row of a request
   streaming its keys once: the cached keys through `_mla_attend_split3`, the new tokens' rows
   through `_mla_attend` with IEEE dots.
4. `_mla_fused_bmm_fp8_kernel` for out, as 2.
MAX's sparse mode (sparse_mla, `d_indices=`) replaces 3 by `_mla_fused_sparse_kernel`, one program per
(new token, block of 16 heads): no mask, no block table; the token's index list is read a 32-key tile at a
time (its first topk_lengths[t] entries, -1 skipped) and the listed rows gathered. Launch 1 also writes a
slot -> token map (-1 elsewhere, one int32 per cache slot), so a listed slot holding one of this step's
rows attends its fp32 row of step 1 (IEEE dots, as 3's new keys) and every other slot its cached row
(the three-part split, as 3's cached keys). MAX's second cache (`extra_k`, e4m3 rows with a float32
scale per row and 128 channels, the rope part its own) joins the same online softmax through its own
list and lengths: its rows dequantized in fp32 (code x scale, one rounding), IEEE dots.

Where it rounds (the golden computes in float64):
- RMSNorm in fp64 (the golden's operations in its order), rounded to fp32; the RoPE of the cache
  rows and of q_rope in fp32. The cache rows are stored in the cache dtype: the rope part rounded
  once, the latent from its fp32 value.
- q_lat, the roped q, the attention and o_lat stay fp32. The cached keys (16-bit) meet the fp32
  query rows on the 16-bit tensor cores through a three-part split (q = q1 + q2 + q3 in the cache
  dtype, the same for the probabilities against the values): every product exact, fp32 sums, six
  MMAs where the plain decode runs two. The new tokens' keys and values are their fp32 rows of
  step 1, not their rounded cache rows, with IEEE fp32 FMA dots, so a token alone with itself gets
  its own row back exactly; an IEEE division by the softmax sum. (An fp32 cache, and the config
  "ieee", use FMA dots throughout.)
- The activation quantizer therefore sees float32 values within a few fp32 ulps of the golden's
  float32(o_lat) (q_nope's are the inputs themselves), and its e4m3 codes are the golden's except
  at true rounding ties. (Rounding the golden's o_lat to bf16, as MAX stores it, moves 2.2% of
  its codes on the ci cases, each by one e4m3 step of that element, felt in all of out's row.)
- Sparse: the listed cached rows as 3's, this step's as 3's new keys; the second cache's rows are code x
  scale rounded once to fp32 (the golden's are exact), met by IEEE fp32 dots (on a GPU the FMA path:
  that list costs the IEEE form's time per key, the main list the split's).
- Products of e4m3 codes are exact, their 128-term block sums and the scale products fp32; out is
  rounded once, to q's dtype.
Cost on an H100 (benchmarks/gpu_mla.py, fused section, b = 128, one new token): the split keeps
out's cos_diff to the IEEE form at 2.6e-7 / 5.3e-7 and runs 23x / 24x faster than it (h_q = 128 /
16); 1.9x (h_q = 16) to 5.2x (h_q = 128, 16384 keys) the plain bf16 mla_decode of the same
attention, 1.0x to 11.5x the eager branch (which rounds o_lat to bf16 and fails production's limits).
The three q parts hold a (BLOCK_M, 576) tile each: BLOCK_M = 16 (mma, not wgmma) is what fits.

Not checked (each would synchronise with the GPU; MAX's cache manager guarantees them):
offsets rising from 0 to T, distinct cache slots for the new tokens, positions inside freqs_cis
and the block table. `max_new_tokens` sizes the attention grid; None reads it from the offsets.

References: modular/modular max/kernels/src/nn/attention/gpu/mla_graph.mojo (mla_decode_branch_fp8),
nn/fused_qk_rope.mojo, linalg/fp8_utils.mojo, linalg/bmm.mojo; DeepSeek-V3 inference/kernel.py.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from .mla import _mla_attend

GROUP = 128  # FP8 scale granularity (1, 128, 128): MAX's bmm supports only this one
FP8_MAX = tl.constexpr(448.0)
FP8_MAX_E5 = tl.constexpr(57344.0)  # e5m2's max finite (MAX's fp8_dtype float8_e5m2)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.bfloat16)
SCALE_UB = 1200.0  # MAX's activation amax bound in the MLA branch
LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (block_m, block_n, warps, stages, "split3" | "ieee" for the cached keys' dots). The H100 sweep
# (benchmarks/gpu_mla.py, fused section): (16, 32, 4, 3) fastest at h_q = 128 / 4096 keys (4.13 ms)
# and h_q = 16 / 16384 (1.91 ms); block_m 32 at h_q = 128, block_n 64 and block_m 64 exceed shared
# memory (the three q parts); the IEEE form took 95.9 / 46.0 ms. Tried and dropped: the keys x rows
# orientation (the 32-key tile as the MMA's M side, the q parts as B): 5.96 / 2.73 ms, slower.
ATTEND_CONFIG = (16, 32, 4, 3, "split3")
BMM_BLOCK_M = 16  # tokens a program; tl.dot needs >= 16
BMM_BLOCK_N = 128
BMM_WARPS = 4
ROPE_HEADS = 16  # heads a step of the q-rope loop


@triton.jit
def _rope_pairs(pair, D_R: tl.constexpr):
    """Offsets of the two elements RoPE rotates together: interleaved (x[2i], x[2i + 1])."""
    xe, xo = 2 * pair, 2 * pair + 1
    return xe, xo


@triton.jit
def _token_request(Off_ptr, b, t, BLOCK_B: tl.constexpr):
    """The request of new token t: how many requests end at or before it (empty requests included)."""
    r = tl.full([], 0, tl.int32)
    for c0 in range(1, b + 1, BLOCK_B):
        offs_b = c0 + tl.arange(0, BLOCK_B)
        ends = tl.load(Off_ptr + offs_b, mask=offs_b <= b, other=0)
        r += tl.sum(((ends <= t) & (offs_b <= b)).to(tl.int32))
    return r


@triton.jit
def _mla_fused_rope_norm_kernel(
    Q_ptr, Off_ptr, CL_ptr, BT_ptr, F_ptr, G_ptr, KV_ptr, New_ptr, QF_ptr, Map_ptr,
    b, H, eps_hi, eps_lo,
    stride_qt, stride_qh, stride_bt_b, stride_bt_p, stride_f, stride_kb, stride_ks, stride_new_t,
    stride_qf_t, stride_qf_h,
    PAGE: tl.constexpr, DN: tl.constexpr, D_C: tl.constexpr, D_R: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, Q_INPLACE: tl.constexpr = False, SLOT_MAP: tl.constexpr = False,
):
    t = tl.program_id(0)
    r = _token_request(Off_ptr, b, t, BLOCK_B)
    pos = tl.load(CL_ptr + r) + t - tl.load(Off_ptr + r)
    page = tl.load(BT_ptr + r.to(tl.int64) * stride_bt_b + (pos // PAGE) * stride_bt_p)
    row = KV_ptr + page.to(tl.int64) * stride_kb + (pos % PAGE) * stride_ks
    if SLOT_MAP:  # the sparse mode's slot -> new token map (its flat slot block * page + offset)
        tl.store(Map_ptr + page.to(tl.int64) * PAGE + pos % PAGE, t)
    new_row = New_ptr + t.to(tl.int64) * stride_new_t

    # RMSNorm of the latent in fp64, the golden's own operations in its order (512 values a token:
    # free), rounded once to fp32. A request's first token attends to itself alone, so its o_lat
    # IS this row: fp32 arithmetic here (two roundings) would sit an ulp off the golden's
    # float32(o_lat), and where the golden lands exactly on an e4m3 midpoint (ratios of 16-bit
    # products do), that ulp moves the code in every head at once.
    offs_c = tl.arange(0, D_C)
    x = tl.load(row + offs_c).to(tl.float64)
    # the float64 eps from two fp32 halves (scalar arguments arrive as fp32)
    eps = tl.full([], eps_hi, tl.float32).to(tl.float64) + tl.full([], eps_lo, tl.float32).to(tl.float64)
    rms = tl.sqrt(tl.sum(x * x, axis=0) * (1.0 / D_C) + eps)  # IEEE in fp64; D_C a power of two: an exact mean
    y = (x / rms * tl.load(G_ptr + offs_c).to(tl.float64)).to(tl.float32)
    tl.store(new_row + offs_c, y)

    # RoPE: the table row is interleaved [cos_i, sin_i]; (x_e + i x_o)(cos + i sin) in fp32.
    pair = tl.arange(0, D_R // 2)
    xe, xo = _rope_pairs(pair, D_R)
    cos = tl.load(F_ptr + pos.to(tl.int64) * stride_f + 2 * pair).to(tl.float32)
    sin = tl.load(F_ptr + pos.to(tl.int64) * stride_f + 2 * pair + 1).to(tl.float32)
    ke = tl.load(row + D_C + xe).to(tl.float32)
    ko = tl.load(row + D_C + xo).to(tl.float32)
    ye = ke * cos - ko * sin
    yo = ke * sin + ko * cos
    tl.store(new_row + D_C + xe, ye)
    tl.store(new_row + D_C + xo, yo)

    # The cache row in its dtype: the rope part rounded once, the latent from its fp32 value (the
    # fp32 row above, not this one, feeds the attention).
    tl.store(row + offs_c, y.to(KV_ptr.dtype.element_ty))
    tl.store(row + D_C + xe, ye.to(KV_ptr.dtype.element_ty))
    tl.store(row + D_C + xo, yo.to(KV_ptr.dtype.element_ty))

    # q_rope of every head, into the fp32 query rows' rope part.
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask_h = (heads < H)[:, None]
        q_row = Q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + DN
        qe = tl.load(q_row + xe[None, :], mask=mask_h, other=0.0).to(tl.float32)
        qo = tl.load(q_row + xo[None, :], mask=mask_h, other=0.0).to(tl.float32)
        qf_row = QF_ptr + t.to(tl.int64) * stride_qf_t + heads[:, None] * stride_qf_h + D_C
        re = qe * cos[None, :] - qo * sin[None, :]
        ro = qe * sin[None, :] + qo * cos[None, :]
        tl.store(qf_row + xe[None, :], re, mask=mask_h)
        tl.store(qf_row + xo[None, :], ro, mask=mask_h)
        if Q_INPLACE:  # MAX's fused_qk_rope: q's rope part left rotated, rounded once to q's dtype
            tl.store(q_row + xe[None, :], re.to(Q_ptr.dtype.element_ty), mask=mask_h)
            tl.store(q_row + xo[None, :], ro.to(Q_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def _mla_fused_bmm_fp8_kernel(
    A_ptr, W_ptr, SW_ptr, C_ptr, M, N, n_kb, scale_ub,
    stride_ab, stride_am, stride_ak, stride_wb, stride_wn, stride_wk, stride_swb, stride_swn, stride_swk,
    stride_cb, stride_cm, stride_cn,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_E5: tl.constexpr = False,
    SCALE_BF16: tl.constexpr = False,
):
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A_ptr + pid_b.to(tl.int64) * stride_ab + offs_m[:, None].to(tl.int64) * stride_am \
        + offs_k[None, :] * stride_ak
    w_ptrs = W_ptr + pid_b.to(tl.int64) * stride_wb + offs_n[:, None].to(tl.int64) * stride_wn \
        + offs_k[None, :] * stride_wk
    sw_ptrs = SW_ptr + pid_b * stride_swb + (offs_n // GROUP_K) * stride_swn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, n_kb):
        # MAX's dynamic quantization of one (token, 128 channels) group, in fp32: the scale and
        # its reciprocal IEEE-divided, x * (1 / s) rounded once, clamped, cast to nearest e4m3.
        # FP8_E5 (MAX's fp8_dtype e5m2): max finite 57344, e5m2 codes; SCALE_BF16 (fp8_scale_dtype bf16):
        # amax and the scale rounded to bf16 (as MAX computes it in the scale dtype), 1 / s from the stored value.
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(a), axis=1)
        fmax = FP8_MAX_E5 if FP8_E5 else FP8_MAX
        if SCALE_BF16:
            amax = amax.to(tl.bfloat16).to(tl.float32)
            s_a = tl.math.div_rn(tl.minimum(amax, scale_ub), fmax).to(tl.bfloat16).to(tl.float32)
        else:
            s_a = tl.math.div_rn(tl.minimum(amax, scale_ub), fmax)
        recip = tl.where(s_a > 0.0, tl.math.div_rn(1.0, tl.where(s_a > 0.0, s_a, 1.0)), 0.0)
        if FP8_E5:
            qa = tl.minimum(tl.maximum(a * recip[:, None], -fmax), fmax).to(tl.float8e5)
        else:
            qa = tl.minimum(tl.maximum(a * recip[:, None], -fmax), fmax).to(tl.float8e4nv)
        qw = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        s_w = tl.load(sw_ptrs + kb * stride_swk, mask=mask_n, other=0.0).to(tl.float32)
        # exact e4m3 products, one block's sum on the tensor cores, promoted to fp32 with both scales
        acc += tl.dot(qa, tl.trans(qw)) * (s_a[:, None] * s_w[None, :])
        a_ptrs += GROUP_K * stride_ak
        w_ptrs += GROUP_K * stride_wk
    c_ptrs = C_ptr + pid_b.to(tl.int64) * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm \
        + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split3(x, DT: tl.constexpr):
    """fp32 x as three DT (bf16 / fp16) parts whose sum is x to ~24 bits: x1 = DT(x), x2 =
    DT(x - x1), x3 = DT(x - x1 - x2) (each difference exact in fp32)."""
    x1 = x.to(DT)
    r = x - x1.to(tl.float32)
    x2 = r.to(DT)
    x3 = (r - x2.to(tl.float32)).to(DT)
    return x1, x2, x3


@triton.jit
def _mla_attend_split3(q1, q2, q3, p1, p2, p3, kn, kp, live, m_i, l_i, acc, qk_scale):
    """One tile of cached keys (no mask but `live`) on 16-bit tensor cores at fp32 grade: the
    keys are exact in their dtype, the fp32 query rows are split in three parts (q = q1 + q2 + q3,
    and its rope part p1 + p2 + p3), so every product is exact and the logits are fp32 sums; the
    probabilities are split the same way against the values. Six 16-bit MMAs where the plain
    decode runs two."""
    kt = tl.trans(kn)
    s = tl.dot(q1, kt)
    s = tl.dot(q2, kt, s)
    s = tl.dot(q3, kt, s)
    pt = tl.trans(kp)
    s = tl.dot(p1, pt, s)
    s = tl.dot(p2, pt, s)
    s = tl.dot(p3, pt, s)
    s = tl.where(live[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    w1, w2, w3 = _split3(p, kn.dtype)
    acc = tl.dot(w1, kn, acc * alpha[:, None])
    acc = tl.dot(w2, kn, acc)
    acc = tl.dot(w3, kn, acc)
    return m_new, l_i, acc


@triton.jit
def _mla_fused_attend_kernel(
    QF_ptr, New_ptr, KV_ptr, O_ptr, Off_ptr, CL_ptr, BT_ptr, Sink_ptr, SAcc_ptr, SM_ptr, SL_ptr,
    H, n_m, qk_scale,
    stride_qf_t, stride_qf_h, stride_new_t, stride_kb, stride_ks, stride_bt_b, stride_bt_p,
    stride_o_t, stride_o_h,
    HAS_SINK: tl.constexpr, SINK_BATCH: tl.constexpr, PAGE: tl.constexpr, D_V: tl.constexpr,
    D_PE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    SPLIT3: tl.constexpr, STATE: tl.constexpr = False,
):
    """STATE: the cached keys' online-softmax state of every row (row tok * H + head: the unnormalised fp32
    accumulator (T H, D_V), the running max in the log2 domain and the sum, (T H,) each) was computed by another
    kernel (kernels/gluon/mla_fused.py); this one starts from it and attends this step's tokens alone."""
    pid = tl.program_id(0)
    pid_m = pid % n_m
    r = pid // n_m
    start = tl.load(Off_ptr + r)
    n_r = tl.load(Off_ptr + r + 1) - start
    cl = tl.load(CL_ptr + r)

    # Row m is new token m // H of the request, head m % H; token i sits at position cl + i and
    # sees keys j <= cl + i (the last n_r keys are the new tokens themselves).
    n_rows = n_r * H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    qi = offs_m // H
    head = offs_m % H
    tok = (start + qi).to(tl.int64)
    offs_dv = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = QF_ptr + tok * stride_qf_t + head * stride_qf_h
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + D_V + offs_pe[None, :], mask=mask_m[:, None], other=0.0)
    diag = cl + qi
    # keys up to the last one this block's last row sees (none for a block past the request's rows)
    hi = tl.where(pid_m * BLOCK_M < n_rows, cl + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // H + 1, 0)

    bt_row = BT_ptr + r.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)  # fp32 accumulator of O
    # Keys cached before this step (every row sees them). SPLIT3: in their 16-bit dtype on the
    # tensor cores, the fp32 q and p split in three parts (_mla_attend_split3: exact products,
    # fp32 sums); otherwise (an fp32 cache, the interpreter) widened to fp32, IEEE FMA dots.
    n_old = tl.minimum(cl, hi)
    if STATE:
        srow = tok * H + head
        m_i = tl.load(SM_ptr + srow, mask=mask_m, other=float("-inf"))
        l_i = tl.load(SL_ptr + srow, mask=mask_m, other=0.0)
        acc = tl.load(SAcc_ptr + srow[:, None] * D_V + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    else:
        if SPLIT3:
            q1, q2, q3 = _split3(q_nope, KV_ptr.dtype.element_ty)
            p1, p2, p3 = _split3(q_pe, KV_ptr.dtype.element_ty)
        for start_n in tl.range(0, n_old, BLOCK_N, num_stages=NUM_STAGES):
            cols = start_n + offs_n
            old = cols < n_old
            page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=old, other=0)
            rows = page.to(tl.int64) * stride_kb + (cols % PAGE) * stride_ks
            kn = tl.load(KV_ptr + rows[:, None] + offs_dv[None, :], mask=old[:, None], other=0.0)
            kp = tl.load(KV_ptr + rows[:, None] + D_V + offs_pe[None, :], mask=old[:, None], other=0.0)
            if SPLIT3:
                m_i, l_i, acc = _mla_attend_split3(q1, q2, q3, p1, p2, p3, kn, kp, old, m_i, l_i, acc, qk_scale)
            else:
                m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn.to(tl.float32), kp.to(tl.float32), kn.to(tl.float32),
                                            old, cols, diag, m_i, l_i, acc, qk_scale, False, False, "ieee")
    # This step's tokens: their fp32 rows (before the cache rounding), causal, IEEE FMA products,
    # so a token alone with itself (an empty cache) gets its own row back exactly.
    for start_n in range(n_old, hi, BLOCK_N):
        cols = start_n + offs_n
        new = cols < hi
        nrows = (start + cols - cl).to(tl.int64) * stride_new_t
        kn = tl.load(New_ptr + nrows[:, None] + offs_dv[None, :], mask=new[:, None], other=0.0)
        kp = tl.load(New_ptr + nrows[:, None] + D_V + offs_pe[None, :], mask=new[:, None], other=0.0)
        m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn, kp, kn, new, cols, diag, m_i, l_i, acc, qk_scale,
                                    True, False, "ieee")

    if HAS_SINK:  # exp(sink) joins the denominator: l + 2^(sink log2 e - m); +inf gives O = 0
        if SINK_BATCH:  # request r's sink, shared by all its rows (MAX's per-batch sink)
            sink = tl.load(Sink_ptr + r + 0 * head, mask=mask_m, other=float("-inf")).to(tl.float32)
        else:
            sink = tl.load(Sink_ptr + head, mask=mask_m, other=float("-inf")).to(tl.float32)
        l_i = l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
    o = tl.math.div_rn(acc, tl.where(l_i > 0.0, l_i, 1.0)[:, None])  # IEEE: o_lat feeds the quantizer
    o_rows = O_ptr + tok * stride_o_t + head * stride_o_h
    tl.store(o_rows[:, None] + offs_dv[None, :], o, mask=mask_m[:, None])


@triton.jit
def _mla_fused_sparse_kernel(
    QF_ptr, New_ptr, KV_ptr, Map_ptr, O_ptr, Off_ptr, Sink_ptr, Idx_ptr, Len_ptr,
    EK_ptr, ES_ptr, EIdx_ptr, ELen_ptr,
    H, b, n_m, topk, idx_stride, qk_scale,
    stride_qf_t, stride_qf_h, stride_new_t, stride_kb, stride_ks, stride_o_t, stride_o_h, stride_ek, stride_es,
    HAS_SINK: tl.constexpr, SINK_BATCH: tl.constexpr, HAS_EXTRA: tl.constexpr, PAGE: tl.constexpr,
    D_V: tl.constexpr, D_PE: tl.constexpr, GROUP_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, SPLIT3: tl.constexpr,
):
    """MAX's sparse_mla: one program per (new token, block of its heads), one online softmax over the token's
    used slots of the updated cache (its list d_indices[t * idx_stride:][:topk], the first topk_lengths[t]
    entries, -1 skipped) and, with HAS_EXTRA, the used rows of the second (e4m3) cache, dequantized in fp32."""
    pid = tl.program_id(0)
    t = pid // n_m
    offs_m = (pid % n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < H
    offs_dv = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = QF_ptr + t.to(tl.int64) * stride_qf_t + offs_m * stride_qf_h
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + D_V + offs_pe[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
    if SPLIT3:
        q1, q2, q3 = _split3(q_nope, KV_ptr.dtype.element_ty)
        p1, p2, p3 = _split3(q_pe, KV_ptr.dtype.element_ty)

    # The main list: cached rows in their 16-bit dtype (split3, as the dense kernel's cached keys); a
    # slot that is one of this step's new rows (Map: slot -> token, -1 elsewhere) attends its fp32 row
    # of step 1 (IEEE dots), as the dense kernel's new keys.
    n_len = tl.minimum(tl.maximum(tl.load(Len_ptr + t), 0), topk)
    idx_row = Idx_ptr + t.to(tl.int64) * idx_stride
    for start_n in range(0, n_len, BLOCK_N):
        cols = start_n + offs_n
        idx = tl.load(idx_row + cols, mask=cols < n_len, other=-1)
        live = (cols < n_len) & (idx != -1)
        slot = tl.where(live, idx, 0)
        tok = tl.load(Map_ptr + slot, mask=live, other=-1)
        old = live & (tok < 0)
        rows = (slot // PAGE).to(tl.int64) * stride_kb + (slot % PAGE) * stride_ks
        kn = tl.load(KV_ptr + rows[:, None] + offs_dv[None, :], mask=old[:, None], other=0.0)
        kp = tl.load(KV_ptr + rows[:, None] + D_V + offs_pe[None, :], mask=old[:, None], other=0.0)
        if SPLIT3:
            m_i, l_i, acc = _mla_attend_split3(q1, q2, q3, p1, p2, p3, kn, kp, old, m_i, l_i, acc, qk_scale)
        else:
            m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn.to(tl.float32), kp.to(tl.float32), kn.to(tl.float32),
                                        old, offs_n, offs_n, m_i, l_i, acc, qk_scale, False, False, "ieee")
        new = live & (tok >= 0)
        if tl.max(new.to(tl.int32), axis=0) > 0:  # this step's rows among the tile's keys
            nrows = tl.where(new, tok, 0).to(tl.int64) * stride_new_t
            # own names: an if block may not rebind the tile's bf16 kn / kp as fp32 (the compiler's rule; the
            # interpreter does not check it)
            kn_new = tl.load(New_ptr + nrows[:, None] + offs_dv[None, :], mask=new[:, None], other=0.0)
            kp_new = tl.load(New_ptr + nrows[:, None] + D_V + offs_pe[None, :], mask=new[:, None], other=0.0)
            m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn_new, kp_new, kn_new, new, offs_n, offs_n, m_i, l_i, acc,
                                        qk_scale, False, False, "ieee")

    if HAS_EXTRA:  # the second cache: e4m3 codes times their row's scale per GROUP_C channels (the
        # rope part's own), dequantized in fp32 (one rounding of an exact 4 x 24-bit product), IEEE dots
        e_len = tl.minimum(tl.maximum(tl.load(ELen_ptr + t), 0), topk)
        e_row = EIdx_ptr + t.to(tl.int64) * idx_stride
        for start_n in range(0, e_len, BLOCK_N):
            cols = start_n + offs_n
            idx = tl.load(e_row + cols, mask=cols < e_len, other=-1)
            live = (cols < e_len) & (idx != -1)
            slot = tl.where(live, idx, 0).to(tl.int64)
            scs = ES_ptr + slot * stride_es
            sn = tl.load(scs[:, None] + (offs_dv // GROUP_C)[None, :], mask=live[:, None], other=0.0)
            sp = tl.load(scs + D_V // GROUP_C, mask=live, other=0.0)
            kn = tl.load(EK_ptr + slot[:, None] * stride_ek + offs_dv[None, :], mask=live[:, None], other=0.0)
            kp = tl.load(EK_ptr + slot[:, None] * stride_ek + D_V + offs_pe[None, :], mask=live[:, None], other=0.0)
            kn = kn.to(tl.float32) * sn
            kp = kp.to(tl.float32) * sp[:, None]
            m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn, kp, kn, live, offs_n, offs_n, m_i, l_i, acc, qk_scale,
                                        False, False, "ieee")

    if HAS_SINK:  # as the dense kernel's; a token with no used key gets O = 0 (l = +inf, or 0 -> 1)
        if SINK_BATCH:  # the token's request's sink, shared by its heads
            r = _token_request(Off_ptr, b, t, BLOCK_B)
            sink = tl.load(Sink_ptr + r + 0 * offs_m, mask=mask_m, other=0.0).to(tl.float32)
        else:  # (heads past H: 0, not -inf, whose -inf - -inf of an empty list would be NaN; never stored)
            sink = tl.load(Sink_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        l_i = l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
    o = tl.math.div_rn(acc, tl.where(l_i > 0.0, l_i, 1.0)[:, None])
    o_rows = O_ptr + t.to(tl.int64) * stride_o_t + offs_m * stride_o_h
    tl.store(o_rows[:, None] + offs_dv[None, :], o, mask=mask_m[:, None])


def _bmm_fp8(a: torch.Tensor, w: torch.Tensor, sw: tuple, c: torch.Tensor) -> None:
    """c[t, h, n] = bmm_fp8(a[t, h, :], w[h]) for (T, H, K) a and (T, H, N) c; sw = (ptr, strides)."""
    T, H, K = a.shape
    N = w.shape[1]
    grid = (H, triton.cdiv(T, BMM_BLOCK_M), triton.cdiv(N, BMM_BLOCK_N))
    _mla_fused_bmm_fp8_kernel[grid](
        a, w, sw[0], c, T, N, K // GROUP, SCALE_UB,
        a.stride(1), a.stride(0), a.stride(2), *w.stride(), *sw[1], c.stride(1), c.stride(0), c.stride(2),
        GROUP_K=GROUP, BLOCK_M=BMM_BLOCK_M, BLOCK_N=BMM_BLOCK_N, FP8_E5=w.dtype == torch.float8_e5m2,
        SCALE_BF16=sw[0].dtype == torch.bfloat16, num_warps=BMM_WARPS,
    )


def _weight(w, w_scale, shape: tuple, what: str, device, fp8=None, scale_dtype=None) -> tuple:
    """Checks an e4m3 or e5m2 (H, N, K) weight and its (H, N / 128, K / 128) (or flattened (H N / 128,
    K / 128)) float32 or bf16 scales (of the dtypes fp8 / scale_dtype when given: w_uk's, which w_uv must
    share, MAX's one fp8_dtype and fp8_scale_dtype); returns (scale tensor, its (b, n, k) strides)."""
    H, N, K = shape
    fp8s = FP8_DTYPES if fp8 is None else (fp8,)
    if not isinstance(w, torch.Tensor) or w.dtype not in fp8s or tuple(w.shape) != shape \
            or w.device != device:
        raise ValueError(f"mla_decode_fused_fp8: {what} must be a {shape} {'/'.join(str(f)[6:] for f in fp8s)} "
                         f"tensor on {device}, got {getattr(w, 'dtype', type(w).__name__)} "
                         f"{tuple(getattr(w, 'shape', ()))}")
    nb, kb = triton.cdiv(N, GROUP), K // GROUP
    sds = SCALE_DTYPES if scale_dtype is None else (scale_dtype,)
    ok = isinstance(w_scale, torch.Tensor) and w_scale.dtype in sds and w_scale.device == device
    if ok and tuple(w_scale.shape) == (H, nb, kb):
        return w_scale, tuple(w_scale.stride())
    if ok and tuple(w_scale.shape) == (H * nb, kb):
        return w_scale, (w_scale.stride(0) * nb, w_scale.stride(0), w_scale.stride(1))
    raise ValueError(f"mla_decode_fused_fp8: {what}_scale must be a ({H}, {nb}, {kb}) (or ({H * nb}, {kb})) "
                     f"{'/'.join(str(d)[6:] for d in sds)} tensor on {device}, got "
                     f"{getattr(w_scale, 'dtype', type(w_scale).__name__)} "
                     f"{tuple(getattr(w_scale, 'shape', ()))}")


def _sparse_args(what, T, d_c, d, dev, d_indices, stride, topk, lengths, extra_k, extra_scales, extra_idx,
                 extra_lengths) -> tuple | None:
    """Checks the sparse mode's arguments; None when dense, else (d_indices, topk_lengths, extra rows (n, d),
    extra scales (n, d_c / 128 + 1), extra_d_indices, extra_topk_lengths), the extra four None without it."""
    if d_indices is None:
        if extra_k is not None:
            raise ValueError(f"{what}: extra_k (MAX's second cache) needs the sparse mode (d_indices)")
        return None

    def index(t, name, n):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != dev or t.numel() < n:
            raise ValueError(f"{what}: {name} must be an int32 tensor on {dev} of >= {n} entries, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        return t.reshape(-1)

    if not (isinstance(topk, int) and isinstance(stride, int) and 0 < topk <= stride):
        raise ValueError(f"{what}: sparse mode needs 0 < topk ({topk!r}) <= indices_stride ({stride!r})")
    idx, lens = index(d_indices, "d_indices", T * stride), index(lengths, "topk_lengths", T)
    if extra_k is None:
        return idx, lens, None, None, None, None
    if not isinstance(extra_k, torch.Tensor) or extra_k.dtype != torch.float8_e4m3fn or extra_k.device != dev \
            or extra_k.shape[-1] != d or not extra_k.is_contiguous():
        raise ValueError(f"{what}: extra_k must be a contiguous (num_blocks, page, [1,] {d}) float8_e4m3fn tensor "
                         f"on {dev}, got {getattr(extra_k, 'dtype', '')} {tuple(getattr(extra_k, 'shape', ()))}")
    e_k = extra_k.reshape(-1, d)
    n_g = d_c // GROUP + 1
    if not isinstance(extra_scales, torch.Tensor) or extra_scales.dtype != torch.float32 \
            or extra_scales.device != dev or extra_scales.numel() != e_k.shape[0] * n_g:
        got = f"{getattr(extra_scales, 'dtype', '')} {tuple(getattr(extra_scales, 'shape', ()))}"
        raise ValueError(f"{what}: extra_scales must be a float32 tensor on {dev} of ({e_k.shape[0]}, {n_g}) "
                         f"scales, got {got}")
    return (idx, lens, e_k, extra_scales.reshape(e_k.shape[0], n_g),
            index(extra_idx, "extra_d_indices", T * stride), index(extra_lengths, "extra_topk_lengths", T))


def mla_decode_fused_fp8(q: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
                         gamma: torch.Tensor, epsilon: float, w_uk: torch.Tensor, w_uk_scale: torch.Tensor,
                         w_uv: torch.Tensor, w_uv_scale: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, cache_lengths: torch.Tensor, scale: float, *,
                         attn_sink: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         max_new_tokens: int | None = None, q_inplace: bool = False,
                         sink_per: str = "head", d_indices: torch.Tensor | None = None, indices_stride: int = 0,
                         topk: int = 0, topk_lengths: torch.Tensor | None = None,
                         extra_k: torch.Tensor | None = None, extra_scales: torch.Tensor | None = None,
                         extra_d_indices: torch.Tensor | None = None,
                         extra_topk_lengths: torch.Tensor | None = None, cached_attend=None) -> torch.Tensor:
    """MAX's mla_decode_branch_fp8; writes the new tokens' cache rows in place (and, with q_inplace, q's
    rope part: MAX's fused_qk_rope leaves q rotated).

    q: (T, H, dn + d_r) bf16/fp16/fp32, last-dim stride 1; dn a multiple of 128 (128), d_r = freqs_cis.shape[1]
    input_row_offsets: (b + 1,) int32, request r's tokens q[off[r]:off[r + 1]] (0 tokens allowed)
    freqs_cis: (max_seq_len, d_r) float, row p = [cos p w_0, sin p w_0, cos p w_1, ...]
    gamma: (d_c,) float RMSNorm weight; epsilon: RMSNorm eps
    w_uk: (H, d_c, dn) float8_e4m3fn or float8_e5m2 (MAX's fp8_dtype, the activations' codes too);
        w_uk_scale: (H, d_c / 128, dn / 128) float32 or bfloat16 (MAX's fp8_scale_dtype, the activation scales'
        too) (or flattened)
    w_uv: (H, dv, d_c) of w_uk's dtype; w_uv_scale: (H, ceil(dv / 128), d_c / 128) of w_uk_scale's (or flattened)
    kv_cache: (num_blocks, page, d_c + d_r) or (num_blocks, page, 1, d_c + d_r) in q's dtype, last-dim
        stride 1; d_c and d_r powers of two >= 16 (512, 64); the new tokens' rows hold the raw latent
    block_table: (b, max_blocks) int32; cache_lengths: (b,) int32, tokens cached before this step
    scale: softmax scale; attn_sink: (H,) float32 or None; sink_per="batch": attn_sink (b,), request r's sink
        shared by its heads (MAX's per-batch sink)
    out: (T, H, dv) q's dtype, last-dim stride 1
    max_new_tokens: >= every request's new-token count (None: read from the offsets, a sync on a GPU)
    q_inplace: q[..., dn:] overwritten with its rotation at the token's position (rounded once to q's dtype;
        the attention uses the fp32 rotation); q[..., :dn] is only read. False: q is only read
    d_indices, indices_stride, topk, topk_lengths: MAX's sparse mode (sparse_mla; None: dense). d_indices
        (>= T * indices_stride,) int32, token t's list d_indices[t * indices_stride:][:topk], flat slots
        block * page + offset of kv_cache; topk_lengths (T,) int32: token t uses its first topk_lengths[t]
        entries (clamped to [0, topk]), -1 skipped. No causal mask, no block table in the attention (the
        indices choose the keys); a listed slot holding one of this step's rows attends its fp32 row.
    extra_k, extra_scales, extra_d_indices, extra_topk_lengths: MAX's second cache (sparse only): extra_k
        (num_blocks', page', [1,] d) float8_e4m3fn, contiguous rows; extra_scales (num_blocks' page',
        d_c / 128 + 1) float32 (or any shape of that many rows), a scale per row and 128 latent channels, the
        last for the rope part; its list and lengths as d_indices / topk_lengths (same stride and topk),
        flat rows of extra_k. Its used rows join the token's keys in the same online softmax.
    cached_attend: None, or (dense mode) another kernel for the cached keys' part of the attention (kernels/gluon/
        mla_fused.py): called as cached_attend(q_full, kv_cache, block_table, cache_lengths, input_row_offsets,
        n_m64, qk_scale) with the fp32 query rows (T, H, d_c + d_r) after step 2 and n_m64 = ceil(max_new_tokens H
        / 64), it returns the online-softmax state over keys [0, cache_lengths[r]) of every row (tok H + head):
        (the unnormalised fp32 accumulator (T H, d_c), the running max (log2 domain, scaled), the sum); step 3 then
        attends this step's tokens alone from that state
    returns: out
    """
    what = "mla_decode_fused_fp8"
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: q must be a (T, H, dn + d_r) bf16/fp16/fp32 tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    dev = q.device
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() not in (3, 4) or kv_cache.dtype != q.dtype \
            or kv_cache.device != dev or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"{what}: kv_cache must be (num_blocks, page, [1,] d) {q.dtype} on {dev}, got "
                         f"{getattr(kv_cache, 'dtype', '')} {tuple(getattr(kv_cache, 'shape', ()))}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{what}: {name} must have last-dim stride 1, got strides {tuple(t.stride())}")
    if not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dim() != 2 or not freqs_cis.dtype.is_floating_point \
            or freqs_cis.device != dev or (freqs_cis.numel() and freqs_cis.stride(1) != 1):
        raise ValueError(f"{what}: freqs_cis must be a (max_seq_len, d_r) float tensor on {dev}, last-dim stride 1")
    T, H, dq = q.shape
    d_r = freqs_cis.shape[1]
    d = kv_cache.shape[-1]
    dn, d_c = dq - d_r, d - d_r
    for name, n in (("d_c", d_c), ("d_r", d_r)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{what}: {name} = {n} must be a power of two >= 16 (cache dim {d}, freqs_cis {d_r})")
    if dn < GROUP or dn % GROUP or d_c % GROUP:
        raise ValueError(f"{what}: dn = {dn} and d_c = {d_c} must be multiples of {GROUP} (q dim {dq}, d_r {d_r})")
    if not isinstance(gamma, torch.Tensor) or tuple(gamma.shape) != (d_c,) or not gamma.dtype.is_floating_point \
            or gamma.device != dev:
        raise ValueError(f"{what}: gamma must be a ({d_c},) float tensor on {dev}")
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"{what}: epsilon={epsilon!r} must be a finite number >= 0")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scale={scale!r} must be a finite number > 0")
    if not isinstance(w_uv, torch.Tensor) or w_uv.dim() != 3:
        raise ValueError(f"{what}: w_uv must be a (H, dv, d_c) float8_e4m3fn tensor")
    dv = w_uv.shape[1]
    s_uk = _weight(w_uk, w_uk_scale, (H, d_c, dn), "w_uk", dev)
    s_uv = _weight(w_uv, w_uv_scale, (H, dv, d_c), "w_uv", dev, w_uk.dtype, s_uk[0].dtype)
    b = (input_row_offsets.numel() - 1) if isinstance(input_row_offsets, torch.Tensor) else -1
    for name, t, shape in (("input_row_offsets", input_row_offsets, (b + 1,)), ("cache_lengths", cache_lengths, (b,)),
                           ("block_table", block_table, (b, None))):
        if b < 0 or not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != dev \
                or t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
            raise ValueError(f"{what}: {name} must be a {tuple('n' if s is None else s for s in shape)} int32 "
                             f"tensor on {dev}, got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if sink_per not in ("head", "batch"):
        raise ValueError(f"{what}: sink_per={sink_per!r} must be 'head' (one sink per query head) or 'batch'")
    n_sink = H if sink_per == "head" else b
    if attn_sink is not None and (not isinstance(attn_sink, torch.Tensor) or tuple(attn_sink.shape) != (n_sink,)
                                  or attn_sink.dtype != torch.float32 or attn_sink.device != dev):
        raise ValueError(f"{what}: attn_sink must be a ({n_sink},) float32 tensor on {dev} (sink_per={sink_per!r})")
    if out is None:
        out = torch.empty((T, H, dv), dtype=q.dtype, device=dev)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, H, dv) or out.dtype != q.dtype \
            or out.device != dev or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"{what}: out must be a ({T}, {H}, {dv}) {q.dtype} tensor on {dev} with last-dim stride 1")
    sparse = _sparse_args(what, T, d_c, d, dev, d_indices, indices_stride, topk, topk_lengths, extra_k,
                          extra_scales, extra_d_indices, extra_topk_lengths)
    if cached_attend is not None and sparse is not None:
        raise ValueError(f"{what}: cached_attend is for the dense mode; the sparse mode (d_indices) has no cached part")
    if T == 0 or H == 0:
        return out
    if max_new_tokens is None and sparse is not None:
        max_new_tokens = T  # sizes nothing in the sparse mode
    if max_new_tokens is None:
        max_new_tokens = int((input_row_offsets[1:] - input_row_offsets[:-1]).max()) if b else 0
    if not isinstance(max_new_tokens, int) or not 0 <= max_new_tokens <= T:
        raise ValueError(f"{what}: max_new_tokens={max_new_tokens!r} must be an int in [0, T={T}]")

    eps_hi = struct.unpack("f", struct.pack("f", float(epsilon)))[0]  # eps = hi + lo, each exact in fp32
    page = kv_cache.shape[1]
    stride_kb, stride_ks = kv_cache.stride(0), kv_cache.stride(1)
    # fp32 intermediates: the new rows (T, d), the query rows [q_lat ; roped q_rope] and o_lat
    new_rows = torch.empty((T, d), dtype=torch.float32, device=dev)
    q_full = torch.empty((T, H, d), dtype=torch.float32, device=dev)
    o_lat = torch.empty((T, H, d_c), dtype=torch.float32, device=dev)
    # sparse: slot -> this step's token (written by the first launch), -1 for every other slot
    slot_map = torch.full((kv_cache.shape[0] * page,), -1, dtype=torch.int32, device=dev) if sparse else q_full
    block_b = min(1024, triton.next_power_of_2(max(b, 1)))

    _mla_fused_rope_norm_kernel[(T,)](
        q, input_row_offsets, cache_lengths, block_table, freqs_cis, gamma, kv_cache, new_rows, q_full, slot_map,
        b, H, eps_hi, float(epsilon) - eps_hi,
        q.stride(0), q.stride(1), *block_table.stride(), freqs_cis.stride(0), stride_kb, stride_ks,
        new_rows.stride(0), q_full.stride(0), q_full.stride(1),
        PAGE=page, DN=dn, D_C=d_c, D_R=d_r, BLOCK_B=block_b,
        BLOCK_H=min(ROPE_HEADS, triton.next_power_of_2(H)), Q_INPLACE=bool(q_inplace), SLOT_MAP=sparse is not None,
        num_warps=4,
    )
    _bmm_fp8(q[..., :dn], w_uk, s_uk, q_full[..., :d_c])
    cfg_m, cfg_n, warps, stages, precision = ATTEND_CONFIG
    split3 = precision == "split3" and kv_cache.dtype != torch.float32
    if sparse is not None:
        idx, lens, e_k, e_s, e_idx, e_len = sparse
        n_m = triton.cdiv(H, cfg_m)
        _mla_fused_sparse_kernel[(T * n_m,)](
            q_full, new_rows, kv_cache, slot_map, o_lat, input_row_offsets,
            attn_sink if attn_sink is not None else q_full, idx, lens,
            *((e_k, e_s, e_idx, e_len) if e_k is not None else (q_full, q_full, idx, lens)),
            H, b, n_m, int(topk), int(indices_stride), float(scale) * LOG2E,
            q_full.stride(0), q_full.stride(1), new_rows.stride(0), stride_kb, stride_ks,
            o_lat.stride(0), o_lat.stride(1), e_k.stride(0) if e_k is not None else 0,
            e_s.stride(0) if e_s is not None else 0,
            HAS_SINK=attn_sink is not None, SINK_BATCH=sink_per == "batch", HAS_EXTRA=e_k is not None, PAGE=page,
            D_V=d_c, D_PE=d_r, GROUP_C=GROUP, BLOCK_M=cfg_m, BLOCK_N=cfg_n, BLOCK_B=block_b, SPLIT3=split3,
            num_warps=warps,
        )
        _bmm_fp8(o_lat, w_uv, s_uv, out)
        return out
    block_m = min(cfg_m, max(16, triton.next_power_of_2(max_new_tokens * H)))
    n_m = max(1, triton.cdiv(max_new_tokens * H, block_m))
    state = None
    if cached_attend is not None and b:
        state = cached_attend(q_full, kv_cache, block_table, cache_lengths, input_row_offsets,
                              triton.cdiv(max_new_tokens * H, 64), float(scale) * LOG2E)
    _mla_fused_attend_kernel[(b * n_m,)](
        q_full, new_rows, kv_cache, o_lat, input_row_offsets, cache_lengths, block_table,
        attn_sink if attn_sink is not None else q_full, *(state if state is not None else (q_full,) * 3),
        H, n_m, float(scale) * LOG2E,
        q_full.stride(0), q_full.stride(1), new_rows.stride(0), stride_kb, stride_ks, *block_table.stride(),
        o_lat.stride(0), o_lat.stride(1),
        HAS_SINK=attn_sink is not None, SINK_BATCH=sink_per == "batch", PAGE=page, D_V=d_c, D_PE=d_r, BLOCK_M=block_m, BLOCK_N=cfg_n,
        NUM_STAGES=stages, SPLIT3=split3, STATE=state is not None, num_warps=warps,
    )
    _bmm_fp8(o_lat, w_uv, s_uv, out)
    return out
