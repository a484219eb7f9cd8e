"""`[tool.kernel-parity]` in the pyproject.toml of the repository being checked.

    [tool.kernel-parity]
    backends = ["mykernels.parity:TRITON", "cpu"]        # names or module:object (default --backend)
    suites = ["parity/suite.toml", "smoke"]              # names or paths, relative to this file
    baseline = "parity/baseline.jsonl"                   # default --baseline of `parity gate`
    known_failures = "parity/known_failures.toml"        # this repo's known failures
    [[tool.kernel-parity.tolerance]]                     # overrides of an op's limits, each with its reason
    op = "softmax.softmax"
    output = "y"                                         # optional: every output
    dtype = "bf16"                                       # optional: every dtype
    rtol = 2e-2
    reason = "our bf16 softmax rounds the max to bf16 first (documented in kernels/softmax.md)"

The file is the nearest pyproject.toml at or above the current directory; without the table there
is no configuration. A command-line flag beats the file, the file beats the default;
`parity config` prints every resolved value and where it came from. A bad table is a one-line
error naming the key (exit 2).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.tolerance import LIMIT_FIELDS, Override

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TABLE = "tool.kernel-parity"
KEYS = {
    "backends": "a list of backend names or module:object strings",
    "suites": "a list of suite names or .toml paths",
    "baseline": "a path to a results file",
    "known_failures": "a path to a known-failures TOML file",
    "tolerance": "a list of [[tool.kernel-parity.tolerance]] tables (op, reason, and limits)",
}
LIMIT_KEYS = LIMIT_FIELDS  # what an override may set (one home: conformance/tolerance.py)


@dataclass(frozen=True)
class ToleranceOverride:
    """A repo's change to an op's limits (applied on top of the op's spec, both tiers)."""

    op: str
    override: Override

    def to_json(self) -> dict:
        o = self.override
        return {"op": self.op, "output": o.output, "dtype": o.dtype, "reason": o.reason,
                **{k: getattr(o, k) for k in LIMIT_KEYS if getattr(o, k) is not None}}


@dataclass(frozen=True)
class Config:
    path: Path | None = None  # the nearest pyproject.toml
    has_table: bool = False  # whether it has a [tool.kernel-parity] table
    backends: tuple[str, ...] = ()
    suites: tuple[str, ...] = ()
    baseline: str | None = None
    known_failures: str | None = None
    tolerance: tuple[ToleranceOverride, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)  # key -> where the value came from

    def overrides_for(self, op: str) -> tuple[Override, ...]:
        return tuple(t.override for t in self.tolerance if t.op == op)


def find_pyproject(start: str | os.PathLike | None = None) -> Path | None:
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        p = d / "pyproject.toml"
        if p.is_file():
            return p
    return None


def load(start: str | os.PathLike | None = None) -> Config:
    """The configuration of the repository at `start` (default: the current directory)."""
    path = find_pyproject(start)
    if path is None:
        return Config()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    table = doc.get("tool", {}).get("kernel-parity") if isinstance(doc.get("tool"), dict) else None
    if table is None:
        return Config(path=path)
    return parse(table, path)


def parse(table: Any, path: Path) -> Config:
    where = f"{path} [{TABLE}]"
    if not isinstance(table, dict):
        raise UsageError(f"{where} must be a table")
    for k in table:
        if k not in KEYS:
            raise UsageError(f"{where}: unknown key {k!r} (known: {', '.join(KEYS)})")
    base = path.parent
    src = f"{path.name} [{TABLE}]"
    sources: dict[str, str] = {}

    def str_list(key: str) -> tuple[str, ...]:
        v = table.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
            raise UsageError(f"{where}: {key} must be {KEYS[key]}, got {v!r:.60}")
        if v:
            sources[key] = f"{src}.{key}"
        return tuple(v)

    def a_path(key: str) -> str | None:
        v = table.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip() or "\0" in v:
            raise UsageError(f"{where}: {key} must be {KEYS[key]}, got {v!r:.60}")
        sources[key] = f"{src}.{key}"
        return str(base / v)

    backends = str_list("backends")
    suites = tuple(str(base / s) if s.endswith(".toml") else s for s in str_list("suites"))
    baseline, known = a_path("baseline"), a_path("known_failures")
    tol = table.get("tolerance", [])
    if not isinstance(tol, list) or not all(isinstance(t, dict) for t in tol):
        raise UsageError(f"{where}: tolerance must be {KEYS['tolerance']}")
    overrides = []
    for i, t in enumerate(tol):
        at = f"{where}.tolerance[{i + 1}]"
        extra = set(t) - {"op", "output", "dtype", "reason", *LIMIT_KEYS}
        if extra:
            raise UsageError(f"{at}: unknown key {sorted(extra)[0]!r} (known: op, output, dtype, reason, "
                             f"{', '.join(LIMIT_KEYS)})")
        for k in ("op", "reason"):
            if not isinstance(t.get(k), str) or not t[k].strip():
                raise UsageError(f"{at}: {k} must be a non-empty string (every override gives its reason)")
        for k in ("output", "dtype"):
            if k in t and (not isinstance(t[k], str) or not t[k]):
                raise UsageError(f"{at}: {k} must be a non-empty string")
        limits = {}
        for k in LIMIT_KEYS:
            if k in t:
                v = t[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise UsageError(f"{at}: {k} must be a finite number >= 0, got {v!r}")
                limits[k] = float(v)
        if not limits:
            raise UsageError(f"{at}: changes no limit (give one of {', '.join(LIMIT_KEYS)})")
        overrides.append(ToleranceOverride(t["op"], Override(t["reason"], output=t.get("output"),
                                                            dtype=t.get("dtype"), **limits)))
    if overrides:
        sources["tolerance"] = f"{src}.tolerance"
    return Config(path, True, backends, suites, baseline, known, tuple(overrides), sources)


def validate_ops(cfg: Config) -> None:
    """Every tolerance override names a registered op, and an output and dtype it has."""
    from kernel_parity.conformance import ops

    for t in cfg.tolerance:
        try:
            spec = ops.get(t.op)
        except UsageError as e:
            raise UsageError(f"{cfg.path} [{TABLE}].tolerance: {e}") from None
        if t.override.output is not None and t.override.output not in spec.all_outputs():
            raise UsageError(f"{cfg.path} [{TABLE}].tolerance: {t.op} has no output {t.override.output!r} "
                             f"(outputs: {', '.join(spec.all_outputs())})")
