"""Native CPU decode and flash decoding over a quantized KV cache (kernel in kvquant_split.c).

    decode(q, k_cache, v_cache, k_scale, v_scale, seqlens, *, scale=None, out=None, out_lse=None) -> (o, lse)
    decode_split(q, k_cache, v_cache, k_scale, v_scale, seqlens, splits, *, block_table=None, scale=None,
                 out=None, out_lse=None, out_o_parts=None, out_lse_parts=None) -> (o, lse, o_parts, lse_parts)

q: (b, s_q, h_q, d) float32 / float16 / bfloat16, last-dim stride 1, the last s_q tokens (causal bottom-right);
k_cache, v_cache: (b, s_max, h_kv, d) codes (or, decode_split with block_table (b, max_pages) int32, pages
(num_blocks, page, h_kv, d)), int8 | float8_e4m3fn | float8_e5m2 (ml_dtypes), last-dim stride 1; k_scale,
v_scale: float32 (1,) per tensor, (h_kv,) per kv head, or the codes' shape without d per token, one layout for
both; seqlens: (b,) int32, cached tokens (the queries' included). Returns o (b, s_q, h_q, d) in q's dtype, lse
(b, h_q, s_q) float32 (natural log; -inf and O = 0 for a query with no key), and with decode_split o_parts
(splits, b, s_q, h_q, d) float32 (0 for an empty split) and lse_parts (splits, b, h_q, s_q) float32 (-inf for an
empty split). Arithmetic is fp32 with double sums (kvquant_split.c); the golden is refimpl/kvquant_split.py.
Bad arguments: ValueError, one line.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.kvquant_decode import FORMATS
from kernel_parity.kernels.cpu.loader import (check_array, check_output, check_status, dtype_code, element_strides,
                                              load, unit_last_strides)

__all__ = ["decode", "decode_split"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_split")
        lib.kvq_split_kernel.argtypes = (
            [_PTR, _INT, _I64, _I64, _I64] + [_PTR, _I64, _I64, _I64] * 2 + [_INT]
            + [_PTR, _PTR, _INT, _I64, _I64, _I64] + [_PTR, _I64, _I64, _I64, _PTR]
            + [_I64] * 6 + [_PTR, _I64, _FLT] + [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64]
            + [_PTR, _I64, _I64, _I64, _I64] * 2)
        lib.kvq_split_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _check_cache(op: str, q, k_cache, v_cache, k_scale, v_scale, seqlens, block_table):
    """(b, s_q, h_q, d, h_kv, gran 0 / 1 / 2, token-scale strides (3,), max keys a sequence); ValueError unless
    valid."""
    check_array("q", q, 4, "(b, s_q, h_q, d)", _FLOATS)
    b, s_q, h_q, d = q.shape
    lay = "(num_blocks, page, h_kv, d)" if block_table is not None else "(b, s_max, h_kv, d)"
    check_array("k_cache", k_cache, 4, lay, tuple(FORMATS))
    check_array("v_cache", v_cache, 4, lay, (k_cache.dtype,))
    if k_cache.shape[-1] != d or v_cache.shape != k_cache.shape or (block_table is None and k_cache.shape[0] != b):
        raise ValueError(f"{op}: k_cache, v_cache must be {lay} with b={b}, d={d}, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    n0, n1, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, np.ndarray) or s.dtype != _F32:
            raise ValueError(f"{op}: {name} must be a float32 numpy.ndarray, got "
                             f"{getattr(s, 'dtype', type(s).__name__)}")
    grans = {(1,): 0, (h_kv,): 1, (n0, n1, h_kv): 2}
    gk, gv = grans.get(k_scale.shape), grans.get(v_scale.shape)
    if gk is None or gk != gv:
        raise ValueError(f"{op}: k_scale, v_scale must share one shape of (1,), ({h_kv},), ({n0}, {n1}, {h_kv}), "
                         f"got {k_scale.shape} and {v_scale.shape}")
    s_str = element_strides("k_scale", k_scale) if gk == 2 else (0, 0, 0)
    if gk == 2 and element_strides("v_scale", v_scale) != s_str:
        raise ValueError(f"{op}: k_scale, v_scale must share strides, got {k_scale.strides} and {v_scale.strides} "
                         f"bytes")
    check_array("seqlens", seqlens, 1, "(b,)", (_I32,))
    if seqlens.shape != (b,):
        raise ValueError(f"{op}: seqlens must be ({b},), got {seqlens.shape}")
    cap = n1
    if block_table is not None:
        check_array("block_table", block_table, 2, "(b, max_pages)", (_I32,))
        if block_table.shape[0] != b:
            raise ValueError(f"{op}: block_table must be ({b}, max_pages), got {block_table.shape}")
        cap = block_table.shape[1] * n1
    if b and (seqlens.min() < 0 or seqlens.max() > cap):
        raise ValueError(f"{op}: seqlens must lie in [0, {cap}]")
    if block_table is not None:
        for i in range(b):  # the live table entries must name pages of the cache
            used = block_table[i, : -(-int(seqlens[i]) // n1)]
            if used.size and (used.min() < 0 or used.max() >= n0):
                raise ValueError(f"{op}: block_table[{i}] names pages outside [0, {n0})")
    return b, s_q, h_q, d, h_kv, gk, s_str, cap


def _run(op, q, k_cache, v_cache, k_scale, v_scale, seqlens, splits, block_table, scale, out, out_lse, o_parts,
         lse_parts, bnd=None):
    b, s_q, h_q, d, h_kv, gran, s_str, cap = _check_cache(op, q, k_cache, v_cache, k_scale, v_scale, seqlens,
                                                          block_table)
    out = np.empty((b, s_q, h_q, d), q.dtype) if out is None else out
    out_lse = np.empty((b, h_q, s_q), _F32) if out_lse is None else out_lse
    check_output("out", out, (b, s_q, h_q, d), q.dtype, "(b, s_q, h_q, d)")
    check_output("out_lse", out_lse, (b, h_q, s_q), _F32, "(b, h_q, s_q)")
    op_str, lp_str = (0, 0, 0, 0), (0, 0, 0, 0)
    if o_parts is not None:
        check_output("out_o_parts", o_parts, (splits, b, s_q, h_q, d), _F32, "(splits, b, s_q, h_q, d)")
        check_output("out_lse_parts", lse_parts, (splits, b, h_q, s_q), _F32, "(splits, b, h_q, s_q)")
        op_str = unit_last_strides("out_o_parts", o_parts)[:4]
        lp_str = element_strides("out_lse_parts", lse_parts)
    sq = unit_last_strides("q", q)
    sk = unit_last_strides("k_cache", k_cache)
    sv = unit_last_strides("v_cache", v_cache)
    so = unit_last_strides("out", out)
    sl = element_strides("out_lse", out_lse)
    sbt = element_strides("block_table", block_table) if block_table is not None else (0, 0)
    (sln,) = element_strides("seqlens", seqlens)
    lens = seqlens if sln in (0, 1) else np.ascontiguousarray(seqlens)
    if b == 0 or h_q == 0 or s_q == 0:
        return out, out_lse
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    status = _kernels().kvq_split_kernel(
        q.ctypes.data, dtype_code(q.dtype), *sq[:3],
        k_cache.ctypes.data, *sk[:3], v_cache.ctypes.data, *sv[:3], FORMATS[k_cache.dtype],
        k_scale.ctypes.data, v_scale.ctypes.data, gran, *s_str,
        block_table.ctypes.data if block_table is not None else None, *sbt, k_cache.shape[1], lens.ctypes.data,
        b, s_q, h_q, h_kv, d, splits, bnd.ctypes.data if bnd is not None else None, max(cap, 1), sm_scale,
        out.ctypes.data, *so[:3], out_lse.ctypes.data, *sl,
        o_parts.ctypes.data if o_parts is not None else None, *op_str,
        lse_parts.ctypes.data if lse_parts is not None else None, *lp_str)
    check_status(status, "kvq_split_kernel")
    return out, out_lse


def decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray,
           seqlens: np.ndarray, *, scale: float | None = None, out: np.ndarray | None = None,
           out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode of s_q new tokens a sequence over a contiguous quantized cache; (o (b, s_q, h_q, d),
    lse (b, h_q, s_q))."""
    return _run("kvquant.decode", q, k_cache, v_cache, k_scale, v_scale, seqlens, 1, None, scale, out, out_lse,
                None, None)


def _bounds(seqlens, b: int, splits: int, block: int | None, bounds) -> np.ndarray | None:
    """(b, splits + 1) int64 boundaries for fixed blocks or explicit bounds (ValueError, one line, unless they
    cover every sequence); None for equal counts (computed in the kernel)."""
    if block is None and bounds is None:
        return None
    if block is not None and bounds is not None:
        raise ValueError("kvquant.decode_split: give block or bounds, not both")
    L = np.asarray(seqlens, dtype=np.int64).reshape(-1)
    if block is not None:
        if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1 \
                or splits * int(block) < L.max(initial=0):
            raise ValueError(f"kvquant.decode_split: block={block!r} must be an int >= 1 with splits x block >= "
                             f"{L.max(initial=0)} (the longest sequence)")
        return np.ascontiguousarray(np.arange(splits + 1, dtype=np.int64)[None, :] * int(block)).repeat(b, 0)
    t = np.asarray(bounds)
    if t.dtype.kind not in "iu" or t.shape != (b, splits + 1) or (b and ((t[:, 0] != 0).any()
                                                                        or (np.diff(t, axis=1) < 0).any()
                                                                        or (t[:, -1] < L).any())):
        raise ValueError(f"kvquant.decode_split: bounds must be ({b}, {splits + 1}) int, non-decreasing from 0 to at "
                         f"least each sequence's length, got {t.shape} {t.dtype}")
    return np.ascontiguousarray(t, dtype=np.int64)


def decode_split(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray,
                 seqlens: np.ndarray, splits: int, *, block_table: np.ndarray | None = None,
                 scale: float | None = None, out: np.ndarray | None = None, out_lse: np.ndarray | None = None,
                 out_o_parts: np.ndarray | None = None, out_lse_parts: np.ndarray | None = None,
                 block: int | None = None, bounds: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flash decoding in `splits` key ranges a sequence: equal counts, fixed blocks of `block` keys (splits x block
    >= every length) or explicit cumulative `bounds` (b, splits + 1) int, non-decreasing from 0 to at least each
    length (refimpl.attention.split_bounds); (o, lse, o_parts, lse_parts) (module docstring)."""
    if not isinstance(splits, (int, np.integer)) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"kvquant.decode_split: splits={splits!r} must be an int >= 1")
    splits = int(splits)
    b, s_q, h_q, d = np.shape(q) if isinstance(q, np.ndarray) and q.ndim == 4 else (0, 0, 0, 0)
    bnd = _bounds(seqlens, b, splits, block, bounds)
    if out_o_parts is None:
        out_o_parts = np.empty((splits, b, s_q, h_q, d), np.float32)
    if out_lse_parts is None:
        out_lse_parts = np.empty((splits, b, h_q, s_q), np.float32)
    o, lse = _run("kvquant.decode_split", q, k_cache, v_cache, k_scale, v_scale, seqlens, splits, block_table, scale,
                  out, out_lse, out_o_parts, out_lse_parts, bnd)
    return o, lse, out_o_parts, out_lse_parts
