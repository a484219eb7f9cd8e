"""Backends: adapters that bind kernels (ours and third-party) to op names.

A backend has a `name`, a `device`, the `dtypes` it handles, and for each op it implements
an adapter `fn(case, inputs, out) -> {output name: array or tensor}`:
- `inputs` are NumPy arrays in their storage dtypes (possibly views into padded buffers);
- `out` is a `conformance.poison.OutputRequest`: `out.numpy(name)` / `out.torch(name, device)`
  give poisoned output buffers with canaries (using them is what lets the framework detect
  unwritten elements and out-of-bounds writes; returning fresh arrays is allowed).
`supports(case)` returns None or the reason the case is not supported: an unsupported case is
a *skip with that reason* in every report, never a silent pass. It is asked before the case's
inputs and golden are built. Optional hooks:
- `available() -> None | reason`: why the backend cannot run at all on this machine;
- `precondition(case, inputs) -> None | reason`: a data-dependent requirement (e.g. "every
  sequence has at least one visible key"); a reason makes the case a skip that says so;
- `outside_contract(case, inputs) -> {output: (bool mask, reason)}`: elements the kernel does not
  promise (e.g. rows with no visible key); they are reported as outside the contract, not judged.
A hook that raises makes that case an `error` with the message; the run goes on. Adapters find
the backend and its device on the request: `out.backend`, `out.device`. A plugin may not take the
name of a built-in backend.

Third-party backends register through the entry-point group `kernel_parity.backends`
(name = "module:object") or `--backend module:object` on the command line. The object may be
a Backend instance, a Backend subclass, or a zero-argument factory returning one.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

from kernel_parity.conformance.errors import UsageError

ENTRY_POINT_GROUP = "kernel_parity.backends"
BUILTIN = ("triton", "cpu", "torch")

Adapter = Callable[[Any, dict, Any], dict]


@dataclass(frozen=True)
class NotProvided:
    """Returned by an adapter for an output its kernel does not compute (e.g. SDPA's public API
    has no LSE). The output is recorded as not provided, with the reason; it never passes or
    fails anything."""

    reason: str


@dataclass
class Backend:
    name: str
    device: str = "cpu"
    dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16")
    ops: dict[str, Adapter] = field(default_factory=dict)
    origin: str | None = None  # "module:object" for a third-party backend (goes into repro lines)
    doc: str = ""
    triton: bool = False  # its kernels are Triton: prepared like ours (the interpreter on a machine without a GPU)
    # its kernels claim run-to-run determinism (the same bits for the same inputs: no atomics, no order that
    # depends on scheduling): a borderline case is then also re-run on its own inputs, and differing bits
    # fail it (kind `determinism`; conformance/runner.py `_recheck`)
    deterministic: bool = False
    # op -> the reference its kernel claims to compute: a name, or fn(case) -> name when it depends on
    # the case (a GEMM whose decode path computes the dequantized product and whose FP8 path the
    # emulated one)
    claims: dict[str, str | Callable[[Any], str | None]] = field(default_factory=dict)
    backward: dict[str, Adapter] = field(default_factory=dict)  # op -> fn(case, inputs, cotangents, out)
    # op -> fn(case) -> None | reason: what one op's kernel cannot do (a weight format it has no path for)
    support: dict[str, Callable[[Any], str | None]] = field(default_factory=dict)
    # op -> fn(case, inputs, out) -> (call, what): the untimed set-up of one kernel call (a training
    # step's forward, whose saved tensors the backward kernels read) and the zero-argument call that
    # `parity bench` times in place of the whole adapter; `what` goes into the record's perf["timed"]
    timed: dict[str, Callable[[Any, dict, Any], tuple[Callable[[], Any], str]]] = field(default_factory=dict)

    def available(self) -> str | None:
        """None, or why this backend cannot run at all on this machine (every case skips)."""
        return None

    def supports(self, case: Any) -> str | None:
        if case.op not in self.ops:
            return f"{self.name} has no kernel for {case.op}"
        if case.dtype not in self.dtypes:
            return f"{self.name} does not support {case.dtype}"
        check = self.support.get(case.op)
        return check(case) if check is not None else None

    def run(self, case: Any, inputs: dict, out: Any) -> dict:
        return self.ops[case.op](case, inputs, out)

    def describe(self) -> str:
        return f"{self.name} ({self.device})"


def claimed_reference(backend: Any, case: Any) -> str | None:
    """The reference `backend` claims for `case` (None: the op's own choice)."""
    claim = (getattr(backend, "claims", None) or {}).get(case.op)
    return claim(case) if callable(claim) else claim


def _builtin(name: str) -> Backend:
    module = importlib.import_module(f"kernel_parity.conformance.backends.{name}_backend")
    return module.make()


def load_object(spec: str) -> Backend:
    """Load a third-party backend from "module:object"; UsageError with a one-line reason."""
    mod_name, sep, obj_name = spec.partition(":")
    if not sep or not mod_name or not obj_name:
        raise UsageError(f"--backend {spec!r} must be a built-in name or module:object")
    if os.getcwd() not in sys.path:  # like `python -m`: modules of the current directory resolve first
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # an import error in user code is a usage error here
        raise UsageError(f"cannot import backend module {mod_name!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in obj_name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"backend module {mod_name!r} has no attribute {obj_name!r}")
        obj = getattr(obj, part)
    backend = coerce(obj, spec)
    backend.origin = spec
    return _with_triton(backend)


def _prepare_triton() -> None:
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()


def _with_triton(backend: Any) -> Any:
    """A backend that declares Triton kernels gets our interpreter preparation in `available()`."""
    if not getattr(backend, "triton", False):
        return backend
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready

    own = backend.available

    def available() -> str | None:
        return interpreter_ready() or own()

    backend.available = available
    return backend


def coerce(obj: Any, where: str) -> Backend:
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "run")):
        try:
            obj = obj()
        except Exception as e:  # a plugin's broken factory is a usage error here, one line
            first = (str(e).strip().splitlines() or [""])[0]
            raise UsageError(f"backend {where!r}: its factory raised {type(e).__name__}: {first}") from None
    missing = [a for a in ("name", "run", "supports") if not hasattr(obj, a)]
    if missing:
        raise UsageError(f"backend {where!r} is not a Backend: missing {', '.join(missing)}")
    if not isinstance(obj.name, str) or not obj.name:
        raise UsageError(f"backend {where!r} has no valid name")
    for attr, default in (("device", "cpu"), ("origin", None), ("doc", "")):
        if not hasattr(obj, attr):
            setattr(obj, attr, default)
    if not hasattr(obj, "available"):
        obj.available = lambda: None
    if not hasattr(obj, "describe"):
        obj.describe = lambda: f"{obj.name} ({obj.device})"
    return obj


def entry_points() -> dict[str, str]:
    """name -> "module:object" for backends registered by installed packages."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


class Registry:
    """Backends by name: built-ins, entry points, and explicit module:object specs."""

    def __init__(self, extra: list[str] | None = None) -> None:
        self._cache: dict[str, Backend] = {}
        self._eps = entry_points()
        if extra:  # a plugin module may import triton or decorate Triton kernels when it loads
            _prepare_triton()
        for name, spec in self._eps.items():
            if name in BUILTIN:
                raise UsageError(f"the installed backend entry point {name!r} ({spec}) takes the name of the "
                                 f"built-in backend {name!r}: a plugin must choose another name")
        for spec in extra or []:
            b = load_object(spec)
            if b.name in BUILTIN:
                raise UsageError(f"backend {spec!r} is named {b.name!r}, the name of a built-in backend: "
                                 f"a plugin must choose another name")
            other = self._cache.get(b.name)
            if other is not None and other.origin != spec:
                raise UsageError(f"backends {other.origin!r} and {spec!r} are both named {b.name!r}")
            self._cache[b.name] = b

    def names(self) -> list[str]:
        names = list(BUILTIN) + [n for n in self._eps if n not in BUILTIN]
        return names + [n for n in self._cache if n not in names]

    def get(self, name: str) -> Backend:
        if name in self._cache:
            return self._cache[name]
        if name in BUILTIN:
            b = _builtin(name)
        elif name in self._eps:
            _prepare_triton()
            b = load_object(self._eps[name])
            if b.name != name:
                raise UsageError(f"the backend entry point {name!r} ({self._eps[name]}) makes a backend named "
                                 f"{b.name!r}: the names must agree")
            b.origin = None  # installed: resolvable by name alone
        else:
            raise UsageError(f"unknown backend {name!r} (known: {', '.join(self.names())}; or use module:object)")
        self._cache[name] = b
        return b

    def add(self, backend: Backend) -> None:
        """Serve `backend` under its own name in this registry (a replay's saved outputs)."""
        self._cache[backend.name] = backend

    def loaded(self) -> list[Backend]:
        return list(self._cache.values())

    def extra_specs(self) -> list[str]:
        return [b.origin for b in self._cache.values() if b.origin]
