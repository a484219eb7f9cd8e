"""GGML dequantization and FP8 block quantization, in Triton.

    dequantize:   y[r, k] = dequant(fmt, w[r])[k]            (Q8_0, Q4_0, Q4_K, Q6_K; float32)
    fp8_quantize: s[i, j] = max(amax_block, 1e-4) [min ub] / 448,  q = e4m3(x / s)   (bm x bk blocks)

The dequantizer is the fused GEMMs' tile decoder (kernels/triton/gemm.py) writing its values
instead of multiplying them: every value is one float32 rounding of the exact dequantized value,
as ggml's `dequantize_row_*` (golden refimpl.quant.dequantize); NaN/inf scales propagate by IEEE
arithmetic in ggml's association. The FP8 quantizer is the FP8 GEMM's activation quantizer
(kernels/triton/gemm_fp8.py) with the block shape as parameters: 1 x 128 is DeepSeek-V3's
`act_quant`, 128 x 128 its weight blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.triton.gemm import FORMATS, _dq_q4_0, _dq_q4_k, _dq_q6_k, _dq_q8_0, _k_of
from kernel_parity.kernels.triton.gemm_fp8 import act_quant_fp8

DEQUANT_FORMATS = tuple(FORMATS)
ROWS = 4  # rows per program
GROUPS = 8  # scale groups per program (8 x 32 = 256 elements of a 32-block format, 2 K-quant blocks)


@triton.jit
def _dequantize_kernel(
    W_ptr, Y_ptr, R, n_groups, stride_wr, stride_yr,
    FMT: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1) * G + tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    mask = (offs_r < R)[:, None, None] & (g < n_groups)
    Wrow = W_ptr + offs_r[:, None, None].to(tl.int64) * stride_wr
    Yrow = Y_ptr + offs_r[:, None, None].to(tl.int64) * stride_yr
    if FMT == 0:
        tl.store(Yrow + _k_of(FMT, g, e, 0), _dq_q8_0(Wrow, g, e, mask), mask=mask)
    elif FMT == 1:
        w0, w1 = _dq_q4_0(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0, mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1, mask=mask)
    elif FMT == 2:
        w0, w1 = _dq_q4_k(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0, mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1, mask=mask)
    else:
        w0, w1, w2, w3 = _dq_q6_k(Wrow, g, e, mask)
        tl.store(Yrow + _k_of(FMT, g, e, 0), w0, mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 1), w1, mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 2), w2, mask=mask)
        tl.store(Yrow + _k_of(FMT, g, e, 3), w3, mask=mask)


def dequantize(fmt: str, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """data: (R, nblocks * nbytes) uint8 ggml blocks, last-dim stride 1 -> out (R, nblocks * QK) float32
    (any row stride, last-dim stride 1)."""
    if fmt not in FORMATS:
        raise ValueError(f"dequantize: format {fmt!r} is not one of {', '.join(DEQUANT_FORMATS)}")
    fid, qk, nbytes, gpb, e = FORMATS[fmt]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % nbytes or (data.shape[1] and data.stride(1) != 1):
        raise ValueError(f"dequantize[{fmt}]: data must be (R, nblocks * {nbytes}) uint8 with unit last stride, "
                         f"got {data.dtype} {tuple(data.shape)}")
    r, k = data.shape[0], data.shape[1] // nbytes * qk
    if out is None:
        out = torch.empty((r, k), dtype=torch.float32, device=data.device)
    if out.dtype != torch.float32 or tuple(out.shape) != (r, k) or (k and out.stride(1) != 1):
        raise ValueError(f"dequantize[{fmt}]: out must be ({r}, {k}) float32 with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    n_groups = data.shape[1] // nbytes * gpb
    if r and n_groups:
        grid = (triton.cdiv(r, ROWS), triton.cdiv(n_groups, GROUPS))
        _dequantize_kernel[grid](data, out, r, n_groups, data.stride(0), out.stride(0),
                                 FMT=fid, E=e, BLOCK_R=ROWS, G=GROUPS)
    return out


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
