"""Golden fused transformer blocks (C-Kernel-Engine's mega-fused kernels), float64, stage by stage.

No new math: every stage is a family golden (refimpl.norm, gemm, rope, kvcache, attention, mlp),
composed; each block returns its intermediates ("stages") beside its outputs, so a fused kernel's
first divergence is named.

attention_prefill (T tokens at positions s .. s + T - 1; attention_decode is T = 1 at s = p):
    norm       = rms_norm(x, gamma, eps; real width E, gemma)                  (T, aE)
    q, k, v    = norm @ Wq^T (+ bq), norm @ Wk^T (+ bk), norm @ Wv^T (+ bv)      (T, h, a_d)
    q_rope     = rope(q, cos, sin, s + t; rot = d, the first d lanes), k_rope likewise
    k_cache[g, s + t] = k_rope[t, g] with lanes [d, a_d) cleared; v_cache likewise (kvcache.update)
    attn       = attention(q_rope, k_cache[:, :s + T], v_cache[:, :s + T];
                           causal bottom_right: query t sees slots j <= s + t, scale 1/sqrt(d))
    out        = attn (T, h_q a_d) @ Wo^T (+ bo) (+ residual)                   (T, aE)
mlp:
    norm = rms_norm(x, gamma, eps);  h = norm @ W1^T (2I, gate first);  act = silu(gate) * up
    down = act @ W2^T;  out = x + down
outproj_mlp (prefill): proj = attn @ Wo^T (+ bo);  h1 = proj + residual;  then the mlp on h1:
    norm = rms_norm(h1); h; act; down;  out = h1 + down

Conventions (OPS.md, layers; research/seed-systems.md §1):
- Rows are aligned: x, gamma, residual, bo and out have aE = E + pad lanes, lanes [E, aE) zero in
  the inputs; RMSNorm's mean runs over the E real lanes. Heads are aligned: a_d = d + pad lanes per
  head; a cached row's lanes [d, a_d) are cleared when written (whatever the projection gave there)
  and the dot products run over a_d, whose padding is then zero. The softmax scale is 1/sqrt(d), d
  the real head dim. Query head h reads kv head h // (h_q / h_kv) (= h * h_kv / h_q, the seed's).
- The caches are head-major (h_kv, capacity, a_d); slots < s hold history, the T new rows are written
  at s .. s + T - 1, every other slot is never read (NaN in the tests) and keeps its value.
- W_o is flat (aE, h_q a_d), or for outproj_mlp with fp32 weights also head-major (h_q, aE, a_d),
  summed over heads with the bias added once (`Weight(fmt="f32_heads", ...)`): the same product.
- A projection weight is a `Weight`: "f32" (N, K) floats, or a GGML format, rows of blocks along K.
  `reference` picks the gemm family's reference for every projection: "dequant" (L1: the weights
  dequantized, float64 products) or "emulated" (L2: each quantized projection's activations -- the
  normalised rows, the attention output, the SwiGLU activation -- rounded to float32 and quantized
  to Q8_0 (Q8_0 / Q5_0 weights) or Q8_K (K-quants) as the production path does, integer block sums).
  L2's quantization of the attention output before a quantized W_o is the seed's prefill step
  (`quantize_attn_out_head_major_q8_0`); with a_d a multiple of 32 its Q8_0 blocks lie inside heads.
Everything else is float64; the golden never rounds an intermediate.

Backward (OPS.md, backward; the seed's whole-layer backward): `mlp_backward` and
`attention_prefill_backward` are the VJPs of `mlp` and `attention_prefill` with respect to the block's
inputs, for the cotangent `dout` of its output, composed of the family VJP goldens (gemm.gemm_nt_backward,
mlp.swiglu_backward, norm.rms_norm_backward, rope.rope_backward, attention_grad.prefill_backward) in
reverse pipeline order, every intermediate gradient returned as a stage:
    mlp:        dact = dout W2;  dh = (dgate, dup) of SwiGLU;  dnorm = dh W1;  dx = RMSNorm's dx + dout;
                dgamma, dw1 = dh^T norm, dw2 = dout^T act
    attention:  dattn = dout W_o;  (dq_rope, dk_rope, dv) of the causal attention over history + chunk
                (the history a constant: only the new keys' gradients);  dq, dk = RoPE^T;
                dnorm = dq Wq + dk Wk + dv Wv;  dx, dgamma of RMSNorm;  dW = dY^T X and db = sum dY per
                projection;  dr = dout
Quantized weights mean their dequantized values (L1); the weight gradients are returned for every
format (what a float32 weight of those values would get). The forward is recomputed in float64 from
the inputs: the exact VJP at them. The new k / v rows' lanes [d, a_d) are cleared by the cache write,
so their gradients there are zero.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import attention, attention_grad, gemm, kvcache, mlp as mlp_ref, norm, rope

F64 = NDArray[np.float64]
REFERENCES = ("dequant", "emulated")
ATTENTION_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn")
MLP_STAGES = ("norm", "h", "act", "down")
OUTPROJ_MLP_STAGES = ("proj", "h1", "norm", "h", "act", "down")
MLP_GRAD_STAGES = ("dact", "dh", "dnorm")
ATTENTION_GRAD_STAGES = ("dattn", "dq_rope", "dk_rope", "dv", "dq", "dk", "dnorm")


class Weight(NamedTuple):
    """A projection weight W (N, K) as stored.

    fmt "f32": data (N, K) float; a GGML format: data (N, K / block * nbytes) uint8 rows of blocks;
    "f32_heads" (W_o only): data (h_q, N, a_d) float, the per-head layout of the same W."""

    fmt: str
    data: NDArray


def project(a: NDArray, w: Weight, bias: NDArray | None = None, reference: str = "dequant") -> F64:
    """a @ W^T (+ bias) by the gemm family's reference.

    a: (M, K) float; w: a Weight of K columns; bias: (N,) or None
    returns: (M, N) float64
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    if w.fmt == "f32_heads":
        h, n, ad = np.shape(w.data)
        flat = np.asarray(w.data, dtype=np.float64).transpose(1, 0, 2).reshape(n, h * ad)  # N, h_q a_d
        return gemm.gemm_nt(a, flat, bias)
    fn = gemm.emulated_reference if reference == "emulated" else gemm.dequant_reference
    return fn(a, w.fmt, {"w": w.data}, bias)


def _head_major(cache: NDArray) -> F64:
    """(h_kv, cap, a_d) -> (1, cap, h_kv, a_d) float64, the attention family's layout."""
    return np.asarray(cache, dtype=np.float64).transpose(1, 0, 2)[None]


def _write(cache: NDArray, rows: F64, start: int, d: int) -> F64:
    """kvcache.update of the head-major cache with rows (T, h_kv, a_d), lanes [d, a_d) cleared."""
    new = rows.copy()
    new[..., d:] = 0.0
    out = kvcache.update(_head_major(cache), new[None], np.array([start]))  # 1, cap, h_kv, a_d
    return out[0].transpose(1, 0, 2)


def attention_prefill(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                      k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, *, n: int,
                      h_q: int, h_kv: int, d: int, bq: NDArray | None = None, bk: NDArray | None = None,
                      bv: NDArray | None = None, bo: NDArray | None = None, residual: NDArray | None = None,
                      style: str = "half", gemma: bool = False, reference: str = "dequant") -> dict[str, F64]:
    """The attention block over T tokens at positions start .. start + T - 1 (module docstring).

    x: (T, aE) float, lanes [n, aE) zero;  gamma: (aE,)
    wq: Weight (h_q a_d, aE); wk, wv: Weight (h_kv a_d, aE); wo: Weight (aE, h_q a_d)
    k_cache, v_cache: (h_kv, cap, a_d), slots < start hold history; cap >= start + T
    cos, sin: (max_seq, d/2) tables; max_seq > start + T - 1
    bq: (h_q a_d,), bk, bv: (h_kv a_d,), bo: (aE,), residual: (T, aE), or None
    style: RoPE pairing ("interleaved" or "half"); gemma: RMSNorm weight (1 + gamma)
    returns: {"norm": (T, aE), "q", "q_rope", "attn": (T, h_q, a_d), "k", "v", "k_rope": (T, h_kv, a_d),
              "k_cache", "v_cache": (h_kv, cap, a_d) after the write, "out": (T, aE)}
    """
    x = np.asarray(x, dtype=np.float64)
    t, ae = x.shape
    ad = np.shape(k_cache)[-1]
    if ad < d or d % 2:
        raise ValueError(f"head dim d={d} must be even and at most the aligned a_d={ad}")
    if np.shape(k_cache)[1] < start + t:
        raise ValueError(f"cache capacity {np.shape(k_cache)[1]} < start + T = {start + t}")
    nrm = norm.rms_norm(x, gamma, eps, n=n, gemma=gemma)["y"]  # T, aE
    q = project(nrm, wq, bq, reference).reshape(t, h_q, ad)
    k = project(nrm, wk, bk, reference).reshape(t, h_kv, ad)
    v = project(nrm, wv, bv, reference).reshape(t, h_kv, ad)
    pos = start + np.arange(t)
    q_rope = rope.rope(q, cos, sin, pos, style=style, rot=d, at="first")
    k_rope = rope.rope(k, cos, sin, pos, style=style, rot=d, at="first")
    kc, vc = _write(k_cache, k_rope, start, d), _write(v_cache, v, start, d)
    live = start + t  # slots past it are never read (they may hold NaN)
    o, _, _ = attention.attention(q_rope[None], _head_major(kc[:, :live]), _head_major(vc[:, :live]),
                                  scale=1.0 / math.sqrt(d), causal="bottom_right")
    attn = o[0]  # T, h_q, a_d
    out = project(attn.reshape(t, h_q * ad), wo, bo, reference)
    if residual is not None:
        out = out + np.asarray(residual, dtype=np.float64)
    return {"norm": nrm, "q": q, "k": k, "v": v, "q_rope": q_rope, "k_rope": k_rope, "attn": attn,
            "k_cache": kc, "v_cache": vc, "out": out}


def attention_decode(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                     k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, pos: int, *, n: int,
                     h_q: int, h_kv: int, d: int, bq: NDArray | None = None, bk: NDArray | None = None,
                     bv: NDArray | None = None, bo: NDArray | None = None, residual: NDArray | None = None,
                     style: str = "half", gemma: bool = False, reference: str = "dequant") -> dict[str, F64]:
    """The attention block for one token at position pos: `attention_prefill` with T = 1, start = pos.

    x: (aE,); residual: (aE,) or None; the rest as `attention_prefill`
    returns: {"norm": (aE,), "q", "q_rope", "attn": (h_q, a_d), "k", "v", "k_rope": (h_kv, a_d),
              "k_cache", "v_cache": (h_kv, cap, a_d), "out": (aE,)}; slots 0 .. pos attended
    """
    r = None if residual is None else np.asarray(residual, dtype=np.float64)[None]
    res = attention_prefill(np.asarray(x)[None], gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, pos, n=n,
                            h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=r, style=style,
                            gemma=gemma, reference=reference)
    return {k: v if k in ("k_cache", "v_cache") else v[0] for k, v in res.items()}


def mlp(x: NDArray, gamma: NDArray, eps: float, w1: Weight, w2: Weight, *, n: int, gemma: bool = False,
        reference: str = "dequant") -> dict[str, F64]:
    """RMSNorm2 -> fused gate/up projection -> SwiGLU -> down projection -> + residual (x).

    x: (T, aE) float, lanes [n, aE) zero;  gamma: (aE,)
    w1: Weight (2I, aE), rows [0, I) the gate, [I, 2I) the up projection;  w2: Weight (aE, I)
    returns: {"norm": (T, aE), "h": (T, 2I), "act": (T, I), "down": (T, aE), "out": (T, aE) = x + down}
    """
    x = np.asarray(x, dtype=np.float64)
    nrm = norm.rms_norm(x, gamma, eps, n=n, gemma=gemma)["y"]
    h = project(nrm, w1, None, reference)
    act = mlp_ref.swiglu(*mlp_ref.split(h))
    down = project(act, w2, None, reference)
    return {"norm": nrm, "h": h, "act": act, "down": down, "out": x + down}


def outproj_mlp(attn: NDArray, residual: NDArray, wo: Weight, gamma: NDArray, eps: float, w1: Weight, w2: Weight,
                *, n: int, bo: NDArray | None = None, gemma: bool = False,
                reference: str = "dequant") -> dict[str, F64]:
    """Output projection + residual, then the MLP block on the sum (the seed's outproj_mlp_prefill).

    attn: (T, h_q a_d) float, the attention output (head-major lanes, padding zero)
    residual: (T, aE);  wo: Weight (aE, h_q a_d) flat, or "f32_heads" (h_q, aE, a_d);  bo: (aE,) or None
    gamma, eps, w1, w2, n, gemma: the MLP's (`mlp`)
    returns: {"proj": (T, aE), "h1": (T, aE) = proj + residual, "norm", "h", "act", "down", "out" = h1 + down}
    """
    proj = project(np.asarray(attn, dtype=np.float64), wo, bo, reference)
    h1 = proj + np.asarray(residual, dtype=np.float64)
    return {"proj": proj, "h1": h1, **mlp(h1, gamma, eps, w1, w2, n=n, gemma=gemma, reference=reference)}


# -- backward ---------------------------------------------------------------------------------------------
def dense(w: Weight, k: int) -> F64:
    """The (N, K) float64 values of a Weight of K columns (dequantized; "f32_heads" flattened)."""
    if w.fmt == "f32_heads":
        h, n, ad = np.shape(w.data)
        return np.asarray(w.data, dtype=np.float64).transpose(1, 0, 2).reshape(n, h * ad)
    return gemm.dequantize_weight(w.fmt, {"w": w.data}, k)


def mlp_backward(x: NDArray, gamma: NDArray, eps: float, w1: Weight, w2: Weight, dout: NDArray, *, n: int,
                 gemma: bool = False) -> dict[str, F64]:
    """VJP of `mlp` (the dequantized weights: L1) for the cotangent dout of its output.

    x: (T, aE), lanes [n, aE) zero;  gamma: (aE,);  w1: Weight (2I, aE) gate rows first;  w2: Weight (aE, I)
    dout: (T, aE) the cotangent of out = x + down
    returns: {"dact": (T, I), "dh": (T, 2I) (dgate | dup), "dnorm": (T, aE), "dx": (T, aE),
              "dgamma": (aE,), "dw1": (2I, aE), "dw2": (aE, I)}
    """
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    fwd = mlp(x, gamma, eps, w1, w2, n=n, gemma=gemma)
    i = fwd["act"].shape[-1]
    g2 = gemm.gemm_nt_backward(fwd["act"], dense(w2, i), dout)  # down = act W2^T
    sw = mlp_ref.swiglu_backward(*mlp_ref.split(fwd["h"]), g2["da"])
    dh = np.concatenate([sw["dgate"], sw["dup"]], axis=-1)  # T, 2I: gate first, as h
    g1 = gemm.gemm_nt_backward(fwd["norm"], dense(w1, x.shape[-1]), dh)  # h = norm W1^T
    nb = norm.rms_norm_backward(x, gamma, g1["da"], eps, n=n, gemma=gemma)
    return {"dact": g2["da"], "dh": dh, "dnorm": g1["da"], "dx": nb["dx"] + dout, "dgamma": nb["dw"],
            "dw1": g1["dw"], "dw2": g2["dw"]}


def attention_prefill_backward(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight,
                               wo: Weight, k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int,
                               dout: NDArray, *, n: int, h_q: int, h_kv: int, d: int, bq: NDArray | None = None,
                               bk: NDArray | None = None, bv: NDArray | None = None, bo: NDArray | None = None,
                               residual: NDArray | None = None, style: str = "half",
                               gemma: bool = False) -> dict[str, F64]:
    """VJP of `attention_prefill` (the dequantized weights: L1) for the cotangent dout of its output; the
    cache history (slots < start) is a constant.

    arguments: as `attention_prefill`;  dout: (T, aE) the cotangent of out
    returns: stages {"dattn", "dq_rope", "dq": (T, h_q, a_d), "dk_rope", "dv", "dk": (T, h_kv, a_d),
             "dnorm": (T, aE)} and {"dx": (T, aE), "dgamma": (aE,), "dwq": (h_q a_d, aE), "dwk", "dwv":
             (h_kv a_d, aE), "dwo": (aE, h_q a_d)}, with "dbq", "dbk", "dbv", "dbo" for the biases given and
             "dr" (= dout) for a residual
    """
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    t, ae = x.shape
    ad = np.shape(k_cache)[-1]
    fwd = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q, h_kv=h_kv,
                            d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style, gemma=gemma)
    go = gemm.gemm_nt_backward(fwd["attn"].reshape(t, h_q * ad), dense(wo, h_q * ad), dout, bias=bo is not None)
    dattn = go["da"].reshape(t, h_q, ad)
    live = start + t  # keys 0 .. live - 1: the history, then the chunk's own rows (bottom-right causal)
    ga = attention_grad.prefill_backward(fwd["q_rope"][None], _head_major(fwd["k_cache"][:, :live]),
                                         _head_major(fwd["v_cache"][:, :live]), dattn[None], causal="bottom_right",
                                         scale=1.0 / math.sqrt(d))
    real = (np.arange(ad) < d).astype(np.float64)  # the cache write cleared lanes [d, a_d) of the new rows
    dq_rope = ga["dq"][0]
    dk_rope, dv = ga["dk"][0, start:] * real, ga["dv"][0, start:] * real  # the new keys' rows only
    pos = start + np.arange(t)
    dq = rope.rope_backward(dq_rope, cos, sin, pos, style=style, rot=d, at="first")
    dk = rope.rope_backward(dk_rope, cos, sin, pos, style=style, rot=d, at="first")
    nrm = fwd["norm"]
    proj = {name: gemm.gemm_nt_backward(nrm, dense(w, ae), dy.reshape(t, -1), bias=b is not None)
            for name, w, dy, b in (("q", wq, dq, bq), ("k", wk, dk, bk), ("v", wv, dv, bv))}
    dnorm = proj["q"]["da"] + proj["k"]["da"] + proj["v"]["da"]
    nb = norm.rms_norm_backward(x, gamma, dnorm, eps, n=n, gemma=gemma)
    out = {"dattn": dattn, "dq_rope": dq_rope, "dk_rope": dk_rope, "dv": dv, "dq": dq, "dk": dk, "dnorm": dnorm,
           "dx": nb["dx"], "dgamma": nb["dw"], "dwq": proj["q"]["dw"], "dwk": proj["k"]["dw"],
           "dwv": proj["v"]["dw"], "dwo": go["dw"]}
    for name in ("q", "k", "v"):
        if "db" in proj[name]:
            out[f"db{name}"] = proj[name]["db"]
    if "db" in go:
        out["dbo"] = go["db"]
    if residual is not None:
        out["dr"] = dout.copy()
    return out
