"""Eager softmax and online softmax with torch's own ops, in the input's dtype (the noise baseline).

    softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m),   m = max_k x_k
    lse          = m + ln sum_k exp(x_k - m)             (natural log, float32)

This is what a careful PyTorch user writes: `torch.softmax` on the fp16/bf16 tensor (torch
accumulates in float32 inside and rounds the output once, as FlashAttention's reference does for
its probabilities) and `torch.logsumexp` on the float32 upcast for the fp32 statistic. torch's
softmax of an all -inf row is NaN; the convention here is 0, so such rows are selected out.
"""

from __future__ import annotations

import torch


def softmax(x: torch.Tensor) -> torch.Tensor:
    """x: (rows, n) -> (rows, n) in x.dtype."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (rows, n), got shape {tuple(x.shape)}")
    empty = torch.isneginf(x).all(dim=-1, keepdim=True)  # all -inf rows (n == 0 too)
    return torch.where(empty, torch.zeros((), dtype=x.dtype, device=x.device), torch.softmax(x, dim=-1))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x: (rows, n) -> (rows,) float32; -inf for an all -inf row."""
    return torch.logsumexp(x.float(), dim=-1)


def online_softmax(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same outputs as the streaming kernels: (softmax in x.dtype, lse in float32).

    The eager baseline does not stream: its job is the error of a same-precision eager
    implementation, the yardstick for the streaming kernels.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return softmax(x), logsumexp(x)
