"""Golden KV-cache writes (contiguous and paged). Bit-exact: a write is a copy.

    contiguous: cache[r, pos[b] + t] = new[b, t]                            for t < s_new
    paged:      cache[block_table[r, p // page], p % page] = new[b, t]      with p = pos[b] + t
    r = cache_loc[b] (TensorRT-LLM's `cache_loc`), or b when no cache_loc is given
    ragged (seq_len, seq_start given): new[b, t] above is new[seq_start[b] + t], for t < seq_len[b]

Conventions: `pos[b]` is the number of tokens already cached for sequence b (the new tokens are
appended after them); every other slot keeps its old bits. `cache_loc` maps sequence b to its
cache row (contiguous) or block-table row (paged): the cache / table may hold more rows than the
batch has sequences, and the rows no sequence maps to are never written. The caller guarantees the
writes fit (pos + s_new <= capacity; the paged table covers every written position), that
cache_loc is injective and, for the paged layout, that no two sequences share a written page.

Paged appends follow the block table token by token: the page of position p is
block_table[r, p // page], so a multi-token append that starts inside a page and crosses its end
continues at the start of the *next table entry*. TensorRT-LLM's Triton `update_paged_kv_cache`
(auto_deploy, triton_attention_with_paged_kv_cache) does not: it lays the tokens out page by page
from cache_len // PAGE_SIZE and then adds cache_len % PAGE_SIZE to the flat physical offset, so the
tokens past the first page's end land in *physical page + 1* (a page the sequence need not own,
or past the cache's end) at the slot they would have had. Its callers only get the right answer
when a sequence's pages are physically consecutive or every multi-token append starts on a page
boundary (prefill into an empty cache; decode writes one token). The golden is the page-table
contract; the ci case with shuffled even-numbered pages and an unaligned append (conformance/ops/
kvcache.py, `rows`) separates the two (mutants *-kvcache-paged-trt-overflow).

Ragged writes (TensorRT-LLM's flattened [B*S, N, D] inputs with per-sequence seq_len / seq_start):
`new` is (total, h_kv, d), the new tokens of every sequence back to back; sequence b owns rows
seq_start[b] .. seq_start[b] + seq_len[b] - 1 of it and appends them after its pos[b] cached tokens
(seq_len[b] = 0: nothing written). The last dim is the cache's own: TensorRT-LLM's V head dim may
differ from K's (V_D_HEAD != Q_D_HEAD), so K and V are two calls with their own d.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def update(cache: NDArray, new: NDArray, pos: NDArray, *, block_table: NDArray | None = None,
           cache_loc: NDArray | None = None, seq_len: NDArray | None = None,
           seq_start: NDArray | None = None) -> NDArray:
    """The cache after appending `new` at `pos` (a new array; the input is not modified).

    cache: (rows, s_max, h_kv, d) contiguous, or (num_blocks, page, h_kv, d) with block_table
    new: (b, s_new, h_kv, d)
    pos: (b,) int, tokens already cached per sequence
    block_table: (rows, max_blocks) int, for the paged layout
    cache_loc: (b,) int, the cache / block-table row of each sequence (None: row b; rows = b)
    seq_len, seq_start: (b,) int, both or neither: the ragged layout (module docstring); new is then
        (total, h_kv, d) and sequence b's tokens are new[seq_start[b] : seq_start[b] + seq_len[b]]
    returns: the updated cache, same shape and dtype as `cache`
    """
    out = np.array(cache, copy=True)
    if (seq_len is None) != (seq_start is None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    if seq_len is not None:
        n = np.asarray(seq_len, dtype=np.int64)  # b
        bi = np.repeat(np.arange(n.size), n)  # the sequence of each written token
        t = np.arange(bi.size) - np.repeat(np.cumsum(n) - n, n)  # its index within the sequence
        src = np.asarray(seq_start, dtype=np.int64)[bi] + t
        p = np.asarray(pos, dtype=np.int64)[bi] + t
        r = bi if cache_loc is None else np.asarray(cache_loc, dtype=np.int64)[bi]
        if block_table is None:
            out[r, p] = new[src]
        else:
            out[np.asarray(block_table, dtype=np.int64)[r, p // cache.shape[1]], p % cache.shape[1]] = new[src]
        return out
    b, s_new = new.shape[:2]
    p = np.asarray(pos, dtype=np.int64)[:, None] + np.arange(s_new)[None, :]  # b, s_new
    row = np.arange(b) if cache_loc is None else np.asarray(cache_loc, dtype=np.int64)  # b
    ri = np.broadcast_to(row[:, None], p.shape)  # b, s_new
    if block_table is None:
        out[ri, p] = new
    else:
        page = cache.shape[1]
        bt = np.asarray(block_table, dtype=np.int64)
        out[bt[ri, p // page], p % page] = new
    return out


def metadata(seq_len: NDArray, input_pos: NDArray, cache_loc: NDArray, *, graph: int = 0) -> tuple[NDArray, ...]:
    """TensorRT-LLM's host metadata step (prepare_fused_mha_metadata with SequenceInfo's sanitising):
    the per-sequence arrays the attention and cache ops take, from the zero-padded batch buffers.

        b = 1 + the last i with seq_len[i] > 0   (0 when there is none): trailing zeros are padding
        m = graph if graph else b                 (CUDA graphs run the batch padded to a captured size)
        seq_len_out[i] = seq_len[i], input_pos_out[i] = input_pos[i], cache_loc_out[i] = cache_loc[i]   i < b
        seq_start[i] = sum_{j < i} seq_len_out[j]                                   the exclusive cumsum
        padding rows b <= i < m: seq_len 0, input_pos and cache_loc those of row b - 1 (0 when b = 0)

    seq_len, input_pos, cache_loc: (max_batch,) int buffers; entries past b are stale (never read)
    graph: the captured batch size (>= b), or 0 (no padding)
    returns: seq_len_out, input_pos_out, cache_loc_out, seq_start, each (m,) int32

    Conventions: a zero-length sequence before the last non-empty one is a sequence (its seq_start
    repeats the next one's); TensorRT-LLM counts sequences as sum(seq_len > 0) and asserts that the
    rest of the buffer is zero, which drops the last sequence of such a batch (the count is one short)
    and trips its assertion. Padding rows write nothing (seq_len 0) and repeat the last real
    sequence's cache row and position, TensorRT-LLM's own suggested padding (SequenceInfo's TODO:
    a kernel that ignores seq_len then repeats a real sequence's write instead of polluting another
    sequence's cache); stale buffer values never reach the outputs.
    """
    n = np.asarray(seq_len, dtype=np.int64)
    nz = np.flatnonzero(n > 0)
    b = int(nz[-1]) + 1 if nz.size else 0
    m = graph if graph else b
    if m < b:
        raise ValueError(f"graph={graph} is smaller than the batch's {b} sequences")
    if b == 0:  # nothing to run: m padding rows of zeros
        length = pos = loc = np.zeros(m, dtype=np.int64)
    else:
        src = np.minimum(np.arange(m), b - 1)  # padding rows read the last real row
        length = np.where(np.arange(m) < b, n[src], 0)
        pos = np.asarray(input_pos, dtype=np.int64)[src]
        loc = np.asarray(cache_loc, dtype=np.int64)[src]
    start = np.cumsum(length) - length  # the exclusive cumsum
    return tuple(a.astype(np.int32) for a in (length, pos, loc, start))
