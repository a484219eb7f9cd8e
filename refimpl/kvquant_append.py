"""Golden fused decode step over a quantized paged KV cache (kvquant.append_decode, issue 34): the write path and
the read path of one decode step in one op.

    slot_b = block_table[b, L_b // page] * page + L_b % page        L_b = seq_lens[b], the length BEFORE the append
    caches' = kvquant.update(caches, k_new / v_new, slot)            refimpl/kvquant_update.py, bit-exact rules
    O, LSE  = kvquant.decode_paged(q, caches', L_b + 1)              refimpl/kvquant_decode.py on the updated caches

The new token of sequence b goes to position L_b (the slot after its last cached token); the attention runs over
L_b + 1 keys, the new token's included, and reads the new token's key and value AS QUANTIZED: its codes times its
scale (for gran "token", the dynamic scale just computed and stored), exactly like every cached key. That is what
an engine that writes and then reads computes: vLLM's FlashAttention / FlashInfer backends call
reshape_and_cache_flash (csrc/cache_kernels.cu: the fp8 codes of the step's new K / V written at slot_mapping,
k_scale / v_scale) and then the attention (flash_attn_varlen_func with k_descale / v_descale, or FlashInfer's
BatchDecodeWithPagedKVCacheWrapper.run with k_scale / v_scale) over the cache with seqused_k = the lengths that
count the new token (vllm/v1/attention/backends/flash_attn.py, flashinfer.py); FlashInfer's own flow is
append_paged_kv_cache then the paged decode, the same order. A fused kernel may keep the new row in registers,
but must attend to its quantized code, not to the unquantized value (which would be a different answer from the
unfused engine by the cache's quantization error).

Conventions (the two goldens'): formats e4m3 / e5m2 / int8, x / s the IEEE float32 division, saturating,
nearest even (int8 half to even, then clamped); gran "tensor" (k_scale, v_scale (1,) fp32), "head" ((h_kv,)
fp32), "token" (scale caches (num_blocks, page, h_kv) fp32: the new row's scale amax_d |x| / FMAX is computed and
stored at the slot, a zero row has scale 0 and codes 0); GQA h -> h // (h_q / h_kv); softmax scale 1 / sqrt(d);
LSE natural log. Every sequence attends to at least one key (its new one): L_b = 0 gives O = the new token's
dequantized value and LSE = its logit. Slots the step does not write keep their bits (codes and scales); the
caller guarantees distinct slots (two sequences never append to one slot: refused, as kvquant.update refuses)
and that position L_b has a page in the table (L_b + 1 <= max_pages * page, the entry in [0, num_blocks)).

`absolute=True` gives refimpl.attention's error model of O and the LSE (the caches are bit-exact copies).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.kvquant_decode import decode_paged
from kernel_parity.refimpl.kvquant_update import GRANS, update

F64 = NDArray[np.float64]


def _fail(msg: str) -> None:
    raise ValueError(f"kvquant.append_decode: {msg}")


def slots_of(block_table: NDArray, seq_lens: NDArray, page: int, num_blocks: int) -> np.ndarray:
    """(b,) int64 slot of each sequence's new token: block_table[b, L_b // page] * page + L_b % page (checked)."""
    bt = np.asarray(block_table)
    lens = np.asarray(seq_lens)
    if bt.ndim != 2 or bt.dtype.kind not in "iu":
        _fail(f"block_table must be (b, max_pages) integers, got {bt.dtype} {bt.shape}")
    b = bt.shape[0]
    if lens.shape != (b,) or lens.dtype.kind not in "iu":
        _fail(f"seq_lens must be ({b},) integers, got {lens.dtype} {lens.shape}")
    lens = lens.astype(np.int64)
    cap = bt.shape[1] * page
    if ((lens < 0) | (lens + 1 > cap)).any():
        _fail(f"seq_lens must lie in [0, max_pages * page - 1 = {cap - 1}] (the new token needs a slot), got "
              f"{lens.tolist() if lens.size <= 16 else (int(lens.min()), int(lens.max()))}")
    pages = bt[np.arange(b), lens // page].astype(np.int64) if b else np.zeros(0, np.int64)
    if ((pages < 0) | (pages >= num_blocks)).any():
        _fail(f"block_table's entry of the new token's page must be in [0, {num_blocks}), got "
              f"{pages.tolist() if pages.size <= 16 else pages.shape}")
    return pages * page + lens % page


def append_decode(q: NDArray, k_new: NDArray, v_new: NDArray, k_cache: NDArray, v_cache: NDArray,
                  block_table: NDArray, seq_lens: NDArray, *, fmt: str, gran: str,
                  k_scale: NDArray | None = None, v_scale: NDArray | None = None,
                  k_scale_cache: NDArray | None = None, v_scale_cache: NDArray | None = None,
                  scale: float | None = None, absolute: bool = False) -> dict[str, np.ndarray]:
    """One decode step: append (k_new, v_new) at position seq_lens[b], then attend over seq_lens[b] + 1 keys.

    q: (b, h_q, d) float; k_new, v_new: (b, h_kv, d) float (the model dtype's values, exact in float32)
    k_cache, v_cache: (num_blocks, page, h_kv, d) codes of refimpl.kvquant.STORAGE[fmt]
    block_table: (b, max_pages) int; seq_lens: (b,) int, lengths BEFORE the append, seq_lens[b] + 1 <=
        max_pages * page
    fmt: "e4m3" | "e5m2" | "int8";  gran: "tensor" | "head" | "token"
    k_scale, v_scale: (1,) (tensor) or (h_kv,) (head) float32; None for token
    k_scale_cache, v_scale_cache: (num_blocks, page, h_kv) float32 for gran token, else None
    returns {"o": (b, h_q, d) float64, "lse": (b, h_q) float64, "k_cache", "v_cache": the caches after the
        write (new arrays, STORAGE[fmt]), and for gran token "k_scale_cache", "v_scale_cache" after it}; with
        absolute=True only the error model's "o" and "lse"
    """
    if gran not in GRANS:
        _fail(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    q = np.asarray(q)
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    if q.ndim != 3:
        _fail(f"q must be (b, h_q, d), got shape {q.shape}")
    if kc.ndim != 4 or vc.shape != kc.shape:
        _fail(f"k_cache, v_cache must both be (num_blocks, page, h_kv, d), got {kc.shape} and {vc.shape}")
    b = q.shape[0]
    nb, page, h_kv, d = kc.shape
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if np.shape(x) != (b, h_kv, d):
            _fail(f"{name} must be ({b}, {h_kv}, {d}) (one new token a sequence), got {np.shape(x)}")
    slots = slots_of(block_table, seq_lens, page, nb)
    out: dict[str, np.ndarray] = {}
    caches = {}
    for kv, cache, new, s, sc in (("k", kc, k_new, k_scale, k_scale_cache), ("v", vc, v_new, v_scale, v_scale_cache)):
        try:
            c2, sc2 = update(cache, new, slots, fmt=fmt, gran=gran, scale=s, scale_cache=sc)
        except ValueError as e:
            _fail(str(e).replace("kvquant.update: ", f"{kv}: "))
        caches[kv] = (c2, sc2 if gran == "token" else np.asarray(s))
    o, lse = decode_paged(q, caches["k"][0], caches["v"][0], caches["k"][1], caches["v"][1], block_table,
                          np.asarray(seq_lens).astype(np.int64) + 1, scale=scale, absolute=absolute)
    out["o"], out["lse"] = o, lse
    if absolute:
        return out
    out["k_cache"], out["v_cache"] = caches["k"][0], caches["v"][0]
    if gran == "token":
        out["k_scale_cache"], out["v_scale_cache"] = caches["k"][1], caches["v"][1]
    return out
