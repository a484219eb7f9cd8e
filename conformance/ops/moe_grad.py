"""`moe.route_backward`: the backward of MoE routing weights (issue 34), refimpl/moe_grad.py the golden.

Given the forward's choice (ids) and the cotangent of its weights (grad_w), the gradient with respect to the
router logits, what torch autograd computes through Hugging Face's Mixtral / Qwen3-MoE / DeepSeek-V3 routers
with the choice held fixed: the choice carries no gradient and the bias (for the choice only) gets none; the
grouping (groups, kept, mask) is accepted and changes nothing given the ids.

Params: moe.route's (conformance/ops/moe_route.py), the same checks. Inputs:
- logits (T, E) in the test dtype and bias (E,) fp32 (when the case has one): moe.route's, from its generator
  (its dists, and its redraws of tokens whose choice fp32 could not decide);
- ids (T, k) int32: the golden forward's choice (refimpl.moe.route), in its rank order; every kernel takes
  them (kernels do not re-route);
- grad_w (T, k) fp32: N(0, 1) times a scale that alternates 1 / 1e-3 between neighbouring slots (the phase
  drawn per token), so a slot's gradient sent to a neighbouring slot's or expert's place, or one read from
  there, is off by orders of magnitude; then every token times 10^U(-3, 3) (cotangents from tiny to large).
Output: grad_logits (T, E) fp32.

Tolerance: fp32 limits judged against the error model (refimpl.moe_grad `route_backward_error_model`), in one
tier for every backend, the eager torch baseline included (autograd through kernels/torch/moe.py's eager
scoring with the ids fixed; it passes the same limits, so it needs no tier of its own):
- magnitude: the golden's computation on root-sum-squares of the terms it sums. An fp32 kernel's scores carry a
  few roundings each (exp, the sum over E, a division: the accumulation length is E), g_s a few more (the
  k-term sums S and D, a division, the scaling), the gradient a subtraction of the k-term row sum r and a
  product: a few u32 of the magnitude, inside rtol = 1.3e-6 (11 eps32) + eps32 sqrt(E). Where the golden
  cancels (softmax with renormalize: r = 0 exactly, every unchosen expert's gradient 0; k = 1 renormalised: 0)
  an fp32 kernel's r is its rounding, judged against s_i |r| (the magnitude keeps |r|).
- compute term `grad_logits@fp32` (conformance/tolerance.py: the bound gains 2 u32 E elementwise, an RMS of
  0.5 u32 E in the aggregates): sigmoid E = 3 |g_s| s: s (1 - s) from an fp32 s (torch autograd's sigmoid
  backward, grad y (1 - y); any kernel that keeps the forward's fp32 scores) carries s's rounding however small
  1 - s is, measured for torch's fp32 sigmoid (CPU, 2M points over [-20, 20]) up to 2.47 u32 s, RMS 0.62 u32 s;
  3 = the roundings of 1 / (1 + exp(-l)) near s = 1. softmax E = magnitude x (|l_i - max l| + the chosen
  experts' largest |l_j - max l| + sum_i s_i |l_i - max l|): an fp32 exp(l_i - max l) of the rounded difference
  is off by up to u32 |l_i - max l| relative (torch's softmax, moe.c's expf; Triton's exp_diff folds the
  difference's rounding back), through the element's own score, the chosen ones' and the row sum.
- atol: every rounding is in the magnitudes, so the absolute part only covers fp32's underflow (scores below
  2^-126, flushed on some GPUs: |grad| < 2^-126 |g_s| ~ 1e-35 at |g_s| ~ 1e3): 1e-30, far stricter than
  torch.testing's fp32 1e-5 (the peers test the router's backward as plain autograd, at assert_close's fp32
  defaults).
- k = 1 with renormalize: the golden is 0 everywhere (one weight, the constant c), so the aggregate limits,
  relative to its norm, are left out (`_ConstantWeightsTol`); the elements stay judged against the error model.
Measured over fresh-seed sweeps of the ci suite (13 seeds, 3549 runs, 0 failures, 0 flaky): the largest
norm_err torch 0.49 and C 0.46 (softmax without renormalisation on `spread`: exp of the rounded l - max l),
Triton 0.30.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.moe  # noqa: F401  (refimpl.moe.route, route_backward)
from kernel_parity.conformance.ops.moe_route import DISTS, ROUTE, _inputs as _route_inputs, route_args
from kernel_parity.conformance.dtypes import DType
from kernel_parity.conformance.metrics import Limits
from kernel_parity.conformance.spec import OpSpec, Output, Rows
from kernel_parity.conformance.tolerance import COMPUTE_SUFFIX, Override, Tol
from kernel_parity.refimpl.moe_grad import route_backward_error_model

SLOT_SCALE = 1e-3  # every other slot's cotangent scale (the phase per token)
TOKEN_DECADES = 3  # each token's cotangents times 10^U(-3, 3)


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = _route_inputs(p, dtype, dist, rng)
    t, k = p["t"], p["k"]
    _, ids, _ = refimpl.moe.route(out["logits"], k, bias=out.get("bias"), **route_args(p))
    phase = rng.integers(0, 2, (t, 1))
    scale = np.where((np.arange(k)[None, :] + phase) % 2 == 0, 1.0, SLOT_SCALE)
    scale = scale * 10.0 ** rng.uniform(-TOKEN_DECADES, TOKEN_DECADES, (t, 1))
    out["ids"] = ids.astype(np.int32)
    out["grad_w"] = (rng.standard_normal((t, k)) * scale).astype(np.float32)
    return out


def _args(x: dict[str, np.ndarray], p: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    return (x["logits"], np.asarray(x["ids"]), x["grad_w"]), dict(bias=x.get("bias"), **route_args(p))


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    args, kw = _args(x, p)
    return {"grad_logits": refimpl.moe.route_backward(*args, **kw)}


def _mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    args, kw = _args(x, p)
    mag, comp = route_backward_error_model(*args, **kw)
    return {"grad_logits": mag, "grad_logits" + COMPUTE_SUFFIX: comp}


@dataclass(frozen=True)
class _ConstantWeightsTol(Tol):
    """Tol, but without the aggregate limits where the golden is 0 everywhere: k = 1 with renormalize (the one
    weight is the constant c, its gradient 0). cos_diff and nmse measure an error against the golden's norm,
    which is 0 there (cos_diff is 1 for any non-zero rounding, nmse undefined), while a correct fp32 kernel's
    g_s = c (grad_w - grad_w s / s) / s rounds to a few u32 |grad_w| / s instead of 0 (torch autograd: in
    about a fifth of the tokens). Each element stays judged against the error model (atol + rtol m), which
    holds such a kernel and fails any that lets the gradient through."""

    def limits(self, output: str, out_dtype: DType, params: dict[str, Any], tier: str = "production") -> Limits:
        lim = super().limits(output, out_dtype, params, tier)
        if params.get("k") == 1 and params.get("renorm"):
            return replace(lim, cos_diff=None, nmse=None)
        return lim


_ATOL = Override("every rounding is in the error model (relative to the magnitudes); the absolute part covers "
                 "only fp32 underflow of the scores: |grad| < 2^-126 |g_s| ~ 1e-35", output="grad_logits",
                 atol=1e-30)

ROUTE_BACKWARD = OpSpec(
    name="moe.route_backward",
    golden=refimpl.moe.route_backward,
    reference=_ref,
    params=ROUTE.params,
    make_inputs=_inputs,
    output_shapes=lambda p: {"grad_logits": (p["t"], p["e"])},
    outputs={"grad_logits": Output("fp32", doc="d loss / d logits, fp32 whatever the logits' dtype")},
    tolerance=_ConstantWeightsTol(acc_len=lambda p, output: p["e"], overrides=(_ATOL,), noise_k=3.0),
    dtypes=ROUTE.dtypes,
    dists=DISTS,
    check=ROUTE.check,
    rows=Rows("t", inputs={"logits": 0, "ids": 0, "grad_w": 0}, outputs={"grad_logits": 0}),
    magnitude=_mag,
    doc="The VJP of moe.route's weights with respect to the logits, the choice (ids) given: softmax / sigmoid "
        "scores, renormalisation, routed scaling; the bias and the grouping get no gradient.",
)

SPECS = (ROUTE_BACKWARD,)
