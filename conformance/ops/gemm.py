"""Op spec of the quantized GEMM: `gemm.gemm_nt`, C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N]).

W is stored in one of `WFMTS`: plain float32, a GGML block format (rows of little-endian blocks),
FP8 e4m3 with float32 block scales (DeepSeek-V3: 1 x 128 activation groups x 128 x 128 weight
blocks; row-wise and per-tensor variants) or int4 groups of 128 with zero points (GPTQ v1 and AWQ
packing). Two references, both float64 and both recorded for every case:

- `dequant` (L1, the main one): A @ dequantize(W)^T, what the weights mean;
- `emulated` (L2): the production arithmetic, activations quantized exactly as the production
  path does (Q8_0 / Q8_1 / Q8_K for the GGML formats with ggml's reference quantizers, 1 x 128
  FP8 groups), integer block sums, scale products in float64;
- `emulated_x86` (GGML formats): L2 with the activation quantizer of ggml's x86 CPU backend, which
  rounds half to even with 127/amax where the reference quantizer rounds half away with 1/d
  (~0.4% of Q8_0 blocks differ by one code).

A backend claims the one its kernel computes (the C kernels and ggml: emulated; a kernel that
dequantizes W and multiplies in floating point: dequant); L1 - L2 is the activation quantization
error itself and shows in the record as the claimed reference's distance to the other.

`gemm.gemm_nt_backward` is its VJP (OPS.md, backward): the forward's params, dists and inputs, then the
cotangent dc of C; da = dc W through the weight the forward means (L1, a quantized W dequantized), and
for float32 W also dw = dc^T A and db = the sum of dc's rows (a quantized weight has no gradient).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.gemm  # noqa: F401  (refimpl.gemm below)
import kernel_parity.refimpl.quant  # noqa: F401
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.quant import decade_factors, random_blocks, tie_rows
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output, Rows
from kernel_parity.conformance.tolerance import Override, Tol

GGML_W = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl")
FP8_W = {"fp8": (1, 128, 128), "fp8_row": (1, 1, None), "fp8_tensor": (None, None, None)}  # (gm, gn, gk); None: all
INT4_W = {"int4_gptq": "gptq", "int4_awq": "awq"}
WFMTS = ("f32",) + GGML_W + tuple(FP8_W) + tuple(INT4_W)
INT4_GROUP = 128
W_SIGMA = 0.02  # weights ~ N(0, 0.02), the scale of a trained projection

DISTS = {
    "normal": "A ~ N(0, 1); W ~ N(0, 0.02) quantized by the golden quantizers",
    "random": "A ~ N(0, 1); W random codes with finite random scales (every code pattern; fast at real sizes)",
    "outlier": "A ~ N(0, 1) with a few channels 30x larger (activation scales set by outliers); W as normal",
    "ties": "A of Q8_0 rounding ties ((j + 1/2) / 4, one +-127/4 per 32-block); W as normal",
    "blockscale": "A ~ N(0, 1) x 10^(u + v), u ~ U(-1.5, 1.5) per 128 channels, v ~ U(-1, 0) per 32; W as normal "
                  "x 10^U(-2, 2) per scale block of its format (a GGML block, times 10^U(-1, 0) per 16 elements: "
                  "K-quant sub-blocks; an FP8 128 x 128 block or row; an int4 group): every weight and "
                  "activation scale differs from its neighbours' (in K, in N and in M) by up to 10^4",
}


def granularity(p: dict[str, Any]) -> dict[str, int]:
    """(gm, gn, gk) of an FP8 weight format at this case's sizes."""
    gm, gn, gk = FP8_W[p["wfmt"]]
    return {"gm": gm or p["m"], "gn": gn or p["n"], "gk": gk or p["k"]}


def _check(p: dict[str, Any]) -> str | None:
    w, k, n = p["wfmt"], p["k"], p["n"]
    if w in GGML_W:
        b = refimpl.quant.FORMATS[w].block
        if k % b:
            return f"k={k} is not a multiple of {w}'s block of {b} elements"
    if w == "fp8" and k % 128:
        return f"k={k} is not a multiple of 128 (fp8's 1 x 128 activation groups)"
    if w in INT4_W and (k % INT4_GROUP or n % 8):
        return f"{w} needs k a multiple of {INT4_GROUP} (k={k}) and n a multiple of 8 (n={n})"
    return None


def _activations(rng: np.random.Generator, m: int, k: int, dist: str) -> np.ndarray:
    if dist == "ties":
        return tie_rows(rng, m, k)
    a = rng.standard_normal((m, k))
    if dist == "outlier":
        cols = rng.choice(k, max(1, k // 64), replace=False)
        a[:, cols] *= 30.0
    elif dist == "blockscale":  # Q8_0 (32), FP8 (128) and Q8_K (256) activation blocks apart
        a *= decade_factors(rng, m, k, 128, 32, span=3.0)
    return a


def _weight_factors(p: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """`blockscale`'s (n, k) factors on W: 10^U(-2, 2) per scale block of the format."""
    w, n, k = p["wfmt"], p["n"], p["k"]
    if w in FP8_W:
        g = granularity(p)
        u = rng.uniform(-2.0, 2.0, (-(-n // g["gn"]), -(-k // g["gk"])))
        return 10.0 ** np.repeat(np.repeat(u, g["gn"], 0), g["gk"], 1)[:n, :k]
    if w in INT4_W:
        return decade_factors(rng, n, k, INT4_GROUP, 0)
    return decade_factors(rng, n, k, refimpl.quant.FORMATS[w].block if w in GGML_W else 32, 16)


def _weights(p: dict[str, Any], dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    w, n, k = p["wfmt"], p["n"], p["k"]
    if w in GGML_W and dist == "random":
        return {"w": random_blocks(rng, w, n, k, special=False)}
    dense = rng.standard_normal((n, k)) * W_SIGMA
    if dist == "blockscale":
        dense = dense * _weight_factors(p, rng)
    dense = dense.astype(np.float32)
    if w == "f32":
        return {"w": dense}
    if w in GGML_W:
        return {"w": refimpl.quant.quantize(w, dense)}
    if w in FP8_W:
        g = granularity(p)
        if dist == "random":
            q = rng.integers(0, 256, (n, k), dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] = 0x7E  # no NaN codes: e4m3fn's NaN is 0x7F / 0xFF
            shape = (-(-n // g["gn"]), -(-k // g["gk"]))
            scale = (rng.uniform(0.5, 1.0, shape) * 2.0 ** rng.integers(-14, -8, shape)).astype(np.float32)
            return {"w": q.view(dt.get("fp8e4m3").np), "w_scale": scale}
        q, scale = refimpl.quant.fp8_quantize(dense, g["gn"], g["gk"])
        return {"w": q, "w_scale": scale}
    packed = refimpl.quant.int4_quantize(dense, INT4_GROUP, INT4_W[w])
    if dist == "random":
        packed = {name: (rng.integers(0, 2**32, v.shape, dtype=np.uint64).astype(np.uint32).view(np.int32)
                         if v.dtype == np.int32 else v) for name, v in packed.items()}
    return packed


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if dist not in DISTS:
        raise ValueError(f"unknown distribution {dist!r}")
    a = dt.round_to(_activations(rng, p["m"], p["k"], dist), dtype)
    inputs = {"a": a, **_weights(p, dist, rng)}
    if p["bias"]:
        inputs["bias"] = dt.round_to(rng.standard_normal(p["n"]), "fp32")
    return inputs


def _weight_args(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> tuple[str, dict, dict]:
    w = p["wfmt"]
    weights = {k: v for k, v in inputs.items() if k not in ("a", "bias")}
    if w in FP8_W:
        return "fp8", weights, granularity(p)
    if w in INT4_W:
        return "int4", weights, {"order": INT4_W[w], "group": INT4_GROUP}
    return w, weights, {}


def _dequant(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    wfmt, weights, extra = _weight_args(inputs, p)
    return {"c": refimpl.gemm.dequant_reference(inputs["a"], wfmt, weights, inputs.get("bias"), **extra)}


def _emulated(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    wfmt, weights, extra = _weight_args(inputs, p)
    return {"c": refimpl.gemm.emulated_reference(inputs["a"], wfmt, weights, inputs.get("bias"), **extra)}


def _emulated_x86(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    """L2 with ggml's x86 CPU activation quantizer (127/amax, half to even): GGML formats only."""
    if p["wfmt"] not in GGML_W:
        return {}
    return {"c": refimpl.gemm.emulated_reference(inputs["a"], p["wfmt"], {"w": inputs["w"]}, inputs.get("bias"),
                                                 act_quantizer="x86")}


def _magnitude(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    """The error model: sqrt(A^2 @ (W^2)^T + bias^2), W dequantized, A the larger of the activations and the
    ones L2 quantizes (refimpl.gemm.dequant_reference, `absolute`)."""
    wfmt, weights, extra = _weight_args(inputs, p)
    return {"c": refimpl.gemm.dequant_reference(inputs["a"], wfmt, weights, inputs.get("bias"), absolute=True,
                                                **extra)}


_C_SCALE = (
    # C = A W^T sums K products with cancellation: a correct fp32 dot product of length K is off by
    # ~eps32 sqrt(K) of the row's magnitude, whatever |C| is at that element. The error model
    # (`_magnitude`: each element against sqrt(sum_k a_k^2 w_k^2 + bias^2), the root-sum-square of its
    # terms; cond 1.3 .. 1.5 on the ci cases, median) covers this against the golden; the override stays
    # for the comparisons that have no magnitude, kernel against kernel (property_tests/test_gemm.py, a row
    # of A alone vs the same row of the whole: torch fails it under the thorough profile without it).
    Override("C sums K products with cancellation: absolute error ~ eps32 sqrt(K) max|C|", output="c",
             atol_acc=1.0),
    # The aggregate error grows with K too (the backward's rule, _GRAD_SCALE): a sum of K terms in index order
    # in fp32 has relative rms error ~ eps32 sqrt(K / 24), cos_diff ~ eps32^2 K / 48: 4.2e-12 at K = 14,336,
    # past the fixed fp32 default of 1e-12 (issue 32, far-end K: eager torch's Q6_K GEMV at K = 14,336, m = 1,
    # n = 4 measured cos_diff 1.2e-12, elementwise at 0.06 of its bound). agg_acc 0.125 = 6x that expectation.
    Override("C: an fp32 sum of K products, cos_diff ~ eps32^2 K / 48 (torch 1.2e-12 measured at K = 14,336)",
             output="c", agg_acc=0.125),
    # A kernel that dequantizes W to the 16-bit activation dtype before a tensor-core dot rounds
    # every weight once (relative 2^-9 in bf16): ~1.1e-3 rms(C) per element, 5x that at the tail
    # of 1e6 elements, = 0.14 eps(bf16) max|C|; 0.5 leaves 3.5x. fp16: 0.29 eps(fp16) max|C|, 1.0.
    Override("bf16 weights: one rounding of each dequantized weight (0.14 eps x max|C| at the tail)",
             output="c", dtype="bf16", atol_max_eps=0.5),
    Override("fp16 weights: one rounding of each dequantized weight (0.29 eps x max|C| at the tail)",
             output="c", dtype="fp16", atol_max_eps=1.0),
)

GEMM_NT = OpSpec(
    name="gemm.gemm_nt",
    golden=refimpl.gemm.gemm_nt,
    reference=_dequant,
    reference_name="dequant",
    references={"emulated": _emulated, "emulated_x86": _emulated_x86},
    params=Schema(dict(
        m=Int(1, 1 << 16, edges=(16, 17, 64, 128), doc="rows of A (tokens): 1..16 decode, more prefill"),
        n=Int(1, 1 << 18, edges=(64, 128, 256), doc="rows of W (output features)"),
        k=Int(1, 1 << 18, edges=(32, 128, 256, 4096), doc="reduction length (input features)"),
        wfmt=OneOf(*WFMTS, doc="weight storage format"),
        bias=OneOf(0, 1, doc="add a float32 bias[N]"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"c": (p["m"], p["n"])},
    outputs={"c": Output("test", doc="A @ W^T (+ bias), in A's dtype")},
    tolerance=Tol(acc_len=lambda p, output: p["k"], overrides=_C_SCALE),
    rows=Rows("m", inputs={"a": 0}, outputs={"c": 0}),  # A's rows (its quantizers work per row)
    dists=DISTS,
    check=_check,
    magnitude=_magnitude,
    flops=lambda p: 2.0 * p["m"] * p["n"] * p["k"],
    doc="C = A @ W^T (+ bias) with W stored quantized: GGML blocks, FP8 block-scaled, int4 groups.",
)



# -- gemm.gemm_nt_backward -----------------------------------------------------------------------------
# The VJP of C = A W^T (+ bias) (OPS.md, backward): the forward's inputs, built as the forward builds
# them, then the cotangent dc of C (N(0, 1) from the same generator, rounded to C's dtype). Outputs: da
# through the weight the forward means (a quantized W dequantized: L1); dw and db only for float32 W
# (gradients of quantized weights are not defined).
def _backward_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    inputs = _inputs(p, dtype, dist, rng)
    inputs["dc"] = dt.round_to(rng.standard_normal((p["m"], p["n"])), dtype)
    return inputs


def _backward_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shapes = {"da": (p["m"], p["k"])}
    if p["wfmt"] == "f32":
        shapes["dw"] = (p["n"], p["k"])
        if p["bias"]:
            shapes["db"] = (p["n"],)
    return shapes


def dequantized_weight(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> np.ndarray:
    """The (N, K) float64 weight the case's W stores (its dequantization), whatever the format."""
    wfmt, weights, extra = _weight_args({k: v for k, v in inputs.items() if k != "dc"}, p)
    extra = {k: v for k, v in extra.items() if k != "gm"}  # the FP8 activation group: not the weight's
    return refimpl.gemm.dequantize_weight(wfmt, weights, p["k"], **extra)


def _backward_ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    g = refimpl.gemm.gemm_nt_backward(x["a"], dequantized_weight(x, p), x["dc"], bias=bool(p["bias"]))
    return {k: g[k] for k in _backward_shapes(p)}


def _backward_mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    """The error model: the root-sum-square of each gradient's terms (refimpl.gemm.gemm_nt_backward, `absolute`):
    da = sqrt(dc^2 @ W^2), dw = sqrt((dc^2)^T @ A^2), db = sqrt(sum dc^2); dw, db only where they are outputs."""
    return refimpl.gemm.gemm_nt_backward(x["a"], dequantized_weight(x, p), x["dc"], bias=bool(p["bias"]),
                                         weight_grad=p["wfmt"] == "f32", absolute=True)


def _backward_acc(p: dict[str, Any], output: str) -> int:
    """da sums over N (dc's rows times W's columns), dw and db over M (the tokens)."""
    return p["n"] if output == "da" else p["m"]


_GRAD_SCALE = (
    # Every gradient is a sum with cancellation (da over N, dw and db over M): an element near 0 carries
    # the rounding of the larger terms, ~eps32 sqrt(reduction length) of the output's scale (as C's). The
    # error model (`_backward_mag`: each element against the root-sum-square of its terms) covers this
    # against the golden; the override stays for the comparisons that have no magnitude, kernel against
    # kernel (property_tests/test_gemm.py: dc split in two or M split in two and the gradients summed,
    # runs.assert_close: without it those fail in the ci profile, da off by 1.4e-4 at max|da| 972).
    *(Override(f"{g} sums its reduction with cancellation: absolute error ~ eps32 sqrt(length) max|{g}|",
               output=g, atol_acc=1.0) for g in ("da", "dw", "db")),
    # Their aggregate error grows with the length too: a sum of n terms added in index order in fp32 (the C
    # kernel, the seed's arithmetic: ISA-independent bits) has relative rms error ~ eps32 sqrt(n / 24), so
    # cos_diff ~ eps32^2 n / 48: 1.2e-12 at n = 4096, past the fixed fp32 default (measured: C da at
    # m=2, n=4096 cos_diff 1.09e-12, flaky in a 180-run sweep). agg_acc 0.125 = 6x that expectation.
    *(Override(f"{g}: an fp32 sum in index order, cos_diff ~ eps32^2 n / 48 (1.09e-12 measured at n = 4096, C)",
               output=g, agg_acc=0.125) for g in ("da", "dw", "db")),
    # The 16-bit paths (eager torch; the Triton kernel on tensor cores) round W to the activation dtype
    # before the product, as the forward does: the same allowance as C's (module overrides above).
    Override("bf16 dc: one rounding of each (dequantized) weight, as the forward's C (0.14 eps x max|da|)",
             output="da", dtype="bf16", atol_max_eps=0.5),
    Override("fp16 dc: one rounding of each (dequantized) weight, as the forward's C (0.29 eps x max|da|)",
             output="da", dtype="fp16", atol_max_eps=1.0),
)

GEMM_NT_BACKWARD = OpSpec(
    name="gemm.gemm_nt_backward",
    golden=refimpl.gemm.gemm_nt_backward,
    reference=_backward_ref,
    params=GEMM_NT.params,
    make_inputs=_backward_inputs,
    output_shapes=_backward_shapes,
    outputs={
        "da": Output("test", doc="dc @ W (W dequantized for a quantized format), in A's dtype"),
        # dw and db are float32 (W's and the bias's storage) but come from 16-bit dc and A in a 16-bit case:
        # the eager baseline's autograd rounds them to the activation dtype through the cast of W.
        "dw": Output("fp32", tol_dtype="test", doc="dc^T @ A (float32 W only), float32"),
        "db": Output("fp32", tol_dtype="test", doc="the sum of dc over the rows (float32 W with a bias)"),
    },
    tolerance=Tol(acc_len=_backward_acc, overrides=_GRAD_SCALE, noise_k=3.0),
    dists=DISTS,
    check=_check,
    magnitude=_backward_mag,
    # da = dc W: 2 M N K; dw = dc^T A (float32 W only): 2 M N K more (db's column sum aside)
    flops=lambda p: 2.0 * p["m"] * p["n"] * p["k"] * (2 if p["wfmt"] == "f32" else 1),
    doc="The VJP of C = A @ W^T (+ bias): da = dc W (W dequantized), dw = dc^T A and db = sum dc for float32 W.",
)

SPECS = (GEMM_NT, GEMM_NT_BACKWARD)
