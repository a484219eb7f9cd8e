"""Adapters binding each built-in backend's quantized-KV-cache kernels to `kvquant.*` ops: each op's are in
its own module (conformance/backends/kvquant_update.py, kvquant_decode.py, kvquant_mla.py, kvquant_prefill.py,
kvquant_append.py, kvquant_split.py, kvquant_mla_dense.py), merged here."""

from __future__ import annotations

from typing import Callable


def _merged(factory: str, *args) -> dict[str, Callable]:
    from kernel_parity.conformance.backends import (kvquant_append, kvquant_decode, kvquant_mla,
                                                  kvquant_mla_dense, kvquant_prefill, kvquant_split,
                                                  kvquant_update)

    out: dict[str, Callable] = {}
    for module in (kvquant_update, kvquant_decode, kvquant_mla, kvquant_prefill, kvquant_append, kvquant_split,
                   kvquant_mla_dense):
        fn = getattr(module, factory, None)
        if fn is not None:
            out.update(fn(*args))
    return out


def triton_ops(device: str) -> dict[str, Callable]:
    return _merged("triton_ops", device)


def cpu_ops() -> dict[str, Callable]:
    return _merged("cpu_ops")


def torch_ops(device: str) -> dict[str, Callable]:
    return _merged("torch_ops", device)
