"""Each tolerance layer on its own: what passes, what fails, and what the record says."""

import math

import numpy as np
import pytest

from conformance import dtypes as dt
from conformance.metrics import Limits
from conformance.tolerance import (DTYPE_DEFAULTS, Override, Tol, noise_layer, numeric_layer,
                                   zero_output_passes)
from conformance.metrics import compare

F16 = dt.get("fp16")


def test_limits_come_from_the_output_dtype_and_overrides_need_reasons():
    tol = Tol(overrides=(Override("LSE is an fp32 statistic", output="lse", rtol=1e-4),))
    assert tol.limits("y", F16, {}) == DTYPE_DEFAULTS["fp16"]
    assert tol.limits("lse", dt.get("fp32"), {}).rtol == 1e-4
    with pytest.raises(ValueError, match="reason"):
        Override("  ", rtol=1.0)


def test_accumulation_term_grows_with_reduction_length_not_numel():
    tol = Tol(acc_len=lambda p, out: p["n"])
    r_short = tol.limits("y", F16, {"n": 4, "rows": 10_000}).rtol
    r_long = tol.limits("y", F16, {"n": 4 * 64, "rows": 1}).rtol
    eps32 = dt.get("fp32").eps
    assert r_short == DTYPE_DEFAULTS["fp16"].rtol + eps32 * 2
    assert r_long == DTYPE_DEFAULTS["fp16"].rtol + eps32 * 16


def test_numeric_layer_elementwise_and_aggregates():
    lim = Limits(atol=0.0, rtol=1e-2, cos_diff=1e-4, nmse=None)  # a 5e-3 scaling has cos_diff ~ 1.25e-5
    ref = np.linspace(1, 2, 100)
    ok = compare((ref * (1 + 5e-3)).astype(np.float32), ref, dt.get("fp32"), lim)
    res, ratios = numeric_layer(ok.metrics, ok.elem_ratio, lim)
    assert res.ok and 0.4 < ratios["elementwise"] < 0.6
    bad = compare((ref * (1 + 2e-2)).astype(np.float32), ref, dt.get("fp32"), lim)
    res, ratios = numeric_layer(bad.metrics, bad.elem_ratio, lim)
    assert not res.ok and "100/100 elements outside" in res.detail and ratios["elementwise"] > 1


def test_cos_diff_limit_catches_a_systematic_error_inside_elementwise_tol():
    lim = Limits(atol=1.0, rtol=0.0, cos_diff=1e-6)
    ref = np.sin(np.arange(1000.0))
    got = (ref + 0.5 * np.cos(np.arange(1000.0))).astype(np.float32)  # every element within atol
    c = compare(got, ref, dt.get("fp32"), lim)
    res, _ = numeric_layer(c.metrics, c.elem_ratio, lim)
    assert c.metrics["mismatch"] == 0 and not res.ok and "cos_diff" in res.detail


def test_noise_layer_ratio_and_nonzero_floor():
    res, r = noise_layer(err=3e-3, baseline_err=1e-3, k=2.0, floor=5e-4)
    assert not res.ok and r["noise"] == 3e-3 / 2.5e-3
    res, r = noise_layer(err=4e-4, baseline_err=0.0, k=2.0, floor=5e-4)  # baseline exact: the floor decides
    assert res.ok
    tol = Tol()
    assert tol.noise_floor(F16, 0.0) > 0  # never zero, even for an all-zero golden
    assert tol.noise_floor(F16, 2.0) == 2.0 * F16.eps * 2.0


def test_trust_layer_flags_a_vacuous_reference():
    lim = Limits(atol=1e-5, rtol=1e-3)  # no aggregate limits
    assert zero_output_passes(1e-6, 1e-5, lim, has_nonzero=True)
    assert not zero_output_passes(1e-3, 1e-5, lim, has_nonzero=True)
    assert not zero_output_passes(0.0, 1e-5, lim, has_nonzero=False)  # zero is the right answer
    with_cos = Limits(atol=1e-5, rtol=1e-3, cos_diff=1e-5)
    assert not zero_output_passes(1e-6, 1e-5, with_cos, has_nonzero=True)  # cos_diff of 0 vs b is 1


def test_scale_aware_atol():
    lim = Limits(atol=0.0, rtol=0.0, atol_max_eps=4.0)
    ref = np.array([100.0, 1e-3])
    c = compare(np.array([100.0, 1e-3 + 0.05], dtype=np.float16), ref, F16, lim)
    assert c.metrics["atol_eff"] == 4.0 * F16.eps * 100.0 and c.metrics["mismatch"] == 0
    assert math.isclose(c.elem_ratio, abs(float(np.float16(1e-3 + 0.05)) - 1e-3) / c.metrics["atol_eff"])
