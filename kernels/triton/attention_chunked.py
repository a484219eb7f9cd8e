"""Chunked prefill over a KV cache that already holds history (contiguous or paged), in Triton.

    L_k,b = hist_b + L_q,b                      the cache holds the history, then the chunk's own keys
    s_ij  = scale * q_i . k_j  (softcap, mask)  query i of sequence b sits at position hist_b + i
    LSE_i = ln sum_j exp(s_ij);  O_i = sum_j exp(s_ij - LSE'_i) v_j   (LSE' with the sink, if any)

Conventions (golden: refimpl.attention.chunked_prefill; as kernels/triton/attention.py otherwise):
queries are packed as FlashAttention's varlen layout (cu_seqlens_q, LSE (h_q, total_q)); the cache
is (b, s_max, h_kv, d) or pages (num_blocks, page, h_kv, d) through a block table (vLLM's and
TensorRT-LLM's paged context attention, after the chunk's keys were written with kvcache.update).
bottom_right causal keeps keys j <= hist_b + i, the diagonal of FlashAttention's bottom-right rule
with L_k = hist_b + L_q; a window (left, right) lies on the same diagonal. A sequence with no
queries writes nothing; one with no history is a plain causal prefill. Cache slots at or past
L_k,b, and table entries past its last page, are never read.

Algorithm: the prefill kernel's (one program per BLOCK_M queries of one head of one sequence,
FlashAttention-2 online softmax, fp32 accumulation, log2-domain logits, tiles outside the mask never
loaded, interior tiles without mask arithmetic), with K/V rows addressed through the cache layout:
a paged tile gathers its rows through the block table, so any page size works (BLOCK_N need not
divide it). The two layouts share every arithmetic step, so they give the same bits.

References: vLLM's chunked prefill (prefix + chunk in one varlen call); TensorRT-LLM's paged context
FMHA; Dao, "FlashAttention-2" (2023).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import PREFILL_CONFIGS, _check_common, _check_out, _tanh, _window_tiles
from .softmax import LN2, LOG2E

CAUSAL = ("bottom_right", "none")


@triton.jit
def _chunk_tiles(
    acc, l_i, m_i, q, K_base, V_base, bt_row, start, end, diag, offs_n, offs_d, offs_dv,
    L_k, left, right, d, d_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt_p, qk_scale, softcap_out,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update over key tiles [start, end); MASK=False: interior tiles, every key valid
    for every row (no mask built, no row all -inf); MASK=True: edge tiles, masked loads and logits."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        live = cols < L_k  # keys at or past L_k may hold NaN: never loaded
        if PAGED:
            if MASK:
                page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0)
            else:
                page = tl.load(bt_row + (cols // PAGE) * stride_bt_p)
            k_rows = page.to(tl.int64) * stride_kb + (cols % PAGE) * stride_ks
            v_rows = page.to(tl.int64) * stride_vb + (cols % PAGE) * stride_vs
        else:
            k_rows = cols.to(tl.int64) * stride_ks
            v_rows = cols.to(tl.int64) * stride_vs
        k_ptrs = K_base + k_rows[None, :] + offs_d[:, None]
        v_ptrs = V_base + v_rows[:, None] + offs_dv[None, :]
        if MASK:
            kmask = live[None, :]
            vmask = live[:, None]
            if not EVEN_D:
                kmask = kmask & (offs_d < d)[:, None]
                vmask = vmask & (offs_dv < d_v)[None, :]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(offs_d < d)[:, None], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # fp32 accumulation
        if SOFTCAP:
            qk = _tanh(qk * qk_scale) * softcap_out  # qk_scale = scale / cap, softcap_out = cap * log2 e
        else:
            qk = qk * qk_scale  # scale * log2 e: log2-domain logits
        if MASK:
            keep = live[None, :]
            if HAS_LEFT:
                keep = keep & (cols[None, :] >= diag[:, None] - left)
            if HAS_RIGHT:
                keep = keep & (cols[None, :] <= diag[:, None] + right)
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = m_new
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # fp32 running sum
        if MASK:
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_dv < d_v)[None, :], other=0.0)
        # P rounded to V's dtype for the tensor cores, as FlashAttention does; acc stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_chunked_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, Lse_ptr, Sinks_ptr, CuQ_ptr, Hist_ptr, BT_ptr, Loc_ptr,
    n_m_blocks, group, d, d_v, qk_scale, softcap_out, left, right,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt_b, stride_bt_p, stride_ot, stride_oh, stride_lh, stride_lt,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_LOC: tl.constexpr,
):
    # Query blocks vary fastest (heaviest, last, first), then heads; grid axis 1 is the sequence.
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    head = pid // n_m_blocks
    b = tl.program_id(1)
    kv_head = head // group
    q0 = tl.load(CuQ_ptr + b)
    L_q = tl.load(CuQ_ptr + b + 1) - q0
    hist = tl.load(Hist_ptr + b)
    L_k = hist + L_q
    m0 = pid_m * BLOCK_M
    if m0 >= L_q:
        return
    row = b  # the sequence's cache row / block-table row: cache_loc[b] (TensorRT-LLM), else b
    if HAS_LOC:
        row = tl.load(Loc_ptr + b)
    if PAGED:
        K_base = K_ptr + kv_head.to(tl.int64) * stride_kh
        V_base = V_ptr + kv_head.to(tl.int64) * stride_vh
        bt_row = BT_ptr + row.to(tl.int64) * stride_bt_b
    else:
        K_base = K_ptr + row.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
        V_base = V_ptr + row.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
        bt_row = BT_ptr

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < L_q
    rows = q0.to(tl.int64) + offs_m
    q = tl.load(Q_ptr + rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d < d)[None, :], other=0.0)

    # Query i sits at absolute position hist + i: row i keeps diag_i - left <= j <= diag_i + right.
    diag = offs_m + hist
    lo, hi, full_lo, full_hi = _window_tiles(m0, tl.minimum(m0 + BLOCK_M, L_q) - 1, hist, L_k, left, right,
                                             HAS_LEFT, HAS_RIGHT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fp32 accumulator of sum_j p_ij v_j
    # Edge tiles below the window's interior, interior tiles (no mask), edge tiles above it.
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, K_base, V_base, bt_row, lo, tl.minimum(full_lo, hi), diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt_p, qk_scale, softcap_out,
        True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, PAGE, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, K_base, V_base, bt_row, full_lo, full_hi, diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt_p, qk_scale, softcap_out,
        False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, PAGE, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, K_base, V_base, bt_row, full_hi, hi, diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_bt_p, qk_scale, softcap_out,
        True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, PAGE, EVEN_D, BLOCK_N, DOT_PRECISION)

    den = l_i  # a row that saw no key has l = 0 and acc = 0: the clamped denominator writes O = 0
    if HAS_SINK:
        sink2 = tl.load(Sinks_ptr + head).to(tl.float32) * LOG2E
        den = l_i + tl.exp2(sink2 - tl.where(m_i == float("-inf"), 0.0, m_i))
    o = acc * (1.0 / tl.where(den > 0.0, den, 1.0))[:, None]
    tl.store(O_ptr + rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_dv[None, :],
             o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < d_v)[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + head.to(tl.int64) * stride_lh + rows * stride_lt, lse, mask=mask_m)


def _check_index(t, name: str, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device or t.dim() != len(shape) \
            or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("n" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must be a ({want}) int32 tensor on {device}, got "
                         f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}")


def chunked_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    hist: torch.Tensor, max_seqlen_q: int, *, block_table: torch.Tensor | None = None,
                    scale: float | None = None, causal: str = "bottom_right", window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    out_lse: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
                    cache_loc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill: packed query chunks attend to each sequence's cached history and own keys.

    q: (total_q, h_q, d); sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    k_cache, v_cache: (b, s_max, h_kv, d | d_v), or pages (num_blocks, page, h_kv, d | d_v) with
        block_table (b, max_blocks) int32 (any strides): token t of sequence b at
        cache[block_table[b, t // page], t % page]; the caller wrote the chunk's keys at hist_b..
        hist_b + L_q,b - 1; one dtype of fp32/fp16/bf16, last-dim stride 1
    cu_seqlens_q: (b + 1,) int32 from 0; hist: (b,) int32 >= 0, tokens cached before the chunk
    max_seqlen_q: host int >= every chunk length (sizes the grid)
    causal: "bottom_right" (query i sees keys j <= hist_b + i) or "none"; window, softcap, sinks,
        scale: as kernels.triton.attention.prefill
    out: (total_q, h_q, d_v) q's dtype, last-dim stride 1; out_lse: (h_q, total_q) float32
    cache_loc: (b,) int32, or None: sequence b reads cache row / block-table row cache_loc[b] (TensorRT-LLM;
        the cache / table may then hold any number of rows); None: row b
    returns: (out, out_lse); LSE natural log, excluding the sink; empty chunks write nothing
    """
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {CAUSAL} for chunked prefill, got {causal!r}")
    left, right = _check_common(q, k_cache, v_cache, causal, window, softcap, sinks, h_axis=-2, scale=scale)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q (total_q, h_q, d) and 4-D caches, got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    b = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else -1
    if b < 0:
        raise ValueError("cu_seqlens_q must be a 1-D (b + 1,) int32 tensor")
    _check_index(cu_seqlens_q, "cu_seqlens_q", (b + 1,), q.device)
    _check_index(hist, "hist", (b,), q.device)
    paged = block_table is not None
    if cache_loc is not None:
        _check_index(cache_loc, "cache_loc", (b,), q.device)
        rows = block_table.shape[0] if paged and isinstance(block_table, torch.Tensor) else k_cache.shape[0]
        if b and (int(cache_loc.min()) < 0 or int(cache_loc.max()) >= rows):
            raise ValueError(f"cache_loc must lie in [0, {rows}) (the {'block table' if paged else 'cache'}'s rows)")
    if paged:
        _check_index(block_table, "block_table", (b if cache_loc is None else None, None), q.device)
        page = k_cache.shape[1]
    elif k_cache.shape[0] != b and cache_loc is None:
        raise ValueError(f"contiguous cache batch {k_cache.shape[0]} != {b} sequences (cu_seqlens_q)")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} must be >= 0")
    total_q, h_q, d = q.shape
    d_v = v_cache.shape[-1]
    if out is None:
        out = torch.empty((total_q, h_q, d_v), dtype=q.dtype, device=q.device)
    _check_out(out, (total_q, h_q, d_v), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((h_q, total_q), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (h_q, total_q), torch.float32, q.device, "out_lse")
    if b == 0 or max_seqlen_q == 0 or total_q == 0:
        return out, out_lse

    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    block_m, block_n, num_warps, num_stages = config or PREFILL_CONFIGS[(max(block_d, block_dv),
                                                                         min(q.element_size(), 4))]
    if paged and config is None:
        # ptxas (CUDA 13, Triton 3.6, sm_90a) segfaults on the 3-stage pipeline of the gathered paged
        # tiles (seen: bf16, d = 32, pages of 16, softcap; 2 stages, or 3 with smaller tiles, compile)
        num_stages = min(num_stages, 2)
    n_m = triton.cdiv(max_seqlen_q, block_m)
    if n_m * h_q >= 2**31 or b > 65535:
        raise ValueError(f"grid ({n_m} query blocks x {h_q} heads, {b} sequences) exceeds CUDA's limits")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    softcap = float(softcap)
    _attention_chunked_kernel[(n_m * h_q, b)](
        q, k_cache, v_cache, out, out_lse, sinks if sinks is not None else out_lse, cu_seqlens_q, hist,
        block_table if paged else hist, cache_loc if cache_loc is not None else hist,
        n_m, h_q // k_cache.shape[2], d, d_v, scale / softcap if softcap else scale * 1.4426950408889634,
        softcap * 1.4426950408889634, left, right,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(block_table.stride() if paged else (0, 0)), *out.stride()[:2], *out_lse.stride(),
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0, HAS_SINK=sinks is not None,
        PAGED=paged, PAGE=page if paged else 1, EVEN_D=block_d == d and block_dv == d_v,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_LOC=cache_loc is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, out_lse
