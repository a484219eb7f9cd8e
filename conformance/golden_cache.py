"""An opt-in disk cache of each input group's inputs, references and cotangents.

A kernel change does not change a case's inputs or goldens, and at the models suite's sizes they are
most of a case's time (float64 on the host: seconds to minutes per group). With
`KERNEL_PARITY_GOLDEN_CACHE=DIR` (or `--golden-cache DIR` on run, gate, bench and sweep) an input group
prepared once is written to DIR and read back by every later run that needs it: a gate re-run after a
kernel edit, a run resumed after it was cut, the same selection on another GPU count.

The key is the group's identity (op, dtype, params, dist, seed) and a digest of everything that makes
those arrays: the source files of the op's input builder, references and VJP (and, for the built-in
families, all of refimpl/ and conformance/ops/, inputs.py, dtypes.py), the kernel-parity, NumPy and
ml_dtypes versions. Any change there is a different key, never a stale golden. An entry is one pickle
file, written atomically, and only while its disk keeps KEEP_FREE bytes free beyond twice its size;
one that cannot be read is a miss (recomputed and rewritten), never an error.
Only the cache's owner should write to DIR (a pickle is code). Timings: a hit's `inputs_s` is the time
to read it and its `golden_s` 0, with `cache_read_s` beside them, so never compare speed between a run
that hit the cache and one that did not. Delete DIR to empty it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

ENV = "KERNEL_PARITY_GOLDEN_CACHE"
FORMAT = 1
KEEP_FREE = 4 << 30  # bytes left free on the cache's disk: an entry that would go below is not written
_ROOT = Path(__file__).resolve().parents[1]
_SHARED = ("refimpl", "conformance/ops", "conformance/inputs.py", "conformance/dtypes.py")


def directory() -> Path | None:
    d = os.environ.get(ENV)
    return Path(d) if d else None


def _files_of(objs: list[Any]) -> set[Path]:
    out: set[Path] = set()
    for o in objs:
        if o is None:
            continue
        try:
            out.add(Path(inspect.getfile(inspect.unwrap(o))).resolve())
        except (TypeError, OSError):  # a builtin or a callable object: its type's module
            try:
                out.add(Path(inspect.getfile(type(o))).resolve())
            except (TypeError, OSError):
                pass
    return out


@functools.lru_cache(maxsize=None)
def _shared_digest() -> str:
    import ml_dtypes
    import numpy as np

    from kernel_parity import __version__

    h = hashlib.sha256(f"{FORMAT} {__version__} {np.__version__} {ml_dtypes.__version__}".encode())
    for rel in _SHARED:
        p = _ROOT / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


_OP_DIGESTS: dict[str, str] = {}


def _op_digest(spec: Any) -> str:
    if spec.name not in _OP_DIGESTS:
        h = hashlib.sha256(_shared_digest().encode())
        fns = [spec.golden, spec.make_inputs, spec.vjp, *spec.all_references().values()]
        for f in sorted(_files_of(fns)):
            h.update(str(f).encode())
            h.update(f.read_bytes())
        _OP_DIGESTS[spec.name] = h.hexdigest()
    return _OP_DIGESTS[spec.name]


def _nbytes(x: Any) -> int:
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    return int(getattr(x, "nbytes", 0))


def key(spec: Any, case: Any, variant: str = "") -> str:
    """`variant`: how the references were made beyond the group's identity (a sampled group's
    threshold, conformance/sampling.py): entries of a sampled and a full run never mix."""
    tail = f" {variant}" if variant else ""
    return hashlib.sha256(f"{_op_digest(spec)} {case.input_key!r}{tail}".encode()).hexdigest()


def read(spec: Any, case: Any, variant: str = "") -> dict | None:
    """The cached group (inputs, references, cotangents), or None (no cache, a miss, unreadable)."""
    d = directory()
    if d is None:
        return None
    path = d / f"{key(spec, case, variant)}.pkl"
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if not isinstance(entry, dict) or entry.get("id") != repr(case.input_key):
            return None
        return entry
    except Exception:  # missing, truncated, from another format: a miss
        return None


def write(spec: Any, case: Any, inputs: dict, references: dict, cotangents: dict, variant: str = "",
          sample: Any = None) -> None:
    """Store a prepared group atomically; a cache that cannot be written is skipped silently (the
    run's results never depend on it)."""
    d = directory()
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        size = sum(_nbytes(x) for x in (inputs, references, cotangents))
        if shutil.disk_usage(d).free < 2 * size + KEEP_FREE:  # never fill the disk the run needs
            return
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"id": repr(case.input_key), "inputs": inputs, "references": references,
                         "cotangents": cotangents, "sample": sample}, f, protocol=5)
        os.replace(tmp, d / f"{key(spec, case, variant)}.pkl")
    except Exception:
        try:
            os.unlink(tmp)  # noqa: F821 (bound when mkstemp succeeded)
        except Exception:
            pass
