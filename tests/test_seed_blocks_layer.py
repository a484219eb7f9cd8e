"""Seed audit S9: the whole layer (`blocks.layer`: the prefill attention block, then the MLP block) and its saved
scores, the attention's softmax probabilities (h_q, T, ctx) the seed's backward reads.

The golden is a composition (refimpl/blocks.py `layer`): attention_prefill with the residual x, then mlp on its
output; the scores are the P whose product with the values is the attention output, 0 on masked slots and on the
padding lanes [start + T, ctx). Each backend's scores come from its own attention; the Triton layer, whose
chunked_prefill never forms P, declares scores=1 unsupported.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import blocks as adapters
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.ops.blocks_params import weights_of
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import blocks as ref

OP = "blocks.layer"
P = dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=5, start=20, cap=30, wqkv="f32", wo="f32", bias=1, obias=1,
         style="half", theta=10000, eps="1e-6", gemma=0, i=32, w1="f32", w2="f32")


def _text(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items())


def _prepared(p: dict, dist: str = "heads", seed: int = 4) -> Prepared:
    return Prepared(ops.get(OP), ops.make_case(OP, "cpu", "fp32", p, dist, seed))


def _golden(x: dict, p: dict, scores: bool = True) -> dict:
    return ref.layer(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                     x["v_cache"], x["cos"], x["sin"], p["start"], x["gamma2"], *weights_of(x, p, "w1", "w2"), n=p["e"],
                     h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x["bq"], bk=x["bk"], bv=x["bv"], bo=x["bo"],
                     scores=scores)


def test_scores_default_off_and_bad_params_are_usage_errors():
    spec = ops.get(OP)
    base = spec.params.parse(OP, _text(P))
    assert "scores" not in base and spec.params.parse(OP, _text(P) + ",scores=0") == base
    assert "scores" not in ops.make_case(OP, "cpu", "fp32", P, "normal", 0).id
    with pytest.raises(UsageError, match="scores"):
        spec.params.parse(OP, _text(P) + ",scores=2")
    with pytest.raises(UsageError, match=r"w2=q8_0 needs aI = i \+ ipad=20"):
        ops.make_case(OP, "cpu", "fp32", dict(P, i=20, w2="q8_0"), "normal", 0)
    with pytest.raises(UsageError, match="cache capacity"):
        ops.make_case(OP, "cpu", "fp32", dict(P, cap=24), "normal", 0)


def test_the_layer_is_the_attention_block_then_the_mlp_block():
    x = _prepared(P).inputs64
    g = _golden(x, P)
    a = ref.attention_prefill(x["x"], x["gamma"], 1e-6, *weights_of(x, P, "wq", "wk", "wv", "wo"), x["k_cache"],
                              x["v_cache"], x["cos"], x["sin"], P["start"], n=P["e"], h_q=4, h_kv=2, d=24, bq=x["bq"],
                              bk=x["bk"], bv=x["bv"], bo=x["bo"], residual=x["x"])
    m = ref.mlp(a["out"], x["gamma2"], 1e-6, *weights_of(x, P, "w1", "w2"), n=P["e"])
    assert np.array_equal(g["h1"], a["out"]) and np.array_equal(g["out"], m["out"])
    assert np.array_equal(g["norm2"], m["norm"]) and np.array_equal(g["attn"], a["attn"])
    # the residual stream matters: the MLP of the pre-residual output is far off
    pre = ref.mlp(a["out"] - x["x"], x["gamma2"], 1e-6, *weights_of(x, P, "w1", "w2"), n=P["e"])["down"]
    assert np.abs(pre - g["down"]).max() > 0.1 * np.abs(g["down"]).max()


def test_the_scores_are_the_p_of_the_attention_output():
    x = _prepared(P).inputs64
    g = _golden(x, P)
    s, live = g["scores"], P["start"] + P["t"]
    assert s.shape == (4, 5, 32) and ref.context_window(live) == 32
    assert np.all(s[..., live:] == 0) and np.allclose(s.sum(-1), 1.0, rtol=0, atol=1e-14)
    for t in range(P["t"]):  # bottom-right causal: token t sees slots <= start + t
        assert np.all(s[:, t, P["start"] + t + 1:] == 0) and np.all(s[:, t, :P["start"] + t + 1] > 0)
    v = np.repeat(g["v_cache"][:, :live], 2, axis=0)  # query head h reads kv head h // 2
    assert np.allclose(np.einsum("htj,hjd->thd", s[..., :live], v), g["attn"], rtol=0, atol=1e-13)
    # a neighbouring head's scores (another kv head under `heads`) are far off
    assert np.abs(s[1:3] - s[2:4]).max() > 0.1


def test_the_c_layer_matches_the_golden_and_its_scores():
    from kernel_parity.kernels.cpu import blocks as k

    prep = _prepared(dict(P, t=65, start=3, cap=70, scores=1), dist="normal")
    x, p = prep.inputs, prep.case.p
    g = _golden(prep.inputs64, p)
    args, kw = adapters._layer_args(prep.case, {**x, "k_cache": x["k_cache"].copy(), "v_cache": x["v_cache"].copy()})
    got = k.layer(*args, **kw, scores=True, quantize_activations=False)
    assert got["scores"].shape == g["scores"].shape == (4, 65, 80)
    assert np.all(got["scores"][..., 68:] == 0)
    for name in ("scores", "attn", "h1", "out"):
        assert np.abs(got[name] - g[name]).max() <= 1e-5 * max(1.0, np.abs(g[name]).max()), name


def test_the_triton_layer_declares_scores_unsupported():
    check = adapters.triton_supports()[OP]
    with_scores = ops.make_case(OP, "triton", "fp32", dict(P, scores=1), "normal", 0)
    assert "never materialises P" in check(with_scores)
    assert check(ops.make_case(OP, "triton", "fp32", P, "normal", 0)) is None


def test_ci_runs_the_layer_with_scores_past_the_query_tile_and_triton_without():
    params = [(set(c["backends"]), p) for c in suites.load_doc("ci")["cases"] if c["op"] == OP for p in c["params"]]
    scored = {b for bs, p in params if p.get("scores") and p["hq"] > p["hkv"] > 1 for b in bs}
    assert scored >= {"cpu", "torch"}
    assert any(p.get("scores") and p["t"] * p["hq"] // p["hkv"] > 64 for _, p in params)
    assert any(p.get("scores") and ref.context_window(p["start"] + p["t"]) > p["start"] + p["t"] for _, p in params)
    assert any("triton" in bs and not p.get("scores") for bs, p in params)
