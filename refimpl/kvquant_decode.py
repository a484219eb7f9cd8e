"""Golden paged decode attention over a quantized KV cache (kvquant.decode_paged, issue 34's read path).

    K_j  = float64(k_codes_j) * float64(s_k(j))        exact (refimpl/kvquant.py `dequantize`)
    V_j  = float64(v_codes_j) * float64(s_v(j))
    s_hj = scale * q_h . K_j                           scale 1/sqrt(d), float64
    LSE_h = ln sum_j exp(s_hj);  O_h = sum_j exp(s_hj - LSE_h) V_j        j < L_b = seq_lens[b]

then refimpl.attention.decode_paged's math on the dequantized cache (one query a sequence, the last token:
it sees every cached key), so the conventions are attention.decode_paged's (refimpl/attention.py):
- GQA: query head h reads kv head h // (h_q / h_kv);
- LSE natural log; a sequence with no key (L_b = 0) has O = 0 and LSE = -inf;
- token t of sequence b lives at cache[block_table[b, t // page], t % page]; slots at or past L_b, pages past
  the sequence's last and whatever block-table entries point at there are never read (the inputs poison them).
Scale granularities (refimpl/kvquant.py GRANS), told apart by the scale's shape:
- "tensor": k_scale, v_scale of shape (1,) fp32, one scale for all of K (V);
- "head":   (h_kv,) fp32, the scale of kv head h (with h_kv = 1 the same as "tensor");
- "token":  the scale caches (num_blocks, page, h_kv) fp32, the scale of each (slot, kv head), read through
  the block table like the codes.
The codes are any values of their format (e4m3, e5m2, int8): saturated ones, subnormals, int8's -128; the
golden reads the same codes as the kernel, so the cache's own quantization error (kvquant.update's business)
is not part of what is compared: only the kernel's arithmetic on the codes is.

`absolute=True` gives refimpl.attention's error model (the magnitudes a correct kernel's rounding scales
with) instead of the outputs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import attention as _attention

F64 = NDArray[np.float64]


def _scale_of(name: str, s: NDArray, num_blocks: int, page: int, h_kv: int) -> np.ndarray:
    """The scale as float64, checked: (1,), (h_kv,) or (num_blocks, page, h_kv)."""
    s = np.asarray(s)
    if s.shape in ((1,), (h_kv,)) or s.shape == (num_blocks, page, h_kv):
        return s
    raise ValueError(f"kvquant.decode_paged: {name} must have shape (1,) (tensor), ({h_kv},) (head) or "
                     f"({num_blocks}, {page}, {h_kv}) (token), got {s.shape}")


def decode_paged(q: NDArray, k_cache: NDArray, v_cache: NDArray, k_scale: NDArray, v_scale: NDArray,
                 block_table: NDArray, seq_lens: NDArray, *, scale: float | None = None,
                 absolute: bool = False) -> tuple[F64, F64]:
    """Decode of one new token a sequence over a paged quantized cache.

    q: (b, h_q, d) float; k_cache, v_cache: (num_blocks, page, h_kv, d) codes (int8, float8_e4m3fn,
       float8_e5m2, or their values as float64)
    k_scale, v_scale: (1,) | (h_kv,) | (num_blocks, page, h_kv) float32 (module docstring)
    block_table: (b, max_pages) int; seq_lens: (b,) int, 0 <= seq_lens[b] <= max_pages * page
    scale: softmax scale, default 1/sqrt(d)
    returns: o (b, h_q, d) float64, lse (b, h_q) float64 (natural log, -inf for L_b = 0)
    """
    q = np.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"kvquant.decode_paged: q must be (b, h_q, d), got shape {q.shape}")
    b, h_q, d = q.shape
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    if kc.ndim != 4 or kc.shape[-1] != d or vc.shape != kc.shape:
        raise ValueError(f"kvquant.decode_paged: k_cache, v_cache must both be (num_blocks, page, h_kv, d={d}), "
                         f"got {kc.shape} and {vc.shape}")
    num_blocks, page, h_kv, _ = kc.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"kvquant.decode_paged: h_q={h_q} must be a multiple of h_kv={h_kv}")
    ks = _scale_of("k_scale", k_scale, num_blocks, page, h_kv)
    vs = _scale_of("v_scale", v_scale, num_blocks, page, h_kv)
    bt = np.asarray(block_table)
    lens = np.asarray(seq_lens)
    if bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"kvquant.decode_paged: block_table must be ({b}, max_pages), got shape {bt.shape}")
    if lens.shape != (b,) or (lens < 0).any() or (lens > bt.shape[1] * page).any():
        raise ValueError(f"kvquant.decode_paged: seq_lens must be ({b},) in [0, max_pages * page = "
                         f"{bt.shape[1] * page}], got {lens.tolist() if lens.size <= 16 else lens.shape}")
    o = np.zeros((b, h_q, d))
    lse = np.full((b, h_q), -np.inf)
    for i in range(b):  # one sequence at a time bounds the float64 copy (32K tokens: 268 MB a cache)
        L = int(lens[i])
        if L == 0:
            if absolute:
                lse[i] = 0.0  # the error model's magnitude of a row with no key
            continue
        pages = bt[i, : -(-L // page)].astype(np.int64)
        if (pages < 0).any() or (pages >= num_blocks).any():
            raise ValueError(f"kvquant.decode_paged: block_table[{i}] points outside [0, {num_blocks}) within "
                             f"its {pages.size} live pages")
        k = _dequant(kc, ks, pages, L, h_kv)
        v = _dequant(vc, vs, pages, L, h_kv)
        oi, li, _ = _attention.decode(q[i][None, None].astype(np.float64), k[None], v[None],
                                      np.asarray([L]), scale=scale, absolute=absolute)
        o[i], lse[i] = oi[0, 0], li[0, :, 0]
    return o, lse


def _dequant(codes: np.ndarray, s: np.ndarray, pages: np.ndarray, L: int, h_kv: int) -> F64:
    """(L, h_kv, d) float64 values of one sequence's keys (or values): codes x scale, exactly."""
    d = codes.shape[-1]
    c = codes[pages].reshape(-1, h_kv, d)[:L].astype(np.float64)
    if s.ndim == 3:
        sc = s[pages].reshape(-1, h_kv)[:L, :, None]
    else:
        sc = s.reshape(1, -1, 1)
    return c * sc.astype(np.float64)
