"""benchmarks/gpu_mla.py as a thin caller of `parity bench`: its cases, quick and full, load as a suite of
the mla ops with backends that exist and params their specs accept, at the benchmark's real shapes;
--quick is a strict subset; a bad flag or --out path is exit 2 with one line before any GPU work."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance import suites
from kernel_parity.conformance.cli import main

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_cases  # noqa: E402
import gpu_mla  # noqa: E402

OPS = {True: {"mla.decode", "mla.decode_sparse"},
       False: {"mla.decode", "mla.decode_sparse", "mla.decode_fused_fp8"}}


def _cases(tmp_path, quick: bool) -> tuple[Path, list]:
    suite = tmp_path / f"mla-{'quick' if quick else 'full'}.toml"
    suite.write_text(bench_cases.suite_text(gpu_mla.entries(quick=quick), description="benchmarks/gpu_mla.py"))
    return suite, suites.cases(str(suite))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_entries_load_as_a_suite(quick, tmp_path, capsys):
    suite, cases = _cases(tmp_path, quick)
    assert {c.op for c in cases} == OPS[quick]
    assert {c.backend for c in cases} == {"triton", "torch"} and {c.dtype for c in cases} == {"bf16"}
    capsys.readouterr()
    assert main(["list", "cases", "--suite", str(suite), "--scale", "real"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [c.id for c in cases]  # every case planned: no backend lacks the op or refuses the case


def test_full_is_the_benchmarks_grid(tmp_path):
    """mla.decode at b=128 over FlashMLA's grid, sparse top-2048 of 8192 at h_q 64 / 128, fused at b=128."""
    _, cases = _cases(tmp_path, quick=False)
    dense = {(c.p["b"], c.p["sq"], c.p["hq"], c.p["kv"]) for c in cases if c.op == "mla.decode"}
    assert dense == set(itertools.product([128], [1, 2], [16, 32, 64, 128], [4096, 8192, 16384]))
    assert all(c.p["causal"] == (c.p["sq"] == 2) for c in cases if c.op == "mla.decode")
    sparse = {(c.p["b"], c.p["sq"], c.p["hq"], c.p["kv"], c.p["topk"]) for c in cases if c.op == "mla.decode_sparse"}
    assert sparse == {(128, 1, 64, 8192, 2048), (128, 1, 128, 8192, 2048)}
    fused = {(c.p["b"], c.p["new"], c.p["hq"], c.p["kv"]) for c in cases if c.op == "mla.decode_fused_fp8"}
    assert fused == set(itertools.product([128], [1], [16, 128], [4096, 16384]))


def test_quick_is_a_strict_subset(tmp_path):
    """--quick: 1-3 input groups of the full list, none of the fused branch (its golden is the costly one)."""
    _, quick = _cases(tmp_path, quick=True)
    _, full = _cases(tmp_path, quick=False)
    q, f = [c.id for c in quick], {c.id for c in full}
    assert q and set(q) < f and len(q) == len(set(q))
    groups = {(c.op, c.dtype, tuple(sorted(c.p.items()))) for c in quick}
    assert 1 <= len(groups) <= 3
    assert all(c.p["kv"] <= 8192 for c in quick)


def test_the_tune_module_is_imported_on_the_tune_path_alone():
    """gpu_mla.py is the thin caller: importing it (entries) leaves gpu_mla_tune unloaded."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import gpu_mla; print('gpu_mla_tune' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_mla.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["--out", "/dev/full"], ["--out", "DIR"], ["--no-such-flag"],
                                  ["--tune", "--sections", "parity"], ["--sections", "sdpa"]],
                         ids=["dev-full", "directory", "bad-flag", "old-parity-section", "sections-without-tune"])
def test_bad_out_or_flag_is_exit_2_with_one_line(args, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    r = _script(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_mla.py: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    if "parity" in args:
        assert "parity run --suite ci --op mla" in lines[0]


def test_without_a_gpu_the_default_path_is_exit_2_with_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the default path runs")
    r = _script("--quick", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("gpu_mla.py: error: no CUDA device") and "--smoke-cpu" in line
    assert not (tmp_path / "x.json").exists()
