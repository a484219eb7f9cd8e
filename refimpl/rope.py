"""Golden rotary position embeddings (RoPE), float64.

A pair (a, b) of the rotary part at position p, frequency w_i, is rotated by the angle p w_i:

    (a, b) -> (a cos(p w_i) - b sin(p w_i),  a sin(p w_i) + b cos(p w_i))

Conventions (OPS.md, layers; research/seed-systems.md "what the gate must also know"):
- style "interleaved": pair i is (x[2i], x[2i+1]) of the rotary part (GPT-J, DeepSeek / MLA,
  llama.cpp's normal mode, Meta's complex freqs_cis); "half": pair i is (x[i], x[i + r/2]) (NeoX,
  HF Llama's rotate_half; TensorRT-LLM's "interleaved as [2, D//2]" is this one).
- the rotary part is `rot` dims (partial rotary): at the first dims (HF models with a rotary
  fraction) or the last (MLA's 64 of 576, TensorRT-LLM's [-rope_dim:]); the other dims pass
  through unchanged (an exact copy).
- frequencies w_i = theta^(-2i / rot), i < rot / 2; Llama-3 scaling (`llama3_scaling`) divides
  the low frequencies by `factor` and blends the middle band, as Meta's `apply_scaling`.
- positions are explicit integers per token (start_pos > 0, ragged per-sequence offsets): the
  table row read is the token's position, never its index.
- tables as engines store them: separate cos and sin [max_seq, rot/2]; interleaved [max_seq,
  rot/2, 2] (cos, sin) pairs (TensorRT-LLM, fp16); complex freqs_cis [max_seq, rot/2] (Meta;
  stored as its (real, imag) pairs, torch.view_as_real). A table given as an input is used with
  the values it holds (its rounded storage values): the golden rotates exactly by them.
Everything is float64; the golden never rounds an intermediate.

Long contexts (positions up to 2^20): the golden's angles p w_i stay float64. A kernel that builds them
(no table) forms p w_i in fp32, as HF's `inv_freq @ position_ids`, liger and Meta's fp32 freqs_cis do:
off by ~eps32 p w_i (0 for w_0 = 1 and an integer p < 2^24; ~0.05 rad at p = 2^20, i = 1), the contract
its judge carries as an error term (conformance/ops/rope.py `_angle_len`), not a rounding of the golden's.
A given table holds its angles: a kernel reads row p, and is judged by the values there at any p.
`tables(..., rows=positions)` builds only the rows a few tokens at 2^20 need.

Backward (`rope_backward`, OPS.md "backward"): RoPE is linear and each pair's rotation is
orthogonal, so the VJP is the transposed rotation, RoPE at the negated angle (cos kept, sin
negated) applied to the cotangent dy:

    (da, db) = (dy_a cos + dy_b sin,  -dy_a sin + dy_b cos)

and the pass-through dims' gradient is dy itself (an exact copy). x does not enter the gradient.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
STYLES = ("interleaved", "half")
ENDS = ("first", "last")
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}


def llama3_scaling(freqs: NDArray, factor: float = 8.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                   original_max_position: int = 8192) -> F64:
    """Llama-3.1's frequency scaling of the inverse frequencies (Meta's `apply_scaling`).

    wavelen = 2 pi / f; wavelen < orig / high: f kept; wavelen > orig / low: f / factor; in between
    (1 - s) f / factor + s f with s = (orig / wavelen - low) / (high - low).
    freqs: (r/2,) float64 inverse frequencies; returns (r/2,) float64
    """
    f = np.asarray(freqs, dtype=np.float64)
    wavelen = 2.0 * np.pi / f
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1.0 - smooth) * f / factor + smooth * f
    return np.where(wavelen < high_wavelen, f, np.where(wavelen > low_wavelen, f / factor, mid))


def inv_freq(rot: int, theta: float, scaling: str = "none") -> F64:
    """w_i = theta^(-2i / rot) for i < rot / 2, then the named scaling ("none" or "llama3")."""
    if rot % 2 or rot < 2:
        raise ValueError(f"the rotary dims must be even and >= 2, got {rot}")
    f = float(theta) ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    if scaling == "llama3":
        return llama3_scaling(f, **LLAMA3)
    if scaling != "none":
        raise ValueError(f"unknown rope scaling {scaling!r} (none, llama3)")
    return f


def tables(max_seq: int, rot: int, theta: float, scaling: str = "none", rows: NDArray | None = None
           ) -> tuple[F64, F64]:
    """(cos, sin) tables [max_seq, rot/2] of the angles p w_i, float64; with `rows` (int positions < max_seq)
    only those rows, [len(rows), rot/2] (a long context's few tokens without its 2^20-row table)."""
    p = np.arange(max_seq) if rows is None else np.asarray(rows, dtype=np.int64)
    if p.size and (p.min() < 0 or p.max() >= max_seq):
        raise ValueError(f"rows must be positions in [0, {max_seq}), got {p.min()} .. {p.max()}")
    ang = p.astype(np.float64)[:, None] * inv_freq(rot, theta, scaling)[None, :]  # p, i
    return np.cos(ang), np.sin(ang)


def _pairs(part: F64, style: str) -> tuple[F64, F64]:
    half = part.shape[-1] // 2
    if style == "interleaved":
        return part[..., 0::2], part[..., 1::2]
    if style == "half":
        return part[..., :half], part[..., half:]
    raise ValueError(f"unknown rope style {style!r} (interleaved, half)")


def rope(x: NDArray, cos: NDArray, sin: NDArray, positions: NDArray, *, style: str = "half", rot: int | None = None,
         at: str = "first", absolute: bool = False) -> F64:
    """Rotate the rotary part of every head of every token by its position's angles.

    x: (t, h, d) float (tokens, heads, head dim)
    cos, sin: (max_seq, rot/2) float tables; row p holds cos(p w_i) / sin(p w_i)
    positions: (t,) int, each token's position (a row of the tables)
    style: "interleaved" or "half" (module docstring); rot: rotary dims (even, <= d; default d)
    at: the rotary part is the "first" or the "last" rot dims
    returns: (t, h, d) float64; the dims outside the rotary part are x's, unchanged
    absolute: the error model's magnitudes instead (conformance/tolerance.py): each rotated element is the
    sum of two products, a cos - b sin (a sin + b cos), whose rounding scales with the root-sum-square of
    the products, sqrt((a cos)^2 + (b sin)^2) (sqrt((a sin)^2 + (b cos)^2); the table values with their
    values, as the golden rotates by them). Where the products cancel (a cos = b sin) the element is near 0
    and its error is still ~eps |a cos|. The pass-through dims are an exact copy: |x|.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    rot = d if rot is None else int(rot)
    if rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"rot={rot} must be even and in [2, d={d}]")
    if at not in ENDS:
        raise ValueError(f"unknown end {at!r} (first, last)")
    pos = np.asarray(positions, dtype=np.int64)
    c = np.asarray(cos, dtype=np.float64)[pos][:, None, :]  # t, 1, rot/2
    s = np.asarray(sin, dtype=np.float64)[pos][:, None, :]
    lo = 0 if at == "first" else d - rot
    out = np.abs(x) if absolute else x.copy()
    a, b = _pairs(x[..., lo:lo + rot], style)
    if absolute:  # squares of the products, sqrt of their sums
        ac, bs, as_, bc = (a * c) ** 2, (b * s) ** 2, (a * s) ** 2, (b * c) ** 2
        ra, rb = np.sqrt(ac + bs), np.sqrt(as_ + bc)
    else:
        ra, rb = a * c - b * s, a * s + b * c
    part = out[..., lo:lo + rot]
    if style == "interleaved":
        part[..., 0::2], part[..., 1::2] = ra, rb
    else:
        part[..., : rot // 2], part[..., rot // 2:] = ra, rb
    return out


def rope_backward(dy: NDArray, cos: NDArray, sin: NDArray, positions: NDArray, *, style: str = "half",
                  rot: int | None = None, at: str = "first", absolute: bool = False) -> F64:
    """VJP of `rope` with respect to x: the rotary pairs of dy rotated by the negated angles.

    Each pair's rotation R(p w) is orthogonal, so its transpose is R(-p w): the VJP is `rope` of dy with
    sin negated (cos is even). dy: (t, h, d) float, the cotangent of y; cos, sin, positions, style, rot,
    at: as `rope`. returns: (t, h, d) float64 dx; the dims outside the rotary part are dy's, unchanged
    absolute: the error model's magnitudes instead, as `rope`'s (of dy at the negated angles)
    """
    return rope(dy, cos, -np.asarray(sin, dtype=np.float64), positions, style=style, rot=rot, at=at,
                absolute=absolute)


def kv_update(k_cache: NDArray, v_cache: NDArray, k_new: NDArray, v_new: NDArray, pos: NDArray, cos: NDArray,
              sin: NDArray, *, block_table: NDArray | None = None, cache_loc: NDArray | None = None,
              q: NDArray | None = None, seq_len: NDArray | None = None, seq_start: NDArray | None = None,
              style: str = "half", absolute: bool = False) -> tuple[F64, ...]:
    """TensorRT-LLM's RoPE-fused KV-cache write: k rotated at position pos[b] + t, then both written
    into the kvcache family's cache (contiguous, or paged through block_table); v unrotated.

    k_cache, v_cache: (rows, s_max, h_kv, d | d_v) or (num_blocks, page, h_kv, d | d_v) with block_table
        (rows, max_blocks); V's head dim d_v may differ from K's d (TensorRT-LLM's V_D_HEAD; v is only copied)
    k_new, v_new: (b, s_new, h_kv, d | d_v); pos: (b,) tokens already cached per sequence
    seq_len, seq_start: (b,) int, both or neither: TensorRT-LLM's ragged layout (refimpl/kvcache.py):
        k_new, v_new (total, h_kv, d | d_v), sequence b's tokens rows seq_start[b] .. + seq_len[b] - 1
        (0: nothing written), token t of them rotated at pos[b] + t; q, if given, is TensorRT-LLM's flattened
        (n_q, h_q, d) buffer (its [B*S, N, D]): sequence b's tokens rows seq_start[b] + t as k_new's, any
        n_q >= every seq_start[b] + seq_len[b]; q_rope's rows no sequence owns are NaN (never written: any value)
    cos, sin: (max_seq, d/2) tables (rows indexed by absolute position)
    cache_loc: (b,) the cache / block-table row of sequence b (TensorRT-LLM's cache_loc; None: row b)
    q: (b, s_new, h_q, d) (ragged: (n_q, h_q, d), above), h_q a multiple of h_kv, or None: TensorRT-LLM's
       update_kv_cache_rope_fusion also rotates the queries, each token at its own position pos[b] + t
       (k's; never its cache slot nor its row of the flattened q)
    returns: (k_cache, v_cache) after the write, float64 (the old slots unchanged), and with q a third
    array, q_rope (like q): q rotated over its whole head dim like k
    absolute: the error model's magnitudes instead: the new k rows (and q_rope) as `rope`'s, every copied
    value (old slots, v) its |value|
    """
    from kernel_parity.refimpl import kvcache

    k_new = np.asarray(k_new, dtype=np.float64)
    if (seq_len is None) != (seq_start is None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    h, d = k_new.shape[-2:]
    if seq_len is not None:  # each flattened row's position: its sequence's pos plus its index within it
        n = np.asarray(seq_len, dtype=np.int64)  # b
        bi = np.repeat(np.arange(n.size), n)  # the sequence of each written token
        t = np.arange(bi.size) - np.repeat(np.cumsum(n) - n, n)
        p = np.zeros(k_new.shape[0], dtype=np.int64)  # rows no sequence owns are never written
        p[np.asarray(seq_start, dtype=np.int64)[bi] + t] = np.asarray(pos, dtype=np.int64)[bi] + t
    else:
        b, s_new = k_new.shape[:2]
        p = (np.asarray(pos, dtype=np.int64)[:, None] + np.arange(s_new)[None, :]).reshape(-1)  # b * s_new
    k_rot = rope(k_new.reshape(-1, h, d), cos, sin, p, style=style, rot=d, absolute=absolute).reshape(k_new.shape)
    k_cache, v_cache, v_new = (np.asarray(a, dtype=np.float64) for a in (k_cache, v_cache, v_new))
    if absolute:
        k_cache, v_cache, v_new = np.abs(k_cache), np.abs(v_cache), np.abs(v_new)
    kw = dict(block_table=block_table, cache_loc=cache_loc, seq_len=seq_len, seq_start=seq_start)
    kc = kvcache.update(k_cache, k_rot, pos, **kw)
    vc = kvcache.update(v_cache, v_new, pos, **kw)
    if q is None:
        return kc, vc
    q = np.asarray(q, dtype=np.float64)
    if seq_len is not None:  # the flattened q: its own row count, the sequences' rows as k_new's
        owned = np.zeros(q.shape[0] if q.ndim == 3 else 0, dtype=bool)
        rows = np.asarray(seq_start, dtype=np.int64)[bi] + t
        if q.ndim != 3 or q.shape[-1] != d or q.shape[-2] % max(h, 1) or (rows.size and rows.max() >= q.shape[0]):
            raise ValueError(f"q {q.shape} must be (n_q, k * {h}, {d}) holding every sequence's rows "
                             f"seq_start[b] + t (n_q > {rows.max(initial=-1)})")
        owned[rows] = True
        p = np.zeros(q.shape[0], dtype=np.int64)
        p[rows] = np.asarray(pos, dtype=np.int64)[bi] + t
    elif q.shape[:-2] != k_new.shape[:-2] or q.shape[-1] != d or q.shape[-2] % max(h, 1):
        raise ValueError(f"q {q.shape} must be k_new's {k_new.shape} with h_q = k * {h} heads")
    q_rope = rope(q.reshape(-1, q.shape[-2], d), cos, sin, p, style=style, rot=d,
                  absolute=absolute).reshape(q.shape)
    if seq_len is not None:
        q_rope[~owned] = np.nan  # TensorRT-LLM writes the sequences' rows only
    return kc, vc, q_rope
