"""Moving NumPy case inputs to torch without losing their bits, strides or padding."""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import storage

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def torch_available() -> str | None:
    try:
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"torch is not importable ({type(e).__name__}: {e})"
    return None


def cuda_available() -> bool:
    try:
        import torch
    except Exception:
        return False
    return bool(torch.cuda.is_available())


_CACHE: dict | None = None  # `parity bench`: (array identity, device) -> the tensor made once


class device_inputs:
    """While active, to_torch moves each input array once and hands the same tensor back on later
    calls (a bench times the kernel, not the host-to-device copy). `with device_inputs(): ...`"""

    def __enter__(self) -> "device_inputs":
        global _CACHE
        self._old, _CACHE = _CACHE, {}
        return self

    def __exit__(self, *exc: Any) -> None:
        global _CACHE
        _CACHE = self._old


def to_torch(a: np.ndarray, device: Any) -> Any:
    """A torch tensor on `device` with a's values, bit for bit, and a's strides.

    A view into a padded buffer is moved with its whole buffer, so the padding (NaN poison)
    travels too and a kernel that ignores the row stride reads it.
    """
    if _CACHE is not None:
        key = (id(a), a.__array_interface__["data"][0], a.shape, a.strides, str(device))
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = (a, _to_torch(a, device))  # the array is kept alive with its tensor
        return hit[1]
    return _to_torch(a, device)


def _to_torch(a: np.ndarray, device: Any) -> Any:
    import torch

    base = storage(a)
    if base.dtype != a.dtype:  # a reinterpreting view (int32 words of a uint32 buffer): move a's own copy
        a = base = a.copy()
    d = dt.of_array(a)
    if d.np.kind == "V" or d.np.type.__module__ == "ml_dtypes":  # bf16, fp8 (ml_dtypes types; e5m2's kind is
        # "f", not "V"): move the bits, view them as torch's type
        if d.torch_name is None:
            raise TypeError(f"torch has no dtype for {d.name}")
        t = torch.from_numpy(np.ascontiguousarray(base).view(_SIGNED[d.np.itemsize])).to(device)
        t = t.view(getattr(torch, d.torch_name))
    else:
        t = torch.from_numpy(np.ascontiguousarray(base)).to(device)
    if base is a:
        return t
    item = a.itemsize
    offset = (a.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    return t.reshape(-1).as_strided(a.shape, tuple(s // item for s in a.strides), offset)


def torch_dtype(d: dt.DType) -> Any:
    import torch

    return getattr(torch, d.torch_name)


def autograd_timed(run: Any, what: str) -> Any:
    """`Backend.timed` for an eager adapter whose backward is torch.autograd.grad through a forward it
    builds: the adapter runs once (untimed) with its autograd.grad calls kept (retain_graph), and the
    timed call replays those calls alone, as benchmarks/gpu_layers_bwd.py times eager torch. An adapter
    that made no autograd.grad call is timed whole."""
    def split(case: Any, inputs: dict, out: Any) -> tuple[Any, str | None]:
        import torch

        real, calls = torch.autograd.grad, []

        def keep(outputs: Any, wrt: Any, grad_outputs: Any = None, **kw: Any) -> Any:
            kw["retain_graph"] = True
            calls.append((outputs, wrt, grad_outputs, kw))
            return real(outputs, wrt, grad_outputs, **kw)

        torch.autograd.grad = keep
        try:
            run(case, inputs, out)
        finally:
            torch.autograd.grad = real
        if not calls:
            return (lambda: run(case, inputs, out)), None

        def replay() -> None:
            for outputs, wrt, grad_outputs, kw in calls:
                real(outputs, wrt, grad_outputs, **kw)
        return replay, what
    return split
