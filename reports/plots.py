"""Error-vs-size plots: norm_err (log) against total output numel (log), one small plot per op x backend
in a fixed grid (a row per op, a column per backend), dtypes as colours, failing cases as crosses.

The plots of one op share their axes, so a backend's errors read against its neighbours'. Marks that
land on the same 4 x 4 px square with the same dtype and shape are drawn once, their title counting them
(a 20,000-case run stays a few thousand marks). Geometry is computed here; the template draws it (so
every title is autoescaped).
"""

from __future__ import annotations

import math

from kernel_parity.reports import records, views

PLOT_W, PLOT_H = 250, 150
PLOT_Y_MIN = -6  # decades: norm_err below 1e-6 of the limit is drawn hollow on the bottom edge
MIN_POINTS = 3  # an op x backend with fewer numeric cases gets no plot
NO_PLOT = frozenset({"skip", "error", "crash", "timeout"})  # verdicts without trustworthy metrics
# dtype colours (Okabe-Ito, colour-blind safe), in the order dtypes first appear (records.dtype_key)
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#000000", "#999933",
           "#882255", "#44aa99")
_ML, _MR, _MT, _MB = 40, 8, 8, 26  # margins: left, right, top, bottom
BUCKET = 4  # px: marks of one dtype and shape within a 4 x 4 px square are drawn once (radius 3)


def _decade_label(k: int) -> str:
    return str(10 ** k) if 0 <= k <= 3 else f"1e{k}"


def _ticks(lo: int, hi: int) -> list[int]:
    step = max(1, math.ceil((hi - lo) / 5))
    return list(range(lo, hi + 1, step))


def _numel(r: dict) -> int:
    n = 0
    for o in (r.get("outputs") or {}).values():
        m = o.get("metrics") if isinstance(o, dict) else None
        if isinstance(m, dict) and views.is_num(m.get("numel")) and math.isfinite(m["numel"]):
            n += int(m["numel"])
    return n


def _plottable(r: dict) -> bool:
    known = r.get("known") if isinstance(r.get("known"), dict) else {}
    if NO_PLOT & {r.get("verdict"), known.get("verdict")} or not views.is_num(r.get("norm_err")):
        return False
    outs = [o for o in (r.get("outputs") or {}).values() if isinstance(o, dict)]
    return any(not o.get("exact") for o in outs)


def _axes(points: list[tuple]) -> tuple[int, int, int, int]:
    xs = [math.log10(p[0]) for p in points]
    ys = [math.log10(p[1]) for p in points if math.isfinite(p[1]) and p[1] > 0]
    xlo, xhi = math.floor(min(xs)), math.ceil(max(xs))
    ylo = max(min(math.floor(min(ys)) if ys else -3, -1), PLOT_Y_MIN)
    yhi = max(math.ceil(max(ys)) if ys else 1, 1)
    return xlo, max(xhi, xlo + 1), ylo, yhi


def _size(e: float) -> float:
    return math.inf if math.isnan(e) else e


def _plot(points: list[tuple], axes: tuple[int, int, int, int], colour: dict[str, int]) -> dict:
    """points: (numel, norm_err, dtype, verdict, id)."""
    xlo, xhi, ylo, yhi = axes
    pw, ph = PLOT_W - _ML - _MR, PLOT_H - _MT - _MB

    def px(lx: float) -> float:
        return round(_ML + (lx - xlo) / (xhi - xlo) * pw)

    def py(ly: float) -> float:
        return round(_MT + (yhi - min(max(ly, ylo), yhi)) / (yhi - ylo) * ph)

    marks: dict[tuple, dict] = {}
    for n, e, dtype, verdict, case_id in points:
        if views.nonfinite(e):
            shape, y = "top", _MT  # NaN/inf error: pinned to the top edge
        elif e <= 0 or math.log10(e) < ylo:
            shape, y = "zero", _MT + ph  # exact, or below the range: hollow on the bottom edge
        else:
            shape, y = ("cross" if verdict in records.FAILING else "dot"), py(math.log10(e))
        x = px(math.log10(n))
        x, y = x - x % BUCKET + BUCKET // 2, y - y % BUCKET + BUCKET // 2 if shape in ("dot", "cross") else y
        key = (x, y, colour[dtype], shape)
        m = marks.get(key)
        if m is None:
            marks[key] = {"x": key[0], "y": y, "c": key[2], "shape": shape, "n": 1, "dtype": dtype,
                          "worst": (e, case_id, n)}
        else:
            m["n"] += 1
            if _size(e) > _size(m["worst"][0]):
                m["worst"] = (e, case_id, n)
    dots = []
    for m in marks.values():  # failing crosses last, on top
        e, case_id, n = m["worst"]
        head = f"{m['n']} {m['dtype']} cases; worst: " if m["n"] > 1 else ""
        dots.append({**m, "title": f"{head}{case_id} norm_err={views.fmt_num(e)}"})
    dots.sort(key=lambda d: (d["shape"] == "cross", d["shape"] == "top"))
    return {
        "w": PLOT_W, "h": PLOT_H, "x0": _ML, "x1": _ML + pw, "y0": _MT, "y1": _MT + ph,
        "limit_y": py(0.0), "dots": dots,
        "xticks": [(px(k), _decade_label(k)) for k in _ticks(xlo, xhi)],
        "yticks": [(py(k), _decade_label(k)) for k in _ticks(ylo, yhi)],
    }


def plot_grid(results: list[dict]) -> dict:
    """{"backends": [...], "dtypes": [(dtype, colour)], "rows": [{"op", "cells": [plot or None per backend]}]}."""
    groups: dict[tuple[str, str], list[tuple]] = {}
    for r in results:
        if not _plottable(r):
            continue
        n = _numel(r)
        if n <= 0:
            continue
        op, backend, dtype = records.cell_key(r)
        groups.setdefault((op, backend), []).append((n, r["norm_err"], dtype, r.get("verdict"), str(r.get("id"))))
    groups = {k: v for k, v in groups.items() if len(v) >= MIN_POINTS}
    dtypes = sorted({p[2] for pts in groups.values() for p in pts}, key=records.dtype_key)
    colour = {d: i % len(PALETTE) for i, d in enumerate(dtypes)}
    backends = sorted({b for _, b in groups})
    rows = []
    for op in sorted({op for op, _ in groups}):
        pts = [p for b in backends for p in groups.get((op, b), [])]
        axes = _axes(pts)
        rows.append({"op": op, "cells": [
            {"n": len(groups[(op, b)]), "plot": _plot(groups[(op, b)], axes, colour), "backend": b}
            if (op, b) in groups else None for b in backends]})
    return {"backends": backends, "dtypes": [(d, PALETTE[colour[d]]) for d in dtypes], "rows": rows,
            "palette": PALETTE}
