"""The benchmark scripts that are thin callers of `parity bench` (benchmarks/gpu_softmax.py,
gpu_attention.py): their cases, quick and full, load as a suite of existing ops and backends, and a
bad flag or --out path is exit 2 with one line before any GPU work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance import suites
from kernel_parity.conformance.cli import main

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_cases  # noqa: E402

SCRIPTS = ("gpu_softmax", "gpu_attention")
OPS = {"gpu_softmax": {"softmax.softmax", "softmax.online_softmax", "combine.lse_combine"},
       "gpu_attention": {"attention.decode", "attention.decode_paged", "attention.prefill"}}


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_entries_load_as_a_suite(name, quick, tmp_path):
    mod = __import__(name)
    suite = tmp_path / f"{name}.toml"
    suite.write_text(bench_cases.suite_text(mod.entries(quick=quick), description=f"benchmarks/{name}.py"))
    cases = suites.cases(str(suite))
    assert {c.op for c in cases} == OPS[name]
    assert "triton" in {c.backend for c in cases}
    assert main(["list", "cases", "--suite", str(suite)]) == 0  # every op and backend exists


def test_quick_is_a_subset(tmp_path):
    """--quick: fewer cases than the full run, and softmax's first case is small (a first record in seconds)."""
    for name in SCRIPTS:
        mod = __import__(name)
        n = {}
        for quick in (True, False):
            suite = tmp_path / f"{name}-{quick}.toml"
            suite.write_text(bench_cases.suite_text(mod.entries(quick=quick)))
            n[quick] = len(suites.cases(str(suite)))
        assert 0 < n[True] < n[False]
    first = __import__("gpu_softmax").entries(quick=True)[0]["params"][0]
    assert first["rows"] * first["n"] * 2 <= 64 << 20


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("args", [["--out", "/dev/full"], ["--out", "DIR"], ["--no-such-flag"]],
                         ids=["dev-full", "directory", "bad-flag"])
def test_bad_out_or_flag_is_exit_2_with_one_line(name, args, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    r = _script(name, *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], r.stderr
    assert r.stdout == ""


def test_attention_rejects_an_unknown_section_naming_the_gate():
    r = _script("gpu_attention", "--sections", "parity")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "--sections" in line and "parity run --suite ci" in line


@pytest.mark.parametrize("args,names", [(["--shapes", "12"], "ROWSxN"), (["--shapes", "16384x0"], "ROWSxN"),
                                        (["--variants", "committed,nope"], "nope"),
                                        (["--out", "/dev/full"], "--out")],
                         ids=["shape", "zero", "variant", "out"])
def test_norm_bwd_tune_bad_flag_is_exit_2_with_one_line(args, names):
    """benchmarks/gpu_norm_bwd_tune.py: a bad --shapes / --variants / --out is exit 2 with one line naming it,
    before any GPU work."""
    r = _script("gpu_norm_bwd_tune", *args)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "error" in line and names in line
    assert r.stdout == ""


def test_norm_bwd_tune_without_a_gpu_says_so():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = _script("gpu_norm_bwd_tune", "--shapes", "8x9000")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "needs a CUDA GPU" in line


@pytest.mark.parametrize("args,names", [(["mla", "0", "64"], "CAUSAL"), (["mla", "2"], "CAUSAL"),
                                        (["prefill", "128"], "D MODE"), (["nope"], "invalid choice")],
                         ids=["mla-config", "mla-causal", "prefill-short", "kernel"])
def test_gluon_sm90_bad_arguments_are_exit_2_with_one_line(args, names):
    """benchmarks/gluon_sm90.py (the offline sm_90a compile): bad arguments are exit 2 with one line naming
    what was expected, before any compiling."""
    r = _script("gluon_sm90", *args)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "error" in line and names in line, line
    assert r.stdout == ""


@pytest.mark.parametrize("args,names", [(["--gemv-shapes", "12x100"], "multiple of 256"),
                                        (["--gemv-shapes", "14336x4096,x"], "NxK"),
                                        (["--gemv-shapes", "0x4096"], "N >= 1"), (["--no-such-flag"], "unrecognized")],
                         ids=["k-not-256", "not-a-pair", "n-zero", "flag"])
def test_gpu_gluon_bad_arguments_are_exit_2_with_one_line(args, names):
    """benchmarks/gpu_gluon.py: a bad --gemv-shapes (or flag) is exit 2 with one line naming what was expected,
    before importing torch or touching a GPU."""
    r = _script("gpu_gluon", *args)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "error" in line and names in line, line
    assert r.stdout == ""
