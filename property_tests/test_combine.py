"""Property tests of the split-KV merge: every kernel vs the golden, and its invariants.

- combining one split returns that split, bit for bit (weight exp(0) = 1, LSE + ln 1 = LSE);
- the result does not depend on the order of the splits (kernel vs kernel, within the op's limits);
- the golden merge of the states of any partition of a row equals attending over the whole row.
Backward (combine.lse_combine_backward), on every kernel and, in float64, on the golden:
- every kernel vs the golden;
- the VJP is linear in the cotangents (dO, dLSE): negated, both gradients are negated value for
  value; times 2^k, scaled by 2^k; and G(c1 + c2) = G(c1) + G(c2) (fp32 outputs);
- sum_i dLSE_i = dLSE on rows with a live split (the split weights are a softmax over the LSEs);
- the cotangents split by rows give the sum of the parts' gradients, value for value.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.combine as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.runner import tier_of
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


# -- backward ----------------------------------------------------------------------------------------
BWD = "combine.lse_combine_backward"
BWD_SMALL = dict(SMALL, rows=(1, 12))  # the Triton kernel runs one program a row (the interpreter on CI)
FEW = settings(max_examples=6)  # each example runs a kernel two or three times (the interpreter on CI)


def _cotangents(x: dict, f: float, rows: np.ndarray | None = None) -> dict:
    """x with do and dlse times f (exact: a sign, a power of two, 1), on `rows` only (the others 0) when
    given."""
    out = dict(x)
    for name in ("do", "dlse"):
        a = x[name].astype(np.float64) * f
        if rows is not None:
            a[~rows] = 0.0
        out[name] = dt.round_to(a, dt.of_array(x[name]))
    return out


def _same_values(case, got: dict, want: dict, what: str) -> None:
    """Equal value for value (float64 holds every 16- and 32-bit value exactly; -0 equals 0)."""
    for n in want:
        bad = np.argwhere(got[n].astype(np.float64) != want[n].astype(np.float64))
        assert bad.size == 0, (f"{case.backend} {case.op} {n}: {len(bad)} element(s) changed when {what}, first at "
                               f"{tuple(bad[0])}\n  repro: parity repro {case.id}")


def _f64(d: dict) -> dict:
    return {n: v.astype(np.float64) for n, v in d.items()}


def _split_weights_and_dots(x: dict) -> tuple[np.ndarray, np.ndarray]:
    """float64 (w_i, a_i = dO . O_i), (splits, rows) each, of the inputs; 0 for an empty split."""
    lse = x["lse_parts"].astype(np.float64)
    live = ~np.isneginf(lse)
    merged = ref.lse_combine(np.zeros(lse.shape + (1,)), lse)[1]  # rows
    w = np.where(live, np.exp(np.where(live, lse, 0.0) - np.where(np.isneginf(merged), 0.0, merged)), 0.0)
    o = np.where(live[..., None], x["o_parts"].astype(np.float64), 0.0)  # an empty split's O is NaN
    return w, np.sum(o * x["do"].astype(np.float64), axis=-1)


def _sum_scale(w: np.ndarray, a: np.ndarray, dlse: np.ndarray) -> np.ndarray:
    """(rows,) sum_i w_i (|a_i| + |abar|) + |dLSE|, abar = sum_i w_i a_i: the size of what cancels in
    sum_i dLSE_i (a rounding of each term's size is what the sum may carry); 1 where it is 0."""
    abar = np.abs(np.sum(w * a, axis=0))
    s = np.sum(w * (np.abs(a) + abar), axis=0) + np.abs(dlse)
    return np.where(s > 0, s, 1.0)


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(BWD, **BWD_SMALL))
def test_lse_combine_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases(BWD, **BWD_SMALL), k=st.integers(1, 6))
def test_backward_is_linear_in_the_cotangent(backend, case, k):
    """Negated cotangents (dO, dLSE) negate both gradients value for value (every rounding is symmetric);
    times 2^k, they scale by 2^k within the op's limits (exactly, but where a 16-bit dO_i is subnormal)."""
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    base = runs.run(case, x)
    neg = runs.run(case, _cotangents(x, -1.0))
    _same_values(case, {n: -v.astype(np.float64) for n, v in neg.items()}, base, "the cotangents were negated")
    up = runs.run(case, _cotangents(x, 2.0**k))
    runs.assert_close(case, {n: v.astype(np.float64) * 2.0**-k for n, v in up.items()}, _f64(base),
                      f"the cotangents were scaled by 2^{k}")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases(BWD, dtypes=("fp32",), **BWD_SMALL), seed=st.integers(0, 2**32 - 1))
def test_backward_is_additive_in_the_cotangent(backend, case, seed):
    """G(c1 + c2) = G(c1) + G(c2) within the op's limits, fp32 (two 16-bit dO_i rounded apart would differ
    by their roundings, which is no property of the kernel)."""
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    rng = np.random.default_rng(seed)
    other = {n: rng.standard_normal(x[n].shape).astype(np.float32) for n in ("do", "dlse")}
    both = {**x, **{n: (x[n].astype(np.float64) + c).astype(np.float32) for n, c in other.items()}}
    g1, g2, g12 = runs.run(case, x), runs.run(case, {**x, **other}), runs.run(case, both)
    runs.assert_close(case, g12, {n: g1[n].astype(np.float64) + g2[n].astype(np.float64) for n in g1},
                      "the cotangent was the sum of two")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases(BWD, **dict(BWD_SMALL, rows=(2, 12))), split_seed=st.integers(0, 2**32 - 1))
def test_gradient_of_a_sum_over_rows_is_the_sum(backend, case, split_seed):
    """The cotangents split by rows in two: both gradients are the sums of the two parts', value for value
    (a row's gradients read only its own row, so one of the two terms is exactly 0)."""
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    rows = np.random.default_rng(split_seed).random(case.p["rows"]) < 0.5
    a, b = runs.run(case, _cotangents(x, 1.0, rows)), runs.run(case, _cotangents(x, 1.0, ~rows))
    _same_values(case, {n: a[n].astype(np.float64) + b[n].astype(np.float64) for n in a}, runs.run(case, x),
                 "the rows' cotangents were split in two and the parts' gradients added")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases(BWD, **BWD_SMALL))
def test_split_lse_gradients_sum_to_dlse(backend, case):
    """sum_i dLSE_i = dLSE on rows with a live split (the weights are a softmax over the splits: they sum
    to 1 and sum_i w_i (O_i - O) = 0); dLSE_i is fp32 in every dtype. Relative to the size of what cancels,
    within the op's dlse_parts limits."""
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    got = runs.run(case, x)["dlse_parts"].astype(np.float64)
    w, a = _split_weights_and_dots(x)
    live = w.sum(axis=0) > 0
    want = np.where(live, x["dlse"].astype(np.float64), 0.0)
    scale = _sum_scale(w, a, want)
    spec = ops.get(BWD)
    tol = spec.tol_dtype("dlse_parts", case.dtype)
    lim = spec.tolerance.limits("dlse_parts", tol, case.p, tier_of(spec, backend))
    cmp = compare(got.sum(axis=0) / scale, want / scale, get_dtype("fp64"), lim, tol)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, (
        f"{backend} {BWD}: sum_i dLSE_i differs from dLSE: {cmp.anomaly_detail or cmp.metrics}\n"
        f"  repro: parity repro {case.id}")


def _golden_close(got, want, what):
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


@given(case=cases(BWD, **BWD_SMALL), a=st.floats(-3, 3), b=st.floats(-3, 3), split_seed=st.integers(0, 2**32 - 1))
def test_golden_backward_invariants(case, a, b, split_seed):
    """In float64: linear in the cotangents, G(a c1 + b c2) = a G(c1) + b G(c2); sum_i dLSE_i = dLSE on
    rows with a live split; the cotangents split by rows giving the sum of the parts' gradients, exactly."""
    x = _f64(runs.inputs_of(case))
    rng = np.random.default_rng(split_seed)
    c2 = {"do": rng.standard_normal(x["do"].shape), "dlse": rng.standard_normal(x["dlse"].shape)}

    def grad(do, dlse):
        return ref.lse_combine_backward(x["o_parts"], x["lse_parts"], do, dlse)

    g1, g2 = grad(x["do"], x["dlse"]), grad(c2["do"], c2["dlse"])
    mix = grad(a * x["do"] + b * c2["do"], a * x["dlse"] + b * c2["dlse"])
    for name, m, u, v in zip(("dO_i", "dLSE_i"), mix, g1, g2):
        scale = max(1.0, float(np.abs(u).max(initial=0)), float(np.abs(v).max(initial=0)))
        _golden_close(m / scale, (a * u + b * v) / scale, f"golden {name} of a c1 + b c2")
    w, dots = _split_weights_and_dots(x)
    want = np.where(w.sum(axis=0) > 0, x["dlse"], 0.0)
    # the golden weighs by exp(LSE_i - LSE), LSE rounded: each weight carries |LSE| eps64 relative
    lse = ref.lse_combine(np.zeros(w.shape + (1,)), x["lse_parts"])[1]
    size = _sum_scale(w, dots, want) * np.maximum(1.0, np.where(np.isfinite(lse), np.abs(lse), 1.0))
    _golden_close(g1[1].sum(axis=0) / size, want / size, "golden sum_i dLSE_i vs dLSE")
    rows = rng.random(case.p["rows"]) < 0.5
    parts = [grad(np.where(keep[:, None], x["do"], 0.0), np.where(keep, x["dlse"], 0.0)) for keep in (rows, ~rows)]
    for i, name in enumerate(("dO_i", "dLSE_i")):
        assert np.array_equal(parts[0][i] + parts[1][i], g1[i]), f"golden {name}: the rows' cotangents split in two"
