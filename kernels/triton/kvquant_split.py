"""Decode and flash decoding over a quantized KV cache (kvquant.decode, kvquant.decode_split), in Triton.

    logit_rj = scale * s_k(j) * (q_r . kc_j)         kc_j: key j's codes, converted exactly to q's dtype
    LSE_r = ln sum_j exp(logit_rj);  O_r = sum_j exp(logit_rj - LSE_r) s_v(j) vc_j        j visible to row r

Golden: refimpl/kvquant_split.py (float64 code x scale, then refimpl.attention's decode / decode_split).
The tile loop is kernels/triton/kvquant_decode.py's `_attend` (imported: the code conversion, the scales out
of the dots: per tensor / per head s_k in the fp32 logit scale and s_v in the final 1 / l, per token the
tile's s_k(j) on the logits and s_v(j) on the probabilities before the P V dot).

Layout: q (b, s_q, h_q, d); the cache contiguous (b, s_max, h_kv, d) or (decode_split with block_table) pages
(num_blocks, page, h_kv, d), token t of sequence b at cache[block_table[b, t // page], t % page]; scales (1,) |
(h_kv,) | the codes' shape without d. A contiguous cache goes through `_attend` as one page of 2^30 slots whose
page stride is 0 (the sequence's row is in the base pointer): the table entry `_attend` loads is multiplied by
0, so no table is built and no index is computed that a direct row index would not.

Schedule: a program takes one kv head of one sequence, a block of the rows (query i, query head g of the kv
head's group: row r = i group + g, the M dimension of the dots, so each code byte is read once whatever the GQA
group and s_q), and one split: split s of sequence b covers keys [s C_b, min((s + 1) C_b, L_b)),
C_b = ceil(L_b / splits) (equal counts; decode_split also takes fixed blocks of `block` keys, [s block, (s + 1)
block) cut to L_b, or explicit boundaries, [bounds[b, s], bounds[b, s + 1]) cut to L_b: PART). Causal
bottom-right: row r sees keys j <= L_b - s_q + i.
Keys [start, min(end, L_b - s_q + 1)) are seen by every row and go through `_attend`; the last s_q - 1 keys
(the diagonal) through `_attend_rows`, one masked tile with a per-row limit. Each split writes fp32 partials
(O_s, LSE_s), merged by `_kvq_merge_kernel` (lse_combine's math, a program a (sequence, kv head, row block); an
empty split: LSE -inf, no weight); with one split (kvquant.decode on the interpreter up to SPLIT_KEYS_CPU keys, or
a short cache on a GPU) the program writes O and LSE itself.

On the interpreter (a CPU tensor) the dots take fp32 operands (kvquant_decode.py's docstring says why) and the
tiles are 32 keys (INTERPRETER_CONFIG). On a GPU, a bf16 q over an FP8 cache takes kvquant_decode.py's integer-pipe
conversion in `_attend` (FAST_CVT 2; the diagonal tile of `_attend_rows` keeps Triton's casts). Status (H200,
reports/baselines/issue34c-h200/ and issue34d-h200/): the ci entries and the models entries (Llama-3-8B / 70B heads,
32K tokens, b 1-32) pass. At b 8, 32K tokens, e4m3 per tensor (issue34d-h200/kvquant-split-tune-h200.json, do_bench /
CUDA graph): kvquant.decode 248 / 242 us at 16 splits (was 277 / 270), 246 / 239 at 8 (was 262 / 254); its partials
alone 236 / 231, the merge 15 / 9 (was 34 / 28); decode_split over pages of 16 in table order 249 / 243;
kvquant_decode.py's paged decode 213 / 207. Two fixes got there: the diagonal tile is compiled only for s_q > 1
(DIAG: with it the split kernel took 226-250 registers on Triton 3.6, two CTAs an SM), and the merge takes the
GQA group's rows, not 16 padded (MERGE_ROWS: 255 registers and 224 bytes of spills a thread at 16). The split
kernel still takes 190 registers (the paged kernel 168): a cap of 168 (config (128, 4, 3, 168)) gave 227 against
243 us at 16 splits but 241 against 239 at 8, so CONFIGS stays. Still slower
than attention.decode over the bf16 cache at b 8 (0.265 ms under parity bench), and short of issue 34's goal as
kvquant_decode.py is.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kvquant_decode import (CONFIGS, FORMATS, GRANS, LN2, LOG2E, MAX_HEAD_DIM, MIN_SPLIT_KEYS,
                             SPLIT_KEYS_CPU, SPLIT_PROGRAMS_PER_SM, _attend, _code_view, _codes)

FLAT_PAGE = 1 << 30  # a contiguous cache as one page: cols // FLAT_PAGE = 0, cols % FLAT_PAGE = cols
INTERPRETER_CONFIG = (32, 4, 2)  # the interpreter's cost grows with the tile: 32 keys (the ci splits hold 1-352)
MERGE_SPLITS = 4  # splits the merge takes at a time (the ci suite's 8-split case loops twice)
MERGE_ROWS = 16  # rows a merge program: its (splits, rows, d) tile is 4 x 16 x 128 fp32 at d 128
MAX_ROWS = 64  # rows (queries x GQA group) a program; more take another program along the grid's third axis


@triton.jit
def _attend_rows(q, K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head, start, end, lim, qk_scale, m_i, l_i, acc,
                 offs_d, mask_d, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh,
                 stride_bt_p, FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """`_attend` over keys [start, end) with a per-row limit: row r takes key j < lim[r] only (the causal
    diagonal: at most s_q - 1 keys)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        live = cols < end
        page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0).to(tl.int64)
        slot = cols % PAGE
        kc = tl.load(K_base + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None],
                     mask=live[None, :] & mask_d[:, None], other=0)
        vc = tl.load(V_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                     mask=live[:, None] & mask_d[None, :], other=0)
        k = _codes(kc, FMT, q.dtype)
        v = _codes(vc, FMT, q.dtype)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if GRAN == 2:
            s_off = page * stride_sb + slot * stride_ss + kv_head * stride_sh
            sk = tl.load(KS_ptr + s_off, mask=live, other=0.0)
            svj = tl.load(VS_ptr + s_off, mask=live, other=0.0)
            qk = qk * sk[None, :]
        seen = live[None, :] & (cols[None, :] < lim[:, None])
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p
        if GRAN == 2:
            pv = p * svj[None, :]
        acc = tl.dot(pv.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _kvq_split_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, BT_ptr, Lens_ptr, O_ptr, Lse_ptr, Bnd_ptr,
    h_kv, group, s_q, d, splits, blk, stride_bnd, sm_scale,
    stride_qb, stride_qs, stride_qh, stride_kr, stride_kb, stride_ks, stride_kh,
    stride_vr, stride_vb, stride_vs, stride_vh, stride_sr, stride_sb, stride_ss, stride_sh,
    stride_bt_b, stride_bt_p,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_l_split, stride_lb, stride_lh, stride_ls,
    FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    FAST_CVT: tl.constexpr = 0, DIAG: tl.constexpr = True, PART: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    b = pid // h_kv
    kv_head = pid % h_kv
    split = tl.program_id(1)
    L = tl.load(Lens_ptr + b)
    if PART == 0:  # equal counts: C_b = ceil(L_b / splits)
        c = (L + splits - 1) // splits
        start = tl.minimum(split * c, L)
        end = tl.minimum(start + c, L)
    elif PART == 1:  # fixed blocks of blk keys
        start = tl.minimum(split * blk, L)
        end = tl.minimum(start + blk, L)
    else:  # explicit cumulative boundaries (b, splits + 1)
        bnd = Bnd_ptr + b.to(tl.int64) * stride_bnd + split
        start = tl.minimum(tl.load(bnd).to(tl.int32), L)
        end = tl.minimum(tl.load(bnd + 1).to(tl.int32), L)
    common = tl.maximum(tl.minimum(end, L - s_q + 1), start)  # keys every query row sees: [start, common)

    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < s_q * group
    qi = offs_m // group
    head = kv_head * group + offs_m % group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < d
    q = tl.load(Q_ptr + b.to(tl.int64) * stride_qb + (qi * stride_qs + head * stride_qh)[:, None] + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    sv = 1.0
    if GRAN == 0:
        qk_scale = qk_scale * tl.load(KS_ptr)
        sv = tl.load(VS_ptr)
    elif GRAN == 1:
        qk_scale = qk_scale * tl.load(KS_ptr + kv_head)
        sv = tl.load(VS_ptr + kv_head)

    # stride_kr / stride_vr / stride_sr: the contiguous cache's sequence rows (0 for pages)
    K_base = K_ptr + b.to(tl.int64) * stride_kr + kv_head.to(tl.int64) * stride_kh
    V_base = V_ptr + b.to(tl.int64) * stride_vr + kv_head.to(tl.int64) * stride_vh
    KS_base = KS_ptr + b.to(tl.int64) * stride_sr
    VS_base = VS_ptr + b.to(tl.int64) * stride_sr
    bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend(q, K_base, V_base, KS_base, VS_base, bt_row, kv_head, start, common, qk_scale, m_i, l_i,
                            acc, offs_d, mask_d, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss,
                            stride_sh, stride_bt_p, FMT, GRAN, PAGE, BLOCK_N, EVEN_D, DOT_PRECISION, FAST_CVT)
    if DIAG:  # s_q > 1 (with one query, common = end): compiled only then (its tile cost the H200 58 registers)
        lim = L - s_q + 1 + qi  # row r sees keys j < L - s_q + 1 + i
        m_i, l_i, acc = _attend_rows(q, K_base, V_base, KS_base, VS_base, bt_row, kv_head, common, end, lim,
                                     qk_scale, m_i, l_i, acc, offs_d, mask_d, stride_kb, stride_ks, stride_vb,
                                     stride_vs, stride_sb, stride_ss, stride_sh, stride_bt_p, FMT, GRAN, PAGE, BLOCK_N,
                                     DOT_PRECISION)
    o = acc * (sv / tl.where(l_i > 0.0, l_i, 1.0))[:, None]  # no key: O = 0
    o_ptrs = (O_ptr + split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob
              + (qi * stride_os + head * stride_oh)[:, None] + offs_d[None, :])
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh
             + qi * stride_ls, lse, mask=mask_m)


@triton.jit
def _kvq_merge_kernel(
    OP_ptr, LP_ptr, O_ptr, Lse_ptr, h_kv, group, s_q, d, splits,
    stride_op_split, stride_op_b, stride_op_s, stride_op_h, stride_lp_split, stride_lp_b, stride_lp_h, stride_lp_s,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """lse_combine of one kv head's rows (queries x GQA group) of one sequence, BLOCK_S splits at a time (online):
    LSE = M + ln sum_s exp(LSE_s - M), O = sum_s exp(LSE_s - LSE) O_s; an empty split (LSE_s = -inf) has no
    weight and its O_s is not read; a row with no key: O = 0, LSE = -inf."""
    pid = tl.program_id(0)
    b = (pid // h_kv).to(tl.int64)
    kv_head = pid % h_kv
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < s_q * group
    qi = offs_m // group
    head = kv_head * group + offs_m % group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < d
    offs_s = tl.arange(0, BLOCK_S)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_row = b * stride_lp_b + head * stride_lp_h + qi * stride_lp_s  # (BLOCK_M,)
    o_row = b * stride_op_b + qi * stride_op_s + head * stride_op_h
    for s0 in range(0, splits, BLOCK_S):
        sp = s0 + offs_s
        ms = (sp < splits)[:, None] & mask_m[None, :]
        lp = tl.load(LP_ptr + sp.to(tl.int64)[:, None] * stride_lp_split + l_row[None, :], mask=ms,
                     other=float("-inf"))  # (BLOCK_S, BLOCK_M)
        live = lp > float("-inf")
        m_new = tl.maximum(m_i, tl.max(lp, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(live, tl.exp2((lp - m_use[None, :]) * LOG2E), 0.0)
        alpha = tl.exp2((m_i - m_use) * LOG2E)
        op = tl.load(OP_ptr + (sp.to(tl.int64)[:, None] * stride_op_split + o_row[None, :])[:, :, None]
                     + offs_d[None, None, :], mask=(ms & live)[:, :, None] & mask_d[None, None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * op, axis=0)
        den = den * alpha + tl.sum(w, axis=0)
        m_i = m_new
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(O_ptr + b * stride_ob + (qi * stride_os + head * stride_oh)[:, None] + offs_d[None, :],
             o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = tl.where(den > 0.0, m_i + tl.log2(tl.where(den > 0.0, den, 1.0)) * LN2, float("-inf"))
    tl.store(Lse_ptr + b * stride_lb + head * stride_lh + qi * stride_ls, lse, mask=mask_m)


def _check(op: str, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table) -> str:
    """ValueError (one line naming `op` and the argument) unless the arguments are valid; the granularity."""
    more = {"seqlens": seqlens, **({"block_table": block_table} if block_table is not None else {})}
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    if q.dim() != 4 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.stride(-1) != 1:
        raise ValueError(f"{op}: q must be (b, s_q, h_q, d) fp32 / fp16 / bf16 with last-dim stride 1, got "
                         f"{tuple(q.shape)} {q.dtype} strides {q.stride()}")
    b, _, h_q, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim d={d} must be in [1, {MAX_HEAD_DIM}]")
    lay = "(num_blocks, page, h_kv, d)" if block_table is not None else f"(b={b}, s_max, h_kv, d)"
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape) or \
            (block_table is None and k_cache.shape[0] != b):
        raise ValueError(f"{op}: k_cache, v_cache must be {lay} with d={d}, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.dtype not in FORMATS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k_cache, v_cache must share one code dtype of int8, float8_e4m3fn, "
                         f"float8_e5m2, got {k_cache.dtype} and {v_cache.dtype}")
    if d > 1 and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(f"{op}: k_cache, v_cache must have last-dim stride 1, got {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    n0, n1, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    grans = {(n0, n1, h_kv): "token", (h_kv,): "head", (1,): "tensor"}
    gk, gv = grans.get(tuple(k_scale.shape)), grans.get(tuple(v_scale.shape))
    if gk is None or gk != gv or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise ValueError(f"{op}: k_scale, v_scale must be float32 of one shape: (1,), ({h_kv},) or "
                         f"({n0}, {n1}, {h_kv}), got {tuple(k_scale.shape)} {k_scale.dtype} and "
                         f"{tuple(v_scale.shape)} {v_scale.dtype}")
    if gk == "token" and k_scale.stride() != v_scale.stride():
        raise ValueError(f"{op}: k_scale, v_scale caches must share strides, got {k_scale.stride()} and "
                         f"{v_scale.stride()}")
    if tuple(seqlens.shape) != (b,) or seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: seqlens must be ({b},) int32, got {tuple(seqlens.shape)} {seqlens.dtype}")
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != b
                                    or block_table.dtype != torch.int32):
        raise ValueError(f"{op}: block_table must be ({b}, max_pages) int32, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    return gk


def _out(op: str, name: str, t, shape: tuple, dtype, q, unit_last: bool = False):
    if t is None:
        return torch.empty(shape, dtype=dtype, device=q.device)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device or \
            (unit_last and shape[-1] > 1 and t.stride(-1) != 1):
        last = " with last-dim stride 1" if unit_last else ""
        raise ValueError(f"{op}: {name} must be {shape} {dtype} on {q.device}{last}")
    return t


def _launch(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, gran, splits, o_dst, l_dst, scale,
            config, block=None, bounds=None):
    """One launch of the kernel: `splits` key ranges a sequence into o_dst (splits, b, s_q, h_q, d) and l_dst
    (splits, b, h_q, s_q) (any strides, last-dim stride 1)."""
    b, s_q, h_q, d = q.shape
    n0, n1, h_kv, _ = k_cache.shape
    group = h_q // h_kv
    rows = s_q * group
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(rows)))
    block_n, num_warps, num_stages, *regs = config or (CONFIGS[block_d] if q.is_cuda else INTERPRETER_CONFIG)
    launch = {"maxnreg": regs[0]} if regs and regs[0] else {}
    kst, vst = k_cache.stride(), v_cache.stride()
    sst = k_scale.stride() if gran == "token" else (0, 0, 0)
    if block_table is None:  # one page of FLAT_PAGE slots a sequence, its row in the base pointer
        page, bt = FLAT_PAGE, seqlens
        k_rows, v_rows, s_rows = (kst[0], 0, kst[1], kst[2]), (vst[0], 0, vst[1], vst[2]), (sst[0], 0, sst[1], sst[2])
        bt_strides = (0, 0)
    else:
        page, bt = n1, block_table
        k_rows, v_rows, s_rows = (0, *kst[:3]), (0, *vst[:3]), (0, *sst)
        bt_strides = block_table.stride()
    if block_table is None and (k_cache.shape[1] - 1) * max(kst[1], vst[1]) + h_kv * d >= 2**31:
        raise ValueError(f"{op}: a cache row of {k_cache.shape[1]} slots x {h_kv * d} codes exceeds int32 offsets")
    grid = (b * h_kv, splits, triton.cdiv(rows, block_m))
    if b * h_kv >= 2**31 or splits > 65535 or grid[2] > 65535:
        raise ValueError(f"{op}: grid {grid} exceeds CUDA's limits")
    interpret = not q.is_cuda
    # kvquant_decode.py's integer-pipe FP8 -> bf16 conversion (fast_cvt 2) for a bf16 q over an FP8 cache on a GPU
    fast_cvt = 2 if not interpret and q.dtype == torch.bfloat16 and k_cache.dtype != torch.int8 else 0
    part = 0 if block is None and bounds is None else 1 if bounds is None else 2
    _kvq_split_kernel[grid](
        q, _code_view(k_cache), _code_view(v_cache), k_scale, v_scale, bt, seqlens, o_dst, l_dst,
        seqlens if bounds is None else bounds, h_kv, group, s_q, d, splits, block or 0,
        0 if bounds is None else bounds.stride(0), 1.0 / math.sqrt(d) if scale is None else float(scale),
        *q.stride()[:3], *k_rows, *v_rows, *s_rows, *bt_strides, *o_dst.stride()[:4], *l_dst.stride(),
        FMT=FORMATS[k_cache.dtype], GRAN=GRANS.index(gran), PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == d, DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
        DOT_FP32=interpret, FAST_CVT=fast_cvt, DIAG=s_q > 1, PART=part, num_warps=num_warps, num_stages=num_stages,
        **launch,
    )


def _merge(o_parts, lse_parts, out, out_lse, h_kv):
    """The splits' merge into out (b, s_q, h_q, d) and out_lse (b, h_q, s_q): `_kvq_merge_kernel`, a program a
    (sequence, kv head, row block) (the interpreter ran lse_combine's program a row 3x slower)."""
    splits, b, s_q, h_q, d = o_parts.shape
    group = h_q // h_kv
    rows = s_q * group
    block_m = min(MERGE_ROWS, triton.next_power_of_2(rows))  # a GQA group of 4: 4 rows, not 16 (255 registers and
    # 224 bytes of spills a thread at 16 on the H200: a (4, 16, 128) tile of 64-bit addresses; 28 us at b 8)
    block_d = max(16, triton.next_power_of_2(d))
    block_s = max(2, min(MERGE_SPLITS, triton.next_power_of_2(splits)))
    _kvq_merge_kernel[(b * h_kv, triton.cdiv(rows, block_m))](
        o_parts, lse_parts, out, out_lse, h_kv, group, s_q, d, splits,
        *o_parts.stride()[:4], *lse_parts.stride(), *out.stride()[:3], *out_lse.stride(),
        BLOCK_S=block_s, BLOCK_M=block_m, BLOCK_D=block_d,
    )


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
           v_scale: torch.Tensor, seqlens: torch.Tensor, *, scale: float | None = None,
           out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None, splits: int | None = None,
           config: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode of s_q new tokens a sequence over a contiguous quantized cache.

    q: (b, s_q, h_q, d) fp32 / fp16 / bf16, d <= 256, last-dim stride 1; the last s_q tokens (causal bottom-right)
    k_cache, v_cache: (b, s_max, h_kv, d) int8 | float8_e4m3fn | float8_e5m2, last-dim stride 1
    k_scale, v_scale: float32 (1,) per tensor, (h_kv,) per kv head, or (b, s_max, h_kv) per token
    seqlens: (b,) int32, 0 <= seqlens[b] <= s_max (the caller's guarantee): cached tokens, the queries' included
    out: (b, s_q, h_q, d) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32 (allocated if None)
    splits: key ranges a sequence; None: 1 up to SPLIT_KEYS_CPU keys on the interpreter (more: one a 512 keys),
        on a GPU enough for SPLIT_PROGRAMS_PER_SM programs an SM, at least MIN_SPLIT_KEYS keys a split
    returns (out, out_lse): LSE natural log, -inf (and O = 0) for a query that sees no key
    """
    op = "kvquant.decode"
    gran = _check(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, None)
    b, s_q, h_q, d = q.shape
    out = _out(op, "out", out, (b, s_q, h_q, d), q.dtype, q, unit_last=True)
    out_lse = _out(op, "out_lse", out_lse, (b, h_q, s_q), torch.float32, q)
    if b == 0 or h_q == 0 or s_q == 0:
        return out, out_lse
    s_max, h_kv = k_cache.shape[1], k_cache.shape[2]
    if splits is None:
        if not q.is_cuda:
            splits = max(1, triton.cdiv(s_max, SPLIT_KEYS_CPU))
        else:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            want = max(1, triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, b * h_kv))
            splits = max(1, min(want, triton.cdiv(s_max, MIN_SPLIT_KEYS)))
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"{op}: splits={splits!r} must be an int >= 1")
    if splits == 1:
        _launch(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, None, gran, 1, out.unsqueeze(0),
                out_lse.unsqueeze(0), scale, config)
        return out, out_lse
    o_parts = torch.empty((splits, b, s_q, h_q, d), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((splits, b, h_q, s_q), dtype=torch.float32, device=q.device)
    _launch(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, None, gran, splits, o_parts, lse_parts, scale, config)
    _merge(o_parts, lse_parts, out, out_lse, k_cache.shape[2])
    return out, out_lse


def decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, seqlens: torch.Tensor, splits: int, *, block_table: torch.Tensor | None = None,
                 scale: float | None = None, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 out_o_parts: torch.Tensor | None = None, out_lse_parts: torch.Tensor | None = None,
                 config: tuple[int, ...] | None = None, block: int | None = None, bounds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash decoding: `splits` key ranges a sequence, their partials and merge.

    q, k_cache, v_cache, k_scale, v_scale, seqlens: as `decode`; with block_table (b, max_pages) int32 the caches
    are pages (num_blocks, page, h_kv, d) and per-token scales (num_blocks, page, h_kv), seqlens[b] <= max_pages
    * page, table entries past a sequence's last page never read
    the partition (refimpl.attention.split_bounds): equal counts (ceil(L_b / splits) keys each) by default;
    block: fixed blocks of `block` keys (splits x block >= every length: the caller's guarantee, as seqlens);
    bounds: (b, splits + 1) int32 / int64 on q's device, cumulative, non-decreasing from 0 to at least each
    length (the caller's guarantee; split s covers [bounds[b, s], bounds[b, s + 1]) cut to [0, L_b))
    out, out_lse: as `decode`; out_o_parts (splits, b, s_q, h_q, d) float32, last-dim stride 1 (0 for an empty
    split); out_lse_parts (splits, b, h_q, s_q) float32 (-inf for an empty split); allocated if None
    returns (out, out_lse, out_o_parts, out_lse_parts)
    """
    op = "kvquant.decode_split"
    gran = _check(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table)
    if not isinstance(splits, int) or not 1 <= splits <= 65535:
        raise ValueError(f"{op}: splits={splits!r} must be an int in [1, 65535]")
    b, s_q, h_q, d = q.shape
    out = _out(op, "out", out, (b, s_q, h_q, d), q.dtype, q, unit_last=True)
    out_lse = _out(op, "out_lse", out_lse, (b, h_q, s_q), torch.float32, q)
    o_parts = _out(op, "out_o_parts", out_o_parts, (splits, b, s_q, h_q, d), torch.float32, q, unit_last=True)
    lse_parts = _out(op, "out_lse_parts", out_lse_parts, (splits, b, h_q, s_q), torch.float32, q)
    if block is not None and bounds is not None:
        raise ValueError(f"{op}: give block or bounds, not both")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or not 1 <= block < 2**31):
        raise ValueError(f"{op}: block={block!r} must be an int in [1, 2^31)")
    if bounds is not None and (not isinstance(bounds, torch.Tensor) or tuple(bounds.shape) != (b, splits + 1)
                               or bounds.dtype not in (torch.int32, torch.int64) or bounds.device != q.device
                               or (splits > 0 and bounds.stride(1) != 1)):
        raise ValueError(f"{op}: bounds must be a ({b}, {splits + 1}) int32 / int64 tensor on {q.device} with unit "
                         f"last stride, got {getattr(bounds, 'shape', type(bounds).__name__)} "
                         f"{getattr(bounds, 'dtype', '')}")
    if b == 0 or h_q == 0 or s_q == 0:
        return out, out_lse, o_parts, lse_parts
    _launch(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table, gran, splits, o_parts, lse_parts, scale,
            config, block, bounds)
    _merge(o_parts, lse_parts, out, out_lse, k_cache.shape[2])
    return out, out_lse, o_parts, lse_parts
