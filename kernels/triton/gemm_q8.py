"""GEMV and small-M GEMM over Q4_K and Q8_0 weights with quantized activations, ggml's production arithmetic.

C = A @ W^T the way llama.cpp's CUDA backend computes a quantized mat-vec (mul_mat_vec_q): the
activations are quantized first, to the weight format's ggml vec_dot type (Q4_K: Q8_K, per row, blocks
of 256: d = max / -127 of the element of largest magnitude, codes rounded half to even, sums of each 32
codes; Q8_0: Q8_0, blocks of 32: d = amax / 127 stored as fp16, codes roundf(x / d)), then every weight
meets its activation as an 8-bit integer product, four at a time (`dp4a`), and the scales are applied
once per 32 weights. The result is gemm.gemm_nt's `emulated` reference (L2), not `dequant`: its distance
to `dequant` is the activation quantization, which llama.cpp's users get on a GPU too.

Why (benchmarks/NOTES-gemm.md): the exact kernel of gemm_gemv.py dequantizes every weight to fp32,
~5-6.4 instructions a Q4_K weight against the ~7 an H100 can issue while it streams one, which held
it at 48% of copy. Here a 32-bit word of Q4_K codes is two LOP3s (low and high nibbles, four codes
each) and two dp4a: ~1.5 instructions a weight with the activation loads and scales (offline SASS).

Q4_K: the layout of gemm_gemv.py's Q4_K path: tensors of (BLOCK_M, BLOCK_N, NB, 4) with lane c of 4
holding chunk c of a 256-block (64 weights: the 16-byte header and two 16-byte loads of codes), rows of A
and W broadcast by index, an unmasked main loop and a masked tail. The activation codes of a chunk are
four 16-byte loads shared by the BLOCK_N rows a thread holds.
Q8_0: blocks of 34 bytes are 2-byte aligned; a pair (68 bytes) is 4-aligned, so an element of the
(BLOCK_M, BLOCK_N, NB) tile is a block pair read as 17 words: block B's codes are words 9-16, block A's
codes straddle words 0-8 (after its fp16 d) and are funnel shifts of neighbours; rows that are not
4-aligned, or an odd block count, read each word as two 16-bit halves (gemm_gemv's `_word`).

From gemm_mmq.MMQ_MIN_M rows of A on, gemm_nt_q8 hands the same quantized activations to gemm_mmq.py's
int8 tensor-core kernel (one dot a 32-weight sub-block for all rows of a tile; here dp4a repeats every
product for each row of A); `kernel_for(M)` says which runs, `kernel=` forces one (benchmarks).

The integer instruction and the exact fp32 division / rounding of the quantizers are inline PTX on a
GPU; under TRITON_INTERPRET=1 (no PTX) the same integers and IEEE results come from plain Triton
arithmetic (`ASM=False`), so the CPU tests check every index and every rounding of the algorithm.

References: ggml-quants.c (quantize_row_q8_K_ref, quantize_row_q8_0_ref, ggml_vec_dot_q4_K_q8_K_generic,
ggml_vec_dot_q8_0_q8_0_generic), llama.cpp's CUDA vecdotq.cuh (the dp4a formulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import _check_common, check_weights
from .gemm_gemv import _ld, _split4, _word
from .gemm_mmq import MMQ_MIN_M, launch_mmq
from .gemm_mmq import default_config as mmq_default_config

# (BLOCK_M, BLOCK_N, NB, num_warps, num_stages); q8_0: NB block pairs. Measured on an H100 (benchmarks/
# gpu_gemm.py --q8-grid, 40 configs a format; NOTES-gemm.md "Version 2, on the device"): one-warp programs of
# few rows win at M = 1 (more programs in flight); Q4_K wants 4 rows x 2 blocks when there are many rows
# (14336 x 4096: 61.8% of the read rate, GEMV alone) but 2 x 4 when there are few (4096 x 14336: 56.3%,
# against 43.6% for 4 x 2); Q8_0 (1, 4, 32, 2) on both (61%). M > 1: BLOCK_M 2, then 4 (the fastest of
# the M = 4 / 16 sweep; the integer-dot GEMV re-reads its weights per BLOCK_M rows of A).
CONFIGS = {"q4_k": (1, 4, 2, 1, 1), "q8_0": (1, 4, 32, 2, 1)}
SMALL_M_CONFIGS = {"q4_k": ((2, 8, 8, 4, 1), (4, 8, 4, 4, 1)), "q8_0": ((2, 8, 16, 4, 1), (4, 8, 8, 4, 1))}


def default_config(fmt: str, M: int, N: int) -> tuple[int, ...]:
    """The launcher's (BLOCK_M, BLOCK_N, NB, num_warps, num_stages) for M rows of A and N of W (above)."""
    if M >= 8:
        return SMALL_M_CONFIGS[fmt][1]
    if M >= 2:
        return SMALL_M_CONFIGS[fmt][0]
    if fmt == "q4_k" and N < 8192:
        return (1, 2, 4, 1, 1)
    return CONFIGS[fmt]
_U32 = tl.constexpr(tl.pointer_type(tl.uint32))


@triton.jit
def _dp4a(w, a, c, ASM: tl.constexpr, SIGNED_W: tl.constexpr = False):
    """c + sum_i w.byte[i] * a.sbyte[i]: the four bytes of w (unsigned, or signed if SIGNED_W) times
    the four signed bytes of a."""
    if ASM:
        if SIGNED_W:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        wi = w.to(tl.int32, bitcast=True)
        ai = a.to(tl.int32, bitcast=True)
        s = c
        for i in tl.static_range(4):
            if SIGNED_W:
                wb = (wi << (24 - 8 * i)) >> 24
            else:
                wb = (wi >> (8 * i)) & 0xFF
            s += wb * ((ai << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def _div_rn(x, y, ASM: tl.constexpr):
    """x / y rounded to nearest even (IEEE), also where the compiler's `/` is an approximation."""
    if ASM:
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x / y


@triton.jit
def _mul_rn(x, y, ASM: tl.constexpr):
    """x * y rounded once: mul.rn is never contracted into an fma with a later add or subtract (PTX), so
    a following `y - trunc(y)` sees the rounded product, as C's separate statements do."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x * y


@triton.jit
def _rint(x, ASM: tl.constexpr):
    """The integer nearest x, ties to even (ggml's nearest_int for |x| < 2^22), as int32."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,f", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:  # numpy float32 under the interpreter: no contraction, the magic sum rounds to even
        return ((x + 12582912.0) - 12582912.0).to(tl.int32)


@triton.jit
def _quantize_q8_k_kernel(A_ptr, Q_ptr, D_ptr, S_ptr, n_blocks, stride_am, stride_ak, ASM: tl.constexpr):
    """Row m, block b of A as Q8_K: codes to Q[m, 256 b ..], d to D[m, b], the sums of each 32 codes to
    S[m, 8 b ..] (quantize_row_q8_K_ref: the first element of largest magnitude sets the sign of d)."""
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    j = tl.arange(0, 256)
    x = tl.load(A_ptr + m * stride_am + (b * 256 + j) * stride_ak).to(tl.float32)
    ax = tl.abs(x)
    ax = tl.where(ax == ax, ax, -1.0)  # `fabsf(NaN) > amax` is false: a NaN never sets the scale
    amax = tl.max(ax, axis=0)
    first = tl.min(tl.where(ax == amax, j, 256), axis=0)
    mx = tl.sum(tl.where(j == first, x, 0.0), axis=0)
    nz = amax > 0
    iscale = _div_rn(tl.full([256], -127.0, tl.float32), tl.where(nz, mx, 1.0) + tl.zeros([256], tl.float32), ASM)
    q = tl.minimum(_rint(iscale * x, ASM), 127)
    q = tl.where(nz, q, 0)
    d = _div_rn(tl.full([256], 1.0, tl.float32), iscale, ASM)
    tl.store(Q_ptr + m * n_blocks * 256 + b * 256 + j, q.to(tl.int8))
    tl.store(D_ptr + m * n_blocks + b + j, tl.where(nz, d, 0.0), mask=j == 0)
    s = tl.sum(tl.reshape(q, (8, 32)), axis=1)
    tl.store(S_ptr + m * n_blocks * 8 + b * 8 + tl.arange(0, 8), s)


def quantize_q8_k(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a (M, K) float, K a multiple of 256 -> (codes int8 (M, K), d float32 (M, K / 256), sums of each 32
    codes int32 (M, K / 32)): Q8_K's fields, the codes and d bit for bit ggml's reference quantizer."""
    M, K = a.shape
    if K % 256:
        raise ValueError(f"quantize_q8_k: K={K} must be a multiple of 256")
    nb = K // 256
    q = torch.empty((M, K), dtype=torch.int8, device=a.device)
    d = torch.empty((M, nb), dtype=torch.float32, device=a.device)
    s = torch.empty((M, nb * 8), dtype=torch.int32, device=a.device)
    if M and nb:
        _quantize_q8_k_kernel[(M, nb)](a, q, d, s, nb, a.stride(0), a.stride(1), ASM=a.is_cuda, num_warps=2)
    return q, d, s


@triton.jit
def _quantize_q8_0_kernel(A_ptr, Q_ptr, D_ptr, n_blocks, K, stride_am, stride_ak, ASM: tl.constexpr):
    """Row m, blocks 8 g .. 8 g + 7 of A as Q8_0 (quantize_row_q8_0_ref): d = amax / 127, codes
    roundf(x / d) (x times 1 / d, half away from zero); codes to Q[m, 32 b ..], fp16(d) as fp32 to D[m, b]."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    b = g * 8 + tl.arange(0, 8)[:, None]
    e = tl.arange(0, 32)[None, :]
    ok = b < n_blocks
    x = tl.load(A_ptr + m * stride_am + (b * 32 + e) * stride_ak, mask=ok, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.max(tl.where(ax == ax, ax, 0.0), axis=1)[:, None]  # fmaxf skips a NaN
    d = _div_rn(amax, tl.full([8, 1], 127.0, tl.float32), ASM)
    idv = tl.where(d != 0, _div_rn(tl.full([8, 1], 1.0, tl.float32), tl.where(d != 0, d, 1.0), ASM), 0.0)
    y = _mul_rn(x, idv + tl.zeros([8, 32], tl.float32), ASM)  # not fused with the subtraction below
    t = y.to(tl.int32)  # toward zero; y - t is exact
    r = y - t.to(tl.float32)
    q = t + (r >= 0.5).to(tl.int32) - (r <= -0.5).to(tl.int32)
    tl.store(Q_ptr + m * K + b * 32 + e, q.to(tl.int8), mask=ok)
    tl.store(D_ptr + m * n_blocks + b + e, d.to(tl.float16).to(tl.float32) + tl.zeros([8, 32], tl.float32),
             mask=ok & (e == 0))


def quantize_q8_0(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, K) float, K a multiple of 32 -> (codes int8 (M, K), fp16(d) as float32 (M, K / 32)): ggml's
    reference Q8_0 quantizer, its codes and stored d bit for bit."""
    M, K = a.shape
    if K % 32:
        raise ValueError(f"quantize_q8_0: K={K} must be a multiple of 32")
    nb = K // 32
    q = torch.empty((M, K), dtype=torch.int8, device=a.device)
    d = torch.empty((M, nb), dtype=torch.float32, device=a.device)
    if M and nb:
        _quantize_q8_0_kernel[(M, triton.cdiv(nb, 8))](a, q, d, nb, K, a.stride(0), a.stride(1), ASM=a.is_cuda,
                                                       num_warps=2)
    return q, d


@triton.jit
def _q8_0_q8_pair(acc, Q_row, D_row, Wp, p, ok_a, ok_b, U16: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):
    """Block pair p (blocks 2p, 2p + 1: d_A, qs_A[32], d_B, qs_B[32], 68 bytes) against its Q8_0 activations.
    Word 0 holds d_A and codes 0-1 of A, word 8 codes 30-31 of A and d_B, words 9-16 the codes of B; A's
    code words are funnel shifts of neighbouring words."""
    w0 = _word(Wp, ok_a, ok_a, U16, MASKED)
    w8 = _word(Wp + 32, ok_a, ok_b, U16, MASKED)  # d_B past the row when B is absent: masked
    k = p * 64
    s_a = tl.zeros(w0.shape, dtype=tl.int32)
    s_b = tl.zeros(w0.shape, dtype=tl.int32)
    prev = w0
    for i in tl.static_range(8):
        if i < 7:
            nxt = _word(Wp + 4 * (i + 1), ok_a, ok_a, U16, MASKED)
        else:
            nxt = w8
        a_a = _ld((Q_row + k + 4 * i).to(_U32), ok_a, MASKED)
        s_a = _dp4a((prev >> 16) | (nxt << 16), a_a, s_a, ASM, True)
        prev = nxt
        w_b = _word(Wp + 36 + 4 * i, ok_b, ok_b, U16, MASKED)
        a_b = _ld((Q_row + k + 32 + 4 * i).to(_U32), ok_b, MASKED)
        s_b = _dp4a(w_b, a_b, s_b, ASM, True)
    d_a = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    d_b = tl.where(ok_b, (w8 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32), 0.0)
    da_a = _ld(D_row + 2 * p, ok_a, MASKED)
    da_b = _ld(D_row + 2 * p + 1, ok_b, MASKED)
    return acc + s_a.to(tl.float32) * (d_a * da_a) + s_b.to(tl.float32) * (d_b * da_b)


@triton.jit
def _gemv_q8_0_q8_kernel(
    Q_ptr, D_ptr, W_ptr, Bias_ptr, C_ptr, M, N, n_blocks, stride_wn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, U16: tl.constexpr,
    ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m3 = tl.minimum(offs_m, M - 1).to(tl.int64)[:, None, None]  # rows past M / N: results dropped
    n3 = tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None]
    pz = tl.arange(0, NB)[None, None, :] + tl.zeros([BLOCK_M, BLOCK_N, NB], dtype=tl.int32)
    Q_row = Q_ptr + m3 * n_blocks * 32
    D_row = D_ptr + m3 * n_blocks
    W_row = W_ptr + n3 * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, NB], dtype=tl.float32)
    n_pairs = (n_blocks + 1) // 2
    p_full = n_blocks // 2 // NB * NB  # whole pairs of the unmasked loop
    for p0 in range(0, p_full, NB):
        p = p0 + pz
        acc = _q8_0_q8_pair(acc, Q_row, D_row, W_row + 68 * p, p, p < n_pairs, 2 * p + 1 < n_blocks, U16, ASM, False)
    if p_full < n_pairs:
        p = p_full + pz
        acc = _q8_0_q8_pair(acc, Q_row, D_row, W_row + 68 * p, p, p < n_pairs, 2 * p + 1 < n_blocks, U16, ASM, True)
    res = tl.sum(acc, axis=2)
    if HAS_BIAS:
        res += tl.load(Bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _q4_k_q8_tile(acc, Q_row, S_row, D_row, Wb, blk, c, mask, ASM: tl.constexpr, MASKED: tl.constexpr):
    """Chunk c (64 weights) of the 256-blocks blk at Wb against their Q8_K activations: the integer
    sums of sub-blocks 2c (low nibbles) and 2c + 1 (high), times their 6-bit scales, times d d_a,
    minus dmin d_a times the 6-bit mins times the activation sums."""
    t = tl.arange(0, 4)[None, None, None, None, :]
    m5 = mask[:, :, :, :, None]
    dd, s0, s1, s2 = _split4(_ld(Wb.to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    q0, q1, q2, q3 = _split4(_ld((Wb + 16 + 32 * c).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    q4, q5, q6, q7 = _split4(_ld((Wb + 32 + 32 * c).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    k = blk * 256 + 64 * c  # the chunk's first element
    a_lo = _split4(_ld((Q_row + k).to(_U32)[:, :, :, :, None] + t, m5, MASKED)) + \
        _split4(_ld((Q_row + k + 16).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    a_hi = _split4(_ld((Q_row + k + 32).to(_U32)[:, :, :, :, None] + t, m5, MASKED)) + \
        _split4(_ld((Q_row + k + 48).to(_U32)[:, :, :, :, None] + t, m5, MASKED))
    words = (q0, q1, q2, q3, q4, q5, q6, q7)
    s_lo = tl.zeros(q0.shape, dtype=tl.int32)
    s_hi = tl.zeros(q0.shape, dtype=tl.int32)
    for i in tl.static_range(8):  # byte l of the chunk: element l (low nibble) and 32 + l (high)
        s_lo = _dp4a(words[i] & 0x0F0F0F0F, a_lo[i], s_lo, ASM)
        s_hi = _dp4a((words[i] >> 4) & 0x0F0F0F0F, a_hi[i], s_hi, ASM)
    # get_scale_min_k4 for sub-blocks 2c, 2c + 1: bytes (c % 2) * 2 + {0, 1} of each scale word
    sh = 16 * (c % 2)
    S0 = s0 >> sh
    S1 = s1 >> sh
    S2 = s2 >> sh
    lo = c < 2
    scp = tl.where(lo, S0, (S2 & 0x0F0F) | ((S0 >> 2) & 0x3030)).to(tl.int32)
    mnp = tl.where(lo, S1, ((S2 >> 4) & 0x0F0F) | ((S1 >> 2) & 0x3030)).to(tl.int32)
    isum = (scp & 63) * s_lo + ((scp >> 8) & 63) * s_hi
    bs0 = _ld(S_row + blk * 8 + 2 * c, mask, MASKED)
    bs1 = _ld(S_row + blk * 8 + 2 * c + 1, mask, MASKED)
    msum = (mnp & 63) * bs0 + ((mnp >> 8) & 63) * bs1
    da = _ld(D_row + blk, mask, MASKED)
    d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return acc + (d * da) * isum.to(tl.float32) - (dmin * da) * msum.to(tl.float32)


@triton.jit
def _gemv_q4_k_q8_kernel(
    Q_ptr, D_ptr, S_ptr, W_ptr, Bias_ptr, C_ptr, M, N, n_blocks, stride_wn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m4 = tl.minimum(offs_m, M - 1).to(tl.int64)[:, None, None, None]  # rows past M / N: results dropped
    n4 = tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None, None]
    zero = tl.zeros([BLOCK_M, BLOCK_N, NB, 4], dtype=tl.int32)
    nb4 = tl.arange(0, NB)[None, None, :, None] + zero
    c4 = tl.arange(0, 4)[None, None, None, :] + zero
    Q_row = Q_ptr + m4 * n_blocks * 256
    S_row = S_ptr + m4 * n_blocks * 8
    D_row = D_ptr + m4 * n_blocks
    W_row = W_ptr + n4 * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, NB, 4], dtype=tl.float32)
    b_full = n_blocks // NB * NB
    for b0 in range(0, b_full, NB):
        blk = b0 + nb4
        acc = _q4_k_q8_tile(acc, Q_row, S_row, D_row, W_row + blk * 144, blk, c4, blk < n_blocks, ASM, False)
    if b_full < n_blocks:
        blk = b_full + nb4
        acc = _q4_k_q8_tile(acc, Q_row, S_row, D_row, W_row + blk * 144, blk, c4, blk < n_blocks, ASM, True)
    res = tl.sum(tl.sum(acc, axis=3), axis=2)
    if HAS_BIAS:
        res += tl.load(Bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


FORMATS = {"q4_k": (256, 144, 4), "q8_0": (32, 34, 2)}  # block elements, block bytes, row alignment


KERNELS = ("auto", "gemv", "mmq")


def kernel_for(M: int) -> str:
    """The integer kernel gemm_nt_q8 runs for M rows of A: the dp4a GEMV at M = 1, the int8 tensor-core
    GEMM of gemm_mmq.py from gemm_mmq.MMQ_MIN_M rows on (one dot serves all BLOCK_M rows of A, where the
    GEMV repeats every product per row)."""
    return "mmq" if M >= MMQ_MIN_M else "gemv"


def gemm_nt_q8(a: torch.Tensor, wfmt: str, w: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, *, config: tuple[int, ...] | None = None,
               kernel: str = "auto") -> torch.Tensor:
    """C = a @ W^T (+ bias) in ggml's quantized-activation arithmetic (module docstring): a quantized to
    Q8_K (Q4_K weights) or Q8_0 (Q8_0 weights), integer products, fp32 scales and sums. The `emulated`
    reference of gemm.gemm_nt.

    a: (M, K) fp32/bf16/fp16, K a multiple of the block (256 / 32); wfmt: "q4_k" | "q8_0"; w: (N, K / QK *
    bytes) uint8, rows 4-byte (q4_k) / 2-byte (q8_0) aligned; bias: (N,) added in fp32; out: (M, N) a's
    dtype. kernel: "auto" (kernel_for(M)), "gemv" (dp4a) or "mmq" (int8 tensor cores), tuning and
    benchmarks only; config: that kernel's tile (launch_gemv's (BLOCK_M, BLOCK_N, NB, num_warps, num_stages)
    or gemm_mmq.launch_mmq's (BLOCK_N, BLOCK_M, NB, num_warps, num_stages)), tuning only. Returns out.
    """
    if kernel not in KERNELS:
        raise ValueError(f"gemm_nt_q8: kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    fmt = str(wfmt).lower()
    if fmt not in FORMATS:
        raise ValueError(f"gemm_nt_q8: weight format {wfmt!r} is not supported; expected one of {sorted(FORMATS)}")
    qk, nbytes, align = FORMATS[fmt]
    N, K, nb = check_weights(f"gemm_nt_q8[{fmt}]", a, w, qk, nbytes, align)
    M, out = _check_common(a, N, K, bias, out, f"gemm_nt_q8[{fmt}]")
    if M == 0 or N == 0:
        return out
    if nb == 0:
        return out.copy_(bias.to(out.dtype).expand(M, N) if bias is not None else torch.zeros_like(out))
    quantized = quantize_q8_k(a) if fmt == "q4_k" else quantize_q8_0(a)
    if (kernel_for(M) if kernel == "auto" else kernel) == "mmq":
        launch_mmq(fmt, quantized, w, bias, out, config or mmq_default_config(fmt, M, N))
    else:
        launch_gemv(fmt, quantized, w, bias, out, config or default_config(fmt, M, N))
    return out


def launch_gemv(fmt: str, quantized: tuple, w: torch.Tensor, bias, out: torch.Tensor, config: tuple[int, ...]) -> None:
    """The integer-dot GEMV alone, on activations already quantized (quantize_q8_k / quantize_q8_0's
    tuple); gemm_nt_q8 has checked the arguments. Separate so that a benchmark can time it alone."""
    block_m, block_n, NB, num_warps, num_stages = config
    M, N = out.shape
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    bias_arg = bias if bias is not None else w
    asm = w.is_cuda
    if fmt == "q4_k":
        q, d, s = quantized
        nb = q.shape[1] // 256
        _gemv_q4_k_q8_kernel[grid](
            q, d, s, w, bias_arg, out, M, N, nb, w.stride(0), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, NB=NB, ASM=asm,
            num_warps=num_warps, num_stages=num_stages)
    else:  # 32-bit words need 4-aligned rows and whole pairs, else 16-bit halves (U16)
        q, d = quantized
        nb = q.shape[1] // 32
        u16 = w.data_ptr() % 4 != 0 or w.stride(0) % 4 != 0 or nb % 2 != 0
        _gemv_q8_0_q8_kernel[grid](
            q, d, w, bias_arg, out, M, N, nb, w.stride(0), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, NB=NB, U16=u16, ASM=asm,
            num_warps=num_warps, num_stages=num_stages)
