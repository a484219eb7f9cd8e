"""Decode attention over a KV cache (contiguous or paged) and split-KV flash decoding, in Triton.

    s_ij  = scale * q_i . k_j  (then softcap, then mask)       j < L_b = seqlens[b]
    LSE_i = ln sum_j exp(s_ij);  O_i = sum_j exp(s_ij - LSE'_i) v_j   (LSE' with the sink, if any)

Conventions as kernels/triton/attention.py (goldens: refimpl.attention.decode, decode_paged,
decode_split): the s_q queries are the last s_q positions of each sequence (bottom_right by
default), seqlens may be 0 (O = 0, LSE = -inf), cache slots at or past L_b and table entries past
a sequence's last page are never read.

Memory traffic is the whole cost of decode (2 * L * h_kv * d cache bytes against ~4 flops a
byte), so one program takes a kv head of one sequence and ALL its query heads and queries at
once: the M dimension of its dots is group * s_q (padded to >= 16 for the tensor cores), and each
K/V byte is read once however large the GQA group. The key loop is a FlashAttention-2 online
softmax with fp32 accumulation, logits in the log2 domain; a paged cache is gathered row by row
through the block table, so the page size only has to be >= 1 (16 and 64 are the tuned ones).

Split-KV ("flash decoding"): split s of sequence b covers keys [s C_b, min((s + 1) C_b, L_b)),
C_b = ceil(L_b / splits) (refimpl.attention.split_bounds). Stage 1 (this file's kernel, SPLIT)
writes each split's normalised fp32 O and its LSE (-inf when empty); stage 2 is
kernels.triton.combine.lse_combine over rows flattened as (b, s_q, h_q); the sink, if any, enters
after the merge (`_decode_finish_kernel`: O *= 1 / (1 + exp(S_h - LSE))). `decode` and
`decode_paged` split on their own when b * h_kv programs cannot fill the GPU. `decode_split` also
takes fixed blocks or explicit boundaries (kernels.triton.attention_split: a request with one
split skips the merge, its stage-1 program writes O and LSE), and a paged cache (TensorRT-LLM's
paged generate, 256-key blocks over pages): PAGED and SPLIT together, every key looked up through
its own page t // PAGE, so a split may start or end inside a page.

d_v may differ from d, and V may be a view of K's first d_v dims (one buffer, K's row stride);
decode takes head dims up to 576 (FlashMLA's 576 / 512 as plain attention; the padded 1024-wide
tile is for correctness, kernels.triton.mla is the fast MLA kernel).

References: Dao et al., "Flash-Decoding for long-context inference" (2023); FlashInfer's decode
with GQA head packing; vLLM's paged attention layout.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import _check_common, _check_out, _tanh
from .attention_split import PARTS, _split_count, _split_range, check_partition, combine_partitioned
from .attention_split import _auto_splits, _sm_count  # noqa: F401  (_sm_count: kernels.triton.mla's too)
from .combine import lse_combine
from .softmax import LN2, LOG2E

MAX_QUERIES = 16
MAX_DECODE_HEAD_DIM = 576
# (BLOCK_N, num_warps, num_stages) by (padded head dim, element size). 16-bit d = 128 measured on
# an H200 with Triton 3.6 (benchmarks/gpu_attention.py; paged bf16, b=64, 8192 tokens, h_q=32,
# h_kv=8, ms for pages of 16 / 64): (64, 4, 2) 0.493-0.497 / 0.487-0.496 (102-104% of copy
# bandwidth, which counts read + write); (64, 2, 2) 0.496 / 0.494; (64, 4, 3) 0.501-0.504;
# (128, 4, 3) 0.497-0.503; (32, 4, 3) 0.559 / 0.553; (128, 8, 3) 0.545 / 0.513. evict_first
# loads and a tl.range-pipelined loop measured the same. Other rows are unmeasured guesses.
DECODE_CONFIGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (16, 2): (128, 4, 3), (32, 2): (128, 4, 3), (64, 2): (128, 4, 3), (128, 2): (64, 4, 2), (256, 2): (32, 4, 3),
    (16, 4): (64, 4, 2), (32, 4): (64, 4, 2), (64, 4): (64, 4, 2), (128, 4): (32, 4, 2), (256, 4): (16, 4, 2),
    (512, 2): (16, 4, 2), (1024, 2): (16, 8, 2), (512, 4): (16, 4, 1), (1024, 4): (16, 8, 1),
}
# Rows of (query head, query) per program; a larger GQA group x s_q is tiled over grid axis 1.
MAX_BLOCK_M = 64


@triton.jit
def _attention_decode_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, Lse_ptr, Sinks_ptr, Seqlens_ptr, BT_ptr, Out_ptr, OutLse_ptr, Bounds_ptr, Loc_ptr,
    s_q, h_kv, group, d, d_v, n_splits, block, qk_scale, softcap_out, left, right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt_b, stride_bt_p, stride_o_split, stride_ob, stride_os, stride_oh,
    stride_l_split, stride_lb, stride_lh, stride_ls,
    stride_fo_b, stride_fo_s, stride_fo_h, stride_fl_b, stride_fl_h, stride_fl_s, stride_bd_b, stride_bd_s,
    TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PART: tl.constexpr, SINK_DIRECT: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_LOC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // h_kv
    kv_head = pid % h_kv
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(Seqlens_ptr + b)

    # Row m of the tile is query i = m // group of query head kv_head * group + m % group.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = group * s_q
    mask_m = offs_m < n_rows
    qi = offs_m // group
    head = kv_head * group + offs_m % group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q_ptr + b.to(tl.int64) * stride_qb + qi[:, None] * stride_qs + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & (offs_d < d)[None, :], other=0.0)

    start = 0
    end = L
    if SPLIT:
        if PART == 0:
            chunk = tl.cdiv(L, n_splits)
            start = tl.minimum(split * chunk, L)
            end = tl.minimum(start + chunk, L)
        else:
            start, end = _split_range(split, L, b, block, Bounds_ptr, stride_bd_b, stride_bd_s, PART)
    if TOP_LEFT:
        diag_off = 0
    else:
        diag_off = L - s_q
    diag = qi + diag_off
    lo = start
    hi = end
    if HAS_LEFT:
        lo = tl.maximum(lo, (pid_m * BLOCK_M) // group + diag_off - left)
    if HAS_RIGHT:
        hi = tl.minimum(hi, (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // group + diag_off + right + 1)

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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fp32 accumulator of sum_j p_ij v_j
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        live = cols < hi  # never past L_b: poisoned slots and pages are not loaded
        if PAGED:
            page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0)
            k_rows = page.to(tl.int64) * stride_kb + (cols % PAGE) * stride_ks
            v_rows = page.to(tl.int64) * stride_vb + (cols % PAGE) * stride_vs
        else:
            k_rows = cols.to(tl.int64) * stride_ks
            v_rows = cols.to(tl.int64) * stride_vs
        if EVEN_D:
            kmask = live[None, :]
            vmask = live[:, None]
        else:
            kmask = live[None, :] & (offs_d < d)[:, None]
            vmask = live[:, None] & (offs_dv < d_v)[None, :]
        k = tl.load(K_base + k_rows[None, :] + offs_d[:, None], mask=kmask, other=0.0)
        v = tl.load(V_base + v_rows[:, None] + offs_dv[None, :], mask=vmask, other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # fp32 accumulation
        if SOFTCAP:
            qk = _tanh(qk * qk_scale) * softcap_out
        else:
            qk = qk * qk_scale  # log2-domain logits
        keep = live[None, :]
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= diag[:, None] - left)
        if HAS_RIGHT:
            keep = keep & (cols[None, :] <= diag[:, None] + right)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    den = l_i
    if HAS_SINK:  # only without SPLIT: split partials take the sink after the merge
        sink2 = tl.load(Sinks_ptr + head, mask=mask_m, other=0.0).to(tl.float32) * LOG2E
        den = l_i + tl.exp2(sink2 - tl.where(m_i == float("-inf"), 0.0, m_i))
    o = acc * (1.0 / tl.where(den > 0.0, den, 1.0))[:, None]  # no key (and no sink): O = 0
    o_ptrs = (O_ptr + split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob
              + qi[:, None] * stride_os + head[:, None] * stride_oh + offs_dv[None, :])
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < d_v)[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    l_ptrs = (Lse_ptr + split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb
              + head * stride_lh + qi * stride_ls)
    tl.store(l_ptrs, lse, mask=mask_m)
    if PART != 0:  # a request with one non-empty split (or none) skips the merge: O and LSE from here
        n_req = _split_count(L, b, n_splits, block, Bounds_ptr, stride_bd_b, stride_bd_s, PART, BLOCK_S)
        if (n_req <= 1) & ((end > start) | ((n_req == 0) & (split == 0))):
            den_f = l_i
            if SINK_DIRECT:
                sink_f = tl.load(Sinks_ptr + head, mask=mask_m, other=0.0).to(tl.float32) * LOG2E
                den_f += tl.exp2(sink_f - tl.where(m_i == float("-inf"), 0.0, m_i))
            o_f = acc * (1.0 / tl.where(den_f > 0.0, den_f, 1.0))[:, None]
            fo_ptrs = (Out_ptr + b.to(tl.int64) * stride_fo_b + qi[:, None] * stride_fo_s
                       + head[:, None] * stride_fo_h + offs_dv[None, :])
            tl.store(fo_ptrs, o_f.to(Out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < d_v)[None, :])
            tl.store(OutLse_ptr + b.to(tl.int64) * stride_fl_b + head * stride_fl_h + qi * stride_fl_s, lse,
                     mask=mask_m)


@triton.jit
def _decode_finish_kernel(
    O_ptr, LseIn_ptr, LseOut_ptr, Sinks_ptr, h_q, s_q, d_v,
    stride_ob, stride_os, stride_oh, stride_ib, stride_is, stride_ih, stride_lb, stride_lh, stride_ls,
    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """After lse_combine: O *= 1 / (1 + exp(S_h - LSE)) with a sink, and LSE moved from the
    combine's (b, s_q, h_q) row order into out_lse's (b, h_q, s_q) strides."""
    pid = tl.program_id(0)
    b = pid // s_q
    i = pid % s_q
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < h_q
    lse = tl.load(LseIn_ptr + b.to(tl.int64) * stride_ib + i * stride_is + offs_h * stride_ih, mask=mask_h, other=0.0)
    if HAS_SINK:
        offs_d = tl.arange(0, BLOCK_DV)
        sink = tl.load(Sinks_ptr + offs_h, mask=mask_h, other=0.0)
        # exp(LSE - logaddexp(LSE, S)); a row with no key has O = 0 already (w = 0 avoids -inf - -inf).
        w = tl.where(lse == float("-inf"), 0.0, 1.0 / (1.0 + tl.exp2((sink - lse) * LOG2E)))
        o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + i * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :]
        mask = mask_h[:, None] & (offs_d < d_v)[None, :]
        o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32) * w[:, None]
        tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=mask)
    tl.store(LseOut_ptr + b.to(tl.int64) * stride_lb + offs_h * stride_lh + i * stride_ls, lse, mask=mask_h)


def _flat_rows(t: torch.Tensor, *tail: int) -> torch.Tensor | None:
    """t viewed as (-1, *tail) without a copy, or None where its strides do not allow it."""
    try:
        return t.view(-1, *tail)
    except RuntimeError:
        return None


def _decode(q, k_cache, v_cache, seqlens, block_table, num_splits, split_api, *, scale, causal, window, softcap,
            sinks, out, out_lse, out_o_parts=None, out_lse_parts=None, config=None, block=None, bounds=None,
            cache_loc=None):
    """Checks, allocation and launches shared by the three entry points."""
    left, right = _check_common(q, k_cache, v_cache, causal, window, softcap, sinks, h_axis=2, scale=scale,
                                max_head_dim=MAX_DECODE_HEAD_DIM)
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"expected q (b, s_q, h_q, d) and 4-D caches, got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    b, s_q, h_q, d = q.shape
    h_kv, d_v = k_cache.shape[2], v_cache.shape[-1]
    if not 1 <= s_q <= MAX_QUERIES:
        raise ValueError(f"s_q={s_q} must be in [1, {MAX_QUERIES}] for decode")
    if not isinstance(seqlens, torch.Tensor) or tuple(seqlens.shape) != (b,) or seqlens.dtype != torch.int32 \
            or seqlens.device != q.device:
        raise ValueError(f"seqlens must be a ({b},) int32 tensor on {q.device}")
    paged = block_table is not None
    rows = (block_table.shape[0] if paged and isinstance(block_table, torch.Tensor) else k_cache.shape[0]) \
        if cache_loc is not None else b  # rows of the table / cache: any number, addressed through cache_loc
    if cache_loc is not None:
        if not isinstance(cache_loc, torch.Tensor) or tuple(cache_loc.shape) != (b,) or cache_loc.dtype != torch.int32 \
                or cache_loc.device != q.device:
            raise ValueError(f"cache_loc must be a ({b},) int32 tensor on {q.device}")
        if b and (int(cache_loc.min()) < 0 or int(cache_loc.max()) >= rows):
            raise ValueError(f"cache_loc must lie in [0, {rows}) (the {'block table' if paged else 'cache'}'s rows)")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != rows \
                or block_table.dtype != torch.int32 or block_table.device != q.device:
            raise ValueError(f"block_table must be a ({b}, max_blocks) int32 tensor on {q.device} "
                             f"(any rows with cache_loc)")
        page, max_keys = k_cache.shape[1], block_table.shape[1] * k_cache.shape[1]
        if page < 1:
            raise ValueError(f"page size {page} must be >= 1")
    else:
        if k_cache.shape[0] != rows:
            raise ValueError(f"cache batch {k_cache.shape[0]} != q batch {b}")
        page, max_keys = 1, k_cache.shape[1]
    if out is None:
        out = torch.empty((b, s_q, h_q, d_v), dtype=q.dtype, device=q.device)
    _check_out(out, (b, s_q, h_q, d_v), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (b, h_q, s_q), torch.float32, q.device, "out_lse")

    group = h_q // h_kv
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(group * s_q)))
    n_m = triton.cdiv(group * s_q, block_m)
    block_n, num_warps, num_stages = config or DECODE_CONFIGS[(max(block_d, block_dv), min(q.element_size(), 4))]
    splits = _auto_splits(q, b, h_kv, n_m, max_keys) if num_splits is None else int(num_splits)
    if not 1 <= splits <= 65535:
        raise ValueError(f"num_splits={num_splits} must be in [1, 65535]")
    if b * h_kv >= 2**31 or n_m > 65535:
        raise ValueError(f"grid ({b * h_kv}, {n_m}, {splits}) exceeds CUDA's limits")
    part = check_partition(block, bounds, splits, b, q.device)
    split = split_api or splits > 1
    o_parts = lse_parts = None
    if split:
        o_parts = out_o_parts
        if o_parts is None:
            o_parts = torch.empty((splits, b, s_q, h_q, d_v), dtype=torch.float32, device=q.device)
        _check_out(o_parts, (splits, b, s_q, h_q, d_v), torch.float32, q.device, "out_o_parts", True)
        lse_parts = out_lse_parts
        if lse_parts is None:  # stored (splits, b, s_q, h_q): lse_combine reads it in o_parts' row order
            lse_parts = torch.empty((splits, b, s_q, h_q), dtype=torch.float32, device=q.device).permute(0, 1, 3, 2)
        _check_out(lse_parts, (splits, b, h_q, s_q), torch.float32, q.device, "out_lse_parts")
    if b == 0 or h_q == 0:
        return out, out_lse, o_parts, lse_parts

    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    softcap = float(softcap)
    dst_o, dst_l = (o_parts, lse_parts) if split else (out.unsqueeze(0), out_lse.unsqueeze(0))
    _attention_decode_kernel[(b * h_kv, n_m, splits if split else 1)](
        q, k_cache, v_cache, dst_o, dst_l, sinks if sinks is not None else dst_l, seqlens,
        block_table if paged else seqlens, out, out_lse, bounds if bounds is not None else seqlens,
        cache_loc if cache_loc is not None else seqlens,
        s_q, h_kv, group, d, d_v, splits, block or 0, scale / softcap if softcap else scale * 1.4426950408889634,
        softcap * 1.4426950408889634, left, right,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(block_table.stride() if paged else (0, 0)), *dst_o.stride()[:4], *dst_l.stride(),
        *out.stride()[:3], *out_lse.stride(), *(bounds.stride() if bounds is not None else (0, 0)),
        TOP_LEFT=causal == "top_left", HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0,
        HAS_SINK=sinks is not None and not split, PAGED=paged, PAGE=page, SPLIT=split,
        EVEN_D=block_d == d and block_dv == d_v, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_DV=block_dv, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PART=part, SINK_DIRECT=sinks is not None and part != 0, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        HAS_LOC=cache_loc is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split and part:
        combine_partitioned(o_parts, lse_parts, out, out_lse, sinks, seqlens, part, block or 0, bounds)
    elif split:
        _combine(o_parts, lse_parts, out, out_lse, sinks)
    return out, out_lse, o_parts, lse_parts


def _combine(o_parts, lse_parts, out, out_lse, sinks) -> None:
    """Stage 2 over rows flattened as (b, s_q, h_q), then the sink and the LSE layout.

    lse_combine has one row stride for its LSE output, which cannot address out_lse's
    (b, h_q, s_q) layout in (b, s_q, h_q) row order when s_q > 1: the LSE then goes to a
    (b, s_q, h_q) scratch that `_decode_finish_kernel` copies into out_lse. Likewise a caller's
    lse_parts in (b, h_q, s_q) order is copied once into (b, s_q, h_q) order for the combine.
    """
    splits, b, s_q, h_q, d_v = o_parts.shape
    rows = b * s_q * h_q
    o_rows = _flat_rows(o_parts, rows, d_v)
    if o_rows is None:
        raise ValueError(f"out_o_parts strides {tuple(o_parts.stride())}: (b, s_q, h_q) must flatten without a copy")
    lse_rows = _flat_rows(lse_parts.permute(0, 1, 3, 2), rows)
    if lse_rows is None:
        lse_rows = lse_parts.permute(0, 1, 3, 2).contiguous().view(splits, rows)  # the one documented copy
    o_dst = _flat_rows(out, d_v)
    scratch_o = o_dst is None
    if scratch_o:
        o_dst = torch.empty((rows, d_v), dtype=out.dtype, device=out.device)
    lse_dst = _flat_rows(out_lse.permute(0, 2, 1))
    direct_lse = lse_dst is not None
    if not direct_lse:
        lse_dst = torch.empty((rows,), dtype=torch.float32, device=out.device)
    lse_combine(o_rows, lse_rows, out=o_dst, out_lse=lse_dst)
    o_bsh = o_dst.view(b, s_q, h_q, d_v)
    if sinks is not None or not direct_lse:
        lse_bsh = out_lse.permute(0, 2, 1) if direct_lse else lse_dst.view(b, s_q, h_q)
        block_h = min(64, max(2, triton.next_power_of_2(h_q)))
        _decode_finish_kernel[(b * s_q, triton.cdiv(h_q, block_h))](
            o_bsh, lse_bsh, out_lse, sinks if sinks is not None else lse_dst, h_q, s_q, d_v,
            *o_bsh.stride()[:3], *lse_bsh.stride(), *out_lse.stride(),
            HAS_SINK=sinks is not None, BLOCK_H=block_h, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
            num_warps=4,
        )
    if scratch_o:
        out.copy_(o_bsh)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, *,
           scale: float | None = None, causal: str = "bottom_right", window: tuple[int, int] = (-1, -1),
           softcap: float = 0.0, sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
           out_lse: torch.Tensor | None = None, num_splits: int | None = None,
           config: tuple[int, int, int] | None = None,
           cache_loc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode over a contiguous cache; the s_q queries are the last s_q tokens of each sequence.

    q: (b, s_q, h_q, d), 1 <= s_q <= 16; k_cache: (b, s_max, h_kv, d); v_cache: (b, s_max, h_kv, d_v)
       one dtype of fp32/fp16/bf16, last-dim stride 1, other strides arbitrary
    seqlens: (b,) int32 on q's device, 0 <= seqlens[b] <= s_max; slots past it are never read
    causal, window, softcap, sinks, scale: as kernels.triton.attention.prefill
    out: (b, s_q, h_q, d_v) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32
    num_splits: split-KV ways (None: enough to fill the GPU, 1 on CPU); config: (BLOCK_N,
                num_warps, num_stages), for tuning only
    cache_loc: (b,) int32 on q's device, or None: sequence b reads cache row cache_loc[b] (TensorRT-LLM;
               the caches may then hold any number of rows); None: row b
    returns: (out, out_lse); LSE natural log, excluding the sink
    """
    o, lse, _, _ = _decode(q, k_cache, v_cache, seqlens, None, num_splits, False, scale=scale, causal=causal,
                           window=window, softcap=softcap, sinks=sinks, out=out, out_lse=out_lse, config=config,
                           cache_loc=cache_loc)
    return o, lse


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seqlens: torch.Tensor, *, scale: float | None = None, causal: str = "bottom_right",
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 num_splits: int | None = None, config: tuple[int, int, int] | None = None,
                 cache_loc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode over a paged cache: token t of sequence b is cache[block_table[b, t // page], t % page].

    q: (b, s_q, h_q, d); k_cache: (num_blocks, page, h_kv, d); v_cache: (num_blocks, page, h_kv, d_v)
    block_table: (b, max_blocks) int32, any strides; entries past a sequence's last page are never
                 read (the caller guarantees max_blocks * page >= seqlens[b])
    seqlens, the keywords and returns: as `decode`; with cache_loc, sequence b reads block-table row
                 cache_loc[b] (TensorRT-LLM's page_table[cache_loc[b]]) of a table with any number of rows
    """
    o, lse, _, _ = _decode(q, k_cache, v_cache, seqlens, block_table, num_splits, False, scale=scale,
                           causal=causal, window=window, softcap=softcap, sinks=sinks, out=out, out_lse=out_lse,
                           config=config, cache_loc=cache_loc)
    return o, lse


def decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 num_splits: int, *, scale: float | None = None, causal: str = "bottom_right",
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 out_o_parts: torch.Tensor | None = None, out_lse_parts: torch.Tensor | None = None,
                 config: tuple[int, int, int] | None = None, block: int | None = None,
                 bounds: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 cache_loc: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash decoding over a contiguous or paged cache: per-split partial states, merged by lse_combine.

    q, k_cache, v_cache, seqlens and the keywords: as `decode`; num_splits >= 1 (may exceed L_b:
    the extra splits are empty)
    block: keys a split (fixed-size splits, TensorRT-LLM's multi-block mode: 64, 256, the page size);
           num_splits * block must cover every seqlens[b] (the caller's guarantee: not checked)
    bounds: (b, num_splits + 1) int32 on q's device, per-request boundaries non-decreasing from 0 to
            >= seqlens[b] (FlashMLA's scheduler; a request with fewer splits repeats its last one)
    With block or bounds a request whose keys lie in one split skips the merge: its stage-1
    program writes O and LSE (kernels.triton.attention_split). Default: equal key counts.
    out_o_parts: (num_splits, b, s_q, h_q, d_v) float32 whose (b, s_q, h_q) dims flatten to one
                 stride; O of each split normalised by its own sum (any value for an empty split)
    out_lse_parts: (num_splits, b, h_q, s_q) float32, -inf for an empty split; allocated as a
                 (num_splits, b, s_q, h_q) buffer viewed in that shape so that the combine reads
                 it without a copy (a caller's buffer in another order costs one small copy)
    block_table: (b, max_blocks) int32, or None; with it k_cache, v_cache are pages (num_blocks, page,
                 h_kv, d | d_v) as in `decode_paged` (TensorRT-LLM's paged generate). Every key is looked up
                 through its own page, t // page, so a split may start or end inside a page.
    cache_loc: (b,) int32, or None: sequence b reads cache row / block-table row cache_loc[b] (TensorRT-LLM)
    returns: (out, out_lse, o_parts, lse_parts); the sink enters after the merge, LSE excludes it
    """
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1")
    return _decode(q, k_cache, v_cache, seqlens, block_table, num_splits, True, scale=scale, causal=causal,
                   window=window, softcap=softcap, sinks=sinks, out=out, out_lse=out_lse,
                   out_o_parts=out_o_parts, out_lse_parts=out_lse_parts, config=config, block=block, bounds=bounds,
                   cache_loc=cache_loc)
