"""The pytest plugin: reports from a pytest run, and a failing hypothesis example names its case."""

import json
from pathlib import Path

from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parent.parent

TEST_FILE = '''
from hypothesis import given, settings
from kernel_parity.property_tests.strategies import cases


@settings(max_examples=4, derandomize=True, database=None, deadline=None)
@given(case=cases("softmax.softmax", "cpu", rows=(1, 3), n=(1, 50), dtypes=("fp16",)))
def test_cpu(parity, case):
    parity.check(case)


@settings(max_examples=4, derandomize=True, database=None, deadline=None)
@given(case=cases("softmax.softmax", "np_noisy", rows=(1, 3), n=(1, 50), dtypes=("fp16",), dists=("normal",)))
def test_noisy(parity, case):
    parity.check(case)
'''


def test_plugin_writes_reports_and_failures_name_their_case(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_kernels=TEST_FILE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--parity-backend", "tests.third_party:NOISY",
        "--parity-json", "r.json", "--parity-html", "r.html", "--parity-junit", "r.xml")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "repro: parity repro softmax.softmax/np_noisy/fp16/" in out
    assert "case softmax.softmax/np_noisy/fp16/rows=1,n=2,pad=0/normal/seed=0" in out  # shrunk to the smallest
    assert "kernel-parity:" in out and "-> r.json, r.html, r.xml" in out
    doc = records.load(pytester.path / "r.json")
    verdicts = {r["backend"]: set() for r in doc["results"]}
    for r in doc["results"]:
        verdicts[r["backend"]].add(r["verdict"])
    assert verdicts["cpu"] == {"pass"} and "fail" in verdicts["np_noisy"]
    # Only final examples are records: the shrunk failing example, not the shrinking steps.
    noisy_fails = [r["id"] for r in doc["results"] if r["backend"] == "np_noisy" and r["verdict"] == "fail"]
    assert noisy_fails == ["softmax.softmax/np_noisy/fp16/rows=1,n=2,pad=0/normal/seed=0"]
    assert (pytester.path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_plugin_is_inert_without_options(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_plain="def test_x():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "kernel-parity:" not in result.stdout.str()


PINNED_TEST = '''
import json, os
from hypothesis import given, strategies as st
from kernel_parity.conformance import profiles

profiles.load("ci")
if os.environ.get("KP_EXTRA_MODULE"):
    import extra_constants  # noqa: F401  (a local module full of constants, as a bigger selection imports)


@given(st.integers(0, 10**9), st.floats(-1e6, 1e6), st.text(max_size=5))
def test_draws(x, y, z):
    with open("draws.jsonl", "a") as f:
        f.write(json.dumps([x, y, z]) + "\\n")
'''


def test_ci_profile_draws_the_same_examples_whatever_else_is_imported(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    consts = "\n".join(f"C{i} = {123456789 + 7919 * i}\nF{i} = {i}.{i}25e3\nS{i} = 'kp{i}'" for i in range(300))
    pytester.makepyfile(test_pinned=PINNED_TEST, extra_constants=consts)
    draws = []
    for extra in ("", "1"):
        monkeypatch.setenv("KP_EXTRA_MODULE", extra)
        (pytester.path / "draws.jsonl").unlink(missing_ok=True)
        pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
        draws.append((pytester.path / "draws.jsonl").read_text())
    assert draws[0] == draws[1] and draws[0].count("\n") >= 30


def test_property_tests_run_against_a_plugin_backend(pytester, monkeypatch):
    """`pytest property_tests --parity-backend module:object`: every property test takes the plugin
    instead of our backends; tests of ops it lacks are skipped whole, and its defect is caught."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("PARITY_PROFILE", "ci")
    result = pytester.runpytest_subprocess(
        str(ROOT / "property_tests" / "test_softmax.py"), str(ROOT / "property_tests" / "test_combine.py"),
        "-p", "no:cacheprovider", "--parity-backend", "tests.third_party:NOISY", "-v", "-rs", "--rootdir", str(ROOT))
    out = result.stdout.str()
    assert "test_softmax[np_noisy] FAILED" in out
    assert "[triton]" not in out and "[cpu]" not in out  # the plugin replaces our backends
    assert "test_online_softmax[np_noisy] SKIPPED" in out  # an op it has no kernel for: skipped whole
    # and the skip says why (-rs: the short summary's reasons; that op's, not online_softmax_backward's)
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert any(line.endswith("np_noisy has no kernel for softmax.online_softmax") for line in reasons), reasons
    good = pytester.runpytest_subprocess(
        str(ROOT / "property_tests" / "test_softmax.py") + "::test_softmax", "-p", "no:cacheprovider",
        "--rootdir", str(ROOT), "--parity-backend", "tests.third_party:GOOD", "-v")
    good.assert_outcomes(passed=1)
    assert "test_softmax[np_good] PASSED" in good.stdout.str()


ONE_DTYPE_TEST = '''
from hypothesis import assume, given, settings
from kernel_parity.property_tests.strategies import cases


@settings(max_examples=4, derandomize=True, database=None, deadline=None)
@given(case=cases("softmax.softmax", "np_bf16_only", rows=(1, 3), n=(1, 50), dtypes=DTYPES))
def test_rows(parity, case):
    rec, _ = parity.arrays(case)
    assume(rec.verdict != "skip")  # a draw the backend has no path for: draw another
'''


def test_a_property_whose_every_draw_the_plugin_does_not_run_is_skipped_with_its_reason(pytester, monkeypatch):
    """A plugin that runs some dtypes of an op (gluon's GEMM: FP8 into bf16 / fp16) against a property drawn
    in another (fp32): a skip naming the backend's reason, not Hypothesis' Unsatisfiable; a property with
    one draw it runs is judged as before."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_fp32=ONE_DTYPE_TEST.replace("DTYPES", '("fp32",)'),
                        test_mixed=ONE_DTYPE_TEST.replace("DTYPES", '("fp32", "bf16")'))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs",
                                           "--parity-backend", "tests.third_party:BF16_ONLY")
    result.assert_outcomes(passed=1, skipped=1)
    out = result.stdout.str()
    assert "every case this test drew is one the backend does not run" in out and "fp32" in out
    assert "Unsatisfiable" not in out


def test_a_plugin_of_triton_kernels_gets_the_interpreter_preparation(tmp_path):
    """Our unmodified Triton prefill, wrapped by a plain plugin: declared (triton = True) it passes
    every bf16 ci case on a CPU; undeclared, the interpreter's bf16 defects fail them all."""
    from kernel_parity.conformance.backends._torch import cuda_available
    from kernel_parity.conformance.cli import main

    if cuda_available():
        import pytest

        pytest.skip("a GPU is present: the interpreter is not used")
    common = ["run", "--suite", "ci", "--op", "attention.prefill", "--dtype", "bf16", "--no-progress", "-q",
              "--jobs", "2"]
    out = tmp_path / "declared.jsonl"
    assert main(common + ["--backend", "tests.third_party:TRITON_PLUGIN", "--json", str(out)]) == 0
    res = records.load(out)["results"]
    assert len(res) >= 24 and {r["verdict"] for r in res} == {"pass"}
    out = tmp_path / "plain.jsonl"
    assert main(common + ["--backend", "tests.third_party:UNDECLARED_TRITON_PLUGIN", "--json", str(out)]) == 1
    assert {r["verdict"] for r in records.load(out)["results"]} == {"fail"}
