"""Launch order and operand descriptors shared by the tiled GEMM kernels (gemm.py, gemm_dense.py, gemm_fp8.py,
gemm_int4.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in a 1-D grid of cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) tiles, in grouped
    order: GROUP_M row tiles run down each column tile of W before the next, so that the column tile (and its
    dequantization, in the fused kernels) is still in L2 for the rows after the first (Triton's matmul
    tutorial's ordering)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    return pid_m, pid_n


@triton.jit
def grouped_tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """grouped_tile's (pid_m, pid_n) and the tile's rows and columns: offs_m, offs_n and their masks
    (offs_m < M, offs_n < N)."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m, pid_n, offs_m, offs_n, offs_m < M, offs_n < N


def _tma_ok(t) -> bool:
    return t.is_cuda and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_operands(a, w, block_m: int, block_n: int, block_k: int, want: bool = True):
    """(a_arg, w_arg, use_tma) for an NT kernel reading (BLOCK_M, BLOCK_K) tiles of a and (BLOCK_N, BLOCK_K) of w:
    tensor descriptors (bulk tensor copies, zero-filled past the edges) where wanted and both operands allow
    them on the GPU (unit last stride, 16-byte aligned rows and base), else the tensors for pointer loads (the
    Triton interpreter has no descriptor loads)."""
    if not (want and _tma_ok(a) and _tma_ok(w)):
        return a, w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
            True)
