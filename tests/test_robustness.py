"""Nothing lost, nothing false: kernels that exit, crash or hang; runs killed from outside; output
paths that point somewhere odd; plugins whose hooks raise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_parity.conformance import suites
from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parent.parent
SOFTMAX_CI = ["--suite", "ci", "--op", "softmax.softmax", "--dtype", "fp32", "--dist", "normal", "--no-progress", "-q"]
N_SOFTMAX_CI = len(suites.cases("ci", suites.Filters(ops=("softmax.softmax",), backends=("cpu",), dtypes=("fp32",), dists=("normal",))))


def test_exit_segfault_and_hang_in_one_gate_run_are_their_cases_verdicts(tmp_path):
    out = tmp_path / "r.jsonl"
    code = main(["gate", *SOFTMAX_CI, "--backend", "tests.third_party:BY_CASE", "--timeout", "5", "--jobs", "2",
                 "--json", str(out)])
    assert code == 1
    doc = records.load(out)
    assert doc["complete"] is not None
    by_rows = {}
    for r in doc["results"]:
        by_rows.setdefault(r["params"]["rows"], []).append(r)
    assert len(doc["results"]) == N_SOFTMAX_CI  # every case of the selection, whatever happened to the others
    assert {r["verdict"] for r in by_rows[1]} == {"crash"}
    assert "exited with code 0" in by_rows[1][0]["reason"]  # exit(0) is never a pass
    assert {r["verdict"] for r in by_rows[4]} == {"crash"} and "SIGSEGV" in by_rows[4][0]["reason"]
    assert {r["verdict"] for r in by_rows[5]} == {"timeout"}
    rest = [r for rows, rs in by_rows.items() if rows not in (1, 4, 5) for r in rs]
    assert rest and {r["verdict"] for r in rest} == {"pass"}


def test_sys_exit_in_process_is_an_error_not_the_end_of_the_run(tmp_path):
    out = tmp_path / "r.jsonl"
    code = main(["run", "--suite", "smoke", "--op", "softmax.softmax", "--no-progress", "-q", "--no-isolate",
                 "--backend", "tests.third_party:SYS_EXIT", "--json", str(out)])
    assert code == 1
    doc = records.load(out)
    assert {r["verdict"] for r in doc["results"]} == {"error"} and len(doc["results"]) == 6
    assert "SystemExit" in doc["results"][0]["reason"]


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_a_killed_run_is_incomplete_and_resume_completes_it(tmp_path):
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KP_TEST_SLOW_S": "0.4"}
    argv = [sys.executable, "-m", "kernel_parity.conformance.cli", "run", *SOFTMAX_CI, "--backend", "tests.third_party:SLOW",
            "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while _lines(out) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the outer CI timeout: the whole process group, no cleanup
    proc.wait()
    doc = records.load(out)
    done = len(doc["results"])
    assert doc["complete"] is None and 3 <= done < N_SOFTMAX_CI
    assert records.status_line(doc) == f"incomplete: {done} of {N_SOFTMAX_CI} cases (the run did not finish)"
    html = tmp_path / "r.html"
    assert main(["report", str(out), "--html", str(html)]) == 1  # an incomplete file never passes
    page = html.read_text()
    assert f"incomplete: {done} of {N_SOFTMAX_CI} cases" in page and 'class="badge FAIL"' in page
    code = subprocess.run([sys.executable, "-m", "kernel_parity.conformance.cli", "run", "--resume", str(out), "--no-progress",
                           "-q"], cwd=tmp_path, env={**env, "KP_TEST_SLOW_S": "0"}, capture_output=True, text=True)
    assert code.returncode == 0, code.stderr
    doc = records.load(out)
    assert doc["complete"] is not None and doc["complete"]["cases"] == N_SOFTMAX_CI
    assert len(doc["results"]) == N_SOFTMAX_CI and {r["verdict"] for r in doc["results"]} == {"pass"}
    assert main(["report", str(out), "--html", str(html)]) == 0


def test_resume_refuses_a_finished_file_and_a_new_selection(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(out)]) == 2
    assert "is complete: nothing to resume" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--suite", "smoke"]) == 2
    assert "drop --suite" in capsys.readouterr().err


# -- output paths ----------------------------------------------------------------------------------
def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parity: error:"), err
    return err


@pytest.mark.parametrize("make, needle", [
    (lambda d: d, "is a directory, expected a file path"),
    (lambda d: d / "plain.txt" / "r.jsonl", "is not a directory"),
    (lambda d: "", "needs a file path"),
])
def test_unwritable_outputs_are_exit_2_before_the_run(tmp_path, capsys, make, needle):
    (tmp_path / "plain.txt").write_text("a file, not a directory")
    t0 = time.monotonic()
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--json", str(make(tmp_path))]) == 2
    assert needle in _err_line(capsys)
    assert time.monotonic() - t0 < 5  # refused before any case ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt"]  # and wrote nothing


def test_an_output_never_overwrites_an_input(tmp_path, capsys):
    base = tmp_path / "base.jsonl"
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--json", str(base)]) == 0
    capsys.readouterr()
    before = base.read_bytes()
    assert main(["gate", *SOFTMAX_CI, "--backend", "cpu", "--baseline", str(base), "--json", str(base)]) == 2
    assert "an output never overwrites an input" in _err_line(capsys)
    assert main(["report", str(base), "--html", str(base)]) == 2
    assert "an output never overwrites an input" in _err_line(capsys)
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--html", str(tmp_path / "a"), "--md", str(tmp_path / "a")]) == 2
    assert "name the same file" in _err_line(capsys)
    assert base.read_bytes() == before


def test_writers_write_through_symlinks_and_into_devices(tmp_path):
    target = tmp_path / "real.md"
    target.write_text("old")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    json_target = tmp_path / "real.jsonl"
    json_link = tmp_path / "link.jsonl"
    json_link.symlink_to(json_target)
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--md", str(link), "--json", str(json_link),
                 "--junit", os.devnull]) == 0
    assert link.is_symlink() and json_link.is_symlink()  # the links stay, their targets are written
    assert target.read_text().startswith("### kernel-parity")
    assert records.load(json_target)["complete"]["cases"] == N_SOFTMAX_CI
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()  # the device is still a device


# -- plugins -------------------------------------------------------------------------------------
@pytest.mark.parametrize("obj, needle", [
    ("NAMED_TRITON", "is named 'triton', the name of a built-in backend"),
    ("FACTORY_RAISES", "its factory raised RuntimeError: cannot open the device"),
])
def test_bad_plugins_are_exit_2_with_one_line(capsys, obj, needle):
    assert main(["run", "--suite", "smoke", "--backend", f"tests.third_party:{obj}"]) == 2
    assert needle in _err_line(capsys)


@pytest.mark.parametrize("obj, needle", [
    ("SUPPORTS_RAISES", "supports() raised KeyError"),
    ("AVAILABLE_RAISES", "available() raised RuntimeError: driver query failed"),
])
def test_a_raising_plugin_hook_is_that_cases_error(tmp_path, obj, needle):
    out = tmp_path / "r.jsonl"
    assert main(["run", "--suite", "smoke", "--op", "softmax.softmax", "--no-progress", "-q",
                 "--backend", f"tests.third_party:{obj}", "--json", str(out)]) == 1
    res = records.load(out)["results"]
    assert len(res) == 6 and {r["verdict"] for r in res} == {"error"}
    assert all(needle in r["reason"] for r in res)


def test_outside_contract_rows_and_preconditions(tmp_path):
    def run(obj):
        out = tmp_path / f"{obj}.jsonl"
        code = main(["run", "--suite", "ci", "--op", "softmax.softmax", "--dtype", "fp32", "--dist", "masked",
                     "--no-progress", "-q", "--backend", f"tests.third_party:{obj}", "--json", str(out)])
        return code, records.load(out)["results"]

    code, res = run("CONTRACT")
    assert code == 0 and {r["verdict"] for r in res} == {"pass"}
    excluded = [r["outputs"]["y"].get("outside_contract") for r in res]
    assert all(e and e["elements"] >= 1 and "no finite logit" in e["reason"] for e in excluded)
    code, res = run("NO_CONTRACT")  # the same kernel without the declaration fails structurally
    assert code == 1 and {r["verdict"] for r in res} == {"fail"}
    code, res = run("PRECONDITION")
    skipped = [r for r in res if r["verdict"] == "skip"]
    assert skipped and all(r["reason"] == "precondition: the kernel needs unpadded rows" for r in skipped)
    assert all(r["params"]["pad"] for r in skipped)
    assert code == 0 and {r["verdict"] for r in res if not r["params"]["pad"]} == {"pass"}
