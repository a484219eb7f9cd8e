"""The pieces of MAX's fused FP8 MLA decode branch (`mla.decode_fused_fp8`), float64.

    rope:  (x_2i + i x_2i+1) * (f_2i + i f_2i+1)      interleaved pairs; f = freqs_cis[pos]
    rms:   x / sqrt(mean(x^2) + eps) * gamma           eps inside the sqrt
    act:   s = min(amax_G, ub) / 448 (float32),  q = e4m3(clamp(float32(x * float32(1 / s)), +-448)),
           s = 0 -> q = 0                              one scale per (m_gran rows x k_gran columns) group G
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
The golden computes in float64 on its inputs: the production casts (RMSNorm output to bf16 before
the gamma product, the bf16 intermediates) are not applied. The activation quantizer's own float32
steps are, as in refimpl.quant_fp.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.quant_fp import fp8_decode, fp8_quantize_blocks

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]
SCALE_UB = 1200.0  # MAX's activation scale_ub in the MLA branch (mla_graph.mojo)


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


def quantize_act(x: NDArray, m_gran: int = 1, k_gran: int = 128,
                 scale_ub: float = SCALE_UB) -> tuple[NDArray, F32]:
    """MAX's dynamic activation quantization, batched over the leading axis.

    x: (B, M, K) float (rounded to float32 first, as the kernel's float32 accumulator type)
    returns: q (B, M, K) float8_e4m3fn, scales (B, ceil(M / m_gran), ceil(K / k_gran)) float32.
    Groups never straddle two batch entries; edge groups are zero-padded (amax unchanged). There is
    no amax floor: an all-zero group gets scale 0 and codes 0 (MAX's reciprocal is 0 there).
    """
    x = np.asarray(x, dtype=np.float32)
    B, M, K = x.shape
    mp = -(-M // m_gran) * m_gran
    xp = np.zeros((B, mp, K), dtype=np.float32)
    xp[:, :M] = x
    with np.errstate(divide="ignore", invalid="ignore"):
        q, s = fp8_quantize_blocks(xp.reshape(B * mp, K), m_gran, k_gran, amax_floor=0.0,
                                   scale_ub=scale_ub, reciprocal=True)
    s = s.reshape(B, mp // m_gran, -1)
    zero = np.repeat(np.repeat(s == 0, m_gran, axis=1), k_gran, axis=2)[:, :, :K].reshape(B * mp, K)
    bits = q.view(np.uint8).copy()
    bits[zero] = 0  # x * 0 = 0: MAX's zero reciprocal, not 0 * inf
    return bits.view(q.dtype).reshape(B, mp, K)[:, :M], s


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
            scale_ub: float = SCALE_UB, absolute: bool = False) -> F64:
    """C = deq(quantize_act(a)) @ deq(w)^T per batch entry: MAX's quantize + batched blockwise FP8 matmul.

    a: (B, M, K) float activations
    w: (B, N, K) float8_e4m3fn weights (transpose_b layout)
    w_scale: (B, ceil(N / n_gran), ceil(K / k_gran)) or its (B * ceil(N / n_gran), ceil(K / k_gran)) flattening
    granularity: (m_gran, n_gran, k_gran)
    returns: (B, M, N) float64 (products of fp8 codes and float32 scales are exact; the sums round
    in float64)
    absolute: the error model's magnitudes instead, the sum in squared form: sqrt(sum_k A_mk^2 W_nk^2) with
    A, W the dequantized operands (refimpl/mla.py)
    """
    mg, ng, kg = granularity
    qa, sa = quantize_act(a, mg, kg, scale_ub)
    x, y = dequantize(qa, sa, mg, kg), dequantize(w, w_scale, ng, kg)
    if absolute:
        return np.sqrt((x * x) @ (y * y).transpose(0, 2, 1))
    return x @ y.transpose(0, 2, 1)
