"""Eager decode and flash decoding over a quantized KV cache (kvquant.decode, kvquant.decode_split's baseline).

    K = float32(k_codes) * k_scale,  V = float32(v_codes) * v_scale      (dequantize to fp32)
    kernels/torch/attention.py's decode / decode_split on (q in fp32, K, V)   every step in fp32

O is rounded to q's dtype once at the end; o_parts, lse_parts and LSE are fp32. Conventions as
refimpl/kvquant_split.py (the golden): q (b, s_q, h_q, d), the last s_q tokens, causal bottom-right; caches
(b, s_max, h_kv, d) contiguous, or (num_blocks, page, h_kv, d) pages through block_table (decode_split);
codes int8 / float8_e4m3fn / float8_e5m2; scales (1,) per tensor, (h_kv,) per kv head, or the codes' shape
without d per token; slots at or past seqlens[b] are never used (they may hold NaN codes and scales).
"""

from __future__ import annotations

import math

import torch

from kernel_parity.kernels.torch import attention as _att

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def check_args(op: str, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table=None) -> str:
    """ValueError (one line naming `op` and the argument) unless valid; the granularity."""
    more = {"block_table": block_table} if block_table is not None else {}
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale), ("seqlens", seqlens), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: q must be (b, s_q, h_q, d) fp32 / fp16 / bf16, got {tuple(q.shape)} {q.dtype}")
    b, _, h_q, d = q.shape
    lay = "(num_blocks, page, h_kv, d)" if block_table is not None else f"(b={b}, s_max, h_kv, d)"
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape) or \
            (block_table is None and k_cache.shape[0] != b):
        raise ValueError(f"{op}: k_cache, v_cache must be {lay} with d={d}, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.dtype not in CODE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k_cache, v_cache must share one code dtype of int8, float8_e4m3fn, "
                         f"float8_e5m2, got {k_cache.dtype} and {v_cache.dtype}")
    n0, n1, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    grans = {(1,): "tensor", (h_kv,): "head", (n0, n1, h_kv): "token"}
    gk, gv = grans.get(tuple(k_scale.shape)), grans.get(tuple(v_scale.shape))
    if gk is None or gk != gv or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise ValueError(f"{op}: k_scale, v_scale must be float32 of one shape: (1,), ({h_kv},) or "
                         f"({n0}, {n1}, {h_kv}), got {tuple(k_scale.shape)} {k_scale.dtype} and "
                         f"{tuple(v_scale.shape)} {v_scale.dtype}")
    if tuple(seqlens.shape) != (b,) or seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: seqlens must be ({b},) int32, got {tuple(seqlens.shape)} {seqlens.dtype}")
    cap = n1 if block_table is None else block_table.shape[-1] * n1
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != b
                                    or block_table.dtype != torch.int32):
        raise ValueError(f"{op}: block_table must be ({b}, max_pages) int32, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if b and (int(seqlens.min()) < 0 or int(seqlens.max()) > cap):
        raise ValueError(f"{op}: seqlens must lie in [0, {cap}]")
    return gk


def _dequant(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 values of the whole cache: codes x scale (the layout of the codes)."""
    sc = s[..., None] if s.dim() == 3 else s.reshape(1, 1, -1, 1)
    return codes.float() * sc


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
           v_scale: torch.Tensor, seqlens: torch.Tensor, *, scale: float | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, d); caches (b, s_max, h_kv, d) codes; scales (1,) | (h_kv,) | (b, s_max, h_kv) fp32;
    seqlens (b,) int32 -> o (b, s_q, h_q, d) q's dtype, lse (b, h_q, s_q) fp32."""
    check_args("kvquant.decode", q, k_cache, v_cache, k_scale, v_scale, seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse = _att.decode(q.float(), _dequant(k_cache, k_scale), _dequant(v_cache, v_scale), seqlens.long(),
                         scale=scale)
    return o.to(q.dtype), lse


def decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, seqlens: torch.Tensor, splits: int, *, block_table: torch.Tensor | None = None,
                 scale: float | None = None, block: int | None = None, bounds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `decode`, split into `splits` key ranges a sequence (pages through block_table when given): equal
    counts, fixed blocks of `block` keys, or explicit (b, splits + 1) `bounds` (refimpl.attention.split_bounds)
    -> o, lse, o_parts (splits, b, s_q, h_q, d) fp32, lse_parts (splits, b, h_q, s_q) fp32."""
    check_args("kvquant.decode_split", q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"kvquant.decode_split: splits={splits!r} must be an int >= 1")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse, o_parts, lse_parts = _att.decode_split(q.float(), _dequant(k_cache, k_scale), _dequant(v_cache, v_scale),
                                                   seqlens.long(), splits, block_table=block_table, scale=scale,
                                                   block=block, bounds=bounds)
    return o.to(q.dtype), lse, o_parts, lse_parts
