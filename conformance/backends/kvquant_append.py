"""Adapters binding each built-in backend's fused decode-step kernel to `kvquant.append_decode` (merged by
conformance/backends/kvquant.py).

- triton: kernels/triton/kvquant_append.py (one launch: the designated split quantizes, stores and attends the new
  token from registers; flash decoding over the cached keys)
- cpu:    kernels/cpu/kvquant_append.c (fp32 loops: the write, then two passes over L + 1 keys)
- torch:  kernels/torch/kvquant_append.py (eager: the write through uint8 views, then the fp32 decode)

The kernels write the caches in place: each adapter hands a kernel the case's fresh copies of the caches (and, gran
token, the scale caches) and returns them as outputs (Output.inplace), the code caches as their bytes (uint8
views); O and the LSE go into the poisoned output buffers (triton, cpu) or come back from the kernel (torch).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch

OP = "kvquant.append_decode"
ARGS = ("q", "k_new", "v_new", "k_cache", "v_cache", "block_table", "seq_lens")


def _scales(inputs, token: bool, conv) -> dict:
    if token:
        return {"k_scale_cache": conv(inputs["k_scale_cache"]), "v_scale_cache": conv(inputs["v_scale_cache"])}
    return {"k_scale": conv(inputs["k_scale"]), "v_scale": conv(inputs["v_scale"])}


def _torch_run(device: str, module: str) -> Callable:
    def run(case, inputs, out):
        import importlib

        import torch

        fn = importlib.import_module(f"kernel_parity.kernels.{module}.kvquant_append").append_decode
        p = case.p
        token = p["gran"] == "token"
        args = [to_torch(inputs[k], device) for k in ARGS]
        scales = _scales(inputs, token, lambda a: to_torch(a, device))
        kw = {}
        if module == "triton":
            kw = {"out": out.torch("o", device), "out_lse": out.torch("lse", device)}
        o, lse = fn(*args, p["fmt"], p["gran"], **scales, **kw)
        res = {"o": o, "lse": lse, "k_cache": args[3].view(torch.uint8), "v_cache": args[4].view(torch.uint8)}
        if token:
            res.update(scales)
        return res

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, "triton")}


def torch_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, "torch")}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_append import append_decode

        p = case.p
        token = p["gran"] == "token"
        scales = _scales(inputs, token, lambda a: a)
        o, lse = out.numpy("o"), out.numpy("lse")
        append_decode(*(inputs[k] for k in ARGS), p["fmt"], p["gran"], **scales, out=o, out_lse=lse)
        res = {"o": o, "lse": lse, "k_cache": inputs["k_cache"].view(np.uint8),
               "v_cache": inputs["v_cache"].view(np.uint8)}
        if token:
            res.update(scales)
        return res

    return {OP: run}
