"""Seed audit S21, extreme logits: FlashMLA's rows of logits near 1e12 and TensorRT-LLM's max taken before
masking. `huge_logits` and `neg_uniform` (conformance/ops/attention_inputs.EXTREME) on the forward attention
ops and mla.decode: exact in every dtype, so the float64 golden and an fp32 kernel see the same softmax.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.ops.attention_inputs import DISTS, EXTREME, HUGE_Q
from kernel_parity.conformance.ops.mla import D, PAGE, SCALES
from kernel_parity.conformance.runner import Prepared

PREFILL = dict(b=2, sq=9, sk=40, hq=4, hkv=2, d=64, causal="bottom_right", wl=-1, wr=-1, cap=0, sink=0)
MLA = dict(b=5, sq=2, hq=8, kv=64, lens="ragged", causal=1, scale="model")
RANGE = {"fp32": 3.4e38, "bf16": 3.4e38, "fp16": 65504.0}


def _prepared(op: str, p: dict, dtype: str, dist: str, seed: int = 3) -> Prepared:
    return Prepared(ops.get(op), ops.make_case(op, "cpu", dtype, p, dist, seed))


def _logits(x: dict) -> np.ndarray:
    """(b, h_q, s_q, s_k) float64 scale q.k of a prefill case (GQA grouped)."""
    q, k = x["q"], np.repeat(x["k"], x["q"].shape[2] // x["k"].shape[2], axis=2)
    return np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_huge_logits_are_exact_distinct_and_reach_the_dtype_range(dtype):
    x = _prepared("attention.prefill", PREFILL, dtype, "huge_logits").inputs64
    q, k = x["q"], x["k"]
    assert np.all(q[..., :-1] == 0) and set(np.unique(np.abs(q[..., -1]))) == {HUGE_Q.get(dtype, (2.0 ** 20,))[0]}
    lvl = k[..., -1]  # b, s_k, h_kv: increasing, distinct, 4 significant bits (exact in every dtype)
    assert np.all(np.diff(lvl, axis=1) > 0)
    assert np.all(np.ldexp(np.frexp(lvl)[0], 4) % 1 == 0)
    qk = np.abs(q[..., -1]).max() * lvl.max()
    assert qk < RANGE[dtype], "q.k overflows the dtype (fp16's eager logits)"
    s = _logits(x)
    assert np.abs(s).max() > (1e11 if dtype != "fp16" else 1e3)
    top2 = np.sort(s, axis=-1)[..., -2:]
    assert np.all(top2[..., 1] - top2[..., 0] >= top2[..., 1] / 16 - 1e-9 * np.abs(top2[..., 1])), \
        "neighbouring levels closer than 1/16"


def test_huge_logits_golden_is_one_hot_where_the_gap_is_huge():
    prep = _prepared("attention.prefill", PREFILL, "bf16", "huge_logits")
    o = prep.golden["o"]  # b, s_q, h_q, d_v
    s = np.where(_mask(PREFILL), _logits(prep.inputs64), -np.inf)
    v = np.repeat(prep.inputs64["v"], 2, axis=2)  # b, s_k, h_q, d
    top = np.argmax(s, axis=-1)  # b, h_q, s_q
    b, h, i = np.indices(top.shape)
    np.testing.assert_array_equal(o[b, i, h], v[b, top, h])


def _mask(p: dict) -> np.ndarray:
    i, j = np.arange(p["sq"])[:, None], np.arange(p["sk"])[None, :]
    return (j <= i + p["sk"] - p["sq"])[None, None]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_neg_uniform_rows_are_one_exact_logit_and_the_golden_their_mean(dtype):
    prep = _prepared("attention.prefill", PREFILL, dtype, "neg_uniform")
    s = _logits(prep.inputs64)
    assert np.all(s == s[..., :1]), "a row's logits differ"
    assert np.all((-s >= 100) & (-s <= 1100)), "exp(-C) must underflow fp32 (C >= 104)"
    keep = np.broadcast_to(_mask(PREFILL), s.shape)
    v = np.repeat(prep.inputs64["v"], 2, axis=2)
    mean = np.einsum("bhqk,bkhd->bqhd", keep / keep.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(prep.golden["o"], mean, rtol=1e-12, atol=1e-14)
    lse = s[..., 0] + np.log(keep.sum(-1))
    np.testing.assert_allclose(prep.golden["lse"], lse, rtol=1e-14)


def test_mla_extreme_logits_live_on_the_last_rope_dim():
    x = _prepared("mla.decode", MLA, "bf16", "huge_logits").inputs64
    q, cache, table, L = x["q"], x["kv_cache"], x["block_table"], x["seqlens"]
    assert np.all(q[..., :-1] == 0)
    for i in range(MLA["b"]):
        t = np.arange(L[i])
        rows = cache[table[i, t // PAGE], t % PAGE, 0]  # L_i, 576
        assert np.all(np.diff(rows[:, D - 1]) > 0), "levels must increase along the request's keys"
        assert np.all(np.isfinite(rows[:, :D - 1]))
    y = _prepared("mla.decode", MLA, "fp16", "neg_uniform").inputs64
    live = ~np.isnan(y["kv_cache"][:, :, 0, D - 1])
    assert np.all(y["kv_cache"][:, :, 0, D - 1][live] == 1.0)
    c = -y["q"][..., -1] * SCALES["model"]
    assert np.all((c >= 100) & (c <= 1100))


def test_extreme_logits_stay_out_of_the_backward_ops_and_the_older_cases():
    for op in ("attention.prefill", "attention.varlen", "attention.decode", "attention.decode_paged",
               "attention.decode_split", "attention.chunked_prefill", "mla.decode"):
        assert set(EXTREME) <= set(ops.get(op).dists), op
    for op in ("attention.prefill_backward", "attention.varlen_backward", "mla.decode_sparse",
               "mla.decode_fused_fp8"):
        assert not set(EXTREME) & set(ops.get(op).dists), op
    assert list(ops.get("attention.prefill_backward").dists) == [*DISTS, "scales"]


@pytest.mark.parametrize("op", ["attention.prefill", "attention.decode", "attention.decode_split", "mla.decode"])
def test_ci_runs_both_extreme_distributions(op):
    docs = [c for c in suites.load_doc("ci")["cases"] if c["op"] == op and set(c.get("dists", ())) & set(EXTREME)]
    assert {d for c in docs for d in c["dists"]} >= set(EXTREME)
    kinds = {"triton", "torch"} | ({"cpu"} if op != "attention.decode_split" else set())
    assert {b for c in docs for b in c["backends"]} >= kinds
