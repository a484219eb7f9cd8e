"""RMSNorm (weight w or Gemma's 1 + w, fused residual add) and LayerNorm over the last dim of
aligned rows, in Triton.

    rms_norm:    y = h * rstd * g,             rstd = 1 / sqrt(mean(h^2) + eps),  h = x (+ r),  g = w or 1 + w
    layer_norm:  y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(mean((x - mean)^2) + eps)

Conventions (OPS.md, layers; goldens in refimpl/norm.py): a row is stored in an aligned width
aw = x.shape[1] >= n (C-Kernel-Engine's aligned_embed_dim); the statistics run over the real
lanes [0, n) only, the padding lanes [n, aw) are never read and are written as zeros in y and h;
eps is inside the square root. h = x + r is summed in fp32 and it is that fp32 sum which is
normalised (h is rounded once, on store, as the new residual stream). rstd and mean are fp32.

Precision: every sum is fp32 except LayerNorm's mean, which is summed in fp64. The mean of
zero-mean rows cancels (its error is eps(fp32) x mean|x|, not x |mean|), and x - mean with an
fp32 mean carries half an ulp of the mean: 3e-5 at |mean| = 1000, 3x fp32's atol at unit spread.
So the fp64 mean is split into hi = fp32(mean) and lo = fp32(mean - hi), x - hi is exact for x
near the mean (Sterbenz) and (x - hi) - lo keeps the centred value to an fp32 rounding; the
variance is then the two-pass sum of its squares (a one-pass E[x^2] - E[x]^2 would cancel).
On the GPU the fp64 adds are ~2 per element of a memory-bound kernel.

Dispatch:
- n <= MAX_FUSED_N: `_*_fused_kernel` holds BLOCK_M rows of BLOCK_N = next_pow2(n) in registers:
  one read of x (and r), one write of y (and h): the memory-bound minimum. Rows shorter than
  FUSED_TILE / 2 are packed BLOCK_M to a program so each program still moves a few KB.
  Padding lanes past BLOCK_N (aw > next_pow2(n)) are zeroed by a short loop.
- n > MAX_FUSED_N: `_*_looped_kernel`, one program per row, chunks of LOOP_BLOCK_N: the
  statistics pass, then the normalising pass (LayerNorm: mean, centred squares, write), so
  rows of any length take fp32 vector accumulators instead of spilling registers.

Measured on an H100 (Triton 3.6, torch 2.11; 16K and 32K rows of 4096 and 8192 lanes, % of the
2.97 TB/s device copy bandwidth, bytes = x (+ r) read and y (+ h) written once): bf16 RMSNorm
95-99%, with the residual 98-100%, LayerNorm 95-99% with the warp table of `_num_warps` (84-86%
at 8192 lanes with 16 warps); fp32 97-100%. torch's F.rms_norm / F.layer_norm: 63-75%.

References: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Ba et al., "Layer
Normalization" (2016); the Triton layer-norm tutorial and Liger-Kernel (one row per program,
BLOCK = next_pow2(n), warps by n); vLLM's fused_add_rms_norm (the residual form).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Longest row held in registers: 16384 values over 16 warps is 32 a thread (the same again for the
# weight), inside the 128 registers a thread has when 512 threads share an SM.
MAX_FUSED_N = 16384
# Elements a fused program aims to hold when rows are short (several rows per program).
FUSED_TILE = 4096
# Chunk of a long row per loop step of the looped kernels (8 warps: 16 values a thread; fp64
# accumulators in LayerNorm's mean pass).
LOOP_BLOCK_N = 4096
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rstd(sum_sq, n_cols, eps):
    """1 / sqrt(sum_sq / n + eps): IEEE sqrt and division, once per row."""
    return 1.0 / tl.sqrt_rn(sum_sq / n_cols + eps)


@triton.jit
def _gain(W_ptr, offs_n, mask_n, GEMMA: tl.constexpr):
    """The fp32 gain of the lanes offs_n: w, or 1 + w (Gemma); 0 on masked lanes (x is 0 there)."""
    w = tl.load(W_ptr + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if GEMMA:
        w = w + 1.0  # Gemma stores w and applies (1 + w)
    return w


@triton.jit
def _zero_tail(Y_ptr, rows, mask_m, stride_row, start, n_store, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros in the padding lanes [start, n_store) of BLOCK_M rows (those past one BLOCK_N)."""
    offs_n = tl.arange(0, BLOCK_N)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=Y_ptr.dtype.element_ty)
    for s in range(start, n_store, BLOCK_N):
        mask = mask_m[:, None] & (s + offs_n < n_store)[None, :]
        tl.store(Y_ptr + rows[:, None] * stride_row + s + offs_n[None, :], zero, mask=mask)


@triton.jit
def _rms_norm_fused_kernel(
    X_ptr, R_ptr, W_ptr, Y_ptr, H_ptr, Rstd_ptr,
    n_rows, n_cols, n_store, stride_x_row, stride_r_row, stride_y_row, stride_h_row, stride_rstd, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    GEMMA: tl.constexpr, STORE_RSTD: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < n_rows
    mask_n = offs_n < n_cols
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)  # rows * stride can pass 2^31 elements
    # Lanes past n (padding, the block's tail) load as 0: they add nothing to the sums and
    # come out as 0 * rstd * g = +0, which is what the padding lanes must hold. No eviction hint on
    # x and r: evict_first cost 3-5% of the copy rate on an H200 (bf16 16K / 32K x 4096, 16K x 8192).
    x = tl.load(X_ptr + rows[:, None] * stride_x_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + rows[:, None] * stride_r_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x + r  # h in fp32: normalised unrounded, rounded once as the residual stream
    rstd = _rstd(tl.sum(x * x, axis=1), n_cols, eps)  # fp32 sum of squares over the real lanes
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * _gain(W_ptr, offs_n, mask_n, GEMMA)[None, :]
    mask_out = mask_m[:, None] & (offs_n < n_store)[None, :]  # real and padding lanes
    tl.store(Y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask_out)
    if HAS_RESIDUAL:
        tl.store(H_ptr + rows[:, None] * stride_h_row + offs_n[None, :], x.to(H_ptr.dtype.element_ty),
                 mask=mask_out)
    if STORE_RSTD:
        tl.store(Rstd_ptr + rows * stride_rstd, rstd, mask=mask_m)
    if n_store > BLOCK_N:
        _zero_tail(Y_ptr, rows, mask_m, stride_y_row, BLOCK_N, n_store, BLOCK_M, BLOCK_N)
        if HAS_RESIDUAL:
            _zero_tail(H_ptr, rows, mask_m, stride_h_row, BLOCK_N, n_store, BLOCK_M, BLOCK_N)


@triton.jit
def _rms_norm_looped_kernel(
    X_ptr, R_ptr, W_ptr, Y_ptr, H_ptr, Rstd_ptr,
    n_cols, n_store, stride_x_row, stride_r_row, stride_y_row, stride_h_row, stride_rstd, eps,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = X_ptr + row * stride_x_row, R_ptr + row * stride_r_row
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # BLOCK_N fp32 partial sums, added once at the end
    for start in range(0, n_cols, BLOCK_N):
        mask_n = start + offs_n < n_cols
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(r_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += x * x
    rstd = _rstd(tl.sum(acc, axis=0), n_cols, eps)
    if STORE_RSTD:
        tl.store(Rstd_ptr + row * stride_rstd, rstd)
    # Second read of the row (and of r: h is re-summed in fp32 rather than read back rounded).
    for start in range(0, n_store, BLOCK_N):
        mask_n = start + offs_n < n_cols
        mask_out = start + offs_n < n_store
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(r_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(H_ptr + row * stride_h_row + start + offs_n, x.to(H_ptr.dtype.element_ty), mask=mask_out)
        y = x * rstd
        if HAS_WEIGHT:
            y = y * _gain(W_ptr, start + offs_n, mask_n, GEMMA)
        tl.store(Y_ptr + row * stride_y_row + start + offs_n, y.to(Y_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _layer_norm_fused_kernel(
    X_ptr, W_ptr, B_ptr, Y_ptr, Mean_ptr, Rstd_ptr,
    n_rows, n_cols, n_store, stride_x_row, stride_y_row, stride_mean, stride_rstd, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < n_rows
    mask_n = offs_n < n_cols
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)
    x = tl.load(X_ptr + rows[:, None] * stride_x_row + offs_n[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    # LayerNorm keeps the hint (and _num_warps): unhinted and at 8 warps it ran 80.6-85.8% of copy on an H200 where
    # the hinted kernel had run 90-95% (NOTES-gemm.md, issue 33 seventh session); RMSNorm gains without it
    mean64 = tl.sum(x.to(tl.float64), axis=1) / n_cols  # fp64: the mean cancels
    mean = mean64.to(tl.float32)
    lo = (mean64 - mean.to(tl.float64)).to(tl.float32)  # what fp32(mean) dropped
    xc = tl.where(mask, (x - mean[:, None]) - lo[:, None], 0.0)  # x - hi exact near the mean
    rstd = _rstd(tl.sum(xc * xc, axis=1), n_cols, eps)  # two-pass variance, biased (divides by n)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W_ptr + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B_ptr + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    mask_out = mask_m[:, None] & (offs_n < n_store)[None, :]
    tl.store(Y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask_out)
    if STORE_STATS:
        tl.store(Mean_ptr + rows * stride_mean, mean, mask=mask_m)
        tl.store(Rstd_ptr + rows * stride_rstd, rstd, mask=mask_m)
    if n_store > BLOCK_N:
        _zero_tail(Y_ptr, rows, mask_m, stride_y_row, BLOCK_N, n_store, BLOCK_M, BLOCK_N)


@triton.jit
def _layer_norm_looped_kernel(
    X_ptr, W_ptr, B_ptr, Y_ptr, Mean_ptr, Rstd_ptr,
    n_cols, n_store, stride_x_row, stride_y_row, stride_mean, stride_rstd, eps,
    BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_STATS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X_ptr + row * stride_x_row
    offs_n = tl.arange(0, BLOCK_N)
    acc64 = tl.zeros((BLOCK_N,), dtype=tl.float64)
    for start in range(0, n_cols, BLOCK_N):  # pass 1: the mean, fp64
        x = tl.load(x_row + start + offs_n, mask=start + offs_n < n_cols, other=0.0)
        acc64 += x.to(tl.float64)
    mean64 = tl.sum(acc64, axis=0) / n_cols
    mean = mean64.to(tl.float32)
    lo = (mean64 - mean.to(tl.float64)).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):  # pass 2: centred squares, fp32
        mask_n = start + offs_n < n_cols
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xc = tl.where(mask_n, (x - mean) - lo, 0.0)
        acc += xc * xc
    rstd = _rstd(tl.sum(acc, axis=0), n_cols, eps)
    if STORE_STATS:
        tl.store(Mean_ptr + row * stride_mean, mean)
        tl.store(Rstd_ptr + row * stride_rstd, rstd)
    for start in range(0, n_store, BLOCK_N):  # pass 3: write (usually from L2)
        mask_n = start + offs_n < n_cols
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = tl.where(mask_n, (x - mean) - lo, 0.0) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W_ptr + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B_ptr + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y_ptr + row * stride_y_row + start + offs_n, y.to(Y_ptr.dtype.element_ty),
                 mask=start + offs_n < n_store)


# ---- launchers -----------------------------------------------------------------------------------

def _num_warps(tile: int, elt: int) -> int:
    """Warps for a program of `tile` values of `elt` bytes: 16-bit rows ~32 values a thread, fp32 ~16.

    Measured on an H100 (Triton 3.6; 16K / 32K rows, % of the 2.97 TB/s copy bandwidth): bf16 at
    4096 lanes 4 warps (RMSNorm 94.5 / 97.6%, LayerNorm 95.1 / 97.4%; 8 warps the same within 1%), at
    8192 lanes 8 warps (98.0 / 99.6%, LayerNorm 97.2 / 98.9%; 16 warps, Liger's choice, left
    LayerNorm, with its fp64 mean, at 84-86%); 32 warps lost 10-45% everywhere. fp32 rows at 16
    values a thread (the earlier table) reached 97-100% at 4096 and 8192 lanes."""
    return max(4, min(16, tile // (512 if elt >= 4 else 1024)))


def _rms_num_warps(tile: int, elt: int) -> int:
    """The RMSNorm forward's warps: _num_warps, but 16-bit tiles up to 8192 values take 8. On an H200, with x's
    load unhinted (benchmarks/NOTES-gemm.md, issue 33 seventh session), bf16 at 4096 lanes ran 1-2 points of the
    copy rate faster at 8 warps than at 4 (16K / 32K rows: 102.3 / 102.4% against 100.2 / 101.0% of a plain copy
    kernel's rate in one run; liger 101.6 / 104.2%)."""
    return _num_warps(tile, elt) if elt >= 4 or tile > 8192 else 8


def _fused_shape(rows: int, n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): whole rows, short ones packed until a program holds ~FUSED_TILE values."""
    block_n = max(16, triton.next_power_of_2(n))
    block_m = min(max(1, FUSED_TILE // block_n), triton.next_power_of_2(rows))
    return block_m, block_n


def _check_rows(what: str, name: str, a: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None
                ) -> torch.Tensor | None:
    """`a`: None, or (rows, aw) like `like` (dtype `dtype`, default like's), last-dim stride 1."""
    if a is None:
        return None
    dtype = like.dtype if dtype is None else dtype
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(like.shape) or a.dtype != dtype:
        got = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"{what}: {name} must be {tuple(like.shape)} {dtype}, got {got}")
    if a.device != like.device:
        raise ValueError(f"{what}: {name} is on {a.device}, x on {like.device}")
    if a.shape[1] > 1 and a.stride(1) != 1:
        raise ValueError(f"{what}: {name} must have last-dim stride 1, got strides {a.stride()}")
    if a.shape[0] > 1 and a.stride(0) < a.shape[1]:
        raise ValueError(f"{what}: {name} row stride {a.stride(0)} < aligned width {a.shape[1]}: rows overlap")
    return a


def _check_vector(what: str, name: str, a: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    """A per-lane vector (weight, bias): 1-D, >= n lanes, float, stride 1, on x's device."""
    if a is None:
        return
    if not isinstance(a, torch.Tensor) or a.dim() != 1 or a.shape[0] < n:
        shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"{what}: {name} must be 1-D with at least n={n} lanes, got shape {shape}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: {name} dtype {a.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if a.device != x.device:
        raise ValueError(f"{what}: {name} is on {a.device}, x on {x.device}")
    if n > 1 and a.stride(0) != 1:
        raise ValueError(f"{what}: {name} must have stride 1, got {a.stride(0)}")


def _check_stat(what: str, name: str, a: torch.Tensor | None, x: torch.Tensor) -> None:
    if a is None:
        return
    rows = x.shape[0]
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != (rows,) or a.dtype != torch.float32 or a.device != x.device:
        got = f"{tuple(a.shape)} {a.dtype} on {a.device}" if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"{what}: {name} must be ({rows},) float32 on {x.device}, got {got}")


def _check_x(what: str, x: torch.Tensor, n: int | None, eps: float) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: x must be a 2-D tensor (rows, aligned width), got shape {shape}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: x dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    aw = x.shape[1]
    n = aw if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= aw:
        raise ValueError(f"{what}: real width n={n!r} must be an integer in [1, {aw}] (x's aligned width)")
    if aw > 1 and x.stride(1) != 1:
        raise ValueError(f"{what}: x must have last-dim stride 1, got strides {x.stride()}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{what}: eps={eps!r} must be a finite number >= 0")
    return n


def _stride(a: torch.Tensor | None, dim: int = 0) -> int:
    return 0 if a is None else a.stride(dim)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, *, n: int | None = None, gemma: bool = False,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             out_h: torch.Tensor | None = None, out_rstd: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """RMSNorm of the real lanes of aligned rows, fp32 math; padding lanes of y and h written as 0.

    x: (rows, aw) fp32/fp16/bf16, last-dim stride 1, any row stride; lanes [n, aw) never read
    w: (>= n,) float weight (lanes [0, n) used), or None for no affine; gemma applies 1 + w
    residual: (rows, aw) like x, or None; with it h = x + r is normalised and returned
    out: (rows, aw) x's dtype, last-dim stride 1; allocated if None
    out_h: (rows, aw) x's dtype for h (allocated if None and residual is given)
    out_rstd: (rows,) float32: 1 / sqrt(mean(h^2) + eps); rstd is computed only when given
    returns: (out, out_h or None, out_rstd or None)
    """
    what = "rms_norm"
    n = _check_x(what, x, n, eps)
    _check_vector(what, "w", w, n, x)
    if gemma and w is None:
        raise ValueError(f"{what}: gemma=True needs a weight w (it applies 1 + w)")
    _check_rows(what, "residual", residual, x)
    if out_h is not None and residual is None:
        raise ValueError(f"{what}: out_h given without a residual (h = x + residual)")
    out = _check_rows(what, "out", out, x) if out is not None else torch.empty_like(x)
    if residual is not None:
        out_h = _check_rows(what, "out_h", out_h, x) if out_h is not None else torch.empty_like(x)
    _check_stat(what, "out_rstd", out_rstd, x)
    rows, aw = x.shape
    if rows == 0:
        return out, out_h, out_rstd
    flags = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=w is not None, GEMMA=bool(gemma),
                 STORE_RSTD=out_rstd is not None)
    # Pointers of absent tensors are never dereferenced (their constexpr flag is off): pass x.
    ptrs = (x, residual if residual is not None else x, w if w is not None else x, out,
            out_h if out_h is not None else out, out_rstd if out_rstd is not None else x)
    strides = (x.stride(0), _stride(residual), out.stride(0), _stride(out_h), _stride(out_rstd))
    if n <= MAX_FUSED_N:
        block_m, block_n = _fused_shape(rows, n)
        _rms_norm_fused_kernel[(triton.cdiv(rows, block_m),)](
            *ptrs, rows, n, aw, *strides, float(eps), BLOCK_M=block_m, BLOCK_N=block_n, **flags,
            num_warps=_rms_num_warps(block_m * block_n, x.element_size()))
    else:
        _rms_norm_looped_kernel[(rows,)](
            *ptrs, n, aw, *strides, float(eps), BLOCK_N=LOOP_BLOCK_N, **flags,
            num_warps=_num_warps(LOOP_BLOCK_N, 4))
    return out, out_h, out_rstd


def layer_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, *,
               n: int | None = None, out: torch.Tensor | None = None, out_mean: torch.Tensor | None = None,
               out_rstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """LayerNorm (biased variance, eps inside the sqrt) of the real lanes of aligned rows.

    x: (rows, aw) fp32/fp16/bf16, last-dim stride 1, any row stride; lanes [n, aw) never read
    w, b: (>= n,) float weight and bias (lanes [0, n) used), each or both None
    out: (rows, aw) x's dtype, last-dim stride 1; allocated if None; padding lanes written as 0
    out_mean, out_rstd: (rows,) float32 (both or neither): mean and 1 / sqrt(var + eps)
    returns: (out, out_mean or None, out_rstd or None)
    """
    what = "layer_norm"
    n = _check_x(what, x, n, eps)
    _check_vector(what, "w", w, n, x)
    _check_vector(what, "b", b, n, x)
    out = _check_rows(what, "out", out, x) if out is not None else torch.empty_like(x)
    if (out_mean is None) != (out_rstd is None):
        raise ValueError(f"{what}: out_mean and out_rstd come together (both or neither)")
    _check_stat(what, "out_mean", out_mean, x)
    _check_stat(what, "out_rstd", out_rstd, x)
    rows, aw = x.shape
    if rows == 0:
        return out, out_mean, out_rstd
    stats = out_mean is not None
    flags = dict(HAS_WEIGHT=w is not None, HAS_BIAS=b is not None, STORE_STATS=stats)
    ptrs = (x, w if w is not None else x, b if b is not None else x, out,
            out_mean if stats else x, out_rstd if stats else x)
    strides = (x.stride(0), out.stride(0), _stride(out_mean), _stride(out_rstd))
    if n <= MAX_FUSED_N:
        block_m, block_n = _fused_shape(rows, n)
        _layer_norm_fused_kernel[(triton.cdiv(rows, block_m),)](
            *ptrs, rows, n, aw, *strides, float(eps), BLOCK_M=block_m, BLOCK_N=block_n, **flags,
            num_warps=_num_warps(block_m * block_n, x.element_size()))
    else:
        _layer_norm_looped_kernel[(rows,)](
            *ptrs, n, aw, *strides, float(eps), BLOCK_N=LOOP_BLOCK_N, **flags,
            num_warps=_num_warps(LOOP_BLOCK_N, 4))
    return out, out_mean, out_rstd
