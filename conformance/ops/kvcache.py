"""Op specs of the KV-cache family: the write `kvcache.update` (contiguous or paged; bit-exact) and
TensorRT-LLM's host metadata step `kvcache.metadata` (exact integers; see its section below).

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

`tokens` = "ragged" (default "fixed": every sequence appends snew tokens, k_new (b, snew, hkv, d))
takes TensorRT-LLM's flattened layout: k_new (total, hkv, d) holds every sequence's new tokens back
to back, seq_len (b,) int32 of them each, drawn in [1, snew] with one sequence (at random) of 0 when
b >= 2, and seq_start (b,) int32 their exclusive cumsum; pos[b] in [0, smax - seq_len[b]]. `dv` > 0
(default 0: d) gives V its own head dim (TensorRT-LLM's V_D_HEAD != Q_D_HEAD): v_cache (..., dv) and
v_new (..., dv), either layout. rope.kv_update takes both too (k rotated, v copied).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.kvcache as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw
from kernel_parity.conformance.params import Defaults, Int, OneOf, Schema
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


def _cache_shape(p: dict[str, Any], d: int | None = None) -> tuple[int, ...]:
    page, d = _page(p), d or p["d"]
    if page is None:
        return (_rows(p), p["smax"], p["hkv"], d)
    return (_n_blocks(p), page, p["hkv"], d)


def _dv(p: dict[str, Any]) -> int:
    """V's head dim: `dv`, or d (0)."""
    return p.get("dv", 0) or p["d"]


def seq_lens(p: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """(b,) int32 ragged new-token counts: each in [1, snew], one (at random) 0 when b >= 2."""
    n = rng.integers(1, p["snew"] + 1, p["b"])
    if p["b"] >= 2:
        n[rng.integers(0, p["b"])] = 0
    return n.astype(np.int32)


def _ragged(p: dict[str, Any], dtype: str, rng: np.random.Generator, out: dict[str, np.ndarray]) -> None:
    """The ragged layout's new tokens, seq_len / seq_start and positions (module docstring)."""
    n = seq_lens(p, rng)
    total = int(n.sum())
    out["k_new"] = dt.round_to(draw(rng, (total, p["hkv"], p["d"]), "normal"), dtype)
    out["v_new"] = dt.round_to(draw(rng, (total, p["hkv"], _dv(p)), "normal"), dtype)
    out["pos"] = rng.integers(0, p["smax"] - n + 1).astype(np.int32)
    out["seq_len"] = n
    out["seq_start"] = (np.cumsum(n) - n).astype(np.int32)


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
    if p.get("tokens", "fixed") == "ragged" or p.get("dv", 0):
        out = {"k_cache": dt.round_to(draw(rng, shape, "normal"), dtype),
               "v_cache": dt.round_to(draw(rng, _cache_shape(p, _dv(p)), "normal"), dtype)}
        if p.get("tokens", "fixed") == "ragged":
            _ragged(p, dtype, rng, out)
        else:
            out["k_new"] = dt.round_to(draw(rng, new_shape, "normal"), dtype)
            out["v_new"] = dt.round_to(draw(rng, new_shape[:3] + (_dv(p),), "normal"), dtype)
            out["pos"] = _positions(p, rng)
    else:  # the draws of the cases that predate `tokens` and `dv`, in their order
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
    kw = dict(block_table=x.get("block_table"), cache_loc=x.get("cache_loc"), seq_len=x.get("seq_len"),
              seq_start=x.get("seq_start"))
    return {"k_cache": ref.update(x["k_cache"], x["k_new"], x["pos"], **kw),
            "v_cache": ref.update(x["v_cache"], x["v_new"], x["pos"], **kw)}


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
                                  "(TensorRT-LLM); 0: none, sequence b writes row b"),
                         tokens=OneOf("fixed", "ragged", doc="snew tokens per sequence (b, snew, h, d), or TensorRT-"
                                      "LLM's flattened (total, h, d) with seq_len / seq_start (<= snew each, some 0)"),
                         dv=Int(0, 576, edges=(0,), doc="V's head dim (TensorRT-LLM's V_D_HEAD); 0: d")),
                    {"rows": 0, "tokens": "fixed", "dv": 0}),
    make_inputs=_inputs,
    output_shapes=lambda p: {"k_cache": _cache_shape(p), "v_cache": _cache_shape(p, _dv(p))},
    outputs={"k_cache": Output("test", exact=True, doc="K cache after the write"),
             "v_cache": Output("test", exact=True, doc="V cache after the write")},
    tolerance=Tol(noise_k=None), dists=DISTS, check=_check, baseline=None,
    doc="Append s_new tokens of K and V at pos[b] (contiguous or through a block table; row cache_loc[b] "
        "when rows > 0; ragged seq_len / seq_start and V's own head dim dv optional); bit-exact.",
)


# -- kvcache.metadata ------------------------------------------------------------------------------
# TensorRT-LLM's prepare_fused_mha_metadata (refimpl/kvcache.py `metadata`): the batch buffers hold
# maxb rows, b of them real; seq_len's real rows are in [1, snew] (snew = 1: a generate batch, all 1)
# with one interior 0 (a zero-length sequence before the last, when b >= 3), its rows past b zero (the
# padding TensorRT-LLM's sanitiser relies on); input_pos and cache_loc hold stale values past b, 10^6
# and more (a kernel that copies them shows). `graph` > 0 pads the outputs to a captured CUDA-graph
# batch size. Output shapes: (graph or b,), a function of the params.
def _meta_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, maxb = p["b"], p["maxb"]
    n = np.zeros(maxb, dtype=np.int64)
    n[:b] = rng.integers(1, p["snew"] + 1, b)
    if b >= 3 and p["snew"] > 1:
        n[rng.integers(0, b - 1)] = 0  # a zero-length sequence that is not the last
    pos = rng.integers(10**6, 2 * 10**6, maxb)  # stale past b
    pos[:b] = rng.integers(0, p["smax"] - n[:b] + 1)
    loc = rng.integers(10**6, 2 * 10**6, maxb)
    loc[:b] = rng.permutation(maxb)[:b]  # distinct cache rows
    return {"seq_len": n.astype(np.int32), "input_pos": pos.astype(np.int32), "cache_loc": loc.astype(np.int32)}


def _meta_ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    out = ref.metadata(x["seq_len"], x["input_pos"], x["cache_loc"], graph=p["graph"])
    return dict(zip(META_OUTPUTS, out))


def _meta_check(p: dict[str, Any]) -> str | None:
    if p["maxb"] < max(p["b"], p["graph"]):
        return (f"maxb={p['maxb']} buffer rows cannot hold b={p['b']} sequences or graph={p['graph']} "
                f"(expected maxb >= both)")
    if p["graph"] and p["graph"] < p["b"]:
        return f"graph={p['graph']} is a captured batch smaller than b={p['b']} (expected graph=0 or graph >= b)"
    if p["snew"] > p["smax"]:
        return f"snew={p['snew']} new tokens do not fit a cache of smax={p['smax']}"
    return None


META_OUTPUTS = ("seq_len", "input_pos", "cache_loc", "seq_start")

METADATA = OpSpec(
    name="kvcache.metadata", golden=ref.metadata, reference=_meta_ref,
    params=Schema(dict(b=Int(1, 4096, doc="real sequences (the last one non-empty)"),
                       maxb=Int(1, 4096, doc="rows of the batch buffers (TensorRT-LLM's max_batch_size)"),
                       graph=Int(0, 4096, edges=(0,), doc="captured CUDA-graph batch size the outputs are padded "
                                 "to (>= b); 0: none"),
                       snew=Int(1, 1 << 14, edges=(1,), doc="most new tokens of a sequence (1: a generate batch)"),
                       smax=Int(1, 1 << 17, doc="cache capacity (input_pos + seq_len <= smax)"))),
    make_inputs=_meta_inputs,
    output_shapes=lambda p: {k: (p["graph"] or p["b"],) for k in META_OUTPUTS},
    outputs={"seq_len": Output("int32", exact=True, doc="real rows' seq_len, 0 on padding rows"),
             "input_pos": Output("int32", exact=True, doc="real rows' input_pos, the last real row's on padding"),
             "cache_loc": Output("int32", exact=True, doc="real rows' cache_loc, the last real row's on padding"),
             "seq_start": Output("int32", exact=True, doc="exclusive cumsum of seq_len")},
    tolerance=Tol(noise_k=None), dtypes=("fp32",), dists={"normal": "seq_len, input_pos, cache_loc as above"},
    check=_meta_check, baseline=None, backends=("cpu", "torch", "triton"),
    doc="TensorRT-LLM's host metadata: sequences from zero-padded buffers, seq_start the exclusive cumsum, "
        "CUDA-graph padding rows inert; exact integers.",
)

SPECS = (UPDATE, METADATA)
