"""kvquant.decode and kvquant.decode_split (issue 34): decode and flash decoding over a quantized KV cache.

kvquant.decode is attention.decode over a quantized contiguous cache: s_q >= 1 queries a sequence (q (b, s_q,
h_q, d) in the test dtype), the last s_q tokens, causal bottom-right, per-sequence lengths (0 allowed), GQA.
kvquant.decode_split is attention.decode_split (flash decoding; `part`: equal key counts a split, fixed blocks of
`blk` keys, or explicit per-request boundaries `split_bounds` as FlashMLA's scheduler draws them, attention's
PART and `split_bounds` input) over the same cache,
contiguous (page=0) or paged through a block table (page=16 / 64, shuffled pages as kvquant.decode_paged's; a
split may start or end inside a page): per-split partials o_parts (splits, b, s_q, h_q, d) fp32 (any value for
an empty split) and lse_parts (splits, b, h_q, s_q) fp32, and their merge O, LSE. Codes of refimpl/kvquant.py's
formats (e4m3, e5m2, int8), fp32 scales per tensor, per kv head or per (token, kv head) (`fmt`, `gran`, as
kvquant.decode_paged's). The golden (refimpl/kvquant_split.py) dequantizes exactly (float64 code x scale) and
runs refimpl.attention's decode / decode_split in float64.

What is compared: the kernel's arithmetic on the codes, not the cache's quantization error (the golden reads
the same codes). So the limits are attention.decode's / attention.decode_split's own production tier
(conformance/ops/attention.py `attention_tolerance` with decode_split's o_parts override: bf16 O cos_diff 1e-5
as FlashMLA's test, fp16 / fp32 the dtype defaults, the calibrated fp32 LSE, O and o_parts' absolute error
against 4 eps max|O|, the error model's magnitudes), for kvquant_decode.py's reason: a dequantized value (an
e4m3 / e5m2 / int8 code times an fp32 scale) is exact in fp32, and a kernel that takes the scales out of its
dots rounds no more than a float-cache kernel. Never widened for a kernel. The eager baseline
(kernels/torch/kvquant_split.py) has attention's baseline tier.

Inputs: kvquant_decode.py's machinery (its `_cache`: NEIGHBOUR factors by kv head parity, or by (token + kv
head) parity for per-token scales, so neighbouring heads and neighbouring tokens differ >= 64x (K) / >= 32x
(V) and V ~16x K; poisoned unused slots (NaN codes, int8 127, NaN token scales); `normal` (clipped static
scales: saturated codes, int8 with 1% -128 codes) and `grid` (every finite code) dists; its ragged `lengths`,
reordered so that 3 sequences hold an empty one: kv, 1, 0, page + 1, page - 1, kv - 1, page, ... (page 16 for
the contiguous cache); its shuffled-page `_layout` for page > 0). The contiguous cache has CACHE_SLACK poisoned
slots past the longest sequence. Split boundaries: the token classes alternate, so every split boundary lies
between a lo and a hi token, and a split that reads one key of its neighbour's range (or one key short), or a
neighbouring token's scale, is off by an order of magnitude in that key. Sequences shorter than s_q have
queries that see no key (O = 0, LSE = -inf), and sequences shorter than `splits` empty splits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import _PARTS_SCALE, PART, attention_tolerance
from kernel_parity.conformance.ops.attention_inputs import split_bounds
from kernel_parity.conformance.ops.kvquant_decode import DISTS, _cache, _layout, lengths
from kernel_parity.conformance.params import Defaults, Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.refimpl import kvquant as kq
from kernel_parity.refimpl.kvquant_split import decode as golden_decode
from kernel_parity.refimpl.kvquant_split import decode_split as golden_split

CACHE_SLACK = 3  # poisoned slots past the longest sequence of a contiguous cache
LENS_PAGE = 16  # the ragged pattern's page for the contiguous cache (1, 17, 15, 16, ...)

PARAMS = dict(
    b=Int(1, 256, doc="sequences"),
    sq=Int(1, 16, edges=(1, 2, 4), doc="new tokens a sequence (queries, the last sq tokens; causal bottom-right)"),
    hq=Int(1, 128, edges=(1, 4, 8, 32, 64), doc="query heads"),
    hkv=Int(1, 128, edges=(1, 2, 8), doc="kv heads (divides hq)"),
    d=Int(1, 256, edges=(64, 128), doc="head dim"),
    kv=Int(1, 1 << 17, edges=(16, 64, 32768), doc="longest cached sequence (its queries included)"),
    lens=OneOf("full", "ragged", doc="every sequence kv, or ragged (0, 1, 17, 15, kv - 1, ...)"),
    fmt=OneOf(*kq.FORMATS, doc="code format (refimpl/kvquant.py)"),
    gran=OneOf(*kq.GRANS, doc="scale granularity: per tensor, per kv head, per (token, kv head)"),
)
SPLIT_PARAMS = dict(
    splits=Int(1, 128, edges=(2, 3, 8, 16), doc="key ranges a sequence (part: their partition)"),
    page=OneOf(0, 16, 64, doc="0: contiguous cache; else tokens per page through a block table"),
    **PART,
)


def _lens(p: dict[str, Any]) -> np.ndarray:
    """(b,) int32 cached tokens a sequence: kvquant_decode.py's `lengths`, its ragged pattern reordered so that
    a batch of 3 has an empty sequence: kv, 1, 0, page + 1, page - 1, kv - 1, page, kv // 2, 2 page + 1, ..."""
    L = lengths(max(p["b"], 9), p["kv"], p["lens"], p.get("page") or LENS_PAGE)
    if p["lens"] == "ragged":
        L = L[[0, 1, 6, 2, 3, 5, 4, 7, 8, *range(9, L.size)]]
    return np.ascontiguousarray(L[: p["b"]])


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    L = _lens(p)
    q = rng.standard_normal((p["b"], p["sq"], p["hq"], p["d"]))
    out = {"q": dt.round_to(q, dtype)}
    if p.get("page"):
        table, live = _layout(rng, L, p["page"], p["kv"])
        out["block_table"] = table
    else:
        live = np.arange(p["kv"] + CACHE_SLACK)[None, :] < L[:, None]  # b, s_max
    shape = (live.shape[0], live.shape[1], p["hkv"], p["d"])
    out["k_cache"], out["k_scale"] = _cache(rng, "k", shape, live, p["fmt"], p["gran"], dist)
    out["v_cache"], out["v_scale"] = _cache(rng, "v", shape, live, p["fmt"], p["gran"], dist)
    out["seqlens"] = L
    if p.get("part") == "bounds":
        out["split_bounds"] = split_bounds(rng, L, p["splits"])
    return out


def _decode_ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    o, lse = golden_decode(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["seqlens"],
                           absolute=absolute)
    return {"o": o, "lse": lse}


def _split_ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    o, lse, o_parts, lse_parts = golden_split(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"],
                                              x["seqlens"], p["splits"], block_table=x.get("block_table"),
                                              block=p.get("blk") or None, bounds=x.get("split_bounds"),
                                              absolute=absolute)
    return {"o": o, "lse": lse, "o_parts": o_parts, "lse_parts": lse_parts}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    if p["kv"] < 1:
        return f"kv={p['kv']} must be >= 1 (the longest sequence)"
    part, blk = p.get("part", "equal"), p.get("blk", 0)
    if (part == "block") != (blk > 0):
        return f"blk={blk} with part={part}: blk > 0 is the block size of part=block, and 0 otherwise"
    if part == "block" and p["splits"] * blk < p["kv"]:
        return f"splits={p['splits']} blocks of blk={blk} keys do not cover kv={p['kv']}"
    return None


def _shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {"o": (p["b"], p["sq"], p["hq"], p["d"]), "lse": (p["b"], p["hq"], p["sq"])}


def _split_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {**_shapes(p), "o_parts": (p["splits"], p["b"], p["sq"], p["hq"], p["d"]),
            "lse_parts": (p["splits"], p["b"], p["hq"], p["sq"])}


def _flops(p: dict[str, Any]) -> float:
    return 4.0 * float(_lens(p).sum()) * p["sq"] * p["hq"] * p["d"]


def _bytes(p: dict[str, Any]) -> tuple[int, int]:
    """(read, written) by a kernel that reads each live code and scale once (the decode's read ceiling)."""
    keys = int(_lens(p).sum())
    el = 2  # q and o in bf16 / fp16
    scales = 2 * keys * p["hkv"] * 4 if p["gran"] == "token" else 0
    rows = p["b"] * p["sq"] * p["hq"]
    return 2 * keys * p["hkv"] * p["d"] + scales + rows * p["d"] * el, rows * (p["d"] * el + 4)


OUT = {"o": Output("test", doc="attention output"),
       "lse": Output("fp32", doc="natural-log LSE of each query row; -inf for a query with no key")}
_ACC = lambda p, out: p["kv"] + p["d"]  # noqa: E731  a dot over d, then a softmax-weighted sum over the keys

DECODE = OpSpec(
    name="kvquant.decode",
    golden=golden_decode,
    reference=_decode_ref,
    magnitude=lambda x, p: _decode_ref(x, p, absolute=True),
    params=Schema(PARAMS),
    make_inputs=_inputs,
    output_shapes=_shapes,
    outputs=OUT,
    tolerance=attention_tolerance(_ACC),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"k_cache", "v_cache"}),
    flops=_flops,
    bytes_moved=_bytes,
    doc="Decode of s_q new tokens over a contiguous quantized KV cache (b, s_max, h_kv, d) (e4m3 / e5m2 / int8 "
        "codes; per-tensor, per-head or per-token fp32 scales): O (b, s_q, h_q, d), LSE (b, h_q, s_q), as "
        "attention.decode on the exactly dequantized cache.",
)

DECODE_SPLIT = OpSpec(
    name="kvquant.decode_split",
    golden=golden_split,
    reference=_split_ref,
    magnitude=lambda x, p: _split_ref(x, p, absolute=True),
    params=Defaults({**PARAMS, **SPLIT_PARAMS}, {"part": "equal", "blk": 0}),
    make_inputs=_inputs,
    output_shapes=_split_shapes,
    outputs={**OUT,
             "o_parts": Output("fp32", nan_is_any=True, tol_dtype="test",
                               doc="per-split normalised O (any value for an empty split)"),
             "lse_parts": Output("fp32", doc="per-split LSE, -inf for an empty split")},
    tolerance=attention_tolerance(_ACC, _PARTS_SCALE),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"k_cache", "v_cache"}),
    flops=_flops,
    bytes_moved=_bytes,
    doc="Flash decoding over a quantized KV cache, contiguous or (page=16 / 64) paged: per-split partial (O, LSE) "
        "over equal key counts, fixed blocks or explicit boundaries, merged by lse_combine; as attention.decode_split "
        "on the exactly dequantized cache.",
)

SPECS = (DECODE, DECODE_SPLIT)
