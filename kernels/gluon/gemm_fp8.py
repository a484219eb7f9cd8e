"""FP8 e4m3 block-scaled GEMM in Gluon (Hopper): C = A @ W^T (+ bias), DeepSeek-V3's recipe.

The same arithmetic as kernels/triton/gemm_fp8.py (its docstring states it): activations quantized
per 1 x 128 group (the Triton quantizer, act_quant_fp8), weights e4m3 per 128 x gn block (gn a
multiple of 128), one fp8 tensor-core dot per 128-wide K block, promoted into an fp32 accumulator
with sa[m, kb] * sw[n // gn, kb], one rounding to A's dtype at the end. It claims the same
`emulated` reference.

Structure (what Triton's high-level language does not express; benchmarks/NOTES-gemm.md profiled
its absence: the promotion FFMAs in the MMA warps, tensor pipe 46% where cuBLASLt's is 82%):
- persistent: one CTA per SM walks the output tiles in grouped order (GROUP_M row tiles down a
  column tile of W, which stays in L2);
- a producer partition (one warp, few registers) issues the bulk tensor copies of each 128 x 128
  A tile and BLOCK_N x 128 W tile into a ring of STAGES shared-memory stages, `ready[s]` an mbarrier
  with the transaction bytes, and waits on `empty[s]` before reusing a stage;
- two consumer partitions (one warp group each, the default partition and a worker) take the upper
  and lower 64 rows of each tile. Each issues the wgmma of K block kb + 1 before it waits for kb's
  (wgmma.wait_group 1) and promotes kb while kb + 1 runs on the tensor cores: the FFMAs leave the
  MMA's critical path. Each arrives on `empty[s]` (count 2) once its wgmma reading the stage retired.
- the epilogue adds the bias in fp32, rounds once, and stores through shared memory with a bulk
  tensor copy (where C's rows are 16-byte aligned) or with masked stores.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernel_parity.kernels.gluon.compat import tma_ops, ws_list
from kernel_parity.kernels.triton.gemm_fp8 import check_scales_bias_out

# (BLOCK_N, STAGES, GROUP_M, consumer registers, producer registers[, SKEW]); BLOCK_M 128 (two warp groups of
# 64 rows), BLOCK_K 128 (one scale group). H200, 8192^3, two runs (benchmarks/NOTES-gemm.md "Gluon"): STAGES 4
# 1,123 / 1,145 TFLOP/s; 5 1,005 / 993; 6 1,017 / 1,038; GROUP_M 16 1,004; registers 240 / 24 1,037 / 1,003.
GEMM_CONFIG = (128, 4, 8, 232, 40)
BLOCK_M = 128
BLOCK_K = 128
# the bulk tensor copies under this Triton's names (compat.py); module globals, so that no kernel's source names
# a function its Triton lacks (Triton resolves every attribute of a kernel's source when it hashes it)
_tma_load, _tma_store = tma_ops()


@gluon.constexpr_function
def _acc_layout(block_n):
    """One warp group's wgmma accumulator: m64 (4 warps x 16 rows), n = BLOCK_N, k 32 (e4m3)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(getattr(block_n, "value", block_n)), 32])


@gluon.jit
def _tile_of(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % width) % rows, (tile % width) // rows


@gluon.jit
def _issue(a_bufs, w_bufs, ready, it, acc, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for pipeline slot `it`'s tiles and issue this warp group's 64 rows of their fp8 dot (async)."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s).slice(WG * 64, 64, dim=0), w_bufs.index(s).permute((1, 0)),
                         gl.zeros_like(acc), use_acc=False, is_async=True)


@gluon.jit
def _retire(raw, acc, scale, empty, it, STAGES: gl.constexpr, PENDING: gl.constexpr):
    """Wait until at most PENDING dots are in flight (raw's retired), free its stage, promote it into acc."""
    done = warpgroup_mma_wait(num_outstanding=PENDING, deps=(raw, ))
    mbarrier.arrive(empty.index(it % STAGES), count=1)
    acc = acc + done * scale[:, None]
    # A no-op wait with acc as its operand: the FFMAs above must complete before the next wgmma is issued.
    # Else they sink past it, reading raw's registers while the next dot (in the same registers) runs, and
    # ptxas serialises every wgmma of the kernel.
    return warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc, ))


@gluon.jit
def _scale(sa_rows, row_ok, sw_tile, kb, stride_sak, stride_swk):
    """sa[rows, kb] * sw[tile, kb]: one K block's promotion factor for this warp group's rows."""
    return gl.load(sa_rows + kb * stride_sak, mask=row_ok, other=0.0) * gl.load(sw_tile + kb * stride_swk)


@gluon.jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    num_pid_m = gl.cdiv(M, 128)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, 128)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        for kb in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * 128, kb * 128], bar, a_bufs.index(s))
            _tma_load(w_desc, [pid_n * BLOCK_N, kb * 128], bar, w_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(c_desc, c_smem, c_ptr, sa_ptr, sw_ptr, bias_ptr, a_bufs, w_bufs, ready, empty, M, N, K, gn,
              stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
              WG: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, SKEW: gl.constexpr):
    HALF: gl.constexpr = 64
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    num_pid_m = gl.cdiv(M, 128)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, 128)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * 128 + WG * HALF + gl.arange(0, HALF, layout=row_layout)
        row_ok = rows < M
        sa_rows = sa_ptr + rows * stride_sam
        sw_tile = sw_ptr + ((pid_n * BLOCK_N) // gn) * stride_swn  # the tile lies in one weight-scale row
        acc = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        # Two raw accumulators in turn, the loop unrolled by two so that neither is ever copied while its
        # wgmma runs (ptxas serialises every wgmma when a register move reads an accumulator in flight):
        # issue block kb + 1, retire block kb (wait_group 1), promote it while kb + 1 runs.
        if SKEW:
            r0 = _issue(a_bufs, w_bufs, ready, it, acc, WG, STAGES)
            s0 = _scale(sa_rows, row_ok, sw_tile, 0, stride_sak, stride_swk)
            for kb in range(1, k_tiles - 1, 2):
                r1 = _issue(a_bufs, w_bufs, ready, it + kb, acc, WG, STAGES)
                s1 = _scale(sa_rows, row_ok, sw_tile, kb, stride_sak, stride_swk)
                acc = _retire(r0, acc, s0, empty, it + kb - 1, STAGES, 1)
                r0 = _issue(a_bufs, w_bufs, ready, it + kb + 1, acc, WG, STAGES)
                s0 = _scale(sa_rows, row_ok, sw_tile, kb + 1, stride_sak, stride_swk)
                acc = _retire(r1, acc, s1, empty, it + kb, STAGES, 1)
            if (k_tiles - 1) % 2 == 1:  # one block left after the pairs
                r1 = _issue(a_bufs, w_bufs, ready, it + k_tiles - 1, acc, WG, STAGES)
                s1 = _scale(sa_rows, row_ok, sw_tile, k_tiles - 1, stride_sak, stride_swk)
                acc = _retire(r0, acc, s0, empty, it + k_tiles - 2, STAGES, 1)
                acc = _retire(r1, acc, s1, empty, it + k_tiles - 1, STAGES, 0)
            else:
                acc = _retire(r0, acc, s0, empty, it + k_tiles - 1, STAGES, 0)
        else:  # one dot at a time: issue, retire, promote (the other warp group's dots overlap the FFMAs)
            for kb in range(k_tiles):
                r0 = _issue(a_bufs, w_bufs, ready, it + kb, acc, WG, STAGES)
                s0 = _scale(sa_rows, row_ok, sw_tile, kb, stride_sak, stride_swk)
                acc = _retire(r0, acc, s0, empty, it + kb, STAGES, 0)
        it += k_tiles
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        if HAS_BIAS:
            acc += gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        if TMA_STORE:
            tma.store_wait(pendings=0)  # this warp group's previous tile has left c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [pid_m * 128 + WG * HALF, pid_n * BLOCK_N], c_smem)
        else:
            ptrs = c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :] * stride_cn
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _gemm_fp8_kernel(a_desc, w_desc, c_desc, c_ptr, sa_ptr, sw_ptr, bias_ptr, M, N, K, gn,
                     stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
                     HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, REGS_MMA: gl.constexpr,
                     REGS_LOAD: gl.constexpr, WS_LIST: gl.constexpr, SKEW: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 128, 128], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warp group
    if TMA_STORE:
        c_all = gl.allocate_shared_memory(c_desc.dtype, [2, 64, BLOCK_N], c_desc.layout)
        c0 = c_all.index(0)
        c1 = c_all.index(1)
    else:
        c0 = a_bufs
        c1 = a_bufs
    # the argument tuples are written in place: a tuple bound to a name first turns its constexprs into tensors
    if WS_LIST:
        gl.warp_specialize([
            (_consumer, (c_desc, c0, c_ptr, sa_ptr, sw_ptr, bias_ptr, a_bufs, w_bufs, ready, empty, M, N, K, gn,
                         stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
                         0, HAS_BIAS, TMA_STORE, BLOCK_N, GROUP_M, STAGES, SKEW)),
            (_consumer, (c_desc, c1, c_ptr, sa_ptr, sw_ptr, bias_ptr, a_bufs, w_bufs, ready, empty, M, N, K, gn,
                         stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
                         1, HAS_BIAS, TMA_STORE, BLOCK_N, GROUP_M, STAGES, SKEW)),
            (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_N, GROUP_M, STAGES)),
        ], [4, 1], [REGS_MMA, REGS_LOAD])
    else:
        gl.warp_specialize(
            (c_desc, c0, c_ptr, sa_ptr, sw_ptr, bias_ptr, a_bufs, w_bufs, ready, empty, M, N, K, gn,
             stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
             0, HAS_BIAS, TMA_STORE, BLOCK_N, GROUP_M, STAGES, SKEW), _consumer,
            [(c_desc, c1, c_ptr, sa_ptr, sw_ptr, bias_ptr, a_bufs, w_bufs, ready, empty, M, N, K, gn,
              stride_sam, stride_sak, stride_swn, stride_swk, stride_cm, stride_cn,
              1, HAS_BIAS, TMA_STORE, BLOCK_N, GROUP_M, STAGES, SKEW),
             (a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, BLOCK_N, GROUP_M, STAGES)],
            [_consumer, _producer], [4, 1], [REGS_MMA, REGS_LOAD])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself where a bulk tensor copy can read it (unit last stride, 16-byte aligned rows and base), else a
    contiguous copy."""
    ok = t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    return t if ok else t.clone(memory_format=torch.contiguous_format)  # one copy: fresh, aligned, contiguous


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_fp8_scaled(qa: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *, gn: int = 128,
                    out_dtype: torch.dtype = torch.bfloat16, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """C = sum_kb dot(qa, w)[kb] * sa[:, kb] * w_scale[n // gn, kb] (+ bias) on quantized operands, 1 x 128 x gn.

    qa: (M, K) float8_e4m3fn, K a multiple of 16; sa: (M, ceil(K / 128)) fp32, any strides
    w: (N, K) float8_e4m3fn; w_scale: (ceil(N / gn), ceil(K / 128)) fp32; gn a multiple of 128
    bias: (N,) float; out: (M, N) out_dtype (bf16 or fp16)
    config: tuning only (BLOCK_N, STAGES, GROUP_M, consumer registers, producer registers[, SKEW])
    """
    for name, t in (("qa", qa), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float8_e4m3fn or not t.is_cuda:
            raise ValueError(f"gluon gemm_fp8: {name} must be a 2-D float8_e4m3fn CUDA tensor, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    M, K = qa.shape
    N = w.shape[0]
    if w.shape[1] != K or w.device != qa.device:
        raise ValueError(f"gluon gemm_fp8: w {tuple(w.shape)} on {w.device} does not match a ({M}, {K}) on {qa.device}")
    if K % 16:
        raise ValueError(f"gluon gemm_fp8: K={K} must be a multiple of 16 (16-byte rows for the bulk copies)")
    if int(gn) < 1 or int(gn) % 128:
        raise ValueError(f"gluon gemm_fp8: gn={gn} must be a multiple of 128 (a column tile in one weight-scale row)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon gemm_fp8: out_dtype must be bf16 or fp16, got {out_dtype}")
    nk = triton.cdiv(K, 128)
    out = check_scales_bias_out("gluon gemm_fp8", qa, sa, (M, nk), w_scale, (triton.cdiv(N, int(gn)), nk), N, bias,
                                out, out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros((), device=out.device))
    block_n, stages, group_m, regs_mma, regs_load, *skew = config or GEMM_CONFIG
    qa, w = _tma_ready(qa), _tma_ready(w)
    f8 = gl.float8e4nv
    a_desc = TensorDescriptor(qa, list(qa.shape), list(qa.stride()), [128, 128],
                              gl.NVMMASharedLayout.get_default_for([128, 128], f8))
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, 128],
                              gl.NVMMASharedLayout.get_default_for([block_n, 128], f8))
    c_gl = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float16
    tma_store = out.stride(1) == 1 and (out.stride(0) * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
    c_tma = out if tma_store else torch.empty((64, block_n), dtype=out_dtype, device=out.device)  # unused stand-in
    c_desc = TensorDescriptor(c_tma, list(c_tma.shape), list(c_tma.stride()), [64, block_n],
                              gl.NVMMASharedLayout.get_default_for([64, block_n], c_gl))
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, block_n)
    grid = (min(_num_sms(qa.device), tiles),)
    _gemm_fp8_kernel[grid](
        a_desc, w_desc, c_desc, out, sa, w_scale, bias if bias is not None else sa, M, N, K, int(gn),
        *sa.stride(), *w_scale.stride(), *out.stride(),
        HAS_BIAS=bias is not None, TMA_STORE=tma_store, BLOCK_N=block_n, GROUP_M=group_m, STAGES=stages,
        REGS_MMA=regs_mma, REGS_LOAD=regs_load, WS_LIST=ws_list(), SKEW=bool(skew[0]) if skew else True, num_warps=4,
    )
    return out


def gemm_fp8(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, gn: int = 128, *, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """C = A @ W^T (+ bias), A quantized to e4m3 per 1 x 128 group by the Triton quantizer, W e4m3 per gn x 128.

    a: (M, K) bf16 / fp16 CUDA tensor, K a multiple of 16; w: (N, K) float8_e4m3fn
    w_scale: (ceil(N / gn), ceil(K / 128)) fp32; bias: (N,) float; out: (M, N) a's dtype
    """
    from kernel_parity.kernels.triton.gemm_fp8 import act_quant_fp8

    if not isinstance(a, torch.Tensor) or a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon gemm_fp8: a must be a bf16 or fp16 tensor, got {getattr(a, 'dtype', type(a))}")
    qa, sa = act_quant_fp8(a, 1, 128)
    return gemm_fp8_scaled(qa, sa, w, w_scale, bias, out, gn=gn, out_dtype=a.dtype, config=config)
