"""`moe.align`: MoE token alignment into expert blocks (vLLM's moe_align_block_size), exact integers.

Before a fused MoE GEMM (vLLM's fused_moe Triton kernel: BLOCK_SIZE_M rows of one expert a program), the T x k
(token, expert) pairs of topk_ids are grouped by expert and each expert's group padded to whole blocks. The
golden is refimpl/moe_align.py (`refimpl.moe.align`); its conventions, in short (P = T k + E (B - 1)):

    sorted_ids (P,)            the slots t k + j grouped by expert (ascending), ascending within an expert (a
                               stable counting sort: declared; vLLM's CUDA kernel leaves that order to atomics),
                               each expert's segment padded to a multiple of B with the sentinel T k; the sentinel
                               past num_tokens_post_pad too
    expert_ids (ceil(P / B),)  the expert of each block of B entries; -1 at and past num_tokens_post_pad (declared)
    num_tokens_post_pad (1,)   sum_e ceil(count_e / B) B (an expert without tokens gets no block)

All three int32 and bit-exact, on every backend and tier: there is no rounding in the op, so a kernel matches
the golden or is wrong (no noise layer, no eager tier of its own; Tol(noise_k=None)). The harness poisons the
output buffers, so a kernel must write every entry (padding and tail included).

Inputs: topk_ids (T, k) int32 drawn by the distribution (`DISTS`): each token's k experts distinct (the routers'
top-k), except that nothing in the op needs it. Neighbours differ: consecutive experts' segments hold different
slots and lengths in every dist but `single`, so a slot placed in the neighbour expert's segment, a block
labelled with the neighbour's expert or a segment cut one short or long moves entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.moe  # noqa: F401  (refimpl.moe.align below)
from kernel_parity.conformance.params import Int, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol
from kernel_parity.refimpl.moe_align import num_blocks, padded_len

DISTS = {
    "uniform": "each token's k experts uniform and distinct (a balanced router)",
    "last": "each token's last choice is expert E - 1, the other k - 1 uniform and distinct (tokens routed to the "
            "last expert: its segment ends at num_tokens_post_pad, its block at the -1 tail)",
    "skew": "most tokens on a few experts: 7/8 of the tokens choose among max(k, E / 16) hot experts with Zipf "
            "weights, the rest uniformly; many experts get no token (no block)",
    "single": "every token on the same k experts (in a random order per token): k segments of T slots each",
    "aligned": "expert counts on block edges: m B, m B + 1 and m B - 1 (and 0), the rest filled in; each token's "
               "experts distinct, in a random order",
}


def _top_k_weighted(logw: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """(T, k) distinct columns per row, drawn without replacement with weights exp(logw) (Gumbel top-k)."""
    keys = logw + rng.gumbel(size=logw.shape)
    return np.argsort(-keys, axis=-1, kind="stable")[:, :k]


def _aligned(t: int, k: int, e: int, b: int, rng: np.random.Generator) -> np.ndarray:
    """(t, k) ids with each token's experts distinct, most experts' counts on m b + {-1, 0, 1}."""
    n, left = t * k, t * k
    counts = np.zeros(e, dtype=np.int64)
    for x in rng.permutation(e):
        cap = min(t, left)
        if cap == 0:
            break
        m = int(rng.integers(0, cap // b + 1)) if cap >= b else 0
        c = m * b + int(rng.choice([-1, 0, 0, 1])) if m else int(rng.choice([0, 1, b - 1, b, b + 1]))
        counts[x] = min(max(c, 0), cap)
        left -= counts[x]
    for x in rng.permutation(e):  # the rest, where room is left (a token has at most one slot an expert)
        add = min(left, t - counts[x])
        counts[x] += add
        left -= add
    seq = np.repeat(np.arange(e), counts)  # expert runs of <= t: position p -> token p % t, column p // t
    ids = seq.reshape(k, t).T.copy() if n else np.zeros((t, k), dtype=np.int64)
    return rng.permuted(ids, axis=1)


def topk_ids(p: dict[str, Any], dist: str, rng: np.random.Generator) -> np.ndarray:
    """(T, k) int32 ids of a case."""
    t, e, k = p["t"], p["e"], p["k"]
    if dist == "uniform":
        ids = _top_k_weighted(np.zeros((t, e)), k, rng)
    elif dist == "last":
        ids = np.concatenate([_top_k_weighted(np.zeros((t, e - 1)), k - 1, rng), np.full((t, 1), e - 1)], axis=1)
    elif dist == "skew":
        hot = rng.permutation(e)[: max(k, e // 16)]
        logw = np.full((t, e), -np.inf)
        logw[:, hot] = -np.log1p(np.arange(hot.size))[None, :] * 2.0  # Zipf, exponent 2
        cold = rng.random(t) < 0.125
        logw[cold] = 0.0
        ids = _top_k_weighted(logw, k, rng)
    elif dist == "single":
        ids = rng.permuted(np.tile(rng.permutation(e)[:k], (t, 1)), axis=1)
    elif dist == "aligned":
        ids = _aligned(t, k, e, p["b"], rng)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return np.ascontiguousarray(ids, dtype=np.int32)


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"topk_ids": topk_ids(p, dist, rng)}


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    s, eids, post = refimpl.moe.align(np.asarray(x["topk_ids"], dtype=np.int32), p["e"], p["b"])
    return {"sorted_ids": s, "expert_ids": eids, "num_tokens_post_pad": post}


def _check(p: dict[str, Any]) -> str | None:
    if p["k"] > p["e"]:
        return f"k={p['k']} must be <= e={p['e']} (a token's experts are distinct)"
    if padded_len(p["t"], p["k"], p["e"], p["b"]) > np.iinfo(np.int32).max:
        return "t k + e (b - 1) entries must fit int32"
    return None


def output_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, k, e, b = p["t"], p["k"], p["e"], p["b"]
    return {"sorted_ids": (padded_len(t, k, e, b),), "expert_ids": (num_blocks(t, k, e, b),),
            "num_tokens_post_pad": (1,)}


ALIGN = OpSpec(
    name="moe.align",
    golden=refimpl.moe.align,
    reference=_ref,
    params=Schema(dict(
        t=Int(1, 1 << 20, edges=(1, 7, 4096), doc="tokens"),
        e=Int(1, 4096, edges=(1, 8, 128, 256), doc="routed experts (Mixtral 8, Qwen3-30B-A3B 128, DeepSeek-V3 256)"),
        k=Int(1, 64, edges=(1, 2, 8), doc="experts a token (Mixtral 2, Qwen3 / DeepSeek-V3 8)"),
        b=Int(1, 1024, edges=(1, 16, 32, 64, 128), doc="block size (vLLM's BLOCK_SIZE_M: 16, 32, 64, 128)"),
    )),
    make_inputs=_inputs,
    output_shapes=output_shapes,
    outputs={"sorted_ids": Output("int32", exact=True, doc="slots grouped by expert, padded with T k"),
             "expert_ids": Output("int32", exact=True, doc="each block's expert, -1 past num_tokens_post_pad"),
             "num_tokens_post_pad": Output("int32", exact=True, doc="sum of the padded segment lengths")},
    tolerance=Tol(noise_k=None),
    dtypes=("int32",),
    dists=DISTS,
    check=_check,
    baseline=None,
    doc="vLLM's moe_align_block_size: topk_ids -> slots grouped by expert in B-aligned segments, each block's "
        "expert, the padded total; bit-exact.",
)

SPECS = (ALIGN,)
