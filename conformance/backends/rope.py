"""Adapters binding the rotary-family kernels of each built-in backend to `rope.rope` and
`rope.kv_update`.

The table a case gives is handed to the kernel in its own layout: `cos`/`sin` (cos_sin), the fp16
(cos, sin) pairs (cs_f16), or Meta's complex64 freqs_cis (cis: the case stores its float32
(real, imag) pairs; the adapters view them as complex, with no copy); table=theta passes theta
and the scaling. rope.rope_backward hands the kernels dy (the cotangent) where the forward hands x:
our Triton and C backward run the forward kernel at the negated angles. With inplace=1 they are
called with out = dy's own buffer (C-Kernel-Engine's rope_backward_qk: d_q in and out), and that buffer
is returned as dx; the torch baseline's autograd forms dx in a fresh tensor before it is copied over
dy, so its in-place form has no aliasing to get wrong (it is the reference behaviour, not a test of
torch). kv_update writes in place, so each adapter first copies the old caches into the
poisoned output buffers (harness work, outside what is judged) and lets the kernel write there;
with q (hq > 0) each kernel also writes the rotated queries into the q_rope output buffer; a ragged
case (tokens=ragged) hands the kernels its seq_len / seq_start.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kernel_parity.conformance.backends._torch import to_torch


def _angles_torch(case, inputs, device) -> dict[str, Any]:
    import torch

    p = case.p
    if p["table"] == "theta":
        return {"theta": float(p["theta"]), "scaling": p["scaling"]}
    if p["table"] == "cos_sin":
        return {"cos": to_torch(inputs["cos"], device), "sin": to_torch(inputs["sin"], device)}
    table = to_torch(inputs["table"], device)
    return {"table": torch.view_as_complex(table) if p["table"] == "cis" else table}


def _angles_numpy(case, inputs) -> dict[str, Any]:
    p = case.p
    if p["table"] == "theta":
        return {"theta": float(p["theta"]), "scaling": p["scaling"]}
    if p["table"] == "cos_sin":
        return {"cos": inputs["cos"], "sin": inputs["sin"]}
    table = inputs["table"]
    return {"table": table.view(np.complex64)[..., 0] if p["table"] == "cis" else table}


def _style(case) -> dict[str, Any]:
    return {"style": case.p["style"], "rot": case.p["rot"], "at": case.p["at"]}


def _torch_kv(device: str, kernel: Callable[[], Any]) -> Callable:
    def run(case, inputs, out):
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        kc, vc = out.torch("k_cache", device), out.torch("v_cache", device)
        kc.copy_(t["k_cache"])
        vc.copy_(t["v_cache"])
        q = t.get("q")
        qo = None if q is None else out.torch("q_rope", device)
        kernel()(kc, vc, t["k_new"], t["v_new"], t["pos"], t["table"], block_table=t.get("block_table"),
                 cache_loc=t.get("cache_loc"), q=q, q_out=qo, **{k: t[k] for k in ("seq_len", "seq_start") if k in t})
        return {"k_cache": kc, "v_cache": vc, **({} if q is None else {"q_rope": qo})}

    return run


def triton_ops(device: str) -> dict[str, Callable]:
    def rope(case, inputs, out):
        from kernel_parity.kernels.triton import rope as k

        y = out.torch("y", device)
        k.rope(to_torch(inputs["x"], device), to_torch(inputs["positions"], device),
               **_angles_torch(case, inputs, device), **_style(case), out=y)
        return {"y": y}

    def kernel():
        from kernel_parity.kernels.triton.rope_kv import kv_update

        return kv_update

    def rope_backward(case, inputs, out):
        from kernel_parity.kernels.triton import rope as k

        dy = to_torch(inputs["dy"], device)
        dx = dy if case.p.get("inplace", 0) else out.torch("dx", device)
        k.rope_backward(dy, to_torch(inputs["positions"], device), **_angles_torch(case, inputs, device),
                        **_style(case), out=dx)
        return {"dx": dx}

    return {"rope.rope": rope, "rope.kv_update": _torch_kv(device, kernel), "rope.rope_backward": rope_backward}


def cpu_ops() -> dict[str, Callable]:
    def rope(case, inputs, out):
        from kernel_parity.kernels.cpu import rope as k

        y = out.numpy("y")
        k.rope(inputs["x"], inputs["positions"], **_angles_numpy(case, inputs), **_style(case), out=y)
        return {"y": y}

    def kv_update(case, inputs, out):
        from kernel_parity.kernels.cpu import rope as k

        kc, vc = out.numpy("k_cache"), out.numpy("v_cache")
        kc[...] = inputs["k_cache"]
        vc[...] = inputs["v_cache"]
        q = inputs.get("q")
        qo = None if q is None else out.numpy("q_rope")
        k.kv_update(kc, vc, inputs["k_new"], inputs["v_new"], inputs["pos"], inputs["table"],
                    block_table=inputs.get("block_table"), cache_loc=inputs.get("cache_loc"), q=q, q_out=qo,
                    seq_len=inputs.get("seq_len"), seq_start=inputs.get("seq_start"))
        return {"k_cache": kc, "v_cache": vc, **({} if q is None else {"q_rope": qo})}

    def rope_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import rope as k

        dx = inputs["dy"] if case.p.get("inplace", 0) else out.numpy("dx")
        k.rope_backward(inputs["dy"], inputs["positions"], **_angles_numpy(case, inputs), **_style(case), out=dx)
        return {"dx": dx}

    return {"rope.rope": rope, "rope.kv_update": kv_update, "rope.rope_backward": rope_backward}


def torch_ops(device: str) -> dict[str, Callable]:
    def rope(case, inputs, out):
        from kernel_parity.kernels.torch import rope as k

        y = out.torch("y", device)
        y.copy_(k.rope(to_torch(inputs["x"], device), to_torch(inputs["positions"], device),
                       **_angles_torch(case, inputs, device), **_style(case)))
        return {"y": y}

    def kernel():
        from kernel_parity.kernels.torch.rope import kv_update

        return kv_update

    def rope_backward(case, inputs, out):
        from kernel_parity.kernels.torch import rope as k

        dy = to_torch(inputs["dy"], device)
        dx = dy if case.p.get("inplace", 0) else out.torch("dx", device)
        dx.copy_(k.rope_backward(to_torch(inputs["x"], device), to_torch(inputs["positions"], device), dy,
                                 **_angles_torch(case, inputs, device), **_style(case)))
        return {"dx": dx}

    return {"rope.rope": rope, "rope.kv_update": _torch_kv(device, kernel), "rope.rope_backward": rope_backward}
