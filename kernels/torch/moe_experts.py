"""The fused MoE experts layer, eager torch in the model dtype (the `moe.experts` op's eager baseline).

    experts(x, ids, weights, w13, w2, *, ws13=None, ws2=None) -> out (T, D), x's dtype

Hugging Face's Mixtral sparse block (MixtralSparseMoeBlock.forward, transformers' modeling_mixtral.py), with
vLLM's w13 layout: the routing weights cast to the model dtype, then for each expert that some token chose,
the tokens gathered (index), gate and up from one matmul (the first F rows of w13[e] the gate), silu(gate) * up,
the down matmul, times each token's routing weight, index_add into a zero output in the model dtype; the shared
experts' MLP output added last (DeepSeek-V3's `y + shared_experts(identity)`). int4 (GPTQ v1) weights are
dequantized an expert at a time into the model dtype (`dequant_int4`), as a torch fallback does. Every matmul
and elementwise op runs in x's dtype, as the eager model does: gate, up, silu, the product, the down output, the
weighted slot and each index_add round to it. The golden rounds act alone (refimpl/moe_experts.py): this
baseline carries the others, judged in its own tier (conformance/ops/moe_experts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_parity.kernels.cpu.moe_experts import check_experts_args


def dequant_int4(w: dict, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of a GPTQ v1 int4 weight (kernels/cpu/moe_experts.py `weight_shape`) as a dense (N, K) matrix in
    `dtype`: s (q - z) formed in fp32 (exact), then rounded to the model dtype, as a torch fallback dequantizes."""
    qw, qz, sc = w["qweight"][e], w["qzeros"][e], w["scales"][e]
    shifts = 4 * torch.arange(8, device=qw.device, dtype=torch.int32)
    k8, n = qw.shape
    q = ((qw[:, None, :] >> shifts[None, :, None]) & 15).reshape(k8 * 8, n)
    z = (((qz[:, :, None] >> shifts[None, None, :]) & 15) + 1).reshape(qz.shape[0], n)
    g = k8 * 8 // sc.shape[0]
    wt = sc.float().repeat_interleave(g, dim=0) * (q - z.repeat_interleave(g, dim=0)).float()
    return wt.t().to(dtype)


def _dense(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    return dequant_int4(w, e, dtype) if isinstance(w, dict) else w[e]


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    f = w13.shape[0] // 2
    h = x @ w13.t()
    return (F.silu(h[:, :f]) * h[:, f:]) @ w2.t()


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
            ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D) in x's dtype: the routed experts' weighted sum plus the shared experts, HF Mixtral's loop."""
    t, d, e, f, k, s, fs = check_experts_args(x, ids, weights, w13, w2, ws13, ws2)
    tensors = {"x": x, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if ws13 is not None else {})}
    for name, a in tensors.items():
        if isinstance(a, dict) and name != "x":
            if any(not isinstance(v, torch.Tensor) for v in a.values()):
                raise ValueError(f"moe.experts: int4 {name}'s parts must be tensors")
        elif not isinstance(a, torch.Tensor) or a.dtype != x.dtype or not a.dtype.is_floating_point:
            raise ValueError(f"moe.experts: {name} must be a float tensor of x's dtype {getattr(x, 'dtype', None)}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("moe.experts: ids must be an int32 / int64 tensor")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"moe.experts: ids must be in [0, E={e})")
    out = torch.zeros_like(x)
    rw = weights.to(x.dtype)
    mask = F.one_hot(ids.long(), num_classes=e).permute(2, 1, 0)  # E, k, T (HF's expert_mask)
    hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten()
    for expert in hit.tolist():
        slot, tok = torch.where(mask[expert])
        y = _mlp(x[tok], _dense(w13, expert, x.dtype), _dense(w2, expert, x.dtype)) * rw[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    for j in range(s):
        out = out + _mlp(x, _dense(ws13, j, x.dtype), _dense(ws2, j, x.dtype))
    return out
