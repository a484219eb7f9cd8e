"""Runs of one suite on several devices, side by side (`parity report cpu.jsonl h100.jsonl h200.jsonl
--html m.html`): a column per device, each named by its results file's header, and per case the
norm_err on each device with the ratio of the largest to the smallest.

Cases match by id (a case id names op, backend, dtype, params, dist and seed, never the device).
norm_err values below RATIO_FLOOR (1% of the limit, the baseline diff's floor for norm_err) count as
RATIO_FLOOR, so two exact results, or 1e-9 against 1e-7, are not a "100x" difference; a ratio of
RATIO_FLAG or more (the baseline diff's growth factor) is flagged, and so is a verdict that differs.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from kernel_parity.reports import diff, records, views

RATIO_FLOOR = diff.FLOORS["norm_err"]
RATIO_FLAG = 4.0


def device_label(header: dict) -> str:
    """A short name for the device a run used: "H100 80GB HBM3", "H200", "CPU Intel Xeon Processor (2 cores)"."""
    name = str(header.get("device") or header.get("gpu") or header.get("cpu") or "?")
    name = re.sub(r"\((R|TM)\)", "", name).replace("NVIDIA ", "")
    name = " ".join(name.split())
    if not header.get("gpu") and header.get("cpu") and not name.lower().startswith("cpu"):
        name = f"CPU {name}"
    return name


def labels(runs: list[tuple[str, dict]]) -> list[str]:
    """Device labels of (path, document) pairs; runs on the same device also get their file name."""
    base = [device_label(doc.get("header") or {}) for _, doc in runs]
    return [f"{b} ({os.path.basename(path)})" if base.count(b) > 1 else b for b, (path, _) in zip(base, runs)]


def ratio(recs: list[dict | None]) -> float | None:
    """Largest / smallest norm_err over the records that have one (each at least RATIO_FLOOR); inf when
    one is NaN or inf and another is finite; None with fewer than two."""
    errs = [r.get("norm_err") for r in recs if r is not None and views.is_num(r.get("norm_err"))]
    if len(errs) < 2:
        return None
    bad = [e for e in errs if not math.isfinite(e)]
    if bad:
        return math.inf if len(bad) < len(errs) else None
    lo, hi = max(min(errs), RATIO_FLOOR), max(max(errs), RATIO_FLOOR)
    return hi / lo


def disagree(recs: list[dict | None]) -> bool:
    return len({r.get("verdict") for r in recs if r is not None}) > 1


def _ratio_key(x: float | None) -> float:
    return -1.0 if x is None else x


def compare(docs: list[dict]) -> list[dict]:
    """Every case id of any run: {"id", "records": [record or None per run], "ratio", "disagree",
    "flag"}; verdict disagreements first, then the largest ratio, then the worst record."""
    by_id: dict[str, list[dict | None]] = {}
    for i, doc in enumerate(docs):
        for r in doc.get("results") or []:
            slot = by_id.setdefault(str(r.get("id")), [None] * len(docs))
            slot[i] = r
    cases = []
    for case_id, recs in by_id.items():
        q = ratio(recs)
        dis = disagree(recs)
        cases.append({"id": case_id, "records": recs, "ratio": q, "disagree": dis,
                      "flag": dis or (q is not None and q >= RATIO_FLAG),
                      "_worst": min(views.severity(r) for r in recs if r is not None)})
    cases.sort(key=lambda c: (not c["disagree"], -_ratio_key(c["ratio"]), c["_worst"]))
    return cases


def matrix(docs: list[dict], cases: list[dict]) -> list[dict]:
    """Rows (op, backend, dtype), each with a records.Cell per run (or None) and its largest ratio:
    [{"op", "backend", "dtype", "cells", "ratio", "ratio_id", "disagree"}] sorted by op, backend, dtype."""
    cells = [records.matrix(doc.get("results") or [], records.plan_of(doc))[2] for doc in docs]
    worst: dict[tuple, tuple[float | None, str | None, int]] = {}
    for c in cases:
        first = next(r for r in c["records"] if r is not None)
        key = records.cell_key(first)
        q, qid, dis = worst.get(key, (None, None, 0))
        if c["ratio"] is not None and (q is None or c["ratio"] > q):
            q, qid = c["ratio"], c["id"]
        worst[key] = (q, qid, dis + int(c["disagree"]))
    keys = sorted({k for cs in cells for k in cs}, key=lambda k: (k[0], k[1], records.dtype_key(k[2])))
    return [{"op": k[0], "backend": k[1], "dtype": k[2], "cells": [cs.get(k) for cs in cells],
             "ratio": worst.get(k, (None,))[0], "ratio_id": worst.get(k, (None, None))[1],
             "disagree": worst.get(k, (None, None, 0))[2]} for k in keys]


def runs_view(runs: list[tuple[str, dict]], names: list[str]) -> list[dict]:
    """One line per run: label, file, header facts, verdict counts, its own gate verdict."""
    out = []
    for (path, doc), label in zip(runs, names):
        header = doc.get("header") or {}
        counts = records.summary(doc.get("results") or [])
        out.append({"label": label, "path": path, "device": header.get("device"), "commit": header.get("git_commit"),
                    "time": header.get("time"), "suite": header.get("suite"), "torch": header.get("torch"),
                    "triton": header.get("triton"), "driver": header.get("driver"),
                    "total": len(doc.get("results") or []), "passed": records.doc_passed(doc),
                    "incomplete": records.status_line(doc), "stale": records.stale_entries(doc),
                    "counts": [(v, counts[v]) for v in records.VERDICTS if counts.get(v)]})
    return out


def summary(cases: list[dict]) -> dict[str, Any]:
    shared = [c for c in cases if sum(r is not None for r in c["records"]) > 1]
    return {"cases": len(cases), "shared": len(shared), "disagree": sum(c["disagree"] for c in cases),
            "flagged": sum(1 for c in cases if c["ratio"] is not None and c["ratio"] >= RATIO_FLAG),
            "ratio_flag": RATIO_FLAG, "ratio_floor": RATIO_FLOOR}
