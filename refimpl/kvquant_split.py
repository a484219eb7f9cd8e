"""Golden decode and flash decoding over a quantized KV cache (kvquant.decode, kvquant.decode_split; issue 34).

    K_j  = float64(k_codes_j) * float64(s_k(j))        exact (refimpl/kvquant.py `dequantize`)
    V_j  = float64(v_codes_j) * float64(s_v(j))

then refimpl.attention's float64 math on the dequantized cache, so the conventions are its own:
- `decode`: attention.decode: q (b, s_q, h_q, d) are the last s_q tokens of each sequence, causal
  bottom-right (query i of sequence b sees keys j <= L_b - s_q + i; one with L_b - s_q + i < 0 sees none:
  O = 0, LSE = -inf), GQA h -> h // (h_q / h_kv), softmax scale 1/sqrt(d), LSE natural log (b, h_q, s_q);
- `decode_split`: attention.decode_split with equal counts: split s of sequence b covers keys
  [s C_b, min((s + 1) C_b, L_b)), C_b = ceil(L_b / splits), each split's partial (O_s normalised over its
  own keys, LSE_s) and their merge by lse_combine; an empty split has LSE_s = -inf and O_s NaN (any value is
  right there). The cache is contiguous (b, s_max, h_kv, d), or (block_table given) pages
  (num_blocks, page, h_kv, d) where token t of sequence b lives at cache[block_table[b, t // page], t % page];
  a split may start or end inside a page.
Scale granularities (refimpl/kvquant.py GRANS), told apart by the scale's shape:
- "tensor": (1,) fp32; "head": (h_kv,) fp32;
- "token": the scale cache, the shape of the codes without d ((b, s_max, h_kv) contiguous,
  (num_blocks, page, h_kv) paged), read like the codes.
Slots at or past L_b (and pages past a sequence's last) are never read: the inputs poison them with NaN
codes and NaN token scales. The golden reads the same codes as the kernel, so the cache's quantization
error is not compared: only the kernel's arithmetic on the codes (as refimpl/kvquant_decode.py).

One sequence at a time (a 32K-token float64 cache of Llama-3-8B's heads is 268 MB a sequence).
`absolute=True` gives refimpl.attention's error model (the magnitudes a correct kernel's rounding scales
with) instead of the outputs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import attention as _attention

F64 = NDArray[np.float64]


def _check(op: str, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, ks, vs, lens, block_table) -> tuple:
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be (b, s_q, h_q, d), got shape {q.shape}")
    b, s_q, h_q, d = q.shape
    lay = "(num_blocks, page, h_kv, d)" if block_table is not None else "(b, s_max, h_kv, d)"
    if kc.ndim != 4 or kc.shape[-1] != d or vc.shape != kc.shape:
        raise ValueError(f"{op}: k_cache, v_cache must both be {lay} with d={d}, got {kc.shape} and {vc.shape}")
    n0, n1, h_kv, _ = kc.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}")
    for name, s in (("k_scale", ks), ("v_scale", vs)):
        if s.shape not in ((1,), (h_kv,), (n0, n1, h_kv)):
            raise ValueError(f"{op}: {name} must have shape (1,) (tensor), ({h_kv},) (head) or "
                             f"({n0}, {n1}, {h_kv}) (token), got {s.shape}")
    if block_table is None:
        if n0 != b:
            raise ValueError(f"{op}: k_cache must have b={b} rows, got {n0}")
        cap = n1
    else:
        bt = np.asarray(block_table)
        if bt.ndim != 2 or bt.shape[0] != b:
            raise ValueError(f"{op}: block_table must be ({b}, max_pages), got shape {bt.shape}")
        cap = bt.shape[1] * n1
    if lens.shape != (b,) or (lens < 0).any() or (lens > cap).any():
        raise ValueError(f"{op}: seqlens must be ({b},) in [0, {cap}], got "
                         f"{lens.tolist() if lens.size <= 16 else lens.shape}")
    return b, s_q, h_q, d, h_kv


def _dequant(codes: np.ndarray, s: np.ndarray, i: int, L: int, block_table) -> F64:
    """(max(L, 1), h_kv, d) float64 values of sequence i's first L keys (or values): codes x scale, exactly;
    a zero row for L = 0 (never read: its length masks it)."""
    n0, n1, h_kv, d = codes.shape
    if L == 0:
        return np.zeros((1, h_kv, d))
    if block_table is None:
        c = codes[i, :L].astype(np.float64)
        sc = s[i, :L, :, None] if s.ndim == 3 else s.reshape(1, -1, 1)
    else:
        pages = np.asarray(block_table)[i, : -(-L // n1)].astype(np.int64)
        if (pages < 0).any() or (pages >= n0).any():
            raise ValueError(f"kvquant.decode_split: block_table[{i}] points outside [0, {n0}) within its "
                             f"{pages.size} live pages")
        c = codes[pages].reshape(-1, h_kv, d)[:L].astype(np.float64)
        sc = s[pages].reshape(-1, h_kv)[:L, :, None] if s.ndim == 3 else s.reshape(1, -1, 1)
    return c * np.asarray(sc, dtype=np.float64)


def decode(q: NDArray, k_cache: NDArray, v_cache: NDArray, k_scale: NDArray, v_scale: NDArray, seqlens: NDArray,
           *, scale: float | None = None, absolute: bool = False) -> tuple[F64, F64]:
    """Decode of s_q new tokens a sequence over a contiguous quantized cache.

    q: (b, s_q, h_q, d) float; k_cache, v_cache: (b, s_max, h_kv, d) codes (int8, float8_e4m3fn, float8_e5m2,
       or their values as float64); k_scale, v_scale: (1,) | (h_kv,) | (b, s_max, h_kv) float32
    seqlens: (b,) int in [0, s_max]: cached tokens, the queries' included
    returns: o (b, s_q, h_q, d) float64, lse (b, h_q, s_q) float64 (natural log, -inf for a query with no key)
    """
    q = np.asarray(q)
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    ks, vs, lens = np.asarray(k_scale), np.asarray(v_scale), np.asarray(seqlens)
    b, s_q, h_q, d, h_kv = _check("kvquant.decode", q, kc, vc, ks, vs, lens, None)
    o = np.zeros((b, s_q, h_q, d))
    lse = np.zeros((b, h_q, s_q))
    for i in range(b):
        L = int(lens[i])
        k, v = _dequant(kc, ks, i, L, None), _dequant(vc, vs, i, L, None)
        oi, li, _ = _attention.decode(q[i][None].astype(np.float64), k[None], v[None], np.asarray([L]),
                                      scale=scale, absolute=absolute)
        o[i], lse[i] = oi[0], li[0]
    return o, lse


def decode_split(q: NDArray, k_cache: NDArray, v_cache: NDArray, k_scale: NDArray, v_scale: NDArray,
                 seqlens: NDArray, splits: int, *, block_table: NDArray | None = None, scale: float | None = None,
                 block: int | None = None, bounds: NDArray | None = None,
                 absolute: bool = False) -> tuple[F64, F64, F64, F64]:
    """Flash decoding over a contiguous or paged quantized cache (module docstring).

    q, k_cache, v_cache, k_scale, v_scale, seqlens: as `decode` (pages and (num_blocks, page, h_kv) token
    scales with block_table (b, max_pages) int); splits >= 1: key ranges a sequence, partitioned as
    refimpl.attention.split_bounds: equal counts (default), fixed blocks of `block` keys (splits x block >= every
    length), or explicit cumulative `bounds` (b, splits + 1) from 0 to at least each length
    returns: o (b, s_q, h_q, d), lse (b, h_q, s_q), o_parts (splits, b, s_q, h_q, d) (NaN for an empty split),
             lse_parts (splits, b, h_q, s_q) (-inf for an empty split), float64
    """
    q = np.asarray(q)
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    ks, vs, lens = np.asarray(k_scale), np.asarray(v_scale), np.asarray(seqlens)
    b, s_q, h_q, d, h_kv = _check("kvquant.decode_split", q, kc, vc, ks, vs, lens, block_table)
    if int(splits) < 1:
        raise ValueError(f"kvquant.decode_split: splits={splits} must be >= 1")
    if block is not None and bounds is not None:
        raise ValueError("kvquant.decode_split: give block or bounds, not both")
    if bounds is not None:
        bounds = np.asarray(bounds)
    _attention.split_bounds(lens, int(splits), block=block, bounds=bounds)  # ValueError unless they cover
    o = np.zeros((b, s_q, h_q, d))
    lse = np.zeros((b, h_q, s_q))
    o_parts = np.zeros((splits, b, s_q, h_q, d))
    lse_parts = np.zeros((splits, b, h_q, s_q))
    for i in range(b):
        L = int(lens[i])
        k, v = _dequant(kc, ks, i, L, block_table), _dequant(vc, vs, i, L, block_table)
        oi, li, _, opi, lpi = _attention.decode_split(q[i][None].astype(np.float64), k[None], v[None],
                                                      np.asarray([L]), int(splits), scale=scale, block=block,
                                                      bounds=None if bounds is None else bounds[i][None],
                                                      absolute=absolute)
        o[i], lse[i], o_parts[:, i], lse_parts[:, i] = oi[0], li[0], opi[:, 0], lpi[:, 0]
    return o, lse, o_parts, lse_parts
