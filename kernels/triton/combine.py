"""Split-KV / flash-decoding merge of partial attention states, in Triton.

    M   = max_i LSE_i
    LSE = M + ln sum_i exp(LSE_i - M)
    O   = sum_i exp(LSE_i - LSE) * O_i  =  sum_i exp(LSE_i - M) * O_i / sum_i exp(LSE_i - M)

Conventions (OPS.md, combine; golden in refimpl/combine.py): LSE is natural-log; an empty split
has LSE_i = -inf and an O_i that may hold NaN, which never reaches the result; a row whose splits
are all empty gives O = 0, LSE = -inf; -inf - -inf is never evaluated.

The kernel weights by exp(LSE_i - M) (M the running max over split blocks, the partial sums
rescaled when it grows) and divides by the sum once at the end rather than forming
exp(LSE_i - LSE): LSE = M + ln s carries an ulp of M (1e-3 at |M| = 1e4 in fp32), which
LSE_i - LSE would turn into a relative error of every weight. Weights go through softmax.py's
`exp_diff` (the GPU's native ex2 on a log2(e)-scaled difference, its rounding errors carried to
first order); LSE = M + log2(s) * ln 2 is stored in natural log.

Layout: rows are the flattened (batch, heads, queries) and every stride is passed explicitly, so
stage 2 of split-KV decoding can hand over its partials without a copy. One program per
(row, BLOCK_D slice of d_v) loads BLOCK_S splits x BLOCK_D values per step, so each partial is
read once with many independent loads in flight.

References: Dao et al., "Flash-Decoding for long-context inference" (2023); FlashInfer's
merge_state; FlashAttention-2's split-KV combine kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softmax import LN2, exp_diff

# Launch shape, measured on an H200 (Triton 3.6; splits 16, rows 2048, d_v 128 and 512): one warp
# per program, BLOCK_S = 8 splits x BLOCK_D <= 256 values a step (64 values a thread in flight).
# Many small single-warp programs beat wider ones by 1.3-3x: 32 resident programs an SM keep more
# independent loads in flight, and no reduction crosses warps. d_v = 512 runs as two programs a row.
MAX_BLOCK_D = 256
MAX_BLOCK_S = 8
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Backward: one program per row holds BLOCK_S splits x BLOCK_D values of O_i per step (BWD_TILE in
# all); up to MAX_BLOCK_S_BWD splits keep their dots a_i in registers (one block), more park them
# in dLSE's output row until dO . O is complete.
MAX_BLOCK_S_BWD = 64
BWD_TILE = 2048


@triton.jit
def _lse_combine_kernel(
    O_ptr, Lse_ptr, Out_ptr, OutLse_ptr, n_splits, d_v,
    stride_o_split, stride_o_row, stride_lse_split, stride_lse_row, stride_out_row, stride_out_lse,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    row = pid_m.to(tl.int64)  # row * stride can pass 2^31 elements (rows = batch * heads * queries)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < d_v
    lse_row = Lse_ptr + row * stride_lse_row
    o_row = O_ptr + row * stride_o_row

    # One pass over the splits with a running max m: acc and total are rescaled by
    # exp(m_old - m_new) when m grows, so O is read once and its load does not wait on the LSE
    # load (no LSE-dependent mask): both are in flight together. With splits <= BLOCK_S (the
    # usual case) the loop runs once and nothing is rescaled.
    m = float("-inf")
    total = 0.0  # fp32 sum_i w_i
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # fp32 accumulation of sum_i w_i O_i
    for s0 in range(0, n_splits, BLOCK_S):
        split = s0 + offs_s
        mask_s = split < n_splits
        lse = tl.load(lse_row + split.to(tl.int64) * stride_lse_split, mask=mask_s, other=float("-inf"))
        o = tl.load(o_row + split.to(tl.int64)[:, None] * stride_o_split + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        live = lse != float("-inf")  # padding lanes past n_splits read -inf, so are not live
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # Finite stand-in while every split so far is empty: LSE_i - m_safe and m - m_safe are
        # then -inf - finite (weight 0), never -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = exp_diff(m, m_safe, True)
        w = tl.where(live, exp_diff(lse, m_safe, True), 0.0)
        # An empty split's O may hold NaN and 0 * NaN = NaN: select it out, not just weight it 0.
        o = tl.where(live[:, None], o.to(tl.float32), 0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)

    # total >= 1 when any split is live (the max split weighs exp(0) = 1); with none, acc = 0 and
    # the clamp gives O = 0 instead of 0/0.
    out = acc * (1.0 / tl.maximum(total, 1.0))
    tl.store(Out_ptr + row * stride_out_row + offs_d, out.to(Out_ptr.dtype.element_ty), mask=mask_d)
    if pid_d == 0:
        lse_out = tl.where(total > 0.0, m + tl.log2(tl.maximum(total, 1.0)) * LN2, float("-inf"))
        tl.store(OutLse_ptr + row * stride_out_lse, lse_out)


@triton.jit
def _split_dots(o_row, do_row, dop_row, split, mask_s, live, w32, d_v, stride_o_split, stride_dop_split,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """a_i = dO . O_i (fp32) for a block of splits, writing dO_i = w_i dO on the way."""
    a = tl.zeros([BLOCK_S], dtype=tl.float32)
    for d0 in range(0, d_v, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = mask_s[:, None] & (offs_d < d_v)[None, :]
        do = tl.load(do_row + offs_d, mask=offs_d < d_v, other=0.0).to(tl.float32)
        o = tl.load(o_row + split.to(tl.int64)[:, None] * stride_o_split + offs_d[None, :], mask=mask, other=0.0)
        # An empty split's O may hold NaN and 0 * NaN = NaN: select it out, not just weight it 0.
        o = tl.where(live[:, None], o.to(tl.float32), 0.0)
        a += tl.sum(o * do[None, :], axis=1)
        tl.store(dop_row + split.to(tl.int64)[:, None] * stride_dop_split + offs_d[None, :],
                 (w32[:, None] * do[None, :]).to(dop_row.dtype.element_ty), mask=mask)
    return a


@triton.jit
def _lse_combine_bwd_kernel(
    O_ptr, Lse_ptr, DO_ptr, Dlse_ptr, DOp_ptr, DLp_ptr, n_splits, d_v,
    stride_o_split, stride_o_row, stride_lse_split, stride_lse_row, stride_do_row, stride_dlse,
    stride_dop_split, stride_dop_row, stride_dlp_split, stride_dlp_row,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = Lse_ptr + row * stride_lse_row
    o_row = O_ptr + row * stride_o_row
    do_row = DO_ptr + row * stride_do_row
    dop_row = DOp_ptr + row * stride_dop_row
    dlp_row = DLp_ptr + row * stride_dlp_row
    dlse = tl.load(Dlse_ptr + row * stride_dlse).to(tl.float64)
    # The weights as the forward builds them: w_i = exp(LSE_i - M) / sum_k exp(LSE_k - M), M the max,
    # never exp(LSE_i - LSE) with a rounded merged LSE. The sum, abar = sum_i w_i a_i (= dO . O) and
    # dLSE_i are fp64 (a few scalars a row): abar is then the weighted mean of the a_i to fp64
    # precision, and a_i - abar cancels exactly where the a_i agree (fp32 weights summing to
    # 1 +- eps would leave eps32 |a_i| there, ~1e-6 at d_v = 128).
    if ONE_BLOCK:  # every split in registers: one read of the LSEs, one pass over the O_i
        mask_s = offs_s < n_splits
        lse = tl.load(lse_row + offs_s.to(tl.int64) * stride_lse_split, mask=mask_s, other=float("-inf"))
        live = lse != float("-inf")  # padding lanes past n_splits read -inf, so are not live
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: -inf - 0, never -inf - -inf
        w_hat = tl.where(live, exp_diff(lse, m, True), 0.0).to(tl.float64)
        w = w_hat / tl.maximum(tl.sum(w_hat, axis=0), 1.0)  # sum >= 1 with a live split; else w = 0
        a = _split_dots(o_row, do_row, dop_row, offs_s, mask_s, live, w.to(tl.float32), d_v,
                        stride_o_split, stride_dop_split, BLOCK_S, BLOCK_D).to(tl.float64)
        abar = tl.sum(w * a, axis=0)
        tl.store(dlp_row + offs_s.to(tl.int64) * stride_dlp_split, (w * ((a - abar) + dlse)).to(tl.float32),
                 mask=mask_s)
    else:  # blocks of splits: the max, then the sum, then the O_i, whose a_i wait in dLSE's output row
        m = float("-inf")
        for s0 in range(0, n_splits, BLOCK_S):
            lse = tl.load(lse_row + (s0 + offs_s).to(tl.int64) * stride_lse_split, mask=s0 + offs_s < n_splits,
                          other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, axis=0))
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([1], dtype=tl.float64)
        for s0 in range(0, n_splits, BLOCK_S):
            lse = tl.load(lse_row + (s0 + offs_s).to(tl.int64) * stride_lse_split, mask=s0 + offs_s < n_splits,
                          other=float("-inf"))
            total += tl.sum(tl.where(lse != float("-inf"), exp_diff(lse, m, True), 0.0).to(tl.float64), axis=0)
        inv = 1.0 / tl.maximum(total, 1.0)
        abar = tl.zeros([1], dtype=tl.float64)
        for s0 in range(0, n_splits, BLOCK_S):
            split = s0 + offs_s
            mask_s = split < n_splits
            lse = tl.load(lse_row + split.to(tl.int64) * stride_lse_split, mask=mask_s, other=float("-inf"))
            live = lse != float("-inf")
            w = tl.where(live, exp_diff(lse, m, True), 0.0).to(tl.float64) * inv
            a = _split_dots(o_row, do_row, dop_row, split, mask_s, live, w.to(tl.float32), d_v,
                            stride_o_split, stride_dop_split, BLOCK_S, BLOCK_D)
            abar += tl.sum(w * a.to(tl.float64), axis=0)
            tl.store(dlp_row + split.to(tl.int64) * stride_dlp_split, a, mask=mask_s)
        tl.debug_barrier()  # the a_i stores above are visible to every thread of the program
        for s0 in range(0, n_splits, BLOCK_S):
            split = s0 + offs_s
            mask_s = split < n_splits
            lse = tl.load(lse_row + split.to(tl.int64) * stride_lse_split, mask=mask_s, other=float("-inf"))
            w = tl.where(lse != float("-inf"), exp_diff(lse, m, True), 0.0).to(tl.float64) * inv
            a = tl.load(dlp_row + split.to(tl.int64) * stride_dlp_split, mask=mask_s, other=0.0).to(tl.float64)
            tl.store(dlp_row + split.to(tl.int64) * stride_dlp_split, (w * ((a - abar) + dlse)).to(tl.float32),
                     mask=mask_s)


def lse_combine(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `splits` partial states of each row.

    o_parts: (splits, rows, d_v) fp32/fp16/bf16, last-dim stride 1, other strides arbitrary
    lse_parts: (splits, rows) float32, natural log, -inf for an empty split; arbitrary strides
    out: (rows, d_v) fp32/fp16/bf16 (may differ from o_parts' dtype), last-dim stride 1, any row
         stride; allocated in o_parts' dtype if None
    out_lse: (rows,) float32, any stride; allocated if None
    returns: (out, out_lse); rows whose splits are all empty -> (0, -inf)
    """
    if not isinstance(o_parts, torch.Tensor) or o_parts.dim() != 3:
        raise ValueError(f"o_parts must be (splits, rows, d_v), got shape {tuple(getattr(o_parts, 'shape', ()))}")
    if not isinstance(lse_parts, torch.Tensor) or lse_parts.dim() != 2:
        raise ValueError(f"lse_parts must be (splits, rows), got shape {tuple(getattr(lse_parts, 'shape', ()))}")
    splits, rows, d_v = o_parts.shape
    if tuple(lse_parts.shape) != (splits, rows):
        raise ValueError(f"lse_parts shape {tuple(lse_parts.shape)} != (splits, rows) = {(splits, rows)}")
    if o_parts.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"o_parts dtype {o_parts.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if lse_parts.dtype != torch.float32:
        raise ValueError(f"lse_parts dtype must be float32, got {lse_parts.dtype}")
    if d_v > 1 and o_parts.stride(2) != 1:
        raise ValueError(f"o_parts must have last-dim stride 1, got strides {o_parts.stride()}")
    if lse_parts.device != o_parts.device:
        raise ValueError(f"lse_parts is on {lse_parts.device}, o_parts on {o_parts.device}")
    if out is None:
        out = torch.empty((rows, d_v), dtype=o_parts.dtype, device=o_parts.device)
    elif tuple(out.shape) != (rows, d_v) or out.dtype not in SUPPORTED_DTYPES or out.device != o_parts.device:
        raise ValueError(f"out must be ({rows}, {d_v}) of {SUPPORTED_DTYPES} on {o_parts.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    elif d_v > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have last-dim stride 1, got strides {out.stride()}")
    elif rows > 1 and out.stride(0) < d_v:
        raise ValueError(f"out row stride {out.stride(0)} < d_v={d_v}: rows would overlap")
    if out_lse is None:
        out_lse = torch.empty((rows,), dtype=torch.float32, device=o_parts.device)
    elif tuple(out_lse.shape) != (rows,) or out_lse.dtype != torch.float32 or out_lse.device != o_parts.device:
        raise ValueError(f"out_lse must be ({rows},) float32 on {o_parts.device}, "
                         f"got {tuple(out_lse.shape)} {out_lse.dtype} on {out_lse.device}")
    if rows == 0:
        return out, out_lse
    block_d = min(MAX_BLOCK_D, max(16, triton.next_power_of_2(d_v)))
    block_s = min(MAX_BLOCK_S, max(2, triton.next_power_of_2(splits)))
    # d_v = 0 still launches one program a row so that out_lse is written.
    grid = (rows, max(1, triton.cdiv(d_v, block_d)))
    _lse_combine_kernel[grid](
        o_parts, lse_parts, out, out_lse, splits, d_v,
        o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0), lse_parts.stride(1),
        out.stride(0), out_lse.stride(0),
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=1,
    )
    return out, out_lse


def lse_combine_backward(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `lse_combine` for the cotangents (do, dlse), one program per row.

    o_parts: (splits, rows, d_v) fp32/fp16/bf16, last-dim stride 1; lse_parts: (splits, rows) float32
    do: (rows, d_v) o_parts' dtype, last-dim stride 1; dlse: (rows,) float32; any other strides
    out: (splits, rows, d_v) o_parts' dtype, last-dim stride 1: dO_i = w_i dO; allocated if None
    out_dlse: (splits, rows) float32: dLSE_i = w_i (dO . (O_i - O) + dLSE); allocated if None
    returns: (out, out_dlse); an empty split's gradients (and every split's in an all-empty row) are 0
    """
    if not isinstance(o_parts, torch.Tensor) or o_parts.dim() != 3:
        raise ValueError(f"o_parts must be (splits, rows, d_v), got shape {tuple(getattr(o_parts, 'shape', ()))}")
    splits, rows, d_v = o_parts.shape
    if o_parts.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"o_parts dtype {o_parts.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    want = {"lse_parts": ((splits, rows), torch.float32), "do": ((rows, d_v), o_parts.dtype),
            "dlse": ((rows,), torch.float32), "out": ((splits, rows, d_v), o_parts.dtype),
            "out_dlse": ((splits, rows), torch.float32)}
    if out is None:
        out = torch.empty((splits, rows, d_v), dtype=o_parts.dtype, device=o_parts.device)
    if out_dlse is None:
        out_dlse = torch.empty((splits, rows), dtype=torch.float32, device=o_parts.device)
    given = {"lse_parts": lse_parts, "do": do, "dlse": dlse, "out": out, "out_dlse": out_dlse}
    for name, t in given.items():
        shape, dtype = want[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != o_parts.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be {shape} {dtype} on {o_parts.device}, got {got}")
    for name, t in (("o_parts", o_parts), ("do", do), ("out", out)):
        if d_v > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {t.stride()}")
    if rows == 0 or splits == 0:
        return out, out_dlse
    block_s = min(MAX_BLOCK_S_BWD, max(2, triton.next_power_of_2(splits)))
    block_d = max(16, min(triton.next_power_of_2(max(d_v, 1)), BWD_TILE // block_s))
    _lse_combine_bwd_kernel[(rows,)](
        o_parts, lse_parts, do, dlse, out, out_dlse, splits, d_v,
        o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0), lse_parts.stride(1), do.stride(0),
        dlse.stride(0), out.stride(0), out.stride(1), out_dlse.stride(0), out_dlse.stride(1),
        BLOCK_S=block_s, BLOCK_D=block_d, ONE_BLOCK=splits <= block_s, num_warps=4,
    )
    return out, out_dlse
