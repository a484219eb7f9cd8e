"""Native CPU RoPE and RoPE-fused KV-cache write (kernels in rope.c).

    pair i at position p:  (a, b) -> (a cos(p w_i) - b sin(p w_i),  a sin(p w_i) + b cos(p w_i))

rope: x (t, h, d) float32 / float16 / bfloat16, last-axis stride 1, other strides any (no copy);
      positions (t,) int32 in [0, max_seq) (checked); style "interleaved" (x[2i], x[2i+1]) or "half"
      (x[i], x[i + rot/2]); rot even in [2, d]; at "first" or "last" (the rotary dims); the other
      dims copied as bits. The angles, exactly one of: cos, sin (max_seq, rot/2) | table (max_seq,
      rot/2, 2) (cos, sin) pairs, or complex64 (max_seq, rot/2) freqs_cis, each read where it lies
      (float32 / float16 / bfloat16) | theta (> 1) with scaling "none" or "llama3": the angles are
      built in the kernel (frequencies in double rounded to float, fp32 angle p w_i).
      out: like x (may be x itself); allocated when None.
rope_backward: dx = RoPE of the cotangent dy (t, h, d) at the negated angles (the same kernel with
      sin negated as it is read or built), the pass-through dims dy's bits; arguments as rope's.
kv_update: TensorRT-LLM's fused write, in place: k_new rotated at position pos[i] + t by table's
      row (half pairs by default) and v_new copied, appended after the first pos[i] tokens of each
      sequence, contiguous (rows, s_max, h, d) or paged (num_blocks, page, h, d) with block_table
      (rows, max_blocks); sequence i writes row cache_loc[i] (TensorRT-LLM's indirection; distinct
      int32 rows, checked) or row i without cache_loc (rows = b). With q (b, s_new, h_q, d), h_q a
      multiple of h, the queries are rotated too, each token at its position pos[i] + t (TensorRT-LLM's
      update_kv_cache_rope_fusion), into q_out (like q; allocated when None), which is returned.
      seq_len, seq_start (b,) int32, both or neither: TensorRT-LLM's ragged layout, k_new / v_new
      (total, h, d | dv) and q (n_q, h_q, d), TensorRT-LLM's flattened [B*S, N, D] buffer of any n_q rows;
      sequence i's tokens rows seq_start[i] : seq_start[i] + seq_len[i] of each (checked to lie inside
      them); q_out's other rows are not written. v_new / v_cache may have their own head dim dv (copied, never rotated).
      Writes must fit, table rows cover every position, written pages lie in the cache and no two
      writes share a slot: ValueError before anything is written.

fp32 arithmetic, one RNE rounding on store (rope.c).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.kvcache import cache_rows, ragged_rows
from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load, unit_last_strides)

__all__ = ["rope", "rope_backward", "kv_update"]

_I64, _PTR, _INT, _DBL = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
_I32 = np.dtype(np.int32)
STYLES = {"interleaved": 0, "half": 1}
ENDS = ("first", "last")
SCALINGS = {"none": 0, "llama3": 1}
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("rope")
        lib.rope_kernel.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT, _I64,
                                    _I64, _DBL, _INT, _INT, _INT, _I64, _I64, _I64, _I64, _I64]
        lib.rope_kv_update_kernel.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64,
                                              _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64,
                                              _PTR, _PTR,
                                              _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                              _INT, _I64, _I64, _INT, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                              _I64]
        for fn in (lib.rope_kernel, lib.rope_kv_update_kernel):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _table(cos, sin, table, half: int) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """(cos view, sin view, row stride, column stride in elements, max_seq): no copies."""
    if table is not None:
        if cos is not None or sin is not None:
            raise ValueError("give either table= or cos= and sin=, not both")
        if not isinstance(table, np.ndarray):
            raise ValueError(f"table must be a numpy.ndarray, got {type(table).__name__}")
        if table.dtype == np.complex64:
            if table.ndim != 2 or table.shape[1] != half:
                raise ValueError(f"complex64 table must be (max_seq, rot/2 = {half}), got shape {table.shape}")
            cos, sin = table.real, table.imag
        else:
            if table.ndim != 3 or table.shape[1:] != (half, 2):
                raise ValueError(f"table must be (max_seq, rot/2 = {half}, 2) (cos, sin) pairs, got shape "
                                 f"{table.shape}")
            if table.dtype not in DTYPE_CODES:
                raise ValueError(f"table dtype {table.dtype} not supported; expected complex64 or one of "
                                 f"{', '.join(map(str, DTYPE_CODES))}")
            cos, sin = table[..., 0], table[..., 1]
    elif cos is None or sin is None:
        raise ValueError("give the angles: table=, or cos= and sin=, or theta=")
    else:
        for name, a in (("cos", cos), ("sin", sin)):
            check_array(name, a, 2, "(max_seq, rot/2)", tuple(DTYPE_CODES))
            if a.shape[1] != half:
                raise ValueError(f"{name} must be (max_seq, rot/2 = {half}), got shape {a.shape}")
        if cos.shape != sin.shape or cos.dtype != sin.dtype:
            raise ValueError(f"cos {cos.shape} {cos.dtype} and sin {sin.shape} {sin.dtype} must match")
    sc, ss = element_strides("cos", cos), element_strides("sin", sin)
    if sc != ss or min(sc) < 0:
        raise ValueError(f"cos and sin must share non-negative element strides, got {sc} and {ss}")
    return cos, sin, sc[0], sc[1], cos.shape[0]


def _check_positions(positions: np.ndarray, n: int, limit: int | None, name: str = "positions") -> int:
    check_array(name, positions, 1, f"({n},)", (_I32,))
    if positions.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {positions.shape}")
    if n and positions.min() < 0:
        raise ValueError(f"{name} must be >= 0, got min {positions.min()}")
    if n and limit is not None and positions.max() >= limit:
        raise ValueError(f"{name} max {positions.max()} must be < the table's max_seq = {limit}")
    return element_strides(name, positions)[0]


def rope(x: np.ndarray, positions: np.ndarray, *, cos: np.ndarray | None = None, sin: np.ndarray | None = None,
         table: np.ndarray | None = None, theta: float | None = None, scaling: str = "none", style: str = "half",
         rot: int | None = None, at: str = "first", out: np.ndarray | None = None) -> np.ndarray:
    """RoPE of every head of every token at its position; returns out (module docstring)."""
    return _rope(x, positions, cos, sin, table, theta, scaling, style, rot, at, out, conj=False)


def rope_backward(dy: np.ndarray, positions: np.ndarray, *, cos: np.ndarray | None = None,
                  sin: np.ndarray | None = None, table: np.ndarray | None = None, theta: float | None = None,
                  scaling: str = "none", style: str = "half", rot: int | None = None, at: str = "first",
                  out: np.ndarray | None = None) -> np.ndarray:
    """dx of RoPE for the cotangent dy (t, h, d): the forward kernel at the negated angles; returns out."""
    return _rope(dy, positions, cos, sin, table, theta, scaling, style, rot, at, out, conj=True)


def _rope(x: np.ndarray, positions: np.ndarray, cos, sin, table, theta, scaling: str, style: str, rot, at: str,
          out: np.ndarray | None, conj: bool) -> np.ndarray:
    check_array("x", x, 3, "(t, h, d)", tuple(DTYPE_CODES))
    t, h, d = x.shape
    rot = d if rot is None else rot
    if isinstance(rot, (bool, np.bool_)) or not isinstance(rot, (int, np.integer)) or rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"rot={rot!r} must be an even integer in [2, d={d}]")
    if style not in STYLES:
        raise ValueError(f"style={style!r} must be one of {', '.join(STYLES)}")
    if at not in ENDS:
        raise ValueError(f"at={at!r} must be one of {', '.join(ENDS)}")
    sx = unit_last_strides("x", x)
    if theta is not None:
        if cos is not None or sin is not None or table is not None:
            raise ValueError("give theta= or a table, not both")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not np.isfinite(theta) or theta <= 1:
            raise ValueError(f"theta={theta!r} must be a finite number > 1")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} must be one of {', '.join(SCALINGS)}")
        cos_ptr = sin_ptr = None
        tab_dt, s_row, s_col, limit = 0, 0, 0, 1 << 24  # float(p) is exact below 2^24
    else:
        if scaling != "none":
            raise ValueError(f"scaling={scaling!r} applies to theta= only (a table holds its angles)")
        cos, sin, s_row, s_col, limit = _table(cos, sin, table, rot // 2)
        cos_ptr, sin_ptr, tab_dt = cos.ctypes.data, sin.ctypes.data, dtype_code(cos.dtype)
    spos = _check_positions(positions, t, limit)
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)
    check_output("out", out, x.shape, x.dtype, "(t, h, d)")
    so = unit_last_strides("out", out)
    same = out.ctypes.data == x.ctypes.data and so == sx
    if not same and np.may_share_memory(out, x):
        raise ValueError("out overlaps x without being x itself; pass out=x for in place, or a separate array")
    if out.size == 0:
        return out
    status = _kernels().rope_kernel(
        dtype_code(x.dtype), x.ctypes.data, sx[0], sx[1], out.ctypes.data, so[0], so[1], positions.ctypes.data, spos,
        cos_ptr, sin_ptr, tab_dt, s_row, s_col, float(theta or 0.0), SCALINGS.get(scaling, 0), int(conj),
        STYLES[style], 0 if at == "first" else d - rot, rot, t, h, d)
    check_status(status, "rope_kernel")
    return out


def kv_update(k_cache: np.ndarray, v_cache: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, pos: np.ndarray,
              table: np.ndarray, *, block_table: np.ndarray | None = None, cache_loc: np.ndarray | None = None,
              q: np.ndarray | None = None, q_out: np.ndarray | None = None, seq_len: np.ndarray | None = None,
              seq_start: np.ndarray | None = None, style: str = "half") -> np.ndarray | None:
    """The RoPE-fused KV write, in place (module docstring); with q, returns q_out (q rotated)."""
    ragged = seq_len is not None
    if ragged != (seq_start is not None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    new_layout = "(total, h, d)" if ragged else "(b, s_new, h, d)"
    check_array("k_cache", k_cache, 4, "(b | num_blocks, s_max | page, h, d)", tuple(DTYPE_CODES))
    for name, a in (("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        check_array(name, a, 3 if ragged and "new" in name else 4, new_layout if "new" in name else "like k_cache",
                    (k_cache.dtype,))
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not a.flags.writeable:
            raise ValueError(f"{name} must be writeable")
    h, d = k_new.shape[-2:]
    dv = v_new.shape[-1]
    if ragged:
        b, n, first = ragged_rows(seq_len, seq_start, k_new.shape[0], "k_new")
        s_new = int(n.max()) if b else 0
    else:
        b, s_new = k_new.shape[:2]
        n = np.full(b, s_new, dtype=np.int64)
    if v_new.shape[:-1] != k_new.shape[:-1]:
        raise ValueError(f"v_new {v_new.shape} must match k_new {k_new.shape} except the last axis (dv)")
    if v_cache.shape[:-1] != k_cache.shape[:-1] or k_cache.shape[2:] != (h, d) or v_cache.shape[3] != dv:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must be alike, with (h, d) = {(h, d)} "
                         f"and v's head dim {dv}")
    if d % 2:
        raise ValueError(f"head dim d={d} must be even (rotary pairs)")
    if style not in STYLES:
        raise ValueError(f"style={style!r} must be one of {', '.join(STYLES)}")
    cos, sin, s_row, s_col, max_seq = _table(None, None, table, d // 2)
    spos = _check_positions(pos, b, None, "pos")
    end = pos.astype(np.int64) + n  # b
    page = k_cache.shape[1]
    if block_table is None:
        if cache_loc is None and k_cache.shape[0] != b:
            raise ValueError(f"k_cache batch {k_cache.shape[0]} must equal k_new's b = {b} (contiguous layout)")
        capacity, bt_strides = page, (0, 0)
    else:
        check_array("block_table", block_table, 2, "(rows, max_blocks)", (_I32,))
        if cache_loc is None and block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape (b, max_blocks) with b = {b}, got {block_table.shape}")
        capacity, bt_strides = block_table.shape[1] * page, element_strides("block_table", block_table)
    row = cache_rows(cache_loc, b, k_cache.shape[0] if block_table is None else block_table.shape[0])  # b
    if b and end.max() > min(capacity, max_seq):
        i = int(end.argmax())
        raise ValueError(f"writes do not fit: pos[{i}] + {'seq_len' if ragged else 's_new'} = {end[i]} > capacity "
                         f"{capacity} or the table's max_seq {max_seq}")
    if block_table is not None and int(n.sum()):
        bi = np.repeat(np.arange(b), n)  # the sequence of each written token
        p = pos.astype(np.int64)[bi] + np.arange(bi.size) - np.repeat(np.cumsum(n) - n, n)
        blk = block_table[row[bi], p // page]
        if blk.min() < 0 or blk.max() >= k_cache.shape[0]:
            j = int(np.flatnonzero((blk < 0) | (blk >= k_cache.shape[0]))[0])
            raise ValueError(f"block_table[{row[bi[j]]}, {p[j] // page}] = {blk[j]} must lie in "
                             f"[0, {k_cache.shape[0]}) (a page written for sequence {bi[j]})")
        if np.unique(blk * page + p % page).size != bi.size:
            raise ValueError("two writes land on the same cache slot (sequences share a written page)")
    for cache in (k_cache, v_cache):
        for name, a in (("k_new", k_new), ("v_new", v_new), ("pos", pos), ("table", table),
                        ("block_table", block_table), ("cache_loc", cache_loc), ("seq_len", seq_len),
                        ("seq_start", seq_start)):
            if a is not None and np.may_share_memory(cache, a):
                raise ValueError(f"{name} overlaps a cache")
    if np.may_share_memory(k_cache, v_cache):
        raise ValueError("k_cache and v_cache overlap")
    sq = sqo = (0, 0, 0)
    if q is not None:
        check_array("q", q, k_new.ndim, "(total, h_q, d)" if ragged else "(b, s_new, h_q, d)", (k_cache.dtype,))
        if ragged:  # TensorRT-LLM's flattened q buffer: its own row count, the sequences' rows as k_new's
            if q.shape[-1] != d or (h and q.shape[-2] % h) or (b and int((first + n).max()) > q.shape[0]):
                raise ValueError(f"q {q.shape} must be (n_q, k * {h}, {d}) holding every sequence's rows "
                                 f"seq_start[i] : seq_start[i] + seq_len[i]")
        elif q.shape[:-2] != k_new.shape[:-2] or q.shape[-1] != d or (h and q.shape[-2] % h):
            raise ValueError(f"q {q.shape} must be k_new's {k_new.shape} with k * {h} query heads")
        if q_out is None:
            q_out = np.empty(q.shape, dtype=q.dtype)
        check_output("q_out", q_out, q.shape, q.dtype, "(b, s_new, h_q, d)")
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache), ("q", q)):
            if np.may_share_memory(q_out, a):
                raise ValueError(f"q_out overlaps {name}")
        sq, sqo = unit_last_strides("q", q)[:3], unit_last_strides("q_out", q_out)[:3]
        if ragged:  # one row per token: no batch stride
            sq, sqo = (0, *sq[:2]), (0, *sqo[:2])
    elif q_out is not None:
        raise ValueError("q_out given without q")
    if b * s_new == 0 or h * d == 0:
        return q_out
    kc, vc = unit_last_strides("k_cache", k_cache), unit_last_strides("v_cache", v_cache)
    kn, vn = unit_last_strides("k_new", k_new), unit_last_strides("v_new", v_new)
    if ragged:  # one row of new per token: no batch stride
        kn, vn = (0, *kn), (0, *vn)
    status = _kernels().rope_kv_update_kernel(
        dtype_code(k_cache.dtype), k_cache.ctypes.data, kc[0], kc[1], kc[2], v_cache.ctypes.data, vc[0], vc[1], vc[2],
        k_new.ctypes.data, kn[0], kn[1], kn[2], v_new.ctypes.data, vn[0], vn[1], vn[2], pos.ctypes.data, spos,
        None if cache_loc is None else cache_loc.ctypes.data,
        0 if cache_loc is None else element_strides("cache_loc", cache_loc)[0],
        None if seq_len is None else seq_len.ctypes.data, None if seq_start is None else seq_start.ctypes.data,
        None if q is None else q.ctypes.data, *sq, None if q is None else q_out.ctypes.data, *sqo,
        0 if q is None else q.shape[-2],
        cos.ctypes.data, sin.ctypes.data, dtype_code(cos.dtype), s_row, s_col, STYLES[style],
        None if block_table is None else block_table.ctypes.data, *bt_strides, page, b, s_new, h, d, dv)
    check_status(status, "rope_kv_update_kernel")
    return q_out
