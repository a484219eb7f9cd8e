"""MoE token alignment, eager torch (the `moe` family's baseline for moe.align; refimpl/moe_align.py's semantics).

    align(topk_ids, num_experts, block_size) -> (sorted_ids (P,), expert_ids (ceil(P / B),), num_tokens_post_pad (1,))

counts by torch.bincount, the padded segments' starts by torch.cumsum, the slots grouped by expert with a stable
argsort (ascending slot within an expert, the declared order), each placed at its segment's start plus its rank;
every other entry of sorted_ids is the sentinel T k, expert_ids' blocks by repeat_interleave, -1 past
num_tokens_post_pad. All int32 (int64 inside). Arguments are refused (ValueError) as kernels/moe_args.py
says; the id range check is a device sync.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.moe_args import bad_id, check_align_args, out_sizes


def align(topk_ids: torch.Tensor, num_experts: int, block_size: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_tokens_post_pad), int32, on topk_ids' device; module docstring."""
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"moe.align: topk_ids must be a (T, k) int32 array, got {type(topk_ids).__name__}")
    T, k, E, B = check_align_args(tuple(topk_ids.shape), topk_ids.dtype, num_experts, block_size)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    if n:
        bad = (flat < 0) | (flat >= E)
        if bool(bad.any()):
            raise bad_id(flat[bad][0].item(), E)
    P, nb = out_sizes(T, k, E, B)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + B - 1) // B * B
    end = torch.cumsum(padded, 0)
    start = end - padded
    order = torch.sort(flat, stable=True).indices  # slots by expert, ascending within one
    e_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts
    pos = start[e_sorted] + torch.arange(n, device=dev) - first[e_sorted]
    sorted_ids = torch.full((P,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(E, dtype=torch.int32, device=dev), padded // B)
    expert_ids = torch.full((nb,), -1, dtype=torch.int32, device=dev)
    expert_ids[: blocks.numel()] = blocks
    return sorted_ids, expert_ids, end[-1:].to(torch.int32)
