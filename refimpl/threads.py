"""Independent pieces of a golden on threads: NumPy releases the GIL in its array loops, so runs of
blocks (quantizers) or request chunks (MLA decode) computed on threads use a worker's share of the
cores, with the same results as one call (each piece is computed exactly as it would be alone)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

_PREFIX = "golden-piece"
T = TypeVar("T")
R = TypeVar("R")


def threads() -> int:
    """The threads a golden may use: a worker process's share of the cores (OMP_NUM_THREADS, which
    conformance/parallel.py sets per worker), else the machine's cores."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def on_threads(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(x) for x in items], on up to threads() threads (in order; one thread: a plain loop). Called from one
    of these threads (a piece that has pieces of its own: an expert whose GGML blocks are dequantized in runs), a
    plain loop: the cores are taken already."""
    items = list(items)
    n = min(threads(), len(items))
    if n <= 1 or threading.current_thread().name.startswith(_PREFIX):
        return [fn(x) for x in items]
    with ThreadPoolExecutor(n, thread_name_prefix=_PREFIX) as ex:
        return list(ex.map(fn, items))
