"""DeepSeek multi-head latent attention (MLA), decode over a paged latent cache, in Triton.

    s_ij  = scale * q_i . c_j                 q_i, c_j: d = d_v + d_pe = 512 + 64 (absorbed form)
    LSE_i = ln sum_j exp(s_ij)                natural log, -inf for a row with no visible key
    O_i   = sum_j exp(s_ij - LSE_i) c_j[:d_v] the values are the first d_v dims of the same rows

Conventions (OPS.md, mla; goldens in refimpl/mla.py): one latent kv head shared by all h_q query
heads (MQA), or mla_decode's h_kv heads (FlashMLA's; query head h on kv head h // (h_q / h_kv), a
program's rows all of one kv head); token t of request b is kv_cache[block_table[b, t // page], t % page, 0]; the s_q
queries are the last s_q positions, so with `causal` row i sees keys j <= L_b - s_q + i
(bottom-right); the scale is explicit; slots at or past L_b and table entries past a request's
last page are never read (FlashMLA's tests fill them with NaN); an empty row gives O = 0,
LSE = -inf (FlashMLA returns +inf there).

Decode reads every cached byte once per call, so one program streams a request's key range for
ALL of its query rows (h_q x s_q, cut into row blocks of <= 64 only because the 512-wide fp32
accumulator must fit in registers; the blocks of one request are adjacent program ids, so the
second reads the tiles from L2). Each key tile is loaded once, as a (BLOCK_N, 512) latent tile
that serves as K and as V plus a (BLOCK_N, 64) rope tile, from the page the block table names
(the table is read a chunk of entries at a time, outside the pipelined tile loop).
Both dots run on the tensor cores with fp32 accumulation; the softmax is FlashAttention-2's
online form in the log2 domain (scale * log2(e) folded into one multiply).
Two tile orientations (the constexpr SWAP_AB):
- rows x keys (SWAP_AB=False): S = Q K^T, O += P V; for >= 64 rows a program (Hopper wgmma
  needs 64-row tiles; 8 warps split the 512 output columns between two warpgroups).
- keys x rows (SWAP_AB=True): S^T = K Q^T, O^T += V^T P^T, for the 16-32 rows of h_q = 16/32:
  the 64 keys fill the MMA's M dimension (wgmma needs 64) and Q^T and the K tile are both read
  from shared memory; 16 rows x keys would run on mma.sync with Q's fragment (16 x 576) held
  in the registers of every warp that shares those rows (expected, not measured).
SHARED_KV=False loads V a second time through another pointer (an L2 hit) in case the compiler
cannot give the one tile a shared-memory layout that both dots accept.

Split-KV: a program owns (request, split, row block); split s covers [bounds[s], bounds[s+1]) of
its request's keys, either uniform (ceil(L_b / n) rounded up to whole tiles, so tiles stay on
page edges) or a caller's per-request boundaries (`splits`: `mla_splits` turns a scheduler's
ranges, FlashMLA's among them, into them; `mla_schedule` is a simple one). With one
split the program writes O and LSE; with more it writes fp32 partial O and LSE per split, merged
by kernels.triton.combine.lse_combine (through attention_decode's stage-2 wrapper).

References: DeepSeek-V2 (2024) for the absorbed form; deepseek-ai/FlashMLA (dense decode, its
tile scheduler and combine); Dao et al., "Flash-Decoding for long-context inference" (2023).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from .attention import _check_out
from .attention_decode import _combine, _sm_count
from .softmax import LN2

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SPLITS = 64  # auto splitting, and the largest partition `splits` may describe (one wave of programs)
MIN_SPLIT_KEYS = 256  # auto splitting keeps at least this many keys a split
SMEM_BYTES = 227 * 1024  # per-block shared memory of an H100/H200: bounds programs per SM


class MlaConfig(NamedTuple):
    block_m: int  # query rows (head x query) a program; rows beyond it go to more programs
    block_n: int  # keys a tile (<= page size keeps a tile on one page)
    num_warps: int
    num_stages: int
    swap_ab: bool  # keys x rows orientation (see the module docstring)
    shared_kv: bool  # one load serves K and V
    chunk: int = 4096  # keys whose table entries (dense) or indices (sparse) one load fetches


# By (row block class, element size). UNMEASURED guesses for an H100 (Triton 3.6):
# benchmarks/gpu_mla.py sweeps alternatives and reports the fastest; replace these from it.
# A (32, 576) bf16 tile is 36 KB: with num_stages=s the pipeliner keeps s - 1 tiles in flight
# (s buffers), and one program an SM (128 requests on 132 SMs) needs ~64 KB in flight to cover
# DRAM latency at full bandwidth; Q (and, for 64 rows, its 72 KB) shares the 227 KB.
MLA_CONFIGS: dict[tuple[int, int], MlaConfig] = {
    (16, 2): MlaConfig(16, 32, 4, 4, True, True),
    (32, 2): MlaConfig(32, 32, 4, 3, True, True),
    (64, 2): MlaConfig(64, 32, 8, 3, False, True),
    (16, 4): MlaConfig(16, 16, 4, 2, False, True),
    (32, 4): MlaConfig(32, 16, 4, 2, False, True),
    (64, 4): MlaConfig(64, 16, 8, 2, False, True),
}


@triton.jit
def _mla_attend(q_nope, q_pe, kn, kp, v, live, cols, diag, m_i, l_i, acc, qk_scale,
                CAUSAL: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax. kn: (BLOCK_N, D_V), kp: (BLOCK_N, D_PE), v: (BLOCK_N, D_V)
    (kn itself when shared); live: (BLOCK_N,) keys to keep; diag: (BLOCK_M,) last visible key a row.
    acc: (BLOCK_M, D_V), or (D_V, BLOCK_M) with SWAP_AB; fp32 accumulation in both dots."""
    if SWAP_AB:
        s = tl.dot(kn, tl.trans(q_nope), input_precision=DOT_PRECISION)  # BLOCK_N, BLOCK_M
        s = tl.dot(kp, tl.trans(q_pe), s, input_precision=DOT_PRECISION)
        keep = live[:, None]
        if CAUSAL:
            keep = keep & (cols[:, None] <= diag[None, :])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        p = tl.exp2(s - m_use[None, :])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = tl.dot(tl.trans(v), p.to(v.dtype), acc * alpha[None, :], input_precision=DOT_PRECISION)
    else:
        s = tl.dot(q_nope, tl.trans(kn), input_precision=DOT_PRECISION)  # BLOCK_M, BLOCK_N
        s = tl.dot(q_pe, tl.trans(kp), s, input_precision=DOT_PRECISION)
        keep = live[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= diag[:, None])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_store(O_ptr, Lse_ptr, acc, m_i, l_i, o_rows, lse_rows, mask_m, offs_dv, SWAP_AB: tl.constexpr):
    """O = acc / l (0 for a row with no key), LSE = (m + log2 l) ln 2 (-inf without a key)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    o = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(O_ptr + o_rows[:, None] + offs_dv[None, :], o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + lse_rows, lse, mask=mask_m)


@triton.jit
def _mla_decode_kernel(
    Q_ptr, KV_ptr, V_ptr, O_ptr, Lse_ptr, Seqlens_ptr, BT_ptr, Splits_ptr,
    s_q, h_q, h_kv, n_m, n_splits, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt_b, stride_bt_p, stride_sp_b, stride_sp_s,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_l_split, stride_lb, stride_lh, stride_ls,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, EXPLICIT_SPLITS: tl.constexpr, SWAP_AB: tl.constexpr,
    SHARED_KV: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Row blocks of one (request, split, kv head) are adjacent program ids: they run together, so
    # the second one's key tiles come from L2.
    pid = tl.program_id(0)
    pid_m = pid % n_m
    kvh = (pid // n_m) % h_kv
    split = (pid // n_m // h_kv) % n_splits
    b = (pid // n_m // h_kv) // n_splits
    L = tl.load(Seqlens_ptr + b)

    # The g = h_q / h_kv query heads of kv head kvh read its cache rows. Row m is query m // g of
    # head kvh g + m % g: a row block holds whole queries when g >= BLOCK_M.
    grp = h_q // h_kv
    n_rows = grp * s_q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    qi = offs_m // grp
    head = kvh * grp + offs_m % grp
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, D_V)
    offs_pe = tl.arange(0, D_PE)
    q_rows = b.to(tl.int64) * stride_qb + qi * stride_qs + head * stride_qh
    q_nope = tl.load(Q_ptr + q_rows[:, None] + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(Q_ptr + q_rows[:, None] + D_V + offs_pe[None, :], mask=mask_m[:, None], other=0.0)

    if EXPLICIT_SPLITS:
        sp = Splits_ptr + b.to(tl.int64) * stride_sp_b + split * stride_sp_s
        lo = tl.minimum(tl.maximum(tl.load(sp), 0), L)
        hi = tl.minimum(tl.maximum(tl.load(sp + stride_sp_s), lo), L)
    else:
        per_split = tl.cdiv(tl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N  # whole tiles
        lo = tl.minimum(split * per_split, L)
        hi = tl.minimum(lo + per_split, L)
    diag = L - s_q + qi
    if CAUSAL:  # no tile past the last key the block's last query sees
        hi = tl.minimum(hi, L - s_q + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // grp + 1)

    bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP_AB:
        acc = tl.zeros([D_V, BLOCK_M], dtype=tl.float32)  # fp32 accumulator of O^T
    else:
        acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)  # fp32 accumulator of O
    # The block table is read CHUNK_PAGES entries at a time, outside the tile loop: a table load
    # inside it would make the tile's address depend on a load of the same iteration, and
    # Triton's pipeliner then splits num_stages between the two levels (AssignLatencies.cpp:
    # num_stages=3 prefetches tiles one step ahead instead of two, 2 leaves the table load
    # synchronous). Tiles start on BLOCK_N edges, so with PAGE % BLOCK_N == 0 a tile lies on one
    # page and takes one table entry from registers.
    lo_t = tl.where(lo < hi, lo // BLOCK_N * BLOCK_N, hi)  # an empty range runs no tile
    offs_p = tl.arange(0, CHUNK_PAGES)
    for c0 in range(lo_t // PAGE * PAGE, hi, CHUNK_PAGES * PAGE):
        p0 = c0 // PAGE
        pages = tl.load(bt_row + (p0 + offs_p) * stride_bt_p, mask=(p0 + offs_p) * PAGE < hi, other=0)
        c1 = tl.minimum(c0 + CHUNK_PAGES * PAGE, hi)
        for start_n in range(tl.maximum(c0, lo_t), c1, BLOCK_N):
            cols = start_n + offs_n
            live = (cols >= lo) & (cols < c1)  # never at or past L_b: poisoned slots and pages are not read
            if PAGE % BLOCK_N == 0:
                page = tl.sum(tl.where(offs_p == start_n // PAGE - p0, pages, 0))
            else:
                page = tl.sum(tl.where((cols // PAGE - p0)[:, None] == offs_p[None, :], pages[None, :], 0), axis=1)
            rows = page.to(tl.int64) * stride_kb + (cols % PAGE) * stride_ks + kvh * stride_kh
            kn = tl.load(KV_ptr + rows[:, None] + offs_dv[None, :], mask=live[:, None], other=0.0)
            kp = tl.load(KV_ptr + rows[:, None] + D_V + offs_pe[None, :], mask=live[:, None], other=0.0)
            if SHARED_KV:
                v = kn
            else:
                v = tl.load(V_ptr + rows[:, None] + offs_dv[None, :], mask=live[:, None], other=0.0)
            m_i, l_i, acc = _mla_attend(q_nope, q_pe, kn, kp, v, live, cols, diag, m_i, l_i, acc, qk_scale,
                                        CAUSAL, SWAP_AB, DOT_PRECISION)

    o_rows = split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob + qi * stride_os + head * stride_oh
    lse_rows = split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh + qi * stride_ls
    _mla_store(O_ptr, Lse_ptr, acc, m_i, l_i, o_rows, lse_rows, mask_m, offs_dv, SWAP_AB)


def _check_q_cache(q, kv_cache, d_v, scale, what: str, heads: bool = False
                   ) -> tuple[int, int, int, int, int]:
    """Checks shared with mla_sparse (heads: kv_cache may hold h_kv > 1 kv heads dividing h_q);
    returns (b, s_q, h_q, d, d_pe)."""
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be a 4-D torch.Tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{what}: {name} dtype {t.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{what}: {name} must have last-dim stride 1, got strides {tuple(t.stride())}")
    if kv_cache.dtype != q.dtype or kv_cache.device != q.device:
        raise ValueError(f"{what}: kv_cache is {kv_cache.dtype} on {kv_cache.device}, q {q.dtype} on {q.device}")
    b, s_q, h_q, d = q.shape
    if kv_cache.shape[2] < 1 or h_q % kv_cache.shape[2] or (kv_cache.shape[2] != 1 and not heads) \
            or kv_cache.shape[3] != d or kv_cache.shape[1] < 1:
        shown = f"h_kv dividing h_q={h_q}" if heads else "1"
        raise ValueError(f"{what}: kv_cache {tuple(kv_cache.shape)} must be (num_blocks, page >= 1, {shown}, d={d})")
    d_pe = d - int(d_v)
    for name, n in (("d_v", int(d_v)), ("d - d_v", d_pe)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{what}: {name} = {n} must be a power of two >= 16 (d={d}, d_v={d_v})")
    if s_q < 1:
        raise ValueError(f"{what}: s_q={s_q} must be >= 1")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scale={scale!r} must be a finite number > 0")
    return b, s_q, h_q, d, d_pe


def _check_index(t, name: str, shape: tuple, device, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or t.dtype != torch.int32 or t.device != device \
            or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        shown = tuple("n" if s is None else s for s in shape)
        raise ValueError(f"{what}: {name} must be a {shown} int32 tensor on {device}, "
                         f"got {getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}")


def _pick_config(q: torch.Tensor, rows: int, config) -> MlaConfig:
    if config is not None:
        return MlaConfig(*config)
    return MLA_CONFIGS[(min(64, max(16, triton.next_power_of_2(rows))), min(q.element_size(), 4))]


def _auto_splits(q: torch.Tensor, programs: int, cfg: MlaConfig, d: int, max_keys: int) -> int:
    """1 on CPU; on a GPU, enough splits for about one wave of programs (as many as fit on every
    SM at once, from the config's shared memory), each >= MIN_SPLIT_KEYS keys. max_keys is the
    table's capacity: seqlens stays on the device, reading it would synchronise."""
    if not q.is_cuda or programs <= 0:
        return 1
    smem = (cfg.num_stages * cfg.block_n + cfg.block_m) * d * q.element_size()
    slots = _sm_count(q.device) * max(1, SMEM_BYTES // max(smem, 1))
    return max(1, min(slots // programs, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def _outputs(q, d_v, out, out_lse, n_splits):
    """out, out_lse checked or allocated, and the stage-1 destinations: the outputs themselves for
    one split, else fp32 partials (n_splits, b, s_q, h_q, d_v) and their LSE stored (n_splits, b,
    s_q, h_q), the row order lse_combine reads, viewed as (n_splits, b, h_q, s_q)."""
    b, s_q, h_q, _ = q.shape
    if out is None:
        out = torch.empty((b, s_q, h_q, d_v), dtype=q.dtype, device=q.device)
    _check_out(out, (b, s_q, h_q, d_v), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (b, h_q, s_q), torch.float32, q.device, "out_lse")
    if n_splits == 1:
        return out, out_lse, out.unsqueeze(0), out_lse.unsqueeze(0)
    o_parts = torch.empty((n_splits, b, s_q, h_q, d_v), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((n_splits, b, s_q, h_q), dtype=torch.float32, device=q.device).permute(0, 1, 3, 2)
    return out, out_lse, o_parts, lse_parts


def mla_splits(ranges: Sequence[Sequence[tuple[int, int]]], device: torch.device | str | None = None) -> torch.Tensor:
    """`mla_decode(splits=...)` from a scheduler's per-request token ranges, e.g. FlashMLA's
    get_mla_metadata turned into ranges (refimpl.mla.partitions(*refimpl.mla.schedule(...), seqlens)).

    ranges: per request, its splits' [start, end) in split order, each starting where the last ended
    returns: (b, n + 1) int32 boundaries, n the most splits of any request; fewer are padded with
             empty splits (the last boundary repeated)
    """
    n = max([len(r) for r in ranges] + [1])
    if n > MAX_SPLITS:
        raise ValueError(f"mla_splits: {n} splits for one request exceed MAX_SPLITS={MAX_SPLITS}")
    bounds = []
    for i, r in enumerate(ranges):
        row = [int(r[0][0]) if r else 0]
        for start, end in r:
            if int(start) != row[-1] or int(end) < int(start):
                raise ValueError(f"mla_splits: request {i}'s ranges {list(r)} are not consecutive")
            row.append(int(end))
        bounds.append(row + [row[-1]] * (n + 1 - len(row)))
    return torch.tensor(bounds, dtype=torch.int32, device=device).reshape(len(bounds), n + 1)


def mla_schedule(seqlens: Sequence[int] | torch.Tensor, num_parts: int, page: int = 64,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """A host-side scheduler for `mla_decode(splits=...)`, FlashMLA's idea in its simplest form
    (no fixed cost per piece, no piece spanning requests): every request's pages are cut into
    pieces of at most ceil(total_pages / num_parts) pages, so about num_parts programs of equal
    work cover the batch whatever the spread of lengths; no request gets more than MAX_SPLITS pieces.
    It is not FlashMLA's get_mla_metadata (fixed cost per piece, pieces spanning requests, 8-int rows):
    that one is kernels/triton/mla_schedule.py, gated as the op mla.schedule.

    seqlens: (b,) host lengths (a list, or a CPU tensor: the scheduler must not synchronise on a GPU one)
    returns: (b, n + 1) int32 on `device`, page-aligned boundaries (`mla_splits`)
    """
    lens = [int(x) for x in (seqlens.tolist() if isinstance(seqlens, torch.Tensor) else seqlens)]
    if num_parts < 1 or page < 1 or any(x < 0 for x in lens):
        raise ValueError(f"mla_schedule: num_parts={num_parts}, page={page} must be >= 1 and seqlens >= 0")
    pages = [triton.cdiv(x, page) for x in lens]
    # pages a piece: an equal share of the batch, but never so few that one request needs more than
    # MAX_SPLITS pieces (num_parts > MAX_SPLITS with one long request: seqlens [4097], 65 parts)
    budget = max(1, triton.cdiv(sum(pages), num_parts), triton.cdiv(max(pages, default=0), MAX_SPLITS)) * page
    return mla_splits([[(s, min(s + budget, x)) for s in range(0, max(x, 1), budget)] for x in lens], device)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
               scale: float, d_v: int = 512, causal: bool = True, num_splits: int | None = None,
               splits: torch.Tensor | None = None, out: torch.Tensor | None = None,
               out_lse: torch.Tensor | None = None, *, config: Sequence | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (absorbed form, one latent kv head, or FlashMLA's h_kv) over a paged cache, split-KV.

    q: (b, s_q, h_q, d), d = d_v + d_pe (576 = 512 + 64); bf16/fp16 (fp32 runs, slowly); last-dim stride 1
    kv_cache: (num_blocks, page, h_kv, d) q's dtype; V = kv_cache[..., :d_v] (read with K, not again);
        h_q % h_kv == 0, query head h reads kv head h // (h_q / h_kv) (DeepSeek: h_kv = 1)
    block_table: (b, max_blocks) int32, any strides: token t of request i at block_table[i, t // page]
    seqlens: (b,) int32 >= 0 on q's device; slots at or past it are never read
    scale: softmax scale (FlashMLA's default 1/sqrt(d); DeepSeek-V3 uses 1/sqrt(192) * mscale^2)
    causal: for s_q > 1, query i sees keys j <= seqlens - s_q + i (bottom-right)
    num_splits: splits per request (None: enough to fill the GPU, 1 on CPU)
    splits: (b, n + 1) int32 token boundaries per request (`mla_splits` of a scheduler's ranges,
            `mla_schedule`); split s of request i covers [splits[i, s], splits[i, s + 1]) clipped
            to [0, seqlens[i]); page edges keep every tile on one page, but any non-decreasing
            boundaries are correct
    out: (b, s_q, h_q, d_v) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32
    config: MlaConfig fields (block_m, block_n, num_warps, num_stages, swap_ab, shared_kv[, chunk]),
            for tuning
    returns: (out, out_lse), LSE natural log; a row with no visible key: O = 0, LSE = -inf
    """
    what = "mla_decode"
    b, s_q, h_q, d, d_pe = _check_q_cache(q, kv_cache, d_v, scale, what, heads=True)
    _check_index(block_table, "block_table", (b, None), q.device, what)
    _check_index(seqlens, "seqlens", (b,), q.device, what)
    if splits is not None:
        _check_index(splits, "splits", (b, None), q.device, what)
        if not 2 <= splits.shape[1] <= MAX_SPLITS + 1:
            raise ValueError(f"{what}: splits has {splits.shape[1]} boundaries, expected 2..{MAX_SPLITS + 1}")
        if num_splits is not None and num_splits != splits.shape[1] - 1:
            raise ValueError(f"{what}: num_splits={num_splits} but splits describes {splits.shape[1] - 1}")
    elif num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 65535):
        raise ValueError(f"{what}: num_splits={num_splits!r} must be an int in [1, 65535]")
    h_kv = kv_cache.shape[2]
    rows = s_q * (h_q // h_kv)  # a kv head's query rows
    cfg = _pick_config(q, rows, config)
    n_m = triton.cdiv(rows, cfg.block_m)
    page = kv_cache.shape[1]
    if splits is not None:
        n_splits = splits.shape[1] - 1
    else:
        n_splits = num_splits or _auto_splits(q, b * h_kv * n_m, cfg, d, block_table.shape[1] * page)
    if b * h_kv * n_m * n_splits >= 2**31:
        raise ValueError(f"{what}: {b} x {h_kv} x {n_m} x {n_splits} programs exceed CUDA's grid")
    out, out_lse, dst_o, dst_l = _outputs(q, d_v, out, out_lse, n_splits)
    if b == 0 or h_q == 0:
        return out, out_lse
    _mla_decode_kernel[(b * h_kv * n_m * n_splits,)](
        q, kv_cache, kv_cache, dst_o, dst_l, seqlens, block_table, splits if splits is not None else seqlens,
        s_q, h_q, h_kv, n_m, n_splits, float(scale) * 1.4426950408889634,
        *q.stride()[:3], *kv_cache.stride()[:3], *block_table.stride(),
        *(splits.stride() if splits is not None else (0, 0)), *dst_o.stride()[:4], *dst_l.stride(),
        CAUSAL=bool(causal) and s_q > 1, PAGE=page, EXPLICIT_SPLITS=splits is not None, SWAP_AB=cfg.swap_ab,
        SHARED_KV=cfg.shared_kv, D_V=int(d_v), D_PE=d_pe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CHUNK_PAGES=triton.next_power_of_2(max(1, cfg.chunk // page)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if n_splits > 1:
        _combine(dst_o, dst_l, out, out_lse, None)
    return out, out_lse
