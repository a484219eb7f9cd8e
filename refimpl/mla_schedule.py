"""Golden of FlashMLA's split-KV tile scheduler (the old API's `get_mla_metadata`), its checker, and
the per-request token ranges it assigns.

    cost_i  = ceil(L_i / B) + F                   blocks of request i plus a fixed overhead, F = 5
    payload = max(ceil(sum_i cost_i / P) + F, 2F) per SM part (P parts); 2F floor: payload_floor
    Parts are filled greedily in request order. A part takes a whole request (the rest of it) when
    its remaining payload covers rest + F; otherwise, if more than F is left, it takes the next
    (remaining - F) blocks of that request (a split) and is full; else it leaves the request to
    the next part.

Layout (FlashMLA `TileSchedulerMetaDataSize = 8`), one row per SM part:
    meta[p] = [begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx, 0, 0, 0]
    Part p processes requests begin_idx..end_idx (inclusive): the first from token begin_seqlen,
    the last up to token end_seqlen (the request's length when the part finishes it, else a
    multiple of B), the ones between whole. The first request's pieces are numbered from
    begin_n_split_idx, the others from 0. A part with begin_idx >= b is idle (FlashMLA's kernel
    returns at once); its row reads [b, 0, b - 1, L_{b-1}, 0]. Columns 5..7 are never read
    (FlashMLA leaves them uninitialised; 0 here).
    num_splits (b + 1,): cumulative split counts, num_splits[0] = 0; request i's partial results
    go to accumulator rows num_splits[i] + split_idx; a request with one split is written directly.

Sources: deepseek-ai/FlashMLA `csrc/flash_fwd_mla_kernel.h` (Feb-Mar 2025, stored @33e110b:
get_mla_metadata_kernel, payload without the 2F floor); `csrc/kernels/get_mla_metadata.cu` @c2067be
(the Apr 2025 rewrite, read in the xiyanjoy/FlashMLA mirror: the `max(..., 2 * fixed_overhead_num_blocks)`
floor); `csrc/kernels/splitkv_mla.cu` (how the kernel reads a row: start block = begin_seqlen / 64,
end block = ceil(end_seqlen / 64), is_no_split, split_idx = num_splits[i] + n_split_idx;
accumulators for b + P splits); `csrc/flash_api.cpp` (block_size_n = 64, fixed_overhead = 5,
num_sm_parts = sm_count / h_kv / ceil(s_q h_q / h_kv / 64), TileSchedulerMetaDataSize = 8).
Not modelled: the Sep 2025 form (`csrc/smxx/get_mla_metadata.cu`, read in vllm-project/FlashMLA),
which stores block indices instead of tokens, marks idle parts with -1, counts an empty request
as one block and has no 2F floor, nor HEAD's `DecodingSchedMeta` struct.
The reference loops over SM parts (a fixed small count); within a part whole requests are taken
with one search over prefix sums, so there is no loop over requests.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

I32 = NDArray[np.int32]
I64 = NDArray[np.int64]

META_COLS = 8
FIXED_OVERHEAD_NUM_BLOCKS = 5
BLOCK_SIZE_M = 64  # query rows per CTA: (s_q h_q / h_kv) rows are tiled by 64
INT32_MAX = 2**31 - 1


def _cdiv(a, b):
    return -(-a // b)


def sm_parts(num_sms: int, s_q: int, h_q: int, h_kv: int = 1) -> int:
    """FlashMLA's num_sm_parts: num_sms // h_kv // ceil(s_q h_q / h_kv / 64) (old API, no floor at 1)."""
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    return num_sms // h_kv // _cdiv(s_q * h_q // h_kv, BLOCK_SIZE_M)


def _lengths(seqlens: NDArray) -> I64:
    L = np.asarray(seqlens, dtype=np.int64).reshape(-1)
    if L.size == 0:
        raise ValueError("seqlens is empty: FlashMLA requires batch size > 0")
    if (L < 0).any():
        raise ValueError(f"seqlens must be >= 0, got min {L.min()}")
    return L


def schedule(seqlens: NDArray, s_q: int, h_q: int, num_sm_parts: int, block: int = 64, h_kv: int = 1, *,
             fixed_overhead: int = FIXED_OVERHEAD_NUM_BLOCKS, payload_floor: bool = True) -> tuple[I32, I32]:
    """FlashMLA's get_mla_metadata: (tile_scheduler_metadata (P, 8) int32, num_splits (b + 1,) int32).

    seqlens: (b,) int >= 0, cached tokens per request (cache_seqlens)
    s_q, h_q, h_kv: the decode's query length and heads. The scheduler does not read them: they fix
        num_sm_parts (`sm_parts`) and the number of CTAs (P h_kv ceil(s_q h_q / h_kv / 64)); validated only
    num_sm_parts: P >= 1, the number of SM parts (rows of the metadata)
    block: tokens per KV block (FlashMLA's page / block_size_n, 64)
    fixed_overhead: cost of one (request, part) piece in blocks (5)
    payload_floor: the >= 2F floor of c2067be (Apr 2025, default); False gives 414a2f3 (Feb 2025)
    Raises ValueError if sum_i cost_i passes int32 (FlashMLA's kernel would overflow silently).
    """
    L = _lengths(seqlens)
    if h_kv < 1 or h_q % h_kv or s_q < 1:
        raise ValueError(f"need s_q >= 1 and h_q % h_kv == 0, got s_q={s_q}, h_q={h_q}, h_kv={h_kv}")
    if num_sm_parts < 1 or block < 1 or fixed_overhead < 0:
        raise ValueError(f"need num_sm_parts >= 1, block >= 1, fixed_overhead >= 0; got "
                         f"{num_sm_parts}, {block}, {fixed_overhead}")
    b, f = L.size, int(fixed_overhead)
    n = _cdiv(L, block)  # blocks per request
    G = np.concatenate([[0], np.cumsum(n + f)])  # G[i] = cost of requests 0..i-1
    if G[-1] > INT32_MAX:
        raise ValueError(f"total cost {G[-1]} blocks overflows FlashMLA's int32 sum")
    payload = int(_cdiv(int(G[-1]), num_sm_parts)) + f
    if payload_floor:
        payload = max(payload, 2 * f)
    meta = np.zeros((num_sm_parts, META_COLS), dtype=np.int64)
    splits = np.zeros(b, dtype=np.int64)
    r, k, ns = 0, 0, 0  # first unfinished request, its first unassigned block, its splits so far
    for p in range(num_sm_parts):
        meta[p, [0, 1, 4]] = r, k * block, ns
        remain = payload
        if r < b:
            rest = int(n[r]) - k + f
            if remain >= rest:  # finish request r, then every whole request that fits
                splits[r], remain, r, k, ns = ns + 1, remain - rest, r + 1, 0, 0
                e = min(int(np.searchsorted(G, G[r] + remain, side="right")) - 1, b)
                splits[r:e] = 1
                remain -= int(G[e] - G[r])
                r = e
                if r < b and remain - f > 0:  # a split of the next request fills the part
                    k, ns = remain - f, 1
            elif remain - f > 0:
                k, ns = k + remain - f, ns + 1
        meta[p, 2] = r if k > 0 else r - 1
        meta[p, 3] = k * block if k > 0 else L[r - 1]
    if (r, k, ns) != (b, 0, 0):  # FlashMLA's FLASH_DEVICE_ASSERT; unreachable for payload > F
        raise RuntimeError(f"scheduler left request {r} block {k} unassigned")
    num_splits = np.concatenate([[0], np.cumsum(splits)])
    return meta.astype(np.int32), num_splits.astype(np.int32)


def _pieces(meta: NDArray, seqlens: I64) -> dict[str, I64]:
    """One entry per (part, request) piece of the active parts, in part order.

    returns arrays part, req, start (first token as stored), stop (end token as stored: end_seqlen
    for the part's last request, else the request's length), split (n_split_idx)."""
    m = np.asarray(meta, dtype=np.int64)
    b = seqlens.size
    begin, end = m[:, 0], m[:, 2]
    active = (begin >= 0) & (begin < b)
    cnt = np.where(active, np.maximum(end - begin + 1, 0), 0)
    part = np.repeat(np.arange(m.shape[0]), cnt)
    off = np.arange(part.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)  # position inside the part
    req = begin[part] + off
    first, last = off == 0, req == end[part]
    req_c = np.minimum(req, b - 1)  # a malformed end_idx >= b is reported by the caller
    return {"part": part, "req": req, "first": first,
            "start": np.where(first, m[part, 1], 0),
            "stop": np.where(last, m[part, 3], seqlens[req_c]),
            "split": np.where(first, m[part, 4], 0)}


def partitions(meta: NDArray, num_splits: NDArray, seqlens: NDArray, block: int = 64) -> list[list[tuple[int, int]]]:
    """Per request, the token ranges [start, end) of its splits in split-index order.

    meta: (P, 8) tile_scheduler_metadata; num_splits: (b + 1,); seqlens: (b,)
    A range is what FlashMLA's kernel attends: blocks begin_seqlen // B .. ceil(end_seqlen / B),
    cut at the request's length. An empty request has one range (0, 0) (its output is 0, LSE -inf).
    Raises ValueError on metadata naming a request >= b or disagreeing with num_splits in count.
    """
    L = _lengths(seqlens)
    pc = _pieces(meta, L)
    if (pc["req"] >= L.size).any():
        raise ValueError(f"metadata names request {int(pc['req'].max())} >= b = {L.size}")
    req = pc["req"]
    start = pc["start"] // block * block
    stop = np.minimum(_cdiv(pc["stop"], block) * block, L[req])
    order = np.lexsort((pc["split"], req))
    counts = np.bincount(req, minlength=L.size)
    want = np.diff(np.asarray(num_splits, dtype=np.int64))
    if want.shape != counts.shape or (want != counts).any():
        raise ValueError(f"pieces per request {counts.tolist()} != num_splits diff {want.tolist()}")
    pairs = list(zip(start[order].tolist(), stop[order].tolist()))
    cuts = np.cumsum(counts)[:-1].tolist()
    return [pairs[i:j] for i, j in zip([0] + cuts, cuts + [len(pairs)])]


def check_schedule(meta: NDArray, num_splits: NDArray, seqlens: NDArray, block: int = 64,
                   max_splits: int | None = None) -> list[str]:
    """Violations of a split schedule (empty list: valid), each 'what: where'.

    meta: (P, 8) int; num_splits: (b + 1,) int; seqlens: (b,)
    max_splits: bound on splits per request (default P: a part holds at most one piece of a request)
    Checks: shapes; num_splits starts at 0 and gives every request >= 1 split; active parts name
    requests in range, begin <= end; begin_seqlen and end_seqlen on block edges (end_seqlen may
    equal the request's length); every block of every request assigned exactly once; a request's
    pieces carry split indices 0..n-1, each once, n = num_splits[i+1] - num_splits[i]; n <= max_splits;
    num_splits[b] <= b + P (FlashMLA's accumulators hold b + P splits).
    """
    L = _lengths(seqlens)
    m, ns = np.asarray(meta, dtype=np.int64), np.asarray(num_splits, dtype=np.int64)
    b = L.size
    if m.ndim != 2 or m.shape[1] < 5 or m.shape[0] < 1:
        return [f"shape: tile_scheduler_metadata {m.shape}, want (num_sm_parts >= 1, {META_COLS})"]
    if ns.shape != (b + 1,):
        return [f"shape: num_splits {ns.shape}, want ({b + 1},)"]
    P = m.shape[0]
    max_splits = P if max_splits is None else max_splits
    bad: list[str] = []

    def note(what: str, idx: NDArray, where: str) -> None:
        idx = np.flatnonzero(idx)
        if idx.size:
            more = f" (and {idx.size - 5} more)" if idx.size > 5 else ""
            bad.append(f"{what}: {where} {idx[:5].tolist()}{more}")

    n_req = np.diff(ns)
    if ns[0] != 0:
        bad.append(f"num_splits[0] = {ns[0]}, want 0")
    note("request without a split", n_req < 1, "requests")
    note(f"more than max_splits={max_splits} splits", n_req > max_splits, "requests")
    if ns[-1] > b + P:
        bad.append(f"num_splits[b] = {ns[-1]} > b + num_sm_parts = {b + P}: accumulators overflow")
    begin, end = m[:, 0], m[:, 2]
    active = (begin >= 0) & (begin < b)
    broken = active & ((end < begin) | (end >= b))
    note("end_idx out of range or before begin_idx", broken, "parts")
    if broken.any():
        return bad  # the pieces below would name requests that do not exist
    endlen = L[np.clip(end, 0, b - 1)]
    note("begin_seqlen off a block edge", active & (m[:, 1] % block != 0), "parts")
    note("end_seqlen off a block edge", active & (m[:, 3] % block != 0) & (m[:, 3] != endlen), "parts")
    pc = _pieces(m, L)
    req = pc["req"]
    sb, eb = pc["start"] // block, _cdiv(pc["stop"], block)
    nb = _cdiv(L, block)
    note("piece past its request's end", eb > nb[req], "pieces")
    note("piece ending before it starts", eb < sb, "pieces")
    boff = np.concatenate([[0], np.cumsum(nb)])  # global block index of each request's block 0
    live = eb > sb
    gs = boff[req[live]] + sb[live]
    ge = boff[req[live]] + np.minimum(eb[live], nb[req[live]])
    order = np.lexsort((ge, gs))
    gs, ge = gs[order], ge[order]
    reach = np.concatenate([[0], np.maximum.accumulate(ge)])  # blocks covered before each piece
    gap_at = np.concatenate([reach[:-1][gs > reach[:-1]], [reach[-1]] if reach[-1] < boff[-1] else []])
    over_at = gs[gs < reach[:-1]]

    def blocks(g: NDArray) -> str:
        r = np.searchsorted(boff, g, side="right") - 1
        more = f" (and {g.size - 5} more)" if g.size > 5 else ""
        return f"(request, block) {[(int(i), int(x - boff[i])) for i, x in zip(r[:5], g[:5])]}{more}"

    if gap_at.size:
        bad.append(f"block assigned 0 times: first of each gap at {blocks(gap_at.astype(np.int64))}")
    if over_at.size:
        bad.append(f"block assigned more than once: first of each overlap at {blocks(over_at)}")
    counts = np.bincount(req, minlength=b)
    note("pieces per request != num_splits", counts != n_req, "requests")
    order = np.lexsort((pc["split"], req))
    pos = np.arange(req.size) - np.repeat(np.cumsum(counts) - counts, counts)
    note("split indices not 0..n-1 once each", np.bincount(req[order][pc["split"][order] != pos],
                                                              minlength=b) > 0, "requests")
    return bad
