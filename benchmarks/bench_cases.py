"""A benchmark as a thin caller of `parity bench`.

A benchmark script names its cases as suite entries (op, backends, dtypes, dists, a params grid) and
calls `run`: the entries are written as a suite file, `parity bench` judges and times every case
(ours and every peer backend on the same inputs, the copy / read / matmul ceilings measured in the
same run; conformance/bench.py), saying each record's line as it lands (a progress bar only on a
terminal), and its records become the benchmark's JSON: per case, each backend's verdict, norm_err,
ms, GB/s or TFLOP/s and share of the ceiling, and each peer's time over ours. A backend that is not
installed, or cannot express a case, is a skip with its reason, never a missing row. The figures
are therefore the same records `parity bench` and `parity gate --bench` write, and a benchmark's
accuracy check is the gate's own judgement; a script's hand-timed path (`--tune`, `--direct`) prints,
beside each time, the gate's verdict on the same case (`Gate`).

    from bench_cases import run
    sys.exit(run([{"op": "norm.rms_norm", "backends": [...], "dtypes": [...], "grid": {...}}],
                 out="norm_bench.json", ours="triton"))

Exit status: `parity bench`'s (0 every case passed or skipped, 1 a case failed, 2 bad input).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class OneLineParser(argparse.ArgumentParser):
    """A benchmark script's parser: a bad flag is one line and exit 2 (argparse prints its usage)."""

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, str, list)):
        raise TypeError(f"suite values are integers, strings or lists of them, not {v!r}")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else str(v)


def suite_text(entries: list[dict], description: str = "") -> str:
    """Suite entries as the TOML `parity bench --suite` reads (conformance/suites.py's keys)."""
    lines = [f"description = {_toml_value(description)}", ""] if description else []
    for e in entries:
        lines.append("[[cases]]")
        for k, v in e.items():
            if isinstance(v, dict):
                inner = ", ".join(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())
                lines.append(f"{k} = {{{inner}}}")
            elif k == "params":
                lines.append("params = [")
                lines += ["  {" + ", ".join(f"{kk} = {_toml_value(vv)}" for kk, vv in p.items()) + "}," for p in v]
                lines.append("]")
            else:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def summarise(doc: dict, ours: str) -> dict:
    """A results document of `parity bench` -> {header, ceilings, cases: [...]}, one entry per
    (op, dtype, params, dist, seed) with every backend's figures and each peer's ms / ours."""
    header = doc["header"]
    cases: dict[tuple, dict] = {}
    for r in doc["results"]:
        key = (r["op"], r["dtype"], json.dumps(r["params"], sort_keys=True), r["dist"], r["seed"])
        row = cases.setdefault(key, {"op": r["op"], "dtype": r["dtype"], "params": r["params"], "dist": r["dist"],
                                     "seed": r["seed"], "backends": {}})
        perf = r.get("perf") if isinstance(r.get("perf"), dict) else {}
        fig = {"verdict": r["verdict"], "norm_err": r.get("norm_err")}
        if r["verdict"] == "skip" or not perf.get("ms"):
            fig["reason"] = r.get("reason") or perf.get("error")
        else:
            fig.update({k: perf.get(k) for k in ("ms", "gbps", "tflops", "bound", "pct_of_ceiling")})
            row.setdefault("bound", perf.get("bound"))
        row["backends"][r["backend"]] = fig
    for row in cases.values():
        mine = row["backends"].get(ours, {}).get("ms")
        row[f"peer_ms_over_{ours}"] = {b: f["ms"] / mine for b, f in row["backends"].items()
                                       if b != ours and mine and f.get("ms")}
    keep = ("device", "gpu", "cpu", "torch", "triton", "git_commit", "git_tree", "time", "command")
    return {"header": {k: header.get(k) for k in keep}, "ceilings": header.get("ceilings"),
            "cases": list(cases.values())}


def _line(row: dict, ours: str) -> str:
    params = ",".join(f"{k}={v}" for k, v in row["params"].items())
    figs = []
    for b, f in row["backends"].items():
        if f.get("ms"):
            figs.append(f"{b} {f['ms']:.4f} ms {f['pct_of_ceiling']:5.1f}% of {f['bound']}"
                        + ("" if f["verdict"] in ("pass", "xfail") else f" [{f['verdict']}]"))
        else:
            figs.append(f"{b} {f['verdict']}")
    return f"{row['op']} {row['dtype']} {params}: " + " | ".join(figs)


def replaced(module: Any, name: str, value: Any) -> Any:
    """A context in which module.name is value (a launch-table entry, config or timed call swapped in
    while the gate judges the line that timed it): unittest.mock's patch.object, restored on exit."""
    from unittest import mock

    return mock.patch.object(module, name, value)


def run(entries: list[dict], *, out: str, ours: str = "triton", description: str = "",
        argv: tuple[str, ...] = ()) -> int:
    """Bench `entries` with `parity bench` (extra `argv` passed on, e.g. --no-recheck): its line per
    record as each lands (a progress bar on a terminal), then the summary written to `out` (JSON) and
    a line per case. Returns parity bench's exit status.

    The records stream into `partial_path(out)` beside `out` as they land, and that file is removed once
    the summary is written: a run killed part-way (a device call's time limit) leaves the records it
    finished there (a results document: `parity report` reads it)."""
    from kernel_parity.conformance.cli import main
    from kernel_parity.reports import records
    from kernel_parity.reports.files import write_text

    results = partial_path(out)
    results.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kp-bench-") as tmp:
        suite = Path(tmp) / "bench.toml"
        suite.write_text(suite_text(entries, description))
        code = main(["bench", "--suite", str(suite), "--json", str(results), *argv])
        if code == 2 or not results.exists():
            return 2
    summary = summarise(records.load(str(results)), ours)
    write_text(out, json.dumps(summary, indent=1, default=str))  # a missing folder is made, atomically
    results.unlink()
    for row in summary["cases"]:
        print(_line(row, ours), flush=True)
    return code


def partial_path(out: str) -> Path:
    """Where `run` streams the records of the summary `out` while it runs: `<out's stem>.partial.jsonl`."""
    p = Path(out)
    return p.with_name(f"{p.stem}.partial.jsonl")


class Gate:
    """The gate's judgement of one case, for a benchmark's hand-timed path (`--tune`, `--direct`): the
    case built from the same op, params and dtype (dist normal, seed 0: its inputs are the case's
    own, not the script's tensors) and evaluated by the Runner as `parity bench --no-recheck` would,
    so the figure printed beside a time is the gate's verdict and norm_err, never a bound of the
    script's own."""

    def __init__(self, backend: str = "triton") -> None:
        from kernel_parity.conformance.runner import Runner

        self.backend = backend
        self.runner = Runner(recheck=False)
        self.failures: list[str] = []  # "id: verdict (reason)" of each case the gate fails

    def __call__(self, op: str, dtype: str, params: dict) -> dict:
        """{"case": id, "verdict": ..., "norm_err": ...} of `op` on this backend; a shape the op's spec
        cannot express (a parameter out of its range) is {"case": None, "verdict": None, "reason": why}."""
        from kernel_parity.conformance import ops
        from kernel_parity.conformance.errors import UsageError

        try:
            case = ops.make_case(op, self.backend, dtype, params, "normal", 0)
        except UsageError as e:
            return {"case": None, "verdict": None, "norm_err": None, "reason": str(e)}
        rec = self.runner.evaluate(case)
        if rec.failing:
            self.failures.append(f"{rec.id}: {rec.verdict} ({rec.reason or rec.kind})")
        return {"case": rec.id, "verdict": rec.verdict, "norm_err": rec.norm_err}


def gate_text(g: dict) -> str:
    """`gate pass norm_err 0.12`; a verdict without a norm_err (a skip, an error) alone; `gate: no case (why)`."""
    if g["verdict"] is None:
        return f"gate: no case ({g['reason']})"
    return f"gate {g['verdict']}" + ("" if g["norm_err"] is None else f" norm_err {g['norm_err']:.3g}")
