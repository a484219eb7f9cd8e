"""The VJP of C = A @ W^T (+ bias) in Triton: two GEMMs and a column sum, fp32 accumulation.

    da[m, k] = sum_n dc[m, n] W[n, k]        W float32, or GGML blocks dequantized in registers
    dw[n, k] = sum_m dc[m, n] A[m, k]        float32 W only (a quantized weight has no gradient)
    db[n]    = sum_m dc[m, n]                float32 W with a bias

Kernels:
- `_matmul_kernel`: C = X @ Y with any strides (da = dc @ W; dw = dc^T @ A through dc's strides, no
  transposed copy). fp32 operands go to an "ieee" fp32 dot (exact products, fp32 sums, no tf32); 16-bit
  operands (bf16 / fp16 dc and A) to the tensor cores in that dtype, W rounded to it first as the forward
  does, with fp32 accumulation. dw is stored in fp32.
- `_da_ggml_kernel`: da for a GGML weight (Q8_0, Q4_0, Q4_K, Q6_K). The reduction runs over W's rows (N),
  across the blocks the forward reads along K, so a program owns G groups of K columns and walks N: each
  (BLOCK_N, G, E) tile is dequantized by the forward kernel's decoders (kernels/triton/gemm.py `_dq_*`:
  one fp32 rounding of every exact value, ggml's) and multiplied in per part, each part's columns at the
  offsets `_k_of` gives them (Q4_0's low / high nibbles, Q4_K's sub-block pairs, Q6_K's four quarters).
- `_colsum_kernel`: db, the rows of dc summed in fp32 in row order, BLOCK_M rows a step.

References: the forward kernels (gemm.py) for the GGML layouts; FlashAttention-2's and llm.c's matmul
backward for the two-GEMM decomposition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import FORMATS, _dq_q4_0, _dq_q4_k, _dq_q6_k, _dq_q8_0, _k_of

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MATMUL_CONFIG = (64, 64, 32, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
# da of a GGML weight: (BLOCK_M, BLOCK_N, G, num_warps, num_stages); G groups of E elements = 64 columns
DA_CONFIGS = {"q8_0": (64, 64, 2, 4, 3), "q4_0": (64, 64, 2, 4, 3), "q4_k": (64, 64, 1, 4, 3),
              "q6_k": (64, 64, 1, 4, 3)}
COLSUM_BLOCK = (32, 128)  # BLOCK_M, BLOCK_N


@triton.jit
def _matmul_kernel(X_ptr, Y_ptr, C_ptr, M, N, K, stride_xm, stride_xk, stride_yk, stride_yn, stride_cm, stride_cn,
                   F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] = X[M, K] @ Y[K, N], fp32 accumulation; C in its own dtype."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        y = tl.load(Y_ptr + offs_k[:, None].to(tl.int64) * stride_yk + offs_n[None, :] * stride_yn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if F32_DOT:  # exact fp32 products, fp32 sums (no tf32)
            acc = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
        else:  # 16-bit operands on the tensor cores (an fp32 W rounded to X's dtype), fp32 accumulation
            acc = tl.dot(x, y.to(x.dtype), acc)
    tl.store(C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _part_dot(acc, dc, w, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, E: tl.constexpr):
    """acc (BLOCK_M, G * E) += dc (BLOCK_M, BLOCK_N) @ w (BLOCK_N, G, E) flattened to (BLOCK_N, G * E)."""
    w2 = tl.reshape(w, [BLOCK_N, G * E])
    if F32_DOT:
        acc = tl.dot(dc.to(tl.float32), w2, acc, input_precision="ieee")
    else:  # the dequantized tile rounded to dc's bf16 / fp16 for the tensor cores, fp32 accumulation
        acc = tl.dot(dc, w2.to(dc.dtype), acc)
    return acc


@triton.jit
def _store_part(DA_ptr, acc, offs_m, mask_m, stride_dam, stride_dak, g0, n_groups, FMT: tl.constexpr,
                P: tl.constexpr, G: tl.constexpr, E: tl.constexpr):
    """da[:, k] = acc for part P's columns k of the groups g0 .. g0 + G - 1."""
    c = tl.arange(0, G * E)
    g = g0 + c // E
    k = _k_of(FMT, g, c % E, P)
    tl.store(DA_ptr + offs_m[:, None].to(tl.int64) * stride_dam + k[None, :] * stride_dak,
             acc.to(DA_ptr.dtype.element_ty), mask=mask_m[:, None] & (g < n_groups)[None, :])


@triton.jit
def _da_ggml_kernel(DC_ptr, W_ptr, DA_ptr, M, N, n_groups, stride_dcm, stride_dcn, stride_wn, stride_dam, stride_dak,
                    FMT: tl.constexpr, E: tl.constexpr, G: tl.constexpr, F32_DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """da = dc @ dequant(W) for the G groups of K columns of program pid_g (module docstring)."""
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    g0 = pid_g * G
    g = g0 + tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    acc0 = tl.zeros((BLOCK_M, G * E), dtype=tl.float32)  # one fp32 accumulator per part
    acc1 = tl.zeros((BLOCK_M, G * E), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, G * E), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, G * E), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        dc = tl.load(DC_ptr + offs_m[:, None].to(tl.int64) * stride_dcm + offs_n[None, :] * stride_dcn,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        Wrow = W_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
        mask = mask_n[:, None, None] & (g < n_groups)  # rows past N and groups past K decode to 0
        if FMT == 0:
            w0 = _dq_q8_0(Wrow, g, e, mask)
            acc0 = _part_dot(acc0, dc, w0, F32_DOT, BLOCK_N, G, E)
        elif FMT == 1:
            w0, w1 = _dq_q4_0(Wrow, g, e, mask)
            acc0 = _part_dot(acc0, dc, w0, F32_DOT, BLOCK_N, G, E)
            acc1 = _part_dot(acc1, dc, w1, F32_DOT, BLOCK_N, G, E)
        elif FMT == 2:
            w0, w1 = _dq_q4_k(Wrow, g, e, mask)
            acc0 = _part_dot(acc0, dc, w0, F32_DOT, BLOCK_N, G, E)
            acc1 = _part_dot(acc1, dc, w1, F32_DOT, BLOCK_N, G, E)
        else:
            w0, w1, w2, w3 = _dq_q6_k(Wrow, g, e, mask)
            acc0 = _part_dot(acc0, dc, w0, F32_DOT, BLOCK_N, G, E)
            acc1 = _part_dot(acc1, dc, w1, F32_DOT, BLOCK_N, G, E)
            acc2 = _part_dot(acc2, dc, w2, F32_DOT, BLOCK_N, G, E)
            acc3 = _part_dot(acc3, dc, w3, F32_DOT, BLOCK_N, G, E)
    _store_part(DA_ptr, acc0, offs_m, mask_m, stride_dam, stride_dak, g0, n_groups, FMT, 0, G, E)
    if FMT != 0:
        _store_part(DA_ptr, acc1, offs_m, mask_m, stride_dam, stride_dak, g0, n_groups, FMT, 1, G, E)
    if FMT == 3:
        _store_part(DA_ptr, acc2, offs_m, mask_m, stride_dam, stride_dak, g0, n_groups, FMT, 2, G, E)
        _store_part(DA_ptr, acc3, offs_m, mask_m, stride_dam, stride_dak, g0, n_groups, FMT, 3, G, E)


@triton.jit
def _colsum_kernel(X_ptr, Out_ptr, M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum_m x[m, n] in fp32, BLOCK_M rows a step in row order."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        x = tl.load(X_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_n[None, :],
                    mask=(offs_m < M)[:, None] & mask_n[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(Out_ptr + offs_n, acc.to(Out_ptr.dtype.element_ty), mask=mask_n)


def matmul(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = x (M, K) @ y (K, N), any strides, fp32 accumulation (module docstring)."""
    m, k = x.shape
    n = y.shape[1]
    if y.shape[0] != k or tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: x {tuple(x.shape)} @ y {tuple(y.shape)} does not give out {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = MATMUL_CONFIG
    _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, y, out, m, n, k, *x.stride(), *y.stride(), *out.stride(),
        F32_DOT=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def colsum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (N,) = the sum of x's (M, N) rows, fp32 (x's last-axis stride 1, out contiguous)."""
    m, n = x.shape
    if n and (x.stride(1) != 1 or not out.is_contiguous()):
        raise ValueError(f"colsum: x needs last-axis stride 1 (strides {tuple(x.stride())}) and out contiguous")
    bm, bn = COLSUM_BLOCK
    if n:
        _colsum_kernel[(triton.cdiv(n, bn),)](x, out, m, n, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


def backward_da(dc: torch.Tensor, wfmt: str, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (M, K) = dc (M, N) @ W (N, K): "f32" W (N, K) float32, or GGML blocks (N, K / QK * nbytes) uint8
    (one of gemm.FORMATS), dequantized in registers. out in dc's dtype, any strides."""
    m, n = dc.shape
    if wfmt == "f32":
        if w.dim() != 2 or w.shape[0] != n or w.dtype != torch.float32:
            raise ValueError(f"backward_da: an f32 w must be ({n}, K) float32, got {w.dtype} {tuple(w.shape)}")
        return matmul(dc, w, out)
    if wfmt not in FORMATS:
        raise ValueError(f"backward_da: weight format {wfmt!r} is not f32 or one of {sorted(FORMATS)}")
    fid, qk, nbytes, gpb, e = FORMATS[wfmt]
    k = out.shape[1]
    if k % qk or w.dtype != torch.uint8 or tuple(w.shape) != (n, k // qk * nbytes) or (w.numel() and w.stride(1) != 1):
        raise ValueError(f"backward_da[{wfmt}]: w must be uint8 ({n}, {k // qk * nbytes}) with last-axis stride 1 "
                         f"for K = {k} (a multiple of {qk}), got {w.dtype} {tuple(w.shape)}")
    align = 4 if wfmt == "q4_k" else 2  # the forward decoders' widest scalar load
    if w.numel() and (w.data_ptr() % align or w.stride(0) % align):
        raise ValueError(f"backward_da[{wfmt}]: w's rows must start at {align}-byte aligned addresses")
    if m == 0 or k == 0:
        return out
    if n == 0:
        return out.zero_()
    n_groups = k // qk * gpb
    bm, bn, g, warps, stages = DA_CONFIGS[wfmt]
    _da_ggml_kernel[(triton.cdiv(m, bm), triton.cdiv(n_groups, g))](
        dc, w, out, m, n, n_groups, *dc.stride(), w.stride(0), *out.stride(), FMT=fid, E=e, G=g,
        F32_DOT=dc.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return out


def gemm_nt_backward(a: torch.Tensor, wfmt: str, w: torch.Tensor, dc: torch.Tensor, *, bias: bool = False,
                     out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The VJP of C = a @ W^T (+ bias): {"da"} and, for "f32" W, {"dw"} (+ {"db"} when `bias`).

    a: (M, K) fp32 / bf16 / fp16;  w: "f32" (N, K) float32 or GGML blocks (gemm.FORMATS);  dc: (M, N), a's dtype
    out: preallocated gradients (any subset): da (M, K) in a's dtype, dw (N, K) and db (N,) float32
    """
    if a.dim() != 2 or dc.dim() != 2 or a.dtype not in DTYPES or dc.dtype != a.dtype or dc.shape[0] != a.shape[0]:
        raise ValueError(f"gemm_nt_backward: a (M, K) and dc (M, N) must be 2-D and of one fp32/bf16/fp16 dtype, "
                         f"got a {a.dtype} {tuple(a.shape)}, dc {dc.dtype} {tuple(dc.shape)}")
    m, k = a.shape
    n = dc.shape[1]
    shapes = {"da": ((m, k), a.dtype)}
    if wfmt == "f32":
        shapes["dw"] = ((n, k), torch.float32)
        if bias:
            shapes["db"] = ((n,), torch.float32)
    res = dict(out or {})
    for name, (shape, dtype) in shapes.items():
        if name not in res:
            res[name] = torch.empty(shape, dtype=dtype, device=a.device)
        elif tuple(res[name].shape) != shape or res[name].dtype != dtype:
            raise ValueError(f"out[{name!r}] must be a {shape} {dtype} tensor, got {tuple(res[name].shape)} "
                             f"{res[name].dtype}")
    backward_da(dc, wfmt, w, res["da"])
    if "dw" in res:
        matmul(dc.t(), a, res["dw"])  # dc^T through strides: (N, M) @ (M, K)
    if "db" in res:
        colsum(dc, res["db"])
    return res
