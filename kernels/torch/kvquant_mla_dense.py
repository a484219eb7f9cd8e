"""Eager FlashMLA dense paged MLA decode over its 656-byte FP8 KV cache rows, and the rows' write path, in torch
(the same-precision baselines of refimpl/kvquant_mla_dense.py).

mla_decode: the cache unpacked to q's dtype (kernels/torch/kvquant_mla.py `unpack`: code x its group's float32
scale in float32, then q's dtype: exact in bf16 for FlashMLA's power-of-two scales; the RoPE part viewed as bf16),
then mla.decode's eager math (kernels/torch/mla.py `decode`: logits a matmul in the dtype, softmax in the dtype, O
a matmul in the dtype; LSE from float32 upcasts). Rows not read (poison, past a request's length) unpack to NaN and
are zeroed by that decode's gather. The whole cache is unpacked (num_blocks x page x 576 values of q's dtype).

mla_pack: torch's ops on the tokens whose slot is not -1: per 128-group amax / 448 (float32 division), clamped
below at 1e-4, rounded up to a power of two with frexp / ldexp (exact), codes (x / scale) clamped to +-448 and cast
to float8_e4m3fn (round to nearest even), the scales' and the RoPE values' bytes; the rows written into the cache
in place with index_put (distinct slots: the caller's).
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.torch.kvquant_mla import unpack
from kernel_parity.kernels.torch.mla import decode

__all__ = ["mla_decode", "mla_pack"]

ROW_BYTES, D_NOPE, D_ROPE = 656, 512, 64


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
               scale: float, d_v: int = 512, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, 576), kv_cache (num_blocks, page, h_kv, 656) uint8 -> o (b, s_q, h_q, 512) in q.dtype,
    lse (b, h_q, s_q) float32."""
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != ROW_BYTES or kv_cache.dim() not in (3, 4):
        raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, {ROW_BYTES}) uint8, got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    if d_v != D_NOPE:
        raise ValueError(f"d_v must be {D_NOPE}, got {d_v!r}")
    kv = kv_cache if kv_cache.dim() == 4 else kv_cache[:, :, None]
    return decode(q, unpack(kv, q.dtype), block_table, seqlens, scale, d_v=d_v, causal=causal)


def mla_pack(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
             ) -> torch.Tensor:
    """Write [kv_c (n, 512) ; k_pe (n, 64)] (bf16) as 656-byte rows into kv_cache (num_blocks, page, 1, 656) uint8 in
    place at slot_mapping (n,) (-1 skipped); returns kv_cache."""
    cache = kv_cache if kv_cache.dim() == 4 else kv_cache[:, :, None]
    if kv_cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != ROW_BYTES:
        raise ValueError(f"kv_cache must be (num_blocks, page, 1, {ROW_BYTES}) uint8, got {tuple(kv_cache.shape)} "
                         f"{kv_cache.dtype}")
    if kv_c.dim() != 2 or kv_c.shape[1] != D_NOPE or tuple(k_pe.shape) != (kv_c.shape[0], D_ROPE) \
            or k_pe.dtype != torch.bfloat16:
        raise ValueError(f"kv_c must be (n, {D_NOPE}) and k_pe (n, {D_ROPE}) bfloat16, got {tuple(kv_c.shape)}, "
                         f"{tuple(k_pe.shape)} {k_pe.dtype}")
    slots = slot_mapping.to(cache.device).long()
    real = slots != -1
    s = slots[real]
    x = kv_c[real].float().unflatten(-1, (4, 128))  # m, 4, 128
    v = torch.clamp_min(x.abs().amax(dim=-1) / 448.0, 1e-4)
    m, e = torch.frexp(v)  # v = m 2^e, m in [0.5, 1): the least power of two >= v is 2^e, or 2^(e-1) at m = 0.5
    sc = torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))
    codes = (x / sc[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    rows = torch.cat([codes, sc.contiguous().view(torch.uint8), k_pe[real].contiguous().view(torch.uint8)], dim=-1)
    page = cache.shape[1]
    cache[s // page, s % page, 0] = rows
    return kv_cache
