"""Known failures: one file, each entry with a reason (STYLE rule 13).

    [[known]]
    op = "attention.prefill"                    # exact op name
    backend = "sdpa-cudnn"                      # exact backend name
    match = "*/masked/*"                        # glob on the rest of the id: dtype/params/dist/seed=N
    reason = "cuDNN with a boolean mask returns non-zero output for fully masked rows"
    seen = "torch 2.11, H200"                   # where it was observed
    suites = ["ci"]                             # optional: the suites whose runs hold the failing cases

A case that matches and fails (fail/error/crash/timeout/flaky) becomes `xfail`: it is still run,
shown and counted, but does not fail the gate. A case that matches and passes becomes `xpass`,
which fails the gate: the entry is out of date and must go. An entry whose op and backend ran
(some case of the pair was not skipped) but which matched no case at all is `stale`, which also
fails the gate -- judged only where the entry could have matched: not in a run narrowed within
its op and backend (by --dtype, --dist or --shard), and not in a run of other suites than the
entry's `suites` when it names them (a failure seen at the ci suite's shapes is no entry of smoke).
"""

from __future__ import annotations

import fnmatch
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.results import FAILING, CaseResult

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_FILE = Path(__file__).parent / "known_failures.toml"


@dataclass(frozen=True)
class Entry:
    op: str
    backend: str
    match: str
    reason: str
    seen: str = ""
    package: bool = False  # kernel-parity's own file: applies to its own backends only
    suites: tuple[str, ...] = ()  # where it is expected to match (empty: any run of its op/backend)

    def matches(self, rec: CaseResult | dict) -> bool:
        op, backend, rid = ((rec.op, rec.backend, rec.id) if isinstance(rec, CaseResult)
                            else (rec["op"], rec["backend"], rec["id"]))
        if op != self.op or backend != self.backend:
            return False
        rest = rid.split("/", 2)[2]  # dtype/params/dist/seed=N
        return fnmatch.fnmatchcase(rest, self.match)

    @property
    def label(self) -> str:
        return f"{self.op}/{self.backend}/{self.match}"


def entries(user_file: str | Path | None = None) -> list[Entry]:
    """kernel-parity's own known failures (scoped to its own backends) and, if given, the user's."""
    own = [Entry(e.op, e.backend, e.match, e.reason, e.seen, package=True, suites=e.suites) for e in load(DEFAULT_FILE)]
    return own + (load(user_file) if user_file is not None else [])


def load(path: str | Path | None = None) -> list[Entry]:
    if path is not None and (not str(path) or "\0" in str(path)):
        raise UsageError(f"--known-failures {str(path)!r} is not a file path")
    path = Path(path) if path else DEFAULT_FILE
    if not path.exists():
        if path == DEFAULT_FILE:
            return []
        raise UsageError(f"known-failures file {str(path)!r} does not exist")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"known-failures file {str(path)!r} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"known-failures file {str(path)!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    unknown = set(doc) - {"known"}
    if unknown:
        raise UsageError(f"known-failures file {str(path)!r}: unknown key {sorted(unknown)[0]!r} (expected [[known]] tables)")
    table = doc.get("known", [])
    if not isinstance(table, list) or not all(isinstance(e, dict) for e in table):
        raise UsageError(f"known-failures file {str(path)!r}: 'known' must be a list of [[known]] tables")
    entries = []
    for i, e in enumerate(table):
        where = f"known-failures entry {i + 1} in {str(path)!r}"
        extra = set(e) - {"op", "backend", "match", "reason", "seen", "suites"}
        if extra:
            raise UsageError(f"{where}: unknown key {sorted(extra)[0]!r} (expected op, backend, match, reason, seen, "
                             f"suites)")
        bad = [k for k in ("op", "backend", "match", "reason") if not isinstance(e.get(k), str) or not e[k].strip()]
        if bad:
            raise UsageError(f"{where}: {', '.join(bad)} must be non-empty string(s)")
        if not isinstance(e.get("seen", ""), str):
            raise UsageError(f"{where}: seen must be a string")
        scope = e.get("suites", [])
        if not isinstance(scope, list) or not all(isinstance(x, str) and x.strip() for x in scope):
            raise UsageError(f"{where}: suites must be a list of suite names")
        entries.append(Entry(e["op"], e["backend"], e["match"], e["reason"], e.get("seen", ""), suites=tuple(scope)))
    return entries


def apply_one(rec: CaseResult, entries: list[Entry]) -> None:
    """Mark one record xfail / xpass in place if an entry matches it (first match wins).
    kernel-parity's own entries apply to its own backends only, never to a user's plugin."""
    for e in entries:
        if not e.matches(rec) or (e.package and rec.backend not in own_backends()):
            continue
        if rec.verdict in FAILING:
            rec.known = {"reason": e.reason, "seen": e.seen, "verdict": rec.verdict}
            rec.verdict = "xfail"
            rec.reason = f"known failure ({e.reason}): {rec.reason}"
        elif rec.verdict in ("pass", "vacuous"):
            rec.known = {"reason": e.reason, "seen": e.seen, "verdict": rec.verdict}
            rec.verdict = "xpass"
            rec.reason = f"listed as a known failure ({e.reason}) but passes: remove the entry"
        return


def stale(results: list[CaseResult], entries: list[Entry], selection: dict | None = None) -> list[str]:
    """Labels of entries whose op/backend pair ran (some case not skipped) but that matched nothing,
    among the entries that could have matched in this run (module docstring): none when the run was
    narrowed within op/backend pairs (`selection` with dtypes, dists or a shard)."""
    sel = selection or {}
    if sel.get("dtypes") or sel.get("dists") or sel.get("shard"):
        return []
    ran_suites = {_suite_name(s) for s in sel.get("suites") or []}
    ran = {(r.op, r.backend) for r in results if r.verdict != "skip"}  # skipped pairs did not run
    return [e.label for e in entries
            if (e.op, e.backend) in ran and not (e.package and e.backend not in own_backends())
            and not (e.suites and ran_suites and not ran_suites & set(e.suites))
            and not any(e.matches(r) for r in results)]


def _suite_name(s: str) -> str:
    """A suite as an entry names it: a built-in name, or a .toml path's file name without .toml."""
    return Path(s).stem if s.endswith(".toml") else s


@functools.lru_cache(maxsize=1)
def own_backends() -> frozenset[str]:
    """Backends kernel-parity itself ships: the built-ins and its own entry-point plugins (torch SDPA)."""
    from kernel_parity.conformance.backends import BUILTIN, entry_points

    return frozenset(BUILTIN) | {n for n, v in entry_points().items() if v.startswith("kernel_parity.")}


def apply(results: list[CaseResult], entries: list[Entry]) -> list[str]:
    """Mark matching results xfail/xpass in place; return the labels of stale entries."""
    for rec in results:
        apply_one(rec, entries)
    return stale(results, entries)
