"""Native CPU attention: prefill, decode over a contiguous KV cache, decode over a paged cache,
chunked prefill over either cache (kernel in attention.c).

    s_ij  = scale * q_i . k_j                       scale default 1/sqrt(d)
    s_ij  = cap * tanh(s_ij / cap)                  softcap > 0, before the mask
    LSE_i = ln sum_j exp(s_ij)  over unmasked j     -inf for a fully masked row
    O_i   = sum_j exp(s_ij - LSE'_i) v_j            LSE' = ln(exp(LSE) + exp(sinks[h])) with sinks

q: (b, s_q, h_q, d)
k, v (prefill): (b, s_k, h_kv, d), (b, s_k, h_kv, d_v)
k_cache, v_cache (decode): (b, s_max, h_kv, d | d_v); seqlens: (b,) int32 in [0, s_max]
k_cache, v_cache (decode_paged): (num_blocks, page, h_kv, d | d_v); block_table: (b, max_blocks)
    int32, token t of sequence i at cache[block_table[i, t // page], t % page]; seqlens (b,) int32 in
    [0, max_blocks * page]
cache_loc (decode, decode_paged, chunked_prefill): (b,) int32 or None; sequence i reads cache row (or
    block-table row) cache_loc[i] instead of i (TensorRT-LLM), the cache / table having any rows
sinks: (h_q,) float32 sink logits (scaled domain) or None
returns (o, lse): o (b, s_q, h_q, d_v) in q's dtype, lse (b, h_q, s_q) float32, natural log,
    excluding the sink; `out` / `out_lse` are used when given (o: last-axis stride 1).
chunked_prefill: q (total_q, h_q, d) packed by cu_seqlens_q (b + 1,) int32; hist (b,) int32 tokens
    cached before each chunk; either cache above; o (total_q, h_q, d_v), lse (h_q, total_q). Sequence b
    is the decode of its L_q queries over hist_b + L_q keys (one kernel call per sequence with queries:
    attention.c has no cu_seqlens input), so query i sees keys j <= hist_b + i (bottom_right).
V may be a view of K's first d_v dims (one cache buffer, K's strides).

Conventions (OPS.md, attention; refimpl/attention.py): q, k, v share one dtype (float32, float16,
bfloat16), fp32 accumulation, one RNE rounding of O. causal is "none", "bottom_right" (decode
default; keep j <= i + L - s_q per sequence) or "top_left" (keep j <= i); window (left, right)
inclusive on the same diagonal, -1 unbounded, causal forces right = 0. Query head h reads kv head
h // (h_q // h_kv). A fully masked row (s_q > seqlen under bottom_right, seqlen 0) gives O = 0,
LSE = -inf. Cache slots at or past a sequence's length, and pages it does not use, are never read.
Inputs may have any element strides except the last axis (stride 1): no copy is made.
`threads` (default 1) > 1 spreads work items (sequence, query block, kv-head chunk) over threads; a
row's arithmetic does not depend on how items are split, so the bits do not depend on the thread
count (nor on the ISA path: see attention.c).
"""

from __future__ import annotations

import ctypes
import math
import numbers

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                element_strides, load)

__all__ = ["prefill", "decode", "decode_paged", "chunked_prefill"]

CAUSAL = {"none": 0, "bottom_right": 1, "top_left": 2}
_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


class _Params(ctypes.Structure):
    """attention.c's attn_params, field for field."""
    _fields_ = [("dtype", _I64),
                *[f for n in "qkv" for f in ((n, _PTR), *((f"stride_{n}_{x}", _I64) for x in "bsh"))],
                ("block_table", _PTR), ("stride_bt_b", _I64), ("stride_bt_p", _I64), ("page", _I64),
                ("seqlens", _PTR), ("stride_sl", _I64), ("cache_loc", _PTR), ("stride_cl", _I64),
                ("sinks", _PTR), ("stride_sinks", _I64),
                ("o", _PTR), *((f"stride_o_{x}", _I64) for x in "bsh"),
                ("lse", _PTR), *((f"stride_lse_{x}", _I64) for x in "bhs"),
                *[(n, _I64) for n in ("b", "s_q", "s_k", "h_q", "h_kv", "d", "d_v", "causal", "left",
                                      "right")],
                ("scale", _F64), ("softcap", _F64), ("threads", _I64)]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("attention")
        lib.attention_kernel.argtypes = [ctypes.POINTER(_Params)]
        lib.attention_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _rows(name: str, a: np.ndarray) -> tuple[int, ...]:
    """Element strides of a 4-D array whose last axis must be unit-stride."""
    strides = element_strides(name, a)
    if a.shape[-1] > 1 and a.size > 0 and strides[-1] != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got {strides[-1]} "
                         f"(strides {a.strides} bytes); no copy is made")
    return strides


def _check_qkv(q: object, k: object, v: object, kn: str, vn: str, layout: str) -> None:
    check_array("q", q, 4, "(b, s_q, h_q, d)", tuple(DTYPE_CODES))
    check_array(kn, k, 4, layout.format("d"), (q.dtype,))
    check_array(vn, v, 4, layout.format("d_v"), (q.dtype,))
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{kn} head dim {k.shape[3]} must equal q's d = {q.shape[3]}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{vn} shape {v.shape} must match {kn} {k.shape} except the last axis")
    h_q, h_kv = q.shape[2], k.shape[2]
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv} ({kn} shape {k.shape})")
    if q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(f"head dims must be >= 1, got d={q.shape[3]}, d_v={v.shape[3]}")


def _check_lengths(name: str, a: object, b: int, capacity: int) -> None:
    check_array(name, a, 1, "(b,)", (_I32,))
    if a.shape[0] != b:
        raise ValueError(f"{name} must have shape ({b},), got {a.shape}")
    if b and (a.min() < 0 or a.max() > capacity):
        raise ValueError(f"{name} must lie in [0, {capacity}] (cache capacity), got min {a.min()} "
                         f"max {a.max()}")


def _check_cache_loc(cache_loc: object, b: int, rows: int, what: str) -> None:
    """cache_loc (b,) int32 with every entry a row of the cache / block table (`rows` of them)."""
    check_array("cache_loc", cache_loc, 1, "(b,)", (_I32,))
    if cache_loc.shape[0] != b:
        raise ValueError(f"cache_loc must have shape ({b},), got {cache_loc.shape}")
    if b and (cache_loc.min() < 0 or cache_loc.max() >= rows):
        raise ValueError(f"cache_loc must lie in [0, {rows}) ({what} rows), got min {cache_loc.min()} "
                         f"max {cache_loc.max()}")


def _launch(q, k, v, *, seqlens, block_table, page, scale, causal, window, softcap, sinks, out,
            out_lse, threads, cache_loc=None) -> tuple[np.ndarray, np.ndarray]:
    b, s_q, h_q, d = q.shape
    d_v = v.shape[3]
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {tuple(CAUSAL)}, got {causal!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= -1
                       for x in window)):
        raise ValueError(f"window must be (left, right) ints >= -1 (-1 unbounded), got {window!r}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(softcap, numbers.Real) or not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if sinks is not None:
        check_array("sinks", sinks, 1, "(h_q,)", (_F32,))
        if sinks.shape != (h_q,):
            raise ValueError(f"sinks must have shape (h_q,) = ({h_q},), got {sinks.shape}")
    if out is None:
        out = np.empty((b, s_q, h_q, d_v), dtype=q.dtype)
    check_output("out", out, (b, s_q, h_q, d_v), q.dtype, "(b, s_q, h_q, d_v)")
    if out_lse is None:
        out_lse = np.empty((b, h_q, s_q), dtype=np.float32)
    check_output("out_lse", out_lse, (b, h_q, s_q), _F32, "(b, h_q, s_q)")
    inputs = [a for a in (q, k, v, seqlens, block_table, sinks, cache_loc) if a is not None]
    for name, a, others in (("out", out, inputs), ("out_lse", out_lse, [*inputs, out])):
        if any(np.may_share_memory(a, x) for x in others):
            raise ValueError(f"{name} overlaps an input or the other output")
    if out.size == 0:
        out_lse[...] = -np.inf
        return out, out_lse

    p = _Params(dtype=dtype_code(q.dtype), b=b, s_q=s_q, s_k=k.shape[1], h_q=h_q, h_kv=k.shape[2],
                d=d, d_v=d_v, causal=CAUSAL[causal], left=int(window[0]), right=int(window[1]),
                scale=float(scale), softcap=float(softcap), threads=int(threads), page=page)
    kv_names = ("k", "v") if seqlens is None else ("k_cache", "v_cache")
    for n, name, a in (("q", "q", q), ("k", kv_names[0], k), ("v", kv_names[1], v), ("o", "out", out)):
        setattr(p, n, a.ctypes.data)
        for axis, stride in zip("bsh", _rows(name, a)):
            setattr(p, f"stride_{n}_{axis}", stride)
    p.lse = out_lse.ctypes.data
    p.stride_lse_b, p.stride_lse_h, p.stride_lse_s = element_strides("out_lse", out_lse)
    if seqlens is not None:
        p.seqlens, (p.stride_sl,) = seqlens.ctypes.data, element_strides("seqlens", seqlens)
    if cache_loc is not None:
        p.cache_loc, (p.stride_cl,) = cache_loc.ctypes.data, element_strides("cache_loc", cache_loc)
    if block_table is not None:
        p.block_table = block_table.ctypes.data
        p.stride_bt_b, p.stride_bt_p = element_strides("block_table", block_table)
    if sinks is not None:
        p.sinks, (p.stride_sinks,) = sinks.ctypes.data, element_strides("sinks", sinks)
    check_status(_kernels().attention_kernel(ctypes.byref(p)), "attention_kernel")
    return out, out_lse


def prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float | None = None,
            causal: str = "none", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            sinks: np.ndarray | None = None, out: np.ndarray | None = None,
            out_lse: np.ndarray | None = None, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Dense attention of q (b, s_q, h_q, d) over k, v (b, s_k, h_kv, d | d_v); returns (o, lse)."""
    _check_qkv(q, k, v, "k", "v", "(b, s_k, h_kv, {})")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch {k.shape[0]} must equal q's b = {q.shape[0]}")
    return _launch(q, k, v, seqlens=None, block_table=None, page=0, scale=scale, causal=causal,
                   window=window, softcap=softcap, sinks=sinks, out=out, out_lse=out_lse,
                   threads=threads)


def decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, seqlens: np.ndarray, *,
           scale: float | None = None, causal: str = "bottom_right", window: tuple[int, int] = (-1, -1),
           softcap: float = 0.0, sinks: np.ndarray | None = None, out: np.ndarray | None = None,
           out_lse: np.ndarray | None = None, threads: int = 1,
           cache_loc: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The s_q queries are the last s_q tokens of each sequence; the cache is (b, s_max, h_kv, d), or
    (rows, s_max, h_kv, d) read at row cache_loc[i] for sequence i."""
    _check_qkv(q, k_cache, v_cache, "k_cache", "v_cache", "(b, s_max, h_kv, {})")
    if cache_loc is not None:
        _check_cache_loc(cache_loc, q.shape[0], k_cache.shape[0], "k_cache")
    elif k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"k_cache batch {k_cache.shape[0]} must equal q's b = {q.shape[0]}")
    _check_lengths("seqlens", seqlens, q.shape[0], k_cache.shape[1])
    return _launch(q, k_cache, v_cache, seqlens=seqlens, block_table=None, page=0, scale=scale,
                   causal=causal, window=window, softcap=softcap, sinks=sinks, out=out,
                   out_lse=out_lse, threads=threads, cache_loc=cache_loc)


def decode_paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                 seqlens: np.ndarray, *, scale: float | None = None, causal: str = "bottom_right",
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 sinks: np.ndarray | None = None, out: np.ndarray | None = None,
                 out_lse: np.ndarray | None = None, threads: int = 1,
                 cache_loc: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode over pages (num_blocks, page, h_kv, d) through block_table (b, max_blocks) int32, or
    (rows, max_blocks) read at row cache_loc[i] for sequence i."""
    _check_qkv(q, k_cache, v_cache, "k_cache", "v_cache", "(num_blocks, page, h_kv, {})")
    check_array("block_table", block_table, 2, "(b, max_blocks)", (_I32,))
    b = q.shape[0]
    num_blocks, page = k_cache.shape[:2]
    if cache_loc is not None:
        _check_cache_loc(cache_loc, b, block_table.shape[0], "block_table")
    elif block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape (b, max_blocks) with b = {b}, got {block_table.shape}")
    if page < 1:
        raise ValueError(f"k_cache page size must be >= 1, got shape {k_cache.shape}")
    _check_lengths("seqlens", seqlens, b, block_table.shape[1] * page)
    rows = block_table if cache_loc is None else block_table[cache_loc]  # each sequence's own table row
    used = np.arange(block_table.shape[1])[None, :] < -(-seqlens.astype(np.int64)[:, None] // page)
    bad = used & ((rows < 0) | (rows >= num_blocks))  # only pages a sequence reads
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"block_table[{i}, {j}] = {rows[i, j]} must lie in [0, {num_blocks}) "
                         f"(k_cache has {num_blocks} blocks; sequence {i} uses {int(used[i].sum())} pages)")
    return _launch(q, k_cache, v_cache, seqlens=seqlens, block_table=block_table, page=page,
                   scale=scale, causal=causal, window=window, softcap=softcap, sinks=sinks, out=out,
                   out_lse=out_lse, threads=threads, cache_loc=cache_loc)


def chunked_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cu_seqlens_q: np.ndarray,
                    hist: np.ndarray, block_table: np.ndarray | None = None, *, scale: float | None = None,
                    causal: str = "bottom_right", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    sinks: np.ndarray | None = None, out: np.ndarray | None = None,
                    out_lse: np.ndarray | None = None, threads: int = 1,
                    cache_loc: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Packed chunks q (total_q, h_q, d) over caches holding each sequence's history and chunk keys
    (at cache row / block-table row cache_loc[i] for sequence i when cache_loc is given)."""
    check_array("q", q, 3, "(total_q, h_q, d)", tuple(DTYPE_CODES))
    check_array("cu_seqlens_q", cu_seqlens_q, 1, "(b + 1,)", (_I32,))
    b = cu_seqlens_q.shape[0] - 1
    cu = cu_seqlens_q.astype(np.int64)
    if b < 0 or cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run non-decreasing from 0 to total_q = {q.shape[0]}, got {cu_seqlens_q}")
    check_array("hist", hist, 1, "(b,)", (_I32,))
    if hist.shape != (b,) or (b and hist.min() < 0):
        raise ValueError(f"hist must be ({b},) int32 >= 0, got {hist.shape}")
    total_q, h_q = q.shape[:2]
    d_v = v_cache.shape[-1]
    if out is None:
        out = np.empty((total_q, h_q, d_v), dtype=q.dtype)
    check_output("out", out, (total_q, h_q, d_v), q.dtype, "(total_q, h_q, d_v)")
    if out_lse is None:
        out_lse = np.empty((h_q, total_q), dtype=np.float32)
    check_output("out_lse", out_lse, (h_q, total_q), _F32, "(h_q, total_q)")
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, sinks=sinks, threads=threads)
    if cache_loc is not None:
        _check_cache_loc(cache_loc, b, (k_cache if block_table is None else block_table).shape[0],
                         "k_cache" if block_table is None else "block_table")
    for i in range(b):  # one kernel call per sequence, on views: the C kernel takes no cu_seqlens
        c0, c1 = int(cu[i]), int(cu[i + 1])
        if c1 == c0:
            continue  # no queries: nothing to write
        lens = (hist[i:i + 1] + (c1 - c0)).astype(np.int32)
        o, lse, qi = out[None, c0:c1], out_lse[None, :, c0:c1], q[None, c0:c1]
        if cache_loc is not None:  # the kernel follows cache_loc itself: the whole cache / table
            loc = cache_loc[i:i + 1]
            if block_table is None:
                decode(qi, k_cache, v_cache, lens, **kw, out=o, out_lse=lse, cache_loc=loc)
            else:
                decode_paged(qi, k_cache, v_cache, block_table, lens, **kw, out=o, out_lse=lse, cache_loc=loc)
        elif block_table is None:
            decode(qi, k_cache[i:i + 1], v_cache[i:i + 1], lens, **kw, out=o, out_lse=lse)
        else:
            decode_paged(qi, k_cache, v_cache, block_table[i:i + 1], lens, **kw, out=o, out_lse=lse)
    return out, out_lse


def context_kv(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
               cu_seqlens: np.ndarray, input_pos: np.ndarray, block_table: np.ndarray | None = None, *,
               scale: float | None = None, out: np.ndarray | None = None,
               out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Context attention that writes the cache (TensorRT-LLM's context_attention_kv), composed of two C
    kernels, not fused: kvcache.c appends k / v (total, h_kv, d) at input_pos_b + t (ragged: seq_start =
    cu_seqlens[:-1], seq_len its diff; in place, through block_table when paged), then the chunked-prefill
    kernel attends q (total, h_q, d) to history + chunk, bottom_right. Returns (o, lse) as chunked_prefill."""
    from .kvcache import update

    cu = np.asarray(cu_seqlens)
    rag = dict(block_table=block_table, seq_len=np.diff(cu).astype(np.int32), seq_start=cu[:-1].astype(np.int32))
    update(k_cache, k, input_pos, **rag)
    update(v_cache, v, input_pos, **rag)
    return chunked_prefill(q, k_cache, v_cache, cu_seqlens, input_pos, block_table, scale=scale,
                           causal="bottom_right", out=out, out_lse=out_lse)
