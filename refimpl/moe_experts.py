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

Block-FP8 weights (DeepSeek-V3; vLLM's fused_moe with block_shape [128, 128]): a weight may be a `BlockFP8`,
e4m3fn codes (E, N, K) and one fp32 scale per 128 x 128 block (E, ceil(N / 128), ceil(K / 128)); expert e's
matrix is code x its block's scale, formed exactly in float64 when the expert's tokens are gathered
(refimpl.quant_fp.fp8_dequantize_blocks), never as a whole float64 copy. w8a16 (vLLM's FP8 Marlin MoE path):
nothing else changes, the activations stay in the model dtype.

GGML weights (llama.cpp's MoE GGUFs run through ggml_mul_mat_id over expert-stacked quantized tensors): a weight may
be a `GGMLWeight`, the GGML blocks of each expert's rows (E, N, K / QK * nbytes) uint8 in one of `GGML_FMTS`
(q8_0, q4_0, q4_k, q6_k; refimpl.quant's byte-exact formats), every row K / QK little-endian blocks of its K
columns (ggml's ne[0]: w13's rows along D, w2's along F); expert e's matrix is refimpl.quant.dequantize of its
rows, exact in float64, formed when the expert's tokens are gathered. The activation semantics are the
dequantize-then-float path (w-only: a kernel that decodes the blocks to floating point, in its K loop or into a
buffer, and multiplies in it): x and act stay in the model dtype, act rounded to act_dtype as for dense weights.
ggml's CPU vec_dot path (x and act quantized to q8_0 / q8_K) and its CUDA MMQ path (q8_1) are not this golden's:
they add the activation quantizer's error (~2^-7 relative RMS on out), which a w-only kernel does not have and the
limits here do not hold (conformance/ops/moe_experts.py).

w8a8 (`act_quant="e4m3"`, DeepSeek-V3 / vLLM's fused_moe use_fp8_w8a8 with block weights): both GEMMs' inputs are
quantized per token per 128 consecutive columns (the last group of a row shorter when the length is not a multiple
of 128): s = float32(amax |group|) / 448 (an IEEE float32 division; vLLM floors amax at 1e-10, a floor that only
a group of magnitudes below 1e-10 reaches: none here; an all-zero group has s = 0 and codes 0, the same values),
codes = e4m3fn(RNE(clamp(float32(v) / s, +-448))) (refimpl.kvquant.quantize: the IEEE division, bit-exact in
float32) and the GEMM reads codes x s, exact in float64:
- x: as stored (bf16 / fp16 / fp32 values are exact in float32): its codes are bit-exact functions of x, so every
  correct kernel quantizes x to the golden's codes and scales;
- act: the SwiGLU output, rounded to act_dtype first (vLLM's intermediate_cache2 in the activation dtype, then
  per_token_group_quant_fp8), then quantized. The golden's act is float64 rounded once; a kernel's is fp32 and can
  sit on the other side of a rounding midpoint: that is the act quantizer's code flip, bounded in the magnitude
  (`act_flip_bound`, below).

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
w8a8: M as above on the quantized x and with the dequantized act in place of act_r. An e4m3 flip of act moves a
term by up to 2^-3 of it, beyond any u M: `flip_bound=True` returns its bound instead ((2, T, D): the code steps'
and the group scales' change; `act_flip_bound`), which conformance/ops/moe_experts.py adds to M.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.threads import on_threads

F64 = NDArray[np.float64]


def _silu_parts(g: F64) -> tuple[F64, F64]:
    """(silu(g), silu'(g)) in float64: g s(g) and s(g) (1 + g (1 - s(g))), s the logistic sigmoid."""
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s * (1.0 + g * (1.0 - s))


FP8_BLOCK = 128  # the block of the weights' scales (128 x 128) and the activations' groups (1 x 128)


class BlockFP8:
    """A block-FP8 weight (E, N, K): e4m3fn codes (E, N, K) and fp32 scales (E, ceil(N / 128), ceil(K / 128)).
    w[e] is expert e's matrix, code x block scale in float64 (exact); shape / ndim as the dense weight's."""

    def __init__(self, codes: NDArray, scales: NDArray):
        codes, scales = np.asarray(codes), np.asarray(scales)
        if codes.ndim != 3 or codes.dtype.itemsize != 1 or codes.dtype.kind not in "fV":
            raise ValueError(f"moe.experts: block-FP8 codes must be (E, N, K) float8_e4m3fn, got shape {codes.shape} "
                             f"dtype {codes.dtype}")
        e, n, k = codes.shape
        want = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        if scales.shape != want:
            raise ValueError(f"moe.experts: block-FP8 scales must be (E, ceil(N/128), ceil(K/128)) = {want}, got "
                             f"{scales.shape}")
        self.codes, self.scales = codes, scales
        self.shape, self.ndim = codes.shape, 3

    def __getitem__(self, e) -> F64:
        from kernel_parity.refimpl.quant_fp import fp8_dequantize_blocks

        return fp8_dequantize_blocks(self.codes[e], self.scales[e], FP8_BLOCK, FP8_BLOCK)


GGML_FMTS = ("q8_0", "q4_0", "q4_k", "q6_k")


class GGMLWeight:
    """A GGML-quantized weight (E, N, K): `fmt` one of GGML_FMTS, blocks (E, N, K / QK * nbytes) uint8, each row
    K / QK consecutive blocks (refimpl.quant's layout). w[e] is expert e's (N, K) matrix, refimpl.quant.dequantize
    (exact float64); shape / ndim as the dense weight's."""

    def __init__(self, fmt: str, blocks: NDArray):
        from kernel_parity.refimpl.quant import FORMATS

        if fmt not in GGML_FMTS:
            raise ValueError(f"moe.experts: GGML weight format must be one of {', '.join(GGML_FMTS)}, got {fmt!r}")
        blocks = np.asarray(blocks)
        f = FORMATS[fmt]
        if blocks.ndim != 3 or blocks.dtype != np.uint8 or blocks.shape[2] % f.nbytes:
            raise ValueError(f"moe.experts: {fmt} blocks must be (E, N, K / {f.block} * {f.nbytes}) uint8, got shape "
                             f"{blocks.shape} dtype {blocks.dtype}")
        self.fmt, self.blocks = fmt, blocks
        self.shape, self.ndim = (blocks.shape[0], blocks.shape[1], blocks.shape[2] // f.nbytes * f.block), 3

    def __getitem__(self, e) -> F64:
        from kernel_parity.refimpl.quant import dequantize

        return dequantize(self.fmt, self.blocks[e])


ACT_QUANTS = (None, "e4m3")


def group_quantize(v: NDArray) -> tuple[F64, F64]:
    """Per-row, per-128-column e4m3 quantization of v (n, L) (module docstring, w8a8): (the dequantized values
    codes x s (n, L) float64, exact; the scales (n, ceil(L / 128)) float64 of float32 values)."""
    from kernel_parity.refimpl.kvquant import dequantize, dynamic_scale, quantize

    v32 = np.asarray(v, dtype=np.float32)
    n, length = v32.shape
    groups = -(-length // FP8_BLOCK)
    pad = np.zeros((n, groups * FP8_BLOCK), dtype=np.float32)
    pad[:, :length] = v32
    pad = pad.reshape(n, groups, FP8_BLOCK)
    s = dynamic_scale(pad, "e4m3", axis=-1)  # float32(amax) / 448, IEEE
    codes = quantize(pad, s[..., None], "e4m3")
    return dequantize(codes, s[..., None]).reshape(n, -1)[:, :length], s.astype(np.float64)


def _round(a: F64, act_dtype) -> F64:
    if act_dtype is None:
        return a
    with np.errstate(over="ignore"):
        return np.asarray(a).astype(act_dtype).astype(np.float64)


def _mlp(xs: F64, w13: NDArray, w2: NDArray, act_dtype, absolute: bool, act_quant: str | None = None,
         flip: bool = False) -> F64:
    """One expert's SwiGLU MLP over the gathered rows xs (n, D) (already quantized under w8a8): its output (n, D),
    its magnitude squared (absolute), or the act quantizer's flip bound (flip, `act_flip_bound`)."""
    w13 = np.asarray(w13, dtype=np.float64)
    w2 = np.asarray(w2, dtype=np.float64)
    f = w13.shape[0] // 2
    d = xs.shape[1]
    h = xs @ w13.T
    g, u = h[:, :f], h[:, f:]
    sg, dsg = _silu_parts(g)
    act = sg * u
    act_r = _round(act, act_dtype)
    scales = None
    if act_quant is not None:
        act_r, scales = group_quantize(act_r)  # the dequantized codes: what the down projection reads
    if not absolute and not flip:
        return act_r @ w2.T
    x2, w13sq = xs * xs, w13 * w13
    mg2, mu2 = x2 @ w13sq[:f].T, x2 @ w13sq[f:].T
    big_l = 1.0 + 2.0 * d
    act2 = (act * act + d * (dsg * u) ** 2 * mg2 + d * sg * sg * mu2) / big_l
    if flip:
        return act_flip_bound(act, act2 * big_l, act_r, scales, w2, act_dtype)
    a2 = act_r * act_r
    c = np.maximum(a2, (f * a2 + big_l * act2) / (f + big_l))  # never below act's own square (module docstring)
    return c @ (w2 * w2).T


FLIP_R = 2.0  # the act error radius, in units of eps32 sqrt(L) M_act (module docstring, `act_flip_bound`)
EPS32 = 2.0 ** -23


def _e4m3(y: NDArray) -> F64:
    """e4m3fn(RNE(clamp(float32 y, +-448))) as float64 (monotone in y)."""
    import ml_dtypes

    y32 = np.clip(np.asarray(y, dtype=np.float32), -448.0, 448.0)
    return y32.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def act_flip_bound(act: F64, lsq: F64, act_q: F64, scales: F64, w2: F64, act_dtype) -> F64:
    """The act quantizer's bounds (2, n, D) on |kernel - golden| of one expert's down projection (module docstring):
    [0] the code steps', [1] the group scales' change.

    act (n, F): the golden's float64 act; lsq: L M_act^2, its error model's squared magnitude times the length;
    act_q, scales: the golden's dequantized act and its group scales (n, G). A kernel's fp32 act lies within
    r = FLIP_R eps32 (sqrt(lsq) + |act|) of act; rounded to act_dtype (monotone) it is in [rnd(act - r),
    rnd(act + r)], its group's amax in [A_lo, A_hi] (the intervals' least and largest |.|), its scale s' in
    [s_lo, s_hi] = float32([A_lo, A_hi] / 448), its code c' in [c_lo, c_hi] (the corners' divisions, then
    e4m3: monotone). c' s' - c s = (c' - c) s' + c (s' - s): the first a code step where the interval crosses a
    midpoint (0 elsewhere), summed in |W2| (every flip of one sign, the worst case); the second the group's scale
    change, coherent over the group: |s' / s - 1| |P_G|, P_G = sum over the group of W2[d, f] act_q[f]."""
    rnd = np.float32 if act_dtype is None else act_dtype
    r = FLIP_R * EPS32 * (np.sqrt(lsq) + np.abs(act))
    lo, hi = _round(act - r, rnd), _round(act + r, rnd)
    n, f = act.shape
    groups = scales.shape[1]
    pad = groups * FP8_BLOCK - f

    def grouped(a: F64) -> F64:
        return np.pad(a, ((0, 0), (0, pad))).reshape(n, groups, FP8_BLOCK)

    amin = np.where(lo * hi <= 0, 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    amax = np.maximum(np.abs(lo), np.abs(hi))
    s_lo = (grouped(amin).max(axis=-1).astype(np.float32) / np.float32(448.0)).astype(np.float64)
    s_hi = (grouped(amax).max(axis=-1).astype(np.float32) / np.float32(448.0)).astype(np.float64)
    s_lo, s_hi = np.minimum(s_lo, scales), np.maximum(s_hi, scales)
    tiny = np.float64(np.finfo(np.float32).tiny)
    each = lambda s: np.repeat(s, FP8_BLOCK, axis=1)[:, :f]  # noqa: E731  (a group's value at each column)
    slo0 = each(s_lo)
    slo, shi, s = np.maximum(slo0, tiny), each(s_hi), each(scales)
    with np.errstate(over="ignore"):
        q = lambda a, b: (np.asarray(a, np.float32) / np.asarray(b, np.float32)).astype(np.float64)  # noqa: E731
        c_lo = _e4m3(np.minimum(q(lo, slo), q(lo, shi)))
        c_hi = _e4m3(np.maximum(q(hi, slo), q(hi, shi)))
    c = np.where(s > 0, act_q / np.where(s > 0, s, 1.0), 0.0)
    c_lo = np.where(slo0 == 0, np.minimum(c_lo, 0.0), c_lo)  # s' = 0 possible: code 0 too
    c_hi = np.where(slo0 == 0, np.maximum(c_hi, 0.0), c_hi)
    step = np.maximum(c_hi - c, c - c_lo) * shi
    delta = np.where(scales > 0, np.maximum(s_hi - scales, scales - s_lo) / np.where(scales > 0, scales, 1.0), 0.0)
    w2p = np.pad(w2, ((0, 0), (0, pad))).reshape(w2.shape[0], groups, FP8_BLOCK)
    part = np.abs(np.matmul(grouped(act_q).transpose(1, 0, 2), w2p.transpose(1, 2, 0)))  # (G, n, D): BLAS a group
    return np.stack([step @ np.abs(w2).T, np.einsum("gnd,ng->nd", part, delta, optimize=True)])


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
            ws2: NDArray | None = None, act_dtype=None, absolute: bool = False, act_quant: str | None = None,
            flip_bound: bool = False) -> F64:
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
    out = np.zeros((2, t, d) if flip_bound else (t, d))
    if act_quant is not None:
        x = group_quantize(x)[0]  # bit-exact codes of the stored x, dequantized exactly
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    experts_present, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)
    wflat = weights.reshape(-1)
    def one(i: int) -> F64:  # a product per present expert, never a loop over tokens
        slots = order[bounds[i]:bounds[i + 1]]
        return _mlp(x[slots // k], w13[experts_present[i]], w2[experts_present[i]], act_dtype, absolute, act_quant,
                    flip_bound)

    # the experts on threads (each widens its own weights: a DeepSeek-V3 layer's 256 are minutes of one core), their
    # outputs summed in expert order as one loop would: the same bits whatever the thread count
    for i, y in enumerate(on_threads(one, range(len(experts_present)))):
        slots = order[bounds[i]:bounds[i + 1]]
        toks = slots // k
        wt = wflat[slots][:, None]
        if flip_bound:
            np.add.at(out, (slice(None), toks), np.abs(wt) * y)
        else:
            np.add.at(out, toks, (wt * wt if absolute else wt) * y)
    if ws13 is not None:
        for s in range(np.shape(ws13)[0]):
            out += _mlp(x, ws13[s], ws2[s], act_dtype, absolute, act_quant, flip_bound)
    return np.sqrt(out) if absolute else out
