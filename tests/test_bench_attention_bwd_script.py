"""benchmarks/gpu_attention_bwd.py as a thin caller of `parity bench`: its cases, quick and full, load as a
suite of attention.prefill_backward on existing backends, each at a timed shape's s and d with a golden the
host can afford, and a bad flag or --out path is exit 2 with one line before any GPU work."""

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
import gpu_attention_bwd as script  # noqa: E402

# b h_q s_q s_k d of the largest case judged (b 1, s 4096, 8 heads, d 128: ~16 s of float64 on one core);
# the target shape itself (b 16, 32 heads) is 64x that
MAX_GOLDEN_WORK = 1 * 8 * 4096 * 4096 * 128


def _cases(tmp_path: Path, quick: bool) -> list:
    suite = tmp_path / f"attention-bwd-{quick}.toml"
    suite.write_text(bench_cases.suite_text(script.entries(quick=quick), description="benchmarks/gpu_attention_bwd.py"))
    return suites.cases(str(suite))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_entries_load_as_a_suite(quick, tmp_path):
    cases = _cases(tmp_path, quick)
    assert {c.op for c in cases} == {"attention.prefill_backward"}
    assert {c.backend for c in cases} == {"triton", "fa4", "sdpa-flash", "sdpa-cudnn"}
    assert {c.dtype for c in cases} == {"bf16"}
    suite = tmp_path / f"attention-bwd-{quick}.toml"
    assert main(["list", "cases", "--suite", str(suite)]) == 0  # every op and backend exists


def test_quick_is_a_strict_subset(tmp_path):
    quick, full = ({c.id for c in _cases(tmp_path, q)} for q in (True, False))
    assert quick and quick < full


def test_each_timed_shape_is_judged_at_its_s_and_d_within_the_host_budget(tmp_path):
    """Every shape --tune times has a gate-judged case at its s and d (fewer sequences or heads, the GQA
    ratio kept), and no case's float64 golden is the full-size one."""
    assert set(script.GATED) == {*script.SHAPES, *script.QUICK_SHAPES}
    judged = {(c.p["sq"], c.p["d"]): c.p for c in _cases(tmp_path, quick=False)}
    for b, s, d in script.GATED:
        p = judged[(s, d)]
        assert p["sk"] == s and p["causal"] == "bottom_right" and p["hq"] // p["hkv"] == script.HQ // script.HKV
        assert p["b"] <= b and p["hq"] <= script.HQ
        assert p["b"] * p["hq"] * p["sq"] * p["sk"] * p["d"] <= MAX_GOLDEN_WORK, p


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_attention_bwd.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["--out", "/dev/full"], ["--out", "DIR"], ["--out", "/no/such/dir/x.json"],
                                  ["--no-such-flag"], ["--sections", "bench"], ["--tune", "--sections", "parity,x"]],
                         ids=["dev-full", "directory", "missing-dir", "bad-flag", "sections-without-tune",
                              "bad-section"])
def test_bad_out_or_flag_is_exit_2_with_one_line(args, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    r = _script(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args", [[], ["--tune"]], ids=["default", "tune"])
def test_no_gpu_is_exit_2_with_one_line(args, tmp_path):
    """Never the float64 goldens and the Triton interpreter at these sizes on a machine without a GPU."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the benchmark")
    out = tmp_path / "bench.json"
    r = _script(*args, "--out", str(out))
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "no CUDA device" in line and not out.exists()
