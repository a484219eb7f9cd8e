"""Hypothesis strategies that draw cases from op specs.

Parameters are drawn from each spec's schema, biased to its edge values (1, primes,
2^k - 1, 2^k + 1, tile boundaries); tensors come from the drawn seed, so every example is a
case id and a failure is replayable with `parity repro`. `bounds` narrows a parameter's range
(the Triton interpreter and the CPU budget keep shapes small in CI).
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import assume
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.params import Int, OneOf

SEED_MAX = 2**32 - 1
PENDING = "pending"  # placeholder backend: tests parametrized over backends call case.with_backend()


def param(name: str, p: Int | OneOf, bound: tuple[int, int] | list | None) -> st.SearchStrategy:
    if isinstance(p, OneOf):
        values = [v for v in p.values if bound is None or v in bound]
        return st.sampled_from(values)
    if isinstance(bound, list):  # explicit values (repeats weight them)
        return st.sampled_from([v for v in bound if p.lo <= v <= p.hi])
    lo, hi = (p.lo, p.hi) if bound is None else (max(p.lo, bound[0]), min(p.hi, bound[1]))
    edges = [v for v in p.edge_values() if lo <= v <= hi]
    # Edges most of the time, the whole range the rest: bugs live at boundaries.
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi)) if edges else st.integers(lo, hi)


@st.composite
def cases(draw: Any, op: str, backend: str = PENDING, dtypes: tuple[str, ...] | None = None,
          dists: tuple[str, ...] | None = None, max_numel: int | None = None,
          transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None, **bounds: Any) -> Case:
    """A valid case of `op` on `backend`; `bounds` maps a parameter to (lo, hi) or a list of values.

    `transform` derives parameters from the drawn ones before validation (e.g. hq = hkv x group),
    so related parameters are drawn valid instead of rejected.
    """
    spec = ops.get(op)
    params = {name: draw(param(name, p, bounds.get(name)), label=name) for name, p in spec.params.params.items()}
    if transform is not None:
        params = transform(params)
    dtype = draw(st.sampled_from(list(dtypes or spec.dtypes)), label="dtype")
    dist = draw(st.sampled_from(list(dists or spec.dists)), label="dist")
    seed = draw(st.integers(0, SEED_MAX), label="seed")
    if max_numel is not None:
        shapes = spec.output_shapes(params)
        assume(sum(_numel(s) for s in shapes.values()) <= max_numel)
    try:
        return ops.make_case(op, backend, dtype, params, dist, seed)
    except UsageError:
        assume(False)  # a cross-parameter constraint rejected the draw
        raise


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
