"""One session of checking, shared by the `parity` CLI and the pytest plugin.

A session resolves, once, what every command needs before it runs a case: the repository's
configuration (`[tool.kernel-parity]`, conformance/config.py), the backend registry (built-ins,
installed plugins, module:object backends from the command line or the configuration), the known
failures (kernel-parity's own, scoped to its own backends, plus the repository's file), and the
tolerance overrides the repository declares. Flags beat the configuration, which beats defaults;
`values()` says where each value came from (`parity config`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from kernel_parity.conformance import config as cfgmod
from kernel_parity.conformance import known
from kernel_parity.conformance.backends import Registry


@dataclass
class Session:
    config: cfgmod.Config
    registry: Registry
    backend_names: list[str]  # the backends asked for (flags or configuration); [] = the suites' own
    entries: list[known.Entry]
    known_file: str | None  # the repository's known-failures file, if any
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def overrides(self) -> dict[str, tuple]:
        return {t.op: self.config.overrides_for(t.op) for t in self.config.tolerance}

    def runner(self, **kw: Any):
        from kernel_parity.conformance.runner import Runner

        return Runner(self.registry, overrides=self.overrides, **kw)

    def values(self) -> list[tuple[str, Any, str]]:
        """(key, resolved value, where it came from) for `parity config`."""
        c = self.config
        return [
            ("pyproject", str(c.path) if c.path else None,
             "the nearest pyproject.toml" + ("" if c.has_table else ": it has no [tool.kernel-parity] table")
             if c.path else "none at or above the current directory"),
            ("backends", self.backend_names or "the suites' own", self.sources.get("backends", "default")),
            ("suites", list(c.suites) or "ci", c.sources.get("suites", "default")),
            ("baseline", c.baseline, c.sources.get("baseline", "default (none)")),
            ("known_failures", self.known_file, self.sources.get("known_failures", "default (none)")),
            ("tolerance", [t.to_json() for t in c.tolerance], c.sources.get("tolerance", "default (none)")),
        ]


def open_session(backend_args: list[str] | tuple[str, ...] = (), known_failures: str | None = None,
                 use_config: bool = True) -> Session:
    """Resolve configuration, registry and known failures; UsageError (exit 2) on anything bad."""
    cfg = cfgmod.load() if use_config else cfgmod.Config()
    sources = {}
    asked = list(backend_args)
    if asked:
        sources["backends"] = "command line (--backend)"
    elif cfg.backends:
        asked = list(cfg.backends)
        sources["backends"] = cfg.sources["backends"]
    registry = Registry(extra=[b for b in asked if ":" in b])
    by_origin = {b.origin: b.name for b in registry.loaded()}
    names = [by_origin.get(b, b) for b in asked]
    for n in names:
        registry.get(n)  # UsageError for an unknown name
    cfgmod.validate_ops(cfg)
    known_file = known_failures
    if known_file is not None:
        sources["known_failures"] = "command line (--known-failures)"
    elif cfg.known_failures:
        known_file = cfg.known_failures
        sources["known_failures"] = cfg.sources["known_failures"]
    return Session(cfg, registry, names, known.entries(known_file), known_file, sources)


def make_registry(backend_args: list[str]) -> tuple[Registry, list[str]]:
    """Registry with module:object backends loaded, and the names asked for (no configuration)."""
    s = open_session(backend_args, use_config=False)
    return s.registry, s.backend_names


def progress(total: int, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="case", file=sys.stderr, disable=True if disable else None,
                dynamic_ncols=True, leave=False)


def say(line: str) -> None:
    """One line on stdout, flushed, written around the progress bar (`progress`) when one is drawn."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
