"""Native CPU FlashMLA dense paged MLA decode over its 656-byte FP8 KV cache rows, and the rows' write path
(kernels in kvquant_mla_dense.c).

    kvquant_mla_decode(q, kv_cache, block_table, seqlens, scale, d_v=512, causal=True, out=None, out_lse=None)
        -> (o, lse)
    kvquant_mla_pack(kv_cache, kv_c, k_pe, slot_mapping) -> kv_cache     (in place)

q: (b, s_q, h_q, 576) bfloat16 (ml_dtypes), last axis unit-stride; kv_cache: (num_blocks, page, h_kv, 656) (or
(num_blocks, page, 656): h_kv = 1) uint8 rows [512 e4m3fn codes | 4 float32 scales | 64 bf16 RoPE], any strides but
a unit-stride last axis (FlashMLA's test pads a block to page + 1 rows); block_table (b, max_blocks) int32;
seqlens (b,) int32 >= 0. Returns o (b, s_q, h_q, 512) bfloat16 and lse (b, h_q, s_q) float32 (natural log; O = 0,
LSE = -inf for a row with no visible token). A block id a live token's table entry names outside the cache is
refused (ValueError), as the golden (refimpl/kvquant_mla_dense.py) refuses it.
Pack: kv_c (n, 512), k_pe (n, 64) bfloat16, slot_mapping (n,) int64 (-1: padding), the cache (num_blocks, page, 1,
656) uint8 written in place; a slot outside the cache or named twice is refused (ValueError).
"""

from __future__ import annotations

import ctypes
import math
import numbers

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.kvquant_mla import _unit_last
from kernel_parity.kernels.cpu.loader import check_array, check_output, check_status, element_strides, load

__all__ = ["kvquant_mla_decode", "kvquant_mla_pack"]

ROW_BYTES, D, D_V, D_PE = 656, 576, 512, 64
_BF16, _U8, _I32, _I64N, _F32 = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint8), np.dtype(np.int32),
                                 np.dtype(np.int64), np.dtype(np.float32))
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


class _Params(ctypes.Structure):
    """kvquant_mla_dense.c's kvq_mla_dense_params, field for field."""
    _fields_ = [("q", _PTR), ("stride_q_b", _I64), ("stride_q_s", _I64), ("stride_q_h", _I64),
                ("kv", _PTR), ("stride_kv_blk", _I64), ("stride_kv_slot", _I64), ("stride_kv_head", _I64),
                ("page", _I64),
                ("bt", _PTR), ("stride_bt_b", _I64), ("stride_bt_p", _I64),
                ("seqlens", _PTR),
                ("o", _PTR), ("stride_o_b", _I64), ("stride_o_s", _I64), ("stride_o_h", _I64),
                ("lse", _PTR), ("stride_l_b", _I64), ("stride_l_h", _I64), ("stride_l_s", _I64),
                *[(n, _I64) for n in ("b", "s_q", "h_q", "h_kv", "causal")],
                ("scale", _F64)]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvquant_mla_dense")
        lib.kvq_mla_decode_kernel.argtypes = [ctypes.POINTER(_Params)]
        lib.kvq_mla_decode_kernel.restype = ctypes.c_int
        lib.kvq_mla_pack_kernel.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64]
        lib.kvq_mla_pack_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _cache(kv_cache) -> np.ndarray:
    if isinstance(kv_cache, np.ndarray) and kv_cache.ndim == 3:
        kv_cache = kv_cache[:, :, None]
    check_array("kv_cache", kv_cache, 4, f"(num_blocks, page, h_kv, {ROW_BYTES})", (_U8,))
    if kv_cache.shape[3] != ROW_BYTES or kv_cache.shape[1] < 1 or kv_cache.shape[2] < 1:
        raise ValueError(f"kv_cache must be (num_blocks, page >= 1, h_kv >= 1, {ROW_BYTES}) uint8, "
                         f"got {kv_cache.shape}")
    return kv_cache


def kvquant_mla_decode(q: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray, seqlens: np.ndarray,
                       scale: float, d_v: int = 512, causal: bool = True, out: np.ndarray | None = None,
                       out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dense MLA decode of q over the FP8 rows the block table names; returns (o, lse) (module docstring)."""
    check_array("q", q, 4, f"(b, s_q, h_q, {D})", (_BF16,))
    if q.shape[-1] != D:
        raise ValueError(f"q must be (b, s_q, h_q, {D}), got shape {q.shape}")
    kv_cache = _cache(kv_cache)
    n_blocks, page, h_kv, _ = kv_cache.shape
    b, s_q, h_q, _ = q.shape
    if h_q % h_kv:
        raise ValueError(f"h_q = {h_q} must be a multiple of the cache's h_kv = {h_kv}")
    check_array("block_table", block_table, 2, "(b, max_blocks)", (_I32,))
    check_array("seqlens", seqlens, 1, "(b,)", (_I32,))
    if block_table.shape[0] != b or seqlens.shape != (b,):
        raise ValueError(f"block_table {block_table.shape} and seqlens {seqlens.shape} must have b = {b} rows")
    L = seqlens.astype(np.int64)
    if (L < 0).any():
        raise ValueError(f"seqlens must be >= 0, got {int(L.min())}")
    need = -(-int(L.max(initial=0)) // page)
    if need > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} blocks per request, seqlens need {need}")
    live = np.arange(block_table.shape[1])[None, :] * page < L[:, None]
    if ((block_table < 0) | (block_table >= n_blocks))[live].any():
        raise ValueError(f"block_table names a block outside the cache's {n_blocks} blocks (for a live token)")
    if d_v != D_V:
        raise ValueError(f"d_v must be {D_V} (the rows' latent part), got {d_v!r}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if out is None:
        out = np.empty((b, s_q, h_q, D_V), dtype=_BF16)
    check_output("out", out, (b, s_q, h_q, D_V), _BF16, "(b, s_q, h_q, 512)")
    if out_lse is None:
        out_lse = np.empty((b, h_q, s_q), dtype=_F32)
    check_output("out_lse", out_lse, (b, h_q, s_q), _F32, "(b, h_q, s_q)")
    if out.size == 0:
        out_lse[...] = -np.inf
        return out, out_lse
    seqlens = np.ascontiguousarray(seqlens)
    p = _Params(page=page, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=int(bool(causal)), scale=float(scale))
    p.q = q.ctypes.data
    p.stride_q_b, p.stride_q_s, p.stride_q_h, _ = _unit_last("q", q)
    p.kv = kv_cache.ctypes.data
    p.stride_kv_blk, p.stride_kv_slot, p.stride_kv_head, _ = _unit_last("kv_cache", kv_cache)
    p.bt = block_table.ctypes.data
    p.stride_bt_b, p.stride_bt_p = element_strides("block_table", block_table)
    p.seqlens = seqlens.ctypes.data
    p.o = out.ctypes.data
    p.stride_o_b, p.stride_o_s, p.stride_o_h, _ = _unit_last("out", out)
    p.lse = out_lse.ctypes.data
    p.stride_l_b, p.stride_l_h, p.stride_l_s = element_strides("out_lse", out_lse)
    check_status(_kernels().kvq_mla_decode_kernel(ctypes.byref(p)), "kvq_mla_decode_kernel")
    return out, out_lse


def kvquant_mla_pack(kv_cache: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray, slot_mapping: np.ndarray
                     ) -> np.ndarray:
    """Write [kv_c ; k_pe] as 656-byte rows into kv_cache in place at slot_mapping (module docstring)."""
    cache = _cache(kv_cache)
    n_blocks, page, h_kv, _ = cache.shape
    if h_kv != 1:
        raise ValueError(f"kv_cache must hold one latent head (num_blocks, page, 1, {ROW_BYTES}), got {cache.shape}")
    if not cache.flags.writeable:
        raise ValueError("kv_cache must be writeable (written in place)")
    check_array("kv_c", kv_c, 2, f"(n, {D_V})", (_BF16,))
    check_array("k_pe", k_pe, 2, f"(n, {D_PE})", (_BF16,))
    n = kv_c.shape[0]
    if kv_c.shape[1] != D_V or k_pe.shape != (n, D_PE):
        raise ValueError(f"kv_c must be (n, {D_V}) and k_pe (n, {D_PE}), got {kv_c.shape} and {k_pe.shape}")
    check_array("slot_mapping", slot_mapping, 1, "(n,)", (_I64N, _I32))
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must have shape ({n},), got {slot_mapping.shape}")
    slots = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    s = slots[slots != -1]
    if ((s < 0) | (s >= n_blocks * page)).any():
        raise ValueError(f"slot_mapping entries must be -1 or lie in [0, {n_blocks * page}) (num_blocks x page)")
    if np.unique(s).size != s.size:
        raise ValueError("slot_mapping names a slot twice (the writes would race)")
    if n == 0:
        return kv_cache
    sb, ss, _, _ = _unit_last("kv_cache", cache)
    sc, _ = _unit_last("kv_c", kv_c)
    sp, _ = _unit_last("k_pe", k_pe)
    check_status(_kernels().kvq_mla_pack_kernel(cache.ctypes.data, sb, ss, page, kv_c.ctypes.data, sc,
                                                k_pe.ctypes.data, sp, slots.ctypes.data, n), "kvq_mla_pack_kernel")
    return kv_cache
