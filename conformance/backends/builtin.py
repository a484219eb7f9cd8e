"""Which stems have adapters for the built-in backends (conformance/backends/<stem>.py)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

ADAPTER_STEMS = ("softmax", "combine", "attention", "kvcache")


def collect(factory: str, *args: Any) -> dict[str, Callable]:
    """Merge `<factory>(*args)` of every adapter stem into one op -> adapter table."""
    ops: dict[str, Callable] = {}
    for stem in ADAPTER_STEMS:
        module = importlib.import_module(f"conformance.backends.{stem}")
        ops.update(getattr(module, factory)(*args))
    return ops
