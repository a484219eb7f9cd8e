"""What the HTML report shows of the records, computed once in Python (the template only lays it out).

- `record_view`: everything the full failure detail shows of one record (metrics table, limits,
  layers, worst elements marked OUT / within, message, repro, the `shrunk` note).
- `failure_groups`: failing records grouped by (op, backend, diagnosis, layer), worst group first;
  each group carries one example (its worst record, shown in full) and the others as compact
  entries (id, verdict, norm_err, reason), each pointing at its row of the all-cases table data,
  where the page's script finds its details on demand.
- `by_reason`: skips (or known failures) grouped by reason.

Views read records only (`reports.records`); missing optional fields become None, never a KeyError.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from kernel_parity.reports import records

OTHERS_LISTED = 100  # compact entries per failure group; the all-cases table holds every one
REASON_EXAMPLES = 5  # example ids per skip / known-failure reason


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def nonfinite(x: Any) -> bool:
    return is_num(x) and not math.isfinite(x)


def fmt_num(x: Any, digits: int = 3) -> str:
    """Compact number: '—' when missing, 'nan'/'inf' spelled out, ints exact, floats %.{digits}g."""
    if x is None:
        return "—"
    if not is_num(x):
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
    if not is_num(s) or not math.isfinite(s):
        return "—"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def output_view(name: str, out: dict) -> dict:
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
                   "abs": w.get("abs"), "rel": w.get("rel"), "out": w.get("out"),
                   # the error model's bound for the element and the magnitude behind it (OpSpec.magnitude)
                   "bound": w.get("bound"), "magnitude": w.get("magnitude")} for w in out.get("worst") or []],
        "noise": out.get("noise") or None,
    }


def record_view(r: dict, device: str | None = None) -> dict:
    """The full detail of one record (a failure group's example)."""
    op, backend, dtype = records.cell_key(r)
    outputs = [output_view(n, o) for n, o in (r.get("outputs") or {}).items() if isinstance(o, dict)]
    return {
        "id": str(r.get("id") or "?"), "verdict": r.get("verdict") or "error", "device": device,
        "op": op, "backend": backend, "dtype": dtype,
        "kind": r.get("kind"), "tier": r.get("tier"), "reason": r.get("reason"), "message": r.get("message"),
        "repro": r.get("repro"), "norm_err": r.get("norm_err"),
        "shrunk": r.get("shrunk") if isinstance(r.get("shrunk"), dict) else None,
        "recheck": r.get("recheck"), "diagnosis": diagnosis_of(r),
        "outputs": outputs,
        # the worst-elements table: outputs with elements outside the tolerance first
        "worst_outputs": sorted((o for o in outputs if o["worst"]), key=lambda o: not any(w["out"] for w in o["worst"])),
    }


def severity(r: dict) -> tuple:
    """Sort key, worst first: verdict (VERDICTS order), then the largest norm_err (NaN first), then id."""
    e = r.get("norm_err")
    err = math.inf if nonfinite(e) else (e if is_num(e) else -math.inf)
    v = r.get("verdict")
    return (records.VERDICTS.index(v) if v in records.VERDICTS else 0, -err, str(r.get("id") or ""))


def layer_of(r: dict) -> str:
    """The layer a failing record failed in: its kind for `fail` (structural, exact, numeric, noise),
    else the verdict itself (error, crash, timeout, flaky, xpass)."""
    return str(r.get("kind") or r.get("verdict") or "error")


def diagnosis_of(r: dict) -> str | None:
    """What the diagnoses named ("matches the other causal alignment: alignment bug"), or, for a fused
    op, the first stage that diverges; None when neither is known."""
    diag = r.get("diagnosis")
    if isinstance(diag, list) and diag:
        return "; ".join(str(d) for d in diag)
    if r.get("first_divergence"):
        return f"first diverging stage: {r['first_divergence']}"
    return None


def failure_groups(failing: list[tuple[dict, str | None]], row_of: Callable[[dict], int]) -> list[dict]:
    """Group failing records, given as (record, device label or None), by (device, op, backend,
    diagnosis, layer). Groups are ordered by their worst record; in each, records worst first: the
    first is the example, the rest compact entries with `row` (their row in the table data)."""
    groups: dict[tuple, list[tuple[dict, str | None]]] = {}
    for r, device in failing:
        op, backend, _ = records.cell_key(r)
        key = (device or "", op, backend, diagnosis_of(r) or "", layer_of(r))
        groups.setdefault(key, []).append((r, device))
    out = []
    for (device, op, backend, diagnosis, layer), members in groups.items():
        members.sort(key=lambda m: severity(m[0]))
        counts: dict[str, int] = {}
        dtypes: dict[str, int] = {}
        for r, _ in members:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
            dtypes[str(r.get("dtype") or "?")] = dtypes.get(str(r.get("dtype") or "?"), 0) + 1
        example, ex_device = members[0]
        others = [{"id": str(r.get("id") or "?"), "verdict": r["verdict"], "norm_err": r.get("norm_err"),
                   "reason": r.get("reason"), "dtype": r.get("dtype"), "row": row_of(r), "device": d}
                  for r, d in members[1:1 + OTHERS_LISTED]]
        out.append({
            "device": device or None, "op": op, "backend": backend, "layer": layer, "diagnosis": diagnosis or None,
            "count": len(members), "counts": [(v, counts[v]) for v in records.VERDICTS if v in counts],
            "dtypes": sorted(dtypes.items(), key=lambda kv: records.dtype_key(kv[0])),
            "example": record_view(example, ex_device), "example_row": row_of(example),
            "others": others, "more": max(0, len(members) - 1 - OTHERS_LISTED), "_key": severity(example),
        })
    out.sort(key=lambda g: (g["_key"], -g["count"]))
    return out


def by_reason(results: list[dict], verdict: str) -> list[dict]:
    """Records of `verdict` grouped by reason (xfail: the known-failures entry's reason), largest first."""
    groups: dict[str, list[str]] = {}
    for r in results:
        if r.get("verdict") == verdict:
            known = r.get("known") if isinstance(r.get("known"), dict) else {}
            reason = known.get("reason") if verdict == "xfail" else None
            groups.setdefault(str(reason or r.get("reason") or "no reason given"), []).append(str(r.get("id") or "?"))
    return [{"reason": k, "count": len(ids), "examples": ids[:REASON_EXAMPLES]}
            for k, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
