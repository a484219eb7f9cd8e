"""Adapters binding each built-in backend's kernels to `kvquant.mla_sparse` (FlashMLA's sparse MLA decode over its
656-byte FP8 cache rows; conformance/ops/kvquant_mla.py):

- triton: kernels/triton/kvquant_mla.py (reads the bytes: codes decoded in integer arithmetic, scales folded per
          128-group into bf16 tl.dot's)
- cpu:    kernels/cpu/kvquant_mla.c (fp32, the bytes decoded in software)
- torch:  kernels/torch/kvquant_mla.py (eager: the used rows unpacked, then mla.decode_sparse's bf16 math)
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.mla import DV, SCALES


def _pair(out, device, o, lse) -> dict:
    oo, ll = out.torch("o", device), out.torch("lse", device)
    oo.copy_(o)
    ll.copy_(lse)
    return {"o": oo, "lse": ll}


def triton_ops(device: str) -> dict[str, Callable]:
    def mla_sparse(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_mla import kvquant_mla_sparse

        o, lse = out.torch("o", device), out.torch("lse", device)
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        kvquant_mla_sparse(t["q"], t["kv_cache"], t["indices"], t.get("topk_length"), SCALES[case.p["scale"]], d_v=DV,
                           out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {"kvquant.mla_sparse": mla_sparse}


def cpu_ops() -> dict[str, Callable]:
    def mla_sparse(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_mla import kvquant_mla_sparse

        o, lse = out.numpy("o"), out.numpy("lse")
        kvquant_mla_sparse(inputs["q"], inputs["kv_cache"], inputs["indices"], inputs.get("topk_length"),
                           SCALES[case.p["scale"]], d_v=DV, out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {"kvquant.mla_sparse": mla_sparse}


def torch_ops(device: str) -> dict[str, Callable]:
    def mla_sparse(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_mla import mla_sparse as eager

        t = {k: to_torch(v, device) for k, v in inputs.items()}
        o, lse = eager(t["q"], t["kv_cache"], t["indices"], t.get("topk_length"), SCALES[case.p["scale"]], d_v=DV)
        return _pair(out, device, o, lse)

    return {"kvquant.mla_sparse": mla_sparse}
