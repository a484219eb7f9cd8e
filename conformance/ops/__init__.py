"""The op registry: op families register through the entry-point group `kernel_parity.ops`.

Each entry point names a module (or module:attribute) that exports `SPECS`, a tuple of OpSpecs;
the entry point's name is the family's stem. Our own families (softmax, combine, attention,
kvcache) register there exactly as an outside repo's do (pyproject.toml), so adding a family never
means editing a list here. `register()` adds specs programmatically (self-tests)."""

from __future__ import annotations

import fnmatch
import importlib
from functools import lru_cache

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.case import Case, split_id
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.spec import OpSpec

ENTRY_POINT_GROUP = "kernel_parity.ops"
_EXTRA: dict[str, OpSpec] = {}  # registered programmatically


def families() -> dict[str, str]:
    """stem -> "module[:attribute]" of every installed op family."""
    from importlib import metadata

    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_family(stem: str, target: str) -> tuple[OpSpec, ...]:
    mod_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(mod_name)
        for part in (attr or "SPECS").split("."):
            obj = getattr(obj, part)
    except Exception as e:  # a broken family is a one-line usage error, naming the entry point
        raise UsageError(f"op family {stem!r} ({target}) cannot be loaded: {type(e).__name__}: {e}") from None
    specs = tuple(obj)
    if not all(isinstance(sp, OpSpec) for sp in specs):
        raise UsageError(f"op family {stem!r} ({target}): SPECS must be a tuple of OpSpec")
    return specs


@lru_cache(maxsize=None)
def _installed() -> dict[str, OpSpec]:
    specs: dict[str, OpSpec] = {}
    for stem, target in sorted(families().items()):
        for spec in _load_family(stem, target):
            if spec.name in specs:
                raise UsageError(f"op {spec.name!r} is registered twice (family {stem!r} and another)")
            specs[spec.name] = spec
    return specs


def all_specs() -> dict[str, OpSpec]:
    return {**_installed(), **_EXTRA}


def register(specs: tuple[OpSpec, ...] | list[OpSpec]) -> None:
    """Add op specs to this process's registry (self-tests; installed families use entry points)."""
    for spec in specs:
        if spec.name in _installed():
            raise UsageError(f"op {spec.name!r} is already registered by an installed family")
        _EXTRA[spec.name] = spec


def unregister(names: list[str]) -> None:
    for n in names:
        _EXTRA.pop(n, None)


def _suggest(name: str, known: list[str]) -> str:
    """'did you mean X?' for a near miss (difflib), else the list of known names (parity list ops)."""
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    close += [k for k in known if name and k.split(".", 1)[-1] == name.split(".", 1)[-1] and k not in close]
    if close:
        return f"did you mean {' or '.join(repr(c) for c in close[:3])}?"
    stems = sorted({k.split('.', 1)[0] for k in known})
    return f"{len(known)} ops in the families {', '.join(stems)}: `parity list ops` shows them"


def get(name: str) -> OpSpec:
    specs = all_specs()
    if name not in specs:
        raise UsageError(f"unknown op {name!r} ({_suggest(name, list(specs))})")
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
            raise UsageError(f"--op {pat!r} matches no op ({_suggest(pat, list(specs))})")
        out.extend(h for h in hits if h not in out)
    return out


def make_case(op: str, backend: str, dtype: str, params: dict, dist: str, seed: int) -> Case:
    """A validated case (UsageError naming the bad field otherwise)."""
    spec = get(op)
    dtype = spec.canonical_dtype(dtype)
    params = spec.validate(params, dtype, dist)
    return Case.make(op, backend, dtype, params, dist, seed)


def parse_case(text: str) -> Case:
    """Parse and validate a case id; the backend name is checked by the caller's registry."""
    op, backend, dtype, params_text, dist, seed = split_id(text)
    spec = get(op)
    params = spec.params.parse(op, params_text)
    return make_case(op, backend, dtype, params, dist, seed)
