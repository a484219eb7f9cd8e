"""Chunked prefill over a quantized paged KV cache (kvquant.chunked_prefill), in Triton.

    logit_ij = scale * s_k(j) * (q_i . kc_j)          kc_j: key j's codes, converted exactly to q's dtype
    LSE_i = ln sum_{j <= hist_b + i} exp(logit_ij);  O_i = sum_{j <= hist_b + i} exp(logit_ij - LSE_i) s_v(j) vc_j

Golden: refimpl/kvquant_prefill.py (float64 code x scale, then attention.chunked_prefill's math). The cache
holds each sequence's history AND its chunk's own K / V as codes (the chunk was written by kvquant.update
first, vLLM's reshape_and_cache flow): sequence b's tokens 0 .. hist_b + L_q,b - 1 at
cache[block_table[b, t // page], t % page]. Query i of sequence b sits at position hist_b + i (causal
bottom-right); queries packed by cu_seqlens_q, LSE (h_q, total_q); an empty chunk writes nothing.

Codes and scales as kernels/triton/kvquant_decode.py: float8_e4m3fn, float8_e5m2 or int8 codes loaded as 8 bits
and converted exactly (every code is exact in bf16, fp16 and fp32) into the tensor-core dots; the scales stay
out of the dots: per tensor / per kv head s_k folds into the fp32 logit scale and s_v into the final 1 / l. Per
token the fp32 logits of a tile are multiplied by the tile's s_k(j) vector, and the probabilities by
s_v(j) / max_tile s_v before the P V dot, whose result the tile's max s_v scales: p s_v(j) itself falls below
fp16's normal range (e5m2's per-token scales are amax / 57344, ~1e-5) and loses bits a float-cache kernel's P
keeps; scaled to [0, 1] it rounds as a float-cache kernel's P does. Emulated on the interpreter with fp16 dot
operands (the GPU's rounding; ci's per-token fp16 cases, e5m2 / e4m3 / int8, seed 1): worst |O error| 6.4e-4
max|O| with p s_v(j), 3.5e-4 scaled; cos_diff 3-5e-8 either way (limit 1e-6). Not yet run on a GPU.
On the interpreter (a CPU tensor) the dots take fp32 operands, as kvquant_decode.py explains (Triton 3.9's
interpreter miscomputes a tl.dot on an operand cast to bf16 in the kernel).

Algorithm: kernels/triton/attention_chunked.py's (FlashAttention-2 online softmax, fp32 accumulation,
log2-domain logits) with the GQA heads packed into the rows of a tile (FlashInfer's / FlashAttention-3's
PackGQA, as the decode kernel): a program takes one kv head of one sequence and BLOCK_M / GROUP_P queries of its
chunk, each with all its group of query heads (GQA: query head h reads kv head h // (h_q / h_kv); GROUP_P the
group padded to a power of two), so each code byte of a tile is read once for the whole group. Keys below
hist_b + m0 + 1 (m0 the block's first query), visible to every row, go in interior tiles without mask
arithmetic; the tiles from there to the block's last query's own key take the causal mask. Tiles gather their
rows through the block table, so any page size works.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kvquant_decode import FORMATS, GRANS, MAX_HEAD_DIM, _code_view, _codes, check_cache

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, BLOCK_M rows = queries x padded GQA group
# (raised to the group if smaller): guesses, unmeasured on a GPU.
CONFIGS = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 32, 4, 2)}


@triton.jit
def _tiles(acc, l_i, m_i, q, K_base, V_base, KS_ptr, VS_ptr, bt_row, start, end, diag, offs_n, offs_d, mask_d,
           kv_head, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh,
           stride_bt_p, MASK: tl.constexpr, FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr,
           BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update over key tiles [start, end); MASK=False: every key visible to every row (no mask
    built); MASK=True: keys at or past `end` not loaded, key j kept for row i where j <= diag_i."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        live = cols < end
        if MASK:
            page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + (cols // PAGE) * stride_bt_p).to(tl.int64)
        slot = cols % PAGE
        k_ptrs = K_base + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None]
        v_ptrs = V_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        if MASK:
            kmask = live[None, :]
            vmask = live[:, None]
            if not EVEN_D:
                kmask = kmask & mask_d[:, None]
                vmask = vmask & mask_d[None, :]
            kc = tl.load(k_ptrs, mask=kmask, other=0)
            vc = tl.load(v_ptrs, mask=vmask, other=0)
        elif EVEN_D:
            kc = tl.load(k_ptrs)
            vc = tl.load(v_ptrs)
        else:
            kc = tl.load(k_ptrs, mask=mask_d[:, None], other=0)
            vc = tl.load(v_ptrs, mask=mask_d[None, :], other=0)
        k = _codes(kc, FMT, q.dtype)
        v = _codes(vc, FMT, q.dtype)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # fp32, log2 domain
        if GRAN == 2:
            s_off = page * stride_sb + slot * stride_ss + kv_head * stride_sh
            if MASK:
                sk = tl.load(KS_ptr + s_off, mask=live, other=0.0)
                svj = tl.load(VS_ptr + s_off, mask=live, other=0.0)
            else:
                sk = tl.load(KS_ptr + s_off)
                svj = tl.load(VS_ptr + s_off)
            qk = qk * sk[None, :]
        if MASK:
            qk = tl.where(live[None, :] & (cols[None, :] <= diag[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = m_new
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if GRAN == 2:  # p s_v(j) / max_j s_v(j) in [0, 1]: an fp16 operand keeps p's range (module docstring)
            sv_max = tl.max(svj, axis=0)
            sv_max = tl.where(sv_max > 0.0, sv_max, 1.0)
            pv = p * (svj / sv_max)[None, :]
            acc = acc * alpha[:, None] + sv_max * tl.dot(pv.to(q.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _kvq_chunked_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, BT_ptr, CuQ_ptr, Hist_ptr, O_ptr, Lse_ptr,
    n_m_blocks, h_kv, group, d, sm_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt_b, stride_bt_p, stride_ot, stride_oh, stride_lh, stride_lt,
    FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Query blocks vary fastest (heaviest, last, first), then kv heads; grid axis 1 is the sequence.
    BLOCK_Q = BLOCK_M // GROUP_P  # queries a program; each with its GROUP_P (padded) query heads
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    kv_head = pid // n_m_blocks
    b = tl.program_id(1)
    q0 = tl.load(CuQ_ptr + b)
    L_q = tl.load(CuQ_ptr + b + 1) - q0
    hist = tl.load(Hist_ptr + b)
    m0 = pid_m * BLOCK_Q
    if m0 >= L_q:  # past the chunk (an empty chunk: every block): nothing to write
        return
    r = tl.arange(0, BLOCK_M)
    offs_m = m0 + r // GROUP_P  # row r: query m0 + r // GROUP_P of query head kv_head * group + r % GROUP_P
    g = r % GROUP_P
    head = kv_head * group + g
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_m < L_q) & (g < group)
    mask_d = offs_d < d
    rows = q0.to(tl.int64) + offs_m
    q = tl.load(Q_ptr + rows[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :],
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

    # Query i sits at absolute position hist + i and keeps keys j <= diag_i = hist + i.
    diag = offs_m + hist
    end = hist + tl.minimum(m0 + BLOCK_Q, L_q)  # one past the block's last query's own key
    full = ((hist + m0 + 1) // BLOCK_N) * BLOCK_N  # keys below hist + m0 + 1: seen by every row
    K_base = K_ptr + kv_head.to(tl.int64) * stride_kh
    V_base = V_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, K_base, V_base, KS_ptr, VS_ptr, bt_row, 0, full, diag, offs_n, offs_d,
                           mask_d, kv_head, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb,
                           stride_ss, stride_sh, stride_bt_p, False, FMT, GRAN, PAGE, BLOCK_N, EVEN_D, DOT_PRECISION)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, K_base, V_base, KS_ptr, VS_ptr, bt_row, full, end, diag, offs_n, offs_d,
                           mask_d, kv_head, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb,
                           stride_ss, stride_sh, stride_bt_p, True, FMT, GRAN, PAGE, BLOCK_N, EVEN_D, DOT_PRECISION)

    o = acc * (sv / tl.where(l_i > 0.0, l_i, 1.0))[:, None]  # every stored row saw its own key: l > 0
    tl.store(O_ptr + rows[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :],
             o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + head.to(tl.int64) * stride_lh + rows * stride_lt, lse, mask=mask_m)


def check_args(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, hist, block_table) -> str:
    """ValueError (one line naming the argument) unless the arguments are valid; the granularity."""
    gk = check_cache("kvquant.chunked_prefill", "(total_q, h_q, d)", q, k_cache, v_cache, k_scale, v_scale,
                     cu_seqlens_q=cu_seqlens_q, hist=hist, block_table=block_table)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"kvquant.chunked_prefill: cu_seqlens_q must be (b + 1,) int32, got "
                         f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    b = cu_seqlens_q.shape[0] - 1
    if tuple(hist.shape) != (b,) or hist.dtype != torch.int32:
        raise ValueError(f"kvquant.chunked_prefill: hist must be ({b},) int32, got {tuple(hist.shape)} {hist.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise ValueError(f"kvquant.chunked_prefill: block_table must be ({b}, max_pages) int32, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    return gk


def chunked_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, hist: torch.Tensor, block_table: torch.Tensor,
                    max_seqlen_q: int, *, scale: float | None = None, out: torch.Tensor | None = None,
                    out_lse: torch.Tensor | None = None,
                    config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed query chunks over a paged quantized cache holding each sequence's history and chunk.

    q: (total_q, h_q, d) fp32 / fp16 / bf16, d <= 256, last-dim stride 1; sequence b's queries are rows
        cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    k_cache, v_cache: (num_blocks, page, h_kv, d) int8 | float8_e4m3fn | float8_e5m2, last-dim stride 1; sequence
        b's tokens 0 .. hist_b + L_q,b - 1 (history, then the chunk's own, written before the call)
    k_scale, v_scale: float32 (1,) per tensor, (h_kv,) per kv head, or (num_blocks, page, h_kv) per token
    cu_seqlens_q: (b + 1,) int32 non-decreasing from 0; hist: (b,) int32 >= 0 (the caller's guarantee)
    block_table: (b, max_pages) int32, hist_b + L_q,b <= max_pages * page; entries past a sequence's last page
        are never read
    max_seqlen_q: host int >= every chunk length (sizes the grid)
    out: (total_q, h_q, d) q's dtype, last-dim stride 1; out_lse: (h_q, total_q) float32 (allocated if None)
    returns (out, out_lse): LSE natural log; rows of an empty chunk: none
    """
    gran = check_args(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, hist, block_table)
    total_q, h_q, d = q.shape
    nb, page, h_kv, _ = k_cache.shape
    b = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty((total_q, h_q, d), dtype=q.dtype, device=q.device)
    if tuple(out.shape) != (total_q, h_q, d) or out.dtype != q.dtype or out.device != q.device or \
            (d > 1 and out.stride(-1) != 1):
        raise ValueError(f"kvquant.chunked_prefill: out must be ({total_q}, {h_q}, {d}) {q.dtype} with last-dim "
                         f"stride 1")
    if out_lse is None:
        out_lse = torch.empty((h_q, total_q), dtype=torch.float32, device=q.device)
    if tuple(out_lse.shape) != (h_q, total_q) or out_lse.dtype != torch.float32 or out_lse.device != q.device:
        raise ValueError(f"kvquant.chunked_prefill: out_lse must be ({h_q}, {total_q}) float32 on {q.device}")
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"kvquant.chunked_prefill: max_seqlen_q={max_seqlen_q!r} must be an int >= 0")
    if b == 0 or total_q == 0 or h_q == 0 or max_seqlen_q == 0:
        return out, out_lse
    block_d = max(16, triton.next_power_of_2(d))
    block_m, block_n, num_warps, num_stages = config or CONFIGS[block_d]
    group_p = triton.next_power_of_2(h_q // h_kv)
    block_m = max(block_m, group_p)
    n_m = triton.cdiv(max_seqlen_q, block_m // group_p)
    if n_m * h_kv >= 2**31 or b > 65535:
        raise ValueError(f"kvquant.chunked_prefill: grid ({n_m * h_kv}, {b}) exceeds CUDA's limits")
    s_strides = k_scale.stride() if gran == "token" else (0, 0, 0)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    interpret = not q.is_cuda  # the interpreter: dots in fp32 (module docstring)
    _kvq_chunked_kernel[(n_m * h_kv, b)](
        q, _code_view(k_cache), _code_view(v_cache), k_scale, v_scale, block_table, cu_seqlens_q, hist, out, out_lse,
        n_m, h_kv, h_q // h_kv, d, sm_scale,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *s_strides, *block_table.stride(),
        *out.stride()[:2], *out_lse.stride(),
        FMT=FORMATS[k_cache.dtype], GRAN=GRANS.index(gran), PAGE=page, GROUP_P=group_p, BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32", DOT_FP32=interpret,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, out_lse
