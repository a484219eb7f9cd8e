"""Seed audit S2 and S3 for the MLP blocks (blocks.mlp, blocks.outproj_mlp, blocks.mlp_backward): the seed's
MLP biases (b1 = b_gate | b_up, b2 = b_down, and their gradients d_b1, d_b2) and its aligned intermediate
width (aI = I + ipad lanes per half, w_up at w1 + aI aE).

The contract (refimpl/blocks.py `mlp`): h carries the padded lanes [I, aI) of each half as the projection
gives them; act's are cleared, so W2's padded columns multiply zeros; the backward's dact, dh, dw1's and
db1's padded rows and dw2's padded columns are zero. The inputs put non-zero values wherever only a
kernel's ignoring of the padding neutralises them: W1's padded rows and b1's padded lanes at PAD_SCALE,
W2's padded columns at the real weights' scale.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.ops.blocks_inputs import PAD_SCALE
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import blocks as ref

P = dict(t=3, e=60, epad=4, i=20, w1="f32", w2="f32", eps="1e-6", gemma=0, bias=1, ipad=12)
EXACT = 1e-12  # float64 sums that differ only by added exact zeros (the padding times zero lanes)


def _inputs(p: dict, op: str = "blocks.mlp_backward", dist: str = "normal", seed: int = 3) -> dict:
    return dict(Prepared(ops.get(op), ops.make_case(op, "cpu", "fp32", p, dist, seed)).inputs64)


def _w(x: dict) -> tuple[ref.Weight, ref.Weight]:
    return ref.Weight("f32", x["w1"]), ref.Weight("f32", x["w2"])


def test_the_defaults_keep_older_case_ids_and_a_bad_width_is_a_usage_error():
    old = dict(t=3, e=64, epad=0, i=32, w1="q8_0", w2="q8_0", eps="1", gemma=1)
    for op in ("blocks.mlp", "blocks.mlp_backward"):
        base = ops.make_case(op, "cpu", "fp32", old, "normal", 0)
        assert ops.make_case(op, "cpu", "fp32", {**old, "bias": 0, "ipad": 0}, "normal", 0).id == base.id
        assert "bias=1,ipad=32" in ops.make_case(op, "cpu", "fp32", {**old, "bias": 1, "ipad": 32}, "normal", 0).id
    with pytest.raises(UsageError, match=r"w2=q8_0 needs aI = i \+ ipad=60 to be a multiple of its block of 32"):
        ops.make_case("blocks.mlp", "cpu", "fp32", {**old, "i": 40, "ipad": 20}, "normal", 0)


def test_the_inputs_put_values_only_where_a_kernel_must_ignore_them():
    p, (i, ai) = P, (P["i"], P["i"] + P["ipad"])
    x = _inputs(p)
    pad = np.tile(np.arange(ai) >= i, 2)  # the padded lanes of the gate and up halves
    real_e = np.arange(p["e"] + p["epad"]) < p["e"]
    assert np.median(np.abs(x["w1"][pad])) > PAD_SCALE / 10 and np.median(np.abs(x["b1"][pad])) > PAD_SCALE / 10
    assert np.mean(x["w2"][real_e][:, i:] != 0) > 0.9, "W2's padded columns are zero"
    assert np.all(x["w2"][~real_e] == 0) and np.all(x["b2"][~real_e] == 0), "out's padding is zero only through them"
    # biases of the products' size or larger, different per lane and between the halves
    b = x["b1"][~pad]
    assert np.std(b) > 1.0 and np.all(b[:i] != b[i:]) and np.std(x["b2"][real_e]) > 1.0


def test_the_golden_with_padding_is_the_golden_of_the_real_lanes():
    """The padded inputs and the same block cut to its I real lanes (no padding, f32: no block shares a padded
    value) give the same out, down and real lanes of h and act; act's padding is zero, h's is the projection's;
    the backward's padded rows and columns are zero and the rest the cut block's."""
    p, (i, ai) = P, (P["i"], P["i"] + P["ipad"])
    x = _inputs(p)
    cut = dict(x, w1=np.concatenate([x["w1"][:i], x["w1"][ai:ai + i]]), w2=x["w2"][:, :i],
               b1=np.concatenate([x["b1"][:i], x["b1"][ai:ai + i]]))
    kw = dict(n=p["e"], b2=x["b2"], gemma=False)
    got = ref.mlp(x["x"], x["gamma"], 1e-6, *_w(x), b1=x["b1"], inter=i, **kw)
    want = ref.mlp(x["x"], x["gamma"], 1e-6, *_w(cut), b1=cut["b1"], **kw)
    for name in ("norm", "down", "out"):
        np.testing.assert_allclose(got[name], want[name], rtol=EXACT, atol=0, err_msg=name)
    np.testing.assert_array_equal(got["h"][:, :i], want["h"][:, :i])
    np.testing.assert_array_equal(got["h"][:, ai:ai + i], want["h"][:, i:])
    assert np.abs(got["h"][:, i:ai]).min() > 1.0, "h does not carry the projection's padding"
    np.testing.assert_array_equal(got["act"][:, :i], want["act"])
    assert np.all(got["act"][:, i:] == 0)
    g = ref.mlp_backward(x["x"], x["gamma"], 1e-6, *_w(x), x["dout"], b1=x["b1"], inter=i, **kw)
    w = ref.mlp_backward(x["x"], x["gamma"], 1e-6, *_w(cut), x["dout"], b1=cut["b1"], **kw)
    for name in ("dnorm", "dx", "dgamma", "db2"):
        np.testing.assert_allclose(g[name], w[name], rtol=EXACT, atol=1e-14, err_msg=name)
    for name in ("dact", "dw2"):
        np.testing.assert_allclose(g[name][..., :i], w[name], rtol=EXACT, err_msg=name)
        assert np.all(g[name][..., i:] == 0), name
    for name in ("dh", "dw1", "db1"):
        a = np.moveaxis(g[name], 0, -1) if name == "dw1" else g[name]  # the 2aI axis last
        b = np.moveaxis(w[name], 0, -1) if name == "dw1" else w[name]
        np.testing.assert_allclose(a[..., :i], b[..., :i], rtol=EXACT, err_msg=name)
        np.testing.assert_allclose(a[..., ai:ai + i], b[..., i:], rtol=EXACT, err_msg=name)
        assert np.all(a[..., i:ai] == 0) and np.all(a[..., ai + i:] == 0), name


@pytest.mark.parametrize("ipad", [0, 12])
def test_the_bias_gradients_are_row_sums_and_the_finite_differences(ipad):
    p, i = dict(P, ipad=ipad), P["i"]
    x = _inputs(p)
    kw = dict(n=p["e"], inter=i, gemma=False)
    g = ref.mlp_backward(x["x"], x["gamma"], 1e-6, *_w(x), x["dout"], b1=x["b1"], b2=x["b2"], **kw)
    np.testing.assert_array_equal(g["db1"], g["dh"].sum(axis=0))
    np.testing.assert_array_equal(g["db2"], x["dout"].sum(axis=0))

    def loss(b1, b2):
        return float(np.sum(ref.mlp(x["x"], x["gamma"], 1e-6, *_w(x), b1=b1, b2=b2, **kw)["out"] * x["dout"]))

    h = 1e-6
    for name, lanes in (("b1", (0, i - 1, i + ipad, 2 * (i + ipad) - 1)), ("b2", (0, 7, p["e"] - 1))):
        for j in lanes:
            step = np.zeros_like(x[name])
            step[j] = h
            bp = {"b1": x["b1"], "b2": x["b2"]}
            up, dn = dict(bp), dict(bp)
            up[name], dn[name] = bp[name] + step, bp[name] - step
            fd = (loss(**up) - loss(**dn)) / (2 * h)
            assert abs(fd - g["d" + name][j]) < 1e-6 * max(1.0, abs(fd)), (name, j, fd, g["d" + name][j])


def test_the_error_model_takes_the_biases():
    """The magnitudes of h and down carry b1^2 and b2^2 (the RSS of their terms), act's padding none."""
    p, (i, ai) = P, (P["i"], P["i"] + P["ipad"])
    x = _inputs(p, "blocks.mlp")
    kw = dict(n=p["e"], inter=i, gemma=False, absolute=True)
    with_b = ref.mlp(x["x"], x["gamma"], 1e-6, *_w(x), b1=x["b1"], b2=x["b2"], **kw)
    without = ref.mlp(x["x"], x["gamma"], 1e-6, *_w(x), **kw)
    np.testing.assert_allclose(with_b["h"] ** 2 - without["h"] ** 2, np.broadcast_to(x["b1"] ** 2, without["h"].shape),
                               rtol=1e-9, atol=1e-9)
    assert np.all(with_b["act"][:, i:] == 0)
    assert np.all(with_b["down"] ** 2 >= x["b2"] ** 2 - 1e-12)


def _ci_params(op: str) -> list[tuple[set, dict]]:
    return [(set(c["backends"]), q) for c in suites.load_doc("ci")["cases"] if c["op"] == op for q in c["params"]]


@pytest.mark.parametrize("op", ["blocks.mlp", "blocks.outproj_mlp", "blocks.mlp_backward"])
def test_ci_runs_biases_and_padded_widths_on_every_kernel_backend(op):
    cases = _ci_params(op)
    for key in ("bias", "ipad"):
        assert set().union(*(b for b, q in cases if q.get(key))) >= {"cpu", "torch", "triton"}, (op, key)
    if op == "blocks.mlp_backward":  # the bias gradients need float32 weights
        assert any(q.get("bias") and q.get("ipad") and q["w1"] == q["w2"] == "f32" for _, q in cases)
