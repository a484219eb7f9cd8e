"""The pieces of MAX's fused FP8 MLA decode branch (`mla.decode_fused_fp8`), float64.

    rope:  (x_2i + i x_2i+1) * (f_2i + i f_2i+1)      interleaved pairs; f = freqs_cis[pos]
    rms:   x / sqrt(mean(x^2) + eps) * gamma           eps inside the sqrt
    act:   s = min(amax_G, ub) / 448 (float32),  q = e4m3(clamp(float32(x * float32(1 / s)), +-448)),
           s = 0 -> q = 0                              one scale per (m_gran rows x k_gran columns) group G
           fp8="e5m2": 57344 for 448 (and e5m2 codes); scale_dtype="bf16": s = bf16(bf16(min(bf16(amax_G),
           ub)) / 448) stored, 1 / s from the stored bf16 value in float32 (MAX's compute_dynamic_fp8_scale
           in the scale dtype: amax cast to it, divided in it; the reciprocal in the float32 accumulator type)
    bmm:   C[h, m, n] = sum_kb s_a[h, m // m_g, kb] s_w[h, n // n_g, kb] sum_{k in kb} q_a[h, m, k] q_w[h, n, k]

Sources (modular/modular, read at the 2025-12 layout): `max/kernels/src/nn/fused_qk_rope.mojo`
(`rope_value`: deinterleave, complex multiply by the freqs pair, reinterleave), the freqs_cis table
of `max/python/max/nn/rotary_embedding.py` (`stack([cos, sin], -1)` flattened: row p holds
cos(p w_0), sin(p w_0), cos(p w_1), ...), `max/kernels/src/nn/normalization.mojo`
(`_rms_norm_warp_tiling_subkernel`: float32 x rsqrt(mean x^2 + eps), cast, then * gamma),
`max/kernels/src/linalg/fp8_quantization.mojo` (`batched_quantize_fp8_kernel`) with
`linalg/fp8_utils.mojo` (`compute_dynamic_fp8_scale`: min(amax, ub) / 448 and 0 reciprocal for a
zero scale; `fp8_quantize`: x * recip cast to e4m3, saturating on NVIDIA), `linalg/bmm.mojo`
(`batched_matmul_dynamic_scaled_fp8`: transpose_b, weight scales [B, N / 128, K / 128], only
(1, 128, 128) supported there; other granularities here are the natural generalisation).
MAX's fp8_dtype / fp8_scale_dtype (`fp8`, `scale_dtype`): the weights, the activation codes and every
scale share them; `quantize_dynamic_scaled_fp8` asserts e4m3fn or e4m3fnuz codes and bf16 / fp16 /
fp32 / e8m0 scales. e5m2 here is the natural generalisation (max finite 57344), as the granularities.
The golden computes in float64 on its inputs: the production casts (RMSNorm output to bf16 before
the gamma product, the bf16 intermediates) are not applied. The activation quantizer's own float32
steps are, as in refimpl.quant_fp.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.quant_fp import FP8_MAX, fp8_decode, fp8_encode, fp8_quantize_blocks

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]
SCALE_UB = 1200.0  # MAX's activation scale_ub in the MLA branch (mla_graph.mojo)
FP8_FORMATS = ("e4m3", "e5m2")  # MAX's fp8_dtype: float8_e4m3fn (DeepSeek's), float8_e5m2
SCALE_DTYPES = ("fp32", "bf16")  # MAX's fp8_scale_dtype: float32 (DeepSeek's), bfloat16


def round_scale(s: NDArray, scale_dtype: str) -> F32:
    """Scales rounded to the scale dtype (RNE; bf16 values are exact in float32), as float32."""
    s = np.asarray(s, dtype=np.float32)
    if scale_dtype == "bf16":
        return s.astype(ml_dtypes.bfloat16).astype(np.float32)
    if scale_dtype != "fp32":
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    return s


def quantize_weight(w: NDArray, n_gran: int, k_gran: int, fp8: str = "e4m3",
                    scale_dtype: str = "fp32") -> tuple[NDArray, NDArray]:
    """Offline block quantization of an (N, K) weight in a format / scale dtype pair other than DeepSeek's.

    s = scale_dtype(amax_B / FP8_MAX[fp8]) per (n_gran x k_gran) block B (float32 division, then rounded),
    q = fp8(clamp(float32(w / s), +-max)); returns q (N, K) float8 and s in the scale dtype (float32 or
    ml_dtypes.bfloat16), the stored values the golden and the kernels read. (e4m3 with fp32 scales is
    refimpl.quant.fp8_quantize, DeepSeek's.)
    """
    x = np.asarray(w, dtype=np.float32)
    n, k = x.shape
    xb = x.reshape(n // n_gran, n_gran, k // k_gran, k_gran)
    amax = np.abs(xb).max(axis=(1, 3))
    s = round_scale(np.maximum(amax, np.float32(1e-30)) / np.float32(FP8_MAX[fp8]), scale_dtype)
    q = fp8_encode(xb / s[:, None, :, None], fp8, saturate=True).reshape(n, k)
    return q, (s.astype(ml_dtypes.bfloat16) if scale_dtype == "bf16" else s)


def as_f64(x: NDArray) -> F64:
    """float64 of an array; float8 (ml_dtypes) arrays decoded exactly."""
    a = np.asarray(x)
    return fp8_decode(a) if "float8" in a.dtype.name else np.asarray(a, dtype=np.float64)


def rope_interleaved(x: NDArray, freqs: NDArray, absolute: bool = False) -> F64:
    """RoPE on interleaved pairs with an explicit cos/sin table row per element.

    x: (..., r) with r even; freqs: (..., r) broadcastable, [cos_0, sin_0, cos_1, sin_1, ...]
    returns: (..., r); the product is a complex multiply, so a table with |f| != 1 (YaRN's mscale
    folded in) scales as well as rotates.
    absolute: the error model's magnitudes instead (refimpl.rope's): each output's two products in
    squared form, sqrt((x_r f_r)^2 + (x_i f_i)^2) and sqrt((x_r f_i)^2 + (x_i f_r)^2)
    """
    x, f = np.asarray(x, dtype=np.float64), np.asarray(freqs, dtype=np.float64)
    xr, xi, fr, fi = x[..., 0::2], x[..., 1::2], f[..., 0::2], f[..., 1::2]
    out = np.empty(np.broadcast_shapes(x.shape, f.shape))
    if absolute:
        out[..., 0::2] = np.hypot(xr * fr, xi * fi)
        out[..., 1::2] = np.hypot(xr * fi, xi * fr)
        return out
    out[..., 0::2] = xr * fr - xi * fi
    out[..., 1::2] = xr * fi + xi * fr
    return out


def rms_norm(x: NDArray, gamma: NDArray, eps: float) -> F64:
    """x / sqrt(mean(x^2, -1) + eps) * gamma.  x: (..., c); gamma: (c,)"""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, dtype=np.float64)


def quantize_act(x: NDArray, m_gran: int = 1, k_gran: int = 128, scale_ub: float = SCALE_UB,
                 fp8: str = "e4m3", scale_dtype: str = "fp32") -> tuple[NDArray, F32]:
    """MAX's dynamic activation quantization, batched over the leading axis.

    x: (B, M, K) float (rounded to float32 first, as the kernel's float32 accumulator type)
    fp8, scale_dtype: the codes' format and the scales' dtype (module docstring, `act`)
    returns: q (B, M, K) float8 (e4m3fn or e5m2), scales (B, ceil(M / m_gran), ceil(K / k_gran)) float32
    holding the scale dtype's values. Groups never straddle two batch entries; edge groups are zero-padded
    (amax unchanged). There is no amax floor: an all-zero group gets scale 0 and codes 0 (MAX's reciprocal
    is 0 there).
    """
    x = np.asarray(x, dtype=np.float32)
    B, M, K = x.shape
    mp = -(-M // m_gran) * m_gran
    xp = np.zeros((B, mp, K), dtype=np.float32)
    xp[:, :M] = x
    if (fp8, scale_dtype) != ("e4m3", "fp32"):
        return _quantize_act_fmt(xp, M, m_gran, k_gran, scale_ub, fp8, scale_dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        q, s = fp8_quantize_blocks(xp.reshape(B * mp, K), m_gran, k_gran, amax_floor=0.0,
                                   scale_ub=scale_ub, reciprocal=True)
    s = s.reshape(B, mp // m_gran, -1)
    zero = np.repeat(np.repeat(s == 0, m_gran, axis=1), k_gran, axis=2)[:, :, :K].reshape(B * mp, K)
    bits = q.view(np.uint8).copy()
    bits[zero] = 0  # x * 0 = 0: MAX's zero reciprocal, not 0 * inf
    return bits.view(q.dtype).reshape(B, mp, K)[:, :M], s


def _quantize_act_fmt(xp: F32, M: int, m_gran: int, k_gran: int, scale_ub: float, fp8: str,
                      scale_dtype: str) -> tuple[NDArray, F32]:
    """quantize_act for a format / scale dtype other than (e4m3, fp32); xp (B, mp, K) float32, zero-padded."""
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be one of {FP8_FORMATS}, got {fp8!r}")
    B, mp, K = xp.shape
    kp = -(-K // k_gran) * k_gran
    xb = np.zeros((B, mp, kp), dtype=np.float32)
    xb[..., :K] = xp
    xb = xb.reshape(B, mp // m_gran, m_gran, kp // k_gran, k_gran)
    amax = np.abs(xb).max(axis=(2, 4))  # B, mg, kg float32
    ub, fmax = round_scale(np.float32(scale_ub), scale_dtype), np.float32(FP8_MAX[fp8])
    s = round_scale(np.minimum(round_scale(amax, scale_dtype), ub) / fmax, scale_dtype)  # in the scale dtype
    with np.errstate(divide="ignore"):
        recip = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)), np.float32(0.0))
    y = xb * recip[:, :, None, :, None]  # float32; a zero group: x * 0 = 0
    q = fp8_encode(y, fp8, saturate=True).reshape(B, mp, kp)[:, :M, :K]
    return q, s.astype(np.float32)


def dequantize(q: NDArray, scales: NDArray, m_gran: int, k_gran: int) -> F64:
    """q[b, m, k] * scales[b, m // m_gran, k // k_gran], float64 (exact).

    q: (B, M, K) float8 (or exact float); scales: (B, ceil(M / m_gran), ceil(K / k_gran))
    """
    q = as_f64(q)
    B, M, K = q.shape
    want = (B, -(-M // m_gran), -(-K // k_gran))
    s = np.asarray(scales, dtype=np.float64).reshape(want)
    return q * np.repeat(np.repeat(s, m_gran, axis=1), k_gran, axis=2)[:, :M, :K]


def bmm_fp8(a: NDArray, w: NDArray, w_scale: NDArray, granularity: tuple[int, int, int] = (1, 128, 128),
            scale_ub: float = SCALE_UB, absolute: bool = False, fp8: str = "e4m3",
            scale_dtype: str = "fp32") -> F64:
    """C = deq(quantize_act(a)) @ deq(w)^T per batch entry: MAX's quantize + batched blockwise FP8 matmul.

    a: (B, M, K) float activations
    w: (B, N, K) float8 weights (transpose_b layout), in the `fp8` format (e4m3fn, or e5m2)
    w_scale: (B, ceil(N / n_gran), ceil(K / k_gran)) or its (B * ceil(N / n_gran), ceil(K / k_gran)) flattening
    granularity: (m_gran, n_gran, k_gran)
    fp8, scale_dtype: MAX's fp8_dtype and fp8_scale_dtype, the activation's quantization (quantize_act); the
    weight's codes and stored scales are read as given (their dtypes must be those)
    returns: (B, M, N) float64 (products of fp8 codes and float32 scales are exact; the sums round
    in float64)
    absolute: the error model's magnitudes instead, the sum in squared form: sqrt(sum_k A_mk^2 W_nk^2) with
    A, W the dequantized operands (refimpl/mla.py)
    """
    mg, ng, kg = granularity
    want = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(fp8)
    if "float8" in np.asarray(w).dtype.name and np.asarray(w).dtype.name != want:
        raise ValueError(f"w is {np.asarray(w).dtype.name}, fp8={fp8!r} wants {want}")
    qa, sa = quantize_act(a, mg, kg, scale_ub, fp8, scale_dtype)
    x, y = dequantize(qa, sa, mg, kg), dequantize(w, w_scale, ng, kg)
    if absolute:
        return np.sqrt((x * x) @ (y * y).transpose(0, 2, 1))
    return x @ y.transpose(0, 2, 1)
