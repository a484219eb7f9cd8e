"""What a new user hit (issue 15), each as a self-test: unwritable outputs of every command are exit 2
before anything runs, a plugin gate plans only the ops its backend has kernels for, listing applies
supports() and `parity coverage` says what a backend covers, calibrate resolves the configuration and
never suggests a degenerate limit, the repro noise line and exported repro.py tell the truth, exported
arrays keep their own dtypes, worst-element lists mark what is out of tolerance, and the small things
(did-you-mean, missing suite files, comma lists, case ids that wrap at '/', plots in a grid, norm_err
explained, incomplete reports showing what never ran, cold caches said or warmed).
(The adopt section in a truly fresh venv is tests/test_adopt.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import cli
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.backends import Registry
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.metrics import Limits, compare
from kernel_parity.conformance.runner import Prepared
from kernel_parity.reports import html, markdown, records

ROOT = Path(__file__).resolve().parent.parent
NOISY = "softmax.softmax/np_noisy/fp16/rows=3,n=113,pad=0/normal/seed=0"
CPU_CASE = "softmax.softmax/cpu/fp32/rows=3,n=113,pad=0/normal/seed=0"


def _usage_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    cap = capsys.readouterr()
    assert code == 2, f"parity {argv} exited {code}\n{cap.out}\n{cap.err}"
    err = cap.err.strip()
    assert "Traceback" not in cap.err + cap.out
    assert len(err.splitlines()) == 1 and err.startswith("parity: error: "), err
    return err


# -- 2: every output path of every command, checked before anything runs -------------------------
@pytest.fixture(scope="module")
def results_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("res") / "r.jsonl"
    assert main(["run", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu", "--no-progress", "-q",
                 "--json", str(out)]) == 0
    return out


def _argv(cmd: str, results: Path) -> list[str]:
    sel = ["--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu", "--no-progress", "-q"]
    return {
        "run": ["run", *sel], "gate": ["gate", *sel], "sweep": ["sweep", *sel, "--per-op", "1"],
        "report": ["report", str(results)], "merge": ["merge", str(results)],
        "diff": ["diff", str(results), str(results)], "repro": ["repro", CPU_CASE],
        "mutants": ["mutants", "--mutant", "tri-softmax-no-max", "-q"],
        "calibrate": ["calibrate", "softmax.softmax", "--backend", "cpu", "--seeds", "1", "--no-progress"],
        "coverage": ["coverage", "--suite", "smoke", "--op", "softmax.softmax"],
        "bench": ["bench", *sel], "shrink": ["shrink", CPU_CASE, "--max-examples", "1"],
    }[cmd]


def _commands_with_outputs() -> dict[str, dict[str, str]]:
    subs = cli.build_parser()._subparsers._group_actions[0]
    return {name: dict(p.get_default("_outputs")) for name, p in subs.choices.items() if p.get_default("_outputs")}


def test_every_command_with_an_output_path_is_covered_by_the_bad_path_test(results_file):
    cmds = _commands_with_outputs()
    assert set(cmds) == {"run", "gate", "sweep", "report", "merge", "diff", "repro", "mutants", "calibrate",
                         "coverage", "bench", "shrink"}
    for c in cmds:
        _argv(c, results_file)  # each has its minimal argv here


@st.composite
def bad_output(draw):
    cmds = _commands_with_outputs()
    cmd = draw(st.sampled_from(sorted(cmds)))
    flag = draw(st.sampled_from(sorted(cmds[cmd])))
    kinds = ["existing", "under_a_file", "under_proc", "empty", "nul"]
    if cmds[cmd][flag] == cli.OUTPUT_FILE:
        kinds.append("dev_full")
    if cmd in ("report", "merge", "diff"):
        kinds.append("an_input")
    return cmd, flag, cmds[cmd][flag], draw(st.sampled_from(kinds))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=bad_output())
def test_bad_output_paths_are_exit_2_before_anything_runs(capsys, tmp_path_factory, monkeypatch, results_file, bad):
    cmd, flag, kind, what = bad
    d = tmp_path_factory.mktemp("bad")
    (d / "a_file").write_text("x")
    (d / "a_dir").mkdir()
    path = {"existing": str(d / ("a_dir" if kind == cli.OUTPUT_FILE else "a_file")),
            "under_a_file": str(d / "a_file" / "x.out"), "under_proc": "/proc/kp-no-such/x.out",
            "empty": "", "nul": str(d / "a\0b"), "dev_full": "/dev/full", "an_input": str(results_file)}[what]
    before = sorted(p.name for p in d.iterdir())
    source = results_file.read_bytes()

    def ran(*a, **k):
        raise AssertionError(f"parity {cmd} ran before checking {flag} {path!r}")

    from kernel_parity.conformance import parallel, runner

    monkeypatch.setattr(parallel, "run_isolated", ran)
    monkeypatch.setattr(runner.Runner, "evaluate_group", ran)
    err = _usage_error(capsys, [*_argv(cmd, results_file), flag, path])
    assert flag in err, err
    assert sorted(p.name for p in d.iterdir()) == before and results_file.read_bytes() == source


@pytest.mark.parametrize("argv, needle", [
    (["run", "--json", "/proc/x.jsonl"], "no file can be created in '/proc'"),
    (["run", "--md", "/dev/full"], "every write to it fails"),
    (["repro", CPU_CASE, "--export", "/etc/hostname"], "is a file, expected a directory"),
    (["repro", CPU_CASE, "--export", "/etc/hostname/bug"], "is not a directory"),
    (["repro", CPU_CASE, "--export", "/proc/bug"], "no file can be created in '/proc'"),
])
def test_the_paths_the_new_user_tried(capsys, argv, needle):
    assert needle in _usage_error(capsys, argv)


# -- 3, 4: plugin gates plan only ops with a kernel; list applies supports(); coverage -------------
def test_a_softmax_only_plugin_gate_plans_only_softmax(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    code = main(["gate", "--backend", "tests.third_party:GOOD", "--no-progress", "--json", str(out),
                 "--html", str(tmp_path / "g.html")])
    cap = capsys.readouterr()
    assert code == 0, cap.out + cap.err
    doc = records.load(out)
    assert {r["op"] for r in doc["results"]} == {"softmax.softmax"}
    assert not [r for r in doc["results"] if r["verdict"] == "skip" and "no kernel" in (r.get("reason") or "")]
    left = doc["header"]["left_out"]
    assert left["count"] > 500 and set(left["by_backend"]) == {"np_good"}
    assert re.search(r"not planned: \d+ cases of ops a selected backend implements no kernel for \(np_good", cap.err)
    ops_in_matrix = set(re.findall(r'<th class="op">([^<]+)</th>', (tmp_path / "g.html").read_text()))
    assert ops_in_matrix == {"softmax.softmax"}


def test_list_cases_lists_only_what_the_backend_runs(capsys):
    assert main(["list", "cases", "--suite", "ci", "--backend", "triton", "--op", "quant.dequantize"]) == 0
    cap = capsys.readouterr()
    ids = cap.out.split()
    triton = Registry().get("triton")
    assert ids and all(triton.supports(ops.parse_case(i)) is None for i in ids)
    assert re.search(r"not listed: \d+ cases the backend will skip", cap.err)
    assert main(["list", "cases", "--suite", "ci", "--backend", "triton", "--op", "quant.dequantize",
                 "--with-skips"]) == 0
    skips = [ln for ln in capsys.readouterr().out.splitlines() if "# skip:" in ln]
    assert skips and all("not" in ln for ln in skips)


def test_coverage_says_what_a_backend_covers(tmp_path, capsys):
    out = tmp_path / "cov.json"
    assert main(["coverage", "--suite", "ci", "--backend", "triton", "--op", "quant.dequantize",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quant.dequantize / triton:" in text and "runs     fmt" in text and "never runs  fmt" in text
    (row,) = json.loads(out.read_text())["rows"]
    ran, skipped = set(row["values"]["fmt"]), {f for s in row["skips"] for f in s["never_run"].get("fmt", [])}
    assert {"q8_0", "q4_0", "q4_k", "q6_k"} <= ran and "q5_0" in skipped and not ran & skipped


# -- 5: calibrate resolves the configuration and never suggests a degenerate limit ---------------
def test_calibrate_honours_the_configured_suites_and_names_them(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.kernel-parity]\nsuites = ["mine.toml"]\n')
    (tmp_path / "mine.toml").write_text('[[cases]]\nop = "softmax.softmax"\nbackends = ["cpu"]\n'
                                         'dtypes = ["fp32"]\nparams = [{rows = 2, n = 7, pad = 0}]\n')
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "softmax.softmax", "--seeds", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "3 runs (1 cases of suite 'mine.toml' x 3 seeds)" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("cpu"))
    assert "nan" not in row.split("verdicts")[0]
    suggest = float(row.split("verdicts")[0].split()[-1])
    assert suggest > 0.5 * float(np.finfo(np.float32).eps)  # never "rtol 0" (printed to 3 digits)
    err = _usage_error(capsys, ["calibrate", "combine.lse_combine", "--seeds", "1"])
    assert "mine.toml" in err


def test_calibrate_prints_no_nan_noise_where_there_is_no_baseline(tmp_path, capsys):
    out = tmp_path / "cal.json"  # torch is softmax's baseline: nothing to compare its noise with
    assert main(["calibrate", "softmax.softmax", "--suite", "smoke", "--backend", "torch", "--seeds", "1",
                 "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text.split("\n", 2)[2].split("verdicts")[0]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["noise_ratio_max"] is None and r["suggest"]["rtol"] > 0 for r in rows)


# -- 6, 7: the repro noise line, and the exported repro.py's exit code ----------------------------
def _noise_record(err: float, limit: float) -> dict:
    return {"outputs": {"y": {"dtype": "fp32", "shape": [3], "metrics": {}, "limits": {}, "layers": {},
                              "worst": [], "noise": {"err": err, "baseline_err": 0.0, "k": 2.0, "floor": 1e-6,
                                                     "limit": limit}}}, "verdict": "fail", "kind": "noise"}


def test_the_repro_noise_line_prints_the_comparison_that_holds(capsys):
    from kernel_parity.conformance.repro import print_record

    print_record(_noise_record(0.002, 1e-6))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "noise" in ln)
    assert "err 0.002 > 2 x baseline 0 + floor 1e-06 = 1e-06: FAIL" in line
    print_record(_noise_record(1e-7, 1e-6))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "noise" in ln)
    assert "err 1e-07 <= 2 x baseline" in line and line.endswith("ok")


def test_exported_repro_py_exits_1_for_a_failing_case(tmp_path, capsys):
    bug = tmp_path / "bug"
    assert main(["repro", NOISY, "--backend", "tests.third_party:NOISY", "--export", str(bug)]) == 1
    capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # where tests.third_party imports: the kernel re-runs
    r = subprocess.run([sys.executable, str(bug / "repro.py")], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "kernel   re-run: np_noisy" in r.stdout and "limits   atol=" in r.stdout
    assert "worst    OUT y[" in r.stdout and "verdict  fail (numeric)" in r.stdout
    r = subprocess.run([sys.executable, str(bug / "repro.py")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and "judging the saved outputs" in r.stdout, r.stdout + r.stderr
    # without kernel-parity at all: the script's own NumPy judge of the saved arrays
    sys.path.insert(0, str(bug))
    try:
        import importlib

        script = importlib.import_module("repro")
        assert script.judge_saved() == 1
    finally:
        sys.path.remove(str(bug))
        sys.modules.pop("repro", None)
    out = capsys.readouterr().out
    assert "OUT y[" in out and "verdict  fail" in out


# -- 8: exported arrays keep their own storage dtype, bit for bit --------------------------------
@pytest.mark.parametrize("name", sorted(dt.DTYPES))
def test_export_round_trip_of_every_dtype(name):
    from kernel_parity.conformance.repro import _pack, unpack

    d = dt.DTYPES[name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(5, 7 * d.np.itemsize), dtype=np.uint8)  # every bit pattern, odd width
    a = raw.view(d.np).reshape(5, 7)
    padded = np.concatenate([a, a[:, :3]], axis=1)[:, :7]  # a view into a wider buffer (row padding)
    for arr in (a, padded, a[0, 0].reshape(())):
        saved, entry = _pack(arr)
        assert entry["dtype"] == arr.dtype.name and saved.dtype.kind in "biufc"
        back = unpack(saved, entry)
        assert back.dtype == arr.dtype and back.shape == arr.shape and back.strides == arr.strides
        assert np.array_equal(np.ascontiguousarray(back).view(np.uint8), np.ascontiguousarray(arr).view(np.uint8))


@pytest.mark.parametrize("case_id", [
    "gemm.gemm_nt/torch/fp32/m=1,n=40,k=512,wfmt=fp8,bias=0/normal/seed=0",  # an fp8 weight (40, 512)
    "softmax.softmax/cpu/bf16/rows=3,n=113,pad=16/normal/seed=0",  # bf16 rows in a padded buffer
])
def test_an_export_rebuilds_the_kernel_inputs_bit_for_bit(tmp_path, capsys, case_id):
    from kernel_parity.conformance.repro import load_arrays

    assert main(["repro", case_id, "--export", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    case = ops.parse_case(case_id)
    want = Prepared(ops.get(case.op), case).inputs
    got = load_arrays(tmp_path / "e", "inputs")
    assert set(got) == set(want)
    from kernel_parity.conformance.inputs import same_bits

    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and got[k].strides == want[k].strides
        assert same_bits(got[k], want[k]), k


# -- 9: worst-element lists --------------------------------------------------------------------
def test_worst_elements_list_the_out_of_tolerance_ones_marked():
    ref = np.full(64, 1e-233)
    got = ref.copy()
    got[:10] += 1e-240  # tiny differences, far inside atol
    got[40] = 0.5  # the one failing element
    c = compare(got, ref, dt.get("fp64"), Limits(atol=1e-5, rtol=1e-5))
    assert [(w["index"], w["out"]) for w in c.worst] == [([40], True)]


# -- 10: the small things ------------------------------------------------------------------------
def test_an_unknown_op_suggests_the_near_name(capsys):
    assert "did you mean 'softmax.softmax'" in _usage_error(capsys, ["run", "--op", "sofmax.softmax"])
    assert "did you mean 'softmax.online_softmax'" in _usage_error(capsys, ["repro", CPU_CASE.replace(
        "softmax.softmax", "softmax.online_sofmax")])


def test_a_missing_suite_file_says_not_found(capsys):
    err = _usage_error(capsys, ["run", "--suite", "nosuch.toml"])
    assert "suite file 'nosuch.toml' not found" in err


def test_comma_lists_are_accepted(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["run", "--suite", "smoke", "--op", "softmax.softmax,combine", "--backend", "cpu,torch",
                 "--no-progress", "-q", "--json", str(out)]) == 0
    res = records.load(out)["results"]
    assert {r["backend"] for r in res} == {"cpu", "torch"}
    assert {r["op"] for r in res} == {"softmax.softmax", "combine.lse_combine", "combine.lse_combine_backward"}
    assert "empty item" in _usage_error(capsys, ["run", "--backend", "cpu,,torch"])


def _rec(case_id: str, verdict: str = "pass", norm_err: float = 0.1) -> dict:
    op, backend, dtype = case_id.split("/")[:3]
    return {"id": case_id, "op": op, "backend": backend, "dtype": dtype, "params": {}, "dist": "normal", "seed": 0,
            "verdict": verdict, "norm_err": norm_err, "outputs": {
                "o": {"dtype": dtype, "shape": [8], "exact": False,
                      "metrics": {"numel": 8, "max_abs": 1e-3, "cos_diff": 1e-7, "max_ulp": 1.0}}}}


def test_case_ids_wrap_only_after_slash_or_comma_and_plots_sit_in_a_grid():
    # ids rendered in the page (failure groups, skips) wrap server-side; those the script draws (a row's
    # details) go through its cid(), which tests/test_reports.py checks in a real browser
    recs = [_rec(f"attention.prefill/sdpa-cpu/fp16/b={i},s=17,h-x=2/normal/seed=0", *vn)
            for i, vn in enumerate([("fail", 3.0), ("pass", 0.1), ("pass", 0.2)])]
    page = html.render({"schema": records.SCHEMA, "header": {}, "results": recs})
    assert "<span>sdpa-cpu/</span><wbr>" in page and "<span>b=0,</span><wbr>" in page
    assert ".cid > span { white-space: nowrap; }" in page
    assert 'return "<span>" + esc(p) + "</span>";' in page and '}).join("<wbr>")' in page  # report.js cid()
    # a fixed grid: a row per op, a column per backend, every plot the same width
    assert re.search(r"\.plots \{ display: grid; grid-template-columns: \d+px repeat\(var\(--nb\), \d+px\)", page)
    assert '<div class="plots" style="--nb: 1">' in page and page.count("<svg") == 1
    assert "worst error divided by its limit" in page  # norm_err, explained where it is shown


def test_an_incomplete_report_shows_the_ops_not_reached_as_not_run():
    plan = {"softmax.softmax/cpu/fp32": 2, "combine.lse_combine/cpu/fp32": 3}
    doc = {"schema": records.SCHEMA, "header": {"planned": 5, "plan": plan},
           "results": [_rec("softmax.softmax/cpu/fp32/rows=1/normal/seed=0")], "complete": None}
    page = html.render(doc)
    assert '<th class="op">combine.lse_combine</th>' in page and "not run (3)" in page
    assert "1/1 · 1 not run" in page
    md = markdown.render(doc)
    assert "`combine.lse_combine`" in md and "not run (3)" in md


def test_cold_caches_are_warmed_and_said(tmp_path, monkeypatch, capsys):
    from kernel_parity.conformance.case import Case
    from kernel_parity.conformance.commands import warm_caches
    from kernel_parity.kernels.cpu import loader

    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.c").write_text("int tiny(void) { return 3; }\n")
    monkeypatch.setattr(loader, "SRC_DIR", src)
    monkeypatch.setenv("KERNEL_PARITY_CACHE", str(tmp_path / "cache"))
    cases = [Case.make("softmax.softmax", "cpu", "fp32", {"rows": 1, "n": 1, "pad": 0}, "normal", 0)]
    warm_caches(cases, 2)
    err = capsys.readouterr().err
    assert "first run with these sources here: compiled 1 C kernel libraries" in err and "later runs skip" in err
    warm_caches(cases, 2)
    assert capsys.readouterr().err == ""  # warm now: nothing said


@pytest.mark.parametrize("argv, flag", [
    (["run", "--suite", "ci", "--suite", "models"], "--suite"),
    (["gate", "--jobs", "2", "--jobs", "3"], "--jobs"),
    (["run", "--json", "a.jsonl", "--json", "b.jsonl"], "--json"),
    (["sweep", "--start", "1", "--start", "2"], "--start"),
])
def test_a_one_value_flag_given_twice_is_one_line_exit_2(argv, flag, capsys, tmp_path, monkeypatch):
    """Given twice, a flag that takes one value never silently keeps the last (a run of one suite
    that looks like a run of two)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {flag}: given twice" in err[0] and "it takes one value" in err[0]
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
