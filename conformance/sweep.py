"""`parity sweep`: fresh seeds over a suite's cases, to measure false alarms.

A suite's cases are fixed (seed 0 mostly); a limit that only holds for those seeds is a false
alarm waiting for the next change. A sweep takes the suite's (op, backend, dtype, params, dist)
combinations after the usual filters and runs each on fresh seeds:

    --seeds N     N fresh seeds for every combination
    --per-op N    N runs per op and backend, spread round-robin over the op's combinations
                  (the default, N = 100)

Seeds are `--start`, `--start + 1`, ... (a random start when not given; it is printed and kept
in the results header, so `--start S` replays the sweep). The backends of one input combination
share its seeds, so inputs and goldens are built once per group. Cases run exactly as in
`parity run` (isolated workers, borderline re-checks that turn disagreeing seeds into `flaky`,
known failures), records stream to --json, and the summary prints, per op and backend: runs,
failures, flaky verdicts, skips and the worst norm_err with its case. Exit 1 on any failure or
flaky verdict.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

from kernel_parity.conformance import suites
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.commands import Selection, prepare, print_summary, select_cases, write_outputs
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK
from kernel_parity.conformance.session import open_session
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.results import CaseResult
from kernel_parity.reports import records

DEFAULT_PER_OP = 100


def sweep_cases(base: list[Case], start: int, seeds: int | None, per_op: int | None) -> list[Case]:
    """Fresh-seed cases from a suite's cases (see the module docstring)."""
    backends: dict[tuple, list[str]] = {}  # input combination (no seed) -> backends, suite order
    for c in base:
        key = (c.op, c.dtype, c.params, c.dist)
        backends.setdefault(key, [])
        if c.backend not in backends[key]:
            backends[key].append(c.backend)
    by_op: dict[str, list[tuple]] = defaultdict(list)
    for key in backends:
        by_op[key[0]].append(key)
    out: list[Case] = []
    for op, keys in by_op.items():
        runs = [(k, i) for k in keys for i in range(seeds)] if seeds else \
            [(keys[i % len(keys)], i) for i in range(per_op or DEFAULT_PER_OP)]
        if seeds:  # interleave so every combination's first seeds come before any one's last
            runs.sort(key=lambda t: (t[1], keys.index(t[0])))
        for n, (key, _) in enumerate(runs):
            op_, dtype, params, dist = key
            for b in backends[key]:
                out.append(Case(op_, b, dtype, params, dist, start + n))
    return out


def summarize(results: list[CaseResult] | list[dict]) -> list[dict]:
    """Per (op, backend): runs (not skipped), verdict counts, worst norm_err and its case."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for res in results:
        r = res.to_json() if isinstance(res, CaseResult) else res
        row = rows.setdefault((r["op"], r["backend"]), {
            "op": r["op"], "backend": r["backend"], "runs": 0, "skip": 0, "failures": 0, "flaky": 0,
            "counts": defaultdict(int), "worst": None, "worst_id": None})
        row["counts"][r["verdict"]] += 1
        if r["verdict"] == "skip":
            row["skip"] += 1
            continue
        row["runs"] += 1
        if r["verdict"] == "flaky":
            row["flaky"] += 1
        elif r["verdict"] in records.FAILING:
            row["failures"] += 1
        ne = r.get("norm_err")
        if isinstance(ne, (int, float)) and (row["worst"] is None or (ne > row["worst"] or math.isnan(ne))):
            row["worst"], row["worst_id"] = ne, r["id"]
    out = []
    for row in rows.values():
        row["counts"] = dict(row["counts"])
        out.append(row)
    return out


def render_table(rows: list[dict]) -> str:
    lines = [f"{'op':<26} {'backend':<10} {'runs':>6} {'fail':>5} {'flaky':>5} {'skip':>5} {'worst norm_err':>15}  case"]
    for r in rows:
        worst = "—" if r["worst"] is None else f"{r['worst']:.3g}"
        lines.append(f"{r['op']:<26} {r['backend']:<10} {r['runs']:>6} {r['failures']:>5} {r['flaky']:>5} "
                     f"{r['skip']:>5} {worst:>15}  {r['worst_id'] or ''}")
    return "\n".join(lines)


def sweep(args: Any, command: str) -> int:
    if getattr(args, "resume", None):
        raise UsageError("sweep has no --resume: re-run it with the printed --start")
    start = args.start if args.start is not None else random.SystemRandom().randrange(10**7, 2**31)
    session = open_session(args.backend, args.known_failures)
    base = select_cases(Selection.from_args(args, session), session)
    cases = sweep_cases(base, start, args.seeds, None if args.seeds else (args.per_op or DEFAULT_PER_OP))
    if not cases:
        raise UsageError("the sweep selected no cases")
    params = {"start": start, "seeds": args.seeds, "per_op": None if args.seeds else (args.per_op or DEFAULT_PER_OP),
              "combinations": len({(c.op, c.backend, c.dtype, c.params, c.dist) for c in base})}
    run = prepare(args, command, cases=cases, header_extra={"sweep": params})
    print(f"parity sweep: {len(cases)} runs from start seed {start} (replay: --start {start})", flush=True)
    doc = run.execute(finish=lambda results: {"sweep": {**params, "rows": summarize(results)}})
    rows = doc["complete"]["sweep"]["rows"]
    write_outputs(args, doc)
    print(render_table(rows))
    ok = print_summary(doc, quiet=True)
    bad = sum(r["failures"] + r["flaky"] for r in rows)
    if bad and not args.quiet:
        for r in doc["results"]:
            if r["verdict"] in records.FAILING:
                print(f"{r['verdict'].upper()} {r['id']}: {r.get('reason')}")
    run.check_stream()
    return EXIT_OK if ok else EXIT_FAIL
