"""Adapters binding each built-in backend's quantized-KV-cache write kernels to `kvquant.update`
(merged by conformance/backends/kvquant.py).

- triton: kernels/triton/kvquant.py (one program per token and block of heads, div_rn, the fp8 cast / int8 RNE)
- cpu:    kernels/cpu/kvquant.c (fp32 loops, an exact software float8 encoder)
- torch:  kernels/torch/kvquant.py (eager: fp32 division, clamp, torch's casts)

The kernels write in place: each adapter hands a kernel the case's fresh copies of the caches (K, then V,
each with its own scales) and returns them as the outputs (Output.inplace), the code caches as their bytes
(uint8 views: the op's output dtype for every format).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch

OP = "kvquant.update"


def _torch_run(device: str, module: str) -> Callable:
    def run(case, inputs, out):
        import importlib

        import torch

        update = importlib.import_module(f"kernel_parity.kernels.{module}.kvquant").update
        p = case.p
        slots = to_torch(inputs["slot_mapping"], device)
        res = {}
        for kv in ("k", "v"):
            cache = to_torch(inputs[f"{kv}_cache"], device)
            sc = to_torch(inputs[f"{kv}_scale_cache"], device) if p["gran"] == "token" else None
            scale = to_torch(inputs[f"{kv}_scale"], device) if p["gran"] != "token" else None
            update(cache, to_torch(inputs[f"{kv}_new"], device), slots, p["fmt"], p["gran"], scale=scale,
                   scale_cache=sc)
            res[f"{kv}_cache"] = cache.view(torch.uint8)
            if sc is not None:
                res[f"{kv}_scale_cache"] = sc
        return res

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, "triton")}


def torch_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, "torch")}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant import update

        p = case.p
        res = {}
        for kv in ("k", "v"):
            cache = inputs[f"{kv}_cache"]
            sc = inputs.get(f"{kv}_scale_cache") if p["gran"] == "token" else None
            update(cache, inputs[f"{kv}_new"], inputs["slot_mapping"], p["fmt"], p["gran"],
                   scale=inputs.get(f"{kv}_scale") if p["gran"] != "token" else None, scale_cache=sc)
            res[f"{kv}_cache"] = cache.view(np.uint8)
            if sc is not None:
                res[f"{kv}_scale_cache"] = sc
        return res

    return {OP: run}
