"""GGML dequantization and FP8 block quantization, in Triton.

    dequantize:   y[r, k] = dequant(fmt, w[r])[k]            (Q8_0, Q4_0, Q4_K, Q6_K; float32)
    fp8_quantize: s[i, j] = max(amax_block, 1e-4) [min ub] / 448,  q = e4m3(x / s)   (bm x bk blocks)

The dequantizer is the fused GEMMs' tile decoder writing its values instead of multiplying them
(kernels/triton/gemm.py's dequantize_into, which its prefill path runs too): every value is one
float32 rounding of the exact dequantized value, as ggml's `dequantize_row_*` (golden refimpl.quant.dequantize); NaN/inf scales propagate by IEEE
arithmetic in ggml's association. The FP8 quantizer is the FP8 GEMM's activation quantizer
(kernels/triton/gemm_fp8.py) with the block shape as parameters: 1 x 128 is DeepSeek-V3's
`act_quant`, 128 x 128 its weight blocks.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.triton.gemm import FORMATS, dequantize_into
from kernel_parity.kernels.triton.gemm_fp8 import act_quant_fp8

DEQUANT_FORMATS = tuple(FORMATS)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # dequantize's out: the fp32 values, or rounded once


def dequantize(fmt: str, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """data: (R, nblocks * nbytes) uint8 ggml blocks, last-dim stride 1 -> out (R, nblocks * QK) float32
    (any row stride, last-dim stride 1). An out of bfloat16 / float16 gets each float32 value rounded once
    to its dtype (what the fused GEMM's tensor-core kernel feeds its dots)."""
    if fmt not in FORMATS:
        raise ValueError(f"dequantize: format {fmt!r} is not one of {', '.join(DEQUANT_FORMATS)}")
    _, qk, nbytes, _, _ = FORMATS[fmt]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % nbytes or (data.shape[1] and data.stride(1) != 1):
        raise ValueError(f"dequantize[{fmt}]: data must be (R, nblocks * {nbytes}) uint8 with unit last stride, "
                         f"got {data.dtype} {tuple(data.shape)}")
    r, k = data.shape[0], data.shape[1] // nbytes * qk
    if out is None:
        out = torch.empty((r, k), dtype=torch.float32, device=data.device)
    if out.dtype not in OUT_DTYPES or tuple(out.shape) != (r, k) or (k and out.stride(1) != 1):
        raise ValueError(f"dequantize[{fmt}]: out must be ({r}, {k}) float32, bfloat16 or float16 with unit last "
                         f"stride, got {out.dtype} {tuple(out.shape)}")
    return dequantize_into(fmt, data, out)


def fp8_quantize(x: torch.Tensor, bm: int, bk: int, *, scale_ub: float | None = None, scale_fmt: str = "fp32",
                 out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp16/fp32 -> (q (M, K) float8_e4m3fn, s (ceil(M / bm), ceil(K / bk)) float32)."""
    q, s = act_quant_fp8(x, bm, bk, scale_ub=scale_ub, scale_fmt=scale_fmt)
    if out is not None:
        out.copy_(q)
        q = out
    if out_scale is not None:
        out_scale.copy_(s)
        s = out_scale
    return q, s
