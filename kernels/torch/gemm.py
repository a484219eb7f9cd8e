"""Eager quantized GEMM: dequantize W to A's dtype in torch, then `a @ w.T (+ bias)` in A's dtype.

    C[M, N] = A[M, K] @ dequantize(W)[N, K]^T (+ bias[N])

The same-precision baseline of the `gemm` family: what a model runs without a fused quantized
kernel (DeepSeek-V3's default `gemm_impl = "bf16"`: `weight_dequant` then `F.linear`; vLLM's AWQ
path dequantizes to fp16 first). W is dequantized once, in float32 for GGML and FP8 (exact there)
and rounded to A's dtype; int4 is dequantized in A's dtype ((q - z) exact, one rounding of the
product). torch's matmul accumulates fp16/bf16 products in float32 and rounds C once to A's dtype.
Activations are not quantized: this baseline is held to the `dequant` (L1) reference.
`gemm_nt_backward` is autograd through `gemm_nt` in A's dtype: the backward's same-precision baseline.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.torch import quant as tq

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dequantize_weight(wfmt: str, weights: dict[str, torch.Tensor], dtype: torch.dtype, k: int, *,
                      order: str = "gptq", group: int | None = None, gn: int = 128,
                      gk: int = 128) -> torch.Tensor:
    """The (N, K) weight of `wfmt` in `dtype`; `weights` holds the tensors named in refimpl/gemm.py."""
    w = weights.get("w")
    if wfmt == "f32":
        return w.to(dtype)
    if wfmt in tq.GGML and wfmt not in ("q8_1", "q8_k"):
        block, nbytes = tq.GGML[wfmt]
        if k % block:
            raise ValueError(f"{wfmt}: K={k} must be a multiple of the block of {block}")
        if w.ndim != 2 or w.shape[1] != k // block * nbytes:
            raise ValueError(f"{wfmt}: w must be uint8 (N, K/{block}*{nbytes}) = (N, {k // block * nbytes}), "
                             f"got {tuple(w.shape)}")
        return tq.dequantize(wfmt, w, dtype)
    if wfmt == "fp8":
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"fp8: w must be (N, K={k}), got {tuple(w.shape)}")
        return tq.fp8_dequantize_blocks(w, weights["w_scale"], gn, gk, dtype)
    if wfmt == "int4":
        wd = tq.int4_dequantize(weights["qweight"], weights["qzeros"], weights["scales"], order, dtype)
        if wd.shape[1] != k or (group is not None and k // weights["scales"].shape[0] != group):
            raise ValueError(f"int4 {order}: weights describe {tuple(wd.shape)} with group "
                             f"{k // weights['scales'].shape[0]}, A has K={k} (group {group})")
        return wd
    raise ValueError(f"unknown weight format {wfmt!r}; known: f32, fp8, int4, "
                     f"{', '.join(f for f in tq.GGML if f not in ('q8_1', 'q8_k'))}")


def gemm_nt(a: torch.Tensor, wfmt: str, weights: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
            *, order: str = "gptq", group: int | None = None, gm: int = 1, gn: int = 128,
            gk: int = 128) -> torch.Tensor:
    """a (M, K) fp32/bf16/fp16 -> C (M, N) in a.dtype; gm is accepted for the fp8 signature and
    unused (no activation quantization here)."""
    if a.ndim != 2:
        raise ValueError(f"a must be (M, K), got shape {tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise ValueError(f"a must be one of {DTYPES}, got {a.dtype}")
    w = dequantize_weight(wfmt, weights, a.dtype, a.shape[1], order=order, group=group, gn=gn, gk=gk)
    c = a @ w.T
    if bias is not None:
        if bias.shape != (w.shape[0],):
            raise ValueError(f"bias must be (N,) = ({w.shape[0]},), got {tuple(bias.shape)}")
        c = c + bias.to(a.dtype)
    return c


def gemm_nt_backward(a: torch.Tensor, wfmt: str, weights: dict[str, torch.Tensor], dc: torch.Tensor,
                     bias: torch.Tensor | None = None, **kw) -> dict[str, torch.Tensor]:
    """The VJP of `gemm_nt` by autograd through it, in A's dtype (what an eager model's backward computes).

    a: (M, K); weights, bias, kw: as `gemm_nt`; dc: (M, N) the cotangent of C, in A's dtype
    returns {"da": (M, K) in A's dtype} and, for "f32" weights, {"dw": (N, K)} (+ {"db": (N,)} with a bias),
    float32: the gradients of the float32 tensors through their casts to A's dtype (an fp16 / bf16 product's
    gradient is rounded to that dtype before the cast back)
    """
    leaves = {"da": a.detach().requires_grad_()}
    weights = dict(weights)
    if wfmt == "f32":
        weights["w"] = leaves["dw"] = weights["w"].detach().requires_grad_()
        if bias is not None:
            bias = leaves["db"] = bias.detach().requires_grad_()
    with torch.enable_grad():
        c = gemm_nt(leaves["da"], wfmt, weights, bias, **kw)
        grads = torch.autograd.grad(c, list(leaves.values()), dc)
    return dict(zip(leaves, grads))
