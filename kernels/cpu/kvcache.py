"""Native CPU KV-cache append, contiguous or paged (kernel in kvcache.c). Bit-exact: a copy.

    contiguous: cache[r, pos[i] + t] = new[i, t]                               t < s_new
    paged:      cache[block_table[r, p // page], p % page] = new[i, t]         p = pos[i] + t
    r = cache_loc[i] (TensorRT-LLM's row indirection), or i without cache_loc

cache: (rows, s_max, h_kv, d), or (num_blocks, page, h_kv, d) with block_table; written in place
new: (b, s_new, h_kv, d), cache's dtype (any of 1, 2 or 4 bytes: the bits are copied)
pos: (b,) int32, tokens already cached per sequence
block_table: (rows, max_blocks) int32 for the paged layout
cache_loc: (b,) int32 distinct rows in [0, rows) (checked), or None (rows = b)
seq_len, seq_start: (b,) int32, both or neither: TensorRT-LLM's ragged layout, new (total, h_kv, d)
      and sequence i's tokens new[seq_start[i] : seq_start[i] + seq_len[i]] (a seq_len may be 0;
      checked to lie inside new). d is each array's own: call once for K and once for V (whose head
      dim may differ, TensorRT-LLM's V_D_HEAD).

Conventions (OPS.md, kvcache.update; refimpl/kvcache.py): every other slot keeps its bits. The
writes must fit (0 <= pos, pos + s_new <= s_max or max_blocks * page; the written pages' table
entries in [0, num_blocks)) and no two may land on the same slot: ValueError otherwise, before
anything is written. Last-axis stride 1 for cache and new, other strides any; no copy is made.

metadata: TensorRT-LLM's host metadata step (prepare_fused_mha_metadata; refimpl/kvcache.py): from
      the zero-padded (max_batch,) int32 buffers seq_len, input_pos, cache_loc, the (m,) int32 arrays
      seq_len, input_pos, cache_loc, seq_start of the b real sequences (b = 1 + the last non-zero
      seq_len), padded to m = graph (a captured CUDA-graph batch, >= b) with inert rows.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import (check_array, check_status, element_strides, load,
                                              unit_last_strides)

__all__ = ["update", "cache_rows", "metadata"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_I32 = np.dtype(np.int32)
_lib: ctypes.CDLL | None = None


def ragged_rows(seq_len: np.ndarray, seq_start: np.ndarray, total: int, what: str) -> tuple[int, np.ndarray,
                                                                                              np.ndarray]:
    """TensorRT-LLM's ragged layout checked: (b, seq_len, seq_start as int64) with sequence i's tokens rows
    seq_start[i] : seq_start[i] + seq_len[i] of the `total` rows of `what`; exit-2 ValueErrors name the field."""
    check_array("seq_len", seq_len, 1, "(b,)", (_I32,))
    b = seq_len.shape[0]
    check_array("seq_start", seq_start, 1, "(b,)", (_I32,))
    if seq_start.shape != (b,):
        raise ValueError(f"seq_start must have shape (b,) = ({b},) like seq_len, got {seq_start.shape}")
    if b > 1 and not (seq_len.flags.c_contiguous and seq_start.flags.c_contiguous):
        raise ValueError("seq_len and seq_start must be contiguous (the kernel reads them as int32 runs)")
    n, first = seq_len.astype(np.int64), seq_start.astype(np.int64)
    if b and (n.min() < 0 or first.min() < 0 or (first + n).max() > total):
        i = int(np.flatnonzero((n < 0) | (first < 0) | (first + n > total))[0])
        raise ValueError(f"sequence {i}'s tokens new[{first[i]} : {first[i] + n[i]}] must lie in {what}'s "
                         f"{total} rows (seq_len and seq_start >= 0)")
    return b, n, first


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("kvcache")
        lib.kvcache_update_kernel.argtypes = [_I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64,
                                              _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                                              _I64, _I64]
        lib.kvcache_metadata_kernel.argtypes = [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64]
        lib.kvcache_metadata_kernel.restype = ctypes.c_int
        lib.kvcache_update_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def update(cache: np.ndarray, new: np.ndarray, pos: np.ndarray, *,
           block_table: np.ndarray | None = None, cache_loc: np.ndarray | None = None,
           seq_len: np.ndarray | None = None, seq_start: np.ndarray | None = None) -> None:
    """Append `new` after the first pos[i] tokens of each sequence (in row cache_loc[i]), in place;
    ragged with seq_len / seq_start (module docstring)."""
    if not isinstance(cache, np.ndarray) or cache.ndim != 4:
        raise ValueError(f"cache must be a 4-D numpy.ndarray (b | num_blocks, s_max | page, h_kv, d), "
                         f"got {getattr(cache, 'shape', type(cache).__name__)}")
    if cache.dtype.itemsize not in (1, 2, 4):
        raise ValueError(f"cache dtype must have 1, 2 or 4-byte elements, got {cache.dtype}")
    if not cache.flags.writeable:
        raise ValueError("cache must be writeable")
    ragged = seq_len is not None
    if ragged != (seq_start is not None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    if ragged:
        check_array("new", new, 3, "(total, h_kv, d)", (cache.dtype,))
        b, n, first = ragged_rows(seq_len, seq_start, new.shape[0], "new")
        s_new = int(n.max()) if b else 0
    else:
        check_array("new", new, 4, "(b, s_new, h_kv, d)", (cache.dtype,))
        b, s_new = new.shape[:2]
        n = np.full(b, s_new, dtype=np.int64)
    if new.shape[-2:] != cache.shape[2:]:
        raise ValueError(f"new (h_kv, d) = {new.shape[-2:]} must match cache's {cache.shape[2:]}")
    check_array("pos", pos, 1, "(b,)", (_I32,))
    if pos.shape != (b,):
        raise ValueError(f"pos must have shape (b,) = ({b},), got {pos.shape}")
    end = pos.astype(np.int64) + n  # b
    if b and pos.min() < 0:
        raise ValueError(f"pos must be >= 0, got min {pos.min()}")
    page = cache.shape[1]
    if block_table is None:
        if cache_loc is None and cache.shape[0] != b:
            raise ValueError(f"cache batch {cache.shape[0]} must equal new's b = {b} (contiguous layout)")
        capacity, bt_strides = page, (0, 0)
    else:
        check_array("block_table", block_table, 2, "(rows, max_blocks)", (_I32,))
        if cache_loc is None and block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape (b, max_blocks) with b = {b}, "
                             f"got {block_table.shape}")
        capacity, bt_strides = block_table.shape[1] * page, element_strides("block_table", block_table)
    row = cache_rows(cache_loc, b, cache.shape[0] if block_table is None else block_table.shape[0])  # b
    if b and end.max() > capacity:
        i = int(end.argmax())
        raise ValueError(f"writes do not fit: pos[{i}] + {'seq_len' if ragged else 's_new'} = {end[i]} "
                         f"> capacity {capacity}")
    if block_table is not None and int(n.sum()):
        bi = np.repeat(np.arange(b), n)  # the sequence of each written token
        p = pos.astype(np.int64)[bi] + np.arange(bi.size) - np.repeat(np.cumsum(n) - n, n)
        blk = block_table[row[bi], p // page]
        if blk.min() < 0 or blk.max() >= cache.shape[0]:
            j = int(np.flatnonzero((blk < 0) | (blk >= cache.shape[0]))[0])
            raise ValueError(f"block_table[{row[bi[j]]}, {p[j] // page}] = {blk[j]} must lie in "
                             f"[0, {cache.shape[0]}) (a page written for sequence {bi[j]})")
        if np.unique(blk * page + p % page).size != bi.size:
            raise ValueError("two writes land on the same cache slot (sequences share a written page)")
    for name, a in (("new", new), ("pos", pos), ("block_table", block_table), ("cache_loc", cache_loc),
                    ("seq_len", seq_len), ("seq_start", seq_start)):
        if a is not None and np.may_share_memory(cache, a):
            raise ValueError(f"{name} overlaps cache")
    if b * s_new == 0 or new.size == 0:
        return
    sc, sn = unit_last_strides("cache", cache), unit_last_strides("new", new)
    if ragged:  # one row of new per token: no batch stride
        sn = (0, *sn)
    status = _kernels().kvcache_update_kernel(
        cache.dtype.itemsize, cache.ctypes.data, sc[0], sc[1], sc[2], new.ctypes.data, sn[0], sn[1],
        sn[2], pos.ctypes.data, element_strides("pos", pos)[0],
        None if cache_loc is None else cache_loc.ctypes.data,
        0 if cache_loc is None else element_strides("cache_loc", cache_loc)[0],
        None if seq_len is None else seq_len.ctypes.data, None if seq_start is None else seq_start.ctypes.data,
        None if block_table is None else block_table.ctypes.data, *bt_strides, page, b, s_new,
        cache.shape[2], cache.shape[3])
    check_status(status, "kvcache_update_kernel")


def cache_rows(cache_loc: np.ndarray | None, b: int, n_rows: int) -> np.ndarray:
    """(b,) int64 row of each sequence: cache_loc, checked to be distinct rows in [0, n_rows), or 0..b-1."""
    if cache_loc is None:
        return np.arange(b)
    check_array("cache_loc", cache_loc, 1, "(b,)", (_I32,))
    if cache_loc.shape != (b,):
        raise ValueError(f"cache_loc must have shape (b,) = ({b},), got {cache_loc.shape}")
    if b and (cache_loc.min() < 0 or cache_loc.max() >= n_rows):
        i = int(np.flatnonzero((cache_loc < 0) | (cache_loc >= n_rows))[0])
        raise ValueError(f"cache_loc[{i}] = {cache_loc[i]} must lie in [0, {n_rows}) (the cache's / block table's rows)")
    if np.unique(cache_loc).size != b:
        raise ValueError("cache_loc maps two sequences to the same cache row")
    return cache_loc.astype(np.int64)


def metadata(seq_len: np.ndarray, input_pos: np.ndarray, cache_loc: np.ndarray, *,
             graph: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seq_len, input_pos, cache_loc, seq_start), each (m,) int32: m = graph, or b when graph is 0."""
    for name, a in (("seq_len", seq_len), ("input_pos", input_pos), ("cache_loc", cache_loc)):
        check_array(name, a, 1, "(max_batch,)", (_I32,))
        if a.shape != seq_len.shape or (a.size > 1 and not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a contiguous ({seq_len.shape[0]},) int32 buffer like seq_len")
    nz = np.flatnonzero(seq_len > 0)
    b = int(nz[-1]) + 1 if nz.size else 0
    if graph < 0 or (graph and graph < b):
        raise ValueError(f"graph={graph} must be 0 (no padding) or a captured batch size >= the {b} sequences")
    m = graph or b
    outs = tuple(np.empty(m, dtype=np.int32) for _ in range(4))
    status = _kernels().kvcache_metadata_kernel(seq_len.ctypes.data, input_pos.ctypes.data, cache_loc.ctypes.data,
                                                seq_len.shape[0], *(o.ctypes.data for o in outs), m)
    check_status(status, "kvcache_metadata_kernel")
    return outs
