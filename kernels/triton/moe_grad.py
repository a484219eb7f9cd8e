"""The backward of MoE routing weights in Triton (moe.route_backward): one program per BLOCK_T tokens, a token's
E experts in registers.

    s       = softmax(logits) | sigmoid(logits)                      (fp32, over the E experts)
    S       = sum_j s[ids_j],  p_j = s[ids_j] / S                    (the k chosen, slot order)
    g_s     = c (grad_w_j - sum_m grad_w_m p_m) / S at ids_j (renormalize; S = 0: 0) | c grad_w_j; 0 elsewhere
    grad    = s (g_s - r), r = sum_j g_s[ids_j] s[ids_j]              (softmax)
            | g_s s (1 - s)                                           (sigmoid)

The choice (ids) is given; the bias and the grouping take no part (refimpl/moe_grad.py, the float64 golden,
defines the op; the wrapper checks them). Everything in fp32 whatever the logits' dtype. softmax as
kernels/triton/moe.py (the row max subtracted, softmax.py's `exp_diff`, an IEEE division by the fp32 sum:
tl.math.div_rn). sigmoid from a = exp(-|x|): 1 / (1 + a) and a / (1 + a) are s and 1 - s by the sign of x
(div_rn), so 1 - s keeps its relative precision where s is near 1. A slot's score is gathered by a masked
sum over the row (a one-hot of its id); the k-term sums run in slot order; (grad_w_j - sum grad_w p) / S
rather than grad_w_j / S - D / S^2, which S^2 could underflow, and with k = 1 exactly 0 (p = s / s = 1: the
one weight is the constant c). Unchosen experts of a softmax row get -s r (0 up to
rounding with renormalize). ids and grad_w values are not checked here (a device sync): an id outside [0, E)
matches no expert (its slot is dropped), equal ids add up; the other kernels and the golden refuse both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.moe_args import check_route_args
from kernel_parity.kernels.triton.softmax import exp_diff

__all__ = ["route_backward", "MAX_EXPERTS"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_EXPERTS = 1024  # a token's padded experts are held in registers
BLOCK_T_MAX = 16
TILE_LANES = 4096  # BLOCK_T * BLOCK_E at most


@triton.jit
def _moe_route_backward_kernel(
    X_ptr, Id_ptr, Gw_ptr, G_ptr, T, E, routed_scaling,
    stride_xt, stride_xe, stride_it, stride_ik, stride_wt, stride_wk, stride_gt, stride_ge,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    rows = offs_t.to(tl.int64)  # rows * stride can pass 2^31 elements
    valid = mask_t[:, None] & (offs_e[None, :] < E)
    x = tl.load(X_ptr + rows[:, None] * stride_xt + offs_e[None, :].to(tl.int64) * stride_xe,
                mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        m = tl.max(x, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: every exp is 0
        e = exp_diff(x, m[:, None], True)
        tot = tl.maximum(tl.sum(e, axis=1), 1.0)  # >= 1 with a finite logit; else e = 0 and 0 / 1 = 0
        s = tl.math.div_rn(e, tot[:, None] + tl.zeros_like(e))
        q = tl.zeros_like(s)
    else:
        xs = tl.where(valid, x, 0.0)
        a = tl.exp(-tl.abs(xs))
        one = tl.full(a.shape, 1.0, tl.float32)
        big = tl.math.div_rn(one, one + a)
        small = tl.math.div_rn(a, one + a)
        pos = xs >= 0.0
        s = tl.where(valid, tl.where(pos, big, small), 0.0)
        q = tl.where(valid, tl.where(pos, small, big), 0.0)

    S = tl.zeros([BLOCK_T], tl.float32)
    for j in range(K):
        idj = tl.load(Id_ptr + rows * stride_it + j * stride_ik, mask=mask_t, other=-1)
        S = S + tl.sum(tl.where(offs_e[None, :] == idj[:, None], s, 0.0), axis=1)
    nz = S > 0.0
    Sd = tl.where(nz, S, 1.0)
    DS = tl.zeros([BLOCK_T], tl.float32)  # sum_m grad_w_m p_m, p = s / S
    for j in range(K):
        idj = tl.load(Id_ptr + rows * stride_it + j * stride_ik, mask=mask_t, other=-1)
        gwj = tl.load(Gw_ptr + rows * stride_wt + j * stride_wk, mask=mask_t, other=0.0).to(tl.float32)
        sj = tl.sum(tl.where(offs_e[None, :] == idj[:, None], s, 0.0), axis=1)
        DS = DS + gwj * tl.math.div_rn(sj, Sd)

    gs = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    r = tl.zeros([BLOCK_T], tl.float32)
    for j in range(K):
        idj = tl.load(Id_ptr + rows * stride_it + j * stride_ik, mask=mask_t, other=-1)
        gwj = tl.load(Gw_ptr + rows * stride_wt + j * stride_wk, mask=mask_t, other=0.0).to(tl.float32)
        hit = offs_e[None, :] == idj[:, None]
        sj = tl.sum(tl.where(hit, s, 0.0), axis=1)
        if RENORM:
            gj = tl.where(nz, tl.math.div_rn(gwj - DS, Sd), 0.0)
        else:
            gj = gwj
        gj = gj * routed_scaling
        gs = gs + tl.where(hit, gj[:, None], 0.0)
        r = r + gj * sj

    if SOFTMAX:
        grad = s * (gs - r[:, None])
    else:
        grad = gs * s * q
    tl.store(G_ptr + rows[:, None] * stride_gt + offs_e[None, :] * stride_ge, grad, mask=valid)


def route_backward(logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor, *, scoring: str = "softmax",
                   renormalize: bool = True, bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   routed_scaling: float = 1.0, mask: str = "-inf", out: torch.Tensor | None = None) -> torch.Tensor:
    """grad_logits (T, E) float32 of the routing weights' cotangent (refimpl/moe_grad.py's semantics, fp32).

    logits: (T, E) fp32 / fp16 / bf16, any strides, E <= MAX_EXPERTS
    ids: (T, k) int32 / int64 on logits' device, any strides: the forward's choice (distinct, in [0, E))
    grad_w: (T, k) fp32 / fp16 / bf16 on logits' device, any strides: the weights' cotangent, in ids' order
    scoring, renormalize, routed_scaling: the forward's; bias ((E,) float32 or None), n_group, topk_group,
    mask: the forward's, checked, no part in the gradient
    out: (T, E) float32 on logits' device, any strides; allocated if None
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"moe.route_backward: logits must be (T, E), got shape {shape}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"moe.route_backward: logits dtype {logits.dtype} not supported; expected one of "
                         f"{SUPPORTED_DTYPES}")
    T, E = logits.shape
    dev = logits.device
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != T
            or ids.dtype not in (torch.int32, torch.int64) or ids.device != dev):
        got = (tuple(ids.shape), ids.dtype, ids.device) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"moe.route_backward: ids must be ({T}, k) int32 / int64 on {dev}, got {got}")
    k = ids.shape[1]
    if (not isinstance(grad_w, torch.Tensor) or tuple(grad_w.shape) != (T, k) or grad_w.dtype not in SUPPORTED_DTYPES
            or grad_w.device != dev):
        got = (tuple(grad_w.shape), grad_w.dtype, grad_w.device) if isinstance(grad_w, torch.Tensor) \
            else type(grad_w).__name__
        raise ValueError(f"moe.route_backward: grad_w must be ({T}, {k}) float on {dev}, got {got}")
    check_route_args(E, k, scoring, n_group, topk_group, mask)
    if E > MAX_EXPERTS:
        raise ValueError(f"moe.route_backward: E={E} experts; at most {MAX_EXPERTS} (a token's experts are held "
                         f"in registers)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,)
                             or bias.dtype != torch.float32 or bias.device != dev):
        got = (tuple(bias.shape), bias.dtype, bias.device) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"moe.route_backward: bias must be ({E},) float32 on {dev}, got {got}")
    if out is None:
        out = torch.empty((T, E), dtype=torch.float32, device=dev)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, E) or out.dtype != torch.float32
          or out.device != dev):
        got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"moe.route_backward: out must be ({T}, {E}) float32 on {dev}, got {got}")
    if T == 0:
        return out
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(BLOCK_T_MAX, triton.next_power_of_2(T), TILE_LANES // block_e))
    grid = (triton.cdiv(T, block_t),)
    _moe_route_backward_kernel[grid](
        logits, ids, grad_w, out, T, E, float(routed_scaling),
        logits.stride(0), logits.stride(1), ids.stride(0), ids.stride(1), grad_w.stride(0), grad_w.stride(1),
        out.stride(0), out.stride(1),
        K=k, BLOCK_T=block_t, BLOCK_E=block_e, SOFTMAX=scoring == "softmax", RENORM=bool(renormalize),
        num_warps=4,
    )
    return out
