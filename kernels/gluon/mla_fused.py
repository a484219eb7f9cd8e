"""The attention of MAX's fused FP8 MLA decode branch in Gluon (Hopper): the cached keys' part, after FlashMLA's
seesaw, at the fp32 grade of kernels/triton/mla_fused.py.

kernels/triton/mla_fused.py's docstring states the branch and its conventions; this module runs its launches 1, 2
and 4 (RMSNorm + RoPE of the new rows, the two FP8 bmms) and 3's new keys as they are, and replaces the part of
3 that costs: every query row of a request against the keys cached before this step, [0, cache_lengths[r]) (all
of them visible to every new token: no mask but the length). Its online-softmax state per row (the unnormalised
fp32 accumulator, the running max in the log2 domain, the sum) goes to a scratch buffer, and the Triton kernel
(`STATE=True`) continues from it over this step's tokens (their fp32 rows, IEEE dots), adds the sink and divides.

Precision. The query rows are fp32 (q_lat from the bmm, the roped q_rope); the cache is bf16 / fp16. The Triton
kernel splits each fp32 value in three parts of the cache dtype (every product exact, six MMAs a tile where the
plain decode runs two). Here two parts, q = q1 + q2 (16 significant bits of q in bf16, 22 in fp16), and the same
for the probabilities against the values, p = p1 + p2: four MMAs a tile. Measured on the CPU against the golden
(benchmarks/NOTES-gemm.md, seventh session: the Triton kernel with its third part zeroed) two parts pass every
production limit with the same norm_err as three; one part fails.

Structure (kernels/gluon/mla.py's, whose docstring has the seesaw): a program owns 64 consecutive rows (token i
of the request, head h: row i H + h) of one request; two consumer warp groups each hold half of O's 512 value
dims and take 32-key tiles in turn (group 0 the even tiles, group 1 the odd), each computing its tile's logits
over the whole 576-dim depth with both parts of q (six wgmmas over 256 / 256 / 64 dims), its softmax, and
handing the other group its probabilities (both parts, bf16, transposed: P1^T over the tile's dead rope slot,
P2^T in a buffer of its own) with the running max and rescale factor. Shared memory: the two parts of Q (2 x 72
KB), two 32-key tiles (2 x 36 KB), P2^T (2 x 4 KB), the row statistics (2 KB): 226 KB. A one-warp producer loads
Q's parts once and each tile from the page the block table names (pages a multiple of 32 keys); slots past the
cached length (the new tokens' rows, NaN in the gate) are masked in the logits and zeroed as values.

Measured on an H200 (benchmarks/gpu_gluon.py --sections fused, reports/baselines/gluon-mla-fused-bench-h200.json and
gluon-acceptance-h200.json; b 128, one new token, DeepSeek-V3's shapes): the whole branch at h_q 128 takes 1.34 ms
at 4K cached keys and 3.65 ms at 16K, against the eager branch's 4.51-6.19 / 11.14-12.05 ms (3.4-4.6x / 3.1-3.3x
over two calls) and the Triton branch's 4.15 / 14.8 ms; at h_q 16 (16 rows a request, 48 of a program's 64 idle)
0.52-0.82 / 1.72 ms beside Triton's 0.54 / 1.91. The attention's rate at h_q 128, 16K: 160 TFLOP/s counting one
part (2 b h_q L (576 + 512)), 320 counting the two parts' MMAs. out matches the Triton branch's within one bf16
rounding (1.5-2.3% of elements differ, max 0.002 at |out| ~ 1-3: a moved e4m3 code or out's own rounding). ptxas
spills 564 bytes with Triton 3.6 (248 at REGS (240, 32), measured no faster).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import barrier_op, tma_ops, ws_list
# the seesaw's layouts and row-statistics slots are kernels/gluon/mla.py's (its tile is 64 keys, this one's 32)
from kernel_parity.kernels.gluon.mla import A0, A1, D_PE, D_V, HALF_V, LA, M0, M1, _mma_layout, _p_layout, \
    _zero_layout

REGS = (232, 40)  # setmaxnreg: the two consumer groups, the producer warp group

_tma_load, _ = tma_ops()
_barrier = barrier_op()
BN = gl.constexpr(32)  # keys a tile


@gluon.jit
def _block(off_ptr, cl_ptr, h_q):
    """(first row of the program's 64 in the (T H) rows, rows of the request left from it (<= 0: none), the
    cached length, tiles to visit)."""
    r = gl.program_id(1)
    start = gl.load(off_ptr + r)
    m0 = gl.program_id(0) * 64
    n_rows = (gl.load(off_ptr + r + 1) - start) * h_q - m0
    L = gl.load(cl_ptr + r)
    n_tiles = gl.where(n_rows > 0, gl.cdiv(L, BN), 0)
    return start * h_q + m0, n_rows, L, n_tiles


@gluon.jit
def _producer(q1n_desc, q1p_desc, q2n_desc, q2p_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar,
              kv_ready, kv_empty, off_ptr, cl_ptr, table_ptr, stride_tb, h_q, page):
    row0, _n_rows, _L, n_tiles = _block(off_ptr, cl_ptr, h_q)
    mbarrier.expect(q_bar, 4 * q1n_desc.block_type.nbytes + 2 * q1p_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(q1n_desc, [row0, w * HALF_V], q_bar, qn_smem.index(w))
        _tma_load(q2n_desc, [row0, w * HALF_V], q_bar, qn_smem.index(2 + w))
    _tma_load(q1p_desc, [row0, D_V], q_bar, qp_smem.index(0))
    _tma_load(q2p_desc, [row0, D_V], q_bar, qp_smem.index(1))
    tb_row = table_ptr + gl.program_id(1).to(gl.int64) * stride_tb
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
    """Wait for tile t and issue its whole-depth logits S = (q1 + q2) K_t^T (async, six wgmmas)."""
    s = t % 2
    mbarrier.wait(kv_ready.index(s), (t // 2) & 1)
    acc = warpgroup_mma(qn_smem.index(0), kn_bufs.index(s * 2).permute((1, 0)),
                        gl.zeros([64, BN], gl.float32, _mma_layout(BN)), use_acc=False, is_async=True)
    acc = warpgroup_mma(qn_smem.index(1), kn_bufs.index(s * 2 + 1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(qp_smem.index(0), kp_bufs.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(qn_smem.index(2), kn_bufs.index(s * 2).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(qn_smem.index(3), kn_bufs.index(s * 2 + 1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(qp_smem.index(1), kp_bufs.index(s).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _softmax(sc, m_prev, t, L, qk_scale, kn_bufs):
    """Tile t's logits scaled and masked past the cached length L, its V rows past L zeroed in both halves:
    (P's two parts in V's dtype, its fp32 row sums, the new row max, the rescale factor exp2(m_prev - m_new))."""
    s_layout: gl.constexpr = _mma_layout(BN)
    sc = sc * qk_scale
    if t * BN + BN > L:
        cols = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        sc = gl.where(cols[None, :] < L, sc, float("-inf"))
        z_layout: gl.constexpr = _zero_layout()
        for w in gl.static_range(2):
            for c in gl.static_range(2):
                slab = kn_bufs.index((t % 2) * 2 + w).slice(c * 16, 16)
                vr = slab.load(z_layout)
                keys = t * BN + c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, z_layout))
                slab.store(gl.where((keys < L)[:, None], vr, gl.zeros_like(vr)))
        fence_async_shared()  # the generic-proxy stores before the tensor cores' reads
        _barrier()
    m_new = gl.maximum(m_prev, gl.max(sc, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    p1 = p.to(kn_bufs.dtype)
    p2 = (p - p1.to(gl.float32)).to(kn_bufs.dtype)
    return p1, p2, gl.sum(p, axis=1), m_new, gl.exp2(m_prev - m_use)


@gluon.jit
def _publish(p1, p2, m_new, alpha, kp_bufs, p2_bufs, stats, ready, t, M_ROW: gl.constexpr, A_ROW: gl.constexpr):
    """Tile t's P parts, transposed (keys x rows, the rope slot's shape), P1^T over its dead rope slot and P2^T to
    its own buffer, (m_new, alpha) to the statistics rows; then signal the partner."""
    kp_bufs.index(t % 2).permute((1, 0)).store(p1)
    p2_bufs.index(t % 2).permute((1, 0)).store(p2)
    stats.index(M_ROW).store(m_new)
    stats.index(A_ROW).store(alpha)
    fence_async_shared()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _partner_pv(acc, kp_bufs, p2_bufs, kn_bufs, s: gl.constexpr, w: gl.constexpr):
    """acc + (P1 + P2) V_w of the partner's tile in buffer s, P's parts read from shared memory."""
    p1 = kp_bufs.index(s).permute((1, 0)).load(_p_layout())
    p2 = p2_bufs.index(s).permute((1, 0)).load(_p_layout())
    acc = warpgroup_mma(p1, kn_bufs.index(s * 2 + w), acc, is_async=True)
    return warpgroup_mma(p2, kn_bufs.index(s * 2 + w), acc, is_async=True)


@gluon.jit
def _own_pv(acc, p1, p2, kn_bufs, s: gl.constexpr, w: gl.constexpr):
    acc = warpgroup_mma(gl.convert_layout(p1, _p_layout()), kn_bufs.index(s * 2 + w), acc, is_async=True)
    return warpgroup_mma(gl.convert_layout(p2, _p_layout()), kn_bufs.index(s * 2 + w), acc, is_async=True)


@gluon.jit
def _epilogue(acc, l_own, stats, fin, acc_ptr, m_ptr, l_ptr, m_fin, row0, n_rows, WG: gl.constexpr):
    """The state out: each group its half of the unnormalised accumulator; group 0 the row max and the two groups'
    row sums added through shared memory."""
    o_layout: gl.constexpr = _mma_layout(HALF_V)
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    stats.index(LA + WG).store(l_own)
    mbarrier.arrive(fin.index(WG), count=1)
    mbarrier.wait(fin.index(1 - WG), 0)
    rows_o = gl.arange(0, 64, layout=o_row)
    cols_o = WG * HALF_V + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = acc_ptr + (row0 + rows_o).to(gl.int64)[:, None] * D_V + cols_o[None, :]
    gl.store(o_ptrs, acc, mask=(rows_o < n_rows)[:, None])
    if WG == 0:
        l_i = l_own + stats.index(LA + 1).load(row_s)
        rows = gl.arange(0, 64, layout=row_s)
        gl.store(m_ptr + row0 + rows, m_fin, mask=rows < n_rows)
        gl.store(l_ptr + row0 + rows, l_i, mask=rows < n_rows)


@gluon.jit
def _group_start(off_ptr, cl_ptr, h_q, q_bar):
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    row0, n_rows, L, n_tiles = _block(off_ptr, cl_ptr, h_q)
    acc = gl.zeros([64, HALF_V], gl.float32, _mma_layout(HALF_V))
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    return row0, n_rows, L, n_tiles, acc, m_i, l_i


@gluon.jit
def _group0(qn_smem, qp_smem, kn_bufs, kp_bufs, p2_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, acc_ptr,
            m_ptr, l_ptr, off_ptr, cl_ptr, h_q, qk_scale):
    """Tiles 0, 2, 4, ...; O_L (value dims 0-255)."""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(HALF_V))
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    row0, n_rows, L, n_tiles, acc, m_i, l_i = _group_start(off_ptr, cl_ptr, h_q, q_bar)
    for i in range(gl.cdiv(n_tiles, 2)):
        t0 = 2 * i
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(_qk(qn_smem, qp_smem, kn_bufs, kp_bufs, kv_ready, t0), ))
        p1, p2, p_sum, m_new, alpha = _softmax(sc, m_i, t0, L, qk_scale, kn_bufs)
        _publish(p1, p2, m_new, alpha, kp_bufs, p2_bufs, stats, ready.index(0), t0, M0, A0)
        l_i = l_i * alpha + p_sum
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        tok = _own_pv(acc, p1, p2, kn_bufs, 0, 0)  # P0 V0_L, in flight over the wait for P1
        m_i = m_new
        if t0 + 1 < n_tiles:
            mbarrier.wait(ready.index(1), i & 1)  # group 1's P1, a1, m1
            alpha1 = stats.index(A1).load(row_s)
            m_i = stats.index(M1).load(row_s)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
            acc = acc * gl.convert_layout(alpha1, o_row)[:, None]
            l_i = l_i * alpha1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(_partner_pv(acc, kp_bufs, p2_bufs, kn_bufs, 1, 0), ))
            mbarrier.arrive(kv_empty.index(1), count=1)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
    _epilogue(acc, l_i, stats, fin, acc_ptr, m_ptr, l_ptr, m_i, row0, n_rows, 0)


@gluon.jit
def _group1(qn_smem, qp_smem, kn_bufs, kp_bufs, p2_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, acc_ptr,
            m_ptr, l_ptr, off_ptr, cl_ptr, h_q, qk_scale):
    """Tiles 1, 3, 5, ...; O_R (value dims 256-511)."""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(HALF_V))
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BN))
    row0, n_rows, L, n_tiles, acc, m_i, l_i = _group_start(off_ptr, cl_ptr, h_q, q_bar)
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
            tok = _partner_pv(acc, kp_bufs, p2_bufs, kn_bufs, 0, 1)
            sc = warpgroup_mma_wait(num_outstanding=2, deps=(sc, ))  # S1 in; P0 V0_R in flight
            p1, p2, p_sum, m_new, alpha = _softmax(sc, m0, t1, L, qk_scale, kn_bufs)
            _publish(p1, p2, m_new, alpha, kp_bufs, p2_bufs, stats, ready.index(1), t1, M1, A1)
            l_i = l_i * alpha + p_sum
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            mbarrier.arrive(kv_empty.index(0), count=1)
            acc = acc * gl.convert_layout(alpha, o_row)[:, None]
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(_own_pv(acc, p1, p2, kn_bufs, 1, 1), ))
            mbarrier.arrive(kv_empty.index(1), count=1)
            m_i = m_new
        else:  # the odd last tile: group 0's alone
            mbarrier.wait(ready.index(0), i & 1)
            mbarrier.wait(kv_ready.index(0), i & 1)
            alpha0 = stats.index(A0).load(row_s)
            m_i = stats.index(M0).load(row_s)
            acc = acc * gl.convert_layout(alpha0, o_row)[:, None]
            l_i = l_i * alpha0
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(_partner_pv(acc, kp_bufs, p2_bufs, kn_bufs, 0, 1), ))
            mbarrier.arrive(kv_empty.index(0), count=1)
    _epilogue(acc, l_i, stats, fin, acc_ptr, m_ptr, l_ptr, m_i, row0, n_rows, 1)


@gluon.jit
def _mla_fused_cached_kernel(q1n_desc, q1p_desc, q2n_desc, q2p_desc, kn_desc, kp_desc, acc_ptr, m_ptr, l_ptr, off_ptr,
                             cl_ptr, table_ptr, stride_tb, h_q, page, qk_scale, REGS_MMA: gl.constexpr,
                             REGS_LOAD: gl.constexpr, WS_LIST: gl.constexpr):
    qn_smem = gl.allocate_shared_memory(q1n_desc.dtype, [4, 64, HALF_V], q1n_desc.layout)  # part p, half w: 2p + w
    qp_smem = gl.allocate_shared_memory(q1p_desc.dtype, [2, 64, D_PE], q1p_desc.layout)
    kn_bufs = gl.allocate_shared_memory(kn_desc.dtype, [4, BN, HALF_V], kn_desc.layout)  # buffer s, half w: 2s + w
    kp_bufs = gl.allocate_shared_memory(kp_desc.dtype, [2, BN, D_PE], kp_desc.layout)  # rope dims, then P1^T
    p2_bufs = gl.allocate_shared_memory(kp_desc.dtype, [2, BN, D_PE], kp_desc.layout)  # P2^T
    stats = gl.allocate_shared_memory(gl.float32, [8, 64],
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
    group_args = (qn_smem, qp_smem, kn_bufs, kp_bufs, p2_bufs, stats, q_bar, kv_ready, kv_empty, ready, fin, acc_ptr,
                  m_ptr, l_ptr, off_ptr, cl_ptr, h_q, qk_scale)
    load_args = (q1n_desc, q1p_desc, q2n_desc, q2p_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar,
                 kv_ready, kv_empty, off_ptr, cl_ptr, table_ptr, stride_tb, h_q, page)
    if WS_LIST:
        gl.warp_specialize([(_group0, group_args), (_group1, group_args), (_producer, load_args)],
                           [4, 1], [REGS_MMA, REGS_LOAD])
    else:
        gl.warp_specialize(group_args, _group0, [group_args, load_args], [_group1, _producer], [4, 1],
                           [REGS_MMA, REGS_LOAD])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(fin.index(i))


def supported(q: torch.Tensor, kv_cache: torch.Tensor, d_c: int, d_r: int) -> str | None:
    """None, or why the kernel cannot take these operands (the dense mode's; the sparse mode has no cached part)."""
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return f"the gluon fused MLA attention takes a bf16 / fp16 cache (16-bit tensor cores), not {kv_cache.dtype}"
    if d_c != 512 or d_r != 64:
        return f"the gluon fused MLA attention takes d_c = 512, d_r = 64, not d_c={d_c}, d_r={d_r}"
    if kv_cache.shape[1] % 32:
        return f"the gluon fused MLA attention takes pages of a multiple of 32 slots, not {kv_cache.shape[1]}"
    if not kv_cache.is_contiguous():
        return "the gluon fused MLA attention takes a contiguous cache (its rows are read by bulk tensor copies)"
    return None


def cached_attend(q_full: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  cache_lengths: torch.Tensor, input_row_offsets: torch.Tensor, n_m: int, qk_scale: float) -> tuple:
    """The cached keys' online-softmax state of every query row (kernels/triton/mla_fused.py's `cached_attend`)."""
    T, H, d = q_full.shape
    rows = q_full.view(T * H, d)
    dt = kv_cache.dtype
    q1 = rows.to(dt)
    q2 = (rows - q1.float()).to(dt)
    c2 = kv_cache.view(-1, d)
    acc = torch.empty((T * H, 512), dtype=torch.float32, device=q_full.device)
    m = torch.empty((T * H,), dtype=torch.float32, device=q_full.device)
    l_ = torch.empty_like(m)
    elt = gl.bfloat16 if dt == torch.bfloat16 else gl.float16

    def desc(t, box):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, gl.NVMMASharedLayout.get_default_for(box, elt))

    b = block_table.shape[0]
    _mla_fused_cached_kernel[(max(n_m, 1), b)](
        desc(q1, [64, 256]), desc(q1, [64, 64]), desc(q2, [64, 256]), desc(q2, [64, 64]), desc(c2, [32, 256]),
        desc(c2, [32, 64]), acc, m, l_, input_row_offsets, cache_lengths, block_table, block_table.stride(0), H,
        kv_cache.shape[1], float(qk_scale), REGS_MMA=REGS[0], REGS_LOAD=REGS[1], WS_LIST=ws_list(), num_warps=4,
        enable_fp_fusion=False,
    )
    return acc, m, l_


def mla_decode_fused_fp8(q: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
                         gamma: torch.Tensor, epsilon: float, w_uk: torch.Tensor, w_uk_scale: torch.Tensor,
                         w_uv: torch.Tensor, w_uv_scale: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, cache_lengths: torch.Tensor, scale: float, **kw) -> torch.Tensor:
    """kernels/triton/mla_fused.py's mla_decode_fused_fp8 (its arguments and conventions) with the cached keys'
    attention in Gluon; dense mode only (the sparse mode's arguments are refused: use the Triton function)."""
    what = "gluon mla_decode_fused_fp8"
    if kw.get("d_indices") is not None:
        raise ValueError(f"{what}: the sparse mode (d_indices) has no cached part: use the Triton kernel")
    if not isinstance(q, torch.Tensor) or not isinstance(kv_cache, torch.Tensor) or not q.is_cuda \
            or kv_cache.dim() not in (3, 4) or q.dim() != 3:
        raise ValueError(f"{what}: q (T, H, dn + d_r) and kv_cache (num_blocks, page, [1,] d) must be CUDA tensors")
    d_r = freqs_cis.shape[-1] if isinstance(freqs_cis, torch.Tensor) and freqs_cis.dim() == 2 else -1
    why = supported(q, kv_cache, kv_cache.shape[-1] - d_r, d_r)
    if why:
        raise ValueError(f"{what}: {why}")
    from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8 as triton_branch

    return triton_branch(q, input_row_offsets, freqs_cis, gamma, epsilon, w_uk, w_uk_scale, w_uv, w_uv_scale,
                         kv_cache, block_table, cache_lengths, scale, cached_attend=cached_attend, **kw)
