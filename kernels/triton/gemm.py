"""Fused dequantize-GEMM over GGML weight bytes, in Triton: C = A @ dequant(W)^T (+ bias).

    C[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]),   W[n, k] = dequant(fmt, w[n])[k]

w is the raw ggml tensor: a uint8 (N, K / QK * nbytes) array of little-endian blocks, one row of
K elements per output channel (ggml's `ne[0]`), never converted. The dequantization formulas are
research/quant-formats.md §1.3 (golden: refimpl.quant.dequantize); an fp16 scale is its two
little-endian bytes loaded as one 16-bit word and bitcast. Every dequantized value is one float32
rounding of the exact value,
as in ggml's `dequantize_row_*` (Q8_0, Q4_0, Q6_K products are exact in fp32; Q4_K's
d*sc*q - dmin*m rounds once).

Three paths, chosen by M and A's dtype:
- exact (M = 1; fp32 A up to M = 16; bf16 / fp16 A below DECODE_DOT_MIN_M): memory-bound. The
  streaming kernel of kernels/triton/gemm_gemv.py reads each weight byte once per program,
  dequantizes it to fp32 in registers and multiplies with fp32 FMAs, for up to BLOCK_M rows of A:
  `A @ dequant(W)^T` in fp32 arithmetic (no activation quantization, unlike ggml's q8_0/q8_K dot
  products; no tf32). Split-K over the weight blocks when its programs cannot fill the GPU; partial
  sums go to an fp32 workspace that a second kernel adds in a fixed order (deterministic).
- tensor cores (M > 16; bf16 / fp16 A from DECODE_DOT_MIN_M rows): a W tile is dequantized once per
  (BLOCK_M x BLOCK_N) output tile, rounded to A's dtype and fed to tl.dot with fp32 accumulation
  (BLOCK_M = 16 for decode: one tile of rows); fp32 A beyond 16 rows uses an "ieee" fp32 dot on the
  exact fp32 dequantization. Measured on an H100 (benchmarks/NOTES-gemm.md): for bf16 A at M = 4,
  Q4_K 14336 x 4096 takes 56 us here against 84 us in the exact kernel (M = 16: 56 us against 249).
- dequantize, then a dense GEMM (bf16 / fp16 A from DEQUANT_MIN_M rows): `dequantize_into` writes W
  once as an (N, K) buffer of A's dtype (the same values the tensor-core kernel feeds its dots), and
  kernels/triton/gemm_dense.py multiplies (fp32 accumulation). The fused kernel decodes every W tile
  again for each BLOCK_M rows of A, in the warps that run the MMA; at M = 4096 on an H200 that held it
  at 0.36-0.38x torch's bf16 matmul (NOTES-gemm.md "Version 4"). Costs a transient N x K copy of W in
  A's dtype.

The tensor-core kernel's tiles are (BLOCK_N, G, E): G "groups" of E elements sharing one scale, so that
scales are loaded once per group and broadcast, and the byte loads are runs of E contiguous bytes:
  Q8_0 group = block (32 el, 34 B): 1 part, E = 32 int8 codes
  Q4_0 group = block (32 el, 18 B): 2 parts (low nibbles: elements j, high: j + 16), E = 16
  Q4_K group = 64-element chunk c of a 256-block (144 B): 2 parts (sub-blocks 2c, 2c+1), E = 32
  Q6_K group = (half h, sixteen s) of a 256-block (210 B): 4 parts (t = 0..3), E = 16
Each part is a (BLOCK_N, G * E) tile with its own K offsets; A is gathered at those offsets.
Small codes become fp32 with the 2^23 trick (OR into the mantissa of 2^23, then subtract): a
logic op and an fp32 add instead of an int->float conversion, which issues on a slower pipe.

References: ggml-org/llama.cpp ggml/src/ggml-common.h (block structs), ggml-quants.c
(dequantize_row_*); llama.cpp's CUDA mul_mat_vec_q for the streaming GEMV structure.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import gemm_dense, gemm_gemv
from .loads import _f16_at, _u32_at
from .tiles import grouped_tile

# name -> (id, elements per block, bytes per block, groups per block, elements per group-part E)
FORMATS: dict[str, tuple[int, int, int, int, int]] = {
    "q8_0": (0, 32, 34, 1, 32),
    "q4_0": (1, 32, 18, 1, 16),
    "q4_k": (2, 256, 144, 4, 32),
    "q6_k": (3, 256, 210, 4, 16),
}
DECODE_MAX_M = 16
DECODE_DOT_MIN_M = 4  # bf16 / fp16 A with DECODE_DOT_MIN_M <= M <= 16: the tensor-core kernel (W rounded to A's dtype)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tensor-core configs (BLOCK_M, BLOCK_N, G, num_warps, num_stages, GROUP_M): G groups of 32 / 64
# elements per iteration. Decode (4 <= M <= 16, bf16 / fp16 A), measured on an H100 at M = 4 and 16,
# 14336 x 4096: Q4_K 56 us, Q8_0 85 us, Q4_0 69 us, Q6_K 102 us (the exact-fp32 GEMV kernel with
# BLOCK_M rows: 71 / 250 us for Q4_K). Prefill: Q4_K (256, 128, 1, 8, 3, 4) 297-307 TFLOP/s at M = 4096
# (0.38-0.41x torch's bf16 matmul); the dequantization of a W tile, once per 256 rows, is the cost.
DECODE_DOT_CONFIGS = {"q8_0": (16, 64, 4, 4, 3, 1), "q4_0": (16, 64, 4, 4, 3, 1), "q4_k": (16, 64, 2, 4, 3, 1),
                      "q6_k": (16, 64, 2, 4, 3, 1)}
PREFILL_CONFIGS = {"q8_0": (256, 128, 2, 8, 3, 4), "q4_0": (256, 128, 2, 8, 3, 4), "q4_k": (256, 128, 1, 8, 4, 4),
                   "q6_k": (256, 128, 2, 8, 2, 4)}
DEQUANT_MIN_M = gemm_dense.DEQUANT_MIN_M  # bf16 / fp16 A from this many rows: the dequant path (gemm_dense.py)
PATHS = ("auto", "fused", "dequant")
# The dequantizer's tile: rows and scale groups a program (8 x 32 = 256 elements of a 32-block format, 2 K-quant
# blocks)
DEQUANT_ROWS = 4
DEQUANT_GROUPS = 8
# Split-K for the GEMV kernel: only when its programs leave the GPU short of about
# SPLIT_PROGRAMS_PER_SM programs per SM (measured: at 7 per SM the second launch costs more than the
# split gains), each split keeping >= MIN_SPLIT_BLOCKS weight blocks.
SPLIT_PROGRAMS_PER_SM = 2
MIN_SPLIT_BLOCKS = 8
MAX_SPLITS = 16


@triton.jit
def _code_f32(q, offset: tl.constexpr):
    """q - offset as fp32, for int32 codes 0 <= q < 2^23: bitcast(0x4B000000 | q) is 2^23 + q exactly."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _dq_q8_0(Wrow, g, e, mask):
    """Q8_0: d f16 at 0, qs int8 at 2; W = d * qs. g: (1, G, 1) block, e: (1, 1, 32)."""
    base = Wrow + g * 34
    d = _f16_at(base, mask)
    b = tl.load(base + 2 + e, mask=mask, other=0).to(tl.int32)
    return _code_f32(b ^ 0x80, 128.0) * d  # b ^ 0x80 = int8 value + 128


@triton.jit
def _dq_q4_0(Wrow, g, e, mask):
    """Q4_0: d f16 at 0, qs at 2; low nibble of qs[j] is element j, high nibble j + 16; W = d (q - 8)."""
    base = Wrow + g * 18
    d = _f16_at(base, mask)
    b = tl.load(base + 2 + e, mask=mask, other=0).to(tl.int32)
    return _code_f32(b & 15, 8.0) * d, _code_f32(b >> 4, 8.0) * d


@triton.jit
def _scale_min_k4(w0, w1, w2, j):
    """get_scale_min_k4(j, scales) of Q4_K/Q5_K from the 12 scale bytes as three little-endian
    words w0, w1, w2: byte i of word t is scales[4t + i]. The 6-bit scale and min of sub-block j:
        j < 4:  sc = scales[j] & 63,  m = scales[j + 4] & 63
        j >= 4: sc = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4,  m = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4
    """
    sh = 8 * (j % 4)
    b0 = ((w0 >> sh) & 255).to(tl.int32)  # scales[j % 4]
    b1 = ((w1 >> sh) & 255).to(tl.int32)  # scales[4 + j % 4]
    b2 = ((w2 >> sh) & 255).to(tl.int32)  # scales[8 + j % 4]
    sc = tl.where(j < 4, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(j < 4, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dq_q4_k(Wrow, g, e, mask):
    """Q4_K: d, dmin f16 at 0, 2; scales[12] at 4; qs[128] at 16. Group g = chunk c = g % 4 of
    block g // 4: bytes qs[32c + l], low nibble -> element 64c + l (sub-block 2c), high nibble ->
    64c + 32 + l (sub-block 2c + 1); W = d sc_j q - dmin m_j."""
    blk = g // 4
    c = g % 4
    base = Wrow + blk * 144  # 16-byte aligned: the header is four 32-bit loads, not 16 byte loads
    dd = _u32_at(base, mask)
    d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    s0 = _u32_at(base + 4, mask)
    s1 = _u32_at(base + 8, mask)
    s2 = _u32_at(base + 12, mask)
    sc0, m0 = _scale_min_k4(s0, s1, s2, 2 * c)
    sc1, m1 = _scale_min_k4(s0, s1, s2, 2 * c + 1)
    b = tl.load(base + 16 + c * 32 + e, mask=mask, other=0).to(tl.int32)
    # d*sc and dmin*m are exact (11 + 6 bits), q*(d*sc) too: each W rounds once, at the subtraction.
    w0 = _code_f32(b & 15, 0.0) * (d * sc0) - dmin * m0
    w1 = _code_f32(b >> 4, 0.0) * (d * sc1) - dmin * m1
    return w0, w1


@triton.jit
def _dq_q6_k(Wrow, g, e, mask):
    """Q6_K: ql[128] at 0, qh[64] at 128, scales[16] int8 at 192, d f16 at 208. Group g = (h, s) =
    ((g // 2) % 2, g % 2) of block g // 4, l = 16 s + e: element 128h + 32t + l takes the low
    (t < 2) or high nibble of ql[64h + 32(t & 1) + l] and bits 2t..2t+1 of qh[32h + l];
    W = d * scales[(128h + 32t + l) // 16] * (q - 32), exact in fp32 (11 + 7 + 6 bits)."""
    blk = g // 4
    h = (g // 2) % 2
    s = g % 2
    base = Wrow + blk * 210
    d = _f16_at(base + 208, mask)
    l = 16 * s + e
    qa = tl.load(base + 64 * h + l, mask=mask, other=0).to(tl.int32)
    qb = tl.load(base + 64 * h + 32 + l, mask=mask, other=0).to(tl.int32)
    qh = tl.load(base + 128 + 32 * h + l, mask=mask, other=0).to(tl.int32)
    sc = base + 192 + 8 * h + s
    ds0 = d * tl.load(sc, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    ds1 = d * tl.load(sc + 2, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    ds2 = d * tl.load(sc + 4, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    ds3 = d * tl.load(sc + 6, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    w0 = _code_f32((qa & 15) | ((qh & 3) << 4), 32.0) * ds0
    w1 = _code_f32((qb & 15) | ((qh & 12) << 2), 32.0) * ds1
    w2 = _code_f32((qa >> 4) | (qh & 48), 32.0) * ds2
    w3 = _code_f32((qb >> 4) | ((qh >> 2) & 48), 32.0) * ds3
    return w0, w1, w2, w3


@triton.jit
def _k_of(FMT: tl.constexpr, g, e, P: tl.constexpr):
    """A's column of element e of group g in part P (see the module docstring)."""
    if FMT == 0:
        k = g * 32 + e
    elif FMT == 1:
        k = g * 32 + 16 * P + e
    elif FMT == 2:
        k = (g // 4) * 256 + (g % 4) * 64 + 32 * P + e
    else:
        k = (g // 4) * 256 + ((g // 2) % 2) * 128 + 32 * P + (g % 2) * 16 + e
    return k


@triton.jit
def _dequantize_kernel(
    W_ptr, Y_ptr, R, n_groups, stride_wr, stride_yr,
    FMT: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1) * G + tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    mask = (offs_r < R)[:, None, None] & (g < n_groups)
    Wrow = W_ptr + offs_r[:, None, None].to(tl.int64) * stride_wr
    Yrow = Y_ptr + offs_r[:, None, None].to(tl.int64) * stride_yr
    if FMT == 0:
        tl.store(Yrow + _k_of(FMT, g, e, 0), _dq_q8_0(Wrow, g, e, mask).to(Y_ptr.dtype.element_ty), mask=mask)
    elif FMT == 1:
        w0, w1 = _dq_q4_0(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1.to(Y_ptr.dtype.element_ty), mask=mask)
    elif FMT == 2:
        w0, w1 = _dq_q4_k(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        w0, w1, w2, w3 = _dq_q6_k(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 2), w2.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 3), w3.to(Y_ptr.dtype.element_ty), mask=mask)


def dequantize_into(fmt: str, data: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (R, nblocks * QK) = the dequantized rows of data (R, nblocks * nbytes) uint8, each value one fp32
    rounding of the exact value, stored in out's dtype (fp32, or rounded once more to bf16 / fp16); the
    caller has checked the shapes (quant.dequantize, gemm_nt)."""
    fid, _, nbytes, gpb, e = FORMATS[fmt]
    r = data.shape[0]
    n_groups = data.shape[1] // nbytes * gpb
    if r and n_groups:
        grid = (triton.cdiv(r, DEQUANT_ROWS), triton.cdiv(n_groups, DEQUANT_GROUPS))
        _dequantize_kernel[grid](data, out, r, n_groups, data.stride(0), out.stride(0),
                                 FMT=fid, E=e, BLOCK_R=DEQUANT_ROWS, G=DEQUANT_GROUPS)
    return out


@triton.jit
def _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w, g0, k_hi, FMT: tl.constexpr, P: tl.constexpr,
         W_TO_A: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, E: tl.constexpr):
    """acc += A[:, k] . w for part P of the groups g0 .. g0 + G - 1 (w: (BLOCK_N, G, E) fp32)."""
    # Offsets from a 1-D arange (not a reshape of the 3-D ones) keep the runs of E contiguous
    # columns visible to the compiler's alignment analysis: vectorised A loads.
    c = tl.arange(0, G * E)
    k = _k_of(FMT, g0 + c // E, c % E, P)
    a = tl.load(A_ptr + offs_m[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak,
                mask=mask_m[:, None] & (k < k_hi)[None, :], other=0.0)
    w2 = tl.reshape(w, [BLOCK_N, G * E])
    if W_TO_A:  # prefill: the tile rounded to A's bf16/fp16 for the tensor cores, fp32 accumulation
        acc = tl.dot(a, tl.trans(w2.to(a.dtype)), acc)
    else:  # exact fp32 products and fp32 accumulation (FMA dot, not tf32)
        acc = tl.dot(a.to(tl.float32), tl.trans(w2), acc, input_precision="ieee")
    return acc


@triton.jit
def _gemm_ggml_kernel(
    A_ptr, W_ptr, Bias_ptr, C_ptr, M, N, K, n_groups, groups_per_split,
    stride_am, stride_ak, stride_wn, stride_cs, stride_cm, stride_cn,
    FMT: tl.constexpr, GROUP_EL: tl.constexpr, E: tl.constexpr, G: tl.constexpr,
    W_TO_A: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # W column tiles (their decode) reused in L2
    pid_s = 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # fp32 accumulation (tl.dot)
    Wrow = W_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
    offs_g = tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    # Splits and n_groups are whole ggml blocks, and a block's groups permute K only inside the
    # block, so "group < g_hi" and "k < k_hi" mask the same columns.
    k_hi = g_hi * GROUP_EL
    for g0 in range(g_lo, g_hi, G):
        g = g0 + offs_g
        mask = mask_n[:, None, None] & (g < g_hi)
        if FMT == 0:
            w0 = _dq_q8_0(Wrow, g, e, mask)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w0, g0, k_hi, FMT, 0, W_TO_A,
                       BLOCK_N, G, E)
        elif FMT == 1:
            w0, w1 = _dq_q4_0(Wrow, g, e, mask)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w0, g0, k_hi, FMT, 0, W_TO_A,
                       BLOCK_N, G, E)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w1, g0, k_hi, FMT, 1, W_TO_A,
                       BLOCK_N, G, E)
        elif FMT == 2:
            w0, w1 = _dq_q4_k(Wrow, g, e, mask)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w0, g0, k_hi, FMT, 0, W_TO_A,
                       BLOCK_N, G, E)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w1, g0, k_hi, FMT, 1, W_TO_A,
                       BLOCK_N, G, E)
        else:
            w0, w1, w2, w3 = _dq_q6_k(Wrow, g, e, mask)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w0, g0, k_hi, FMT, 0, W_TO_A,
                       BLOCK_N, G, E)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w1, g0, k_hi, FMT, 1, W_TO_A,
                       BLOCK_N, G, E)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w2, g0, k_hi, FMT, 2, W_TO_A,
                       BLOCK_N, G, E)
            acc = _mac(acc, A_ptr, offs_m, mask_m, stride_am, stride_ak, w3, g0, k_hi, FMT, 3, W_TO_A,
                       BLOCK_N, G, E)

    res = acc
    if HAS_BIAS:  # split-K partials take the bias in the reduction instead
        res += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = (C_ptr + pid_s.to(tl.int64) * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm
              + offs_n[None, :] * stride_cn)
    tl.store(c_ptrs, res.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _splitk_reduce_kernel(P_ptr, Bias_ptr, C_ptr, S, M, N, stride_ps, stride_cm, stride_cn,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """C = sum_s P[s] (+ bias), the splits added in order in fp32; P is (S, M, N) contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(P_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(C_ptr + m.to(tl.int64) * stride_cm + n * stride_cn, acc.to(C_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_fmt(wfmt: str) -> str:
    fmt = str(wfmt).lower()
    if fmt not in FORMATS:
        raise ValueError(f"weight format {wfmt!r} is not one of {sorted(FORMATS)}")
    return fmt


def _check_common(a, N, K, bias, out, op):
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.dtype not in DTYPES:
        raise ValueError(f"{op}: a must be a 2-D fp32/bf16/fp16 tensor, got "
                         f"{getattr(a, 'dtype', type(a))} {tuple(getattr(a, 'shape', ()))}")
    if a.shape[1] != K:
        raise ValueError(f"{op}: a has K={a.shape[1]}, the weights K={K}")
    M = a.shape[0]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,) or not bias.dtype.is_floating_point \
                or bias.device != a.device or (N > 0 and bias.stride(0) != 1):
            raise ValueError(f"{op}: bias must be a contiguous ({N},) float tensor on {a.device}")
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N) or out.dtype != a.dtype \
            or out.device != a.device:
        raise ValueError(f"{op}: out must be a ({M}, {N}) {a.dtype} tensor on {a.device}")
    return M, out


def check_weights(op: str, a, w, qk: int, nbytes: int, align: int) -> tuple[int, int, int]:
    """The checks of a GGML weight tensor against a (also gemm_q8's): (N, K, blocks per row), else
    ValueError naming `op`. w: (N, K / qk * nbytes) uint8, last-dim stride 1, rows `align`-aligned."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 2:
        raise ValueError(f"{op}: w must be a 2-D uint8 tensor of ggml blocks, got "
                         f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    K = a.shape[1] if isinstance(a, torch.Tensor) and a.dim() == 2 else -1
    if K % qk:
        raise ValueError(f"{op}: K={K} must be a multiple of {qk}")
    N = w.shape[0]
    n_blocks = K // qk
    if w.shape[1] != n_blocks * nbytes or (w.numel() > 0 and w.stride(1) != 1):
        raise ValueError(f"{op}: w must be ({N}, {n_blocks * nbytes}) with last-dim stride 1 "
                         f"for K={K}, got {tuple(w.shape)} strides {tuple(w.stride())}")
    if w.device != a.device:
        raise ValueError(f"{op}: w is on {w.device}, a on {a.device}")
    if w.numel() > 0 and (w.data_ptr() % align or w.stride(0) % align):
        raise ValueError(f"{op}: w's rows must start at {align}-byte aligned addresses (row stride "
                         f"{w.stride(0)}, address {w.data_ptr()} mod {align} = {w.data_ptr() % align})")
    return N, K, n_blocks


def _auto_splits(a: torch.Tensor, programs: int, n_blocks: int) -> int:
    """1 on CPU and whenever the unsplit grid fills the GPU; else enough splits to fill it."""
    if not a.is_cuda or programs >= SPLIT_PROGRAMS_PER_SM * _sm_count(a.device):
        return 1
    want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * _sm_count(a.device), max(programs, 1))
    return max(1, min(want, n_blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


def _split_dst(out: torch.Tensor, splits: int, M: int, N: int):
    """out itself, or an fp32 (splits, M, N) workspace of split-K partials; with its 3 strides."""
    if splits == 1:
        return out, (0, *out.stride())
    dst = torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
    return dst, dst.stride()


def gemm_nt(a: torch.Tensor, wfmt: str, w: torch.Tensor, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, *, split_k: int | None = None,
            config: tuple[int, ...] | None = None, path: str = "auto") -> torch.Tensor:
    """C = a @ dequant(wfmt, w)^T (+ bias), the GGML weights dequantized on the fly.

    a: (M, K) fp32/bf16/fp16, any strides
    wfmt: "q8_0" | "q4_0" | "q4_k" | "q6_k" (case-insensitive); K a multiple of 32 / 256
    w: (N, K // QK * bytes_per_block) uint8, the ggml blocks of row n in w[n], last-dim stride 1,
       rows 4-byte aligned for q4_k (2-byte for the others)
    bias: (N,) any float dtype, added in fp32; out: (M, N) a's dtype, any strides
    split_k: exact kernel only, weight-block splits (None: automatic, 1 on CPU)
    config: tuning only: exact kernel (BLOCK_N, NB, num_warps, num_stages) at M = 1 or (BLOCK_M,
            BLOCK_N, NB, num_warps, num_stages) (gemm_gemv.GEMV_CONFIGS, DECODE_CONFIGS); tensor-core
            kernel (BLOCK_M, BLOCK_N, G, num_warps, num_stages[, GROUP_M]), 6 elements to force it at M <= 16
    path: "auto"; "fused" (the kernels above, whatever M) or "dequant" (bf16 / fp16 a only: W dequantized
          once into an (N, K) buffer of a's dtype, then gemm_dense.gemm_nt_dense, config its tile), for
          tuning and benchmarks; "auto" takes "dequant" for bf16 / fp16 a from DEQUANT_MIN_M rows (and no
          config), the fused kernels below that
    returns out. The exact kernel: fp32 arithmetic on the exact fp32 dequantization; the tensor-core
    kernel (M > 16, or bf16/fp16 a with M >= DECODE_DOT_MIN_M) and the dequant path: W rounded to a's
    dtype (fp32 stays exact) into tensor-core dots, fp32 accumulation.
    """
    fmt = _check_fmt(wfmt)
    fid, qk, nbytes, gpb, E = FORMATS[fmt]
    align = 4 if fmt == "q4_k" else 2  # the widest scalar load of a block's fields
    N, K, n_blocks = check_weights(f"gemm_nt[{fmt}]", a, w, qk, nbytes, align)
    M, out = _check_common(a, N, K, bias, out, f"gemm_nt[{fmt}]")
    if path not in PATHS:
        raise ValueError(f"gemm_nt[{fmt}]: path {path!r} is not one of {', '.join(PATHS)}")
    if path == "dequant" and a.dtype == torch.float32:
        raise ValueError(f"gemm_nt[{fmt}]: path 'dequant' needs bf16 / fp16 a (its dense GEMM runs 16-bit "
                         "tensor-core dots), got float32")
    if M == 0 or N == 0:
        return out
    if path == "dequant" or (path == "auto" and config is None and a.dtype != torch.float32 and M >= DEQUANT_MIN_M):
        wd = torch.empty((N, K), dtype=a.dtype, device=a.device)  # a transient bf16 / fp16 copy of W
        dequantize_into(fmt, w, wd)
        return gemm_dense.gemm_nt_dense(a, wd, bias, out, config)
    n_groups = n_blocks * gpb
    dot = M > DECODE_MAX_M or (config is not None and len(config) == 6) or (
        config is None and a.dtype != torch.float32 and M >= DECODE_DOT_MIN_M)
    if not dot:
        config = tuple(config or (gemm_gemv.GEMV_CONFIGS if M == 1 else gemm_gemv.DECODE_CONFIGS)[fmt])
        block_m = config[0] if len(config) == 5 else 1
        block_n = config[-4]
        programs = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        splits = _auto_splits(a, programs, n_blocks) if split_k is None else int(split_k)
        if splits < 1:
            raise ValueError(f"gemm_nt[{fmt}]: split_k={split_k} must be >= 1")
        blocks_per_split = triton.cdiv(max(n_blocks, 1), splits)
        blocks_per_split += blocks_per_split % 2 if fid < 2 else 0  # Q8_0 / Q4_0 split at block pairs
        splits = triton.cdiv(max(n_blocks, 1), blocks_per_split)  # no empty split
        dst, strides = _split_dst(out, splits, M, N)
        gemm_gemv.launch(a, w, bias, dst, fmt, n_blocks, blocks_per_split, splits, strides, config)
    else:
        block_m, block_n, G, num_warps, num_stages, *group_m = config or (
            PREFILL_CONFIGS if M > DECODE_MAX_M else DECODE_DOT_CONFIGS)[fmt]
        splits = 1
        _gemm_ggml_kernel[(triton.cdiv(N, block_n) * triton.cdiv(M, block_m),)](
            a, w, bias if bias is not None else w, out, M, N, K, n_groups, n_groups,
            a.stride(0), a.stride(1), w.stride(0), 0, *out.stride(),
            FMT=fid, GROUP_EL=qk // gpb, E=E, G=G, W_TO_A=a.dtype != torch.float32,
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m[0] if group_m else 8,
            num_warps=num_warps, num_stages=num_stages,
        )
    if splits > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            dst, bias if bias is not None else dst, out, splits, M, N, dst.stride(0), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out
