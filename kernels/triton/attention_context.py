"""Context attention that writes the KV cache, fused in one Triton launch (TensorRT-LLM's
context_attention_kv).

    cache[b, input_pos_b + t] = k_t, v_t              the chunk's K/V appended (through the block table)
    s_ij  = scale * q_i . k_j                         query i of sequence b sits at input_pos_b + i
    LSE_i = ln sum_{j <= input_pos_b + i} exp(s_ij);  O_i = sum_j exp(s_ij - LSE_i) v_j

Conventions (golden: refimpl.attention.context_kv; chunked_prefill's otherwise): q, k, v packed
(total, h, d) with cu_seqlens (TensorRT-LLM's seq_start = cu_seqlens[:-1], seq_len its diff), zero-length
sequences allowed (they write nothing); input_pos (b,) the tokens already cached; caches (b, s_max, h_kv, d)
or pages (num_blocks, page, h_kv, d) through a block table; causal bottom-right; LSE (h_q, total), natural
log; fp32 accumulation. The caches are written in place; no other slot is touched.

One launch, race-free: a program (BLOCK_M queries of one head of one sequence) attends the history
(cache slots 0 .. input_pos_b - 1, which no program writes) and the chunk's own keys read from the new
k / v (never from the cache slots this launch is writing); the first query head of each kv group writes
its block's K/V rows into the cache. So no program reads a slot another writes, and the order in which
programs run cannot change a bit. The arithmetic is the chunked-prefill kernel's (FlashAttention-2 online
softmax, log2-domain logits, interior tiles without mask arithmetic; attention_chunked._chunk_tiles).

References: TensorRT-LLM auto_deploy's Triton context_attention_kv (flattened and paged); vLLM's chunked
prefill; Dao, "FlashAttention-2" (2023).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import PREFILL_CONFIGS, _check_common, _check_out
from .attention_chunked import _check_index, _chunk_tiles
from .softmax import LN2


@triton.jit
def _context_kv_kernel(
    Q_ptr, K_ptr, V_ptr, Kc_ptr, Vc_ptr, O_ptr, Lse_ptr, Cu_ptr, Pos_ptr, BT_ptr,
    n_m_blocks, group, d, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt_b, stride_bt_p, stride_ot, stride_oh, stride_lh, stride_lt,
    PAGED: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Query blocks vary fastest (heaviest, last, first), then heads; grid axis 1 is the sequence.
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    head = pid // n_m_blocks
    b = tl.program_id(1)
    kv_head = head // group
    q0 = tl.load(Cu_ptr + b)
    L_q = tl.load(Cu_ptr + b + 1) - q0
    hist = tl.load(Pos_ptr + b)
    m0 = pid_m * BLOCK_M
    if m0 >= L_q:  # past the chunk (every block of an empty one): no rows, nothing written
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < L_q
    mask_md = mask_m[:, None] & (offs_d < d)[None, :]
    rows = q0.to(tl.int64) + offs_m
    Kn_base = K_ptr + q0.to(tl.int64) * stride_kt + kv_head.to(tl.int64) * stride_kh
    Vn_base = V_ptr + q0.to(tl.int64) * stride_vt + kv_head.to(tl.int64) * stride_vh
    if PAGED:
        Kc_base = Kc_ptr + kv_head.to(tl.int64) * stride_kch
        Vc_base = Vc_ptr + kv_head.to(tl.int64) * stride_vch
        bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    else:
        Kc_base = Kc_ptr + b.to(tl.int64) * stride_kcb + kv_head.to(tl.int64) * stride_kch
        Vc_base = Vc_ptr + b.to(tl.int64) * stride_vcb + kv_head.to(tl.int64) * stride_vch
        bt_row = BT_ptr

    # The write: one program per (query block, kv head) copies its rows of the chunk to input_pos + t.
    if head % group == 0:
        slot = hist + offs_m
        if PAGED:
            page = tl.load(bt_row + (slot // PAGE) * stride_bt_p, mask=mask_m, other=0)
            kc_rows = page.to(tl.int64) * stride_kcb + (slot % PAGE) * stride_kcs
            vc_rows = page.to(tl.int64) * stride_vcb + (slot % PAGE) * stride_vcs
        else:
            kc_rows = slot.to(tl.int64) * stride_kcs
            vc_rows = slot.to(tl.int64) * stride_vcs
        k_new = tl.load(Kn_base + offs_m[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=mask_md)
        v_new = tl.load(Vn_base + offs_m[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=mask_md)
        tl.store(Kc_base + kc_rows[:, None] + offs_d[None, :], k_new, mask=mask_md)
        tl.store(Vc_base + vc_rows[:, None] + offs_d[None, :], v_new, mask=mask_md)

    q = tl.load(Q_ptr + rows[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :],
                mask=mask_md, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # fp32 accumulator of sum_j p_ij v_j

    # History: cache slots 0 .. hist - 1, below every query's diagonal (whole tiles unmasked, the tail
    # tile masked at hist). The chunk's slots are never read here: they are being written.
    n_hist = hist
    full_h = (n_hist // BLOCK_N) * BLOCK_N
    diag = offs_m  # query i's own key is chunk key i (absolute position hist + i)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, Kc_base, Vc_base, bt_row, 0, full_h, diag, offs_n, offs_d, offs_d,
        n_hist, 0, 0, d, d, stride_kcb, stride_kcs, stride_vcb, stride_vcs, stride_bt_p, qk_scale, 0.0,
        False, False, False, False, PAGED, PAGE, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, Kc_base, Vc_base, bt_row, full_h, n_hist, diag, offs_n, offs_d, offs_d,
        n_hist, 0, 0, d, d, stride_kcb, stride_kcs, stride_vcb, stride_vcs, stride_bt_p, qk_scale, 0.0,
        True, False, False, False, PAGED, PAGE, EVEN_D, BLOCK_N, DOT_PRECISION)
    # The chunk: keys 0 .. min(m0 + BLOCK_M, L_q) - 1 from the new k / v rows, causal (key j <= query i):
    # tiles wholly at or below the block's first row unmasked, the diagonal tiles masked.
    chunk_end = tl.minimum(m0 + BLOCK_M, L_q)
    full_c = (tl.minimum(m0 + 1, chunk_end) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, Kn_base, Vn_base, bt_row, 0, full_c, diag, offs_n, offs_d, offs_d,
        L_q, 0, 0, d, d, 0, stride_kt, 0, stride_vt, stride_bt_p, qk_scale, 0.0,
        False, False, True, False, False, 1, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, Kn_base, Vn_base, bt_row, full_c, chunk_end, diag, offs_n, offs_d, offs_d,
        L_q, 0, 0, d, d, 0, stride_kt, 0, stride_vt, stride_bt_p, qk_scale, 0.0,
        True, False, True, False, False, 1, EVEN_D, BLOCK_N, DOT_PRECISION)

    # Every row sees at least its own key: l_i >= 1.
    o = acc * (1.0 / l_i)[:, None]
    tl.store(O_ptr + rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_d[None, :],
             o.to(O_ptr.dtype.element_ty), mask=mask_md)
    lse = (m_i + tl.log2(l_i)) * LN2
    tl.store(Lse_ptr + head.to(tl.int64) * stride_lh + rows * stride_lt, lse, mask=mask_m)


def context_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cu_seqlens: torch.Tensor, input_pos: torch.Tensor, max_seqlen: int, *,
               block_table: torch.Tensor | None = None, scale: float | None = None, out: torch.Tensor | None = None,
               out_lse: torch.Tensor | None = None,
               config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the chunk's K/V to the caches (in place) and attend its queries to history + chunk.

    q: (total, h_q, d); k, v: (total, h_kv, d), sequence b's tokens rows cu_seqlens[b]:cu_seqlens[b + 1]
    k_cache, v_cache: (b, s_max, h_kv, d), or pages (num_blocks, page, h_kv, d) with block_table
        (b, max_blocks) int32: position t of sequence b at cache[block_table[b, t // page], t % page];
        slots 0 .. input_pos_b - 1 hold the history; the table covers input_pos_b + L_b positions and no
        two sequences share a written page; written in place (q's dtype, last-dim stride 1)
    cu_seqlens: (b + 1,) int32 from 0; input_pos: (b,) int32 >= 0
    max_seqlen: host int >= every chunk length (sizes the grid)
    out: (total, h_q, d) q's dtype; out_lse: (h_q, total) float32
    returns: (out, out_lse); causal bottom-right (query i sees keys j <= input_pos_b + i)
    """
    _check_common(q, k, v, "bottom_right", (-1, -1), 0.0, None, h_axis=-2, scale=scale)
    _check_common(q, k_cache, v_cache, "bottom_right", (-1, -1), 0.0, None, h_axis=-2, scale=scale)
    if q.dim() != 3 or k.dim() != 3 or k_cache.dim() != 4 or k.shape[:2] != (q.shape[0], k_cache.shape[2]):
        raise ValueError(f"expected q (total, h_q, d), k / v (total, h_kv, d) and 4-D caches (.., h_kv, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(k_cache.shape)}")
    if v.shape[-1] != q.shape[-1] or v_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"v and v_cache head dims ({v.shape[-1]}, {v_cache.shape[-1]}) must equal d={q.shape[-1]}")
    b = cu_seqlens.shape[0] - 1 if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 else -1
    if b < 0:
        raise ValueError("cu_seqlens must be a 1-D (b + 1,) int32 tensor")
    _check_index(cu_seqlens, "cu_seqlens", (b + 1,), q.device)
    _check_index(input_pos, "input_pos", (b,), q.device)
    paged = block_table is not None
    if paged:
        _check_index(block_table, "block_table", (b, None), q.device)
    elif k_cache.shape[0] != b:
        raise ValueError(f"contiguous cache batch {k_cache.shape[0]} != {b} sequences (cu_seqlens)")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen={max_seqlen} must be >= 0")
    total, h_q, d = q.shape
    if out is None:
        out = torch.empty((total, h_q, d), dtype=q.dtype, device=q.device)
    _check_out(out, (total, h_q, d), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((h_q, total), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (h_q, total), torch.float32, q.device, "out_lse")
    if b == 0 or max_seqlen == 0 or total == 0:
        return out, out_lse

    block_d = max(16, triton.next_power_of_2(d))
    block_m, block_n, num_warps, num_stages = config or PREFILL_CONFIGS[(block_d, min(q.element_size(), 4))]
    if paged and config is None:
        num_stages = min(num_stages, 2)  # as chunked_prefill: ptxas and 3-stage gathered paged tiles
    n_m = triton.cdiv(max_seqlen, block_m)
    if n_m * h_q >= 2**31 or b > 65535:
        raise ValueError(f"grid ({n_m} query blocks x {h_q} heads, {b} sequences) exceeds CUDA's limits")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _context_kv_kernel[(n_m * h_q, b)](
        q, k, v, k_cache, v_cache, out, out_lse, cu_seqlens, input_pos, block_table if paged else input_pos,
        n_m, h_q // k_cache.shape[2], d, scale * 1.4426950408889634,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(block_table.stride() if paged else (0, 0)), *out.stride()[:2], *out_lse.stride(),
        PAGED=paged, PAGE=k_cache.shape[1] if paged else 1, EVEN_D=block_d == d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, out_lse
