"""Adapters binding each built-in backend's kernels to `kvquant.mla_decode` (FlashMLA's dense paged MLA decode over
its 656-byte FP8 cache rows) and `kvquant.mla_pack` (the rows' write path; conformance/ops/kvquant_mla_dense.py):

- triton: kernels/triton/kvquant_mla_dense.py (the bytes read as kvquant.mla_sparse's kernel reads them, paged as
          mla.decode's; the write: div_rn, power-of-two scales on the bits, the fp8 cast)
- cpu:    kernels/cpu/kvquant_mla_dense.c (fp32, the bytes decoded in software; kvquant.c's float8 encoder)
- torch:  kernels/torch/kvquant_mla_dense.py (eager: the cache unpacked, then mla.decode's bf16 math; torch's ops)

The pack kernels write in place: each adapter hands a kernel the case's fresh copy of the cache and returns it
(Output.inplace).
"""

from __future__ import annotations

from typing import Callable

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.mla import DV, SCALES

DECODE, PACK = "kvquant.mla_decode", "kvquant.mla_pack"


def _pair(out, device, o, lse) -> dict:
    oo, ll = out.torch("o", device), out.torch("lse", device)
    oo.copy_(o)
    ll.copy_(lse)
    return {"o": oo, "lse": ll}


def _torch_pack(device: str, module: str) -> Callable:
    def run(case, inputs, out):
        import importlib

        mod = importlib.import_module(f"kernel_parity.kernels.{module}.kvquant_mla_dense")
        fn = mod.kvquant_mla_pack if module == "triton" else mod.mla_pack
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        fn(t["kv_cache"], t["kv_c"], t["k_pe"], t["slot_mapping"])
        return {"kv_cache": t["kv_cache"]}

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.triton.kvquant_mla_dense import kvquant_mla_decode

        o, lse = out.torch("o", device), out.torch("lse", device)
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        kvquant_mla_decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[case.p["scale"]], d_v=DV,
                           causal=bool(case.p["causal"]), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {DECODE: decode, PACK: _torch_pack(device, "triton")}


def cpu_ops() -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_mla_dense import kvquant_mla_decode

        o, lse = out.numpy("o"), out.numpy("lse")
        kvquant_mla_decode(inputs["q"], inputs["kv_cache"], inputs["block_table"], inputs["seqlens"],
                           SCALES[case.p["scale"]], d_v=DV, causal=bool(case.p["causal"]), out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    def pack(case, inputs, out):
        from kernel_parity.kernels.cpu.kvquant_mla_dense import kvquant_mla_pack

        cache = inputs["kv_cache"]
        kvquant_mla_pack(cache, inputs["kv_c"], inputs["k_pe"], inputs["slot_mapping"])
        return {"kv_cache": cache}

    return {DECODE: decode, PACK: pack}


def torch_ops(device: str) -> dict[str, Callable]:
    def decode(case, inputs, out):
        from kernel_parity.kernels.torch.kvquant_mla_dense import mla_decode

        t = {k: to_torch(v, device) for k, v in inputs.items()}
        o, lse = mla_decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[case.p["scale"]], d_v=DV,
                            causal=bool(case.p["causal"]))
        return _pair(out, device, o, lse)

    return {DECODE: decode, PACK: _torch_pack(device, "torch")}
