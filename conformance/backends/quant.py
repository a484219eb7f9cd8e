"""Adapters binding the quantization-family kernels of each built-in backend to `quant.*` ops.

- cpu:    kernels/cpu/quant.c: every GGML format's reference quantizer and dequantizer
- torch:  kernels/torch/quant.py: GGML dequantization and FP8 block scaling in eager torch
- triton: kernels/triton/quant.py: GGML dequantization (the fused GEMMs' tile decoders) and the
          FP8 activation/weight block quantizer of the FP8 GEMM
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch


def cpu_ops() -> dict[str, Callable]:
    def quantize(case, inputs, out):
        from kernel_parity.kernels.cpu import quant as k

        q = out.numpy("q")
        k.quantize(case.p["fmt"], inputs["x"], out=q)
        return {"q": q}

    def dequantize(case, inputs, out):
        from kernel_parity.kernels.cpu import quant as k

        y = out.numpy("y")
        k.dequantize(case.p["fmt"], inputs["data"], out=y)
        return {"y": y}

    return {"quant.quantize": quantize, "quant.dequantize": dequantize}


def torch_ops(device: str) -> dict[str, Callable]:
    def dequantize(case, inputs, out):
        import torch

        from kernel_parity.kernels.torch import quant as k

        y = out.torch("y", device)
        y.copy_(k.dequantize(case.p["fmt"], to_torch(inputs["data"], device), torch.float32))
        return {"y": y}

    def fp8_quantize(case, inputs, out):
        from kernel_parity.kernels.torch import quant as k

        p = case.p
        q, s = k.fp8_quantize_blocks(to_torch(inputs["x"], device), p["bm"], p["bk"],
                                     scale_ub=p["ub"] or None, scale_fmt=p["sfmt"])
        qo, so = out.torch("q", device), out.torch("scale", device)
        qo.copy_(q)
        so.copy_(s)
        return {"q": qo, "scale": so}

    return {"quant.dequantize": dequantize, "quant.fp8_quantize": fp8_quantize}


def triton_ops(device: str) -> dict[str, Callable]:
    def dequantize(case, inputs, out):
        from kernel_parity.kernels.triton import quant as k

        y = out.torch("y", device)
        k.dequantize(case.p["fmt"], to_torch(inputs["data"], device), out=y)
        return {"y": y}

    def fp8_quantize(case, inputs, out):
        from kernel_parity.kernels.triton import quant as k

        p = case.p
        qo, so = out.torch("q", device), out.torch("scale", device)
        k.fp8_quantize(to_torch(inputs["x"], device), p["bm"], p["bk"], scale_ub=p["ub"] or None,
                       scale_fmt=p["sfmt"], out=qo, out_scale=so)
        return {"q": qo, "scale": so}

    return {"quant.dequantize": dequantize, "quant.fp8_quantize": fp8_quantize}


def triton_supports() -> dict[str, Callable[[Any], str | None]]:
    """Formats the Triton dequantizer decodes (the GEMM tile decoders)."""
    def dequantize(case) -> str | None:
        from kernel_parity.kernels.triton.quant import DEQUANT_FORMATS

        fmt = case.p["fmt"]
        return None if fmt in DEQUANT_FORMATS else f"triton dequantizes {', '.join(DEQUANT_FORMATS)}, not {fmt}"

    return {"quant.dequantize": dequantize}
