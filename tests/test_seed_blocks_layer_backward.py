"""Seed audit S9: the whole layer's backward (`blocks.layer_backward`): the MLP block's backward on h1, then the
attention block's for dh1, with the forward's saved scores (its softmax probabilities P, (h_q, T, ctx)) as an
optional input the backward reads instead of recomputing P.

The golden (refimpl/blocks.py `layer_backward`) composes the two blocks' VJPs; it is checked here against
central differences of the forward golden `layer`, and the C kernel is checked to read the scores it is given.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import blocks as adapters
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.ops.blocks_grad import layer_grad_shapes
from kernel_parity.conformance.ops.blocks_params import weights_of
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import blocks as ref

OP = "blocks.layer_backward"
P = dict(e=32, epad=0, hq=4, hkv=2, d=16, dpad=16, t=7, start=2, cap=9, wqkv="f32", wo="f32", bias=1, obias=1,
         style="interleaved", theta=10000, eps="1e-5", gemma=1, i=48, w1="f32", w2="f32")


def _text(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items())


def _prepared(p: dict, dist: str = "heads", seed: int = 3) -> Prepared:
    return Prepared(ops.get(OP), ops.make_case(OP, "cpu", "fp32", p, dist, seed))


def _kw(x: dict, p: dict) -> dict:
    return dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x["bq"], bk=x["bk"], bv=x["bv"], bo=x["bo"],
                style=p["style"], gemma=bool(p["gemma"]))


def _forward(x: dict, p: dict, change: dict | None = None) -> dict:
    x = {**x, **(change or {})}
    return ref.layer(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                     x["v_cache"], x["cos"], x["sin"], p["start"], x["gamma2"], *weights_of(x, p, "w1", "w2"),
                     **_kw(x, p))


def _backward(x: dict, p: dict) -> dict:
    return ref.layer_backward(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"),
                              x["k_cache"], x["v_cache"], x["cos"], x["sin"], p["start"], x["gamma2"],
                              *weights_of(x, p, "w1", "w2"), x["dout"], **_kw(x, p))


def test_scores_default_off_and_bad_params_are_usage_errors():
    spec = ops.get(OP)
    assert "scores" not in spec.params.parse(OP, _text(P))
    assert "scores" not in ops.make_case(OP, "cpu", "fp32", P, "normal", 0).id
    with pytest.raises(UsageError, match="scores"):
        spec.params.parse(OP, _text(P) + ",scores=2")
    with pytest.raises(UsageError, match="cache capacity"):
        ops.make_case(OP, "cpu", "fp32", dict(P, cap=8), "normal", 0)


def test_outputs_union_both_blocks_without_clashes():
    names = list(layer_grad_shapes(P))
    assert names[:4] == ["dact", "dh", "dnorm2", "dh1"] and names[-3:] == ["dgamma2", "dw1", "dw2"]
    assert {"dx", "dgamma", "dwq", "dwk", "dwv", "dwo", "dbq", "dbk", "dbv", "dbo"} <= set(names)
    assert "dr" not in names and len(names) == len(set(names))
    quant = list(layer_grad_shapes(dict(P, wqkv="q8_0", wo="q8_0", w1="q8_0", w2="q8_0")))
    assert quant == ["dact", "dh", "dnorm2", "dh1", "dattn", "dq_rope", "dk_rope", "dv", "dq", "dk", "dnorm", "dx"]
    scored = _prepared(dict(P, scores=1)).inputs
    assert scored["scores"].shape == (4, 7, 16) and "scores" not in _prepared(P).inputs


def test_the_golden_matches_central_differences_of_the_layer():
    x = dict(_prepared(P).inputs64)
    g = _backward(x, P)
    rng = np.random.default_rng(0)
    for name, grad in (("x", "dx"), ("gamma", "dgamma"), ("gamma2", "dgamma2"), ("wq", "dwq"), ("w1", "dw1"),
                       ("bo", "dbo")):
        v = rng.standard_normal(x[name].shape)
        if name == "x":
            v[:, P["e"]:] = 0.0
        h = 1e-6
        up = _forward(x, P, {name: x[name] + h * v})["out"]
        dn = _forward(x, P, {name: x[name] - h * v})["out"]
        fd = np.sum(x["dout"] * (up - dn)) / (2 * h)
        assert abs(fd - np.sum(g[grad] * v)) <= 1e-6 * max(1.0, abs(fd)), name


def test_the_golden_composes_the_two_blocks_and_the_residuals():
    x = _prepared(P).inputs64
    g = _backward(x, P)
    h1 = _forward(x, P)["h1"]
    m = ref.mlp_backward(h1, x["gamma2"], 1e-5, *weights_of(x, P, "w1", "w2"), x["dout"], n=32, gemma=True)
    assert np.array_equal(g["dh1"], m["dx"]) and np.array_equal(g["dgamma2"], m["dgamma"])
    a = ref.attention_prefill_backward(x["x"], x["gamma"], 1e-5, *weights_of(x, P, "wq", "wk", "wv", "wo"),
                                       x["k_cache"], x["v_cache"], x["cos"], x["sin"], 2, m["dx"], **_kw(x, P),
                                       residual=x["x"])
    assert np.array_equal(g["dx"], a["dx"] + m["dx"]) and np.array_equal(g["dwq"], a["dwq"])
    # both residual paths matter: dx without dh1, or dh1 without dout, are far off
    assert np.abs(g["dx"] - a["dx"]).max() > 0.1 * np.abs(g["dx"]).max()
    assert np.abs(m["dx"] - x["dout"]).max() > 0.1 * np.abs(m["dx"] - x["dout"] + x["dout"]).max()


def test_the_c_backward_reads_the_scores_it_is_given():
    from kernel_parity.kernels.cpu import blocks_bwd as k

    prep = _prepared(dict(P, scores=1))
    x, case = prep.inputs, prep.case
    g = _backward(prep.inputs64, case.p)

    def run(scores):
        args, kw = adapters._layer_args(case, x)
        return k.layer_backward(*args, x["dout"], **kw, **{**adapters._layer_backward_kw(case, x), "scores": scores})

    given, recomputed = run(x["scores"]), run(None)
    for name in ("dq", "dk_rope", "dx", "dwq", "dgamma2"):
        tol = 1e-4 * np.abs(g[name]).max()
        assert np.abs(given[name] - g[name]).max() <= tol and np.abs(recomputed[name] - g[name]).max() <= tol, name
    wrong = x["scores"].copy()
    wrong[1] = wrong[0]  # head 1 given head 0's P: its gradients move
    assert np.abs(run(wrong)["dq"][:, 1] - given["dq"][:, 1]).max() > 1e-3 * np.abs(given["dq"]).max()
    with pytest.raises(ValueError, match="scores must be"):
        run(x["scores"][..., :8].copy())


def test_the_triton_layer_backward_declares_scores_unsupported():
    check = adapters.triton_supports()[OP]
    assert "takes no saved scores" in check(ops.make_case(OP, "triton", "fp32", dict(P, scores=1), "normal", 0))
    assert check(ops.make_case(OP, "triton", "fp32", P, "normal", 0)) is None


def test_ci_runs_the_backward_with_and_without_scores():
    params = [(set(c["backends"]), p) for c in suites.load_doc("ci")["cases"] if c["op"] == OP for p in c["params"]]
    assert {b for bs, p in params if p.get("scores") and p["hq"] > p["hkv"] > 1 for b in bs} >= {"cpu", "torch"}
    assert any(p.get("scores") and ref.context_window(p["start"] + p["t"]) > p["start"] + p["t"] for _, p in params)
    assert any(p.get("scores") and p["t"] * p["hq"] // p["hkv"] > 64 for _, p in params)
    assert any(p.get("scores") and p["w1"] != "f32" for _, p in params)
    assert any("triton" in bs and not p.get("scores") for bs, p in params)
