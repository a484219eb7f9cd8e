"""The MoE layer end to end in Triton: a router GEMM kernel, then our routing, alignment and experts kernels.

    layer(x, wg, w13, w2, k, *, scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask, ws13, ws2)
        -> (out (T, D) x's dtype, weights (T, k) fp32, ids (T, k) int32 in rank order)

1. `_router_gemm`: logits (T, E) fp32 = x (T, D) @ Wg (E, D)^T, a program per (BLOCK_T tokens, BLOCK_E experts),
   tl.dot over BLOCK_D slices of D with an fp32 accumulator: 16-bit operands on the tensor cores for bf16 / fp16
   (exact products, fp32 sums), "ieee" fp32 products for fp32 (never tf32). The logits stay fp32 (the op's
   declared path, refimpl/moe_layer.py): no rounding to the model dtype.
2. kernels/triton/moe.py `route` on the fp32 logits (softmax / sigmoid, bias, grouped top-k, renormalisation,
   routed scaling).
3. kernels/triton/moe_experts.py `experts` (which aligns the slots with kernels/triton/moe_align.py `align`, then
   the two fused GEMMs and the slot sum; the shared experts as S more).
Arguments: x (T, D), wg (E, D), w13 (E, 2F, D), w2 (E, D, F), ws13 / ws2 in one dtype (fp32 / bf16 / fp16);
bias (E,) fp32. Bad arguments: ValueError in one line (the router's here, the rest by the kernels called).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.triton.moe import route
from kernel_parity.kernels.triton.moe_experts import experts

__all__ = ["layer", "router_logits"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_T, BLOCK_E, BLOCK_D = 16, 32, 64


@triton.jit
def _router_gemm(X, WG, OUT, T, E, D, stride_xt, stride_we, stride_ot,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    mask_e = offs_e < E
    rows = offs_t.to(tl.int64)
    cols = offs_e.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        a = tl.load(X + rows[:, None] * stride_xt + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0)
        w = tl.load(WG + cols[None, :] * stride_we + offs_d[:, None], mask=mask_d[:, None] & mask_e[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    tl.store(OUT + rows[:, None] * stride_ot + cols[None, :], acc, mask=mask_t[:, None] & mask_e[None, :])


def router_logits(x: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 logits x @ wg^T, fp32 accumulation (module docstring, step 1)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in DTYPES:
        got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"moe.layer: x must be a (T, D) float32 / bfloat16 / float16 tensor, got {got}")
    t, d = x.shape
    if (not isinstance(wg, torch.Tensor) or wg.dim() != 2 or wg.shape[1] != d or wg.shape[0] < 1
            or wg.dtype != x.dtype or wg.device != x.device):
        got = (tuple(wg.shape), wg.dtype, wg.device) if isinstance(wg, torch.Tensor) else type(wg).__name__
        raise ValueError(f"moe.layer: wg must be (E, D={d}) of x's dtype {x.dtype} on {x.device}, got {got}")
    if x.stride(1) != 1 or wg.stride(1) != 1:
        raise ValueError(f"moe.layer: x's and wg's rows must be contiguous, got strides {x.stride()} and "
                         f"{wg.stride()}")
    e = wg.shape[0]
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(e, BLOCK_E))
    _router_gemm[grid](x, wg, out, t, e, d, x.stride(0), wg.stride(0), out.stride(0),
                       BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D, IEEE=x.dtype == torch.float32, num_warps=4)
    return out


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
