"""MoE top-k expert routing in Triton: one program per BLOCK_T tokens, a token's experts in registers.

    scores  = softmax(logits) | sigmoid(logits)                    (fp32, over the E experts)
    select  = scores + bias                                         (bias for the choice only; 0 without)
    groups  : n_group contiguous groups of E / n_group; group score = max + second max of `select` with a
              bias, max without; the topk_group best groups stay, the others' `select` becomes mask (-inf | 0)
    ids     = the k largest `select`, rank order (descending, ties to the lower index)
    weights = scores[ids], / their sum when renormalize (a zero sum: 0), * routed_scaling

Conventions (refimpl/moe.py, the float64 golden, defines them): everything in fp32 whatever the logits'
dtype. softmax subtracts the row max (a row of all -inf: scores 0) and divides each exp by the fp32 sum
with an IEEE division (tl.math.div_rn: Triton's `/` on fp32 is approximate on the GPU); exp(x - m) is
softmax.py's `exp_diff` (a few ulp). sigmoid is 1 / (1 + exp(-x)), also divided by div_rn. The experts
are loaded as a [BLOCK_T, BLOCK_G, BLOCK_S] tile (group, expert within the group; each padded to a power
of two, padding lanes never chosen), so that group scores are reductions over the last axis whatever E
and n_group are. A group's second largest value is the largest after removing the first occurrence of
its largest. Every top-g / top-k choice is rounds of: m = the largest value of the lanes still open,
index = the smallest open index holding m, close that lane; so ties go to the lower index and a
value of -inf is chosen in index order too. The k weights are gathered from the fp32 scores, summed
in rank order in fp32 and divided by that sum with div_rn, then multiplied by routed_scaling.
Logits are taken as they are: NaN / +inf (which the golden refuses) are not looked for (a device sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.triton.softmax import exp_diff

from kernel_parity.kernels.moe_args import MASKS, SCORINGS, check_route_args  # noqa: F401  (re-exported)

__all__ = ["route", "SCORINGS", "MASKS", "MAX_EXPERTS"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_EXPERTS = 1024  # a token's padded experts are held in registers
BLOCK_T_MAX = 16
TILE_LANES = 4096  # BLOCK_T * BLOCK_G * BLOCK_S at most (fewer tokens a program for wide padded rows)
BIG = tl.constexpr(2**30)  # an index past every lane


@triton.jit
def _max2(x):
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _min2(x):
    return tl.min(tl.min(x, axis=2), axis=1)


@triton.jit
def _moe_route_kernel(
    X_ptr, Bias_ptr, W_ptr, Id_ptr, T, E, GS, n_group, routed_scaling,
    stride_xt, stride_xe, stride_b, stride_wt, stride_wk, stride_it, stride_ik,
    K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, MASK_ZERO: tl.constexpr, RENORM: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    mask_t = offs_t < T
    rows = offs_t.to(tl.int64)  # rows * stride can pass 2^31 elements
    eidx = offs_g[:, None] * GS + offs_s[None, :]  # [BLOCK_G, BLOCK_S] expert index
    valid_e = (offs_g[:, None] < n_group) & (offs_s[None, :] < GS)
    eidx3 = eidx[None, :, :]
    valid3 = valid_e[None, :, :] & mask_t[:, None, None]  # [BLOCK_T, BLOCK_G, BLOCK_S]
    x = tl.load(X_ptr + rows[:, None, None] * stride_xt + eidx3.to(tl.int64) * stride_xe,
                mask=valid3, other=float("-inf")).to(tl.float32)

    if SOFTMAX:
        m = _max2(x)
        m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: every exp is 0, never -inf - -inf
        e = exp_diff(x, m[:, None, None], True)  # padding lanes: exp(-inf) = 0
        s = tl.sum(tl.sum(e, axis=2), axis=1)
        # s >= 1 when the row holds a finite logit (its max gives exp(0)); else e = 0 and 0 / 1 = 0
        s = tl.maximum(s, 1.0)
        scores = tl.math.div_rn(e, s[:, None, None] + tl.zeros_like(e))
    else:
        xs = tl.where(valid3, x, 0.0)
        den = 1.0 + tl.exp(-xs)
        scores = tl.math.div_rn(tl.full(den.shape, 1.0, tl.float32), den)
        scores = tl.where(valid3, scores, 0.0)

    sel = scores
    if HAS_BIAS:
        b = tl.load(Bias_ptr + eidx.to(tl.int64) * stride_b, mask=valid_e, other=0.0).to(tl.float32)
        sel = sel + b[None, :, :]
    sel = tl.where(valid3, sel, float("-inf"))

    if GROUPED:
        g1 = tl.max(sel, axis=2)  # [BLOCK_T, BLOCK_G]; padding groups -inf
        if TOP2:
            sidx = offs_s[None, None, :]
            first = tl.min(tl.where(sel == g1[:, :, None], sidx, BIG), axis=2)
            g2 = tl.max(tl.where(sidx == first[:, :, None], float("-inf"), sel), axis=2)
            gscore = g1 + g2
        else:
            gscore = g1
        gidx = offs_g[None, :] + tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
        gopen = gidx < n_group
        keep = gidx < 0
        for _r in range(TOPK_GROUP):
            gm = tl.max(tl.where(gopen, gscore, float("-inf")), axis=1)
            gi = tl.min(tl.where(gopen & (gscore == gm[:, None]), gidx, BIG), axis=1)
            hit = gidx == gi[:, None]
            keep = keep | hit
            gopen = gopen & ~hit
        if MASK_ZERO:
            fill = 0.0
        else:
            fill = float("-inf")
        sel = tl.where(keep[:, :, None], sel, fill)

    opened = valid3  # padding lanes (and tokens past T) are never open
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    i_tile = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    tot = tl.zeros([BLOCK_T], tl.float32)
    for r in range(K):
        mx = _max2(tl.where(opened, sel, float("-inf")))
        idx = _min2(tl.where(opened & (sel == mx[:, None, None]), eidx3, BIG))
        hit = eidx3 == idx[:, None, None]
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        opened = opened & ~hit
        tot = tot + w  # rank order
        w_tile = tl.where(offs_k[None, :] == r, w[:, None], w_tile)
        i_tile = tl.where(offs_k[None, :] == r, idx[:, None], i_tile)

    if RENORM:
        nz = tot > 0.0
        den = tl.where(nz, tot, 1.0)
        w_tile = tl.where(nz[:, None], tl.math.div_rn(w_tile, den[:, None] + tl.zeros_like(w_tile)), 0.0)
    w_tile = w_tile * routed_scaling
    mask_out = mask_t[:, None] & (offs_k[None, :] < K)
    tl.store(W_ptr + rows[:, None] * stride_wt + offs_k[None, :] * stride_wk, w_tile, mask=mask_out)
    tl.store(Id_ptr + rows[:, None] * stride_it + offs_k[None, :] * stride_ik, i_tile, mask=mask_out)


def _check_out(out: torch.Tensor | None, name: str, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"moe.route: {name} must be {shape} {dtype} on {device}, got {got}")
    return out


def route(logits: torch.Tensor, k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          mask: str = "-inf", out_weights: torch.Tensor | None = None, out_ids: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert routing of each token (refimpl/moe.py's semantics, fp32).

    logits: (T, E) fp32 / fp16 / bf16, any strides, E <= MAX_EXPERTS
    k: experts a token, 1 <= k <= topk_group * E / n_group
    scoring: "softmax" | "sigmoid"; renormalize: divide the k weights by their sum (a zero sum gives 0)
    bias: (E,) float32 on logits' device (any stride) or None, added for the selection only
    n_group, topk_group: grouped selection (n_group divides E; 1 <= topk_group <= n_group); n_group 1: none
    routed_scaling: the weights' final factor; mask: a dropped group's experts' selection, "-inf" | "zero"
    out_weights: (T, k) float32, out_ids: (T, k) int32, any strides; allocated if None
    returns: (weights, ids) in rank order (descending selection value, ties to the lower index)
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"moe.route: logits must be (T, E), got shape {shape}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"moe.route: logits dtype {logits.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    T, E = logits.shape
    check_route_args(E, k, scoring, n_group, topk_group, mask)
    if E > MAX_EXPERTS:
        raise ValueError(f"moe.route: E={E} experts; at most {MAX_EXPERTS} (a token's experts are held in registers)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,)
                             or bias.dtype != torch.float32 or bias.device != logits.device):
        got = (tuple(bias.shape), bias.dtype, bias.device) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"moe.route: bias must be ({E},) float32 on {logits.device}, got {got}")
    w = _check_out(out_weights, "out_weights", (T, k), torch.float32, logits.device)
    ids = _check_out(out_ids, "out_ids", (T, k), torch.int32, logits.device)
    if T == 0:
        return w, ids
    gs = E // n_group
    block_g = triton.next_power_of_2(n_group)
    block_s = triton.next_power_of_2(gs)
    block_t = max(1, min(BLOCK_T_MAX, triton.next_power_of_2(T), TILE_LANES // (block_g * block_s)))
    grid = (triton.cdiv(T, block_t),)
    _moe_route_kernel[grid](
        logits, logits if bias is None else bias, w, ids, T, E, gs, n_group, float(routed_scaling),
        logits.stride(0), logits.stride(1), 0 if bias is None else bias.stride(0),
        w.stride(0), w.stride(1), ids.stride(0), ids.stride(1),
        K=k, TOPK_GROUP=topk_group, BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(k), SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None,
        GROUPED=n_group > 1, TOP2=bias is not None and gs >= 2, MASK_ZERO=mask == "zero",
        RENORM=bool(renormalize), num_warps=4,
    )
    return w, ids
