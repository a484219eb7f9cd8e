"""Property tests of the split-KV merge: every kernel vs the golden, and its invariants.

- combining one split returns that split, bit for bit (weight exp(0) = 1, LSE + ln 1 = LSE);
- the result does not depend on the order of the splits (kernel vs kernel, within the op's limits);
- the golden merge of the states of any partition of a row equals attending over the whole row.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernel_parity.refimpl.combine as ref
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(splits=(1, 20), rows=(1, 40), dv=(1, 160))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("combine.lse_combine", **SMALL))
def test_lse_combine(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("combine.lse_combine", splits=(1, 1), rows=(1, 40), dv=(1, 160), dists=("normal", "spread", "neg_large")))
def test_combine_of_one_split_is_that_split(parity, backend, case):
    rec, a = parity.arrays(case.with_backend(backend))
    if rec.verdict == "skip":
        pytest.skip(rec.reason)
    o_in, lse_in = a["inputs"]["o_parts"][0], a["inputs"]["lse_parts"][0]
    o, lse = a["outputs"]["o"], a["outputs"]["lse"]
    assert np.array_equal(o.view(np.uint8), np.ascontiguousarray(o_in).view(np.uint8)), (
        f"O of a one-split combine differs from the split's O\n  repro: {rec.repro}")
    assert np.array_equal(lse.view(np.uint32), np.ascontiguousarray(lse_in).view(np.uint32)), (
        f"LSE of a one-split combine differs from the split's LSE\n  repro: {rec.repro}")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("combine.lse_combine", splits=(2, 20), rows=(1, 20), dv=(1, 130)), perm_seed=st.integers(0, 2**32 - 1))
def test_combine_independent_of_split_order(parity, backend, case, perm_seed):
    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    if rec.verdict == "skip":
        pytest.skip(rec.reason)
    perm = np.random.default_rng(perm_seed).permutation(case.p["splits"])
    permuted = {k: np.ascontiguousarray(v[perm]) for k, v in a["inputs"].items()}
    runs.assert_close(case, runs.run(case, permuted), a["outputs"], f"the splits were permuted by {perm.tolist()}")


@st.composite
def partitioned_row(draw):
    rows, k, dv = draw(st.integers(1, 4)), draw(st.integers(1, 200)), draw(st.integers(1, 16))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    s = rng.standard_normal((rows, k)) * draw(st.sampled_from([1.0, 30.0]))
    if draw(st.booleans()):
        s[rng.random((rows, k)) < 0.5] = -np.inf
    v = rng.standard_normal((rows, k, dv))
    cuts = sorted(draw(st.lists(st.integers(0, k), max_size=8)))  # empty splits allowed
    bounds = [0, *cuts, k]
    return s, v, list(zip(bounds[:-1], bounds[1:]))


@given(row=partitioned_row(), order_seed=st.integers(0, 1000))
def test_golden_combine_equals_whole_row(row, order_seed):
    s, v, parts = row
    o_full, lse_full = ref.attention_state(s, v)
    states = [ref.attention_state(s[:, a:b], v[:, a:b]) for a, b in parts]
    order = np.random.default_rng(order_seed).permutation(len(states))
    o_parts = np.stack([states[i][0] for i in order])
    lse_parts = np.stack([states[i][1] for i in order])
    o_parts[np.isneginf(lse_parts)] = np.nan  # empty splits carry any O
    o, lse = ref.lse_combine(o_parts, lse_parts)
    f64 = get_dtype("fp64")
    for got, want, what in ((o, o_full, "O"), (lse, lse_full, "LSE")):
        cmp = compare(got, want, f64, GOLDEN_SELF_CHECK)
        assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what} of merged partition {parts}: {cmp.metrics}"


def test_golden_combine_all_empty():
    o_parts = np.full((3, 2, 4), np.nan)
    lse_parts = np.full((3, 2), -np.inf)
    o, lse = ref.lse_combine(o_parts, lse_parts)
    assert np.array_equal(o, np.zeros((2, 4))) and np.all(np.isneginf(lse))
