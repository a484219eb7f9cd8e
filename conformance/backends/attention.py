"""Adapters binding the attention kernels of each built-in backend to op names.

Every backend receives the same keyword arguments (scale left to the kernel's 1/sqrt(d)
default, causal, window, softcap, sinks) and writes into the poisoned output buffers.
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch

DECODE_OPS = ("attention.decode", "attention.decode_paged")


def _kw(case, sinks) -> dict[str, Any]:
    p = case.p
    return dict(causal=p["causal"], window=(p["wl"], p["wr"]), softcap=float(p["cap"]), sinks=sinks)


def _torch_args(case, inputs, device):
    """Positional tensor arguments of the op (in the kernels' order) and the keyword arguments."""
    t = {k: to_torch(v, device) for k, v in inputs.items()}
    kw = _kw(case, t.get("sinks"))
    if case.op in ("attention.prefill",):
        return (t["q"], t["k"], t["v"]), kw
    if case.op == "attention.varlen":
        return (t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"]), kw
    if case.op == "attention.decode_paged":
        return (t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seqlens"]), kw
    return (t["q"], t["k_cache"], t["v_cache"], t["seqlens"]), kw


def _max_lens(inputs) -> tuple[int, int]:
    import numpy as np

    lq, lk = np.diff(inputs["cu_seqlens_q"]), np.diff(inputs["cu_seqlens_k"])
    return int(lq.max(initial=0)), int(lk.max(initial=0))


def triton_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton import attention as fa
        from kernel_parity.kernels.triton import attention_decode as dec

        args, kw = _torch_args(case, inputs, device)
        o, lse = out.torch("o", device), out.torch("lse", device)
        if case.op == "attention.prefill":
            fa.prefill(*args, **kw, out=o, out_lse=lse)
        elif case.op == "attention.varlen":
            fa.varlen(*args, *_max_lens(inputs), **kw, out=o, out_lse=lse)
        elif case.op == "attention.decode":
            dec.decode(*args, **kw, out=o, out_lse=lse)
        elif case.op == "attention.decode_paged":
            dec.decode_paged(*args, **kw, out=o, out_lse=lse)
        else:
            o_parts, lse_parts = out.torch("o_parts", device), out.torch("lse_parts", device)
            dec.decode_split(*args, case.p["splits"], **kw, out=o, out_lse=lse, out_o_parts=o_parts,
                             out_lse_parts=lse_parts)
            return {"o": o, "lse": lse, "o_parts": o_parts, "lse_parts": lse_parts}
        return {"o": o, "lse": lse}

    return {op: run for op in ("attention.prefill", "attention.varlen", *DECODE_OPS, "attention.decode_split")}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import attention as k

        kw = _kw(case, inputs.get("sinks"))
        o, lse = out.numpy("o"), out.numpy("lse")
        x = inputs
        if case.op == "attention.prefill":
            k.prefill(x["q"], x["k"], x["v"], **kw, out=o, out_lse=lse)
        elif case.op == "attention.decode":
            k.decode(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], **kw, out=o, out_lse=lse)
        else:
            k.decode_paged(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seqlens"], **kw, out=o, out_lse=lse)
        return {"o": o, "lse": lse}

    return {op: run for op in ("attention.prefill", *DECODE_OPS)}


def torch_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch import attention as k

        args, kw = _torch_args(case, inputs, device)
        fn = {"attention.prefill": k.attention, "attention.varlen": k.varlen, "attention.decode": k.decode,
              "attention.decode_paged": k.decode_paged, "attention.decode_split": k.decode_split}[case.op]
        if case.op == "attention.decode_split":
            res = fn(*args, case.p["splits"], **kw)
            names = ("o", "lse", "o_parts", "lse_parts")
        else:
            res = fn(*args, **kw)
            names = ("o", "lse")
        bufs = {n: out.torch(n, device) for n in names}
        for n, r in zip(names, res):
            bufs[n].copy_(r)
        return bufs

    return {op: run for op in ("attention.prefill", "attention.varlen", *DECODE_OPS, "attention.decode_split")}
