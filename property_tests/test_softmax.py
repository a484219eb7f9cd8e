"""Property tests of the softmax family: every kernel vs the golden, and invariants.

Kernel tests draw whole cases (shape, dtype, distribution, seed) from the spec, so a failing
example prints a case id and its `parity repro` line. Shapes stay small: the Triton kernels
run through the interpreter on CI.

Backward (softmax.softmax_backward, softmax.online_softmax_backward), on every kernel (a plugin
backend with --parity-backend too) and, in float64, on the golden:
- every kernel vs the golden, on well-posed draws (`_well_posed`: near one-hot rows are rejected);
- the VJP is linear in the cotangent: negated, dx is negated value for value; times 2^k, scaled by
  2^k; and dx(c1 + c2) = dx(c1) + dx(c2) (fp32 outputs);
- dx's rows sum to 0 (dlse with the LSE's cotangent) on rows with a finite logit (fp32 outputs);
- the cotangent split by rows gives the sum of the parts' dx, value for value.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.softmax as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.runner import Prepared, tier_of
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK, numeric_layer, trust_layer
from kernel_parity.property_tests import runs
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


# -- backward ----------------------------------------------------------------------------------------
SOFTMAX_BWD, ONLINE_BWD = "softmax.softmax_backward", "softmax.online_softmax_backward"
BWD_OPS = {SOFTMAX_BWD: BACKENDS, ONLINE_BWD: BACKENDS}
FEW = settings(max_examples=6)  # each example runs a kernel two or three times (the interpreter on CI)


def _vjp_of_rounded_y(x: dict) -> np.ndarray:
    """float64 dx = y (dy - sum(dy y) + dlse) of the inputs as given: the VJP a kernel that makes no
    error of its own computes from the forward's y, which is rounded to the dtype."""
    y, dy = x["y"].astype(np.float64), x["dy"].astype(np.float64)
    dx = y * (dy - np.sum(dy * y, axis=-1, keepdims=True))
    return dx + x["dlse"].astype(np.float64)[:, None] * y if "dlse" in x else dx


def _well_posed(case) -> bool:
    """Whether a correct kernel can pass the draw (STYLE 9: ill-conditioned inputs are rejected by the
    strategy, not absorbed by a looser limit): the VJP of the inputs as given, rounded once more to the
    dtype away from the golden, is within the op's limits, and an all-zero dx would not pass.

    What this rejects: rows that `large` logits make one-hot, whose dx vanishes (vacuous), and short
    16-bit rows (`masked` ones keep few finite logits) whose largest probability's rounding, carried into
    every element through D = sum(dy y), is large against dx (at n = 2, dx_0 = y_0 y_1 (dy_0 - dy_1) is
    off by eps/2 x y_0 / y_1 relative). The online form's dlse y term keeps its near one-hot rows
    well-posed."""
    spec = ops.get(case.op)
    prep = Prepared(spec, case)
    want = prep.golden["dx"]
    exact = _vjp_of_rounded_y(prep.inputs)
    away = exact + np.where(exact >= want, 0.5, -0.5) * get_dtype(case.dtype).eps * np.abs(exact)
    tol = spec.tol_dtype("dx", case.dtype)
    lim = spec.tolerance.limits("dx", tol, case.p)
    cmp = compare(away, want, get_dtype("fp64"), lim, tol)
    return numeric_layer(cmp.metrics, cmp.elem_ratio, lim)[0].ok and not trust_layer(want, cmp.metrics, lim)[1]


def bwd_cases(op: str, **over):
    return cases(op, **{**SMALL, **over}).filter(_well_posed)


def _cotangents(x: dict, f: float, rows: np.ndarray | None = None) -> dict:
    """x with dy (and dlse) times f (exact: a sign, a power of two, 1), on `rows` only (the others 0)
    when given."""
    out = dict(x)
    for name in ("dy", "dlse"):
        if name in x:
            a = x[name].astype(np.float64) * f
            if rows is not None:
                a[~rows] = 0.0
            out[name] = dt.round_to(a, dt.of_array(x[name]))
    return out


def _same_values(case, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal value for value (float64 holds every 16- and 32-bit value exactly; -0 equals 0)."""
    bad = np.argwhere(got.astype(np.float64) != want.astype(np.float64))
    assert bad.size == 0, (f"{case.backend} {case.op} dx: {len(bad)} element(s) changed when {what}, first at "
                           f"{tuple(bad[0])}\n  repro: parity repro {case.id}")


def _row_scale(y: np.ndarray, dy: np.ndarray, dlse: np.ndarray) -> np.ndarray:
    """(rows,) sum_j y_j (|dy_j| + |D|) + |dlse|, D = sum_j dy_j y_j: the size of what cancels in a row
    sum of dx (a rounding of each term's size is what the sum may carry); 1 where it is 0."""
    d = np.abs(np.sum(dy * y, axis=-1, keepdims=True))
    s = np.sum(y * (np.abs(dy) + d), axis=-1) + np.abs(dlse)
    return np.where(s > 0, s, 1.0)


def _row_sums_close(case, dx: np.ndarray, want: np.ndarray, scale: np.ndarray, lim, tol, what: str) -> None:
    """Each row's sum of dx (float64) against `want`, both relative to the row's `scale`, within `lim`."""
    cmp = compare(np.sum(dx, axis=-1) / scale, want / scale, get_dtype("fp64"), lim, tol)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, (
        f"{case.backend} {case.op}: rows of dx do not sum to {what}: {cmp.anomaly_detail or cmp.metrics}\n"
        f"  repro: parity repro {case.id}")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=bwd_cases(SOFTMAX_BWD))
def test_softmax_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=bwd_cases(ONLINE_BWD))
def test_online_softmax_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(by_op=BWD_OPS)
@FEW
@given(data=st.data(), k=st.integers(1, 6))
def test_backward_is_linear_in_the_cotangent(op, backend, data, k):
    """Negated cotangents (dy, dlse) negate dx value for value (every rounding is symmetric); times 2^k,
    dx scales by 2^k within the op's limits (exactly, but where 2^k dx or dx is subnormal)."""
    case = data.draw(bwd_cases(op)).with_backend(backend)
    x = runs.inputs_of(case)
    base = runs.run(case, x)["dx"]
    _same_values(case, -runs.run(case, _cotangents(x, -1.0))["dx"].astype(np.float64), base,
                 "the cotangents were negated")
    up = runs.run(case, _cotangents(x, 2.0**k))["dx"].astype(np.float64)
    runs.assert_close(case, {"dx": up * 2.0**-k}, {"dx": base.astype(np.float64)},
                      f"the cotangents were scaled by 2^{k}")


@pytest.mark.parity_backends(by_op=BWD_OPS)
@FEW
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_backward_is_additive_in_the_cotangent(op, backend, data, seed):
    """dx(c1 + c2) = dx(c1) + dx(c2) within the op's limits, fp32 (two 16-bit outputs rounded apart
    would differ by their roundings, which is no property of the kernel)."""
    case = data.draw(bwd_cases(op, dtypes=("fp32",))).with_backend(backend)
    x = runs.inputs_of(case)
    rng = np.random.default_rng(seed)
    other = {n: rng.standard_normal(x[n].shape).astype(np.float32) for n in ("dy", "dlse") if n in x}
    both = {**x, **{n: (x[n].astype(np.float64) + c).astype(np.float32) for n, c in other.items()}}
    g1, g2, g12 = runs.run(case, x), runs.run(case, {**x, **other}), runs.run(case, both)
    runs.assert_close(case, g12, {"dx": g1["dx"].astype(np.float64) + g2["dx"].astype(np.float64)},
                      "the cotangent was the sum of two")


@pytest.mark.parity_backends(by_op=BWD_OPS)
@FEW
@given(data=st.data(), split_seed=st.integers(0, 2**32 - 1))
def test_gradient_of_a_sum_over_rows_is_the_sum(op, backend, data, split_seed):
    """The cotangent split by rows in two: dx is the sum of the two parts' dx, value for value (a row's dx
    reads only its own row, so one of the two terms is exactly 0: a neighbour's D or dlse shows)."""
    case = data.draw(bwd_cases(op, rows=(2, 6))).with_backend(backend)
    x = runs.inputs_of(case)
    rows = np.random.default_rng(split_seed).random(case.p["rows"]) < 0.5
    a, b = runs.run(case, _cotangents(x, 1.0, rows)), runs.run(case, _cotangents(x, 1.0, ~rows))
    _same_values(case, a["dx"].astype(np.float64) + b["dx"].astype(np.float64), runs.run(case, x)["dx"],
                 "the rows' cotangents were split in two and the parts' dx added")


@pytest.mark.parity_backends(by_op=BWD_OPS)
@FEW
@given(data=st.data())
def test_dx_rows_sum_to_zero(op, backend, data):
    """sum_j dx_ij = 0 (softmax's rows sum to 1), dlse_i with the LSE's cotangent, on rows with a finite
    logit (an all -inf row's dx is 0): fp32 outputs, whose sum carries fp32 roundings only; relative to
    the size of what cancels in the sum, within the op's dx limits."""
    case = data.draw(bwd_cases(op, dtypes=("fp32",))).with_backend(backend)
    x = runs.inputs_of(case)
    dx = runs.run(case, x)["dx"].astype(np.float64)
    live = ~np.isneginf(x["x"]).all(axis=-1)
    want = np.where(live, x["dlse"].astype(np.float64), 0.0) if "dlse" in x else np.zeros(len(dx))
    scale = _row_scale(x["y"].astype(np.float64), x["dy"].astype(np.float64), want)
    spec = ops.get(op)
    tol = spec.tol_dtype("dx", case.dtype)
    _row_sums_close(case, dx, want, scale, spec.tolerance.limits("dx", tol, case.p, tier_of(spec, backend)), tol,
                    "dlse" if "dlse" in x else "0")


@given(case=cases(ONLINE_BWD, **SMALL), a=st.floats(-3, 3), b=st.floats(-3, 3), split_seed=st.integers(0, 2**32 - 1))
def test_golden_backward_invariants(case, a, b, split_seed):
    """In float64, for softmax_backward (no dlse) and online_softmax_backward: linear in the cotangent,
    dx(a c1 + b c2) = a dx(c1) + b dx(c2); rows summing to 0 (dlse) on rows with a finite logit; and the
    cotangent split by rows giving the sum of the parts' dx, exactly."""
    x = {k: v.astype(np.float64) for k, v in runs.inputs_of(case).items()}
    rng = np.random.default_rng(split_seed)
    c2 = {"dy": rng.standard_normal(x["dy"].shape), "dlse": rng.standard_normal(x["dlse"].shape)}
    rows = rng.random(case.p["rows"]) < 0.5
    live = ~np.isneginf(x["x"]).all(axis=-1)
    tile = case.p["tile"]
    for name, grad in (("softmax_backward", lambda dy, dl: ref.softmax_backward(x["x"], dy)),
                       ("online_softmax_backward", lambda dy, dl: ref.online_softmax_backward(x["x"], tile, dy, dl))):
        g1, g2 = grad(x["dy"], x["dlse"]), grad(c2["dy"], c2["dlse"])
        mix = grad(a * x["dy"] + b * c2["dy"], a * x["dlse"] + b * c2["dlse"])
        scale = max(1.0, float(np.abs(g1).max(initial=0)), float(np.abs(g2).max(initial=0)))
        _golden_close(mix / scale, (a * g1 + b * g2) / scale, f"golden {name} of a c1 + b c2")
        want = np.where(live, x["dlse"], 0.0) if name.startswith("online") else np.zeros(len(g1))
        size = _row_scale(ref.softmax(x["x"]), x["dy"], want)
        _golden_close(np.sum(g1, axis=-1) / size, want / size, f"golden {name}: rows of dx summed")
        parts = [grad(np.where(keep[:, None], x["dy"], 0.0), np.where(keep, x["dlse"], 0.0)) for keep in (rows, ~rows)]
        assert np.array_equal(parts[0] + parts[1], g1), f"golden {name}: the rows' cotangents split in two"
