"""Eager FlashMLA sparse MLA decode over its 656-byte FP8 KV cache rows (the same-precision baseline of
refimpl/kvquant_mla.py): the rows the used entries name are gathered and unpacked, then mla.decode_sparse's eager
math in q's dtype (kernels/torch/mla.py: logits a matmul rounded to the dtype, softmax in the dtype, O a matmul in
the dtype; LSE from float32 upcasts).

Unpack: codes viewed as float8_e4m3fn and widened to float32, times their group's float32 scale (one float32
rounding: none for FlashMLA's power-of-two scales), then cast to q's dtype (exact in bf16 for power-of-two scales:
code x 2^k is a bf16 value); the RoPE part viewed as bfloat16. Conventions as refimpl/kvquant_mla.py: indices (b,
s_q, h_kv, topk) (or (b, s_q, topk) with h_kv = 1) flat slots block * page + offset, -1 padding, entries at or
past topk_length[b] unused (never gathered: those rows may hold NaN), query head h on kv head h // (h_q / h_kv).
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.torch.mla import _softmax_dtype

__all__ = ["unpack", "mla_sparse"]

ROW_BYTES, SCALE_OFF, ROPE_OFF, D_NOPE = 656, 512, 528, 512


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., 656) uint8 rows -> (..., 576) in `dtype`: code x scale of its 128-group, then the bf16 RoPE part."""
    r = rows.contiguous()
    codes = r[..., :SCALE_OFF].view(torch.float8_e4m3fn).float()
    scales = r[..., SCALE_OFF:ROPE_OFF].contiguous().view(torch.float32)
    nope = (codes.unflatten(-1, (4, 128)) * scales[..., None]).flatten(-2)
    rope = r[..., ROPE_OFF:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype)


def mla_sparse(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None,
               scale: float, d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, 576), kv_cache (num_blocks, page, h_kv, 656) uint8 -> o (b, s_q, h_q, 512) in q.dtype,
    lse (b, h_q, s_q) float32."""
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != ROW_BYTES or kv_cache.dim() not in (3, 4):
        raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, {ROW_BYTES}) uint8, got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    kv = kv_cache if kv_cache.dim() == 4 else kv_cache[:, :, None]
    n_blocks, page, h_kv, _ = kv.shape
    b, s_q, h, d = q.shape
    if d != D_NOPE + 64 or d_v != D_NOPE or h % h_kv:
        raise ValueError(f"q {tuple(q.shape)} must be (b, s_q, h_q, 576) with h_q a multiple of h_kv = {h_kv}, "
                         f"d_v {d_v} must be 512")
    g = h // h_kv
    idx = indices.to(q.device).long()
    if idx.dim() == 3:
        idx = idx[:, :, None]
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (b, s_q, h_kv):
        raise ValueError(f"indices {tuple(indices.shape)} must be (b, s_q, h_kv, topk) = ({b}, {s_q}, {h_kv}, topk)")
    used = idx != -1
    if topk_length is not None:
        k = torch.arange(idx.shape[-1], device=q.device)
        used = used & (k < topk_length.to(q.device).long().reshape(b, 1, 1, 1))
    n_slots = n_blocks * page
    if ((idx < 0) | (idx >= n_slots))[used].any():
        raise ValueError(f"indices outside the cache's {n_slots} slots (and not -1)")
    slot = torch.where(used, idx, 0)
    heads = torch.arange(h_kv, device=q.device)[:, None]
    rows = kv[slot // page, slot % page, heads]  # b, s_q, h_kv, topk, 656: only the named rows
    kvf = torch.where(used[..., None], unpack(rows, q.dtype), torch.zeros((), dtype=q.dtype, device=q.device))
    qg = q.reshape(b, s_q, h_kv, g, d)
    keep = used[:, :, :, None, :]
    s = (qg @ kvf.transpose(-1, -2)) * scale  # b, s_q, h_kv, g, topk in q.dtype
    p = _softmax_dtype(s, keep, None)
    o = (p @ kvf[..., :d_v]).reshape(b, s_q, h, d_v)
    s32 = (qg.float() @ kvf.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s32.masked_fill(~keep, float("-inf")), dim=-1).reshape(b, s_q, h)
    return o, lse.permute(0, 2, 1)
