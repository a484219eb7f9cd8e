"""`moe.route` (issue 34), top-k expert routing: the `moe` family's first op (conformance/ops/moe.py gathers them).

`moe.route`: router logits (T, E) -> the k experts of each token and their weights, as refimpl/moe.py (the
golden) defines them: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) scores, DeepSeek-V3's
score-correction bias for the choice only, grouped top-k (n_group groups, topk_group kept; a group's score its
two best with a bias, its best without; dropped groups at -inf or 0), renormalisation, routed scaling, ties to
the lower expert index.

Outputs: `ids` (T, k) int32, each token's experts in ascending index order (bit-exact), and `weights` (T, k)
fp32 in the same order (fp32 limits: every kernel scores in fp32, as the engines do: Mixtral's softmax and
DeepSeek's gate run in fp32 whatever the model's dtype). Ascending order, not rank order: two chosen experts of
nearly equal score may rank either way in fp32, while the set is what the layer uses (vLLM's topk is unsorted).

Inputs: logits in the test dtype (a bf16 / fp16 gate GEMM's output, or fp32), bias (E,) fp32. Every token of
a case is drawn so that its selection is decided in fp32: the golden's decision margin (refimpl.moe.route's
third output: the gap at the k-th expert and at the topk_group-th group) is 0 (an exact tie, decided by the
declared lower-index rule; the `ties` dist makes them on purpose) or above MARGIN_REL of the row's largest
|selection value|; a token below is redrawn (after half of REDRAWS, from `normal`: see `spread`). So an fp32 kernel's choice is the golden's unless it is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.moe  # noqa: F401  (refimpl.moe.route below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol

MARGIN_REL = 2.0 ** -12  # fp32 scores carry ~2^-23 relative error: 2^11 of headroom at every decision
REDRAWS = 64

DISTS = {
    "normal": "N(0, 1.5) logits (a trained router's spread)",
    "ties": "integer logits in [-2, 2]: many exact ties, decided by the lower index",
    "peaked": "N(0, 1) logits with one expert a token at +8 (a confident router: weights near 1 and near 0)",
    "last": "logits rising with the expert index plus N(0, 0.3): the top experts at the end (tokens routed to the "
            "last expert)",
    "spread": "N(0, 6) logits: scores near 0 and 1 (softmax underflow toward 0, sigmoid saturation); a token still "
              "undecided in fp32 after 32 redraws (saturated sigmoids over many experts) is drawn from `normal`",
}


def rscale(p: dict[str, Any]) -> float:
    return float(p["rscale"])


def _draw(dist: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    t, e = shape
    if dist == "normal":
        return rng.normal(0.0, 1.5, shape)
    if dist == "ties":
        return rng.integers(-2, 3, shape).astype(np.float64)
    if dist == "peaked":
        x = rng.normal(0.0, 1.0, shape)
        x[np.arange(t), rng.integers(0, e, t)] = 8.0
        return x
    if dist == "last":
        return np.linspace(-2.0, 2.0, e)[None, :] + rng.normal(0.0, 0.3, shape)
    if dist == "spread":
        return rng.normal(0.0, 6.0, shape)
    raise ValueError(f"unknown distribution {dist!r}")


def route_args(p: dict[str, Any]) -> dict[str, Any]:
    """The routing keywords of a case's params (golden and kernels take the same)."""
    return dict(scoring=p["scoring"], renormalize=bool(p["renorm"]), n_group=p["groups"], topk_group=p["kept"],
                routed_scaling=rscale(p), mask=p["mask"])


def _select_scale(logits: np.ndarray, bias: np.ndarray | None, scoring: str) -> np.ndarray:
    """Each row's largest |selection value| (scores + bias), the scale of its margins."""
    if scoring == "softmax":
        m = logits.max(axis=-1, keepdims=True)
        e = np.exp(logits - m)
        s = e / e.sum(axis=-1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-logits))
    if bias is not None:
        s = s + bias[None, :]
    return np.abs(s).max(axis=-1)


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t, e = p["t"], p["e"]
    bias = rng.normal(0.0, 0.3, e).astype(np.float32) if p["bias"] else None
    logits = dt.round_to(_draw(dist, (t, e), rng), dtype).astype(np.float64)
    todo = np.arange(t)
    for i in range(REDRAWS):  # redraw the tokens whose choice fp32 could not decide
        _, _, margin = refimpl.moe.route(logits[todo], p["k"], bias=bias, **route_args(p))
        scale = _select_scale(logits[todo], None if bias is None else bias.astype(np.float64), p["scoring"])
        bad = (margin > 0) & (margin < MARGIN_REL * scale)
        todo = todo[bad]
        if todo.size == 0:
            break
        # past half the budget, from `normal`: a dist no fp32 router can decide on for some shapes (`spread`'s
        # saturated sigmoids over 128 experts, top-1: the best two scores ~1e-6 apart) keeps its other tokens
        logits[todo] = dt.round_to(_draw(dist if i < REDRAWS // 2 else "normal", (todo.size, e), rng),
                                   dtype).astype(np.float64)
    else:
        raise ValueError(f"moe.route: {todo.size} tokens of dist {dist!r} stay undecided in fp32 after {REDRAWS} "
                         f"redraws (params {p})")
    out = {"logits": dt.round_to(logits, dtype)}
    if bias is not None:
        out["bias"] = bias
    return out


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    w, ids, _ = refimpl.moe.route(x["logits"], p["k"], bias=x.get("bias"), **route_args(p))
    return canonical(w, ids)


def canonical(weights: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
    """(T, k) weights and ids in any order -> ids ascending per token, the weights beside them."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return {"ids": np.take_along_axis(np.asarray(ids), order, axis=-1).astype(np.int32),
            "weights": np.take_along_axis(np.asarray(weights), order, axis=-1)}


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


ROUTE = OpSpec(
    name="moe.route",
    golden=refimpl.moe.route,
    reference=_ref,
    params=Schema(dict(
        t=Int(1, 1 << 20, edges=(1, 7, 128), doc="tokens"),
        e=Int(1, 1024, edges=(8, 60, 128, 256), doc="routed experts (Mixtral 8, Qwen1.5-MoE 60, Qwen3-30B-A3B 128, "
          "DeepSeek-V3 256)"),
        k=Int(1, 64, edges=(1, 2, 8), doc="experts a token"),
        scoring=OneOf("softmax", "sigmoid", doc="softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) scores"),
        renorm=OneOf(1, 0, doc="1: the k weights divided by their sum (Mixtral, DeepSeek-V3, Qwen3 "
                     "norm_topk_prob); 0: the raw scores"),
        bias=OneOf(0, 1, doc="1: a score-correction bias (E,) fp32 added for the choice only (DeepSeek-V3)"),
        groups=Int(1, 64, edges=(1, 8), doc="expert groups (DeepSeek-V3's n_group 8); 1: no grouping"),
        kept=Int(1, 64, edges=(1, 4), doc="groups kept (DeepSeek-V3's topk_group 4)"),
        rscale=OneOf("1", "2.5", doc="routed scaling factor of the weights (DeepSeek-V3 2.5)"),
        mask=OneOf("-inf", "zero", doc="a dropped group's experts' selection value: -inf (DeepSeek's inference "
                   "code, vLLM, SGLang) or 0 (Hugging Face's modeling_deepseek.py)"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"ids": (p["t"], p["k"]), "weights": (p["t"], p["k"])},
    outputs={"ids": Output("int32", exact=True, doc="each token's experts, ascending"),
             "weights": Output("fp32", doc="their weights (renormalised, scaled), beside the ids")},
    tolerance=Tol(),
    dtypes=("fp32", "bf16", "fp16"),
    dists=DISTS,
    check=_check,
    doc="Top-k expert routing (Mixtral / Qwen3 softmax, DeepSeek-V3 sigmoid + bias + grouped top-k): ids bit-exact "
        "(ascending), fp32 weights.",
)

SPECS = (ROUTE,)
