"""benchmarks/gpu_gemm_bwd.py as a thin caller of `parity bench`: its cases, quick and full, load as a suite
of gemm.gemm_nt_backward on existing backends, --quick is a strict subset whose first input group is the
cheap float32 W, a bad flag or --out path (or no GPU) is exit 2 with one line before any GPU work, and
--tune's code runs on the CPU (--smoke-cpu) with the gate's verdict on every row: exit 1 when the gate
fails one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_parity.conformance import suites
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.runner import group_cases, largest_first

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_cases  # noqa: E402
import gpu_gemm_bwd  # noqa: E402

OP = "gemm.gemm_nt_backward"


def _suite(quick: bool, tmp_path: Path) -> Path:
    suite = tmp_path / f"gemm-bwd-{'quick' if quick else 'full'}.toml"
    suite.write_text(bench_cases.suite_text(gpu_gemm_bwd.entries(quick=quick),
                                            description="benchmarks/gpu_gemm_bwd.py"))
    return suite


def _cases(quick: bool, tmp_path: Path) -> list:
    return suites.cases(str(_suite(quick, tmp_path)))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_entries_load_as_a_suite(quick, tmp_path):
    suite = _suite(quick, tmp_path)
    cases = suites.cases(str(suite))
    assert {c.op for c in cases} == {OP}
    assert {c.backend for c in cases} == {"triton", "torch"}
    assert main(["list", "cases", "--suite", str(suite)]) == 0  # every op and backend exists


def test_full_holds_the_scripts_shapes_and_formats(tmp_path):
    """Every Llama-3-8B projection at M = 512 with float32 W in bf16 and fp32, and each of Q4_K / Q6_K / Q8_0."""
    cases = _cases(False, tmp_path)
    groups = {(c.dtype, c.p["n"], c.p["k"], c.p["wfmt"]) for c in cases}
    assert {c.p["m"] for c in cases} == {512}
    for n, k in gpu_gemm_bwd.SHAPES.values():
        assert {("bf16", n, k, "f32"), ("fp32", n, k, "f32")} <= groups
        assert {("bf16", n, k, w) for w in ("q4_k", "q6_k", "q8_0")} <= groups
    assert {w for d, _, _, w in groups if d == "fp32"} == {"f32", "q4_k", "q6_k", "q8_0"}


def test_quick_is_a_strict_subset_led_by_the_float32_weight(tmp_path):
    """--quick: fewer cases, all of them in the full run, 1-3 input groups; the first group parity bench
    runs (largest first, ties in suite order) is float32 W at 4096 x 4096 (no quantization: a first line in seconds)."""
    quick, full = _cases(True, tmp_path), _cases(False, tmp_path)
    assert 0 < len(quick) < len(full)
    assert set(quick) < set(full)
    groups = largest_first(group_cases(quick), seconds={})
    assert 1 <= len(groups) <= 3
    first = groups[0][0]
    assert (first.p["n"], first.p["k"], first.p["wfmt"]) == (4096, 4096, "f32")


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_gemm_bwd.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["--out", "/dev/full"], ["--out", "DIR"], ["--no-such-flag"],
                                  ["--tune", "--out", "/dev/full"], ["--smoke-cpu", "--out", "DIR"]],
                         ids=["dev-full", "directory", "bad-flag", "tune-dev-full", "smoke-directory"])
def test_bad_out_or_flag_is_exit_2_with_one_line(args, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    r = _script(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_smoke_cpu_runs_tune_with_the_gates_verdict(tmp_path):
    """--smoke-cpu: --tune's rows at the tiny shape, every format and dtype timed beside the gate's verdict
    on the same case; exit 0 only when the gate passes them all."""
    out = tmp_path / "sub" / "gemm-bwd.json"  # a missing directory is created
    r = _script("--smoke-cpu", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert {(row["dtype"], row["wfmt"]) for row in rows} == {(d, w) for d in ("bf16", "fp32")
                                                            for w in ("f32", "q4_k", "q6_k", "q8_0")}
    for row in rows:
        assert "error" not in row, row
        assert row["gate"]["verdict"] == "pass", row["gate"]
        assert row["gate"]["case"].startswith(f"{OP}/triton/{row['dtype']}/m=16,n=64,k=256,wfmt={row['wfmt']},")
        peers = {"torch"} if row["wfmt"] == "f32" else {"torch_dequant_matmul", "torch_matmul_predequantized"}
        assert {"ours"} | peers <= {k for k, v in row.items() if isinstance(v, dict) and "ms" in v}
    assert doc["gate_failures"] == [] and doc["errors"] == []
    assert len(r.stdout.strip().splitlines()) == len(rows) and "gate pass" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the default path runs the whole bench")
@pytest.mark.parametrize("args", [[], ["--tune"]], ids=["bench", "tune"])
def test_no_gpu_is_exit_2_with_one_line(args, tmp_path):
    r = _script(*args, "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "no CUDA device" in line and "--smoke-cpu" in line
    assert not (tmp_path / "x.json").exists()


# --tune's rows under a Q6_K backward_da 1% off (what the gate's triton backend and the timings both call)
_OFF_BY_ONE_PERCENT = """
import runpy, sys
from kernel_parity.conformance.backends.triton_prep import interpreter_ready
interpreter_ready()
from kernel_parity.kernels.triton import gemm_bwd as k
right = k.backward_da
def wrong(dc, wfmt, w, out):
    right(dc, wfmt, w, out)
    return out.mul_(1.01) if wfmt == "q6_k" else out
k.backward_da = wrong
sys.argv = ["gpu_gemm_bwd.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_case_the_gate_fails_is_exit_1(tmp_path):
    out = tmp_path / "gemm-bwd.json"
    r = subprocess.run([sys.executable, "-c", _OFF_BY_ONE_PERCENT, "--smoke-cpu", "--quick", "--out", str(out)],
                       cwd=BENCH, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stdout + r.stderr
    verdicts = {row["wfmt"]: row["gate"]["verdict"] for row in json.loads(out.read_text())["results"]}
    assert verdicts == {"f32": "pass", "q4_k": "pass", "q6_k": "fail", "q8_0": "pass"}
    assert "GATE FAIL gemm.gemm_nt_backward/triton/bf16/m=16,n=64,k=256,wfmt=q6_k" in r.stdout
