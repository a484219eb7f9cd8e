"""Adapters binding the KV-cache write kernels of each built-in backend to `kvcache.update`, and the C,
torch and Triton metadata step to `kvcache.metadata` (TensorRT-LLM's prepare_fused_mha_metadata).

The kernels write in place, so each adapter first copies the old cache into the poisoned output
buffer (harness work, outside what is judged) and lets the kernel append K and V there. A case
with `rows` > 0 hands the kernels its cache_loc (each sequence's cache / block-table row); a ragged
case (`tokens` = "ragged") its seq_len / seq_start. K and V are separate calls, each with its own head
dim (`dv`).
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch

META_OUTPUTS = ("seq_len", "input_pos", "cache_loc", "seq_start")  # kvcache.metadata's, in the kernels' order


def _torch_run(device: str, kernel: Callable[[], Any]) -> Callable:
    def run(case, inputs, out):
        update = kernel()
        bt = to_torch(inputs["block_table"], device) if "block_table" in inputs else None
        loc = to_torch(inputs["cache_loc"], device) if "cache_loc" in inputs else None
        rag = {k: to_torch(inputs[k], device) for k in ("seq_len", "seq_start") if k in inputs}
        res = {}
        for name, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
            buf = out.torch(name, device)
            buf.copy_(to_torch(inputs[name], device))
            update(buf, to_torch(inputs[new], device), to_torch(inputs["pos"], device), block_table=bt, cache_loc=loc,
                   **rag)
            res[name] = buf
        return res

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    def kernel():
        from kernel_parity.kernels.triton.kvcache import update

        return update

    def metadata(case, inputs, out):
        from kernel_parity.kernels.triton.kvcache import metadata as meta

        bufs = tuple(out.torch(n, device) for n in META_OUTPUTS)
        meta(*(to_torch(inputs[k], device) for k in ("seq_len", "input_pos", "cache_loc")), graph=case.p["graph"],
             out=bufs)
        return dict(zip(META_OUTPUTS, bufs))

    return {"kvcache.update": _torch_run(device, kernel), "kvcache.metadata": metadata}


def torch_ops(device: str) -> dict[str, Callable]:
    def kernel():
        from kernel_parity.kernels.torch.kvcache import update

        return update

    def metadata(case, inputs, out):
        from kernel_parity.kernels.torch.kvcache import metadata as meta

        res = meta(*(to_torch(inputs[k], device) for k in ("seq_len", "input_pos", "cache_loc")), graph=case.p["graph"])
        bufs = {n: out.torch(n, device) for n in META_OUTPUTS}
        for n, r in zip(META_OUTPUTS, res):
            bufs[n].copy_(r)
        return bufs

    return {"kvcache.update": _torch_run(device, kernel), "kvcache.metadata": metadata}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu.kvcache import update

        res = {}
        for name, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
            buf = out.numpy(name)
            buf[...] = inputs[name]
            update(buf, inputs[new], inputs["pos"], block_table=inputs.get("block_table"),
                   cache_loc=inputs.get("cache_loc"), seq_len=inputs.get("seq_len"), seq_start=inputs.get("seq_start"))
            res[name] = buf
        return res

    def metadata(case, inputs, out):
        from kernel_parity.kernels.cpu.kvcache import metadata as meta

        res = meta(inputs["seq_len"], inputs["input_pos"], inputs["cache_loc"], graph=case.p["graph"])
        bufs = {n: out.numpy(n) for n in META_OUTPUTS}
        for n, r in zip(META_OUTPUTS, res):
            bufs[n][...] = r
        return bufs

    return {"kvcache.update": run, "kvcache.metadata": metadata}
