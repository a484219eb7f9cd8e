"""Golden fused transformer blocks (C-Kernel-Engine's mega-fused kernels), float64, stage by stage.

No new math: every stage is a family golden (refimpl.norm, gemm, rope, kvcache, attention, mlp),
composed; each block returns its intermediates ("stages") beside its outputs, so a fused kernel's
first divergence is named.

attention_prefill (T tokens at positions s .. s + T - 1; attention_decode is T = 1 at s = p):
    norm       = rms_norm(x, gamma, eps; real width E, gemma)                  (T, aE)
    q, k, v    = norm @ Wq^T (+ bq), norm @ Wk^T (+ bk), norm @ Wv^T (+ bv)      (T, h, a_d)
                 (qkv="fused": the row sections of one W_qkv / b_qkv, q heads then k then v)
    q_rope     = rope(q, cos, sin, o + s + t; rot = d, the first d lanes), k_rope likewise (o = rope_off:
                 the seed's rope_pos_offset, RoPE's position apart from the cache slot; 0 by default)
    k_cache[g, s + t] = k_rope[t, g] with lanes [d, a_d) cleared; v_cache likewise (kvcache.update)
    attn       = attention(q_rope, k_cache[:, :s + T], v_cache[:, :s + T];
                           causal bottom_right: query t sees slots j <= s + t, scale 1/sqrt(d))
    out        = attn (T, h_q a_d) @ Wo^T (+ bo) (+ residual)                   (T, aE)
mlp:
    norm = rms_norm(x, gamma, eps);  h = norm @ W1^T (+ b1) (2aI, gate first);  act = silu(gate) * up (I real
    lanes of each aI-lane half, act's lanes [I, aI) cleared);  down = act @ W2^T (+ b2);  out = x + down
outproj_mlp (prefill): proj = attn @ Wo^T (+ bo);  h1 = proj + residual;  then the mlp on h1:
    norm = rms_norm(h1); h; act; down;  out = h1 + down
    attn token-major (T, h_q a_d), or head-major (h_q, T, a_d) (`attn_layout`, the seed's [h, T, a_d]):
    row t of the product is (attn[0, t], .., attn[h_q - 1, t]), the same math read per head

Conventions (OPS.md, layers; research/seed-systems.md §1):
- Rows are aligned: x, gamma, residual, bo and out have aE = E + pad lanes, lanes [E, aE) zero in
  the inputs; RMSNorm's mean runs over the E real lanes. Heads are aligned: a_d = d + pad lanes per
  head; a cached row's lanes [d, a_d) are cleared when written (whatever the projection gave there)
  and the dot products run over a_d, whose padding is then zero. The softmax scale is 1/sqrt(d), d
  the real head dim. Query head h reads kv head h // (h_q / h_kv) (= h * h_kv / h_q, the seed's).
- The caches are head-major (h_kv, capacity, a_d); slots < s hold history, the T new rows are written
  at s .. s + T - 1, every other slot is never read (NaN in the tests) and keeps its value.
- W_o is flat (aE, h_q a_d), or with fp32 weights also head-major (h_q, aE, a_d) (outproj_mlp, and the attention
  blocks with wo_layout=head_major, whose backward returns dwo per head),
  summed over heads with the bias added once (`Weight(fmt="f32_heads", ...)`): the same product.
- A projection weight is a `Weight`: "f32" (N, K) floats, or a GGML format, rows of blocks along K.
  `reference` picks the gemm family's reference for every projection: "dequant" (L1: the weights
  dequantized, float64 products) or "emulated" (L2: each quantized projection's activations -- the
  normalised rows, the attention output, the SwiGLU activation -- rounded to float32 and quantized
  to the weight's ggml vec_dot format, Q8_0 (Q8_0 / Q5_0 / Q4_0 weights), Q8_1 (Q4_1 / Q5_1) or Q8_K
  (K-quants), as the production path does, integer block sums). L2's quantization of the attention output
  before a quantized W_o is the seed's prefill step (`quantize_attn_out_head_major_q8_0`); with a_d a
  multiple of 32 its Q8_0 (Q8_1) blocks lie inside heads; a K-quant W_o's Q8_K blocks of 256 span heads
  (seed audit S1: h_q a_d a multiple of 256).
Everything else is float64; the golden never rounds an intermediate.

Backward (OPS.md, backward; the seed's whole-layer backward): `mlp_backward` and
`attention_prefill_backward` are the VJPs of `mlp` and `attention_prefill` with respect to the block's
inputs, for the cotangent `dout` of its output, composed of the family VJP goldens (gemm.gemm_nt_backward,
mlp.swiglu_backward, norm.rms_norm_backward, rope.rope_backward, attention_grad.prefill_backward) in
reverse pipeline order, every intermediate gradient returned as a stage:
    mlp:        dact = dout W2 (padding lanes zero);  dh = (dgate, dup) of SwiGLU;  dnorm = dh W1;
                dx = RMSNorm's dx + dout;  dgamma, dw1 = dh^T norm, dw2 = dout^T act, db1 = sum dh, db2 = sum dout
    attention:  dattn = dout W_o;  (dq_rope, dk_rope, dv) of the causal attention over history + chunk
                (the history a constant: only the new keys' gradients);  dq, dk = RoPE^T;
                dnorm = dq Wq + dk Wk + dv Wv;  dx, dgamma of RMSNorm;  dW = dY^T X and db = sum dY per
                projection;  dr = dout
Quantized weights mean their dequantized values (L1); the weight gradients are returned for every
format (what a float32 weight of those values would get). The forward is recomputed in float64 from
the inputs: the exact VJP at them. The new k / v rows' lanes [d, a_d) are cleared by the cache write,
so their gradients there are zero.

Error model (`absolute=True`; conformance/tolerance.py, layer 3): each output's magnitude M, what a kernel's
rounding error in it scales with, built stage by stage from the golden's own intermediates. A stage's
error has two parts: its own rounding, the root-sum-square (RSS) of the terms it sums (a projection's
element sqrt(sum_k a_k^2 W_k^2 + bias^2), RoPE's sqrt((x1 cos)^2 + (x2 sin)^2), the attention's
sqrt(sum_j P_j^2 V_j^2), a residual add's sqrt(x^2 + y^2)), and what it inherits from the errors of the
computed operands it reads (the same terms with an operand's M^2 in place of its value squared). Both
are weighted by the roundings behind them -- the stage's own reduction length l (a projection's K, the
attention's keys, RMSNorm's n, 1 for RoPE, SwiGLU and an add) and the operand's accumulated length L (the
lengths the specs' acc_len sums) -- and averaged, in squared form:
    a sum's term whose computed factor is v:   (l v^2 + L M_v^2) / (l + L) in place of v^2
    a product of computed factors u v:         (l u^2 v^2 + L_u M_u^2 v^2 + L_v u^2 M_v^2) / (l + L_u + L_v)
since the numeric layer's rtol already carries eps32 sqrt(total length): M is the scale each rounding
is proportional to, their weighted RMS, not their sum (summing a product's two routes doubles M^2 on any
input: act's cond ~2.2 where the RSS of random-sign terms gives ~1.5). Inputs as stored enter with |value|
and L = 0; the cache's stored history and its new rows side by side, each with its own. Nonlinear factors
enter with their values (rstd, the gain, P, silu(g), cos / sin), their sensitivities where an operand is
computed: silu'(g) (silu''(g) in the backward) and RMSNorm's of a computed input (g rstd (dx_i - xhat_i
mean(xhat dx))). P enters with its value in the magnitudes; its sensitivity to the logits' fp32 rounding
(dP_j = P_j (ds_j - sum_l P_l ds_l), |ds_j| ~ u32 sigma_j) is a separate compute-precision term per output,
`<output>@fp32` (conformance/tolerance.py: it widens the elementwise bound by ~2 u32 E whatever the rtol, and
the aggregate limits by their own allowance, not through cond -- folded into the magnitudes it had put dv's
cond at 2.5 .. 4.6 on ordinary inputs): sigma^2 = s^2 + (d + L_q + L_k) (q^2 . k^2) / d (`_logit_sigma2`;
against an fp32 emulation of the pipeline |ds| / (u32 sigma) is 0.14 RMS, at most 0.90), attn's E^2 =
sum_j P_j^2 sigma_j^2 (V_j - O)^2, then linearly (squared) through W_o, the residual and, in the layer, the
MLP block. Backward: P recomputed from the fp32 LSE carries sigma_ij^2 + L_i^2 + sum_l P_il^2 sigma_il^2 (no
normalization cancels the common part): dv's E^2 = (P^2 that)^T dO^2, dS's = dS^2 that + P^2 (dO^2 . E_O^2),
then through K, Q, RoPE, the three projections, RMSNorm and the weight gradients. Backward:
the same rules on the VJP's terms, the forward's magnitudes for the activations it reads (a kernel may
recompute them); dS = P (dP - D) carries P^2 (M_dP^2 + M_D^2) where dP - D cancels. Every magnitude is
float64, vectorised as the golden (the weights squared a block of rows at a time: no second (N, K) copy).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import attention, attention_grad, gemm, kvcache, mlp as mlp_ref, norm, quant, rope

F64 = NDArray[np.float64]
REFERENCES = ("dequant", "emulated")
COMPUTE = "@fp32"  # an output's compute-precision term (conformance/tolerance.py COMPUTE_SUFFIX)
ATTENTION_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn")
MLP_STAGES = ("norm", "h", "act", "down")
OUTPROJ_MLP_STAGES = ("proj", "h1", "norm", "h", "act", "down")
MLP_GRAD_STAGES = ("dact", "dh", "dnorm")
ATTENTION_GRAD_STAGES = ("dattn", "dq_rope", "dk_rope", "dv", "dq", "dk", "dnorm")
LAYER_GRAD_STAGES = ("dact", "dh", "dnorm2", "dh1") + ATTENTION_GRAD_STAGES
# the MLP block's gradients in the layer's backward: mlp_backward's names, renamed where the attention's clash
LAYER_MLP_GRADS = {"dact": "dact", "dh": "dh", "dnorm": "dnorm2", "dx": "dh1", "dgamma": "dgamma2", "dw1": "dw1",
                   "dw2": "dw2"}
LAYER_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn", "h1", "norm2", "h", "act", "down")
CTX_ALIGN = 16  # the saved scores' rows: start + T slots padded to a multiple of 16 floats (64 bytes)


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


QKV_LAYOUTS = ("separate", "fused")


def qkv_sections(qkv: str, wq: Weight, wk: Weight | None, wv: Weight | None, bq: NDArray | None,
                 bk: NDArray | None, bv: NDArray | None, *, h_q: int, h_kv: int,
                 ad: int) -> tuple[Weight, Weight, Weight, NDArray | None, NDArray | None, NDArray | None]:
    """(wq, wk, wv, bq, bk, bv): as given ("separate"), or ("fused") the sections of W_qkv = wq and b_qkv = bq:
    rows [0, h_q a_d) the q heads, then h_kv a_d rows of k heads, then h_kv a_d of v heads (the seed's
    concatenation, each head's a_d rows padded as the separate weights are)."""
    if qkv not in QKV_LAYOUTS:
        raise ValueError(f"qkv must be one of {QKV_LAYOUTS}, got {qkv!r}")
    if qkv == "separate":
        return wq, wk, wv, bq, bk, bv
    if wk is not None or wv is not None or bk is not None or bv is not None:
        raise ValueError("qkv='fused' takes W_qkv as wq and b_qkv as bq; wk, wv, bk, bv must be None")
    rows = (h_q + 2 * h_kv) * ad
    if np.shape(wq.data)[0] != rows or (bq is not None and np.shape(bq) != (rows,)):
        raise ValueError(f"W_qkv must have (h_q + 2 h_kv) a_d = {rows} rows (and b_qkv as many), got "
                         f"{np.shape(wq.data)}, {None if bq is None else np.shape(bq)}")
    cut = (0, h_q * ad, (h_q + h_kv) * ad, rows)
    ws = [Weight(wq.fmt, wq.data[lo:hi]) for lo, hi in zip(cut, cut[1:])]
    bs = [None] * 3 if bq is None else [bq[lo:hi] for lo, hi in zip(cut, cut[1:])]
    return (*ws, *bs)


def fused_grads(qkv: str, g: dict[str, F64]) -> dict[str, F64]:
    """The backward's gradients; with qkv="fused", dwq, dwk, dwv (and dbq, dbk, dbv) as one dwqkv (dbqkv) in
    W_qkv's row order, in dwq's place (the gradient of the block's input W_qkv)."""
    if qkv != "fused":
        return g
    out = {}
    for k, v in g.items():
        if k in ("dwq", "dbq"):
            pre = k[:2]
            out[f"{pre}qkv"] = np.concatenate([g[f"{pre}q"], g[f"{pre}k"], g[f"{pre}v"]], axis=0)
        elif k not in ("dwk", "dwv", "dbk", "dbv"):
            out[k] = v
    return out


def wo_grad(wo: Weight, dw: F64) -> F64:
    """W_o's gradient (aE, h_q a_d) in W_o's layout: per head (h_q, aE, a_d) for "f32_heads" (the seed's per-head
    d_wo), as computed otherwise."""
    if wo.fmt != "f32_heads":
        return dw
    h, n, ad = np.shape(wo.data)
    return np.ascontiguousarray(dw.reshape(n, h, ad).transpose(1, 0, 2))


def attention_prefill(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                      k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, *, n: int,
                      h_q: int, h_kv: int, d: int, bq: NDArray | None = None, bk: NDArray | None = None,
                      bv: NDArray | None = None, bo: NDArray | None = None, residual: NDArray | None = None,
                      style: str = "half", gemma: bool = False, reference: str = "dequant",
                      absolute: bool = False, rope_off: int = 0, qkv: str = "separate") -> dict[str, F64]:
    """The attention block over T tokens in cache slots start .. start + T - 1 (module docstring).

    x: (T, aE) float, lanes [n, aE) zero;  gamma: (aE,)
    wq: Weight (h_q a_d, aE); wk, wv: Weight (h_kv a_d, aE); wo: Weight (aE, h_q a_d), or "f32_heads"
    (h_q, aE, a_d): the seed's per-head W_o, summed over heads, the bias added once (the backward's dwo per head)
    k_cache, v_cache: (h_kv, cap, a_d), slots < start hold history; cap >= start + T
    cos, sin: (max_seq, d/2) tables; max_seq > rope_off + start + T - 1
    bq: (h_q a_d,), bk, bv: (h_kv a_d,), bo: (aE,), residual: (T, aE), or None
    style: RoPE pairing ("interleaved" or "half"); gemma: RMSNorm weight (1 + gamma)
    rope_off: RoPE's position minus the cache slot (the seed's rope_pos_offset beside token_index): token t
    is rotated at position rope_off + start + t and written at slot start + t; the causal mask counts slots
    qkv: "separate" (wq, wk, wv, bq, bk, bv) or "fused" (the seed's one W_qkv / b_qkv: wq is W_qkv
    ((h_q + 2 h_kv) a_d, aE), rows [q heads; k heads; v heads], bq is b_qkv likewise, wk, wv, bk, bv None)
    returns: {"norm": (T, aE), "q", "q_rope", "attn": (T, h_q, a_d), "k", "v", "k_rope": (T, h_kv, a_d),
              "k_cache", "v_cache": (h_kv, cap, a_d) after the write, "out": (T, aE)}
    absolute: the error model's magnitudes instead (module docstring), for every output but "norm" (a
    product of stored x and the well-conditioned rstd: |norm| is its magnitude). q, k, v: sqrt(norm^2 @
    (W^2)^T + b^2) (blended with norm's n roundings: the same); q_rope, k_rope: RoPE's RSS of the blended
    q; the caches: the stored history's |value| (NaN where the golden is: slots never read), the new rows'
    model; attn: sqrt(sum_j P_j^2 (keys V_j^2 + L_v M_V_j^2) / (keys + L_v)); out: W_o's on the blended attn,
    + bo^2 + r^2. Measured (ci suite, 4 dists, cpu): cond <= 1.9 on every output (2.3 on decode's k and v
    of 32 lanes, a ratio of sums of 32 squares).
    """
    wq, wk, wv, bq, bk, bv = qkv_sections(qkv, wq, wk, wv, bq, bk, bv, h_q=h_q, h_kv=h_kv, ad=np.shape(k_cache)[-1])
    if absolute:
        kw = dict(n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style,
                  gemma=gemma, reference=reference, rope_off=rope_off)
        _, mags, at = _attention_pass(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, **kw)
        comp = _attention_comp(at, np.shape(x)[0], wo, h_q)
        return {**{k: np.sqrt(m.sq, out=m.sq) for k, m in mags.items() if k != "norm"},
                **{k + COMPUTE: np.sqrt(e) for k, e in comp.items()}}
    x = np.asarray(x, dtype=np.float64)
    t, ae = x.shape
    ad = np.shape(k_cache)[-1]
    if ad < d or d % 2:
        raise ValueError(f"head dim d={d} must be even and at most the aligned a_d={ad}")
    if np.shape(k_cache)[1] < start + t:
        raise ValueError(f"cache capacity {np.shape(k_cache)[1]} < start + T = {start + t}")
    if rope_off < 0 or np.shape(cos)[0] < rope_off + start + t:
        raise ValueError(f"RoPE positions up to rope_off + start + T - 1 = {rope_off + start + t - 1} need that many "
                         f"cos/sin rows, the tables have {np.shape(cos)[0]} (rope_off={rope_off} must be >= 0)")
    nrm = norm.rms_norm(x, gamma, eps, n=n, gemma=gemma)["y"]  # T, aE
    q = project(nrm, wq, bq, reference).reshape(t, h_q, ad)
    k = project(nrm, wk, bk, reference).reshape(t, h_kv, ad)
    v = project(nrm, wv, bv, reference).reshape(t, h_kv, ad)
    pos = rope_off + start + np.arange(t)  # RoPE's positions; the cache slots are start + t
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
                     style: str = "half", gemma: bool = False, reference: str = "dequant",
                     absolute: bool = False, rope_off: int = 0, qkv: str = "separate") -> dict[str, F64]:
    """The attention block for one token in slot pos: `attention_prefill` with T = 1, start = pos (RoPE at
    rope_off + pos).

    x: (aE,); residual: (aE,) or None; the rest as `attention_prefill`
    returns: {"norm": (aE,), "q", "q_rope", "attn": (h_q, a_d), "k", "v", "k_rope": (h_kv, a_d),
              "k_cache", "v_cache": (h_kv, cap, a_d), "out": (aE,)}; slots 0 .. pos attended
    absolute: the magnitudes instead (`attention_prefill`'s), "norm" left out
    """
    r = None if residual is None else np.asarray(residual, dtype=np.float64)[None]
    res = attention_prefill(np.asarray(x)[None], gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, pos, n=n,
                            h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=r, style=style,
                            gemma=gemma, reference=reference, absolute=absolute, rope_off=rope_off, qkv=qkv)
    return {k: v if k in ("k_cache", "v_cache") else v[0] for k, v in res.items()}


def mlp(x: NDArray, gamma: NDArray, eps: float, w1: Weight, w2: Weight, *, n: int, b1: NDArray | None = None,
        b2: NDArray | None = None, inter: int | None = None, gemma: bool = False, reference: str = "dequant",
        absolute: bool = False) -> dict[str, F64]:
    """RMSNorm2 -> fused gate/up projection (+ b1) -> SwiGLU -> down projection (+ b2) -> + residual (x).

    x: (T, aE) float, lanes [n, aE) zero;  gamma: (aE,)
    w1: Weight (2aI, aE), rows [0, aI) the gate, [aI, 2aI) the up projection (the seed's w_up at w1 + aI aE);
    w2: Weight (aE, aI);  b1: (2aI,) (b_gate | b_up) or None;  b2: (aE,) (b_down) or None
    inter: the real intermediate width I <= aI (the seed's intermediate_dim; aI its aligned_intermediate_dim),
    None: I = aI. Lanes [I, aI) of each half are padding: h carries them as the projection gives them (W1's
    padded rows and b1's lanes there need not be zero), act's are cleared (zero whatever h holds), so W2's
    padded columns multiply zeros: a kernel that reads w_up at w1 + I aE, or lets the padding into act and
    the down projection, is off.
    returns: {"norm": (T, aE), "h": (T, 2aI), "act": (T, aI), "down": (T, aE), "out": (T, aE) = x + down}
    absolute: the error model's magnitudes instead (module docstring), "norm" left out (|norm|): h =
    sqrt(norm^2 @ (W1^2)^T + b1^2); act = sqrt((act^2 + L_h ((silu'(g) up M_g)^2 + (silu(g) M_up)^2)) / (1 + 2 L_h))
    (0 on the padding); down: W2's on the blended act, + b2^2; out = sqrt(x^2 + (down^2 + L M_down^2) / (1 + L)).
    Measured (ci suite, cpu): cond <= 1.9 on every output and distribution.
    """
    if absolute:
        _, mags = _mlp_pass(np.asarray(x, dtype=np.float64), None, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter,
                            gemma=gemma, reference=reference)
        return {k: np.sqrt(m.sq, out=m.sq) for k, m in mags.items() if k != "norm"}
    x = np.asarray(x, dtype=np.float64)
    nrm = norm.rms_norm(x, gamma, eps, n=n, gemma=gemma)["y"]
    h = project(nrm, w1, b1, reference)
    ai = h.shape[-1] // 2
    act = _lanes(mlp_ref.swiglu(*_gate_up(h, inter)), ai)
    down = project(act, w2, b2, reference)
    return {"norm": nrm, "h": h, "act": act, "down": down, "out": x + down}


def _gate_up(h: F64, inter: int | None) -> tuple[F64, F64]:
    """(gate, up): the real lanes of a fused projection h (..., 2aI), [0, I) and [aI, aI + I) (I = inter or aI)."""
    ai = np.shape(h)[-1] // 2
    i = ai if inter is None else inter
    if not 1 <= i <= ai:
        raise ValueError(f"inter={inter} must be in [1, aI = {ai}] (h has 2aI = {2 * ai} lanes)")
    return h[..., :i], h[..., ai:ai + i]


def _lanes(a: F64, aw: int) -> F64:
    """(..., I) in (..., aw) with lanes [I, aw) zero (a itself when I = aw)."""
    if a.shape[-1] == aw:
        return a
    out = np.zeros(a.shape[:-1] + (aw,))
    out[..., :a.shape[-1]] = a
    return out


def _halves(gate: F64, up: F64, ai: int) -> F64:
    """(gate | up) of I lanes each in the aligned layout (..., 2aI), padding lanes zero."""
    return np.concatenate([_lanes(gate, ai), _lanes(up, ai)], axis=-1)


def outproj_mlp(attn: NDArray, residual: NDArray, wo: Weight, gamma: NDArray, eps: float, w1: Weight, w2: Weight,
                *, n: int, bo: NDArray | None = None, b1: NDArray | None = None, b2: NDArray | None = None,
                inter: int | None = None, gemma: bool = False, reference: str = "dequant",
                absolute: bool = False, attn_layout: str = "token_major") -> dict[str, F64]:
    """Output projection + residual, then the MLP block on the sum (the seed's outproj_mlp_prefill).

    attn: (T, h_q a_d) float, the attention output (head-major lanes, padding zero); attn_layout="head_major":
    (h_q, T, a_d), the seed's [h, T, a_d] (seed audit S5), token t's row the concatenation of its heads' rows
    residual: (T, aE);  wo: Weight (aE, h_q a_d) flat, or "f32_heads" (h_q, aE, a_d);  bo: (aE,) or None
    gamma, eps, w1, w2, n, b1, b2, inter, gemma: the MLP's (`mlp`; b1 / b2 the seed's outproj_mlp biases)
    returns: {"proj": (T, aE), "h1": (T, aE) = proj + residual, "norm", "h", "act", "down", "out" = h1 + down}
    absolute: the error model's magnitudes instead (module docstring), every output: proj = sqrt(attn^2 @
    (W_o^2)^T + bo^2) (attn as stored); h1 = sqrt((proj^2 + L M_proj^2) / (1 + L) + residual^2); norm: |norm|
    blended with h1's error through RMSNorm (g rstd (dh1_i - xhat_i mean(xhat dh1))); then `mlp`'s
    """
    attn = attn_rows(attn, attn_layout)
    if absolute:
        a = np.asarray(attn, dtype=np.float64)
        proj, pm = _project_mag(a, _exact(a), wo, bo, reference)
        r = np.asarray(residual, dtype=np.float64)
        h1m = _Mag(_blend(proj, pm, 1.0) + r * r, pm.n + 1.0)
        _, mags = _mlp_pass(proj + r, h1m, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma,
                            reference=reference)
        return {k: np.sqrt(m.sq, out=m.sq) for k, m in {"proj": pm, "h1": h1m, **mags}.items()}
    proj = project(np.asarray(attn, dtype=np.float64), wo, bo, reference)
    h1 = proj + np.asarray(residual, dtype=np.float64)
    return {"proj": proj, "h1": h1, **mlp(h1, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma,
                                          reference=reference)}


def attn_rows(attn: NDArray, layout: str) -> F64:
    """The attention output as token rows (T, h_q a_d): itself when token-major, a head-major (h_q, T, a_d)
    one read per head (row t = attn[0, t] | .. | attn[h_q - 1, t])."""
    a = np.asarray(attn, dtype=np.float64)
    if layout == "token_major":
        return a
    if layout != "head_major":
        raise ValueError(f"attn_layout={layout!r}: expected 'token_major' or 'head_major'")
    if a.ndim != 3:
        raise ValueError(f"a head-major attention output is (h_q, T, a_d), got shape {a.shape}")
    h, t, ad = a.shape
    return a.transpose(1, 0, 2).reshape(t, h * ad)


def context_window(live: int) -> int:
    """The saved scores' row length ctx (the seed's aligned_context_window): the live slots start + T rounded up
    to a multiple of CTX_ALIGN (16 floats, one 64-byte line; the seed's own rounding is not in our notes)."""
    return -(-live // CTX_ALIGN) * CTX_ALIGN


def layer(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight, k_cache: NDArray,
          v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, gamma2: NDArray, w1: Weight, w2: Weight, *,
          n: int, h_q: int, h_kv: int, d: int, bq: NDArray | None = None, bk: NDArray | None = None,
          bv: NDArray | None = None, bo: NDArray | None = None, style: str = "half", gemma: bool = False,
          reference: str = "dequant", absolute: bool = False, scores: bool = False) -> dict[str, F64]:
    """A whole transformer layer over T tokens in cache slots start .. start + T - 1 (seed audit S9): the
    attention block, then the MLP block, pre-norm with the residual stream x.

        h1  = attention_prefill(x, gamma, ..., residual=x)["out"] = x + attn W_o^T (+ bo)
        out = mlp(h1, gamma2, eps, w1, w2)["out"]                  = h1 + down(SwiGLU(RMSNorm2(h1)))

    The seed's split (mega_fused_attention_prefill, then mega_fused_outproj_mlp_prefill with the attention output
    and residual = x) is the same math: outproj_mlp's h1 = attn W_o^T (+ bo) + residual is attention_prefill's
    out with residual x, its MLP the `mlp` on h1; the layer composes attention_prefill (W_o and the residual
    inside) and mlp. One eps and gemma for both norms (the model's); the MLP without biases or padding.

    arguments: `attention_prefill`'s (separate Q/K/V), and gamma2 (aE,), w1 (2I, aE) gate rows first, w2 (aE, I)
    returns: {"norm", "q", "k", "v", "q_rope", "k_rope", "attn", "k_cache", "v_cache": attention_prefill's;
              "h1": (T, aE) the attention block's output; "norm2", "h", "act", "down", "out": mlp's on h1}, and
              with scores "scores": (h_q, T, ctx) the attention's softmax probabilities P, the buffer the seed's
              backward reads (ctx = context_window(start + T)): P[h, t, j] for slots j <= start + t, 0 on the
              masked slots and on the padding lanes [start + T, ctx)
    absolute: the error model's magnitudes (module docstring) instead, "norm" left out: attention_prefill's
    (h1 its out), the mlp's with h1 computed (norm2 blended as outproj_mlp's norm); scores: P sqrt(1 + c_j^2 +
    sum_l P_l^2 c_l^2), c_j^2 = (q_rope^2 . k_j^2) / d the RSS of logit j's terms (dP_j = P_j (ds_j - sum_l
    P_l ds_l), each ds ~ the logit's terms' size), 0 where P is
    """
    x = np.asarray(x, dtype=np.float64)
    t = x.shape[0]
    live = start + t
    akw = dict(n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=x, style=style, gemma=gemma,
               reference=reference)
    if absolute:
        val, mags, at = _attention_pass(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, **akw)
        mv, mm = _mlp_pass(val["out"], mags["out"], gamma2, eps, w1, w2, n=n, b1=None, b2=None, inter=None,
                           gemma=gemma, reference=reference)
        res = {k: m for k, m in mags.items() if k not in ("norm", "out")}
        res.update(h1=mags["out"], norm2=mm["norm"], **{k: mm[k] for k in ("h", "act", "down", "out")})
        res = {k: np.sqrt(m.sq, out=m.sq) for k, m in res.items()}
        ac = _attention_comp(at, t, wo, h_q)
        mc = _mlp_comp(mv, val["out"], ac["out"], gamma2, eps, w1, w2, n=n, inter=None, gemma=gemma)
        comp = {"attn": ac["attn"], "h1": ac["out"], "norm2": mc["norm"], **{k: mc[k] for k in ("h", "act", "down",
                                                                                              "out")}}
        res.update({k + COMPUTE: np.sqrt(e) for k, e in comp.items()})
        if scores:
            qg = np.square(_grouped(val["q_rope"], h_kv))  # h_kv, G T, a_d
            c2 = qg @ np.square(val["k_cache"][:, :live]).transpose(0, 2, 1) / d  # h_kv, G T, live
            p = at.p
            res["scores"] = _context(p * np.sqrt(1.0 + c2 + np.sum(p * p * c2, axis=-1, keepdims=True)), h_q, t)
        return res
    a = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, **akw)
    m = mlp(a["out"], gamma2, eps, w1, w2, n=n, gemma=gemma, reference=reference)
    res = {k: v for k, v in a.items() if k != "out"}
    res.update(h1=a["out"], norm2=m["norm"], **{k: m[k] for k in ("h", "act", "down", "out")})
    if scores:
        res["scores"] = _context(_probabilities(a["q_rope"], a["k_cache"][:, :live], start, d), h_q, t)
    return res


def _context(p: F64, h_q: int, t: int) -> F64:
    """Grouped rows (h_kv, G T, live) as the saved scores (h_q, T, ctx), lanes [live, ctx) zero."""
    live = p.shape[-1]
    out = np.zeros((h_q, t, context_window(live)))
    out[..., :live] = p.reshape(h_q, t, live)
    return out


# -- backward ---------------------------------------------------------------------------------------------
def dense(w: Weight, k: int) -> F64:
    """The (N, K) float64 values of a Weight of K columns (dequantized; "f32_heads" flattened)."""
    if w.fmt == "f32_heads":
        h, n, ad = np.shape(w.data)
        return np.asarray(w.data, dtype=np.float64).transpose(1, 0, 2).reshape(n, h * ad)
    return gemm.dequantize_weight(w.fmt, {"w": w.data}, k)


def mlp_backward(x: NDArray, gamma: NDArray, eps: float, w1: Weight, w2: Weight, dout: NDArray, *, n: int,
                 b1: NDArray | None = None, b2: NDArray | None = None, inter: int | None = None,
                 gemma: bool = False, absolute: bool = False) -> dict[str, F64]:
    """VJP of `mlp` (the dequantized weights: L1) for the cotangent dout of its output.

    x: (T, aE), lanes [n, aE) zero;  gamma: (aE,);  w1: Weight (2aI, aE) gate rows first;  w2: Weight (aE, aI)
    b1: (2aI,), b2: (aE,) or None;  inter: the real I (`mlp`);  dout: (T, aE) the cotangent of out = x + down
    returns: {"dact": (T, aI), "dh": (T, 2aI) (dgate | dup), "dnorm": (T, aE), "dx": (T, aE),
              "dgamma": (aE,), "dw1": (2aI, aE), "dw2": (aE, aI)}, with "db1" = sum_t dh (2aI,) (the seed's
              d_b1: d_b_gate | d_b_up) and "db2" = sum_t dout (aE,) (d_b2, d_b_down) for the biases given.
              act's padding lanes are cleared by the forward: dact, dh, dw1's and db1's padded rows and dw2's
              padded columns are zero
    absolute: the error model's magnitudes instead (module docstring), every output: dact = sqrt(dout^2 @
    W2^2); dgate, dup: products of the blended dact, up, silu'(g) (silu''(g) for g's route), silu(g);
    dnorm = W1's on the blended dh; dx = sqrt(rstd^2 (g^2 c + xhat^2 sum_k xhat_k^2 g_k^2 c_k / n^2) +
    dout^2), c the blended dnorm^2; dgamma = sqrt(sum_t c xhat^2); dw1 = sqrt(c'^T @ norm^2), c' dh blended
    (its L, norm's n); dw2 = sqrt(dout^2^T @ the blended act); db1 = sqrt(sum_t c'), db2 = sqrt(sum_t dout^2).
    Measured (ci suite, cpu): cond <= 1.65 on `normal`, <= 2.2 on every distribution
    """
    if absolute:
        return _mlp_backward_mag(np.asarray(x, dtype=np.float64), gamma, eps, w1, w2,
                                 np.asarray(dout, dtype=np.float64), n=n, b1=b1, b2=b2, inter=inter, gemma=gemma)
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    fwd = mlp(x, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma)
    ai = fwd["act"].shape[-1]
    gate, up = _gate_up(fwd["h"], inter)
    i = gate.shape[-1]
    g2 = gemm.gemm_nt_backward(fwd["act"], dense(w2, ai), dout, bias=b2 is not None)  # down = act W2^T (+ b2)
    dact = _lanes(g2["da"][:, :i], ai)  # act's padding lanes are cleared: no gradient reaches them
    sw = mlp_ref.swiglu_backward(gate, up, dact[:, :i])
    dh = _halves(sw["dgate"], sw["dup"], ai)  # T, 2aI: gate first, as h
    g1 = gemm.gemm_nt_backward(fwd["norm"], dense(w1, x.shape[-1]), dh, bias=b1 is not None)  # h = norm W1^T (+ b1)
    nb = norm.rms_norm_backward(x, gamma, g1["da"], eps, n=n, gemma=gemma)
    out = {"dact": dact, "dh": dh, "dnorm": g1["da"], "dx": nb["dx"] + dout, "dgamma": nb["dw"],
           "dw1": g1["dw"], "dw2": g2["dw"]}
    if b1 is not None:
        out["db1"] = g1["db"]
    if b2 is not None:
        out["db2"] = g2["db"]
    return out


def attention_prefill_backward(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight,
                               wo: Weight, k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int,
                               dout: NDArray, *, n: int, h_q: int, h_kv: int, d: int, bq: NDArray | None = None,
                               bk: NDArray | None = None, bv: NDArray | None = None, bo: NDArray | None = None,
                               residual: NDArray | None = None, style: str = "half",
                               gemma: bool = False, absolute: bool = False, rope_off: int = 0,
                               qkv: str = "separate") -> dict[str, F64]:
    """VJP of `attention_prefill` (the dequantized weights: L1) for the cotangent dout of its output; the
    cache history (slots < start) is a constant.

    arguments: as `attention_prefill` (RoPE's transpose at the forward's positions rope_off + start + t);
    dout: (T, aE) the cotangent of out
    returns: stages {"dattn", "dq_rope", "dq": (T, h_q, a_d), "dk_rope", "dv", "dk": (T, h_kv, a_d),
             "dnorm": (T, aE)} and {"dx": (T, aE), "dgamma": (aE,), "dwq": (h_q a_d, aE), "dwk", "dwv":
             (h_kv a_d, aE), "dwo": (aE, h_q a_d)}, with "dbq", "dbk", "dbv", "dbo" for the biases given and
             "dr" (= dout) for a residual; with qkv="fused" "dwqkv" ((h_q + 2 h_kv) a_d, aE) and
             "dbqkv" in place of the three (`fused_grads`)
    absolute: the error model's magnitudes instead (module docstring), every output but "dr" (dout as
    given): dattn = sqrt(dout^2 @ W_o^2); the attention's dP = dO V^T and D = sum dO O (blended dO, V, O),
    dS = P (dP - D) with P^2 (M_dP^2 + M_D^2), dq = scale dS K, dk = scale dS^T Q (products of the blended
    factors), dv = P^T dO; RoPE's transpose in squared form; dnorm the three projections' sum; dx, dgamma as
    `mlp_backward`'s; dW = (blended dY)^T @ norm^2, db = sum_t (blended dY)^2, dwo = dout^2^T @ the blended
    attn, dbo = sum_t dout^2 (all under a sqrt). dq's weights dS sum to zero over the keys: it cancels the keys'
    common part (the bias bk) on any input, cond 1.2 .. 20 on `normal`; dbk, a sum of dk over the chunk,
    cancels further (up to 1.7e3)
    """
    if absolute:
        kw = dict(n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style,
                  gemma=gemma, rope_off=rope_off, qkv=qkv)
        return _attention_backward_mag(np.asarray(x, dtype=np.float64), gamma, eps, wq, wk, wv, wo, k_cache,
                                       v_cache, cos, sin, start, np.asarray(dout, dtype=np.float64), **kw)
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    t, ae = x.shape
    ad = np.shape(k_cache)[-1]
    wq, wk, wv, bq, bk, bv = qkv_sections(qkv, wq, wk, wv, bq, bk, bv, h_q=h_q, h_kv=h_kv, ad=ad)
    fwd = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q, h_kv=h_kv,
                            d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style, gemma=gemma,
                            rope_off=rope_off)
    go = gemm.gemm_nt_backward(fwd["attn"].reshape(t, h_q * ad), dense(wo, h_q * ad), dout, bias=bo is not None)
    dattn = go["da"].reshape(t, h_q, ad)
    live = start + t  # keys 0 .. live - 1: the history, then the chunk's own rows (bottom-right causal)
    ga = attention_grad.prefill_backward(fwd["q_rope"][None], _head_major(fwd["k_cache"][:, :live]),
                                         _head_major(fwd["v_cache"][:, :live]), dattn[None], causal="bottom_right",
                                         scale=1.0 / math.sqrt(d))
    real = (np.arange(ad) < d).astype(np.float64)  # the cache write cleared lanes [d, a_d) of the new rows
    dq_rope = ga["dq"][0]
    dk_rope, dv = ga["dk"][0, start:] * real, ga["dv"][0, start:] * real  # the new keys' rows only
    pos = rope_off + start + np.arange(t)
    dq = rope.rope_backward(dq_rope, cos, sin, pos, style=style, rot=d, at="first")
    dk = rope.rope_backward(dk_rope, cos, sin, pos, style=style, rot=d, at="first")
    nrm = fwd["norm"]
    proj = {name: gemm.gemm_nt_backward(nrm, dense(w, ae), dy.reshape(t, -1), bias=b is not None)
            for name, w, dy, b in (("q", wq, dq, bq), ("k", wk, dk, bk), ("v", wv, dv, bv))}
    dnorm = proj["q"]["da"] + proj["k"]["da"] + proj["v"]["da"]
    nb = norm.rms_norm_backward(x, gamma, dnorm, eps, n=n, gemma=gemma)
    out = {"dattn": dattn, "dq_rope": dq_rope, "dk_rope": dk_rope, "dv": dv, "dq": dq, "dk": dk, "dnorm": dnorm,
           "dx": nb["dx"], "dgamma": nb["dw"], "dwq": proj["q"]["dw"], "dwk": proj["k"]["dw"],
           "dwv": proj["v"]["dw"], "dwo": wo_grad(wo, go["dw"])}
    for name in ("q", "k", "v"):
        if "db" in proj[name]:
            out[f"db{name}"] = proj[name]["db"]
    if "db" in go:
        out["dbo"] = go["db"]
    if residual is not None:
        out["dr"] = dout.copy()
    return fused_grads(qkv, out)


def layer_backward(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                   k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, gamma2: NDArray,
                   w1: Weight, w2: Weight, dout: NDArray, *, n: int, h_q: int, h_kv: int, d: int,
                   bq: NDArray | None = None, bk: NDArray | None = None, bv: NDArray | None = None,
                   bo: NDArray | None = None, style: str = "half", gemma: bool = False,
                   absolute: bool = False) -> dict[str, F64]:
    """VJP of `layer` (seed audit S9; the dequantized weights: L1) for the cotangent dout of its output; the
    cache history is a constant. The two blocks' VJPs composed, the MLP's first:

        g   = mlp_backward(h1, gamma2, eps, w1, w2, dout)   h1 = the attention block's output (`layer`'s)
        dh1 = g["dx"]                                      = RMSNorm2's dx + dout (the MLP's residual)
        a   = attention_prefill_backward(x, ..., dh1, residual=x)
        dx  = a["dx"] + dh1                                 RMSNorm's dx + the attention's residual (dr = dh1)

    The saved scores (`layer`'s scores=1) are P itself: the VJP is the same whether a kernel recomputes P or
    reads it; only the rounding differs.
    arguments: `layer`'s, and dout (T, aE) the cotangent of out
    returns: the MLP's (LAYER_MLP_GRADS: "dact", "dh", "dnorm2", "dh1", "dgamma2", "dw1", "dw2"), then the
    attention's ("dattn", "dq_rope", "dk_rope", "dv", "dq", "dk", "dnorm", "dgamma", "dwq", "dwk", "dwv", "dwo",
    "dbq", "dbk", "dbv", "dbo" for the biases given) and "dx" (T, aE)
    absolute: the error model's magnitudes, the two blocks' composed: the MLP's at the golden h1 (taken as
    stored), the attention's for the golden dh1 (taken as stored: dh1's own rounding enters the specs' acc
    lengths, not these magnitudes), dx = sqrt(M_dx,attention^2 + M_dh1^2)
    """
    x, dout = np.asarray(x, dtype=np.float64), np.asarray(dout, dtype=np.float64)
    akw = dict(n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=x, style=style, gemma=gemma)
    h1 = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, **akw)["out"]
    m = mlp_backward(h1, gamma2, eps, w1, w2, dout, n=n, gemma=gemma)
    dh1 = m["dx"]
    a = attention_prefill_backward(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, dh1, **akw)
    res = {LAYER_MLP_GRADS[k]: v for k, v in m.items()}
    res.update({k: v for k, v in a.items() if k not in ("dx", "dr")})
    res["dx"] = a["dx"] + dh1
    if absolute:
        mm = mlp_backward(h1, gamma2, eps, w1, w2, dout, n=n, gemma=gemma, absolute=True)
        am = attention_prefill_backward(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, dh1, **akw,
                                        absolute=True)
        res = {LAYER_MLP_GRADS[k]: v for k, v in mm.items()}
        res.update({k: v for k, v in am.items() if k != "dx"})
        res["dx"] = np.sqrt(np.square(am["dx"]) + np.square(mm["dx"]))
    return res


# -- the error model (absolute=True; module docstring) ---------------------------------------------------
_ROWS = 2048  # weight rows squared at a time: (2048, K) float64 temporaries, never a second (N, K) copy


class _Mag(NamedTuple):
    """A stage's magnitude squared `sq` (the golden's shape) and the roundings `n` behind it (the reduction
    lengths along the pipeline, as the specs' acc_len sums them)."""

    sq: F64
    n: float


def _exact(v: F64) -> _Mag:
    """An input as stored: |value|, no rounding behind it."""
    return _Mag(v * v, 0.0)


def _blend(v: F64, m: _Mag, own: float) -> F64:
    """A computed operand v of a stage that rounds `own` times, in squared form: (own v^2 + n M^2) / (own + n)."""
    return (own * (v * v) + m.n * m.sq) / (own + m.n)


def _squared_rows(w: F64) -> Iterator[tuple[int, F64]]:
    """(first row, W's rows squared) a block of _ROWS rows at a time, in one reused buffer."""
    buf = np.empty((min(_ROWS, w.shape[0]), w.shape[1]))
    for lo in range(0, w.shape[0], _ROWS):  # memory, not the algorithm
        blk = w[lo:lo + _ROWS]
        yield lo, np.square(blk, out=buf[:len(blk)])


def _act_own(a: F64, w: Weight, reference: str) -> F64:
    """The activations the golden's products take: a, or ("emulated", a GGML weight) a rounded to float32 and
    quantized to the weight's activation format (Q8_0 / Q8_K), as gemm.emulated_reference does."""
    if reference != "emulated" or w.fmt in ("f32", "f32_heads"):
        return a
    act = quant.FORMATS[w.fmt].vec_dot
    return quant.dequantize(act, quant.quantize(act, a.astype(np.float32)))


def _project_mag(a: F64, m: _Mag, w: Weight, bias: NDArray | None, reference: str) -> tuple[F64, _Mag]:
    """a @ W^T (+ bias) with the dequantized W, and its magnitude: c @ (W^2)^T + bias^2, c the activations
    blended with their own error (own = K, the sum's length). a: (M, K); m: a's _Mag."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    k = a.shape[-1]
    wd = dense(w, k)  # N, K
    own = _act_own(a, w, reference)
    c = (k * (own * own) + m.n * m.sq) / (k + m.n)
    val, sq = a @ wd.T, np.empty((a.shape[0], wd.shape[0]))
    for lo, w2 in _squared_rows(wd):
        sq[:, lo:lo + len(w2)] = (w2 @ c.T).T  # the weight block on the left: BLAS's fast side for small M
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        val += b
        sq += b * b
    return val, _Mag(sq, k + m.n)


def _back(dy: F64, c: F64, w: F64) -> tuple[F64, F64]:
    """(dy @ W, c @ W^2): a projection's input gradient and its squared form. dy, c: (M, N); w: (N, K)."""
    val, sq = (w.T @ dy.T).T, np.zeros((dy.shape[0], w.shape[1]))
    for lo, w2 in _squared_rows(w):
        sq += (w2.T @ c[:, lo:lo + len(w2)].T).T
    return val, sq


def _gain2(gamma: NDArray, n: int, gemma: bool) -> F64:
    g = np.asarray(gamma, dtype=np.float64)[:n]
    return np.square(1.0 + g if gemma else g)


def _rstd(x: F64, eps: float, n: int) -> F64:
    return 1.0 / np.sqrt(np.mean(x[..., :n] ** 2, axis=-1) + eps)


def _rms_mag(x: F64, m: _Mag | None, gamma: NDArray, eps: float, n: int, gemma: bool) -> tuple[F64, _Mag]:
    """RMSNorm and its magnitude: |y| (n roundings in the mean of squares), blended, for a computed x, with
    x's error through it: dy_i = g rstd (dx_i - xhat_i mean(xhat dx))."""
    y = norm.rms_norm(x, gamma, eps, n=n, gemma=gemma)["y"]
    if m is None or m.n == 0:
        return y, _Mag(y * y, float(n))
    r2 = np.square(_rstd(x, eps, n))[..., None]
    xh2 = np.square(x[..., :n]) * r2
    mk = m.sq[..., :n]
    route = _gain2(gamma, n, gemma) * r2 * (mk + xh2 * np.sum(xh2 * mk, axis=-1, keepdims=True) / (n * n))
    sq = np.zeros_like(y)
    sq[..., :n] = (n * np.square(y[..., :n]) + m.n * route) / (n + m.n)
    return y, _Mag(sq, n + m.n)


def _rms_backward_mag(x: F64, gamma: NDArray, eps: float, n: int, gemma: bool, dy: F64, m: _Mag,
                      t: int) -> tuple[F64, F64]:
    """(dx^2, dgamma^2) of RMSNorm's VJP at stored x for a computed cotangent dy (m): rstd^2 (g^2 c + xhat^2
    sum_k xhat_k^2 g_k^2 c_k / n^2) with c = dy blended (own n), and sum_t c xhat^2 (own t)."""
    r2 = np.square(_rstd(x, eps, n))[..., None]
    xh2 = np.square(x[..., :n]) * r2
    g2 = _gain2(gamma, n, gemma)
    sub = _Mag(m.sq[..., :n], m.n)
    c = g2 * _blend(dy[..., :n], sub, float(n))
    dx = np.zeros_like(x)
    dx[..., :n] = r2 * (c + xh2 * np.sum(xh2 * c, axis=-1, keepdims=True) / (n * n))
    dg = np.zeros(x.shape[-1])
    dg[:n] = np.sum(_blend(dy[..., :n], sub, float(t)) * xh2, axis=0)
    return dx, dg


def _rope_sq(sq: F64, cos: NDArray, sin: NDArray, pos: NDArray, style: str, d: int) -> F64:
    """RoPE (or its transpose) in squared form: each rotated lane a^2 cos^2 + b^2 sin^2 (or a^2 sin^2 +
    b^2 cos^2) of its pair; lanes [d, a_d) as they are. sq: (T, h, a_d)."""
    c2 = np.square(np.asarray(cos, dtype=np.float64)[pos])[:, None, :]  # T, 1, d/2
    s2 = np.square(np.asarray(sin, dtype=np.float64)[pos])[:, None, :]
    out = sq.copy()
    lanes = (slice(0, d, 2), slice(1, d, 2)) if style == "interleaved" else (slice(0, d // 2), slice(d // 2, d))
    a, b = sq[..., lanes[0]], sq[..., lanes[1]]
    out[..., lanes[0]], out[..., lanes[1]] = a * c2 + b * s2, a * s2 + b * c2
    return out


def _grouped(a: F64, h_kv: int) -> F64:
    """(T, h_q, a_d) -> (h_kv, G T, a_d): the G query heads of each kv head stacked (row r T + t: head kv G + r)."""
    t, hq, ad = a.shape
    return a.reshape(t, h_kv, hq // h_kv, ad).transpose(1, 2, 0, 3).reshape(h_kv, hq // h_kv * t, ad)


def _ungrouped(a: F64, t: int) -> F64:
    """`_grouped`'s inverse: (h_kv, G T, a_d) -> (T, h_q, a_d)."""
    hkv, gt, ad = a.shape
    return a.reshape(hkv, gt // t, t, ad).transpose(2, 0, 1, 3).reshape(t, gt // t * hkv, ad)


class _Attn(NamedTuple):
    """The attention stage in the grouped layout (h_kv, G T, .)."""

    p: F64  # probabilities (h_kv, G T, live), 0 where masked
    o: F64  # the output (h_kv, G T, a_d)
    om: _Mag
    s2: F64  # sigma^2 (h_kv, G T, live): a logit's fp32 error in units of u32, squared (`_logit_sigma2`)
    oc: F64  # the output's compute-precision term squared (h_kv, G T, a_d): sum_j P_j^2 sigma_j^2 (V_j - O)^2


def _logit_sigma2(q: F64, qm: _Mag, kc: F64, km: _Mag, start: int, d: int) -> F64:
    """sigma^2 (h_kv, G T, live) of each scaled logit s = q.k / sqrt(d): its fp32 error is ~u32 sigma, sigma^2 =
    s^2 (its own rounding) + (d + L_q + L_k) (qm^2 . km^2) / d (the RSS of its terms, weighted by the roundings
    behind them: the dot's d and q's, k's accumulated lengths)."""
    hkv = kc.shape[0]
    qg, qg2 = _grouped(q, hkv), _grouped(qm.sq, hkv)
    s = qg @ kc.transpose(0, 2, 1) / math.sqrt(d)
    return s * s + (d + qm.n + km.n) * (qg2 @ km.sq.transpose(0, 2, 1)) / d


def _attention_mag(q: F64, kc: F64, vc: F64, vm: _Mag, start: int, d: int, qm: _Mag, km: _Mag) -> _Attn:
    """Bottom-right causal attention of q (T, h_q, a_d) over the live cache slots kc, vc (h_kv, live, a_d), and
    its magnitude sqrt(sum_j P_j^2 V_j^2), V blended (own: the keys) with vm (the stored history's |value|); the
    compute-precision term of P's sensitivity to the logits' rounding (attention.logit_error_sq) from q's and
    the keys' magnitudes qm, km."""
    live = kc.shape[1]
    p = _probabilities(q, kc, start, d)
    o = p @ vc
    s2 = _logit_sigma2(q, qm, kc, km, start, d)
    return _Attn(p, o, _Mag((p * p) @ _blend(vc, vm, float(live)), live + vm.n), s2,
                 attention.logit_error_sq(p, s2, vc, o))


def _sq_project(e2: F64, w: F64) -> F64:
    """An absolute error's squared form through a @ W^T: e2 (M, K) @ (W^2)^T, W (N, K)."""
    sq = np.empty((e2.shape[0], w.shape[0]))
    for lo, w2 in _squared_rows(w):
        sq[:, lo:lo + len(w2)] = (w2 @ e2.T).T
    return sq


def _sq_back(e2: F64, w: F64) -> F64:
    """An absolute error's squared form through dy @ W: e2 (M, N) @ W^2, W (N, K)."""
    sq = np.zeros((e2.shape[0], w.shape[1]))
    for lo, w2 in _squared_rows(w):
        sq += (w2.T @ e2[:, lo:lo + len(w2)].T).T
    return sq


def _attention_comp(at: _Attn, t: int, wo: Weight, h_q: int) -> dict[str, F64]:
    """The compute-precision terms squared of the attention block's outputs: attn's, and out's through W_o."""
    attn = _ungrouped(at.oc, t)
    return {"attn": attn, "out": _sq_project(attn.reshape(t, -1), dense(wo, h_q * attn.shape[-1]))}


def _rms_comp(x: F64, e2: F64, gamma: NDArray, eps: float, n: int, gemma: bool) -> F64:
    """RMSNorm's output error (squared) from an absolute error e2 of its input x: g^2 rstd^2 (e2 + xhat^2
    sum(xhat^2 e2) / n^2) on the n real lanes (dy = g rstd (dx - xhat mean(xhat dx)))."""
    r2 = np.square(_rstd(x, eps, n))[..., None]
    xh2 = np.square(x[..., :n]) * r2
    out = np.zeros_like(x)
    ek = e2[..., :n]
    out[..., :n] = _gain2(gamma, n, gemma) * r2 * (ek + xh2 * np.sum(xh2 * ek, axis=-1, keepdims=True) / (n * n))
    return out


def _mlp_comp(val: dict[str, F64], x: F64, e2: F64, gamma: NDArray, eps: float, w1: Weight, w2: Weight, *, n: int,
              inter: int | None, gemma: bool) -> dict[str, F64]:
    """The MLP block's stages' compute-precision terms squared from its input's (e2; x its value): RMSNorm's,
    the projections' (squared weights), SwiGLU's derivative (silu'(g) up, silu(g)), and the residual's."""
    ae = x.shape[-1]
    nrm = _rms_comp(x, e2, gamma, eps, n, gemma)
    h = _sq_project(nrm, dense(w1, ae))
    ai = h.shape[-1] // 2
    (gate, up), (eg, eu) = _gate_up(val["h"], inter), _gate_up(h, inter)
    act = _lanes(np.square(mlp_ref.silu_grad(gate) * up) * eg + np.square(mlp_ref.silu(gate)) * eu, ai)
    down = _sq_project(act, dense(w2, ai))
    return {"norm": nrm, "h": h, "act": act, "down": down, "out": e2 + down}


def _logits_of(qg: F64, kc: F64, d: int) -> F64:
    """The scaled logits (h_kv, G T, live) of grouped queries qg over keys kc (h_kv, live, a_d)."""
    return qg @ kc.transpose(0, 2, 1) / math.sqrt(d)


def _keep(t: int, g: int, live: int, start: int) -> NDArray:
    """(G T, live) bottom-right causal mask of the grouped rows (row r T + t sees slots j <= start + t)."""
    tok = np.arange(g * t) % t
    return np.arange(live)[None, :] <= start + tok[:, None]


def _probabilities(q: F64, kc: F64, start: int, d: int) -> F64:
    """The softmax probabilities P (h_kv, G T, live) of q (T, h_q, a_d) over the live slots kc (h_kv, live, a_d)
    (grouped rows, `_grouped`), bottom-right causal, scale 1/sqrt(d); 0 where masked."""
    t, (hkv, live, _) = q.shape[0], kc.shape
    qg = _grouped(q, hkv)
    keep = _keep(t, qg.shape[1] // t, live, start)
    s = np.where(keep, qg @ kc.transpose(0, 2, 1) / math.sqrt(d), -np.inf)  # h_kv, G T, live
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p


def _attention_pass(x: NDArray, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                    k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, *, n: int, h_q: int,
                    h_kv: int, d: int, bq: NDArray | None, bk: NDArray | None, bv: NDArray | None,
                    bo: NDArray | None, residual: NDArray | None, style: str, gemma: bool,
                    reference: str, rope_off: int = 0) -> tuple[dict[str, F64], dict[str, _Mag], _Attn]:
    """`attention_prefill`'s stages (values) and their magnitudes, stage by stage."""
    x = np.asarray(x, dtype=np.float64)
    t, ad = x.shape[0], np.shape(k_cache)[-1]
    nrm, nm = _rms_mag(x, None, gamma, eps, n, gemma)
    val, mag = {"norm": nrm}, {"norm": nm}
    for name, w, b, h in (("q", wq, bq, h_q), ("k", wk, bk, h_kv), ("v", wv, bv, h_kv)):
        v, m = _project_mag(nrm, nm, w, b, reference)
        val[name], mag[name] = v.reshape(t, h, ad), _Mag(m.sq.reshape(t, h, ad), m.n)
    pos = rope_off + start + np.arange(t)
    for name in ("q", "k"):
        val[f"{name}_rope"] = rope.rope(val[name], cos, sin, pos, style=style, rot=d, at="first")
        mag[f"{name}_rope"] = _Mag(_rope_sq(_blend(val[name], mag[name], 1.0), cos, sin, pos, style, d),
                                   mag[name].n + 1.0)
    live = start + t
    for name, cache, new in (("k_cache", k_cache, "k_rope"), ("v_cache", v_cache, "v")):
        val[name] = _write(cache, val[new], start, d)
        mag[name] = _Mag(_write(np.square(np.asarray(cache, dtype=np.float64)), mag[new].sq, start, d), mag[new].n)
    vm = mag["v_cache"]
    km = mag["k_cache"]
    at = _attention_mag(val["q_rope"], val["k_cache"][:, :live], val["v_cache"][:, :live],
                        _Mag(vm.sq[:, :live], vm.n), start, d, mag["q_rope"], _Mag(km.sq[:, :live], km.n))
    val["attn"], mag["attn"] = _ungrouped(at.o, t), _Mag(_ungrouped(at.om.sq, t), at.om.n)
    out, om = _project_mag(val["attn"].reshape(t, -1), _Mag(mag["attn"].sq.reshape(t, -1), at.om.n), wo, bo,
                           reference)
    if residual is not None:
        r = np.asarray(residual, dtype=np.float64)
        out, om = out + r, _Mag(_blend(out, om, 1.0) + r * r, om.n + 1.0)
    val["out"], mag["out"] = out, om
    return val, mag, at


def _mlp_pass(x: F64, xm: _Mag | None, gamma: NDArray, eps: float, w1: Weight, w2: Weight, *, n: int,
              b1: NDArray | None, b2: NDArray | None, inter: int | None, gemma: bool,
              reference: str) -> tuple[dict[str, F64], dict[str, _Mag]]:
    """`mlp`'s stages and their magnitudes; xm: x's when x is computed (outproj_mlp's h1), None as stored."""
    nrm, nm = _rms_mag(x, xm, gamma, eps, n, gemma)
    h, hm = _project_mag(nrm, nm, w1, b1, reference)
    ai = h.shape[-1] // 2
    (gate, up), (g2, u2) = _gate_up(h, inter), _gate_up(hm.sq, inter)
    sg, dg = mlp_ref.silu(gate), mlp_ref.silu_grad(gate)
    act = _lanes(sg * up, ai)
    am = _Mag(_lanes((np.square(sg * up) + hm.n * (np.square(dg * up) * g2 + sg * sg * u2)) / (1.0 + 2.0 * hm.n), ai),
              hm.n + 1.0)
    down, dm = _project_mag(act, am, w2, b2, reference)
    xs = x * x if xm is None else _blend(x, xm, 1.0)
    val = {"norm": nrm, "h": h, "act": act, "down": down, "out": x + down}
    return val, {"norm": nm, "h": hm, "act": am, "down": dm, "out": _Mag(xs + _blend(down, dm, 1.0), dm.n + 1.0)}


def _weight_grad_sq(dy: F64, m: _Mag, a2: F64, own: float) -> F64:
    """dW = dy^T @ a's squared form: (dy blended, own the rows plus a's roundings)^T @ a^2."""
    return _blend(dy, m, own).T @ a2


def _mlp_backward_mag(x: F64, gamma: NDArray, eps: float, w1: Weight, w2: Weight, dout: F64, *, n: int,
                      b1: NDArray | None, b2: NDArray | None, inter: int | None, gemma: bool) -> dict[str, F64]:
    val, mag = _mlp_pass(x, None, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma,
                         reference="dequant")
    t, ae, ai = x.shape[0], x.shape[-1], val["act"].shape[-1]
    (gate, up), (g2, u2), lh = _gate_up(val["h"], inter), _gate_up(mag["h"].sq, inter), mag["h"].n
    i = gate.shape[-1]
    d2 = dout * dout
    dact, sq = _back(dout, d2, dense(w2, ai))  # dout W2: stored factors
    dact, dam = dact[:, :i], _Mag(sq[:, :i], float(ae))  # the real lanes (the padding's gradient is zero)
    sg, s1 = mlp_ref.silu(gate), mlp_ref.silu_grad(gate)
    s2 = mlp_ref.sigmoid_grad(gate) * (2.0 + gate * (mlp_ref.sigmoid(-gate) - mlp_ref.sigmoid(gate)))  # silu''
    dgate, dup = dact * up * s1, dact * sg
    dgs = (dgate * dgate + dam.n * dam.sq * np.square(up * s1)
           + lh * (u2 * np.square(dact * s1) + g2 * np.square(dact * up * s2))) / (1.0 + dam.n + 2.0 * lh)
    dus = (dup * dup + dam.n * dam.sq * sg * sg + lh * g2 * np.square(dact * s1)) / (1.0 + dam.n + lh)
    dh, dhm = _halves(dgate, dup, ai), _Mag(_halves(dgs, dus, ai), 1.0 + max(dam.n, lh))
    dnorm, sq = _back(dh, _blend(dh, dhm, 2.0 * i), dense(w1, ae))
    dnm = _Mag(sq, 2.0 * i + dhm.n)
    dx, dg = _rms_backward_mag(x, gamma, eps, n, gemma, dnorm, dnm, t)
    out = {"dact": _lanes(dam.sq, ai), "dh": dhm.sq, "dnorm": dnm.sq, "dx": dx + d2, "dgamma": dg,
           "dw1": _weight_grad_sq(dh, dhm, np.square(val["norm"]), float(t + n)),
           "dw2": d2.T @ _blend(val["act"], mag["act"], float(t))}
    if b1 is not None:
        out["db1"] = np.sum(_blend(dh, dhm, float(t)), axis=0)
    if b2 is not None:
        out["db2"] = np.sum(d2, axis=0)
    return {k: np.sqrt(v, out=v) for k, v in out.items()}  # in place: dW is (N, K)


def _attention_backward_mag(x: F64, gamma: NDArray, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                            k_cache: NDArray, v_cache: NDArray, cos: NDArray, sin: NDArray, start: int, dout: F64, *,
                            n: int, h_q: int, h_kv: int, d: int, bq: NDArray | None, bk: NDArray | None,
                            bv: NDArray | None, bo: NDArray | None, residual: NDArray | None, style: str,
                            gemma: bool, rope_off: int = 0, qkv: str = "separate") -> dict[str, F64]:
    wq, wk, wv, bq, bk, bv = qkv_sections(qkv, wq, wk, wv, bq, bk, bv, h_q=h_q, h_kv=h_kv, ad=np.shape(k_cache)[-1])
    val, mag, at = _attention_pass(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q,
                                   h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style,
                                   gemma=gemma, reference="dequant", rope_off=rope_off)
    t, ae = x.shape
    ad, live = np.shape(k_cache)[-1], start + t
    d2 = dout * dout
    dattn, sq = _back(dout, d2, dense(wo, h_q * ad))  # dout W_o: stored factors
    ldo = float(ae)
    do, do2 = _grouped(dattn.reshape(t, h_q, ad), h_kv), _grouped(sq.reshape(t, h_q, ad), h_kv)
    kc, vc = val["k_cache"][:, :live], val["v_cache"][:, :live]  # h_kv, live, a_d
    km, vm, qm = mag["k_cache"], mag["v_cache"], mag["q_rope"]
    k2m, v2m = km.sq[:, :live], vm.sq[:, :live]
    qg, q2m = _grouped(val["q_rope"], h_kv), _grouped(qm.sq, h_kv)
    p, o, rows = at.p, at.o, at.p.shape[1]
    dp = do @ vc.transpose(0, 2, 1)  # h_kv, G T, live
    dd = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - dd)
    dos, bdo = do * do, ad * do * do + ldo * do2  # dO^2, and dO blended (own a_d) times (a_d + L_dO)
    dp2 = (bdo @ np.square(vc).transpose(0, 2, 1) + vm.n * dos @ v2m.transpose(0, 2, 1)) / (ad + ldo + vm.n)
    dd2 = np.sum(bdo * o * o + at.om.n * dos * at.om.sq, axis=-1, keepdims=True) / (ad + ldo + at.om.n)
    n_diff, p2 = ad + max(ldo, vm.n, at.om.n), p * p
    ds2 = (ds * ds + n_diff * p2 * (dp2 + dd2)) / (1.0 + n_diff)  # P (dP - D): P's value, dP - D's terms
    n_ds, s2d = 1.0 + n_diff, ds * ds
    grads = {"dq_rope": (ds @ kc / math.sqrt(d),
                         ((live * s2d + n_ds * ds2) @ np.square(kc) + km.n * s2d @ k2m) / (d * (live + n_ds + km.n)),
                         live + max(n_ds, km.n)),
             "dk_rope": (ds.transpose(0, 2, 1) @ qg / math.sqrt(d),
                         ((rows * s2d + n_ds * ds2).transpose(0, 2, 1) @ np.square(qg)
                          + qm.n * s2d.transpose(0, 2, 1) @ q2m) / (d * (rows + n_ds + qm.n)),
                         rows + max(n_ds, qm.n)),
             "dv": (p.transpose(0, 2, 1) @ do, p2.transpose(0, 2, 1) @ _blend(do, _Mag(do2, ldo), float(rows)),
                    rows + ldo)}
    # compute-precision terms (squared): P recomputed as exp(s - L) with the fp32 LSE carries each logit's
    # sigma^2, L's own rounding L^2 and the forward's sum_l P_l^2 sigma_l^2 (no normalization cancels them)
    sl = np.where(_keep(t, rows // t, live, start), _logits_of(qg, kc, d), -np.inf)  # every row sees slot 0
    mx = np.max(sl, axis=-1, keepdims=True)
    lse = mx + np.log(np.sum(np.exp(sl - mx), axis=-1, keepdims=True))
    eps2 = at.s2 + lse * lse + np.sum(p2 * at.s2, axis=-1, keepdims=True)
    w2 = p2 * eps2
    ed = np.sum(dos * at.oc, axis=-1, keepdims=True)  # D = dO . O through O's own term
    eds = s2d * eps2 + p2 * ed
    comp = {"dq_rope": eds @ np.square(kc) / d, "dk_rope": eds.transpose(0, 2, 1) @ np.square(qg) / d,
            "dv": w2.transpose(0, 2, 1) @ dos}
    real = (np.arange(ad) < d).astype(np.float64)
    cg = {}
    for name, e in comp.items():
        cg[name] = _ungrouped(e, t) if name == "dq_rope" else e[:, start:].transpose(1, 0, 2) * real
    g, m = {}, {}
    for name, (v, s, nn) in grads.items():
        if name == "dq_rope":
            g[name], s = _ungrouped(v, t), _ungrouped(s, t)
        else:  # the new keys' rows, lanes [d, a_d) cleared by the write
            g[name], s = v[:, start:].transpose(1, 0, 2) * real, s[:, start:].transpose(1, 0, 2) * real
        m[name] = _Mag(s, float(nn))
    pos = rope_off + start + np.arange(t)
    for name in ("dq", "dk"):
        src = f"{name}_rope"
        g[name] = rope.rope_backward(g[src], cos, sin, pos, style=style, rot=d, at="first")
        m[name] = _Mag(_rope_sq(_blend(g[src], m[src], 1.0), cos, sin, pos, style, d), m[src].n + 1.0)
        cg[name] = _rope_sq(cg[src], cos, sin, pos, style, d)
    own = float((h_q + 2 * h_kv) * ad)  # dnorm sums the three projections' terms
    dnorm, sq = np.zeros((t, ae)), np.zeros((t, ae))
    for name, w in (("dq", wq), ("dk", wk), ("dv", wv)):
        dy = g[name].reshape(t, -1)
        pv, ps = _back(dy, _blend(dy, _Mag(m[name].sq.reshape(t, -1), m[name].n), own), dense(w, ae))
        dnorm, sq = dnorm + pv, sq + ps
    dnm = _Mag(sq, own + max(m[k].n for k in ("dq", "dk", "dv")))
    dx, dgam = _rms_backward_mag(x, gamma, eps, n, gemma, dnorm, dnm, t)
    cg["dnorm"] = sum(_sq_back(cg[k].reshape(t, -1), dense(w, ae)) for k, w in (("dq", wq), ("dk", wk), ("dv", wv)))
    cg["dx"] = _rms_comp(x, cg["dnorm"], gamma, eps, n, gemma)
    xh2 = np.square(x[..., :n]) * np.square(_rstd(x, eps, n))[..., None]
    cg["dgamma"] = np.zeros(ae)
    cg["dgamma"][:n] = np.sum(cg["dnorm"][..., :n] * xh2, axis=0)
    cg["dwo"] = wo_grad(wo, d2.T @ _ungrouped(at.oc, t).reshape(t, -1))
    out = {"dattn": _ungrouped(do2, t), **{k: v.sq for k, v in m.items()}, "dnorm": dnm.sq, "dx": dx,
           "dgamma": dgam, "dwo": wo_grad(wo, d2.T @ _blend(val["attn"].reshape(t, -1),
                                                        _Mag(mag["attn"].sq.reshape(t, -1), mag["attn"].n), float(t)))}
    n2 = np.square(val["norm"])
    for name, b in (("q", bq), ("k", bk), ("v", bv)):
        dy, mm = g[f"d{name}"].reshape(t, -1), m[f"d{name}"]
        sub = _Mag(mm.sq.reshape(t, -1), mm.n)
        out[f"dw{name}"] = _weight_grad_sq(dy, sub, n2, float(t + n))
        cg[f"dw{name}"] = cg[f"d{name}"].reshape(t, -1).T @ n2
        if b is not None:
            out[f"db{name}"] = np.sum(_blend(dy, sub, float(t)), axis=0)
            cg[f"db{name}"] = np.sum(cg[f"d{name}"].reshape(t, -1), axis=0)
    if bo is not None:
        out["dbo"] = np.sum(d2, axis=0)
    out = {k: np.sqrt(v, out=v) for k, v in fused_grads(qkv, out).items()}  # in place: dW is (N, K)
    return {**out, **{k + COMPUTE: np.sqrt(v, out=v) for k, v in fused_grads(qkv, cg).items()}}
