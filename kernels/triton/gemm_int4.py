"""Int4 group-quantized GEMM (GPTQ v1 and AWQ checkpoints), in Triton: C = A @ W^T (+ bias).

With g the group size along K (research/quant-formats.md §4):

  GPTQ v1: qweight int32 (K/8, N) packed along K, q(k, n) = (qweight[k // 8, n] >> 4 (k % 8)) & 15;
           qzeros int32 (K/g, N/8) packed along N, z(G, n) = (qzeros[G, n // 8] >> 4 (n % 8)) & 15,
           storing zero - 1;  W[n, k] = scales[k // g, n] * (q(k, n) - (z(k // g, n) + 1))
  AWQ:     qweight int32 (K, N/8) packed along N in the interleaved order: column 8j + i is nibble
           rev[i] of qweight[k, j], rev = [0, 4, 1, 5, 2, 6, 3, 7]; qzeros the same packing;
           W[n, k] = scales[k // g, n] * (q(k, n) - z(k // g, n))
  scales fp16 (K/g, N) in both.

Each K tile lies inside one group (BLOCK_K divides g), so a tile needs one row of scales and
zeros. The packed words are loaded once each and unpacked in registers by a broadcast shift into
a (rows, 8, cols) tile reshaped to (BLOCK_K, BLOCK_N). (q - z) * s is exact in fp32 (5 + 11
bits); the tile is then rounded to A's bf16/fp16 and fed to a tensor-core tl.dot with fp32
accumulation (fp32 A: the exact tile, "ieee" fp32 dot). No act-order (g_idx) permutation.
From DEQUANT_MIN_M rows of bf16 / fp16 A the same tiles are written once into an (N, K) buffer
of A's dtype and kernels/triton/gemm_dense.py multiplies (the fused kernel decodes every tile again for
each 256 rows of A, in the warps that run the MMA: benchmarks/NOTES-gemm.md "Version 4").

Golden: refimpl.gemm's dequant reference (A @ dequant(W)^T in float64).
References: vllm-project/vllm vllm/model_executor/layers/quantization/awq_triton.py (AWQ order);
ModelCloud/GPTQModel gptqmodel/nn_modules/qlinear (GPTQ v1 zero - 1 convention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm_dense
from .tiles import grouped_tile_offsets

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for M <= 16 (decode: one row tile,
# many column tiles; unmeasured) and larger M; BLOCK_K is lowered to divide the group. Prefill
# measured on an H100 at M = 4096, 4096^2 and 14336 x 4096 (group 128): (256, 128, 64, 4, 8, 3) 315-334
# TFLOP/s for GPTQ and AWQ, (128, 128, 64, 8, 8, 3) 209-220 (256 rows share each dequantized tile).
DECODE_CONFIG = (16, 64, 128, 1, 4, 3)
PREFILL_CONFIG = (256, 128, 64, 4, 8, 3)
# From DEQUANT_MIN_M rows of bf16 / fp16 A: W dequantized once by _dequant_int4_kernel in (BLOCK_K, BLOCK_N)
# tiles (BLOCK_K lowered to divide the group), then gemm_dense (module docstring there). Measured on an H200
# (benchmarks/gpu_gemm.py int4 section, GPTQ 14336 x 4096, group 128; NOTES-gemm.md "Version 4"): the fused
# kernel 0.112 / 0.216 ms at M = 256 / 512, the dequant path 0.161 / 0.147 ms (its dequantizer ~50 us).
DEQUANT_MIN_M = 512
DEQUANT_TILE = (64, 128)
PATHS = ("auto", "fused", "dequant")


@triton.jit
def _w_tile(QW_ptr, QZ_ptr, S_ptr, k0, group, n0, offs_k, offs_n, mask_n, N,
            stride_qw0, stride_qw1, stride_qz0, stride_qz1, stride_s0, stride_s1,
            AWQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The W^T tile (BLOCK_K, BLOCK_N) at rows k0 .. k0 + BLOCK_K (inside one group) and columns offs_n =
    n0 + 0 .. BLOCK_N, in fp32: (q - z) * s, exact."""
    nib = tl.arange(0, 8)
    grp = k0 // group
    scale = tl.load(S_ptr + grp * stride_s0 + offs_n * stride_s1, mask=mask_n, other=0.0).to(tl.float32)
    if AWQ:
        shift = 4 * ((nib // 2) + 4 * (nib % 2))  # rev[i] = [0, 4, 1, 5, 2, 6, 3, 7][i]
        offs_j = n0 // 8 + tl.arange(0, BLOCK_N // 8)  # packed columns
        mask_j = offs_j < N // 8
        zw = tl.load(QZ_ptr + grp * stride_qz0 + offs_j * stride_qz1, mask=mask_j, other=0)
        zero = tl.reshape((zw[:, None] >> shift[None, :]) & 15, [BLOCK_N])
        qw = tl.load(QW_ptr + (k0 + offs_k)[:, None].to(tl.int64) * stride_qw0 + offs_j[None, :] * stride_qw1,
                     mask=mask_j[None, :], other=0)  # (BLOCK_K, BLOCK_N / 8)
        q = tl.reshape((qw[:, :, None] >> shift[None, None, :]) & 15, [BLOCK_K, BLOCK_N])
    else:
        shift = 4 * nib
        offs_r = tl.arange(0, BLOCK_K // 8)  # packed rows of the K tile
        zw = tl.load(QZ_ptr + grp * stride_qz0 + (offs_n // 8) * stride_qz1, mask=mask_n, other=0)
        zero = ((zw >> (4 * (offs_n % 8))) & 15) + 1  # v1 checkpoints store zero - 1
        qw = tl.load(QW_ptr + (k0 // 8 + offs_r)[:, None].to(tl.int64) * stride_qw0 + offs_n[None, :] * stride_qw1,
                     mask=mask_n[None, :], other=0)  # (BLOCK_K / 8, BLOCK_N)
        q = tl.reshape((qw[:, None, :] >> shift[None, :, None]) & 15, [BLOCK_K, BLOCK_N])
    return (q - zero[None, :]).to(tl.float32) * scale[None, :]


@triton.jit
def _gemm_int4_kernel(
    A_ptr, QW_ptr, QZ_ptr, S_ptr, Bias_ptr, C_ptr, M, N, K, group,
    stride_am, stride_ak, stride_qw0, stride_qw1, stride_qz0, stride_qz1, stride_s0, stride_s1,
    stride_cm, stride_cn,
    AWQ: tl.constexpr, W_TO_A: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GROUP_M row tiles share a W column tile in L2
    pid_m, pid_n, offs_m, offs_n, mask_m, mask_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _w_tile(QW_ptr, QZ_ptr, S_ptr, k0, group, pid_n * BLOCK_N, offs_k, offs_n, mask_n, N,
                    stride_qw0, stride_qw1, stride_qz0, stride_qz1, stride_s0, stride_s1, AWQ, BLOCK_K, BLOCK_N)
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        if W_TO_A:  # rounded to A's bf16/fp16 for the tensor cores; fp32 accumulation
            acc = tl.dot(a, w.to(a.dtype), acc)
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequant_int4_kernel(
    QW_ptr, QZ_ptr, S_ptr, Wd_ptr, N, K, group,
    stride_qw0, stride_qw1, stride_qz0, stride_qz1, stride_s0, stride_s1, stride_wd,
    AWQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Wd (N, K) in its dtype = dequant(W): the fused kernel's tiles, each value rounded once to Wd's dtype."""
    k0 = tl.program_id(0) * BLOCK_K
    n0 = tl.program_id(1) * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = _w_tile(QW_ptr, QZ_ptr, S_ptr, k0, group, n0, offs_k, offs_n, mask_n, N,
                stride_qw0, stride_qw1, stride_qz0, stride_qz1, stride_s0, stride_s1, AWQ, BLOCK_K, BLOCK_N)
    tl.store(Wd_ptr + offs_n[None, :].to(tl.int64) * stride_wd + (k0 + offs_k)[:, None], w.to(Wd_ptr.dtype.element_ty),
             mask=mask_n[None, :])


def _check_int32(name: str, t, shape: tuple[int, int], device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"gemm_int4: {name} must be a {shape} int32 tensor on {device}, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def gemm_int4(a: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group: int = 128, order: str = "gptq", bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, *, config: tuple[int, ...] | None = None,
              path: str = "auto") -> torch.Tensor:
    """C = a @ dequant(W)^T (+ bias) for GPTQ v1 / AWQ int4 group-quantized weights.

    a: (M, K) fp32/bf16/fp16, any strides
    order "gptq": qweight (K/8, N) int32, qzeros (K/g, N/8) int32 (zero - 1), scales (K/g, N)
    order "awq":  qweight (K, N/8) int32 (interleaved nibbles), qzeros (K/g, N/8), scales (K/g, N)
    group: g, a multiple of 16 dividing K (-1: K, one group); N a multiple of 8
    scales: fp16 (any float dtype accepted); bias: (N,) float; out: (M, N) a's dtype
    config: tuning only (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); on the dequant path
            gemm_dense.gemm_nt_dense's tile
    path: "auto"; "fused" (this module's kernel, whatever M) or "dequant" (bf16 / fp16 a only: W dequantized
          once into an (N, K) buffer of a's dtype, the fused kernel's values, then gemm_dense.gemm_nt_dense);
          "auto" takes "dequant" for bf16 / fp16 a from DEQUANT_MIN_M rows (and no config)
    """
    if order not in ("gptq", "awq"):
        raise ValueError(f"gemm_int4: order={order!r} must be 'gptq' or 'awq'")
    if path not in PATHS:
        raise ValueError(f"gemm_int4: path {path!r} is not one of {', '.join(PATHS)}")
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.dtype not in DTYPES:
        raise ValueError(f"gemm_int4: a must be a 2-D fp32/bf16/fp16 tensor, got "
                         f"{getattr(a, 'dtype', type(a))} {tuple(getattr(a, 'shape', ()))}")
    M, K = a.shape
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("gemm_int4: qweight must be a 2-D int32 tensor")
    N = qweight.shape[1] if order == "gptq" else 8 * qweight.shape[1]
    g = K if int(group) == -1 else int(group)
    if g < 16 or g % 16 or K % g or N % 8:
        raise ValueError(f"gemm_int4: group={group} must be a multiple of 16 dividing K={K}, and N={N} a multiple of 8")
    _check_int32("qweight", qweight, (K // 8, N) if order == "gptq" else (K, N // 8), a.device)
    _check_int32("qzeros", qzeros, (K // g, N // 8), a.device)
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (K // g, N) \
            or not scales.dtype.is_floating_point or scales.device != a.device:
        raise ValueError(f"gemm_int4: scales must be a ({K // g}, {N}) float tensor on {a.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)
                             or not bias.dtype.is_floating_point or bias.device != a.device):
        raise ValueError(f"gemm_int4: bias must be a ({N},) float tensor on {a.device}")
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N) or out.dtype != a.dtype \
            or out.device != a.device:
        raise ValueError(f"gemm_int4: out must be a ({M}, {N}) {a.dtype} tensor on {a.device}")
    if path == "dequant" and a.dtype == torch.float32:
        raise ValueError("gemm_int4: path 'dequant' needs bf16 / fp16 a (its dense GEMM runs 16-bit tensor-core "
                         "dots), got float32")
    if M == 0 or N == 0:
        return out
    if path == "dequant" or (path == "auto" and config is None and a.dtype != torch.float32
                             and M >= DEQUANT_MIN_M):
        wd = torch.empty((N, K), dtype=a.dtype, device=a.device)  # a transient bf16 / fp16 copy of W
        block_k, block_n = DEQUANT_TILE
        while g % block_k:
            block_k //= 2
        _dequant_int4_kernel[(K // block_k, triton.cdiv(N, block_n))](
            qweight, qzeros, scales, wd, N, K, g, *qweight.stride(), *qzeros.stride(), *scales.stride(), wd.stride(0),
            AWQ=order == "awq", BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
        return gemm_dense.gemm_nt_dense(a, wd, bias, out, config)
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or (DECODE_CONFIG if M <= 16 else PREFILL_CONFIG)
    while g % block_k:  # each K tile inside one group
        block_k //= 2
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _gemm_int4_kernel[grid](
        a, qweight, qzeros, scales, bias if bias is not None else scales, out, M, N, K, g,
        *a.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(), *out.stride(),
        AWQ=order == "awq", W_TO_A=a.dtype != torch.float32, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )
    return out
