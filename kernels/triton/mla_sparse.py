"""MLA decode over gathered top-k cache slots (DeepSeek sparse attention, FlashMLA's `indices`), in Triton.

    s_ij  = scale * q_i . c_{I_ij}            j < T_b = topk_length[b] (or topk), I_ij != -1
    LSE_i = ln sum_j exp(s_ij);  O_i = sum_j exp(s_ij - LSE_i) c_{I_ij}[:d_v]

Conventions (OPS.md, mla; golden refimpl.mla.decode_sparse): indices (b, s_q, h_kv, topk) (or
(b, s_q, topk) with one kv head) are flat slot ids into kv_cache viewed as (num_blocks * page, h_kv, d),
per query (each of the s_q queries has its own list, so no causal mask) and per latent kv head
(FlashMLA's h_kv: query head h reads kv head h // (h_q / h_kv)'s list and that head's rows); -1 is
padding; entries at or past topk_length[b] are not read; a row with no valid entry gives O = 0, LSE = -inf.

One program per (request, query, split of the index list, kv head, block of <= 64 of its query heads):
the heads of a kv head share its gathered rows, so each selected 576-dim row is read once per query, and the
tile update is mla.py's (`_mla_attend`: both dots on the tensor cores, fp32 accumulation, log2-
domain online softmax, V = the first d_v dims of the same gathered tile); the index list is
read a chunk at a time outside the pipelined tile loop. Split s covers [s C, (s + 1) C) of the
used list, C = ceil(T_b / n) in whole tiles; partials merge with lse_combine as in mla_decode.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .attention_decode import _combine
from .mla import MIN_SPLIT_KEYS, _auto_splits, _check_index, _check_q_cache, _mla_attend, _mla_store, _outputs, \
    _pick_config


@triton.jit
def _mla_decode_sparse_kernel(
    Q_ptr, KV_ptr, V_ptr, O_ptr, Lse_ptr, Idx_ptr, TopkLen_ptr,
    h_q, h_kv, s_q, topk, n_m, n_splits, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_ib, stride_is, stride_ih, stride_it,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_l_split, stride_lb, stride_lh, stride_ls,
    HAS_TOPK_LEN: tl.constexpr, PAGE: tl.constexpr, SWAP_AB: tl.constexpr, SHARED_KV: tl.constexpr,
    D_V: tl.constexpr, D_PE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % n_m
    kvh = (pid // n_m) % h_kv
    split = (pid // n_m // h_kv) % n_splits
    qi = (pid // n_m // h_kv // n_splits) % s_q
    b = pid // n_m // h_kv // n_splits // s_q

    grp = h_q // h_kv  # kv head kvh's query heads kvh grp + [0, grp)
    offs_g = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_g < grp
    head = kvh * grp + offs_g
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    q_rows = b.to(tl.int64) * stride_qb + qi * stride_qs + head * stride_qh
    q_nope = tl.load(Q_ptr + q_rows[:, None] + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(Q_ptr + q_rows[:, None] + D_V + offs_pe[None, :], mask=mask_m[:, None], other=0.0)

    T = topk
    if HAS_TOPK_LEN:
        T = tl.minimum(tl.maximum(tl.load(TopkLen_ptr + b), 0), topk)
    per_split = tl.cdiv(tl.cdiv(T, n_splits), BLOCK_N) * BLOCK_N  # whole tiles
    lo = tl.minimum(split * per_split, T)
    hi = tl.minimum(lo + per_split, T)

    idx_row = Idx_ptr + b.to(tl.int64) * stride_ib + qi.to(tl.int64) * stride_is + kvh * stride_ih
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP_AB:
        acc = tl.zeros([D_V, BLOCK_M], dtype=tl.float32)  # fp32 accumulator of O^T
    else:
        acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)  # fp32 accumulator of O
    # Indices are read CHUNK_N at a time outside the tile loop (see mla.py: an index load inside
    # it would halve the pipeliner's prefetch distance); a tile takes its BLOCK_N of them from
    # registers. lo is a multiple of BLOCK_N, so tiles are rows of the (CHUNK_N / BLOCK_N, BLOCK_N) chunk.
    offs_c = tl.arange(0, CHUNK_N)
    offs_r = tl.arange(0, CHUNK_N // BLOCK_N)
    for c0 in range(lo, hi, CHUNK_N):
        chunk_idx = tl.load(idx_row + (c0 + offs_c) * stride_it, mask=c0 + offs_c < hi, other=-1)
        chunk_idx = tl.reshape(chunk_idx, (CHUNK_N // BLOCK_N, BLOCK_N))
        for start_n in range(c0, tl.minimum(c0 + CHUNK_N, hi), BLOCK_N):
            slot = tl.sum(tl.where(offs_r[:, None] == (start_n - c0) // BLOCK_N, chunk_idx, 0), axis=0)
            live = slot >= 0  # padding and entries past T_b are never gathered
            slot = tl.where(live, slot, 0)
            rows = (slot // PAGE).to(tl.int64) * stride_kb + (slot % PAGE) * stride_ks + kvh * stride_kh
            kn = tl.load(KV_ptr + rows[:, None] + offs_dv[None, :], mask=live[:, None], other=0.0)
            kp = tl.load(KV_ptr + rows[:, None] + D_V + offs_pe[None, :], mask=live[:, None], other=0.0)
            if SHARED_KV:
                v = kn
            else:
                v = tl.load(V_ptr + rows[:, None] + offs_dv[None, :], mask=live[:, None], other=0.0)
            m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn, kp, v, live, offs_n, offs_n, m_i, l_i, acc, qk_scale,
                                        False, SWAP_AB, DOT_PRECISION)

    o_rows = split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob + qi * stride_os + head * stride_oh
    lse_rows = split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh + qi * stride_ls
    _mla_store(O_ptr, Lse_ptr, acc, m_i, l_i, o_rows, lse_rows, mask_m, offs_dv, SWAP_AB)


def mla_decode_sparse(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                      topk_length: torch.Tensor | None, scale: float, d_v: int = 512,
                      num_splits: int | None = None, out: torch.Tensor | None = None,
                      out_lse: torch.Tensor | None = None, *, config: Sequence | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over each query's top-k cache slots.

    q: (b, s_q, h_q, d), d = d_v + d_pe; kv_cache: (num_blocks, page, h_kv, d), q's dtype; as mla_decode
    indices: (b, s_q, h_kv, topk) (or (b, s_q, topk) when h_kv = 1) int32, any strides: flat slot ids
        block * page + offset, -1 = padding; query head h reads kv head h // (h_q / h_kv)'s list and rows
    topk_length: (b,) int32 on q's device or None: only the first topk_length[i] entries are used
    scale, out, out_lse, config: as mla_decode; num_splits: splits of the index list (None: auto)
    returns: (out, out_lse); a row with no valid entry: O = 0, LSE = -inf
    """
    what = "mla_decode_sparse"
    b, s_q, h_q, d, d_pe = _check_q_cache(q, kv_cache, d_v, scale, what, heads=True)
    h_kv = kv_cache.shape[2]
    if isinstance(indices, torch.Tensor) and indices.dim() == 3 and h_kv == 1:
        indices = indices[:, :, None]
    _check_index(indices, "indices", (b, s_q, h_kv, None), q.device, what)
    if topk_length is not None:
        _check_index(topk_length, "topk_length", (b,), q.device, what)
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 65535):
        raise ValueError(f"{what}: num_splits={num_splits!r} must be an int in [1, 65535]")
    topk = indices.shape[3]
    grp = h_q // h_kv
    cfg = _pick_config(q, grp, config)
    n_m = triton.cdiv(grp, cfg.block_m)
    n_splits = num_splits or _auto_splits(q, b * s_q * h_kv * n_m, cfg, d, max(topk, MIN_SPLIT_KEYS))
    if b * s_q * h_kv * n_m * n_splits >= 2**31:
        raise ValueError(f"{what}: {b} x {s_q} x {h_kv} x {n_m} x {n_splits} programs exceed CUDA's grid")
    out, out_lse, dst_o, dst_l = _outputs(q, d_v, out, out_lse, n_splits)
    if b == 0 or h_q == 0:
        return out, out_lse
    _mla_decode_sparse_kernel[(b * s_q * h_kv * n_m * n_splits,)](
        q, kv_cache, kv_cache, dst_o, dst_l, indices, topk_length if topk_length is not None else indices,
        h_q, h_kv, s_q, topk, n_m, n_splits, float(scale) * 1.4426950408889634,
        *q.stride()[:3], *kv_cache.stride()[:3], *indices.stride(), *dst_o.stride()[:4], *dst_l.stride(),
        HAS_TOPK_LEN=topk_length is not None, PAGE=kv_cache.shape[1], SWAP_AB=cfg.swap_ab,
        SHARED_KV=cfg.shared_kv, D_V=int(d_v), D_PE=d_pe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CHUNK_N=max(cfg.block_n, min(triton.next_power_of_2(cfg.chunk), triton.next_power_of_2(max(topk, 1)))),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if n_splits > 1:
        _combine(dst_o, dst_l, out, out_lse, None)
    return out, out_lse
