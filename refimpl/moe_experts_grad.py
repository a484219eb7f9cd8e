"""Golden backward of the fused mixture-of-experts layer (`moe.experts_backward`, issue 34), in float64.

The forward (refimpl/moe_experts.py, dense weights):
    out[t] = sum_j w[t, j] y(t, e_j)  +  sum_s ys(t, s),   y(t, e) = W2[e] act_r,  act_r = rnd(silu(g) * u)
    g = G_e x_t, u = U_e x_t  (G_e = W13[e][0:F], U_e = W13[e][F:2F]: vLLM's w13, gate first)
Given the cotangent dout (T, D) of out, its VJP:
    dact0 = W2[e]^T dout_t                      (F,) the unweighted gradient of act
    dweights[t, j] = dout_t . y(t, e_j) = act_r . dact0        (the routing weights' gradient: moe.route_backward's
                                                                grad_w)
    dact = w[t, j] dact0;  dgate = dact u silu'(g),  dup = dact silu(g),  dh = (dgate | dup)  (2F,)
    dx[t] = sum_j W13[e_j]^T dh(t, j)  +  the shared experts' (weight 1)
    dW13[e] = sum over e's slots of dh (x) x_t          (2F, D)
    dW2[e]  = sum over e's slots of (w dout_t) (x) act_r  (D, F)
    dWs13[s], dWs2[s] the same over every token at weight 1.

Conventions (declared):
- act's rounding (`act_dtype`, the forward's one production cast) is recomputed and its value act_r is what y,
  dweights and dW2 read; the chain rule passes through it as the identity (straight-through: rnd has no useful
  derivative; autograd through a cast does the same). Nothing else is rounded: dact, dh and the weighted cotangent
  w dout are exact here (a kernel keeps them in fp32, or splits them into two 16-bit parts for a 16-bit GEMM).
- An expert no slot chose has dW13 = dW2 = 0 exactly (nothing sums into it).
- ids may repeat within a token (each slot counts); the op's inputs never do.
- Vectorised by expert: the token slots grouped by expert (a stable sort of the flat ids), each present expert's
  rows gathered and its products taken at once, dx scattered back with np.add.at; weights widened to float64 one
  expert at a time (as the forward's golden).

Error model (`absolute=True`; refimpl/blocks.py mlp_backward's rules, on the forward's magnitudes): every
quantity carries a squared magnitude M^2 and the length n of the sums its error grew over; a computed operand v of
a stage that sums `own` terms enters blended, blend(v) = max(v^2, (own v^2 + n M^2) / (own + n)) (never below its
own square, as the forward's act):
    gate, up: M_g^2 = x^2 @ (G^2)^T, M_u^2 = x^2 @ (U^2)^T (n = D);  act, act_r: the forward's (`experts`)
    dact0:    dout^2 @ W2^2 (n = D; dout and W2 exact);  dact = w dact0 (w exact)
    dgate:    (dgate^2 + D M_dact^2 (u s')^2 + D (M_u^2 (dact s')^2 + M_g^2 (dact u s'')^2)) / (1 + 3D)
    dup:      (dup^2 + D M_dact^2 s^2 + D M_g^2 (dact s')^2) / (1 + 2D)       (s = silu(g), s' = silu', s'' = silu'')
    dx:       sum over the token's slots of blend(dh, own 2F) @ W13^2, plus the shared experts'
    dweights: sum_f blend(act_r, own F) blend(dact0, own F)  (at least the square of each term act_r dact0, so one
              code flip of act_r, <= 2 u |act_r dact0|, is within 2 u M)
    dW13:     blend(dh, own n_e)^T @ x^2 over the expert's n_e slots
    dW2:      (w^2 dout^2)^T @ blend(act_r, own n_e)
M >= the RSS of each output's terms (every blend is at least its operand's square), so the forward's code flips of
act_r stay within 2 u M on dweights and dW2, as on the forward's out.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.moe_experts import _check, _round, _silu_parts
from kernel_parity.refimpl.threads import on_threads

F64 = NDArray[np.float64]
GRADS = ("dx", "dweights", "dw13", "dw2", "dws13", "dws2")


def _silu2(g: F64) -> F64:
    """silu''(g) = s(g) (1 - s(g)) (2 + g (1 - 2 s(g)))."""
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-g))
    return s * (1.0 - s) * (2.0 + g * (1.0 - 2.0 * s))


def _blend(v: F64, m2: F64, n: float, own: float) -> F64:
    """A computed operand v (squared magnitude m2 over n terms) of a stage summing `own` terms, in squared form,
    never below v^2: (own v^2 + n m2) / (own + n), at least v^2 (the output's M at least the RSS of its terms)."""
    return np.maximum(v * v, (own * v * v + n * m2) / (own + n))


def _expert_grad(xs: F64, dys: F64, wt: F64, w13: NDArray, w2: NDArray, act_dtype,
                 absolute: bool) -> tuple[F64, F64, F64, F64]:
    """One expert's backward over its gathered slots: (dx rows (n, D), dweights (n,), dW13 (2F, D), dW2 (D, F)),
    or their squared magnitudes. xs, dys: the slots' x and dout rows (n, D); wt: their routing weights (n,)."""
    w13 = np.asarray(w13, dtype=np.float64)
    w2 = np.asarray(w2, dtype=np.float64)
    f, d, n = w13.shape[0] // 2, xs.shape[1], xs.shape[0]
    h = xs @ w13.T
    g, u = h[:, :f], h[:, f:]
    sg, s1 = _silu_parts(g)
    act = sg * u
    act_r = _round(act, act_dtype)
    dact0 = dys @ w2
    dact = wt[:, None] * dact0
    dgate, dup = dact * u * s1, dact * sg
    dh = np.concatenate([dgate, dup], axis=1)
    if not absolute:
        return dh @ w13, np.sum(act_r * dact0, axis=1), dh.T @ xs, (wt[:, None] * dys).T @ act_r
    x2, w13sq, w2sq = xs * xs, w13 * w13, w2 * w2
    mg2, mu2 = x2 @ w13sq[:f].T, x2 @ w13sq[f:].T
    big_l = 1.0 + 2.0 * d
    act2 = (act * act + d * (s1 * u) ** 2 * mg2 + d * sg * sg * mu2) / big_l  # the forward's
    md2 = (dys * dys) @ w2sq
    dam2 = (wt * wt)[:, None] * md2
    s2 = _silu2(g)
    dgs = (dgate * dgate + d * dam2 * (u * s1) ** 2 + d * (mu2 * (dact * s1) ** 2 + mg2 * (dact * u * s2) ** 2)) \
        / (1.0 + 3.0 * d)
    dus = (dup * dup + d * dam2 * sg * sg + d * mg2 * (dact * s1) ** 2) / (1.0 + 2.0 * d)
    dhm, n_dh = np.concatenate([dgs, dus], axis=1), 1.0 + 3.0 * d
    dx2 = _blend(dh, dhm, n_dh, 2.0 * f) @ w13sq
    dwt2 = np.sum(_blend(act_r, act2, big_l, float(f)) * _blend(dact0, md2, float(d), float(f)), axis=1)
    dw13 = _blend(dh, dhm, n_dh, float(n)).T @ x2
    dw2 = ((wt * wt)[:, None] * dys * dys).T @ _blend(act_r, act2, big_l, float(n))
    return dx2, dwt2, dw13, dw2


def experts_backward(x: NDArray, ids: NDArray, weights: NDArray, w13: NDArray, w2: NDArray, dout: NDArray, *,
                     ws13: NDArray | None = None, ws2: NDArray | None = None, act_dtype=None,
                     absolute: bool = False) -> dict[str, F64]:
    """The VJP of refimpl.moe_experts.experts for the cotangent dout of its output (module docstring).

    x: (T, D);  ids: (T, k) integers in [0, E);  weights: (T, k) routing weights;  w13: (E, 2F, D);  w2: (E, D, F)
    dout: (T, D);  ws13: (S, 2Fs, D), ws2: (S, D, Fs) the shared experts, or None;  act_dtype: as `experts`
    returns {"dx": (T, D), "dweights": (T, k), "dw13": (E, 2F, D), "dw2": (E, D, F)} and, with shared experts,
    "dws13": (S, 2Fs, D), "dws2": (S, D, Fs), float64; absolute: the error model's magnitudes instead
    """
    x = np.asarray(x, dtype=np.float64)
    ids = np.asarray(ids)
    weights = np.asarray(weights, dtype=np.float64)
    _check(x, ids, weights, w13, w2, ws13, ws2)
    dout = np.asarray(dout, dtype=np.float64)
    if dout.shape != x.shape:
        raise ValueError(f"moe.experts_backward: dout must have x's shape {x.shape}, got {dout.shape}")
    t, d = x.shape
    k = ids.shape[1]
    e_n, f2, _ = np.shape(w13)
    dx = np.zeros((t, d))
    dwt = np.zeros(t * k)
    dw13 = np.zeros((e_n, f2, d))
    dw2 = np.zeros((e_n, d, f2 // 2))
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    present, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)
    wflat = weights.reshape(-1)
    def one(i: int) -> F64:  # a product per present expert, never a loop over tokens; its own slices written
        e, slots = present[i], order[bounds[i]:bounds[i + 1]]
        toks = slots // k
        gx, dwt[slots], dw13[e], dw2[e] = _expert_grad(x[toks], dout[toks], wflat[slots], w13[e], w2[e], act_dtype,
                                                       absolute)
        return gx

    # the experts on threads (as `experts`), dx summed in expert order: the same bits whatever the thread count
    for i, gx in enumerate(on_threads(one, range(len(present)))):
        np.add.at(dx, order[bounds[i]:bounds[i + 1]] // k, gx)
    out = {"dx": dx, "dweights": dwt.reshape(t, k), "dw13": dw13, "dw2": dw2}
    if ws13 is not None:
        s_n, fs2, _ = np.shape(ws13)
        out["dws13"], out["dws2"] = np.zeros((s_n, fs2, d)), np.zeros((s_n, d, fs2 // 2))
        ones = np.ones(t)
        for s in range(s_n):
            gx, _, g13, g2 = _expert_grad(x, dout, ones, ws13[s], ws2[s], act_dtype, absolute)
            dx += gx
            out["dws13"][s], out["dws2"][s] = g13, g2
    if absolute:
        return {name: np.sqrt(v) for name, v in out.items()}
    return out
