"""`moe.experts` (issue 34): the fused mixture-of-experts layer over routed tokens, as vLLM's fused_moe computes it.

    out[t] = sum_j weights[t, j] W2[e] rnd(silu(G_e x_t) * (U_e x_t))  +  sum_s Ws2[s] rnd(silu(Gs x_t) * (Us x_t))

e = ids[t, j]; w13 (E, 2F, D) holds the gate rows [0, F) then the up rows [F, 2F) (vLLM's w13: silu_and_mul takes
the first half as the gate); w2 (E, D, F); `shared` S experts ws13 (S, 2F, D), ws2 (S, D, F) of weight 1 on every
token (DeepSeek-V3's shared expert). rnd: act rounded to the test dtype before the down projection, the one
production cast the golden applies (refimpl/moe_experts.py lists those it does not).

Inputs (every dist): x ~ N(0, 1) in the test dtype; expert e's w13 ~ N(0, 1 / D) sqrt(s_e) and w2 ~ N(0, 1 / F)
s_e with s_e = 10^((e mod 3) - 1): neighbouring experts' outputs differ 10-100x, so a slot sent to its neighbour
expert, a neighbour's weights or a neighbour's scale fails far beyond any limit; the shared experts at s 1.
Routing weights fp32 uniform in [0.05, 1], divided by their sum on half the tokens (the other half sum to
anything: unnormalised routing, DeepSeek-V3's routed scaling). ids (T, k) int32, distinct per token.
The golden takes x and the weights in their storage dtype (`storage_inputs`): it learns the activation dtype
from x and widens one expert's weights at a time (a model-size layer is never a float64 copy).

Tolerance (production): the dtype's defaults on the error model's magnitude M (refimpl/moe_experts.py
`absolute`: gate / up -> act -> the down projection, weighted by the routing weights), rtol + eps32
sqrt(D + F + k + S) for the fp32 sums (acc_len). What a correct fused kernel differs by: fp32 accumulation
(the acc term), the output's one rounding (u |out|), and act's code flips (a kernel's fp32 act rounds to the
other neighbour of the test dtype where its fp32 error crosses a midpoint: one ulp of act_f, <= 2 u |w W2[d, f]
act_f| on one term, <= 2 u M since M is at least the RSS of the down projection's terms; bf16's rtol 1.6e-2 is
4.1 u, fp16's 1e-3 is 2.05 u; a flip needs the fp32 error ~eps32 sqrt(D) |g| to reach a midpoint, so a few flips
a case at most). The eager baseline's tier: EAGER below.

wfmt=int4 (GPTQ v1 w4a16, group 128 along D for w13 and F for w2, fp16 scales; every routed and shared expert,
drawn as the dense ones and quantized by refimpl.quant_fp.int4_quantize): the golden takes the exact dequantized
values (s (q - z), exact in float32), and so do the production kernels (C: s (q - z) in fp32; Triton: the codes
q - z, exact in any dtype, are the dot's operand and the group's scale multiplies the tile's fp32 partial
product), so the limits are the dense ones. The eager baseline dequantizes into the model dtype (rounded), within
its tier. Measured worst norm_err (ci, 3 fresh seeds a case, 378 runs): triton 0.63, cpu 0.48, torch (baseline
tier) 0.66; H200: ci 84 pass (triton, torch), Mixtral-8x7B t 64 dense / int4 and Qwen3-30B-A3B t 512 pass
(triton 0.25-0.33; torch 0.66-0.94 of the tier before it was set to 12 u, see EAGER).
wfmt=fp8w (DeepSeek-V3's block FP8 as w8a16, vLLM's FP8 Marlin MoE path: e4m3fn codes and one fp32 scale per
128 x 128 block, every routed and shared expert; inputs <w>_codes (E, N, K), <w>_bscales (E, ceil(N/128),
ceil(K/128))): drawn as the dense ones, each weight's blocks multiplied by 10^(((rb + 2 cb) mod 3) - 2)
(`block_factor`) before refimpl.quant_fp.fp8_quantize_blocks, so the neighbouring block's scale along rows or along
columns (or the transposed block's) is 10-100x off. The golden takes the exact dequantized weights (code x block
scale in float64, refimpl.moe_experts.BlockFP8, one expert at a time); Triton uses them exactly (the codes, exact in
bf16 / fp16 / fp32, as the dot's operand, the block scale on the tile's fp32 partial product), C within one fp32
rounding a weight (code x scale in fp32, a product's rounding as any fp32 product has), so the limits are the dense
ones. The eager baseline dequantizes into the model dtype (rounded), within its tier.

wfmt=q8_0 / q4_0 / q4_k / q6_k (GGML expert weights, llama.cpp's MoE GGUFs through ggml_mul_mat_id over
expert-stacked quantized tensors; Mixtral / Qwen3 Q4_K_M GGUFs store the experts as q4_k, some as q6_k or q8_0):
every routed and shared weight drawn as the dense ones (the test dtype's values), times `ggml_factor` (column block b
of row r scaled 10^(((b + 2 r) mod 3) - 1), the K-quants' sub-blocks 10^0.5 apart more, one constant dividing them
all), each expert's rows quantized by refimpl.quant.quantize (ggml's byte-exact reference quantizer): input
<w>_ggml (E, N, K / QK * nbytes) uint8, d and f whole blocks. A neighbouring block's scale (along the row, or the
same block of the neighbouring row) is 10-100x off, a K-quant's neighbouring sub-block scale ~3x, the neighbouring
expert's 3-10x. Activation semantics, declared: w-only (the dequantize-then-float path): x and act stay in the
test dtype, act rounded to it as for dense weights; the golden dequantizes each expert exactly (float64,
refimpl.moe_experts.GGMLWeight). ggml's CPU vec_dot path (x and act quantized to q8_0 / q8_K) and its CUDA MMQ
path (q8_1) are other semantics, not this spec's: x's quantization alone (q8_0 / q8_K by refimpl.quant, act left
as is) moves out by nmse 5-11e-5 (measured, t 16, d 512, f 256: relative RMS ~2^-7), past fp32's limit (2e-12) by
10^7 and bf16's (4e-5) by 1.3-3x, 2x bf16's elementwise limit; no kernel here claims them (a `wfmt` or reference of
its own with a bit-exact q8 golden of x and act, as gemm.gemm_nt's `emulated` reference, is the way to add them).
The production kernels use the weights within one fp32 rounding of the exact value (C: gemm_bwd.h's lb_row_f32,
ggml's dequantize_row_*; Triton: kernels/triton/gemm.py's decoders in the fused kernel's K loop, fp32 "ieee" dots
of x or act widened to fp32, never a 16-bit weight: q8_0 / q4_0 / q6_k values are exact in fp32, q4_k's d sc q -
dmin m rounds once, 2^-24 relative, far below the fp32 accumulation's eps32 sqrt(D)), so the limits are the dense
ones, no new term. The eager baseline dequantizes into the model dtype (rounded; kernels/torch/quant.py), as the
int4 path: within its tier (EAGER). Measured worst norm_err (CPU, the ci entries of new_moeggml_ci.toml, a
fresh-seed sweep of 5 seeds, 255 runs, no failure, no flaky verdict): triton 0.68, cpu 0.71 (both fp16 q4_0; fp16's
rtol is 2.05 u, the dense fp16 cases reach 0.63 / 0.48), torch (baseline tier) 0.47; at seed 0: triton 0.26 (bf16)
/ 0.12 (fp32), cpu 0.23 / 0.39 (fp32 q4_k: the sequential fp32 sum over D 512). Seeded bugs:
conformance/mutants/moeggml.toml (neighbouring expert, row, block scale, K-quant sub-block scale, q4_0 nibble
order, the code offset, the K-quant min, the last group), every one killed by the ci entries.

wfmt=fp8 (w8a8, DeepSeek-V3 / vLLM's use_fp8_w8a8 with block_shape [128, 128]): the same weights; x and act
quantized per token per 128 columns before each GEMM (refimpl/moe_experts.py; x's 128-column groups scaled
10^((c mod 3) - 1), `group_factor`: a neighbouring group's scale is 10-100x off). x's codes and scales are bit-exact
functions of x (the IEEE division), the same in every correct kernel: no term. act is not: the golden rounds its
float64 act once to the test dtype and quantizes that; a kernel's fp32 act lies within r = 2 eps32 (sqrt(L) M_act +
|act|) of the float64 one (L = 1 + 2D, M_act the error model's act magnitude; measured: a sequential fp32 sum, the
worst order, reaches 1.05 eps32 sqrt(L) M_act at most over 16k elements at D 256 / 1024 / 7168, 0.09 on average, so r
is ~2x the worst seen), and from there it may round to the test dtype's other neighbour, then to a neighbouring
e4m3 code, and its group's amax (so the group's scale) may move. The derived bound (refimpl.moe_experts
`act_flip_bound`, exact given r): the codes c' in [c_lo, c_hi] and scales s' in [s_lo, s_hi] reachable from [act -
r, act + r] (rounding, amax, the float32 division and the e4m3 rounding are all monotone); c' s' - c s = (c' - c) s'
+ c (s' - s). The first is max(c_hi - c, c - c_lo) s_hi at most: one e4m3 code step of a flipped element at this r
(2^-3 |c| for normal codes, 2^-9 for subnormal ones; 0 where the interval holds no midpoint), summed in |W2| (every
flip of one sign, the worst case): Q_steps. The second moves the whole group coherently: |s' / s - 1| |sum over
the group of W2[d, f] act_q[f]|, summed over the groups: Q_scale. Both weighted by |w_j| over the slots, plus the
shared experts. They join the magnitude linearly: m = M + (c Q_steps + Q_scale) / rtol, rtol the case's
production rtol (acc term included), so the elementwise limit rtol m gains exactly c Q_steps + Q_scale.
c = max(1, rtol sqrt(COND_RANDOM / min(nmse, 2 cos_diff))) (`flip_multiple`): a flip at its bound puts Q^2 on one
element; the aggregate limits scale with cond = sum m^2 / sum b^2, which that element raises by (c Q / rtol)^2 /
sum b^2, so they hold it when c^2 >= COND_RANDOM rtol^2 / nmse: c = 1 (fp16), 3.6 (bf16), 3.6-4.0 (fp32) at the ci
shapes. Q_scale is spread over whole groups (c = 1).
How wide: bf16 / fp16 carry Q_steps only where an act element sits within r of a test-dtype midpoint whose
neighbour is another e4m3 code (one step of one term, though it reaches the token's whole output row), and Q_scale
only where a group's largest element does; fp32's amax moves within r in every group, so Q_scale is everywhere
there. Measured at t 7, d f 256, e 4, k 2, one shared (3 seeds): m / M median 1.00 (bf16, fp16) and
1.9-2.5 (fp32), largest 2.6 (bf16), 4.6 (fp16), 3200 (fp32: the element beside a possible flip, 2^-3 of a term
against fp32's rtol). Every seeded bug of the catalogue (conformance/mutants/moefp8.toml) fails: act left unquantized
(e4m3's ~2^-5 |act| RMS noise on every term), x left unquantized, a neighbouring group's scale, the IEEE division
replaced by a reciprocal multiply (x's codes change where x / s is an e4m3 tie or within an ulp of one: 0.8e-3
of bf16 x elements, 1e-4 of fp16 ones, none of fp32's in 20 seeds at d 256; no allowance covers x, so the bf16
cases kill it), and the weights' block-scale bugs (the bf16 / fp16 cases alone kill the act, x and group bugs too).
The eager baseline (vLLM's test reference, torch_w8a8_block_fp8_moe, with gate / up kept fp32:
kernels/torch/moe_experts.py) within its tier (EAGER): its output-side roundings are the dense loop's.
tests/test_moe_experts_golden.py checks the bound itself: with r widened 10^4x (codes flip and group scales move
across most of the output), every act drawn within r, rounded and quantized as a kernel does, stays within it.
Measured worst norm_err (CPU, fresh seeds): the ci entries, 8 seeds, 288 runs: fp8w triton / cpu 0.453 (fp16),
0.238 (bf16), 0.105 / 0.120 (fp32), torch (baseline tier) 0.441; fp8 triton / cpu 0.395 (fp16), 0.234 (bf16), 0.018 /
0.068 (fp32), torch 0.245. At t 7, d f 256, e 4, k 2 (8 seeds, 384 runs; cpu 20 more, 320 runs): at most 0.496
(fp8w fp16), fp8 0.466 (fp16), 0.272 (bf16), 0.166 (fp32). No failure, no flaky verdict.
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.moe_experts  # noqa: F401  (refimpl.moe_experts.experts below)
from kernel_parity.refimpl.moe_experts import FP8_BLOCK, GGML_FMTS, BlockFP8, GGMLWeight
from kernel_parity.refimpl.quant import FORMATS as GGML_FORMATS, quantize as ggml_quantize
from kernel_parity.refimpl.quant_fp import fp8_quantize_blocks, int4_dequantize, int4_quantize
from kernel_parity.refimpl.threads import on_threads
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import COND_RANDOM, Override, Tier, Tol

DISTS = {
    "normal": "ids uniform: each token k distinct experts drawn uniformly",
    "last": "every token routed to the last expert E - 1 (its other k - 1 experts uniform)",
    "skew": "ids drawn from the first max(k, E // 3) experts only: the others get no token",
}


def expert_scale(e: np.ndarray | int) -> np.ndarray:
    """s_e = 10^((e mod 3) - 1): neighbouring experts 10-100x apart."""
    return 10.0 ** ((np.asarray(e) % 3) - 1.0)


def _ids(p: dict[str, Any], dist: str, rng: np.random.Generator) -> np.ndarray:
    t, e, k = p["t"], p["e"], p["k"]
    if dist == "normal":
        pool = e
    elif dist == "skew":
        pool = max(k, e // 3)
    elif dist == "last":
        rest = np.argsort(rng.random((t, e - 1)), axis=-1)[:, :k - 1]  # distinct experts of [0, E - 1)
        ids = np.concatenate([np.full((t, 1), e - 1), rest], axis=-1)
        return np.take_along_axis(ids, np.argsort(rng.random((t, k)), axis=-1), axis=-1).astype(np.int32)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return np.argsort(rng.random((t, pool)), axis=-1)[:, :k].astype(np.int32)


def _weights(shape: tuple[int, ...], scale: float, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """N(0, scale^2) weights of `shape` (lead, rows, cols) in the storage dtype, one leading index at a time
    (fp32 draws: a model-size layer never passes through float64 as a whole)."""
    out = np.empty(shape, dtype=dt.get(dtype).np)
    for i in range(shape[0]):
        out[i] = dt.round_to(rng.standard_normal(shape[1:], dtype=np.float32).astype(np.float64) * scale, dtype)
    return out


# Routed weight elements from which a layer's experts are drawn each from its own stream, on threads: a model-size
# layer (Qwen3-30B-A3B's 604 M, DeepSeek-V3's 11.3 G) is minutes of one core otherwise (DeepSeek-V3: 215 s on the
# H200's host). Every ci case is far below it and draws from the case's generator, in expert order.
SPAWN_MIN = 1 << 27


def on_experts(draw: Callable[[int, np.random.Generator], None], rng: np.random.Generator, e: int,
               elements: int) -> None:
    """draw(i, r) for each expert i < e: below SPAWN_MIN elements with r = rng in expert order; from it, with r the
    i-th of rng.spawn(e) (independent child streams) on refimpl.threads.on_threads: the values depend on the seed
    only, never on the thread count."""
    if elements < SPAWN_MIN:
        for i in range(e):
            draw(i, rng)
        return
    kids = rng.spawn(e)
    on_threads(lambda i: draw(i, kids[i]), range(e))


GROUP = 128  # the int4 group along D (w13) and F (w2)
INT4_PARTS = ("qweight", "qzeros", "scales")
WEIGHTS = ("w13", "w2", "ws13", "ws2")


def _int4(w: np.ndarray) -> dict[str, np.ndarray]:
    """(E, N, K) weights -> GPTQ v1 int4 per expert, stacked: qweight (E, K/8, N), qzeros (E, K/g, N/8), scales
    (E, K/g, N) fp16 (refimpl.quant_fp.int4_quantize, group 128)."""
    parts = [int4_quantize(w[i].astype(np.float64), group=GROUP, order="gptq") for i in range(w.shape[0])]
    return {n: np.stack([q[n] for q in parts]) for n in INT4_PARTS}


def int4_weight(x: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray] | None:
    """The int4 dict of weight `name` among a case's inputs (`<name>_qweight`, ...), None if absent."""
    if f"{name}_qweight" not in x:
        return None
    return {n: x[f"{name}_{n}"] for n in INT4_PARTS}


FP8_PARTS = ("codes", "bscales")  # inputs <name>_codes (E, N, K) float8_e4m3fn, <name>_bscales fp32 block scales
FP8_FMTS = ("fp8w", "fp8")


def block_factor(n: int, k: int) -> np.ndarray:
    """(ceil(n / 128), ceil(k / 128)) factors 10^(((rb + 2 cb) mod 3) - 2) of a block-FP8 weight's blocks: the
    neighbour block along rows (rb + 1) and along columns (cb + 1) are 10-100x off, and so is the transposed block
    (rb + 2 cb differs from cb + 2 rb unless rb = cb mod 3)."""
    rb = np.arange(-(-n // FP8_BLOCK))[:, None]
    cb = np.arange(-(-k // FP8_BLOCK))[None, :]
    return 10.0 ** (((rb + 2 * cb) % 3) - 2.0)


def group_factor(d: int) -> np.ndarray:
    """(d,) factors 10^((c mod 3) - 1) of x's 128-column groups under wfmt=fp8 (w8a8): neighbouring groups' scales
    10-100x apart."""
    return 10.0 ** ((np.arange(d) // FP8_BLOCK % 3) - 1.0)


def _fp8_empty(e: int, n: int, k: int) -> dict[str, np.ndarray]:
    return {"codes": np.empty((e, n, k), dtype=ml_dtypes.float8_e4m3fn),
            "bscales": np.empty((e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), dtype=np.float32)}


def _fp8_put(dst: dict[str, np.ndarray], i: int, w: np.ndarray) -> None:
    """Expert i's (N, K) weights, times their block factors, block-FP8 quantized into dst
    (refimpl.quant_fp.fp8_quantize_blocks, 128 x 128, DeepSeek-V3's amax floor 1e-4)."""
    n, k = w.shape
    fac = np.repeat(np.repeat(block_factor(n, k), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:n, :k]
    dst["codes"][i], dst["bscales"][i] = fp8_quantize_blocks(w.astype(np.float32) * fac.astype(np.float32),
                                                             FP8_BLOCK, FP8_BLOCK)


def _fp8(w: np.ndarray) -> dict[str, np.ndarray]:
    """(E, N, K) weights -> block FP8 per expert (`_fp8_put`): codes (E, N, K) float8_e4m3fn, bscales (E, N/128,
    K/128) fp32."""
    out = _fp8_empty(*w.shape)
    for i in range(w.shape[0]):
        _fp8_put(out, i, w[i])
    return out


def fp8_weight(x: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray] | None:
    """The block-FP8 parts of weight `name` among a case's inputs as the kernels take them: {"codes": (E, N, K)
    float8_e4m3fn, "scales": (E, ceil(N/128), ceil(K/128)) float32}, None if absent."""
    if f"{name}_codes" not in x:
        return None
    return {"codes": x[f"{name}_codes"], "scales": x[f"{name}_bscales"]}


def ggml_factor(n: int, k: int, fmt: str) -> np.ndarray:
    """(n, k) float32 factors of a GGML weight's rows before quantization: 10^(((b + 2 r) mod 3) - 1) for column
    block b (the format's block: 32, or 256 for the K-quants) of row r, so the neighbouring block along the row and
    the same block of the neighbouring row are 10-100x off (their scales d too); the K-quants' sub-blocks (q4_k:
    32 elements, q6_k: 16) times 10^(-(j mod 2) / 2) more, so the neighbouring sub-block's 6-bit (q4_k) or 8-bit
    (q6_k) scale is ~3x off. All divided by the factors' RMS over the matrix (one constant: the neighbours' ratios
    stay exact): the layer's outputs keep the dense ones' scale (fp16 never overflows)."""
    f = GGML_FORMATS[fmt]
    cols = np.arange(k)
    e = ((cols[None, :] // f.block + 2 * np.arange(n)[:, None]) % 3) - 1.0
    if f.block == 256:
        sub = 32 if fmt == "q4_k" else 16
        e = e - 0.5 * ((cols // sub) % 2)[None, :]
    fac = 10.0 ** e
    return (fac / np.sqrt(np.mean(fac * fac))).astype(np.float32)


def _ggml(w: np.ndarray, fmt: str) -> np.ndarray:
    """(E, N, K) weights (the test dtype's values) times `ggml_factor`, each expert's rows GGML-quantized by the
    byte-exact reference quantizer (refimpl.quant.quantize): (E, N, K / QK * nbytes) uint8."""
    e, n, k = w.shape
    fac = ggml_factor(n, k, fmt)
    return np.stack([ggml_quantize(fmt, w[i].astype(np.float32) * fac) for i in range(e)])


def ggml_weight(x: dict[str, np.ndarray], name: str, fmt: str | None) -> dict[str, Any] | None:
    """The GGML weight `name` among a case's inputs (`<name>_ggml`, its blocks) as the kernels take it: {"fmt":
    the case's wfmt, "blocks": (E, N, K / QK * nbytes) uint8}, None if absent."""
    if f"{name}_ggml" not in x:
        return None
    if fmt not in GGML_FMTS:
        raise ValueError(f"moe.experts: input {name}_ggml needs a GGML wfmt ({', '.join(GGML_FMTS)}), got {fmt!r}")
    return {"fmt": fmt, "blocks": x[f"{name}_ggml"]}


def dense_weight(x: dict[str, np.ndarray], name: str, fmt: str | None = None) -> np.ndarray | None:
    """Weight `name` as the golden takes it: stored (dense), each expert's int4 dequantized exactly (float32
    holds s (q - z): 11 + 5 bits), block FP8 as a refimpl.moe_experts.BlockFP8 (each expert dequantized
    exactly in float64 when the golden reads it), or GGML blocks (fmt: the case's wfmt) as a
    refimpl.moe_experts.GGMLWeight (likewise)."""
    gg = ggml_weight(x, name, fmt)
    if gg is not None:
        return GGMLWeight(gg["fmt"], gg["blocks"])
    f8 = fp8_weight(x, name)
    if f8 is not None:
        return BlockFP8(f8["codes"], f8["scales"])
    q = int4_weight(x, name)
    if q is None:
        return x.get(name)
    return np.stack([int4_dequantize({n: q[n][i] for n in INT4_PARTS}).astype(np.float32)
                     for i in range(q["qweight"].shape[0])])


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t, d, f, e, k, s = p["t"], p["d"], p["f"], p["e"], p["k"], p["shared"]
    x = rng.standard_normal((t, d))
    if p["wfmt"] == "fp8":
        x = x * group_factor(d)
    x = dt.round_to(x, dtype)
    ids = _ids(p, dist, rng)
    w = rng.uniform(0.05, 1.0, (t, k))
    norm = rng.random(t) < 0.5
    w[norm] /= w[norm].sum(axis=-1, keepdims=True)
    fp8 = p["wfmt"] in FP8_FMTS  # each expert quantized as drawn: a model-size layer never exists in 16 bits
    w13 = _fp8_empty(e, 2 * f, d) if fp8 else np.empty((e, 2 * f, d), dtype=dt.get(dtype).np)
    w2 = _fp8_empty(e, d, f) if fp8 else np.empty((e, d, f), dtype=dt.get(dtype).np)

    def draw(i: int, r: np.random.Generator) -> None:
        sc = float(expert_scale(i))
        a = _weights((1, 2 * f, d), np.sqrt(sc) / np.sqrt(d), dtype, r)[0]
        b = _weights((1, d, f), sc / np.sqrt(f), dtype, r)[0]
        if fp8:
            _fp8_put(w13, i, a)
            _fp8_put(w2, i, b)
        else:
            w13[i], w2[i] = a, b

    on_experts(draw, rng, e, e * 3 * f * d)
    out = {"x": x, "ids": ids, "weights": w.astype(np.float32)}
    if fp8:
        out.update({f"{name}_{part}": v for name, q in (("w13", w13), ("w2", w2)) for part, v in q.items()})
    else:
        out.update(w13=w13, w2=w2)
    if s:
        out["ws13"] = _weights((s, 2 * f, d), 1.0 / np.sqrt(d), dtype, rng)
        out["ws2"] = _weights((s, d, f), 1.0 / np.sqrt(f), dtype, rng)
    if p["wfmt"] == "int4":  # the drawn weights quantized (the test dtype's values), every expert and shared one
        for name in [n for n in WEIGHTS if n in out]:
            for part, a in _int4(out.pop(name)).items():
                out[f"{name}_{part}"] = a
    if fp8:  # the shared experts' drawn weights, times their block factors, block-FP8 quantized
        for name in [n for n in WEIGHTS if n in out]:
            for part, a in _fp8(out.pop(name)).items():
                out[f"{name}_{part}"] = a
    if p["wfmt"] in GGML_FMTS:  # every routed and shared weight, times its block factors, GGML-quantized
        for name in [n for n in WEIGHTS if n in out]:
            out[f"{name}_ggml"] = _ggml(out.pop(name), p["wfmt"])
    return out


def _golden(x: dict[str, np.ndarray], absolute: bool, p: dict[str, Any] | None = None, flip: bool = False
            ) -> np.ndarray:
    xs = x["x"]
    act = None if xs.dtype == np.float64 else xs.dtype  # a float64 view (a caller's own): act not rounded
    w = {n: dense_weight(x, n, None if p is None else p.get("wfmt")) for n in WEIGHTS}
    quant = "e4m3" if p is not None and p.get("wfmt") == "fp8" else None
    return refimpl.moe_experts.experts(xs, x["ids"], x["weights"], w["w13"], w["w2"], ws13=w["ws13"], ws2=w["ws2"],
                                       act_dtype=act, absolute=absolute, act_quant=quant, flip_bound=flip)


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"out": _golden(x, False, p)}


def _mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    m = _golden(x, True, p)
    if p.get("wfmt") != "fp8":
        return {"out": m}
    # w8a8: the act quantizer's bounds join linearly, as Q / rtol (the production limits of the case's dtype, acc
    # term included), so the elementwise limit rtol m gains Q; the code steps' at the multiple c that lets one
    # flip at its bound pass the aggregate limits through cond (module docstring)
    name = "fp32" if x["x"].dtype == np.float64 else dt.of_array(x["x"]).name
    lim = EXPERTS.tolerance.limits("out", dt.get(name), p)
    steps, scale = _golden(x, False, p, flip=True)
    return {"out": m + (flip_multiple(lim) * steps + scale) / lim.rtol}


def flip_multiple(lim) -> float:
    """c = max(1, rtol sqrt(COND_RANDOM / min(nmse, 2 cos_diff))): a code flip at its bound Q on one element, e
    = Q, adds e^2 / sum b^2 to nmse (2x that to cos_diff); the aggregate limits scale by cond / COND_RANDOM,
    cond >= (c Q / rtol)^2 / sum b^2 from that element, so they hold it when c^2 >= COND_RANDOM rtol^2 / nmse."""
    return max(1.0, lim.rtol * float(np.sqrt(COND_RANDOM / min(lim.nmse, 2.0 * lim.cos_diff))))


def _check(p: dict[str, Any]) -> str | None:
    if p["k"] > p["e"]:
        return f"k={p['k']} must be <= e={p['e']} (distinct experts a token)"
    if p["wfmt"] == "int4" and (p["d"] % GROUP or p["f"] % GROUP):
        return f"wfmt=int4 needs d and f multiples of the group {GROUP}, got d={p['d']} f={p['f']}"
    if p["wfmt"] in FP8_FMTS and (p["d"] % FP8_BLOCK or p["f"] % FP8_BLOCK):
        return f"wfmt={p['wfmt']} needs d and f multiples of the block {FP8_BLOCK}, got d={p['d']} f={p['f']}"
    if p["wfmt"] in GGML_FMTS:
        qk = GGML_FORMATS[p["wfmt"]].block
        if p["d"] % qk or p["f"] % qk:
            return (f"wfmt={p['wfmt']} needs d and f multiples of its block of {qk} elements (w13's rows run along d, "
                    f"w2's along f), got d={p['d']} f={p['f']}")
    return None


def _acc(p: dict[str, Any], output: str) -> int:
    """GEMM1's sum over D, GEMM2's over F, then the k slots and S shared experts summed."""
    return p["d"] + p["f"] + p["k"] + p["shared"]


# The eager baseline's tier (the torch backend only: HF Mixtral's loop in the model dtype). Besides act it rounds
# gate and up (each u relative, reaching act as ~(1 + |g s(-g)|) u), silu(g), and for each of the k slots its down
# output, its product with the routing weight (itself rounded to the model dtype) and the index_add into the
# model-dtype output (then the shared experts' add): the act-side roundings are random over the F terms (RMS ~2 u
# M / sqrt 3), the output-side ones ~3k of up to u |partial sum| each, a partial sum up to ~M. Measured worst
# elementwise |error| / max(|golden|, M): 5.0 u (bf16) and 4.5 u (fp16) on the ci cases (k <= 4, 4 seeds, CPU);
# 7.5 u at k = 8 (Qwen3-30B-A3B's shape, t 512, 1M elements, H200). rtol 12 u (bf16 4.7e-2, fp16 5.9e-3) covers
# k up to 8 (the models') with a 1.6x margin; the aggregate limits for an RMS error of ~2 u M, (2 u)^2 / 2 cond:
# cos_diff 8 u^2 (bf16 1.2e-4, fp16 1.9e-6; measured 1.5e-5 at k = 8), nmse twice that. fp32 computes as a
# fused kernel does: no override.
_U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
EAGER = Tier(
    reason="eager torch (HF Mixtral's loop) computes in the model dtype: gate, up, silu, each slot's output, its "
           "weighted product and every index_add round to bf16 / fp16 (~3k + 4 roundings where a fused kernel rounds "
           "act and out)",
    overrides=tuple(Override(f"{n}: ~3k + 4 roundings of u = 2^{int(np.log2(u))} in the eager loop (rtol 12 u: "
                             f"measured 7.5 u at k = 8; cos_diff 8 u^2)", dtype=n, rtol=12 * u, cos_diff=8 * u * u,
                             nmse=16 * u * u)
                    for n, u in _U.items()),
)

EXPERTS = OpSpec(
    name="moe.experts",
    golden=refimpl.moe_experts.experts,
    reference=_ref,
    params=Schema(dict(
        t=Int(1, 1 << 20, edges=(1, 64, 512), doc="tokens"),
        d=Int(1, 1 << 16, edges=(64, 2048, 4096, 7168), doc="hidden size (Qwen3-30B-A3B 2048, Mixtral 4096, "
          "DeepSeek-V3 7168)"),
        f=Int(1, 1 << 16, edges=(64, 768, 2048, 14336), doc="expert intermediate size (Qwen3-30B-A3B 768, "
          "DeepSeek-V3 2048, Mixtral 14336); the shared experts' too"),
        e=Int(1, 1024, edges=(8, 128, 256), doc="routed experts (Mixtral 8, Qwen3-30B-A3B 128, DeepSeek-V3 256)"),
        k=Int(1, 64, edges=(1, 2, 8), doc="experts a token"),
        shared=Int(0, 2, edges=(0, 1), doc="shared experts of weight 1 on every token (DeepSeek-V3 1)"),
        wfmt=OneOf("dense", "int4", "fp8w", "fp8", *GGML_FMTS, doc="weight format: dense (the test dtype); int4: "
                   "GPTQ v1 w4a16, group 128 along D (w13) and F (w2), fp16 scales, every routed and shared expert "
                   "(inputs <w>_qweight, <w>_qzeros, <w>_scales; activations in the test dtype, the golden "
                   "dequantizes exactly); fp8w: block FP8 w8a16 (DeepSeek-V3's e4m3fn weights, one fp32 scale per "
                   "128 x 128 block: inputs <w>_codes, <w>_bscales; activations in the test dtype); fp8: block FP8 "
                   "w8a8 (the same weights, x and act quantized per token per 128-group to e4m3 before each GEMM); "
                   "q8_0 / q4_0 / q4_k / q6_k: GGML blocks of each expert's rows (llama.cpp's ggml_mul_mat_id "
                   "weights; input <w>_ggml (E, N, K / QK * nbytes) uint8), w-only: activations in the test dtype, "
                   "the golden dequantizes exactly"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"out": (p["t"], p["d"])},
    outputs={"out": Output("test", doc="the routed experts' weighted sum plus the shared experts")},
    tolerance=Tol(acc_len=_acc, baseline=EAGER),
    dtypes=("fp32", "bf16", "fp16"),
    dists=DISTS,
    check=_check,
    magnitude=_mag,
    storage_inputs=frozenset({"x", *WEIGHTS, *(f"{n}_scales" for n in WEIGHTS),
                              *(f"{n}_{part}" for n in WEIGHTS for part in FP8_PARTS)}),
    flops=lambda p: 6.0 * p["t"] * (p["k"] + p["shared"]) * p["d"] * p["f"],
    doc="Fused MoE experts (vLLM fused_moe): SwiGLU experts over routed tokens, weighted by the routing weights, "
        "plus shared experts; act rounded to the test dtype between the GEMMs.",
)

SPECS = (EXPERTS,)
