"""Op spec of the KV-cache write: `kvcache.update` (contiguous or paged; bit-exact).

The cache starts with random old contents (every slot is a value, so an unwritten slot, a
write to the wrong position, or a write through the wrong page shows as a bit difference); the
new tokens are appended after `pos[b]` tokens. Outputs are the whole caches after the write.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.kvcache as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol

LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}
DISTS = {"normal": "old cache and new tokens ~ N(0, 1)"}


def _page(p: dict[str, Any]) -> int | None:
    return LAYOUTS[p["layout"]]


def _n_blocks(p: dict[str, Any]) -> int:
    page = _page(p)
    return p["b"] * -(-p["smax"] // page) + 2  # every sequence's pages, and two spare ones


def _cache_shape(p: dict[str, Any]) -> tuple[int, ...]:
    page = _page(p)
    if page is None:
        return (p["b"], p["smax"], p["hkv"], p["d"])
    return (_n_blocks(p), page, p["hkv"], p["d"])


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = _cache_shape(p)
    new_shape = (p["b"], p["snew"], p["hkv"], p["d"])
    out = {
        "k_cache": dt.round_to(draw(rng, shape, "normal"), dtype),
        "v_cache": dt.round_to(draw(rng, shape, "normal"), dtype),
        "k_new": dt.round_to(draw(rng, new_shape, "normal"), dtype),
        "v_new": dt.round_to(draw(rng, new_shape, "normal"), dtype),
        "pos": rng.integers(0, p["smax"] - p["snew"] + 1, p["b"]).astype(np.int32),
    }
    page = _page(p)
    if page is not None:
        per_seq = -(-p["smax"] // page)
        perm = rng.permutation(_n_blocks(p))[: p["b"] * per_seq]  # shuffled, distinct pages
        out["block_table"] = perm.reshape(p["b"], per_seq).astype(np.int32)
    return out


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    bt = x.get("block_table")
    return {"k_cache": ref.update(x["k_cache"], x["k_new"], x["pos"], block_table=bt),
            "v_cache": ref.update(x["v_cache"], x["v_new"], x["pos"], block_table=bt)}


def _check(p: dict[str, Any]) -> str | None:
    if p["snew"] > p["smax"]:
        return f"snew={p['snew']} new tokens do not fit a cache of smax={p['smax']}"
    return None


UPDATE = OpSpec(
    name="kvcache.update", golden=ref.update, reference=_ref,
    params=Schema(dict(b=Int(1, 256),
                       snew=Int(1, 1 << 14, edges=(1, 2, 4), doc="new tokens per request (decode; a prefill chunk)"),
                       hkv=Int(1, 128, edges=(1, 8)), d=Int(1, 576, edges=(64, 128)), smax=Int(1, 1 << 17),
                       layout=OneOf(*LAYOUTS, doc="contiguous (b, smax, h, d) or pages of 16 / 64"))),
    make_inputs=_inputs,
    output_shapes=lambda p: {"k_cache": _cache_shape(p), "v_cache": _cache_shape(p)},
    outputs={"k_cache": Output("test", exact=True, doc="K cache after the write"),
             "v_cache": Output("test", exact=True, doc="V cache after the write")},
    tolerance=Tol(noise_k=None), dists=DISTS, check=_check, baseline=None,
    doc="Append s_new tokens of K and V at pos[b] (contiguous or through a block table); bit-exact.",
)

SPECS = (UPDATE,)
