"""`parity mutants`: does the gate catch each seeded bug of the catalogue?

For every mutant (conformance/mutants/catalogue.toml), in worker processes that load the patched
kernels: the suite's cases of the mutated backend run, those of the mutated file's op family
first, until one fails (killed by the gate: which case, which layer, and whether a diagnosis named
the bug). With --props, a mutant the gate let through then meets the property tests of that
backend under the ci Hypothesis profile (killed by props: which test). A mutant nothing kills
*survived*, and fails the command. Mutants declared equivalent are listed with their reason and not
run; GPU-only ones run only where a CUDA GPU is. A mutant that cannot be applied or built is an
`error` row (its message says why) and fails the command too; the others still run.

    parity mutants [--suite ci] [--props] [--mutant ID ...] [--bug CLASS ...] [--backend B ...]
                   [--shard I/N] [--jobs N] [--timeout S] [--json PATH] [--html PATH]

--shard I/N runs the I-th of N round-robin slices of the selected mutants: N of them side by side
cover the catalogue on a many-core host (each mutant's cases are sequential until one kills it).
"""

from __future__ import annotations

import argparse

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kernel_parity.conformance import env, suites
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.mutants import CLASSES, Mutant, MutantError, catalogue, materialise
from kernel_parity.conformance.suites import Filters, parse_shard
from kernel_parity.reports import files, records

SCHEMA = "kernel-parity/mutants/1"
ROOT = Path(__file__).resolve().parent.parent.parent
_FAILED_TEST = re.compile(r"^FAILED (\S+)", re.MULTILINE)


def select(args: Any) -> list[Mutant]:
    muts = list(catalogue())
    if args.mutant:
        known = {m.id for m in muts}
        for i in args.mutant:
            if i not in known:
                raise UsageError(f"unknown mutant {i!r} (parity mutants --list shows them)")
        muts = [m for m in muts if m.id in args.mutant]
    if args.bug:
        for b in args.bug:
            if b not in CLASSES:
                raise UsageError(f"unknown bug class {b!r} (known: {', '.join(CLASSES)})")
        muts = [m for m in muts if m.bug in args.bug]
    if args.backend:
        for b in args.backend:
            if b not in ("triton", "cpu", "torch", "gluon"):
                raise UsageError(f"--backend {b!r}: mutants exist for our own kernels only (triton, cpu, torch, gluon)")
        muts = [m for m in muts if m.backend in args.backend]
    shard = parse_shard(getattr(args, "shard", None))
    if shard is not None:  # the i-th of n slices, round-robin in catalogue order: parallel runs on one host
        muts = [m for k, m in enumerate(muts) if k % shard[1] == shard[0] - 1]
    if not muts:
        raise UsageError("no mutant matches the filters" + (f" in shard {shard[0]}/{shard[1]}" if shard else ""))
    return muts


# Our backends whose kernels live in one kernels/ folder: a mutant of kernels/triton/ runs the cases of each.
OWN_BACKENDS = {"triton": ("triton", "triton-q8")}


def gate_cases(mutant: Mutant, suite: str) -> list[Case]:
    """The suite's cases of the mutant's backends (OWN_BACKENDS), its own op family first."""
    mine = [c for c in suites.cases(suite, Filters(scale="cpu" if not _gpu() else "auto"))
            if c.backend in OWN_BACKENDS.get(mutant.backend, (mutant.backend,))]
    return sorted(mine, key=lambda c: c.op.split(".", 1)[0] != mutant.stem)


def _gpu() -> bool:
    from kernel_parity.conformance.backends._torch import cuda_available

    return cuda_available()


def run_gate(mutant: Mutant, cases: list[Case], root: Path, jobs: int, timeout: float,
             args: Any = None, judged: dict | None = None) -> CaseResult | None:
    """The first failing record of `cases` under the mutant (None: every case passed or skipped),
    in the suite's order (small cases first), on local workers or over the GPUs of `--devices`.
    judged: filled with op -> how many of its cases ran (not skipped)."""
    from kernel_parity.conformance import executors

    found: list[CaseResult] = []

    def on_result(rec: CaseResult) -> None:
        if judged is not None and rec.verdict != "skip":
            judged[rec.op] = judged.get(rec.op, 0) + 1
        if rec.failing and not found:
            found.append(rec)

    copy = materialise(mutant, root)
    executors.run(args if args is not None else argparse.Namespace(), cases, jobs=jobs, extra_backends=[],
                  timeout=timeout, on_result=on_result, recheck=False, largest=False, stop=lambda: bool(found),
                  setup=("kernel_parity.conformance.mutants", "use_copy", str(copy), str(root / "cache")))
    return found[0] if found else None


def run_props(mutant: Mutant, root: Path, timeout: float) -> tuple[str | None, str]:
    """(the first failing property test or None, a one-line note) under the ci profile."""
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "property_tests"), "-q", "-x", "-p", "no:cacheprovider",
           "-k", mutant.backend, "--parity-mutant", mutant.id, "--parity-mutant-root", str(root)]
    env_ = {**os.environ, "PARITY_PROFILE": "ci"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env_, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "property tests (timed out)", f"the property tests ran longer than {timeout:g} s"
    out = proc.stdout + proc.stderr
    if proc.returncode == 1:
        m = _FAILED_TEST.search(out)
        return (m.group(1) if m else "property tests"), "a property test failed"
    if proc.returncode == 0:
        return None, "every property test passed"
    if proc.returncode == 5:
        raise MutantError(f"mutant {mutant.id!r}: pytest collected no property test for backend {mutant.backend!r}")
    tail = " ".join(out.strip().splitlines()[-1:])
    raise MutantError(f"mutant {mutant.id!r}: the property tests could not run (exit {proc.returncode}): {tail}")


def evaluate(mutant: Mutant, args: Any, root: Path) -> dict:
    res: dict[str, Any] = {"id": mutant.id, "bug": mutant.bug, "file": mutant.file, "backend": mutant.backend,
                           "doc": mutant.doc, "status": None, "by": None, "case": None, "verdict": None,
                           "layer": None, "diagnosis": None, "test": None, "elapsed_s": 0.0, "note": None}
    if mutant.equivalent:
        res.update(status="equivalent", note=mutant.equivalent)
        return res
    if mutant.gpu_only and not _gpu():
        res.update(status="gpu-only", note=mutant.gpu_only)
        return res
    t0 = time.perf_counter()
    materialise(mutant, root)
    if mutant.backend == "cpu":  # a C mutant must build: a compile error would only skip every case
        _check_builds(mutant, root)
    from kernel_parity.conformance.parallel import WorkerSetupError

    judged: dict[str, int] = {}
    try:
        rec = run_gate(mutant, gate_cases(mutant, args.suite or suites.DEFAULT_SUITE), root, args.jobs, args.timeout,
                       args, judged)
    except WorkerSetupError as e:
        raise MutantError(f"mutant {mutant.id!r}: {e}") from None
    if rec is not None:
        res.update(status="killed", by="gate", case=rec.id, verdict=rec.verdict, layer=rec.kind or rec.verdict,
                   diagnosis=(rec.diagnosis or [None])[0], note=(rec.reason or "")[:300])
    elif args.props:
        test, note = run_props(mutant, root, max(args.timeout, 600.0))
        res.update(status="killed" if test else "survived", by="props" if test else None, test=test, note=note)
    else:
        res.update(status="survived", note=passed_note(judged))
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return res


def passed_note(judged: dict[str, int]) -> str:
    """A survivor's note: which ops' cases ran it (a mutant of a kernel no case runs survives vacuously: the
    note says so, naming no op)."""
    if not judged:
        return "no gate case ran (every case of its backend skipped or none listed)"
    ops = sorted(judged.items(), key=lambda kv: -kv[1])
    more = f", +{len(ops) - 4} ops" if len(ops) > 4 else ""
    return (f"every gate case passed: {sum(judged.values())} ran ("
            + ", ".join(f"{op} {n}" for op, n in ops[:4]) + more + ")")


def _check_builds(mutant: Mutant, root: Path) -> None:
    stems = [Path(mutant.file).stem] if mutant.file.endswith(".c") else \
        sorted(p.stem for p in (materialise(mutant, root) / "cpu").glob("*.c"))
    code = (f"from conformance.mutants import install; install({mutant.id!r}, {str(root)!r}); "
            f"from kernel_parity.kernels.cpu.loader import load; [load(s) for s in {stems!r}]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise MutantError(f"mutant {mutant.id!r}: the patched C source does not build: {last}")


def render_table(rows: list[dict]) -> str:
    lines = [f"{'mutant':<40} {'bug':<26} {'status':<10} {'by':<5} {'layer':<10} {'diag':<4} {'s':>6}  case / test / note"]
    for r in rows:
        what = r["case"] or r["test"] or r["note"] or ""
        lines.append(f"{r['id']:<40} {r['bug']:<26} {r['status']:<10} {r['by'] or '':<5} {r['layer'] or '':<10} "
                     f"{'yes' if r['diagnosis'] else '':<4} {r['elapsed_s']:>6.1f}  {what[:110]}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def main(args: Any, command: str) -> int:
    """`parity mutants`; a catalogue that cannot be read is a usage error (exit 2)."""
    try:
        return mutants_command(args, command)
    except MutantError as e:
        raise UsageError(str(e)) from None


def mutants_command(args: Any, command: str) -> int:
    if args.list:  # the selection's (--mutant, --bug, --backend, --shard), the whole catalogue by default
        for m in select(args):
            flag = " [equivalent]" if m.equivalent else " [gpu only]" if m.gpu_only else ""
            print(f"{m.id:<40} {m.bug:<26} {m.file:<26} {m.doc}{flag}")
        return EXIT_OK
    from kernel_parity.conformance import executors

    executors.choose(args)  # --devices on a machine without that GPU: exit 2 before any mutant runs
    muts = select(args)  # output paths were checked before the command started (cli.check_paths)
    header = env.header(command, args.suite or suites.DEFAULT_SUITE)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kp-mutants-") as tmp:
        root = Path(tmp)
        for m in muts:
            try:
                rows.append(evaluate(m, args, root))
            except MutantError as e:  # a broken entry is loud, but the other mutants still run
                rows.append({"id": m.id, "bug": m.bug, "file": m.file, "backend": m.backend, "doc": m.doc,
                             "status": "error", "by": None, "case": None, "verdict": None, "layer": None,
                             "diagnosis": None, "test": None, "elapsed_s": 0.0, "note": str(e)})
            if not args.quiet:
                r = rows[-1]
                print(f"{r['status']:<10} {r['id']:<40} {r['by'] or '':<5} {r['case'] or r['test'] or r['note'] or ''}"[:200],
                      flush=True)
    doc = {"schema": SCHEMA, "header": {**header, "elapsed_s": round(time.perf_counter() - t0, 1),
                                         "props": bool(args.props)},
           "mutants": rows, "summary": summary(rows)}
    try:
        if args.json:
            import json

            files.write_text(args.json, json.dumps(records.encode(doc), indent=1) + "\n")
        if args.html:
            from kernel_parity.reports import html

            html.write_mutants(args.html, doc)
    except OSError as e:
        raise UsageError(f"the kill table could not be written ({e.strerror or e})") from None
    print(render_table(rows))
    s = doc["summary"]
    print(f"parity mutants: {len(rows)} mutants: " + ", ".join(f"{n} {k}" for k, n in s.items())
          + f" in {doc['header']['elapsed_s']:.0f} s")
    return EXIT_FAIL if s.get("survived") or s.get("error") else EXIT_OK
