"""Q8_0 x Q8_0 GEMV (M = 1) in Gluon (Hopper): the weights streamed by bulk tensor copies.

The arithmetic of kernels/triton/gemm_q8.py's `_gemv_q8_0_q8_kernel` (ggml's mul_mat_vec_q for Q8_0): the
activation row quantized to Q8_0 by the Triton quantizer (quantize_q8_0: int8 codes, one fp16-rounded d a
32), for each 32-weight block the integer sum of code products (dp4a, signed x signed), times d_w d_a in
fp32. It claims gemm.gemm_nt's `emulated` reference, as triton-q8 does.

The structure is kernels/gluon/gemv.py's (persistent CTAs over (row tile, K split) work items, a ring of
STAGES shared-memory stages fed by bulk copies, auto_splits, the epilogue `_tile_out`); what differs is the
byte layout. A Q8_0 block is 34 bytes (fp16 d, 32 codes): 2-byte aligned, too ragged for a tensor copy. Eight
blocks are 272 bytes = 68 words, so with K a multiple of 256 a row is whole groups of eight blocks and the
weights are an int32 tensor (N, K / 256, 68) whose rows and groups are 16-byte aligned. Three descriptors copy
a K step (BN rows x G groups): words 0-31 and 32-63 (128-byte swizzled: a thread's 32 words are one 128-byte
line, so each 16-byte load of a quarter warp hits distinct banks) and words 64-67. Inside a group, blocks 2q
and 2q + 1 (q = 0..3) are words 17q .. 17q + 16: block 2q's d is the low half of word 17q and its code word i
the funnel shift of words 17q + i and 17q + i + 1 by 16 bits; block 2q + 1's d is the high half of word
17q + 8 and its codes words 17q + 9 .. 17q + 16.
- a thread owns one row's group in a K step (G groups a step: 32 / G rows a warp, BN = 32 / G x WARPS rows a
  tile): 17 shared loads of 16 bytes, 64 dp4a, 8 fp32 terms; no data crosses threads until the tile's row
  sums (a reduction over the G threads of a row);
- the step's activation codes (256 bytes a group) and scales are loaded before the wait for its weights.
Rows past N are zero-filled by the copies and never stored. M = 1 only; K a multiple of 256.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import barrier_op, tma_ops
from kernel_parity.kernels.gluon.gemv import _tile_out, launch_plan
from kernel_parity.kernels.triton.gemm import _check_common, check_weights
from kernel_parity.kernels.triton.gemm_q8 import quantize_q8_0

# (WARPS, G, STAGES, CTAS_PER_SM): BN = 32 / G x WARPS rows a tile, G groups of 8 blocks (256 weights) a K step.
# The fastest of eight on an H200 at both Llama-3-8B shapes (reports/baselines/gluon-gemv-bench-h200.json run 9):
# 128-row tiles of one group a step, K split by auto_splits (14336 x 4096: 2 splits, 4096 x 14336: 8).
GEMV_Q8_0_CONFIG = (4, 1, 2, 3)
_tma_load, _ = tma_ops()
_barrier = barrier_op()


@gluon.jit
def _dp4a_ss(w, a, c):
    """c + sum_i w.sbyte[i] * a.sbyte[i]."""
    return gl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, c], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _shf16(lo, hi):
    """The 32 bits of hi:lo from bit 16: lo's high half, then hi's low half (the codes straddling two words)."""
    return gl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, 16;", "=r,r,r", [lo, hi], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _split4(x):
    """The 4 slices x[..., j] of x's last dim (held whole by each thread), j = 0, 1, 2, 3."""
    e, o = gl.split(x.reshape(x.shape[:-1] + [2, 2]))
    x0, x2 = gl.split(e)
    x1, x3 = gl.split(o)
    return x0, x1, x2, x3


@gluon.jit
def _split8(x):
    """The 8 slices x[..., j], j = 0 .. 7."""
    e, o = gl.split(x.reshape(x.shape[:-1] + [4, 2]))
    x0, x2, x4, x6 = _split4(e)
    x1, x3, x5, x7 = _split4(o)
    return x0, x1, x2, x3, x4, x5, x6, x7


@gluon.jit
def _split32(x):
    """The 32 slices x[..., j], j = 0 .. 31 (word j = 8 c + k: slice k of 8, then c of 4)."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _split8(x.reshape(x.shape[:-1] + [4, 8]))
    a0, a8, a16, a24 = _split4(k0)
    a1, a9, a17, a25 = _split4(k1)
    a2, a10, a18, a26 = _split4(k2)
    a3, a11, a19, a27 = _split4(k3)
    a4, a12, a20, a28 = _split4(k4)
    a5, a13, a21, a29 = _split4(k5)
    a6, a14, a22, a30 = _split4(k6)
    a7, a15, a23, a31 = _split4(k7)
    return (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
            a22, a23, a24, a25, a26, a27, a28, a29, a30, a31)


@gluon.jit
def _word(lo, hi, tail, x: gl.constexpr):
    """Word x (0 .. 67) of a thread's group: from the first, second or last copy."""
    if x < 32:
        w = lo[x]
    elif x < 64:
        w = hi[x - 32]
    else:
        w = tail[x - 64]
    return w


@gluon.jit
def _issue(lo_desc, hi_desc, tail_desc, lo, hi, tail, ready, j, pid, P, kps, BN: gl.constexpr, G: gl.constexpr,
           STAGES: gl.constexpr, SPLITS: gl.constexpr):
    """The three bulk copies of pipeline slot j (this CTA's work item j // kps = (row tile, K split), its K step
    j % kps): BN rows x G groups of words 0-31, 32-63 and 64-67."""
    s = j % STAGES
    item = pid + (j // kps) * P
    r0 = (item // SPLITS) * BN
    g0 = ((item % SPLITS) * kps + j % kps) * G
    bar = ready.index(s)
    mbarrier.expect(bar, lo_desc.block_type.nbytes + hi_desc.block_type.nbytes + tail_desc.block_type.nbytes)
    _tma_load(lo_desc, [r0, g0, 0], bar, lo.index(s))
    _tma_load(hi_desc, [r0, g0, 32], bar, hi.index(s))
    _tma_load(tail_desc, [r0, g0, 64], bar, tail.index(s))


@gluon.jit
def _gemv_q8_0_tma_kernel(lo_desc, hi_desc, tail_desc, q_ptr, d_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_groups,
                          stride_cn, HAS_BIAS: gl.constexpr, WARPS: gl.constexpr, G: gl.constexpr,
                          STAGES: gl.constexpr, SPLITS: gl.constexpr):
    RW: gl.constexpr = 32 // G  # rows a warp
    BN: gl.constexpr = RW * WARPS
    # [rows, groups, words]: a thread holds one row's words of one group (and the group's activations)
    L32: gl.constexpr = gl.BlockedLayout([1, 1, 32], [RW, G, 1], [WARPS, 1, 1], [2, 1, 0])
    L8: gl.constexpr = gl.BlockedLayout([1, 1, 8], [RW, G, 1], [WARPS, 1, 1], [2, 1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 4], [RW, G, 1], [WARPS, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L32)  # [rows, groups]
    LR: gl.constexpr = gl.SliceLayout(1, LS)  # [rows]

    pid = gl.program_id(0)
    P = gl.num_programs(0)
    n_items = gl.cdiv(N, BN) * SPLITS  # (row tile, K split) pairs; SPLITS divides the K steps
    kps = n_groups // G // SPLITS  # K steps a work item
    total = ((n_items - pid + P - 1) // P) * kps

    lo = gl.allocate_shared_memory(gl.int32, [STAGES, BN, G, 32], lo_desc.layout)
    hi = gl.allocate_shared_memory(gl.int32, [STAGES, BN, G, 32], hi_desc.layout)
    tail = gl.allocate_shared_memory(gl.int32, [STAGES, BN, G, 4], tail_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(ready.index(k), count=1)
    for p in gl.static_range(STAGES - 1):
        if p < total:
            _issue(lo_desc, hi_desc, tail_desc, lo, hi, tail, ready, p, pid, P, kps, BN, G, STAGES, SPLITS)

    LA: gl.constexpr = gl.SliceLayout(0, L32)  # [groups, words]
    act_off = (64 * gl.arange(0, G, layout=gl.SliceLayout(1, LA))[:, None]
               + gl.arange(0, 32, layout=gl.SliceLayout(0, LA))[None, :])  # words 0-31 of each group's codes
    LD: gl.constexpr = gl.SliceLayout(0, L8)
    d_off = (8 * gl.arange(0, G, layout=gl.SliceLayout(1, LD))[:, None]
             + gl.arange(0, 8, layout=gl.SliceLayout(0, LD))[None, :])  # the group's 8 activation scales
    rows_r = gl.arange(0, BN, layout=LR)
    acc = gl.zeros([BN, G], gl.float32, LS)
    for i in range(total):
        j = i + STAGES - 1
        if j < total:  # into the stage read at i - 1: every thread passed the barrier at its end
            _issue(lo_desc, hi_desc, tail_desc, lo, hi, tail, ready, j, pid, P, kps, BN, G, STAGES, SPLITS)
        st = i % STAGES
        item = pid + (i // kps) * P
        g0 = ((item % SPLITS) * kps + i % kps) * G
        # the step's activations before the wait for its weights: their latency under the copy's
        al = _split32(gl.load(q_ptr + g0 * 64 + act_off)[None])  # blocks 0-3 of each group, [1, G] a word
        ah = _split32(gl.load(q_ptr + g0 * 64 + 32 + act_off)[None])  # blocks 4-7
        das = _split8(gl.load(d_ptr + g0 * 8 + d_off)[None])
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        wl = _split32(lo.index(st).load(L32))
        wh = _split32(hi.index(st).load(L32))
        wt = _split4(tail.index(st).load(L4))
        for q in gl.static_range(4):  # blocks 2q (A: straddling words) and 2q + 1 (B)
            s_a = gl.zeros([BN, G], gl.int32, LS)
            s_b = gl.zeros([BN, G], gl.int32, LS)
            for t in gl.static_range(8):  # every word to LS: the splits' layouts are the same threads' registers
                w0 = gl.convert_layout(_word(wl, wh, wt, 17 * q + t), LS)
                w1 = gl.convert_layout(_word(wl, wh, wt, 17 * q + t + 1), LS)
                wb = gl.convert_layout(_word(wl, wh, wt, 17 * q + 9 + t), LS)
                s_a = _dp4a_ss(_shf16(w0, w1), gl.convert_layout(_word(al, ah, ah, 16 * q + t), LS), s_a)
                s_b = _dp4a_ss(wb, gl.convert_layout(_word(al, ah, ah, 16 * q + 8 + t), LS), s_b)
            h0 = gl.convert_layout(_word(wl, wh, wt, 17 * q), LS)
            h8 = gl.convert_layout(_word(wl, wh, wt, 17 * q + 8), LS)
            d_a = (h0 & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            d_b = ((h8 >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            da_a = gl.convert_layout(das[2 * q], LS)
            da_b = gl.convert_layout(das[2 * q + 1], LS)
            acc += s_a.to(gl.float32) * (d_a * da_a) + s_b.to(gl.float32) * (d_b * da_b)
        if i % kps == kps - 1:
            _tile_out(gl.sum(acc, axis=1), rows_r, item, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_cn, HAS_BIAS,
                      BN, SPLITS)
            acc = gl.zeros([BN, G], gl.float32, LS)
        _barrier()
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(k))


def descriptors(w: torch.Tensor, bn: int, g: int) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """Q8_0 rows w (N, K / 32 x 34) uint8, K a multiple of 256, seen as int32 (N, K / 256, 68): the descriptors of
    words 0-31 and 32-63 (bn rows x g groups x 32 words, 128-byte swizzle) and 64-67 (bn x g x 4)."""
    n = w.shape[0]
    w32 = w.view(torch.int32).view(n, -1, 68)
    swz = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    shape, strides = list(w32.shape), list(w32.stride())
    return (TensorDescriptor(w32, shape, strides, [bn, g, 32], swz),
            TensorDescriptor(w32, shape, strides, [bn, g, 32], swz),
            TensorDescriptor(w32, shape, strides, [bn, g, 4], flat))


def gemv_q8_0(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
              *, config: tuple[int, ...] | None = None, quantized: tuple | None = None) -> torch.Tensor:
    """out = a @ W^T (+ bias) for one row of a (M = 1) over Q8_0 weights w (N, K / 32 x 34) uint8, K a multiple of
    256, in triton-q8's arithmetic (module docstring). quantized: quantize_q8_0(a) already made (benchmarks time
    the GEMV alone); config: (WARPS, G, STAGES, CTAS_PER_SM[, SPLITS]), tuning only (G is lowered to a power of two
    dividing K / 256; SPLITS, K splits of each row tile, auto_splits by default, must divide its K steps)."""
    N, K, nb = check_weights("gluon gemv_q8_0", a, w, 32, 34, 2)
    M, out = _check_common(a, N, K, bias, out, "gluon gemv_q8_0")
    if M != 1:
        raise ValueError(f"gluon gemv_q8_0: M={M}; the gluon GEMV takes one row of activations")
    if K % 256:
        raise ValueError(f"gluon gemv_q8_0: K={K} must be a multiple of 256 (rows of whole 272-byte groups of "
                         f"8 blocks for the bulk copies)")
    if not w.is_contiguous():
        raise ValueError("gluon gemv_q8_0: w must be contiguous (its rows one 2-D tensor for the bulk copies)")
    if w.numel() and w.data_ptr() % 16:
        raise ValueError(f"gluon gemv_q8_0: w must start at a 16-byte aligned address for the bulk copies (address "
                         f"mod 16 = {w.data_ptr() % 16})")
    if N == 0:
        return out
    if nb == 0:
        return out.copy_(bias.to(out.dtype).view(1, N) if bias is not None else torch.zeros_like(out))
    warps, g, stages, per_sm, *rest = config or GEMV_Q8_0_CONFIG
    ng = K // 256
    while ng % g:
        g //= 2
    q, d = quantized if quantized is not None else quantize_q8_0(a)
    bn = 32 // g * warps
    descs = descriptors(w, bn, g)
    grid, splits, ws, cnt = launch_plan("gluon gemv_q8_0", a.device, N, bn, ng // g, per_sm, rest, d,
                                        f"{g} groups")
    _gemv_q8_0_tma_kernel[grid](
        *descs, q.view(torch.int32), d, bias if bias is not None else d, out, ws, cnt, N, ng, out.stride(1),
        HAS_BIAS=bias is not None, WARPS=warps, G=g, STAGES=stages, SPLITS=splits, num_warps=warps)
    return out
