"""Golden quantized GEMM, C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N]), in float64: two references.

    L1 dequant:   C = A @ dequantize(W)^T                                  what the weights mean
    L2 emulated:  the production arithmetic on quantized activations       what the kernel computes

L2 per weight format (research/quant-formats.md §1.5 and §3.3; b a block, j a sub-block):
    q4_0 q5_0 q8_0 iq4_nl x Q8_0:  C = sum_b (d_w d_a) J_b,                 J_b = sum_i c_w c_a
    q4_1 q5_1 x Q8_1:              C = sum_b (d_w d_a) J_b + m_w s_a,       s_a = fp16(d_a sum_i c_a)
    q3_k q6_k x Q8_K:              C = sum_b (d_w d_a) J_b,                 J_b = sum_j sc_j sum_i c_w c_a
    q2_k q4_k q5_k x Q8_K:         C = sum_b (d_w d_a) J_b - (dmin_w d_a) sum_j m_j bsum_j
    fp8 (DeepSeek-V3):             C = sum_kb (J_kb s_a[m // gm, kb]) s_w[n // gn, kb]
with the activations quantized exactly as the production path does: `quant.quantize(vec_dot,
float32(A))` (ggml's reference activation quantizers: Q8_0/Q8_1 roundf, Q8_K half-even) and
DeepSeek's `act_quant` in (gm x gk) groups. GGML: each term d_w d_a sc_j c_w c_a is formed from the
stored fields in float64 and all of them summed by one float64 matmul over K (the sum's order is not
the kernel's: a float64 sum of the same terms, within ~1e-16 of the blockwise one, against errors of
1e-7 and more that L2 is there to separate); FP8: exact block dots (multiples of 2^-18 for gk <=
2^17) scaled per block, summed over blocks in float64. Q8_K's bsum_j is the activation block's
stored sum of 16 codes (sub-blocks of 32 add two): the "bsums trick" for the mins.
"f32" and "int4" weights have no activation quantization in production (int4 kernels dequantize
to fp16 and multiply in floating point): L2 = L1 there.

L1 - L2 is the activation quantization error itself (the per-element bound is |c_a d_a - a| <=
|d_a| / 2 for Q8_*, half an e4m3 step for FP8); a kernel's distance to L2 is its accumulation
rounding (~1e-7 |w||a| for ggml on CPU), to L1 both. Both are exact functions of the inputs.
Shapes: A (M, K); W in the layout of `wfmt` (see `dequantize_weight`); bias (N,) or None.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import quant
from kernel_parity.refimpl import quant_fp as qf

F64 = NDArray[np.float64]

GGML_W = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl")
WFMTS = ("f32", *GGML_W, "fp8", "int4")
_TEMP = 1 << 22  # elements of FP8's (M, N, blocks) temporaries per chunk of blocks (32 MiB float64)


def gemm_nt(a: NDArray, w: NDArray, bias: NDArray | None = None, *, absolute: bool = False) -> F64:
    """C = a @ w^T (+ bias), the textbook product in float64.

    a: (M, K) float
    w: (N, K) float (a dequantized weight)
    bias: (N,) float or None
    returns: (M, N) float64
    absolute: the error model's magnitude instead (conformance/tolerance.py): the root-sum-square of
    the K + 1 terms each element sums, sqrt(a^2 @ (w^2)^T + bias^2): what a K-long dot product's
    rounding scales with (an fp32 dot product keeps ~eps32 of its terms, not of the result where they
    cancel); on random-sign terms it is |C|'s expected size (cond ~1.5)
    """
    a, w = np.asarray(a, dtype=np.float64), np.asarray(w, dtype=np.float64)
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_nt: a (M, K) and w (N, K) must share K, got {a.shape} and {w.shape}")
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        if bias.shape != (w.shape[0],):
            raise ValueError(f"gemm_nt: bias must be (N,) = ({w.shape[0]},), got {bias.shape}")
    if absolute:  # the squared form: squares of the factors, their matmul, the bias's square; one sqrt
        c = np.square(a) @ np.square(w).T  # M, N
        if bias is not None:
            c += np.square(bias)
        return np.sqrt(c, out=c)
    c = a @ w.T  # M, N
    if bias is not None:
        c = c + bias
    return c


def _check_ggml(wfmt: str, w: NDArray, k: int) -> None:
    f = quant.FORMATS[wfmt]
    if k % f.block:
        kind = "K-quant" if f.block == 256 else f"{f.block}-element block format"
        raise ValueError(f"{wfmt}: K={k} must be a multiple of {f.block} ({wfmt} is a {kind})")
    row = k // f.block * f.nbytes
    if np.ndim(w) != 2 or np.shape(w)[1] != row or np.asarray(w).dtype != np.uint8:
        raise ValueError(f"{wfmt}: w must be uint8 (N, K/{f.block}*{f.nbytes}) = (N, {row}) for K={k}, "
                         f"got {np.asarray(w).dtype} {np.shape(w)}")


def dequantize_weight(wfmt: str, weights: dict[str, NDArray], k: int, *, order: str = "gptq",
                      group: int | None = None, gn: int = 128, gk: int = 128) -> F64:
    """The (N, K) float64 weight that `weights` stores, exactly.

    wfmt "f32":   {"w": (N, K) float32}
    GGML formats: {"w": (N, K // block * nbytes) uint8}, rows of little-endian blocks along K
    "fp8":        {"w": (N, K) float8_e4m3fn, "w_scale": (ceil(N/gn), ceil(K/gk)) float32}
    "int4":       {"qweight", "qzeros", "scales"} in the `order` layout ("gptq" v1 or "awq"),
                  group = K / scales.shape[0] (checked against `group` when given)
    k: K, the reduction length of the activations (checked against the weight)
    """
    if wfmt == "f32":
        w = np.asarray(weights["w"], dtype=np.float64)
    elif wfmt in GGML_W:
        _check_ggml(wfmt, weights["w"], k)
        w = quant.dequantize(wfmt, weights["w"])
    elif wfmt == "fp8":
        w = qf.fp8_dequantize_blocks(weights["w"], weights["w_scale"], gn, gk)
    elif wfmt == "int4":
        w = qf.int4_dequantize(weights, order)
        g = w.shape[1] // np.shape(weights["scales"])[0]
        if group is not None and g != group:
            raise ValueError(f"int4 {order}: scales give group {g}, expected {group}")
    elif wfmt in quant.FORMATS:
        raise ValueError(f"{wfmt} is an activation format (ggml's vec_dot side), not a weight format")
    else:
        raise ValueError(f"unknown weight format {wfmt!r}; known: {', '.join(WFMTS)}")
    if w.ndim != 2 or w.shape[1] != k:
        raise ValueError(f"{wfmt}: the weight is {w.shape}, expected (N, K={k})")
    return w


def _a_2d(a: NDArray) -> NDArray:
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"a must be (M, K), got shape {a.shape}")
    return a


def dequant_reference(a: NDArray, wfmt: str, weights: dict[str, NDArray], bias: NDArray | None = None, *,
                      order: str = "gptq", group: int | None = None, gm: int = 1, gn: int = 128,
                      gk: int = 128, absolute: bool = False) -> F64:
    """L1: C = a @ dequantize_weight(wfmt, weights)^T (+ bias), float64.

    a: (M, K) float (used as given, in float64)
    weights: see `dequantize_weight`; gm is the FP8 activation group (unused by L1)
    bias: (N,) or None
    returns: (M, N) float64
    absolute: the error model's magnitude of C instead, one for both references: `gemm_nt`'s
    sqrt(A^2 @ (W^2)^T + bias^2) against the dequantized W, A = max(|a|, |quantized a|) where L2
    quantizes the activations (`quantized_activations`: GGML formats, fp8), |a| otherwise
    """
    a = _a_2d(a)
    w = dequantize_weight(wfmt, weights, a.shape[1], order=order, group=group, gn=gn, gk=gk)
    if absolute:
        act = np.abs(np.asarray(a, dtype=np.float64))
        if wfmt in GGML_W or wfmt == "fp8":
            act = np.maximum(act, np.abs(quantized_activations(a, wfmt, gm=gm, gk=gk)))
        return gemm_nt(act, w, bias, absolute=True)
    return gemm_nt(a, w, bias)


def quantized_activations(a: NDArray, wfmt: str, *, gm: int = 1, gk: int = 128) -> F64:
    """The (M, K) activations L2 multiplies, dequantized: c_a d_a of the GGML format's vec_dot blocks
    (ggml's reference quantizer, `quant.quantize`), or DeepSeek's (gm x gk) e4m3 groups times their
    scales for "fp8"; `a` itself (float64) for the formats whose production path keeps it ("f32", "int4").

    a: (M, K) float (rounded to float32 first, as L2 does)
    """
    a = _a_2d(a)
    if wfmt in GGML_W:
        act = quant.FORMATS[wfmt].vec_dot
        fa = quant.block_fields(act, quant.quantize(act, np.asarray(a, dtype=np.float32)))  # (M, nb)
        return (fa.codes.astype(np.float64) * fa.d[..., None]).reshape(a.shape[0], -1)
    if wfmt == "fp8":
        qa, sa = qf.fp8_quantize_blocks(a, gm, gk)
        return qf.fp8_dequantize_blocks(qa, sa, gm, gk)
    return np.asarray(a, dtype=np.float64)


def _sum_blocks(m: int, n: int, nb: int, term) -> F64:
    """sum over blocks b of term(slice of blocks) -> (M, N), in chunks that bound the temporaries."""
    step = max(1, _TEMP // max(1, m * n))
    c = np.zeros((m, n))
    for lo in range(0, nb, step):  # a handful of chunks: memory, not the algorithm
        c += term(slice(lo, min(nb, lo + step))).sum(axis=-1)
    return c


def _emulated_ggml(a: NDArray, wfmt: str, w: NDArray, act_quantizer: str) -> F64:
    act = quant.FORMATS[wfmt].vec_dot
    quantizer = {"ref": quant.quantize, "x86": quant.quantize_x86}[act_quantizer]
    fa = quant.block_fields(act, quantizer(act, np.asarray(a, dtype=np.float32)))  # (M, nb)
    fw = quant.block_fields(wfmt, w)  # (N, nb)
    m, n, nb = fa.codes.shape[0], fw.codes.shape[0], fa.codes.shape[1]
    cw = fw.codes if fw.scales is None else fw.codes * np.repeat(
        fw.scales, fw.codes.shape[-1] // fw.scales.shape[-1], axis=-1)  # sc_j * c_w
    # every term d_w d_a (sc_j c_w) c_a is a product of the stored fields: one float64 matmul over all
    # of K sums them (the block structure is in the factors, not in the order of the float64 sum)
    xa = (fa.codes.astype(np.float64) * fa.d[..., None]).reshape(m, -1)  # M, K: c_a d_a
    xw = (cw.astype(np.float64) * fw.d[..., None]).reshape(n, -1)  # N, K: sc_j c_w d_w
    c = xa @ xw.T
    if fw.m is not None:  # q4_1 / q5_1: the min times Q8_1's stored fp16 s = fp16(d_a sum c_a)
        c += np.asarray(fa.s, dtype=np.float64) @ np.asarray(fw.m, dtype=np.float64).T
    if fw.mins is not None:  # K-quants with mins: dmin d_a sum_j m_j bsum_j
        nsub = fw.mins.shape[-1]
        bs = fa.bsums.reshape(m, nb, nsub, 16 // nsub).sum(-1) * fa.d[..., None]  # M, nb, nsub
        c -= bs.reshape(m, -1) @ (fw.mins * fw.dmin[..., None]).reshape(n, -1).T
    return c


def _emulated_fp8(a: NDArray, weights: dict[str, NDArray], gm: int, gn: int, gk: int) -> F64:
    qa, sa = qf.fp8_quantize_blocks(a, gm, gk)  # DeepSeek act_quant: division, 1e-4 amax floor
    qw, sw = weights["w"], np.asarray(weights["w_scale"], dtype=np.float64)
    m, k = qa.shape
    n = np.shape(qw)[0]
    kb = -(-k // gk)
    if sw.shape != (-(-n // gn), kb):
        raise ValueError(f"fp8: w_scale {sw.shape} != (ceil(N/gn), ceil(K/gk)) = ({-(-n // gn)}, {kb})")
    pad = kb * gk - k  # zero columns complete the last K group, as the kernels' masked loads do
    xa = np.pad(qf.fp8_decode(qa), ((0, 0), (0, pad))).reshape(m, kb, gk)
    xw = np.pad(qf.fp8_decode(qw), ((0, 0), (0, pad))).reshape(n, kb, gk)
    sa_m = np.asarray(sa, dtype=np.float64)[np.arange(m) // gm][:, None, :]  # M, 1, kb
    sw_n = sw[np.arange(n) // gn][None, :, :]  # 1, N, kb

    def term(s: slice) -> F64:
        j = np.matmul(xa[:, s].transpose(1, 0, 2), xw[:, s].transpose(1, 2, 0)).transpose(1, 2, 0)
        return (j * sa_m[..., s]) * sw_n[..., s]  # DeepSeek: dot(a, b) * a_s * b_s

    return _sum_blocks(m, n, kb, term)


def emulated_reference(a: NDArray, wfmt: str, weights: dict[str, NDArray], bias: NDArray | None = None, *,
                       order: str = "gptq", group: int | None = None, gm: int = 1, gn: int = 128,
                       gk: int = 128, act_quantizer: str = "ref") -> F64:
    """L2: the production arithmetic (module docstring), float64.

    a: (M, K) float; rounded to float32 before the activation quantization (GGML, FP8)
    act_quantizer: GGML activation quantizer, "ref" (`quantize_row_q8_*_ref`: roundf, 1/d) or "x86"
        (ggml's AVX2 CPU `from_float`: 127/amax, round half to even; Q8_K is the ref either way)
    weights: see `dequantize_weight`; FP8 granularity (gm, gn, gk): 1 x 128 x 128 DeepSeek-V3,
        (1, 1, K) row-wise, (M, N, K) per-tensor
    bias: (N,) or None, added in float64 last
    returns: (M, N) float64
    """
    a = _a_2d(a)
    k = a.shape[1]
    if wfmt in ("f32", "int4"):
        return dequant_reference(a, wfmt, weights, bias, order=order, group=group, gn=gn, gk=gk)
    if wfmt in GGML_W:
        _check_ggml(wfmt, weights["w"], k)
        if act_quantizer not in ("ref", "x86"):
            raise ValueError(f"act_quantizer must be 'ref' or 'x86', got {act_quantizer!r}")
        c = _emulated_ggml(a, wfmt, weights["w"], act_quantizer)
    elif wfmt == "fp8":
        if np.shape(weights["w"])[1:] != (k,):
            raise ValueError(f"fp8: w must be (N, K={k}), got {np.shape(weights['w'])}")
        c = _emulated_fp8(a, weights, gm, gn, gk)
    else:
        dequantize_weight(wfmt, weights, k)  # raises the format's error
        raise AssertionError(wfmt)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        if bias.shape != (c.shape[1],):
            raise ValueError(f"bias must be (N,) = ({c.shape[1]},), got {bias.shape}")
        c = c + bias
    return c


def gemm_nt_backward(a: NDArray, w: NDArray, dc: NDArray, bias: bool = False, *, weight_grad: bool = True,
                     absolute: bool = False) -> dict[str, F64]:
    """VJP of C = a @ w^T (+ bias), written out, float64.

        da = dc @ w,   dw = dc^T @ a,   db = sum over rows of dc

    a: (M, K); w: (N, K) float -- for a quantized weight, its dequantized values: the gradient of the
        activations through the weight the forward means (L1); dw of a quantized weight is not defined
        (the caller passes weight_grad=False); dc: (M, N) the cotangent of C; bias: whether C had one
    weight_grad: compute dw (and db); False: da alone (a quantized weight's case)
    returns: {"da": (M, K), "dw": (N, K), "db": (N,) when bias}
    absolute: the error model's magnitudes instead (conformance/tolerance.py), the root-sum-square of the
    terms each element sums: da = sqrt(dc^2 @ w^2) (N terms), dw = sqrt((dc^2)^T @ a^2) and
    db = sqrt(sum over rows of dc^2) (M terms)
    """
    a, w, dc = (np.asarray(t, dtype=np.float64) for t in (a, w, dc))
    if dc.shape != (a.shape[0], w.shape[0]) or a.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_nt_backward: a {a.shape}, w {w.shape} and dc {dc.shape} do not fit C = a w^T")
    if absolute:  # the squared form: the same matmuls on squares, one sqrt each
        a, w, dc = np.square(a), np.square(w), np.square(dc)
    out = {"da": dc @ w}
    if weight_grad:
        out["dw"] = dc.T @ a
        if bias:
            out["db"] = dc.sum(axis=0)
    return {k: np.sqrt(v) for k, v in out.items()} if absolute else out
