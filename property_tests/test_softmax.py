"""Property tests of the softmax family: every kernel vs the golden, and invariants.

Kernel tests draw whole cases (shape, dtype, distribution, seed) from the spec, so a failing
example prints a case id and its `parity repro` line. Shapes stay small: the Triton kernels
run through the interpreter on CI.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernel_parity.refimpl.softmax as ref
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(rows=(1, 6), n=(1, 700))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("softmax.softmax", **SMALL))
def test_softmax(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("softmax.online_softmax", **SMALL))
def test_online_softmax(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("softmax.softmax", dists=("grid",), **SMALL))
def test_softmax_shift_invariance_bitwise(parity, backend, case):
    """softmax(x + 16) == softmax(x) bit for bit when x and x + 16 are exact: the kernel subtracts the max."""
    case = case.with_backend(backend)
    shifted = ops.make_case(case.op, backend, case.dtype, case.p, "grid_shift16", case.seed)
    rec, a = parity.arrays(case)
    rec_s, b = parity.arrays(shifted)
    if rec.verdict == "skip":
        pytest.skip(rec.reason)
    assert np.array_equal(a["inputs"]["x"].astype(np.float64) + 16, b["inputs"]["x"].astype(np.float64))
    ya, yb = a["outputs"]["y"], b["outputs"]["y"]
    diff = np.flatnonzero(ya.view(np.uint8) != yb.view(np.uint8))
    assert diff.size == 0, (f"{backend} softmax changed under a +16 shift at {diff.size} bytes\n"
                            f"  repro: {rec.repro}\n  repro: {rec_s.repro}")


def _golden_close(got, want, what):
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


@st.composite
def golden_logits(draw):
    """float64 logits of a spec distribution (the golden self-tests need no dtype rounding)."""
    from kernel_parity.conformance.ops.softmax import logits

    rows, n = draw(st.integers(1, 5), label="rows"), draw(st.integers(1, 300), label="n")
    dist = draw(st.sampled_from(["normal", "masked", "large", "neg_large"]), label="dist")
    return logits(np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed")), rows, n, dist)


@given(x=golden_logits(), c=st.floats(-1e3, 1e3))
def test_golden_softmax_shift_invariance(x, c):
    _golden_close(ref.softmax(x + c), ref.softmax(x), "softmax(x + c) vs softmax(x)")


@given(x=golden_logits(), tile=st.integers(1, 400))
def test_golden_online_softmax_matches_textbook(x, tile):
    y, lse = ref.online_softmax(x, tile)
    _golden_close(y, ref.softmax(x), f"online_softmax(tile={tile}).y vs softmax")
    _golden_close(lse, ref.logsumexp(x), f"online_softmax(tile={tile}).lse vs logsumexp")


def test_golden_all_neginf_row():
    x = np.full((2, 7), -np.inf)
    x[1, 3] = 2.0
    y = ref.softmax(x)
    assert np.array_equal(y[0], np.zeros(7)) and y[1, 3] == 1.0
    assert ref.logsumexp(x)[0] == -np.inf and ref.logsumexp(x)[1] == 2.0
    yo, lse = ref.online_softmax(x, 3)
    assert np.array_equal(yo, y) and lse[0] == -np.inf
