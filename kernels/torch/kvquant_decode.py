"""Eager paged decode attention over a quantized KV cache (kvquant.decode_paged's eager baseline).

    K = float32(k_codes) * k_scale,  V = float32(v_codes) * v_scale      (dequantize to fp32, gathered pages)
    o, lse = attention over (q in fp32, K, V)                             every step in fp32

The dequantized cache in fp32 and the attention of kernels/torch/attention.py on fp32 tensors; O is rounded
to q's dtype once at the end. Conventions as kernels/triton/kvquant_decode.py (golden:
refimpl/kvquant_decode.py): codes int8 / float8_e4m3fn / float8_e5m2, scales (1,) per tensor, (h_kv,) per
kv head or (num_blocks, page, h_kv) per (slot, kv head); GQA h -> h // (h_q / h_kv); seq_lens 0 gives O = 0,
LSE = -inf; slots at or past seq_lens[b] are never used (they may hold NaN codes and scales).
"""

from __future__ import annotations

import math

import torch

from kernel_parity.kernels.torch.attention import attention

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache(op: str, q_layout: str, q, k_cache, v_cache, k_scale, v_scale, **more) -> str:
    """ValueError (one line naming `op`) unless q (q_layout: its shape's names), the quantized cache, its scales
    and every tensor of `more` are valid; returns the granularity ("tensor" / "head" / "token")."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: q must be {q_layout} fp32 / fp16 / bf16, got {tuple(q.shape)} {q.dtype}")
    _, h_q, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"{op}: k_cache, v_cache must be (num_blocks, page, h_kv, d={d}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in CODE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k_cache, v_cache must share one code dtype of int8, float8_e4m3fn, "
                         f"float8_e5m2, got {k_cache.dtype} and {v_cache.dtype}")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    grans = {(1,): "tensor", (h_kv,): "head", (nb, page, h_kv): "token"}
    gk, gv = grans.get(tuple(k_scale.shape)), grans.get(tuple(v_scale.shape))
    if gk is None or gk != gv or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise ValueError(f"{op}: k_scale, v_scale must be float32 of one shape: (1,), ({h_kv},) or "
                         f"({nb}, {page}, {h_kv}), got {tuple(k_scale.shape)} {k_scale.dtype} and "
                         f"{tuple(v_scale.shape)} {v_scale.dtype}")
    return gk


def check_args(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens) -> str:
    """ValueError (one line) unless the arguments are valid; returns the granularity ("tensor" / "head" / "token")."""
    gk = check_cache("kvquant.decode_paged", "(b, h_q, d)", q, k_cache, v_cache, k_scale, v_scale,
                     block_table=block_table, seq_lens=seq_lens)
    b = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise ValueError(f"kvquant.decode_paged: block_table must be ({b}, max_pages) int32, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if tuple(seq_lens.shape) != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"kvquant.decode_paged: seq_lens must be ({b},) int32, got {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype}")
    return gk


def _dequant(codes: torch.Tensor, s: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(b, max_pages * page, h_kv, d) fp32 values gathered through the table: codes x scale."""
    bt = block_table.long()
    c = codes[bt].float()  # b, max_pages, page, h_kv, d
    if s.dim() == 3:
        sc = s[bt][..., None]  # b, max_pages, page, h_kv, 1
    else:
        sc = s.reshape(1, 1, 1, -1, 1)
    x = c * sc
    return x.reshape(bt.shape[0], -1, *codes.shape[2:])


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, h_q, d); caches (num_blocks, page, h_kv, d) codes; scales (1,) | (h_kv,) | (num_blocks, page, h_kv)
    fp32; block_table (b, max_pages) int32; seq_lens (b,) int32 -> o (b, h_q, d) q's dtype, lse (b, h_q) fp32."""
    check_args(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k = _dequant(k_cache, k_scale, block_table)
    v = _dequant(v_cache, v_scale, block_table)
    o, lse = attention(q.float()[:, None], k, v, scale=scale, causal="bottom_right", k_lens=seq_lens)
    return o[:, 0].to(q.dtype), lse[..., 0]
