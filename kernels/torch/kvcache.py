"""Eager KV-cache append with torch indexing (bit-exact copies).

    contiguous: cache[b, pos[b] + t] = new[b, t];  paged: cache[table[b, p // page], p % page] = new[b, t]
"""

from __future__ import annotations

import torch


def update(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, *, block_table: torch.Tensor | None = None) -> None:
    """In place. cache (b, s_max, h, d) or (num_blocks, page, h, d) with block_table (b, max_blocks);
    new (b, s_new, h, d); pos (b,) tokens already cached."""
    b, s_new = new.shape[:2]
    p = pos.to(cache.device).long()[:, None] + torch.arange(s_new, device=cache.device)[None, :]
    bi = torch.arange(b, device=cache.device)[:, None].expand_as(p)
    if block_table is None:
        cache[bi, p] = new
    else:
        page = cache.shape[1]
        cache[block_table.to(cache.device).long()[bi, p // page], p % page] = new
