"""Native CPU FlashMLA sparse MLA decode over its 656-byte FP8 KV cache rows (kernel in kvquant_mla.c).

    kvquant_mla_sparse(q, kv_cache, indices, topk_length, scale, d_v=512, out=None, out_lse=None) -> (o, lse)

q: (b, s_q, h_q, 576) bfloat16 (ml_dtypes), last axis unit-stride; kv_cache: (num_blocks, page, h_kv, 656) (or
(num_blocks, page, 656): h_kv = 1) uint8 rows [512 e4m3fn codes | 4 float32 scales | 64 bf16 RoPE], any strides
but a unit-stride last axis (FlashMLA's test pads a block to page + 1 rows); indices: (b, s_q, h_kv, topk) (or
(b, s_q, topk) with h_kv = 1) int32 flat slots block * page + offset, -1 padding; topk_length: (b,) int32 or None.
Returns o (b, s_q, h_q, 512) bfloat16 and lse (b, h_q, s_q) float32 (natural log; O = 0, LSE = -inf for a row
with no used entry); `out` / `out_lse` used when given. A used entry (not -1, before topk_length) outside
[0, num_blocks * page) is refused (ValueError), as the golden (refimpl/kvquant_mla.py) refuses it.
Arithmetic: kvquant_mla.c (fp32, the bytes decoded in software, the scales folded in per 128-group).
"""

from __future__ import annotations

import ctypes
import math
import numbers

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, check_status, element_strides, load

__all__ = ["kvquant_mla_sparse"]

ROW_BYTES, D, D_V = 656, 576, 512
_BF16, _U8, _I32, _F32 = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint8), np.dtype(np.int32),
                          np.dtype(np.float32))
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


class _Params(ctypes.Structure):
    """kvquant_mla.c's kvq_mla_params, field for field."""
    _fields_ = [("q", _PTR), ("stride_q_b", _I64), ("stride_q_s", _I64), ("stride_q_h", _I64),
                ("kv", _PTR), ("stride_kv_blk", _I64), ("stride_kv_slot", _I64), ("stride_kv_head", _I64),
                ("page", _I64),
                ("idx", _PTR), ("stride_i_b", _I64), ("stride_i_s", _I64), ("stride_i_h", _I64), ("stride_i_k", _I64),
                ("topk_len", _PTR),
                ("o", _PTR), ("stride_o_b", _I64), ("stride_o_s", _I64), ("stride_o_h", _I64),
                ("lse", _PTR), ("stride_l_b", _I64), ("stride_l_h", _I64), ("stride_l_s", _I64),
                *[(n, _I64) for n in ("b", "s_q", "h_q", "h_kv", "topk")],
                ("scale", _F64)]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_mla")
        lib.kvq_mla_sparse_kernel.argtypes = [ctypes.POINTER(_Params)]
        lib.kvq_mla_sparse_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _unit_last(name: str, a: np.ndarray) -> tuple[int, ...]:
    strides = element_strides(name, a)
    if a.size and a.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got strides {a.strides} bytes; no copy is made")
    return strides


def _check(q, kv_cache, indices, topk_length, scale, d_v):
    check_array("q", q, 4, f"(b, s_q, h_q, {D})", (_BF16,))
    if q.shape[-1] != D:
        raise ValueError(f"q must be (b, s_q, h_q, {D}), got shape {q.shape}")
    if isinstance(kv_cache, np.ndarray) and kv_cache.ndim == 3:
        kv_cache = kv_cache[:, :, None]
    check_array("kv_cache", kv_cache, 4, f"(num_blocks, page, h_kv, {ROW_BYTES})", (_U8,))
    n_blocks, page, h_kv, row = kv_cache.shape
    if row != ROW_BYTES or page < 1 or h_kv < 1:
        raise ValueError(f"kv_cache must be (num_blocks, page >= 1, h_kv >= 1, {ROW_BYTES}) uint8, "
                         f"got {kv_cache.shape}")
    b, s_q, h_q, _ = q.shape
    if h_q % h_kv:
        raise ValueError(f"h_q = {h_q} must be a multiple of the cache's h_kv = {h_kv}")
    if isinstance(indices, np.ndarray) and indices.ndim == 3 and h_kv == 1:
        indices = indices[:, :, None]
    check_array("indices", indices, 4, "(b, s_q, h_kv, topk)", (_I32,))
    if indices.shape[:3] != (b, s_q, h_kv):
        raise ValueError(f"indices {indices.shape} must be (b, s_q, h_kv, topk) = ({b}, {s_q}, {h_kv}, topk)")
    used = indices != -1
    if topk_length is not None:
        check_array("topk_length", topk_length, 1, "(b,)", (_I32,))
        if topk_length.shape != (b,):
            raise ValueError(f"topk_length must have shape ({b},), got {topk_length.shape}")
        used &= np.arange(indices.shape[-1]) < topk_length.astype(np.int64).reshape(b, 1, 1, 1)
    n_slots = n_blocks * page
    bad = used & ((indices < 0) | (indices >= n_slots))
    if bad.any():
        at = tuple(int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"indices{list(at)} = {indices[at]} must be -1 or lie in [0, {n_slots}) (num_blocks x page)")
    if d_v != D_V:
        raise ValueError(f"d_v must be {D_V} (the rows' NoPE part), got {d_v!r}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return kv_cache, indices


def kvquant_mla_sparse(q: np.ndarray, kv_cache: np.ndarray, indices: np.ndarray, topk_length: np.ndarray | None,
                       scale: float, d_v: int = 512, out: np.ndarray | None = None,
                       out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse MLA decode of q over the FP8 rows its indices name; returns (o, lse) (module docstring)."""
    kv_cache, indices = _check(q, kv_cache, indices, topk_length, scale, d_v)
    b, s_q, h_q, _ = q.shape
    if out is None:
        out = np.empty((b, s_q, h_q, D_V), dtype=_BF16)
    check_output("out", out, (b, s_q, h_q, D_V), _BF16, "(b, s_q, h_q, 512)")
    if out_lse is None:
        out_lse = np.empty((b, h_q, s_q), dtype=_F32)
    check_output("out_lse", out_lse, (b, h_q, s_q), _F32, "(b, h_q, s_q)")
    if out.size == 0:
        out_lse[...] = -np.inf
        return out, out_lse
    p = _Params(page=kv_cache.shape[1], b=b, s_q=s_q, h_q=h_q, h_kv=kv_cache.shape[2], topk=indices.shape[3],
                scale=float(scale))
    p.q = q.ctypes.data
    p.stride_q_b, p.stride_q_s, p.stride_q_h, _ = _unit_last("q", q)
    p.kv = kv_cache.ctypes.data
    p.stride_kv_blk, p.stride_kv_slot, p.stride_kv_head, _ = _unit_last("kv_cache", kv_cache)
    p.idx = indices.ctypes.data
    p.stride_i_b, p.stride_i_s, p.stride_i_h, p.stride_i_k = element_strides("indices", indices)
    if topk_length is not None:
        if topk_length.size > 1 and element_strides("topk_length", topk_length)[0] != 1:
            topk_length = np.ascontiguousarray(topk_length)
        p.topk_len = topk_length.ctypes.data
    p.o = out.ctypes.data
    p.stride_o_b, p.stride_o_s, p.stride_o_h, _ = _unit_last("out", out)
    p.lse = out_lse.ctypes.data
    p.stride_l_b, p.stride_l_h, p.stride_l_s = element_strides("out_lse", out_lse)
    check_status(_kernels().kvq_mla_sparse_kernel(ctypes.byref(p)), "kvq_mla_sparse_kernel")
    return out, out_lse
