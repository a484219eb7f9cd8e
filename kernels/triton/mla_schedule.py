"""FlashMLA's split scheduler (`get_mla_metadata`) as one Triton program over the whole batch.

FlashMLA runs it as one warp: the lanes sum the requests' costs, then one thread walks the requests
part by part. Here too: a vector pass sums ceil(L_i / 64) + 5 over the batch in chunks, then a scalar
loop over the SM parts that get work, and inside each a loop over requests, carries (request, block,
split index); the idle parts after the last request (FlashMLA walks them one by one) are written as one
block of rows:

    num_sm_parts P = sms // h_kv // ceil(s_q h_q / h_kv / 64)         (host, as flash_api.cpp)
    payload = ceil(sum_i (ceil(L_i / 64) + 5) / P) + 5, >= 10 when FLOOR
    the rest of a request fits (rest + 5 <= remaining payload): finish it, num_splits[i + 1] written;
    else, if more than 5 is left, take (remaining - 5) blocks of it (a split) and close the part.

Row p of meta: [begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx, 0, 0, 0] (int32);
num_splits (b + 1,) int32, cumulative from 0. The updates inside the loop are selects (tl.where),
so the loop body has no branches. Conventions: refimpl/mla_schedule.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["get_mla_metadata", "num_sm_parts"]

BLOCK, FIXED_OVERHEAD = 64, 5


@triton.jit
def _mla_metadata_kernel(L_ptr, Meta_ptr, Ns_ptr, b, num_parts, BLOCK_N: tl.constexpr, F: tl.constexpr,
                         FLOOR: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr):
    zero = tl.program_id(0) * 0  # int32 scalars carried through the loops
    total = zero
    for c in range(0, b, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        L = tl.load(L_ptr + offs, mask=offs < b, other=0)
        total += tl.sum(tl.where(offs < b, (L + BLOCK_N - 1) // BLOCK_N + F, 0), axis=0)
    payload = (total + num_parts - 1) // num_parts + F
    if FLOOR:
        payload = tl.maximum(payload, 2 * F)
    tl.store(Ns_ptr, zero)
    cols = tl.arange(0, 8)
    now_idx = zero
    now_block = zero
    now_n = zero
    cum = zero
    p = zero
    while (p < num_parts) & (now_idx < b):  # the active parts; the idle ones are written below
        begin_idx = now_idx
        begin_seq = now_block * BLOCK_N
        begin_n = now_n
        remain = payload
        go = now_idx < b
        while go:
            blocks = (tl.load(L_ptr + now_idx) + BLOCK_N - 1) // BLOCK_N
            rest = blocks - now_block + F
            fits = remain >= rest
            split = (remain < rest) & (remain - F > 0)
            cum = tl.where(fits, cum + now_n + 1, cum)
            tl.store(Ns_ptr + now_idx + 1, cum, mask=fits)
            now_block = tl.where(fits, 0, tl.where(split, now_block + remain - F, now_block))
            now_n = tl.where(fits, 0, tl.where(split, now_n + 1, now_n))
            remain = tl.where(fits, remain - rest, remain)
            now_idx = tl.where(fits, now_idx + 1, now_idx)
            go = fits & (now_idx < b)
        last = tl.load(L_ptr + now_idx - 1, mask=now_idx > 0, other=0)
        end_idx = tl.where(now_block > 0, now_idx, now_idx - 1)
        end_seq = tl.where(now_block > 0, now_block * BLOCK_N, last)
        row = Meta_ptr + p * 8
        tl.store(row, begin_idx)
        tl.store(row + 1, begin_seq)
        tl.store(row + 2, end_idx)
        tl.store(row + 3, end_seq)
        tl.store(row + 4, begin_n)
        tl.store(row + cols, zero, mask=cols >= 5)  # the padding columns: 0
        p += 1
    # every part from p on starts past the last request: [b, 0, b - 1, L[b - 1], 0, 0, 0, 0]
    idle = tl.where(cols == 0, b, tl.where(cols == 2, b - 1, tl.where(cols == 3, tl.load(L_ptr + b - 1), 0)))
    for c in range(0, num_parts, PARTS):
        rows = c + tl.arange(0, PARTS)
        keep = (rows >= p) & (rows < num_parts)
        tl.store(Meta_ptr + rows[:, None] * 8 + cols[None, :], idle[None, :] + rows[:, None] * 0, mask=keep[:, None])


def num_sm_parts(sms: int, s_q: int, h_q: int, h_kv: int = 1) -> int:
    return sms // h_kv // triton.cdiv(s_q * h_q // h_kv, 64)


def get_mla_metadata(seqlens: torch.Tensor, s_q: int, h_q: int, h_kv: int, sms: int, floor: bool = True,
                     out_meta: torch.Tensor | None = None, out_num_splits: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """seqlens: (b,) int32 on the device -> (meta (P, 8), num_splits (b + 1,)) int32 there."""
    if seqlens.ndim != 1 or seqlens.numel() < 1 or seqlens.dtype != torch.int32 or h_q % h_kv:
        raise ValueError(f"need seqlens (b >= 1,) int32 and h_q % h_kv == 0, got {tuple(seqlens.shape)} "
                         f"{seqlens.dtype}, h_q={h_q}, h_kv={h_kv}")
    parts = num_sm_parts(sms, s_q, h_q, h_kv)
    if parts < 1:
        raise ValueError(f"num_sm_parts = {parts} for sms={sms}, s_q={s_q}, h_q={h_q}, h_kv={h_kv}")
    b = seqlens.numel()
    dev = seqlens.device
    meta = torch.empty((parts, 8), dtype=torch.int32, device=dev) if out_meta is None else out_meta
    ns = torch.empty(b + 1, dtype=torch.int32, device=dev) if out_num_splits is None else out_num_splits
    if meta.shape != (parts, 8) or ns.shape != (b + 1,) or not (meta.is_contiguous() and ns.is_contiguous()):
        raise ValueError(f"out_meta {tuple(meta.shape)} / out_num_splits {tuple(ns.shape)}: want contiguous "
                         f"({parts}, 8) and ({b + 1},)")
    _mla_metadata_kernel[(1,)](seqlens.contiguous(), meta, ns, b, parts, BLOCK_N=BLOCK, F=FIXED_OVERHEAD,
                               FLOOR=bool(floor), CHUNK=min(1024, max(16, triton.next_power_of_2(b))),
                               PARTS=min(256, max(16, triton.next_power_of_2(parts))))
    return meta, ns
