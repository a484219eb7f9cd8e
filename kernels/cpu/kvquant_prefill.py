"""Native CPU chunked prefill over a quantized paged KV cache (kernel in kvquant_prefill.c).

    chunked_prefill(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, hist, block_table, *, scale=None,
                    out=None, out_lse=None) -> (o, lse)

q: (total_q, h_q, d) float32 / float16 / bfloat16, last-dim stride 1, sequence b's queries rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1]; k_cache, v_cache: (num_blocks, page, h_kv, d) int8 | float8_e4m3fn |
float8_e5m2 codes (ml_dtypes), last-dim stride 1, holding sequence b's history and its chunk's own K / V (tokens
0 .. hist_b + L_q,b - 1); k_scale, v_scale: float32 (1,) per tensor, (h_kv,) per kv head, or (num_blocks, page,
h_kv) per (slot, kv head), one layout for both; cu_seqlens_q: (b + 1,) int32 non-decreasing from 0 to total_q;
hist: (b,) int32 >= 0; block_table: (b, max_pages) int32. Returns o (total_q, h_q, d) in q's dtype and lse
(h_q, total_q) float32 (natural log); causal bottom-right (query i of sequence b sees keys j <= hist_b + i), an
empty chunk writes nothing. Arithmetic is fp32 (kvquant_prefill.c); the golden is refimpl/kvquant_prefill.py.
Bad arguments: ValueError, one line.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.kvquant_decode import FORMATS, check_cache
from kernel_parity.kernels.cpu.loader import (check_array, check_output, check_status, dtype_code, element_strides,
                                              load, unit_last_strides)

__all__ = ["chunked_prefill"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_prefill")
        lib.kvq_chunked_prefill_kernel.argtypes = (
            [_PTR, _INT, _I64, _I64] + [_PTR, _I64, _I64, _I64] * 2 + [_INT]
            + [_PTR, _PTR, _INT, _I64, _I64, _I64] + [_PTR, _I64, _I64, _PTR, _PTR]
            + [_I64] * 6 + [_FLT] + [_PTR, _I64, _I64, _PTR, _I64, _I64])
        lib.kvq_chunked_prefill_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _contiguous_1d(name: str, a: np.ndarray) -> np.ndarray:
    (st,) = element_strides(name, a)
    return a if st in (0, 1) or a.size <= 1 else np.ascontiguousarray(a)


def chunked_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray,
                    v_scale: np.ndarray, cu_seqlens_q: np.ndarray, hist: np.ndarray, block_table: np.ndarray, *,
                    scale: float | None = None, out: np.ndarray | None = None,
                    out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Packed query chunks over a paged quantized cache; returns (o (total_q, h_q, d), lse (h_q, total_q))."""
    check_array("q", q, 3, "(total_q, h_q, d)", _FLOATS)
    total_q, h_q, d = q.shape
    nb, page, h_kv, gran, s_str = check_cache("kvquant.chunked_prefill", d, h_q, k_cache, v_cache, k_scale,
                                              v_scale)
    check_array("cu_seqlens_q", cu_seqlens_q, 1, "(b + 1,)", (_I32,))
    b = cu_seqlens_q.shape[0] - 1
    cu = cu_seqlens_q.astype(np.int64)
    if b < 0 or cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != total_q:
        raise ValueError(f"kvquant.chunked_prefill: cu_seqlens_q must run non-decreasing from 0 to total_q = "
                         f"{total_q}, got {cu_seqlens_q.tolist() if cu.size <= 16 else cu.shape}")
    check_array("hist", hist, 1, "(b,)", (_I32,))
    if hist.shape != (b,) or (b and hist.min() < 0):
        raise ValueError(f"kvquant.chunked_prefill: hist must be ({b},) int32 >= 0, got shape {hist.shape}")
    check_array("block_table", block_table, 2, "(b, max_pages)", (_I32,))
    if block_table.shape[0] != b:
        raise ValueError(f"kvquant.chunked_prefill: block_table must be ({b}, max_pages), got {block_table.shape}")
    max_keys = block_table.shape[1] * page
    lk = hist.astype(np.int64) + np.diff(cu)
    if b and lk.max() > max_keys:
        raise ValueError(f"kvquant.chunked_prefill: hist + chunk length must be <= max_pages * page = {max_keys}, "
                         f"got {int(lk.max())}")
    for i in range(b):  # the live table entries of a sequence with rows must name pages of the cache
        if cu[i + 1] == cu[i]:
            continue
        used = block_table[i, : -(-int(lk[i]) // page)]
        if used.size and (used.min() < 0 or used.max() >= nb):
            raise ValueError(f"kvquant.chunked_prefill: block_table[{i}] names pages outside [0, {nb})")
    out = np.empty((total_q, h_q, d), q.dtype) if out is None else out
    out_lse = np.empty((h_q, total_q), _F32) if out_lse is None else out_lse
    check_output("out", out, (total_q, h_q, d), q.dtype, "(total_q, h_q, d)")
    check_output("out_lse", out_lse, (h_q, total_q), _F32, "(h_q, total_q)")
    sq = unit_last_strides("q", q)
    sk = unit_last_strides("k_cache", k_cache)
    sv = unit_last_strides("v_cache", v_cache)
    so = unit_last_strides("out", out)
    sl = element_strides("out_lse", out_lse)
    sbt = element_strides("block_table", block_table)
    cu32, hist32 = _contiguous_1d("cu_seqlens_q", cu_seqlens_q), _contiguous_1d("hist", hist)
    if b == 0 or total_q == 0 or h_q == 0:
        return out, out_lse
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    status = _kernels().kvq_chunked_prefill_kernel(
        q.ctypes.data, dtype_code(q.dtype), sq[0], sq[1],
        k_cache.ctypes.data, sk[0], sk[1], sk[2], v_cache.ctypes.data, sv[0], sv[1], sv[2], FORMATS[k_cache.dtype],
        k_scale.ctypes.data, v_scale.ctypes.data, gran, *s_str,
        block_table.ctypes.data, sbt[0], sbt[1], cu32.ctypes.data, hist32.ctypes.data,
        b, h_q, h_kv, d, page, max_keys, sm_scale, out.ctypes.data, so[0], so[1], out_lse.ctypes.data, sl[0], sl[1])
    check_status(status, "kvq_chunked_prefill_kernel")
    return out, out_lse
