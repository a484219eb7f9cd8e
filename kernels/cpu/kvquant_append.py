"""Native CPU decode step over a quantized paged KV cache (kernel in kvquant_append.c): kvquant.append_decode.

    append_decode(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, fmt, gran, *, k_scale=None,
                  v_scale=None, k_scale_cache=None, v_scale_cache=None, scale=None, out=None, out_lse=None)
        -> (o, lse)

Each sequence's new token (k_new, v_new (b, h_kv, d)) is quantized into the caches at position seq_lens[b]
(kvquant.update's rules, in place; gran token also writes its scales into the scale caches), then q (b, h_q, d)
attends over the seq_lens[b] + 1 keys, the new one read back as quantized. Conventions: refimpl/kvquant_append.py.

q, k_new, v_new: float32 / float16 / bfloat16, last-axis stride 1 (k_new, v_new one dtype, finite: checked);
k_cache, v_cache: (num_blocks, page, h_kv, d) of fmt's storage (ml_dtypes float8_e4m3fn / float8_e5m2, int8),
writeable, last-axis stride 1; k_scale, v_scale: (1,) / (h_kv,) float32, finite and > 0 (gran tensor / head);
k_scale_cache, v_scale_cache: writeable (num_blocks, page, h_kv) float32 of one layout (gran token);
block_table (b, max_pages) int32; seq_lens (b,) int32 with seq_lens[b] + 1 <= max_pages * page, the new token's
page entry and the live ones in [0, num_blocks), the new slots distinct (all checked). Bad arguments: ValueError,
one line, before anything is written.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.loader import (check_array, check_output, check_status, dtype_code, element_strides,
                                              load, unit_last_strides)

__all__ = ["append_decode", "FORMATS", "GRANS"]

FORMATS = ("e4m3", "e5m2", "int8")
GRANS = ("tensor", "head", "token")
STORAGE = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2),
           "int8": np.dtype(np.int8)}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_append")
        lib.kvq_append_decode_kernel.argtypes = (
            [_PTR, _INT, _I64, _I64] + [_PTR, _PTR, _INT, _I64, _I64, _I64, _I64]
            + [_PTR, _I64, _I64, _I64] * 2 + [_INT]
            + [_PTR, _PTR, _INT, _I64, _I64, _I64] + [_PTR, _I64, _I64, _PTR]
            + [_I64] * 6 + [_FLT] + [_PTR, _I64, _I64, _PTR, _I64, _I64])
        lib.kvq_append_decode_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _bad(msg: str) -> None:
    raise ValueError(f"kvquant.append_decode: {msg}")


def append_decode(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  block_table: np.ndarray, seq_lens: np.ndarray, fmt: str, gran: str, *,
                  k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None,
                  k_scale_cache: np.ndarray | None = None, v_scale_cache: np.ndarray | None = None,
                  scale: float | None = None, out: np.ndarray | None = None,
                  out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One decode step (module docstring): the caches (and scale caches) written in place; returns (o, lse)."""
    if fmt not in FORMATS:
        _bad(f"fmt={fmt!r} must be one of {', '.join(FORMATS)}")
    if gran not in GRANS:
        _bad(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    check_array("q", q, 3, "(b, h_q, d)", _FLOATS)
    b, h_q, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_array(name, c, 4, "(num_blocks, page, h_kv, d)", (STORAGE[fmt],))
        if not c.flags.writeable:
            _bad(f"{name} must be writeable")
    if k_cache.shape[-1] != d or v_cache.shape != k_cache.shape:
        _bad(f"k_cache, v_cache must be (num_blocks, page, h_kv, d={d}), got {k_cache.shape} and {v_cache.shape}")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        _bad(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    check_array("k_new", k_new, 3, "(b, h_kv, d)", _FLOATS)
    check_array("v_new", v_new, 3, "(b, h_kv, d)", (k_new.dtype,))
    if k_new.shape != (b, h_kv, d) or v_new.shape != (b, h_kv, d):
        _bad(f"k_new, v_new must be ({b}, {h_kv}, {d}), got {k_new.shape} and {v_new.shape}")
    if not (np.isfinite(k_new.astype(np.float32)).all() and np.isfinite(v_new.astype(np.float32)).all()):
        _bad("k_new, v_new must be finite (NaN / inf codes are the hardware's, not a convention)")
    s_str = (0, 0, 0)
    if gran == "token":
        if k_scale is not None or v_scale is not None:
            _bad("gran token computes its scales: k_scale, v_scale must be None")
        for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            check_array(name, sc, 3, "(num_blocks, page, h_kv)", (_F32,))
            if sc.shape != (nb, page, h_kv) or not sc.flags.writeable:
                _bad(f"{name} must be a writeable ({nb}, {page}, {h_kv}) float32 array, got {sc.shape}")
        s_str = element_strides("k_scale_cache", k_scale_cache)
        if element_strides("v_scale_cache", v_scale_cache) != s_str:
            _bad(f"k_scale_cache, v_scale_cache must share strides, got {k_scale_cache.strides} and "
                 f"{v_scale_cache.strides} bytes")
        ks, vs = k_scale_cache, v_scale_cache
    else:
        if k_scale_cache is not None or v_scale_cache is not None:
            _bad(f"gran {gran} has static scales: k_scale_cache, v_scale_cache must be None")
        want = (1,) if gran == "tensor" else (h_kv,)
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_array(name, s, 1, str(want), (_F32,))
            if s.shape != want:
                _bad(f"gran {gran} needs {name} of shape {want}, got {s.shape}")
            if not (np.isfinite(s).all() and (s > 0).all()):
                _bad(f"{name}: static scales must be finite and > 0")
        ks, vs = np.ascontiguousarray(k_scale), np.ascontiguousarray(v_scale)
    check_array("block_table", block_table, 2, "(b, max_pages)", (_I32,))
    check_array("seq_lens", seq_lens, 1, "(b,)", (_I32,))
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        _bad(f"block_table must be ({b}, max_pages) and seq_lens ({b},), got {block_table.shape} and "
             f"{seq_lens.shape}")
    max_keys = block_table.shape[1] * page
    if b and (seq_lens.min() < 0 or seq_lens.max() + 1 > max_keys):
        _bad(f"seq_lens must lie in [0, max_pages * page - 1 = {max_keys - 1}] (the new token needs a slot)")
    for i in range(b):  # the live table entries (the new token's page included) must name pages of the cache
        used = block_table[i, : int(seq_lens[i]) // page + 1]
        if used.min() < 0 or used.max() >= nb:
            _bad(f"block_table[{i}] names pages outside [0, {nb})")
    if b:
        lens64 = seq_lens.astype(np.int64)
        slots = block_table[np.arange(b), lens64 // page].astype(np.int64) * page + lens64 % page
        if np.unique(slots).size != b:
            _bad("the new tokens' slots must be distinct (two sequences append to one slot)")
    out = np.empty((b, h_q, d), q.dtype) if out is None else out
    out_lse = np.empty((b, h_q), _F32) if out_lse is None else out_lse
    check_output("out", out, (b, h_q, d), q.dtype, "(b, h_q, d)")
    check_output("out_lse", out_lse, (b, h_q), _F32, "(b, h_q)")
    sq = unit_last_strides("q", q)
    skn = unit_last_strides("k_new", k_new)
    svn = unit_last_strides("v_new", v_new)
    sk = unit_last_strides("k_cache", k_cache)
    sv = unit_last_strides("v_cache", v_cache)
    so = unit_last_strides("out", out)
    sl = element_strides("out_lse", out_lse)
    sbt = element_strides("block_table", block_table)
    lens = np.ascontiguousarray(seq_lens)
    if b == 0 or h_q == 0:
        return out, out_lse
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    status = _kernels().kvq_append_decode_kernel(
        q.ctypes.data, dtype_code(q.dtype), sq[0], sq[1],
        k_new.ctypes.data, v_new.ctypes.data, dtype_code(k_new.dtype), skn[0], skn[1], svn[0], svn[1],
        k_cache.ctypes.data, sk[0], sk[1], sk[2], v_cache.ctypes.data, sv[0], sv[1], sv[2], FORMATS.index(fmt),
        ks.ctypes.data, vs.ctypes.data, GRANS.index(gran), *s_str,
        block_table.ctypes.data, sbt[0], sbt[1], lens.ctypes.data,
        b, h_q, h_kv, d, page, max_keys, sm_scale, out.ctypes.data, so[0], so[1], out_lse.ctypes.data, sl[0], sl[1])
    check_status(status, "kvq_append_decode_kernel")
    return out, out_lse
