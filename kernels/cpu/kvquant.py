"""Native CPU quantized KV cache write (kernel in kvquant.c): kvquant.update, quantize on append.

    update(cache, new, slot_mapping, fmt, gran, *, scale=None, scale_cache=None)      in place, K and V apart

    s(t, h) = scale[0] (tensor) | scale[h] (head) | amax_d |new[t, h, :]| / FMAX (token, written to scale_cache)
    cache[slot // page, slot % page, h, :] = Q(float32(new[t, h, :]) / s(t, h))        slot = slot_mapping[t] != -1

cache: (num_blocks, page, h_kv, d) of ml_dtypes.float8_e4m3fn / float8_e5m2 / int8 (fmt's storage), written in
      place; last-axis stride 1, other strides any
new: (n, h_kv, d) float32 / float16 / bfloat16, finite (checked), last-axis stride 1
slot_mapping: (n,) int64, distinct slots in [0, num_blocks * page) or -1 (padding: skipped); checked
scale: (1,) float32 (tensor) or (h_kv,) float32 (head), finite and > 0 (checked); None for token
scale_cache: (num_blocks, page, h_kv) float32 for gran token (written in place), else None

Q is refimpl/kvquant.py's: x / s the IEEE float32 division, then e4m3 / e5m2 saturated to +-FMAX and
rounded to nearest even by an exact software encoder, or int8 rounded half to even and clamped to
[-128, 127]. Conventions: refimpl/kvquant_update.py (the golden). Bad arguments: ValueError before anything
is written.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.loader import (check_array, check_status, dtype_code, element_strides, load,
                                              unit_last_strides)

__all__ = ["update", "FORMATS", "GRANS"]

FORMATS = ("e4m3", "e5m2", "int8")
GRANS = ("tensor", "head", "token")
STORAGE = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2),
           "int8": np.dtype(np.int8)}
_NEW = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32 = np.dtype(np.float32)
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant")
        lib.kvquant_update_kernel.argtypes = [_PTR, _INT, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64,
                                              _I64, _I64, _INT, _PTR, _I64, _PTR, _I64, _I64, _I64]
        lib.kvquant_update_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _bad(msg: str) -> None:
    raise ValueError(f"kvquant.update: {msg}")


def update(cache: np.ndarray, new: np.ndarray, slot_mapping: np.ndarray, fmt: str, gran: str, *,
           scale: np.ndarray | None = None, scale_cache: np.ndarray | None = None) -> None:
    """Quantize `new` into `cache` in place at slot_mapping's slots (-1 skipped); gran token also writes the
    scales into scale_cache. See the module docstring for shapes and conventions."""
    if fmt not in FORMATS:
        _bad(f"fmt={fmt!r} must be one of {', '.join(FORMATS)}")
    if gran not in GRANS:
        _bad(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    check_array("cache", cache, 4, "(num_blocks, page, h_kv, d)", (STORAGE[fmt],))
    if not cache.flags.writeable:
        _bad("cache must be writeable")
    nb, page, h, d = cache.shape
    check_array("new", new, 3, "(n, h_kv, d)", _NEW)
    if new.shape[1:] != (h, d):
        _bad(f"new must be (n, {h}, {d}) like the cache's heads, got {new.shape}")
    n = new.shape[0]
    if not np.isfinite(new.astype(np.float32)).all():
        _bad("new must be finite (NaN / inf codes are the hardware's, not a convention)")
    check_array("slot_mapping", slot_mapping, 1, "(n,)", (np.dtype(np.int64),))
    if slot_mapping.shape != (n,):
        _bad(f"slot_mapping must have shape ({n},), got {slot_mapping.shape}")
    slots = np.ascontiguousarray(slot_mapping)
    if n and (slots.min() < -1 or slots.max() >= nb * page):
        _bad(f"slot_mapping entries must be -1 or in [0, {nb * page}), got {slots.min()}..{slots.max()}")
    real = slots[slots >= 0]
    if np.unique(real).size != real.size:
        _bad("slot_mapping's slots must be distinct (two tokens written to one slot)")
    sc_strides = (0, 0, 0)
    if gran == "token":
        if scale is not None:
            _bad("gran token computes its scales: scale must be None")
        check_array("scale_cache", scale_cache, 3, "(num_blocks, page, h_kv)", (_F32,))
        if scale_cache.shape != (nb, page, h) or not scale_cache.flags.writeable:
            _bad(f"scale_cache must be a writeable ({nb}, {page}, {h}) float32 array, got {scale_cache.shape}")
        sc_strides = element_strides("scale_cache", scale_cache)
        stride_s = 0
    else:
        if scale_cache is not None:
            _bad(f"gran {gran} has static scales: scale_cache must be None")
        want = (1,) if gran == "tensor" else (h,)
        check_array("scale", scale, 1, str(want), (_F32,))
        if scale.shape != want:
            _bad(f"gran {gran} needs scale of shape {want}, got {scale.shape}")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            _bad("static scales must be finite and > 0")
        stride_s = 0 if gran == "tensor" else element_strides("scale", scale)[0]
    stride_cb, stride_cp, stride_ch, _ = unit_last_strides("cache", cache)
    stride_nt, stride_nh, _ = unit_last_strides("new", new)
    if n == 0 or h * d == 0:
        return
    status = _kernels().kvquant_update_kernel(
        new.ctypes.data, dtype_code(new.dtype), stride_nt, stride_nh, slots.ctypes.data, n, h, d,
        cache.ctypes.data, stride_cb, stride_cp, stride_ch, page, nb * page, FORMATS.index(fmt),
        None if gran == "token" else scale.ctypes.data, stride_s,
        scale_cache.ctypes.data if gran == "token" else None, *sc_strides)
    check_status(status, "kvquant_update_kernel")
