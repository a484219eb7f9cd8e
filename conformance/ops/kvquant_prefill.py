"""kvquant.chunked_prefill (issue 34): packed query chunks over a quantized paged KV cache.

Each sequence's new chunk of L_q,b queries (q (total_q, h_q, d) packed by cu_seqlens_q, in the test dtype)
attends over its cached history (hist_b tokens) and its own chunk, causal bottom-right (query i of sequence b
at position hist_b + i sees keys j <= hist_b + i): attention.chunked_prefill's semantics over a paged cache of
refimpl/kvquant.py's codes (e4m3, e5m2, int8) with fp32 scales per tensor, per kv head or per (slot, kv head)
(`gran`). Declared flow: the chunk's own K / V are in the quantized cache already (vLLM's: reshape_and_cache
writes the chunk into the fp8 cache, then the attention reads history + chunk from it), so the cache holds
hist_b + L_q,b tokens of codes for sequence b. O (total_q, h_q, d) in the test dtype, LSE (h_q, total_q) fp32,
natural log; a sequence with an empty chunk writes no row. Golden: refimpl/kvquant_prefill.py (float64 code x
scale, then refimpl.attention.chunked_prefill's math).

What is compared: the kernel's arithmetic on the codes, not the cache's quantization error (the golden reads the
same codes; kvquant.update answers for how they were written). So the limits are attention.chunked_prefill's
production tier (conformance/ops/attention.py `attention_tolerance`: bf16 O cos_diff 1e-5 as FlashMLA's test,
fp16 / fp32 the dtype defaults, the calibrated fp32 LSE, O's absolute error against 4 eps max|O|, the error
model's magnitudes; reduction length hist + sq + d): every code of the three formats is exact in bf16, fp16 and
fp32, and a code x fp32 scale is exact in float64, so a kernel that keeps the scales out of its dots (logits
s_k(j) (q . codes_j), O = sum_j p_j s_v(j) codes_j) rounds no more than a float-cache kernel does. Never widened
for a kernel. The eager baseline (kernels/torch/kvquant_prefill.py: dequantize to fp32, then fp32 attention)
has attention's baseline tier.

Inputs (make_inputs), conformance/ops/kvquant_decode.py's builders:
- lengths (`lengths`): "full": every sequence a chunk of sq after hist cached tokens; "ragged": (L_q, hist) =
  (sq, hist), (0, hist // 2) an empty chunk after a history, (1, hist - 1) one query (decode-like), (sq, 0) no
  history, (min(sq, 3), 2 page + 1 - min(sq, 3)) a short chunk crossing a page end, the sequence one past it,
  (sq // 2, page - 1) a chunk starting on a page's last slot, (0, 0) an empty sequence, then
  (sq (i + 1) // (i + 2), hist (i + 1) // (i + 2)), each cut to [0, sq] x [0, hist];
- pages shuffled through a block table (two unused pages, a trap page every unused entry points at); every
  slot not holding a live token (history or chunk) poisoned: NaN codes (e4m3 / e5m2 0x7F), int8 127, NaN token
  scales;
- neighbour separation (kvquant_decode.NEIGHBOUR): magnitude factors by kv-head parity ("tensor", "head") or
  (slot + head) parity ("token"), lo / hi classes >= 64x apart for K and >= 32x for V, V ~16x K;
- `normal`: quantized N(0, 1) x the factors at calibrated static scales clipped at 0.75 amax (saturated codes)
  or dynamic token scales, int8 with 1% of its codes -128; `grid`: codes uniform over every finite code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.ops.kvquant_decode import DISTS, _cache, _layout
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.refimpl import kvquant as kq
from kernel_parity.refimpl.kvquant_prefill import chunked_prefill as golden


def lengths(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(chunk lengths, history lengths), each (b,) int32, functions of the parameters only (module docstring)."""
    b, sq, hist, page = p["b"], p["sq"], p["hist"], p["page"]
    if p["lens"] == "full":
        return np.full(b, sq, dtype=np.int32), np.full(b, hist, dtype=np.int32)
    head = [(sq, hist), (0, hist // 2), (1, hist - 1), (sq, 0), (min(sq, 3), 2 * page + 1 - min(sq, 3)),
            (sq // 2, page - 1), (0, 0)]
    pairs = [head[i] if i < len(head) else ((sq * (i + 1)) // (i + 2), (hist * (i + 1)) // (i + 2))
             for i in range(b)]
    lq = np.clip([x for x, _ in pairs], 0, sq).astype(np.int32)
    hs = np.clip([y for _, y in pairs], 0, hist).astype(np.int32)
    return lq, hs


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    lq, hs = lengths(p)
    cu = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), p["hq"], p["d"]))
    table, live = _layout(rng, hs + lq, p["page"], p["hist"] + p["sq"])
    shape = (live.shape[0], p["page"], p["hkv"], p["d"])
    kc, ks = _cache(rng, "k", shape, live, p["fmt"], p["gran"], dist)
    vc, vs = _cache(rng, "v", shape, live, p["fmt"], p["gran"], dist)
    return {"q": dt.round_to(q, dtype), "k_cache": kc, "v_cache": vc, "k_scale": ks, "v_scale": vs,
            "cu_seqlens_q": cu, "hist": hs, "block_table": table}


def _ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    o, lse = golden(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["cu_seqlens_q"], x["hist"],
                    x["block_table"], absolute=absolute)
    return {"o": o, "lse": lse}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    return None


def _total_q(p: dict[str, Any]) -> int:
    return int(lengths(p)[0].sum())


def _keys(p: dict[str, Any]) -> float:
    """Query-key pairs the causal mask keeps: sum_b sum_i (hist_b + i + 1)."""
    lq, hs = (x.astype(np.float64) for x in lengths(p))
    return float((lq * hs + lq * (lq + 1) / 2).sum())


def _bytes(p: dict[str, Any]) -> tuple[int, int]:
    """(read, written) by a kernel that reads each live code and scale once (GQA heads packed)."""
    lq, hs = lengths(p)
    keys = int((lq + hs)[lq > 0].sum())
    el = 2  # q and o in bf16 / fp16
    scales = 2 * keys * p["hkv"] * 4 if p["gran"] == "token" else 0
    tq = int(lq.sum())
    return 2 * keys * p["hkv"] * p["d"] + scales + tq * p["hq"] * p["d"] * el, tq * p["hq"] * (p["d"] * el + 4)


CHUNKED_PREFILL = OpSpec(
    name="kvquant.chunked_prefill",
    golden=golden,
    reference=_ref,
    magnitude=lambda x, p: _ref(x, p, absolute=True),
    params=Schema(dict(
        b=Int(1, 64, doc="sequences (one chunk each)"),
        sq=Int(1, 1 << 16, edges=(1, 40, 512), doc="longest chunk (queries of a sequence)"),
        hist=Int(0, 1 << 17, edges=(0, 16, 64, 32768), doc="longest history (tokens cached before the chunk)"),
        hq=Int(1, 128, edges=(1, 4, 8, 32), doc="query heads"),
        hkv=Int(1, 128, edges=(1, 2, 8), doc="kv heads (divides hq)"),
        d=Int(1, 256, edges=(64, 128), doc="head dim"),
        lens=OneOf("full", "ragged", doc="every sequence (sq, hist), or ragged (empty chunks, no history, page "
                                         "edges +- 1, an empty sequence)"),
        page=OneOf(16, 64, doc="tokens per page"),
        fmt=OneOf(*kq.FORMATS, doc="code format (refimpl/kvquant.py)"),
        gran=OneOf(*kq.GRANS, doc="scale granularity: per tensor, per kv head, per (slot, kv head)"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"o": (_total_q(p), p["hq"], p["d"]), "lse": (p["hq"], _total_q(p))},
    outputs={"o": Output("test", doc="attention output of each packed query"),
             "lse": Output("fp32", doc="natural-log LSE (h_q, total_q)")},
    tolerance=attention_tolerance(lambda p, out: p["hist"] + p["sq"] + p["d"]),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"k_cache", "v_cache"}),
    flops=lambda p: 4.0 * _keys(p) * p["hq"] * p["d"],
    bytes_moved=_bytes,
    doc="Chunked prefill over a quantized paged KV cache (e4m3 / e5m2 / int8 codes; per-tensor, per-head or "
        "per-token fp32 scales) holding each sequence's history and its chunk's own K / V: O (total_q, h_q, d), "
        "LSE (h_q, total_q), as attention.chunked_prefill on the exactly dequantized cache.",
)

SPECS = (CHUNKED_PREFILL,)
