"""Adapters binding the split-KV merge kernels of each built-in backend to op names."""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance.backends._torch import to_torch


def triton_ops(device: str) -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.triton import combine as k

        o, lse = out.torch("o", device), out.torch("lse", device)
        k.lse_combine(to_torch(inputs["o_parts"], device), to_torch(inputs["lse_parts"], device), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {"combine.lse_combine": lse_combine}


def cpu_ops() -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.cpu import combine as k

        o, lse = out.numpy("o"), out.numpy("lse")
        k.lse_combine(inputs["o_parts"], inputs["lse_parts"], out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {"combine.lse_combine": lse_combine}


def torch_ops(device: str) -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.torch import combine as k

        o, lse = out.torch("o", device), out.torch("lse", device)
        o_, lse_ = k.lse_combine(to_torch(inputs["o_parts"], device), to_torch(inputs["lse_parts"], device))
        o.copy_(o_)
        lse.copy_(lse_)
        return {"o": o, "lse": lse}

    return {"combine.lse_combine": lse_combine}
