"""Parameter-space coverage of a run, from its records: per op, every backend, dtype, distribution and
parameter value (masks, layouts, sizes: whatever the op's params are) that was exercised, with its
case count and verdicts. Integer size parameters also say which tile-boundary sizes they hit: 1,
2^k - 1, 2^k and 2^k + 1 (k >= 4), and primes (the STYLE's edges: 1, 113, 239, 2^k +- 1).

`parity coverage` (conformance/listing.py) answers the same question before a run, from the planned
cases and the backends' supports(); this answers it after, from what the records say ran and how.
"""

from __future__ import annotations

import json
from typing import Any

from kernel_parity.reports import records

EDGES = ("1", "2^k-1", "2^k", "2^k+1", "prime")
EDGE_K_MIN = 4  # 2^k +- 1 counts as a tile edge from 15 / 16 / 17 up (tiles are 16 wide and more)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def edge_of(v: Any) -> str | None:
    """The tile-boundary class of a size (one of EDGES), or None."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None
    if v == 1:
        return "1"
    lo = 1 << EDGE_K_MIN
    for name, n in (("2^k-1", v + 1), ("2^k", v), ("2^k+1", v - 1)):
        if n >= lo and n & (n - 1) == 0:
            return name
    return "prime" if v > 10 and _is_prime(v) else None


def _label(v: Any) -> str:
    if isinstance(v, str):
        return v
    if type(v) is int:  # the common case, 200,000 times in a 20,000-case run: json.dumps is 10x slower
        return str(v)
    return json.dumps(v, separators=(",", ":"))


def _order(name: str, v: Any) -> tuple:
    if name == "dtype":
        return (0, records.dtype_key(str(v)), "")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, (float(v), ""), "")
    return (1, (0.0, ""), _label(v))


def _value_view(name: str, v: Any, counts: dict[str, int]) -> dict:
    ran = [x for x in counts if x != "skip"]
    worst = records.worst_verdict(ran or ["skip"])
    total = sum(counts.values())
    failing = sum(n for x, n in counts.items() if x in records.FAILING)
    parts = ", ".join(f"{counts[x]} {x}" for x in records.VERDICTS if x in counts)
    return {"label": _label(v), "count": total, "worst": worst, "failing": failing,
            "edge": edge_of(v) if name not in ("dtype", "dist", "backend") else None,
            "title": f"{name}={_label(v)}: {total} cases: {parts}"}


def coverage(results: list[dict]) -> list[dict]:
    """Per op (sorted): {"op", "cases", "counts": [(verdict, n)], "failing_values", "params": [{"name",
    "vals": [{"label", "count", "worst", "failing", "edge", "title"}], "edges": [(edge, hit)] or None}]}."""
    per_op: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    keys: dict[str, dict[str, dict[str, Any]]] = {}  # op -> param -> label -> value (for ordering)
    totals: dict[str, dict[str, int]] = {}
    for r in results:
        op, backend, dtype = records.cell_key(r)
        verdict = str(r.get("verdict"))
        t = totals.setdefault(op, {})
        t[verdict] = t.get(verdict, 0) + 1
        params = r.get("params") if isinstance(r.get("params"), dict) else {}
        table = per_op.setdefault(op, {})
        seen = keys.setdefault(op, {})
        for name, v in (("backend", backend), ("dtype", dtype), ("dist", r.get("dist") or "?"), *params.items()):
            label = _label(v)
            cell = table.setdefault(name, {}).setdefault(label, {})
            cell[verdict] = cell.get(verdict, 0) + 1
            seen.setdefault(name, {}).setdefault(label, v)
    out = []
    for op in sorted(per_op):
        params = []
        for name, vals in per_op[op].items():
            order = sorted(vals, key=lambda lb: _order(name, keys[op][name][lb]))
            values = [_value_view(name, keys[op][name][lb], vals[lb]) for lb in order]
            sizes = [keys[op][name][lb] for lb in order]
            size_like = all(isinstance(v, int) and not isinstance(v, bool) for v in sizes) and max(sizes) >= 16
            hit = {v["edge"] for v in values}
            params.append({"name": name, "vals": values,
                           "edges": [(e, e in hit) for e in EDGES] if size_like and name not in ("dtype", "dist", "backend") else None})
        counts = totals[op]
        out.append({"op": op, "cases": sum(counts.values()),
                    "counts": [(v, counts[v]) for v in records.VERDICTS if v in counts],
                    "failing_values": sum(1 for p in params for v in p["vals"] if v["failing"]),
                    "params": params})
    return out
