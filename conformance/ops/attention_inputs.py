"""Input builders of the attention family: q/k/v draws, ragged lengths, poisoned caches, page tables,
explicit split-KV boundaries, chunked-prefill histories.

Poisoning as FlashMLA's own test does it: every cache slot at or past a sequence's length, every
unused page, and the page that unused block-table entries point at hold NaN, so a kernel that
reads past the end fails structurally (NaN where the golden has none), not numerically.
A case with `vk=1` passes one cache buffer, `k_cache`, whose first d_v dims are V (FlashMLA's
layout): there is no `v_cache` input, and each backend reads V through a view of K's rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw

DISTS = {
    "normal": "q, k, v ~ N(0, 1)",
    "uniform": "q, k, v ~ U(-1, 1)",
    "large": "q ~ N(0, 16): peaked softmax (logits ~ N(0, 16)); saturates a softcap",
    "outlier": "N(0, 1) with 1% of k and v entries x 20: one key dominates, accumulation errors show",
}
# Extreme logits (seed-audit S21), the forward ops only (their own dict: the backward ops and the property
# tests keep DISTS). Each is exact in every dtype: q is 0 but for its last dim and k's last dim takes a few
# significant bits, so every logit is one exact product times the scale, identical wherever keys tie, and
# the float64 golden and an fp32 kernel see the same softmax (a spread of O(1) on logits of 1e4 would be
# rounded away by any fp32 kernel: that is the fp32 logit's own error, not the kernel's).
EXTREME = {
    "huge_logits": "q = (0, .., 0, +-Q), the sign per query row; k's last dim a level 2^e (1 + f/8), e < E, "
                   "f < 8, distinct and increasing along each sequence's keys (a random subset of the 8 E levels): "
                   "logits up to ~1e12 (bf16 / fp32: Q = 2^20, E = 24) or ~1e4 (fp16: Q = 2^4, E = 12, "
                   "q.k < 65504), neighbours 1/16 apart: a causal row's masked keys outrank its own (+Q), or every "
                   "logit is negative (-Q, the max the row's first key); v ~ N(0, 1)",
    "neg_uniform": "q = (0, .., 0, -C / scale), k's last dim 1: every logit of a query row is exactly -C, "
                   "C = 2^U(7, 10) per row (exp underflows in fp32 unless the max is subtracted); O is the mean "
                   "of the visible values, LSE = -C + ln n; v ~ N(0, 1)",
}
HUGE_Q = {"fp16": (2.0 ** 4, 12)}  # (Q, octaves E) per dtype; other dtypes (2^20, 24)
CACHE_SLACK = 16  # extra poisoned slots past the longest sequence in a contiguous cache


def qkv(rng: np.random.Generator, dist: str, q_shape: tuple, k_shape: tuple, v_shape: tuple,
        dtype: str | None = None) -> tuple:
    """float64 q, k, v of the named distribution (EXTREME's need the test dtype and take scale 1/sqrt(d))."""
    kind = "uniform" if dist == "uniform" else "normal"
    q, k, v = draw(rng, q_shape, kind), draw(rng, k_shape, kind), draw(rng, v_shape, kind)
    if dist in EXTREME:
        q = extreme_q(rng, dist, q_shape, dtype, q_shape[-1] ** -0.5)
        k[..., -1] = extreme_keys(rng, dist, k_shape[:-1], dtype)
    elif dist == "large":
        q = q * 4.0
    elif dist == "outlier":
        for t in (k, v):
            t[rng.random(t.shape) < 0.01] *= 20.0
    elif dist not in ("normal", "uniform"):
        raise ValueError(f"unknown distribution {dist!r}")
    return q, k, v


def huge_levels(rng: np.random.Generator, shape: tuple, dtype: str, axis: int = -2) -> np.ndarray:
    """huge_logits' key levels 2^e (1 + f/8), e < E, f < 8, exact in every float dtype (4 significant bits),
    increasing along `axis` of `shape` (the keys): a random subset of the 8 E levels in order per position of
    the other axes, or all of them in order, repeated, past 8 E keys (ties from there on)."""
    n_lvl = 8 * HUGE_Q.get(dtype, (0, 24))[1]
    axis = axis % len(shape)
    n = shape[axis]
    if n >= n_lvl:
        lvl = np.arange(n) % n_lvl
        lvl = np.broadcast_to(lvl.reshape([-1 if i == axis else 1 for i in range(len(shape))]), shape)
    else:
        draws = list(shape)
        draws[axis] = n_lvl
        pick = np.argsort(rng.random(draws), axis=axis)  # a shuffle of the levels per position of the other axes
        lvl = np.sort(np.take(pick, np.arange(n), axis=axis), axis=axis)
    return np.ldexp(1.0 + (lvl % 8) / 8.0, lvl // 8)


def extreme_q(rng: np.random.Generator, dist: str, shape: tuple, dtype: str | None, scale: float) -> np.ndarray:
    """The query of an EXTREME distribution: 0 but for the last dim (float64, before rounding)."""
    if dtype is None:
        raise ValueError(f"distribution {dist!r} needs the test dtype")
    q = np.zeros(shape)
    if dist == "huge_logits":
        q[..., -1] = np.where(rng.random(shape[:-1]) < 0.5, -1.0, 1.0) * HUGE_Q.get(dtype, (2.0 ** 20,))[0]
    else:  # neg_uniform: every logit of the row scale q.k = -C
        q[..., -1] = -np.exp2(rng.uniform(7.0, 10.0, shape[:-1])) / scale
    return q


def extreme_keys(rng: np.random.Generator, dist: str, shape: tuple, dtype: str | None) -> np.ndarray:
    """The last dim of the keys (shape (..., s, h): keys along axis -2) of an EXTREME distribution."""
    return np.ones(shape) if dist == "neg_uniform" else huge_levels(rng, shape, dtype)


def sinks(rng: np.random.Generator, p: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-query-head sink logits (fp32, scaled domain) when the case has sinks."""
    if not p.get("sink"):
        return {}
    return {"sinks": dt.round_to(rng.standard_normal(p["hq"]) * 2.0, "fp32")}


def lengths(b: int, longest: int, mode: str, shift: int = 0) -> np.ndarray:
    """(b,) int32 lengths, a function of the parameters only (so output shapes are too).

    "full": every sequence `longest`. "ragged": the pattern longest, 0, 1, longest - 1,
    longest // 2, then (longest (i + 1)) // (i + 2): empty and single-token sequences whenever
    b > 2, rotated by `shift` so q and k lengths of a varlen case differ per sequence.
    """
    if mode == "full":
        return np.full(b, longest, dtype=np.int32)
    head = [longest, 0, 1, max(longest - 1, 0), longest // 2]
    pattern = [head[i] if i < len(head) else (longest * (i + 1)) // (i + 2) for i in range(b + shift)]
    return np.asarray(pattern[shift:] if shift else pattern, dtype=np.int32)[:b]


def contiguous_cache(rng: np.random.Generator, values: np.ndarray, seqlens: np.ndarray, dtype: str) -> np.ndarray:
    """(b, s_max, h, d) cache in `dtype` with NaN at and past each sequence's length."""
    cache = dt.round_to(values, dtype)
    j = np.arange(cache.shape[1])[None, :]
    cache[j >= seqlens[:, None]] = np.nan
    return cache


def paged_cache(rng: np.random.Generator, k_seq: np.ndarray, v_seq: np.ndarray, seqlens: np.ndarray,
                page: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scatter per-sequence caches (b, s_max, h, d) into shuffled pages.

    returns (k_pages, v_pages, block_table): pages (num_blocks, page, h, d) in `dtype`, every slot
    not holding a live token NaN (the tail of a last page, two unused pages, and a trap page that
    every unused block-table entry points at); block_table (b, ceil(s_max / page)) int32.
    """
    b, s_max = k_seq.shape[:2]
    max_blocks = -(-s_max // page)
    used = [-(-int(n) // page) for n in seqlens]
    n_blocks = sum(used) + 3  # + two unused pages + the trap page
    perm = rng.permutation(n_blocks)
    trap = int(perm[-1])
    k_pages = np.full((n_blocks, page) + k_seq.shape[2:], np.nan)
    v_pages = np.full((n_blocks, page) + v_seq.shape[2:], np.nan)
    table = np.full((b, max_blocks), trap, dtype=np.int32)
    nxt = 0
    for i in range(b):  # a loop over sequences and their pages builds the layout, not the math
        for blk in range(used[i]):
            phys = int(perm[nxt])
            nxt += 1
            table[i, blk] = phys
            lo, hi = blk * page, min((blk + 1) * page, int(seqlens[i]))
            k_pages[phys, : hi - lo] = k_seq[i, lo:hi]
            v_pages[phys, : hi - lo] = v_seq[i, lo:hi]
    return dt.round_to(k_pages, dtype), dt.round_to(v_pages, dtype), table


def varlen_lens(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(query lengths, key lengths) of a varlen case, each (b,) int32: `lengths` of sq and of sk,
    the keys' pattern rotated by two."""
    return lengths(p["b"], p["sq"], p["lens"]), lengths(p["b"], p["sk"], p["lens"], shift=2)


def golden_kw(p: dict[str, Any]) -> dict[str, Any]:
    """Golden keyword arguments of an attention case (forward and backward ops); `_head_map` and
    `_scale` come only from diagnoses."""
    return dict(causal=p["causal"], window=(p["wl"], p["wr"]), softcap=float(p["cap"]),
                head_map=p.get("_head_map", "grouped"), scale=p.get("_scale"))


def cu_seqlens(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def value_dim(p: dict[str, Any]) -> int:
    """d_v of a case: its `dv` parameter, or d where the case leaves it out (dv = 0)."""
    return p.get("dv", 0) or p["d"]


def values(x: dict[str, np.ndarray], p: dict[str, Any], name: str = "v_cache", keys: str = "k_cache") -> np.ndarray:
    """The value tensor of a case: its own input, or the first d_v dims of the keys' rows (vk=1)."""
    return x[name] if name in x else x[keys][..., : value_dim(p)]


def split_bounds(rng: np.random.Generator, seqlens: np.ndarray, splits: int) -> np.ndarray:
    """(b, splits + 1) int32 per-request cumulative split boundaries (FlashMLA's scheduler style).

    Request b takes n_b splits: one for every third request (b % 3 == 0: its only split holds all
    its keys, so the combine skips it), else n_b ~ U[1, splits]. Its n_b - 1 inner boundaries are
    drawn with replacement from [0, L_b] and sorted (empty splits inside a request included); the
    row runs 0 .. L_b and repeats L_b past n_b (empty trailing splits).
    """
    L = np.asarray(seqlens, dtype=np.int64)
    b = L.size
    n = rng.integers(1, splits + 1, size=b)
    n[::3] = 1
    cuts = rng.integers(0, L[:, None] + 1, size=(b, max(splits - 1, 0)))  # b, splits - 1
    cuts = np.where(np.arange(splits - 1)[None, :] < n[:, None] - 1, cuts, L[:, None])
    inner = np.sort(cuts, axis=1)
    return np.concatenate([np.zeros((b, 1), np.int64), inner, L[:, None]], axis=1).astype(np.int32)


def chunk_lengths(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(chunk lengths, history lengths), each (b,) int32: `lengths` of sq and of hist, the histories
    rotated by one so that empty chunks, empty histories and both full fall on different sequences."""
    return lengths(p["b"], p["sq"], p["lens"]), lengths(p["b"], p["hist"], p["lens"], shift=1)


def chunked_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Packed chunk queries and a cache holding each sequence's history and chunk keys (NaN past them),
    contiguous (page = 0, s_max = hist + sq + CACHE_SLACK) or in shuffled pages."""
    lq, hist = chunk_lengths(p)
    L = hist + lq
    s_max = p["hist"] + p["sq"] + CACHE_SLACK
    b, h_kv = p["b"], p["hkv"]
    q, k, v = qkv(rng, dist, (int(lq.sum()), p["hq"], p["d"]), (b, s_max, h_kv, p["d"]),
                  (b, s_max, h_kv, value_dim(p)), dtype)
    out = {"q": dt.round_to(q, dtype), "cu_seqlens_q": cu_seqlens(lq), "hist": hist, **sinks(rng, p)}
    if p["page"]:
        out["k_cache"], out["v_cache"], out["block_table"] = paged_cache(rng, k, v, L, p["page"], dtype)
    else:
        out["k_cache"], out["v_cache"] = contiguous_cache(rng, k, L, dtype), contiguous_cache(rng, v, L, dtype)
    return out
