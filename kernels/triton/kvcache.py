"""KV-cache append (contiguous and paged), in Triton. Bit-exact: a write is a copy.

    contiguous: cache[r, pos[b] + t] = new[b, t]                          for t < s_new
    paged:      cache[block_table[r, p // page], p % page] = new[b, t]    with p = pos[b] + t
    r = cache_loc[b] (TensorRT-LLM's row indirection), or b without cache_loc
    ragged (seq_len, seq_start): new (total, h_kv, d), new[b, t] is new[seq_start[b] + t], t < seq_len[b]

Conventions (OPS.md, kvcache.update; golden refimpl/kvcache.py): pos[b] is the number of tokens
already cached; every other slot keeps its bits. The caller guarantees the writes fit (and, for a
paged cache, that the table covers every written position and no two sequences share a written
page). Both tensors are reinterpreted as same-width integers before the copy, so NaN payloads and
signed zeros move unchanged and no float conversion can happen on any backend.

One program copies one token's (h_kv, d) slab: BLOCK_H heads x BLOCK_D values, 16-byte rows. Ragged
(TensorRT-LLM's flattened tokens) launches max_len programs per sequence (new's row count unless
given: no device sync); those past the sequence's seq_len return at once. K and V are separate calls,
each with its own head dim (TensorRT-LLM's V_D_HEAD may differ from K's).

`metadata` is TensorRT-LLM's host metadata step (prepare_fused_mha_metadata; golden
refimpl/kvcache.py `metadata`) on the device: one program scans the (max_batch,) seq_len buffer for b
(1 + the last non-zero length), then writes the m = graph or b output rows a block at a time: real
rows copied, padding rows (b <= i < m) seq_len 0 with row b - 1's input_pos and cache_loc, seq_start
the exclusive cumsum (tl.cumsum of the block, minus the row's own length, plus the earlier blocks' sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Values a program copies per step: 4096 two-byte values is 8 KB, enough loads in flight per
# program; larger slabs loop over head blocks.
SLAB = 4096


@triton.jit
def _kvcache_update_kernel(
    Cache_ptr, New_ptr, Pos_ptr, BT_ptr, Loc_ptr, SeqLen_ptr, SeqStart_ptr, s_new, h_kv, d,
    stride_cb, stride_cs, stride_ch, stride_nb, stride_ns, stride_nh, stride_bt_b, stride_bt_p,
    PAGED: tl.constexpr, PAGE: tl.constexpr, LOC: tl.constexpr, RAGGED: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // s_new
    t = pid % s_new
    if RAGGED:
        if t >= tl.load(SeqLen_ptr + b):  # past the sequence's new tokens
            return
    p = tl.load(Pos_ptr + b).to(tl.int64) + t
    if LOC:
        row = tl.load(Loc_ptr + b).to(tl.int64)  # the sequence's cache / block-table row
    else:
        row = b.to(tl.int64)
    if PAGED:
        page = tl.load(BT_ptr + row * stride_bt_b + (p // PAGE) * stride_bt_p)
        dst = Cache_ptr + page.to(tl.int64) * stride_cb + (p % PAGE) * stride_cs
    else:
        dst = Cache_ptr + row * stride_cb + p * stride_cs
    if RAGGED:
        src = New_ptr + (tl.load(SeqStart_ptr + b).to(tl.int64) + t) * stride_ns  # the flattened token's row
    else:
        src = New_ptr + b.to(tl.int64) * stride_nb + t.to(tl.int64) * stride_ns
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, h_kv, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < h_kv)[:, None] & (offs_d < d)[None, :]
        x = tl.load(src + offs_h[:, None] * stride_nh + offs_d[None, :], mask=mask)
        tl.store(dst + offs_h[:, None] * stride_ch + offs_d[None, :], x, mask=mask)


def update(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, *,
           block_table: torch.Tensor | None = None, cache_loc: torch.Tensor | None = None,
           seq_len: torch.Tensor | None = None, seq_start: torch.Tensor | None = None,
           max_len: int | None = None) -> None:
    """Append `new` to `cache` in place at positions pos[b] + t; call once for K and once for V.

    cache: (rows, s_max, h_kv, d) contiguous layout, or (num_blocks, page, h_kv, d) with block_table;
           last-dim stride 1, other strides arbitrary
    new: (b, s_new, h_kv, d), cache's dtype, last-dim stride 1
    pos: (b,) int32 on cache's device, tokens already cached per sequence
    block_table: (rows, max_blocks) int32 for the paged layout, any strides
    cache_loc: (b,) int32 contiguous, each sequence's cache / block-table row (None: row b, rows = b);
               distinct rows in range (not checked: that would sync the device)
    seq_len, seq_start: (b,) int32 contiguous, both or neither: TensorRT-LLM's ragged layout, new (total,
               h_kv, d) and sequence b's tokens new[seq_start[b] : seq_start[b] + seq_len[b]] (in range: not
               checked); max_len >= every seq_len (default: total, no device sync)
    """
    ragged = seq_len is not None
    if ragged != (seq_start is not None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    if not isinstance(cache, torch.Tensor) or not isinstance(new, torch.Tensor) or cache.dim() != 4 \
            or new.dim() != (3 if ragged else 4):
        raise ValueError("cache and new must be tensors: cache (b|num_blocks, s_max|page, h_kv, d), "
                         f"new {'(total, h_kv, d)' if ragged else '(b, s_new, h_kv, d)'}")
    if ragged:
        b = seq_len.shape[0] if isinstance(seq_len, torch.Tensor) and seq_len.dim() == 1 else -1
        for name, a in (("seq_len", seq_len), ("seq_start", seq_start)):
            if not isinstance(a, torch.Tensor) or tuple(a.shape) != (b,) or a.dtype != torch.int32 \
                    or a.device != cache.device or (b > 1 and a.stride(0) != 1):
                raise ValueError(f"{name} must be a contiguous (b,) int32 tensor on {cache.device}, like seq_len")
        s_new, (h_kv, d) = (new.shape[0] if max_len is None else int(max_len)), new.shape[1:]
    else:
        b, s_new, h_kv, d = new.shape
    if cache.dtype != new.dtype or cache.element_size() not in _INT_OF_SIZE:
        raise ValueError(f"cache dtype {cache.dtype} and new dtype {new.dtype} must match (1/2/4/8-byte elements)")
    if tuple(cache.shape[2:]) != (h_kv, d):
        raise ValueError(f"cache {tuple(cache.shape)} and new {tuple(new.shape)} differ in (h_kv, d)")
    for name, t in (("cache", cache), ("new", new)):
        if d > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {tuple(t.stride())}")
        if t.device != cache.device:
            raise ValueError(f"{name} is on {t.device}, cache on {cache.device}")
    if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (b,) or pos.dtype != torch.int32 \
            or pos.device != cache.device:
        raise ValueError(f"pos must be a ({b},) int32 tensor on {cache.device}")
    paged, loc = block_table is not None, cache_loc is not None
    check_cache_loc(cache_loc, b, cache.device)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 \
                or (not loc and block_table.shape[0] != b) \
                or block_table.dtype != torch.int32 or block_table.device != cache.device:
            raise ValueError(f"block_table must be a ({'rows' if loc else b}, max_blocks) int32 tensor on {cache.device}")
    elif not loc and cache.shape[0] != b:
        raise ValueError(f"cache batch {cache.shape[0]} != new batch {b}")
    if b * s_new == 0 or h_kv * d == 0:
        return
    ity = _INT_OF_SIZE[cache.element_size()]
    cache_i, new_i = cache.view(ity), new.view(ity)  # same strides, integer bits
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h_kv), SLAB // block_d))
    _kvcache_update_kernel[(b * s_new,)](
        cache_i, new_i, pos, block_table if paged else pos, cache_loc if loc else pos,
        seq_len if ragged else pos, seq_start if ragged else pos, s_new, h_kv, d,
        *cache_i.stride()[:3], *((0, *new_i.stride()[:2]) if ragged else new_i.stride()[:3]),
        *(block_table.stride() if paged else (0, 0)),
        PAGED=paged, PAGE=cache.shape[1] if paged else 1, LOC=loc, RAGGED=ragged, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )


def check_cache_loc(cache_loc: torch.Tensor | None, b: int, device: torch.device) -> None:
    """ValueError unless cache_loc is None or a contiguous (b,) int32 tensor on `device`."""
    if cache_loc is not None and (not isinstance(cache_loc, torch.Tensor) or tuple(cache_loc.shape) != (b,)
                                  or cache_loc.dtype != torch.int32 or cache_loc.device != device
                                  or (b > 1 and cache_loc.stride(0) != 1)):
        raise ValueError(f"cache_loc must be a contiguous ({b},) int32 tensor on {device}")


META_BLOCK = 1024  # rows a metadata step handles per loop iteration


@triton.jit
def _kvcache_metadata_kernel(
    SeqLen_ptr, Pos_ptr, Loc_ptr, OutLen_ptr, OutPos_ptr, OutLoc_ptr, OutStart_ptr, OutB_ptr, maxb, m,
    BLOCK: tl.constexpr,
):
    # b = 1 + the last i with seq_len[i] > 0 (0 when none): trailing zeros are padding, interior zeros
    # are zero-length sequences
    b = 0
    for r0 in range(0, maxb, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        n = tl.load(SeqLen_ptr + offs, mask=offs < maxb, other=0)
        b = tl.maximum(b, tl.max(tl.where(n > 0, offs + 1, 0), axis=0))
    tl.store(OutB_ptr, b)
    last = tl.maximum(b - 1, 0)
    pos_last = tl.where(b > 0, tl.load(Pos_ptr + last), 0)  # what the padding rows repeat
    loc_last = tl.where(b > 0, tl.load(Loc_ptr + last), 0)
    carry = 0  # the seq_len sum of the earlier blocks
    for r0 in range(0, m, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        real = offs < b
        n = tl.load(SeqLen_ptr + offs, mask=real, other=0)
        pos = tl.where(real, tl.load(Pos_ptr + offs, mask=real, other=0), pos_last)
        loc = tl.where(real, tl.load(Loc_ptr + offs, mask=real, other=0), loc_last)
        start = carry + tl.cumsum(n, axis=0) - n  # exclusive
        out = offs < m
        tl.store(OutLen_ptr + offs, n, mask=out)
        tl.store(OutPos_ptr + offs, pos, mask=out)
        tl.store(OutLoc_ptr + offs, loc, mask=out)
        tl.store(OutStart_ptr + offs, start, mask=out)
        carry += tl.sum(n, axis=0)


def metadata(seq_len: torch.Tensor, input_pos: torch.Tensor, cache_loc: torch.Tensor, *, graph: int = 0,
             out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """TensorRT-LLM's prepare_fused_mha_metadata on (max_batch,) buffers -> (seq_len, input_pos, cache_loc,
    seq_start), each (m,) int32: b = 1 + the last non-zero seq_len, m = graph or b, padding rows seq_len 0
    with the last real row's input_pos and cache_loc, seq_start the exclusive cumsum (refimpl/kvcache.py).

    seq_len, input_pos, cache_loc: contiguous (max_batch,) int32 tensors on one device; rows past b are
        stale and never read
    graph: the captured CUDA-graph batch size (>= b), or 0 (m = b)
    out: four contiguous (m,) int32 tensors to write, or None (allocated; with graph = 0 that reads b
        first, a device sync). b is read back after the step either way and checked against m.
    """
    dev = seq_len.device if isinstance(seq_len, torch.Tensor) else None
    maxb = seq_len.shape[0] if isinstance(seq_len, torch.Tensor) and seq_len.dim() == 1 else -1
    for name, a in (("seq_len", seq_len), ("input_pos", input_pos), ("cache_loc", cache_loc)):
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != (maxb,) or a.dtype != torch.int32 \
                or a.device != dev or (maxb > 1 and a.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous (max_batch,) int32 tensor on seq_len's device, like "
                             f"seq_len, got {getattr(a, 'dtype', type(a).__name__)} {tuple(getattr(a, 'shape', ()))}")
    if not isinstance(graph, int) or graph < 0:
        raise ValueError(f"graph={graph!r} must be an int >= 0 (a captured batch size, or 0 for none)")
    if out is None:
        if graph:
            m = graph
        else:
            nz = torch.nonzero(seq_len > 0)
            m = int(nz[-1]) + 1 if nz.numel() else 0
        out = tuple(torch.empty(m, dtype=torch.int32, device=dev) for _ in range(4))
    m = out[0].shape[0] if len(out) == 4 and isinstance(out[0], torch.Tensor) and out[0].dim() == 1 else -1
    if m < 0 or any(not isinstance(o, torch.Tensor) or tuple(o.shape) != (m,) or o.dtype != torch.int32
                    or o.device != dev or (m > 1 and o.stride(0) != 1) for o in out):
        raise ValueError(f"out must be four contiguous (m,) int32 tensors on {dev}")
    if graph and m != graph:
        raise ValueError(f"out has {m} rows, graph={graph} wants {graph}")
    b_out = torch.empty(1, dtype=torch.int32, device=dev)
    _kvcache_metadata_kernel[(1,)](seq_len, input_pos, cache_loc, *out, b_out, maxb, m,
                                   BLOCK=min(META_BLOCK, triton.next_power_of_2(max(maxb, m, 1))), num_warps=4)
    b = int(b_out)
    if m < b or (not graph and m != b):
        raise ValueError(f"the batch has {b} sequences: {'graph' if graph else 'out'} of {m} rows "
                         f"(expected {'>= ' if graph else ''}{b})")
    return out
