"""Golden mixture-of-experts layer end to end (`moe.layer`, issue 34), in float64: router GEMM, routing, experts.

    logits          = x @ Wg^T                                       (the router GEMM; Wg (E, D))
    weights, ids    = route(logits, k, scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask)
    out             = experts(x, ids, weights, w13, w2, ws13, ws2, act_dtype)

route is moe.route's golden (refimpl/moe.py `route`), experts moe.experts' (refimpl/moe_experts.py `experts`):
this module composes them and adds the router GEMM, nothing else.

Conventions (declared):
- The logits are fp32 (the declared path): the router GEMM reads x and Wg in the model dtype, accumulates in
  fp32 and keeps its fp32 result; routing scores them in fp32 (moe.route's kernels). Serving engines differ here:
  vLLM's and Hugging Face's Mixtral / Qwen3-MoE gates round the logits to the model dtype (a bf16 linear) before
  an fp32 softmax, while DeepSeek's own modeling_deepseek.py MoEGate and Hugging Face's DeepseekV3TopkRouter keep
  them fp32 (F.linear on fp32 casts of x and Wg: the products of bf16 / fp16 values exact in fp32). The golden
  computes them in float64 from the stored x and Wg (exact) and never rounds them: a kernel that rounds its logits
  to bf16 does not implement this op.
- Every production cast of moe.experts applies unchanged (act rounded to `act_dtype` before the down projection),
  and so do moe.route's conventions (ties to the lower index; ids in rank order).
- The routing weights enter the experts unrounded (float64 here, fp32 in the kernels: moe.experts' weights input).

Error model (what judges fp32 / bf16 / fp16 kernels; conformance/ops/moe_layer.py uses it):
- logits: a kernel's fp32 router GEMM is off by at most r_g max(|l_e|, M_e) per logit, M_e = sqrt(sum_d x_d^2
  Wg[e, d]^2) the root-sum-square of its terms and r_g = rtol32 + eps32 sqrt(D): gemm.gemm_nt's fp32 limit
  (conformance/ops/gemm.py: an fp32 dot product of length D against max(|C|, its RSS magnitude)). `logit_scale`
  gives m_e = max(|l_e|, M_e); the bound is r_g m_e.
- routing weights: functions of the logits. Their first-order sensitivity to logit errors of at most r_g m_e is
  r_g G_j, G_j = sum_e |dw_j / dl_e| m_e (`weight_sensitivity`):
      softmax, renormalised (w_j = c softmax over the chosen):
          G_j = w_j ((1 - w_j / c) m_j + sum_{i != j} (w_i / c) m_i)
      softmax, raw (w_j = c s_j):            G_j = c s_j ((1 - s_j) m_j + sum_{e != j} s_e m_e)
      sigmoid, raw (w_j = c s_j):            G_j = c s_j (1 - s_j) m_j
      sigmoid, renormalised (w_j = c s_j / S, S = sum_chosen s):
          G_j = (c / S) (s'_j (1 - s_j / S) m_j + (s_j / S) sum_{i != j} s'_i m_i)
  with s' = s (1 - s), i over the chosen experts (the others move no renormalised weight).
- the choice: the selection values sel_e = s_e (+ bias_e) move by at most r_g H_e, H_e = sum_e' |dsel_e / dl_e'| m_e'
  (`select_sensitivity`: softmax s_e ((1 - s_e) m_e + sum_{e' != e} s_e' m_e'), sigmoid s_e (1 - s_e) m_e). A
  boundary (the k-th against the (k+1)-th selection value, or a group score, the sum of two of them, against the
  next group's) moves by at most 4 r_g max_e H_e; a token whose golden margin (moe.route's third output) exceeds
  that many times over has one right choice, the golden's (conformance/ops/moe_layer.py draws only such tokens).
- out: moe.experts' magnitude (refimpl/moe_experts.py `absolute`) plus the routing weights' part, r_g sum_j G_j
  |y_j| with y_j = E_{ids_j}(x) the slot's expert output (`weight_part`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.moe_experts import experts

F64 = NDArray[np.float64]


def _route():
    """moe.route's golden (refimpl/moe.py): imported at call time, since refimpl/moe.py re-exports this module."""
    from kernel_parity.refimpl.moe import route

    return route


def router_logits(x: NDArray, wg: NDArray) -> F64:
    """logits (T, E) = x (T, D) @ Wg (E, D)^T in float64 (exact inputs, never rounded)."""
    x = np.asarray(x, dtype=np.float64)
    wg = np.asarray(wg, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"moe.layer: x must be (T, D), got shape {x.shape}")
    if wg.ndim != 2 or wg.shape[1] != x.shape[1]:
        raise ValueError(f"moe.layer: wg must be (E, D={x.shape[1]}), got shape {wg.shape}")
    return x @ wg.T


def logit_scale(x: NDArray, wg: NDArray) -> F64:
    """m (T, E) = max(|l|, M), M = sqrt(x^2 @ (Wg^2)^T): what the router GEMM's rounding errors scale with."""
    x = np.asarray(x, dtype=np.float64)
    wg = np.asarray(wg, dtype=np.float64)
    return np.maximum(np.abs(x @ wg.T), np.sqrt((x * x) @ (wg * wg).T))


def scores(logits: NDArray, scoring: str) -> F64:
    """softmax (over the E experts) or sigmoid scores of logits (T, E), float64."""
    logits = np.asarray(logits, dtype=np.float64)
    if scoring == "softmax":
        m = logits.max(axis=-1, keepdims=True)
        e = np.exp(logits - m)
        return e / e.sum(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-logits))


def select_sensitivity(logits: NDArray, m: NDArray, scoring: str) -> F64:
    """H (T, E) = sum_e' |dsel_e / dl_e'| m_e' (module docstring): a selection value's first-order move per unit
    of relative logit error."""
    s = scores(np.asarray(logits, dtype=np.float64), scoring)
    m = np.asarray(m, dtype=np.float64)
    if scoring == "softmax":
        tot = (s * m).sum(axis=-1, keepdims=True)
        return s * ((1.0 - s) * m + (tot - s * m))
    return s * (1.0 - s) * m


def weight_sensitivity(logits: NDArray, ids: NDArray, m: NDArray, scoring: str, renormalize: bool,
                       routed_scaling: float) -> F64:
    """G (T, k) = sum_e |dw_j / dl_e| m_e for the chosen experts ids (T, k) (module docstring)."""
    logits = np.asarray(logits, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    ids = np.asarray(ids).astype(np.int64)
    c = abs(float(routed_scaling))
    s = scores(logits, scoring)
    sj = np.take_along_axis(s, ids, axis=-1)
    mj = np.take_along_axis(m, ids, axis=-1)
    if scoring == "softmax":
        if renormalize:
            tot = sj.sum(axis=-1, keepdims=True)
            w = np.divide(sj, tot, out=np.zeros_like(sj), where=tot > 0)  # the renormalised weights / c
            return c * w * ((1.0 - w) * mj + ((w * mj).sum(axis=-1, keepdims=True) - w * mj))
        tot = (s * m).sum(axis=-1, keepdims=True)
        return c * sj * ((1.0 - sj) * mj + (tot - sj * mj))
    d = sj * (1.0 - sj)  # sigmoid'
    if not renormalize:
        return c * d * mj
    S = sj.sum(axis=-1, keepdims=True)
    safe = np.where(S > 0, S, 1.0)
    r = sj / safe
    others = (d * mj).sum(axis=-1, keepdims=True) - d * mj
    return np.where(S > 0, (c / safe) * (d * (1.0 - r) * mj + r * others), 0.0)


def weight_part(x: NDArray, ids: NDArray, g: NDArray, w13: NDArray, w2: NDArray, act_dtype=None) -> F64:
    """sum_j g_j |y_j| (T, D), y_j = E_{ids_j}(x) the slot's expert output (act rounded to act_dtype as in the
    golden): one moe.experts golden call over the T k slots, each its own row of weight g_j."""
    x = np.asarray(x)
    t, k = np.shape(ids)
    xs = np.repeat(x, k, axis=0)  # slot t k + j reads token t
    ys = experts(xs, np.asarray(ids).reshape(t * k, 1), np.asarray(g, dtype=np.float64).reshape(t * k, 1), w13, w2,
                 act_dtype=act_dtype)
    return np.abs(ys).reshape(t, k, -1).sum(axis=1)


def layer(x: NDArray, wg: NDArray, w13: NDArray, w2: NDArray, k: int, *, scoring: str = "softmax",
          renormalize: bool = True, bias: NDArray | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling: float = 1.0, mask: str = "-inf", ws13: NDArray | None = None, ws2: NDArray | None = None,
          act_dtype=None) -> tuple[F64, F64, NDArray[np.int32], F64]:
    """The MoE layer of each token of x.

    x: (T, D) float (bf16 / fp16 / fp32 as stored, or float64); wg: (E, D) the router weights; w13 (E, 2F, D), w2
    (E, D, F) the routed experts, ws13 (S, 2Fs, D), ws2 (S, D, Fs) the shared ones or None (refimpl/moe_experts.py)
    k and the routing keywords: refimpl/moe.py `route`; act_dtype: refimpl/moe_experts.py `experts`
    returns (out (T, D) float64, weights (T, k) float64, ids (T, k) int32 in rank order, margin (T,) float64: the
    routing decision's margin, moe.route's)
    """
    logits = router_logits(x, wg)
    if np.shape(w13)[0] != logits.shape[1]:
        raise ValueError(f"moe.layer: w13 must hold the router's E={logits.shape[1]} experts, got shape "
                         f"{np.shape(w13)}")
    weights, ids, margin = _route()(logits, k, scoring=scoring, renormalize=renormalize, bias=bias, n_group=n_group,
                                    topk_group=topk_group, routed_scaling=routed_scaling, mask=mask)
    out = experts(x, ids, weights, w13, w2, ws13=ws13, ws2=ws2, act_dtype=act_dtype)
    return out, weights, ids, margin
