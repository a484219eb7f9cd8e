"""Dense C = A @ W^T (+ bias) over 16-bit operands, in Triton: the second step of the GGML prefill path.

    C[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]),   A (M, K), W (N, K) both bf16 or both fp16

kernels/triton/gemm.py runs a prefill (bf16 / fp16 A, M >= DEQUANT_MIN_M rows) in two launches:
the GGML weights dequantized once into an (N, K) buffer of A's dtype (each value the fp32 dequantization
rounded once, what its fused kernel feeds the tensor cores), then this kernel. The fused kernel decodes
each W tile again for every BLOCK_M rows of A, inside the warps that run the MMA (benchmarks/NOTES-gemm.md:
tensor pipe 32% busy, 0.36-0.38x torch's bf16 matmul at M = 4096 on an H200); here the decode is one
memory-bound pass (tens of microseconds) and the product a plain tensor-core GEMM. gemm_int4.py does the
same for GPTQ / AWQ weights.

Tiles: (BLOCK_M, BLOCK_N) of C a program, BLOCK_K columns an iteration, fp32 accumulation
(tl.dot), grouped launch order (GROUP_M row tiles share each W column tile while it is in L2), the
bias added in fp32, C rounded once to its dtype. On the GPU, when both operands have unit last stride
and 16-byte aligned rows, the A and W tiles are bulk tensor copies (TMA descriptors, zero-filled past
the edges); otherwise (and under the Triton interpreter) masked pointer loads.

References: Triton's matrix-multiplication tutorial (grouped ordering); kernels/triton/gemm_fp8.py
(the same loop over fp8 tiles with block scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import grouped_tile_offsets, tma_operands

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). Measured on an H200 (benchmarks/gpu_gemm.py
# prefill section, DENSE_SWEEP, 4096^3 then 4096 x 14336 x 4096; NOTES-gemm.md "Version 4"): (256, 128, 64)
# over 8 warps, 4 stages, TMA: 696 / 640 TFLOP/s with the dequantization (0.91x / 0.88x torch's bf16 matmul
# in the same run); 3 stages 646 / 625, (128, 256, 64) 565, (128, 128, 64) 614, pointer loads instead of TMA 567.
CONFIG = (256, 128, 64, 8, 8, 4)
DTYPES = (torch.bfloat16, torch.float16)
# bf16 / fp16 A from this many rows: gemm.gemm_nt dequantizes GGML weights once and runs this kernel instead of
# its fused kernel (gemm_int4 has its own threshold, 512). Measured on an H200 (benchmarks/gpu_gemm.py prefill
# section, Q4_K 14336 x 4096, NOTES-gemm.md "Version 4"): the fused kernel 0.117 / 0.120 / 0.234 ms at
# M = 128 / 256 / 512, the dequant path 0.123 / 0.106 / 0.150 ms.
DEQUANT_MIN_M = 256


@triton.jit
def _dense_nt_kernel(
    A_ptr, W_ptr, Bias_ptr, C_ptr, M, N, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GROUP_M row tiles share a W column tile in L2
    pid_m, pid_n, offs_m, offs_n, mask_m, mask_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # A_ptr, W_ptr are tensor descriptors
            a = A_ptr.load([pid_m * BLOCK_M, k0])
            w = W_ptr.load([pid_n * BLOCK_N, k0])
        else:
            mask_k = (k0 + offs_k) < K
            a = tl.load(A_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(W_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :] * stride_wk,
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn,
             acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_nt_dense(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  config: tuple[int, ...] | None = None) -> torch.Tensor:
    """out (M, N) = a (M, K) @ w (N, K)^T (+ bias (N,), any float dtype, added in fp32); a and w of one
    16-bit dtype, any strides; out any strides. config: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
    num_stages[, TMA]) (default CONFIG; TMA 0 forces the pointer loads). Raises ValueError for operands it
    does not take."""
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1] or a.dtype != w.dtype or a.dtype not in DTYPES:
        raise ValueError(f"gemm_nt_dense: a {a.dtype} {tuple(a.shape)} and w {w.dtype} {tuple(w.shape)} must be "
                         f"(M, K) and (N, K) of one dtype in {DTYPES}")
    M, K = a.shape
    N = w.shape[0]
    if tuple(out.shape) != (M, N):
        raise ValueError(f"gemm_nt_dense: out must be ({M}, {N}), got {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out
    block_m, block_n, block_k, group_m, num_warps, num_stages, *opt = config or CONFIG
    a_arg, w_arg, use_tma = tma_operands(a, w, block_m, block_n, block_k, bool(opt[0]) if opt else True)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _dense_nt_kernel[grid](
        a_arg, w_arg, bias if bias is not None else a, out, M, N, K, *a.stride(), *w.stride(), *out.stride(),
        TMA=use_tma, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )
    return out
