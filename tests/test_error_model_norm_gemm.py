"""The error model (issue 31) of the norm and GEMM families: each output's magnitude is the root-sum-square of
the terms its golden sums (refimpl.norm, refimpl.gemm, `absolute=True`; conformance/ops/norm.py, gemm.py).

Per family: a cancelling input where a correct kernel (our `cpu` backend, or a numpy emulation of fp32
arithmetic) fails the limits without the model (and the override it replaced) and passes under it; the
magnitude against |golden| on random inputs (Cauchy-Schwarz: |golden| <= sqrt(terms) x magnitude, and
equality where the golden is one term); cond < 2 on an ordinary random case."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.runner import Runner
from kernel_parity.conformance.spec import float64_view
from kernel_parity.conformance.tolerance import Override, numeric_layer

FP32 = dt.get("fp32")


def _case(op: str, params: dict, dist: str = "normal", seed: int = 0, backend: str = "cpu", dtype: str = "fp32"):
    """(Case, its inputs as drawn, their float64 view)."""
    case = Case.make(op, backend, dtype, params, dist, seed)
    spec = ops.get(op)
    x = spec.make_inputs(case.p, dtype, dist, np.random.Generator(np.random.PCG64(case.seed)))
    return case, x, float64_view(x)


def _ok(got, ref, lim, mag=None) -> bool:
    cmp = compare(got, ref, FP32, lim, magnitude=mag)
    return numeric_layer(cmp.metrics, cmp.elem_ratio, lim)[0].ok


def _old_limits(spec, name: str, p: dict, atol_acc: float):
    """The spec's limits with the absolute override the model replaced (atol_acc: eps32 sqrt(length) max|golden|)."""
    tol = dataclasses.replace(spec.tolerance, overrides=spec.tolerance.overrides + (
        Override("the override the error model replaced", output=name, atol_acc=atol_acc),))
    return tol.limits(name, FP32, p)


def _cond(gold: np.ndarray, mag: np.ndarray) -> float:
    m = np.maximum(np.abs(gold), mag)
    return float(np.sum(m * m) / np.sum(gold * gold))


def _run(case: Case, inputs: dict):
    rec = Runner(recheck=False).evaluate(case, inputs=inputs)
    return rec


# -- norm -------------------------------------------------------------------------------------------------
RMS = dict(rows=4, n=64, pad=0, eps="1e-6", gemma=0, residual=0, rstd=1)
LN = dict(rows=4, n=64, pad=0, eps="1e-6", bias=1, stats=1)


def test_rms_norm_backward_cancellation_regression():
    """dy along h / g (times 1000) plus 1e-3 of noise: dx = rstd (g dy - h rstd^2 mean(h g dy)) is ~1e-3 of its
    terms. Our C kernel keeps ~eps32 of the terms (1e-4 absolute, 1e-4 relative to dx): it fails without the
    model, even with the override it replaced, and passes under it (cond ~1e6)."""
    from kernel_parity.property_tests import runs  # noqa: PLC0415  (a backend on hand-made inputs)

    case, x, x64 = _case("norm.rms_norm_backward", RMS)
    rng = np.random.default_rng(11)
    h, g = x64["x"], x64["w"]
    x["dy"] = dt.round_to(1000.0 * (h / g + 1e-3 * rng.standard_normal(h.shape)), "fp32")
    spec, x64 = ops.get(case.op), float64_view(x)
    rec = _run(case, x)
    assert rec.verdict == "pass", rec.message
    assert rec.outputs["dx"].metrics["cond"] > 1e5
    gold = spec.reference(x64, case.p)["dx"]
    out = runs.run(case, x)["dx"].astype(np.float64)
    assert np.max(np.abs(out - gold)) > 1e-5  # the rounding of terms of ~1e3
    assert not _ok(out, gold, _old_limits(spec, "dx", case.p, 1.0))
    assert _ok(out, gold, spec.tolerance.limits("dx", FP32, case.p), spec.magnitude(x64, case.p)["dx"])


def test_layer_norm_backward_cancellation_regression():
    """d = dy w = 1000 (a + b xhat) plus 1e-3 of noise: dx = rstd (d - mean(d) - xhat mean(d xhat)) takes out
    exactly the components along 1 and xhat, ~1e-3 of its terms. Our C kernel fails without the model (and the
    override it replaced) and passes under it."""
    from kernel_parity.property_tests import runs  # noqa: PLC0415

    case, x, x64 = _case("norm.layer_norm_backward", LN)
    rng = np.random.default_rng(12)
    xr, w = x64["x"], x64["w"]
    xhat = (xr - xr.mean(-1, keepdims=True)) / xr.std(-1, keepdims=True)
    d = rng.standard_normal((4, 1)) + rng.standard_normal((4, 1)) * xhat + 1e-3 * rng.standard_normal(xr.shape)
    x["dy"] = dt.round_to(1000.0 * d / w, "fp32")
    spec, x64 = ops.get(case.op), float64_view(x)
    rec = _run(case, x)
    assert rec.verdict == "pass", rec.message
    assert rec.outputs["dx"].metrics["cond"] > 1e5
    gold = spec.reference(x64, case.p)["dx"]
    out = runs.run(case, x)["dx"].astype(np.float64)
    assert np.max(np.abs(out - gold)) > 1e-5
    assert not _ok(out, gold, _old_limits(spec, "dx", case.p, 1.0))
    assert _ok(out, gold, spec.tolerance.limits("dx", FP32, case.p), spec.magnitude(x64, case.p)["dx"])


def _ln_fp32(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm in fp32 arithmetic with the best fp32 mean (the float64 mean, rounded once) and no
    compensation of its rounding: x - mean carries half an ulp of |mean| (F.layer_norm's arithmetic)."""
    f = np.float32
    x32 = x.astype(f)
    mean = x.mean(-1, keepdims=True).astype(f)
    c = x32 - mean
    rstd = (f(1) / np.sqrt(np.mean(c * c, axis=-1, keepdims=True, dtype=f) + f(eps))).astype(f)
    return (c * rstd * w.astype(f) + b.astype(f)).astype(np.float64)


def test_layer_norm_forward_fp32_centring_stays_outside_the_model():
    """`shifted` rows (1000 + N(0, 1)): an fp32 mean is half an ulp of 1000 (3e-5) off, and x - mean carries it
    into y at ~3e-5 rstd, 3x fp32's atol. The model takes x - mean as exact (refimpl.norm._centred_sq: the
    term x^2 + mean^2 would be scaled by the output dtype's rtol, leaving 16-bit shifted rows unjudged), so
    fp32-centring arithmetic still fails there, with and without the magnitude (F.layer_norm's known
    failure); on rows centred near zero it passes either way and the magnitude is ~|y| (cond < 2)."""
    spec = ops.get("norm.layer_norm")
    p = dict(LN, n=1000)
    _, _, x64 = _case("norm.layer_norm", p, "shifted")
    gold, mag = spec.reference(x64, p)["y"], spec.magnitude(x64, p)["y"]
    lim = spec.tolerance.limits("y", FP32, p)
    got = _ln_fp32(x64["x"], x64["w"], x64["b"], 1e-6)
    assert np.max(np.abs(got - gold)) > 2e-5
    assert not _ok(got, gold, lim) and not _ok(got, gold, lim, mag) and _cond(gold, mag) < 2
    _, _, x64 = _case("norm.layer_norm", p, "normal")
    gold, mag = spec.reference(x64, p)["y"], spec.magnitude(x64, p)["y"]
    got = _ln_fp32(x64["x"], x64["w"], x64["b"], 1e-6)
    assert _ok(got, gold, lim) and _ok(got, gold, lim, mag) and _cond(gold, mag) < 2


@pytest.mark.parametrize("op, params, terms", [
    ("norm.rms_norm_backward", dict(RMS, rows=5, n=9, pad=3, gemma=1, residual=1),
     lambda p: {"dx": p["n"] + 2, "dw": p["rows"]}),
    ("norm.layer_norm_backward", dict(LN, rows=5, n=9, pad=3),
     lambda p: {"dx": 2 * p["n"] + 1, "dw": p["rows"], "db": p["rows"]}),
    ("norm.layer_norm", dict(LN, rows=5, n=9, pad=3), lambda p: {"y": 3}),
])
@pytest.mark.parametrize("dist", ["normal", "scales"])
def test_norm_magnitudes_bound_the_golden(op, params, terms, dist):
    """|golden| <= sqrt(number of terms) x magnitude element by element (the root-sum-square of the terms
    against their sum, Cauchy-Schwarz), on random inputs; the magnitudes are zero on the padding lanes."""
    spec = ops.get(op)
    for seed in range(4):
        case, _, x64 = _case(op, params, dist, seed)
        gold, mag = spec.reference(x64, case.p), spec.magnitude(x64, case.p)
        for k, t in terms(case.p).items():
            assert mag[k].shape == gold[k].shape
            assert (np.abs(gold[k]) <= np.sqrt(t) * mag[k] * (1 + 1e-12) + 1e-300).all(), (k, seed)
            assert not mag[k][..., case.p["n"]:].any()


def test_norm_magnitudes_of_one_term_are_the_golden():
    """One row: dw = dy h rstd (RMSNorm) and db = dy (LayerNorm) are single terms, their magnitude is |golden|."""
    for op, params, names in (("norm.rms_norm_backward", dict(RMS, rows=1, n=33), ("dw",)),
                              ("norm.layer_norm_backward", dict(LN, rows=1, n=33), ("db",))):
        spec = ops.get(op)
        case, _, x64 = _case(op, params)
        gold, mag = spec.reference(x64, case.p), spec.magnitude(x64, case.p)
        for k in names:
            np.testing.assert_allclose(mag[k], np.abs(gold[k]), rtol=1e-14)


@pytest.mark.parametrize("op, params", [
    ("norm.rms_norm_backward", dict(RMS, rows=150, n=113, pad=16)),
    ("norm.layer_norm_backward", dict(LN, rows=150, n=113, pad=16)),
    ("norm.layer_norm", dict(LN, rows=37, n=113, pad=16)),
])
def test_norm_cond_of_an_ordinary_case(op, params):
    """Rows centred near zero, N(0, 1) cotangents: every output's cond < 2 (today's limits, COND_RANDOM)."""
    spec = ops.get(op)
    case, _, x64 = _case(op, params)
    gold, mag = spec.reference(x64, case.p), spec.magnitude(x64, case.p)
    for k in mag:
        assert 1.0 <= _cond(gold[k], mag[k]) < 2.0, k


# -- GEMM -------------------------------------------------------------------------------------------------
def test_gemm_cancellation_regression():
    """Rows of A (x 1000) made orthogonal to W's rows up to 1e-3: C is ~1e-3 of its terms' magnitude. Our C
    kernel's fp32 dot product keeps ~eps32 of the terms: it fails without the model (and with the override it
    replaced, eps32 sqrt(K) max|C|) and passes under it."""
    params = dict(m=4, n=8, k=512, wfmt="f32", bias=0)
    case, x, x64 = _case("gemm.gemm_nt", params)
    rng = np.random.default_rng(13)
    w = x64["w"]
    a = rng.standard_normal((4, 512))
    a -= (a @ np.linalg.pinv(w)) @ w  # out of W's row space: A W^T = 0
    a = 1000.0 * (a / np.linalg.norm(a, axis=1, keepdims=True) * np.sqrt(512) + 1e-3 * rng.standard_normal(a.shape))
    x["a"] = dt.round_to(a, "fp32")
    _assert_model_judges_the_cancellation(case, x, "c")


def test_gemm_backward_cancellation_regression():
    """da = dc W with each row of dc (x 1000) orthogonal to W's columns up to 3e-4 (N > K): da is ~1e-3 of its
    terms; the C kernel fails without the model (and the override it replaced) and passes under it."""

    params = dict(m=4, n=96, k=32, wfmt="f32", bias=1)
    case, x, x64 = _case("gemm.gemm_nt_backward", params)
    rng = np.random.default_rng(14)
    w = x64["w"]  # N, K
    dc = rng.standard_normal((4, 96))
    dc -= (dc @ w) @ np.linalg.pinv(w)  # dc W = 0
    dc = 1000.0 * (dc / np.linalg.norm(dc, axis=1, keepdims=True) * np.sqrt(96) + 3e-4 * rng.standard_normal(dc.shape))
    x["dc"] = dt.round_to(dc, "fp32")
    _assert_model_judges_the_cancellation(case, x, "da")


def _assert_model_judges_the_cancellation(case, x, name: str) -> None:
    """Output `name` is ~1e-3 of its terms' magnitude; our kernel's error there fails the limits that stood
    before the model and passes under it, and the whole case passes."""
    from kernel_parity.property_tests import runs  # noqa: PLC0415

    spec, x64 = ops.get(case.op), float64_view(x)
    gold, mag = spec.reference(x64, case.p)[name], spec.magnitude(x64, case.p)[name]
    assert np.max(np.abs(gold)) < 3e-3 * np.min(mag)
    out = runs.run(case, x)[name].astype(np.float64)
    assert np.max(np.abs(out - gold)) > 1e-5
    lim = spec.tolerance.limits(name, FP32, case.p)
    assert not _ok(out, gold, _old_limits(spec, name, case.p, 1.0)) and _ok(out, gold, lim, mag)
    rec = _run(case, x)
    assert rec.verdict == "pass", rec.message


@pytest.mark.parametrize("wfmt", ["f32", "q4_k", "q8_0", "fp8", "int4_awq"])
def test_gemm_magnitudes_bound_the_golden(wfmt):
    """|C| <= sqrt(K + 1) x magnitude (both references: L1 and the emulated L2, whose activations are quantized),
    |da| <= sqrt(N), |dw|, |db| <= sqrt(M) x theirs; with K = 1 and no bias the magnitude is |C| itself."""
    k = 256
    for op, params in (("gemm.gemm_nt", dict(m=5, n=16, k=k, wfmt=wfmt, bias=1)),
                       ("gemm.gemm_nt_backward", dict(m=5, n=16, k=k, wfmt=wfmt, bias=1))):
        spec = ops.get(op)
        case, _, x64 = _case(op, params)
        refs = {name: fn(x64, case.p) for name, fn in spec.all_references().items()}
        mag = spec.magnitude(x64, case.p)
        terms = {"c": k + 1, "da": 16, "dw": 5, "db": 5}
        assert set(mag) == set(refs[spec.reference_name])
        for ref in refs.values():
            for name, g in ref.items():
                assert (np.abs(g) <= np.sqrt(terms[name]) * mag[name] * (1 + 1e-12)).all(), (op, name)
    case, _, x64 = _case("gemm.gemm_nt", dict(m=3, n=4, k=1, wfmt="f32", bias=0))
    spec = ops.get("gemm.gemm_nt")
    np.testing.assert_allclose(spec.magnitude(x64, case.p)["c"], np.abs(spec.reference(x64, case.p)["c"]), rtol=1e-15)


def test_gemm_cond_of_an_ordinary_case():
    """A ~ N(0, 1), W ~ N(0, 0.02), N(0, 1) cotangents: cond ~1.45 (E (sum t)^2 = sum t^2), < 2 for every output."""
    for op in ("gemm.gemm_nt", "gemm.gemm_nt_backward"):
        spec = ops.get(op)
        case, _, x64 = _case(op, dict(m=17, n=40, k=512, wfmt="f32", bias=1))
        gold, mag = spec.reference(x64, case.p), spec.magnitude(x64, case.p)
        for k in mag:
            assert 1.0 <= _cond(gold[k], mag[k]) < 2.0, (op, k)
