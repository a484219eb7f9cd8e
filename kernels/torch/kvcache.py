"""Eager KV-cache append with torch indexing (bit-exact copies).

    contiguous: cache[r, pos[b] + t] = new[b, t];  paged: cache[table[r, p // page], p % page] = new[b, t]
    r = cache_loc[b] (TensorRT-LLM's row indirection), or b without cache_loc
    ragged (seq_len, seq_start): new (total, h, d), new[b, t] read as new[seq_start[b] + t], t < seq_len[b]
"""

from __future__ import annotations

import torch


def update(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, *, block_table: torch.Tensor | None = None,
           cache_loc: torch.Tensor | None = None, seq_len: torch.Tensor | None = None,
           seq_start: torch.Tensor | None = None) -> None:
    """In place. cache (rows, s_max, h, d) or (num_blocks, page, h, d) with block_table (rows, max_blocks);
    new (b, s_new, h, d); pos (b,) tokens already cached; cache_loc (b,) each sequence's row (None: row b).
    Ragged (TensorRT-LLM): new (total, h, d) with seq_len, seq_start (b,); d is the cache's own (V's may differ)."""
    if seq_len is not None:
        n = seq_len.to(cache.device).long()
        bi = torch.repeat_interleave(torch.arange(n.numel(), device=cache.device), n)  # each token's sequence
        t = torch.arange(bi.numel(), device=cache.device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        src = seq_start.to(cache.device).long()[bi] + t
        p = pos.to(cache.device).long()[bi] + t
        r = bi if cache_loc is None else cache_loc.to(cache.device).long()[bi]
        if block_table is None:
            cache[r, p] = new[src]
        else:
            cache[block_table.to(cache.device).long()[r, p // cache.shape[1]], p % cache.shape[1]] = new[src]
        return
    b, s_new = new.shape[:2]
    p = pos.to(cache.device).long()[:, None] + torch.arange(s_new, device=cache.device)[None, :]
    row = torch.arange(b, device=cache.device) if cache_loc is None else cache_loc.to(cache.device).long()
    bi = row[:, None].expand_as(p)
    if block_table is None:
        cache[bi, p] = new
    else:
        page = cache.shape[1]
        cache[block_table.to(cache.device).long()[bi, p // page], p % page] = new


def metadata(seq_len: torch.Tensor, input_pos: torch.Tensor, cache_loc: torch.Tensor, *,
             graph: int = 0) -> tuple[torch.Tensor, ...]:
    """TensorRT-LLM's prepare_fused_mha_metadata on (max_batch,) buffers -> (seq_len, input_pos, cache_loc,
    seq_start), each (m,) int32: b = 1 + the last non-zero seq_len, m = graph or b, padding rows seq_len 0
    with the last real row's input_pos and cache_loc, seq_start the exclusive cumsum (refimpl/kvcache.py)."""
    nz = torch.nonzero(seq_len > 0)
    b = int(nz[-1]) + 1 if nz.numel() else 0
    m = graph or b
    if m < b:
        raise ValueError(f"graph={graph} is smaller than the batch's {b} sequences")
    if b == 0:
        z = torch.zeros(m, dtype=torch.int32, device=seq_len.device)
        return z, z.clone(), z.clone(), z.clone()
    src = torch.clamp(torch.arange(m, device=seq_len.device), max=b - 1)
    length = torch.where(torch.arange(m, device=seq_len.device) < b, seq_len[src], 0).to(torch.int32)
    start = (torch.cumsum(length, 0) - length).to(torch.int32)
    return length, input_pos[src].to(torch.int32), cache_loc[src].to(torch.int32), start
