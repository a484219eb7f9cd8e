"""Golden backward of mixture-of-experts routing weights, in float64 (issue 34: `moe.route_backward`).

The forward (refimpl/moe.py `route`) gives each token the weights of its k chosen experts:

    s        = softmax(l) | sigmoid(l)                       over the E experts
    w_j      = c s[ids_j] / S,  S = sum_j s[ids_j]            (renormalize; else w_j = c s[ids_j])

with c the routed scaling. The choice of ids is piecewise constant in the logits, so it carries no
gradient, and the bias (used for the choice only) gets none; the grouping (n_group, topk_group, mask)
only shapes the choice, so given the ids it changes nothing here. With the forward's ids held fixed,
the VJP of the weights' cotangent grad_w (T, k) is (what torch autograd computes through Hugging
Face's Mixtral / DeepSeek-V3 routers):

    g_s[ids_j] = c (grad_w_j / S - D / S^2),  D = sum_m grad_w_m s[ids_m]    (renormalize)
               | c grad_w_j                                                   (else)
    g_s        = 0 at the unchosen experts
    grad_l     = s (g_s - r),  r = sum_i g_s,i s_i                            (softmax)
               | g_s s (1 - s)                                                (sigmoid)

Conventions (declared):
- softmax with renormalize: r = c (D / S - D S / S^2) = 0 by algebra (the weights are the softmax of
  the chosen logits alone), and the golden uses r = 0: every unchosen expert's gradient is exactly 0
  and the chosen ones carry no float64 cancellation.
- sigmoid's 1 - s is sigmoid(-l), evaluated as such (1 - s in float64 would be 0 past l = 37).
- ids are the forward's (any order of a token's k slots; grad_w in the same order), distinct per token
  and in [0, E); the golden refuses duplicates (the forward never makes them). k follows from ids.
- A row's logits are finite or -inf (an expert that can never win: score 0, gradient 0). renormalize
  with S = 0 (every chosen score 0) gave weights 0 in the forward (a constant): its gradient is 0.
- The routing parameters are checked as the forward checks them (k against the kept groups' experts).

`route_backward_error_model` gives the magnitudes the rounding errors of an fp32 kernel scale with
(conformance/tolerance.py's error model): the same computation on root-sum-squares of the terms, and
sigmoid's compute term (1 - s taken from an fp32 s carries ~u32 |g_s| s whatever its size).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

SCORINGS = ("softmax", "sigmoid")
MASKS = ("-inf", "zero")
SIGMOID_ROUNDINGS = 3.0  # an fp32 sigmoid's roundings near s = 1: exp, 1 + e, the division


def _check(x: NDArray[np.float64], ids: NDArray, grad_w: NDArray, scoring: str, bias, n_group, topk_group,
           mask) -> tuple[NDArray[np.intp], NDArray[np.float64]]:
    if x.ndim != 2:
        raise ValueError(f"moe.route_backward: logits must be (T, E), got shape {x.shape}")
    T, E = x.shape
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] != T or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"moe.route_backward: ids must be ({T}, k) integers, got {ids.dtype} {ids.shape}")
    k = ids.shape[1]
    g = np.asarray(grad_w, dtype=np.float64)
    if g.shape != (T, k):
        raise ValueError(f"moe.route_backward: grad_w must be ({T}, {k}) like ids, got shape {g.shape}")
    if scoring not in SCORINGS:
        raise ValueError(f"moe.route_backward: scoring={scoring!r} must be one of {', '.join(SCORINGS)}")
    if mask not in MASKS:
        raise ValueError(f"moe.route_backward: mask={mask!r} must be one of {', '.join(MASKS)}")
    if not (isinstance(n_group, int) and n_group >= 1 and E % n_group == 0):
        raise ValueError(f"moe.route_backward: n_group={n_group!r} must be a positive divisor of E={E}")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise ValueError(f"moe.route_backward: topk_group={topk_group!r} must be in [1, n_group={n_group}]")
    if not 1 <= k <= topk_group * (E // n_group):
        raise ValueError(f"moe.route_backward: k={k} (ids' columns) must be in [1, {topk_group * (E // n_group)}] "
                         f"(the experts of the {topk_group} kept groups of {E // n_group})")
    if bias is not None and np.shape(bias) != (E,):
        raise ValueError(f"moe.route_backward: bias must be ({E},), got shape {np.shape(bias)}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("moe.route_backward: logits must be finite or -inf")
    if not np.isfinite(g).all():
        raise ValueError("moe.route_backward: grad_w must be finite")
    if T and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"moe.route_backward: ids must be in [0, {E}), got [{ids.min()}, {ids.max()}]")
    if T and k > 1 and (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any():
        raise ValueError("moe.route_backward: a token's ids must be distinct (the forward's choice)")
    return ids.astype(np.intp), g


def _scores(x: NDArray[np.float64], scoring: str) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(s, 1 - s): softmax as the forward golden; sigmoid and its complement each without cancellation."""
    if scoring == "softmax":
        m = np.max(x, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.exp(x - m)
        tot = e.sum(axis=-1, keepdims=True)
        s = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
        return s, 1.0 - s
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x)), 1.0 / (1.0 + np.exp(x))


def _chosen_grad(sc: NDArray[np.float64], g: NDArray[np.float64], renormalize: bool, c: float,
                 rss: bool) -> NDArray[np.float64]:
    """g_s at the k chosen experts (T, k); rss: the root-sum-square magnitude of its terms instead."""
    if not renormalize:
        return c * (np.abs(g) if rss else g)
    S = sc.sum(axis=-1, keepdims=True)
    ok = S > 0
    Sd = np.where(ok, S, 1.0)
    if rss:
        D = np.sqrt(np.sum(np.square(g * sc), axis=-1, keepdims=True))
        out = c * np.hypot(g / Sd, D / (Sd * Sd))
    else:
        p = sc / Sd  # the renormalised weights / c: (grad_w_j - sum_m grad_w_m p_m) / S, exactly 0 at k = 1
        out = c * (g - np.sum(g * p, axis=-1, keepdims=True)) / Sd
    return np.where(ok, out, 0.0)


def route_backward(logits: NDArray, ids: NDArray, grad_w: NDArray, *, scoring: str = "softmax",
                   renormalize: bool = True, bias: NDArray | None = None, n_group: int = 1, topk_group: int = 1,
                   routed_scaling: float = 1.0, mask: str = "-inf") -> NDArray[np.float64]:
    """The gradient of the routing weights' loss with respect to the router logits (module docstring).

    logits: (T, E) float router logits (finite or -inf); ids: (T, k) int, the forward's experts (distinct);
    grad_w: (T, k) float, the cotangent of the forward's weights, in the order of ids
    scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask: the forward's (refimpl/moe.py
    `route`); bias and the grouping are checked and take no part (the choice is given)
    returns grad_logits (T, E) float64
    """
    x = np.asarray(logits, dtype=np.float64)
    idx, g = _check(x, ids, grad_w, scoring, bias, n_group, topk_group, mask)
    s, q = _scores(x, scoring)
    sc = np.take_along_axis(s, idx, axis=-1)
    gs = np.zeros_like(s)
    np.put_along_axis(gs, idx, _chosen_grad(sc, g, bool(renormalize), float(routed_scaling), False), axis=-1)
    if scoring == "sigmoid":
        return gs * s * q
    if renormalize:
        return s * gs  # r = 0 by algebra (module docstring)
    r = np.sum(gs * s, axis=-1, keepdims=True)
    return s * (gs - r)


def route_backward_error_model(logits: NDArray, ids: NDArray, grad_w: NDArray, *, scoring: str = "softmax",
                               renormalize: bool = True, bias: NDArray | None = None, n_group: int = 1,
                               topk_group: int = 1, routed_scaling: float = 1.0, mask: str = "-inf"
                               ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(magnitude, compute) of each gradient element, (T, E) float64 each, for conformance/tolerance.py.

    magnitude: route_backward's computation on the root-sum-squares of the terms it sums, as an fp32
    kernel that follows the general formulas rounds them: |g_s,j| -> c sqrt((grad_w_j / S)^2 +
    (|D| / S^2)^2) with |D| = sqrt(sum (grad_w_m s_m)^2); softmax s_i sqrt(|g_s,i|^2 + |r|^2), |r| =
    sqrt(sum (|g_s,i| s_i)^2) (also with renormalize, where r is 0 exactly but an fp32 kernel's is its
    rounding, ~u32 |r|: so every expert of such a row, unchosen included, is judged against s_i |r|);
    sigmoid |g_s| s (1 - s).
    compute: sigmoid SIGMOID_ROUNDINGS |g_s| s: an fp32 kernel's 1 - s taken from its fp32 s (torch
    autograd's sigmoid backward is grad y (1 - y)) carries s's rounding however small 1 - s is, up to a
    u32 for each of the roundings of 1 / (1 + exp(-l)) near s = 1 (exp, the sum, the division).
    softmax: magnitude x the reach of the scores that element is made of: an fp32 exp(l_i - max l) of
    the rounded difference is off by up to u32 |l_i - max l| relative (torch's softmax, moe.c's expf):
    the element's own score (|l_i - max l|), the chosen ones' through S, D and r (their largest), and
    the row sum's, which every score shares (sum_i s_i |l_i - max l|).
    """
    x = np.asarray(logits, dtype=np.float64)
    idx, g = _check(x, ids, grad_w, scoring, bias, n_group, topk_group, mask)
    s, q = _scores(x, scoring)
    sc = np.take_along_axis(s, idx, axis=-1)
    a = np.zeros_like(s)
    np.put_along_axis(a, idx, _chosen_grad(sc, g, bool(renormalize), float(routed_scaling), True), axis=-1)
    if scoring == "sigmoid":
        return a * s * q, SIGMOID_ROUNDINGS * a * s
    r = np.sqrt(np.sum(np.square(a * s), axis=-1, keepdims=True))
    mag = s * np.hypot(a, r)
    fin = np.isfinite(x)
    m = np.max(x, axis=-1, keepdims=True) if x.shape[-1] else np.zeros((x.shape[0], 1))
    with np.errstate(invalid="ignore"):  # a row of all -inf: -inf - -inf, not taken
        own = np.where(fin, m - x, 0.0)  # each score's reach |l_i - max l| (0 for -inf: its score and terms are 0)
    chosen = np.take_along_axis(own, idx, axis=-1).max(axis=-1, keepdims=True) if idx.shape[-1] else 0.0
    mean = np.sum(s * own, axis=-1, keepdims=True)  # the row sum's relative error, shared by every score
    return mag, mag * (own + chosen + mean)
