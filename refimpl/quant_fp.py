"""Golden floating-point and int4 weight formats: FP8, DeepSeek block scaling, GPTQ/AWQ int4, MXFP4, NVFP4.

    fp8:    q = RNE_fp8(float32(x)),  optionally clamped to +-max finite first (saturating)
    blocks: s_B = max(amax_B, floor) / 448 (float32),  q = e4m3(float32(x / s_B)),  x^ = q * s_B
    int4:   W[n, k] = s[k // g, n] * (q[k, n] - z[k // g, n])
    mxfp4:  x^ = 2^(e - 127) * e2m1,  e - 127 = floor(log2 amax_32) - 2
    nvfp4:  x^ = e2m1 * f32(s_16) [* g],  s_16 = e4m3(clamp(amax_16 / 6 [/ g], 2^-6, 448))

Conventions (OPS.md, quant; research/quant-formats.md sections 3 and 4):
- Every encoder first rounds its input to float32 (torch and ml_dtypes convert float64 through
  float32, so a float64 input double-rounds exactly as the production cast does). Arithmetic that
  production does in float32 (scales, x / s) is done in float32 here; decoding is exact in float64.
- FP8 rounding is round-to-nearest-even. Non-saturating is OCP's non-saturating mode, the cast of
  ml_dtypes and of torch <= 2.11: e4m3fn |x| > 464 -> NaN (464 ties to 448), e5m2 |x| >= 61440 ->
  inf. Saturating clamps to +-max finite first (+-inf -> +-max; NaN stays NaN): the MAX kernels,
  CUDA's __NV_SATFINITE, and torch's own e4m3fn cast since pytorch/pytorch#178817 (April 2026;
  torch 2.13 saturates, 2.11 does not), whose e5m2 cast still overflows to inf. NaN is encoded as torch does
  (0x7F | sign) in both formats (ml_dtypes alone gives 0x7E for e5m2).
- E2M1 rounding is RNE (torchao, OCP MX); FP4 pairs pack element 2i in the low nibble (torchao,
  DeepGEMM), not ggml's j / j+16 order.
- The int4 quantizer rounds half to even (torch.round, as GPTQ/AWQ quantizers do).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]
U8 = NDArray[np.uint8]
I32 = NDArray[np.int32]

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
E2M1_MAX = 6.0
E4M3_TINY = 2.0**-6  # smallest normal e4m3fn: torchao's floor for NVFP4 block scales
MX_BLOCK, NV_BLOCK = 32, 16
INT4_ORDERS = ("gptq", "awq")
AWQ_PACK = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble p of a word holds column 8j + AWQ_PACK[p]
_E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


# --------------------------------------------------------------------------- FP8 elements

def fp8_encode(x: NDArray, fmt: str = "e4m3", saturate: bool = False) -> NDArray:
    """Encode to float8 (e4m3fn or e5m2) from float32, round-to-nearest-even.

    x: (...) any float; rounded to float32 first (as torch's `.to(float8)` does for float64)
    fmt: "e4m3" (float8_e4m3fn, max 448, no inf) or "e5m2" (max 57344, has inf)
    saturate: False = OCP non-saturating (e4m3fn |x| > 464 -> NaN, e5m2 overflow -> +-inf);
              True = clamp to +-max finite before the cast (+-inf -> +-max; NaN stays NaN)
    returns: (...) ml_dtypes float8 array
    """
    if fmt not in FP8:
        raise ValueError(f"fp8 format must be one of {sorted(FP8)}, got {fmt!r}")
    x = np.asarray(x, dtype=np.float32)
    if saturate:
        x = np.clip(x, -FP8_MAX[fmt], FP8_MAX[fmt])  # np.clip keeps NaN
    q = x.astype(FP8[fmt])
    nan = np.isnan(x)
    if nan.any():  # torch's NaN bits: 0x7F with the input's sign, in both formats
        bits = q.view(np.uint8).copy()
        bits[nan] = 0x7F | (np.signbit(x[nan]).astype(np.uint8) << 7)
        q = bits.view(FP8[fmt])
    return q


# Every code's float64 value, by format (NaN codes NaN): fp8_decode reads them by the code byte, 3x faster than
# ml_dtypes' cast through float32 (a DeepSeek-V3 expert's 29 M codes: 0.21 against 0.66 s), the same values.
_DECODE = {np.dtype(t): np.arange(256, dtype=np.uint8).view(t).astype(np.float64) for t in FP8.values()}


def fp8_decode(q: NDArray) -> F64:
    """float8 (ml_dtypes array) -> float64, exact (the code's value; NaN codes NaN).

    q: (...) float8_e4m3fn or float8_e5m2
    """
    q = np.asarray(q)
    table = _DECODE.get(q.dtype)
    if table is None:  # another dtype: its own cast (fp8 -> f32 is exact)
        return q.astype(np.float32).astype(np.float64)
    return table[q.view(np.uint8)]


# --------------------------------------------------------------------------- FP8 block scaling

def _pad_blocks(x: NDArray, block_m: int, block_k: int) -> NDArray:
    """(M, K) -> (ceil(M/bm), bm, ceil(K/bk), bk), edge blocks zero-padded."""
    m, k = x.shape
    mb, kb = -(-m // block_m), -(-k // block_k)
    xp = np.zeros((mb * block_m, kb * block_k), dtype=x.dtype)
    xp[:m, :k] = x
    return xp.reshape(mb, block_m, kb, block_k)


def _ceil_pow2(s: F32) -> F32:
    """2^ceil(log2 s) for s > 0, exactly (DeepGEMM's ceil_to_ue8m0: exponent + (mantissa != 0)).

    DeepSeek's Triton act_quant computes exp2(ceil(log2(s))) with fp32 log2; it can differ from
    the exact value when s is within an ulp above a power of two."""
    mant, exp = np.frexp(s.astype(np.float64))  # s = mant 2^exp, mant in [0.5, 1)
    e = np.where(mant == 0.5, exp - 1, exp)
    return np.ldexp(1.0, e).astype(np.float32)


def fp8_quantize_blocks(x: NDArray, block_m: int, block_k: int, amax_floor: float = 1e-4,
                        scale_ub: float | None = None, scale_fmt: str = "fp32",
                        reciprocal: bool = False) -> tuple[NDArray, F32]:
    """DeepSeek-V3 block-scaled e4m3fn quantization with (block_m x block_k) blocks.

        amax = max(max |x_B|, amax_floor)             float32, per block
        amax = min(amax, scale_ub)                     MAX's scale_ub variant only
        s    = amax / 448                              float32; ue8m0: s = 2^ceil(log2 s)
        q    = e4m3fn(clamp(float32(x / s), +-448))    division (DeepSeek's act_quant);
                                                       reciprocal=True: x * float32(1 / s) (DeepGEMM, MAX)

    x: (M, K) float, rounded to float32 first (DeepSeek upcasts bf16 activations to float32)
    block_m, block_k: block shape; activations 1 x 128 (per token and 128 channels), weights
        128 x 128; edge blocks are zero-padded, which leaves their amax unchanged
    amax_floor: DeepSeek's 1e-4 keeps an all-zero block finite (the Dec-2024 release had none)
    scale_ub: MAX's upper bound on amax (1200 in its MLA kernel); values then exceed 448 and the
        clamp saturates them. Without it |x / s| <= 448 up to one float32 rounding, so the clamp
        changes nothing (448 (1 + 2^-23) rounds to 448 in e4m3 anyway)
    scale_fmt: "fp32" or "ue8m0" (power-of-two scales, DeepSeek-V3.1's config)
    returns: q (M, K) float8_e4m3fn, scales (ceil(M/block_m), ceil(K/block_k)) float32
    """
    if scale_fmt not in ("fp32", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'fp32' or 'ue8m0', got {scale_fmt!r}")
    if block_m < 1 or block_k < 1:
        raise ValueError(f"block shape must be positive, got ({block_m}, {block_k})")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K), got shape {x.shape}")
    m, k = x.shape
    xb = _pad_blocks(x, block_m, block_k)  # mb, bm, kb, bk
    amax = np.abs(xb).max(axis=(1, 3), initial=np.float32(0))  # mb, kb
    amax = np.maximum(amax, np.float32(amax_floor))
    if scale_ub is not None:
        amax = np.minimum(amax, np.float32(scale_ub))
    s = amax / np.float32(448.0)  # float32 division
    if scale_fmt == "ue8m0":
        s = _ceil_pow2(s)
    sb = s[:, None, :, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = xb * (np.float32(1.0) / sb) if reciprocal else xb / sb  # float32
    q = fp8_encode(y, "e4m3", saturate=True).reshape(xb.shape[0] * block_m, xb.shape[2] * block_k)[:m, :k]
    return q, s.astype(np.float32)


def fp8_dequantize_blocks(q: NDArray, scales: NDArray, block_m: int, block_k: int) -> F64:
    """x^[i, j] = q[i, j] * scales[i // block_m, j // block_k], float64 (exact).

    q: (M, K) float8_e4m3fn (or e5m2)
    scales: (ceil(M/block_m), ceil(K/block_k)) float
    """
    m, k = np.shape(q)
    want = (-(-m // block_m), -(-k // block_k))
    if np.shape(scales) != want:
        raise ValueError(f"scales shape {np.shape(scales)} != {want} for q {(m, k)} and blocks "
                         f"({block_m}, {block_k})")
    s = np.asarray(scales, dtype=np.float64)
    x = fp8_decode(q)
    if m % block_m == 0 and k % block_k == 0:  # whole blocks: the scales broadcast over each block's view
        x = x.reshape(want[0], block_m, want[1], block_k)
        x *= s[:, None, :, None]
        return x.reshape(m, k)
    return x * np.repeat(np.repeat(s, block_m, axis=0), block_k, axis=1)[:m, :k]


# --------------------------------------------------------------------------- int4 group-wise

def _pack_nibbles(codes: NDArray, axis: int, order: NDArray | None = None) -> I32:
    """Pack groups of 8 consecutive 4-bit codes along `axis` into int32 words.

    Nibble p (bits 4p..4p+3) of word j holds element 8j + p, or 8j + order[p] when given."""
    c = np.moveaxis(np.asarray(codes, dtype=np.uint32), axis, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 8, 8)
    if order is not None:
        c = c[..., order]
    words = np.bitwise_or.reduce(c << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)).copy()


def _unpack_nibbles(words: NDArray, axis: int, order: NDArray | None = None) -> NDArray[np.int64]:
    """Inverse of `_pack_nibbles`: int32 words -> codes 0..15, 8 per word along `axis`."""
    w = np.moveaxis(np.asarray(words, dtype=np.int32).view(np.uint32), axis, -1)
    c = (w[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # ..., words, nibble p
    if order is not None:
        c = c[..., np.argsort(order)]  # element 8j + i sits in nibble argsort(order)[i]
    return np.moveaxis(c.reshape(*c.shape[:-2], 8 * c.shape[-2]).astype(np.int64), -1, axis)


def int4_quantize(w: NDArray, group: int = 128, order: str = "gptq") -> dict[str, NDArray]:
    """Asymmetric group-wise int4 quantization of a linear weight, packed as GPTQ v1 or AWQ.

        lo, hi = min(x_G, 0), max(x_G, 0)     per group of `group` input channels and column n
        s  = fp16((hi - lo) / 15)            (lo, hi) = (-1, 1) when both are 0 (GPTQ's rule)
        z  = clamp(round(-lo / s), zmin, 15)  q = clamp(round(x / s) + z, 0, 15)

    round is half-to-even (torch.round); x / s and -lo / s use the stored fp16 scale in float64,
    so the dequantized weight is within s / 2 of x. The range includes 0 (GPTQ's Quantizer;
    AWQ's pseudo-quantizer does not, which differs only for a group of one sign).
    GPTQ v1 stores z - 1 and cannot represent z = 0 (it would read back as 16), so zmin = 1 for
    "gptq"; zmin = 0 for "awq".

    w: (N, K) float, N = out_features, K = in_features; K % group == 0, N % 8 == 0
    order: "gptq" (v1) -> qweight (K/8, N) int32 packed along K, qzeros (K/g, N/8) int32 packed
           along N holding z - 1, scales (K/g, N) float16;
           "awq" -> qweight (K, N/8) int32 packed along N in nibble order 0,2,4,6,1,3,5,7,
           qzeros (K/g, N/8) the same packing holding z, scales (K/g, N) float16
    returns: {"qweight", "qzeros", "scales"}
    """
    if order not in INT4_ORDERS:
        raise ValueError(f"int4 order must be one of {INT4_ORDERS}, got {order!r}")
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"int4: w must be (N, K), got shape {w.shape}")
    n, k = w.shape
    if group < 8 or k % group or n % 8:
        raise ValueError(f"int4: K={k} must be a multiple of group={group} and N={n} of 8")
    x = w.T.reshape(k // group, group, n)  # G, g, N
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = np.maximum(x.max(axis=1), 0.0)
    flat = (lo == 0) & (hi == 0)
    lo, hi = np.where(flat, -1.0, lo), np.where(flat, 1.0, hi)
    scales = ((hi - lo) / 15).astype(np.float16)  # G, N
    s = scales.astype(np.float64)
    zmin = 1 if order == "gptq" else 0
    z = np.clip(np.rint(-lo / s), zmin, 15).astype(np.int64)  # G, N
    q = np.clip(np.rint(x / s[:, None]) + z[:, None], 0, 15).astype(np.int64).reshape(k, n)
    if order == "gptq":
        return {"qweight": _pack_nibbles(q, axis=0), "qzeros": _pack_nibbles(z - 1, axis=1),
                "scales": scales}
    return {"qweight": _pack_nibbles(q, axis=1, order=AWQ_PACK),
            "qzeros": _pack_nibbles(z, axis=1, order=AWQ_PACK), "scales": scales}


def int4_unpack(packed: dict[str, NDArray], order: str = "gptq") -> tuple[NDArray[np.int64], NDArray[np.int64], F64]:
    """Codes, zero points and scales of a packed int4 weight (no act-order g_idx).

    packed: {"qweight", "qzeros", "scales"} as `int4_quantize` returns them
    returns: q (K, N) 0..15, z (K/g, N) true zero points (GPTQ v1: stored + 1, so 1..16),
             s (K/g, N) float64
    """
    if order not in INT4_ORDERS:
        raise ValueError(f"int4 order must be one of {INT4_ORDERS}, got {order!r}")
    qw, qz = packed["qweight"], packed["qzeros"]
    s = np.asarray(packed["scales"]).astype(np.float64)
    if order == "gptq":
        q = _unpack_nibbles(qw, axis=0)
        z = _unpack_nibbles(qz, axis=1) + 1  # v1 stores zero - 1; kernels add 1 back without a mask
    else:
        q = _unpack_nibbles(qw, axis=1, order=AWQ_PACK)
        z = _unpack_nibbles(qz, axis=1, order=AWQ_PACK)
    if z.shape != s.shape or q.shape[1] != s.shape[1] or q.shape[0] % s.shape[0]:
        raise ValueError(f"int4 {order}: qweight {np.shape(qw)}, qzeros {np.shape(qz)} and scales "
                         f"{s.shape} do not describe one (K, N) weight")
    return q, z, s


def int4_dequantize(packed: dict[str, NDArray], order: str = "gptq") -> F64:
    """W[n, k] = s[k // g, n] * (q[k, n] - z[k // g, n]), float64 (exact), g = K / scales.shape[0].

    packed: {"qweight", "qzeros", "scales"} (GPTQ v1 or AWQ layout, see `int4_quantize`)
    returns: (N, K) float64
    """
    q, z, s = int4_unpack(packed, order)
    g = q.shape[0] // s.shape[0]
    zk, sk = np.repeat(z, g, axis=0), np.repeat(s, g, axis=0)  # K, N
    return (sk * (q - zk)).T


# --------------------------------------------------------------------------- MXFP4 / NVFP4

def _e2m1_codes(y: NDArray) -> U8:
    """float32 values -> E2M1 codes 0..15 (sign bit 3), RNE, saturated to +-6."""
    y = np.clip(np.asarray(y, dtype=np.float32), -E2M1_MAX, E2M1_MAX)
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0xF)


def _pack_fp4(codes: U8) -> U8:
    """(..., K) codes -> (..., K/2) bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def fp4_unpack(packed: NDArray) -> F64:
    """(..., K/2) bytes -> (..., K) E2M1 values in float64 (element 2i from the low nibble)."""
    b = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return _E2M1_VALUES[codes]


def _blocks(x: NDArray, block: int, name: str) -> F32:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % block:
        raise ValueError(f"{name}: the last dimension must be a multiple of {block}, got shape {x.shape}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def mxfp4_quantize(x: NDArray) -> tuple[U8, NDArray]:
    """OCP MX v1 MXFP4: blocks of 32 along the last axis, one E8M0 scale, E2M1 elements.

        u = clamp(floor(log2 amax_B) - 2, -127, 127)   (amax_B = 0 -> u = -127)
        e = u + 127 (E8M0 code),   elem = RNE_e2m1(clamp(x / 2^u, +-6))

    x: (..., K) float, rounded to float32 first; K % 32 == 0
    returns: packed (..., K/2) uint8 (element 2i in the low nibble), scales (..., K/32)
             float8_e8m0fnu; a block holding inf or NaN gets the NaN scale 0xFF.
    floor(log2) is exact here (frexp); torchao reads the float32 exponent bits, which agrees
    except for subnormal amax (< 2^-126), where torchao also floors the scale at 2^-126.
    """
    xb = _blocks(x, MX_BLOCK, "mxfp4")  # ..., nb, 32
    amax = np.abs(xb).max(axis=-1).astype(np.float64)
    _, exp = np.frexp(amax)  # amax = mant 2^exp, mant in [0.5, 1): floor(log2 amax) = exp - 1
    u = np.clip(np.where(amax > 0, exp - 1 - 2, -127), -127, 127)
    bad = ~np.isfinite(amax)
    y = xb.astype(np.float64) / np.ldexp(1.0, np.where(bad, 0, u))[..., None]  # exact
    codes = _e2m1_codes(y).reshape(np.shape(x))
    e = np.where(bad, 255, u + 127).astype(np.uint8)
    return _pack_fp4(codes), e.view(ml_dtypes.float8_e8m0fnu)


def mxfp4_dequantize(packed: NDArray, scales: NDArray) -> F64:
    """x^ = 2^(e - 127) * e2m1 per block of 32 (E8M0 0xFF -> NaN), float64 (exact).

    packed: (..., K/2) uint8;  scales: (..., K/32) float8_e8m0fnu (or its uint8 codes)
    returns: (..., K) float64
    """
    v = fp4_unpack(packed)
    e = np.asarray(scales).view(np.uint8).astype(np.int64)
    if v.shape[:-1] != e.shape[:-1] or v.shape[-1] != e.shape[-1] * MX_BLOCK:
        raise ValueError(f"mxfp4: packed {np.shape(packed)} and scales {e.shape} disagree (32-blocks)")
    s = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))
    return (v.reshape(*e.shape, MX_BLOCK) * s[..., None]).reshape(v.shape)


def nvfp4_per_tensor_scale(x: NDArray) -> np.float32:
    """torchao's per-tensor scale g = amax / (448 * 6), float32."""
    amax = np.abs(np.asarray(x, dtype=np.float32)).max(initial=np.float32(0))
    return np.float32(amax) / np.float32(448.0 * 6.0)


def nvfp4_quantize(x: NDArray, per_tensor_scale: float | None = None) -> tuple[U8, NDArray]:
    """NVFP4 (torchao `nvfp4_quantize`): blocks of 16, e4m3fn scales, optional float32 scale g.

        b    = amax_B / 6                                 float32
        s_B  = e4m3fn(clamp(b [/ g], 2^-6, 448))          two-level when g is given
        t    = f32(s_B) [* g]                             float32 product
        elem = RNE_e2m1(clamp(float32(x / t), +-6))       float32 division, as torchao

    x: (..., K) float, rounded to float32 first; K % 16 == 0
    per_tensor_scale: g (see `nvfp4_per_tensor_scale`) or None for single-level scaling
    returns: packed (..., K/2) uint8 (element 2i in the low nibble), scales (..., K/16) float8_e4m3fn
    """
    xb = _blocks(x, NV_BLOCK, "nvfp4")  # ..., nb, 16
    b = np.abs(xb).max(axis=-1) / np.float32(E2M1_MAX)  # float32
    g = None if per_tensor_scale is None else np.float32(per_tensor_scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        sb = b if g is None else b / g
        s8 = fp8_encode(np.clip(sb, np.float32(E4M3_TINY), np.float32(448.0)), "e4m3")
        t = s8.astype(np.float32) if g is None else s8.astype(np.float32) * g
        y = xb / t[..., None]  # float32 division
    codes = _e2m1_codes(y).reshape(np.shape(x))
    return _pack_fp4(codes), s8


def nvfp4_dequantize(packed: NDArray, scales: NDArray, per_tensor_scale: float | None = None) -> F64:
    """x^ = e2m1 * s_B [* g] per block of 16, float64 (exact).

    packed: (..., K/2) uint8;  scales: (..., K/16) float8_e4m3fn
    per_tensor_scale: g or None, as passed to `nvfp4_quantize`
    returns: (..., K) float64
    """
    v = fp4_unpack(packed)
    s = fp8_decode(scales)
    if v.shape[:-1] != s.shape[:-1] or v.shape[-1] != s.shape[-1] * NV_BLOCK:
        raise ValueError(f"nvfp4: packed {np.shape(packed)} and scales {s.shape} disagree (16-blocks)")
    if per_tensor_scale is not None:
        s = s * float(np.float32(per_tensor_scale))
    return (v.reshape(*s.shape, NV_BLOCK) * s[..., None]).reshape(v.shape)
