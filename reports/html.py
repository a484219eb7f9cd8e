"""HTML report: one self-contained page (inline CSS and SVG, no network) rendered from a results
document (`reports.records`).

Sections, in order: header, summary badge, op x backend x dtype matrix, baseline diff (when a
`reports.diff.Diff` is given), failures (worst first, with metrics, worst elements, message and
repro), skips grouped by reason, all cases (collapsed), error vs size plots (inline SVG).
The page reads fully without JavaScript; a few lines of inline JS add sorting, filtering and
copy buttons.
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

from kernel_parity.reports import records

HEADER_FIELDS = (
    ("suite", "suite"), ("device", "device"), ("driver", "driver"),
    ("package_version", "kernel-parity"), ("git_commit", "commit"), ("time", "time"),
    ("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"), ("python", "python"),
    ("platform", "platform"), ("command", "command"),
)
METRIC_COLUMNS = ("max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp")
TABLE_METRICS = ("max_abs", "cos_diff", "max_ulp")  # per output, in the all-cases table
OPEN_FAILURES = 50  # failure blocks rendered open; the rest start collapsed
SKIP_EXAMPLES = 5
NO_PLOT = frozenset({"skip", "error", "crash", "timeout"})  # verdicts without trustworthy metrics


# Formatting (jinja filters).

def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fmt_num(x: Any, digits: int = 3) -> str:
    """Compact number: '—' when missing, 'nan'/'inf' spelled out, ints exact, floats %.{digits}g."""
    if x is None:
        return "—"
    if not _is_num(x):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.{digits}g}"


def fmt_dur(s: Any) -> str:
    if not _is_num(s) or not math.isfinite(s):
        return "—"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def case_id_markup(case_id: Any) -> Markup:
    """A case id that wraps only after "/" or ",": each piece in a no-wrap span followed by <wbr>,
    so a line never breaks at the hyphen of `sdpa-cpu` or inside a parameter (copying the text
    still gives the id, unchanged)."""
    text = str(case_id)
    pieces = re.findall(r"[^/,]*[/,]|[^/,]+$", text)
    inner = Markup("<wbr>").join(Markup("<span>{}</span>").format(p) for p in pieces)
    return Markup('<span class="cid">{}</span>').format(inner)


NORM_ERR_HELP = ("norm_err: the case's worst error divided by its limit, over every output and tolerance layer "
                 "(elementwise, cos_diff, nmse, noise); at most 1 passes, 0.5 used half the allowance")


def sort_value(x: Any) -> str:
    """data-v attribute for the JS sorter: NaN and inf sort as the largest, missing as the smallest."""
    if not _is_num(x) or x == -math.inf:
        return "-1e999"
    return "1e999" if math.isnan(x) or x == math.inf else repr(float(x))


def _nonfinite(x: Any) -> bool:
    return _is_num(x) and not math.isfinite(x)


def _over(x: Any, limit: Any) -> bool:
    """A metric above its limit, or non-finite (highlighted in the metrics table)."""
    if _nonfinite(x):
        return True
    return _is_num(x) and _is_num(limit) and x > limit


# View model: every field the template reads exists, so missing optional fields render as '—'.

def _output_view(name: str, out: dict) -> dict:
    metrics = out.get("metrics") or {}
    return {
        "name": name,
        "dtype": out.get("dtype") or "—",
        "shape": "[" + ", ".join(str(s) for s in out["shape"]) + "]"
                 if isinstance(out.get("shape"), (list, tuple)) else "—",
        "exact": bool(out.get("exact")),
        "metrics": metrics,
        "limits": {k: v for k, v in (out.get("limits") or {}).items() if v is not None},
        "layers": [(k, (v or {}).get("ok"), (v or {}).get("detail") or "")
                   for k, v in (out.get("layers") or {}).items()],
        "worst": [{"index": "[" + ", ".join(str(i) for i in w.get("index", [])) + "]",
                   "got": w.get("got"), "expected": w.get("expected"),
                   "abs": w.get("abs"), "rel": w.get("rel"), "out": w.get("out")} for w in out.get("worst") or []],
        "noise": out.get("noise") or None,
    }


def _record_view(r: dict) -> dict:
    outputs = [_output_view(n, o) for n, o in (r.get("outputs") or {}).items()]
    numel = sum(o["metrics"].get("numel") or 0 for o in outputs if _is_num(o["metrics"].get("numel")))
    timing = r.get("timing") or {}
    return {
        "id": str(r.get("id") or "?"), "verdict": r.get("verdict") or "error",
        "op": records.cell_key(r)[0], "backend": records.cell_key(r)[1],
        "dtype": records.cell_key(r)[2],
        "kind": r.get("kind"), "tier": r.get("tier"), "reason": r.get("reason"), "message": r.get("message"),
        "repro": r.get("repro"), "norm_err": r.get("norm_err"),
        "layers": r.get("layers") or {}, "recheck": r.get("recheck"), "known": r.get("known") or {},
        "kernel_s": timing.get("kernel_s"), "total_s": timing.get("total_s"),
        "outputs": outputs, "numel": numel,
        # all-cases table: per metric, (sort key = worst over outputs, [(output, value), ...])
        "table": [(max((sort_value(o["metrics"].get(m)) for o in outputs), key=float, default="-1e999"),
                   [(o["name"], o["metrics"].get(m)) for o in outputs]) for m in TABLE_METRICS],
    }


def _severity(v: dict) -> tuple:
    """Worst verdict first, then the largest norm_err (NaN first), then id."""
    e = v["norm_err"]
    err = math.inf if _nonfinite(e) else (e if _is_num(e) else -math.inf)
    return (records.VERDICTS.index(v["verdict"]) if v["verdict"] in records.VERDICTS else 0,
            -err, v["id"])


def _grouped(views: list[dict], verdict: str) -> list[dict]:
    """Records of `verdict` grouped by reason (xfail: the known-failures entry's reason)."""
    groups: dict[str, list[str]] = {}
    for v in views:
        if v["verdict"] == verdict:
            reason = v["known"].get("reason") if verdict == "xfail" else None
            groups.setdefault(reason or v["reason"] or "no reason given", []).append(v["id"])
    return [{"reason": k, "count": len(ids), "examples": ids[:SKIP_EXAMPLES]}
            for k, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


# Error-vs-size plots: geometry computed here, drawn by the template (so it is autoescaped).

PLOT_W, PLOT_H = 300, 170
PLOT_Y_MIN = -6  # decades: norm_err below 1e-6 of the limit is drawn hollow on the bottom edge
_ML, _MR, _MT, _MB = 44, 10, 10, 28  # margins: left, right, top, bottom


def _decade_label(k: int) -> str:
    return str(10 ** k) if 0 <= k <= 3 else f"1e{k}"


def _ticks(lo: int, hi: int) -> list[int]:
    step = max(1, math.ceil((hi - lo) / 6))
    return list(range(lo, hi + 1, step))


def _plot(points: list[tuple[float, Any, str, str]]) -> dict:
    """points: (numel, norm_err, verdict, id). y = norm_err (log), x = numel (log)."""
    xs = [math.log10(p[0]) for p in points]
    ys = [math.log10(p[1]) for p in points if _is_num(p[1]) and math.isfinite(p[1]) and p[1] > 0]
    xlo, xhi = math.floor(min(xs)), math.ceil(max(xs))
    xhi = max(xhi, xlo + 1)
    ylo = max(min(math.floor(min(ys)) if ys else -3, -1), PLOT_Y_MIN)
    yhi = max(math.ceil(max(ys)) if ys else 1, 1)
    pw, ph = PLOT_W - _ML - _MR, PLOT_H - _MT - _MB

    def px(lx: float) -> float:
        return round(_ML + (lx - xlo) / (xhi - xlo) * pw, 1)

    def py(ly: float) -> float:
        return round(_MT + (yhi - min(max(ly, ylo), yhi)) / (yhi - ylo) * ph, 1)

    dots = []
    for (n, e, verdict, case_id), lx in zip(points, xs):
        if _nonfinite(e):
            shape, y = "top", _MT  # NaN/inf error: pinned to the top edge
        elif e <= 0:
            shape, y = "zero", _MT + ph  # exact match: pinned to the bottom edge
        else:
            shape, y = ("dot" if math.log10(e) >= ylo else "zero"), py(math.log10(e))
        dots.append({"x": px(lx), "y": y, "shape": shape, "verdict": verdict,
                     "title": f"{case_id}\nnorm_err={fmt_num(e)}  numel={n}"})
    return {
        "w": PLOT_W, "h": PLOT_H, "x0": _ML, "x1": _ML + pw, "y0": _MT, "y1": _MT + ph,
        "limit_y": py(0.0), "dots": dots,
        "xticks": [(px(k), _decade_label(k)) for k in _ticks(xlo, xhi)],
        "yticks": [(py(k), _decade_label(k)) for k in _ticks(ylo, yhi)],
    }


def _plots(views: list[dict], order: list[tuple[str, str, str]]) -> list[dict]:
    groups: dict[tuple[str, str, str], list] = {}
    for v in views:
        numeric = any(not o["exact"] for o in v["outputs"])
        if NO_PLOT & {v["verdict"], v["known"].get("verdict")} or not numeric or not _is_num(v["norm_err"]) or v["numel"] <= 0:
            continue
        groups.setdefault((v["op"], v["backend"], v["dtype"]), []).append(
            (v["numel"], v["norm_err"], v["verdict"], v["id"]))
    return [{"key": key, "n": len(groups[key]), "plot": _plot(groups[key])}
            for key in order if len(groups.get(key, ())) >= 3]


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=fmt_num, dur=fmt_dur, sortv=sort_value, cid=case_id_markup)
    env.tests.update(nonfinite=_nonfinite)
    env.globals.update(over=_over)
    return env


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
    views = sorted((_record_view(r) for r in results), key=_severity)
    ops, columns, cells = records.matrix(results, records.plan_of(doc))
    order = [(op, b, d) for op in ops for b, dts in columns for d in dts]
    left_out = header.get("left_out") if isinstance(header.get("left_out"), dict) else None
    counts = records.summary(results)
    return _env().get_template("report.html.j2").render(
        header=[(label, header.get(key)) for key, label in HEADER_FIELDS],
        title=f"kernel-parity · {header.get('suite') or 'results'} · {header.get('device') or '?'}",
        passed=records.doc_passed(doc), total=len(results), incomplete=records.status_line(doc),
        stale=records.stale_entries(doc),
        counts=[(v, counts[v]) for v in records.VERDICTS if counts.get(v)],
        ops=ops, columns=columns, cells=cells,
        failures=[v for v in views if v["verdict"] in records.FAILING],
        open_failures=OPEN_FAILURES, skips=_grouped(views, "skip"), known=_grouped(views, "xfail"),
        cases=views,
        table_metrics=TABLE_METRICS, metric_columns=METRIC_COLUMNS,
        plots=_plots(views, order), diff=diff, left_out=left_out, plot_w=PLOT_W, norm_err_help=NORM_ERR_HELP, verdicts=records.VERDICTS, mutants=_mutants_view(mutants),
        version=header.get("package_version") or "",
        diff_entries=list(diff.entries()) if diff is not None else [],
    )


def write(path: str | os.PathLike, doc: dict, diff: Any = None, mutants: dict | None = None) -> None:
    """Render `doc` and write it to `path` atomically."""
    records.atomic_write_text(path, render(doc, diff, mutants))


def render_diff_section(diff: Any) -> str:
    """The "Baseline diff" section alone, as an HTML fragment (for embedding elsewhere)."""
    return _env().get_template("report.html.j2").render(
        only_diff=True, diff=diff, diff_entries=list(diff.entries()))
