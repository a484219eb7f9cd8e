"""The MoE layer end to end, eager torch in the Hugging Face style (the `moe.layer` op's eager baseline).

    layer(x, wg, w13, w2, k, *, scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask, ws13, ws2)
        -> (out (T, D) x's dtype, weights (T, k) fp32, ids (T, k) int32 in rank order)

Router: F.linear on fp32 casts of x and Wg (transformers' DeepseekV3TopkRouter: the logits in fp32, the op's
declared path; Mixtral's and Qwen3-MoE's HF gates would round them to the model dtype). Routing in fp32 as the HF
blocks do it: softmax / sigmoid scores, the bias added for the choice, grouped selection by torch.topk over the
group scores (the two best with a bias, the best without) and masked_fill of the dropped groups' experts (-inf or
0), the k experts by torch.topk, their scores gathered, divided by their sum (renormalize), times the routed
scaling. Experts: kernels/torch/moe_experts.py `experts` (HF Mixtral's loop over the experts in the model dtype,
then the shared experts' MLP added). torch.topk orders ties as it likes: the op's inputs have none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_parity.kernels.moe_args import check_route_args
from kernel_parity.kernels.torch.moe_experts import experts

__all__ = ["layer", "router_logits", "route"]


def router_logits(x: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 logits: F.linear(x.float(), wg.float())."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"moe.layer: x must be a (T, D) float tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if (not isinstance(wg, torch.Tensor) or wg.dim() != 2 or wg.shape[1] != x.shape[1] or wg.shape[0] < 1
            or wg.dtype != x.dtype):
        got = (tuple(wg.shape), wg.dtype) if isinstance(wg, torch.Tensor) else type(wg).__name__
        raise ValueError(f"moe.layer: wg must be (E, D={x.shape[1]}) of x's dtype {x.dtype}, got {got}")
    return F.linear(x.float(), wg.float())


def route(logits: torch.Tensor, k: int, *, scoring: str, renormalize: bool, bias: torch.Tensor | None,
          n_group: int, topk_group: int, routed_scaling: float, mask: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, ids (T, k) int32) of fp32 logits, the HF way (module docstring)."""
    t, e = logits.shape
    check_route_args(e, k, scoring, n_group, topk_group, mask)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (e,)):
        raise ValueError(f"moe.layer: bias must be an ({e},) tensor, got {getattr(bias, 'shape', bias)!r}")
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    select = scores if bias is None else scores + bias.float()[None, :]
    if n_group > 1:
        grouped = select.view(t, n_group, e // n_group)
        if bias is not None and e // n_group >= 2:
            gscore = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            gscore = grouped.max(dim=-1).values
        gidx = torch.topk(gscore, k=topk_group, dim=-1)[1]
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        select = select.masked_fill(~smask.bool(), float("-inf") if mask == "-inf" else 0.0)
    ids = torch.topk(select, k=k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        tot = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(tot > 0, weights / torch.where(tot > 0, tot, torch.ones_like(tot)), 0.0)
    return weights * float(routed_scaling), ids.to(torch.int32)


def layer(x: torch.Tensor, wg: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k: int, *,
          scoring: str = "softmax", renormalize: bool = True, bias: torch.Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, routed_scaling: float = 1.0, mask: str = "-inf", ws13: torch.Tensor | None = None,
          ws2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (T, D) in x's dtype, weights (T, k) fp32, ids (T, k) int32 in rank order): module docstring."""
    logits = router_logits(x, wg)
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[0] != wg.shape[0]:
        got = tuple(w13.shape) if isinstance(w13, torch.Tensor) else type(w13).__name__
        raise ValueError(f"moe.layer: w13 must be (E={wg.shape[0]}, 2F, D) like the router's experts, got {got}")
    weights, ids = route(logits, k, scoring=scoring, renormalize=renormalize, bias=bias, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, mask=mask)
    out = experts(x, ids, weights, w13, w2, ws13=ws13, ws2=ws2)
    return out, weights, ids
