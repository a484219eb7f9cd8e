"""Implementations of the `parity` subcommands (argument parsing lives in cli.py).

Every run streams its records to the --json results file as cases finish (JSON lines, a
completion record at the end), so a run killed by an outer timeout keeps what it finished and
`parity run --resume FILE` continues it. Cases run in worker processes unless --no-isolate: an
exit, abort, segfault or hang inside a kernel is that case's `crash` or `timeout`. Output paths
are checked before anything runs. The repository's `[tool.kernel-parity]` table supplies the
backends, suites, baseline, known failures and tolerance overrides a flag does not
(conformance/session.py).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kernel_parity.conformance import env, known, suites
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK, UsageError
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.session import Session, open_session, progress, say
from kernel_parity.conformance.suites import Filters, parse_shard
from kernel_parity.reports import files, records

MAX_PRINTED_FAILURES = 20
OUTPUT_FLAGS = ("json", "html", "junit", "md")


# -- selection --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    """What a run set out to do: enough to re-derive its cases (`--resume`)."""

    suites: tuple[str, ...]
    ops: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()  # names or module:object, as given (flags or configuration)
    dtypes: tuple[str, ...] = ()
    dists: tuple[str, ...] = ()
    scale: str = "auto"
    shard: tuple[int, int] | None = None  # (i, n): the i-th of n deterministic slices, 1-based

    @property
    def label(self) -> str:
        return "+".join(os.path.basename(s) if s.endswith(".toml") else s for s in self.suites)

    @staticmethod
    def from_args(args: Any, session: Session) -> "Selection":
        given = [args.suite] if getattr(args, "suite", None) else list(session.config.suites) or [suites.DEFAULT_SUITE]
        names = tuple(os.path.abspath(s) if s.endswith(".toml") and os.path.exists(s) else s for s in given)
        return Selection(names, tuple(args.op), tuple(_backend_args(args, session)),
                         tuple(args.dtype), tuple(args.dist), suites.resolve_scale(getattr(args, "scale", "auto")),
                         parse_shard(getattr(args, "shard", None)))

    def to_json(self) -> dict:
        return {"suites": list(self.suites), "ops": list(self.ops), "backends": list(self.backends),
                "dtypes": list(self.dtypes), "dists": list(self.dists), "scale": self.scale,
                "shard": list(self.shard) if self.shard else None}

    @staticmethod
    def from_json(d: Any, where: str) -> "Selection":
        if not isinstance(d, dict) or not isinstance(d.get("suites", d.get("suite")), (list, str)):
            raise UsageError(f"{where} has no run selection in its header (it was not written by parity run)")
        names = d.get("suites", d.get("suite"))
        names = [names] if isinstance(names, str) else names
        lists = {}
        for k in ("ops", "backends", "dtypes", "dists"):
            v = d.get(k, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise UsageError(f"{where}: header selection {k!r} must be a list of strings")
            lists[k] = tuple(v)
        if not names or not all(isinstance(x, str) for x in names):
            raise UsageError(f"{where}: header selection 'suites' must be a list of strings")
        scale = d.get("scale", "auto")
        if scale not in suites.SCALES:
            raise UsageError(f"{where}: header selection scale {scale!r} is not one of {', '.join(suites.SCALES)}")
        shard = d.get("shard")
        if shard is not None and (not isinstance(shard, list) or len(shard) != 2):
            raise UsageError(f"{where}: header selection shard must be [i, n] or null")
        return Selection(tuple(names), scale=scale, shard=tuple(shard) if shard else None, **lists)


def _backend_args(args: Any, session: Session) -> list[str]:
    """The backends as given (module:object kept, so a resumed run loads them again)."""
    return list(args.backend) if args.backend else list(session.config.backends)


def shard_of(cases: list[Case], shard: tuple[int, int] | None) -> list[Case]:
    """The i-th of n slices: whole input groups dealt round-robin in suite order (deterministic, and
    the backends of one input group stay together so its golden is built once)."""
    if shard is None:
        return cases
    i, n = shard
    from kernel_parity.conformance.runner import group_cases

    return [c for k, g in enumerate(group_cases(cases)) if k % n == i - 1 for c in g]


@dataclass
class LeftOut:
    """Cases not planned because their backend implements no adapter for their op."""

    by_backend: dict[str, dict[str, int]] = field(default_factory=dict)  # backend -> op -> cases

    @property
    def count(self) -> int:
        return sum(n for ops in self.by_backend.values() for n in ops.values())

    def line(self) -> str | None:
        if not self.count:
            return None
        parts = []
        for b, ops in self.by_backend.items():
            names = sorted(ops)
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} ops)" if len(names) > 6 else "")
            parts.append(f"{b} has no adapter for {shown}")
        return f"not planned: {self.count} cases of ops a selected backend implements no kernel for ({'; '.join(parts)})"

    def to_json(self) -> dict:
        return {"count": self.count, "by_backend": self.by_backend}


def without_adapters(cases: list[Case], registry: Any) -> tuple[list[Case], LeftOut]:
    """Drop cases whose backend implements no adapter for the op (a Backend's `ops`); an object
    without an `ops` table keeps every case and answers through `supports()`."""
    left = LeftOut()
    kept = []
    for c in cases:
        ops_table = getattr(registry.get(c.backend), "ops", None)
        if isinstance(ops_table, dict) and c.op not in ops_table:
            left.by_backend.setdefault(c.backend, {}).setdefault(c.op, 0)
            left.by_backend[c.backend][c.op] += 1
        else:
            kept.append(c)
    return kept, left


def select_cases(sel: Selection, session: Session, left_out: LeftOut | None = None) -> list[Case]:
    """The cases of a selection, in suite order: filters applied, cases of ops the backend has no
    adapter for left out (counted in `left_out`), then the shard."""
    from kernel_parity.conformance import ops

    specs = ops.match(list(sel.ops) or None)
    known_dists = {d for spec in specs for d in spec.dists}
    for d in sel.dists:
        if d not in known_dists:
            raise UsageError(f"--dist {d!r} is no value distribution of the selected ops "
                             f"(known: {', '.join(sorted(known_dists))})")
    known_dtypes = {d for spec in specs for d in spec.dtypes}
    for d in sel.dtypes:
        c = suites.canonical_filter_dtype(d)
        if c not in known_dtypes:
            raise UsageError(f"--dtype {d!r} is no dtype of the selected ops (they take: {', '.join(sorted(known_dtypes))})")
    filters = Filters(sel.ops, tuple(session.backend_names), sel.dtypes, sel.dists, sel.scale)
    cases: list[Case] = []
    for name in sel.suites:
        cases.extend(suites.cases(name, filters))
    cases = list(dict.fromkeys(cases))
    for name in dict.fromkeys(c.backend for c in cases):
        try:
            session.registry.get(name)
        except UsageError as e:  # names given with --backend were checked already: this one is the suite's
            raise UsageError(f"suite {sel.label!r} names a backend that does not exist: {e}") from None
    found = len(cases)
    cases, left = without_adapters(cases, session.registry)
    if left_out is not None:
        left_out.by_backend.update(left.by_backend)
    cases = shard_of(cases, sel.shard)
    if not cases:
        what = f"no cases in suite {sel.label!r} match the filters"
        if found and not left.count == 0:
            what = (f"none of the {found} cases of suite {sel.label!r} that match the filters has a kernel: "
                    f"{left.line()}")
        raise UsageError(what + (f" in shard {sel.shard[0]}/{sel.shard[1]}" if sel.shard else ""))
    return cases


def plan_summary(cases: list[Case]) -> dict[str, int]:
    """{"op/backend/dtype": planned cases}: what an incomplete report shows as not run."""
    out: dict[str, int] = {}
    for c in cases:
        k = f"{c.op}/{c.backend}/{c.dtype}"
        out[k] = out.get(k, 0) + 1
    return out


def digest(cases: list[Case]) -> str:
    h = hashlib.sha256()
    for c in cases:
        h.update(c.id.encode() + b"\n")
    return h.hexdigest()[:16]


def check_output_paths(args: Any, **inputs: str | None) -> None:
    """Exit 2 (UsageError) before the run if any output path cannot be written or is an input."""
    outputs = {f"--{k}": getattr(args, k, None) for k in OUTPUT_FLAGS}
    try:
        files.check_outputs(outputs, inputs)
    except files.OutputPathError as e:
        raise UsageError(str(e)) from None


# -- a run ----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One execution: its cases, where records stream, and what happens to each record."""

    args: Any
    command: str
    session: Session
    cases: list[Case]
    header: dict
    stream: records.Stream | None = None
    done: list[CaseResult] = field(default_factory=list)  # records from a resumed file
    setup: tuple | None = None  # (module, function, *args) run first in every worker
    stream_error: str | None = None  # why the results stream stopped being written, if it did

    def check_stream(self) -> None:
        """Exit 2 when the results file could not be written to the end (it reads as incomplete)."""
        if self.stream_error:
            raise UsageError(f"--json {self.args.json or self.args.resume!r} could not be written "
                             f"({self.stream_error}): it holds an incomplete run")

    def execute(self, on_record: Callable[[CaseResult], None] | None = None,
                finish: Callable[[list[CaseResult]], dict] | None = None) -> dict:
        """Run the cases (those not in `done`), streaming each record; the finished document.

        `finish(results)` may add fields to the completion record (a sweep's summary)."""
        args, session = self.args, self.session
        have = {r.id for r in self.done}
        todo = [c for c in self.cases if c.id not in have]
        t0 = time.perf_counter()
        warm_caches(todo, args.jobs)
        bar = progress(len(todo), disable=args.no_progress)
        fresh: list[CaseResult] = []

        ceilings = self.header.get("ceilings") or {}

        def on_result(rec: CaseResult) -> None:
            known.apply_one(rec, session.entries)
            if rec.perf and "ms" in rec.perf and rec.perf.get("on") in ceilings:
                from kernel_parity.conformance import bench

                rec.perf = bench.classify(rec.perf, bench.Ceilings(**ceilings[rec.perf["on"]]))
            fresh.append(rec)
            if self.stream is not None and self.stream_error is None:
                try:
                    self.stream.add(rec.to_json())
                except OSError as e:  # the disk filled mid-run: the run goes on, the command then exits 2
                    self.stream_error = f"{e.strerror or e} after {len(fresh) - 1} records"
            if on_record is not None:
                on_record(rec)
            bar.update(1)

        diagnose = not getattr(args, "no_diagnose", False)
        try:
            bench = bool(getattr(args, "bench", False))
            if getattr(args, "no_isolate", False):
                session.runner(recheck=not args.no_recheck, diagnose=diagnose, bench=bench).run(todo, on_result=on_result)
            else:
                from kernel_parity.conformance import executors

                origins = {b.name: b.origin for b in session.registry.loaded() if b.origin}
                executors.run(args, todo, jobs=args.jobs, extra_backends=session.registry.extra_specs(),
                              recheck=not args.no_recheck, timeout=args.timeout, on_result=on_result,
                              origins=origins, diagnose=diagnose, setup=self.setup, overrides=session.overrides,
                              bench=bench)
        finally:
            bar.close()
        by_id = {r.id: r for r in self.done + fresh}
        results = [by_id[c.id] for c in self.cases if c.id in by_id]
        stale = known.stale(results, session.entries, self.header.get("selection"))
        complete = {
            "cases": len(results),
            "elapsed_s": round(time.perf_counter() - t0, 3) + float(self.header.get("resumed_elapsed_s", 0.0)),
            "known_failures": {"entries": len(session.entries), "stale": stale},
            "backends": {n: session.registry.get(n).describe() for n in dict.fromkeys(c.backend for c in self.cases)},
        }
        if finish is not None:
            complete.update(finish(results))
        if self.stream is not None and self.stream_error is None:
            try:
                self.stream.finish(complete)
            except OSError as e:
                self.stream_error = f"{e.strerror or e} at the completion record"
        header = {**self.header, "elapsed_s": complete["elapsed_s"], "known_failures": complete["known_failures"],
                  "backends": complete["backends"]}
        as_json = [r.to_json() for r in results]
        if ceilings:  # a bench: every record's peers, then the file once more with them
            from kernel_parity.conformance import bench

            bench.add_peers(as_json)
            for r, j in zip(results, as_json):
                r.perf = j.get("perf")
            if self.stream is not None and self.stream_error is None and getattr(args, "json", None):
                try:
                    records.write(args.json, self.header, as_json, complete)
                except OSError as e:
                    self.stream_error = f"{e.strerror or e} when the peers' ratios were added"
        return {"schema": records.SCHEMA, "header": header, "results": as_json,
                "complete": complete, "case_results": results}


def warm_caches(cases: list[Case], jobs: int) -> None:
    """Build what the first run on a machine would otherwise build inside every worker (the C
    kernel libraries, cached on disk), in parallel, and say so: a cold run is slower for a reason."""
    if not any(c.backend == "cpu" for c in cases):
        return
    from kernel_parity.kernels.cpu import loader

    built, seconds, where = loader.warm(jobs=max(2, jobs))
    if built:
        print(f"parity: first run with these sources here: compiled {len(built)} C kernel libraries in "
              f"{seconds:.0f} s (cached in {where}; later runs skip this)", file=sys.stderr)


def prepare(args: Any, command: str, cases: list[Case] | None = None, extra_inputs: dict[str, str | None] | None = None,
            header_extra: dict | None = None) -> Run:
    """Everything before the first case: session, cases, output checks, header, the stream."""
    from kernel_parity.conformance import executors

    ex = executors.choose(args)  # --executor / --address / --devices: exit 2 before anything is written
    if getattr(args, "resume", None):
        return _prepare_resume(args, command)
    session = open_session(args.backend, args.known_failures)
    sel = Selection.from_args(args, session)
    left = LeftOut()
    if cases is None:
        cases = select_cases(sel, session, left)
    suite_files = {f"suite file {s}": s for s in sel.suites if s.endswith(".toml")}
    check_output_paths(args, **{"known-failures file": session.known_file, **suite_files, **(extra_inputs or {})})
    if left.count and not getattr(args, "quiet", False):
        print(f"parity: {left.line()}", file=sys.stderr)
    if getattr(args, "bench", False):
        header_extra = {**(header_extra or {}), "ceilings": _ceilings(cases, session, args)}
    header = env.header(command, sel.label)
    header.update(planned=len(cases), planned_digest=digest(cases), selection=sel.to_json(),
                  plan=plan_summary(cases), left_out=left.to_json() if left.count else None,
                  tolerance_overrides=[t.to_json() for t in session.config.tolerance],
                  config=_shown_path(session.config.path),
                  executor=executors.describe(ex, int(getattr(args, "jobs", 1) or 1)), **(header_extra or {}))
    stream = open_stream(args.json, header) if args.json else None
    return Run(args, command, session, cases, header, stream)


def _ceilings(cases: list[Case], session: Session, args: Any) -> dict:
    """The copy, read and matmul rates of every device the cases run on, measured now (a bench)."""
    from kernel_parity.conformance import bench

    if args.jobs != 1:
        print(f"parity: a bench times one case at a time: --jobs {args.jobs} -> 1", file=sys.stderr)
        args.jobs = 1
    backends = {b: session.registry.get(b) for b in {c.backend for c in cases}}
    # only where some case can run: a backend that is not available (a GPU peer on a CPU machine)
    # skips every case and has no device to measure
    devices = sorted({str(getattr(b, "device", "cpu")) for b in backends.values() if not b.available()})
    out = {}
    for dev in devices:
        c = bench.measure_ceilings(dev)
        out[dev] = c.to_json()
        if not args.quiet:
            print(f"parity: ceilings on {c.device}: copy {c.copy_gbps:.1f} GB/s, read {c.read_gbps:.1f} GB/s, "
                  f"{c.matmul_dtype} matmul {c.matmul_tflops:.3g} TFLOP/s", file=sys.stderr)
    return out


def open_stream(path: str, header: dict) -> records.Stream:
    """The results stream, or exit 2 naming the path (the up-front check makes this rare)."""
    try:
        return records.Stream.create(path, header)
    except OSError as e:
        raise UsageError(f"--json {path!r} cannot be written: {e.strerror or e}") from None


def _shown_path(path: Any) -> str | None:
    """A config path as results record it: relative to the working directory when under it (a
    results file names no machine's layout), else as given."""
    if not path:
        return None
    rel = os.path.relpath(os.path.abspath(path))
    return str(path) if rel.startswith("..") else rel


def _prepare_resume(args: Any, command: str) -> Run:
    path = args.resume
    for flag, given in (("--suite", args.suite), ("--op", args.op), ("--backend", args.backend),
                        ("--dtype", args.dtype), ("--dist", args.dist), ("--json", args.json),
                        ("--shard", getattr(args, "shard", None))):
        if given:
            raise UsageError(f"--resume takes the selection and the results file from {path!r}: drop {flag}")
    try:
        doc = records.load(path)
    except records.RecordsError as e:
        raise UsageError(str(e)) from None
    if doc["complete"] is not None:
        raise UsageError(f"results file {path!r} is complete: nothing to resume")
    header = doc["header"]
    if header.get("changed_since"):
        raise UsageError(f"results file {path!r} is a gate --changed-since run: run the gate again")
    sel = Selection.from_json(header.get("selection"), f"results file {path!r}")
    session = open_session(list(sel.backends), args.known_failures)
    cases = select_cases(sel, session)
    if header.get("planned_digest") not in (None, digest(cases)) or header.get("planned") not in (None, len(cases)):
        raise UsageError(f"the cases of {path!r} no longer match its selection (the suite or the ops changed "
                         f"since the run started): start a new run")
    known_ids = {c.id for c in cases}
    stray = [r["id"] for r in doc["results"] if r["id"] not in known_ids]
    if stray:
        raise UsageError(f"results file {path!r} holds case {stray[0]!r}, which its selection does not make")
    done = [CaseResult.from_json(r, f"results file {path!r}") for r in doc["results"]]
    args.json = None
    check_output_paths(args, **{"resumed results file": path, "known-failures file": session.known_file})
    stream = records.Stream.reopen(path)
    header = {**header, "command": f"{header.get('command')} ; {command}"}
    return Run(args, command, session, cases, header, stream, done=done)


# -- reporting -------------------------------------------------------------------------------------
def write_outputs(args: Any, doc: dict, diff: Any = None, mutants: dict | None = None) -> None:
    """The rendered reports (the JSON results were streamed as the run went). Each is written
    atomically; a path that fails at this point (checked before the run, so only a disk that
    filled meanwhile) is exit 2 naming it, never a traceback."""
    writers = []
    if getattr(args, "html", None):
        from kernel_parity.reports import html

        writers.append(("--html", args.html, lambda p: html.write(p, doc, diff=diff, mutants=mutants)))
    if getattr(args, "junit", None):
        from kernel_parity.reports import junit

        writers.append(("--junit", args.junit, lambda p: junit.write(p, doc)))
    if getattr(args, "md", None):
        from kernel_parity.reports import markdown

        writers.append(("--md", args.md, lambda p: markdown.write(p, doc)))
    failed = []
    for flag, path, write in writers:
        try:
            write(path)
        except OSError as e:
            failed.append(f"{flag} {path!r} could not be written ({e.strerror or e})")
    if failed:
        raise UsageError("; ".join(failed))


def print_summary(doc: dict, quiet: bool = False) -> bool:
    """Print failures (at most MAX_PRINTED_FAILURES) and the count line; True if the gate passes."""
    header, results = doc["header"], doc["results"]
    counts = records.summary(results)
    failing = [r for r in results if r["verdict"] in records.FAILING]
    if not quiet:
        for r in failing[:MAX_PRINTED_FAILURES]:
            print(f"{r['verdict'].upper()} {r['id']}")
            print("  " + (r.get("message") or r.get("reason") or "").replace("\n", "\n  "))
        if len(failing) > MAX_PRINTED_FAILURES:
            print(f"... and {len(failing) - MAX_PRINTED_FAILURES} more failing cases (see the reports)")
    parts = [f"{n} {v}" for v, n in counts.items() if n]
    for label in records.stale_entries(doc):
        print(f"STALE known-failures entry matches no case that ran: {label}")
    status = records.status_line(doc)
    if status:
        print(f"parity: {status}")
    ok = records.doc_passed(doc)
    elapsed = header.get("elapsed_s") or (doc.get("complete") or {}).get("elapsed_s") or 0
    left = header.get("left_out") if isinstance(header.get("left_out"), dict) else None
    note = f" ({left.get('count')} cases of ops without a kernel in the backend not planned)" if left else ""
    print(f"parity: {'PASS' if ok else 'FAIL'}: {len(results)} cases: {', '.join(parts) or 'none'} in "
          f"{float(elapsed):.1f} s on {header.get('device')}{note}")
    return ok


def load_input(path: str, what: str) -> dict:
    """A results file given as an input (baseline, diff side, report source): exit 2 if unusable."""
    try:
        return records.load(path)
    except records.RecordsError as e:
        raise UsageError(f"{what}: {e}") from None


# -- commands -------------------------------------------------------------------------------------
def cmd_run(args: Any, command: str) -> int:
    run = prepare(args, command)
    doc = run.execute()
    write_outputs(args, doc)
    ok = print_summary(doc, args.quiet)
    run.check_stream()
    return EXIT_OK if ok else EXIT_FAIL


def cmd_bench(args: Any, command: str) -> int:
    """`parity run` with every case timed (conformance/bench.py), and one line per record on stdout as
    it lands (bench.Lines; none with -q), written around the progress bar."""
    from kernel_parity.conformance import bench

    run = prepare(args, command)
    done = {r.id for r in run.done}
    lines = bench.Lines([c for c in run.cases if c.id not in done])

    def on_record(rec: CaseResult) -> None:
        say(lines.add(rec.to_json()))

    doc = run.execute(on_record=None if args.quiet else on_record)
    write_outputs(args, doc)
    ok = print_summary(doc, args.quiet)
    run.check_stream()
    return EXIT_OK if ok else EXIT_FAIL


def cmd_gate(args: Any, command: str) -> int:
    from kernel_parity.conformance import config as cfgmod

    baseline = args.baseline
    if baseline is None:
        baseline = cfgmod.load().baseline
        if baseline is not None and not os.path.exists(baseline):
            raise UsageError(f"the configured baseline {baseline!r} ([tool.kernel-parity] baseline) does not exist")
    old = None
    if baseline:  # fail fast on a bad baseline, before the run
        old = load_input(baseline, "--baseline")
        status = records.status_line(old)
        if status:
            raise UsageError(f"--baseline {baseline!r} is {status}: finish it with parity run --resume")
    cases, extra = (None, None)
    if getattr(args, "changed_since", None):
        cases, extra = changed_cases(args)
    run = prepare(args, command, cases=cases, extra_inputs={"--baseline file": baseline},
                  header_extra={"changed_since": extra} if extra else None)
    doc = run.execute()
    diff = None
    if old is not None:
        from kernel_parity.reports.diff import compare

        diff = compare(old, doc, growth=args.growth, slowdown=args.slowdown if getattr(args, "bench", False) else None)
        if getattr(args, "bench", False) and not any(isinstance(r.get("perf"), dict) for r in old["results"]):
            diff.perf_note = f"times not compared: the baseline {baseline!r} holds no times (take it with --bench)"
        doc["header"]["baseline"] = {"path": baseline, "git_commit": old["header"].get("git_commit")}
    write_outputs(args, doc, diff)
    ok = print_summary(doc, args.quiet)
    if diff is not None:
        print(diff.render_text())
        ok = ok and not diff.failed
    run.check_stream()
    return EXIT_OK if ok else EXIT_FAIL


THOROUGH_STRIDE = 7_000_003  # fresh seed k of a thorough case with seed s is s + k * THOROUGH_STRIDE


def changed_cases(args: Any) -> tuple[list[Case], dict]:
    """`gate --changed-since REF`: the families the change touches run thorough (the selected suites'
    cases, each also at `--thorough-seeds` fresh seeds), the others quick (the smoke suite); prints what
    it selected and why. Returns (cases, the header's record of the selection)."""
    from kernel_parity.conformance import changes, ops

    session = open_session(args.backend, args.known_failures)
    sel = Selection.from_args(args, session)
    files = changes.git_changed(args.changed_since)
    stems = sorted({s.stem for s in ops.all_specs().values()})
    picked = changes.select(files, stems, changes.plugin_sources(session.registry))
    thorough = stems if picked.everything else sorted(picked.families)
    quick = [s for s in stems if s not in thorough]
    print(f"parity: changed since {args.changed_since}: {len(files)} files")
    if picked.everything:
        print(f"parity: every family runs thorough: {picked.everything}")
    else:
        for stem in thorough:
            reasons = picked.families[stem]
            more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
            print(f"parity: {stem}: thorough ({'; '.join(reasons[:3])}{more})")
    if quick:
        print(f"parity: quick (the smoke suite): {', '.join(quick)}")
    cases: list[Case] = []
    if thorough:
        base = [c for c in _cases_or_none(dataclasses_replace(sel, ops=sel.ops or tuple(f"{s}.*" for s in thorough)),
                                          session) if c.op.split(".", 1)[0] in thorough]
        cases += base
        cases += [c.with_seed(c.seed + k * THOROUGH_STRIDE) for k in range(1, args.thorough_seeds + 1) for c in base]
    if quick:
        smoke = dataclasses_replace(sel, suites=("smoke",), ops=sel.ops or tuple(f"{s}.*" for s in quick))
        cases += [c for c in _cases_or_none(smoke, session) if c.op.split(".", 1)[0] in quick]
    cases = list(dict.fromkeys(cases))
    if not cases:
        raise UsageError(f"--changed-since {args.changed_since!r}: the change selects no case to run")
    record = {"ref": args.changed_since, "files": files, "thorough": thorough, "quick": quick,
              "everything": picked.everything, "thorough_seeds": args.thorough_seeds,
              "why": {k: v for k, v in picked.families.items()}}
    return cases, record


def _cases_or_none(sel: Selection, session: Session) -> list[Case]:
    """The selection's cases, or none when it selects nothing (select_cases raises then)."""
    try:
        return select_cases(sel, session)
    except UsageError:
        return []


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)


def cmd_config(args: Any, command: str) -> int:
    session = open_session(args.backend, args.known_failures)
    for key, value, source in session.values():
        print(f"{key:<15} {value!s:<60} ({source})")
    return EXIT_OK


def cmd_report(args: Any, command: str) -> int:
    if not (args.html or args.junit or args.md):
        raise UsageError("report needs at least one of --html, --junit, --md")
    paths = list(args.results)
    check_output_paths(args, **{f"results file {p}": p for p in paths}, **{"mutants file": args.mutants})
    if len(paths) > 1:
        return _report_devices(args, paths)
    doc = load_input(paths[0], "report")
    mutants = _load_mutants(args.mutants) if args.mutants else None
    write_outputs(args, doc, mutants=mutants)
    status = records.status_line(doc)
    if status:
        print(f"parity: {paths[0]}: {status}", file=sys.stderr)
    return EXIT_OK if records.doc_passed(doc) else EXIT_FAIL


def _report_devices(args: Any, paths: list[str]) -> int:
    """`parity report a.jsonl b.jsonl ... --html m.html`: the runs side by side, a column per device;
    exit 1 unless every run passes its own gate."""
    from kernel_parity.reports import html

    for flag in ("junit", "md", "mutants"):
        if getattr(args, flag, None):
            raise UsageError(f"--{flag} takes one results file; with several (a device matrix) only --html")
    seen: dict[str, str] = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            raise UsageError(f"results file {p!r} is given twice (as {seen[real]!r})")
        seen[real] = p
    runs = [(p, load_input(p, "report")) for p in paths]
    try:
        html.write_devices(args.html, runs)
    except OSError as e:
        raise UsageError(f"--html {args.html!r} could not be written ({e.strerror or e})") from None
    for p, doc in runs:
        status = records.status_line(doc)
        if status:
            print(f"parity: {p}: {status}", file=sys.stderr)
    return EXIT_OK if all(records.doc_passed(doc) for _, doc in runs) else EXIT_FAIL


def cmd_merge(args: Any, command: str) -> int:
    """Join results files (the shards of one run, or any runs) into one results file and reports."""
    inputs = {f"input {p}": p for p in args.results}
    check_output_paths(args, **inputs)
    if not (args.json or args.html or args.junit or args.md):
        raise UsageError("merge needs at least one of --json, --html, --junit, --md")
    docs = [(p, load_input(p, "merge")) for p in args.results]
    merged: dict[str, dict] = {}
    for p, d in docs:
        for r in d["results"]:
            old = merged.get(r["id"])
            if old is not None and old["verdict"] != r["verdict"]:
                raise UsageError(f"merge: case {r['id']!r} is {old['verdict']} in one file and {r['verdict']} in "
                                 f"{p!r}: these are not shards of one run")
            merged[r["id"]] = r
    first = docs[0][1]["header"]
    planned = [d["header"].get("planned") for _, d in docs]
    header = {**first, "command": command, "merged_from": [p for p, _ in docs],
              "planned": sum(planned) if all(isinstance(x, int) for x in planned) else None}
    header.pop("planned_digest", None)
    incomplete = [p for p, d in docs if d["complete"] is None]
    stale = sorted({s for _, d in docs for s in records.stale_entries(d)})
    results = list(merged.values())
    complete = None if incomplete else {"cases": len(results), "known_failures": {"stale": stale},
                                        "elapsed_s": sum(float(d["complete"].get("elapsed_s", 0)) for _, d in docs)}
    if args.json:  # an incomplete input keeps the merge incomplete: no completion line
        try:
            records.atomic_write_text(args.json, records.dump(header, results, complete, finished=complete is not None))
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    doc = {"schema": records.SCHEMA, "header": header, "results": results, "complete": complete}
    write_outputs(args, doc)
    return EXIT_OK if print_summary(doc, args.quiet) else EXIT_FAIL


def _load_mutants(path: str) -> dict:
    import json

    from kernel_parity.conformance.mutants.run import SCHEMA

    try:
        doc = json.loads(open(path, encoding="utf-8").read())
    except FileNotFoundError:
        raise UsageError(f"--mutants file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--mutants file {path!r} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("mutants"), list) \
            or not all(isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("status"), str)
                       for m in doc["mutants"]):
        raise UsageError(f"--mutants file {path!r} is not a {SCHEMA!r} document with a list of mutants")
    return doc


def cmd_diff(args: Any, command: str) -> int:
    from kernel_parity.reports.diff import compare

    old, new = load_input(args.old, "diff"), load_input(args.new, "diff")
    d = compare(old, new, growth=args.growth)
    print(d.render_text())
    if getattr(args, "json", None):
        import json

        doc = {"schema": "kernel-parity/diff/1", "old_file": args.old, "new_file": args.new,
               "counts": d.counts(), **d.to_dict()}
        try:
            files.write_text(args.json, json.dumps(records.encode(doc), indent=1) + "\n")
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    return EXIT_FAIL if d.failed else EXIT_OK
