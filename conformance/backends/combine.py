"""Adapters binding the split-KV merge kernels of each built-in backend to op names.

The backward op hands our Triton and C kernels the splits' states and the cotangents: they rebuild
the weights from the split LSEs as the forward does, so the merged (O, LSE) inputs are not read
(exp(LSE_i - LSE) with the fp32-rounded LSE would scale every weight by its rounding, 0.4% at
|LSE| ~ 6e4). The eager baseline differentiates its own forward (autograd)."""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance.backends._torch import to_torch


def triton_ops(device: str) -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.triton import combine as k

        o, lse = out.torch("o", device), out.torch("lse", device)
        k.lse_combine(to_torch(inputs["o_parts"], device), to_torch(inputs["lse_parts"], device), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def lse_combine_backward(case, inputs, out):
        from kernel_parity.kernels.triton import combine as k

        do_parts, dlse_parts = out.torch("do_parts", device), out.torch("dlse_parts", device)
        k.lse_combine_backward(*(to_torch(inputs[n], device) for n in ("o_parts", "lse_parts", "do", "dlse")),
                               out=do_parts, out_dlse=dlse_parts)
        return {"do_parts": do_parts, "dlse_parts": dlse_parts}

    return {"combine.lse_combine": lse_combine, "combine.lse_combine_backward": lse_combine_backward}


def cpu_ops() -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.cpu import combine as k

        o, lse = out.numpy("o"), out.numpy("lse")
        k.lse_combine(inputs["o_parts"], inputs["lse_parts"], out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def lse_combine_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import combine as k

        do_parts, dlse_parts = out.numpy("do_parts"), out.numpy("dlse_parts")
        k.lse_combine_backward(inputs["o_parts"], inputs["lse_parts"], inputs["do"], inputs["dlse"],
                               out=do_parts, out_dlse=dlse_parts)
        return {"do_parts": do_parts, "dlse_parts": dlse_parts}

    return {"combine.lse_combine": lse_combine, "combine.lse_combine_backward": lse_combine_backward}


def torch_ops(device: str) -> dict[str, Any]:
    def lse_combine(case, inputs, out):
        from kernel_parity.kernels.torch import combine as k

        o, lse = out.torch("o", device), out.torch("lse", device)
        o_, lse_ = k.lse_combine(to_torch(inputs["o_parts"], device), to_torch(inputs["lse_parts"], device))
        o.copy_(o_)
        lse.copy_(lse_)
        return {"o": o, "lse": lse}

    def lse_combine_backward(case, inputs, out):
        from kernel_parity.kernels.torch import combine as k

        do_parts, dlse_parts = out.torch("do_parts", device), out.torch("dlse_parts", device)
        g_o, g_lse = k.lse_combine_backward(*(to_torch(inputs[n], device) for n in ("o_parts", "lse_parts", "do", "dlse")))
        do_parts.copy_(g_o)
        dlse_parts.copy_(g_lse)
        return {"do_parts": do_parts, "dlse_parts": dlse_parts}

    return {"combine.lse_combine": lse_combine, "combine.lse_combine_backward": lse_combine_backward}
