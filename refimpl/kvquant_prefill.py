"""Golden chunked prefill over a quantized paged KV cache (kvquant.chunked_prefill, issue 34).

    K_j  = float64(k_codes_j) * float64(s_k(j))        exact (refimpl/kvquant.py `dequantize`)
    V_j  = float64(v_codes_j) * float64(s_v(j))
    s_ij = scale * q_i . K_j                           scale 1/sqrt(d), float64
    LSE_i = ln sum_{j <= hist_b + i} exp(s_ij);  O_i = sum_{j <= hist_b + i} exp(s_ij - LSE_i) V_j

then refimpl.attention.chunked_prefill's float64 math on the dequantized cache, so the conventions are
attention.chunked_prefill's (refimpl/attention.py):
- queries packed as FlashAttention's varlen layout: sequence b's L_q,b queries are rows
  cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (total_q, h_q, d); LSE (h_q, total_q), natural log;
- the cache holds hist_b + L_q,b tokens of sequence b: its history (hist_b tokens cached before the chunk),
  then the chunk's own K / V, ALREADY QUANTIZED AND WRITTEN (vLLM's flow: reshape_and_cache writes the chunk
  into the fp8 cache first, kvquant.update here, then the attention reads history + chunk from the cache as
  codes). So the chunk's keys are codes like the history's, with the same scales;
- causal bottom-right: query i of sequence b sits at absolute position hist_b + i and sees keys
  j <= hist_b + i (every query sees at least one key, its own); no window, softcap or sink;
- GQA: query head h reads kv head h // (h_q / h_kv);
- a sequence with no queries (L_q,b = 0, whatever its history) contributes no rows; hist_b = 0 is a plain
  causal prefill;
- token t of sequence b lives at cache[block_table[b, t // page], t % page]; slots at or past hist_b + L_q,b,
  pages past the sequence's last and whatever table entries point at there are never read (the inputs
  poison them).
Scale granularities as kvquant.decode_paged's (refimpl/kvquant_decode.py), told apart by the scale's shape:
(1,) per tensor, (h_kv,) per kv head, (num_blocks, page, h_kv) per (slot, kv head) through the block table.
The golden reads the same codes as the kernel: the cache's quantization error is not compared, only the
kernel's arithmetic on the codes.

Memory: one sequence at a time, and its queries in blocks of rows (rows r0..r1 of a chunk are the chunked
prefill of hist_b + r0 cached tokens and a chunk of r1 - r0 queries: the same numbers), so 512-query chunks
over 32K-token histories keep the float64 logits near 256 MB.

`absolute=True` gives refimpl.attention's error model (the magnitudes a correct kernel's rounding scales
with) instead of the outputs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import attention as _attention

F64 = NDArray[np.float64]
LOGIT_BUDGET = 1 << 25  # float64 logits a block of query rows may form (256 MB)


def _scale_of(name: str, s: NDArray, num_blocks: int, page: int, h_kv: int) -> np.ndarray:
    s = np.asarray(s)
    if s.shape in ((1,), (h_kv,)) or s.shape == (num_blocks, page, h_kv):
        return s
    raise ValueError(f"kvquant.chunked_prefill: {name} must have shape (1,) (tensor), ({h_kv},) (head) or "
                     f"({num_blocks}, {page}, {h_kv}) (token), got {s.shape}")


def _dequant(codes: np.ndarray, s: np.ndarray, pages: np.ndarray, L: int, h_kv: int) -> F64:
    """(L, h_kv, d) float64 values of one sequence's keys (or values): codes x scale, exactly."""
    d = codes.shape[-1]
    c = codes[pages].reshape(-1, h_kv, d)[:L].astype(np.float64)
    sc = s[pages].reshape(-1, h_kv)[:L, :, None] if s.ndim == 3 else s.reshape(1, -1, 1)
    return c * sc.astype(np.float64)


def chunked_prefill(q: NDArray, k_cache: NDArray, v_cache: NDArray, k_scale: NDArray, v_scale: NDArray,
                    cu_seqlens_q: NDArray, hist: NDArray, block_table: NDArray, *, scale: float | None = None,
                    absolute: bool = False) -> tuple[F64, F64]:
    """Packed query chunks over a paged quantized cache holding each sequence's history and chunk.

    q: (total_q, h_q, d) float; sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    k_cache, v_cache: (num_blocks, page, h_kv, d) codes (int8, float8_e4m3fn, float8_e5m2, or their values
        as float64); sequence b's tokens 0 .. hist_b + L_q,b - 1 (history, then the chunk's own)
    k_scale, v_scale: (1,) | (h_kv,) | (num_blocks, page, h_kv) float32 (module docstring)
    cu_seqlens_q: (b + 1,) int, non-decreasing from 0 to total_q; hist: (b,) int >= 0
    block_table: (b, max_pages) int; hist_b + L_q,b <= max_pages * page
    scale: softmax scale, default 1/sqrt(d)
    returns: o (total_q, h_q, d) float64, lse (h_q, total_q) float64 (natural log)
    """
    q = np.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"kvquant.chunked_prefill: q must be (total_q, h_q, d), got shape {q.shape}")
    total_q, h_q, d = q.shape
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    if kc.ndim != 4 or kc.shape[-1] != d or vc.shape != kc.shape:
        raise ValueError(f"kvquant.chunked_prefill: k_cache, v_cache must both be (num_blocks, page, h_kv, d={d}), "
                         f"got {kc.shape} and {vc.shape}")
    num_blocks, page, h_kv, _ = kc.shape
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"kvquant.chunked_prefill: h_q={h_q} must be a multiple of h_kv={h_kv}")
    ks = _scale_of("k_scale", k_scale, num_blocks, page, h_kv)
    vs = _scale_of("v_scale", v_scale, num_blocks, page, h_kv)
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != total_q:
        raise ValueError(f"kvquant.chunked_prefill: cu_seqlens_q must be (b + 1,) non-decreasing from 0 to "
                         f"total_q={total_q}, got {cu.tolist() if cu.size <= 16 else cu.shape}")
    b = cu.size - 1
    hs = np.asarray(hist).astype(np.int64)
    bt = np.asarray(block_table)
    if hs.shape != (b,) or (hs < 0).any():
        raise ValueError(f"kvquant.chunked_prefill: hist must be ({b},) >= 0, got "
                         f"{hs.tolist() if hs.size <= 16 else hs.shape}")
    if bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"kvquant.chunked_prefill: block_table must be ({b}, max_pages), got shape {bt.shape}")
    lq = np.diff(cu)
    if ((hs + lq) > bt.shape[1] * page).any():
        raise ValueError(f"kvquant.chunked_prefill: hist + chunk length must be <= max_pages * page = "
                         f"{bt.shape[1] * page}")
    o = np.zeros((total_q, h_q, d))
    lse = np.zeros((h_q, total_q))
    for i in range(b):  # one sequence at a time bounds the float64 copies
        n_q, H = int(lq[i]), int(hs[i])
        if n_q == 0:
            continue  # no queries: no rows
        L = H + n_q
        pages = bt[i, : -(-L // page)].astype(np.int64)
        if (pages < 0).any() or (pages >= num_blocks).any():
            raise ValueError(f"kvquant.chunked_prefill: block_table[{i}] points outside [0, {num_blocks}) within "
                             f"its {pages.size} live pages")
        k = _dequant(kc, ks, pages, L, h_kv)[None]
        v = _dequant(vc, vs, pages, L, h_kv)[None]
        rows = max(1, LOGIT_BUDGET // (h_q * L))
        c0 = int(cu[i])
        for r0 in range(0, n_q, rows):
            r1 = min(n_q, r0 + rows)
            oi, li, _ = _attention.chunked_prefill(q[c0 + r0: c0 + r1].astype(np.float64), k[:, : H + r1],
                                                   v[:, : H + r1], np.asarray([0, r1 - r0]), np.asarray([H + r0]),
                                                   scale=scale, absolute=absolute)
            o[c0 + r0: c0 + r1], lse[:, c0 + r0: c0 + r1] = oi, li
    return o, lse
