"""The pytest plugin: reports from a pytest run, and a failing hypothesis example names its case."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEST_FILE = '''
from hypothesis import given, settings
from property_tests.strategies import cases


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
    doc = json.loads((pytester.path / "r.json").read_text())
    verdicts = {r["backend"]: set() for r in doc["results"]}
    for r in doc["results"]:
        verdicts[r["backend"]].add(r["verdict"])
    assert verdicts["cpu"] == {"pass"} and "fail" in verdicts["np_noisy"]
    assert (pytester.path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_plugin_is_inert_without_options(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_plain="def test_x():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "kernel-parity:" not in result.stdout.str()
