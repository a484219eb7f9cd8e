"""Metrics against values computed by hand."""

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.metrics import Limits, compare, exact_mismatch

F32 = dt.get("fp32")


def test_cos_diff_nmse_rmse_by_hand():
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    b = np.array([1.0, 2.0, 4.0])
    m = compare(a, b, F32, Limits(atol=0.0, rtol=0.0)).metrics
    # sum(a b) = 1 + 4 + 12 = 17; sum(a^2 + b^2) = 14 + 21 = 35
    assert m["cos_diff"] == 1.0 - 2.0 * 17.0 / 35.0
    # sum (a - b)^2 = 1; sum b^2 = 21
    assert m["nmse"] == 1.0 / 21.0
    assert m["rmse"] == math.sqrt(1.0 / 3.0)
    assert m["max_abs"] == 1.0
    assert m["max_rel"] == 0.25
    assert m["mismatch"] == 1


def test_identical_tensors_have_zero_error_even_when_zero():
    z = np.zeros(4, dtype=np.float32)
    m = compare(z, np.zeros(4), F32, Limits(atol=1e-5, rtol=0.0)).metrics
    assert m["cos_diff"] == 0.0 and m["nmse"] == 0.0 and m["max_abs"] == 0.0


def test_cos_diff_is_scale_free():
    b = np.array([1e-7, -2e-7, 3e-7])
    a = (b * (1 + 1e-3)).astype(np.float32)
    small = compare(a, b, F32, None).metrics["cos_diff"]
    big = compare((b * 1e7 * (1 + 1e-3)).astype(np.float32), b * 1e7, F32, None).metrics["cos_diff"]
    assert small < 1e-6 and big < 1e-6  # FlashMLA's 1e-12 clamp would give ~1 for the small one


def test_ulp_distance_by_hand():
    one = np.float32(1.0)
    nxt = np.nextafter(one, np.float32(2.0))
    three_up = np.nextafter(np.nextafter(nxt, np.float32(2)), np.float32(2))
    m = compare(np.array([nxt, three_up], dtype=np.float32), np.array([1.0, 1.0]), F32, None).metrics
    assert m["max_ulp"] == 3.0
    # across zero: -0 and +0 are the same number; the smallest subnormals are 2 ulps apart
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    m = compare(np.array([-tiny], dtype=np.float32), np.array([float(tiny)]), F32, None).metrics
    assert m["max_ulp"] == 2.0


def test_ulp_bfloat16_rounds_golden_first():
    bf = dt.get("bf16")
    got = np.array([1.0], dtype=ml_dtypes.bfloat16)
    # 1 + 2^-9 rounds (to nearest even) to 1.0 in bf16: distance 0
    assert compare(got, np.array([1.0 + 2.0**-9]), bf, None).metrics["max_ulp"] == 0.0
    assert compare(got, np.array([1.0 + 2.0**-7]), bf, None).metrics["max_ulp"] == 1.0


def test_anomaly_positions_must_match():
    a = np.array([np.nan, 1.0, -np.inf, np.inf], dtype=np.float32)
    b = np.array([np.nan, 1.0, -np.inf, 5.0])
    c = compare(a, b, F32, Limits(atol=0.0, rtol=0.0))
    assert c.anomaly_mismatch == 1
    assert "+inf" in c.anomaly_detail and "expected finite" in c.anomaly_detail
    assert c.worst[0]["index"] == [3]  # anomalies are listed first
    assert c.metrics["max_abs"] == 0.0  # values compare only where both are finite


def test_worst_elements_are_ordered_by_error_over_limit():
    b = np.array([1.0, 100.0, 0.0, 2.0])
    a = np.array([1.1, 100.5, 0.0, 2.0], dtype=np.float32)
    c = compare(a, b, F32, Limits(atol=0.0, rtol=1e-2))
    # |d|/(rtol |b|): 0.1/0.01 = 10 at index 0 (out), 0.5/1 = 0.5 at index 1 (within: not listed
    # beside an element that is out)
    assert [(w["index"], w["out"]) for w in c.worst] == [([0], True)]
    assert c.elem_ratio == float(np.float32(1.1) - 1.0) / 0.01
    # nothing out: the elements nearest their limit, each marked within
    c = compare(a, b, F32, Limits(atol=0.0, rtol=2e-1))
    assert [(w["index"], w["out"]) for w in c.worst] == [([0], False), ([1], False)]


def test_exact_mismatch_compares_bits():
    a = np.array([1, 2, 3], dtype=np.uint8)
    n, worst = exact_mismatch(a, np.array([1, 2, 4]))
    assert n == 1 and worst[0]["index"] == [2] and worst[0]["got"] == 3
    # -0.0 and +0.0 are equal numbers but different bits
    n, _ = exact_mismatch(np.array([-0.0], dtype=np.float32), np.array([0.0]))
    assert n == 1


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 3 * 8192 + 5])
def test_dot_is_blockwise_exact_enough_at_every_length(n):
    """metrics._dot (the sums behind rmse, nmse and cos_diff, independent of the BLAS thread count) is
    the exactly rounded dot product to float64 precision at lengths around its block."""
    from kernel_parity.conformance.metrics import _dot

    rng = np.random.default_rng(n)
    x, y = rng.standard_normal(n), rng.standard_normal(n)
    exact = math.fsum((x.astype(object) * y.astype(object)).tolist()) if n else 0.0
    scale = float(np.abs(x) @ np.abs(y)) if n else 0.0
    assert abs(_dot(x, y) - exact) <= 1e-14 * scale
