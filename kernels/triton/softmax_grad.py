"""Backward of the row softmax and of the online softmax (with its row LSE), in Triton.

    D_i   = sum_j dy_ij y_ij
    dx_ij = y_ij (dy_ij - D_i + dlse_i)          (dlse = 0 when the LSE has no cotangent)

y is the forward's output; x and the LSE are not needed. Conventions (OPS.md "backward"; goldens
in refimpl/softmax.py): a -inf logit has y = 0, so its gradient is 0, and an all -inf row (y = 0
throughout) gets D = 0 and dx = 0 without a branch. fp32 arithmetic whatever the storage dtype:
y, dy are widened on load, D is summed in fp32 and dx is rounded once on store.

Dispatch of `softmax_backward`, as the forward's (kernels/triton/softmax.py):
- n <= MAX_FUSED_N: `_softmax_bwd_fused_kernel` holds BLOCK_M whole rows of y and dy in registers:
  one read of each and one write of dx, the memory-bound minimum (three tensors).
- n >  MAX_FUSED_N: the row is cut into chunks of SPLIT_BLOCK_N over a (rows, chunks) grid.
  `_softmax_bwd_split_dot_kernel` writes each chunk's partial D in fp32 to a workspace;
  `_softmax_bwd_split_apply_kernel` sums its row's partials (in chunk order, so the result does
  not depend on scheduling) and writes its chunk: two reads of y and dy, but every SM has work
  even when there are few rows.
`online_softmax_backward` is the streaming form (one program per row, tiles of `tile`: D over the
tiles, then dx tile by tile), the counterpart of the forward's `_softmax_online_kernel`.

References: the softmax Jacobian-vector product as PyTorch's `_softmax_backward_data` and
FlashAttention-2's D = rowsum(dO * O) preprocessing compute it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softmax import FUSED_TILE, MAX_FUSED_N, ONLINE_TILE_MAX, ONLINE_TILE_MIN, SPLIT_BLOCK_N, SUPPORTED_DTYPES

# Chunk partials of D merged per loop step by the apply kernel.
SPLIT_DOT_BLOCK = 1024


@triton.jit
def _softmax_bwd_fused_kernel(
    Y_ptr, DY_ptr, Dlse_ptr, DX_ptr, n_rows, n_cols,
    stride_y_row, stride_dy_row, stride_dlse, stride_dx_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < n_rows
    mask = mask_m[:, None] & (offs_n < n_cols)[None, :]
    rows = offs_m.to(tl.int64)  # rows * stride can pass 2^31 elements on large tensors
    # Masked lanes (the row's tail, padding past n, rows past n_rows) read as 0 and add 0 to D:
    # the padding (NaN in the tests) is never fetched.
    y = tl.load(Y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + rows[:, None] * stride_dy_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    d = tl.sum(y * dy, axis=1)  # fp32 accumulation over the row
    g = dy - d[:, None]
    if HAS_DLSE:
        g += tl.load(Dlse_ptr + rows * stride_dlse, mask=mask_m, other=0.0)[:, None]
    tl.store(DX_ptr + rows[:, None] * stride_dx_row + offs_n[None, :],
             (y * g).to(DX_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_split_dot_kernel(
    Y_ptr, DY_ptr, Part_ptr, n_cols, n_chunks, stride_y_row, stride_dy_row,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_n = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    row = pid_m.to(tl.int64)
    y = tl.load(Y_ptr + row * stride_y_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + row * stride_dy_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Part_ptr + row * n_chunks + pid_c, tl.sum(y * dy, axis=0))  # fp32 partial of D


@triton.jit
def _softmax_bwd_split_apply_kernel(
    Y_ptr, DY_ptr, Dlse_ptr, DX_ptr, Part_ptr, n_cols, n_chunks,
    stride_y_row, stride_dy_row, stride_dlse, stride_dx_row,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    row = pid_m.to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    # Every program of a row re-sums the row's chunk partials: a few hundred bytes from L2,
    # cheaper than a third launch and a second workspace round trip.
    d = 0.0
    for c0 in range(0, n_chunks, BLOCK_C):
        part = tl.load(Part_ptr + row * n_chunks + c0 + offs_c, mask=c0 + offs_c < n_chunks, other=0.0)
        d += tl.sum(part, axis=0)  # fp32
    offs_n = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    y = tl.load(Y_ptr + row * stride_y_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + row * stride_dy_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    g = dy - d
    if HAS_DLSE:
        g += tl.load(Dlse_ptr + row * stride_dlse)
    tl.store(DX_ptr + row * stride_dx_row + offs_n, (y * g).to(DX_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _softmax_bwd_online_kernel(
    Y_ptr, DY_ptr, Dlse_ptr, DX_ptr, n_cols, stride_y_row, stride_dy_row, stride_dlse, stride_dx_row,
    TILE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    row = pid_m.to(tl.int64)
    y_row = Y_ptr + row * stride_y_row
    dy_row = DY_ptr + row * stride_dy_row
    dx_row = DX_ptr + row * stride_dx_row
    offs_n = tl.arange(0, TILE)
    # Pass 1: D over the tiles, an fp32 vector of per-lane partials reduced once at the end (the
    # lanes' sums do not depend on how many tiles there are, as a running scalar's would).
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, n_cols, TILE):
        mask_n = start + offs_n < n_cols
        y = tl.load(y_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += y * dy
    d = tl.sum(acc, axis=0)
    dlse = tl.load(Dlse_ptr + row * stride_dlse)
    # Pass 2: the second read of the row (from L2 for rows up to a few MB). dy - D first: that is
    # where the cancellation is (dy + (dlse - D) would lose dlse's low bits against a large D).
    for start in range(0, n_cols, TILE):
        mask_n = start + offs_n < n_cols
        y = tl.load(y_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + start + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(dx_row + start + offs_n, (y * ((dy - d) + dlse)).to(DX_ptr.dtype.element_ty), mask=mask_n)


def _num_warps(tile: int) -> int:
    """Warps for a program holding `tile` fp32 values of each of two tensors: ~32 a thread, 4..16."""
    return max(4, min(16, tile // 512))


def _check_pair(y: torch.Tensor, dy: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Validate y, dy (and out); returns out, allocated in y's dtype when None."""
    for name, t in (("y", y), ("dy", dy)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D tensor (rows, n), got shape {shape}")
    if y.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"y dtype {y.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if dy.shape != y.shape or dy.dtype != y.dtype or dy.device != y.device:
        raise ValueError(f"dy must be {tuple(y.shape)} {y.dtype} on {y.device}, "
                         f"got {tuple(dy.shape)} {dy.dtype} on {dy.device}")
    rows, n = y.shape
    for name, t in (("y", y), ("dy", dy)):
        if n > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {t.stride()}")
    if n >= 2**31:
        raise ValueError(f"row length n={n} must be < 2**31")
    if out is None:
        return torch.empty((rows, n), dtype=y.dtype, device=y.device)
    if out.shape != y.shape or out.dtype != y.dtype or out.device != y.device:
        raise ValueError(f"out must be {tuple(y.shape)} {y.dtype} on {y.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if n > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have last-dim stride 1, got strides {out.stride()}")
    if rows > 1 and out.stride(0) < n:
        raise ValueError(f"out row stride {out.stride(0)} < n={n}: rows would overlap")
    return out


def _check_dlse(dlse: torch.Tensor | None, y: torch.Tensor) -> None:
    if dlse is None:
        return
    if not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != (y.shape[0],) or dlse.dtype != torch.float32:
        got = f"{tuple(dlse.shape)} {dlse.dtype}" if isinstance(dlse, torch.Tensor) else type(dlse).__name__
        raise ValueError(f"dlse must be ({y.shape[0]},) float32, got {got}")
    if dlse.device != y.device:
        raise ValueError(f"dlse is on {dlse.device}, y on {y.device}")


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dlse: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None, max_fused: int | None = None) -> torch.Tensor:
    """dx = y (dy - sum(dy y) + dlse) over the last dim, fp32 math.

    y: (rows, n) fp32/fp16/bf16, the forward's softmax; last-dim stride 1, any row stride
    dy: like y (same shape and dtype), the cotangent of y; any row stride
    dlse: (rows,) float32, the cotangent of the row LSE, any stride; None: no LSE output
    out: (rows, n) y's dtype, last-dim stride 1, any row stride >= n; allocated if None
    max_fused: for testing dispatch paths only: rows longer than this take the split path
               (default MAX_FUSED_N); it also caps the split chunk so a small n spans many chunks
    returns: out
    """
    out = _check_pair(y, dy, out)
    _check_dlse(dlse, y)
    limit = MAX_FUSED_N if max_fused is None else max_fused
    if not 1 <= limit <= MAX_FUSED_N:
        raise ValueError(f"max_fused={max_fused} must be in [1, {MAX_FUSED_N}]")
    rows, n = y.shape
    if rows == 0 or n == 0:
        return out
    has_dlse = dlse is not None
    dlse_arg, stride_dlse = (dlse, dlse.stride(0)) if has_dlse else (y, 0)  # a dummy pointer, never read
    if n <= limit:
        block_n = max(16, triton.next_power_of_2(n))
        block_m = min(max(1, FUSED_TILE // block_n), triton.next_power_of_2(rows))
        _softmax_bwd_fused_kernel[(triton.cdiv(rows, block_m),)](
            y, dy, dlse_arg, out, rows, n, y.stride(0), dy.stride(0), stride_dlse, out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_DLSE=has_dlse, num_warps=_num_warps(block_m * block_n),
        )
        return out
    # Largest power of two <= limit, so that a lowered limit also lowers the chunk.
    block_n = max(16, min(SPLIT_BLOCK_N, 1 << (limit.bit_length() - 1)))
    n_chunks = triton.cdiv(n, block_n)
    if n_chunks > 65535:  # CUDA's limit on grid dim 1
        raise ValueError(f"row length n={n} needs {n_chunks} chunks of {block_n}; at most 65535")
    part = torch.empty((rows, n_chunks), dtype=torch.float32, device=y.device)
    grid = (rows, n_chunks)
    num_warps = _num_warps(block_n)
    _softmax_bwd_split_dot_kernel[grid](
        y, dy, part, n, n_chunks, y.stride(0), dy.stride(0), BLOCK_N=block_n, num_warps=num_warps,
    )
    _softmax_bwd_split_apply_kernel[grid](
        y, dy, dlse_arg, out, part, n, n_chunks, y.stride(0), dy.stride(0), stride_dlse, out.stride(0),
        BLOCK_N=block_n, BLOCK_C=min(SPLIT_DOT_BLOCK, max(16, triton.next_power_of_2(n_chunks))),
        HAS_DLSE=has_dlse, num_warps=num_warps,
    )
    return out


def online_softmax_backward(y: torch.Tensor, dy: torch.Tensor, dlse: torch.Tensor, tile: int, *,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """The streaming backward, one program per row over tiles of `tile` elements.

    y, dy: (rows, n) as `softmax_backward`; dlse: (rows,) float32, any stride
    tile: power of two in [16, 8192]; the last tile of a row may be partial
    out: (rows, n) y's dtype, last-dim stride 1, any row stride >= n; allocated if None
    returns: out
    """
    if not isinstance(tile, int) or tile < ONLINE_TILE_MIN or tile > ONLINE_TILE_MAX or tile & (tile - 1):
        raise ValueError(f"tile={tile!r} must be a power of two in [{ONLINE_TILE_MIN}, {ONLINE_TILE_MAX}]")
    out = _check_pair(y, dy, out)
    if dlse is None:
        raise ValueError("dlse must be a (rows,) float32 tensor, got None")
    _check_dlse(dlse, y)
    rows, n = y.shape
    if rows == 0 or n == 0:
        return out
    _softmax_bwd_online_kernel[(rows,)](
        y, dy, dlse, out, n, y.stride(0), dy.stride(0), dlse.stride(0), out.stride(0),
        TILE=tile, num_warps=_num_warps(tile),
    )
    return out
