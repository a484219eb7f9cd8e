"""Where a gate run's time goes, per op: inputs, goldens, kernels, judging, from its own records.

    python benchmarks/gate_timing.py RESULTS [RESULTS ...] [--json PATH]

Each record's `timing` holds its group's `inputs_s` and `golden_s` (drawn and computed once per input
group, shared by the group's backends), its own `kernel_s` and `total_s` (kernel, judging, and the
baseline's run when the noise layer needed it). Per op this sums inputs and goldens once per group,
kernels and judging (total - kernel) per record, and the records judged on a sample of rows
(conformance/sampling.py); then the whole run's worker time against its wall time (header and
completion record) and workers, i.e. how busy the workers were. Several files (e.g. a run before and
after a change) print one table each, then the ratio of their totals.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLUMNS = ("records", "groups", "sampled", "inputs_s", "golden_s", "kernel_s", "judge_s")


def where(doc: dict) -> dict:
    """{op: {column: value}}, "total" included, from a loaded results document."""
    per: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    seen: set[tuple] = set()
    for r in doc["results"]:
        t = r.get("timing") or {}
        row = per[r["op"]]
        row["records"] += 1
        if r.get("sample"):
            row["sampled"] += 1
        if "total_s" not in t:  # a skip or a dead worker: no time measured
            continue
        op, _, dtype, params, dist, seed = r["id"].split("/")
        key = (op, dtype, params, dist, seed)
        if key not in seen:
            seen.add(key)
            row["groups"] += 1
            row["inputs_s"] += float(t.get("inputs_s", 0.0))
            row["golden_s"] += float(t.get("golden_s", 0.0))
        row["kernel_s"] += float(t.get("kernel_s", 0.0))
        row["judge_s"] += float(t["total_s"]) - float(t.get("kernel_s", 0.0))
    total = dict.fromkeys(COLUMNS, 0)
    for row in per.values():
        for k in COLUMNS:
            total[k] += row[k]
    out = dict(sorted(per.items(), key=lambda kv: -_sum(kv[1])))
    out["total"] = total
    return out


def _sum(row: dict) -> float:
    return row["inputs_s"] + row["golden_s"] + row["kernel_s"] + row["judge_s"]


def table(name: str, doc: dict, rows: dict) -> str:
    header = doc.get("header") or {}
    complete = doc.get("complete") or {}
    ex = header.get("executor") or {}
    lines = [f"{name}: {header.get('device', '?')}, commit {str(header.get('git_commit', '?'))[:7]}, "
             f"{ex.get('workers', ex.get('jobs', '?'))} workers, wall {complete.get('elapsed_s', float('nan')):.0f} s"]
    lines.append(f"{'op':40s} {'recs':>5s} {'grps':>5s} {'smpl':>5s} {'inputs':>8s} {'golden':>8s} {'kernel':>8s} "
                  f"{'judge':>8s} {'sum':>8s}")
    for op, r in rows.items():
        lines.append(f"{op:40s} {r['records']:5d} {r['groups']:5d} {r['sampled']:5d} {r['inputs_s']:8.1f} "
                     f"{r['golden_s']:8.1f} {r['kernel_s']:8.1f} {r['judge_s']:8.1f} {_sum(r):8.1f}")
    workers = ex.get("workers") or ex.get("jobs")
    wall = complete.get("elapsed_s")
    if isinstance(workers, int) and wall:
        busy = _sum(rows["total"]) / (workers * wall)
        lines.append(f"worker time {_sum(rows['total']):.0f} s of {workers} x {wall:.0f} s: {100 * busy:.0f}% busy")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results files (.jsonl or .jsonl.gz)")
    p.add_argument("--json", default=None, help="also write the tables as JSON")
    args = p.parse_args(argv)
    from kernel_parity.reports import records
    from kernel_parity.reports.files import check_output_or_exit

    if args.json:
        check_output_or_exit(p.prog, "--json", args.json)
    out = {}
    for path in args.results:
        try:
            doc = records.load(path)
        except records.RecordsError as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            return 2
        out[path] = where(doc)
        print(table(path, doc, out[path]), flush=True)
    if len(out) > 1:
        sums = [_sum(v["total"]) for v in out.values()]
        print("totals: " + ", ".join(f"{s:.0f} s" for s in sums) +
              "".join(f"; first / #{i + 1}: {sums[0] / s:.2f}x" for i, s in enumerate(sums[1:], 1) if s))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
