"""Adapters binding the attention kernels of each built-in backend to op names.

Every backend receives the same keyword arguments (scale left to the kernel's 1/sqrt(d)
default, causal, window, softcap, sinks) and writes into the poisoned output buffers. A case with
vk=1 has one cache input, k_cache; V is handed to the kernel as a view of its first d_v dims (the
same memory, K's row stride), never as a copy. A case with `rows` > 0 hands the decode and chunked
kernels its cache_loc (each sequence's cache / block-table row, TensorRT-LLM's indirection).
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends import attention_context as context
from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.attention_inputs import value_dim

DECODE_OPS = ("attention.decode", "attention.decode_paged")
TRITON_MAX_D = {"attention.prefill": 256, "attention.varlen": 256, "attention.chunked_prefill": 256,
                "attention.prefill_backward": 256, "attention.varlen_backward": 256, "attention.context_kv": 256}


def _kw(case, sinks) -> dict[str, Any]:
    p = case.p
    return dict(causal=p["causal"], window=(p["wl"], p["wr"]), softcap=float(p["cap"]), sinks=sinks)


def _loc(t: dict[str, Any]) -> dict[str, Any]:
    """cache_loc=... for a case with `rows` > 0, else nothing (the kernels' calls stay as before)."""
    return {"cache_loc": t["cache_loc"]} if "cache_loc" in t else {}


def _values(case, t: dict[str, Any], keys: str = "k_cache"):
    """The V input, or a view of the key buffer's first d_v dims (vk=1)."""
    return t["v_cache"] if "v_cache" in t else t[keys][..., : value_dim(case.p)]


def _part(case, t: dict[str, Any]) -> dict[str, Any]:
    """decode_split's partition keywords: none (equal counts), block=blk, or bounds=split_bounds; and
    block_table with a paged cache (page > 0)."""
    kw = {"block_table": t["block_table"]} if "block_table" in t else {}
    if case.p.get("part") == "block":
        return {**kw, "block": case.p["blk"]}
    if case.p.get("part") == "bounds":
        return {**kw, "bounds": t["split_bounds"]}
    return kw


def _torch_args(case, inputs, device):
    """Positional tensor arguments of the op (in the kernels' order) and the keyword arguments."""
    t = {k: to_torch(v, device) for k, v in inputs.items()}
    kw = {**_kw(case, t.get("sinks")), **_loc(t)}
    if case.op in ("attention.prefill",):
        return (t["q"], t["k"], t["v"]), kw
    if case.op == "attention.varlen":
        return (t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"]), kw
    if case.op == "attention.chunked_prefill":
        return (t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["hist"], t.get("block_table")), kw
    if case.op == "attention.decode_paged":
        return (t["q"], t["k_cache"], _values(case, t), t["block_table"], t["seqlens"]), kw
    if case.op == "attention.decode_split":
        kw.update(_part(case, t))
    return (t["q"], t["k_cache"], _values(case, t), t["seqlens"]), kw


def _max_lens(inputs) -> tuple[int, int]:
    import numpy as np

    lq, lk = np.diff(inputs["cu_seqlens_q"]), np.diff(inputs["cu_seqlens_k"])
    return int(lq.max(initial=0)), int(lk.max(initial=0))


def triton_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton import attention as fa
        from kernel_parity.kernels.triton import attention_chunked as chunked
        from kernel_parity.kernels.triton import attention_decode as dec

        args, kw = _torch_args(case, inputs, device)
        o, lse = out.torch("o", device), out.torch("lse", device)
        if case.op == "attention.prefill":
            fa.prefill(*args, **kw, out=o, out_lse=lse)
        elif case.op == "attention.varlen":
            fa.varlen(*args, *_max_lens(inputs), **kw, out=o, out_lse=lse)
        elif case.op == "attention.chunked_prefill":
            max_q = int((inputs["cu_seqlens_q"][1:] - inputs["cu_seqlens_q"][:-1]).max(initial=0))
            chunked.chunked_prefill(*args[:5], max_q, block_table=args[5], **kw, out=o, out_lse=lse)
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

    return {**{op: run for op in ("attention.prefill", "attention.varlen", *DECODE_OPS, "attention.decode_split",
                                  "attention.chunked_prefill")}, **triton_backward_ops(device),
            **context.triton_ops(device)}


def triton_supports() -> dict[str, Callable]:
    """Prefill-type Triton kernels hold a (BLOCK_M, d) Q tile and K/V tiles in shared memory: d <= 256."""
    def head_dim(case) -> str | None:
        lim = TRITON_MAX_D[case.op]
        if max(case.p["d"], value_dim(case.p)) > lim:
            return f"the Triton {case.op} kernel takes head dims <= {lim} (d={case.p['d']}, d_v={value_dim(case.p)})"
        return None

    return {op: head_dim for op in TRITON_MAX_D}


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import attention as k

        kw = {**_kw(case, inputs.get("sinks")), **_loc(inputs)}
        o, lse = out.numpy("o"), out.numpy("lse")
        x = inputs
        if case.op == "attention.prefill":
            k.prefill(x["q"], x["k"], x["v"], **kw, out=o, out_lse=lse)
        elif case.op == "attention.chunked_prefill":
            k.chunked_prefill(x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["hist"], x.get("block_table"),
                              **kw, out=o, out_lse=lse)
        elif case.op == "attention.decode":
            k.decode(x["q"], x["k_cache"], _values(case, x), x["seqlens"], **kw, out=o, out_lse=lse)
        else:
            k.decode_paged(x["q"], x["k_cache"], _values(case, x), x["block_table"], x["seqlens"], **kw, out=o,
                           out_lse=lse)
        return {"o": o, "lse": lse}

    return {**{op: run for op in ("attention.prefill", *DECODE_OPS, "attention.chunked_prefill")}, **cpu_backward_ops(),
            **context.cpu_ops()}


def torch_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch import attention as k

        args, kw = _torch_args(case, inputs, device)
        fn = {"attention.prefill": k.attention, "attention.varlen": k.varlen, "attention.decode": k.decode,
              "attention.decode_paged": k.decode_paged, "attention.decode_split": k.decode_split,
              "attention.chunked_prefill": k.chunked_prefill}[case.op]
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

    return {**{op: run for op in ("attention.prefill", "attention.varlen", *DECODE_OPS, "attention.decode_split",
                                  "attention.chunked_prefill")}, **torch_backward_ops(device),
            **context.torch_ops(device)}


# -- backward ops (attention.prefill_backward, attention.varlen_backward) --------------------------
BACKWARD_OPS = ("attention.prefill_backward", "attention.varlen_backward")


def _grad_names(case) -> tuple[str, ...]:
    return ("dq", "dk", "dv", "dsinks") if case.p["sink"] else ("dq", "dk", "dv")


def _backward_args(case, t: dict[str, Any]):
    """Positional tensors (q, k, v, [cu_seqlens_q, cu_seqlens_k], o, lse, do, dlse) and keywords."""
    seq = (t["cu_seqlens_q"], t["cu_seqlens_k"]) if case.op == "attention.varlen_backward" else ()
    return (t["q"], t["k"], t["v"], *seq, t["o"], t["lse"], t["do"], t.get("dlse")), _kw(case, t.get("sinks"))


def triton_backward_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton import attention_bwd as bwd

        t = {k: to_torch(v, device) for k, v in inputs.items()}
        args, kw = _backward_args(case, t)
        bufs = {n: out.torch(n, device) for n in _grad_names(case)}
        outs = dict(out_dq=bufs["dq"], out_dk=bufs["dk"], out_dv=bufs["dv"], out_dsinks=bufs.get("dsinks"))
        if case.op == "attention.varlen_backward":
            bwd.varlen_backward(*args, *_max_lens(inputs), **kw, **outs)
        else:
            bwd.prefill_backward(*args, **kw, **outs)
        return bufs

    return {op: run for op in BACKWARD_OPS}


def cpu_backward_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import attention_bwd as bwd

        args, kw = _backward_args(case, inputs)
        bufs = {n: out.numpy(n) for n in _grad_names(case)}
        fn = bwd.varlen_backward if case.op == "attention.varlen_backward" else bwd.prefill_backward
        fn(*args, **kw, out_dq=bufs["dq"], out_dk=bufs["dk"], out_dv=bufs["dv"], out_dsinks=bufs.get("dsinks"))
        return bufs

    return {op: run for op in BACKWARD_OPS}


def torch_backward_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch import attention as k

        t = {n: to_torch(v, device) for n, v in inputs.items()}
        kw = _kw(case, t.get("sinks"))
        if case.op == "attention.varlen_backward":
            g = k.varlen_backward(t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"], t["do"], t.get("dlse"), **kw)
        else:
            g = k.prefill_backward(t["q"], t["k"], t["v"], t["do"], t.get("dlse"), **kw)
        bufs = {n: out.torch(n, device) for n in _grad_names(case)}
        for n, buf in bufs.items():
            buf.copy_(g[n])
        return bufs

    return {op: run for op in BACKWARD_OPS}
