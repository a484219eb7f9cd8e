"""Eager chunked prefill over a quantized paged KV cache (kvquant.chunked_prefill's eager baseline).

    K = float32(k_codes) * k_scale,  V = float32(v_codes) * v_scale      (dequantize to fp32, gathered pages)
    o, lse = kernels.torch.attention.chunked_prefill(q in fp32, K, V)    every step in fp32

The dequantized cache in fp32 (gathered through the block table, as kernels/torch/kvquant_decode.py) and the
eager chunked prefill of kernels/torch/attention.py on fp32 tensors (bottom-right: query i of sequence b sees keys
j <= hist_b + i); O is rounded to q's dtype once at the end. Conventions as kernels/triton/kvquant_prefill.py
(golden: refimpl/kvquant_prefill.py): the cache holds each sequence's history and its chunk's own K / V as codes;
codes int8 / float8_e4m3fn / float8_e5m2, scales (1,) per tensor, (h_kv,) per kv head or (num_blocks, page, h_kv)
per (slot, kv head); GQA h -> h // (h_q / h_kv); an empty chunk has no rows; slots at or past hist_b + L_q,b are
never used (they may hold NaN codes and scales).
"""

from __future__ import annotations

import math

import torch

from kernel_parity.kernels.torch.attention import chunked_prefill as _chunked
from kernel_parity.kernels.torch.kvquant_decode import check_cache


def check_args(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, hist, block_table) -> str:
    """ValueError (one line) unless the arguments are valid; returns the granularity ("tensor" / "head" / "token")."""
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


def _dequant(codes: torch.Tensor, s: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(b, max_pages * page, h_kv, d) fp32 values gathered through the table: codes x scale."""
    bt = block_table.long()
    c = codes[bt].float()  # b, max_pages, page, h_kv, d
    if s.dim() == 3:
        sc = s[bt][..., None]  # b, max_pages, page, h_kv, 1: each (slot, kv head)'s scale
    else:
        sc = s.reshape(1, 1, 1, -1, 1)  # one a tensor, or one a kv head
    return (c * sc).reshape(bt.shape[0], -1, *codes.shape[2:])


def chunked_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, hist: torch.Tensor, block_table: torch.Tensor,
                    *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (total_q, h_q, d); caches (num_blocks, page, h_kv, d) codes; scales (1,) | (h_kv,) | (num_blocks, page,
    h_kv) fp32; cu_seqlens_q (b + 1,), hist (b,), block_table (b, max_pages) int32 -> o (total_q, h_q, d) q's
    dtype, lse (h_q, total_q) fp32."""
    check_args(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, hist, block_table)
    total_q, h_q, d = q.shape
    if total_q == 0:
        return q.new_empty((0, h_q, d)), torch.empty((h_q, 0), dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k = _dequant(k_cache, k_scale, block_table)  # b, max_pages * page, h_kv, d fp32
    v = _dequant(v_cache, v_scale, block_table)
    o, lse = _chunked(q.float(), k, v, cu_seqlens_q, hist, scale=scale, causal="bottom_right")
    return o.to(q.dtype), lse
