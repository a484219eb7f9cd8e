"""The fused MoE experts layer, eager torch in the model dtype (the `moe.experts` op's eager baseline).

    experts(x, ids, weights, w13, w2, *, ws13=None, ws2=None, act_fp8=False) -> out (T, D), x's dtype

Hugging Face's Mixtral sparse block (MixtralSparseMoeBlock.forward, transformers' modeling_mixtral.py), with
vLLM's w13 layout: the routing weights cast to the model dtype, then for each expert that some token chose,
the tokens gathered (index), gate and up from one matmul (the first F rows of w13[e] the gate), silu(gate) * up,
the down matmul, times each token's routing weight, index_add into a zero output in the model dtype; the shared
experts' MLP output added last (DeepSeek-V3's `y + shared_experts(identity)`). int4 (GPTQ v1) weights are
dequantized an expert at a time into the model dtype (`dequant_int4`), as a torch fallback does; so are block-FP8
weights (w8a16: code x block scale in fp32, then rounded: `dequant_fp8`) and GGML weights ({"fmt", "blocks"}:
kernels/torch/quant.py `dequantize`, ggml's dequantize_row_* in fp32, then rounded: `dequant_ggml`; w-only, as
transformers' GGUF loading dequantizes the experts into the model dtype). Every matmul
and elementwise op runs in x's dtype, as the eager model does: gate, up, silu, the product, the down output, the
weighted slot and each index_add round to it. The golden rounds act alone (refimpl/moe_experts.py): this
baseline carries the others, judged in its own tier (conformance/ops/moe_experts.py).

w8a8 (act_fp8, block-FP8 weights): vLLM's own test reference (torch_w8a8_block_fp8_moe, tests/kernels/moe): x
quantized per token per 128 columns (`group_quant_fp8`: amax / 448, the IEEE division, clamp, e4m3fn), gate / up
as fp32 matmuls of the dequantized codes (its native_w8a8_block_matmul), SwiGLU in fp32, act rounded to the model
dtype and quantized alike, the down projection in fp32, each slot's output rounded to the model dtype, weighted
and index_added in it (the loop above). Unlike vLLM's reference, gate / up stay fp32 (it rounds them to the model
dtype): a bf16 gate / up moves act by ~u, which flips ~3% of act's e4m3 codes (2^-4 apart) and moves ~45% of the
groups' scales (N(0, 1) gate and up, measured), an error the baseline tier is not made for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_parity.kernels.cpu.moe_experts import check_act_fp8, check_experts_args


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


FP8_BLOCK = 128


def dequant_fp8(w: dict, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of a block-FP8 weight (codes (E, N, K) float8_e4m3fn, scales (E, ceil(N/128), ceil(K/128)) fp32) as a
    dense (N, K) matrix: code x its block's scale in fp32 (one rounding), then cast to `dtype`."""
    c, sc = w["codes"][e], w["scales"][e]
    n, k = c.shape
    full = sc.float().repeat_interleave(FP8_BLOCK, dim=0)[:n].repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
    return (c.float() * full).to(dtype)


def group_quant_fp8(v: torch.Tensor) -> torch.Tensor:
    """v (n, L) quantized per row per 128 columns (s = fp32 amax / 448, codes e4m3fn(clamp(v / s, +-448)), the IEEE
    division; s = 0: codes 0), read back as code x s in fp32."""
    n, length = v.shape
    groups = -(-length // FP8_BLOCK)
    pad = torch.zeros((n, groups * FP8_BLOCK), dtype=torch.float32, device=v.device)
    pad[:, :length] = v.float()
    pad = pad.view(n, groups, FP8_BLOCK)
    amax = pad.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by float32(1 / 448), one ulp off the IEEE
    # division at some groups (an H200 failed 3 of the ci suite's w8a8 torch cases that way)
    s = amax / torch.full_like(amax, 448.0)
    codes = torch.where(s == 0, torch.zeros_like(pad), pad / torch.where(s == 0, torch.ones_like(s), s))
    codes = codes.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (codes.float() * s).view(n, -1)[:, :length]


def dequant_ggml(w: dict, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of a GGML weight ({"fmt": format, "blocks": (E, N, K / QK * nbytes) uint8}) as a dense (N, K) matrix:
    ggml's dequantize_row_* in fp32 (kernels/torch/quant.py), then cast to `dtype`."""
    from kernel_parity.kernels.torch.quant import dequantize

    return dequantize(w["fmt"], w["blocks"][e]).to(dtype)


def _dense(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, dict) and "fmt" in w:
        return dequant_ggml(w, e, dtype)
    if isinstance(w, dict):
        return dequant_fp8(w, e, dtype) if "codes" in w else dequant_int4(w, e, dtype)
    return w[e]


def _mlp_a8(xq: torch.Tensor, w13: dict, w2: dict, e: int, dtype: torch.dtype) -> torch.Tensor:
    """w8a8: xq the quantized rows (fp32), expert e's block-FP8 w13 / w2 dequantized in fp32; gate / up and SwiGLU
    in fp32, act rounded to `dtype` and quantized, the slot outputs rounded to `dtype`."""
    a, b = dequant_fp8(w13, e, torch.float32), dequant_fp8(w2, e, torch.float32)
    f = a.shape[0] // 2
    h = xq @ a.t()
    act = (F.silu(h[:, :f]) * h[:, f:]).to(dtype)
    return (group_quant_fp8(act) @ b.t()).to(dtype)


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    f = w13.shape[0] // 2
    h = x @ w13.t()
    return (F.silu(h[:, :f]) * h[:, f:]) @ w2.t()


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
            ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None, act_fp8: bool = False) -> torch.Tensor:
    """(T, D) in x's dtype: the routed experts' weighted sum plus the shared experts, HF Mixtral's loop (act_fp8:
    w8a8, module docstring)."""
    t, d, e, f, k, s, fs = check_experts_args(x, ids, weights, w13, w2, ws13, ws2)
    a8 = check_act_fp8(act_fp8, w13)
    tensors = {"x": x, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if ws13 is not None else {})}
    for name, a in tensors.items():
        if isinstance(a, dict) and name != "x":
            if any(not isinstance(v, torch.Tensor) for p, v in a.items() if p != "fmt"):
                raise ValueError(f"moe.experts: {name}'s parts must be tensors")
        elif not isinstance(a, torch.Tensor) or a.dtype != x.dtype or not a.dtype.is_floating_point:
            raise ValueError(f"moe.experts: {name} must be a float tensor of x's dtype {getattr(x, 'dtype', None)}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("moe.experts: ids must be an int32 / int64 tensor")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"moe.experts: ids must be in [0, E={e})")
    out = torch.zeros_like(x)
    rw = weights.to(x.dtype)
    xq = group_quant_fp8(x) if a8 else None
    mask = F.one_hot(ids.long(), num_classes=e).permute(2, 1, 0)  # E, k, T (HF's expert_mask)
    hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten()
    for expert in hit.tolist():
        slot, tok = torch.where(mask[expert])
        if a8:
            y = _mlp_a8(xq[tok], w13, w2, expert, x.dtype) * rw[tok, slot, None]
        else:
            y = _mlp(x[tok], _dense(w13, expert, x.dtype), _dense(w2, expert, x.dtype)) * rw[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    for j in range(s):
        if a8:
            out = out + _mlp_a8(xq, ws13, ws2, j, x.dtype)
        else:
            out = out + _mlp(x, _dense(ws13, j, x.dtype), _dense(ws2, j, x.dtype))
    return out
