"""Golden KV-cache writes (contiguous and paged). Bit-exact: a write is a copy.

    contiguous: cache[b, pos[b] + t] = new[b, t]                          for t < s_new
    paged:      cache[block_table[b, p // page], p % page] = new[b, t]    with p = pos[b] + t

Conventions: `pos[b]` is the number of tokens already cached for sequence b (the new tokens are
appended after them); every other slot keeps its old bits. The caller guarantees the writes fit
(pos + s_new <= capacity; the paged table covers every written position) and, for the paged
layout, that no two sequences share a written page.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def update(cache: NDArray, new: NDArray, pos: NDArray, *, block_table: NDArray | None = None) -> NDArray:
    """The cache after appending `new` at `pos` (a new array; the input is not modified).

    cache: (b, s_max, h_kv, d) contiguous, or (num_blocks, page, h_kv, d) with block_table
    new: (b, s_new, h_kv, d)
    pos: (b,) int, tokens already cached per sequence
    block_table: (b, max_blocks) int, for the paged layout
    returns: the updated cache, same shape and dtype as `cache`
    """
    out = np.array(cache, copy=True)
    b, s_new = new.shape[:2]
    p = np.asarray(pos, dtype=np.int64)[:, None] + np.arange(s_new)[None, :]  # b, s_new
    bi = np.broadcast_to(np.arange(b)[:, None], p.shape)
    if block_table is None:
        out[bi, p] = new
    else:
        page = cache.shape[1]
        bt = np.asarray(block_table, dtype=np.int64)
        out[bt[bi, p // page], p % page] = new
    return out
