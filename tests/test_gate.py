"""Gate behaviour end to end through the CLI: every defect of a third-party backend is caught,
one bad case never stops the run, usage errors exit 2 with one line."""

import json

import pytest

from kernel_parity.reports import records
from kernel_parity.conformance.cli import main

SMOKE = ["--suite", "smoke", "--op", "softmax.softmax", "--no-progress", "-q"]


def gate(tmp_path, *extra):
    out = tmp_path / "r.json"
    code = main(["gate", *SMOKE, "--json", str(out), *extra])
    return code, records.load(out) if out.exists() else None


def test_good_third_party_backend_passes(tmp_path):
    code, doc = gate(tmp_path, "--backend", "tests.third_party:GOOD")
    assert code == 0
    assert {r["verdict"] for r in doc["results"]} == {"pass"}
    assert all("--backend tests.third_party:GOOD" in r["repro"] for r in doc["results"])


def test_backend_class_is_instantiated(tmp_path):
    code, doc = gate(tmp_path, "--backend", "tests.third_party:FactoryBackend")
    assert code == 0 and doc["results"][0]["backend"] == "np_class"


@pytest.mark.parametrize("name, verdict, kind, needle", [
    ("NOISY", "fail", "numeric", "elements outside"),
    ("UNWRITTEN", "fail", "structural", "never written"),
    ("OOB", "fail", "structural", "canary"),
    ("WRITES_INPUT", "fail", "structural", "wrote into input"),
    ("RAISES", "error", None, "RuntimeError: kernel launch failed"),
])
def test_broken_third_party_backend_fails_the_gate(tmp_path, name, verdict, kind, needle):
    code, doc = gate(tmp_path, "--backend", f"tests.third_party:{name}")
    assert code == 1
    results = doc["results"]
    assert len(results) == 6  # every case ran and was recorded despite the failures
    assert all(r["verdict"] == verdict and r["kind"] == kind for r in results)
    assert all(needle in (r["reason"] + (r["message"] or "")) for r in results)
    assert all(r["repro"].startswith("parity repro softmax.softmax/np_") for r in results)


def test_missing_max_subtraction_is_caught_on_large_logits(tmp_path):
    out = tmp_path / "r.json"
    code = main(["gate", "--suite", "ci", "--op", "softmax.softmax", "--dist", "large", "--dtype", "fp32",
                 "--backend", "tests.third_party:NO_MAX", "--no-progress", "-q", "--json", str(out)])
    assert code == 1
    verdicts = {r["verdict"] for r in records.load(out)["results"]}
    assert "fail" in verdicts


def test_crash_is_isolated_and_recorded(tmp_path):
    code, doc = gate(tmp_path, "--backend", "tests.third_party:CRASHES")
    assert code == 1
    assert len(doc["results"]) == 6
    assert {r["verdict"] for r in doc["results"]} == {"crash"}
    assert "exited with code 3" in doc["results"][0]["reason"]


def test_hang_is_a_timeout(tmp_path):
    out = tmp_path / "r.json"
    code = main(["gate", "--suite", "smoke", "--op", "softmax.softmax", "--dtype", "fp32", "--dist", "normal",
                 "--backend", "tests.third_party:HANGS", "--timeout", "2", "--no-progress", "-q", "--json", str(out)])
    assert code == 1
    (rec,) = records.load(out)["results"]
    assert rec["verdict"] == "timeout" and "2 s" in rec["reason"]


@pytest.mark.parametrize("argv, needle", [
    (["run", "--bogus"], "unrecognized arguments"),
    (["run", "--op", "nope"], "--op 'nope' matches no op"),
    (["run", "--backend", "nope"], "unknown backend 'nope'"),
    (["run", "--backend", "nomodule_xyz:OBJ"], "cannot import backend module"),
    (["run", "--backend", "tests.third_party:MISSING"], "has no attribute"),
    (["run", "--dtype", "fp128"], "unknown dtype 'fp128'"),
    (["run", "--dtype", "fp8"], "--dtype 'fp8' is no dtype of the selected ops"),
    (["run", "--suite", "nope"], "unknown suite 'nope'"),
    (["repro", "not-an-id"], "malformed case id"),
    (["repro", "softmax.softmax/torch/fp16/rows=0,n=4,pad=0/normal/seed=0"], "rows=0 is out of range"),
    (["repro", "softmax.softmax/torch/fp16/rows=1,n=4,pad=0,zz=1/normal/seed=0"], "no parameter 'zz'"),
    (["report", "missing.json", "--html", "x.html"], "does not exist"),
    (["diff", "a.json"], "the following arguments are required"),
])
def test_usage_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parity: error:") and needle in err
