"""benchmarks/gpu_gemm.py as a thin caller of `parity bench`: its cases, quick and full, load as a suite of
gemm.gemm_nt cases on existing backends, quick is a small part of the full list, the calls of
benchmarks/gpu_gate.sh still reach the --tune path (benchmarks/gpu_gemm_tune.py, imported on that path alone),
and a bad flag or --out path is exit 2 with one line before any GPU work."""

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
import gpu_gemm  # noqa: E402


def _cases(tmp_path: Path, quick: bool) -> tuple[Path, list]:
    suite = tmp_path / f"gemm-{'quick' if quick else 'full'}.toml"
    suite.write_text(bench_cases.suite_text(gpu_gemm.entries(quick=quick), description="benchmarks/gpu_gemm.py"))
    return suite, suites.cases(str(suite))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_entries_load_as_a_suite(quick, tmp_path):
    suite, cases = _cases(tmp_path, quick)
    assert {c.op for c in cases} == {"gemm.gemm_nt"}
    assert "triton" in {c.backend for c in cases}
    assert main(["list", "cases", "--suite", str(suite)]) == 0  # every op and backend exists


def test_full_list_holds_the_scripts_shapes(tmp_path):
    """The GEMVs of every Triton GGML format on both projections, Q4_K prefill at M = 4096, FP8 and int4,
    each beside its peers (triton-q8 where it has a path, torch, scaled-mm for FP8)."""
    _, cases = _cases(tmp_path, quick=False)
    got = {(c.p["wfmt"], c.p["m"], c.p["n"], c.p["k"], c.backend) for c in cases}
    for fmt in ("q4_k", "q8_0", "q4_0", "q6_k"):
        assert {(fmt, 1, 14336, 4096, "triton"), (fmt, 1, 4096, 14336, "triton"),
                (fmt, 16, 14336, 4096, "torch")} <= got
    assert ("q8_0", 1, 4096, 14336, "triton-q8") in got and ("q6_k", 1, 4096, 14336, "triton-q8") not in got
    assert ("q4_k", 4096, 14336, 4096, "triton") in got
    assert ("fp8", 8192, 8192, 8192, "scaled-mm") in got
    assert {("int4_gptq", 4096, 14336, 4096, "triton"), ("int4_awq", 1, 4096, 4096, "torch")} <= got


def test_quick_is_a_strict_subset_of_m1_gemvs(tmp_path):
    """--quick: a few M = 1 GEMV groups (a first record in seconds), every one of them a case of the full run."""
    _, quick = _cases(tmp_path, quick=True)
    _, full = _cases(tmp_path, quick=False)
    groups = {(c.p["wfmt"], c.p["n"], c.p["k"]) for c in quick}
    assert 2 <= len(groups) <= 4
    assert {c.p["m"] for c in quick} == {1}
    assert {c.id for c in quick} < {c.id for c in full}


@pytest.mark.parametrize("argv", [["--quick", "--budget-s", "60"], ["--sections", "q8", "--budget-s", "120"]],
                         ids=["gate-gemm-step", "gate-q8-step"])
def test_gpu_gate_calls_take_the_tune_path(argv, tmp_path):
    """benchmarks/gpu_gate.sh's two calls (steps gemm and q8) keep their direct measurement."""
    args = gpu_gemm.parse_args([*argv, "--out", str(tmp_path / "gemm.json")])
    assert args.tune
    assert gpu_gemm.parse_args(["--quick", "--out", str(tmp_path / "gemm.json")]).tune is False


def test_the_tune_module_is_imported_on_the_tune_path_alone():
    """gpu_gemm.py is the thin caller: importing it (entries, parse_args) leaves gpu_gemm_tune unloaded."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import gpu_gemm; print('gpu_gemm_tune' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_gemm.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, names", [
    (["--out", "/dev/full"], "--out"), (["--out", "DIR"], "--out"), (["--no-such-flag"], "--no-such-flag"),
    (["--sections", "q8,bogus"], "--sections"), (["--q8-m", "2"], "--q8-m"),
    (["--dump", "/dev/full", "--out", "OK"], "--dump")],
    ids=["dev-full", "directory", "bad-flag", "bad-section", "bad-q8-m", "dump-dev-full"])
def test_bad_out_or_flag_is_exit_2_with_one_line(args, names, tmp_path):
    args = [str(tmp_path) if a == "DIR" else str(tmp_path / "ok.json") if a == "OK" else a for a in args]
    r = _script(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and names in lines[0], r.stderr
    assert r.stdout == ""


def test_the_gate_judges_the_swapped_in_call():
    """--tune's check of a line is the gate's verdict on the call the line timed, swapped into the triton
    adapter while the gate runs (then put back): a call writing zeros fails, torch's dequantize + matmul passes."""
    from kernel_parity.kernels.torch import gemm as TG
    from kernel_parity.kernels.triton import gemm as G

    from gpu_gemm_tune import Ctx

    launcher = G.gemm_nt
    ctx = Ctx()
    params = gpu_gemm._case(2, 64, 256, "q4_k")
    zeros = (G, "gemm_nt", lambda a, wfmt, w, bias=None, out=None, **_: out.zero_())
    assert ctx.judge(params, zeros)["verdict"] == "fail"
    eager = (G, "gemm_nt", lambda a, wfmt, w, bias=None, out=None, **_: out.copy_(TG.gemm_nt(a, wfmt, {"w": w}, bias)))
    assert ctx.judge(params, eager)["verdict"] == "pass"
    assert G.gemm_nt is launcher
    assert len(ctx.failures()) == 1 and ctx.failures()[0].startswith("gemm.gemm_nt/triton/bf16/")
