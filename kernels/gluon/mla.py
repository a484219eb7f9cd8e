"""MLA decode over a paged latent cache in Gluon (Hopper), 64 query rows a program, the QK depth split.

The arithmetic of kernels/triton/mla.py's mla_decode (its docstring states the conventions): one latent kv
head, d = d_v + d_pe = 512 + 64, V = the first d_v dims of the cached row,

    s_ij  = scale q_i . c_j            -inf past the request's length (causal: keys <= L - s_q + s_i)
    LSE_i = ln sum_j exp(s_ij)         -inf, O_i = 0 for a row with no visible key
    O_i   = sum_j exp(s_ij - LSE_i) c_j[:d_v]

Structure. A program owns 64 query rows (h_q x s_q flattened, s major) of one request and streams every key
tile of it once. The 64 x 512 fp32 output does not fit one warp group's registers (256 a thread), so two
consumer warp groups each own half of it (256 value dims). FlashMLA balances their MMAs with its seesaw (each
group computes S for every other tile and hands P over); here instead each group computes the partial logits
of half the QK depth (its 256 latent dims and 32 of the 64 rope dims: the same 288 of 576 each), writes them
to shared memory and adds its partner's: S = S_0 + S_1 in one group and S_1 + S_0 in the other, the same bits
(fp32 addition commutes), so both run the same online softmax with no further exchange and P V their own
half of V from the tile their partner never touches. Per tile each group issues 288 + 256 of MMA depth,
the ideal 544 of the 1,088, plus a 64 x BLOCK_N fp32 exchange through shared memory (double-buffered by tile
parity: a group passes its wait for tile j + 1 only after its partner has read tile j's partial).
A producer warp loads Q once (four boxes: two 256-dim halves, two 32-dim rope halves) and each key tile from
the page the block table names (BLOCK_N divides the page: a tile never straddles two pages). Slots past the
request's length in its last page may hold anything (the gate fills them with NaN): their logits are masked,
and the group zeroes its half of those V rows in shared memory before P V (0 x NaN would be NaN).
The default loop (PIPE 1) is FlashAttention-3's intra-warp-group overlap: tile j + 1's partial logits are issued
before tile j's softmax and run under it. Measured on an H200 (bf16, b 128, h_q 128 s_q 1 or h_q 64 s_q 2, 4K and
16K keys, three runs: reports/baselines/gluon-mla-bench-h200.json): 397-414 TFLOP/s, 50.5-53.9% of the bf16
matmul rate measured in the same run, 2.0x the Triton mla_decode (the exchange buffer unswizzled, 8-way bank
conflicts: 42%). PIPE 0 (serial) is within 4% of it either way (slower in 7 of 9 pairs); a pair-unrolled loop
keeping P V in flight through the next tile's exchange was 4-13% slower (ptxas spilled it) and is gone.
What bounds it (ncu: tensor pipe 44-45% of cycles, barrier the first stall): the two groups wait on each other
at every tile's exchange, so neither one's softmax hides under the other's dots; FlashMLA's seesaw (each group's
own full-depth tile, P handed over) is the step past it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import barrier_op, tma_ops, ws_list

_tma_load, _ = tma_ops()
_barrier = barrier_op()
LOG2E = 1.4426950408889634
D_V, D_PE = gl.constexpr(512), gl.constexpr(64)
HALF_V, HALF_PE = gl.constexpr(256), gl.constexpr(32)
CONFIG = (64, 2, 3)  # the seesaw (mla_seesaw.py); (32, 3, 1): BLOCK_N, STAGES, PIPE of the split-depth kernel: 72 KB of Q + 3 x 36 KB of tiles + 32 KB of exchanged logits
REGS = (232, 40)
SEESAW = 3  # PIPE 3: kernels/gluon/mla_seesaw.py (config (64, 2, 3))


@gluon.constexpr_function
def _mma_layout(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(getattr(n, "value", n)), 16])


@gluon.constexpr_function
def _p_layout(n):
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(n), k_width=2)


@gluon.constexpr_function
def _v_rows_layout(n):
    """A (BLOCK_N, 256) tile over one warp group: 8 elements a thread along the row."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0])


@gluon.constexpr_function
def _sx_layout(n):
    """The exchanged fp32 logits (64 x n): a row's 32-byte chunks rotated by row, so the accumulator layout's
    stores and loads (a quarter-warp on each of 8 rows, 32 bytes a row) meet no bank twice in a half-warp."""
    n = int(getattr(n, "value", n))
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=max(n // 8, 1), order=[1, 0])


@gluon.jit
def _tiles(L, s_q, m0, h_q, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """(tiles every row of the block sees whole, tiles to visit) for keys [0, L)."""
    if CAUSAL:
        s_lo = m0 // h_q  # the block's first row has the smallest limit
        lo = gl.maximum(L - s_q + s_lo + 1, 0)
    else:
        lo = L
    return lo // BLOCK_N, gl.cdiv(L, BLOCK_N)


@gluon.jit
def _producer(qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready, kv_empty,
              table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page,
              CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    b = gl.program_id(1)
    m0 = gl.program_id(0) * 64
    row0 = b * rows_per_req + m0
    mbarrier.expect(q_bar, 2 * qn_desc.block_type.nbytes + 2 * qp_desc.block_type.nbytes)
    for w in gl.static_range(2):
        _tma_load(qn_desc, [row0, w * HALF_V], q_bar, qn_smem.index(w))
        _tma_load(qp_desc, [row0, D_V + w * HALF_PE], q_bar, qp_smem.index(w))
    L = gl.load(seqlens_ptr + b)
    _full, n_tiles = _tiles(L, s_q, m0, h_q, CAUSAL, BLOCK_N)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        key = j * BLOCK_N
        blk = gl.load(table_ptr + b.to(gl.int64) * stride_tb + key // page)
        r = blk * page + key % page
        bar = kv_ready.index(s)
        mbarrier.expect(bar, 2 * kn_desc.block_type.nbytes + 2 * kp_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_load(kn_desc, [r, w * HALF_V], bar, kn_bufs.index(s * 2 + w))
            _tma_load(kp_desc, [r, D_V + w * HALF_PE], bar, kp_bufs.index(s * 2 + w))


@gluon.jit
def _qk_half(qn, qp, kn_bufs, kp_bufs, kv_ready, j, WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Wait for key tile j and issue this group's partial logits over its 288 of the 576 dims (async)."""
    s = j % STAGES
    mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
    part = warpgroup_mma(qn, kn_bufs.index(s * 2 + WG).permute((1, 0)),
                         gl.zeros([64, BLOCK_N], gl.float32, _mma_layout(BLOCK_N)), use_acc=False, is_async=True)
    return warpgroup_mma(qp, kp_bufs.index(s * 2 + WG).permute((1, 0)), part, is_async=True)


@gluon.jit
def _exchange(part, sx, sx_ready, j, WG: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile j's whole logits: mine to sx[WG, j % 2], the partner's from sx[1 - WG, j % 2], added (S_0 + S_1 in one
    group, S_1 + S_0 in the other: the same bits). A group passes its wait for tile j + 1 only after its partner
    has read tile j's partial, so two buffers a group suffice."""
    x = j % 2
    sx.index(WG * 2 + x).store(part)
    mbarrier.arrive(sx_ready.index(WG * 2 + x), count=1)
    mbarrier.wait(sx_ready.index((1 - WG) * 2 + x), (j // 2) & 1)
    return part + sx.index((1 - WG) * 2 + x).load(_mma_layout(BLOCK_N))


@gluon.jit
def _step(sc, kn, m_i, l_i, j, full, limit, L, qk_scale, BLOCK_N: gl.constexpr):
    """Tile j's online-softmax step on its whole raw logits sc (masked where j >= full; in the tile holding the
    request's last key, this group's half of the V rows past L zeroed in shared memory): (P as the P V dot's
    register operand, the rescale factor, the new running max and sum)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    sc = sc * qk_scale
    if j >= full:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        sc = gl.where(cols[None, :] < limit[:, None], sc, float("-inf"))
        if j * BLOCK_N + BLOCK_N > L:  # slots past L in this tile: zero my half of their V rows
            v_layout: gl.constexpr = _v_rows_layout(BLOCK_N)
            vr = kn.load(v_layout)
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
            kn.store(gl.where((keys < L)[:, None], vr, gl.zeros_like(vr)))
            fence_async_shared()  # the generic-proxy stores before the tensor cores' reads
            _barrier()  # every thread's rows stored before the warp group's P V
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(kn.dtype), _p_layout(HALF_V)), alpha, m_new, l_i


@gluon.jit
def _consumer(qn_smem, qp_smem, kn_bufs, kp_bufs, sx, q_bar, kv_ready, kv_empty, sx_ready, o_ptr, lse_ptr,
              seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
              stride_ls, WG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              PIPE: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HALF_V)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    b = gl.program_id(1)
    m0 = gl.program_id(0) * 64
    L = gl.load(seqlens_ptr + b)
    full, n_tiles = _tiles(L, s_q, m0, h_q, CAUSAL, BLOCK_N)
    rows = m0 + gl.arange(0, 64, layout=row_s)  # the request's rows: (s, h) as s * h_q + h
    if CAUSAL:
        limit = L - s_q + rows // h_q + 1  # keys < limit are visible
    else:
        limit = gl.zeros([64], gl.int32, row_s) + L
    acc = gl.zeros([64, HALF_V], gl.float32, o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    qn = qn_smem.index(WG)
    qp = qp_smem.index(WG)
    if PIPE == 1:
        # FlashAttention-3's intra-warp-group overlap: tile j + 1's partial logits are issued before tile j's
        # softmax and run under it; every dot is retired at the end of an iteration (a wgmma in flight across
        # the back edge makes ptxas serialise them all). The last iteration re-issues tile n - 1's (discarded).
        if n_tiles > 0:
            part = warpgroup_mma_wait(num_outstanding=0,
                                      deps=(_qk_half(qn, qp, kn_bufs, kp_bufs, kv_ready, 0, WG, BLOCK_N, STAGES), ))
            for j in range(n_tiles):
                sc = _exchange(part, sx, sx_ready, j, WG, BLOCK_N)
                nxt = _qk_half(qn, qp, kn_bufs, kp_bufs, kv_ready, gl.minimum(j + 1, n_tiles - 1), WG, BLOCK_N,
                               STAGES)
                kn = kn_bufs.index((j % STAGES) * 2 + WG)
                p16, alpha, m_i, l_i = _step(sc, kn, m_i, l_i, j, full, limit, L, qk_scale, BLOCK_N)
                acc = acc * gl.convert_layout(alpha, o_row)[:, None]
                tok = warpgroup_mma(p16, kn, acc, is_async=True)
                part, acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, tok))
                mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
    else:
        for j in range(n_tiles):
            part = warpgroup_mma_wait(num_outstanding=0,
                                      deps=(_qk_half(qn, qp, kn_bufs, kp_bufs, kv_ready, j, WG, BLOCK_N, STAGES), ))
            sc = _exchange(part, sx, sx_ready, j, WG, BLOCK_N)
            kn = kn_bufs.index((j % STAGES) * 2 + WG)
            p16, alpha, m_i, l_i = _step(sc, kn, m_i, l_i, j, full, limit, L, qk_scale, BLOCK_N)
            acc = acc * gl.convert_layout(alpha, o_row)[:, None]
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(p16, kn, acc, is_async=True), ))
            mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
    # epilogue: O = acc / l (0 for a row with no key), LSE = (m + log2 l) ln 2 (-inf for such a row)
    seen = l_i > 0.0
    inv = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    out = acc * gl.convert_layout(inv, o_row)[:, None]
    rows_o = m0 + gl.arange(0, 64, layout=o_row)
    cols_o = WG * HALF_V + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + b.to(gl.int64) * stride_ob + ((rows_o // h_q) * stride_os + (rows_o % h_q) * stride_oh)[:, None] \
        + cols_o[None, :]
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows_o < rows_per_req)[:, None])
    if WG == 0:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + b.to(gl.int64) * stride_lb + (rows % h_q) * stride_lh + (rows // h_q) * stride_ls, lse,
                 mask=rows < rows_per_req)


@gluon.jit
def _mla_decode_kernel(qn_desc, qp_desc, kn_desc, kp_desc, o_ptr, lse_ptr, table_ptr, seqlens_ptr, stride_tb,
                       rows_per_req, s_q, h_q, page, qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                       stride_ls, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       PIPE: gl.constexpr, REGS_MMA: gl.constexpr, REGS_LOAD: gl.constexpr, WS_LIST: gl.constexpr):
    qn_smem = gl.allocate_shared_memory(qn_desc.dtype, [2, 64, HALF_V], qn_desc.layout)
    qp_smem = gl.allocate_shared_memory(qp_desc.dtype, [2, 64, HALF_PE], qp_desc.layout)
    kn_bufs = gl.allocate_shared_memory(kn_desc.dtype, [STAGES * 2, BLOCK_N, HALF_V], kn_desc.layout)
    kp_bufs = gl.allocate_shared_memory(kp_desc.dtype, [STAGES * 2, BLOCK_N, HALF_PE], kp_desc.layout)
    sx = gl.allocate_shared_memory(gl.float32, [4, 64, BLOCK_N], _sx_layout(BLOCK_N))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sx_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warp group
    for i in gl.static_range(4):
        mbarrier.init(sx_ready.index(i), count=1)
    # the argument tuples are written in place: a tuple bound to a name first turns its constexprs into tensors
    if WS_LIST:
        gl.warp_specialize([
            (_consumer, (qn_smem, qp_smem, kn_bufs, kp_bufs, sx, q_bar, kv_ready, kv_empty, sx_ready, o_ptr, lse_ptr,
                         seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb,
                         stride_lh, stride_ls, 0, CAUSAL, BLOCK_N, STAGES, PIPE)),
            (_consumer, (qn_smem, qp_smem, kn_bufs, kp_bufs, sx, q_bar, kv_ready, kv_empty, sx_ready, o_ptr, lse_ptr,
                         seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb,
                         stride_lh, stride_ls, 1, CAUSAL, BLOCK_N, STAGES, PIPE)),
            (_producer, (qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready,
                         kv_empty, table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page, CAUSAL, BLOCK_N,
                         STAGES)),
        ], [4, 1], [REGS_MMA, REGS_LOAD])
    else:
        gl.warp_specialize(
            (qn_smem, qp_smem, kn_bufs, kp_bufs, sx, q_bar, kv_ready, kv_empty, sx_ready, o_ptr, lse_ptr,
             seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb,
             stride_lh, stride_ls, 0, CAUSAL, BLOCK_N, STAGES, PIPE), _consumer,
            [(qn_smem, qp_smem, kn_bufs, kp_bufs, sx, q_bar, kv_ready, kv_empty, sx_ready, o_ptr, lse_ptr,
              seqlens_ptr, rows_per_req, s_q, h_q, qk_scale, stride_ob, stride_os, stride_oh, stride_lb,
              stride_lh, stride_ls, 1, CAUSAL, BLOCK_N, STAGES, PIPE),
             (qn_desc, qp_desc, kn_desc, kp_desc, qn_smem, qp_smem, kn_bufs, kp_bufs, q_bar, kv_ready,
              kv_empty, table_ptr, seqlens_ptr, stride_tb, rows_per_req, s_q, h_q, page, CAUSAL, BLOCK_N,
              STAGES)],
            [_consumer, _producer], [4, 1], [REGS_MMA, REGS_LOAD])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(4):
        mbarrier.invalidate(sx_ready.index(i))


def supported(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int, config: tuple[int, ...] | None = None) -> str | None:
    """None, or why the kernel cannot take these operands."""
    block_n = (config or CONFIG)[0]
    if config is not None and len(config) > 2 and config[2] == SEESAW and tuple(config[:2]) != (64, 2):
        return f"the seesaw kernel (PIPE {SEESAW}) takes BLOCK_N 64 and 2 key buffers, not {tuple(config)}"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        return f"the gluon MLA decode takes bf16 / fp16 q and cache of one dtype, not {q.dtype} / {kv_cache.dtype}"
    if q.shape[-1] != 576 or d_v != 512 or kv_cache.shape[-1] != 576:
        return f"the gluon MLA decode takes d = 576, d_v = 512, not d={q.shape[-1]}, d_v={d_v}"
    if kv_cache.shape[2] != 1:
        return f"the gluon MLA decode takes one latent kv head, not h_kv={kv_cache.shape[2]}"
    if (q.shape[1] * q.shape[2]) % 64:
        return f"the gluon MLA decode takes s_q x h_q a multiple of 64 rows, not {q.shape[1]} x {q.shape[2]}"
    if kv_cache.shape[1] % block_n:
        return f"the gluon MLA decode takes a page size that is a multiple of {block_n}, not {kv_cache.shape[1]}"
    return None


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
               scale: float, d_v: int = 512, causal: bool = True, out: torch.Tensor | None = None,
               out_lse: torch.Tensor | None = None, *, config: tuple[int, ...] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode on a Hopper GPU (kernels/triton/mla.py's mla_decode without splits).

    q: (b, s_q, h_q, 576) bf16 / fp16, contiguous rows; s_q * h_q a multiple of 64
    kv_cache: (num_blocks, page, 1, 576) q's dtype; page a multiple of BLOCK_N
    block_table: (b, max_blocks) int32; seqlens: (b,) int32 on q's device
    out: (b, s_q, h_q, 512) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32
    config: (BLOCK_N, STAGES[, PIPE]), tuning only (PIPE 1: the next tile's logits under this one's softmax)
    returns (out, out_lse), LSE natural log; a row with no visible key: O = 0, LSE = -inf
    """
    what = "gluon mla_decode"
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_cuda:
            raise ValueError(f"{what}: {name} must be a 4-D CUDA tensor, got {tuple(getattr(t, 'shape', ()))}")
    why = supported(q, kv_cache, d_v, config)
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
    block_n, stages, pipe = (tuple(config) + (0,))[:3] if config else CONFIG
    rows = s_q * h_q
    q2 = q if q.is_contiguous() else q.contiguous()
    q2 = q2.view(b * rows, d)
    c = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
    c2 = c.view(-1, d)
    elt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t, box):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, gl.NVMMASharedLayout.get_default_for(box, elt))

    grid = (rows // 64, b)
    if pipe == SEESAW:  # kernels/gluon/mla_seesaw.py: 64-key tiles, two key buffers, each group its own tile
        from kernel_parity.kernels.gluon.mla_seesaw import _mla_seesaw_kernel
        _mla_seesaw_kernel[grid](
            desc(q2, [64, 256]), desc(q2, [64, 64]), desc(c2, [64, 256]), desc(c2, [64, 64]),
            out, out_lse, block_table, seqlens, block_table.stride(0), rows, s_q, h_q, kv_cache.shape[1],
            float(scale) * LOG2E, out.stride(0), out.stride(1), out.stride(2), *out_lse.stride(),
            CAUSAL=bool(causal) and s_q > 1, REGS_MMA=REGS[0], REGS_LOAD=REGS[1], WS_LIST=ws_list(), num_warps=4,
            enable_fp_fusion=False,
        )
        return out, out_lse
    _mla_decode_kernel[grid](
        desc(q2, [64, 256]), desc(q2, [64, 32]), desc(c2, [block_n, 256]), desc(c2, [block_n, 32]),
        out, out_lse, block_table, seqlens, block_table.stride(0), rows, s_q, h_q, kv_cache.shape[1],
        float(scale) * LOG2E, out.stride(0), out.stride(1), out.stride(2), *out_lse.stride(),
        CAUSAL=bool(causal) and s_q > 1, BLOCK_N=block_n, STAGES=stages, PIPE=pipe, REGS_MMA=REGS[0], REGS_LOAD=REGS[1],
        WS_LIST=ws_list(), num_warps=4, enable_fp_fusion=False,
    )
    return out, out_lse
