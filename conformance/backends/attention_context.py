"""Adapters of attention.context_kv (conformance/ops/attention_context.py) for the built-in backends,
merged into conformance/backends/attention.py's tables (the attention family's adapter module).

Each kernel writes the caches in place: the adapter hands it the case's fresh input copies and returns
them as the k_cache / v_cache outputs (Output.inplace), beside O and the LSE in the poisoned buffers.
Triton runs the fused kernel (one launch); cpu and torch compose their cache write and chunked prefill.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch

OP = "attention.context_kv"


def _torch_run(device: str, fused: bool) -> Callable:
    def run(case, inputs, out):
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        args = (t["q"], t["k"], t["v"], t["k_cache"], t["v_cache"], t["cu_seqlens"], t["input_pos"])
        o, lse = out.torch("o", device), out.torch("lse", device)
        if fused:
            from kernel_parity.kernels.triton.attention_context import context_kv

            max_q = int(np.diff(inputs["cu_seqlens"]).max(initial=0))
            context_kv(*args, max_q, block_table=t.get("block_table"), out=o, out_lse=lse)
        else:
            from kernel_parity.kernels.torch.attention import context_kv

            res = context_kv(*args, t.get("block_table"))
            o.copy_(res[0])
            lse.copy_(res[1])
        return {"o": o, "lse": lse, "k_cache": t["k_cache"], "v_cache": t["v_cache"]}

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, fused=True)}


def torch_ops(device: str) -> dict[str, Callable]:
    return {OP: _torch_run(device, fused=False)}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.attention import context_kv

        o, lse = out.numpy("o"), out.numpy("lse")
        context_kv(inputs["q"], inputs["k"], inputs["v"], inputs["k_cache"], inputs["v_cache"], inputs["cu_seqlens"],
                   inputs["input_pos"], inputs.get("block_table"), out=o, out_lse=lse)
        return {"o": o, "lse": lse, "k_cache": inputs["k_cache"], "v_cache": inputs["v_cache"]}

    return {OP: run}
