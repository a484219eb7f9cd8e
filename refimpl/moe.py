"""Golden mixture-of-experts routing, in float64 (issue 34's `moe` stem: its first op's reference).

    scores   = softmax(logits) over the E experts        (scoring="softmax": Mixtral, Qwen3-MoE)
             | sigmoid(logits)                          (scoring="sigmoid": DeepSeek-V3)
    select   = scores + bias                            (DeepSeek-V3's e_score_correction_bias; 0 without)
    groups   : the E experts in n_group contiguous groups of E / n_group; a group's score is the sum of its
               two largest `select` values with a bias, its largest without (DeepSeek-V3's inference code,
               vLLM's and SGLang's grouped_topk); the topk_group best groups stay, every other expert's
               `select` becomes `mask` (-inf: DeepSeek's inference/model.py, vLLM, SGLang; 0: Hugging
               Face's modeling_deepseek.py, where a masked expert can beat a kept one whose select < 0)
    ids      = the k experts of largest `select`
    weights  = scores[ids] (never the bias), divided by their sum when renormalize, times routed_scaling

Conventions (declared, since engines differ or leave them to torch.topk):
- Ties go to the lower index: among equal `select` values (and equal group scores) the lower expert (group)
  index ranks first. ids come in rank order (descending `select`, ties by index).
- A row's logits are finite (a -inf logit is an expert that can never win: scores 0 (softmax) or 0
  (sigmoid), allowed). renormalize with a zero sum (every chosen score 0) gives weights 0, not NaN.
- Everything in float64; `margin` is what a judge of fp32 kernels needs: per token, the smallest gap at a
  decision boundary, min(select_k - select_{k+1} among the kept experts, group_g - group_{g+1}); where it is
  below a kernel's rounding of `select`, either side of the boundary is a correct choice. +inf where no
  boundary exists (k = E, topk_group = n_group).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

SCORINGS = ("softmax", "sigmoid")
MASKS = ("-inf", "zero")


def _ranked(x: NDArray[np.float64]) -> NDArray[np.intp]:
    """Indices along the last axis in descending order of x, ties by the lower index (a stable sort of -x)."""
    return np.argsort(-x, axis=-1, kind="stable")


def _gap(x_sorted_desc: NDArray[np.float64], k: int) -> NDArray[np.float64]:
    """x[k - 1] - x[k] of each row sorted descending (+inf where there is no k-th element past the last)."""
    n = x_sorted_desc.shape[-1]
    if k >= n:
        return np.full(x_sorted_desc.shape[:-1], np.inf)
    with np.errstate(invalid="ignore"):
        gap = x_sorted_desc[..., k - 1] - x_sorted_desc[..., k]
    return np.where(np.isnan(gap), 0.0, gap)  # -inf - -inf: both sides masked, no decision


def route(logits: NDArray, k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: NDArray | None = None, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          mask: str = "-inf") -> tuple[NDArray[np.float64], NDArray[np.int32], NDArray[np.float64]]:
    """Top-k expert routing of each token.

    logits: (T, E) float router logits (finite or -inf)
    k: experts a token, 1 <= k <= E (and <= the experts the kept groups hold)
    scoring: "softmax" | "sigmoid"; renormalize: divide the k weights by their sum
    bias: (E,) float or None, added for the selection only
    n_group, topk_group: grouped selection (n_group divides E; 1 <= topk_group <= n_group); n_group 1: none
    routed_scaling: the weights' final factor (DeepSeek-V3: 2.5)
    mask: what a dropped group's experts' selection value becomes: "-inf" or "zero" (module docstring)
    returns (weights (T, k) float64, ids (T, k) int32 in rank order, margin (T,) float64)
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"moe.route: logits must be (T, E), got shape {x.shape}")
    T, E = x.shape
    if scoring not in SCORINGS:
        raise ValueError(f"moe.route: scoring={scoring!r} must be one of {', '.join(SCORINGS)}")
    if mask not in MASKS:
        raise ValueError(f"moe.route: mask={mask!r} must be one of {', '.join(MASKS)}")
    if not (isinstance(n_group, int) and n_group >= 1 and E % n_group == 0):
        raise ValueError(f"moe.route: n_group={n_group!r} must be a positive divisor of E={E}")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise ValueError(f"moe.route: topk_group={topk_group!r} must be in [1, n_group={n_group}]")
    if not (isinstance(k, int) and 1 <= k <= topk_group * (E // n_group)):
        raise ValueError(f"moe.route: k={k!r} must be in [1, {topk_group * (E // n_group)}] (the experts of the "
                         f"{topk_group} kept groups of {E // n_group})")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("moe.route: logits must be finite or -inf")
    if scoring == "softmax":
        m = np.max(x, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.exp(x - m)
        s = e.sum(axis=-1, keepdims=True)
        scores = np.divide(e, s, out=np.zeros_like(e), where=s > 0)
    else:
        with np.errstate(over="ignore"):
            scores = 1.0 / (1.0 + np.exp(-x))
    select = scores if bias is None else scores + np.asarray(bias, dtype=np.float64).reshape(1, E)
    margin = np.full(T, np.inf)
    if n_group > 1:
        grouped = select.reshape(T, n_group, E // n_group)
        if bias is not None:
            top2 = -np.sort(-grouped, axis=-1)[..., :2]
            gscore = top2.sum(axis=-1) if grouped.shape[-1] >= 2 else top2[..., 0]
        else:
            gscore = grouped.max(axis=-1)
        gorder = _ranked(gscore)
        margin = np.minimum(margin, _gap(np.take_along_axis(gscore, gorder, axis=-1), topk_group))
        keep = np.zeros((T, n_group), dtype=bool)
        np.put_along_axis(keep, gorder[:, :topk_group], True, axis=-1)
        fill = -np.inf if mask == "-inf" else 0.0
        select = np.where(np.repeat(keep, E // n_group, axis=-1), select, fill)
    order = _ranked(select)
    ids = order[:, :k]
    margin = np.minimum(margin, _gap(np.take_along_axis(select, order, axis=-1), k))
    weights = np.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        tot = weights.sum(axis=-1, keepdims=True)
        weights = np.divide(weights, tot, out=np.zeros_like(weights), where=tot > 0)
    return weights * float(routed_scaling), ids.astype(np.int32), margin


# The family's other goldens live in their own modules (one op each), re-exported here: refimpl.moe.<op> is the golden
from kernel_parity.refimpl.moe_align import align  # noqa: E402,F401  (moe.align)
from kernel_parity.refimpl.moe_experts import experts  # noqa: E402,F401  (moe.experts)
from kernel_parity.refimpl.moe_grad import route_backward  # noqa: E402,F401  (moe.route_backward)
from kernel_parity.refimpl.moe_experts_grad import experts_backward  # noqa: E402,F401  (moe.experts_backward)
from kernel_parity.refimpl.moe_layer import layer  # noqa: E402,F401  (moe.layer)
