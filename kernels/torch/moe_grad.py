"""The backward of MoE routing weights, eager torch (moe.route_backward's baseline; refimpl/moe_grad.py's semantics).

    route_backward(logits, ids, grad_w, *, scoring, renormalize, bias, n_group, topk_group, routed_scaling,
                   mask) -> grad_logits (T, E) float32

torch autograd through the eager router's weights (kernels/torch/moe.py's scoring: torch.softmax /
torch.sigmoid in fp32 whatever the logits' dtype, gather, renormalise, scale) with the choice ids held fixed,
what a training framework computes through Hugging Face's Mixtral / DeepSeek-V3 routers: the bias and the
grouping take no part (checked only). ids (T, k) int, distinct per token, in [0, E); grad_w (T, k) float,
the cotangent of the weights in the order of ids. renormalize with a zero sum gives weights 0 (a constant):
gradient 0. The arguments are refused (ValueError) under the golden's conditions.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.moe_args import check_route_args


def check_backward_args(logits, ids, grad_w, bias, k_check) -> tuple[int, int, int]:
    """(T, E, k) of valid tensors, else ValueError (one line)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"moe.route_backward: logits must be a (T, E) float tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)!r}")
    T, E = logits.shape
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != T
            or ids.dtype not in (torch.int32, torch.int64) or ids.device != logits.device):
        got = (tuple(ids.shape), ids.dtype, ids.device) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"moe.route_backward: ids must be ({T}, k) int32 / int64 on {logits.device}, got {got}")
    k = ids.shape[1]
    if (not isinstance(grad_w, torch.Tensor) or tuple(grad_w.shape) != (T, k) or not grad_w.dtype.is_floating_point
            or grad_w.device != logits.device):
        got = (tuple(grad_w.shape), grad_w.dtype, grad_w.device) if isinstance(grad_w, torch.Tensor) \
            else type(grad_w).__name__
        raise ValueError(f"moe.route_backward: grad_w must be ({T}, {k}) float on {logits.device}, got {got}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,)):
        raise ValueError(f"moe.route_backward: bias must be an ({E},) tensor, got {getattr(bias, 'shape', bias)!r}")
    k_check(E, k)
    return T, E, k


def route_backward(logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor, *, scoring: str = "softmax",
                   renormalize: bool = True, bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   routed_scaling: float = 1.0, mask: str = "-inf") -> torch.Tensor:
    """grad_logits (T, E) float32: autograd of the eager router's weights, ids fixed."""
    T, E, k = check_backward_args(logits, ids, grad_w, bias,
                                  lambda e, kk: check_route_args(e, kk, scoring, n_group, topk_group, mask))
    if T and k and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"moe.route_backward: ids must be in [0, {E}), got [{int(ids.min())}, {int(ids.max())}]")
    if T and k > 1 and bool((torch.sort(ids, dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("moe.route_backward: a token's ids must be distinct (the forward's choice)")
    with torch.enable_grad():
        x = logits.detach().float().requires_grad_(True)
        scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
        weights = scores.gather(1, ids.long())
        if renormalize:
            tot = weights.sum(dim=-1, keepdim=True)
            weights = torch.where(tot > 0, weights / torch.where(tot > 0, tot, torch.ones_like(tot)), 0.0)
        weights = weights * float(routed_scaling)
        (grad,) = torch.autograd.grad(weights, x, grad_outputs=grad_w.float())
    return grad
