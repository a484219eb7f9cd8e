"""Native CPU MLA decode over a paged latent cache (kernel in mla.c; FlashMLA's dense decode).

    s_ij  = scale * q_i . k_j                       k_j the cache row of token j (d = d_v + rope)
    LSE_i = ln sum_j exp(s_ij)  over visible j      -inf for a row with no visible key
    O_i   = sum_j exp(s_ij - LSE_i) k_j[:d_v]       V aliases K: the first d_v dims of the same rows

q: (b, s_q, h_q, d)
kv_cache: (num_blocks, page, h_kv, d), h_q % h_kv == 0; token t of request i at
    kv_cache[block_table[i, t // page], t % page, g] for query head h of kv head g = h // (h_q / h_kv)
block_table: (b, max_blocks) int32; entries of pages a request does not use are never read
seqlens: (b,) int32 in [0, max_blocks * page]
returns (o, lse): o (b, s_q, h_q, d_v) in q's dtype, lse (b, h_q, s_q) float32, natural log;
    `out` / `out_lse` are used when given (o: last-axis stride 1).

Conventions (refimpl/mla.py decode): q and kv_cache share one dtype (float32, float16, bfloat16),
fp32 accumulation, one rounding of O to fp32 and one to the dtype. scale is explicit (FlashMLA's
default is d^-0.5, DeepSeek-V3's model scale 0.1352). causal (s_q > 1) is bottom-right: query row i
sees keys j <= seqlens - s_q + i; a row that sees no key (seqlen 0, s_q > seqlen) gives O = 0,
LSE = -inf. Cache rows at or past a request's length and pages it does not use are never read.
Inputs may have any element strides except the last axis (stride 1): no copy is made.
`threads` (default 1) > 1 spreads items (request, kv head, chunk of its s_q * h_q / h_kv rows) over
threads; the bits depend on neither the thread count nor the ISA path, and equal those of
`attention.decode_paged(q, kv_cache, kv_cache[..., :d_v], ...)` (h_kv = 1), which reads the cache
once per kv head too but with tiles made for GQA (see mla.c).
"""

from __future__ import annotations

import ctypes
import math
import numbers

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load)

__all__ = ["mla_decode"]

_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


class _Params(ctypes.Structure):
    """mla.c's mla_params, field for field."""
    _fields_ = [("dtype", _I64),
                ("q", _PTR), ("stride_q_b", _I64), ("stride_q_s", _I64), ("stride_q_h", _I64),
                ("kv", _PTR), ("stride_kv_blk", _I64), ("stride_kv_slot", _I64), ("stride_kv_head", _I64),
                ("block_table", _PTR), ("stride_bt_b", _I64), ("stride_bt_p", _I64), ("page", _I64),
                ("seqlens", _PTR), ("stride_sl", _I64),
                ("o", _PTR), ("stride_o_b", _I64), ("stride_o_s", _I64), ("stride_o_h", _I64),
                ("lse", _PTR), ("stride_lse_b", _I64), ("stride_lse_h", _I64), ("stride_lse_s", _I64),
                *[(n, _I64) for n in ("b", "s_q", "h_q", "d", "d_v", "causal", "h_kv")],
                ("scale", _F64), ("threads", _I64)]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("mla")
        lib.mla_decode_kernel.argtypes = [ctypes.POINTER(_Params)]
        lib.mla_decode_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _rows(name: str, a: np.ndarray) -> tuple[int, ...]:
    """Element strides of an array whose last axis must be unit-stride."""
    strides = element_strides(name, a)
    if a.shape[-1] > 1 and a.size > 0 and strides[-1] != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got {strides[-1]} "
                         f"(strides {a.strides} bytes); no copy is made")
    return strides


def _check_inputs(q, kv_cache, block_table, seqlens, scale, d_v, causal, threads) -> None:
    check_array("q", q, 4, "(b, s_q, h_q, d)", tuple(DTYPE_CODES))
    check_array("kv_cache", kv_cache, 4, "(num_blocks, page, h_kv, d)", (q.dtype,))
    b, _, h_q, d = q.shape
    num_blocks, page, h_kv, d_k = kv_cache.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"kv_cache's h_kv = {h_kv} latent kv heads must divide h_q = {h_q} (q {q.shape}, "
                         f"kv_cache {kv_cache.shape})")
    if d_k != d:
        raise ValueError(f"kv_cache head dim {d_k} must equal q's d = {d} (shape {kv_cache.shape})")
    if page < 1:
        raise ValueError(f"kv_cache page size must be >= 1, got shape {kv_cache.shape}")
    if not isinstance(d_v, numbers.Integral) or isinstance(d_v, bool) or not 1 <= d_v <= d:
        raise ValueError(f"d_v must be an int in [1, d = {d}] (V is kv_cache[..., :d_v]), got {d_v!r}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool (bottom-right when True), got {causal!r}")
    if not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    check_array("block_table", block_table, 2, "(b, max_blocks)", (_I32,))
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape (b, max_blocks) with b = {b}, got {block_table.shape}")
    check_array("seqlens", seqlens, 1, "(b,)", (_I32,))
    if seqlens.shape[0] != b:
        raise ValueError(f"seqlens must have shape ({b},), got {seqlens.shape}")
    capacity = block_table.shape[1] * page
    if b and (seqlens.min() < 0 or seqlens.max() > capacity):
        raise ValueError(f"seqlens must lie in [0, {capacity}] (max_blocks * page), got min {seqlens.min()} "
                         f"max {seqlens.max()}")
    used = np.arange(block_table.shape[1])[None, :] < -(-seqlens.astype(np.int64)[:, None] // page)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))  # only pages a request reads
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"block_table[{i}, {j}] = {block_table[i, j]} must lie in [0, {num_blocks}) "
                         f"(kv_cache has {num_blocks} blocks; request {i} uses {int(used[i].sum())} pages)")


def mla_decode(q: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray, seqlens: np.ndarray,
               scale: float, d_v: int = 512, causal: bool = True, out: np.ndarray | None = None,
               out_lse: np.ndarray | None = None, *, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """MLA decode of q (b, s_q, h_q, d) over the paged latent cache; returns (o, lse)."""
    _check_inputs(q, kv_cache, block_table, seqlens, scale, d_v, causal, threads)
    b, s_q, h_q, d = q.shape
    if out is None:
        out = np.empty((b, s_q, h_q, d_v), dtype=q.dtype)
    check_output("out", out, (b, s_q, h_q, d_v), q.dtype, "(b, s_q, h_q, d_v)")
    if out_lse is None:
        out_lse = np.empty((b, h_q, s_q), dtype=np.float32)
    check_output("out_lse", out_lse, (b, h_q, s_q), _F32, "(b, h_q, s_q)")
    inputs = (q, kv_cache, block_table, seqlens)
    for name, a, others in (("out", out, inputs), ("out_lse", out_lse, (*inputs, out))):
        if any(np.may_share_memory(a, x) for x in others):
            raise ValueError(f"{name} overlaps an input or the other output")
    if out.size == 0:
        out_lse[...] = -np.inf
        return out, out_lse

    p = _Params(dtype=dtype_code(q.dtype), b=b, s_q=s_q, h_q=h_q, d=d, d_v=int(d_v), causal=int(bool(causal)),
                h_kv=kv_cache.shape[2], scale=float(scale), threads=int(threads), page=kv_cache.shape[1])
    p.q = q.ctypes.data
    p.stride_q_b, p.stride_q_s, p.stride_q_h, _ = _rows("q", q)
    p.kv = kv_cache.ctypes.data
    p.stride_kv_blk, p.stride_kv_slot, p.stride_kv_head, _ = _rows("kv_cache", kv_cache)
    p.o = out.ctypes.data
    p.stride_o_b, p.stride_o_s, p.stride_o_h, _ = _rows("out", out)
    p.lse = out_lse.ctypes.data
    p.stride_lse_b, p.stride_lse_h, p.stride_lse_s = element_strides("out_lse", out_lse)
    p.block_table = block_table.ctypes.data
    p.stride_bt_b, p.stride_bt_p = element_strides("block_table", block_table)
    p.seqlens, (p.stride_sl,) = seqlens.ctypes.data, element_strides("seqlens", seqlens)
    check_status(_kernels().mla_decode_kernel(ctypes.byref(p)), "mla_decode_kernel")
    return out, out_lse
