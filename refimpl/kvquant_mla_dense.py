"""Golden FlashMLA dense paged MLA decode over its FP8 KV cache rows of 656 bytes, and the rows' write path
(issue 34, `kvquant.mla_decode`, `kvquant.mla_pack`).

The row format is refimpl/kvquant_mla.py's (FlashMLA README "FP8 KV cache", tests/quant.py, layout V32_FP8Sparse):
bytes [0, 512) 512 float8_e4m3fn codes of the latent part, [512, 528) 4 float32 scales (one per 128 channels),
[528, 656) 64 bfloat16 RoPE values; `pack`, `unpack` and `row_scales` are imported from there.

mla_decode (FlashMLA `flash_mla_with_kvcache(q, kv_cache, block_table, cache_seqlens, 512, ...,
is_fp8_kvcache=True)` with indices=None, the dense decode):
    q (b, s_q, h_q, 576); kv_cache (num_blocks, page, h_kv, 656) uint8 (or (num_blocks, page, 656): h_kv = 1);
    block_table (b, max_blocks) int: token t of request i is row kv_cache[block_table[i, t // page], t % page];
    seqlens (b,) int >= 0 (cached tokens, the s_q new ones included); causal: bottom-right for s_q > 1, row r of
    request i sees tokens t <= seqlens[i] - s_q + r (refimpl.mla.decode); scale explicit; d_v = 512.
    The golden unpacks exactly (float64 code x float64 scale, the bf16 RoPE values) the rows of the tokens a
    request holds (t < seqlens[i]: no other row and no table entry past a request's last page is read, those may
    hold NaN bytes and poison block ids) and runs refimpl.mla.decode's float64 math on them: O (b, s_q, h_q, 512),
    LSE (b, h_q, s_q) natural log; a row with no visible token O = 0, LSE = -inf; `absolute` passes through to
    refimpl.mla.decode's error model (magnitudes, or COMPUTE's compute-precision terms).
    The kernels are judged on the same codes: the cache's quantization error is not in the comparison, only the
    kernels' arithmetic (as kvquant.mla_sparse, refimpl/kvquant_mla.py).

mla_pack (the write path: vLLM's concat_and_cache_mla with kv_cache_dtype "fp8_ds_mla", FlashMLA's
tests/quant.py quantize_k_cache): new latent rows kv_c (n, 512) and RoPE rows k_pe (n, 64), bfloat16 (any float:
widened as stored) written at slot_mapping (n,) int (flat slot block * page + offset; -1: padding, nothing
written) into a copy of the cache, returned whole; every byte of every other row keeps its value. Each written
row is refimpl.kvquant_mla.pack([kv_c ; k_pe]): per 128-group scale = the least power of two >=
max(float32(amax) / 448, float32(1e-4)) (an all-zero group: 2^-13 and codes 0; a group whose amax is exactly
448 2^k: scale 2^k and its amax element the code +-448), codes = e4m3 round-to-nearest-even of float32(x) /
scale (subnormal codes m 2^-9 included, never past +-448), the RoPE values' bf16 bytes copied.
A slot outside [0, num_blocks * page) (and not -1), or a slot named twice, is refused (ValueError).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.kvquant_mla import (  # noqa: F401  (re-exported for the spec and the tests)
    D, D_NOPE, D_ROPE, ROW_BYTES, _check_rows, pack, row_scales, unpack,
)
from kernel_parity.refimpl.mla import COMPUTE, decode  # noqa: F401  (COMPUTE: the error model's switch)

F64 = NDArray[np.float64]
CHUNK = 1 << 25  # unpacked float64 values a request chunk of `mla_decode` holds at once (256 MiB)

__all__ = ["mla_decode", "mla_pack", "pack", "unpack", "row_scales"]


def _cache4(kv_cache: NDArray) -> NDArray[np.uint8]:
    cache = _check_rows(kv_cache)
    if cache.ndim == 3:
        cache = cache[:, :, None]
    if cache.ndim != 4 or cache.shape[1] < 1 or cache.shape[2] < 1:
        raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, {ROW_BYTES}) uint8, got shape {cache.shape}")
    return cache


def mla_decode(q: NDArray, kv_cache: NDArray, block_table: NDArray, seqlens: NDArray, scale: float,
               d_v: int = 512, causal: bool = True, *, absolute: bool | str = False) -> tuple[F64, F64]:
    """FlashMLA's dense decode over the 656-byte FP8 rows (module docstring).

    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q) natural log; a row with no visible token (0, -inf)."""
    cache = _cache4(kv_cache)
    n_blocks, page, h_kv, _ = cache.shape
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 4 or q.shape[-1] != D:
        raise ValueError(f"q must be (b, s_q, h_q, {D}), got shape {q.shape}")
    b, s_q, h_q, _ = q.shape
    if h_q % h_kv:
        raise ValueError(f"h_q = {h_q} query heads must be a multiple of the cache's h_kv = {h_kv} kv heads")
    if d_v != D_NOPE:
        raise ValueError(f"d_v must be {D_NOPE} (the rows' latent part), got {d_v!r}")
    L = np.asarray(seqlens)
    if L.dtype.kind not in "iu" or L.size != b:
        raise ValueError(f"seqlens must be ({b},) integers, got {L.dtype} {L.shape}")
    L = L.astype(np.int64).reshape(b)
    if (L < 0).any():
        raise ValueError(f"seqlens must be >= 0, got {int(L.min())}")
    bt = np.asarray(block_table)
    if bt.dtype.kind not in "iu" or bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"block_table must be ({b}, max_blocks) integers, got {bt.dtype} {bt.shape}")
    need = -(-int(L.max(initial=0)) // page)
    if need > bt.shape[1]:
        raise ValueError(f"block_table has {bt.shape[1]} blocks per request, seqlens need {need}")
    o, lse = np.empty((b, s_q, h_q, d_v)), np.empty((b, h_q, s_q))
    step = max(1, CHUNK // (max(int(L.max(initial=0)), 1) * h_kv * D))
    for c0 in range(0, b, step):  # request chunks: the unpacked rows' memory is bounded (refimpl.mla.decode
        # spreads a chunk's requests over threads)
        c = slice(c0, min(b, c0 + step))
        Lc = L[c]
        s_k = max(int(Lc.max(initial=0)), 1)
        t = np.arange(s_k)
        live = t[None, :] < Lc[:, None]
        blk = bt[c][:, np.minimum(t // page, bt.shape[1] - 1)].astype(np.int64)
        if ((blk[live] < 0) | (blk[live] >= n_blocks)).any():
            raise ValueError(f"block_table names a block outside the cache's {n_blocks} blocks")
        blk = np.where(live, blk, 0)
        rows = np.zeros((Lc.size, s_k, h_kv, D))
        off = np.broadcast_to(t % page, blk.shape)
        rows[live] = unpack(cache[blk[live], off[live]])  # only the live tokens' rows
        # a compact float64 cache of pages of one token: request r's token t at block r s_k + t
        compact = rows.reshape(Lc.size * s_k, 1, h_kv, D)
        table = np.arange(Lc.size * s_k, dtype=np.int64).reshape(Lc.size, s_k)
        o[c], lse[c] = decode(q[c], compact, table, Lc, scale, d_v=d_v, causal=causal, absolute=absolute)
    return o, lse


def mla_pack(kv_cache: NDArray, kv_c: NDArray, k_pe: NDArray, slot_mapping: NDArray) -> NDArray[np.uint8]:
    """The cache after writing rows pack([kv_c ; k_pe]) at slot_mapping (module docstring): a new array."""
    cache = _cache4(kv_cache)
    n_blocks, page, h_kv, _ = cache.shape
    if h_kv != 1:
        raise ValueError(f"mla_pack writes one latent head: kv_cache must be (num_blocks, page, 1, {ROW_BYTES}), "
                         f"got {cache.shape}")
    kv_c, k_pe = np.asarray(kv_c), np.asarray(k_pe)
    if kv_c.ndim != 2 or kv_c.shape[1] != D_NOPE or k_pe.shape != (kv_c.shape[0], D_ROPE):
        raise ValueError(f"kv_c must be (n, {D_NOPE}) and k_pe (n, {D_ROPE}), got {kv_c.shape} and {k_pe.shape}")
    n = kv_c.shape[0]
    slots = np.asarray(slot_mapping)
    if slots.dtype.kind not in "iu" or slots.shape != (n,):
        raise ValueError(f"slot_mapping must be ({n},) integers, got {slots.dtype} {slots.shape}")
    slots = slots.astype(np.int64)
    real = slots != -1
    s = slots[real]
    if ((s < 0) | (s >= n_blocks * page)).any():
        raise ValueError(f"slot_mapping entries must be -1 or lie in [0, {n_blocks * page}) (num_blocks x page)")
    if np.unique(s).size != s.size:
        raise ValueError("slot_mapping names a slot twice (the writes would race)")
    out = np.array(cache, copy=True)
    x = np.concatenate([kv_c[real].astype(np.float64), k_pe[real].astype(np.float64)], axis=-1)
    out[s // page, s % page, 0] = pack(x)
    return out.reshape(np.shape(kv_cache))
