"""GEMV (M = 1) over GGML weight bytes, in Triton: c = a @ dequant(W)^T, streamed once, fp32 FMAs.

The decode-time matrix-vector product of kernels/triton/gemm.py (formulas and goldens there):
every weight byte is read once, dequantized exactly to fp32 in registers (each value one fp32
rounding of the exact one, as ggml's dequantize_row_*) and multiplied into an fp32 accumulator;
the result is `a @ dequant(W)^T` in fp32 arithmetic, reduced once after the loop.

Why it looks like this: at ~4.5 bits a weight, an H100 streams one weight element in about the
time its SMs issue 7 instructions per element (estimate: ~3 TB/s, 132 SMs x 128 lanes at
~1.75 GHz), so instruction count decides whether a GEMV is bound by memory or by issue. The
choices below were made on SASS compiled offline for sm_90 (Q4_K: 14 -> ~7 instructions per
element, Q4_0: 11 -> 8.5, Q6_K: 19 -> 14, Q8_0: ~9.5 against a larger budget). Hence:
- Weights are loaded as aligned 16/32-bit words (a uint8 tensor costs a byte extract per
  element), directly in 4-D tiles (BLOCK_N, G, E, I): G groups sharing a scale, E words per
  group, I bytes per word, so the loaded tile is the layout every other tensor is converted to.
- A code never moves: with p its bit position inside the word, (word & (mask << p)) | 0x4B000000
  is the fp32 2^23 + q 2^p, so subtracting 2^23 leaves q 2^p exactly (one logic op and one add,
  no shift, no int->float conversion), and the group scale is pre-multiplied by 2^-p (exact).
  Positions stay below bit 20 (bit 23 is the exponent's): bytes 2 and 3 of a 32-bit word are
  read from the word shifted by 16.
- `a` is loaded once per iteration as one contiguous run (the groups of a tile cover a contiguous
  K range) and split into the "parts" of the words with reshape/permute/split: part P holds,
  for every (group, word, byte), the column of `a` that the code of part P multiplies.

  format  word   E   I  parts P               element of (group g, word e, byte i, part P)
  Q8_0    u16   16   2  1                     32 g + 2e + i
  Q4_0    u16    8   2  2 (nibble h)          32 g + 16 h + 2e + i
  Q4_K    u32    8   4  2 (nibble h)          256 blk + 64 c + 32 h + 4e + i       (g = 4 blk + c)
  Q6_K    u16    8   2  4 (t)                 256 blk + 128 h2 + 32 t + 16 s + 2e + i   (g = 4 blk + 2 h2 + s)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemm import _f16_at, _scale_min_k4, _u32_at

# (BLOCK_N, G, num_warps, num_stages) at M = 1. Unmeasured guesses (benchmarks/gpu_gemm.py sweeps);
# the SASS of (32, 8, 8) has ~7 instructions per Q4_K element, G even is required for Q6_K.
GEMV_CONFIGS = {"q8_0": (32, 8, 8, 2), "q4_0": (32, 8, 8, 2), "q4_k": (32, 8, 8, 2), "q6_k": (32, 4, 8, 2)}
WORDS = {0: (16, 2), 1: (8, 2), 2: (8, 4), 3: (8, 2)}  # format id -> (E words per group, I bytes per word)


@triton.jit
def _words(ptr_u8, e, mask, WORD: tl.constexpr):
    """Words e (1, 1, E) at the aligned byte addresses ptr_u8 (BLOCK_N, G, 1), as a 4-D
    (BLOCK_N, G, E, 1) int32 tile: loaded in 4-D, so that this load anchors the layout."""
    p = (ptr_u8.to(tl.pointer_type(WORD)) + e)[:, :, :, None]
    return tl.load(p, mask=mask[:, :, :, None], other=0).to(tl.int32)


@triton.jit
def _pow2(n):
    """2^n as fp32 for integer n in [-126, 127], exactly (tl.exp2 is ex2.approx on the GPU)."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _code_at(x, p, mask_bits: tl.constexpr, offset: tl.constexpr):
    """(q - offset) 2^p as fp32, q = (x >> p) & mask_bits (p + bits <= 23), exactly: the code stays in place."""
    f = ((x & (mask_bits << p)) | 0x4B000000).to(tl.float32, bitcast=True)
    if offset == 0:
        return f - 8388608.0
    else:
        return f - (8388608.0 + offset * _pow2(p))


@triton.jit
def _split2(x):
    """(x[..., 0], x[..., 1])."""
    return tl.split(x)


@triton.jit
def _gemv_ggml_kernel(
    A_ptr, W_ptr, Bias_ptr, C_ptr, N, n_groups, groups_per_split,
    stride_am, stride_ak, stride_wn, stride_cs, stride_cm, stride_cn,
    FMT: tl.constexpr, GROUP_EL: tl.constexpr, E: tl.constexpr, I: tl.constexpr, G: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    A_row = A_ptr + pid_m.to(tl.int64) * stride_am
    Wrow = W_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
    offs_g = tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    ii = tl.arange(0, I)[None, None, None, :]
    offs_a = tl.arange(0, G * GROUP_EL)
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    k_hi = g_hi * GROUP_EL
    acc = tl.zeros([BLOCK_N, G, E, I], dtype=tl.float32)  # fp32 accumulator, one value per weight byte
    for g0 in range(g_lo, g_hi, G):
        g = g0 + offs_g
        mask = mask_n[:, None, None] & (g < g_hi)
        k = g0 * GROUP_EL + offs_a  # the tile's contiguous K range
        a = tl.load(A_row + k * stride_ak, mask=k < k_hi, other=0.0).to(tl.float32)
        if FMT == 0:  # Q8_0: d, then 16 words of two int8 codes; W = d * code
            base = Wrow + g * 34
            d = _f16_at(base, mask)[:, :, :, None]
            x = _words(base + 2, e, mask, tl.uint16) ^ 0x8080  # byte ^ 0x80 = int8 code + 128
            p = 8 * ii
            w = _code_at(x, p, 255, 128.0) * (d * _pow2(-p))
            acc += w * tl.reshape(a, [G, E, I])[None, :, :, :]
        elif FMT == 1:  # Q4_0: d, then 8 words of four nibbles; W = d (q - 8)
            base = Wrow + g * 18
            d = _f16_at(base, mask)[:, :, :, None]
            x = _words(base + 2, e, mask, tl.uint16)
            a0, a1 = _split2(tl.permute(tl.reshape(a, [G, 2, E, I]), (0, 2, 3, 1)))
            for h in tl.static_range(2):
                p = 8 * ii + 4 * h
                # q 2^p (d 2^-p) - 8 d = (q - 8) d exactly (5 + 11 bits), the FMA rounds nothing
                w = _code_at(x, p, 15, 0.0) * (d * _pow2(-p)) - 8.0 * d
                acc += w * (a0 if h == 0 else a1)[None, :, :, :]
        elif FMT == 2:  # Q4_K: chunk c of block blk: header, then 8 words of qs
            blk = g // 4
            c = g % 4
            base = Wrow + blk * 144
            dd = _u32_at(base, mask)
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            s0 = _u32_at(base + 4, mask)
            s1 = _u32_at(base + 8, mask)
            s2 = _u32_at(base + 12, mask)
            x = _words(base + 16 + 32 * c, e, mask, tl.uint32)
            a0, a1 = _split2(tl.permute(tl.reshape(a, [G, 2, E, I]), (0, 2, 3, 1)))
            hi = ii // 2  # bytes 2, 3 are read from the word shifted by 16: every code below bit 16
            p = 8 * (ii % 2)
            for h in tl.static_range(2):
                sc, mn = _scale_min_k4(s0, s1, s2, 2 * c + h)
                ds = (d * sc)[:, :, :, None] * _pow2(-(p + 4 * h))  # exact: 11 + 6 bits
                dm = (dmin * mn)[:, :, :, None]
                # q 2^p (d sc 2^-p) is exact; W = q d sc - dmin m rounds once, as in ggml
                w = _code_at(x >> (16 * hi), p + 4 * h, 15, 0.0) * ds - dm
                acc += w * (a0 if h == 0 else a1)[None, :, :, :]
        else:  # Q6_K: group (h2, s) of block blk: ql words qa, qb and qh words
            blk = g // 4
            h2 = (g // 2) % 2
            s = g % 2
            base = Wrow + blk * 210
            d = _f16_at(base + 208, mask)
            qa = _words(base + 64 * h2 + 16 * s, e, mask, tl.uint16)
            qb = _words(base + 64 * h2 + 32 + 16 * s, e, mask, tl.uint16)
            qh = _words(base + 128 + 32 * h2 + 16 * s, e, mask, tl.uint16)
            # a: (G/2 of (blk, h2), t, s, e, i) -> (g, e, i, t), then parts t = 2 t1 + t0
            a5 = tl.permute(tl.reshape(a, [G // 2, 4, 2, E, I]), (0, 2, 3, 4, 1))
            a_e, a_o = _split2(tl.reshape(a5, [G, E, I, 2, 2]))  # t0 = 0, 1
            a_t0, a_t2 = _split2(a_e)
            a_t1, a_t3 = _split2(a_o)
            p = 8 * ii
            for t in tl.static_range(4):
                if t == 0:
                    x = (qa & 0x0F0F) | ((qh << 4) & 0x3030)
                elif t == 1:
                    x = (qb & 0x0F0F) | ((qh << 2) & 0x3030)
                elif t == 2:
                    x = ((qa >> 4) & 0x0F0F) | (qh & 0x3030)
                else:
                    x = ((qb >> 4) & 0x0F0F) | ((qh >> 2) & 0x3030)
                sc = tl.load(base + 192 + 8 * h2 + 2 * t + s, mask=mask, other=0).to(tl.int8, bitcast=True)
                ds = (d * sc.to(tl.float32))[:, :, :, None] * _pow2(-p)  # exact: 11 + 7 bits
                w = _code_at(x, p, 63, 32.0) * ds  # (q - 32) d sc: exact, 6 + 7 + 11 bits
                if t == 0:
                    acc += w * a_t0[None, :, :, :]
                elif t == 1:
                    acc += w * a_t1[None, :, :, :]
                elif t == 2:
                    acc += w * a_t2[None, :, :, :]
                else:
                    acc += w * a_t3[None, :, :, :]
    res = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)  # the one cross-thread reduction
    if HAS_BIAS:  # split-K partials take the bias in the reduction instead
        res += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    c_ptrs = C_ptr + pid_s.to(tl.int64) * stride_cs + pid_m.to(tl.int64) * stride_cm + offs_n * stride_cn
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=mask_n)


def launch(a, w, bias, dst, fmt_id: int, group_el: int, n_groups: int, groups_per_split: int, splits: int,
           strides: tuple[int, int, int], config: tuple[int, int, int, int]) -> None:
    """Grid (N tiles, M rows, splits); the checks and split-K set-up are gemm.gemm_nt's."""
    block_n, G, num_warps, num_stages = config
    if fmt_id == 3 and G % 2:
        raise ValueError(f"gemm_nt[q6_k] GEMV: G={G} must be even (a tile covers whole 128-element halves)")
    E, I = WORDS[fmt_id]
    _gemv_ggml_kernel[(triton.cdiv(w.shape[0], block_n), a.shape[0], splits)](
        a, w, bias if bias is not None else w, dst, w.shape[0], n_groups, groups_per_split,
        a.stride(0), a.stride(1), w.stride(0), *strides,
        FMT=fmt_id, GROUP_EL=group_el, E=E, I=I, G=G, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
