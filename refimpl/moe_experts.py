"""Golden fused mixture-of-experts layer over routed tokens (`moe.experts`, issue 34), in float64.

    out[t] = sum_j weights[t, j] * E_{ids[t, j]}(x[t])  +  sum_s S_s(x[t])
    E_e(x) = W2[e] @ act,  act = silu(G_e x) * (U_e x),  silu(g) = g / (1 + exp(-g))
    G_e = W13[e][0:F], U_e = W13[e][F:2F]   (vLLM's w13 layout: silu_and_mul takes the first half as the gate)
    S_s    the shared experts (DeepSeek-V3's shared expert), the same MLP on ws13[s], ws2[s], weight 1, every token

Conventions (declared):
- ids may repeat within a token (each slot counts, as vLLM's fused_moe sums them); the op's inputs never do.
- Weights arrive dense (a spec dequantizes int4 / fp8 exactly before calling); they may come in their storage
  dtype (bf16 / fp16 / fp32): each expert's matrices are widened to float64 only when its tokens are gathered,
  so a model-size layer (DeepSeek-V3: 256 x 2 x 2048 x 7168 weights) never exists as one float64 copy.
- Vectorised by expert: the token slots are grouped by expert (a stable sort of the flat ids), each present
  expert's tokens gathered and multiplied in one product, the weighted results scattered back with np.add.at.

Production casts (what every engine does between the two GEMMs, and what it does not):
- applied, `act_dtype`: the SwiGLU output act is rounded to the activation dtype before the down projection
  (vLLM's intermediate_cache2 is in the activation dtype; a 16-bit tl.dot needs 16-bit operands; the eager
  HF loop holds it in the model dtype). float32 for an fp32 layer. The golden computes act in float64 and
  rounds it once (RNE); a kernel's fp32 act rounds to the other neighbour only where its fp32 error crosses a
  rounding midpoint (a "code flip": one ulp of act, <= 2 u |act_f| for the unit roundoff u of act_dtype, on
  one term of the down projection's sum, which the error model's magnitude holds: see `absolute`).
- not applied: the rounding of the gate / up GEMM output (vLLM's intermediate_cache1 when SwiGLU is not fused
  in the GEMM's epilogue), of each slot's expert output before the sum over k (vLLM's intermediate_cache3 and
  moe_sum), of the routing weights to the model dtype, and of the eager loop's index_add in the model dtype.
  Our fused kernels keep those in fp32 (gate / up, the weighted slot outputs, their sum) and round `out` once;
  the eager torch baseline rounds them all and is judged in its own tier (conformance/ops/moe_experts.py).

Error model (`absolute=True`; conformance/tolerance.py layer 3, refimpl/blocks.py's rules): the magnitude M of
out, what a kernel's rounding errors scale with, stage by stage in squared form:
    gate, up:  M_g^2 = x^2 @ (G^2)^T, M_u^2 = x^2 @ (U^2)^T        (x as stored: exact; own length D)
    act:       (act^2 + D (silu'(g) u)^2 M_g^2 + D silu(g)^2 M_u^2) / (1 + 2D)    (a product of computed factors;
               length L = 1 + 2D)
    y_e:       c @ (W2^2)^T, c = max(act_r^2, (F act_r^2 + L act^2_blended) / (F + L))   (act_r: act as rounded;
               the max keeps M at least the RSS of the down projection's terms where |g| exceeds M_g)
    out:       sum_j weights_j^2 M_{y_j}^2 + sum_s M_{S_s}^2                      (the weights exact inputs)
M >= the RSS of the down projection's terms, so one code flip of act (<= 2 u |w W2[d, f] act_f|, a single
term) stays within 2 u M: bf16's rtol 1.6e-2 is 4.1 u, fp16's 1e-3 is 2.05 u.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def _silu_parts(g: F64) -> tuple[F64, F64]:
    """(silu(g), silu'(g)) in float64: g s(g) and s(g) (1 + g (1 - s(g))), s the logistic sigmoid."""
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s * (1.0 + g * (1.0 - s))


def _round(a: F64, act_dtype) -> F64:
    if act_dtype is None:
        return a
    with np.errstate(over="ignore"):
        return np.asarray(a).astype(act_dtype).astype(np.float64)


def _mlp(xs: F64, w13: NDArray, w2: NDArray, act_dtype, absolute: bool) -> F64:
    """One expert's SwiGLU MLP over the gathered rows xs (n, D): its output (n, D), or its magnitude squared."""
    w13 = np.asarray(w13, dtype=np.float64)
    w2 = np.asarray(w2, dtype=np.float64)
    f = w13.shape[0] // 2
    d = xs.shape[1]
    h = xs @ w13.T
    g, u = h[:, :f], h[:, f:]
    sg, dsg = _silu_parts(g)
    act = sg * u
    act_r = _round(act, act_dtype)
    if not absolute:
        return act_r @ w2.T
    x2, w13sq = xs * xs, w13 * w13
    mg2, mu2 = x2 @ w13sq[:f].T, x2 @ w13sq[f:].T
    big_l = 1.0 + 2.0 * d
    act2 = (act * act + d * (dsg * u) ** 2 * mg2 + d * sg * sg * mu2) / big_l
    a2 = act_r * act_r
    c = np.maximum(a2, (f * a2 + big_l * act2) / (f + big_l))  # never below act's own square (module docstring)
    return c @ (w2 * w2).T


def _check(x: F64, ids: NDArray, weights: F64, w13, w2, ws13, ws2) -> None:
    if x.ndim != 2:
        raise ValueError(f"moe.experts: x must be (T, D), got shape {x.shape}")
    t, d = x.shape
    if ids.ndim != 2 or ids.shape[0] != t or ids.dtype.kind not in "iu":
        raise ValueError(f"moe.experts: ids must be (T={t}, k) integers, got shape {ids.shape} dtype {ids.dtype}")
    if weights.shape != ids.shape:
        raise ValueError(f"moe.experts: weights must have ids' shape {ids.shape}, got {weights.shape}")
    if np.ndim(w13) != 3 or np.shape(w13)[2] != d or np.shape(w13)[1] % 2:
        raise ValueError(f"moe.experts: w13 must be (E, 2F, D={d}), got shape {np.shape(w13)}")
    e, f2, _ = np.shape(w13)
    if np.shape(w2) != (e, d, f2 // 2):
        raise ValueError(f"moe.experts: w2 must be (E={e}, D={d}, F={f2 // 2}), got shape {np.shape(w2)}")
    if ids.size and (ids.min() < 0 or ids.max() >= e):
        raise ValueError(f"moe.experts: ids must be in [0, E={e})")
    if (ws13 is None) != (ws2 is None):
        raise ValueError("moe.experts: ws13 and ws2 come together (or neither)")
    if ws13 is not None:
        if np.ndim(ws13) != 3 or np.shape(ws13)[2] != d or np.shape(ws13)[1] % 2:
            raise ValueError(f"moe.experts: ws13 must be (S, 2Fs, D={d}), got shape {np.shape(ws13)}")
        s, fs2, _ = np.shape(ws13)
        if np.shape(ws2) != (s, d, fs2 // 2):
            raise ValueError(f"moe.experts: ws2 must be (S={s}, D={d}, Fs={fs2 // 2}), got shape {np.shape(ws2)}")


def experts(x: NDArray, ids: NDArray, weights: NDArray, w13: NDArray, w2: NDArray, *, ws13: NDArray | None = None,
            ws2: NDArray | None = None, act_dtype=None, absolute: bool = False) -> F64:
    """The routed experts' weighted sum (plus the shared experts) of each token.

    x: (T, D) float;  ids: (T, k) integers in [0, E);  weights: (T, k) float routing weights
    w13: (E, 2F, D), gate rows [0, F) then up rows [F, 2F);  w2: (E, D, F)
    ws13: (S, 2Fs, D) and ws2: (S, D, Fs), the shared experts (weight 1), or None
    act_dtype: the dtype act is rounded to before the down projection (a NumPy dtype: np.float32, ml_dtypes'
    bfloat16, np.float16), None: not rounded
    returns out (T, D) float64; absolute: the error model's magnitude M (T, D) instead (module docstring)
    """
    x = np.asarray(x, dtype=np.float64)
    ids = np.asarray(ids)
    weights = np.asarray(weights, dtype=np.float64)
    _check(x, ids, weights, w13, w2, ws13, ws2)
    t, d = x.shape
    k = ids.shape[1] if ids.ndim == 2 else 0
    out = np.zeros((t, d))
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    experts_present, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)
    wflat = weights.reshape(-1)
    for i, e in enumerate(experts_present):  # a product per present expert, never a loop over tokens
        slots = order[bounds[i]:bounds[i + 1]]
        toks = slots // k
        y = _mlp(x[toks], w13[e], w2[e], act_dtype, absolute)
        wt = wflat[slots][:, None]
        np.add.at(out, toks, (wt * wt if absolute else wt) * y)
    if ws13 is not None:
        for s in range(np.shape(ws13)[0]):
            out += _mlp(x, ws13[s], ws2[s], act_dtype, absolute)
    return np.sqrt(out) if absolute else out
