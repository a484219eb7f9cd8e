"""Row-wise softmax and streaming (online) softmax over the last dim of a 2-D tensor, in Triton.

    softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m),   m = max_k x_k
    lse(x)       = m + ln sum_k exp(x_k - m)             (natural log)

Conventions (OPS.md, softmax; goldens in refimpl/softmax.py): a row of all -inf gives 0, never
NaN, and lse -inf. All arithmetic is fp32 whatever the storage dtype. exp(x - m) is the GPU's ex2
unit on a log2(e)-scaled argument (`exp_diff`). For fp32 outputs the rounding errors of x - m and
of the scaling are carried to first order, so results stay within a few fp32 ulp of the golden
even where |x - m| is large; plain exp2((x - m) * log2 e) drifts to ~|x - m| * 6e-8 relative, far
below an fp16/bf16 ulp, so 16-bit outputs skip the ~12 extra flops (they would make bf16 rows of
16K+ elements ALU-bound on Hopper).

Dispatch of `softmax`:
- n <= MAX_FUSED_N: `_softmax_fused_kernel` holds whole rows in registers (BLOCK_M rows of
  BLOCK_N = next_pow2(n) per step): one read and one write of x, the memory-bound minimum.
  Where FUSED_CONFIGS says so (16-bit rows of 32K) the grid is persistent, one program per SM
  looping over row blocks, so that the loop is software-pipelined: the next rows' loads are in
  flight while this one is reduced. Elsewhere each program takes one row block.
- n >  MAX_FUSED_N: the row is cut into chunks of SPLIT_BLOCK_N over a (rows, chunks) grid.
  `_softmax_split_stats_kernel` writes each chunk's (max, sum exp(x - max)) in fp32 to a
  workspace, `_softmax_split_norm_kernel` merges its row's chunk stats and writes its chunk: two
  reads and one write, but every SM has work even when there are few rows.
`online_softmax` is the streaming algorithm itself (running max and rescaled running sum per tile,
one program per row), kept as a kernel of its own so it can be checked against refimpl's golden.

References: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018); the Triton
fused-softmax tutorial; Liger-Kernel's softmax (block size and warp scaling).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LOG2E_LO = tl.constexpr(1.9259629911266175e-08)  # log2(e) - fp32(log2(e))
LN2 = tl.constexpr(0.6931471805599453)
# exp(-128) underflows fp32 to 0: exp_diff clamps x - m here, which also keeps -inf out of its
# error terms (-inf - -inf).
EXP_FLOOR = tl.constexpr(-128.0)

# Longest row kept in registers by the fused kernel. 32768 fp32 over 32 warps is 32 values a
# thread, inside the 64 registers a thread may use when 1024 threads share an SM's 64K; a longer
# row would spill (or need fewer, fatter threads, which hid latency worse when measured).
MAX_FUSED_N = 32768
# Elements a fused program aims to hold: short rows are packed BLOCK_M to a program so that each
# program still moves enough bytes to hide memory latency and amortise its reductions.
FUSED_TILE = 4096
# Chunk of a long row handled by one program of the split path, over _num_warps(4096) = 4 warps.
# On an H200, 2048..8192 all reached ~60% of copy bandwidth (of the 67% that its two reads and one
# write allow); 4096 was the most even across fp32/bf16 and 16 or 256+ rows.
SPLIT_BLOCK_N = 4096
# Chunk stats merged per loop step by the normalise kernel.
SPLIT_STATS_BLOCK = 1024
ONLINE_TILE_MIN, ONLINE_TILE_MAX = 16, 8192
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def exp_diff(x, m, ACCURATE: tl.constexpr):
    """exp(x - m) in fp32 for x <= m (m finite); -inf -> 0, NaN propagates.

    ACCURATE: within a few ulp over the whole range. x - m = t_hi + t_lo exactly (TwoSum),
    t * log2(e) = u_hi + u_lo (fma and the low word of log2 e), and exp2(u_hi + u_lo) =
    p + p * u_lo * ln 2 to first order (|u_lo| < 3e-5).
    Otherwise: exp2((x - m) * log2 e), relative error up to ~|x - m| * 6e-8.
    """
    if not ACCURATE:
        return tl.exp2((x - m) * LOG2E)
    # exp(x - m) underflows fp32 to 0 below the floor (and at x = -inf): x is set to m there (a select, not
    # tl.maximum, so that NaN is kept), which keeps the error terms finite, and the result to 0. The test is on
    # x - m, not x < m + EXP_FLOOR: once ulp(m) > 256 (|m| >= 2^31, logits near 1e12) m + EXP_FLOOR is m itself,
    # and every x < m would weigh exp(0) = 1.
    below = x - m < EXP_FLOOR
    x = tl.where(below, m, x)
    neg_m = -m
    t_hi = x + neg_m
    x_virt = t_hi - neg_m
    t_lo = (x - x_virt) + (neg_m - (t_hi - x_virt))
    u_hi = t_hi * LOG2E
    u_lo = tl.fma(t_hi, LOG2E, -u_hi) + (t_hi * LOG2E_LO + t_lo * LOG2E)
    p = tl.exp2(u_hi)
    return tl.where(below, 0.0, tl.fma(p, u_lo * LN2, p))


@triton.jit
def _softmax_fused_kernel(
    X_ptr, Out_ptr, n_rows, n_cols, stride_x_row, stride_out_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, ACCURATE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    # Persistent loop: NUM_STAGES > 1 lets the compiler prefetch the next row block into shared
    # memory while this one is reduced, which hides the load latency of programs so large that
    # one or two fill an SM.
    for block in tl.range(pid, n_blocks, tl.num_programs(0), num_stages=NUM_STAGES):
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (offs_m < n_rows)[:, None] & mask_n[None, :]
        rows = offs_m.to(tl.int64)  # rows * stride can pass 2^31 elements on large tensors
        # Masked lanes (the row's tail, padding past n, rows past n_rows) read as -inf: they add
        # exp(-inf) = 0 to the sum and are never fetched, so NaN in the padding cannot leak in.
        x = tl.load(X_ptr + rows[:, None] * stride_x_row + offs_n[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: x - m stays -inf, never -inf - -inf
        e = exp_diff(x, m[:, None], ACCURATE)
        s = tl.sum(e, axis=1)  # fp32 accumulation over the row
        # s >= 1 whenever the row holds a finite value (its max contributes exp(0) = 1); an all
        # -inf row has s = 0 and e = 0, so the clamp turns 0/0 into 0 * 1 = 0 without a branch.
        inv = 1.0 / tl.maximum(s, 1.0)
        y = e * inv[:, None]
        tl.store(Out_ptr + rows[:, None] * stride_out_row + offs_n[None, :],
                 y.to(Out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_split_stats_kernel(
    X_ptr, Max_ptr, Sum_ptr, n_cols, n_chunks, stride_x_row,
    BLOCK_N: tl.constexpr, ACCURATE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_n = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    x = tl.load(X_ptr + pid_m.to(tl.int64) * stride_x_row + offs_n, mask=mask_n, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(exp_diff(x, m_safe, ACCURATE), axis=0)  # fp32; 0 for an all -inf chunk
    stat = pid_m.to(tl.int64) * n_chunks + pid_c
    tl.store(Max_ptr + stat, m)
    tl.store(Sum_ptr + stat, s)


@triton.jit
def _softmax_split_norm_kernel(
    X_ptr, Out_ptr, Max_ptr, Sum_ptr, n_cols, n_chunks, stride_x_row, stride_out_row,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ACCURATE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    stats_row = pid_m.to(tl.int64) * n_chunks
    offs_c = tl.arange(0, BLOCK_C)
    # Every program of a row re-merges the row's chunk stats: a few hundred bytes from L2,
    # cheaper than a third launch and a second workspace round trip.
    m_row = float("-inf")
    for c0 in range(0, n_chunks, BLOCK_C):
        mask_c = c0 + offs_c < n_chunks
        m_c = tl.load(Max_ptr + stats_row + c0 + offs_c, mask=mask_c, other=float("-inf"))
        m_row = tl.maximum(m_row, tl.max(m_c, axis=0))
    m_row = tl.where(m_row == float("-inf"), 0.0, m_row)  # finite, so m_c - m_row is never -inf - -inf
    s_row = 0.0
    for c0 in range(0, n_chunks, BLOCK_C):
        mask_c = c0 + offs_c < n_chunks
        m_c = tl.load(Max_ptr + stats_row + c0 + offs_c, mask=mask_c, other=float("-inf"))
        s_c = tl.load(Sum_ptr + stats_row + c0 + offs_c, mask=mask_c, other=0.0)
        s_row += tl.sum(s_c * exp_diff(m_c, m_row, True), axis=0)  # fp32 merge of chunk sums
    inv = 1.0 / tl.maximum(s_row, 1.0)  # s_row >= 1 unless the row is all -inf (then every e is 0)

    offs_n = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    x = tl.load(X_ptr + pid_m.to(tl.int64) * stride_x_row + offs_n, mask=mask_n, other=float("-inf"))
    y = exp_diff(x.to(tl.float32), m_row, ACCURATE) * inv
    tl.store(Out_ptr + pid_m.to(tl.int64) * stride_out_row + offs_n,
             y.to(Out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _softmax_online_kernel(
    X_ptr, Out_ptr, Lse_ptr, n_cols, stride_x_row, stride_out_row, stride_lse,
    TILE: tl.constexpr, ACCURATE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    x_row = X_ptr + pid_m.to(tl.int64) * stride_x_row
    out_row = Out_ptr + pid_m.to(tl.int64) * stride_out_row
    offs_n = tl.arange(0, TILE)
    # Pass 1: running max m and running sum l (fp32), l rescaled by exp(m_old - m_new) per tile.
    m = float("-inf")
    l = 0.0
    for start in range(0, n_cols, TILE):
        mask_n = start + offs_n < n_cols
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A finite stand-in while no finite value has been seen: m - m_safe is then
        # -inf - 0 = -inf (alpha = 0, and l is still 0), never -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = exp_diff(m, m_safe, True)  # one per tile: always the accurate form
        l = l * alpha + tl.sum(exp_diff(x, m_safe, ACCURATE), axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv = 1.0 / tl.maximum(l, 1.0)  # l >= 1 once a finite value was seen; all -inf rows write 0
    lse = tl.where(l > 0.0, m_safe + tl.log2(tl.maximum(l, 1.0)) * LN2, float("-inf"))
    tl.store(Lse_ptr + pid_m.to(tl.int64) * stride_lse, lse)
    # Pass 2: the second read of the row; the first pass's tiles have usually left L2 by now.
    for start in range(0, n_cols, TILE):
        mask_n = start + offs_n < n_cols
        x = tl.load(x_row + start + offs_n, mask=mask_n, other=float("-inf")).to(tl.float32)
        y = exp_diff(x, m_safe, ACCURATE) * inv
        tl.store(out_row + start + offs_n, y.to(Out_ptr.dtype.element_ty), mask=mask_n)


def _num_warps(tile: int) -> int:
    """Warps for a program holding `tile` fp32 values: ~32 a thread, between 4 and 16 warps."""
    return max(4, min(16, tile // 1024))


# Fused-kernel launch table, by (tile = BLOCK_M * BLOCK_N, element size in bytes): (num_warps,
# pipeline stages, persistent programs per SM, None meaning one program per row block). Tiles are
# 4096 for every n <= 4096 (short rows packed BLOCK_M to a program), else next_pow2(n). Measured
# on an H200 (Triton 3.6) over >= 256 MiB inputs, in % of device copy bandwidth:
# - up to 16K, one program per row block (the hardware scheduler is the best load balancer)
#   reached 92-95%; pipelining cost 5-40% there (shared-memory staging, fewer programs).
# - fp32 16K: 32 warps 92-95%, 16 warps 73-95% (unsteady across runs); fp32 32K: 32 warps
#   85-88%, 16 warps 84-86%. fp32 32K cannot pipeline (two 128 KB stages exceed shared memory).
# - 16-bit 32K: with one program per row only one fits an SM and its load latency is exposed
#   (75%); one persistent program per SM with 3 stages prefetches the next rows (86%).
FUSED_CONFIGS: dict[tuple[int, int], tuple[int, int, int | None]] = {
    (4096, 4): (4, 1, None), (8192, 4): (8, 1, None), (16384, 4): (32, 1, None), (32768, 4): (32, 1, None),
    (4096, 2): (4, 1, None), (8192, 2): (4, 1, None), (16384, 2): (16, 1, None), (32768, 2): (32, 3, 1),
}


def _fused_config(tile: int, elt: int) -> tuple[int, int, int | None]:
    if (tile, elt) in FUSED_CONFIGS:
        return FUSED_CONFIGS[(tile, elt)]
    return _num_warps(tile), 1, None


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_input(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor (rows, n), got shape {shape}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    rows, n = x.shape
    if x.stride(1) != 1 and n > 1:
        raise ValueError(f"x must have last-dim stride 1, got strides {x.stride()}")
    if n >= 2**31:
        raise ValueError(f"row length n={n} must be < 2**31")
    if out is None:
        return torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")
    if n > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have last-dim stride 1, got strides {out.stride()}")
    if rows > 1 and out.stride(0) < n:
        raise ValueError(f"out row stride {out.stride(0)} < n={n}: rows would overlap")
    return out


def softmax(x: torch.Tensor, *, out: torch.Tensor | None = None, max_fused: int | None = None) -> torch.Tensor:
    """Softmax over the last dim, fp32 math; all -inf rows give 0.

    x: (rows, n) fp32/fp16/bf16, last-dim stride 1, any row stride (padding is never read)
    out: (rows, n) x's dtype, last-dim stride 1, any row stride >= n; allocated if None
    max_fused: for testing dispatch paths only: rows longer than this take the split path
               (default MAX_FUSED_N); it also caps the split chunk so a small n spans many chunks
    returns: out
    """
    out = _check_input(x, out)
    limit = MAX_FUSED_N if max_fused is None else max_fused
    if not 1 <= limit <= MAX_FUSED_N:
        raise ValueError(f"max_fused={max_fused} must be in [1, {MAX_FUSED_N}]")
    rows, n = x.shape
    if rows == 0 or n == 0:
        return out
    accurate = out.dtype == torch.float32
    if n <= limit:
        block_n = max(16, triton.next_power_of_2(n))
        block_m = min(max(1, FUSED_TILE // block_n), triton.next_power_of_2(rows))
        n_blocks = triton.cdiv(rows, block_m)
        num_warps, num_stages, per_sm = _fused_config(block_m * block_n, x.element_size())
        grid = n_blocks if per_sm is None or not x.is_cuda else min(n_blocks, per_sm * _sm_count(x.device))
        _softmax_fused_kernel[(grid,)](
            x, out, rows, n, x.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, ACCURATE=accurate,
            num_warps=num_warps, num_stages=num_stages,
        )
        return out
    # Largest power of two <= limit, so that a lowered limit also lowers the chunk.
    block_n = max(16, min(SPLIT_BLOCK_N, 1 << (limit.bit_length() - 1)))
    n_chunks = triton.cdiv(n, block_n)
    if n_chunks > 65535:  # CUDA's limit on grid dim 1
        raise ValueError(f"row length n={n} needs {n_chunks} chunks of {block_n}; at most 65535")
    stats = torch.empty((2, rows, n_chunks), dtype=torch.float32, device=x.device)
    grid = (rows, n_chunks)
    num_warps = _num_warps(block_n)
    _softmax_split_stats_kernel[grid](
        x, stats[0], stats[1], n, n_chunks, x.stride(0),
        BLOCK_N=block_n, ACCURATE=accurate, num_warps=num_warps,
    )
    _softmax_split_norm_kernel[grid](
        x, out, stats[0], stats[1], n, n_chunks, x.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_C=min(SPLIT_STATS_BLOCK, max(16, triton.next_power_of_2(n_chunks))),
        ACCURATE=accurate, num_warps=num_warps,
    )
    return out


def online_softmax(
    x: torch.Tensor, tile: int, *, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Streaming softmax, one program per row, over tiles of `tile` elements.

    x: (rows, n) fp32/fp16/bf16, last-dim stride 1, any row stride (padding is never read)
    tile: power of two in [16, 8192]; the last tile of a row may be partial
    out: (rows, n) x's dtype, last-dim stride 1, any row stride >= n; allocated if None
    out_lse: (rows,) float32, any stride; natural-log logsumexp, -inf for all -inf rows
    returns: (out, out_lse)
    """
    if not isinstance(tile, int) or tile < ONLINE_TILE_MIN or tile > ONLINE_TILE_MAX or tile & (tile - 1):
        raise ValueError(f"tile={tile!r} must be a power of two in [{ONLINE_TILE_MIN}, {ONLINE_TILE_MAX}]")
    out = _check_input(x, out)
    rows, n = x.shape
    if out_lse is None:
        out_lse = torch.empty((rows,), dtype=torch.float32, device=x.device)
    elif out_lse.shape != (rows,) or out_lse.dtype != torch.float32 or out_lse.device != x.device:
        raise ValueError(f"out_lse must be ({rows},) float32 on {x.device}, "
                         f"got {tuple(out_lse.shape)} {out_lse.dtype} on {out_lse.device}")
    if rows == 0:
        return out, out_lse
    _softmax_online_kernel[(rows,)](
        x, out, out_lse, n, x.stride(0), out.stride(0), out_lse.stride(0),
        TILE=tile, ACCURATE=out.dtype == torch.float32, num_warps=_num_warps(tile),
    )
    return out, out_lse
