"""MoE top-k routing, eager torch (the `moe` family's baseline; the semantics of refimpl/moe.py).

    route(logits, k, *, scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask) -> (weights, ids)

In fp32 whatever the logits' dtype, as the engines route (Mixtral's softmax and DeepSeek-V3's gate run in fp32):
scores by torch.softmax / torch.sigmoid, the selection by a stable descending sort (ties to the lower index,
the declared convention; torch.topk leaves tie order unspecified), group scores by the two largest (bias) or
the largest (no bias). weights (T, k) fp32 and ids (T, k) int32 in rank order.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.moe_args import check_route_args


def _check(logits, k, scoring, bias, n_group, topk_group, mask) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"moe.route: logits must be a (T, E) float tensor, got {getattr(logits, 'shape', logits)!r}")
    E = logits.shape[1]
    check_route_args(E, k, scoring, n_group, topk_group, mask)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,)):
        raise ValueError(f"moe.route: bias must be an ({E},) tensor, got {getattr(bias, 'shape', bias)!r}")


def route(logits: torch.Tensor, k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          mask: str = "-inf") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, ids (T, k) int32), rank order; refimpl/moe.py's conventions."""
    _check(logits, k, scoring, bias, n_group, topk_group, mask)
    x = logits.float()
    T, E = x.shape
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    scores = torch.nan_to_num(scores, nan=0.0)  # a row of all -inf: softmax 0 (the golden's convention)
    select = scores if bias is None else scores + bias.float()[None, :]
    if n_group > 1:
        grouped = select.view(T, n_group, E // n_group)
        if bias is not None and E // n_group >= 2:
            gscore = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(dim=-1)
        else:
            gscore = grouped.max(dim=-1).values
        gorder = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=x.device).scatter_(1, gorder, True)
        fill = float("-inf") if mask == "-inf" else 0.0
        select = select.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), fill)
    ids = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, ids)
    if renormalize:
        tot = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(tot > 0, weights / torch.where(tot > 0, tot, torch.ones_like(tot)), 0.0)
    return weights * float(routed_scaling), ids.to(torch.int32)
