"""Native CPU paged decode attention over a quantized KV cache (kernel in kvquant_decode.c).

    decode_paged(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, *, scale=None, out=None,
                 out_lse=None) -> (o, lse)

q: (b, h_q, d) float32 / float16 / bfloat16, last-dim stride 1; k_cache, v_cache: (num_blocks, page, h_kv, d)
int8 | float8_e4m3fn | float8_e5m2 codes (ml_dtypes), last-dim stride 1; k_scale, v_scale: float32 (1,) per
tensor, (h_kv,) per kv head, or (num_blocks, page, h_kv) per (slot, kv head), one layout for both;
block_table: (b, max_pages) int32; seq_lens: (b,) int32 in [0, max_pages * page]. Returns o (b, h_q, d) in
q's dtype and lse (b, h_q) float32 (natural log; -inf and O = 0 for an empty sequence). Arithmetic is fp32
(kvquant_decode.c); the golden is refimpl/kvquant_decode.py. Bad arguments: ValueError, one line.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.loader import (check_array, check_output, check_status, dtype_code, element_strides,
                                              load, unit_last_strides)

__all__ = ["decode_paged", "FORMATS"]

FORMATS = {np.dtype(ml_dtypes.float8_e4m3fn): 0, np.dtype(ml_dtypes.float8_e5m2): 1, np.dtype(np.int8): 2}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_decode")
        lib.kvq_decode_paged_kernel.argtypes = (
            [_PTR, _INT, _I64, _I64] + [_PTR, _I64, _I64, _I64] * 2 + [_INT]
            + [_PTR, _PTR, _INT, _I64, _I64, _I64] + [_PTR, _I64, _I64, _PTR]
            + [_I64] * 6 + [_FLT] + [_PTR, _I64, _I64, _PTR, _I64, _I64])
        lib.kvq_decode_paged_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def check_cache(op: str, d: int, h_q: int, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray,
                v_scale: np.ndarray) -> tuple[int, int, int, int, tuple[int, int, int]]:
    """The quantized cache and its scales against q's d and h_q (ValueError naming `op` unless valid):
    (num_blocks, page, h_kv, the scale granularity 0 tensor / 1 head / 2 token, the per-token scales' strides)."""
    check_array("k_cache", k_cache, 4, "(num_blocks, page, h_kv, d)", tuple(FORMATS))
    check_array("v_cache", v_cache, 4, "(num_blocks, page, h_kv, d)", (k_cache.dtype,))
    if k_cache.shape[-1] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache, v_cache must be (num_blocks, page, h_kv, d={d}), got "
                         f"{k_cache.shape} and {v_cache.shape}")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    grans = {(1,): 0, (h_kv,): 1, (nb, page, h_kv): 2}
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, np.ndarray) or s.dtype != _F32:
            raise ValueError(f"{op}: {name} must be a float32 numpy.ndarray, got "
                             f"{getattr(s, 'dtype', type(s).__name__)}")
    gk, gv = grans.get(k_scale.shape), grans.get(v_scale.shape)
    if gk is None or gk != gv:
        raise ValueError(f"{op}: k_scale, v_scale must share one shape of (1,), ({h_kv},), "
                         f"({nb}, {page}, {h_kv}), got {k_scale.shape} and {v_scale.shape}")
    s_str = element_strides("k_scale", k_scale) if gk == 2 else (0, 0, 0)
    if gk == 2 and element_strides("v_scale", v_scale) != s_str:
        raise ValueError(f"{op}: k_scale, v_scale must share strides, got {k_scale.strides} and "
                         f"{v_scale.strides} bytes")
    return nb, page, h_kv, gk, s_str


def decode_paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray,
                 v_scale: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray, *, scale: float | None = None,
                 out: np.ndarray | None = None, out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode of one new token a sequence over a paged quantized cache; returns (o (b, h_q, d), lse (b, h_q))."""
    check_array("q", q, 3, "(b, h_q, d)", _FLOATS)
    b, h_q, d = q.shape
    nb, page, h_kv, gran, s_str = check_cache("kvquant.decode_paged", d, h_q, k_cache, v_cache, k_scale, v_scale)
    check_array("block_table", block_table, 2, "(b, max_pages)", (_I32,))
    check_array("seq_lens", seq_lens, 1, "(b,)", (_I32,))
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"kvquant.decode_paged: block_table must be ({b}, max_pages) and seq_lens ({b},), got "
                         f"{block_table.shape} and {seq_lens.shape}")
    max_keys = block_table.shape[1] * page
    if b and (seq_lens.min() < 0 or seq_lens.max() > max_keys):
        raise ValueError(f"kvquant.decode_paged: seq_lens must lie in [0, max_pages * page = {max_keys}]")
    for i in range(b):  # the live table entries must name pages of the cache
        used = block_table[i, : -(-int(seq_lens[i]) // page)]
        if used.size and (used.min() < 0 or used.max() >= nb):
            raise ValueError(f"kvquant.decode_paged: block_table[{i}] names pages outside [0, {nb})")
    out = np.empty((b, h_q, d), q.dtype) if out is None else out
    out_lse = np.empty((b, h_q), _F32) if out_lse is None else out_lse
    check_output("out", out, (b, h_q, d), q.dtype, "(b, h_q, d)")
    check_output("out_lse", out_lse, (b, h_q), _F32, "(b, h_q)")
    sq = unit_last_strides("q", q)
    sk = unit_last_strides("k_cache", k_cache)
    sv = unit_last_strides("v_cache", v_cache)
    so = unit_last_strides("out", out)
    sl = element_strides("out_lse", out_lse)
    sbt = element_strides("block_table", block_table)
    (sln,) = element_strides("seq_lens", seq_lens)
    lens = seq_lens if sln in (0, 1) else np.ascontiguousarray(seq_lens)
    if b == 0 or h_q == 0:
        return out, out_lse
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    status = _kernels().kvq_decode_paged_kernel(
        q.ctypes.data, dtype_code(q.dtype), sq[0], sq[1],
        k_cache.ctypes.data, sk[0], sk[1], sk[2], v_cache.ctypes.data, sv[0], sv[1], sv[2], FORMATS[k_cache.dtype],
        k_scale.ctypes.data, v_scale.ctypes.data, gran, *s_str,
        block_table.ctypes.data, sbt[0], sbt[1], lens.ctypes.data,
        b, h_q, h_kv, d, page, max_keys, sm_scale, out.ctypes.data, so[0], so[1], out_lse.ctypes.data, sl[0], sl[1])
    check_status(status, "kvq_decode_paged_kernel")
    return out, out_lse
