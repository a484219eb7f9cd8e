"""Op spec of the KV-cache write: `kvcache.update` (contiguous or paged; bit-exact).

The cache starts with random old contents (every slot is a value, so an unwritten slot, a
write to the wrong position, or a write through the wrong page shows as a bit difference); the
new tokens are appended after `pos[b]` tokens. Outputs are the whole caches after the write.

`rows` (default 0: none) adds TensorRT-LLM's `cache_loc` indirection: the cache (contiguous) or
the block table (paged) has `rows` >= b rows and sequence b writes row cache_loc[b], an injective
map drawn at random with cache_loc[b] != b wherever that is possible (a kernel that indexes by b
writes some other row); the rows no sequence maps to lie at random among the used ones, and their
slots (and pages) keep their old values, which the bit-exact judge reads as canaries. Paged caches of
these cases own only the even physical pages, shuffled, so a sequence's consecutive table entries
are never physically adjacent and every odd page (one after each owned page, and the last) is a
page no row owns; pos[0] starts inside a page. An append that crosses a page end there separates
the page-table contract (refimpl/kvcache.py) from TensorRT-LLM's overflow into physical page + 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.kvcache as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw
from kernel_parity.conformance.params import Defaults, Int, OneOf
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol

LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}
DISTS = {"normal": "old cache and new tokens ~ N(0, 1)"}


def _page(p: dict[str, Any]) -> int | None:
    return LAYOUTS[p["layout"]]


def _rows(p: dict[str, Any]) -> int:
    """Cache rows (contiguous) / block-table rows (paged): b, or `rows` with cache_loc."""
    return p.get("rows", 0) or p["b"]


def _n_blocks(p: dict[str, Any]) -> int:
    per_seq = -(-p["smax"] // _page(p))
    if p.get("rows", 0):
        return 2 * p["rows"] * per_seq + 1  # every row's (even) pages, an odd one after each, and the last
    return p["b"] * per_seq + 2  # every sequence's pages, and two spare ones


def _cache_shape(p: dict[str, Any]) -> tuple[int, ...]:
    page = _page(p)
    if page is None:
        return (_rows(p), p["smax"], p["hkv"], p["d"])
    return (_n_blocks(p), page, p["hkv"], p["d"])


def cache_loc(p: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """(b,) int32: distinct rows of [0, rows), none equal to its sequence's index where possible."""
    b, rows = p["b"], p["rows"]
    for _ in range(1000):
        loc = rng.choice(rows, b, replace=False)
        if not (loc == np.arange(b)).any() or (b == 1 and rows == 1):
            return loc.astype(np.int32)
    raise AssertionError(f"no cache_loc without a fixed point drawn for b={b}, rows={rows}")  # pragma: no cover


def _positions(p: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    top = p["smax"] - p["snew"]  # pos in [0, top]
    pos = rng.integers(0, top + 1, p["b"])
    page = _page(p)
    if p.get("rows", 0) and page is not None and top >= 1:  # sequence 0's append starts inside a page
        k = int(rng.integers(0, top - top // page))  # the k-th of the unaligned values in [1, top]
        pos[0] = 1 + k + k // (page - 1)
    return pos.astype(np.int32)


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = _cache_shape(p)
    new_shape = (p["b"], p["snew"], p["hkv"], p["d"])
    out = {
        "k_cache": dt.round_to(draw(rng, shape, "normal"), dtype),
        "v_cache": dt.round_to(draw(rng, shape, "normal"), dtype),
        "k_new": dt.round_to(draw(rng, new_shape, "normal"), dtype),
        "v_new": dt.round_to(draw(rng, new_shape, "normal"), dtype),
        "pos": _positions(p, rng),
    }
    page = _page(p)
    if page is not None:
        per_seq = -(-p["smax"] // page)
        if p.get("rows", 0):
            perm = 2 * rng.permutation(p["rows"] * per_seq)  # shuffled even pages; odd pages owned by no row
        else:
            perm = rng.permutation(_n_blocks(p))[: p["b"] * per_seq]  # shuffled, distinct pages
        out["block_table"] = perm.reshape(_rows(p), per_seq).astype(np.int32)
    if p.get("rows", 0):
        out["cache_loc"] = cache_loc(p, rng)
    return out


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    bt, loc = x.get("block_table"), x.get("cache_loc")
    return {"k_cache": ref.update(x["k_cache"], x["k_new"], x["pos"], block_table=bt, cache_loc=loc),
            "v_cache": ref.update(x["v_cache"], x["v_new"], x["pos"], block_table=bt, cache_loc=loc)}


def _check(p: dict[str, Any]) -> str | None:
    if p["snew"] > p["smax"]:
        return f"snew={p['snew']} new tokens do not fit a cache of smax={p['smax']}"
    if p.get("rows", 0) and p["rows"] < p["b"]:
        return (f"rows={p['rows']} cache rows cannot give b={p['b']} sequences a row each "
                f"(expected rows=0, no cache_loc, or rows >= b)")
    return None


UPDATE = OpSpec(
    name="kvcache.update", golden=ref.update, reference=_ref,
    params=Defaults(dict(b=Int(1, 256),
                         snew=Int(1, 1 << 14, edges=(1, 2, 4), doc="new tokens per request (decode; a prefill chunk)"),
                         hkv=Int(1, 128, edges=(1, 8)), d=Int(1, 576, edges=(64, 128)), smax=Int(1, 1 << 17),
                         layout=OneOf(*LAYOUTS, doc="contiguous (b, smax, h, d) or pages of 16 / 64"),
                         rows=Int(0, 4096, edges=(0,), doc="cache / block-table rows addressed through cache_loc "
                                  "(TensorRT-LLM); 0: none, sequence b writes row b")),
                    {"rows": 0}),
    make_inputs=_inputs,
    output_shapes=lambda p: {"k_cache": _cache_shape(p), "v_cache": _cache_shape(p)},
    outputs={"k_cache": Output("test", exact=True, doc="K cache after the write"),
             "v_cache": Output("test", exact=True, doc="V cache after the write")},
    tolerance=Tol(noise_k=None), dists=DISTS, check=_check, baseline=None,
    doc="Append s_new tokens of K and V at pos[b] (contiguous or through a block table; row cache_loc[b] "
        "when rows > 0); bit-exact.",
)

SPECS = (UPDATE,)
