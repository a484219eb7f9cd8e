"""`moe.experts_backward` (issue 34): the backward of the fused MoE experts layer (`moe.experts`, dense weights):
the gradients of the tokens, of the routing weights and of the grouped GEMMs' weights for the cotangent of out.

    dact0 = W2[e]^T dout_t,  dweights[t, j] = act_r . dact0 (= dout_t . y(t, e))
    dh = w (dact0 u silu'(g) | dact0 silu(g)),  dx[t] = sum_j W13[e]^T dh + the shared experts'
    dW13[e] = sum_slots dh (x) x_t,  dW2[e] = sum_slots w dout_t (x) act_r

(refimpl/moe_experts_grad.py; act_r the forward's act rounded to the test dtype, its one production cast,
passed through as the identity by the chain rule.)

Params: moe.experts' without wfmt (dense weights only: int4 weights have no gradient). Inputs: the forward's
(conformance/ops/moe_experts.py: expert e's weights scaled by 10^((e mod 3) - 1), so neighbouring experts' gradients
differ 10-100x; routing weights in [0.05, 1], normalised on half the tokens; `last`, and `skew`, whose experts
outside the first max(k, E // 3) get no token: their dW13, dW2 must be exactly 0), then the cotangent dout ~ N(0, 1)
in the test dtype from the same generator.

Outputs and their dtypes:
- dx (T, D) in the test dtype (the activations' gradient, as autograd gives it in a bf16 layer);
- dweights (T, k) fp32 (the routing weights are fp32, moe.route's output; moe.route_backward takes it as grad_w);
- dw13 (E, 2F, D), dw2 (E, D, F), and dws13 (S, 2F, D), dws2 (S, D, F) with shared experts: fp32, the sums over an
  expert's slots accumulated in fp32 and never rounded to 16 bits (a training framework keeps fp32 main grads:
  Megatron's grouped-GEMM wgrad accumulates into an fp32 main_grad), so a 16-bit model's gradient is not rounded
  twice.

Tolerance (production): each output judged at its case dtype's limits (the fp32 outputs with `tol_dtype` "test":
fp32 sums of terms whose factors carry the test dtype's act_r), against the error model's magnitude M
(refimpl/moe_experts_grad.py `absolute`: the forward's gate / up / act, the dact GEMM over D, the SwiGLU backward
with silu'' for g's error, then the dx GEMM over 2F or the sums over the expert's slots), rtol + eps32
sqrt(acc_len) with the reduction lengths of `_acc`. What a correct fused kernel differs by: fp32 accumulation (the
acc term), dx's one rounding (u |dx|), and act_r's code flips (a kernel's fp32 act rounding to the other neighbour,
<= 2 u |term| on one term of dweights' sum over F and of dW2's over the slots, <= 2 u M since M >= the RSS of the
terms; bf16's rtol 1.6e-2 is 4.1 u, fp16's 1e-3 2.05 u, as the forward's). dact, dh and w dout are exact in the
golden: a kernel keeps them fp32 (our Triton kernel feeds a 16-bit tl.dot two 16-bit parts, hi + lo, of each), so
no rounding of them is allowed for. The eager baseline's tier: EAGER below.
One code flip uses up to 2 u / 2.05 u = 0.98 of fp16's elementwise bound on a dW2 element that is a single term (an
expert with one slot, or one dominant slot): measured 0.894 (triton and cpu alike: the same flip, fp16, `last`).
Two flips of one sign in the same dW2 element (two dominant slots of one expert, one column f) could exceed it:
each act element flips with probability ~eps32 sqrt(D) |g| / ulp16(act) ~ 1e-3, so that needs ~1e-6 per pair of
dominant slots; not seen.
Measured worst norm_err over 9 fresh seeds of the ci suite (207 runs a backend, 621 in all: 0 fail, 0 flaky):
triton 0.894 (fp16 dW2, the flip above; bf16 0.28, fp32 0.37), cpu 0.894 (bf16 0.28, fp32 0.38), torch (its tier)
0.62; the aggregate limits at most 0.17 (ours) and 0.31 (torch) used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops import moe_experts as fwd
from kernel_parity.conformance.params import Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Override, Tier, Tol
from kernel_parity.refimpl import moe_experts_grad as ref

PARAMS = Schema({n: v for n, v in fwd.EXPERTS.params.params.items() if n != "wfmt"})


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = fwd._inputs({**p, "wfmt": "dense"}, dtype, dist, rng)
    out["dout"] = dt.round_to(rng.standard_normal((p["t"], p["d"])), dtype)
    return out


def _golden(x: dict[str, np.ndarray], absolute: bool) -> dict[str, np.ndarray]:
    xs = x["x"]
    act = None if xs.dtype == np.float64 else xs.dtype  # a float64 view (a caller's own): act not rounded
    return ref.experts_backward(xs, x["ids"], x["weights"], x["w13"], x["w2"], x["dout"], ws13=x.get("ws13"),
                                ws2=x.get("ws2"), act_dtype=act, absolute=absolute)


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return _golden(x, False)


def _mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return _golden(x, True)


def grad_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, d, f, e, k, s = p["t"], p["d"], p["f"], p["e"], p["k"], p["shared"]
    shapes = {"dx": (t, d), "dweights": (t, k), "dw13": (e, 2 * f, d), "dw2": (e, d, f)}
    if s:
        shapes.update(dws13=(s, 2 * f, d), dws2=(s, d, f))
    return shapes


def _check(p: dict[str, Any]) -> str | None:
    if p["k"] > p["e"]:
        return f"k={p['k']} must be <= e={p['e']} (distinct experts a token)"
    return None


def _acc(p: dict[str, Any], output: str) -> int:
    """Reduction lengths back along the pipeline, on top of the forward's gate / up over D (a kernel recomputes
    them): dact0 sums over D; dx over 2F (the dx GEMM) then the k slots and S shared experts; dweights over F; the
    weight gradients over an expert's slots (at most T)."""
    t, d, f = p["t"], p["d"], p["f"]
    n = {"dx": 2 * d + 2 * f + p["k"] + p["shared"], "dweights": 2 * d + f}
    return n.get(output, 2 * d + t)


OUTPUTS = {
    "dx": Output("test", doc="sum over the token's slots of W13[e]^T dh, plus the shared experts'"),
    "dweights": Output("fp32", tol_dtype="test", doc="dout_t . y(t, e_j) = act_r . (W2[e]^T dout_t): the routing "
                       "weights' gradient (fp32, as the weights)"),
    "dw13": Output("fp32", tol_dtype="test", doc="sum over the expert's slots of dh (x) x_t, fp32 (0 for an expert "
                   "with no token)"),
    "dw2": Output("fp32", tol_dtype="test", doc="sum over the expert's slots of w dout_t (x) act_r, fp32 (0 for an "
                  "expert with no token)"),
    "dws13": Output("fp32", tol_dtype="test", doc="the shared experts' dW13 (every token, weight 1), fp32"),
    "dws2": Output("fp32", tol_dtype="test", doc="the shared experts' dW2 (every token, weight 1), fp32"),
}

# The eager baseline's tier (the torch backend only): autograd through HF Mixtral's loop in the model dtype
# (kernels/torch/moe_experts_grad.py). Besides act's rounding it rounds, per slot, dout times the routing weight
# (itself rounded to the model dtype), dact, silu'(g)'s parts, dgate, dup and each slot's dx partial (index_add's
# backward then a model-dtype sum over the slots), and each expert's weight gradient once (the matmul's output in
# the model dtype, widened to fp32 afterwards): ~2k + 6 roundings of u on dx, ~4 on each weight-gradient term.
# Measured worst elementwise |error| / max(|golden|, M) on the ci cases (9 fresh seeds, 207 runs): bf16 dx 4.8 u,
# dweights 4.0 u, dW13 6.9 u, dW2 5.6 u; fp16 dx 5.4 u, dweights 3.9 u, dW13 7.6 u, dW2 5.2 u (the production
# limits, 4.1 u / 2.05 u, fail it). rtol 12 u (bf16 4.7e-2, fp16 5.9e-3): 1.6x the worst; cos_diff 8 u^2 and nmse
# 16 u^2 (scaled by cond): at most 0.31 of them used (dweights, dW2). fp32 computes as a fused kernel does: no
# override (torch fp32 worst norm_err 0.47 at the production limits).
_U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
EAGER = Tier(
    reason="eager torch autograd (HF Mixtral's loop) computes the backward in the model dtype: the weighted "
           "cotangent, dact, dgate, dup, each slot's dx and each weight gradient round to bf16 / fp16 (where a fused "
           "kernel rounds act and dx only)",
    overrides=tuple(Override(f"{n}: eager autograd rounds every intermediate to u = 2^{int(np.log2(u))} (rtol 12 u: "
                             f"measured 7.6 u, dW13; cos_diff 8 u^2, as moe.experts' eager tier)", dtype=n, rtol=12 * u,
                             cos_diff=8 * u * u, nmse=16 * u * u)
                    for n, u in _U.items()),
)

EXPERTS_BACKWARD = OpSpec(
    name="moe.experts_backward",
    golden=ref.experts_backward,
    reference=_ref,
    params=PARAMS,
    make_inputs=_inputs,
    output_shapes=grad_shapes,
    outputs=OUTPUTS,
    tolerance=Tol(acc_len=_acc, baseline=EAGER, noise_k=3.0),
    dtypes=("fp32", "bf16", "fp16"),
    dists=fwd.DISTS,
    check=_check,
    magnitude=_mag,
    storage_inputs=frozenset({"x", "w13", "w2", "ws13", "ws2"}),
    flops=lambda p: 16.0 * p["t"] * (p["k"] + p["shared"]) * p["d"] * p["f"],
    doc="Backward of the fused MoE experts layer (dense SwiGLU experts): dx, the routing weights' gradient and the "
        "experts' (and shared experts') weight gradients in fp32, act rounded to the test dtype as the forward.",
)

SPECS = (EXPERTS_BACKWARD,)
