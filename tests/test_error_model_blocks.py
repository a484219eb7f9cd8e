"""The error model of the fused blocks (issue 31; refimpl/blocks.py `absolute`, the `magnitude` of the blocks
specs): each stage's magnitude the RSS of its terms, blended with what it inherits from the stages it reads."""

from __future__ import annotations

import numpy as np
import pytest

import kernel_parity.conformance.ops.blocks_grad as blocks_grad
import kernel_parity.refimpl.blocks as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.runner import Runner
from kernel_parity.conformance.spec import float64_view
from kernel_parity.conformance.tolerance import COMPUTE_SUFFIX, Override, Tol, numeric_layer
from kernel_parity.refimpl import mlp as mlp_ref
from kernel_parity.refimpl import norm

FP32 = dt.get("fp32")
OUTPROJ = dict(t=2, e=64, epad=0, hq=2, d=32, dpad=0, wo="f32", wo_layout="flat", obias=0, i=64, w1="f32", w2="f32",
               eps="1e-6", gemma=0)
PREFILL = dict(e=32, epad=0, hq=2, hkv=2, d=32, dpad=0, t=7, start=0, cap=7, wqkv="f32", wo="f32", bias=1, obias=0,
               residual=1, style="interleaved", theta=10000, eps="1", gemma=0)


def _captured(op: str, backend: str, params: dict, dist: str, seed: int, inputs: dict | None = None):
    """(record, {golden, outputs, magnitudes}) of one case run by the runner."""
    r = Runner(recheck=False, noise=False, diagnose=False)
    r.capture = {}
    rec = r.evaluate(Case.make(op, backend, "fp32", params, dist, seed), inputs=inputs)
    spec, cap = ops.get(op), r.capture[rec.id]
    p = spec.validate(params, "fp32", dist)
    return rec, {**cap, "magnitudes": spec.magnitude(float64_view(cap["inputs"], spec.storage_inputs), p)}


def _verdict(got, gold, tol: Tol, name: str, p: dict, magnitude=None) -> tuple[bool, float]:
    lim = tol.limits(name, FP32, p)
    cmp = compare(got, gold, FP32, lim, magnitude=magnitude)
    layer, ratios = numeric_layer(cmp.metrics, cmp.elem_ratio, lim)
    return bool(layer.ok), max(ratios.values())


def _scaled(spec, outputs) -> Tol:
    """The spec's limits with the absolute allowance the model replaced: eps32 sqrt(reduction length) max|out|."""
    return Tol(acc_len=spec.tolerance.acc_len, overrides=tuple(Override("before the model", output=o, atol_acc=1.0)
                                                                 for o in outputs) + spec.tolerance.overrides)


def test_outproj_mlp_cancellation_regression():
    """h1 = proj + residual with the residual -proj to 1e-3 (|proj| ~ 30): eager fp32 torch's rounding of proj (~1e-6
    of it) is ~1e-3 of h1, and RMSNorm scales h1 back up, so every stage after it is off by ~1e-4 relative. The
    limits before the model (against |golden|, atol eps32 sqrt(L) max|out|) fail h1 .. out by 100x and more; under the
    model each passes at ~0.1 of its bound, the stage magnitudes carrying proj's scale (cond ~1e9)."""
    pytest.importorskip("torch")
    spec = ops.get("blocks.outproj_mlp")
    p = spec.validate(OUTPROJ, "fp32", "normal")
    x = spec.make_inputs(p, "fp32", "normal", np.random.default_rng(0))
    x["attn"] = dt.round_to(x["attn"] * 30.0, "fp32")
    proj = spec.reference(float64_view(x), p)["proj"]
    x["residual"] = dt.round_to(-proj + 1e-3 * np.random.default_rng(1).standard_normal(proj.shape), "fp32")
    rec, cap = _captured("blocks.outproj_mlp", "torch", OUTPROJ, "normal", 0, inputs=x)
    assert rec.verdict == "pass", rec.message
    before = _scaled(spec, spec.outputs)
    for name in ("h1", "norm", "h", "act", "down", "out"):
        got, gold, mag = cap["outputs"][name], cap["golden"][name], cap["magnitudes"][name]
        ok_before, r_before = _verdict(got, gold, before, name, p)
        ok_model, r_model = _verdict(got, gold, spec.tolerance, name, p, mag)
        assert not ok_before and (r_before > 100 or name == "h1"), (name, r_before)
        assert ok_model and r_model < 0.5, (name, r_model)
        assert rec.outputs[name].metrics["cond"] > 1e6


def test_attention_backward_dbk_cancellation_regression():
    """dbk = sum over the chunk's tokens of dk, whose softmax rows sum to zero: only RoPE and the bias keep a
    remainder, far under its terms. Our C kernel on `heads` (start 0: every key new) failed dbk's limits without the
    override that stood for it (6.5x); under the model (cond ~700) it passes at 0.07 of its bound."""
    spec = ops.get("blocks.attention_prefill_backward")
    p = spec.validate(PREFILL, "fp32", "heads")
    rec, cap = _captured("blocks.attention_prefill_backward", "cpu", PREFILL, "heads", 11)
    assert rec.verdict == "pass", rec.message
    got, gold, mag = cap["outputs"]["dbk"], cap["golden"]["dbk"], cap["magnitudes"]["dbk"]
    without = Tol(acc_len=spec.tolerance.acc_len,
                  overrides=tuple(Override("before the model", output=o, atol_acc=1.0) for o in spec.outputs)
                  + blocks_grad._LOGITS + blocks_grad._PV)
    ok, r = _verdict(got, gold, without, "dbk", p)
    assert not ok and r > 2
    ok, r = _verdict(got, gold, spec.tolerance, "dbk", p, mag)
    assert ok and r < 0.5
    assert rec.outputs["dbk"].metrics["cond"] > 100


def _mlp_case(seed: int, positive: bool = False):
    spec = ops.get("blocks.mlp")
    p = spec.validate(dict(t=3, e=64, epad=0, i=32, w1="f32", w2="f32", eps="1e-5", gemma=0), "fp32", "normal")
    x = float64_view(spec.make_inputs(p, "fp32", "normal", np.random.default_rng(seed)))
    if positive:
        x = {k: np.abs(v) for k, v in x.items()}
    return spec, p, x


def test_mlp_magnitudes_are_their_formulas():
    """h, act, down and out by the model's rules written out element by element: h an RSS over K (norm's own n
    roundings blend with the same terms), act the mean of its own and its two operands' routes, down W2's RSS on
    the blended act, out the blended down plus x^2."""
    spec, p, x = _mlp_case(3)
    gold, mag = spec.reference(x, p), spec.magnitude(x, p)
    assert set(mag) == {"h", "act", "down", "out"}  # norm: |norm| (stored x, well-conditioned rstd)
    w1, w2 = x["w1"], x["w2"]
    nrm = norm.rms_norm(x["x"], x["gamma"], 1e-5, n=64)["y"]
    h2 = np.array([[sum(nrm[t, k] ** 2 * w1[n, k] ** 2 for k in range(64)) for n in range(64)] for t in range(3)])
    np.testing.assert_allclose(mag["h"], np.sqrt(h2), rtol=1e-12)
    lh = 64 + 64  # the norm's n, the projection's K
    gate, up = mlp_ref.split(gold["h"])
    g2, u2 = mlp_ref.split(h2)
    act2 = (gold["act"] ** 2 + lh * ((mlp_ref.silu_grad(gate) * up) ** 2 * g2 + mlp_ref.silu(gate) ** 2 * u2)) / (
        1 + 2 * lh)
    np.testing.assert_allclose(mag["act"], np.sqrt(act2), rtol=1e-12)
    la = lh + 1
    down2 = ((32 * gold["act"] ** 2 + la * act2) / (32 + la)) @ (w2 ** 2).T
    np.testing.assert_allclose(mag["down"], np.sqrt(down2), rtol=1e-12)
    ld = la + 32
    np.testing.assert_allclose(mag["out"], np.sqrt(x["x"] ** 2 + (gold["down"] ** 2 + ld * down2) / (1 + ld)),
                               rtol=1e-12)


def test_sums_of_positive_terms_keep_their_golden():
    """Every term positive (x, gamma, W >= 0): nothing cancels, each sum's RSS is at most the sum, so max(|golden|,
    M) = |golden| in the projections, the residual add and the attention: the limits are those without a model."""
    spec, p, x = _mlp_case(4, positive=True)
    gold, mag = spec.reference(x, p), spec.magnitude(x, p)
    for k in ("h", "out"):
        assert (mag[k] <= np.abs(gold[k]) * (1 + 1e-12)).all(), k
    spec = ops.get("blocks.attention_prefill")
    params = dict(e=64, epad=0, hq=4, hkv=2, d=32, dpad=0, t=5, start=8, cap=16, wqkv="f32", wo="f32", bias=1,
                  obias=1, residual=1, style="half", theta=10000, eps="1e-5", gemma=0)
    p = spec.validate(params, "fp32", "normal")
    x = float64_view(spec.make_inputs(p, "fp32", "normal", np.random.default_rng(5)))
    x = {k: np.abs(v) for k, v in x.items()}
    gold, mag = spec.reference(x, p), spec.magnitude(x, p)
    for k in ("q", "k", "v", "out"):
        assert (mag[k] <= np.abs(gold[k]) * (1 + 1e-12)).all(), k
    live = p["start"] + p["t"]
    assert (mag["v_cache"][:, :live] <= np.abs(gold["v_cache"][:, :live]) * (1 + 1e-12)).all()


@pytest.mark.parametrize("op,params", [
    ("blocks.attention_prefill", dict(e=64, epad=0, hq=4, hkv=1, d=32, dpad=0, t=9, start=60, cap=70, wqkv="q5_0",
                                      wo="q5_0", bias=0, obias=1, residual=0, style="interleaved", theta=1000000,
                                      eps="1e-5", gemma=1)),
    ("blocks.attention_decode", dict(e=64, epad=0, hq=4, hkv=4, d=64, dpad=0, pos=130, cap=140, wqkv="q8_0", wo="f32",
                                     bias=0, obias=1, residual=0, style="half", theta=10000, eps="1e-5", gemma=1)),
    ("blocks.mlp", dict(t=3, e=250, epad=6, i=256, w1="q4_k", w2="q6_k", eps="1e-6", gemma=0)),
    ("blocks.outproj_mlp", dict(t=3, e=250, epad=6, hq=4, d=24, dpad=8, wo="f32", wo_layout="head_major", obias=1,
                                i=256, w1="q4_k", w2="q6_k", eps="1e-6", gemma=0)),
    ("blocks.mlp_backward", dict(t=3, e=60, epad=4, i=96, w1="f32", w2="f32", eps="1e-6", gemma=0)),
])
def test_an_ordinary_case_keeps_its_limits(op, params):
    """A ci case on ordinary random inputs: cond < 2 on every output with a magnitude (the RSS of random-sign terms
    is their golden's expected size, cond ~1.5): the aggregate limits stay the fixed ones."""
    rec, cap = _captured(op, "cpu", params, "normal", 0)
    assert rec.verdict == "pass", rec.message
    assert cap["magnitudes"]
    for name in cap["magnitudes"]:
        if name.endswith(COMPUTE_SUFFIX):  # a compute-precision term beside its output's magnitude
            continue
        assert rec.outputs[name].metrics["cond"] < 2.0, (name, rec.outputs[name].metrics["cond"])


def test_attention_backward_plain_sums_are_ordinary():
    """The attention backward's plain sums on ordinary inputs (no bias: no common part for dS's zero row sums to
    cancel): cond < 2 for dattn = dout W_o, dv = P^T dO, dnorm, dx and the weight gradients."""
    params = {**PREFILL, "bias": 0, "e": 60, "epad": 4, "hq": 4, "hkv": 2, "d": 24, "dpad": 8, "t": 5, "start": 20,
              "cap": 30}
    rec, _ = _captured("blocks.attention_prefill_backward", "cpu", params, "normal", 0)
    assert rec.verdict == "pass", rec.message
    for name in ("dattn", "dv", "dnorm", "dx", "dwv", "dwo"):
        assert rec.outputs[name].metrics["cond"] < 2.0, (name, rec.outputs[name].metrics["cond"])


def test_the_emulated_reference_squares_the_quantized_activations():
    """`reference="emulated"`: a quantized projection's own terms take the activations quantized as the golden does
    (Q8_K before Q4_K), within Q8's half step of the float ones; f32 weights are unchanged."""
    spec = ops.get("blocks.mlp")
    p = spec.validate(dict(t=2, e=256, epad=0, i=256, w1="q4_k", w2="f32", eps="1e-6", gemma=0), "fp32", "blocks")
    x = float64_view(spec.make_inputs(p, "fp32", "blocks", np.random.default_rng(6)))
    w1, w2 = ref.Weight("q4_k", x["w1"]), ref.Weight("f32", x["w2"])
    a = ref.mlp(x["x"], x["gamma"], 1e-6, w1, w2, n=256, absolute=True)
    b = ref.mlp(x["x"], x["gamma"], 1e-6, w1, w2, n=256, absolute=True, reference="emulated")
    assert not np.array_equal(a["h"], b["h"])
    np.testing.assert_allclose(a["h"], b["h"], rtol=0.02)
    with pytest.raises(ValueError, match="reference"):
        ref.mlp(x["x"], x["gamma"], 1e-6, w1, w2, n=256, absolute=True, reference="exact")
