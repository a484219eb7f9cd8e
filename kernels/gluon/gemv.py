"""Q4_K x Q8_K GEMV (M = 1) in Gluon (Hopper): the weights streamed by bulk tensor copies.

The arithmetic of kernels/triton/gemm_q8.py's `_gemv_q4_k_q8_kernel` (its docstring states it; ggml's
mul_mat_vec_q): the activation row quantized to Q8_K by the Triton quantizer (quantize_q8_k: int8
codes, one fp32 d per 256, the sums of each 32 codes), for each 32-weight sub-block the integer sum of
code products (dp4a), times its 6-bit scale, minus the 6-bit min times the activation sums, times
d d_a (dmin d_a) in fp32. It claims gemm.gemm_nt's `emulated` reference, as triton-q8 does.

Why a second kernel: on an H200 the Triton GEMV reaches 68% of a pure read of the same bytes
(benchmarks/NOTES-gemm.md, fourth session of issue 33; its profile: L1 at 92%, every lane re-reading its
block's header and its chunk's activations). Here the weights reach shared memory by bulk copies:
- persistent CTAs (as many as divide the row tiles evenly, up to CTAS_PER_SM a multiprocessor) walk
  (row tile, K step) pairs; a K step is BN rows x KB blocks (144 bytes each: a 16-byte header of d,
  dmin and the packed scales, then 128 bytes of codes);
- the weight matrix is a 3-D int32 tensor (N, blocks, 36) to two tensor descriptors: the codes box
  (BN rows x KB blocks x 32 words from word 4, 128-byte swizzled) and the header box (BN x KB x 4
  words); a ring of STAGES shared-memory stages, each an mbarrier with its transaction bytes, keeps
  STAGES - 1 K steps in flight while the warps compute one (a CTA-wide barrier at the end of each step
  frees its stage);
- each thread owns one 64-weight chunk (eight code words) of one row in each of the step's KB blocks:
  16 chained dp4a a chunk (the high nibbles masked in place, 16 x the code, the 16 shifted out of
  the sum), the row's 4 header words split from one 16-byte load, its two sub-blocks' scale / min, one
  fp32 term; the chunks of a row summed across its four threads once per row tile.
- the step's activation codes, sums and scales are loaded before the wait for its weights, so that their
  latency runs under the copy's;
- where the row tiles leave resident CTAs idle, each tile's K is split (auto_splits) and the tile's last CTA
  sums the fp32 partials in split order (the bits do not depend on which split arrives last).
Measured (H200, reports/baselines/gluon-gemv-bench-h200.json run 11, default (2, 2, 2, 8)): 14336 x 4096 14.2 us =
77.3% of the pure read of the same bytes (triton-q8 16.0 us, 68.6%); 4096 x 14336 (4 splits) 15.5 us = 73.4% (17.7 us,
64.2%): past the Triton kernel, short of the 95% goal; NOTES-gemm.md has the profiles and what is next.
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
from kernel_parity.kernels.triton.gemm import _check_common, _sm_count, check_weights
from kernel_parity.kernels.triton.gemm_q8 import quantize_q8_k

# (WARPS, KB, STAGES, CTAS_PER_SM): BN = 8 x WARPS rows a tile, KB 256-blocks a K step. The fastest of the
# eighteen measured on an H200 at both Llama-3-8B shapes (gluon-gemv-bench-h200.json runs 10-11; (4, 4, 2, 6), the
# default before, 70.8% / 64.7% of the pure read against 77.3% / 73.4%): occupancy over ring depth, two blocks a
# step (68 registers: 8 CTAs of 2 warps fit a multiprocessor).
GEMV_CONFIG = (2, 2, 2, 8)
_tma_load, _ = tma_ops()
_barrier = barrier_op()


@gluon.jit
def _dp4a(w, a, c):
    """c + sum_i w.byte[i] * a.sbyte[i] (w's bytes unsigned nibbles here, a's signed codes)."""
    return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, c], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _split8(x):
    """The 8 slices x[..., j] of x's last dim (held whole by each thread), in the order j = 0, 4, 2, 6, 1, 5, 3, 7:
    only the pairing of two tensors split alike matters to a dot."""
    e, o = gl.split(x.reshape(x.shape[:-1] + [2, 2, 2]))
    e0, e1 = gl.split(e)
    o0, o1 = gl.split(o)
    x0, x4 = gl.split(e0)
    x2, x6 = gl.split(e1)
    x1, x5 = gl.split(o0)
    x3, x7 = gl.split(o1)
    return x0, x4, x2, x6, x1, x5, x3, x7


@gluon.jit
def _issue(codes_desc, hdr_desc, codes, hdrs, ready, j, pid, G, kps, BN: gl.constexpr, KB: gl.constexpr,
           STAGES: gl.constexpr, SPLITS: gl.constexpr):
    """The two bulk copies of pipeline slot j (this CTA's work item j // kps = (row tile, K split), its K step
    j % kps): BN rows x KB blocks of codes (32 words a block, from word 4) and of headers (words 0-3)."""
    s = j % STAGES
    item = pid + (j // kps) * G
    r0 = (item // SPLITS) * BN
    kb0 = ((item % SPLITS) * kps + j % kps) * KB
    bar = ready.index(s)
    mbarrier.expect(bar, codes_desc.block_type.nbytes + hdr_desc.block_type.nbytes)
    _tma_load(codes_desc, [r0, kb0, 4], bar, codes.index(s))
    _tma_load(hdr_desc, [r0, kb0, 0], bar, hdrs.index(s))


@gluon.jit
def _tile_out(res, rows_r, item, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_cn, HAS_BIAS: gl.constexpr,
              BN: gl.constexpr, SPLITS: gl.constexpr):
    """The end of work item `item` (row tile item // SPLITS, K split item % SPLITS): res, its BN row sums (rows_r
    0 .. BN - 1 in res's layout), plus the bias to out; or, when K is split, the partial to the workspace and, by the
    tile's last split to arrive, the sum of all partials in split order (the bits do not depend on who came last)."""
    tile = item // SPLITS
    rows = tile * BN + rows_r
    if SPLITS == 1:
        if HAS_BIAS:
            res += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        gl.store(out_ptr + rows * stride_cn, res.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:
        gl.store(ws_ptr + (item % SPLITS) * N + rows, res, mask=rows < N)
        _barrier()  # every thread's partial before the release below
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tot = gl.zeros_like(res)
            for sp in gl.static_range(SPLITS):  # a fixed order: the sum does not depend on who came last
                tot += gl.load(ws_ptr + sp * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
            gl.store(out_ptr + rows * stride_cn, tot.to(out_ptr.dtype.element_ty), mask=rows < N)
            gl.store(cnt_ptr + tile, 0)  # the counter back to zero for the next call


@gluon.jit
def _gemv_q4_k_tma_kernel(codes_desc, hdr_desc, q_ptr, d_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_blocks,
                          stride_cn, HAS_BIAS: gl.constexpr, WARPS: gl.constexpr, KB: gl.constexpr,
                          STAGES: gl.constexpr, SPLITS: gl.constexpr):
    BN: gl.constexpr = 8 * WARPS
    # [rows, blocks, chunks, words]: a thread holds the 8 code words of one chunk of one row in each of the KB
    # blocks of a K step; its row's 4 header words of each block (replicated over the row's 4 chunk threads)
    L4: gl.constexpr = gl.BlockedLayout([1, KB, 1, 8], [8, 1, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    LC: gl.constexpr = gl.BlockedLayout([1, KB, 8], [8, 1, 4], [WARPS, 1, 1], [2, 1, 0])  # codes, [rows, blocks, 32]
    LH: gl.constexpr = gl.BlockedLayout([1, KB, 4], [8, 1, 4], [WARPS, 1, 1], [2, 1, 0])  # headers, [rows, blocks, 4]
    LS: gl.constexpr = gl.SliceLayout(3, L4)  # [rows, blocks, chunks]
    LB: gl.constexpr = gl.SliceLayout(2, LS)  # [rows, blocks]
    LQ: gl.constexpr = gl.SliceLayout(1, LS)  # [rows, chunks]: the K step's sums, reduced across threads per tile
    LR: gl.constexpr = gl.SliceLayout(1, LQ)  # [rows]

    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_items = gl.cdiv(N, BN) * SPLITS  # (row tile, K split) pairs; SPLITS divides the K steps
    kps = n_blocks // KB // SPLITS  # K steps a work item
    total = ((n_items - pid + G - 1) // G) * kps

    codes = gl.allocate_shared_memory(gl.int32, [STAGES, BN, KB, 32], codes_desc.layout)
    hdrs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, KB, 4], hdr_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(ready.index(k), count=1)
    for p in gl.static_range(STAGES - 1):
        if p < total:
            _issue(codes_desc, hdr_desc, codes, hdrs, ready, p, pid, G, kps, BN, KB, STAGES, SPLITS)

    LA: gl.constexpr = gl.SliceLayout(0, L4)  # [blocks, chunks, words]
    b_a = gl.arange(0, KB, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA)))[:, None, None]
    c_a = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA)))[None, :, None]
    w_a = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA)))[None, None, :]
    act_off = 64 * b_a + 16 * c_a + w_a  # chunk c's low-nibble partners in block b of the step; + 8: the high's
    LSB: gl.constexpr = gl.SliceLayout(0, LS)  # [blocks, chunks]
    c_s = gl.arange(0, 4, layout=gl.SliceLayout(0, LSB))[None, :]
    b_s = gl.arange(0, KB, layout=gl.SliceLayout(1, LSB))[:, None]
    sh = (16 * (c_s % 2))[None, :, :]
    lo_c = (c_s < 2)[None, :, :]
    b_d = gl.arange(0, KB, layout=gl.SliceLayout(0, LB))
    rows_r = gl.arange(0, BN, layout=LR)
    acc = gl.zeros([BN, 4], gl.float32, LQ)
    for i in range(total):
        j = i + STAGES - 1
        if j < total:  # into the stage read at i - 1: every thread passed the barrier at its end
            _issue(codes_desc, hdr_desc, codes, hdrs, ready, j, pid, G, kps, BN, KB, STAGES, SPLITS)
        st = i % STAGES
        item = pid + (i // kps) * G
        kb0 = ((item % SPLITS) * kps + i % kps) * KB
        # the step's activations (codes, sums, scales) are loaded before the wait for its weights: their latency runs
        # under the copy's instead of after it (ncu: long-scoreboard stalls 6.7 an issued instruction without this)
        a_lo = gl.load(q_ptr + kb0 * 64 + act_off)[None]
        a_hi = gl.load(q_ptr + kb0 * 64 + 8 + act_off)[None]
        bs0 = gl.load(s_ptr + (kb0 + b_s) * 8 + 2 * c_s)[None]
        bs1 = gl.load(s_ptr + (kb0 + b_s) * 8 + 2 * c_s + 1)[None]
        da = gl.load(d_ptr + kb0 + b_d)[None, :, None]
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        w = codes.index(st).load(LC).reshape([BN, KB, 4, 8])
        h02, h13 = gl.split(hdrs.index(st).load(LH).reshape([BN, KB, 2, 2]))  # words (0, 2) and (1, 3)
        dd, s1 = gl.split(h02)  # word 0: d | dmin << 16; word 2: scales 4-7
        s0, s2 = gl.split(h13)  # words 1 and 3: scales 0-3, 8-11
        dd = gl.convert_layout(dd, LB)[:, :, None]
        s0 = gl.convert_layout(s0, LB)[:, :, None]
        s1 = gl.convert_layout(s1, LB)[:, :, None]
        s2 = gl.convert_layout(s2, LB)[:, :, None]
        wv = _split8(w)
        lv = _split8(a_lo)
        hv = _split8(a_hi)
        s_lo = gl.zeros_like(wv[0])
        s_hi = gl.zeros_like(wv[0])
        for t in gl.static_range(8):  # high nibbles in place (16 x the code): one mask a word, the 16 shifted out once
            s_lo = _dp4a(wv[t] & 0x0F0F0F0F, lv[t], s_lo)
            s_hi = _dp4a(wv[t] & -252645136, hv[t], s_hi)  # 0xF0F0F0F0 as an int32
        s_lo = gl.convert_layout(s_lo, LS)
        s_hi = gl.convert_layout(s_hi >> 4, LS)  # exact: a sum of multiples of 16
        S0 = s0 >> sh
        S1 = s1 >> sh
        S2 = s2 >> sh
        scp = gl.where(lo_c, S0, (S2 & 0x0F0F) | ((S0 >> 2) & 0x3030))
        mnp = gl.where(lo_c, S1, ((S2 >> 4) & 0x0F0F) | ((S1 >> 2) & 0x3030))
        isum = (scp & 63) * s_lo + ((scp >> 8) & 63) * s_hi
        msum = (mnp & 63) * bs0 + ((mnp >> 8) & 63) * bs1
        d = (dd & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        dmin = ((dd >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        acc += gl.sum((d * da) * isum.to(gl.float32) - (dmin * da) * msum.to(gl.float32), axis=1)
        if i % kps == kps - 1:
            _tile_out(gl.sum(acc, axis=1), rows_r, item, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_cn, HAS_BIAS,
                      BN, SPLITS)
            acc = gl.zeros([BN, 4], gl.float32, LQ)
        _barrier()
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(k))


def descriptors(w: torch.Tensor, bn: int, kb: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The codes (bn rows x kb blocks x 32 words, 128-byte swizzle) and header (bn x kb x 4 words) descriptors of
    Q4_K rows w (N, nb x 144) uint8, seen as int32 (N, nb, 36)."""
    n = w.shape[0]
    w32 = w.view(torch.int32).view(n, -1, 36)
    codes_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    hdr_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    return (TensorDescriptor(w32, list(w32.shape), list(w32.stride()), [bn, kb, 32], codes_layout),
            TensorDescriptor(w32, list(w32.shape), list(w32.stride()), [bn, kb, 4], hdr_layout))


MAX_SPLITS = 8
_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """n int32 zeros on device: the split-K arrival counters, kept between calls (each tile's last split puts its
    counter back to 0). One set per device: two split calls in flight at once on different streams would share it."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def auto_splits(n_tiles: int, ksteps: int, slots: int) -> int:
    """K splits for n_tiles row tiles of ksteps K steps on `slots` resident CTAs: 1 when the tiles fill them, else
    the divisor s of ksteps (<= MAX_SPLITS) whose busiest CTA does the least: ceil(n_tiles s / slots) items of
    ksteps / s steps plus one step's worth of epilogue each (the smallest s on a tie). On an H200 (132 SMs x 6)
    this keeps 14336 x 4096 whole (448 tiles: 2 splits ran 57.6% of the read ceiling vs 65.0% unsplit) and gives
    4096 x 14336 7 splits (128 tiles: 58.8% vs 52.9%)."""
    if n_tiles >= slots:
        return 1
    divisors = [s for s in range(1, min(ksteps, MAX_SPLITS) + 1) if ksteps % s == 0]
    return min(divisors, key=lambda s: -(-n_tiles * s // slots) * (ksteps // s + 1))


def launch_plan(name: str, device, n: int, bn: int, ksteps: int, per_sm: int, rest, dummy: torch.Tensor,
                step: str) -> tuple:
    """The persistent launch of a GEMV over cdiv(n, bn) row tiles of `ksteps` K steps (`step` says what one step
    is, for the error): (grid, K splits, the fp32 split workspace (splits, n), the tiles' arrival counters). The
    splits are rest[0] when the config names them (they must divide ksteps), else auto_splits over per_sm resident
    CTAs a multiprocessor; the grid gives every CTA the same number of work items (+- 1). Unsplit, both buffers
    are `dummy` (the kernel never touches them)."""
    n_tiles = triton.cdiv(n, bn)
    slots = per_sm * _sm_count(device)
    splits = rest[0] if rest and rest[0] else auto_splits(n_tiles, ksteps, slots)
    if ksteps % splits:
        raise ValueError(f"{name}: {splits} K splits do not divide {ksteps} K steps of {step}")
    items = n_tiles * splits
    waves = triton.cdiv(items, slots)
    if splits == 1:
        return (triton.cdiv(items, waves),), 1, dummy, dummy
    ws = torch.empty((splits, n), dtype=torch.float32, device=device)
    return (triton.cdiv(items, waves),), splits, ws, _counters(device, n_tiles)


def gemv_q4_k(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
              *, config: tuple[int, ...] | None = None, quantized: tuple | None = None) -> torch.Tensor:
    """out = a @ W^T (+ bias) for one row of a (M = 1) over Q4_K weights w (N, K / 256 x 144) uint8, in
    triton-q8's arithmetic (module docstring). quantized: quantize_q8_k(a) already made (benchmarks time
    the GEMV alone); config: (WARPS, KB, STAGES, CTAS_PER_SM[, SPLITS]), tuning only (KB is lowered to a power
    of two dividing K / 256; SPLITS, K splits of each row tile, auto_splits by default, must divide its K steps)."""
    N, K, nb = check_weights("gluon gemv_q4_k", a, w, 256, 144, 16)
    M, out = _check_common(a, N, K, bias, out, "gluon gemv_q4_k")
    if M != 1:
        raise ValueError(f"gluon gemv_q4_k: M={M}; the gluon GEMV takes one row of activations")
    if not w.is_contiguous():
        raise ValueError("gluon gemv_q4_k: w must be contiguous (its rows one 2-D tensor for the bulk copies)")
    if N == 0:
        return out
    if nb == 0:
        return out.copy_(bias.to(out.dtype).view(1, N) if bias is not None else torch.zeros_like(out))
    warps, kb, stages, per_sm, *rest = config or GEMV_CONFIG
    while nb % kb:
        kb //= 2
    q, d, s = quantized if quantized is not None else quantize_q8_k(a)
    bn = 8 * warps
    codes_desc, hdr_desc = descriptors(w, bn, kb)
    grid, splits, ws, cnt = launch_plan("gluon gemv_q4_k", a.device, N, bn, nb // kb, per_sm, rest, d,
                                        f"{kb} blocks")
    _gemv_q4_k_tma_kernel[grid](
        codes_desc, hdr_desc, q.view(torch.int32), d, s, bias if bias is not None else d, out, ws, cnt, N, nb,
        out.stride(1), HAS_BIAS=bias is not None, WARPS=warps, KB=kb, STAGES=stages, SPLITS=splits, num_warps=warps)
    return out
