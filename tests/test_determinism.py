"""Run-to-run determinism (issue 31): a borderline case is re-run on its own inputs; a backend that
claims determinism (`Backend.deterministic`: ours, triton and cpu) fails with kind `determinism` when
the bits differ, any other backend gets the difference recorded and the fresh seeds decide."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.backends import Backend, Registry
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.runner import Prepared, Runner

CASE = "softmax.softmax/{}/fp32/rows=3,n=40,pad=0/normal/seed=5"


def _kernel(jitter: bool):
    calls = [0]

    def run(case, inputs, out):
        x = inputs["x"].astype(np.float64)
        y = np.exp(x - x.max(axis=-1, keepdims=True))
        y /= y.sum(axis=-1, keepdims=True)
        calls[0] += 1
        if jitter:  # one ulp on one element, every other call: a reduction order that depends on scheduling
            y.flat[0] = np.nextafter(np.float32(y.flat[0]), np.float32(1)) if calls[0] % 2 else y.flat[0]
        res = out.numpy("y")
        res[...] = y.astype(np.float32)
        return {"y": res}
    return run


def _recheck(name: str, jitter: bool, deterministic: bool) -> CaseResult:
    be = Backend(name=name, ops={"softmax.softmax": _kernel(jitter)}, dtypes=("fp32",), deterministic=deterministic)
    reg = Registry()
    reg._cache[name] = be  # a backend object in hand (a plugin module would name it module:object)
    runner = Runner(reg)
    case = ops.parse_case(CASE.format(name))
    rec = runner.evaluate(case)
    assert rec.verdict == "pass" and rec.recheck is None  # far from its limits: no recheck
    prep = Prepared(runner.spec(case.op), case)
    rec = dataclasses.replace(rec, norm_err=1.0)  # as if within the borderline band
    return runner._recheck(case, rec, prep)


def test_a_deterministic_claim_with_differing_bits_fails():
    rec = _recheck("ex_jitter_det", jitter=True, deterministic=True)
    assert (rec.verdict, rec.kind) == ("fail", "determinism")
    assert "y (1 of 120 elements)" in rec.reason and "claims run-to-run determinism" in rec.reason


@pytest.mark.parametrize("jitter", [False, True])
def test_without_the_claim_the_difference_is_recorded(jitter):
    rec = _recheck(f"ex_jitter_{jitter}", jitter=jitter, deterministic=False)
    assert rec.verdict == "pass" and rec.recheck["verdicts"] == ["pass"] * 3
    assert rec.recheck["same_inputs"] == ("y (1 of 120 elements)" if jitter else "bit-identical")


def test_a_deterministic_kernel_keeps_its_verdict():
    rec = _recheck("ex_steady", jitter=False, deterministic=True)
    assert rec.verdict == "pass" and rec.recheck["same_inputs"] == "bit-identical"


def test_ours_claim_determinism():
    reg = Registry()
    assert reg.get("cpu").deterministic and reg.get("triton").deterministic
    assert not reg.get("torch").deterministic


def test_the_determinism_flag_checks_every_case(monkeypatch):
    """--determinism (KERNEL_PARITY_DETERMINISM=1): a case far from its limits is checked too."""
    monkeypatch.setenv("KERNEL_PARITY_DETERMINISM", "1")
    for name, jitter, det, want in (("ex_d1", True, True, ("fail", "determinism")), ("ex_d2", True, False, ("pass", None)),
                                    ("ex_d3", False, True, ("pass", None))):
        be = Backend(name=name, ops={"softmax.softmax": _kernel(jitter)}, dtypes=("fp32",), deterministic=det)
        reg = Registry()
        reg._cache[name] = be
        rec = Runner(reg).evaluate(ops.parse_case(CASE.format(name)))
        assert (rec.verdict, rec.kind) == want
        assert rec.recheck["same_inputs"] == ("y (1 of 120 elements)" if jitter else "bit-identical")


def test_the_flag_reaches_the_workers(tmp_path):
    from kernel_parity.conformance.cli import main

    out = tmp_path / "r.jsonl"
    assert main(["run", "--op", "softmax.softmax", "--backend", "cpu", "--dtype", "fp32", "--suite", "smoke",
                 "--determinism", "--jobs", "1", "--no-progress", "-q", "--json", str(out)]) == 0
    from kernel_parity.reports import records

    recs = records.load(str(out))["results"]
    assert recs and all(r["recheck"]["same_inputs"] == "bit-identical" for r in recs)
