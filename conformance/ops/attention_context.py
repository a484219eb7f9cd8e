"""Op spec of `attention.context_kv`: context attention that writes the cache (TensorRT-LLM's
context_attention_kv), registered with the attention family: conformance/ops/attention.py's SPECS builds
it with `context_kv_spec`, handing in the family's head params and tolerance (no import back, no cycle).

The packed new tokens q, k, v (total, h, d) of b sequences (cu_seqlens; TensorRT-LLM's seq_start and
seq_len are its exclusive cumsum and diff) come after input_pos_b cached tokens each; the op writes the
chunk's K/V into the caches at input_pos_b + t and attends its queries to history + chunk, causal
bottom-right. Outputs: O, the LSE (h_q, total) and the two caches as the kernel left them (in place,
bit-exact). Lengths are chunked_prefill's (`chunk_lengths`): ragged puts an empty chunk (which must write
nothing), an empty history, a one-token chunk and both full on different sequences.

Poison: every cache slot at or past input_pos_b holds NaN, the slots the write must fill included, as do
the spare pages and the trap page that table entries past a sequence's pages point at. A kernel that
attends before its write lands, reads a chunk key from a slot it has not written (the stale slot), or
reads past the chunk gets NaN in O; a write to a wrong slot (or by an empty chunk) leaves a value where
the golden keeps the NaN, or a NaN where it has the key (the bit-exact judge; every slot is a canary).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import kernel_parity.refimpl.attention as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention_inputs import (CACHE_SLACK, DISTS, chunk_lengths, contiguous_cache,
                                                           cu_seqlens, paged_cache, qkv)
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import Diagnosis, OpSpec, Output
from kernel_parity.conformance.tolerance import Tol


def _spare_pages(p: dict[str, Any]) -> int:
    """Pages of a paged case: each sequence's ceil((hist + L_q) / page), two spare ones and the trap."""
    lq, hist = chunk_lengths(p)
    return int((-(-(hist + lq) // p["page"])).sum()) + 3


def _cache_shape(p: dict[str, Any]) -> tuple[int, ...]:
    if p["page"]:
        return (_spare_pages(p), p["page"], p["hkv"], p["d"])
    return (p["b"], p["hist"] + p["sq"] + CACHE_SLACK, p["hkv"], p["d"])


def _shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    total = int(chunk_lengths(p)[0].sum())
    return {"o": (total, p["hq"], p["d"]), "lse": (p["hq"], total), "k_cache": _cache_shape(p),
            "v_cache": _cache_shape(p)}


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each sequence's whole key/value run (b, s_max, h_kv, d) drawn at once: its first input_pos_b
    positions are the cached history, the next L_q,b the chunk's packed k / v; the caches hold NaN from
    input_pos_b on (module docstring)."""
    lq, hist = chunk_lengths(p)
    b, total = p["b"], int(lq.sum())
    s_max = p["hist"] + p["sq"] + CACHE_SLACK
    q, k, v = qkv(rng, dist, (total, p["hq"], p["d"]), (b, s_max, p["hkv"], p["d"]), (b, s_max, p["hkv"], p["d"]))
    cu = cu_seqlens(lq)
    bi = np.repeat(np.arange(b), lq)  # each new token's sequence
    pos = hist[bi] + np.arange(total) - cu[:-1][bi]  # its position in the sequence
    out = {"q": dt.round_to(q, dtype), "k": dt.round_to(k[bi, pos], dtype), "v": dt.round_to(v[bi, pos], dtype),
           "cu_seqlens": cu, "input_pos": hist}
    if p["page"]:
        past = np.arange(s_max)[None, :] >= hist[:, None]  # b, s_max: the chunk's slots and beyond
        k[past], v[past] = np.nan, np.nan
        out["k_cache"], out["v_cache"], out["block_table"] = paged_cache(rng, k, v, hist + lq, p["page"], dtype)
    else:
        out["k_cache"], out["v_cache"] = contiguous_cache(rng, k, hist, dtype), contiguous_cache(rng, v, hist, dtype)
    return out


def _golden_kw(p: dict[str, Any]) -> dict[str, Any]:
    return dict(causal="bottom_right", head_map=p.get("_head_map", "grouped"), scale=p.get("_scale"))


def _ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    o, lse, _, k_cache, v_cache = ref.context_kv(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["cu_seqlens"],
                                                 x["input_pos"], x.get("block_table"), absolute=absolute,
                                                 **_golden_kw(p))
    lse = lse * np.log2(np.e) if p.get("_lse_base2") else lse
    if absolute:  # the error model of O and the LSE; the caches are bit-exact copies
        return {"o": o, "lse": lse}
    return {"o": o, "lse": lse, "k_cache": k_cache, "v_cache": v_cache}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    return None


DIAGNOSES = (
    Diagnosis("matches kv head h % h_kv: GQA head-mapping bug (repeat instead of repeat_interleave)",
              lambda p: {**p, "_head_map": "tiled"} if p["hkv"] > 1 and p["hq"] > p["hkv"] else None),
    Diagnosis("matches scale 1 (no 1/sqrt(d)): scale bug", lambda p: {**p, "_scale": 1.0} if p["d"] > 1 else None),
    Diagnosis("matches a base-2 LSE: LSE not converted to natural log", lambda p: {**p, "_lse_base2": True}),
)

def context_kv_spec(heads: dict[str, Int], tolerance: Callable[[Callable], Tol]) -> OpSpec:
    """The op's spec, given the attention family's head params (hq, hkv, d) and its tolerance for an
    accumulation length (conformance/ops/attention.py's HEADS and attention_tolerance)."""
    return OpSpec(
        name="attention.context_kv", golden=ref.context_kv, reference=_ref,
        magnitude=lambda x, p: _ref(x, p, absolute=True),
        params=Schema(dict(
            b=Int(1, 64), sq=Int(1, 1 << 16, doc="longest chunk (new tokens of a sequence)"),
            hist=Int(0, 1 << 17, edges=(16, 64), doc="longest history (input_pos: tokens cached before)"), **heads,
            lens=OneOf("full", "ragged", doc="chunk and history lengths: all at the maximum, or ragged with an "
                                             "empty chunk and an empty history"),
            page=OneOf(0, 16, 64, doc="0: contiguous cache (b, s_max, h_kv, d); else tokens per page"))),
        make_inputs=_inputs, output_shapes=_shapes,
        outputs={"o": Output("test", doc="attention output (total, h_q, d)"),
                 "lse": Output("fp32", doc="natural-log LSE (h_q, total) of each query row"),
                 "k_cache": Output("test", exact=True, inplace="k_cache",
                                   doc="K cache after the write (in place): the chunk at input_pos_b + t, rest kept"),
                 "v_cache": Output("test", exact=True, inplace="v_cache", doc="V cache after the write (in place)")},
        tolerance=tolerance(lambda p, output: p["hist"] + p["sq"] + p["d"]), dists=DISTS, check=_check,
        diagnoses=DIAGNOSES, backends=("triton", "cpu", "torch"),
        doc="TensorRT-LLM's context attention with the cache write: packed new q/k/v (cu_seqlens) after input_pos "
            "cached tokens; K/V appended to the cache (contiguous or paged, in place) and the queries attend "
            "history + chunk, causal bottom-right (query i sees keys j <= input_pos_b + i).",
    )
