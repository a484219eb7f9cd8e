"""The all-cases table's data: every case as one compact row of a JSON document embedded in the page
(`<script type="application/json" id="kp-data">`), which the page's script renders on demand: only
the rows in view are in the DOM, so filtering and sorting 20,000 cases stays interactive, and a
clicked row's details (per output metrics and limits, layers, message, repro) are built when asked.

Document: {"kind": "run" | "devices", "s": [strings], "verdicts": [...], "cols": [{"name", "type",
"help"}], "rows": [...], "devices": [labels], "detail_limit", "omitted"}. Repeated text (id pieces,
reasons, output names, dtypes, shapes, limits) is interned in "s" and referenced by index (-1:
none); a case id is its "/"-separated pieces. Numbers carry 3 significant digits (what the page
shows), non-finite ones are the strings "nan", "inf", "-inf", missing ones null.

    run row:     [id pieces, verdict, norm_err, max_abs, cos_diff, max_ulp, kernel_s, case]
    devices row: [id pieces, (verdict, norm_err) per device ..., ratio, [case or 0 per device]]
    case:        [kind, tier, reason, layers, [output, ...], extra or 0]
    output:      [name, dtype, shape, numel, max_abs, max_rel, rmse, nmse, cos_diff, max_ulp,
                  mismatch, limits, exact]
    extra:       {"m": message, "r": repro (when not `parity repro <id>`), "s": [shrunk id, verdict,
                  kind, reason, repro], "d": diagnosis, "k": known-failure reason, "c": recheck}

A failing case carries its extra (message, shrunk note, ...) among the first DETAIL_LIMIT failing
cases, worst first; the rest say that their details are in the results file (`omitted`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from kernel_parity.reports import records, views

TABLE_METRICS = ("max_abs", "cos_diff", "max_ulp")  # worst over outputs, in the run table
OUTPUT_METRICS = ("numel", "max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp", "mismatch")
DETAIL_LIMIT = 2000  # failing cases whose message and notes ride in the page


class Strings:
    """An intern table: `self(s)` is the index of `s` (-1 for None)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.limits: dict[tuple, str | None] = {}

    def __call__(self, s: Any) -> int:
        if s is None:
            return -1
        s = str(s)
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.index)
        return i

    def json(self) -> str:
        return _str_list(self.index)


def _str_list(items: Any) -> str:
    return "[" + ",".join(json.dumps(s, ensure_ascii=False) for s in items) + "]"


def num(x: Any) -> str:
    """A JSON token for a number as the page shows it (views.fmt_num): an integer, a number at 3
    significant digits ("1.23e-5", which the script prints as Python does: "1.23e-05"), or, where
    the digits alone would print differently (9.72e+04, 1.5e+06), the shown text as a string; "nan",
    "inf", "-inf" as strings, null when missing."""
    t = type(x)  # exact types first: 300,000 calls on a 20,000-case page
    if t is float:
        if x != x:
            return '"nan"'
        if x == math.inf or x == -math.inf:
            return '"inf"' if x > 0 else '"-inf"'
        if -1e6 < x < 1e6 and x == int(x):
            return str(int(x))
        s = f"{x:.3g}"
        if "e" not in s:
            return s
        if "e+" in s:
            return f'"{s}"'
        mant, exp = s.split("e")
        return f"{mant}e{int(exp)}"
    if t is int:
        return str(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "null"
    return num(float(x)) if isinstance(x, float) else str(int(x))  # subclasses (numpy scalars)


def _worst(outputs: list[dict], metric: str) -> Any:
    """The worst value of `metric` over outputs: NaN / inf first, then the largest."""
    best: Any = None
    for o in outputs:
        x = (o.get("metrics") or {}).get(metric)
        if not views.is_num(x):
            continue
        if views.nonfinite(x):
            return x
        if best is None or x > best:
            best = x
    return best


def _ids(case_id: str, strings: Strings) -> str:
    return "[" + ",".join(str(strings(p)) for p in case_id.split("/")) + "]"


def _limits_text(limits: Any, seen: dict) -> str | None:
    """"atol=1e-05 cos_diff=1e-06 ..." (limits repeat across a run's cases: each formatted once)."""
    if not isinstance(limits, dict):
        return None
    key = tuple(limits.items())
    if key not in seen:
        seen[key] = " ".join(f"{k}={views.fmt_num(v)}" for k, v in sorted(limits.items()) if v is not None) or None
    return seen[key]


def _extra(r: dict) -> str:
    out: dict[str, Any] = {}
    if r.get("message"):
        out["m"] = r["message"]
    repro = r.get("repro")
    if repro and repro != f"parity repro {r.get('id')}":
        out["r"] = repro
    shrunk = r.get("shrunk")
    if isinstance(shrunk, dict):
        out["s"] = [shrunk.get(k) for k in ("id", "verdict", "kind", "reason", "repro")]
    diag = views.diagnosis_of(r)
    if diag:
        out["d"] = diag
    known = r.get("known")
    if isinstance(known, dict) and known.get("reason"):
        out["k"] = known["reason"]
    recheck = r.get("recheck")
    if isinstance(recheck, dict):
        out["c"] = f"seeds {recheck.get('seeds')} -> {recheck.get('verdicts')}"
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")) if out else "0"


def case_payload(r: dict, strings: Strings, detailed: bool) -> str:
    outs = []
    for name, o in (r.get("outputs") or {}).items():
        if not isinstance(o, dict):
            continue
        m = o.get("metrics") or {}
        shape = "[" + ", ".join(str(s) for s in o["shape"]) + "]" if isinstance(o.get("shape"), list) else None
        outs.append("[" + ",".join([str(strings(name)), str(strings(o.get("dtype"))), str(strings(shape)),
                                    *(num(m.get(k)) for k in OUTPUT_METRICS),
                                    str(strings(_limits_text(o.get("limits"), strings.limits))), "1" if o.get("exact") else "0"]) + "]")
    layers = r.get("layers")
    layers_text = " ".join(f"{k}:{v}" for k, v in layers.items()) if isinstance(layers, dict) and layers else None
    return "[" + ",".join([str(strings(r.get("kind"))), str(strings(r.get("tier"))), str(strings(r.get("reason"))),
                           str(strings(layers_text)), "[" + ",".join(outs) + "]",
                           _extra(r) if detailed else "0"]) + "]"


def _document(kind: str, strings: Strings, cols: list[dict], rows: list[str], devices: list[str],
              omitted: int) -> str:
    text = ('{"kind":' + json.dumps(kind) + ',"verdicts":' + _str_list(records.VERDICTS)
            + ',"cols":' + json.dumps(cols, ensure_ascii=False) + ',"devices":' + _str_list(devices)
            + f',"detail_limit":{DETAIL_LIMIT},"omitted":{omitted},"rows":[' + ",\n".join(rows) + "]"
            + ',"s":' + strings.json() + "}")
    # inside <script>: no "</script>" or "<!--" can appear once every "<" is escaped (JSON allows it)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _detailed(ordered: list[dict]) -> set[int]:
    """Positions (in `ordered`, worst first) of the failing records whose extra rides in the page."""
    picked = [i for i, r in enumerate(ordered) if r.get("verdict") in records.FAILING][:DETAIL_LIMIT]
    return set(picked)


def run_table(ordered: list[dict]) -> tuple[str, int]:
    """(JSON text, details omitted) of one run's records, given worst first (the table's first order)."""
    strings = Strings()
    detailed = _detailed(ordered)
    rows = []
    for i, r in enumerate(ordered):
        outs = [o for o in (r.get("outputs") or {}).values() if isinstance(o, dict)]
        timing = r.get("timing") if isinstance(r.get("timing"), dict) else {}
        rows.append("[" + ",".join([_ids(str(r.get("id") or "?"), strings),
                                    str(records.VERDICTS.index(r["verdict"]) if r.get("verdict") in records.VERDICTS else 1),
                                    num(r.get("norm_err")), *(num(_worst(outs, m)) for m in TABLE_METRICS),
                                    num(timing.get("kernel_s")), case_payload(r, strings, i in detailed)]) + "]")
    omitted = sum(1 for r in ordered if r.get("verdict") in records.FAILING) - len(detailed)
    cols = [{"name": "id", "type": "id"}, {"name": "verdict", "type": "verdict"},
            {"name": "norm_err", "type": "num", "help": "worst error / its limit (<= 1 passes)"},
            *({"name": m, "type": "num", "help": f"worst {m} over the outputs"} for m in TABLE_METRICS),
            {"name": "kernel", "type": "dur"}]
    return _document("run", strings, cols, rows, [], omitted), omitted


def devices_table(devices: list[str], cases: list[dict]) -> tuple[str, int]:
    """(JSON text, details omitted) of a device comparison: `cases` as from `devices.compare`
    ({"id", "records": [record or None per device], "ratio"}), in the table's first order."""
    strings = Strings()
    failing_rank = sorted(((views.severity(r), ci, di) for ci, c in enumerate(cases)
                           for di, r in enumerate(c["records"]) if r is not None and r.get("verdict") in records.FAILING))
    detailed = {(ci, di) for _, ci, di in failing_rank[:DETAIL_LIMIT]}
    rows = []
    for ci, c in enumerate(cases):
        cells, payloads = [], []
        for di, r in enumerate(c["records"]):
            if r is None:
                cells += ["-1", "null"]
                payloads.append("0")
                continue
            cells += [str(records.VERDICTS.index(r["verdict"]) if r.get("verdict") in records.VERDICTS else 1),
                      num(r.get("norm_err"))]
            payloads.append(case_payload(r, strings, (ci, di) in detailed))
        rows.append("[" + ",".join([_ids(c["id"], strings), *cells, num(c["ratio"]),
                                    "[" + ",".join(payloads) + "]"]) + "]")
    cols = [{"name": "id", "type": "id"}]
    for d in devices:
        cols += [{"name": d, "type": "verdict", "help": f"verdict on {d}"},
                 {"name": "norm_err", "type": "num", "help": f"norm_err on {d}"}]
    cols.append({"name": "ratio", "type": "ratio",
                 "help": "largest / smallest norm_err over the devices (each at least 0.01)"})
    return _document("devices", strings, cols, rows, devices, max(0, len(failing_rank) - DETAIL_LIMIT)), \
        max(0, len(failing_rank) - DETAIL_LIMIT)
