"""`parity list` (ops, backends, suites, cases) and `parity coverage`.

`parity list cases` prints the cases `parity run` with the same flags would run: the selection
(suites, filters, the configuration's backends) without the cases of ops a backend has no
adapter for, and without the cases its `available()` / `supports()` turn away; one line on
stderr says how many were left out and why (`--with-skips` lists them too, each with its reason).

`parity coverage` answers "what does backend X cover": per op and backend, the parameter values,
dtypes and distributions of the cases that run, and of those it skips, grouped by reason (a
value listed under a reason never runs on that backend in the selection).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import Registry
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import EXIT_OK, UsageError


def list_things(args: Any, command: str = "") -> int:
    what = args.what
    if what in ("all", "ops"):
        print("ops:")
        for spec in ops.match(args.op or None):
            params = ", ".join(f"{k} ({p.describe()})" for k, p in spec.params.params.items())
            print(f"  {spec.name:<26} {spec.doc}")
            print(f"  {'':<26} params: {params}")
            print(f"  {'':<26} dtypes: {', '.join(spec.dtypes)}; dists: {', '.join(spec.dists)}; "
                  f"outputs: {', '.join(spec.outputs)}")
    if what in ("all", "backends"):
        registry = Registry(extra=[b for b in args.backend if ":" in b])
        print("backends:")
        for name in registry.names():
            try:
                b = registry.get(name)
                why = b.available()
                state = "available" if not why else f"unavailable: {why}"
                print(f"  {name:<15} {b.describe():<32} {state}")
            except Exception as e:  # a broken third-party backend must not hide the others
                print(f"  {name:<15} {'?':<32} broken: {type(e).__name__}: {e}")
    if what in ("all", "suites"):
        print("suites:")
        for name in suites.names():
            print(f"  {name:<10} {len(suites.cases(name)):>6} cases  {suites.description(name)}")
    if what == "cases":
        run, skipped, left = _planned(args)
        for c in run:
            print(c.id)
        if args.with_skips:
            for c, why in skipped:
                print(f"{c.id}  # skip: {why}")
        notes = [n for n in (left.line(), _skip_line(skipped)) if n]
        for n in notes:
            print(f"parity: {n}", file=sys.stderr)
    return EXIT_OK


def _skip_line(skipped: list[tuple[Case, str]]) -> str | None:
    if not skipped:
        return None
    reasons: dict[str, int] = defaultdict(int)
    for _, why in skipped:
        reasons[why] += 1
    top = sorted(reasons.items(), key=lambda kv: -kv[1])
    shown = "; ".join(f"{n} x {why}" for why, n in top[:3]) + (f"; ... {len(top) - 3} more reasons" if len(top) > 3 else "")
    return f"not listed: {len(skipped)} cases the backend will skip ({shown}); --with-skips lists them"


def _planned(args: Any) -> tuple[list[Case], list[tuple[Case, str]], Any]:
    """(cases that run, [(case, skip reason)], the cases left out for want of an adapter)."""
    from kernel_parity.conformance.commands import LeftOut, Selection, select_cases
    from kernel_parity.conformance.session import open_session

    session = open_session(args.backend)
    left = LeftOut()
    cases = select_cases(Selection.from_args(args, session), session, left)
    run, skipped = [], []
    for c in cases:
        why = _skip_reason(session.registry, c)
        if why:
            skipped.append((c, why))
        else:
            run.append(c)
    return run, skipped, left


def _skip_reason(registry: Registry, case: Case) -> str | None:
    """The backend's `available()` / `supports()` answer for the case (a hook that raises says so)."""
    b = registry.get(case.backend)
    try:
        why = b.available() or b.supports(case)
    except Exception as e:  # the case would be an error when run: it is listed as not running
        return f"{case.backend}: supports() raised {type(e).__name__}: {e}"
    return str(why) if why else None


# -- coverage ------------------------------------------------------------------------------------
def coverage_table(run: list[Case], skipped: list[tuple[Case, str]]) -> list[dict]:
    """Per (op, backend): counts, and for the cases that run and for each skip reason the values of
    every parameter, the dtypes and the distributions."""
    def values(cases: list[Case]) -> dict[str, list]:
        out: dict[str, dict] = {"dtype": {}, "dist": {}}
        for c in cases:
            out["dtype"][c.dtype] = None
            out["dist"][c.dist] = None
            for k, v in c.params:
                out.setdefault(k, {})[v] = None
        return {k: sorted(v, key=lambda x: (isinstance(x, str), x)) for k, v in out.items()}

    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for c in run:
        groups.setdefault((c.op, c.backend), {"run": [], "skip": defaultdict(list)})["run"].append(c)
    for c, why in skipped:
        groups.setdefault((c.op, c.backend), {"run": [], "skip": defaultdict(list)})["skip"][why].append(c)
    rows = []
    for (op, backend), g in sorted(groups.items()):
        ran = values(g["run"])
        skips = []
        for why, cs in sorted(g["skip"].items(), key=lambda kv: -len(kv[1])):
            vals = values(cs)
            # the values that never run on this backend, the telling part of a skip reason
            only = {k: [x for x in v if x not in ran.get(k, [])] for k, v in vals.items()}
            skips.append({"reason": why, "cases": len(cs), "values": vals,
                          "never_run": {k: v for k, v in only.items() if v}})
        rows.append({"op": op, "backend": backend, "run": len(g["run"]),
                     "skip": sum(len(cs) for cs in g["skip"].values()), "values": ran, "skips": skips})
    return rows


def _fmt_values(vals: dict[str, list], width: int = 100) -> list[str]:
    lines = []
    for k, v in vals.items():
        text = " ".join(str(x) for x in v)
        lines.append(f"{k:<10} {text if len(text) <= width else text[:width - 3] + '...'}")
    return lines


def coverage(args: Any, command: str = "") -> int:
    run, skipped, left = _planned(args)
    rows = coverage_table(run, skipped)
    for r in rows:
        print(f"{r['op']} / {r['backend']}: {r['run']} run, {r['skip']} skip")
        if r["run"]:
            for line in _fmt_values(r["values"]):
                print(f"  runs     {line}")
        for s in r["skips"]:
            print(f"  skips {s['cases']}: {s['reason']}")
            for line in _fmt_values(s["never_run"] or {"(values)": ["the same values as the cases that run"]}):
                print(f"    never runs  {line}")
    line = left.line()
    if line:
        print(f"parity: {line}")
    print(f"parity coverage: {len(rows)} op x backend pairs, {len(run)} cases run, {len(skipped)} skip"
          + (f", {left.count} not planned" if left.count else ""))
    if getattr(args, "json", None):
        from kernel_parity.reports import files, records

        doc = {"schema": "kernel-parity/coverage/1", "command": command, "rows": rows,
               "not_planned": left.to_json()}
        try:
            files.write_text(args.json, json.dumps(records.encode(doc), indent=1) + "\n")
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    return EXIT_OK
