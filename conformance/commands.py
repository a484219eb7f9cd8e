"""Implementations of the `parity` subcommands (argument parsing lives in cli.py)."""

from __future__ import annotations

import sys
import time
from typing import Any

from conformance import env, suites
from conformance.backends import Registry
from conformance.case import Case
from conformance.cli import EXIT_FAIL, EXIT_OK
from conformance.errors import UsageError
from conformance.suites import Filters
from reports import records

MAX_PRINTED_FAILURES = 20


# -- shared ---------------------------------------------------------------------------------
def make_registry(backend_args: list[str]) -> tuple[Registry, list[str]]:
    """Registry with any module:object backends loaded, and the backend names asked for."""
    registry = Registry(extra=[b for b in backend_args if ":" in b])
    by_origin = {b.origin: b.name for b in registry.loaded()}
    names = [by_origin.get(b, b) for b in backend_args]
    for n in names:
        registry.get(n)  # UsageError for an unknown name
    return registry, names


def select_cases(args: Any, registry: Registry, backend_names: list[str]) -> tuple[str, list[Case]]:
    suite = args.suite or suites.DEFAULT_SUITE
    filters = Filters(tuple(args.op), tuple(backend_names), tuple(args.dtype), tuple(args.dist),
                      getattr(args, "scale", "auto"))
    cases = suites.cases(suite, filters)
    for name in dict.fromkeys(c.backend for c in cases):
        registry.get(name)
    if not cases:
        raise UsageError(f"no cases in suite {suite!r} match the filters")
    return suite, cases


def execute(args: Any, command: str) -> tuple[dict, list[dict]]:
    registry, names = make_registry(args.backend)
    suite, cases = select_cases(args, registry, names)
    t0 = time.perf_counter()
    bar = _progress(len(cases), disable=args.no_progress)
    if args.jobs > 1 or args.isolate or args.timeout:
        from conformance.parallel import run_isolated

        origins = {b.name: b.origin for b in registry.loaded() if b.origin}
        results = run_isolated(cases, jobs=max(1, args.jobs), extra_backends=registry.extra_specs(),
                               recheck=not args.no_recheck, timeout=args.timeout,
                               on_result=lambda r: bar.update(1), origins=origins)
    else:
        from conformance.runner import Runner

        results = Runner(registry, recheck=not args.no_recheck).run(cases, on_result=lambda r: bar.update(1))
    bar.close()
    from conformance import known

    entries = known.load(args.known_failures)
    stale = known.apply(results, entries)
    header = env.header(command, suite)
    header["known_failures"] = {"entries": len(entries), "stale": stale}
    header["elapsed_s"] = round(time.perf_counter() - t0, 3)
    header["backends"] = {n: registry.get(n).describe() for n in dict.fromkeys(c.backend for c in cases)}
    return header, results


def write_outputs(args: Any, header: dict, results: list[dict], diff: Any = None) -> None:
    doc = {"schema": records.SCHEMA, "header": header, "results": results}
    if getattr(args, "json", None):
        records.write(args.json, header, results)
    if getattr(args, "html", None):
        from reports import html

        html.write(args.html, doc, diff=diff)
    if getattr(args, "junit", None):
        from reports import junit

        junit.write(args.junit, doc)
    if getattr(args, "md", None):
        from reports import markdown

        markdown.write(args.md, doc)


def print_summary(header: dict, results: list[dict], quiet: bool = False) -> bool:
    """Print failures (at most MAX_PRINTED_FAILURES) and the count line; True if all passed."""
    counts = records.summary(results)
    failing = [r for r in results if r["verdict"] in records.FAILING]
    if not quiet:
        for r in failing[:MAX_PRINTED_FAILURES]:
            print(f"{r['verdict'].upper()} {r['id']}")
            print("  " + (r.get("message") or r.get("reason") or "").replace("\n", "\n  "))
        if len(failing) > MAX_PRINTED_FAILURES:
            print(f"... and {len(failing) - MAX_PRINTED_FAILURES} more failing cases (see the reports)")
    parts = [f"{n} {v}" for v, n in counts.items() if n]
    stale = (header.get("known_failures") or {}).get("stale") or []
    for label in stale:
        print(f"STALE known-failures entry matches no case that ran: {label}")
    status = "FAIL" if failing or stale else "PASS"
    print(f"parity: {status}: {len(results)} cases: {', '.join(parts)} in {header.get('elapsed_s', 0):.1f} s"
          f" on {header.get('device')}")
    return not failing and not stale


def _progress(total: int, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="case", file=sys.stderr, disable=True if disable else None,
                dynamic_ncols=True, leave=False)


# -- commands -------------------------------------------------------------------------------
def cmd_run(args: Any, command: str) -> int:
    header, results = execute(args, command)
    write_outputs(args, header, results)
    return EXIT_OK if print_summary(header, results, args.quiet) else EXIT_FAIL


def cmd_gate(args: Any, command: str) -> int:
    diff = None
    old = records.load(args.baseline) if args.baseline else None  # fail fast on a bad baseline
    header, results = execute(args, command)
    if old is not None:
        from reports.diff import compare

        diff = compare(old, {"schema": records.SCHEMA, "header": header, "results": results}, growth=args.growth)
        header["baseline"] = {"path": args.baseline, "git_commit": old["header"].get("git_commit")}
    write_outputs(args, header, results, diff)
    ok = print_summary(header, results, args.quiet)
    if diff is not None:
        print(diff.render_text())
        ok = ok and not diff.failed
    return EXIT_OK if ok else EXIT_FAIL


def cmd_list(args: Any, command: str) -> int:
    from conformance.listing import list_things

    return list_things(args)


def cmd_repro(args: Any, command: str) -> int:
    from conformance.repro import repro

    return repro(args)


def cmd_report(args: Any, command: str) -> int:
    try:
        doc = records.load(args.results)
    except records.RecordsError as e:
        raise UsageError(str(e)) from None
    if not (args.html or args.junit or args.md):
        raise UsageError("report needs at least one of --html, --junit, --md")
    write_outputs(args, doc["header"], doc["results"])
    return EXIT_OK


def cmd_diff(args: Any, command: str) -> int:
    from reports.diff import compare

    try:
        old, new = records.load(args.old), records.load(args.new)
    except records.RecordsError as e:
        raise UsageError(str(e)) from None
    d = compare(old, new, growth=args.growth)
    print(d.render_text())
    return EXIT_FAIL if d.failed else EXIT_OK


def cmd_calibrate(args: Any, command: str) -> int:
    from conformance.calibrate import calibrate

    return calibrate(args)

