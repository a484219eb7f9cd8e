"""The op registry: one module per stem, each exporting SPECS."""

from __future__ import annotations

import fnmatch
import importlib
from functools import lru_cache

from conformance import dtypes as dt
from conformance.case import Case, split_id
from conformance.errors import UsageError
from conformance.spec import OpSpec

STEMS = ("softmax", "combine", "attention", "kvcache")


@lru_cache(maxsize=None)
def all_specs() -> dict[str, OpSpec]:
    specs: dict[str, OpSpec] = {}
    for stem in STEMS:
        for spec in importlib.import_module(f"conformance.ops.{stem}").SPECS:
            specs[spec.name] = spec
    return specs


def get(name: str) -> OpSpec:
    specs = all_specs()
    if name not in specs:
        raise UsageError(f"unknown op {name!r} (known: {', '.join(specs)})")
    return specs[name]


def match(patterns: list[str] | None) -> list[OpSpec]:
    """Specs whose name equals, starts with `<pattern>.`, or glob-matches any pattern."""
    specs = all_specs()
    if not patterns:
        return list(specs.values())
    out = []
    for pat in patterns:
        hits = [s for n, s in specs.items()
                if n == pat or n.startswith(pat + ".") or fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise UsageError(f"--op {pat!r} matches no op (known: {', '.join(specs)})")
        out.extend(h for h in hits if h not in out)
    return out


def make_case(op: str, backend: str, dtype: str, params: dict, dist: str, seed: int) -> Case:
    """A validated case (UsageError naming the bad field otherwise)."""
    spec = get(op)
    dtype = dt.canonical(dtype)
    params = spec.validate(params, dtype, dist)
    return Case.make(op, backend, dtype, params, dist, seed)


def parse_case(text: str) -> Case:
    """Parse and validate a case id; the backend name is checked by the caller's registry."""
    op, backend, dtype, params_text, dist, seed = split_id(text)
    spec = get(op)
    params = spec.params.parse(op, params_text)
    return make_case(op, backend, dtype, params, dist, seed)
