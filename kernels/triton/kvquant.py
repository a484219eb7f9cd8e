"""Quantized KV cache write (quantize on append) in Triton: kvquant.update, vLLM's reshape_and_cache_flash with
an fp8 (e4m3 / e5m2) or int8 cache and static (per tensor, per kv head) or dynamic per-token scales.

    update(cache, new, slot_mapping, fmt, gran, *, scale=None, scale_cache=None)      in place, K and V apart

One program per (token, block of BLOCK_H kv heads): it loads the token's slot (-1: return at once, a
padding token writes nothing; so does a slot past the cache, which the caller must not pass), its (BLOCK_H, d) values widened to fp32, the heads' scales
(tensor: scale[0]; head: scale[h]; token: amax over d / FMAX, stored into scale_cache at the slot), then

    v = x / s                       tl.math.div_rn: the IEEE round-to-nearest division (Triton's `/` on fp32
                                    is the approximate div.full.f32 on the GPU: on an H200, Triton 3.6, it gave
                                    1,247,494 of 4,194,304 random quotients other bits than IEEE, div_rn none;
                                    a reciprocal multiply, or an approximate quotient, lands on the other side of
                                    a code midpoint)
    e4m3 / e5m2: clamp to +-FMAX, .to(tl.float8e4nv / tl.float8e5)   (cvt.rn.satfinite on the GPU: nearest
                                    even, and it saturates by itself, inf included: checked on an H200 with
                                    Triton 3.6; the clamp states it whatever the cast does)
    int8: clamp to [-128, 127], round half to even as (v + 1.5 * 2^23) - 1.5 * 2^23 (exact for |v| <= 2^22 in
          fp32 arithmetic with round-to-nearest-even adds; libdevice's rint has no interpreter path), to int8
    s = 0 (a row of zeros, gran token): codes 0, never 0 / 0

and stores the codes (bitcast to bytes: the caches are passed as uint8 views) at cache[slot // page,
slot % page]. Conventions: refimpl/kvquant_update.py (golden) and refimpl/kvquant.py (formats); argument rules
kernels/torch/kvquant.py `check_update`. Slot values (range, distinctness) are the caller's: not checked
(a device sync).

Triton interpreter (CPU): its fp32 -> fp8 cast is fixed by the harness to the GPU's (conformance/backends/
triton_interpreter.py: saturating, nearest even, signed zeros); tl.math.div_rn is numpy's IEEE division there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.torch.kvquant import FMAX, check_update

_FMT = {"e4m3": 0, "e5m2": 1, "int8": 2}
_GRAN = {"tensor": 0, "head": 1, "token": 2}
SLAB = 4096  # values a program holds (BLOCK_H * BLOCK_D)
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + M - M rounds v to an integer, half to even, for |v| <= 2^22


@triton.jit
def _kvquant_update_kernel(
    Cache_ptr, New_ptr, Slot_ptr, Scale_ptr, SC_ptr, h_kv, d, page, nslots,
    stride_cb, stride_cp, stride_ch, stride_nt, stride_nh, stride_scb, stride_scp, stride_sch, stride_s,
    FMT: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= nslots):  # a padding token (vLLM's -1), or a slot past the cache: nothing written
        return
    blk = slot // page
    off = slot % page
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < h_kv
    mask = mask_h[:, None] & (offs_d < d)[None, :]
    x = tl.load(New_ptr + t.to(tl.int64) * stride_nt + offs_h[:, None] * stride_nh + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if GRAN == 2:  # dynamic: one scale a (token, head), stored beside the codes
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.math.div_rn(amax, QMAX)
        tl.store(SC_ptr + blk * stride_scb + off * stride_scp + offs_h * stride_sch, s, mask=mask_h)
    else:  # static: tensor (stride 0) or per kv head
        s = tl.load(Scale_ptr + offs_h * stride_s, mask=mask_h, other=1.0)
    zero = s == 0.0
    v = tl.math.div_rn(x, tl.where(zero, 1.0, s)[:, None])
    v = tl.where(zero[:, None], 0.0, v)
    if FMT == 2:
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        v = (v + RNE_MAGIC) - RNE_MAGIC
        q = v.to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)  # saturate (__NV_SATFINITE)
        if FMT == 0:
            q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    dst = Cache_ptr + blk * stride_cb + off * stride_cp
    tl.store(dst + offs_h[:, None] * stride_ch + offs_d[None, :], q, mask=mask)


def update(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, fmt: str, gran: str, *,
           scale: torch.Tensor | None = None, scale_cache: torch.Tensor | None = None) -> None:
    """Quantize `new` (n, h_kv, d) into `cache` (num_blocks, page, h_kv, d) of fmt's storage dtype in place at
    slot_mapping's slots (-1 skipped); gran token also writes the scales into scale_cache (num_blocks, page,
    h_kv) fp32. cache and new: last-dim stride 1, other strides arbitrary; scale (1,) / (h_kv,) fp32."""
    check_update(cache, new, slot_mapping, fmt, gran, scale, scale_cache)
    nb, page, h, d = cache.shape
    n = new.shape[0]
    if n == 0 or h * d == 0 or nb * page == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), SLAB // block_d))
    cache_u8 = cache.view(torch.uint8)
    token = gran == "token"
    sc = scale_cache if token else cache_u8  # unused pointer when static
    sp = scale if not token else slot_mapping  # unused pointer when dynamic
    stride_s = 0 if gran == "tensor" else (scale.stride(0) if gran == "head" else 0)
    _kvquant_update_kernel[(n, triton.cdiv(h, block_h))](
        cache_u8, new, slot_mapping, sp, sc, h, d, page, nb * page,
        *cache_u8.stride()[:3], *new.stride()[:2],
        *(scale_cache.stride() if token else (0, 0, 0)), stride_s,
        FMT=_FMT[fmt], GRAN=_GRAN[gran], QMAX=FMAX[fmt], BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
