"""The CLI end to end: repro is bit-identical, export, list, report, diff, calibrate, jobs."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kernel_parity.conformance.cli import main
from kernel_parity.reports import records


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    assert main(["run", "--suite", "smoke", "--no-progress", "-q", "--json", str(out)]) == 0
    return records.load(out)


def test_run_covers_every_backend_and_dtype(smoke_run):
    res = smoke_run["results"]
    assert {r["backend"] for r in res} == {"triton", "cpu", "torch", "sdpa-cpu", "gguf", "torch-norm"}
    assert {r["dtype"] for r in res} == {"fp32", "fp16", "bf16", "int32"}  # int32: the schedulers' exact rows
    assert {r["verdict"] for r in res} == {"pass"}
    assert smoke_run["header"]["suite"] == "smoke" and smoke_run["header"]["numpy"]


def test_repro_reproduces_metrics_to_the_last_bit(smoke_run, tmp_path):
    picks = [r for r in smoke_run["results"] if r["dist"] in ("masked", "empty")][::5]
    assert picks
    for rec in picks:
        out = tmp_path / "one.json"
        assert main(["repro", rec["id"], "--json", str(out)]) == 0
        (again,) = records.load(out)["results"]
        for name, o in rec["outputs"].items():
            assert again["outputs"][name]["metrics"] == o["metrics"], rec["id"]
            assert again["outputs"][name]["worst"] == o["worst"], rec["id"]


def test_repro_prints_metrics_worst_elements_and_verdict(capsys):
    case = "softmax.softmax/np_noisy/fp16/rows=3,n=113,pad=0/normal/seed=0"
    assert main(["repro", case, "--backend", "tests.third_party:NOISY"]) == 1
    out = capsys.readouterr().out
    assert "max_abs" in out and "cos_diff" in out and "worst    OUT y[" in out
    assert "verdict  fail (numeric)" in out
    assert f"repro: parity repro {case} --backend tests.third_party:NOISY" in out


def test_repro_export_writes_a_standalone_bug_report(tmp_path):
    case = "combine.lse_combine/cpu/bf16/splits=5,rows=7,dv=64/empty/seed=0"
    assert main(["repro", case, "--export", str(tmp_path / "bug")]) == 0
    bug = tmp_path / "bug"
    assert {p.name for p in bug.iterdir()} >= {"inputs.npz", "expected.npz", "actual.npz", "case.json", "repro.py",
                                               "layout.json"}
    inputs = np.load(bug / "inputs.npz")
    assert inputs["o_parts"].dtype == np.uint16  # bf16 travels as its bits
    layout = json.loads((bug / "layout.json").read_text())
    assert layout["inputs/o_parts"]["dtype"] == "bfloat16"
    r = subprocess.run([sys.executable, str(bug / "repro.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "output o (bf16" in r.stdout and "output lse" in r.stdout and "verdict  pass" in r.stdout


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for needle in ("softmax.online_softmax", "combine.lse_combine", "triton", "available", "ci", "smoke"):
        assert needle in out
    assert main(["list", "cases", "--suite", "smoke", "--op", "combine"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids and all(i.startswith(("combine.lse_combine/", "combine.lse_combine_backward/")) for i in ids)


def test_report_and_diff(smoke_run, tmp_path):
    src = tmp_path / "a.json"
    records.write(src, smoke_run["header"], smoke_run["results"])
    assert main(["report", str(src), "--html", str(tmp_path / "a.html"), "--junit", str(tmp_path / "a.xml"),
                 "--md", str(tmp_path / "a.md")]) == 0
    assert (tmp_path / "a.html").read_text().startswith("<!DOCTYPE html>")
    worse = json.loads(json.dumps(smoke_run["results"]))
    worse[0]["verdict"], worse[0]["reason"] = "fail", "y: made up for the test"
    dst = tmp_path / "b.json"
    records.write(dst, smoke_run["header"], worse)
    assert main(["diff", str(src), str(src)]) == 0
    assert main(["diff", str(src), str(dst)]) == 1


def test_gate_against_a_baseline_flags_a_regression(smoke_run, tmp_path):
    base = json.loads(json.dumps(smoke_run["results"]))
    target = next(r for r in base if r["backend"] == "cpu" and r["op"] == "softmax.softmax")
    for o in target["outputs"].values():  # pretend the baseline was 1000x more accurate
        o["metrics"]["max_abs"] /= 1000
        o["metrics"]["nmse"] /= 1e6
    target["norm_err"] /= 1000
    path = tmp_path / "base.json"
    records.write(path, smoke_run["header"], base)
    code = main(["gate", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu", "--dtype",
                 target["dtype"], "--no-progress", "-q", "--baseline", str(path)])
    # the cpu kernel's errors sit below diff.FLOORS (rounding level), so a baseline 1000x "better" than
    # that is no growth; growth above the floors fails the gate (tests/test_gate_baseline.py)
    assert code == 0


def test_jobs_give_the_same_results(smoke_run, tmp_path):
    """--jobs 2 against one worker: the cpu records of the module's smoke run (--jobs 1; a run of the cpu
    backend alone gives the same records) and a run of the cpu backend on two workers."""
    b = tmp_path / "b.json"
    assert main(["run", "--suite", "smoke", "--backend", "cpu", "--no-progress", "-q", "--jobs", "2",
                 "--json", str(b)]) == 0
    ra = {r["id"]: r for r in smoke_run["results"] if r["backend"] == "cpu"}
    rb = {r["id"]: r for r in records.load(b)["results"]}  # streamed in completion order
    assert sorted(ra) == sorted(rb)
    assert all(_kernel_side(ra[i]["outputs"]) == _kernel_side(rb[i]["outputs"]) for i in ra)
    assert all(ra[i]["verdict"] == rb[i]["verdict"] for i in ra)


def _kernel_side(outputs: dict) -> dict:
    """A record's outputs without what the eager-torch baseline measured: torch's CPU matmuls split
    their reductions by thread count (--jobs 2 gives each worker one thread), so the baseline's error
    may differ in its last bits; the kernel's own metrics and the golden's must not."""
    out = {}
    for name, o in outputs.items():
        o = dict(o)
        o.pop("noise", None)
        o["layers"] = {k: v for k, v in (o.get("layers") or {}).items() if k != "noise"}
        out[name] = o
    return out


def test_calibrate_prints_quantiles(capsys):
    assert main(["calibrate", "combine.lse_combine", "--suite", "smoke", "--backend", "cpu", "--dtype", "bf16",
                 "--seeds", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "calibrate combine.lse_combine: 4 runs" in out and "cpu" in out and "suggest" in out
