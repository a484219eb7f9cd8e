"""`parity bench` speaks as it goes: one line per record on stdout as the record lands (the case, the
gate's verdict and norm_err, ms, throughput, share of the ceiling; each peer's ms over ours once the
input group is complete), none with -q, the --json records unchanged; benchmarks/bench_cases.run
streams the same lines before its table; the hand-timed paths judge through the gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance import bench, commands
from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parents[1]
SEL = ["--suite", "smoke", "--op", "softmax.softmax", "--dtype", "fp32", "--backend", "cpu,torch", "--no-progress"]


def _spy(monkeypatch, results: Path) -> list[tuple[str, list[dict], bool]]:
    """Every line `parity bench` says, with the records and whether the completion were in --json then."""
    said = []

    def say(line: str) -> None:
        rows = [json.loads(x) for x in results.read_text().splitlines()[1:]]
        said.append((line, [r for r in rows if "id" in r], any("complete" in r for r in rows)))

    monkeypatch.setattr(commands, "say", say)
    return said


def _shape(x):
    """The keys of a record, nested (the values are measurements and differ run to run)."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    return type(x).__name__ if not isinstance(x, list) else [_shape(v) for v in x[:1]]


def test_bench_says_each_record_as_it_lands(tmp_path, monkeypatch, capsys):
    out = tmp_path / "b.jsonl"
    said = _spy(monkeypatch, out)
    assert main(["bench", *SEL, "--json", str(out)]) == 0
    doc = records.load(out)
    assert len(said) == len(doc["results"]) == 4
    for k, (line, landed, complete) in enumerate(said, 1):  # said as record k landed, before the completion
        rec = landed[-1]
        assert len(landed) == k and not complete, line
        assert line.startswith(f"[{k}/4] {rec['op']}/{rec['backend']}/{rec['dtype']} rows=3,n=113 {rec['dist']}: "
                               f"{rec['verdict']} norm_err "), line
        assert f"{rec['perf']['ms']:.4g} ms" in line and "GB/s" in line and "% of copy" in line, line
    by_id = {r["id"]: r for r in doc["results"]}
    for line, landed, _ in said[1::2]:  # the second record of each input group completes it: the ratio
        cpu = by_id[next(r["id"] for r in landed[-2:] if r["backend"] == "cpu")]
        assert line.endswith(f"| peers' ms / cpu's: torch {cpu['perf']['peers']['torch']['ratio']:.3g}x"), line
    assert not any("peers'" in line for line, _, _ in said[0::2])


def test_the_lines_leave_the_records_as_they_were(tmp_path, capsys):
    """-q says no line per record; the records of a run that says them have the same fields. Bad flags
    stay exit 2 with one line."""
    quiet, loud = tmp_path / "q.jsonl", tmp_path / "l.jsonl"
    assert main(["bench", *SEL, "--no-isolate", "-q", "--json", str(quiet)]) == 0
    assert "[1/4]" not in capsys.readouterr().out
    assert main(["bench", *SEL, "--no-isolate", "--json", str(loud)]) == 0
    assert "[4/4]" in capsys.readouterr().out
    a, b = records.load(quiet)["results"], records.load(loud)["results"]
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [_shape(r) for r in a] == [_shape(r) for r in b]
    assert main(["bench", *SEL, "--jobs", "0"]) == 2
    err = capsys.readouterr()
    assert len(err.err.strip().splitlines()) == 1 and not err.out, err


def test_the_cli_flushes_a_line_per_record_on_stdout(tmp_path):
    """As a user runs it (stdout a pipe, so no progress bar): one line per record, each naming its
    verdict, then the summary."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    cmd = [sys.executable, "-m", "kernel_parity.conformance.cli", "bench", *SEL[:-1], "--no-isolate"]
    out = tmp_path / "b.jsonl"
    p = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("[")]
    results = records.load(out)["results"]
    assert len(lines) == len(results) and all(" pass norm_err " in x for x in lines), p.stdout
    assert p.stdout.splitlines()[-1].startswith("parity: PASS: 4 cases")
    assert "%|" not in p.stderr  # no bar off a terminal


def test_a_line_is_flushed_as_it_is_said(monkeypatch):
    """stdout a pipe is block-buffered: each line goes out when said, not when the run ends."""
    import io

    from kernel_parity.conformance.session import say

    class Pipe(io.StringIO):
        flushed = ""

        def flush(self):
            self.flushed = self.getvalue()

    pipe = Pipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    say("[1/4] a line")
    assert pipe.flushed == "[1/4] a line\n"


def _rec(backend: str, verdict: str = "pass", ms: float | None = 1.0, **kw) -> dict:
    perf = None if ms is None else {"ms": ms, "gbps": 2.0, "tflops": 0.0, "bound": "copy", "pct_of_ceiling": 50.0}
    r = {"op": "norm.rms_norm", "backend": backend, "dtype": "bf16", "dist": "normal", "seed": 0,
         "params": {"rows": 16, "n": 64, "pad": 0}, "verdict": verdict, "norm_err": 0.25, "reason": None, "perf": perf}
    return {**r, **kw}


def test_a_line_says_why_a_record_has_no_figures_and_ours_is_the_triton_kernel():
    from kernel_parity.conformance.case import Case

    backends = ["torch", "liger", "triton"]
    lines = bench.Lines([Case("norm.rms_norm", b, "bf16", (("rows", 16), ("n", 64), ("pad", 0)), "normal", 0)
                         for b in backends])
    first = lines.add(_rec("torch", ms=3.0))
    assert first == "[1/3] norm.rms_norm/torch/bf16 rows=16,n=64 normal: pass norm_err 0.25  3 ms 2 GB/s 50% of copy"
    skip = lines.add(_rec("liger", "skip", None, norm_err=None, reason="liger-kernel is not installed"))
    assert skip == "[2/3] norm.rms_norm/liger/bf16 rows=16,n=64 normal: skip: liger-kernel is not installed"
    last = lines.add(_rec("triton", ms=1.5))
    assert last.endswith("50% of copy  | peers' ms / triton's: torch 2x")
    assert bench.ours_of(["torch", "cpu", "liger"]) == "cpu" and bench.ours_of(["liger", "triton-q8"]) == "triton-q8"
    assert bench.ours_of(["liger", "quack"]) == "liger"
    untimed = _rec("cpu", perf={"error": "RuntimeError: no timer"})
    assert bench.figures(untimed) == "pass norm_err 0.25  not timed: RuntimeError: no timer"
    group = [_rec("cpu", ms=2.0), untimed | {"backend": "torch"}]
    bench.add_peers(group)  # an untimed record takes no part (and breaks nothing)
    assert group[0]["perf"]["peers"] == {} and "peers" not in group[1]["perf"]


def test_a_benchmark_script_streams_its_records_before_its_table(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_cases

    out = tmp_path / "bench.json"
    partial = bench_cases.partial_path(str(out))
    seen, streamed = [], []
    monkeypatch.setattr(commands, "say", lambda line: (seen.append((line, out.exists())),
                                                       streamed.append(partial.read_text().count('"verdict"'))))
    entries = [{"op": "softmax.softmax", "backends": ["cpu", "torch"], "dtypes": ["fp32"],
                "params": [{"rows": 3, "n": 113, "pad": 0}]}]
    assert bench_cases.run(entries, out=str(out), ours="cpu", argv=("--no-recheck",)) == 0
    assert [line.split(":")[0] for line, _ in seen] == ["[1/2] softmax.softmax/torch/fp32 rows=3,n=113 normal",
                                                         "[2/2] softmax.softmax/cpu/fp32 rows=3,n=113 normal"]
    assert not any(written for _, written in seen)  # said while the run went, before the summary existed
    assert partial.name == "bench.partial.jsonl" and streamed[-1] == 2  # each record beside out as it lands
    assert not partial.exists()  # a finished run keeps the summary only
    table = capsys.readouterr().out
    assert "softmax.softmax fp32 rows=3,n=113,pad=0: cpu " in table and json.loads(out.read_text())["cases"]


def test_a_hand_timed_path_reports_the_gates_verdict(capsys):
    """bench_cases.Gate: the same case through the Runner, its verdict and norm_err; a shape the spec
    cannot express says so instead of a figure of its own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cases import Gate, gate_text

    gate = Gate("cpu")
    g = gate("norm.rms_norm", "bf16", dict(rows=16, n=64, pad=0, eps="1e-6", gemma=0, residual=1, rstd=0))
    assert g["case"] == "norm.rms_norm/cpu/bf16/rows=16,n=64,pad=0,eps=1e-6,gemma=0,residual=1,rstd=0/normal/seed=0"
    assert gate_text(g) == f"gate pass norm_err {g['norm_err']:.3g}" and not gate.failures
    assert gate_text(gate("rope.kv_update", "bf16", dict(b=8, snew=32768, hkv=8, d=128, smax=65536,
                                                         layout="paged16"))) \
        == "gate: no case (parameter snew=32768 is out of range [1, 16384])"


@pytest.mark.parametrize("name", ["gpu_norm", "gpu_mlp", "gpu_rope", "gpu_layers_bwd"])
def test_the_hand_timed_paths_keep_no_error_bound_of_their_own(name):
    text = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert "Gate(" in text and "gate_text(" in text
    for home_made in ("bound", "err_over_bound", "rms_err", "glu_err", "ln_err", "golden_check", "k_max_abs"):
        assert f"{home_made} =" not in text and f"{home_made}=" not in text, home_made
