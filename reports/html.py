"""HTML report: one self-contained page (inline CSS, SVG and script, no network) rendered from a
results document (`reports.records`), or from several runs on different devices side by side.

A run's page, in order: header, summary badge, op x backend x dtype matrix, baseline diff (when a
`reports.diff.Diff` is given), mutant kill table, failures grouped by (op, backend, diagnosis,
layer) with one example each in full, known failures and skips by reason, parameter coverage,
error-vs-size plots (SVG, a fixed grid), and the all-cases table.

Everything above the all-cases table is static HTML and reads without JavaScript. The table is a
compact JSON document at the end of the page (`reports.casetable`) that the inline script draws:
only the rows in view are in the DOM, so filtering and sorting 20,000 cases stays interactive,
and a row's details (and those of the failures listed under each group's example) are built on
demand.

`render_devices` puts runs of one suite on several devices side by side (`reports.devices`): a
column per device, per case the norm_err on each and the ratio of the largest to the smallest.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from kernel_parity.reports import casetable, coverage, devices, plots, records, views

HEADER_FIELDS = (
    ("suite", "suite"), ("device", "device"), ("driver", "driver"),
    ("package_version", "kernel-parity"), ("git_commit", "commit"), ("git_tree", "tree"), ("time", "time"),
    ("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"), ("python", "python"),
    ("platform", "platform"), ("command", "command"),
)
METRIC_COLUMNS = ("max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp")
OPEN_FAILURES = 200  # failure groups whose example starts open (every one, in any real run); the rest collapsed
DIFFER_LISTED = 200  # device page: cases listed statically under "where the devices differ"
NORM_ERR_HELP = ("norm_err: the case's worst error divided by its limit, over every output and tolerance layer "
                 "(elementwise, cos_diff, nmse, noise); at most 1 passes, 0.5 used half the allowance")

fmt_num = views.fmt_num
fmt_dur = views.fmt_dur


def case_id_markup(case_id: Any) -> Markup:
    """A case id that wraps only after "/" or ",": each piece in a no-wrap span followed by <wbr>,
    so a line never breaks at the hyphen of `sdpa-cpu` or inside a parameter (copying the text
    still gives the id, unchanged)."""
    text = str(case_id)
    pieces = re.findall(r"[^/,]*[/,]|[^/,]+$", text)
    inner = Markup("<wbr>").join(Markup("<span>{}</span>").format(p) for p in pieces)
    return Markup('<span class="cid">{}</span>').format(inner)


def _over(x: Any, limit: Any) -> bool:
    """A metric above its limit, or non-finite (highlighted in the metrics table)."""
    if views.nonfinite(x):
        return True
    return views.is_num(x) and views.is_num(limit) and x > limit


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=fmt_num, dur=fmt_dur, cid=case_id_markup)
    env.tests.update(nonfinite=views.nonfinite)
    env.globals.update(over=_over, verdicts=records.VERDICTS, metric_columns=METRIC_COLUMNS,
                       norm_err_help=NORM_ERR_HELP, open_failures=OPEN_FAILURES, plot_w=plots.PLOT_W,
                       plot_h=plots.PLOT_H, palette=plots.PALETTE)
    return env


@functools.lru_cache(maxsize=1)
def _script() -> Markup:
    """The page's script (templates/report.js), inlined as it is."""
    return Markup((Path(__file__).parent / "templates" / "report.js").read_text(encoding="utf-8"))


def _mutants_view(mdoc: dict | None) -> dict | None:
    if not mdoc:
        return None
    return {"rows": list(mdoc.get("mutants") or []), "summary": dict(mdoc.get("summary") or {}),
            "props": bool((mdoc.get("header") or {}).get("props"))}


def render_mutants(mdoc: dict) -> str:
    """A page with the mutant kill table alone (`parity mutants --html`)."""
    header = mdoc.get("header") or {}
    return _env().get_template("report.html.j2").render(
        only_mutants=True, mutants=_mutants_view(mdoc), version=header.get("package_version") or "",
        title=f"kernel-parity · mutants · {header.get('suite') or ''} · {header.get('device') or '?'}",
        command=header.get("command") or "")


def write_mutants(path: str | os.PathLike, mdoc: dict) -> None:
    records.atomic_write_text(path, render_mutants(mdoc))


def render(doc: dict, diff: Any = None, mutants: dict | None = None) -> str:
    """The HTML page for a results document; `diff` (a reports.diff.Diff) adds a baseline section,
    `mutants` (a `parity mutants` document) the kill table."""
    header = doc.get("header") or {}
    results = doc.get("results") or []
    ordered = sorted(results, key=views.severity)
    row = {id(r): i for i, r in enumerate(ordered)}
    failing = [(r, None) for r in ordered if r.get("verdict") in records.FAILING]
    ops, columns, cells = records.matrix(results, records.plan_of(doc))
    left_out = header.get("left_out") if isinstance(header.get("left_out"), dict) else None
    counts = records.summary(results)
    sampled = sum(1 for r in results if isinstance(r.get("sample"), dict))
    data, omitted = casetable.run_table(ordered)
    return _env().get_template("report.html.j2").render(
        page="run", header=[(label, header.get(key)) for key, label in HEADER_FIELDS],
        title=f"kernel-parity · {header.get('suite') or 'results'} · {header.get('device') or '?'}",
        passed=records.doc_passed(doc), total=len(results), incomplete=records.status_line(doc),
        stale=records.stale_entries(doc),
        counts=[(v, counts[v]) for v in records.VERDICTS if counts.get(v)],
        ops=ops, columns=columns, cells=cells, failing=len(failing),
        groups=views.failure_groups(failing, lambda r: row[id(r)]),
        skips=views.by_reason(results, "skip"), known=views.by_reason(results, "xfail"),
        coverage=coverage.coverage(results), plots=plots.plot_grid(results),
        diff=diff, left_out=left_out, mutants=_mutants_view(mutants), sampled=sampled,
        version=header.get("package_version") or "",
        diff_entries=list(diff.entries()) if diff is not None else [],
        data=Markup(data), omitted=omitted, script=_script(),
    )


def write(path: str | os.PathLike, doc: dict, diff: Any = None, mutants: dict | None = None) -> None:
    """Render `doc` and write it to `path` atomically."""
    records.atomic_write_text(path, render(doc, diff, mutants))


def _differ_view(c: dict) -> dict:
    errs = [r.get("norm_err") if r is not None and views.is_num(r.get("norm_err")) else None for r in c["records"]]
    finite = [(math.inf if math.isnan(e) else e) for e in errs if e is not None]
    top = max(finite) if len(finite) > 1 else None
    cells = [None if r is None else {"verdict": r.get("verdict"), "norm_err": r.get("norm_err"),
                                     "max": top is not None and e is not None and (math.inf if math.isnan(e) else e) == top}
             for r, e in zip(c["records"], errs)]
    return {"id": c["id"], "cells": cells, "ratio": c["ratio"],
            "flag_ratio": c["ratio"] is not None and c["ratio"] >= devices.RATIO_FLAG}


def render_devices(runs: list[tuple[str, dict]]) -> str:
    """One page comparing runs on several devices: `runs` as (path, results document) pairs."""
    names = devices.labels(runs)
    docs = [doc for _, doc in runs]
    cases = devices.compare(docs)
    row = {c["id"]: i for i, c in enumerate(cases)}
    failing = [(r, names[i]) for i, doc in enumerate(docs)
               for r in sorted(doc.get("results") or [], key=views.severity) if r.get("verdict") in records.FAILING]
    dmatrix = devices.matrix(docs, cases)
    for i, r in enumerate(dmatrix):
        r["op_span"] = 0 if i and dmatrix[i - 1]["op"] == r["op"] else sum(1 for x in dmatrix if x["op"] == r["op"])
        r["flag"] = r["ratio"] is not None and r["ratio"] >= devices.RATIO_FLAG
    differ = [c for c in cases if c["flag"]]
    data, omitted = casetable.devices_table(names, cases)
    suites = sorted({str((d.get("header") or {}).get("suite")) for d in docs if (d.get("header") or {}).get("suite")})
    version = next(((d.get("header") or {}).get("package_version") for d in docs
                    if (d.get("header") or {}).get("package_version")), "")
    return _env().get_template("report.html.j2").render(
        page="devices", title=f"kernel-parity · device matrix · {', '.join(suites) or 'results'} · {' vs '.join(names)}",
        runs=devices.runs_view(runs, names), passed=all(records.doc_passed(d) for d in docs),
        summary=devices.summary(cases), dmatrix=dmatrix, differ=[_differ_view(c) for c in differ[:DIFFER_LISTED]],
        differ_total=len(differ), failing=len(failing),
        groups=views.failure_groups(failing, lambda r: row[str(r.get("id"))]),
        version=version, data=Markup(data), omitted=omitted, script=_script(),
    )


def write_devices(path: str | os.PathLike, runs: list[tuple[str, dict]]) -> None:
    records.atomic_write_text(path, render_devices(runs))


def render_diff_section(diff: Any) -> str:
    """The "Baseline diff" section alone, as an HTML fragment (for embedding elsewhere)."""
    return _env().get_template("report.html.j2").render(
        only_diff=True, diff=diff, diff_entries=list(diff.entries()))
