"""Adapters binding each built-in backend's FlashMLA scheduler to `mla.schedule` (merged into the
`mla` family's adapters by conformance/backends/mla.py).

- triton: kernels/triton/mla_schedule.py (one program over the batch)
- cpu:    kernels/cpu/mla_schedule.c (FlashMLA's one-thread loop)
- torch:  kernels/torch/mla_schedule.py (eager: prefix sums, a search per SM part)
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch


def _args(case) -> tuple:
    p = case.p
    return p["sq"], p["hq"], p["hkv"], p["sms"], bool(p["floor"])


def triton_ops(device: str) -> dict[str, Callable]:
    def schedule(case, inputs, out):
        from kernel_parity.kernels.triton.mla_schedule import get_mla_metadata

        meta, ns = out.torch("meta", device), out.torch("num_splits", device)
        get_mla_metadata(to_torch(inputs["seqlens"], device), *_args(case), out_meta=meta, out_num_splits=ns)
        return {"meta": meta, "num_splits": ns}

    return {"mla.schedule": schedule}


def cpu_ops() -> dict[str, Callable]:
    def schedule(case, inputs, out):
        from kernel_parity.kernels.cpu.mla_schedule import get_mla_metadata

        meta, ns = out.numpy("meta"), out.numpy("num_splits")
        get_mla_metadata(inputs["seqlens"], *_args(case), out_meta=meta, out_num_splits=ns)
        return {"meta": meta, "num_splits": ns}

    return {"mla.schedule": schedule}


def torch_ops(device: str) -> dict[str, Callable]:
    def schedule(case, inputs, out):
        from kernel_parity.kernels.torch.mla_schedule import get_mla_metadata

        meta, ns = get_mla_metadata(to_torch(inputs["seqlens"], device), *_args(case))
        return {"meta": meta, "num_splits": ns}

    return {"mla.schedule": schedule}
