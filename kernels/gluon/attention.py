"""Dense attention prefill in Gluon (Hopper): causal (bottom-right / top-left) or full, GQA, LSE out.

The arithmetic of kernels/triton/attention.py's prefill (its docstring states the conventions):

    s_ij = scale q_i . k_j,  -inf where masked      causal or past s_k
    LSE_i = ln sum_j exp(s_ij)                      natural log; -inf, O_i = 0 for a row with no key
    O_i = sum_j exp(s_ij - LSE_i) v_j               P rounded to V's dtype before P @ V, fp32 accumulation

in base 2 (exp2 of s * scale * log2 e), one online-softmax pass over the key tiles the 128-row query tile
can see (the tiles above the causal diagonal are never loaded), the logits not fused into an FMA with the
max (enable_fp_fusion off, as the Triton kernel: rows of +-4096 logits).

Structure (FlashAttention-3's, what the high-level language does not express; NOTES-gemm.md profiled the
Triton kernel: one 8-warp program of 255 registers, loads / softmax / MMA in the same warps):
- a producer partition (one warp) issues the bulk tensor copies: the Q tile once, then K and V tiles into
  a ring of STAGES stages (`kv_ready[s]` with the transaction bytes, `kv_empty[s]` with 2 arrivals);
- two consumer warp groups (the default partition and a 4-warp worker) own the upper and lower 64 query
  rows: S = Q K^T by wgmma from shared memory, the online softmax in registers, P @ V by wgmma with P in
  registers; each frees a stage once its P @ V retired. The two groups run out of phase, so one's softmax
  overlaps the other's MMAs;
- PIPE (the default at d 64 and 128, `_pipelined`): within a group, key tiles in pairs: S_{j+1} = Q K_{j+1}^T
  is issued with P_j V_j and tile j + 1's softmax runs while P_j V_j is on the tensor cores (FlashAttention-3's
  intra-warp-group overlap, for every other tile: a pair ends with every dot retired, see `_pipelined`).
Q, K, V are read through 2-D views (tokens x heads * d): rows past a sequence's end may belong to the next
batch, so keys past s_k are masked and rows past s_q are never stored (masked stores).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import tma_ops, ws_list

_tma_load, _ = tma_ops()
LOG2E = 1.4426950408889634
# d -> (BLOCK_N, STAGES, PIPE); BLOCK_M 128 (two warp groups of 64 rows); PIPE 1: _pipelined's overlap,
# 2: _pingpong's (work in progress: compiled offline, not yet run)
CONFIGS = {32: (128, 3, 0), 64: (128, 3, 1), 128: (64, 3, 1), 256: (64, 2, 0)}
REGS = (232, 40)


@gluon.constexpr_function
def _mma_layout(n):
    """One warp group's wgmma accumulator for 16-bit operands: m64 (4 warps x 16 rows), n, k 16."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(getattr(n, "value", n)), 16])


@gluon.constexpr_function
def _p_layout(d):
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(d), k_width=2)


@gluon.jit
def _key_range(m0, s_q, s_k, DIAG_MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(blocks with no mask, blocks to visit) of the query tile starting at row m0. DIAG_MODE 0: no causal
    mask; 1: bottom-right (row i sees keys <= i + s_k - s_q); 2: top-left (keys <= i)."""
    if DIAG_MODE == 0:
        hi = s_k
        full = s_k // BLOCK_N
    else:
        off = s_k - s_q if DIAG_MODE == 1 else 0
        hi = gl.minimum(gl.maximum(m0 + BLOCK_M + off, 0), s_k)
        full = gl.minimum(gl.maximum(m0 + off + 1, 0), s_k) // BLOCK_N  # every row of the tile sees all its keys
    return full, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, s_q, s_k, h_q, group,
              DIAG_MODE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest causal rows first
    bh = gl.program_id(1)
    b = bh // h_q
    h = bh % h_q
    m0 = pid_m * BLOCK_M
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [b * s_q + m0, h * D], q_bar, q_smem)
    _full, n_blocks = _key_range(m0, s_q, s_k, DIAG_MODE, BLOCK_M, BLOCK_N)
    kv_col = (h // group) * D
    for j in range(n_blocks):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = kv_ready.index(s)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b * s_k + j * BLOCK_N, kv_col], bar, k_bufs.index(s))
        _tma_load(v_desc, [b * s_k + j * BLOCK_N, kv_col], bar, v_bufs.index(s))


@gluon.jit
def _attend(q, k_bufs, v_bufs, kv_ready, kv_empty, j, acc, m_i, l_i, rows, s_k, diag_off, qk_scale,
            MASK: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """One key tile: S = Q K^T, the online-softmax update, acc += P V; frees the tile's stage."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(D)
    s = j % STAGES
    mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
    sc = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
    sc = sc * qk_scale
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (cols[None, :] < s_k) & (cols[None, :] <= rows[:, None] + diag_off)
        sc = gl.where(keep, sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    if MASK:  # a row with nothing seen yet keeps m = -inf: a finite stand-in gives exp2 = 0, not NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(v_bufs.dtype), _p_layout(D))
    acc = warpgroup_mma(p16, v_bufs.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(s), count=1)
    return acc, m_new, l_i


@gluon.jit
def _qk_issue(q, k_bufs, kv_ready, j, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Wait for key tile j and issue S = Q K_j^T (async)."""
    s = j % STAGES
    mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
    return warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32,
                         _mma_layout(BLOCK_N)), use_acc=False, is_async=True)


@gluon.jit
def _softmax(sc, m_i, l_i, j, full, rows, s_k, diag_off, qk_scale, BLOCK_N: gl.constexpr, D: gl.constexpr,
             dtype: gl.constexpr):
    """Tile j's online-softmax step on its raw logits sc (masked where j >= full): (P in V's dtype as the
    P V dot's register operand, the rescale factor, the new running max and sum)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    sc = sc * qk_scale
    if j >= full:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (cols[None, :] < s_k) & (cols[None, :] <= rows[:, None] + diag_off)
        sc = gl.where(keep, sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), _p_layout(D)), alpha, m_new, l_i


@gluon.jit
def _pipelined(q, k_bufs, v_bufs, kv_ready, kv_empty, acc, m_i, l_i, rows, s_k, diag_off, qk_scale, full, n_blocks,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """FlashAttention-3's intra-warp-group overlap (n_blocks > 0), in pairs of key tiles: S_{j+1} = Q K_{j+1}^T
    is issued with P_j V_j, and tile j + 1's softmax runs while P_j V_j is on the tensor cores; the pair ends
    with every dot retired. (A loop carrying P_j V_j in flight across its back edge, P_j in registers, made
    ptxas serialise every wgmma: C7512, "insufficient register resources".)"""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(D))
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(_qk_issue(q, k_bufs, kv_ready, 0, BLOCK_N, STAGES), ))
    for pair in range(n_blocks // 2):
        j = 2 * pair
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, full, rows, s_k, diag_off, qk_scale, BLOCK_N, D, v_bufs.dtype)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        nxt = _qk_issue(q, k_bufs, kv_ready, j + 1, BLOCK_N, STAGES)
        tok = warpgroup_mma(p, v_bufs.index(j % STAGES), acc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(nxt, ))
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j + 1, full, rows, s_k, diag_off, qk_scale, BLOCK_N, D,
                                      v_bufs.dtype)  # overlaps P_j V_j
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        nxt = _qk_issue(q, k_bufs, kv_ready, gl.minimum(j + 2, n_blocks - 1), BLOCK_N, STAGES)
        tok = warpgroup_mma(p, v_bufs.index((j + 1) % STAGES), acc, is_async=True)
        sc, acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, tok))
        mbarrier.arrive(kv_empty.index((j + 1) % STAGES), count=1)
    if n_blocks % 2 == 1:
        j = n_blocks - 1
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, full, rows, s_k, diag_off, qk_scale, BLOCK_N, D, v_bufs.dtype)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(p, v_bufs.index(j % STAGES), acc,
                                                                         is_async=True), ))
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _turn(turn, WG: gl.constexpr, k):
    """Wait for this group's k-th turn to issue its dots (PIPE 2): group 0's first passes at once (a fresh
    barrier passes parity 1), every later one waits for the other group's previous issue."""
    if WG == 0:
        mbarrier.wait(turn.index(0), (k & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(1), k & 1)


@gluon.jit
def _pingpong(q, k_bufs, v_bufs, kv_ready, kv_empty, turn, acc, m_i, l_i, rows, s_k, diag_off, qk_scale, full,
              n_blocks, WG: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """FlashAttention-3's ping-pong of the two warp groups (n_blocks > 0): in iteration j a group issues
    S_j = Q K_j^T and P_{j-1} V_{j-1} in its turn and hands the turn over, so its softmax of tile j runs while
    the other group's dots are on the tensor cores. Both dots retire inside the iteration (P_{j-1} crosses the
    back edge in registers, no accumulator in flight: see _pipelined)."""
    o_row: gl.constexpr = gl.SliceLayout(1, _mma_layout(D))
    _turn(turn, WG, 0)
    nxt = _qk_issue(q, k_bufs, kv_ready, 0, BLOCK_N, STAGES)
    mbarrier.arrive(turn.index(1 - WG), count=1)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
    p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, 0, full, rows, s_k, diag_off, qk_scale, BLOCK_N, D, v_bufs.dtype)
    for j in range(1, n_blocks):
        _turn(turn, WG, j)
        nxt = _qk_issue(q, k_bufs, kv_ready, j, BLOCK_N, STAGES)
        tok = warpgroup_mma(p, v_bufs.index((j - 1) % STAGES), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        sc, acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, tok))
        mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, full, rows, s_k, diag_off, qk_scale, BLOCK_N, D,
                                      v_bufs.dtype)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
    _turn(turn, WG, n_blocks)
    tok = warpgroup_mma(p, v_bufs.index((n_blocks - 1) % STAGES), acc, is_async=True)
    mbarrier.arrive(turn.index(1 - WG), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
    mbarrier.arrive(kv_empty.index((n_blocks - 1) % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turn, o_ptr, lse_ptr, s_q, s_k, h_q, qk_scale,
              stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
              WG: gl.constexpr, DIAG_MODE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(D)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // h_q
    h = bh % h_q
    m0 = pid_m * BLOCK_M
    rows = m0 + WG * 64 + gl.arange(0, 64, layout=row_s)
    if DIAG_MODE == 1:
        diag_off = s_k - s_q
    elif DIAG_MODE == 2:
        diag_off = 0
    else:
        diag_off = s_k  # no causal limit: cols < s_k decides
    full, n_blocks = _key_range(m0, s_q, s_k, DIAG_MODE, BLOCK_M, BLOCK_N)
    acc = gl.zeros([64, D], gl.float32, o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    q = q_smem.slice(WG * 64, 64, dim=0)
    if PIPE == 2:
        if n_blocks > 0:
            acc, m_i, l_i = _pingpong(q, k_bufs, v_bufs, kv_ready, kv_empty, turn, acc, m_i, l_i, rows, s_k, diag_off,
                                      qk_scale, full, n_blocks, WG, BLOCK_N, D, STAGES)
    elif PIPE == 1:
        if n_blocks > 0:
            acc, m_i, l_i = _pipelined(q, k_bufs, v_bufs, kv_ready, kv_empty, acc, m_i, l_i, rows, s_k, diag_off,
                                       qk_scale, full, n_blocks, BLOCK_N, D, STAGES)
    else:
        for j in range(0, full):
            acc, m_i, l_i = _attend(q, k_bufs, v_bufs, kv_ready, kv_empty, j, acc, m_i, l_i, rows, s_k, diag_off,
                                    qk_scale, False, BLOCK_N, D, STAGES)
        for j in range(full, n_blocks):
            acc, m_i, l_i = _attend(q, k_bufs, v_bufs, kv_ready, kv_empty, j, acc, m_i, l_i, rows, s_k, diag_off,
                                    qk_scale, True, BLOCK_N, D, STAGES)
    # epilogue: O = acc / l (0 for a row with no key), LSE = (m + log2 l) ln 2 (-inf for such a row)
    seen = l_i > 0.0
    inv = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row_o = m0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    col_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + b.to(gl.int64) * stride_ob + row_o[:, None].to(gl.int64) * stride_os + h * stride_oh \
        + col_o[None, :]
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(row_o < s_q)[:, None])
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + h * stride_lh + rows * stride_ls, lse, mask=rows < s_q)


@gluon.jit
def _prefill_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, s_q, s_k, h_q, group, qk_scale,
                    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                    DIAG_MODE: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    REGS_MMA: gl.constexpr, REGS_LOAD: gl.constexpr, WS_LIST: gl.constexpr, PIPE: gl.constexpr):
    BLOCK_M: gl.constexpr = 128
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PIPE 2's turns
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warp group
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # the argument tuples are written in place: a tuple bound to a name first turns its constexprs into tensors
    if WS_LIST:
        gl.warp_specialize([
            (_consumer, (q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turn, o_ptr, lse_ptr, s_q, s_k, h_q,
                         qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                         0, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES, PIPE)),
            (_consumer, (q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turn, o_ptr, lse_ptr, s_q, s_k, h_q,
                         qk_scale, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                         1, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES, PIPE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, s_q, s_k, h_q,
                         group, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 1], [REGS_MMA, REGS_LOAD])
    else:
        gl.warp_specialize(
            (q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turn, o_ptr, lse_ptr, s_q, s_k, h_q, qk_scale,
             stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
             0, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES, PIPE), _consumer,
            [(q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, turn, o_ptr, lse_ptr, s_q, s_k, h_q, qk_scale,
              stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
              1, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES, PIPE),
             (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, s_q, s_k, h_q,
              group, DIAG_MODE, D, BLOCK_M, BLOCK_N, STAGES)],
            [_consumer, _producer], [4, 1], [REGS_MMA, REGS_LOAD])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


DIAG = {"none": 0, "bottom_right": 1, "top_left": 2}


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> the 2-D (b * s, h * d) view a bulk tensor copy reads (a contiguous copy where the
    strides do not allow one: token rows 16-byte aligned, heads adjacent, unit last stride)."""
    b, s, h, d = t.shape
    ok = t.stride(3) == 1 and t.stride(2) == d and t.stride(0) == s * t.stride(1) and \
        (t.stride(1) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    if not ok:  # a fresh allocation (aligned): .contiguous() would return a contiguous view with an odd base as is
        t = t.clone(memory_format=torch.contiguous_format)
    return t.as_strided((b * s, h * d), (t.stride(1), 1))


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None, or why the kernel cannot take these operands."""
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the gluon prefill takes bf16 / fp16 q, k, v of one dtype, not {q.dtype} / {k.dtype} / {v.dtype}"
    d = q.shape[-1]
    if d not in CONFIGS or k.shape[-1] != d or v.shape[-1] != d:
        return f"the gluon prefill takes d = d_v in {sorted(CONFIGS)}, not d={d}, d_v={v.shape[-1]}"
    return None


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, causal: str = "none",
            out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
            config: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense batched attention on a Hopper GPU.

    q: (b, s_q, h_q, d); k, v: (b, s_k, h_kv, d), bf16 or fp16, one dtype; d in 32, 64, 128, 256; h_q % h_kv == 0
    causal: "none" | "bottom_right" | "top_left"
    out: (b, s_q, h_q, d) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32, any strides
    config: (BLOCK_N, STAGES[, PIPE 0 / 1 / 2]), tuning only
    returns (out, out_lse): LSE natural log; a row with no key gives O = 0, LSE = -inf
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_cuda:
            raise ValueError(f"gluon prefill: {name} must be a 4-D CUDA tensor (b, s, h, d), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    why = supported(q, k, v)
    if why:
        raise ValueError(f"gluon prefill: {why}")
    if causal not in DIAG:
        raise ValueError(f"gluon prefill: causal must be one of {', '.join(DIAG)}, got {causal!r}")
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if k.shape[0] != b or tuple(v.shape[:3]) != tuple(k.shape[:3]) or h_kv < 1 or h_q % h_kv:
        raise ValueError(f"gluon prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected one "
                         f"batch, k and v alike, h_q a multiple of h_kv")
    if out is None:
        out = torch.empty((b, s_q, h_q, d), dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (b, s_q, h_q, d) or out.dtype != q.dtype \
            or out.stride(3) != 1 or out.device != q.device:
        raise ValueError(f"gluon prefill: out must be a ({b}, {s_q}, {h_q}, {d}) {q.dtype} tensor, last stride 1")
    if out_lse is None:
        out_lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    elif not isinstance(out_lse, torch.Tensor) or tuple(out_lse.shape) != (b, h_q, s_q) \
            or out_lse.dtype != torch.float32 or out_lse.device != q.device:
        raise ValueError(f"gluon prefill: out_lse must be a ({b}, {h_q}, {s_q}) float32 tensor")
    if b == 0 or s_q == 0 or h_q == 0:
        return out, out_lse
    block_n, stages, pipe = (tuple(config) + (0,))[:3] if config else CONFIGS[d]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    elt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q2, k2, v2 = _rows_view(q), _rows_view(k), _rows_view(v)

    def desc(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, d],
                                gl.NVMMASharedLayout.get_default_for([rows, d], elt))

    grid = (triton.cdiv(s_q, 128), b * h_q)
    _prefill_kernel[grid](
        desc(q2, 128), desc(k2, block_n), desc(v2, block_n), out, out_lse, s_q, s_k, h_q, h_q // h_kv,
        scale * LOG2E, *out.stride()[:3], *out_lse.stride(),
        DIAG_MODE=DIAG[causal], D=d, BLOCK_N=block_n, STAGES=stages, REGS_MMA=REGS[0], REGS_LOAD=REGS[1],
        WS_LIST=ws_list(), PIPE=int(pipe), num_warps=4, enable_fp_fusion=False,
    )
    return out, out_lse
