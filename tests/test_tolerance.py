"""Each tolerance layer on its own: what passes, what fails, and what the record says."""

import math

import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.metrics import Limits
from kernel_parity.conformance.tolerance import (AGG_FLOOR, DTYPE_DEFAULTS, Override, Tier, Tol, aggregate_limits, noise_layer,
                                   numeric_layer, zero_output_passes)
from kernel_parity.conformance.metrics import compare

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


def test_an_all_zero_golden_has_finite_ratios_when_it_passes():
    """dq of rows that see one key is exactly 0: a kernel's 5e-7 there passes elementwise, no nmse can be judged
    (limit inf), and the case's norm_err must say how close it came (was inf: inf / inf, on an H200 sweep)."""
    lim = Limits(atol=1e-5, rtol=1e-3, cos_diff=1e-6, nmse=2e-6)
    got = np.full(64, 4.8e-7, dtype=np.float32)
    c = compare(got, np.zeros(64), dt.get("fp32"), lim)
    res, ratios = numeric_layer(c.metrics, c.elem_ratio, lim)
    assert res.ok and all(math.isfinite(r) for r in ratios.values()) and ratios["nmse"] == 0.0
    assert 0.0 < max(ratios.values()) < 1.0  # the elementwise ratio, 4.8e-7 / 1e-5


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
    assert tol.noise_floor(F16, 1e-9, atol=1e-5) == AGG_FLOOR * 1e-5  # the absolute floor


def test_noise_floor_carries_the_fp32_accumulation_allowance():
    tol = Tol(acc_len=lambda p, out: p["n"])
    f32 = dt.get("fp32")
    assert tol.noise_floor(f32, 1.0, 0.0, {"n": 256}, "o") == 2.0 * (f32.eps + f32.eps * 16) * 1.0
    assert tol.noise_floor(F16, 1.0, 0.0, {"n": 256}, "o") == 2.0 * (F16.eps + f32.eps * 16) * 1.0


def test_aggregate_limits_have_an_absolute_floor():
    """One LSE value off by 3e-8 against atol 1e-5: elementwise passes by 300x, and so must the
    aggregates (without the floor its cos_diff of 1.3e-11 fails the fp32 limit of 1e-12)."""
    f32 = dt.get("fp32")
    lim = DTYPE_DEFAULTS["fp32"]
    ref = np.array([-0.005891263484954834])
    c = compare(np.array([-0.005891233682632446], dtype=np.float32), ref, f32, lim)
    assert c.metrics["cos_diff"] > lim.cos_diff and c.elem_ratio < 0.01
    res, _ = numeric_layer(c.metrics, c.elem_ratio, lim)
    assert res.ok
    cos, nmse = aggregate_limits(c.metrics, lim)
    assert cos > lim.cos_diff and nmse > lim.nmse
    # At unit scale the floor is far below the declared limits: they stay in force.
    big = np.linspace(-2, 2, 1000)
    c = compare((big * (1 + 1e-5)).astype(np.float32), big, f32, lim)
    assert aggregate_limits(c.metrics, lim) == (lim.cos_diff, lim.nmse)
    res, _ = numeric_layer(c.metrics, c.elem_ratio, lim)
    assert not res.ok and "cos_diff" in res.detail


def test_tiers_are_declared_with_reasons_and_only_loosen_the_baseline():
    base = Tier("eager rounds its logits", overrides=(Override("eager bf16", dtype="bf16", cos_diff=2.5e-4),))
    tol = Tol(overrides=(Override("FlashMLA", dtype="bf16", cos_diff=1e-5),), baseline=base)
    bf16 = dt.get("bf16")
    assert tol.limits("o", bf16, {}).cos_diff == 1e-5
    assert tol.limits("o", bf16, {}, "production").cos_diff == 1e-5
    assert tol.limits("o", bf16, {}, "baseline").cos_diff == 2.5e-4
    with pytest.raises(ValueError, match="reason"):
        Tier(" ")
    with pytest.raises(ValueError, match="unknown tolerance tier"):
        tol.limits("o", bf16, {}, "lenient")


def test_a_dtype_without_default_limits_is_an_error_not_limits_of_zero():
    with pytest.raises(KeyError, match="no default limits for output dtype 'int32'"):
        Tol().limits("y", dt.get("int32"), {})


def test_trust_layer_flags_a_vacuous_reference():
    lim = Limits(atol=1e-5, rtol=1e-3)  # no aggregate limits
    assert zero_output_passes(1e-6, 1e-5, lim, has_nonzero=True)
    assert not zero_output_passes(1e-3, 1e-5, lim, has_nonzero=True)
    assert not zero_output_passes(0.0, 1e-5, lim, has_nonzero=False)  # zero is the right answer
    with_cos = Limits(atol=1e-5, rtol=1e-3, cos_diff=1e-5)
    assert not zero_output_passes(1e-6, 1e-5, with_cos, has_nonzero=True)  # cos_diff of 0 vs b is 1
    assert not zero_output_passes(1e-6, 1e-5, with_cos, True, rms_ref=5e-6)
    assert zero_output_passes(1e-6, 1e-5, with_cos, True, rms_ref=5e-7)  # under the aggregates' floor


def test_scale_aware_atol():
    lim = Limits(atol=0.0, rtol=0.0, atol_max_eps=4.0)
    ref = np.array([100.0, 1e-3])
    c = compare(np.array([100.0, 1e-3 + 0.05], dtype=np.float16), ref, F16, lim)
    assert c.metrics["atol_eff"] == 4.0 * F16.eps * 100.0 and c.metrics["mismatch"] == 0
    assert math.isclose(c.elem_ratio, abs(float(np.float16(1e-3 + 0.05)) - 1e-3) / c.metrics["atol_eff"])
