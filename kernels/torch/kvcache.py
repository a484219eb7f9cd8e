"""Eager KV-cache append with torch indexing (bit-exact copies).

    contiguous: cache[r, pos[b] + t] = new[b, t];  paged: cache[table[r, p // page], p % page] = new[b, t]
    r = cache_loc[b] (TensorRT-LLM's row indirection), or b without cache_loc
"""

from __future__ import annotations

import torch


def update(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, *, block_table: torch.Tensor | None = None,
           cache_loc: torch.Tensor | None = None) -> None:
    """In place. cache (rows, s_max, h, d) or (num_blocks, page, h, d) with block_table (rows, max_blocks);
    new (b, s_new, h, d); pos (b,) tokens already cached; cache_loc (b,) each sequence's row (None: row b)."""
    b, s_new = new.shape[:2]
    p = pos.to(cache.device).long()[:, None] + torch.arange(s_new, device=cache.device)[None, :]
    row = torch.arange(b, device=cache.device) if cache_loc is None else cache_loc.to(cache.device).long()
    bi = row[:, None].expand_as(p)
    if block_table is None:
        cache[bi, p] = new
    else:
        page = cache.shape[1]
        cache[block_table.to(cache.device).long()[bi, p // page], p % page] = new
