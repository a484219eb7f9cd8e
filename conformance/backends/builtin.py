"""Adapters of the built-in backends: conformance/backends/<stem>.py for every registered op family
that has such a module (no list of stems here: a family registers through `kernel_parity.ops`)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

def adapter_stems() -> list[str]:
    """Registered op families with an adapter module among the built-in backends."""
    from kernel_parity.conformance import ops

    stems = sorted({spec.stem for spec in ops.all_specs().values()})
    return [s for s in stems if importlib.util.find_spec(f"kernel_parity.conformance.backends.{s}") is not None]


def collect(factory: str, *args: Any) -> dict[str, Any]:
    """Merge `<factory>(*args)` of every adapter module into one table keyed by op: adapters
    (`<backend>_ops`), or the references a backend's kernels claim (`<backend>_claims`)."""
    ops: dict[str, Callable] = {}
    for stem in adapter_stems():
        module = importlib.import_module(f"kernel_parity.conformance.backends.{stem}")
        fn = getattr(module, factory, None)
        if fn is not None:
            ops.update(fn(*args))
    return ops
