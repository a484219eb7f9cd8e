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


def _rows_with_mass(x: torch.Tensor) -> torch.Tensor:
    """(rows, 1) True where the row holds a finite logit."""
    return ~torch.isneginf(x).all(dim=-1, keepdim=True)


def softmax_backward(x: torch.Tensor, dy: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """Autograd through the eager forward in x.dtype: dx = d<dy, softmax(x)> (+ d<dlse, logsumexp(x)>) / dx.

    x, dy: (rows, n) in one dtype; dlse: (rows,) float32 or None -> dx (rows, n) in x.dtype.
    torch's softmax backward multiplies the gradient by the row's output, and the forward's
    torch.where hands a zero gradient to torch.softmax's NaN row: 0 * NaN. An all -inf row's
    gradient is 0 by the convention, so such rows are selected out here as in the forward.
    """
    if x.ndim != 2 or dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"x and dy must be (rows, n) of one dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(dy.shape)} {dy.dtype}")
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        outs, cots = [softmax(xg)], [dy]
        if dlse is not None:
            outs.append(logsumexp(xg))
            cots.append(dlse)
        (dx,) = torch.autograd.grad(outs, xg, cots)
    return torch.where(_rows_with_mass(x), dx, torch.zeros((), dtype=dx.dtype, device=dx.device))


def online_softmax_backward(x: torch.Tensor, tile: int, dy: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """Autograd through `online_softmax` (outputs y and lse): dx in x.dtype."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return softmax_backward(x, dy, dlse)
