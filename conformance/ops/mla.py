"""Op specs of DeepSeek multi-head latent attention (stem `mla`), FlashMLA's interface.

- `mla.decode`         dense decode over a paged latent cache [blocks, 64, 1, 576]: one KV head,
                       values = the first 512 dims of the key rows, explicit scale, s_q in {1, 2}
                       (causal bottom-right for s_q = 2); O [b, s_q, h_q, 512], LSE [b, h_q, s_q];
                       `hkv` (default 1, ids unchanged): FlashMLA's [blocks, 64, h_kv, 576] cache,
                       query head h on kv head h // (h_q / h_kv), each kv head's rows drawn apart
- `mla.decode_sparse`  each query row attends to a top-k list of cache slots (-1 padding,
                       per-request top-k lengths): DeepSeek's sparse MLA; `hkv` (default 1, ids
                       unchanged): FlashMLA's (b, s_q, h_kv, topk) indices, query head h on kv head
                       h // (h_q / h_kv)'s own list over that head's rows
- `mla.decode_fused_fp8`  Modular MAX's mla_decode_branch_fp8: RoPE and RMSNorm of the new cache
                       rows (in place: the cache after the call is an output), FP8 W_UK / W_UV
                       block-scaled matmuls around the decode; with `qrope` (default 0, ids
                       unchanged) q's rope part is rotated in place too, as MAX's fused_qk_rope
                       leaves it, and q after the call is an output (rope.rope's error model,
                       acc_len 2); without it q must stay untouched; `sink_shape` (default head):
                       sinks per query head, or per request (MAX's per-batch sink); `gran` (MAX's
                       m / n / k scale granularity, default 1x128x128), `eps` (default 1e-6) and
                       `mask` (MAX's mask_str: causal, default, or null); `sparse=k` (default 0)
                       MAX's sparse_mla: each new token attends only its top-k slots (d_indices
                       with indices_stride, per-token topk_lengths, -1 padding); with it `extra=1`
                       MAX's second cache: FP8 rows, own indices / lengths / scales, one softmax;
                       `fp8` (MAX's fp8_dtype: e4m3, default, or e5m2) and `scale_dtype` (MAX's
                       fp8_scale_dtype: fp32, default, or bf16), ids unchanged
- `mla.schedule`       FlashMLA's split scheduler (get_mla_metadata), bit-exact int32 rows:
                       conformance/ops/mla_schedule.py, registered here

Inputs follow FlashMLA's own test (tests/test_flash_mla_dense_decoding.py): randn / 10 clamped
to [-1, 1], every cache row past a request's length and every unused page NaN, unused block-table
entries 2147480000 (a kernel that reads them fails structurally or crashes); the older
tests/test_flash_mla.py draws plain randn (`large`) and varlen lengths (`lens=varlen`). Tolerances are the
attention family's (conformance/ops/attention.py): production bf16 O at FlashMLA's cos_diff < 1e-5.
mla.decode also takes the family's extreme logits (attention_inputs.EXTREME: `huge_logits`, `neg_uniform`),
carried by q's and each cache row's last rope dim (575, never a value).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.mla  # noqa: F401  (refimpl.mla below)
import kernel_parity.refimpl.quant  # noqa: F401  (refimpl.quant below)
import kernel_parity.refimpl.mla_fp8  # noqa: F401  (refimpl.mla_fp8 below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import BASELINE_TIER, attention_tolerance
from kernel_parity.conformance.inputs import normal_quantiles, table_words
from kernel_parity.conformance.ops.attention_inputs import EXTREME, extreme_keys, extreme_q, lengths
from kernel_parity.conformance.ops.mla_schedule import SPECS as SCHEDULE_SPECS  # mla.schedule
from kernel_parity.conformance.params import Defaults, Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output, Rows
from kernel_parity.conformance.tolerance import COMPUTE_SUFFIX, Override, Tier

D, DV, PAGE = 576, 512, 64  # FlashMLA: kv_lora_rank 512 + rope 64; values = first 512 dims; pages of 64
TABLE_POISON = 2147480000  # FlashMLA's test fills unused block-table entries with it
SCALES = {"head": D ** -0.5,  # FlashMLA's default and tests: 576^-0.5
          "model": 0.13523377886}  # DeepSeek-V3: 192^-0.5 x mscale^2 (mscale 1.36888794541)
DISTS = {
    "normal": "q, cache ~ N(0, 1) / 10 clamped to [-1, 1] (FlashMLA's test inputs; the cache from 65536 quantiles)",
    "large": "q, cache ~ N(0, 1): logits of std ~ sqrt(576) x scale, a peaked softmax",
    "outlier": "as normal, with 1% of cache entries x 20: one key dominates",
}
HEADS = dict(
    b=Int(1, 256, edges=(1, 2, 128), doc="requests"),
    sq=OneOf(1, 2, doc="new tokens per request (2: multi-token prediction, causal bottom-right)"),
    hq=Int(1, 128, edges=(16, 32, 64, 128), doc="query heads (one latent KV head)"),
)
LENS = OneOf("full", "ragged", doc="requests at the longest length, or ragged (0, 1, ... among them)")
DECODE_LENS = OneOf("full", "ragged", "varlen", "bench",
                    doc="full, ragged, or FlashMLA's: varlen (its test, max(N(kv, kv / 2), s_q)), bench (kv + 2 i)")


def _draw(rng: np.random.Generator, shape: tuple, dist: str, out: np.ndarray | None = None) -> np.ndarray:
    """float64 values of `dist`; into `out` (shape `shape`) when given, with the same values."""
    x = rng.standard_normal(shape) if out is None else rng.standard_normal(out=out)
    if dist == "large":
        return x
    np.divide(x, 10.0, out=x)
    np.clip(x, -1.0, 1.0, out=x)
    if dist == "outlier":
        x[rng.random(shape) < 0.01] *= 20.0
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return x


@functools.lru_cache(maxsize=None)
def _value_table(dist: str, dtype: str) -> np.ndarray:
    """The 65536 N(0, 1) quantiles as `dist` shapes them (normal: / 10, clamped to [-1, 1]), rounded to
    the cache's dtype: the cache's values (conformance/inputs.table_draw)."""
    q = normal_quantiles()
    if dist == "normal":
        q = np.clip(q / 10.0, -1.0, 1.0)
    return dt.round_to(q, dtype)


def paged_latent_cache(rng: np.random.Generator, seqlens: np.ndarray, dist: str, dtype: str,
                       extra_rows: int = 0, hkv: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(kv_cache (num_blocks, 64, hkv, 576), block_table (b, max_blocks) int32): shuffled pages, NaN in
    every slot not holding a live token (the tail of each last page, two spare pages), unused table
    entries TABLE_POISON. A token's hkv latent rows are independent draws (hkv = 1: the draws of before)."""
    b = seqlens.shape[0]
    used = [-(-int(n) // PAGE) for n in seqlens]
    max_blocks = max(1, max(used, default=1))
    n_blocks = sum(used) + 2
    perm = rng.permutation(n_blocks)
    cache = np.empty((n_blocks, PAGE, hkv, D), dtype=dt.get(dtype).np)  # every page written below: 2.4 GB once
    cache[perm[sum(used):]] = np.nan  # the spare pages
    table = np.full((b, max_blocks), TABLE_POISON, dtype=np.int32)
    # one request's values and pages at a time, in buffers reused across requests: at 16K tokens x 128
    # requests the cache is 1.2G values, and fresh per-request arrays were most of its time
    values = np.empty(max_blocks * PAGE * hkv * D)
    rows = np.empty((max_blocks * PAGE, hkv * D), dtype=cache.dtype)
    # the quantile table where its 65536 levels are finer than most of the dtype's (16-bit caches, the
    # models suite's); fp32 caches keep draws of full precision
    quick = _value_table(dist, dtype) if dist in ("normal", "large") and dtype in ("bf16", "fp16") else None
    nxt = 0
    for i in range(b):  # builds the layout (which page holds which tokens), not the math
        n, k = int(seqlens[i]), used[i]
        phys = perm[nxt:nxt + k]
        nxt += k
        table[i, :k] = phys
        if quick is not None:  # the distribution's quantiles, rounded once: indexed by raw random bits,
            for j, page in enumerate(phys):  # straight into each page (the same draws as one call)
                m = min(PAGE, n - j * PAGE)
                np.take(quick, table_words(rng, m * hkv * D), out=cache[page, :m].reshape(-1), mode="clip")
                cache[page, m:] = np.nan
            continue
        x = _draw(rng, (n, hkv * D), dist, out=values[:n * hkv * D].reshape(n, hkv * D))
        with np.errstate(over="ignore"):  # dt.round_to's rounding, into the page buffer
            rows[:n] = x
        rows[n:k * PAGE] = np.nan
        cache[phys] = rows[:k * PAGE].reshape(k, PAGE, hkv, D)
    return cache, table


def _decode_lens(p: dict[str, Any]) -> np.ndarray:
    """(b,) int32 cache lengths, a function of the params. mla.decode's `lens` adds FlashMLA's two:
    varlen (its test: max(normalvariate(kv, kv / 2), s_q) truncated, from a generator seeded by
    (b, kv, s_q)) and bench (its benchmark: kv + 2 i)."""
    if p["lens"] == "varlen":
        x = np.random.default_rng([p["b"], p["kv"], p["sq"]]).normal(p["kv"], p["kv"] / 2, p["b"])
        return np.maximum(x, p["sq"]).astype(np.int32)
    if p["lens"] == "bench":
        return (p["kv"] + 2 * np.arange(p["b"])).astype(np.int32)
    return lengths(p["b"], p["kv"], p["lens"])


def _decode_inputs(p, dtype, dist, rng):
    seqlens = _decode_lens(p)
    if dist in EXTREME:
        return _extreme_inputs(p, dtype, dist, rng, seqlens)
    cache, table = paged_latent_cache(rng, seqlens, dist, dtype, hkv=p.get("hkv", 1))
    q = dt.round_to(_draw(rng, (p["b"], p["sq"], p["hq"], D), dist), dtype)
    return {"q": q, "kv_cache": cache, "block_table": table, "seqlens": seqlens}


def _extreme_inputs(p, dtype, dist, rng, seqlens):
    """The attention family's extreme logits (attention_inputs.EXTREME) on FlashMLA's layout: the cache drawn as
    `normal`, then each live row's last rope dim (575, never a value) is its key level; q is 0 but for dim 575."""
    hkv = p.get("hkv", 1)
    cache, table = paged_latent_cache(rng, seqlens, "normal", dtype, hkv=hkv)
    n = int(seqlens.max(initial=0))
    col = extreme_keys(rng, dist, (p["b"], n, hkv), dtype)  # b, n, h_kv: each request's keys per kv head
    live = np.arange(n)[None, :] < seqlens[:, None]
    req, tok = np.nonzero(live)
    cache[table[req, tok // PAGE], tok % PAGE, :, D - 1] = dt.round_to(col[req, tok], dtype)
    q = extreme_q(rng, dist, (p["b"], p["sq"], p["hq"], D), dtype, SCALES[p["scale"]])
    return {"q": dt.round_to(q, dtype), "kv_cache": cache, "block_table": table, "seqlens": seqlens}


def _decode_ref(x, p, absolute=False):
    o, lse = refimpl.mla.decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], SCALES[p["scale"]],
                                d_v=DV, causal=bool(p["causal"]), absolute=absolute)
    return {"o": o, "lse": lse}


# The error model (OpSpec.magnitude; refimpl/mla.py, `absolute`): O's magnitude sqrt(sum_j P_ij^2 v_j^2),
# the LSE's sqrt(mx^2 + ln(s)^2 + (1 - 1/s)^2), as the attention family's (conformance/ops/attention.py).
# cond on the ci cases (seed 0): decode and decode_sparse O at most 1.55, LSE at most 1.08.
def _decode_mag(x, p):
    return {**_decode_ref(x, p, absolute=True), **_compute(_decode_ref(x, p, absolute=refimpl.mla.COMPUTE))}


def _compute(terms: dict) -> dict:
    """O's compute-precision term (refimpl/mla.py `absolute=COMPUTE`) as the tolerance's `o@fp32`: P's
    sensitivity to the logits' fp32 rounding, ~u32 sigma_j per probability (sigma_j^2 = s_j^2 + d x the RSS
    of the dot's terms squared). The LSE's (sqrt(sum_j P_j^2 sigma_j^2)) is left to its calibrated absolute
    limit (attention's fp32 LSE override), which already holds ~eps32 |logits|."""
    return {"o" + COMPUTE_SUFFIX: terms["o"]}


def _sparse_inputs(p, dtype, dist, rng):
    """Each request's rows list `topk` slots: a random subset of its visible tokens (all of them when
    fewer), -1 for about 1 in 8 entries and past the end, and, past topk_length, slots of NaN rows.
    hkv > 1: FlashMLA's (b, s_q, h_kv, topk) indices, each kv head's own list over its own rows (drawn
    apart); hkv = 1: (b, s_q, topk), the draws of before."""
    b, sq, k, hkv = p["b"], p["sq"], p["topk"], p.get("hkv", 1)
    seqlens = _decode_lens(p)
    cache, table = paged_latent_cache(rng, seqlens, dist, dtype, hkv=hkv)
    nan_slots = np.flatnonzero(np.isnan(cache[:, :, 0, 0].astype(np.float64)).reshape(-1))
    idx = np.full((b, sq, hkv, k), -1, dtype=np.int32)
    for i in range(b):  # per request: which of its tokens each kv head's top-k list names
        L = int(seqlens[i])
        tok = np.arange(L)
        slots = table[i, tok // PAGE].astype(np.int64) * PAGE + tok % PAGE
        for r in range(sq):
            for h in range(hkv):
                pick = rng.permutation(slots)[:k]
                idx[i, r, h, :pick.size] = pick
    idx[rng.random(idx.shape) < 0.125] = -1
    if p["topk_len"] == "ragged":
        topk_length = rng.integers(0, k + 1, b).astype(np.int32)
        past = np.arange(k)[None, None, None, :] >= topk_length[:, None, None, None]
        if nan_slots.size:  # garbage past the length: a kernel that reads it gets NaN
            idx[np.broadcast_to(past, idx.shape)] = rng.choice(nan_slots, int(past.sum() * sq * hkv))
    else:
        topk_length = np.full(b, k, dtype=np.int32)
    q = dt.round_to(_draw(rng, (b, sq, p["hq"], D), dist), dtype)
    return {"q": q, "kv_cache": cache, "indices": idx[:, :, 0] if hkv == 1 else idx, "topk_length": topk_length}


def _sparse_ref(x, p, absolute=False):
    o, lse = refimpl.mla.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], SCALES[p["scale"]],
                                       d_v=DV, absolute=absolute)
    return {"o": o, "lse": lse}


def _sparse_mag(x, p):
    return {**_sparse_ref(x, p, absolute=True), **_compute(_sparse_ref(x, p, absolute=refimpl.mla.COMPUTE))}


def _check(p: dict[str, Any]) -> str | None:
    if p.get("causal") and p["sq"] == 1:
        return "causal=1 needs sq=2 (with one new token the mask is empty; use causal=0)"
    if p["hq"] % p.get("hkv", 1):
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']} (query head h reads kv head h // (hq / hkv))"
    return None


def _shapes(p):
    return {"o": (p["b"], p["sq"], p["hq"], DV), "lse": (p["b"], p["hq"], p["sq"])}


OUT = {
    "o": Output("test", doc="latent attention output (512), before W_UV"),
    "lse": Output("fp32", doc="natural-log LSE of each query row; -inf for a row with no visible key"),
}

def _edge_requests(p: dict[str, Any], x: dict[str, np.ndarray]) -> np.ndarray:
    """Requests always judged when sampled: empty, one token, and lengths at a page edge."""
    n = np.asarray(x["seqlens"])
    return np.flatnonzero((n <= 1) | (n % PAGE <= 1) | (n % PAGE == PAGE - 1))


# each request reads its own pages of the shared cache: its query rows are independent of the others'
REQUESTS = Rows("b", inputs={"q": 0, "block_table": 0, "seqlens": 0}, outputs={"o": 0, "lse": 0},
                always=_edge_requests, size=lambda p: p["b"] * p["sq"] * p["hq"] * p["kv"])

def _decode_flops(p: dict[str, Any]) -> float:
    """FlashMLA's count: 2 s_q h_q (576 + 512) per cached token (`parity bench`)."""
    return 2.0 * p["sq"] * p["hq"] * float(_decode_lens(p).sum()) * (D + DV)


def _sparse_flops(p: dict[str, Any]) -> float:
    return 2.0 * p["b"] * p["sq"] * p["hq"] * p["topk"] * (D + DV)


DECODE = OpSpec(
    name="mla.decode",
    golden=refimpl.mla.decode,
    reference=_decode_ref,
    magnitude=_decode_mag,
    params=Defaults(dict(
        HEADS, kv=Int(0, 1 << 17, edges=(64, 65, 4096, 8192, 16384), doc="longest cached length (varlen: the mean; bench: the first)"),
        lens=DECODE_LENS, causal=OneOf(0, 1, doc="bottom-right causal mask (sq = 2)"),
        scale=OneOf("head", "model", doc="576^-0.5 (FlashMLA's tests) or DeepSeek-V3's 0.1352"),
        hkv=Int(1, 128, edges=(1, 2, 4), doc="latent KV heads (FlashMLA's h_kv; hq % hkv == 0, query head h reads "
                                             "kv head h // (hq / hkv)); 1: DeepSeek's MQA, ids unchanged")),
        {"hkv": 1}),
    make_inputs=_decode_inputs,
    output_shapes=_shapes,
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: int(_decode_lens(p).max()) + D),  # full / ragged: kv + D
    dtypes=("bf16", "fp16", "fp32"),
    dists={**DISTS, **EXTREME},
    check=_check,
    storage_inputs=frozenset({"kv_cache"}),  # refimpl.mla.decode widens the rows it gathers
    rows=REQUESTS,
    flops=_decode_flops,
    doc="FlashMLA dense decode: paged latent cache (64-token pages, 576 dims, V = first 512), one KV head "
        "(hkv > 1: FlashMLA's h_kv latent heads, query head h on kv head h // (hq / hkv)).",
)

DECODE_SPARSE = OpSpec(
    name="mla.decode_sparse",
    golden=refimpl.mla.decode_sparse,
    reference=_sparse_ref,
    magnitude=_sparse_mag,
    params=Defaults(dict(
        HEADS, kv=Int(0, 1 << 17, edges=(64, 2048), doc="longest cached length"), lens=LENS,
        topk=Int(1, 2048, edges=(64, 128, 2048), doc="slots listed per query row"),
        topk_len=OneOf("full", "ragged", doc="per-request top-k lengths: all topk, or random"),
        scale=OneOf("head", "model", doc="576^-0.5 or DeepSeek-V3's 0.1352"),
        hkv=Int(1, 128, edges=(1, 2, 4), doc="latent KV heads (FlashMLA's h_kv; hq % hkv == 0): indices "
                                             "(b, sq, hkv, topk), query head h on kv head h // (hq / hkv)'s list "
                                             "and rows; 1: (b, sq, topk), ids unchanged")),
        {"hkv": 1}),
    make_inputs=_sparse_inputs,
    output_shapes=_shapes,
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: p["topk"] + D),
    dtypes=("bf16", "fp16", "fp32"),
    dists=DISTS,
    backends=("triton", "torch"),
    flops=_sparse_flops,
    check=_check,
    doc="DeepSeek sparse MLA decode: each query row attends to its top-k list of cache slots (-1 skipped); "
        "hkv > 1: FlashMLA's h_kv latent heads, each with its own index lists and rows.",
)

# --------------------------------------------------------------------------- MAX's fused FP8 branch

D_C, D_R, DN, DV_HEAD = 512, 64, 128, 128  # DeepSeek-V3: kv_lora_rank, rope, q_nope and v head dims
FUSED_EPS = 1e-6  # DeepSeek-V3's RMSNorm eps (kv_a_layernorm)
FUSED_SCALE = SCALES["model"]  # 192^-0.5 x mscale^2: the scale MAX's MLA decode runs with
W_SIGMA = 0.02  # kv_b_proj weights ~ N(0, 0.02) (DeepSeek-V3's init std), then e4m3 per 128 x 128 block
ROPE_THETA = 10000.0


def _fused_new(p: dict[str, Any]) -> np.ndarray:
    """(b,) new tokens per request: all 1, all 2, or ragged 1, 2, 0, 1, 2, 0, ... (a function of the params)."""
    if p["new"] == "ragged":
        return np.array([(1, 2, 0)[i % 3] for i in range(p["b"])], dtype=np.int32)
    return np.full(p["b"], p["new"], dtype=np.int32)


def _fused_layout(p: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(cache_lengths, new tokens) per request; cache_lengths ragged as the decode specs' lengths."""
    return _decode_lens(p), _fused_new(p)


def _fp8_heads(rng: np.random.Generator, h: int, n: int, k: int, spread: bool = False, ng: int = 128,
               kg: int = 128, fmt: tuple[str, str] = ("e4m3", "fp32")) -> tuple[np.ndarray, np.ndarray]:
    """(h, n, k) e4m3 weights from N(0, W_SIGMA) by refimpl.quant.fp8_quantize per (ng x kg) block of
    each head (128 x 128: DeepSeek's), and their (h, n / ng, k / kg) float32 scales; spread: each 128 x 128
    block of each head times 10^U(-1, 1) first (`blockscale`). fmt (the `fp8`, `scale_dtype` params) other
    than (e4m3, fp32): the same draws quantized by refimpl.mla_fp8.quantize_weight (e5m2 codes at amax / 57344,
    bf16 scales rounded before the codes are formed; the scales then a bfloat16 array)."""
    def head() -> tuple[np.ndarray, np.ndarray]:
        w = rng.standard_normal((n, k)) * W_SIGMA
        if spread:
            w = w * 10.0 ** np.repeat(np.repeat(rng.uniform(-1.0, 1.0, (n // 128, k // 128)), 128, 0), 128, 1)
        if fmt != ("e4m3", "fp32"):
            return refimpl.mla_fp8.quantize_weight(w, ng, kg, *fmt)
        return refimpl.quant.fp8_quantize(w, ng, kg)

    q, s = zip(*(head() for _ in range(h)))
    return np.stack(q), np.stack(s)


# Distributions of the fused branch beyond DISTS (drawn as `normal`, then changed). A kernel that reads
# a neighbour's value (head h + 1's weight scales or query, the next 128 x 128 block's scale, the next
# row's RMS) is off by far more than the tolerance only if neighbours differ by far more: with
# `normal` every weight block's scale is max|N(0, 0.02)| / 448 within a few percent of the next, the
# softmax is near uniform in every head, and every new row's mean square (~0.01) dwarfs eps = 1e-6.
FUSED_DISTS = {
    **DISTS,
    "blockscale": "as normal, with each head's query scaled by 10^U(0, 2) (heads of different sharpness) and each "
                  "128 x 128 block of W_UK and W_UV by 10^U(-1, 1) before quantization (block scales two decades "
                  "apart, per head)",
    "tinynorm": "as normal, with the latent of each new cache row (the RMSNorm's input) scaled by 10^U(-4, 0): mean "
                "squares from 1e-10 to 1e-2 around eps = 1e-6, so where eps sits shows (the op's eps is a constant; "
                "RMSNorm(c x; eps) = RMSNorm(x; eps / c^2), so a row of tiny norm is the test of a large eps)",
}



# FUSED_GAMMA. The RMSNorm weight is drawn in fp32, not the test dtype, to keep rounding ties out
# of the golden (STYLE 9: ill-conditioned inputs are excluded by the strategy). A request's first
# token sees one key, its own normalised row x gamma / rms, so its o_lat groups are that row times
# one weight; with x and gamma both 16-bit, the ratios x_k gamma_k / (x_m gamma_m) that the
# quantizer rounds (times 448) are ratios of short products and land exactly on e4m3 midpoints:
# 49 of 737,280 codes over 40 seeds of two ci cases with a bf16 gamma, 1 with an fp32 gamma (the
# chance rate). At a midpoint the code is decided by the last fp32 ulp of o_lat, and one moved
# code on such a token moves its whole row of out (bf16 cos_diff 7.3e-6 seen, FlashMLA's limit 1e-5).
def _fused_inputs(p, dtype, dist, rng):
    """The new tokens' cache rows hold the raw latent (drawn like the cached rows); every other
    unused row is NaN, unused table entries poisoned; freqs_cis is DeepSeek's interleaved table."""
    cl, n = _fused_layout(p)
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    base = dist if dist in DISTS else "normal"
    cache, table = paged_latent_cache(rng, cl + n, base, dtype)
    h = p["hq"]
    q = dt.round_to(_draw(rng, (int(off[-1]), h, DN + D_R), base), dtype)
    gamma = dt.round_to(1.0 + 0.1 * rng.standard_normal(D_C), "fp32")  # fp32: see FUSED_GAMMA above
    _, ng, kg = fused_granularity(p)
    fmt = fused_formats(p)
    w_uk, s_uk = _fp8_heads(rng, h, D_C, DN, spread=dist == "blockscale", ng=ng, kg=kg, fmt=fmt)
    w_uv, s_uv = _fp8_heads(rng, h, DV_HEAD, D_C, spread=dist == "blockscale", ng=ng, kg=kg, fmt=fmt)
    if dist == "blockscale":
        q = dt.round_to(q.astype(np.float64) * 10.0 ** rng.uniform(0.0, 2.0, (1, h, 1)), dtype)
    elif dist == "tinynorm":  # the new tokens' rows: request i's tokens at positions cl_i .. cl_i + n_i - 1
        req = np.repeat(np.arange(p["b"]), n)
        pos = cl[req] + np.arange(int(n.sum())) - off[req]
        page, slot = table[req, pos // PAGE], pos % PAGE
        lat = cache[page, slot, 0, :D_C].astype(np.float64) * 10.0 ** rng.uniform(-4.0, 0.0, (pos.size, 1))
        cache[page, slot, 0, :D_C] = dt.round_to(lat, dtype)
    ang = np.arange(int((cl + n).max()) + 1)[:, None] * ROPE_THETA ** (-np.arange(0, D_R, 2) / D_R)
    freqs = dt.round_to(np.stack([np.cos(ang), np.sin(ang)], -1).reshape(ang.shape[0], D_R), "fp32")
    x = {"q": q, "input_row_offsets": off, "freqs_cis": freqs, "gamma": gamma, "w_uk": w_uk, "w_uk_scale": s_uk,
         "w_uv": w_uv, "w_uv_scale": s_uv, "kv_cache": cache, "block_table": table,
         "cache_lengths": cl.astype(np.int32)}
    if p["sink"]:  # one per head, or (sink_shape=batch) one per request, shared by its heads (MAX's)
        per_batch = p.get("sink_shape", "head") == "batch"
        x["attn_sink"] = dt.round_to(rng.standard_normal(p["b"] if per_batch else h) * 2.0, "fp32")
    if p.get("sparse", 0):  # drawn last: the dense cases' draws above are unchanged
        x.update(_fused_sparse_inputs(p, rng, cache, table, cl, n))
    if p.get("extra", 0):  # after the sparse draws: those are unchanged
        x.update(_fused_extra_inputs(p, rng, int(n.sum())))
    return x


EXTRA_PAGES = 3  # the second cache: two pages of rows and a spare page of NaN codes


def _fused_extra_inputs(p, rng, T):
    """extra=1 (MAX's second cache of the sparse mode): extra_k (3, 64, 1, 576) e4m3 codes with extra_scales
    (3, 64, 5) float32 (refimpl.mla.dequantize_latent_rows: one per 128 latent channels and one for the rope
    part, per row). Each row's five groups are drawn as `normal` times 10^U(-1, 1) (scales a decade or two
    apart: a kernel using a neighbour's scale is far off), quantized at amax / 448. extra_d_indices at the main
    list's stride: k random rows of the two live pages, about 1 in 8 -1; extra_topk_lengths ~ U[0, k], the
    second token's 0 (it attends the main list only). Entries past a length and in the stride's extra columns
    name the spare page's NaN rows, and every live row that no used entry names is NaN too."""
    import ml_dtypes

    k, stride = p["sparse"], fused_stride(p)
    n_live = (EXTRA_PAGES - 1) * PAGE
    widths = [128] * (D_C // 128) + [D_R]
    x = np.clip(rng.standard_normal((n_live, D)) / 10.0, -1.0, 1.0)
    x *= np.repeat(10.0 ** rng.uniform(-1.0, 1.0, (n_live, len(widths))), widths, axis=1)
    amax = np.maximum.reduceat(np.abs(x), np.cumsum([0] + widths[:-1]), axis=1)
    scales = np.ones((EXTRA_PAGES * PAGE, len(widths)), dtype=np.float32)
    scales[:n_live] = (amax / 448.0).astype(np.float32)
    codes = np.full((EXTRA_PAGES * PAGE, D), np.nan, dtype=np.float64)
    codes[:n_live] = x / np.repeat(scales[:n_live].astype(np.float64), widths, axis=1)
    idx = np.full((T, stride), -1, dtype=np.int64)
    for t in range(T):  # the layout: which extra rows token t lists
        idx[t, :k] = rng.permutation(n_live)[:k] if k <= n_live else rng.integers(0, n_live, k)
    idx[:, :k][rng.random((T, k)) < 0.125] = -1
    lens = rng.integers(0, k + 1, T)
    lens[1:2] = 0
    used = (idx != -1) & (np.arange(stride)[None, :] < lens[:, None])
    keep = np.zeros(EXTRA_PAGES * PAGE, dtype=bool)
    keep[idx[used]] = True
    codes[~keep] = np.nan  # the spare page and every unselected row
    pad = np.arange(stride)[None, :] >= lens[:, None]
    idx[pad] = rng.integers(n_live, EXTRA_PAGES * PAGE, int(pad.sum()))
    return {"extra_k": codes.astype(ml_dtypes.float8_e4m3fn).reshape(EXTRA_PAGES, PAGE, 1, D),
            "extra_scales": scales.reshape(EXTRA_PAGES, PAGE, len(widths)),
            "extra_d_indices": idx.reshape(-1).astype(np.int32), "extra_topk_lengths": lens.astype(np.int32)}


def fused_stride(p: dict[str, Any]) -> int:
    """MAX's indices_stride of a sparse case: topk + 3, so a kernel stepping rows by topk reads other entries."""
    return p["sparse"] + 3


def _fused_sparse_inputs(p, rng, cache, table, cl, n):
    """sparse=k (MAX's sparse_mla): d_indices (T x (k + 3),) and topk_lengths (T,). Token t at position p of
    request r lists a random subset (random order, far apart) of its request's slots 0..p (its own new row
    and the step's earlier ones among them), about 1 in 8 entries -1; topk_lengths[t] ~ U[0, k], the first
    token's k, the third's 0 (a row that attends nothing: out 0). Entries past topk_lengths[t] and in the
    stride's 3 extra columns name NaN slots (a kernel reading them fails), and every cached row that no used
    entry names and no new token owns is set to NaN: a kernel attending a slot it was not given fails."""
    k, stride = p["sparse"], fused_stride(p)
    T = int(n.sum())
    req = np.repeat(np.arange(p["b"]), n)
    pos = cl[req] + np.arange(T) - np.concatenate([[0], np.cumsum(n)])[req]
    flat = cache.reshape(-1, D)
    idx = np.full((T, stride), -1, dtype=np.int64)
    for t in range(T):  # the layout: which slots token t lists
        tok = np.arange(int(pos[t]) + 1)
        pick = rng.permutation(table[req[t], tok // PAGE].astype(np.int64) * PAGE + tok % PAGE)[:k]
        idx[t, :pick.size] = pick
    idx[:, :k][rng.random((T, k)) < 0.125] = -1
    lens = rng.integers(0, k + 1, T)
    lens[:1] = k
    lens[2:3] = 0
    used = (idx != -1) & (np.arange(stride)[None, :] < lens[:, None])
    new = table[req, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
    live = ~np.isnan(flat[:, 0].astype(np.float64))
    keep = np.zeros(flat.shape[0], dtype=bool)
    keep[idx[used]] = True
    keep[new] = True
    flat[live & ~keep] = np.nan  # unselected cached rows: poison
    nan_slots = np.flatnonzero(np.isnan(flat[:, 0].astype(np.float64)))
    pad = np.arange(stride)[None, :] >= lens[:, None]
    idx[pad] = rng.choice(nan_slots, int(pad.sum()))
    return {"d_indices": idx.reshape(-1).astype(np.int32), "topk_lengths": lens.astype(np.int32)}


def _fused_check(p: dict[str, Any]) -> str | None:
    if p.get("extra", 0) and not p.get("sparse", 0):
        return "extra=1 needs sparse=k > 0 (MAX's second cache is attended through its own top-k list)"
    if p.get("sparse", 0) and not fused_causal(p):
        return f"mask={p['mask']} needs sparse=0 (with sparse=k the indices choose each token's keys, no mask applies)"
    if p.get("sink_shape", "head") != "head" and not p["sink"]:
        return f"sink_shape={p['sink_shape']} needs sink=1 (without a sink there is no sink shape)"
    return None


def fused_granularity(p: dict[str, Any]) -> tuple[int, int, int]:
    """(m, n, k) scale granularity of the `gran` param ("1x128x128", DeepSeek's, by default)."""
    m, n, k = (int(v) for v in p.get("gran", "1x128x128").split("x"))
    return m, n, k


def fused_formats(p: dict[str, Any]) -> tuple[str, str]:
    """(fp8, scale_dtype) of a case: MAX's fp8_dtype and fp8_scale_dtype (e4m3 and fp32, DeepSeek's, by default)."""
    return p.get("fp8", "e4m3"), p.get("scale_dtype", "fp32")


def fused_causal(p: dict[str, Any]) -> bool:
    """MAX's mask_str of the `mask` param: causal (default) or null (every key of the request)."""
    return p.get("mask", "causal") == "causal"


def fused_eps(p: dict[str, Any]) -> float:
    """The RMSNorm epsilon of the `eps` param (DeepSeek-V3's 1e-6 by default)."""
    return float(p.get("eps", "1e-6"))


def fused_sparse_args(x: dict, p: dict[str, Any]) -> dict:
    """decode_fused_fp8's sparse keywords of a case (none when sparse=0): golden and kernels take the same."""
    if not p.get("sparse", 0):
        return {}
    extra = ("extra_k", "extra_scales", "extra_d_indices", "extra_topk_lengths") if p.get("extra", 0) else ()
    return {"d_indices": x["d_indices"], "indices_stride": fused_stride(p), "topk": p["sparse"],
            "topk_lengths": x["topk_lengths"], **{k: x[k] for k in extra}}


def _fused_ref(x, p, absolute=False):
    got = refimpl.mla.decode_fused_fp8(
        x["q"], x["input_row_offsets"], x["freqs_cis"], x["gamma"], fused_eps(p), x["w_uk"], x["w_uk_scale"],
        x["w_uv"], x["w_uv_scale"], x["kv_cache"], x["block_table"], x["cache_lengths"], FUSED_SCALE,
        attn_sink=x.get("attn_sink"), absolute=absolute, q_inplace=bool(p.get("qrope", 0)),
        sink_per=p.get("sink_shape", "head"), granularity=fused_granularity(p), causal=fused_causal(p),
        **fused_sparse_args(x, p), **dict(zip(("fp8", "scale_dtype"), fused_formats(p))))
    return dict(zip(("out", "kv_cache", "q"), got))


def _fused_mag(x, p):
    """out's magnitude: the FP8 projection's 512 terms in squared form (refimpl/mla.py; cond 1.46-1.58 on the ci
    cases, sums of random-sign products); the cache after the call is judged against |golden| as before (left
    out: its new rows are products and RoPE's two-term rotations). With qrope, q's rotated part has rope.rope's
    model (each output's two products in squared form; the nope part |q|, an exact copy)."""
    mag = _fused_ref(x, p, absolute=True)
    del mag["kv_cache"]
    return mag


def _fused_shapes(p):
    cl, n = _fused_layout(p)
    blocks = sum(-(-int(L) // PAGE) for L in cl + n) + 2  # paged_latent_cache's pages plus its two spares
    out = {"out": (int(n.sum()), p["hq"], DV_HEAD), "kv_cache": (blocks, PAGE, 1, D)}
    if p.get("qrope", 0):
        out["q"] = (int(n.sum()), p["hq"], DN + D_R)
    return out


def _fused_acc(p, output):
    if output == "kv_cache":
        return D_C  # the RMSNorm's sum of squares
    if output == "q":
        return 2  # rope.rope's: a rotated element sums two products (judged by its error model, _fused_mag)
    keys = p.get("sparse", 0) * (1 + p.get("extra", 0)) or p["kv"] + 2  # sparse: its top-k keys (x 2: extra)
    return D_C + keys + D  # the 512-term FP8 matmul after a softmax over the keys of 576-dim dots


# `out` is judged like an attention output: its elements sum 512 products with cancellation
# (absolute error against max|out|), and bf16 as FlashMLA's test holds O. The Triton kernel keeps
# the intermediates in fp32 (the RMSNorm in fp64), so its activation codes are the golden's but at
# chance ties: over 40 fresh seeds of each ci case, out cos_diff up to 2.1e-6 (bf16, the final
# rounding) and 1.2e-7 (fp16), elementwise within 0.19 (bf16) and 0.93 (fp16) eps x max|out|. The error
# model (_fused_mag) judges the 512-term cancellation element by element now, but the max|out| floor stays:
# a code moved at a tie moves its whole (token, head) row by ~1% of its magnitude, which no rounding-sized
# bound holds; without it an 8-seed ci sweep failed 3 of 168 Triton runs (fp16, up to 70 of 3,072 elements).
_FUSED_OUT = (
    Override("out sums 512 weighted products with cancellation: absolute error relative to max|out|",
             output="out", atol_max_eps=4.0),
    Override("FlashMLA's own test holds bf16 attention outputs to cos_diff < 1e-5", output="out", dtype="bf16",
             cos_diff=1e-5, nmse=2e-5),
)
# The eager baseline (kernels/torch/mla.py) rounds gamma, q_lat, the new cache rows, the logits, the
# probabilities and o_lat to the test dtype; the rounded o_lat moves its e4m3 codes off the golden's
# (2.2% of them on the ci cases, each by one step, 1/16 to 1/8 of that element), and each moved code
# shows in all 128 outputs of its (token, head). Measured over 100 fresh seeds of each ci case: out
# cos_diff up to 4.1e-4 (bf16) and 1.45e-4 (fp16), elementwise up to 4.0 (bf16) and 19.2 (fp16)
# eps x max|out| beyond rtol. The limits leave ~3x. Its cache rows (F.rms_norm in the dtype:
# cos_diff up to 3.7e-6 bf16, 6.0e-8 fp16) stay inside production's limits.
FUSED_BASELINE = Tier(
    "eager fused FP8 MLA rounds q_lat, the cache rows, logits, probabilities and o_lat to the test dtype, "
    "moving 2% of the FP8 activation codes: out cos_diff up to 4.1e-4 (bf16) and 1.45e-4 (fp16), 4.0 / 19.2 "
    "eps x max|out| elementwise, over 100 fresh seeds of each ci case",
    overrides=BASELINE_TIER.overrides + (
        Override("eager bf16 fused FP8 MLA reaches out cos_diff 4.1e-4 and 4.0 eps x max|out| (measured)",
                 output="out", dtype="bf16", cos_diff=1.2e-3, nmse=2.4e-3, atol_max_eps=12.0),
        Override("eager fp16 fused FP8 MLA reaches out cos_diff 1.45e-4 and 19.2 eps x max|out| (measured)",
                 output="out", dtype="fp16", cos_diff=4.5e-4, nmse=9e-4, atol_max_eps=60.0),
    ),
)

def _fused_flops(p: dict[str, Any]) -> float:
    """The attention (each new token over its request's keys, FlashMLA's count) and the two FP8 bmms."""
    cl, n = _fused_layout(p)
    keys = float(n.sum()) * p["sparse"] if p.get("sparse", 0) else float(((cl + n) * n).sum())
    return (2.0 * p["hq"] * keys * (D + DV)
            + 2.0 * int(n.sum()) * p["hq"] * (DN * D_C + D_C * DV_HEAD))


DECODE_FUSED_FP8 = OpSpec(
    name="mla.decode_fused_fp8",
    golden=refimpl.mla.decode_fused_fp8,
    reference=_fused_ref,
    magnitude=_fused_mag,
    params=Defaults(dict(
        b=Int(1, 256, edges=(1, 3, 128), doc="requests"),
        new=OneOf(1, 2, "ragged", doc="new tokens per request: 1, 2 (MTP), or ragged 1, 2, 0, ..."),
        hq=Int(1, 128, edges=(16, 128), doc="query heads (one latent KV head)"),
        kv=Int(0, 1 << 17, edges=(63, 64, 65), doc="longest cached length before the step"),
        lens=LENS,
        sink=OneOf(0, 1, doc="one sink logit per query head (or per request: sink_shape)"),
        sink_shape=OneOf("head", "batch", doc="sink=1: one sink per query head, or per request (MAX's per-batch "
                                              "attention sink, shared by the request's heads and tokens)"),
        qrope=OneOf(0, 1, doc="1: q's rope part rotated in place at its token's position (MAX's fused_qk_rope) and "
                              "judged as output q; 0: q must stay untouched"),
        gran=OneOf("1x128x128", "1x64x64", "2x128x64",
                   doc="MAX's (m, n, k) scale granularity: activation groups of m tokens x k channels, weight blocks "
                       "n x k (1x128x128: DeepSeek's checkpoints)"),
        eps=OneOf("1e-6", "1e-2", doc="the RMSNorm epsilon (1e-6: DeepSeek-V3's; 1e-2 is about a row's mean square)"),
        mask=OneOf("causal", "null", doc="MAX's mask_str: causal (key j <= the token's position) or null (every key "
                                         "of the request, this step's later tokens included)"),
        sparse=Int(0, 2048, edges=(0, 1, 16), doc="MAX's sparse_mla: k > 0 gives each new token a top-k list of "
                                                  "cache slots (d_indices, indices_stride k + 3, topk_lengths per "
                                                  "token, -1 padding) and attends only those; 0: dense"),
        extra=OneOf(0, 1, doc="sparse only: MAX's second cache (extra_k, e4m3 rows with per-row scales, its own "
                              "top-k list and lengths), attended jointly with the main list (one softmax)"),
        fp8=OneOf("e4m3", "e5m2", doc="MAX's fp8_dtype: the codes of W_UK, W_UV and both quantized activations "
                                      "(e4m3fn: DeepSeek's; e5m2, max 57344: the generalisation)"),
        scale_dtype=OneOf("fp32", "bf16", doc="MAX's fp8_scale_dtype: the weights' stored block scales and the "
                                              "activations' dynamic scales (bf16: amax and the scale rounded to "
                                              "bf16, the codes formed with the rounded scale)"),
    ), {"qrope": 0, "sink_shape": "head", "gran": "1x128x128", "eps": "1e-6", "mask": "causal", "sparse": 0,
        "extra": 0, "fp8": "e4m3", "scale_dtype": "fp32"}),
    make_inputs=_fused_inputs,
    check=_fused_check,
    output_shapes=_fused_shapes,
    outputs={
        "out": Output("test", doc="out = o_lat W_UV (T, h_q, 128), through MAX's FP8 activation quantization"),
        "kv_cache": Output("test", inplace="kv_cache",
                           doc="the cache after the call: the new tokens' rows RMS-normalised and roped"),
        "q": Output("test", inplace=lambda p: "q" if p.get("qrope", 0) else None,
                    doc="qrope=1 only: q after the call, its rope part rotated at its token's position, the nope "
                        "part untouched"),
    },
    tolerance=replace(attention_tolerance(_fused_acc, *_FUSED_OUT), baseline=FUSED_BASELINE),
    flops=_fused_flops,
    dtypes=("bf16", "fp16"),
    dists=FUSED_DISTS,
    backends=("triton", "torch"),
    doc="MAX's mla_decode_branch_fp8: RoPE + RMSNorm of the new cache rows in place, FP8 W_UK / W_UV "
        "block-scaled batched matmuls around the dense MLA decode; qrope=1: q's rope part rotated in place too.",
)

SPECS = (DECODE, DECODE_SPARSE, DECODE_FUSED_FP8, *SCHEDULE_SPECS)
