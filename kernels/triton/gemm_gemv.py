"""GEMV and small-M GEMM over GGML weight bytes, in Triton: C = A @ dequant(W)^T in fp32 arithmetic.

gemm.gemm_nt's exact path (formulas, goldens and dispatch there): M = 1, fp32 A up to M = 16, and
bf16 / fp16 A below gemm.DECODE_DOT_MIN_M. Every weight byte is read once per program, dequantized
exactly to fp32 in registers (each value one fp32 rounding of the exact one, as ggml's
dequantize_row_*) and multiplied with fp32 FMAs into accumulators, once for each of BLOCK_M rows of A.

Why it looks like this (offline sm_90 SASS, then an H100; benchmarks/NOTES-gemm.md): an H100 streams
a 4.5-bit weight in the time its SMs issue ~7 instructions, so instructions per weight decide.
- Lanes run along K, the rows of W in registers: a warp's load is a contiguous run of a row, and an
  activation a thread loads serves all rows it holds. Every tensor has the full (BLOCK_M, BLOCK_N, NB,
  L) shape (rows broadcast by index), so loads, dequantization and products share one layout: no
  layout conversion, no shared memory. The compiler merges the loads of a row-broadcast pointer only
  when unmasked: the main loop has no mask (rows past M, N are clamped, their results dropped), only
  the last, partial iteration.
- A code stays in place: (word & (mask << p)) | 0x4B000000 is the fp32 2^23 + q 2^p (one LOP3; the
  masks are kernel arguments, which ptxas keeps in registers where it rematerialises immediates).
  Q4_K: (f - 2^23) (d sc 2^-p) - dmin m rounds once, at the subtraction, as ggml. Q8_0 / Q4_0: one
  fma, (2^23 + q 2^p) (d 2^-p) - (2^(23-p) + offset) d = (q - offset) d, exact with every byte moved
  to bits 8-15 first (the constant then spans <= 24 bits; at p = 0, 27).
- Q4_K (144-byte blocks, 16-byte aligned): lane c of 4 holds chunk c (64 weights: two 16-byte qs
  loads and the 16-byte header), its scales decoded once per 64 weights.
- Q8_0 / Q4_0 blocks (34 / 18 bytes) are 2-byte aligned, a pair (68 / 36 bytes) 4-aligned: lane l of
  L = 16 / 8 holds 32-bit word l of a pair (its bytes are codes of one block, but words 0 and L / 2
  hold a scale: those activations are zeroed); the last word of a pair is a tile of its own.
  Unaligned rows or an odd block count read words as two 16-bit halves (U16).
- Q6_K keeps the word-tile kernel of the first version (one row of A per program).

References: llama.cpp's CUDA mul_mat_vec_q (the streaming structure), ggml-quants.c (dequantize_row_*).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .loads import _f16_at, _u32_at

# format -> (BLOCK_N, NB blocks (pairs for Q8_0 / Q4_0) per iteration, num_warps, num_stages) at M = 1
# and (BLOCK_M, BLOCK_N, NB, num_warps, num_stages) for 2 <= M <= 16 (fp32 A; bf16 / fp16 A from
# M = 4 on take gemm.py's tensor-core kernel). Best of the sweeps on an H100 (14336 x 4096 and
# 4096 x 14336, weight bytes / time against 3.02 TB/s copy): Q4_K 1.46 TB/s (48%), Q8_0 1.21 (40%),
# Q4_0 1.0 (33%), Q6_K 1.09 (36%); Q4_K decode M = 4 (2, 8, 8, 4, 1) 71 us. Two rows a thread (8 of
# BLOCK_N over 4 warps) beat four: ~80 registers, 6 programs an SM (offline SASS: 5.6 instructions
# per Q4_K weight at two rows, 5.2 at four).
GEMV_CONFIGS = {"q8_0": (8, 16, 4, 1), "q4_0": (8, 16, 4, 1), "q4_k": (8, 8, 4, 1), "q6_k": (16, 4, 4, 2)}
DECODE_CONFIGS = {"q8_0": (4, 8, 8, 4, 1), "q4_0": (2, 8, 16, 4, 1), "q4_k": (2, 8, 8, 4, 1), "q6_k": (1, 16, 4, 4, 2)}
FMT_IDS = {"q8_0": 0, "q4_0": 1, "q4_k": 2, "q6_k": 3}
LANES = {0: 16, 1: 8, 2: 4}  # L: words of a pair (Q8_0, Q4_0), chunks of a block (Q4_K)
CODE_MASKS = {0: (0xFF, 0xFF00, 0, 0), 1: (0xF, 0xF0, 0xF00, 0xF000), 2: (0xF, 0xF0, 0xF00, 0xF000),
              3: (0x3F, 0x3F00, 0, 0)}
_U32 = tl.constexpr(tl.pointer_type(tl.uint32))
_U16 = tl.constexpr(tl.pointer_type(tl.uint16))


@triton.jit
def _split4(x):
    """x[..., 0], ..., x[..., 3] of a 5-D (..., 4) tensor: the last dim is one thread's vector."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2], x.shape[3], 2, 2)))  # [.., 0, 2], [.., 1, 3]
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _split8(x):
    """x[..., 0], ..., x[..., 7] of a 5-D (..., 8) tensor."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2], x.shape[3], 4, 2)))
    x0, x2, x4, x6 = _split4(a)
    x1, x3, x5, x7 = _split4(b)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _ld(p, mask, MASKED: tl.constexpr):
    """Masked loads are never merged by the compiler; the unmasked ones of a row-broadcast pointer are
    (one load for all BLOCK_N rows a thread holds), so only a tile's tail iteration is masked."""
    if MASKED:
        return tl.load(p, mask=mask, other=0)
    else:
        return tl.load(p)


@triton.jit
def _a8(A_row, k, stride_ak, mask, AV: tl.constexpr, MASKED: tl.constexpr):
    """A[m, k + 0..7] as eight fp32 tensors: one 16-byte load (bf16/fp16, AV = 8) or two (fp32)."""
    j = tl.arange(0, AV)[None, None, None, None, :]
    p = A_row[:, :, :, :, None] + (k[:, :, :, :, None] + j) * stride_ak
    m = mask[:, :, :, :, None]
    if AV == 8:
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(_ld(p, m, MASKED).to(tl.float32))
    else:
        x0, x1, x2, x3 = _split4(_ld(p, m, MASKED).to(tl.float32))
        x4, x5, x6, x7 = _split4(_ld(p + 4 * stride_ak, m, MASKED).to(tl.float32))
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _a2(A_row, k, stride_ak, mask, MASKED: tl.constexpr):
    """A[m, k], A[m, k + 1] as fp32: one 4-byte (bf16/fp16) or 8-byte (fp32) load."""
    j = tl.arange(0, 2)[None, None, None, None, :]
    x = _ld(A_row[:, :, :, :, None] + (k[:, :, :, :, None] + j) * stride_ak, mask[:, :, :, :, None], MASKED)
    return tl.split(x.to(tl.float32))


@triton.jit
def _code(x, mk):
    """q 2^p + 2^23 as fp32 for the code bits mk = mask << p of x (p + bits <= 23): one LOP3 (mk from a
    kernel argument: ptxas keeps it in a register instead of rematerialising the immediate)."""
    return ((x & mk) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _f16(h):
    """The fp16 in the low 16 bits of the int h, as fp32."""
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k_tile(acc, A_row, k, stride_ak, Wb, c, mask, mk0, mk1, mk2, mk3, AV: tl.constexpr, MASKED: tl.constexpr):
    """Chunk c (64 elements) of the 256-blocks at Wb: header (d, dmin, scales) and qs[32c .. 32c + 31]
    as two 16-byte loads; k: A's column of element 0 of the chunk."""
    t = tl.arange(0, 4)[None, None, None, None, :]
    m5 = mask[:, :, :, :, None]
    dd, s0, s1, s2 = _split4(_ld(Wb.to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    q0, q1, q2, q3 = _split4(_ld((Wb + 16 + 32 * c).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    q4, q5, q6, q7 = _split4(_ld((Wb + 32 + 32 * c).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    d = _f16(dd)
    dmin = _f16(dd >> 16)
    # get_scale_min_k4 for sub-blocks j = 2c, 2c + 1: bytes (c % 2) * 2 + {0, 1} of each scale word
    sh = 16 * (c % 2)
    S0 = s0 >> sh
    S1 = s1 >> sh
    S2 = s2 >> sh
    lo = c < 2
    scp = tl.where(lo, S0, (S2 & 0x0F0F) | ((S0 >> 2) & 0x3030))
    mnp = tl.where(lo, S1, ((S2 >> 4) & 0x0F0F) | ((S1 >> 2) & 0x3030))
    ds0 = d * (scp & 63).to(tl.float32)
    ds1 = d * ((scp >> 8) & 63).to(tl.float32)
    dm0 = dmin * (mnp & 63).to(tl.float32)
    dm1 = dmin * ((mnp >> 8) & 63).to(tl.float32)
    # codes stay in place: byte 1's nibbles sit at bits 8 and 12, so their scales carry 2^-8, 2^-12
    ds0b = ds0 * (1.0 / 256.0)
    ds1a = ds1 * (1.0 / 16.0)
    ds1b = ds1 * (1.0 / 4096.0)
    words = (q0, q1, q2, q3, q4, q5, q6, q7)
    for ep in tl.static_range(4):  # elements 8 ep .. 8 ep + 7 (low nibbles) and 32 + 8 ep .. (high)
        a_lo = _a8(A_row, k + 8 * ep, stride_ak, mask, AV, MASKED)
        a_hi = _a8(A_row, k + 32 + 8 * ep, stride_ak, mask, AV, MASKED)
        for h in tl.static_range(2):
            x = words[2 * ep + h]
            xh = x >> 16  # bytes 2, 3: every code below bit 16
            for i in tl.static_range(4):
                y = x if i < 2 else xh
                if i % 2 == 0:
                    wl = (_code(y, mk0) - 8388608.0) * ds0 - dm0
                    wh = (_code(y, mk1) - 8388608.0) * ds1a - dm1
                else:
                    wl = (_code(y, mk2) - 8388608.0) * ds0b - dm0
                    wh = (_code(y, mk3) - 8388608.0) * ds1b - dm1
                acc += wl * a_lo[4 * h + i]
                acc += wh * a_hi[4 * h + i]
    return acc


@triton.jit
def _word(p, mask, mask_hi, U16: tl.constexpr, MASKED: tl.constexpr):
    """The little-endian u32 at the byte address p (4-aligned unless U16: then two 16-bit loads,
    the high one under mask_hi)."""
    if U16:
        lo = _ld(p.to(_U16), mask, MASKED).to(tl.uint32)
        hi = _ld(p.to(_U16) + 1, mask_hi, MASKED).to(tl.uint32)
        return lo | (hi << 16)
    else:
        return _ld(p.to(_U32), mask, MASKED)


@triton.jit
def _q8_0_word(acc, x, d, a0, a1, a2, a3, mk):
    """acc += sum_i a_i (q_i d) for the 4 codes of x (bytes ^ 0x80), each moved to bits 8-15 (mk = 0xFF00):
    (2^23 + (q + 128) 2^8) (d 2^-8) - (2^15 + 128) d = q d exactly in one fma, the constant (2^15 + 2^7) d
    being exact (a code at bit 0 would need (2^23 + 2^7) d: 27 bits)."""
    d8 = d * (1.0 / 256.0)
    nc = d * -32896.0
    acc += tl.fma(_code(x << 8, mk), d8, nc) * a0
    acc += tl.fma(_code(x, mk), d8, nc) * a1
    acc += tl.fma(_code(x >> 8, mk), d8, nc) * a2
    acc += tl.fma(_code(x >> 16, mk), d8, nc) * a3
    return acc


@triton.jit
def _q8_0_tile(acc, A_row, kp, stride_ak, Wp, lam, mask, mask_hi, mk0, mk1, U16: tl.constexpr, MASKED: tl.constexpr):
    """Word lam (bytes 4 lam .. 4 lam + 3) of the block pairs at Wp (2 x 34 bytes: d_A, qs_A[32], d_B,
    qs_B[32]); kp: A's column of the pair's element 0. Every byte of a word belongs to one block;
    words 0 and 8 hold a scale in bytes 0-1 / 2-3, whose activations are set to zero."""
    sel = lam >= 9  # block B
    d = _f16(_ld((Wp + 34 * sel).to(_U16), mask, MASKED).to(tl.uint32))
    x = _word(Wp + 4 * lam, mask, mask_hi, U16, MASKED) ^ 0x80808080  # byte ^ 0x80 = int8 code + 128
    k = kp + 4 * lam - 2 - 2 * sel
    a0, a1 = _a2(A_row, tl.maximum(k, 0), stride_ak, mask, MASKED)
    a2, a3 = _a2(A_row, k + 2, stride_ak, mask, MASKED)
    a0 = tl.where(lam == 0, 0.0, a0)
    a1 = tl.where(lam == 0, 0.0, a1)
    a2 = tl.where(lam == 8, 0.0, a2)
    a3 = tl.where(lam == 8, 0.0, a3)
    return _q8_0_word(acc, x, d, a0, a1, a2, a3, mk1)


@triton.jit
def _q8_0_tail(acc, A_row, kp, stride_ak, Wp, mask, mk0, mk1, U16: tl.constexpr, MASKED: tl.constexpr):
    """Word 16 of each pair: qs_B[28 .. 31], scale d_B."""
    d = _f16(_ld((Wp + 34).to(_U16), mask, MASKED).to(tl.uint32))
    x = _word(Wp + 64, mask, mask, U16, MASKED) ^ 0x80808080
    a0, a1 = _a2(A_row, kp + 60, stride_ak, mask, MASKED)
    a2, a3 = _a2(A_row, kp + 62, stride_ak, mask, MASKED)
    return _q8_0_word(acc, x, d, a0, a1, a2, a3, mk1)


@triton.jit
def _q4_0_words(acc, A_row, k, stride_ak, x, d, lo_ok, hi_ok, mask, mk0, mk1, mk2, mk3, MASKED: tl.constexpr):
    """4 qs bytes x of one Q4_0 block (scale d): low nibbles are A's columns k .. k + 3, high
    nibbles k + 16 .. k + 19; lo_ok / hi_ok: bytes 0-1 / 2-3 are codes (else a scale: activation 0)."""
    a0, a1 = _a2(A_row, tl.maximum(k, 0), stride_ak, mask, MASKED)
    a2, a3 = _a2(A_row, k + 2, stride_ak, mask, MASKED)
    b0, b1 = _a2(A_row, k + 16, stride_ak, mask, MASKED)
    b2, b3 = _a2(A_row, k + 18, stride_ak, mask, MASKED)
    a0 = tl.where(lo_ok, a0, 0.0)
    a1 = tl.where(lo_ok, a1, 0.0)
    b0 = tl.where(lo_ok, b0, 0.0)
    b1 = tl.where(lo_ok, b1, 0.0)
    a2 = tl.where(hi_ok, a2, 0.0)
    a3 = tl.where(hi_ok, a3, 0.0)
    b2 = tl.where(hi_ok, b2, 0.0)
    b3 = tl.where(hi_ok, b3, 0.0)
    # (2^23 + q 2^p) (d 2^-p) - (2^(23 - p) + 8) d = (q - 8) d exactly in one fma for p = 8, 12 (the
    # constant spans 23 - p - 3 + 11 <= 24 bits): every byte is moved to bits 8-15 first
    d8 = d * (1.0 / 256.0)
    d12 = d * (1.0 / 4096.0)
    c8 = d * -32776.0
    c12 = d * -2056.0
    x0 = x << 8
    x2 = x >> 8
    x3 = x >> 16
    acc += tl.fma(_code(x0, mk2), d8, c8) * a0
    acc += tl.fma(_code(x0, mk3), d12, c12) * b0
    acc += tl.fma(_code(x, mk2), d8, c8) * a1
    acc += tl.fma(_code(x, mk3), d12, c12) * b1
    acc += tl.fma(_code(x2, mk2), d8, c8) * a2
    acc += tl.fma(_code(x2, mk3), d12, c12) * b2
    acc += tl.fma(_code(x3, mk2), d8, c8) * a3
    acc += tl.fma(_code(x3, mk3), d12, c12) * b3
    return acc


@triton.jit
def _q4_0_tile(acc, A_row, kp, stride_ak, Wp, lam, mask, mask_hi, mk0, mk1, mk2, mk3, U16: tl.constexpr,
               MASKED: tl.constexpr):
    """Word lam of the Q4_0 block pairs at Wp (2 x 18 bytes: d_A, qs_A[16], d_B, qs_B[16])."""
    sel = lam >= 5  # block B
    d = _f16(_ld((Wp + 18 * sel).to(_U16), mask, MASKED).to(tl.uint32))
    x = _word(Wp + 4 * lam, mask, mask_hi, U16, MASKED)
    k = kp + 4 * lam - 2 + 14 * sel
    return _q4_0_words(acc, A_row, k, stride_ak, x, d, lam != 0, lam != 4, mask, mk0, mk1, mk2, mk3, MASKED)


@triton.jit
def _q4_0_tail(acc, A_row, kp, stride_ak, Wp, mask, mk0, mk1, mk2, mk3, U16: tl.constexpr, MASKED: tl.constexpr):
    """Word 8 of each pair: qs_B[12 .. 15], scale d_B."""
    d = _f16(_ld((Wp + 18).to(_U16), mask, MASKED).to(tl.uint32))
    x = _word(Wp + 32, mask, mask, U16, MASKED)
    return _q4_0_words(acc, A_row, kp + 44, stride_ak, x, d, mask, mask, mask, mk0, mk1, mk2, mk3, MASKED)


@triton.jit
def _pair_tiles(acc, acc_t, A_row, stride_ak, W_row, pr, pt, lam, b_hi, mk0, mk1, mk2, mk3,
                FMT: tl.constexpr, L: tl.constexpr, U16: tl.constexpr, MASKED: tl.constexpr):
    """One iteration over the block pairs pr (lanes lam: words 0 .. L - 1) and pt (word L)."""
    if FMT == 0:
        # lane lam's word is block A's up to 8 (bytes 0-1 of word 8 too), block B's from 9
        acc = _q8_0_tile(acc, A_row, pr * 64, stride_ak, W_row + pr * 68, lam, 2 * pr + (lam >= 9) < b_hi,
                         2 * pr + (lam >= 8) < b_hi, mk0, mk1, U16, MASKED)
        acc_t = _q8_0_tail(acc_t, A_row, pt * 64, stride_ak, W_row + pt * 68, 2 * pt + 1 < b_hi, mk0, mk1, U16,
                           MASKED)
    else:
        acc = _q4_0_tile(acc, A_row, pr * 64, stride_ak, W_row + pr * 36, lam, 2 * pr + (lam >= 5) < b_hi,
                         2 * pr + (lam >= 4) < b_hi, mk0, mk1, mk2, mk3, U16, MASKED)
        acc_t = _q4_0_tail(acc_t, A_row, pt * 64, stride_ak, W_row + pt * 36, 2 * pt + 1 < b_hi, mk0, mk1, mk2, mk3,
                           U16, MASKED)
    return acc, acc_t


@triton.jit
def _gemv_kernel(
    A_ptr, W_ptr, Bias_ptr, C_ptr, M, N, n_blocks, blocks_per_split,
    stride_am, stride_ak, stride_wn, stride_cs, stride_cm, stride_cn, mk0, mk1, mk2, mk3,
    FMT: tl.constexpr, L: tl.constexpr, U16: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, AV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m4 = offs_m[:, None, None, None]
    n4 = offs_n[None, :, None, None]
    zero = tl.zeros([BLOCK_M, BLOCK_N, NB, L], dtype=tl.int32)
    nb4 = tl.arange(0, NB)[None, None, :, None] + zero
    l4 = tl.arange(0, L)[None, None, None, :] + zero
    # rows past M / N read row M - 1 / N - 1 (their results are not stored): no mask in the main loop
    A_row = A_ptr + tl.minimum(m4, M - 1).to(tl.int64) * stride_am
    W_row = W_ptr + tl.minimum(n4, N - 1).to(tl.int64) * stride_wn
    b_lo = pid_s * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    b_full = b_lo + (b_hi - b_lo) // NB * NB
    acc = tl.zeros([BLOCK_M, BLOCK_N, NB, L], dtype=tl.float32)
    if FMT == 2:
        res_t = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for b0 in range(b_lo, b_full, NB):
            blk = b0 + nb4
            acc = _q4_k_tile(acc, A_row, blk * 256 + 64 * l4, stride_ak, W_row + blk * 144, l4, blk < b_hi,
                             mk0, mk1, mk2, mk3, AV, False)
        if b_full < b_hi:  # the tail: blocks b_full .. b_hi - 1 of NB
            blk = b_full + nb4
            acc = _q4_k_tile(acc, A_row, blk * 256 + 64 * l4, stride_ak, W_row + blk * 144, l4, blk < b_hi,
                             mk0, mk1, mk2, mk3, AV, True)
    else:  # Q8_0 / Q4_0: NB block pairs (b_lo even), lanes along the pair's first L words, one tail word
        acc_t = tl.zeros([BLOCK_M, BLOCK_N, NB, 1], dtype=tl.float32)
        nbt = tl.arange(0, NB)[None, None, :, None] + tl.zeros([BLOCK_M, BLOCK_N, NB, 1], dtype=tl.int32)
        p_lo = b_lo // 2
        p_hi = (b_hi + 1) // 2
        p_full = p_lo + (b_hi // 2 - p_lo) // NB * NB  # whole pairs only: an odd last block is masked
        for p0 in range(p_lo, p_full, NB):
            acc, acc_t = _pair_tiles(acc, acc_t, A_row, stride_ak, W_row, p0 + nb4, p0 + nbt, l4, b_hi,
                                     mk0, mk1, mk2, mk3, FMT, L, U16, False)
        if p_full < p_hi:
            acc, acc_t = _pair_tiles(acc, acc_t, A_row, stride_ak, W_row, p_full + nb4, p_full + nbt, l4, b_hi,
                                     mk0, mk1, mk2, mk3, FMT, L, U16, True)
        res_t = tl.sum(tl.sum(acc_t, axis=3), axis=2)
    res = tl.sum(tl.sum(acc, axis=3), axis=2) + res_t  # (BM, BN)
    if HAS_BIAS:
        res += tl.load(Bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = (C_ptr + pid_s.to(tl.int64) * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm
              + offs_n[None, :] * stride_cn)
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _q6_k_kernel(
    A_ptr, W_ptr, Bias_ptr, C_ptr, N, n_groups, groups_per_split,
    stride_am, stride_ak, stride_wn, stride_cs, stride_cm, stride_cn, mk0, mk1,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
):
    """Q6_K, one row of A per program: (BLOCK_N, G, 8, 2) byte tiles of G groups (h2, s) of 16 bytes,
    read as 16-bit words; the fp32 accumulator holds one value per weight byte."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    A_row = A_ptr + pid_m.to(tl.int64) * stride_am
    Wrow = W_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
    offs_g = tl.arange(0, G)[None, :, None]
    e = tl.arange(0, 8)[None, None, :]
    ii = tl.arange(0, 2)[None, None, None, :]
    offs_a = tl.arange(0, G * 64)
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros([BLOCK_N, G, 8, 2], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, G):
        g = g0 + offs_g
        mask = mask_n[:, None, None] & (g < g_hi)
        k = g0 * 64 + offs_a  # the tile's contiguous K range
        a = tl.load(A_row + k * stride_ak, mask=k < g_hi * 64, other=0.0).to(tl.float32)
        blk = g // 4
        h2 = (g // 2) % 2
        s = g % 2
        base = Wrow + blk * 210
        d = _f16_at(base + 208, mask)
        m4 = mask[:, :, :, None]
        qa = tl.load((base + 64 * h2 + 16 * s).to(_U16)[:, :, :, None] + e[:, :, :, None], mask=m4, other=0)
        qb = tl.load((base + 64 * h2 + 32 + 16 * s).to(_U16)[:, :, :, None] + e[:, :, :, None], mask=m4, other=0)
        qh = tl.load((base + 128 + 32 * h2 + 16 * s).to(_U16)[:, :, :, None] + e[:, :, :, None], mask=m4, other=0)
        qa = qa.to(tl.int32)
        qb = qb.to(tl.int32)
        qh = qh.to(tl.int32)
        # a: (G/2 of (blk, h2), t, s, e, i) -> (g, e, i, t), then parts t = 2 t1 + t0
        a5 = tl.permute(tl.reshape(a, [G // 2, 4, 2, 8, 2]), (0, 2, 3, 4, 1))
        a_e, a_o = tl.split(tl.reshape(a5, [G, 8, 2, 2, 2]))  # t0 = 0, 1
        a_t0, a_t2 = tl.split(a_e)
        a_t1, a_t3 = tl.split(a_o)
        p = 8 * ii
        for t in tl.static_range(4):
            if t == 0:
                x = (qa & 0x0F0F) | ((qh << 4) & 0x3030)
                at = a_t0
            elif t == 1:
                x = (qb & 0x0F0F) | ((qh << 2) & 0x3030)
                at = a_t1
            elif t == 2:
                x = ((qa >> 4) & 0x0F0F) | (qh & 0x3030)
                at = a_t2
            else:
                x = ((qb >> 4) & 0x0F0F) | ((qh >> 2) & 0x3030)
                at = a_t3
            sc = tl.load(base + 192 + 8 * h2 + 2 * t + s, mask=mask, other=0).to(tl.int8, bitcast=True)
            ds = (d * sc.to(tl.float32))[:, :, :, None] * tl.where(ii == 0, 1.0, 1.0 / 256.0)  # exact
            f = ((x & tl.where(ii == 0, mk0, mk1)) | 0x4B000000).to(tl.float32, bitcast=True)
            # (q - 32) d sc: (2^23 + q 2^p - 2^23 - 32 2^p) is exact, so is the product (6 + 8 + 11 bits)
            w = (f - (8388608.0 + 32.0 * tl.where(ii == 0, 1.0, 256.0))) * ds
            acc += w * at[None, :, :, :]
    res = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    if HAS_BIAS:
        res += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    c_ptrs = C_ptr + pid_s.to(tl.int64) * stride_cs + pid_m.to(tl.int64) * stride_cm + offs_n * stride_cn
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=mask_n)


def launch(a: torch.Tensor, w: torch.Tensor, bias, dst: torch.Tensor, fmt: str, n_blocks: int, blocks_per_split: int,
           splits: int, strides: tuple[int, int, int], config: tuple[int, ...]) -> None:
    """Grid (N tiles, M tiles, splits); the checks and split-K set-up are gemm.gemm_nt's (blocks_per_split
    even for Q8_0 / Q4_0). config: GEMV_CONFIGS / DECODE_CONFIGS layout (BLOCK_M first when len 5)."""
    M, N = a.shape[0], w.shape[0]
    block_m, block_n, nb, num_warps, num_stages = config if len(config) == 5 else (1, *config)
    fid = FMT_IDS[fmt]
    has_bias = bias is not None and splits == 1
    bias_arg = bias if bias is not None else w
    if fid == 3:
        if nb % 2:
            raise ValueError(f"gemm_nt[q6_k] GEMV: G={nb} must be even (a tile covers whole 128-element halves)")
        _q6_k_kernel[(triton.cdiv(N, block_n), M, splits)](
            a, w, bias_arg, dst, N, n_blocks * 4, blocks_per_split * 4, a.stride(0), a.stride(1), w.stride(0),
            *strides, *CODE_MASKS[3][:2], HAS_BIAS=has_bias, BLOCK_N=block_n, G=nb,
            num_warps=num_warps, num_stages=num_stages)
        return
    # 32-bit words of the pair formats need 4-aligned rows and whole pairs (else 16-bit halves)
    u16 = fid < 2 and (w.data_ptr() % 4 != 0 or w.stride(0) % 4 != 0 or n_blocks % 2 != 0)
    _gemv_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m), splits)](
        a, w, bias_arg, dst, M, N, n_blocks, blocks_per_split, a.stride(0), a.stride(1), w.stride(0), *strides,
        *CODE_MASKS[fid], FMT=fid, L=LANES[fid], U16=u16, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n,
        NB=nb, AV=16 // a.element_size(), num_warps=num_warps, num_stages=num_stages)
