"""Golden write path of a quantized paged KV cache (kvquant.update, issue 34): quantize on append.

    slot = slot_mapping[t]                         page * page_size + offset; -1: a padding token, not written
    cache[slot // page, slot % page, h, :] = quantize(new[t, h, :], s(t, h), fmt)       refimpl/kvquant.py
    s(t, h) = scale[0]             gran "tensor"  (static, calibrated: vLLM's k_scale / v_scale)
            = scale[h]             gran "head"    (static, one a kv head)
            = float32(amax_d |new[t, h, :]|) / FMAX     gran "token" (dynamic), also written:
              scale_cache[slot // page, slot % page, h] = s(t, h)

vLLM's reshape_and_cache_flash with kv_cache_dtype "fp8" / "fp8_e5m2" and k_scale / v_scale
(csrc/cache_kernels.cu; the conversion scaled_vec_conversion of csrc/quantization/fp8/nvidia/quant_utils.cuh:
x / scale in float32, then __nv_cvt_float_to_fp8 with __NV_SATFINITE): the new token's K or V, in the
model's dtype (bf16 / fp16 / fp32, widened exactly to float32), is divided by its scale with the IEEE float32
division (correctly rounded: a kernel that multiplies by a float32 reciprocal differs where the quotient
lands on or next to a rounding midpoint of the code grid), then
- e4m3 / e5m2: clamped to +-FMAX (448 / 57344: saturation, never inf or NaN) and rounded to nearest even;
- int8: rounded half to even, then clamped to [-128, 127] (vLLM's float_to_int8_rn);
and the code stored at the token's slot. Per-token dynamic scales (gran "token") are the amax of the token's
head row over d divided by FMAX (float32, IEEE); a row of zeros has scale 0 and codes 0, and its scale 0
is stored. Codes compare bit for bit (float8 bit patterns, two's complement int8), and so do the stored
float32 scales.

Conventions: K and V are two calls with their own scales (vLLM's k_scale / v_scale), each of
`update(cache, new, slot_mapping, ...)`. Slots the batch does not map to keep their old codes (and old
scales): the cache holds other sequences' tokens. slot_mapping's entries are distinct (the caller's
guarantee in vLLM: two tokens never share a slot; refused here) and in [0, num_blocks * page) or -1.
Static scales are finite and > 0; new is finite (the golden refuses NaN / inf: their codes are the
hardware's business, not a convention).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

GRANS = ("tensor", "head", "token")


def _fail(msg: str) -> None:
    raise ValueError(f"kvquant.update: {msg}")


def update(cache: NDArray, new: NDArray, slot_mapping: NDArray, *, fmt: str, gran: str,
           scale: NDArray | None = None, scale_cache: NDArray | None = None
           ) -> tuple[NDArray, NDArray | None]:
    """(the cache after the write, the scale cache after it or None): new arrays, the inputs are not modified.

    cache: (num_blocks, page, h_kv, d) codes of refimpl.kvquant.STORAGE[fmt] (float8_e4m3fn, float8_e5m2, int8)
    new: (n, h_kv, d) float values (the test dtype's, or their float64 widening: exact in float32)
    slot_mapping: (n,) int, each token's slot page * page_size + offset, or -1 (a padding token: skipped)
    fmt: "e4m3" | "e5m2" | "int8";  gran: "tensor" | "head" | "token"
    scale: (1,) float32 (tensor) or (h_kv,) float32 (head); None for token
    scale_cache: (num_blocks, page, h_kv) float32, gran token only: the per-(slot, head) scales
    """
    from kernel_parity.refimpl import kvquant as kq

    if fmt not in kq.FORMATS:
        _fail(f"fmt={fmt!r} must be one of {', '.join(kq.FORMATS)}")
    if gran not in GRANS:
        _fail(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    cache, new = np.asarray(cache), np.asarray(new)
    if cache.ndim != 4 or cache.dtype != np.dtype(kq.STORAGE[fmt]):
        _fail(f"cache must be (num_blocks, page, h_kv, d) of {np.dtype(kq.STORAGE[fmt])}, got {cache.dtype} "
              f"{cache.shape}")
    nb, page, h, d = cache.shape
    if new.ndim != 3 or new.shape[1:] != (h, d) or new.dtype.kind != "f":
        _fail(f"new must be a float (n, {h}, {d}) array, got {new.dtype} {new.shape}")
    n = new.shape[0]
    slots = np.asarray(slot_mapping)
    if slots.shape != (n,) or slots.dtype.kind not in "iu":
        _fail(f"slot_mapping must be ({n},) integers, got {slots.dtype} {slots.shape}")
    slots = slots.astype(np.int64)
    if ((slots < -1) | (slots >= nb * page)).any():
        _fail(f"slot_mapping entries must be -1 or in [0, {nb * page}), got {slots.min()}..{slots.max()}")
    real = slots >= 0
    if np.unique(slots[real]).size != int(real.sum()):
        _fail("slot_mapping's slots must be distinct (two tokens written to one slot)")
    x32 = new.astype(np.float32)
    if not np.isfinite(x32).all():
        _fail("new must be finite")
    if gran == "token":
        if scale is not None:
            _fail("gran token computes its scales (scale must be None)")
        sc = np.asarray(scale_cache) if scale_cache is not None else None
        if sc is None or sc.shape != (nb, page, h) or sc.dtype != np.float32:
            _fail(f"gran token needs scale_cache ({nb}, {page}, {h}) float32")
        s = kq.dynamic_scale(x32, fmt, axis=-1)  # (n, h)
    else:
        if scale_cache is not None:
            _fail(f"gran {gran} has static scales (scale_cache must be None)")
        want = (1,) if gran == "tensor" else (h,)
        s = np.asarray(scale) if scale is not None else None
        if s is None or s.shape != want:
            _fail(f"gran {gran} needs scale of shape {want}")
        s32 = s.astype(np.float32)
        if not (np.isfinite(s32).all() and (s32 > 0).all()):
            _fail("static scales must be finite and > 0")
        s = np.broadcast_to(s32[None, :], (n, h))
    codes = kq.quantize(x32, s[:, :, None], fmt)
    out = np.array(cache, copy=True)
    flat = out.reshape(nb * page, h, d)
    flat[slots[real]] = codes[real]
    sc_out = None
    if gran == "token":
        sc_out = np.array(scale_cache, dtype=np.float32, copy=True)
        sc_out.reshape(nb * page, h)[slots[real]] = s[real]
    return out, sc_out
