"""Eager softmax and online softmax in the input's dtype (the noise baseline).

    softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m),   m = max_k x_k
    lse          = m + ln sum_k exp(x_k - m)             (natural log, computed in float32)

Rows of all -inf give 0 and LSE -inf: the max of such a row is replaced by 0 before the
subtraction, as FlashAttention's Check_inf does, so -inf - -inf is never evaluated.
"""

from __future__ import annotations

import torch


def _safe_max(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(dim=-1, keepdim=True)
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """x: (rows, n) -> (rows, n), every step in x.dtype."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (rows, n), got shape {tuple(x.shape)}")
    e = torch.exp(x - _safe_max(x))
    s = e.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x: (rows, n) -> (rows,) float32; the statistic is upcast, as an fp32 output must be."""
    xf = x.float()
    m = _safe_max(xf)
    s = torch.exp(xf - m).sum(dim=-1, keepdim=True)
    return (m + torch.log(s)).squeeze(-1)  # log(0) = -inf for an all -inf row


def online_softmax(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same outputs as the streaming kernel: (softmax in x.dtype, lse in float32).

    The eager baseline need not stream: its job is the error a same-precision textbook
    implementation makes, which is the yardstick for the streaming kernels.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return softmax(x), logsumexp(x)
