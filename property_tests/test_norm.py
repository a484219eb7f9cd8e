"""Property tests of the normalisation family: every kernel vs the golden, and the ops' invariants.

- RMSNorm is scale invariant: y(2^k x) = y(x) with eps tiny against mean(x^2) (2^k scales exactly in
  every dtype; eps's small share is put back exactly), rstd scales by 2^-k and h by 2^k;
- LayerNorm is shift invariant: y(x + 8) = y(x), mean moves by 8, rstd stays (rows on a grid that
  x + 8 keeps exact);
- the fused residual form on (x, r) is the plain form on x + r (a grid where the sum is exact),
  and h = x + r bit for bit;
- the padding lanes of every row output are exactly zero.
Backward (norm.rms_norm_backward, norm.layer_norm_backward):
- every kernel vs the golden (rows of fewer than 7 lanes left out, but LayerNorm's n = 1 where dx = 0
  exactly: dx lies in the n - 1 (RMSNorm) or n - 2 (LayerNorm) dimensions the projection leaves, and
  a row's condition |g dy| / |dx| has a heavy tail there; the figures are in the ci suite's comment);
- the VJP is linear in the cotangent: dy (and dh) scaled by 2^k scale dx and dw by 2^k;
- dw of a sum of row-cotangents is the sum: dy split into two sets of rows gives dx row by row
  exactly, each part's dw (db) its own golden's (the sum over its rows), and the goldens' parts add
  up to the whole in float64;
- golden: RMSNorm's dx is orthogonal to x up to eps's share, sum(dx x) = eps rstd^2 sum(dy y) per row.
Shapes stay small: the Triton kernels run through the interpreter on CI.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.backends import NotProvided
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(rows=(1, 40), n=(1, 600), pad=(0, 64), max_numel=8000)


def _skip_unsupported(case):
    """Skip the whole test when the backend cannot take the kind of case every draw of the test is
    (a plugin without the fused residual): rejecting each draw would leave Hypothesis none."""
    backend = runs.registry().get(case.backend)
    why = backend.available() or backend.supports(case)
    if why:
        pytest.skip(why)


def _grid(a: np.ndarray, n: int, step: float, bound: float, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """`a` (rows, aw) with its real lanes replaced by multiples of `step` in [-bound, bound] (exact in
    every test dtype, and so is their sum or shift in the tests below); padding lanes stay zero."""
    out = a.copy()
    k = int(round(bound / step))
    out[:, :n] = dt.round_to(rng.integers(-k, k + 1, (a.shape[0], n)) * step, dtype)
    return out


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.rms_norm", **SMALL))
def test_rms_norm(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.layer_norm", **SMALL))
def test_layer_norm(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.rms_norm", eps=["1e-6"], dists=("normal",), **SMALL), k=st.integers(1, 6))
def test_rms_norm_scale_invariance(backend, case, k):
    """RMSNorm(2^k x) = RMSNorm(x) but for eps's share: eps = 1e-6 against mean(h^2) ~ 1 moves y by
    ~5e-7 relative, which is put back exactly (y' = y sqrt((ms + eps) / (ms + eps 4^-k)) per row)
    so that rows of small mean square (n = 1) compare as tightly as the rest."""
    case = case.with_backend(backend)
    inputs = runs.inputs_of(case)
    scaled = {name: dt.round_to(a.astype(np.float64) * 2.0**k, case.dtype) if name in ("x", "r") else a
              for name, a in inputs.items()}
    a, b = runs.run(case, inputs), runs.run(case, scaled)
    n, eps = case.p["n"], float(case.p["eps"])
    h = inputs["x"].astype(np.float64)[:, :n] + (inputs["r"].astype(np.float64)[:, :n] if "r" in inputs else 0.0)
    ms = np.mean(h * h, axis=1)
    share = np.sqrt((ms + eps) / (ms + eps * 4.0**-k))  # rows
    expect = {"y": a["y"].astype(np.float64) * share[:, None]}
    if "rstd" in a and not isinstance(a["rstd"], NotProvided):
        expect["rstd"] = a["rstd"].astype(np.float64) * share * 2.0**-k
    if "h" in a:
        expect["h"] = a["h"].astype(np.float64) * 2.0**k
    runs.assert_close(case, b, expect, f"x{' and r' if 'r' in inputs else ''} were scaled by 2^{k}")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.layer_norm", eps=["1e-6"], dists=("normal",), **SMALL), grid_seed=st.integers(0, 2**32 - 1))
def test_layer_norm_shift_invariance(backend, case, grid_seed):
    """LayerNorm(x + 8) = LayerNorm(x), on rows of multiples of 1/8 in [-4, 4] (x + 8 exact in bf16)."""
    case = case.with_backend(backend)
    inputs = runs.inputs_of(case)
    n = case.p["n"]
    x = _grid(inputs["x"].astype(np.float64), n, 0.125, 4.0, case.dtype, np.random.default_rng(grid_seed))
    shifted = x.copy()
    shifted[:, :n] += 8.0
    base = dict(inputs, x=dt.round_to(x, case.dtype))
    a, b = runs.run(case, base), runs.run(case, dict(inputs, x=dt.round_to(shifted, case.dtype)))
    expect = {k: v.astype(np.float64) for k, v in a.items() if not isinstance(v, NotProvided)}
    if "mean" in expect:
        expect["mean"] = expect["mean"] + 8.0
    runs.assert_close(case, b, expect, "every real lane was shifted by 8")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.rms_norm", residual=[1], dists=("normal",), **SMALL), grid_seed=st.integers(0, 2**32 - 1))
def test_rms_norm_residual_form_is_the_norm_of_the_sum(backend, case, grid_seed):
    """rms_norm(x, residual=r) = rms_norm(x + r) with h = x + r exactly (x, r multiples of 1/16 in
    [-4, 4]: their sum is exact in every dtype)."""
    case = case.with_backend(backend)
    _skip_unsupported(case)
    inputs = runs.inputs_of(case)
    n, rng = case.p["n"], np.random.default_rng(grid_seed)
    x = _grid(inputs["x"].astype(np.float64), n, 1 / 16, 4.0, case.dtype, rng)
    r = _grid(inputs["r"].astype(np.float64), n, 1 / 16, 4.0, case.dtype, rng)
    fused = runs.run(case, dict(inputs, x=dt.round_to(x, case.dtype), r=dt.round_to(r, case.dtype)))
    plain_case = ops.make_case(case.op, backend, case.dtype, {**case.p, "residual": 0}, case.dist, case.seed)
    plain = runs.run(plain_case, {"x": dt.round_to(x + r, case.dtype), "w": inputs["w"]})
    h = np.asarray(fused["h"]).astype(np.float64)
    bad = np.flatnonzero(h != x + r)
    assert bad.size == 0, (f"{backend} rms_norm h differs from x + r (exact here) at {bad.size} elements, "
                           f"first flat index {bad[0] if bad.size else None}\n  repro: parity repro {case.id}")
    runs.assert_close(case, {k: v for k, v in fused.items() if k != "h"},
                      {k: v.astype(np.float64) for k, v in plain.items()},
                      "the residual was added by the caller instead (plain form on x + r)")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=st.one_of(cases("norm.rms_norm", rows=(1, 40), n=(1, 600), pad=(1, 64), max_numel=8000),
                      cases("norm.layer_norm", rows=(1, 40), n=(1, 600), pad=(1, 64), max_numel=8000)))
def test_padding_lanes_are_zero(parity, backend, case):
    """Every padding lane of y (and h) is written as an exact zero, whatever the row holds."""
    rec, arrays = parity.arrays(case.with_backend(backend))
    assume(rec.verdict != "skip")  # a draw the backend cannot take (a plugin without the residual form)
    n = case.p["n"]
    for name in ("y", "h"):
        got = arrays.get("outputs", {}).get(name)
        if got is None or isinstance(got, NotProvided):
            continue
        pad = np.asarray(got)[:, n:].astype(np.float64)
        bad = np.argwhere(pad != 0)
        assert bad.size == 0, (f"{backend} {case.op} {name}: {len(bad)} padding lane(s) not zero, first at "
                               f"[{bad[0][0]}, {n + bad[0][1]}] = {pad[tuple(bad[0])]:g}\n  repro: {rec.repro}")


# -- backward --------------------------------------------------------------------------------------------
BWD = dict(rows=(1, 24), n=(7, 300), pad=(0, 32), max_numel=4000)


# Rows past 8192 lanes (Llama-3 / Mistral MLP widths, 14336): an odd row count gets an aligned width that is
# a multiple of 16 (kernels/triton/norm_backward.py's wide kernels), an even one the drawn padding (mostly
# the looped kernels); n up to 16400 crosses the wide kernels' 16384-lane limit.
WIDE = dict(rows=(1, 3), n=(8193, 16400), pad=(0, 24), max_numel=60000)


def _wide(p):
    return {**p, "pad": (-p["n"]) % 16 + 16 * (p["pad"] % 2)} if p["rows"] % 2 else p


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=4)  # the interpreter holds a 16384-lane row a program: seconds each
@given(case=st.one_of(cases("norm.rms_norm_backward", transform=_wide, **WIDE),
                      cases("norm.layer_norm_backward", transform=_wide, **WIDE)))
def test_norm_backward_wide_rows(parity, backend, case):
    parity.check(case.with_backend(backend))


def _ln_n(p):
    """LayerNorm's backward without n = 2 .. 6 (ill-conditioned rows; n = 1, dx = 0 exactly, stays)."""
    return {**p, "n": 7 if 2 <= p["n"] <= 6 else p["n"]}


def _cotangents_scaled(inputs: dict, scale: float, rows: np.ndarray | None = None) -> dict:
    """The inputs with dy (and dh) multiplied by `scale` (exact: a power of two or 0), on `rows` only
    (the others zeroed) when given."""
    out = dict(inputs)
    for name in ("dy", "dh"):
        if name in out:
            a = out[name].astype(np.float64) * scale
            if rows is not None:
                a[~rows] = 0.0
            out[name] = dt.round_to(a, dt.of_array(out[name]))
    return out


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.rms_norm_backward", **BWD))
def test_rms_norm_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("norm.layer_norm_backward", transform=_ln_n, **dict(BWD, n=(1, 300))))
def test_layer_norm_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


def _bwd_case(op: str, backend: str, data, **bounds):
    """A case of `op` itself (drawn with its own schema, so a failing example names it) on `backend`."""
    return data.draw(cases(op, transform=_ln_n if op == "norm.layer_norm_backward" else None,
                           dists=("normal", "scales"), **dict(BWD, **bounds)), label="case").with_backend(backend)


@pytest.mark.parity_backends(by_op={"norm.rms_norm_backward": BACKENDS, "norm.layer_norm_backward": BACKENDS})
@given(data=st.data(), k=st.integers(1, 4))
def test_backward_is_linear_in_the_cotangent(op, backend, data, k):
    case = _bwd_case(op, backend, data)
    _skip_unsupported(case)
    inputs = runs.inputs_of(case)
    a, b = runs.run(case, inputs), runs.run(case, _cotangents_scaled(inputs, 2.0**k))
    expect = {name: v.astype(np.float64) * 2.0**k for name, v in a.items() if not isinstance(v, NotProvided)}
    runs.assert_close(case, b, expect, f"the cotangents were scaled by 2^{k}")


@pytest.mark.parity_backends(by_op={"norm.rms_norm_backward": BACKENDS, "norm.layer_norm_backward": BACKENDS})
@given(data=st.data(), split_seed=st.integers(0, 2**32 - 1))
def test_weight_grad_of_a_row_split_is_the_sum(op, backend, data, split_seed):
    """dy (and dh) split into two sets of rows: dx is each part's on its rows (exactly: a row's dx
    reads only its own row); each part's dw (db) is its own golden's, the sum over exactly its rows,
    within the op's limits; and the goldens' dw (db) of the parts add up to the whole's in float64.
    (The kernel's part outputs are not added up and compared with its whole: in 16 bits the sum of
    two rounded outputs is rounded twice, and a linear kernel that sums the wrong rows is additive
    anyway; against the golden it is not.)"""
    from kernel_parity.conformance.metrics import compare
    from kernel_parity.conformance.spec import float64_view
    from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK

    case = _bwd_case(op, backend, data, rows=(2, 24))
    _skip_unsupported(case)
    spec, inputs = ops.get(case.op), runs.inputs_of(case)
    rows = np.random.default_rng(split_seed).random(case.p["rows"]) < 0.5
    parts = [_cotangents_scaled(inputs, 1.0, rows), _cotangents_scaled(inputs, 1.0, ~rows)]
    full = runs.run(case, inputs)
    a, b = (runs.run(case, part) for part in parts)
    dx = np.where(rows[:, None], a["dx"].astype(np.float64), b["dx"].astype(np.float64))
    bad = np.argwhere(dx != full["dx"].astype(np.float64))
    assert bad.size == 0, (f"{backend} {op}: dx of the split cotangents differs from dx at {len(bad)} elements, "
                           f"first {tuple(bad[0])}\n  repro: parity repro {case.id}")
    golden = [spec.reference(float64_view(x), case.p) for x in (inputs, *parts)]
    for got, want, which in ((a, golden[1], "first"), (b, golden[2], "second")):
        runs.assert_close(case, got, want, f"only the {which} set of rows had a cotangent (vs that input's golden: "
                                           f"split_seed={split_seed})")
    for name in (n for n in golden[0] if n != "dx"):
        cmp = compare(golden[1][name] + golden[2][name], golden[0][name], dt.get("fp64"), GOLDEN_SELF_CHECK)
        assert cmp.elem_ratio <= 1.0, (f"golden {op} {name}: the parts' sum is not the whole's: {cmp.metrics}\n"
                                       f"  repro: parity repro {case.id}")


@given(case=cases("norm.rms_norm_backward", dists=("normal", "tiny", "scales"), **BWD))
def test_golden_rms_norm_dx_is_orthogonal_to_h_but_for_eps(case):
    """sum(dx h) = eps rstd^2 sum(dy y) (+ sum(dh h)) per row, exactly in the algebra: h's own direction
    moves y only through eps's share of the mean square."""
    from kernel_parity.conformance.metrics import compare
    from kernel_parity.conformance.spec import float64_view
    from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
    import kernel_parity.refimpl.norm as ref

    x = float64_view(runs.inputs_of(case))
    p, eps = case.p, float(case.p["eps"])
    n = p["n"]
    g = ref.rms_norm_backward(x["x"], x["w"], x["dy"], eps, n=n, gemma=bool(p["gemma"]), residual=x.get("r"),
                              dh=x.get("dh"))
    y = ref.rms_norm(x["x"], x["w"], eps, n=n, gemma=bool(p["gemma"]), residual=x.get("r"))
    h = x["x"][:, :n] + (x["r"][:, :n] if "r" in x else 0.0)
    want = eps * y["rstd"] ** 2 * np.sum(x["dy"][:, :n] * y["y"][:, :n], axis=1)
    if "dh" in x:
        want = want + np.sum(x["dh"][:, :n] * h, axis=1)
    got = np.sum(g["dx"][:, :n] * h, axis=1)
    scale = np.sum(np.abs(g["dx"][:, :n] * h), axis=1) + np.abs(want)  # the sum's own rounding
    cmp = compare(got / np.maximum(scale, 1e-300), want / np.maximum(scale, 1e-300), dt.get("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.elem_ratio <= 1.0, f"sum(dx h) vs eps rstd^2 sum(dy y): {cmp.metrics}\n  repro: parity repro {case.id}"
