"""`mla.schedule`: FlashMLA's split-KV tile scheduler (`get_mla_metadata`) as a gated op.

FlashMLA's decode runs one CTA per (SM part, kv head, 64-row query tile); before the decode, a one-warp
kernel cuts the batch's KV blocks into num_sm_parts pieces of about equal cost and writes where each part
starts and ends. Its golden is refimpl/mla_schedule.py (`refimpl.mla.schedule`); its conventions:

    num_sm_parts P = sms // h_kv // ceil(s_q h_q / h_kv / 64)      (flash_api.cpp, the old API)
    cost_i  = ceil(L_i / 64) + 5                                     (FIXED_OVERHEAD_NUM_BLOCKS = 5)
    payload = max(ceil(sum_i cost_i / P) + 5, 10)                    (the 2F floor: floor = 1, Apr 2025;
                                                                      floor = 0: Feb 2025, no floor)
    outputs: meta (P, 8) int32 rows [begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx,
             0, 0, 0] and num_splits (b + 1,) int32 (cumulative split counts from 0), both bit-exact.
    Columns 5..7 are padding FlashMLA leaves uninitialised; the contract here is 0 (the harness poisons
    the output, so a kernel must write every column).

The block size (64) and the fixed overhead (5) are FlashMLA's constants, not params. This is not the
scheduler of kernels/triton/mla.py (`mla_schedule`: equal page-aligned pieces, no fixed cost, no piece
spanning requests), which drives our own split decode; that one has no FlashMLA contract to meet.

Inputs: cache_seqlens (b,) int32, drawn by the distribution (`DISTS`); kv scales the lengths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.mla  # noqa: F401  (refimpl.mla.schedule below)
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol
from kernel_parity.refimpl.mla_schedule import FIXED_OVERHEAD_NUM_BLOCKS as F  # 5

BLOCK = 64  # FlashMLA's block_size_n (the page)

DISTS = {
    "equal": "every request kv tokens (FlashMLA's test, varlen off)",
    "varlen": "max(N(kv, kv / 2), s_q) truncated (FlashMLA's test, varlen on)",
    "bench": "kv + 2 i (FlashMLA's benchmark)",
    "uniform": "U{0..kv}",
    "skewed": "very unequal: one request at kv, a quarter of the rest empty, the others U{1..64}",
    "edges": "block edges: 64 k - 1, 64 k, 64 k + 1 and 0, k in U{0..kv / 64}",
    "tight": "lengths built so pieces land on payload boundaries: a request ending a part exactly (remaining "
             "payload 0), one leaving exactly 5 (no split), 6 (a one-block split) or one block short of fitting; "
             "lengths on and one past block edges, zeros; kv sets the scale",
}


def num_sm_parts(p: dict[str, Any]) -> int:
    return refimpl.mla.sm_parts(p["sms"], p["sq"], p["hq"], p["hkv"])


def _tight(b: int, kv: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """(b,) block counts whose greedy schedule hits the payload's boundaries; the total cost is
    parts x (W - F), so the payload is exactly W (above the 2F floor)."""
    avg = -(-kv // BLOCK)
    W = F + max(F + 1, -(-b * (2 * avg + F) // parts))
    budget = parts * (W - F)  # the total cost of the batch
    n = np.zeros(b, dtype=np.int64)
    R = W  # the current part's remaining payload when the next request starts
    for i in range(b - 1):  # the last request takes what the budget leaves
        free = int(rng.integers(0, 2 * avg + 1))
        # ends the part with 0 left, leaves exactly 5 (no split), 6 (a one-block split), one block short
        want = [R - F, R - 2 * F, R - 2 * F - 1, R - F + 1, 0, free, free][rng.integers(0, 7)]
        want = free if want < 0 else want
        left = budget - F * (b - i)  # blocks this request may take, leaving every later one its F
        k = int(min(max(want, 0), left))
        n[i] = k
        budget -= k + F
        rest = k + F  # place it: whole into this part, or split over parts
        while True:
            if R >= rest:
                R -= rest
                break
            if R - F > 0:
                rest -= R - F
            R = W
    n[b - 1] = budget - F
    return n


def seqlens(p: dict[str, Any], dist: str, rng: np.random.Generator) -> np.ndarray:
    """(b,) int32 cache_seqlens of a case."""
    b, kv = p["b"], p["kv"]
    if dist == "equal":
        L = np.full(b, kv)
    elif dist == "varlen":
        L = np.maximum(rng.normal(kv, kv / 2, b), p["sq"]).astype(np.int64)
    elif dist == "bench":
        L = kv + 2 * np.arange(b)
    elif dist == "uniform":
        L = rng.integers(0, kv + 1, b)
    elif dist == "skewed":
        L = np.where(rng.random(b) < 0.25, 0, rng.integers(1, BLOCK + 1, b))
        L[rng.integers(0, b)] = kv
    elif dist == "edges":
        L = np.maximum(rng.integers(0, kv // BLOCK + 1, b) * BLOCK + rng.integers(-1, 2, b), 0)
        L[rng.random(b) < 0.125] = 0
    elif dist == "tight":
        n = _tight(b, kv, num_sm_parts(p), rng)
        off = np.where(rng.random(b) < 0.5, 0, np.where(rng.random(b) < 0.5, BLOCK - 1, rng.integers(0, BLOCK, b)))
        L = np.maximum(n * BLOCK - off, 0)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return L.astype(np.int32)


def _inputs(p, dtype, dist, rng):
    return {"seqlens": seqlens(p, dist, rng)}


def _ref(x, p):
    meta, ns = refimpl.mla.schedule(x["seqlens"], p["sq"], p["hq"], num_sm_parts(p), BLOCK, p["hkv"],
                                    payload_floor=bool(p["floor"]))
    return {"meta": meta, "num_splits": ns}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    if num_sm_parts(p) < 1:
        need = p["hkv"] * -(-p["sq"] * p["hq"] // p["hkv"] // 64)
        return (f"num_sm_parts = sms // hkv // ceil(sq hq / hkv / 64) = 0 for sms={p['sms']}; "
                f"expected sms >= {need}")
    return None


SCHEDULE = OpSpec(
    name="mla.schedule",
    golden=refimpl.mla.schedule,
    reference=_ref,
    params=Schema(dict(
        b=Int(1, 16384, edges=(1, 2, 128), doc="requests"),
        kv=Int(0, 1 << 20, edges=(0, 64, 4096, 8192, 16384), doc="length scale: the longest (equal, uniform, "
           "skewed, edges), the mean (varlen), the first (bench), the scale (tight)"),
        sq=OneOf(1, 2, doc="new tokens per request (FlashMLA's s_q)"),
        hq=Int(1, 128, edges=(16, 32, 64, 128), doc="query heads"),
        hkv=Int(1, 128, edges=(1,), doc="kv heads (FlashMLA's num_heads_k)"),
        sms=Int(1, 1024, edges=(78, 114, 132), doc="the device's SM count (H20 78, H800 PCIe 114, H800/H100 "
            "SXM 132)"),
        floor=OneOf(1, 0, doc="1: payload >= 2 x 5 (Apr 2025 get_mla_metadata.cu); 0: no floor (Feb 2025)"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"meta": (num_sm_parts(p), 8), "num_splits": (p["b"] + 1,)},
    outputs={"meta": Output("int32", exact=True, doc="tile_scheduler_metadata (num_sm_parts, 8)"),
             "num_splits": Output("int32", exact=True, doc="cumulative splits per request (b + 1,), from 0")},
    tolerance=Tol(noise_k=None),
    dtypes=("int32",),
    dists=DISTS,
    check=_check,
    baseline=None,
    doc="FlashMLA's get_mla_metadata: per-request cache_seqlens -> tile-scheduler rows and num_splits, bit-exact.",
)

SPECS = (SCHEDULE,)
