"""Seed audit S1 for the attention blocks: each of W_q, W_k, W_v in its own format (`wk`, `wv` beside `wqkv`: the
seed's wq_dt, wk_dt, wv_dt), K-quants (q4_k, q6_k; Q8_K activations on the L2 path) and Q4_0 / Q4_1 / Q5_1 (Q8_0,
Q8_1) among them; W_o in the same formats (the attention output quantized for its own), and the backward with each
projection in its own format, as the forward takes them.

The contract (refimpl/blocks.py): every projection is dequantized (L1) or takes its activations quantized (L2)
by its own format. `wk` / `wv` default to "" (wqkv's format): the older ids, inputs and goldens are unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import blocks as ref, quant

P = dict(e=64, epad=0, hq=4, hkv=2, d=16, dpad=16, t=3, start=2, cap=6, wqkv="q5_0", wo="q8_0", bias=1, obias=1,
         residual=1, style="half", theta=10000, eps="1e-6", gemma=0)
PREFILL, DECODE, BWD = "blocks.attention_prefill", "blocks.attention_decode", "blocks.attention_prefill_backward"
MIXED = dict(wk="q8_0", wv="f32")


def _text(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items())


def _prepared(op: str, p: dict, dist: str = "heads", seed: int = 4) -> Prepared:
    return Prepared(ops.get(op), ops.make_case(op, "cpu", "fp32", p, dist, seed))


@pytest.mark.parametrize("op", [PREFILL, BWD])
def test_defaults_keep_the_older_ids_and_inputs(op):
    spec = ops.get(op)
    base = spec.params.parse(op, _text(P))
    assert "wk" not in base and "wv" not in base
    assert spec.params.parse(op, _text(P) + ",wk=,wv=") == base
    a, b = _prepared(op, P).inputs64, _prepared(op, dict(P, wk="", wv="")).inputs64
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def test_each_projection_is_stored_and_read_in_its_own_format():
    """The mixed case's weights are the default case's draws in their own formats; the golden dequantizes each
    with its own: q and its stages match the all-q5_0 golden's, k and v differ by their own formats' rounding."""
    spec = ops.get(PREFILL)
    mixed, same = _prepared(PREFILL, dict(P, **MIXED)), _prepared(PREFILL, P)
    xm, xs = mixed.inputs64, same.inputs64
    np.testing.assert_array_equal(xm["wq"], xs["wq"])
    assert xm["wk"].shape[1] == P["e"] // 32 * 34 and xm["wv"].shape == (P["hkv"] * 32, P["e"])
    p = spec.params.parse(PREFILL, _text(dict(P, **MIXED)))
    gm, gs = spec.reference(xm, p), spec.reference(xs, spec.params.parse(PREFILL, _text(P)))
    np.testing.assert_array_equal(gm["q"], gs["q"])
    wk = quant.dequantize("q8_0", xm["wk"]).astype(np.float64)
    np.testing.assert_allclose(gm["k"][:, :, :P["d"]].reshape(P["t"], -1),
                               (gm["norm"] @ wk.T + xm["bk"]).reshape(P["t"], P["hkv"], -1)[:, :, :P["d"]]
                               .reshape(P["t"], -1), rtol=1e-12, atol=1e-12)
    assert not np.allclose(gm["v"], gs["v"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad, what", [(dict(wk="q2_k"), "wk"), (dict(qkv="fused", wv="f32"), "fused"),
                                       (dict(e=48, wqkv="f32", wk="q8_0"), "wk=q8_0"),
                                       (dict(wqkv="q4_k"), "wqkv=q4_k needs aE"),
                                       (dict(e=250, epad=22, wqkv="f32", wv="q6_k"), "multiple of its block of 256")])
def test_bad_params_are_usage_errors(bad, what):
    with pytest.raises(UsageError, match=what):
        ops.make_case(PREFILL, "cpu", "fp32", dict(P, **bad), "normal", 1)


@pytest.mark.parametrize("fmts", [("q8_0", "f32", "q5_0"), ("q4_1", "q5_1", "q4_0")])
def test_the_backward_takes_each_projections_own_format(fmts):
    """The backward as the forward takes them (S1): blocks_bwd.c's dnorm = dq Wq + dk Wk + dv Wv with each weight
    dequantized by its own format is the golden's (L1) to fp32 rounding; no weight gradients (quantized weights)."""
    from kernel_parity.conformance.backends.blocks import SAVED_ATTENTION, _attention_args
    from kernel_parity.kernels.cpu import blocks_bwd as cbw

    p = dict(P, wqkv=fmts[0], wk=fmts[1], wv=fmts[2])
    prep = _prepared(BWD, p, dist="normal")
    x = prep.inputs
    assert "dwk" not in prep.spec.output_shapes(prep.params)
    args, kw = _attention_args(prep.case, x)
    assert [w[0] for w in args[3:6]] == list(fmts)
    got = cbw.attention_prefill_backward(*args, x["dout"], **kw, **{n: x[n] for n in SAVED_ATTENTION},
                                         weight_grads=False)
    want = prep.spec.reference(prep.inputs64, prep.params)
    for name in ("dk", "dv", "dnorm", "dx"):
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-4 * np.abs(want[name]).max(),
                                   err_msg=name)


def test_weight_gradients_need_every_projection_float32():
    """An f32 W_qkv with a quantized W_k (S1) has no weight gradients (the quantized weights have none)."""
    spec = ops.get(BWD)
    shapes = spec.output_shapes(spec.params.parse(BWD, _text(dict(P, wqkv="f32", wo="f32", wk="q8_0"))))
    assert "dx" in shapes and "dwq" not in shapes and "dgamma" not in shapes
    shapes = spec.output_shapes(spec.params.parse(BWD, _text(dict(P, wqkv="f32", wo="f32", wk="f32"))))
    assert "dwk" in shapes and "dwo" in shapes


# -- W_o in S1's formats (K-quants with Q8_K activations over the whole attention row, Q4_0 / Q4_1 / Q5_1) ----------
@pytest.mark.parametrize("op", [PREFILL, DECODE])
@pytest.mark.parametrize("wo, d, dpad", [("q4_k", 48, 16), ("q6_k", 64, 64), ("q4_1", 16, 16), ("q5_1", 16, 16),
                                         ("q4_0", 30, 2)])
def test_c_kernel_projects_wo_in_its_own_format_as_the_l2_golden(op, wo, d, dpad):
    """blocks.c's W_o (decode: per kv group when a group's columns are whole blocks, a_d = 128 for Q6_K; after the
    last group otherwise, a_d = 64 for Q4_K) with the attention output quantized for its format (Q8_K, Q8_1, Q8_0):
    out is the golden's L2 (`emulated`) value to double rounding, not its L1 one."""
    from kernel_parity.kernels.cpu import blocks as cb

    p = {k: v for k, v in dict(P, d=d, dpad=dpad, wqkv="q8_0", wo=wo, pos=P["start"]).items()
         if k not in (("t", "start") if op == DECODE else ("pos",))}
    prep = _prepared(op, p, dist="blocks")
    x = prep.inputs
    fn, where = (cb.attention_decode, p["pos"]) if op == DECODE else (cb.attention_prefill, p["start"])
    got = fn(x["x"], x["gamma"], 1e-6, *(("q8_0", x[n]) for n in ("wq", "wk", "wv")), (wo, x["wo"]),
             x["k_cache"].copy(), x["v_cache"].copy(), x["cos"], x["sin"], where, n=P["e"], h_q=P["hq"], h_kv=P["hkv"],
             d=d, bq=x["bq"], bk=x["bk"], bv=x["bv"], bo=x["bo"], residual=x["r"])
    attn = got["attn"].astype(np.float64).reshape(-1, P["hq"] * (d + dpad))
    w = ref.Weight(wo, x["wo"])
    l2 = (ref.project(attn, w, x["bo"], reference="emulated") + x["r"].reshape(attn.shape[0], -1)).reshape(
        got["out"].shape)
    l1 = (ref.project(attn, w, x["bo"]) + x["r"].reshape(attn.shape[0], -1)).reshape(got["out"].shape)
    np.testing.assert_allclose(got["out"], l2, rtol=1e-6, atol=1e-6 * np.abs(l2).max())
    assert np.abs(l2 - l1).max() > 1e-4 * np.abs(l1).max()


@pytest.mark.parametrize("op, bad, what", [
    (PREFILL, dict(wo="q4_k"), r"h_q a_d = 4 x 32 = 128 must be a multiple of 256"),
    (DECODE, dict(wo="q6_k", d=40, dpad=0), "must be a multiple of 256"),
    (BWD, dict(wo="q4_k", wk="f32"), "must be a multiple of 256"),
    (PREFILL, dict(wo="q5_1", d=40, dpad=8), r"a_d = d \+ dpad = 48 must be a multiple of 32"),
    ("blocks.outproj_mlp", dict(wo="q6_k"), "must be a multiple of 256"),
])
def test_bad_wo_params_are_usage_errors(op, bad, what):
    p = dict(P, **bad)
    if op == DECODE:
        p = {**{k: v for k, v in p.items() if k not in ("t", "start")}, "pos": 2}
    if op == "blocks.outproj_mlp":
        p = dict(t=2, e=64, epad=0, hq=4, d=16, dpad=16, wo_layout="flat", obias=0, i=32, w1="f32", w2="f32",
                 eps="1e-6", gemma=0, **bad)
    with pytest.raises(UsageError, match=what):
        ops.make_case(op, "cpu", "fp32", p, "normal", 1)


def test_ci_runs_wo_in_the_new_formats_and_mixed_formats_in_the_backward():
    for op, kquant in ((DECODE, {"cpu", "torch", "triton"}), (PREFILL, {"cpu", "torch"})):
        assert kquant <= {b for bs, p in _ci_params(op) if p["wo"] in ("q4_k", "q6_k") for b in bs}, op
        assert {"cpu", "torch"} <= {b for bs, p in _ci_params(op) if p["wo"] in ("q4_1", "q5_1") for b in bs}, op
    mixed = {b for bs, p in _ci_params(BWD) if len({p["wqkv"], p.get("wk") or p["wqkv"], p.get("wv") or p["wqkv"]}) == 3
             for b in bs}
    assert mixed == {"cpu", "torch", "triton"}


@pytest.mark.parametrize("fmts", [("q5_0", "q8_0", "f32"), ("q4_0", "q4_1", "q5_1")])
def test_c_kernel_reads_each_projection_in_its_own_format(fmts):
    """blocks.c with W_q, W_k, W_v in three formats: k and v are their own formats' projections (L1: the weights
    dequantized, Q4_1 / Q5_1 with their mins), to double rounding."""
    from kernel_parity.kernels.cpu import blocks as cb

    x = _prepared(PREFILL, dict(P, wqkv=fmts[0], wk=fmts[1], wv=fmts[2])).inputs
    ws = list(zip(fmts, (x["wq"], x["wk"], x["wv"])))
    got = cb.attention_prefill(x["x"], x["gamma"], 1e-6, *ws, ("q8_0", x["wo"]), x["k_cache"].copy(),
                               x["v_cache"].copy(), x["cos"], x["sin"], P["start"], n=P["e"], h_q=P["hq"],
                               h_kv=P["hkv"], d=P["d"], bq=x["bq"], bk=x["bk"], bv=x["bv"],
                               quantize_activations=False)
    nrm = got["norm"].astype(np.float64)
    for name, (fmt, w), b in zip("kv", ws[1:], (x["bk"], x["bv"])):
        dense = w.astype(np.float64) if fmt == "f32" else quant.dequantize(fmt, w).astype(np.float64)
        want = (nrm @ dense.T + b).reshape(got[name].shape)
        np.testing.assert_allclose(got[name], want, rtol=2e-6, atol=1e-6, err_msg=name)


def _ci_params(op: str) -> list[tuple[set, dict]]:
    return [(set(c["backends"]), p) for c in suites.load_doc("ci")["cases"] if c["op"] == op and "params" in c
            for p in c["params"]]


@pytest.mark.parametrize("op", [DECODE, PREFILL])
def test_ci_runs_three_formats_in_one_block(op):
    got = {b for bs, p in _ci_params(op) if len({p["wqkv"], p.get("wk") or p["wqkv"], p.get("wv") or p["wqkv"]}) == 3
           for b in bs}
    assert got >= {"cpu", "torch"}


@pytest.mark.parametrize("e, fmts", [(256, ("q4_k", "q6_k", "q8_0")), (64, ("q4_1", "q5_1", "q4_0"))])
def test_quantized_projections_take_their_activation_formats_in_c_as_the_l2_golden(e, fmts):
    """blocks.c's K-quant projections (Q8_K activations, integer sub-block sums) and Q4_1 / Q5_1 ones (Q8_1, the
    min times the stored block sum) beside a Q8_0 / Q4_0 one: each projection is the golden's L2 (`emulated`)
    value to double rounding, and not the L1 one (the activation quantization shows)."""
    from kernel_parity.kernels.cpu import blocks as cb

    p = dict(P, e=e, wqkv=fmts[0], wk=fmts[1], wv=fmts[2])
    x = _prepared(PREFILL, p, dist="blocks").inputs
    ws = list(zip(fmts, (x["wq"], x["wk"], x["wv"])))
    got = cb.attention_prefill(x["x"], x["gamma"], 1e-6, *ws, ("q8_0", x["wo"]), x["k_cache"].copy(),
                               x["v_cache"].copy(), x["cos"], x["sin"], P["start"], n=e, h_q=P["hq"],
                               h_kv=P["hkv"], d=P["d"], bq=x["bq"], bk=x["bk"], bv=x["bv"])
    nrm = got["norm"].astype(np.float64)
    for name, w, b in zip("qkv", ws, (x["bq"], x["bk"], x["bv"])):
        l2 = ref.project(nrm, ref.Weight(*w), b, reference="emulated").reshape(got[name].shape)
        l1 = ref.project(nrm, ref.Weight(*w), b).reshape(got[name].shape)
        np.testing.assert_allclose(got[name], l2, rtol=1e-6, atol=1e-6, err_msg=name)
        assert np.abs(l2 - l1).max() > 1e-4 * np.abs(l1).max(), name
