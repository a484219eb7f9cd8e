"""The 256-element GGML super-block formats (K-quants and Q8_K): fields, dequantization and the
reference quantizers `quantize_row_q{2..6}_K_ref`, `quantize_row_q8_K_ref`.

Used through `refimpl.quant` (public API, formulas and conventions in its docstring). Byte layouts
(offset: field), research/quant-formats.md §1.2-1.3:

    q2_k  84 B: 0 scales[16] (low nibble sc_j, high nibble m_j) | 16 qs[64] | 80 d | 82 dmin
    q3_k 110 B: 0 hmask[32] | 32 qs[64] | 96 scales[12] (6-bit, minus 32) | 108 d
    q4_k 144 B: 0 d | 2 dmin | 4 scales[12] (get_scale_min_k4) | 16 qs[128]
    q5_k 176 B: 0 d | 2 dmin | 4 scales[12] | 16 qh[32] | 48 qs[128]
    q6_k 210 B: 0 ql[128] | 128 qh[64] | 192 scales[16] int8 | 208 d
    q8_k 292 B: 0 d float32 | 4 qs[256] int8 | 260 bsums[16] int16

Element e of a super-block, in the 2-bit-plane formats (q2_k, q3_k, q6_k's high bits): half
h = e // 128, plane t = (e % 128) // 32, lane l = e % 32, stored in byte 32h + l at bits 2t.
Arrays below are shaped (B, ...) for B blocks; sub-block quantities are (B, nsub).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import quant_bits as qb
from kernel_parity.refimpl import quant_search as qs
from kernel_parity.refimpl.quant_search import F32

U8 = NDArray[np.uint8]
A32 = NDArray[np.float32]
F64 = NDArray[np.float64]

NBYTES = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210, "q8_k": 292}  # the structs above
_SHIFT2 = np.array([0, 2, 4, 6], np.uint8)  # the 2-bit plane t sits at bits 2t


# ---- fields --------------------------------------------------------------------------------------


def _f16(b: U8, offset: int) -> F64:
    return b.view("<f2")[:, offset // 2].astype(np.float64)


def _planes2(q: U8) -> U8:
    """(B, 32 * nh) bytes of 2-bit planes -> (B, nh * 128) codes in element order (h, t, l)."""
    return qb.bit_planes(qb.words(q).reshape(q.shape[0], -1, 4), 2, 4).view(np.uint8).reshape(q.shape[0], -1)


def _mask_planes(m: U8) -> qb.W:
    """(B, 32) bytes -> (B, 8, 4) words: plane k holds bit k of byte l, element 32k + l (hmask, qh)."""
    return qb.bit_planes(qb.words(m), 1, 8)


def _nibble_pairs(q: U8) -> qb.W:
    """(B, 128) bytes -> (B, 4, 2, 4) words: chunk c holds elements 64c + l (low nibble of byte
    32c + l) and 64c + 32 + l (high nibble), the Q4_K/Q5_K order."""
    lo, hi = qb.nibbles(qb.words(q).reshape(q.shape[0], 4, 1, 4))
    return np.concatenate([lo, hi], axis=2)


def scale_min_k4(s: U8) -> tuple[U8, U8]:
    """`get_scale_min_k4` for j = 0..7: the 6-bit (sc_j, m_j) of Q4_K/Q5_K from 12 bytes (B, 12)."""
    sc = np.empty((s.shape[0], 8), np.uint8)
    m = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    m[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def _q3_scales(s: U8) -> NDArray[np.int8]:
    """Q3_K's 16 six-bit scales minus 32: low 4 bits in s[j] (j < 8) or s[j-8] >> 4, high 2 bits
    at bits 2*(j//4) of s[8 + j%4]."""
    lo = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=1)
    hi = ((s[:, None, 8:12] >> _SHIFT2[:, None]) & 3).reshape(-1, 16)
    sc = lo | (hi << 4)
    sc -= 32  # uint8 wraps below 32; read as int8 it is sc - 32
    return sc.view(np.int8)


def fields(fmt: str, b: U8) -> tuple[NDArray, dict[str, NDArray]]:
    """(codes (B, 256) uint8/int8, {d, dmin, scales, mins, bsums}) of blocks b (B, nbytes)."""
    B = b.shape[0]
    if fmt == "q8_k":
        return b[:, 4:260].view(np.int8), {"d": b.view("<f4")[:, 0].astype(np.float64),
                                           "bsums": b[:, 260:292].view("<i2")}
    if fmt == "q2_k":
        return _planes2(b[:, 16:80]), {"d": _f16(b, 80), "dmin": _f16(b, 82),
                                       "scales": b[:, :16] & 0x0F, "mins": b[:, :16] >> 4}
    if fmt == "q3_k":  # q = low2 - (hmask bit ? 0 : 4) = (low2 | bit << 2) - 4
        low = qb.bit_planes(qb.words(b[:, 32:96]).reshape(B, 2, 4), 2, 4).reshape(B, 8, 4)
        c = qb.offset_codes(low | (_mask_planes(b[:, :32]) << np.uint64(2)), 3)
        return c.reshape(B, 256), {"d": _f16(b, 108), "scales": _q3_scales(b[:, 96:108])}
    if fmt in ("q4_k", "q5_k"):
        c = _nibble_pairs(b[:, 16:144] if fmt == "q4_k" else b[:, 48:176])
        if fmt == "q5_k":
            c |= _mask_planes(b[:, 16:48]).reshape(B, 4, 2, 4) << np.uint64(4)
        sc, m = scale_min_k4(b[:, 4:16])
        return c.view(np.uint8).reshape(B, 256), {"d": _f16(b, 0), "dmin": _f16(b, 2),
                                                  "scales": sc, "mins": m}
    # q6_k: low 4 bits from ql (planes t = 0, 1 low nibbles, t = 2, 3 high nibbles), high 2 from qh
    lo, hi = qb.nibbles(qb.words(b[:, :128]).reshape(B, 2, 1, 2, 4))
    low = np.concatenate([lo, hi], axis=2).reshape(B, 2, 4, 4)
    high = qb.bit_planes(qb.words(b[:, 128:192]).reshape(B, 2, 4), 2, 4)
    c = qb.offset_codes(low | (high << np.uint64(4)), 6)
    return c.reshape(B, 256), {"d": _f16(b, 208), "scales": b[:, 192:208].view(np.int8)}


def dequantize(fmt: str, b: U8) -> F64:
    """(B, nbytes) blocks -> (B, 256) exact float64, in ggml's association (d*sc_j)*c - dmin*m_j."""
    c, f = fields(fmt, b)
    if fmt == "q8_k":
        return np.multiply(c, f["d"][:, None])
    nsub = f["scales"].shape[1]
    d1 = f["d"][:, None] * f["scales"]  # B, nsub: exact, as C's float32 d * sc is
    y = np.multiply(c.reshape(c.shape[0], nsub, -1), d1[..., None])
    if "dmin" in f:
        y -= (f["dmin"][:, None] * f["mins"])[..., None]
    return y.reshape(c.shape[0], 256)


# ---- quantizers ----------------------------------------------------------------------------------


def _sub_major(x: A32, n: int) -> A32:
    """(B, 256) -> (n, B * 256 / n): sub-blocks of n elements, element-major (see quant_search)."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _block_major(L: A32, nsub: int) -> A32:
    """Inverse of _sub_major: (n, B * nsub) -> (B, nsub, n)."""
    return L.T.reshape(-1, nsub, L.shape[0])


def _pack_planes2(L: U8) -> U8:
    """(B, 256) codes in [0, 3] -> (B, 64): byte 32h + l = sum_t L[128h + 32t + l] << 2t."""
    L = L.reshape(L.shape[0], 2, 4, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _pack_nibble_pairs(L: U8) -> U8:
    """(B, 256) codes -> (B, 128): byte 32c + l = L[64c + l] | L[64c + 32 + l] << 4."""
    L = L.reshape(L.shape[0], 4, 2, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def _pack_bit_planes(bits: NDArray[np.bool_]) -> U8:
    """(B, 256) bits -> (B, 32): bit k of byte l is element 32k + l."""
    t = np.ascontiguousarray(bits.reshape(-1, 8, 32).transpose(0, 2, 1))
    return np.packbits(t, axis=-1, bitorder="little").reshape(-1, 32)


def _codes_where(use: NDArray[np.bool_], new: A32, old: A32) -> U8:
    """Codes (B, 256): `new` in sub-blocks where `use`, else the search's `old` (B, nsub, n)."""
    return np.where(use[..., None], new, old).astype(np.uint8).reshape(old.shape[0], 256)


def _quantize_q2_q4_q5(fmt: str, x: A32) -> U8:
    """Asymmetric K-quants: make_qkx2_quants per sub-block, 4-bit (q2_k) or 6-bit sub-scales."""
    B = x.shape[0]
    n, nmax, qmax = {"q2_k": (16, 3, 15), "q4_k": (32, 15, 63), "q5_k": (32, 31, 63)}[fmt]
    nsub = 256 // n
    xs = _sub_major(x, n)
    if fmt == "q2_k":
        w = np.abs(xs)
        scale, the_min, L = qs.make_qkx2_quants(xs, w, 3, -0.5, 0.1, 15, use_mad=True)
    else:
        av_x = np.sqrt(qs.seq_sum(xs * xs) / F32(32))
        w = av_x + np.abs(xs)
        rmin, nstep = (-1.0, 20) if fmt == "q4_k" else (-0.5, 15)
        scale, the_min, L = qs.make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scale.reshape(B, nsub), the_min.reshape(B, nsub)
    max_scale = np.maximum(scales, F32(0)).max(axis=1)  # C: running max from 0
    max_min = np.maximum(mins, F32(0)).max(axis=1)
    inv_s = np.where(max_scale > 0, F32(qmax) / max_scale, F32(0)).astype(np.float32)
    inv_m = np.where(max_min > 0, F32(qmax) / max_min, F32(0)).astype(np.float32)
    ls = (qs.nearest_int(inv_s[:, None] * scales) & 0xFF).astype(np.uint8)  # stored to uint8
    lm = (qs.nearest_int(inv_m[:, None] * mins) & 0xFF).astype(np.uint8)
    if fmt == "q2_k":  # d = 0 when max_scale <= 0 (inv_s = 0 then gives ls = 0 too)
        d = qs.fp16_bits(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
        dmin = qs.fp16_bits(np.where(max_min > 0, max_min / F32(15), F32(0)))
        packed = ls | (lm << 4)
        ls, lm = packed & 0x0F, packed >> 4  # what the C reads back from the stored byte
    else:
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
        d, dmin = qs.fp16_bits(max_scale / F32(63)), qs.fp16_bits(max_min / F32(63))
    # final codes from the stored scales: L = clamp(nearest_int((x + dmin*m_j) / (d*sc_j)))
    df = qs.fp16_value(d)[:, None] * ls.astype(np.float32)
    dm = qs.fp16_value(dmin)[:, None] * lm.astype(np.float32)
    x3 = x.reshape(B, nsub, n)
    use = df != 0  # d == 0: the C skips the sub-block and keeps the search's codes
    new = qs.nearest_code((x3 + dm[..., None]) / np.where(use, df, F32(1))[..., None], 0, nmax)
    codes = _codes_where(use, new, _block_major(L, nsub))

    out = np.zeros((B, NBYTES[fmt]), np.uint8)
    if fmt == "q2_k":
        out[:, :16] = packed
        out[:, 16:80] = _pack_planes2(codes)
        out.view("<u2")[:, 40], out.view("<u2")[:, 41] = d, dmin
        return out
    out.view("<u2")[:, 0], out.view("<u2")[:, 1] = d, dmin
    out[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    if fmt == "q4_k":
        out[:, 16:] = _pack_nibble_pairs(codes)
    else:
        out[:, 16:48] = _pack_bit_planes(codes > 15)
        out[:, 48:] = _pack_nibble_pairs(codes & 0x0F)
    return out


def _quantize_q3_k(x: A32) -> U8:
    B = x.shape[0]
    scale, L = qs.make_q3_quants(_sub_major(x, 16), 4)
    scales = scale.reshape(B, 16)
    _, max_scale = qs.signed_absmax(scales, axis=1)  # first sub-scale of largest magnitude
    nz = max_scale != 0
    iscale = F32(-32) / max_scale
    l6 = np.clip(qs.nearest_int(iscale[:, None] * scales).astype(np.int8), -32, 31) + 32
    l6 = np.where(nz[:, None], l6, 32).astype(np.uint8)  # no scales written: bytes stay 0
    d = qs.fp16_bits(np.where(nz, F32(1) / iscale, F32(0)))
    df = qs.fp16_value(d)[:, None] * (l6.astype(np.float32) - F32(32))
    use = df != 0
    new = qs.nearest_code(x.reshape(B, 16, 16) / np.where(use, df, F32(1))[..., None], -4, 3) + 4
    codes = _codes_where(use, new, _block_major(L, 16))

    out = np.zeros((B, 110), np.uint8)
    out[:, :32] = _pack_bit_planes(codes > 3)
    out[:, 32:96] = _pack_planes2(codes & 3)
    lo = np.where(nz[:, None], l6 & 0x0F, 0).astype(np.uint8)
    hi = np.where(nz[:, None], l6 >> 4, 0).astype(np.uint8).reshape(B, 4, 4)  # j // 4, j % 4
    out[:, 96:104] = lo[:, :8] | (lo[:, 8:] << 4)
    out[:, 104:108] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    out.view("<u2")[:, 54] = d
    return out


def _quantize_q6_k(x: A32) -> U8:
    B = x.shape[0]
    scale, L = qs.make_qx_quants(_sub_major(x, 16), 32)
    scales = scale.reshape(B, 16)
    amax, max_scale = qs.signed_absmax(scales, axis=1)
    live = ~(amax < qs.GROUP_MAX_EPS)  # else the whole block is zero bytes
    iscale = F32(-128) / max_scale
    d = qs.fp16_bits(F32(1) / iscale)
    sc = np.minimum(127, qs.nearest_int(iscale[:, None] * scales)).astype(np.int8)
    df = qs.fp16_value(d)[:, None] * sc.astype(np.float32)
    use = df != 0
    new = qs.nearest_code(x.reshape(B, 16, 16) / np.where(use, df, F32(1))[..., None], -32, 31) + 32
    codes = _codes_where(use, new, _block_major(L, 16)).reshape(B, 2, 4, 32)

    out = np.zeros((B, 210), np.uint8)
    lo = codes & 0x0F
    ql = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    out[:, :128] = ql.reshape(B, 128)
    out[:, 128:192] = _pack_planes2((codes >> 4).reshape(B, 256))
    out[:, 192:208] = sc.view(np.uint8)
    out.view("<u2")[:, 104] = d
    out[~live] = 0
    return out


def _quantize_q8_k(x: A32) -> U8:
    amax, mx = qs.signed_absmax(x, axis=1)
    nz = amax != 0
    iscale = F32(-127) / mx
    q = np.minimum(127, qs.nearest_int(iscale[:, None] * x)).astype(np.int8)
    q = np.where(nz[:, None], q, np.int8(0))
    out = np.zeros((x.shape[0], 292), np.uint8)
    out.view("<f4")[:, 0] = np.where(nz, F32(1) / iscale, F32(0))
    out[:, 4:260] = q.view(np.uint8)
    out[:, 260:292] = q.reshape(-1, 16, 16).sum(axis=-1, dtype=np.int16).view(np.uint8)
    return out


def quantize(fmt: str, x: A32) -> U8:
    """(B, 256) float32 -> (B, nbytes), `quantize_row_<fmt>_ref` byte for byte."""
    if fmt == "q3_k":
        return _quantize_q3_k(x)
    if fmt == "q6_k":
        return _quantize_q6_k(x)
    if fmt == "q8_k":
        return _quantize_q8_k(x)
    return _quantize_q2_q4_q5(fmt, x)
