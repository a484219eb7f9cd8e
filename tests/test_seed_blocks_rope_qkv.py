"""Seed audit S7, S11 and S4 for the attention blocks: RoPE's position apart from the cache slot (`rope_off`, the
seed's rope_pos_offset beside token_index), one fused W_qkv / b_qkv (`qkv=fused`, mega_fuse_rmsnorm_qkv) and the
fp32 per-head W_o [h_q, aE, a_d] (`wo_layout=head_major`, the bias once; the backward's dwo per head).

The contract (refimpl/blocks.py): token t is rotated at rope_off + start + t and written at slot start + t (the
causal mask counts slots); W_qkv's rows are the q heads', then the k heads', then the v heads' (b_qkv likewise),
and the backward returns dwqkv / dbqkv in that order. All three default to the older ops: their ids, inputs and
goldens are unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import blocks as ref

P = dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=3, start=5, cap=9, wqkv="f32", wo="f32", bias=1, obias=1,
         residual=1, style="half", theta=10000, eps="1e-6", gemma=0)
PREFILL, DECODE, BWD = "blocks.attention_prefill", "blocks.attention_decode", "blocks.attention_prefill_backward"


def _prepared(op: str, p: dict, dist: str = "heads", backend: str = "cpu", seed: int = 4) -> Prepared:
    return Prepared(ops.get(op), ops.make_case(op, backend, "fp32", p, dist, seed))


@pytest.mark.parametrize("op", [PREFILL, BWD])
def test_defaults_keep_the_older_ids_and_inputs(op):
    spec = ops.get(op)
    text = ",".join(f"{k}={v}" for k, v in P.items())
    base = spec.params.parse(op, text)
    assert "rope_off" not in base and "qkv" not in base
    assert spec.params.parse(op, text + ",rope_off=0,qkv=separate") == base
    a, b = _prepared(op, P).inputs64, _prepared(op, dict(P, rope_off=0, qkv="separate")).inputs64
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


@pytest.mark.parametrize("bad, what", [("qkv=concat", "qkv"), ("rope_off=-1", "rope_off")])
def test_bad_params_are_usage_errors(bad, what):
    text = ",".join(f"{k}={v}" for k, v in P.items())
    with pytest.raises(UsageError, match=what):
        ops.get(PREFILL).params.parse(PREFILL, f"{text},{bad}")


def test_rope_off_is_the_tables_shifted_and_moves_only_the_rotation():
    """rope_off = o at the full tables is rope_off = 0 at the tables from row o: the same golden; the caches'
    slots and the mask do not move. o = 3000 changes q_rope, k_rope, attn and out by O(1)."""
    o = 3000
    x = _prepared(PREFILL, dict(P, rope_off=o)).inputs64
    spec = ops.get(PREFILL)
    p = spec.params.parse(PREFILL, ",".join(f"{k}={v}" for k, v in P.items()))
    shifted = spec.reference({**x, "cos": x["cos"][o:], "sin": x["sin"][o:]}, p)
    got = spec.reference(x, {**p, "rope_off": o})
    for name in got:
        np.testing.assert_array_equal(got[name], shifted[name], err_msg=name)
    at_slot = spec.reference(x, p)
    for name in ("q_rope", "k_rope", "attn", "out"):
        assert np.max(np.abs(got[name] - at_slot[name])) > 0.1, f"{name}: rope_off changes nothing"
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(got[name], at_slot[name], err_msg=name)
    written = ~np.isnan(got["v_cache"][0, :, 0])
    assert np.array_equal(np.flatnonzero(written), np.arange(P["start"] + P["t"])), "rows written off their slots"


@pytest.mark.parametrize("op", [PREFILL, DECODE, BWD])
@pytest.mark.parametrize("wfmt", ["f32", "q8_0"])
def test_fused_qkv_is_the_separate_weights_concatenated(op, wfmt):
    p = dict(P, wqkv=wfmt, wo=wfmt)
    if op == DECODE:
        p = {k: v for k, v in p.items() if k not in ("t", "start")} | dict(pos=5, cap=6)
    if op == BWD:
        p = dict(p, wqkv="f32", wo="f32")
    sep, fused = _prepared(op, p).inputs64, _prepared(op, dict(p, qkv="fused")).inputs64
    assert "wq" not in fused and "bq" not in fused
    np.testing.assert_array_equal(fused["wqkv"], np.concatenate([sep["wq"], sep["wk"], sep["wv"]]))
    np.testing.assert_array_equal(fused["bqkv"], np.concatenate([sep["bq"], sep["bk"], sep["bv"]]))
    spec = ops.get(op)
    ps = spec.params.parse(op, ",".join(f"{k}={v}" for k, v in p.items()))
    a, b = spec.reference(sep, ps), spec.reference(fused, {**ps, "qkv": "fused"})
    if op == BWD:
        for w in ("w", "b"):
            np.testing.assert_array_equal(b.pop(f"d{w}qkv"),
                                          np.concatenate([a.pop(f"d{w}{k}") for k in ("q", "k", "v")]))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_sections_differ_far_beyond_rounding():
    """A section read at another's offset must be off by far more than a tolerance: the sections are independent
    draws, and under `heads` each head's rows carry their own scale (v's 10^U(-2, 2))."""
    x = _prepared(PREFILL, dict(P, qkv="fused")).inputs64
    ad, hkv = P["d"] + P["dpad"], P["hkv"]
    q, k, v = np.split(x["wqkv"], [P["hq"] * ad, (P["hq"] + hkv) * ad])
    for a, b in ((k, q[:hkv * ad]), (v, k), (v[ad:], k[:ad])):  # K at Q's offset, V at K's, V one head early
        assert np.linalg.norm(a - b) > 0.5 * np.linalg.norm(a)
    bq, bk, bv = np.split(x["bqkv"], [P["hq"] * ad, (P["hq"] + hkv) * ad])
    assert np.linalg.norm(bk - bv) > 0.5 * np.linalg.norm(bk)


def test_c_kernels_fused_and_offset_match_their_equivalents_bitwise():
    """blocks.c reads W_qkv's sections and rotates at rope_off + slot: the same bits as the separate weights at
    the shifted tables."""
    from kernel_parity.kernels.cpu import blocks as cb

    o = 4096
    x = _prepared(PREFILL, dict(P, wqkv="q8_0", rope_off=o), backend="cpu").inputs
    kw = dict(n=P["e"], h_q=P["hq"], h_kv=P["hkv"], d=P["d"], bo=x["bo"], residual=x["r"])
    ws = [("q8_0", x[n]) for n in ("wq", "wk", "wv")]
    fused = cb.attention_prefill(x["x"], x["gamma"], 1e-6, ("q8_0", np.concatenate([w for _, w in ws])), None, None,
                                 ("f32", x["wo"]), x["k_cache"].copy(), x["v_cache"].copy(), x["cos"], x["sin"],
                                 P["start"], bq=np.concatenate([x["bq"], x["bk"], x["bv"]]), rope_off=o, qkv="fused",
                                 **kw)
    shifted = cb.attention_prefill(x["x"], x["gamma"], 1e-6, *ws, ("f32", x["wo"]), x["k_cache"].copy(),
                                   x["v_cache"].copy(), np.ascontiguousarray(x["cos"][o:]),
                                   np.ascontiguousarray(x["sin"][o:]), P["start"], bq=x["bq"], bk=x["bk"], bv=x["bv"],
                                   **kw)
    for name in fused:
        np.testing.assert_array_equal(fused[name], shifted[name], err_msg=name)
    with pytest.raises(ValueError, match="wk, wv, bk, bv must be None"):
        cb.attention_prefill(x["x"], x["gamma"], 1e-6, ws[0], *ws[1:], ("f32", x["wo"]), x["k_cache"].copy(),
                             x["v_cache"].copy(), x["cos"], x["sin"], P["start"], qkv="fused", **kw)
    with pytest.raises(ValueError, match="cos/sin rows"):
        cb.attention_prefill(x["x"], x["gamma"], 1e-6, *ws, ("f32", x["wo"]), x["k_cache"].copy(),
                             x["v_cache"].copy(), x["cos"], x["sin"], P["start"], rope_off=o + 10, **kw)


def _ci_params(op: str) -> list[tuple[set, dict]]:
    return [(set(c["backends"]), p) for c in suites.load_doc("ci")["cases"] if c["op"] == op and "params" in c
            for p in c["params"]]


@pytest.mark.parametrize("op", [DECODE, PREFILL, BWD])
def test_ci_runs_a_large_rope_off_and_fused_qkv_with_biases_on_every_kernel_backend(op):
    params = _ci_params(op)
    off = {b for bs, p in params if p.get("rope_off", 0) >= 1000 for b in bs}
    fused = {b for bs, p in params if p.get("qkv") == "fused" and p["bias"] and p["hkv"] > 1 for b in bs}
    assert off >= {"cpu", "torch", "triton"} and fused >= {"cpu", "torch", "triton"}


@pytest.mark.parametrize("op", [PREFILL, DECODE, BWD])
def test_head_major_wo_is_the_flat_wo_per_head(op):
    p = dict(P)
    if op == DECODE:
        p = {k: v for k, v in p.items() if k not in ("t", "start")} | dict(pos=5, cap=6)
    flat, heads = _prepared(op, p).inputs64, _prepared(op, dict(p, wo_layout="head_major")).inputs64
    ae, ad = P["e"] + P["epad"], P["d"] + P["dpad"]
    assert heads["wo"].shape == (P["hq"], ae, ad)
    np.testing.assert_array_equal(heads["wo"], flat["wo"].reshape(ae, P["hq"], ad).transpose(1, 0, 2))
    spec = ops.get(op)
    ps = spec.params.parse(op, ",".join(f"{k}={v}" for k, v in p.items()))
    a, b = spec.reference(flat, ps), spec.reference(heads, {**ps, "wo_layout": "head_major"})
    if op == BWD:
        np.testing.assert_allclose(b.pop("dwo"), a.pop("dwo").reshape(ae, P["hq"], ad).transpose(1, 0, 2),
                                   rtol=1e-13, atol=0)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-13, atol=1e-300, err_msg=name)


def test_head_major_wo_needs_f32():
    with pytest.raises(UsageError, match="head_major"):
        ops.make_case(PREFILL, "cpu", "fp32", dict(P, wo="q8_0", wo_layout="head_major"), "normal", 1)


@pytest.mark.parametrize("op", [DECODE, PREFILL, BWD])
def test_ci_runs_head_major_wo_with_a_bias_on_every_kernel_backend(op):
    got = {b for bs, p in _ci_params(op) if p.get("wo_layout") == "head_major" and p["obias"] for b in bs}
    assert got >= {"cpu", "torch", "triton"}
