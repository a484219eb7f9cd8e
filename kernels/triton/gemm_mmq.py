"""Small-M GEMM over Q4_K and Q8_0 weights with quantized activations on int8 tensor cores ("MMQ").

The same product as gemm_q8.py, C = A @ W^T (+ bias) in ggml's quantized-activation arithmetic: A is
quantized to the weight format's vec_dot type first (gemm_q8.quantize_q8_k for Q4_K weights,
gemm_q8.quantize_q8_0 for Q8_0), every weight meets its activation as an 8-bit integer product, the
products of each 32-element sub-block are summed exactly in int32, and the fp32 scales are applied per
sub-block (Q8_0) or per 256-block (Q4_K). Only the instruction that forms the integer sums differs: here
one tensor-core dot, tl.dot(int8, int8) -> int32, of a (BLOCK_N, 32) tile of weight codes with a
(32, BLOCK_M) tile of activation codes, instead of gemm_q8's dp4a, four products per instruction per row
of A. gemm_q8 redoes all of a weight's products for each row of A, so past a few rows it is bound by
integer issue (an H100 at M = 4 / 16: 20% / 5% of its memory read rate); a tensor-core dot costs about
the same for 16 or 32 rows of A as for one, so this kernel should stay bound by the weight stream up to
M of a few dozen (unmeasured: the configs below are guesses until a GPU sweep).

The tile is the transposed product: a program owns BLOCK_N rows of W, the dot's M dimension (64 or 128,
what Hopper's warpgroup MMA wants), and BLOCK_M rows of A, its N dimension (16 or 32; tl.dot needs every
dimension >= 16); acc is fp32 (BLOCK_N, BLOCK_M) and is stored transposed through C's strides. Rows past
M and N are clamped to the last row for the loads and dropped by the store's mask.

Q8_0 (block_q8_0, 34 bytes: fp16 d, 32 int8 codes): the codes of a block start two bytes in, so they are
2-byte aligned only; they are loaded as 16 int16 words a row (rows are 2-byte aligned: the launcher
checks it) and each word is split into its low byte (element 2w, little-endian) and high byte (element
2w + 1), joined and reshaped to (BLOCK_N, 32) in element order. Per block b:
    acc += dot(wq_b, aq_b) * (d_w[n] * d_a[m, b])
NB blocks per iteration of the main loop (unrolled: their loads can be in flight together), then the
K / 32 % NB left-over blocks one at a time. Measured slower on an H200 and dropped (benchmarks/
NOTES-gemm.md, Version 4): the blocks read in 68-byte pairs as 32-bit words (gemm_q8's GEMV layout), and,
for both formats, the next block's weight loads issued before this block's dots (a register double buffer).

Q4_K (block_q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes):
chunk c (0..3) of the codes is bytes 16 + 32c .. 16 + 32c + 31; their low nibbles are sub-block 2c
(elements 64c + l), their high nibbles sub-block 2c + 1 (elements 64c + 32 + l). Per 256-block:
    isum = sum_j sc_j[n] * dot(q_j, aq_j)          (int32, exact)
    msum = sum_j m_j[n] * bsum_j[m]                (int32, exact; bsum_j: quantize_q8_k's code sums)
    acc += (d[n] * d_a[m]) * isum - (dmin[n] * d_a[m]) * msum
with sc_j, m_j decoded from the 12 scale bytes as get_scale_min_k4 does. gemm_q8 converts the integer
sums to fp32 per 64-element chunk, here per 256-block: |isum| < 8 * 32 * 15 * 127 * 63 < 2^31, so the
int32 is exact, and its conversion to fp32 rounds (by at most 2^-24 relative) only above 2^24, within the
fp32 summation error both kernels have anyway.

Each chunk's 32 code bytes are loaded as eight 32-bit words: w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F
hold four low / high nibbles each, then split into bytes for the dot (one mask or shift a word instead of
one a byte; 4-7% faster on an H200 than the byte loads: NOTES-gemm.md, Version 4).

Alignment: the Q8_0 int16 words need 2-byte aligned rows, the Q4_K header (four 32-bit words) 4-byte
aligned rows; both are what gemm.check_weights already demands of gemm_q8's weights, and launch_mmq
raises ValueError for weights that break them instead of reading misaligned words.

References: ggml-common.h (block_q8_0, block_q4_K, block_q8_K), ggml-quants.c (quantize_row_q8_0_ref,
quantize_row_q8_K_ref, get_scale_min_k4, ggml_vec_dot_q4_K_q8_K_generic, ggml_vec_dot_q8_0_q8_0_generic);
llama.cpp's CUDA backend names its tensor-core quantized GEMM mul_mat_q ("MMQ").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import _sm_count, _split_dst, _splitk_reduce_kernel

_I16 = tl.constexpr(tl.pointer_type(tl.int16))
_U16 = tl.constexpr(tl.pointer_type(tl.uint16))
_U32 = tl.constexpr(tl.pointer_type(tl.uint32))

# gemm_q8.gemm_nt_q8 calls launch_mmq from this many rows of A (M = 1 stays on the dp4a GEMV).
MMQ_MIN_M = 2
# Split-K: a 14336-row W in 64-row tiles is 224 programs, 1.7 an SM of an H100 / H200, and ncu showed the
# unsplit kernel latency-bound there (11% of warps active, DRAM 16-18% busy; benchmarks/NOTES-gemm.md).
SPLIT_PROGRAMS_PER_SM = 6
MAX_SPLITS = 16

ALIGN = {"q4_k": 4, "q8_0": 2}  # row alignment (bytes) the kernels' 32-bit / 16-bit word loads need


def default_config(fmt: str, M: int, N: int) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_M, NB, num_warps, num_stages) for M rows of A and N of W; SPLIT_K automatic
    (auto_splits). Measured on an H200 (benchmarks/gpu_gemm.py q8 section, 14336 x 4096, M = 4 / 16, 13
    configs; NOTES-gemm.md "Version 3"): one NB step (NB 2 was 10-20% slower: registers), Q8_0 in 64-row
    tiles over one warpgroup (31.0% / 28.5% of the read rate against 26.5% / 24.4% for 32 rows), Q4_K in
    32-row tiles over two warps (22.4% / 20.0% against 21.7% / 18.4%). BLOCK_M 32 past 16 rows: unmeasured."""
    del N  # kept so that a tuned table can depend on it
    block_m = 16 if M <= 16 else 32
    return (64, block_m, 1, 4, 3) if fmt == "q8_0" else (32, block_m, 1, 2, 3)


@triton.jit
def _tile_rows(M, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's rows of W (offs_n) and of A (offs_m), and the same clamped to the last row as int64
    (rows past N / M: their loads read the last row, their results are dropped by _store_tile's mask)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_n, offs_m, tl.minimum(offs_n, N - 1).to(tl.int64), tl.minimum(offs_m, M - 1).to(tl.int64)


@triton.jit
def _store_tile(acc, Bias_ptr, C_ptr, offs_n, offs_m, n_c, M, N, stride_cs, stride_cm, stride_cn,
                HAS_BIAS: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M) (+ bias) stored transposed into C[split] (M, N) (split: program_id 2;
    stride_cs 0 when unsplit), rows past M and N masked."""
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + n_c).to(tl.float32)[:, None]
    c_ptrs = C_ptr + tl.program_id(2).to(tl.int64) * stride_cs + offs_m[None, :].to(tl.int64) * stride_cm + \
        offs_n[:, None].to(tl.int64) * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@triton.jit
def _q8_0_block(acc, W_row, Q_row, D_row, b, e, w16, BLOCK_N: tl.constexpr):
    """acc += (dot of block b's W codes with A's) * d_w * d_a. W_row: (BLOCK_N, 1) byte pointers to rows
    of W; Q_row: (BLOCK_M, 1) to rows of A's codes; D_row: (1, BLOCK_M) to rows of A's d."""
    blk = W_row + 34 * b
    h = tl.load((blk + 2).to(_I16) + w16)  # (BLOCK_N, 16): word w = codes 2w (low byte), 2w + 1 (high byte)
    lo = h.to(tl.int8)  # truncation keeps the low byte, as a signed code
    hi = (h >> 8).to(tl.int8)  # arithmetic shift: the high byte, sign-extended
    wq = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))  # [n, w, 0 / 1] -> [n, 2w + 0 / 1]: element order
    aq = tl.load(Q_row + 32 * b + e)  # (BLOCK_M, 32): K contiguous in memory, transposed for the dot
    isum = tl.dot(wq, tl.trans(aq), out_dtype=tl.int32)  # (BLOCK_N, BLOCK_M), exact
    d_w = tl.load(blk.to(_U16)).to(tl.float16, bitcast=True).to(tl.float32)  # (BLOCK_N, 1)
    d_a = tl.load(D_row + b)  # (1, BLOCK_M): fp16(d) already widened by quantize_q8_0
    return acc + isum.to(tl.float32) * (d_w * d_a)


@triton.jit
def _mmq_q8_0_kernel(
    Q_ptr, D_ptr, W_ptr, Bias_ptr, C_ptr, M, N, n_blocks, blocks_per_split, stride_wn, stride_cs, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
):
    offs_n, offs_m, n_c, m_c = _tile_rows(M, N, BLOCK_N, BLOCK_M)
    W_row = W_ptr + n_c[:, None] * stride_wn
    Q_row = Q_ptr + m_c[:, None] * (n_blocks * 32)  # quantize_q8_0's codes: (M, K) contiguous
    D_row = D_ptr + m_c[None, :] * n_blocks  # and its d: (M, K / 32) contiguous
    e = tl.arange(0, 32)[None, :]
    w16 = tl.arange(0, 16)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    b_lo = tl.program_id(2) * blocks_per_split  # this split's blocks: [b_lo, b_hi)
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    b_full = b_lo + (b_hi - b_lo) // NB * NB
    for b0 in range(b_lo, b_full, NB):
        for i in tl.static_range(NB):
            acc = _q8_0_block(acc, W_row, Q_row, D_row, b0 + i, e, w16, BLOCK_N)
    for b in range(b_full, b_hi):  # the blocks left over after whole NB steps, one at a time
        acc = _q8_0_block(acc, W_row, Q_row, D_row, b, e, w16, BLOCK_N)
    _store_tile(acc, Bias_ptr, C_ptr, offs_n, offs_m, n_c, M, N, stride_cs, stride_cm, stride_cn, HAS_BIAS)


@triton.jit
def _bytes_of_words(x, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """(BLOCK_N, WORDS) 32-bit words -> (BLOCK_N, 4 WORDS) int8, byte i of word t at column 4t + i
    (little-endian element order): join(join(b0, b2), join(b1, b3))[.., t, a, h] is byte 2a + h of word t,
    so the row-major reshape lays the bytes out in order."""
    b0 = x.to(tl.int8)  # truncation: the low byte
    b1 = (x >> 8).to(tl.int8)
    b2 = (x >> 16).to(tl.int8)
    b3 = (x >> 24).to(tl.int8)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, 4 * WORDS))


@triton.jit
def _scale_min(s0, s1, s2, j: tl.constexpr):
    """get_scale_min_k4 for sub-block j (constexpr) from the 12 scale bytes as three little-endian words:
    byte i of word t is scales[4t + i]. Returns the 6-bit scale and min as int32.
        j < 4:  sc = scales[j] & 63,                            m = scales[j + 4] & 63
        j >= 4: sc = scales[j + 4] & 15 | (scales[j - 4] >> 6) << 4,  m = scales[j + 4] >> 4 | (scales[j] >> 6) << 4
    """
    sh: tl.constexpr = 8 * (j % 4)
    b0 = ((s0 >> sh) & 255).to(tl.int32)  # scales[j % 4]
    b1 = ((s1 >> sh) & 255).to(tl.int32)  # scales[4 + j % 4]
    if j < 4:
        sc = b0 & 63
        mn = b1 & 63
    else:
        b2 = ((s2 >> sh) & 255).to(tl.int32)  # scales[8 + j % 4] = scales[j + 4]
        sc = (b2 & 15) | ((b0 >> 6) << 4)
        mn = (b2 >> 4) | ((b1 >> 6) << 4)
    return sc, mn


@triton.jit
def _q4_k_block(acc, W_row, Q_row, S_row, D_row, blk, e, t8, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc += block blk of W against its Q8_K activations (module docstring). W_row: (BLOCK_N, 1) byte
    pointers to rows of W; Q_row: (BLOCK_M, 1) to rows of A's codes; S_row, D_row: (1, BLOCK_M) to rows of
    A's 32-code sums and d."""
    base = W_row + 144 * blk
    dd = tl.load(base.to(_U32))  # d (low half), dmin (high half)
    s0 = tl.load((base + 4).to(_U32))
    s1 = tl.load((base + 8).to(_U32))
    s2 = tl.load((base + 12).to(_U32))
    k0 = blk * 256
    isum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    msum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    for c in tl.static_range(4):
        # 8 words a row: bytes 4t .. 4t + 3 of the chunk, low nibbles elements 64c + 4t + i, high 64c + 32 + 4t + i
        qw = tl.load((base + 16 + 32 * c).to(_U32) + t8)
        q_lo = _bytes_of_words(qw & 0x0F0F0F0F, BLOCK_N, 8)
        q_hi = _bytes_of_words((qw >> 4) & 0x0F0F0F0F, BLOCK_N, 8)
        a_lo = tl.load(Q_row + k0 + 64 * c + e)  # (BLOCK_M, 32): sub-block 2c of A
        a_hi = tl.load(Q_row + k0 + 64 * c + 32 + e)  # sub-block 2c + 1
        sc0, m0 = _scale_min(s0, s1, s2, 2 * c)
        sc1, m1 = _scale_min(s0, s1, s2, 2 * c + 1)
        d_lo = tl.dot(q_lo, tl.trans(a_lo), out_dtype=tl.int32)
        d_hi = tl.dot(q_hi, tl.trans(a_hi), out_dtype=tl.int32)
        isum += sc0 * d_lo + sc1 * d_hi
        bs0 = tl.load(S_row + blk * 8 + 2 * c)
        bs1 = tl.load(S_row + blk * 8 + 2 * c + 1)
        msum += m0 * bs0 + m1 * bs1  # (BLOCK_N, 1) x (1, BLOCK_M) outer products
    d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    d_a = tl.load(D_row + blk)
    return acc + (d * d_a) * isum.to(tl.float32) - (dmin * d_a) * msum.to(tl.float32)


@triton.jit
def _mmq_q4_k_kernel(
    Q_ptr, D_ptr, S_ptr, W_ptr, Bias_ptr, C_ptr, M, N, n_blocks, blocks_per_split, stride_wn, stride_cs, stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
):
    offs_n, offs_m, n_c, m_c = _tile_rows(M, N, BLOCK_N, BLOCK_M)
    W_row = W_ptr + n_c[:, None] * stride_wn
    Q_row = Q_ptr + m_c[:, None] * (n_blocks * 256)  # quantize_q8_k's codes: (M, K) contiguous
    S_row = S_ptr + m_c[None, :] * (n_blocks * 8)  # its sums of 32 codes: (M, K / 32)
    D_row = D_ptr + m_c[None, :] * n_blocks  # its d: (M, K / 256)
    e = tl.arange(0, 32)[None, :]
    t8 = tl.arange(0, 8)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    b_lo = tl.program_id(2) * blocks_per_split  # this split's blocks: [b_lo, b_hi)
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    b_full = b_lo + (b_hi - b_lo) // NB * NB
    for b0 in range(b_lo, b_full, NB):
        for i in tl.static_range(NB):
            acc = _q4_k_block(acc, W_row, Q_row, S_row, D_row, b0 + i, e, t8, BLOCK_N, BLOCK_M)
    for b in range(b_full, b_hi):  # the blocks left over after whole NB steps, one at a time
        acc = _q4_k_block(acc, W_row, Q_row, S_row, D_row, b, e, t8, BLOCK_N, BLOCK_M)
    _store_tile(acc, Bias_ptr, C_ptr, offs_n, offs_m, n_c, M, N, stride_cs, stride_cm, stride_cn, HAS_BIAS)


def auto_splits(programs: int, n_blocks: int, nb_iter: int, device: torch.device) -> int:
    """Split-K factor for a grid of `programs` tiles: 1 on CPU or when the tiles alone give every SM
    SPLIT_PROGRAMS_PER_SM programs; else enough splits for that, each keeping >= 2 NB steps of blocks."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * _sm_count(device), max(programs, 1))
    return max(1, min(want, n_blocks // (2 * nb_iter), MAX_SPLITS))


def launch_mmq(fmt: str, quantized: tuple, w: torch.Tensor, bias, out: torch.Tensor, config: tuple[int, ...]) -> None:
    """The tensor-core GEMM on activations already quantized (gemm_q8.quantize_q8_k / quantize_q8_0's
    tuple), writing out (M, N) = A @ W^T (+ bias); the arguments as gemm_q8.launch_gemv's, already checked
    by gemm_nt_q8 (formats, shapes, devices). config: (BLOCK_N, BLOCK_M, NB, num_warps, num_stages[,
    SPLIT_K]); SPLIT_K (None or absent: auto_splits) cuts each row's blocks into that many ranges, one
    program each, whose fp32 partials a second kernel adds in split order (deterministic) with the bias.
    Raises ValueError for weights whose rows break the kernels' word alignment (module docstring) and for
    tiles tl.dot cannot take."""
    block_n, block_m, nb_iter, num_warps, num_stages = config[:5]
    split_k = config[5] if len(config) > 5 else None
    if fmt not in ALIGN:
        raise ValueError(f"launch_mmq: weight format {fmt!r} is not one of {sorted(ALIGN)}")
    if block_n < 16 or block_m < 16 or nb_iter < 1 or (split_k is not None and split_k < 1):
        raise ValueError(f"launch_mmq: config {tuple(config)} needs BLOCK_N, BLOCK_M >= 16 (tl.dot), NB >= 1 "
                         "and SPLIT_K >= 1")
    align = ALIGN[fmt]
    if w.numel() > 0 and (w.data_ptr() % align or w.stride(0) % align):
        raise ValueError(f"launch_mmq[{fmt}]: w's rows must be {align}-byte aligned (row stride {w.stride(0)}, "
                         f"address mod {align} = {w.data_ptr() % align})")
    M, N = out.shape
    if M == 0 or N == 0:
        return
    q = quantized[0]
    n_blocks = q.shape[1] // (256 if fmt == "q4_k" else 32)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    splits = auto_splits(tiles, n_blocks, nb_iter, out.device) if split_k is None else int(split_k)
    splits = max(1, min(splits, n_blocks))
    per_split = triton.cdiv(max(n_blocks, 1), splits)
    splits = triton.cdiv(max(n_blocks, 1), per_split)  # no empty split
    dst, strides = _split_dst(out, splits, M, N)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), splits)
    bias_arg = bias if bias is not None else w
    has_bias = bias is not None and splits == 1  # split partials take the bias in the reduction
    if fmt == "q4_k":
        _, d, s = quantized
        _mmq_q4_k_kernel[grid](
            q, d, s, w, bias_arg, dst, M, N, n_blocks, per_split, w.stride(0), *strides,
            HAS_BIAS=has_bias, BLOCK_N=block_n, BLOCK_M=block_m, NB=nb_iter,
            num_warps=num_warps, num_stages=num_stages)
    else:
        _, d = quantized
        _mmq_q8_0_kernel[grid](
            q, d, w, bias_arg, dst, M, N, n_blocks, per_split, w.stride(0), *strides,
            HAS_BIAS=has_bias, BLOCK_N=block_n, BLOCK_M=block_m, NB=nb_iter,
            num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            dst, bias if bias is not None else dst, out, splits, M, N, dst.stride(0), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
