"""Parameter schemas of an op spec: validation, parsing from case ids, and edge values.

Each parameter type knows its legal values, how to parse one from the text of a case id,
and its edge values (1, primes, 2^k - 1, 2^k + 1, tile boundaries) that strategies favour.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kernel_parity.conformance.errors import UsageError

_INT_TEXT = re.compile(r"^(-?[1-9][0-9]{0,17}|0|-1)$")
PRIMES = (2, 3, 5, 7, 13, 17, 31, 61, 113, 127, 239, 251, 509, 1021, 2039, 4093, 8191, 16381, 65521)


def _edge_ints(lo: int, hi: int, extra: tuple[int, ...]) -> tuple[int, ...]:
    vals = {lo, hi, 1, 2, 3}
    vals.update(PRIMES)
    for k in range(1, 63):
        p = 1 << k
        if p - 1 > hi:
            break
        vals.update((p - 1, p, p + 1))
    vals.update(extra)
    return tuple(sorted(v for v in vals if lo <= v <= hi))


@dataclass(frozen=True)
class Int:
    """An integer in [lo, hi]; `edges` adds op-specific boundaries (tile sizes)."""

    lo: int
    hi: int
    edges: tuple[int, ...] = ()
    doc: str = ""

    def parse(self, name: str, text: str) -> int:
        if not _INT_TEXT.match(text):  # decimal digits only: no "+5", " 5", "5_0", "05"
            raise UsageError(f"parameter {name}={text!r} is not an integer (expected decimal digits, e.g. {name}={self.lo})")
        return int(text)

    def check(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"parameter {name}={value!r} must be an integer")
        if not self.lo <= value <= self.hi:
            raise UsageError(f"parameter {name}={value} is out of range [{self.lo}, {self.hi}]")

    def edge_values(self) -> tuple[int, ...]:
        return _edge_ints(self.lo, self.hi, self.edges)

    def describe(self) -> str:
        return f"int in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of values (ints or short strings)."""

    values: tuple[Any, ...]
    doc: str = ""

    def __init__(self, *values: Any, doc: str = "") -> None:
        object.__setattr__(self, "values", tuple(values))
        object.__setattr__(self, "doc", doc)

    def parse(self, name: str, text: str) -> Any:
        for v in self.values:
            if str(v) == text:
                return v
        raise UsageError(f"parameter {name}={text!r} is not one of {', '.join(map(str, self.values))}")

    def check(self, name: str, value: Any) -> None:
        if value not in self.values or isinstance(value, bool) != any(isinstance(v, bool) for v in self.values):
            raise UsageError(f"parameter {name}={value!r} is not one of {', '.join(map(str, self.values))}")

    def edge_values(self) -> tuple[Any, ...]:
        return self.values

    def describe(self) -> str:
        return "one of " + ", ".join(map(str, self.values))


@dataclass(frozen=True)
class Schema:
    """Ordered parameter schema; the order is the canonical order in case ids."""

    params: dict[str, Int | OneOf] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return tuple(self.params)

    def parse(self, op: str, text: str) -> dict[str, Any]:
        """Parse `k=v,k=v` (any order) into a validated, canonically ordered dict."""
        raw: dict[str, str] = {}
        if text not in ("", "-"):
            for part in text.split(","):
                k, sep, v = part.partition("=")
                if not sep or not k:
                    raise UsageError(f"malformed parameter {part!r} in {text!r}: expected name=value")
                if k in raw:
                    raise UsageError(f"parameter {k!r} given twice in {text!r}")
                raw[k] = v
        values = {}
        for k, v in raw.items():
            if k not in self.params:
                raise UsageError(f"{op} has no parameter {k!r} (parameters: {', '.join(self.params) or 'none'})")
            values[k] = self.params[k].parse(k, v)
        return self.validate(op, values)

    def validate(self, op: str, values: dict[str, Any]) -> dict[str, Any]:
        for k in values:
            if k not in self.params:
                raise UsageError(f"{op} has no parameter {k!r} (parameters: {', '.join(self.params) or 'none'})")
        missing = [k for k in self.params if k not in values]
        if missing:
            raise UsageError(f"{op} needs parameter(s) {', '.join(missing)}")
        for k, p in self.params.items():
            p.check(k, values[k])
        return {k: values[k] for k in self.params}


@dataclass(frozen=True)
class Defaults(Schema):
    """A schema some of whose parameters have defaults: a case may leave them out, and one that
    gives the default has the same canonical id (the default is left out of it). Ops whose cases
    predate a parameter keep their ids, suites and baselines."""

    defaults: dict[str, Any] = field(default_factory=dict)

    def validate(self, op: str, values: dict[str, Any]) -> dict[str, Any]:
        full = super().validate(op, {**self.defaults, **values})
        return {k: v for k, v in full.items() if k not in self.defaults or v != self.defaults[k]}
