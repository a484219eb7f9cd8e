"""Eager split-KV merge of partial attention states, as a careful PyTorch user writes it.

    M = max_i LSE_i,  w_i = exp(LSE_i - M),  LSE = M + ln sum_i w_i,  O = sum_i w_i O_i / sum_i w_i

The weights are normalised by their own sum rather than computed as exp(LSE_i - LSE): LSE is
rounded to float32, and at |LSE| ~ 6e4 that rounding (2^-8) would scale every weight by the
same wrong factor (0.4% error in O, seen with the textbook form). The weights come from the
float32 LSEs, so torch's type promotion does the weighted sum in float32 and O is rounded to
its dtype once. Empty splits (LSE = -inf) are masked out of both the weights and the values
(their O may be NaN and 0 * NaN = NaN); a row whose splits are all empty gives O = 0, LSE = -inf.
"""

from __future__ import annotations

import torch


def lse_combine(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o_parts: (splits, rows, d_v); lse_parts: (splits, rows) float32 -> (o (rows, d_v), lse (rows,))."""
    if o_parts.ndim != 3 or lse_parts.ndim != 2 or o_parts.shape[:2] != lse_parts.shape:
        raise ValueError(
            f"expected o_parts (splits, rows, d_v) and lse_parts (splits, rows), "
            f"got {tuple(o_parts.shape)} and {tuple(lse_parts.shape)}"
        )
    live = ~torch.isneginf(lse_parts)
    m = lse_parts.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.where(live, torch.exp(lse_parts - m_safe), torch.zeros_like(lse_parts))  # splits, rows
    total = w.sum(dim=0)
    lse = m_safe + torch.log(total)  # log(0) = -inf where every split is empty
    o_live = torch.where(live[..., None], o_parts, torch.zeros_like(o_parts))
    o = (w[..., None] * o_live).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return o.to(o_parts.dtype), lse


def lse_combine_backward(o_parts: torch.Tensor, lse_parts: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd through `lse_combine`: (do_parts (splits, rows, d_v) in o_parts' dtype, dlse_parts
    (splits, rows) float32) for the cotangents do (rows, d_v) and dlse (rows,).

    The forward selects empty splits out (torch.where, not a zero weight), so their gradients are
    exactly 0 and their NaN O never meets a gradient; an all-empty row's log(0) sends an infinite
    gradient only into branches torch.where discards.
    """
    with torch.enable_grad():
        og = o_parts.detach().requires_grad_(True)
        lg = lse_parts.detach().requires_grad_(True)
        o, lse = lse_combine(og, lg)
        return torch.autograd.grad([o, lse], [og, lg], [do, dlse])
