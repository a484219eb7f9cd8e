"""MLA decode over a paged latent cache in Gluon (Hopper), after FlashMLA's seesaw: two consumer warp groups,
each with its own key tile.

The arithmetic of kernels/triton/mla.py's mla_decode (its docstring states the conventions): one latent kv
head, d = d_v + d_pe = 512 + 64, V = the first d_v dims of the cached row,

    s_ij  = scale q_i . c_j            -inf past the request's length (causal: keys <= L - s_q + s_i)
    LSE_i = ln sum_j exp(s_ij)         -inf, O_i = 0 for a row with no visible key
    O_i   = sum_j exp(s_ij - LSE_i) c_j[:d_v]

Structure. A program owns 64 query rows of one request; the 64 x 512 fp32 output is split by columns between
two consumer warp groups (O_L: value dims 0-255 in group 0, O_R: 256-511 in group 1). Key tiles of 64 (one
page) go to the groups in turn: group 0 takes tiles 0, 2, 4, ... and group 1 tiles 1, 3, 5, ..., each computing
its tile's logits over the whole 576-dim depth. Per pair of tiles
(t0 = 2i, t1 = 2i + 1), with m the running row max:

    group 0: S0 = Q K0^T;  m0 = max(m, rowmax S0);  P0 = exp2(S0 - m0);  a0 = exp2(m - m0)
             P0 (bf16) to the tile's rope slot in shared memory, m0 and a0 beside it; then
             O_L = a0 O_L + P0 V0_L  (P0 from registers)
    group 1: S1 = Q K1^T (issued at once, under group 0's softmax); waits for group 0's P0:
             O_R = a0 O_R + P0 V0_R  (P0 from shared memory), under which it runs its own softmax:
             m1 = max(m0, rowmax S1);  P1 = exp2(S1 - m1);  a1 = exp2(m0 - m1);  P1, a1, m1 to shared memory;
             O_R = a1 O_R + P1 V1_R
    group 0: waits for P1:  O_L = a1 O_L + P1 V1_L  (P1 from shared memory);  m = m1

so each group's softmax runs while the other's dots are on the tensor cores, and neither waits for a whole
tile's partial logits. The row sums are kept in two parts (group 0 adds rowsum P0, group 1 rowsum P1, both
rescaled as their O) and added at the end. A tile's 64 rope dims are dead once its logits are computed: its
P (64 x 64 bf16, the same 8 KB and swizzled layout) is written over them, so Q (72 KB) and two key tiles (2 x
72 KB) fit in shared memory with nothing else but the row statistics. A one-warp producer loads Q once and
each tile from the page the block table names (the page a multiple of 64). The slots past the request's
length in its last page may hold anything (the gate fills them with NaN): their logits are masked, and the
tile's owner zeroes both halves of those V rows in shared memory before handing the tile over.

Measured on an H200 (bf16, b 128, h_q 128 s_q 1 / h_q 64 s_q 2, 4K / 16K keys; benchmarks/gpu_gluon.py --sections
mla, reports/baselines/gluon-mla-bench-h200.json run 8): 430-446 TFLOP/s = 53.4-55.4% of the bf16 matmul rate
measured in the same run (804), 2.2x the Triton mla_decode. The kernel it replaced split the QK depth between
the groups (each 288 of the 576 dims of the same 32-key tile, the fp32 partial logits exchanged through shared
memory every tile): 411-413 TFLOP/s in the same run (397-414 over four runs, 42% before its exchange buffer was
swizzled); ncu had its tensor pipe at 44-45% of cycles with barrier stalls first, both groups waiting on each
other at every tile. The goal (60%) is not reached: ptxas spills 40 bytes (60 causal) of the groups' registers
(232 each: O's half, S, P, the statistics), and the producer can run only one tile ahead of each group (two
72 KB key buffers beside Q's 72 KB).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import barrier_op, tma_ops, ws_list

LOG2E = 1.4426950408889634
REGS = (232, 40)  # setmaxnreg: the two consumer groups, the producer warp group

_tma_load, _ = tma_ops()
_barrier = barrier_op()
BN = gl.constexpr(64)  # keys a tile (= the smallest page the kernel takes)
HALF_V, D_V, D_PE = gl.constexpr(256), gl.constexpr(512), gl.constexpr(64)
# the row statistics in shared memory: [8, 64] fp32 rows
M0, A0, M1, A1, LA, LB = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3), gl.constexpr(4), \
    gl.constexpr(5)


@gluon.constexpr_function
def _mma_layout(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(getattr(n, "value", n)), 16])


@gluon.constexpr_function
def _p_layout():
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(256), k_width=2)


@gluon.constexpr_function
def _zero_layout():
    """A (16, 256) slab of V rows over one warp group."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0])


@gluon.jit
def _tiles(L, s_q, m0, h_q, CAUSAL: gl.constexpr):
    """(tiles every row of the block sees whole, tiles to visit) for keys [0, L)."""
    if CAUSAL:
        lo = gl.maximum(L - s_q + m0 // h_q + 1, 0)  # the block's first row has the smallest limit
    else:
        lo = L
    return lo // BN, gl.cdiv(L, BN)


@gluon.jit
def _producer(qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready, kv_empty,
              table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page, CAUSAL: gl.constexpr):
    b = gl.program_id(1)
    m0 = gl.program_id(0) * 64
    row0 = b * rows_per_req + m0
    mbarrier.expect(q_bar, 2 * qn_desc.block_type.nbytes + qp_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(qn_desc, [row0, w * HALF_V], q_bar, qn_smem.index(w))
    _tma_load(qp_desc, [row0, D_V], q_bar, qp_smem)
    L = gl.load(seqlens_ptr + b)
    _full, n_tiles = _tiles(L, s_q, m0, h_q, CAUSAL)
    tb_row = table_ptr + b.to(gl.int64) * stride_tb
    blk_next = gl.load(tb_row)  # tile 0's page; each tile's page is read one tile ahead, under the wait below
    for t in range(n_tiles):
        s = t % 2  # tile t lives in buffer t % 2: its owner is group t % 2
        key = t * BN
        blk = blk_next
        blk_next = gl.load(tb_row + gl.minimum(key + BN, (n_tiles - 1) * BN) // page)
        mbarrier.wait(kv_empty.index(s), ((t // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        r = blk * page + key % page
        bar = kv_ready.index(s)
        mbarrier.expect(bar, 2 * kn_desc.block_type.nbytes + kp_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_load(kn_desc, [r, w * HALF_V], bar, kn_bufs.index(s * 2 + w))
        _tma_load(kp_desc, [r, D_V], bar, kp_bufs.index(s))


@gluon.jit
def _qk(qn_smem, qp_smem, kn_bufs, kp_bufs, kv_ready, t):
    """Wait for tile t and issue its whole-depth logits S = Q K_t^T (async)."""
    s = t % 2
    mbarrier.wait(kv_ready.index(s), (t // 2) & 1)
    acc = warpgroup_mma(qn_smem.index(0), kn_bufs.index(s * 2).permute((1, 0)),
                        gl.zeros([64, BN], gl.float32, _mma_layout(BN)), use_acc=False, is_async=True)
    acc = warpgroup_mma(qn_smem.index(1), kn_bufs.index(s * 2 + 1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(qp_smem, kp_bufs.index(s).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _softmax(sc, m_prev, t, full, limit, L, qk_scale, kn_bufs):
    """Tile t's logits scaled and masked (t >= full), its V rows past L zeroed in both halves (the tile holding
    the request's last key): (P in V's dtype, its fp32 row sums, the new row max, the rescale factor
    exp2(m_prev - m_new))."""
    s_layout: gl.constexpr = _mma_layout(BN)
    sc = sc * qk_scale
    if t >= full:
        cols = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        sc = gl.where(cols[None, :] < limit[:, None], sc, float("-inf"))
        if t * BN + BN > L:
            z_layout: gl.constexpr = _zero_layout()
            for w in gl.static_range(2):
                for c in gl.static_range(4):
                    slab = kn_bufs.index((t % 2) * 2 + w).slice(c * 16, 16)
                    vr = slab.load(z_layout)
                    keys = t * BN + c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, z_layout))
                    slab.store(gl.where((keys < L)[:, None], vr, gl.zeros_like(vr)))
            fence_async_shared()  # the generic-proxy stores before the tensor cores' reads
            _barrier()
    m_new = gl.maximum(m_prev, gl.max(sc, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    return p.to(kn_bufs.dtype), gl.sum(p, axis=1), m_new, gl.exp2(m_prev - m_use)


@gluon.jit
def _publish(p, m_new, alpha, kp_bufs, stats, ready, t, M_ROW: gl.constexpr, A_ROW: gl.constexpr):
    """Tile t's P over its dead rope slot and (m_new, alpha) to the statistics rows; then signal the partner."""
    kp_bufs.index(t % 2).store(p)
    stats.index(M_ROW).store(m_new)
    stats.index(A_ROW).store(alpha)
    fence_async_shared()  # P is read by the partner's wgmma (async proxy)
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _epilogue(acc, l_own, stats, fin, o_ptr, lse_ptr, m_fin, rows_per_req, h_q, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ls, WG: gl.constexpr):
    """Both groups' row sums added through shared memory; O = acc / l (0 for a row with no key); group 0 writes
    LSE = (m + log2 l) ln 2 (-inf for such a row)."""
    o_layout: gl.constexpr = _mma_layout(HALF_V)
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    b = gl.program_id(1)
    m0 = gl.program_id(0) * 64
    stats.index(LA + WG).store(l_own)
    mbarrier.arrive(fin.index(WG), count=1)
    mbarrier.wait(fin.index(1 - WG), 0)
    l_i = l_own + stats.index(LA + 1 - WG).load(row_s)
    seen = l_i > 0.0
    inv = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    out = acc * gl.convert_layout(inv, o_row)[:, None]
    rows_o = m0 + gl.arange(0, 64, layout=o_row)
    cols_o = WG * HALF_V + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + b.to(gl.int64) * stride_ob + ((rows_o // h_q) * stride_os + (rows_o % h_q) * stride_oh)[:, None] \
        + cols_o[None, :]
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows_o < rows_per_req)[:, None])
    if WG == 0:
        rows = m0 + gl.arange(0, 64, layout=row_s)
        lse = gl.where(seen, (m_fin + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + b.to(gl.int64) * stride_lb + (rows % h_q) * stride_lh + (rows // h_q) * stride_ls, lse,
                 mask=rows < rows_per_req)


@gluon.jit
def _limits(L, s_q, h_q, CAUSAL: gl.constexpr):
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    rows = gl.program_id(0) * 64 + gl.arange(0, 64, layout=row_s)
    if CAUSAL:
        limit = L - s_q + rows // h_q + 1  # keys < limit are visible
    else:
        limit = gl.zeros([64], gl.int32, row_s) + L
    return limit


@gluon.jit
def _group_start(seqlens_ptr, s_q, h_q, q_bar, CAUSAL: gl.constexpr):
    """A consumer group's start: the request's length, its tiles (seen whole, to visit), the rows' key limits,
    O's half, the running max and sum; then Q landed."""
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    L = gl.load(seqlens_ptr + gl.program_id(1))
    full, n_tiles = _tiles(L, s_q, gl.program_id(0) * 64, h_q, CAUSAL)
    limit = _limits(L, s_q, h_q, CAUSAL)
    acc = gl.zeros([64, HALF_V], gl.float32, _mma_layout(HALF_V))
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    return L, full, n_tiles, limit, acc, m_i, l_i


@gluon.jit
def _group0(qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr, lse_ptr,
            seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
            stride_ls, CAUSAL: gl.constexpr):
    """Tiles 0, 2, 4, ...; O_L (value dims 0-255)."""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(HALF_V))
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    L, full, n_tiles, limit, acc, m_i, l_i = _group_start(seqlens_ptr, s_q, h_q, q_bar, CAUSAL)
    for i in range(gl.cdiv(n_tiles, 2)):
        t0 = 2 * i
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(_qk(qn_smem, qp_smem, kn_bufs, kp_bufs, kv_ready, t0), ))
        p, p_sum, m_new, alpha = _softmax(sc, m_i, t0, full, limit, L, qk_scale, kn_bufs)
        _publish(p, m_new, alpha, kp_bufs, stats, ready.index(0), t0, M0, A0)
        l_i = l_i * alpha + p_sum
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        p16 = gl.convert_layout(p, _p_layout())
        tok = warpgroup_mma(p16, kn_bufs.index(0), acc, is_async=True)  # P0 V0_L, in flight over the wait for P1
        m_i = m_new
        if t0 + 1 < n_tiles:
            mbarrier.wait(ready.index(1), i & 1)  # group 1's P1, a1, m1
            alpha1 = stats.index(A1).load(row_s)
            m_i = stats.index(M1).load(row_s)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
            acc = acc * gl.convert_layout(alpha1, o_row)[:, None]
            l_i = l_i * alpha1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(kp_bufs.index(1), kn_bufs.index(2), acc,
                                                                             is_async=True), ))
            mbarrier.arrive(kv_empty.index(1), count=1)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
    _epilogue(acc, l_i, stats, fin, o_ptr, lse_ptr, m_i, rows_per_req, h_q, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ls, 0)


@gluon.jit
def _group1(qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr, lse_ptr,
            seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
            stride_ls, CAUSAL: gl.constexpr):
    """Tiles 1, 3, 5, ...; O_R (value dims 256-511)."""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(HALF_V))
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    L, full, n_tiles, limit, acc, m_i, l_i = _group_start(seqlens_ptr, s_q, h_q, q_bar, CAUSAL)
    for i in range(gl.cdiv(n_tiles, 2)):
        t1 = 2 * i + 1
        if t1 < n_tiles:
            sc = _qk(qn_smem, qp_smem, kn_bufs, kp_bufs, kv_ready, t1)
            mbarrier.wait(ready.index(0), i & 1)  # group 0's P0, a0, m0
            mbarrier.wait(kv_ready.index(0), i & 1)  # V0 (seen by group 0 already)
            alpha0 = stats.index(A0).load(row_s)
            m0 = stats.index(M0).load(row_s)
            acc = acc * gl.convert_layout(alpha0, o_row)[:, None]
            l_i = l_i * alpha0
            tok = warpgroup_mma(kp_bufs.index(0), kn_bufs.index(1), acc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc, ))  # S1 in; P0 V0_R in flight
            p, p_sum, m_new, alpha = _softmax(sc, m0, t1, full, limit, L, qk_scale, kn_bufs)
            _publish(p, m_new, alpha, kp_bufs, stats, ready.index(1), t1, M1, A1)
            l_i = l_i * alpha + p_sum
            p16 = gl.convert_layout(p, _p_layout())
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
            acc = acc * gl.convert_layout(alpha, o_row)[:, None]
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(p16, kn_bufs.index(3), acc,
                                                                             is_async=True), ))
            mbarrier.arrive(kv_empty.index(1), count=1)
            m_i = m_new
        else:  # the odd last tile: group 0's alone
            mbarrier.wait(ready.index(0), i & 1)
            mbarrier.wait(kv_ready.index(0), i & 1)
            alpha0 = stats.index(A0).load(row_s)
            m_i = stats.index(M0).load(row_s)
            acc = acc * gl.convert_layout(alpha0, o_row)[:, None]
            l_i = l_i * alpha0
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(kp_bufs.index(0), kn_bufs.index(1), acc,
                                                                             is_async=True), ))
            mbarrier.arrive(kv_empty.index(0), count=1)
    _epilogue(acc, l_i, stats, fin, o_ptr, lse_ptr, m_i, rows_per_req, h_q, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ls, 1)


@gluon.jit
def _mla_seesaw_kernel(qn_desc, qp_desc, kn_desc, kp_desc, o_ptr, lse_ptr, table_ptr, seqlens_ptr, stride_tb,
                       rows_per_req, s_q, h_q, page, qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                       stride_ls, CAUSAL: gl.constexpr, REGS_MMA: gl.constexpr, REGS_LOAD: gl.constexpr,
                       WS_LIST: gl.constexpr):
    qn_smem = gl.allocate_shared_memory(qn_desc.dtype, [2, 64, HALF_V], qn_desc.layout)
    qp_smem = gl.allocate_shared_memory(qp_desc.dtype, [64, D_PE], qp_desc.layout)
    kn_bufs = gl.allocate_shared_memory(kn_desc.dtype, [4, BN, HALF_V], kn_desc.layout)  # buffer s, half w: s * 2 + w
    kp_bufs = gl.allocate_shared_memory(kp_desc.dtype, [2, BN, D_PE], kp_desc.layout)  # rope dims, then P
    stats = gl.allocate_shared_memory(gl.float32, [8, 64],  # rows of 64: the layout is a row's (rank 1)
                                      gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warp group
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(fin.index(i), count=1)
    if WS_LIST:
        gl.warp_specialize([
            (_group0, (qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr,
                       lse_ptr, seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh,
                       stride_lb, stride_lh, stride_ls, CAUSAL)),
            (_group1, (qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr,
                       lse_ptr, seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh,
                       stride_lb, stride_lh, stride_ls, CAUSAL)),
            (_producer, (qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready,
                         kv_empty, table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page, CAUSAL)),
        ], [4, 1], [REGS_MMA, REGS_LOAD])
    else:
        gl.warp_specialize(
            (qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr,
             lse_ptr, seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh,
             stride_lb, stride_lh, stride_ls, CAUSAL), _group0,
            [(qn_smem, qp_smem, kn_bufs, kp_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, o_ptr,
              lse_ptr, seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ls, CAUSAL),
             (qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready,
              kv_empty, table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page, CAUSAL)],
            [_group1, _producer], [4, 1], [REGS_MMA, REGS_LOAD])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(fin.index(i))


def supported(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int) -> str | None:
    """None, or why the kernel cannot take these operands."""
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return f"the gluon MLA decode takes bf16 / fp16 q and cache of one dtype, not {q.dtype} / {kv_cache.dtype}"
    if q.shape[-1] != 576 or d_v != 512 or kv_cache.shape[-1] != 576:
        return f"the gluon MLA decode takes d = 576, d_v = 512, not d={q.shape[-1]}, d_v={d_v}"
    if kv_cache.shape[2] != 1:
        return f"the gluon MLA decode takes one latent kv head, not h_kv={kv_cache.shape[2]}"
    if (q.shape[1] * q.shape[2]) % 64:
        return f"the gluon MLA decode takes s_q x h_q a multiple of 64 rows, not {q.shape[1]} x {q.shape[2]}"
    if kv_cache.shape[1] % 64:
        return f"the gluon MLA decode takes a page size that is a multiple of 64, not {kv_cache.shape[1]}"
    return None


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
               scale: float, d_v: int = 512, causal: bool = True, out: torch.Tensor | None = None,
               out_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode on a Hopper GPU (kernels/triton/mla.py's mla_decode without splits).

    q: (b, s_q, h_q, 576) bf16 / fp16, contiguous rows; s_q * h_q a multiple of 64
    kv_cache: (num_blocks, page, 1, 576) q's dtype; page a multiple of 64
    block_table: (b, max_blocks) int32; seqlens: (b,) int32 on q's device
    out: (b, s_q, h_q, 512) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32
    returns (out, out_lse), LSE natural log; a row with no visible key: O = 0, LSE = -inf
    """
    what = "gluon mla_decode"
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_cuda:
            raise ValueError(f"{what}: {name} must be a 4-D CUDA tensor, got {tuple(getattr(t, 'shape', ()))}")
    why = supported(q, kv_cache, d_v)
    if why:
        raise ValueError(f"{what}: {why}")
    b, s_q, h_q, d = q.shape
    for name, t, shape in (("block_table", block_table, 2), ("seqlens", seqlens, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != shape or t.dtype != torch.int32 or t.device != q.device \
                or t.shape[0] != b:
            raise ValueError(f"{what}: {name} must be a {shape}-D int32 tensor of {b} rows on {q.device}")
    if out is None:
        out = torch.empty((b, s_q, h_q, 512), dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (b, s_q, h_q, 512) or out.dtype != q.dtype or out.stride(3) != 1:
        raise ValueError(f"{what}: out must be a ({b}, {s_q}, {h_q}, 512) {q.dtype} tensor, last stride 1")
    if out_lse is None:
        out_lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    elif tuple(out_lse.shape) != (b, h_q, s_q) or out_lse.dtype != torch.float32:
        raise ValueError(f"{what}: out_lse must be a ({b}, {h_q}, {s_q}) float32 tensor")
    if b == 0:
        return out, out_lse
    rows = s_q * h_q
    q2 = q if q.is_contiguous() else q.contiguous()
    q2 = q2.view(b * rows, d)
    c = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
    c2 = c.view(-1, d)
    elt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t, box):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, gl.NVMMASharedLayout.get_default_for(box, elt))

    grid = (rows // 64, b)
    _mla_seesaw_kernel[grid](
        desc(q2, [64, 256]), desc(q2, [64, 64]), desc(c2, [64, 256]), desc(c2, [64, 64]),
        out, out_lse, block_table, seqlens, block_table.stride(0), rows, s_q, h_q, kv_cache.shape[1],
        float(scale) * LOG2E, out.stride(0), out.stride(1), out.stride(2), *out_lse.stride(),
        CAUSAL=bool(causal) and s_q > 1, REGS_MMA=REGS[0], REGS_LOAD=REGS[1], WS_LIST=ws_list(), num_warps=4,
        enable_fp_fusion=False,
    )
    return out, out_lse
