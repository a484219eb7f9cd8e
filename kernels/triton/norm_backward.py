"""The backward of RMSNorm (weight w or Gemma's 1 + w, fused residual add) and LayerNorm over the
last dim of aligned rows, in Triton.

    rms_norm:    dx = rstd (g dy - h rstd^2 mean(h g dy)) (+ dh),   dw = sum over rows of dy h rstd
    layer_norm:  dx = rstd (d - mean(d) - xhat mean(d xhat)),       d = w dy,  xhat = (x - mean) rstd
                 dw = sum over rows of dy xhat,                     db = sum over rows of dy

Conventions (OPS.md "backward"; goldens refimpl/norm.py `*_backward`; forward kernels norm.py): rows
are stored in an aligned width aw >= n; lanes [n, aw) of x, r, dy and dh are never read and dx's are
written as zeros; rstd (and LayerNorm's mean) are the forward's fp32 statistics, one per row. With
the fused residual h = x + r (summed in fp32, as the forward does), dx is also r's gradient and
includes the cotangent dh of h. Gemma's (1 + w) scales dy; dw has the same formula.

Precision: fp32 arithmetic, one rounding on store. The saved LayerNorm mean is the fp32 rounding of
the true mean: x - mean is exact near the mean (Sterbenz), so the mean of those differences, lo, is
exactly the rounding the saved mean dropped (half an ulp of 1000 on `shifted` rows: 3x fp32's atol
if left in xhat), and xhat = ((x - mean) - lo) rstd takes it out: one more row sum, in registers.

Two steps for the weight gradients: step 1 (`_*_bwd_fused_kernel` / `_*_bwd_looped_kernel`) gives each
program a contiguous range of rows; it writes their dx and sums their dy h rstd (dy xhat, dy) into
an fp32 partial row of its own; step 2 (`_partials_reduce_kernel`) sums the partial rows column by
column in fp32 and rounds once. No atomics, so the result is deterministic. On a GPU the programs
are a few per SM (the partials are programs x n fp32: ~1% of the rows' traffic at 16K rows); under
the interpreter a handful.

Dispatch: n <= MAX_FUSED_N holds BLOCK_M rows of BLOCK_N = next_pow2(n) lanes in registers (x, dy and the
row's intermediates: one read of each input, one write of dx), the gain held across rows. Rows up to
MAX_WIDE_N (14336-lane Llama-3 / Mistral MLP widths) whose row strides are multiples of 16 elements take the
wide kernels: one row at a time, whole, BLOCK_N = next_pow2(n); the row sums from one read, then the row
read again (from L1) for dx and the partials, so only the partial rows stay in registers across the sums
(holding the row as the fused kernel does spilled: ptxas sm_90a, 16 warps, RMSNorm 184 / LayerNorm 512
bytes a thread; the wide kernels 0 / 128, and LayerNorm's at its 8 warps 255 registers and 192 bytes,
still the fastest of 4 / 8 / 16 warps). Longer rows, and rows whose stride Triton cannot prove 16-byte
aligned (element-wise loads: the wide kernels at 8200 lanes ran at 13% / 6% of copy), take the looped
kernels: chunks of LOOP_BLOCK_N, two passes per row (the row sums, then dx and the partial, read-modify-
written each row), the second read mostly from L2.
Measured on an H200 (bf16, benchmarks/gpu_norm_bwd_tune.py, % of the copy rate of the same run, x + dy
read and dx written; reports/baselines/norm-bwd-tune-h200.json): 16384 x 14336 RMSNorm 28.9% (looped,
before) -> 77.6% (liger 73.0%, torch 36.3%), LayerNorm 20.6% -> 49.3% (liger 41.8%, torch 36.1%); 4096 x
14336 25.7% -> 65.1% (liger 43.0%) and 17.4% -> 40.3% (liger 18.8%); with 2 programs per SM instead of 4,
32768 x 4096 RMSNorm 69.9% -> 77.1%, LayerNorm 55.7% -> 65.7%.

References: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Ba et al., "Layer
Normalization" (2016); the Triton layer-norm tutorial (the partial-sum reduction of dw, db);
C-Kernel-Engine's rmsnorm backward with d_gamma.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.triton.norm import SUPPORTED_DTYPES, _check_rows, _check_stat, _check_vector, _gain, \
    _num_warps, _zero_tail

# Longest row held in registers: x (+ r), dy, their products and the partial sums are ~6 fp32 values a
# lane, so half the forward's MAX_FUSED_N keeps a thread under ~100 registers at 16 warps.
MAX_FUSED_N = 8192
FUSED_TILE = 4096
# Rows of MAX_FUSED_N < n <= MAX_WIDE_N lanes (and row strides a multiple of 16) take the wide kernels: one
# row at a time, whole, read twice (the row sums, then dx and the partials, the second read from L1), so only
# the partial rows stay in registers across the sums. Warps measured on an H200 (16384 x 14336 bf16, % of
# copy): RMSNorm 16 warps 77.7% (8: 63.0%, 32: 74.9%), LayerNorm 8 warps 49.3% (16: 44.3%, 4: 17.9%).
MAX_WIDE_N = 16384
WIDE_WARPS = 16
LN_WIDE_WARPS = 8
LOOP_BLOCK_N = 2048
# Programs of step 1 on a GPU: two per SM keep every SM streaming while the partial rows stay a small
# fraction of the traffic; step 2 in column slices of REDUCE_BLOCK_N (64 programs at 4096 lanes). Under
# the interpreter (no SMs) a handful exercise the reduction.
PROGRAMS_PER_SM = 2
INTERPRETER_PROGRAMS = 4
REDUCE_BLOCK_P = 32
REDUCE_BLOCK_N = 64


@triton.jit
def _rms_norm_bwd_fused_kernel(
    X_ptr, R_ptr, W_ptr, Rstd_ptr, DY_ptr, DH_ptr, DX_ptr, DWP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_r_row, stride_dy_row, stride_dh_row,
    stride_dx_row, stride_rstd, stride_dwp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    g = _gain(W_ptr, offs_n, mask_n, GEMMA)  # 0 on masked lanes
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # this program's partial of dw, fp32
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for m0 in range(row_start, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        rows = offs_m.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        # lanes past n load as 0: they add nothing to the sums and give dx = 0 there
        h = tl.load(X_ptr + rows[:, None] * stride_x_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = h + tl.load(R_ptr + rows[:, None] * stride_r_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + rows[:, None] * stride_dy_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd_ptr + rows * stride_rstd, mask=mask_m, other=0.0)
        gdy = dy * g[None, :]
        c = rstd * rstd * (tl.sum(h * gdy, axis=1) / n_cols)  # rstd^2 mean(h g dy), fp32 sum
        dx = rstd[:, None] * (gdy - h * c[:, None])
        if HAS_RESIDUAL:
            dx += tl.load(DH_ptr + rows[:, None] * stride_dh_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        mask_out = mask_m[:, None] & (offs_n < n_store)[None, :]
        tl.store(DX_ptr + rows[:, None] * stride_dx_row + offs_n[None, :], dx.to(DX_ptr.dtype.element_ty),
                 mask=mask_out)
        dw_acc += tl.sum(dy * (h * rstd[:, None]), axis=0)
        if n_store > BLOCK_N:
            _zero_tail(DX_ptr, rows, mask_m, stride_dx_row, BLOCK_N, n_store, BLOCK_M, BLOCK_N)
    tl.store(DWP_ptr + pid * stride_dwp + offs_n, dw_acc, mask=mask_n)


@triton.jit
def _rms_norm_bwd_looped_kernel(
    X_ptr, R_ptr, W_ptr, Rstd_ptr, DY_ptr, DH_ptr, DX_ptr, DWP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_r_row, stride_dy_row, stride_dh_row,
    stride_dx_row, stride_rstd, stride_dwp,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    dwp_row = DWP_ptr + pid * stride_dwp  # zeroed by the launcher; this program's own row
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    base = pid.to(tl.int64) * rows_per_prog  # row * stride can pass 2^31 elements
    for row32 in range(row_start, row_end):
        row = base + (row32 - row_start)
        x_row, r_row = X_ptr + row * stride_x_row, R_ptr + row * stride_r_row
        dy_row = DY_ptr + row * stride_dy_row
        rstd = tl.load(Rstd_ptr + row * stride_rstd)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):  # pass 1: sum(h g dy)
            mask_n = start + offs_n < n_cols
            h = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = h + tl.load(r_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += h * (dy * _gain(W_ptr, start + offs_n, mask_n, GEMMA))
        c = rstd * rstd * (tl.sum(acc, axis=0) / n_cols)
        for start in range(0, n_store, BLOCK_N):  # pass 2: dx and this program's dw partial
            mask_n = start + offs_n < n_cols
            h = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = h + tl.load(r_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            dx = rstd * (dy * _gain(W_ptr, start + offs_n, mask_n, GEMMA) - h * c)
            if HAS_RESIDUAL:
                dx += tl.load(DH_ptr + row * stride_dh_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(DX_ptr + row * stride_dx_row + start + offs_n, dx.to(DX_ptr.dtype.element_ty),
                     mask=start + offs_n < n_store)
            part = tl.load(dwp_row + start + offs_n, mask=mask_n, other=0.0)
            tl.store(dwp_row + start + offs_n, part + dy * (h * rstd), mask=mask_n)


@triton.jit
def _layer_norm_bwd_fused_kernel(
    X_ptr, W_ptr, Mean_ptr, Rstd_ptr, DY_ptr, DX_ptr, DWP_ptr, DBP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_dy_row, stride_dx_row, stride_mean, stride_rstd,
    stride_dwp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    w = tl.load(W_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for m0 in range(row_start, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        rows = offs_m.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        x = tl.load(X_ptr + rows[:, None] * stride_x_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + rows[:, None] * stride_dy_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean_ptr + rows * stride_mean, mask=mask_m, other=0.0)
        rstd = tl.load(Rstd_ptr + rows * stride_rstd, mask=mask_m, other=0.0)
        xc = tl.where(mask, x - mean[:, None], 0.0)  # exact near the mean
        lo = tl.sum(xc, axis=1) / n_cols  # the rounding the fp32 mean dropped
        xhat = tl.where(mask, (xc - lo[:, None]) * rstd[:, None], 0.0)
        d = dy * w[None, :]
        m1 = tl.sum(d, axis=1) / n_cols
        m2 = tl.sum(d * xhat, axis=1) / n_cols
        dx = tl.where(mask, rstd[:, None] * ((d - m1[:, None]) - xhat * m2[:, None]), 0.0)
        mask_out = mask_m[:, None] & (offs_n < n_store)[None, :]
        tl.store(DX_ptr + rows[:, None] * stride_dx_row + offs_n[None, :], dx.to(DX_ptr.dtype.element_ty),
                 mask=mask_out)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
        if n_store > BLOCK_N:
            _zero_tail(DX_ptr, rows, mask_m, stride_dx_row, BLOCK_N, n_store, BLOCK_M, BLOCK_N)
    tl.store(DWP_ptr + pid * stride_dwp + offs_n, dw_acc, mask=mask_n)
    if HAS_BIAS:
        tl.store(DBP_ptr + pid * stride_dwp + offs_n, db_acc, mask=mask_n)


@triton.jit
def _zero_row_tail(row_ptr, n_store, BLOCK_N: tl.constexpr):
    """Zeros in one row's padding lanes [BLOCK_N, n_store) (an aligned width past next_pow2(n))."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(BLOCK_N, n_store, BLOCK_N):  # padding lanes past one BLOCK_N
        tl.store(row_ptr + start + offs_n, tl.zeros((BLOCK_N,), row_ptr.dtype.element_ty),
                 mask=start + offs_n < n_store)


@triton.jit
def _rms_norm_bwd_wide_kernel(
    X_ptr, R_ptr, W_ptr, Rstd_ptr, DY_ptr, DH_ptr, DX_ptr, DWP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_r_row, stride_dy_row, stride_dh_row,
    stride_dx_row, stride_rstd, stride_dwp,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):
    """Rows of 8192 < n <= MAX_WIDE_N, one at a time, whole: the row sum from one read of x (r) and dy, then
    the row read again (from L1) for dx and the partial, so only the partial row of dw stays in registers
    across the sum (held, the row spilled)."""
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    base = pid.to(tl.int64) * rows_per_prog  # row * stride can pass 2^31 elements
    for row32 in range(row_start, row_end):
        row = base + (row32 - row_start)
        x_row, r_row, dy_row = X_ptr + row * stride_x_row, R_ptr + row * stride_r_row, DY_ptr + row * stride_dy_row
        rstd = tl.load(Rstd_ptr + row * stride_rstd)
        h = tl.load(x_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        gdy = tl.load(dy_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32) * \
            _gain(W_ptr, offs_n, mask_n, GEMMA)
        c = rstd * rstd * (tl.sum(h * gdy, axis=0) / n_cols)  # rstd^2 mean(h g dy), fp32 sum
        # the second read (another cache policy: not merged with the first)
        h = tl.load(x_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dy_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        g = tl.load(W_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if GEMMA:
            g = tl.where(mask_n, g + 1.0, 0.0)
        dx = rstd * (dy * g - h * c)
        if HAS_RESIDUAL:
            dx += tl.load(DH_ptr + row * stride_dh_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(DX_ptr + row * stride_dx_row + offs_n, dx.to(DX_ptr.dtype.element_ty), mask=offs_n < n_store)
        dw_acc += dy * (h * rstd)
        _zero_row_tail(DX_ptr + row * stride_dx_row, n_store, BLOCK_N)
    tl.store(DWP_ptr + pid * stride_dwp + offs_n, dw_acc, mask=mask_n)


@triton.jit
def _layer_norm_bwd_wide_kernel(
    X_ptr, W_ptr, Mean_ptr, Rstd_ptr, DY_ptr, DX_ptr, DWP_ptr, DBP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_dy_row, stride_dx_row, stride_mean, stride_rstd,
    stride_dwp,
    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """LayerNorm's rows of 8192 < n <= MAX_WIDE_N as `_rms_norm_bwd_wide_kernel`: sum(xc), sum(d), sum(d xc)
    from one read (the looped kernel's pass 1: mean(d xhat) = rstd (mean(d xc) - lo mean(d))), then x and dy
    again for dx and the two partial rows, the only values held across the sums."""
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    base = pid.to(tl.int64) * rows_per_prog
    for row32 in range(row_start, row_end):
        row = base + (row32 - row_start)
        x_row, dy_row = X_ptr + row * stride_x_row, DY_ptr + row * stride_dy_row
        mean = tl.load(Mean_ptr + row * stride_mean)
        rstd = tl.load(Rstd_ptr + row * stride_rstd)
        xc = tl.where(mask_n, tl.load(x_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last")
                      .to(tl.float32) - mean, 0.0)  # exact near the mean
        d = tl.load(dy_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32) * \
            tl.load(W_ptr + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        lo = tl.sum(xc, axis=0) / n_cols  # the rounding the fp32 mean dropped
        m1 = tl.sum(d, axis=0) / n_cols
        m2 = rstd * (tl.sum(d * xc, axis=0) / n_cols - lo * m1)
        x = tl.load(x_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        xhat = tl.where(mask_n, ((x - mean) - lo) * rstd, 0.0)
        dy = tl.load(dy_row + offs_n, mask=mask_n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        d = dy * tl.load(W_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        dx = tl.where(mask_n, rstd * ((d - m1) - xhat * m2), 0.0)
        tl.store(DX_ptr + row * stride_dx_row + offs_n, dx.to(DX_ptr.dtype.element_ty), mask=offs_n < n_store)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
        _zero_row_tail(DX_ptr + row * stride_dx_row, n_store, BLOCK_N)
    tl.store(DWP_ptr + pid * stride_dwp + offs_n, dw_acc, mask=mask_n)
    if HAS_BIAS:
        tl.store(DBP_ptr + pid * stride_dwp + offs_n, db_acc, mask=mask_n)


@triton.jit
def _layer_norm_bwd_looped_kernel(
    X_ptr, W_ptr, Mean_ptr, Rstd_ptr, DY_ptr, DX_ptr, DWP_ptr, DBP_ptr,
    n_rows, n_cols, n_store, rows_per_prog, stride_x_row, stride_dy_row, stride_dx_row, stride_mean, stride_rstd,
    stride_dwp,
    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    dwp_row, dbp_row = DWP_ptr + pid * stride_dwp, DBP_ptr + pid * stride_dwp  # zeroed by the launcher
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    base = pid.to(tl.int64) * rows_per_prog  # row * stride can pass 2^31 elements
    for row32 in range(row_start, row_end):
        row = base + (row32 - row_start)
        x_row, dy_row = X_ptr + row * stride_x_row, DY_ptr + row * stride_dy_row
        mean = tl.load(Mean_ptr + row * stride_mean)
        rstd = tl.load(Rstd_ptr + row * stride_rstd)
        acc_c = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_d = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_dc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        # pass 1: sum(xc), sum(d), sum(d xc) in one read; mean(d xhat) = rstd (mean(d xc) - lo mean(d))
        for start in range(0, n_cols, BLOCK_N):
            mask_n = start + offs_n < n_cols
            xc = tl.where(mask_n, tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32) - mean, 0.0)
            d = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32) * \
                tl.load(W_ptr + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc_c += xc
            acc_d += d
            acc_dc += d * xc
        lo = tl.sum(acc_c, axis=0) / n_cols
        m1 = tl.sum(acc_d, axis=0) / n_cols
        m2 = rstd * (tl.sum(acc_dc, axis=0) / n_cols - lo * m1)
        for start in range(0, n_store, BLOCK_N):  # pass 2: dx and the partials
            mask_n = start + offs_n < n_cols
            x = tl.load(x_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            xhat = tl.where(mask_n, ((x - mean) - lo) * rstd, 0.0)
            dy = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            d = dy * tl.load(W_ptr + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            dx = tl.where(mask_n, rstd * ((d - m1) - xhat * m2), 0.0)
            tl.store(DX_ptr + row * stride_dx_row + start + offs_n, dx.to(DX_ptr.dtype.element_ty),
                     mask=start + offs_n < n_store)
            part = tl.load(dwp_row + start + offs_n, mask=mask_n, other=0.0)
            tl.store(dwp_row + start + offs_n, part + dy * xhat, mask=mask_n)
            if HAS_BIAS:
                part = tl.load(dbp_row + start + offs_n, mask=mask_n, other=0.0)
                tl.store(dbp_row + start + offs_n, part + dy, mask=mask_n)


@triton.jit
def _partials_reduce_kernel(P_ptr, Out_ptr, n_parts, n_cols, n_out, stride_p,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out[j] = sum over the partial rows of P[:, j] (fp32), rounded once; 0 on lanes [n_cols, n_out)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask = (offs_p < n_parts)[:, None] & mask_n[None, :]
        acc += tl.load(P_ptr + offs_p[:, None].to(tl.int64) * stride_p + offs_n[None, :], mask=mask, other=0.0)
    tl.store(Out_ptr + offs_n, tl.sum(acc, axis=0).to(Out_ptr.dtype.element_ty), mask=offs_n < n_out)


# ---- launchers -----------------------------------------------------------------------------------

def _programs(rows: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program, a multiple of block_m) of step 1."""
    if device.type == "cuda":
        cap = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = INTERPRETER_PROGRAMS
    blocks = max(1, triton.cdiv(rows, block_m))
    per = triton.cdiv(blocks, min(blocks, cap)) * block_m
    return triton.cdiv(rows, per), per


def _check_common(what: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, n: int | None,
                  stats: dict[str, torch.Tensor]) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: x must be a 2-D fp32 / fp16 / bf16 tensor (rows, aligned width), got {got}")
    aw = x.shape[1]
    n = aw if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= aw:
        raise ValueError(f"{what}: real width n={n!r} must be an integer in [1, {aw}] (x's aligned width)")
    if aw > 1 and x.stride(1) != 1:
        raise ValueError(f"{what}: x must have last-dim stride 1, got strides {x.stride()}")
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{what}: w must be a tensor (the backward of a norm without a weight has no dw)")
    _check_vector(what, "w", w, n, x)
    if w.dtype != x.dtype:
        raise ValueError(f"{what}: w dtype {w.dtype} must be x's ({x.dtype}): dw is written in it")
    _check_rows(what, "dy", dy, x)
    for name, a in stats.items():
        _check_stat(what, name, a, x)
    return n


def _grad_out(what: str, name: str, a: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    if a is None:
        return torch.empty_like(w)
    if not isinstance(a, torch.Tensor) or a.shape != w.shape or a.dtype != w.dtype or a.device != w.device:
        raise ValueError(f"{what}: {name} must be a {tuple(w.shape)} {w.dtype} tensor on {w.device}")
    if a.shape[0] > 1 and a.stride(0) != 1:
        raise ValueError(f"{what}: {name} must have stride 1")
    return a


def _reduce(partials: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """Step 2: out[:n] = the column sums of the (programs, >= n) fp32 partials; out[n:] = 0."""
    _partials_reduce_kernel[(triton.cdiv(out.shape[0], REDUCE_BLOCK_N),)](
        partials, out, partials.shape[0], n, out.shape[0], partials.stride(0),
        BLOCK_P=REDUCE_BLOCK_P, BLOCK_N=REDUCE_BLOCK_N, num_warps=4)


def _step1_shape(rows: int, n: int, device: torch.device, strides: tuple[int, ...] = ()
                 ) -> tuple[str, int, int, int, int]:
    """(kind, BLOCK_M, BLOCK_N, programs, rows per program); kind: fused, wide or looped. The wide kernels
    only where every row stride is a multiple of 16 elements: Triton then knows each row starts 16-byte
    aligned and loads 16 bytes a lane; at 8200 lanes (a stride of 8 mod 16) their element-wise loads ran
    at 13% (RMSNorm) and 6% (LayerNorm) of the copy rate on an H200, the looped kernels at 23% / 15%."""
    if n <= MAX_FUSED_N:
        block_n = max(16, triton.next_power_of_2(n))
        block_m = min(max(1, FUSED_TILE // block_n), triton.next_power_of_2(rows))
        return ("fused", block_m, block_n) + _programs(rows, block_m, device)
    if n <= MAX_WIDE_N and all(st % 16 == 0 for st in strides):
        return ("wide", 1, triton.next_power_of_2(n)) + _programs(rows, 1, device)
    return ("looped", 1, LOOP_BLOCK_N) + _programs(rows, 1, device)


def rms_norm_backward(x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *, n: int | None = None,
                      gemma: bool = False, residual: torch.Tensor | None = None, dh: torch.Tensor | None = None,
                      out_dx: torch.Tensor | None = None, out_dw: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx and dw of RMSNorm, fp32 math, one rounding; padding lanes of dx and dw written as 0.

    x, residual, dy, dh: (rows, aw) one dtype, last-dim stride 1, any row strides; lanes [n, aw) never read
    w: (>= n,) x's dtype (1 + w applied when gemma); rstd: (rows,) float32, the forward's
    out_dx: (rows, aw) x's dtype (also r's gradient, dh included); out_dw: w's shape; allocated if None
    returns: (out_dx, out_dw)
    """
    what = "rms_norm_backward"
    n = _check_common(what, x, w, dy, n, {"rstd": rstd})
    if (residual is None) != (dh is None):
        raise ValueError(f"{what}: dh is the cotangent of h = x + residual: give both or neither")
    _check_rows(what, "residual", residual, x)
    _check_rows(what, "dh", dh, x)
    out_dx = _check_rows(what, "out_dx", out_dx, x) if out_dx is not None else torch.empty_like(x)
    out_dw = _grad_out(what, "out_dw", out_dw, w)
    rows, aw = x.shape
    strides = tuple(a.stride(0) for a in (x, residual, dy, dh, out_dx) if a is not None)
    kind, block_m, block_n, progs, per = _step1_shape(rows, n, x.device, strides)
    partials = torch.zeros((max(1, progs), n), dtype=torch.float32, device=x.device)
    if rows:
        r = residual if residual is not None else x  # never dereferenced without HAS_RESIDUAL
        args = (x, r, w, rstd, dy, dh if dh is not None else x, out_dx, partials, rows, n, aw, per, x.stride(0),
                r.stride(0), dy.stride(0), dh.stride(0) if dh is not None else 0, out_dx.stride(0), rstd.stride(0),
                partials.stride(0))
        flags = dict(HAS_RESIDUAL=residual is not None, GEMMA=bool(gemma))
        if kind == "wide":
            _rms_norm_bwd_wide_kernel[(progs,)](*args, BLOCK_N=block_n, **flags, num_warps=WIDE_WARPS)
        elif kind == "fused":
            _rms_norm_bwd_fused_kernel[(progs,)](*args, BLOCK_M=block_m, BLOCK_N=block_n, **flags,
                                                 num_warps=_num_warps(block_m * block_n, 4))
        else:
            _rms_norm_bwd_looped_kernel[(progs,)](*args, BLOCK_N=block_n, **flags, num_warps=_num_warps(block_n, 4))
    _reduce(partials, out_dw, n)
    return out_dx, out_dw


def layer_norm_backward(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, *,
                        n: int | None = None, out_dx: torch.Tensor | None = None, out_dw: torch.Tensor | None = None,
                        out_db: torch.Tensor | None = None, bias: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dx, dw (and db, when out_db is given or bias=True) of LayerNorm; padding lanes written as 0.

    x, dy: (rows, aw); w: (>= n,) x's dtype; mean, rstd: (rows,) float32, the forward's
    returns: (out_dx, out_dw, out_db or None)
    """
    what = "layer_norm_backward"
    n = _check_common(what, x, w, dy, n, {"mean": mean, "rstd": rstd})
    out_dx = _check_rows(what, "out_dx", out_dx, x) if out_dx is not None else torch.empty_like(x)
    out_dw = _grad_out(what, "out_dw", out_dw, w)
    has_bias = out_db is not None or bool(bias)
    out_db = _grad_out(what, "out_db", out_db, w) if has_bias else None
    rows, aw = x.shape
    kind, block_m, block_n, progs, per = _step1_shape(rows, n, x.device, (x.stride(0), dy.stride(0), out_dx.stride(0)))
    partials = torch.zeros((2, max(1, progs), n), dtype=torch.float32, device=x.device)  # dw, db
    if rows:
        args = (x, w, mean, rstd, dy, out_dx, partials[0], partials[1], rows, n, aw, per, x.stride(0), dy.stride(0),
                out_dx.stride(0), mean.stride(0), rstd.stride(0), partials.stride(1))
        if kind == "wide":
            _layer_norm_bwd_wide_kernel[(progs,)](*args, BLOCK_N=block_n, HAS_BIAS=has_bias, num_warps=LN_WIDE_WARPS)
        elif kind == "fused":
            _layer_norm_bwd_fused_kernel[(progs,)](*args, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias,
                                                   num_warps=_num_warps(block_m * block_n, 4))
        else:
            _layer_norm_bwd_looped_kernel[(progs,)](*args, BLOCK_N=block_n, HAS_BIAS=has_bias,
                                                    num_warps=_num_warps(block_n, 4))
    _reduce(partials[0], out_dw, n)
    if out_db is not None:
        _reduce(partials[1], out_db, n)
    return out_dx, out_dw, out_db
