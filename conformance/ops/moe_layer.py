"""`moe.layer` (issue 34): the MoE layer end to end, as a serving engine runs it (conformance/ops/moe.py gathers it).

    logits       = x @ Wg^T                         the router GEMM: x (T, D), Wg (E, D) in the model dtype, fp32
                                                    accumulation, the logits kept in fp32 (the declared path)
    weights, ids = moe.route(logits, k, ...)        softmax / sigmoid, bias, grouped top-k, renormalisation, scaling
    out          = moe.experts(x, ids, weights, w13, w2, ws13, ws2)     SwiGLU experts plus the shared experts

The golden is refimpl/moe_layer.py `layer` (moe.route's golden composed with moe.experts'); its docstring
declares the logits' dtype: fp32, never rounded to the model dtype (DeepSeek's MoEGate and Hugging Face's
DeepseekV3TopkRouter: F.linear on fp32 casts; vLLM's and Hugging Face's Mixtral / Qwen3-MoE gates round them to the
model dtype first: that path is not this op).

Outputs: `out` (T, D) in the test dtype; `ids` (T, k) int32 bit-exact, each token's experts ascending (moe.route's
canonical order); `weights` (T, k) fp32 beside them.

Inputs: x ~ N(0, 1) in the test dtype; Wg rows N(0, 1.5^2 / D) (logits ~ N(0, 1.5^2), moe.route's `normal`);
`last` and `skew` give x a constant column x[:, 0] = 1 read by Wg[:, 0]: rising with the expert index (the top
experts at the end: tokens routed to the last expert) or -6 for every expert past max(k, E / 3) (those get no
token; their bias, DeepSeek-V3's, lowered by 1 so that it does not choose them either). bias (E,) fp32 N(0, 0.3).
Experts as moe.experts draws them: expert e's w13 ~ N(0, 1 / D) sqrt(s_e), w2 ~ N(0, 1 / F) s_e, s_e = 10^((e mod
3) - 1) (conformance/ops/moe_experts.py `expert_scale`: a slot sent to its neighbour expert is 10-100x off);
shared experts at s 1.

Decidable choices: the expert choice is discontinuous in the logits, and a kernel's fp32 logits are not the
golden's float64 ones. refimpl/moe_layer.py bounds a kernel's logit error by r_g max(|l_e|, M_e) (the router GEMM's
fp32 limit, r_g = rtol32 + eps32 sqrt(D)) and a decision boundary's move by 4 r_g max_e H_e (H: the selection
values' sensitivity); every token is drawn so that the golden's margin (moe.route's, at the k-th expert and the
topk_group-th group) exceeds HEADROOM times that bound, and moe.route's own MARGIN_REL of the row's largest
selection value (the fp32 scoring's error); a token below is redrawn (its row of x). So the golden's ids are the
only right answer, judged bit-exact.

Tolerance (production; the layer's error model, refimpl/moe_layer.py):
- weights: fp32, rtol = rtol32 + eps32 sqrt(D) = r_g (acc_len D), on the magnitude |w| + G (G: the weights'
  sensitivity to the logits' magnitudes): r_g |w| holds the route kernel's own fp32 arithmetic (moe.route's
  limit is rtol32 |w|), r_g G the logits' error carried through softmax / sigmoid, renormalisation and scaling.
- out: moe.experts' limits on its magnitude (conformance/ops/moe_experts.py: the dtype's rtol + eps32 sqrt(D + F +
  k + S) on max(|out|, M)), plus the weights' error carried into out, r_g sum_j G_j |y_j| (y_j the slot's expert
  output): an fp32 error whatever the output's dtype, so given as the compute-precision term `out@fp32` (E = r_g
  sum_j G_j |y_j| / (COMPUTE_K u32): the bound gains it in quadrature, conformance/tolerance.py layer 3).
- ids: bit-exact.
The eager baseline's tier is moe.experts' (EAGER: HF Mixtral's loop in the model dtype); its router and routing
run in fp32 like ours (Hugging Face's DeepseekV3TopkRouter), so weights and ids keep the production limits.
Measured (ci, 7 fresh seeds a case, 588 runs, CPU): worst norm_err of out 0.30 / 0.24 / 0.49 (fp32 / bf16 / fp16;
triton), the same for cpu, torch (baseline tier) 0.34 / 0.43 / 0.51; weights at most 0.037 of their limits (the
fp32 atol dominates at these sizes); ids exact in every run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.moe  # noqa: F401  (refimpl.moe.route: moe.route's golden)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops import moe_experts as mexp
from kernel_parity.conformance.ops.moe_route import MARGIN_REL, canonical, route_args
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import COMPUTE_K, COMPUTE_SUFFIX, DTYPE_DEFAULTS, U32, Tol
from kernel_parity.refimpl import moe_layer as ref
from kernel_parity.refimpl.moe_experts import experts as experts_golden

HEADROOM = 64.0  # a token's margin exceeds 64x the largest move fp32 logits allow at its decision boundaries
REDRAWS = 64
WEIGHTS = ("wg", "w13", "w2", "ws13", "ws2")

DISTS = {
    "normal": "x ~ N(0, 1), router rows N(0, 1.5^2 / D): logits ~ N(0, 1.5^2) (moe.route's `normal`)",
    "last": "x[:, 0] = 1 and Wg[:, 0] rising from -2 to 2 with the expert index (the rest N(0, 0.3^2 / (D - 1))): the "
            "top experts at the end, tokens routed to the last expert",
    "skew": "x[:, 0] = 1 and Wg[:, 0] = -6 past the first max(k, E / 3) experts (their bias - 1), the rest as "
            "`normal`: experts with no token",
}


def r_g(d: int) -> float:
    """The router GEMM's fp32 limit over a length-D dot product: rtol32 + eps32 sqrt(D) (gemm.gemm_nt's)."""
    return DTYPE_DEFAULTS["fp32"].rtol + dt.get("fp32").eps * math.sqrt(max(1, d))


def _draw_x(dist: str, n: int, d: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, d))
    if dist in ("last", "skew"):
        x[:, 0] = 1.0
    return dt.round_to(x, dtype)


def _live(p: dict[str, Any]) -> int:
    return max(p["k"], p["e"] // 3)


def _router(p: dict[str, Any], dist: str, dtype: str, rng: np.random.Generator) -> np.ndarray:
    e, d = p["e"], p["d"]
    if dist == "normal":
        wg = rng.normal(0.0, 1.5 / math.sqrt(d), (e, d))
    elif dist == "last":
        wg = rng.normal(0.0, 0.3 / math.sqrt(max(1, d - 1)), (e, d))
        wg[:, 0] = np.linspace(-2.0, 2.0, e)
    elif dist == "skew":
        wg = rng.normal(0.0, 1.5 / math.sqrt(max(1, d - 1)), (e, d))
        wg[:, 0] = np.where(np.arange(e) < _live(p), wg[:, 0], -6.0)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return dt.round_to(wg, dtype)


def _need(logits: np.ndarray, m: np.ndarray, bias: np.ndarray | None, p: dict[str, Any]) -> np.ndarray:
    """Per token, the margin its choice needs: HEADROOM x 4 r_g max H (a boundary's largest move: two selection
    values each side for a group score), and moe.route's MARGIN_REL of the largest |selection value|."""
    h = ref.select_sensitivity(logits, m, p["scoring"])
    sel = ref.scores(logits, p["scoring"])
    if bias is not None:
        sel = sel + bias[None, :]
    return np.maximum(HEADROOM * 4.0 * r_g(p["d"]) * h.max(axis=-1), MARGIN_REL * np.abs(sel).max(axis=-1))


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t, d, f, e, k, s = p["t"], p["d"], p["f"], p["e"], p["k"], p["shared"]
    wg = _router(p, dist, dtype, rng)
    bias = None
    if p["bias"]:
        b = rng.normal(0.0, 0.3, e)
        if dist == "skew":
            b[_live(p):] -= 1.0
        bias = b.astype(np.float32)
    b64 = None if bias is None else bias.astype(np.float64)
    wg64 = wg.astype(np.float64)
    x = _draw_x(dist, t, d, dtype, rng)
    todo = np.arange(t)
    for _ in range(REDRAWS):  # redraw the tokens whose choice an fp32 router GEMM could not decide
        x64 = x[todo].astype(np.float64)
        logits = x64 @ wg64.T
        _, _, margin = refimpl.moe.route(logits, k, bias=b64, **route_args(p))
        bad = margin <= _need(logits, ref.logit_scale(x64, wg64), b64, p)
        todo = todo[bad]
        if todo.size == 0:
            break
        x[todo] = _draw_x(dist, todo.size, d, dtype, rng)
    else:
        raise ValueError(f"moe.layer: {todo.size} tokens of dist {dist!r} stay undecidable by an fp32 router GEMM "
                         f"after {REDRAWS} redraws (params {p})")
    out = {"x": x, "wg": wg}
    if bias is not None:
        out["bias"] = bias
    sc = mexp.expert_scale(np.arange(e))
    out["w13"] = _expert_weights((e, 2 * f, d), np.sqrt(sc) / math.sqrt(d), dtype, rng)
    out["w2"] = _expert_weights((e, d, f), sc / math.sqrt(f), dtype, rng)
    if s:
        out["ws13"] = _expert_weights((s, 2 * f, d), np.full(s, 1.0 / math.sqrt(d)), dtype, rng)
        out["ws2"] = _expert_weights((s, d, f), np.full(s, 1.0 / math.sqrt(f)), dtype, rng)
    return out


def _expert_weights(shape: tuple[int, int, int], scale: np.ndarray, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """N(0, scale[i]^2) matrices in the storage dtype, one expert at a time from fp32 draws (a model-size layer
    never passes through float64 whole); a model-size one on threads, an expert a child stream
    (moe_experts.on_experts)."""
    out = np.empty(shape, dtype=dt.get(dtype).np)

    def draw(i: int, r: np.random.Generator) -> None:
        out[i] = dt.round_to(r.standard_normal(shape[1:], dtype=np.float32).astype(np.float64) * float(scale[i]), dtype)

    mexp.on_experts(draw, rng, shape[0], math.prod(shape))
    return out


def _args(x: dict[str, np.ndarray], p: dict[str, Any]) -> tuple[list, dict]:
    xs = x["x"]
    act = None if xs.dtype == np.float64 else xs.dtype  # a float64 view (a caller's own): act not rounded
    bias = x.get("bias")
    kw = dict(bias=None if bias is None else np.asarray(bias, dtype=np.float64), ws13=x.get("ws13"),
              ws2=x.get("ws2"), act_dtype=act, **route_args(p))
    return [xs, x["wg"], x["w13"], x["w2"], p["k"]], kw


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    args, kw = _args(x, p)
    out, w, ids, _ = ref.layer(*args, **kw)
    return {"out": out, **canonical(w, ids)}


def _mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    """The error model (module docstring): weights |w| + G; out moe.experts' magnitude and, as the compute term,
    r_g sum_j G_j |y_j| / (COMPUTE_K u32)."""
    args, kw = _args(x, p)
    xs, wg, w13, w2, k = args
    logits = ref.router_logits(xs, wg)
    w, ids, _ = refimpl.moe.route(logits, k, bias=kw["bias"], **route_args(p))  # the golden's routing (moe.route's)
    g = ref.weight_sensitivity(logits, ids, ref.logit_scale(xs, wg), p["scoring"], bool(p["renorm"]),
                               float(p["rscale"]))
    m_exp = experts_golden(xs, ids, w, w13, w2, ws13=kw["ws13"], ws2=kw["ws2"], act_dtype=kw["act_dtype"],
                           absolute=True)
    part = ref.weight_part(xs, ids, g, w13, w2, act_dtype=kw["act_dtype"])
    mags = canonical(np.abs(w) + g, ids)
    return {"out": m_exp, "out" + COMPUTE_SUFFIX: r_g(p["d"]) * part / (COMPUTE_K * U32), "weights": mags["weights"]}


def _check(p: dict[str, Any]) -> str | None:
    e, g, kept, k = p["e"], p["groups"], p["kept"], p["k"]
    if e % g:
        return f"groups={g} must divide e={e}"
    if kept > g:
        return f"kept={kept} must be <= groups={g}"
    if k > kept * (e // g):
        return f"k={k} must be <= kept x e / groups = {kept * (e // g)}"
    if g == 1 and p["mask"] != "-inf":
        return "mask only matters with groups > 1 (use mask=-inf)"
    return None


def _acc(p: dict[str, Any], output: str) -> int:
    """out: moe.experts' (GEMM1 over D, GEMM2 over F, the k slots and S shared experts); weights: the router
    GEMM's D (their rtol is then r_g)."""
    if output == "weights":
        return p["d"]
    return p["d"] + p["f"] + p["k"] + p["shared"]


LAYER = OpSpec(
    name="moe.layer",
    golden=ref.layer,
    reference=_ref,
    params=Schema(dict(
        t=Int(1, 1 << 20, edges=(1, 64, 256), doc="tokens"),
        d=Int(1, 1 << 16, edges=(64, 2048, 4096, 7168), doc="hidden size (Qwen3-30B-A3B 2048, Mixtral 4096, "
          "DeepSeek-V3 7168)"),
        f=Int(1, 1 << 16, edges=(64, 768, 2048, 14336), doc="expert intermediate size (Qwen3-30B-A3B 768, "
          "DeepSeek-V3 2048, Mixtral 14336); the shared experts' too"),
        e=Int(1, 1024, edges=(8, 128, 256), doc="routed experts (Mixtral 8, Qwen3-30B-A3B 128, DeepSeek-V3 256)"),
        k=Int(1, 64, edges=(1, 2, 8), doc="experts a token"),
        scoring=OneOf("softmax", "sigmoid", doc="softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) scores"),
        renorm=OneOf(1, 0, doc="1: the k weights divided by their sum (Mixtral, DeepSeek-V3, Qwen3 norm_topk_prob)"),
        bias=OneOf(0, 1, doc="1: a score-correction bias (E,) fp32 added for the choice only (DeepSeek-V3)"),
        groups=Int(1, 64, edges=(1, 8), doc="expert groups (DeepSeek-V3's n_group 8); 1: no grouping"),
        kept=Int(1, 64, edges=(1, 4), doc="groups kept (DeepSeek-V3's topk_group 4)"),
        rscale=OneOf("1", "2.5", doc="routed scaling factor of the weights (DeepSeek-V3 2.5)"),
        mask=OneOf("-inf", "zero", doc="a dropped group's experts' selection value: -inf (DeepSeek's inference "
                   "code, vLLM, SGLang) or 0 (Hugging Face's modeling_deepseek.py)"),
        shared=Int(0, 2, edges=(0, 1), doc="shared experts of weight 1 on every token (DeepSeek-V3 1)"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"out": (p["t"], p["d"]), "ids": (p["t"], p["k"]), "weights": (p["t"], p["k"])},
    outputs={"out": Output("test", doc="the routed experts' weighted sum plus the shared experts"),
             "ids": Output("int32", exact=True, doc="each token's experts, ascending"),
             "weights": Output("fp32", doc="their routing weights (renormalised, scaled), beside the ids")},
    tolerance=Tol(acc_len=_acc, baseline=mexp.EAGER),
    dtypes=("fp32", "bf16", "fp16"),
    dists=DISTS,
    check=_check,
    magnitude=_mag,
    storage_inputs=frozenset({"x", *WEIGHTS}),
    flops=lambda p: 2.0 * p["t"] * p["e"] * p["d"] + 6.0 * p["t"] * (p["k"] + p["shared"]) * p["d"] * p["f"],
    doc="The MoE layer end to end: fp32 router GEMM, top-k routing (moe.route), fused SwiGLU experts and shared "
        "experts (moe.experts); ids bit-exact, fp32 weights, out in the model dtype.",
)

SPECS = (LAYER,)
