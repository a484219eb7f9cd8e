"""Adapters binding each built-in backend's quantized-KV-cache chunked-prefill kernel to `kvquant.chunked_prefill`.

- triton: kernels/triton/kvquant_prefill.py (FlashAttention-2 over codes: 8-bit loads, scales out of the dots)
- cpu:    kernels/cpu/kvquant_prefill.c (fp32 loops, one (query, query head) at a time)
- torch:  kernels/torch/kvquant_prefill.py (eager: dequantize to fp32, then fp32 chunked attention)
Every kernel writes into the poisoned output buffers; the codes travel in their own dtype (int8 or float8).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch

OP = "kvquant.chunked_prefill"
ARGS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "cu_seqlens_q", "hist", "block_table")


def _max_seqlen_q(inputs) -> int:
    return int(np.diff(np.asarray(inputs["cu_seqlens_q"], dtype=np.int64)).max(initial=0))


def triton_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_prefill import chunked_prefill

        o, lse = out.torch("o", device), out.torch("lse", device)
        chunked_prefill(*(to_torch(inputs[k], device) for k in ARGS), _max_seqlen_q(inputs), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {OP: run}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_prefill import chunked_prefill

        o, lse = out.numpy("o"), out.numpy("lse")
        chunked_prefill(*(inputs[k] for k in ARGS), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {OP: run}


def torch_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_prefill import chunked_prefill

        o, lse = chunked_prefill(*(to_torch(inputs[k], device) for k in ARGS))
        return {"o": o, "lse": lse}

    return {OP: run}
