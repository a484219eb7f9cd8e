"""Op specs of DeepSeek multi-head latent attention (stem `mla`), FlashMLA's interface.

- `mla.decode`         dense decode over a paged latent cache [blocks, 64, 1, 576]: one KV head,
                       values = the first 512 dims of the key rows, explicit scale, s_q in {1, 2}
                       (causal bottom-right for s_q = 2); O [b, s_q, h_q, 512], LSE [b, h_q, s_q]
- `mla.decode_sparse`  each query row attends to a top-k list of cache slots (-1 padding,
                       per-request top-k lengths): DeepSeek's sparse MLA
- `mla.decode_fused_fp8`  Modular MAX's mla_decode_branch_fp8: RoPE and RMSNorm of the new cache
                       rows (in place: the cache after the call is an output), FP8 W_UK / W_UV
                       block-scaled matmuls around the decode

Inputs follow FlashMLA's own test (tests/test_flash_mla_dense_decoding.py): randn / 10 clamped
to [-1, 1], every cache row past a request's length and every unused page NaN, unused block-table
entries 2147480000 (a kernel that reads them fails structurally or crashes). Tolerances are the
attention family's (conformance/ops/attention.py): production bf16 O at FlashMLA's cos_diff < 1e-5.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.mla  # noqa: F401  (refimpl.mla below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.ops.attention_inputs import lengths
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output

D, DV, PAGE = 576, 512, 64  # FlashMLA: kv_lora_rank 512 + rope 64; values = first 512 dims; pages of 64
TABLE_POISON = 2147480000  # FlashMLA's test fills unused block-table entries with it
SCALES = {"head": D ** -0.5,  # FlashMLA's default and tests: 576^-0.5
          "model": 0.13523377886}  # DeepSeek-V3: 192^-0.5 x mscale^2 (mscale 1.36888794541)
DISTS = {
    "normal": "q, cache ~ N(0, 1) / 10 clamped to [-1, 1] (FlashMLA's test inputs)",
    "large": "q, cache ~ N(0, 1): logits of std ~ sqrt(576) x scale, a peaked softmax",
    "outlier": "as normal, with 1% of cache entries x 20: one key dominates",
}
HEADS = dict(
    b=Int(1, 256, edges=(1, 2, 128), doc="requests"),
    sq=OneOf(1, 2, doc="new tokens per request (2: multi-token prediction, causal bottom-right)"),
    hq=Int(1, 128, edges=(16, 32, 64, 128), doc="query heads (one latent KV head)"),
)
LENS = OneOf("full", "ragged", doc="requests at the longest length, or ragged (0, 1, ... among them)")


def _draw(rng: np.random.Generator, shape: tuple, dist: str) -> np.ndarray:
    x = rng.standard_normal(shape)
    if dist == "large":
        return x
    x = np.clip(x / 10.0, -1.0, 1.0)
    if dist == "outlier":
        x[rng.random(shape) < 0.01] *= 20.0
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return x


def paged_latent_cache(rng: np.random.Generator, seqlens: np.ndarray, dist: str, dtype: str,
                       extra_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(kv_cache (num_blocks, 64, 1, 576), block_table (b, max_blocks) int32): shuffled pages, NaN in
    every slot not holding a live token (the tail of each last page, two spare pages), unused table
    entries TABLE_POISON."""
    b = seqlens.shape[0]
    used = [-(-int(n) // PAGE) for n in seqlens]
    max_blocks = max(1, max(used, default=1))
    n_blocks = sum(used) + 2
    perm = rng.permutation(n_blocks)
    cache = np.full((n_blocks, PAGE, 1, D), np.nan)
    table = np.full((b, max_blocks), TABLE_POISON, dtype=np.int32)
    nxt = 0
    for i in range(b):  # builds the layout (which page holds which tokens), not the math
        rows = _draw(rng, (int(seqlens[i]), D), dist)
        for blk in range(used[i]):
            phys = int(perm[nxt])
            nxt += 1
            table[i, blk] = phys
            part = rows[blk * PAGE:(blk + 1) * PAGE]
            cache[phys, :part.shape[0], 0] = part
    return dt.round_to(cache, dtype), table


def _decode_lens(p: dict[str, Any]) -> np.ndarray:
    return lengths(p["b"], p["kv"], p["lens"])


def _decode_inputs(p, dtype, dist, rng):
    seqlens = _decode_lens(p)
    cache, table = paged_latent_cache(rng, seqlens, dist, dtype)
    q = dt.round_to(_draw(rng, (p["b"], p["sq"], p["hq"], D), dist), dtype)
    return {"q": q, "kv_cache": cache, "block_table": table, "seqlens": seqlens}


def _decode_ref(x, p):
    o, lse = refimpl.mla.decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], SCALES[p["scale"]],
                                d_v=DV, causal=bool(p["causal"]))
    return {"o": o, "lse": lse}


def _sparse_inputs(p, dtype, dist, rng):
    """Each request's rows list `topk` slots: a random subset of its visible tokens (all of them when
    fewer), -1 for about 1 in 8 entries and past the end, and, past topk_length, slots of NaN rows."""
    b, sq, k = p["b"], p["sq"], p["topk"]
    seqlens = _decode_lens(p)
    cache, table = paged_latent_cache(rng, seqlens, dist, dtype)
    nan_slots = np.flatnonzero(np.isnan(cache[:, :, 0, 0].astype(np.float64)).reshape(-1))
    idx = np.full((b, sq, k), -1, dtype=np.int32)
    for i in range(b):  # per request: which of its tokens the top-k list names
        L = int(seqlens[i])
        tok = np.arange(L)
        slots = table[i, tok // PAGE].astype(np.int64) * PAGE + tok % PAGE
        for r in range(sq):
            pick = rng.permutation(slots)[:k]
            idx[i, r, :pick.size] = pick
    idx[rng.random(idx.shape) < 0.125] = -1
    if p["topk_len"] == "ragged":
        topk_length = rng.integers(0, k + 1, b).astype(np.int32)
        past = np.arange(k)[None, None, :] >= topk_length[:, None, None]
        if nan_slots.size:  # garbage past the length: a kernel that reads it gets NaN
            idx[np.broadcast_to(past, idx.shape)] = rng.choice(nan_slots, int(past.sum() * sq))
    else:
        topk_length = np.full(b, k, dtype=np.int32)
    q = dt.round_to(_draw(rng, (b, sq, p["hq"], D), dist), dtype)
    return {"q": q, "kv_cache": cache, "indices": idx, "topk_length": topk_length}


def _sparse_ref(x, p):
    o, lse = refimpl.mla.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], SCALES[p["scale"]],
                                       d_v=DV)
    return {"o": o, "lse": lse}


def _check(p: dict[str, Any]) -> str | None:
    if p.get("causal") and p["sq"] == 1:
        return "causal=1 needs sq=2 (with one new token the mask is empty; use causal=0)"
    return None


def _shapes(p):
    return {"o": (p["b"], p["sq"], p["hq"], DV), "lse": (p["b"], p["hq"], p["sq"])}


OUT = {
    "o": Output("test", doc="latent attention output (512), before W_UV"),
    "lse": Output("fp32", doc="natural-log LSE of each query row; -inf for a row with no visible key"),
}

DECODE = OpSpec(
    name="mla.decode",
    golden=refimpl.mla.decode,
    reference=_decode_ref,
    params=Schema(dict(HEADS, kv=Int(0, 1 << 17, edges=(64, 65, 4096, 8192, 16384), doc="longest cached length"),
                       lens=LENS, causal=OneOf(0, 1, doc="bottom-right causal mask (sq = 2)"),
                       scale=OneOf("head", "model", doc="576^-0.5 (FlashMLA's tests) or DeepSeek-V3's 0.1352"))),
    make_inputs=_decode_inputs,
    output_shapes=_shapes,
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: p["kv"] + D),
    dtypes=("bf16", "fp16", "fp32"),
    dists=DISTS,
    check=_check,
    doc="FlashMLA dense decode: paged latent cache (64-token pages, 576 dims, V = first 512), one KV head.",
)

DECODE_SPARSE = OpSpec(
    name="mla.decode_sparse",
    golden=refimpl.mla.decode_sparse,
    reference=_sparse_ref,
    params=Schema(dict(HEADS, kv=Int(0, 1 << 17, edges=(64, 2048), doc="longest cached length"), lens=LENS,
                       topk=Int(1, 2048, edges=(64, 128, 2048), doc="slots listed per query row"),
                       topk_len=OneOf("full", "ragged", doc="per-request top-k lengths: all topk, or random"),
                       scale=OneOf("head", "model", doc="576^-0.5 or DeepSeek-V3's 0.1352"))),
    make_inputs=_sparse_inputs,
    output_shapes=_shapes,
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: p["topk"] + D),
    dtypes=("bf16", "fp16", "fp32"),
    dists=DISTS,
    backends=("triton", "torch"),
    doc="DeepSeek sparse MLA decode: each query row attends to its top-k list of cache slots (-1 skipped).",
)

SPECS = (DECODE, DECODE_SPARSE)
