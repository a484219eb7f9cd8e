"""Running a backend on hand-modified inputs, for metamorphic (invariant) tests.

A metamorphic test builds a case's inputs, transforms them (repeat the KV heads, permute the
pages, change masked keys), runs the same backend on both, and compares the two outputs: bit
for bit where the arithmetic must be identical, within the op's own limits where it may be
reordered. Every assertion names both repro commands.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.backends import NotProvided, Registry
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.runner import Prepared, tier_of, to_numpy
from kernel_parity.conformance.poison import OutputRequest
from kernel_parity.conformance.pytest_plugin import note_draw

_REGISTRY = Registry()
_PLUGINS: list[str] = []  # names of the --parity-backend plugins, when given


def use_backends(specs: list[str]) -> None:
    """Load --parity-backend module:object plugins; property tests then run on them alone."""
    global _REGISTRY
    _REGISTRY = Registry(extra=list(specs))
    _PLUGINS[:] = [b.name for b in _REGISTRY.loaded()]


def backends_for(builtin: tuple[str, ...]) -> list[str]:
    """The backends a property test runs on: the plugins if any were given, else its built-ins."""
    return list(_PLUGINS) or list(builtin)


def registry() -> Registry:
    return _REGISTRY


def inputs_of(case: Case) -> dict[str, np.ndarray]:
    return Prepared(ops.get(case.op), case).inputs


def run(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Outputs of case.backend on `inputs` (skips the test if the backend cannot run the case)."""
    backend = _REGISTRY.get(case.backend)
    if isinstance(getattr(backend, "ops", None), dict) and case.op not in backend.ops:
        pytest.skip(f"{backend.name} has no kernel for {case.op}")  # skips the whole test, not one draw
    unavailable = backend.available()
    if unavailable:  # the machine cannot run it at all: every draw would be rejected (Unsatisfiable)
        pytest.skip(f"{backend.name} is unavailable: {unavailable}")
    why = backend.supports(case)
    note_draw(why)
    if why:
        from hypothesis import assume
        from hypothesis.control import currently_in_test_context

        if currently_in_test_context():
            assume(False)  # an unsupported draw is rejected, not a pass
        pytest.skip(why)
    spec = ops.get(case.op)
    shapes = {k: tuple(v) for k, v in spec.output_shapes(case.p).items()}
    req = OutputRequest(shapes, {k: spec.out_dtype(k, case.dtype) for k in spec.outputs},
                        backend=backend, device=getattr(backend, "device", "cpu"))
    out = backend.run(case, inputs, req)
    return {k: to_numpy(v) for k, v in out.items()}


def assert_same_bits(case: Case, a: dict, b: dict, what: str, names: tuple[str, ...] | None = None) -> None:
    for name in names or tuple(a):
        if isinstance(a[name], NotProvided):
            continue
        x, y = np.ascontiguousarray(a[name]), np.ascontiguousarray(b[name])
        bad = int(np.count_nonzero(x.view(np.uint8) != y.view(np.uint8)))
        assert bad == 0, f"{case.backend} {case.op} {name} changed bits when {what}\n  repro: parity repro {case.id}"


def assert_close(case: Case, got: dict, ref: dict, what: str) -> None:
    """got vs ref (both kernel outputs) within the op's limits for each output."""
    spec = ops.get(case.op)
    for name, out in spec.outputs.items():
        if name not in got or isinstance(got[name], NotProvided):
            continue
        tol_dtype = spec.tol_dtype(name, case.dtype)
        lim = spec.tolerance.limits(name, tol_dtype, case.p, tier_of(spec, case.backend))
        r = ref[name].astype(np.float64)
        g = out.accept_any(got[name], r)
        cmp = compare(g, r, spec.out_dtype(name, case.dtype), lim, tol_dtype)
        assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, (
            f"{case.backend} {case.op} {name} changed beyond its limits when {what}: "
            f"{cmp.anomaly_detail or cmp.metrics}\n  repro: parity repro {case.id}")
