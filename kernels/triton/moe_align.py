"""MoE token alignment (vLLM's moe_align_block_size) in Triton: a histogram, a scan, a stable scatter, a fill.

The n = T k slots s = t k + j (topk_ids in row-major order) are cut into chunks of CHUNK slots:

    1. _moe_align_count_kernel (a program a chunk): hist[c, e] = the slots of chunk c routed to expert e, a
       one-hot [CHUNK, BLOCK_E] tile summed over the slots
    2. _moe_align_scan_kernel (one program): hist[c, e] <- the slots of expert e in chunks before c (an exclusive
       cumsum down the chunks, CT chunks a step, a running carry); the totals give count[e], padded[e] =
       ceil(count[e] / B) B, end[e] = their inclusive cumsum over experts, start[e] = end[e] - padded[e];
       num_tokens_post_pad = end[E - 1]
    3. _moe_align_scatter_kernel (a program a chunk): each slot's rank among its expert's slots of the chunk (an
       inclusive cumsum of the one-hot tile down the slots, minus 1); sorted_ids[start[e] + hist[c, e] + rank] = s.
       Chunks in order, slots in order within one: a stable counting sort (the declared order)
    4. _moe_align_fill_kernel (NBLK blocks a program): block i's expert is the number of experts whose segment
       ends at or before i B (an empty expert ends where its predecessor does, so never owns a block); -1 for
       i B >= num_tokens_post_pad. Every entry of sorted_ids the scatter does not write (a segment's padding, the
       tail) gets the sentinel n: each entry is written once, whatever order the kernels' programs run in.

Conventions: refimpl/moe_align.py (the golden). Everything int32 (P = n + E (B - 1) < 2^31, checked). The id
range check is one device sync (an id outside [0, E) would otherwise be dropped from every segment). Scratch:
(n_chunks, BLOCK_E) + 3 BLOCK_E int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.moe_args import bad_id, check_align_args, out_sizes

__all__ = ["align", "MAX_EXPERTS"]

MAX_EXPERTS = 4096  # a one-hot row of the experts is held in registers
TILE = 8192  # elements of a one-hot tile (CHUNK x BLOCK_E, CT x BLOCK_E, NBLK x BLOCK_E)
BIG = tl.constexpr(2**31 - 1)


@triton.jit
def _moe_align_count_kernel(Ids_ptr, Hist_ptr, n, k, stride_t, stride_k, CHUNK: tl.constexpr,
                            BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    offs_s = c * CHUNK + tl.arange(0, CHUNK)  # slots t k + j
    mask_s = offs_s < n
    ids = tl.load(Ids_ptr + (offs_s // k).to(tl.int64) * stride_t + (offs_s % k).to(tl.int64) * stride_k,
                  mask=mask_s, other=-1)  # -1: no expert's lane
    e = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    tl.store(Hist_ptr + c.to(tl.int64) * BLOCK_E + e, tl.sum(onehot, axis=0))


@triton.jit
def _moe_align_scan_kernel(Hist_ptr, Seg_ptr, Post_ptr, n_chunks, E, B, CT: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, CT)
    running = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_chunks, CT):
        r = c0 + rows
        ptrs = Hist_ptr + r.to(tl.int64)[:, None] * BLOCK_E + e[None, :]
        m = (r < n_chunks)[:, None]
        tile = tl.load(ptrs, mask=m, other=0)
        excl = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(ptrs, excl, mask=m)
        running += tl.sum(tile, axis=0)
    padded = (running + B - 1) // B * B
    end = tl.cumsum(padded, axis=0)
    tl.store(Seg_ptr + e, end - padded)  # start
    tl.store(Seg_ptr + BLOCK_E + e, running)  # count
    tl.store(Seg_ptr + 2 * BLOCK_E + e, tl.where(e < E, end, BIG))  # end (padding experts: never counted)
    tl.store(Post_ptr, tl.sum(padded, axis=0))


@triton.jit
def _moe_align_scatter_kernel(Ids_ptr, Hist_ptr, Seg_ptr, Sorted_ptr, n, k, stride_t, stride_k,
                              CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    offs_s = c * CHUNK + tl.arange(0, CHUNK)  # slots t k + j
    mask_s = offs_s < n
    ids = tl.load(Ids_ptr + (offs_s // k).to(tl.int64) * stride_t + (offs_s % k).to(tl.int64) * stride_k,
                  mask=mask_s, other=-1)  # -1: no expert's lane
    e = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)
    base = tl.load(Hist_ptr + c.to(tl.int64) * BLOCK_E + e) + tl.load(Seg_ptr + e)
    pos = tl.sum(onehot * base[None, :], axis=1) + rank
    tl.store(Sorted_ptr + pos, offs_s, mask=mask_s)


@triton.jit
def _moe_align_fill_kernel(Seg_ptr, Post_ptr, Sorted_ptr, Eid_ptr, n, P, nb, B, NBLK: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
    e = tl.arange(0, BLOCK_E)
    total = tl.load(Post_ptr)
    end = tl.load(Seg_ptr + 2 * BLOCK_E + e)
    owner = tl.sum((end[None, :] <= (blk * B)[:, None]).to(tl.int32), axis=1)
    live = blk * B < total
    tl.store(Eid_ptr + blk, tl.where(live, owner, -1), mask=blk < nb)
    mine = (owner[:, None] == e[None, :]).to(tl.int32)
    start = tl.sum(mine * tl.load(Seg_ptr + e)[None, :], axis=1)
    count = tl.sum(mine * tl.load(Seg_ptr + BLOCK_E + e)[None, :], axis=1)
    p = blk[:, None] * B + tl.arange(0, BLOCK_B)[None, :]
    pad = ~live[:, None] | (p - start[:, None] >= count[:, None])
    inside = (tl.arange(0, BLOCK_B)[None, :] < B) & (p < P)
    tl.store(Sorted_ptr + p, n + tl.zeros_like(p), mask=inside & pad)


def _check_out(out: torch.Tensor | None, name: str, size: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=torch.int32, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (size,) or out.dtype != torch.int32 \
            or out.device != device or not out.is_contiguous():
        got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"moe.align: {name} must be a contiguous ({size},) torch.int32 on {device}, got {got}")
    return out


def align(topk_ids: torch.Tensor, num_experts: int, block_size: int, *, out_sorted: torch.Tensor | None = None,
          out_expert_ids: torch.Tensor | None = None, out_post_pad: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids (P,), expert_ids (ceil(P / B),), num_tokens_post_pad (1,)) int32 (refimpl/moe_align.py).

    topk_ids: (T, k) int32, any strides, ids in [0, num_experts); num_experts <= MAX_EXPERTS; block_size >= 1.
    out_*: contiguous int32 on topk_ids' device of those shapes; allocated if None.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"moe.align: topk_ids must be a (T, k) int32 array, got {type(topk_ids).__name__}")
    T, k, E, B = check_align_args(tuple(topk_ids.shape), topk_ids.dtype, num_experts, block_size)
    if E > MAX_EXPERTS:
        raise ValueError(f"moe.align: num_experts={E}; at most {MAX_EXPERTS} (a one-hot row of experts in registers)")
    n = T * k
    if n:
        bad = (topk_ids < 0) | (topk_ids >= E)
        if bool(bad.any()):
            raise bad_id(topk_ids[bad][0].item(), E)
    dev = topk_ids.device
    P, nb = out_sizes(T, k, E, B)
    sorted_ids = _check_out(out_sorted, "out_sorted", P, dev)
    expert_ids = _check_out(out_expert_ids, "out_expert_ids", nb, dev)
    post_pad = _check_out(out_post_pad, "out_post_pad", 1, dev)
    block_e = triton.next_power_of_2(E)
    chunk = max(16, min(1024, TILE // block_e))
    n_chunks = max(1, triton.cdiv(n, chunk))
    hist = torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev)
    seg = torch.empty(3 * block_e, dtype=torch.int32, device=dev)
    st, sk = topk_ids.stride() if n else (0, 0)
    _moe_align_count_kernel[(n_chunks,)](topk_ids, hist, n, max(k, 1), st, sk, CHUNK=chunk, BLOCK_E=block_e)
    ct = max(1, min(64, TILE // block_e))
    _moe_align_scan_kernel[(1,)](hist, seg, post_pad, n_chunks, E, B, CT=ct, BLOCK_E=block_e)
    if n:
        _moe_align_scatter_kernel[(n_chunks,)](topk_ids, hist, seg, sorted_ids, n, k, st, sk, CHUNK=chunk,
                                               BLOCK_E=block_e)
    block_b = triton.next_power_of_2(B)
    nblk = max(1, min(1024, TILE // block_e, TILE // block_b))
    _moe_align_fill_kernel[(triton.cdiv(nb, nblk),)](seg, post_pad, sorted_ids, expert_ids, n, P, nb, B, NBLK=nblk,
                                                     BLOCK_B=block_b, BLOCK_E=block_e)
    return sorted_ids, expert_ids, post_pad
