"""Adapters binding each built-in backend's alignment kernel to `moe.align` (merged into the `moe` family's
adapters by conformance/backends/moe.py `_more`).

- triton: kernels/triton/moe_align.py (histogram, scan, stable scatter, fill: four kernels)
- cpu:    kernels/cpu/moe_align.c (a counting sort, one thread)
- torch:  kernels/torch/moe_align.py (eager: bincount, cumsum, stable sort)
The triton and cpu kernels write into the harness's poisoned buffers; the eager one allocates its own.
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch

OUTPUTS = ("sorted_ids", "expert_ids", "num_tokens_post_pad")


def triton_ops(device: str) -> dict[str, Callable]:
    def align(case, inputs, out):
        from kernel_parity.kernels.triton.moe_align import align as kernel

        bufs = [out.torch(name, device) for name in OUTPUTS]
        kernel(to_torch(inputs["topk_ids"], device), case.p["e"], case.p["b"], out_sorted=bufs[0],
               out_expert_ids=bufs[1], out_post_pad=bufs[2])
        return dict(zip(OUTPUTS, bufs))

    return {"moe.align": align}


def cpu_ops() -> dict[str, Callable]:
    def align(case, inputs, out):
        from kernel_parity.kernels.cpu.moe_align import align as kernel

        bufs = [out.numpy(name) for name in OUTPUTS]
        kernel(inputs["topk_ids"], case.p["e"], case.p["b"], out_sorted=bufs[0], out_expert_ids=bufs[1],
               out_post_pad=bufs[2])
        return dict(zip(OUTPUTS, bufs))

    return {"moe.align": align}


def torch_ops(device: str) -> dict[str, Callable]:
    def align(case, inputs, out):
        from kernel_parity.kernels.torch.moe_align import align as kernel

        return dict(zip(OUTPUTS, kernel(to_torch(inputs["topk_ids"], device), case.p["e"], case.p["b"])))

    return {"moe.align": align}
