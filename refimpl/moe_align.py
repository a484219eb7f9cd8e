"""Golden MoE token alignment (vLLM's moe_align_block_size): the `moe` family's `moe.align`, exact integers.

A fused MoE GEMM (vLLM's fused_moe Triton kernel) multiplies BLOCK_SIZE_M rows of tokens by one expert's
weights a program; before it, the T x k (token, expert) pairs are grouped by expert, each expert's group padded
to a whole number of blocks, and each block labelled with its expert:

    slot      s = t k + j           the j-th choice of token t (topk_ids.flatten() order), 0 <= s < T k
    count_e   = #{s : topk_ids.flat[s] == e}                         (the histogram over the E experts)
    padded_e  = ceil(count_e / B) B                                  (an expert without tokens: 0, no block)
    start_e   = padded_0 + ... + padded_{e-1}                        (exclusive cumsum of the padded counts)
    num_tokens_post_pad = start_E = sum_e padded_e                   ((1,) int32)
    sorted_ids[start_e : start_e + count_e] = expert e's slots in ascending slot order
    sorted_ids[start_e + count_e : start_e + padded_e] = T k        (the sentinel: "no row", past every slot)
    sorted_ids[num_tokens_post_pad :] = T k                          (P = T k + E (B - 1) entries in all: vLLM's
                                                                      max_num_tokens_padded, the most any routing
                                                                      can need)
    expert_ids[i] = the expert e with start_e <= i B < start_e + padded_e, for i B < num_tokens_post_pad;
                    -1 for every block from num_tokens_post_pad / B on  (ceil(P / B) entries)

Conventions (declared; vLLM's csrc/moe/moe_align_sum_kernels.cu leaves some to its thread schedule):
- Within an expert, slots come in ascending order: a stable counting sort. vLLM's CUDA kernel places a
  segment's slots by atomics (any order); its fused GEMM does not depend on the order, our kernels all keep it.
- The tail of expert_ids (blocks at or past num_tokens_post_pad) is -1 (vLLM's contract leaves it open: its
  fused GEMM stops at num_tokens_post_pad, and -1 is what it reads as "no expert" under expert parallelism). The tail of sorted_ids is the sentinel T k
  (vLLM fills the whole buffer with topk_ids.numel() first).
- P = T k + E (B - 1) always (vLLM's classic max_num_tokens_padded; recent vLLM shrinks its buffer to T k B
  when T k < E, and may round P up to B with pad_sorted_ids: both leave the first num_tokens_post_pad entries
  as here). expert_ids has ceil(P / B) entries (SGLang's test allocates floor(P / B)).
- A token may name an expert more than once (nothing here needs distinct ids; the routers give distinct ones).
- T = 0 is allowed: every entry the sentinel 0, every block -1, num_tokens_post_pad 0.
- Refused, ValueError in one line (the kernels refuse the same: kernels/moe_args.py): topk_ids not a 2-D
  int32 array, an id outside [0, E), num_experts or block_size not an int >= 1, more slots or padded entries
  than int32 holds.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

INT32_MAX = np.iinfo(np.int32).max


def padded_len(T: int, k: int, E: int, B: int) -> int:
    """P = T k + E (B - 1): vLLM's max_num_tokens_padded, sorted_ids' length."""
    return T * k + E * (B - 1)


def num_blocks(T: int, k: int, E: int, B: int) -> int:
    """ceil(P / B): expert_ids' length."""
    return -(-padded_len(T, k, E, B) // B)


def align(topk_ids: NDArray, num_experts: int, block_size: int
          ) -> tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.int32]]:
    """(sorted_ids (P,), expert_ids (ceil(P / B),), num_tokens_post_pad (1,)), all int32; module docstring.

    topk_ids: (T, k) int32, every id in [0, num_experts); num_experts E >= 1; block_size B >= 1 (vLLM's
    BLOCK_SIZE_M: 16, 32, 64, 128).
    """
    ids = topk_ids if isinstance(topk_ids, np.ndarray) else None
    if ids is None or ids.ndim != 2 or ids.dtype != np.int32:
        got = f"{ids.dtype} shape {tuple(ids.shape)}" if ids is not None else type(topk_ids).__name__
        raise ValueError(f"moe.align: topk_ids must be a (T, k) int32 array, got {got}")
    if isinstance(num_experts, bool) or not hasattr(num_experts, "__index__") or num_experts < 1:
        raise ValueError(f"moe.align: num_experts={num_experts!r} must be an int >= 1")
    if isinstance(block_size, bool) or not hasattr(block_size, "__index__") or block_size < 1:
        raise ValueError(f"moe.align: block_size={block_size!r} must be an int >= 1")
    T, k = ids.shape
    E, B = int(num_experts), int(block_size)
    P = padded_len(T, k, E, B)
    if P > INT32_MAX:
        raise ValueError(f"moe.align: T k + E (B - 1) = {P} entries do not fit int32 (at most {INT32_MAX})")
    flat = ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= E):
        bad = flat[(flat < 0) | (flat >= E)][0]
        raise ValueError(f"moe.align: expert id {int(bad)} outside [0, num_experts={E})")
    n = flat.size
    counts = np.bincount(flat, minlength=E).astype(np.int64)
    padded = -(-counts // B) * B
    end = np.cumsum(padded)
    start = end - padded
    total = int(end[-1])
    order = np.argsort(flat, kind="stable")  # slots grouped by expert, ascending within one
    first = np.cumsum(counts) - counts  # where each expert's run begins in `order`
    e_sorted = flat[order]
    pos = start[e_sorted] + (np.arange(n) - first[e_sorted])
    sorted_ids = np.full(P, n, dtype=np.int32)
    sorted_ids[pos] = order
    nb = -(-P // B)
    expert_ids = np.full(nb, -1, dtype=np.int32)
    expert_ids[: total // B] = np.repeat(np.arange(E, dtype=np.int32), padded // B)
    return sorted_ids, expert_ids, np.array([total], dtype=np.int32)
