"""Seed audit S6 and S8 for the attention blocks: the `pads` inputs put large values only where the
contract makes an output zero by the kernel's own clearing (a cached row's lanes [d, a_d)), and the ci
suite reaches past the seed's 64-query tile with T >= 65 tokens.

The contract (refimpl/blocks.py, OPS.md layers): a cached row's padding lanes are cleared "whatever the
projection gave there"; the q / k / v / q_rope / k_rope stages keep the projection's values; x, gamma,
the residual, bo and the history's padding are zero in the inputs (a kernel may assume it), and W_o's
padded output rows too (out's padding is zero only through them).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import Registry
from kernel_parity.conformance.ops.blocks_inputs import PAD_SCALE, head_lanes
from kernel_parity.conformance.runner import Prepared, Runner
from kernel_parity.refimpl import gemm

P = dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=3, start=5, cap=9, wqkv="f32", wo="f32", bias=1, obias=1,
         residual=1, style="half", theta=10000, eps="1e-6", gemma=0)
EXACT = 1e-12  # float64 sums that differ only by added exact zeros (the padding times zero lanes)


def _prepared(p: dict, dist: str, seed: int = 4) -> Prepared:
    return Prepared(ops.get("blocks.attention_prefill"), ops.make_case("blocks.attention_prefill", "cpu", "fp32",
                                                                        p, dist, seed))


def _w(x: dict, p: dict, name: str, k: int) -> np.ndarray:
    fmt = p["wo"] if name == "wo" else p["wqkv"]
    return gemm.dequantize_weight(fmt, {"w": x[name]}, k)


@pytest.mark.parametrize("wfmt", ["f32", "q8_0"])
def test_pads_puts_values_only_where_a_kernel_must_clear(wfmt):
    p = dict(P, wqkv=wfmt, wo=wfmt)
    x = _prepared(p, "pads").inputs64
    ae, ad = p["e"] + p["epad"], p["d"] + p["dpad"]
    real_e = np.arange(ae) < p["e"]
    q_pad, kv_pad = head_lanes(p["hq"], p["d"], ad) == 0, head_lanes(p["hkv"], p["d"], ad) == 0
    for name, pad in (("wq", q_pad), ("wk", kv_pad), ("wv", kv_pad)):
        w = _w(x, p, name, ae)
        assert np.median(np.abs(w[pad])) > PAD_SCALE / 10, f"{name}'s padded rows are not large"
        # a Q8_0 code may round a small value to 0
        assert np.mean(w[~pad][:, ~real_e] != 0) > 0.9, f"{name}'s padded input columns are zero"
        b = x["b" + name[1]]
        assert np.median(np.abs(b[pad])) > PAD_SCALE / 10, f"b{name[1]}'s padded lanes are not large"
    wo = _w(x, p, "wo", p["hq"] * ad)
    assert np.mean(wo[real_e][:, q_pad] != 0) > 0.9, "W_o's padded columns are zero"
    # what the contract lets a kernel assume zero stays zero
    assert np.all(wo[~real_e] == 0), "W_o's padded rows must stay zero (out's padding has no clearing)"
    for name in ("x", "r"):
        assert np.all(x[name][:, ~real_e] == 0), f"{name}'s padding lanes"
    assert np.all(x["gamma"][~real_e] == 0) and np.all(x["bo"][~real_e] == 0)
    for name in ("k_cache", "v_cache"):
        assert np.all(x[name][:, :p["start"], p["d"]:] == 0), f"{name}: the history's padding lanes"


def test_pads_changes_the_stages_that_carry_padding_and_no_contract_output():
    """The golden of the `pads` inputs and of the same inputs with that padding zeroed (f32 weights: no
    quantization block shares a padded value): q, k, v, q_rope, k_rope differ at the padding lanes, the
    caches, attn and out are the same."""
    p = P
    prep = _prepared(p, "pads")
    x = dict(prep.inputs64)
    ad = p["d"] + p["dpad"]
    q_pad, kv_pad = head_lanes(p["hq"], p["d"], ad) == 0, head_lanes(p["hkv"], p["d"], ad) == 0
    real_e = np.arange(p["e"] + p["epad"]) < p["e"]
    z = {k: np.array(v, copy=True) for k, v in x.items()}
    for name, pad in (("wq", q_pad), ("wk", kv_pad), ("wv", kv_pad)):
        z[name][pad] = 0.0
        z[name][:, ~real_e] = 0.0
        z["b" + name[1]][pad] = 0.0
    z["wo"][:, q_pad] = 0.0
    spec = ops.get("blocks.attention_prefill")
    got, clean = spec.reference(x, prep.case.p), spec.reference(z, prep.case.p)
    for name in ("q", "k", "v", "q_rope", "k_rope"):
        pad = clean[name][..., p["d"]:]
        assert np.all(pad == 0) and np.abs(got[name][..., p["d"]:]).min() > 1.0, f"{name}: padding not carried"
        np.testing.assert_allclose(got[name][..., :p["d"]], clean[name][..., :p["d"]], rtol=EXACT)
    for name in ("norm", "k_cache", "v_cache", "attn", "out"):
        np.testing.assert_allclose(got[name], clean[name], rtol=EXACT, atol=0, err_msg=name)
        if name in ("k_cache", "v_cache", "attn"):
            assert np.all(got[name][..., p["d"]:][~np.isnan(got[name][..., p["d"]:])] == 0), name


def _copying_write(cache, rows, start, d):
    """A cache write that copies the projection's padding lanes instead of clearing them."""
    cache[:, start:start + rows.shape[0]] = rows.transpose(0, 1).to(cache.dtype)


@pytest.mark.parametrize("dist, want", [("normal", "pass"), ("pads", "fail")])
def test_a_write_that_copies_the_padding_fails_only_on_pads(monkeypatch, dist, want):
    from kernel_parity.conformance.backends import torch_backend
    from kernel_parity.kernels.torch import blocks as tblocks

    monkeypatch.setattr(tblocks, "write_cache", _copying_write)
    registry = Registry()
    registry.add(torch_backend.make())
    runner = Runner(registry, recheck=False, noise=False, diagnose=False)
    rec = runner.evaluate(ops.make_case("blocks.attention_prefill", "torch", "fp32", P, dist, 4))
    assert rec.verdict == want, f"{rec.id}: {rec.verdict} {rec.message or rec.reason}"
    if want == "fail":
        assert "k_cache" in (rec.message or "") or "attn" in (rec.message or "")


def _ci_cases(op: str) -> list[dict]:
    """The ci suite's [[cases]] entries of op, as written (op, backends, dists, params)."""
    return [c for c in suites.load_doc("ci")["cases"] if c["op"] == op and "params" in c]


@pytest.mark.parametrize("op", ["blocks.attention_decode", "blocks.attention_prefill",
                                "blocks.attention_prefill_backward"])
def test_ci_runs_pads_on_padded_heads_with_every_kernel_backend(op):
    cases = [c for c in _ci_cases(op) if "pads" in c["dists"]]
    assert {b for c in cases for b in c["backends"]} >= {"cpu", "torch", "triton"}
    params = [p for c in cases for p in c["params"]]
    assert any(p["dpad"] > 0 and p["bias"] for p in params), "no padded head with Q/K/V biases under pads"


@pytest.mark.parametrize("op", ["blocks.attention_prefill", "blocks.attention_prefill_backward"])
def test_ci_prefill_reaches_past_the_64_query_tile_without_gqa(op):
    """S8: T >= 65 tokens of one query head per kv head (GQA's 33 x 2 rows do not count), every backend."""
    cases = [c for c in _ci_cases(op) if any(p["t"] >= 65 and p["hq"] == p["hkv"] for p in c["params"])]
    assert {b for c in cases for b in c["backends"]} >= {"cpu", "torch", "triton"}
