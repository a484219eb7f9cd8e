"""Property tests of the attention family: every kernel vs the golden, and the invariants

- GQA equals MHA with the KV heads repeated;
- a paged cache equals the contiguous one, and permuting the pages (with the table) changes
  nothing, bit for bit;
- the split-KV result does not depend on the number of splits;
- bottom-right and top-left alignment agree when s_q == s_k;
- keys outside the window or the causal mask change nothing, bit for bit.

Shapes are small: the Triton kernels run in the interpreter on CI. The eager torch backend is
the noise baseline, not a kernel under test here: it rounds the logits to the test dtype on
purpose (FlashAttention's same-precision reference), and hypothesis drives that rounding past
the bf16 limits (a softcap near saturation with peaked logits gave O off by 4% of max|O|:
attention.prefill/torch/bf16/b=1,sq=19,sk=31,hq=2,hkv=2,d=17,causal=none,wl=-1,wr=-1,cap=30,sink=0/large/seed=16381).
It runs its fixed ci-suite cases in the gate and takes part in the invariants below.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernel_parity.refimpl.attention as ref
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases


def heads(p):
    """hq is drawn as a group size: hq = hkv * group keeps every draw valid."""
    p = {**p, "hq": p["hkv"] * p["hq"]}
    if p["causal"] != "none":
        p["wr"] = min(p["wr"], 0)
    return p


MASKS = dict(wl=[-1, -1, 0, 1, 3, 9], wr=[-1, -1, 0, 2], cap=[0, 0, 30], sink=[0, 1])
HEADS = dict(hq=(1, 4), hkv=[1, 2], d=[16, 32, 64, 96])
SMALL = {
    "attention.prefill": dict(b=(1, 2), sq=(1, 24), sk=(1, 40), **HEADS, **MASKS),
    "attention.varlen": dict(b=(1, 4), sq=(1, 16), sk=(1, 24), **HEADS, **MASKS),
    "attention.decode": dict(b=(1, 3), sq=(1, 4), kv=(0, 64), **HEADS, **MASKS),
    "attention.decode_paged": dict(b=(1, 3), sq=(1, 4), kv=(0, 80), **HEADS, **MASKS),
    "attention.decode_split": dict(b=(1, 3), sq=(1, 4), kv=(0, 64), splits=(1, 9), **HEADS, **MASKS),
}
BACKENDS = {
    "attention.prefill": ("triton", "cpu", "sdpa-cpu"),
    "attention.varlen": ("triton",),
    "attention.decode": ("triton", "cpu"),
    "attention.decode_paged": ("triton", "cpu"),
    "attention.decode_split": ("triton",),
}


def attn_cases(op, **over):
    return cases(op, transform=heads, **{**SMALL[op], **over})


@pytest.mark.parity_backends(by_op=BACKENDS)
@given(data=st.data())
def test_attention(parity, op, backend, data):
    parity.check(data.draw(attn_cases(op)).with_backend(backend))


# -- invariants on the kernels ------------------------------------------------------------------
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.decode", hkv=[2], hq=(2, 4)))
def test_gqa_equals_mha_with_repeated_kv(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    g = case.p["hq"] // case.p["hkv"]
    mha = ops.make_case(case.op, backend, case.dtype, {**case.p, "hkv": case.p["hq"]}, case.dist, case.seed)
    y = {**x, "k_cache": np.repeat(x["k_cache"], g, axis=2), "v_cache": np.repeat(x["v_cache"], g, axis=2)}
    runs.assert_close(case, runs.run(mha, y), runs.run(case, x), f"the {case.p['hkv']} kv heads were repeated {g}x")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.decode_paged"), perm_seed=st.integers(0, 2**32 - 1))
def test_paged_equals_contiguous_and_page_order_is_irrelevant(backend, case, perm_seed):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    paged = runs.run(case, x)
    # Permute the physical pages and rewrite the table: same logical cache, same bits out.
    perm = np.random.default_rng(perm_seed).permutation(x["k_cache"].shape[0])
    inv = np.argsort(perm)
    y = {**x, "k_cache": x["k_cache"][perm], "v_cache": x["v_cache"][perm],
         "block_table": inv[x["block_table"]].astype(np.int32)}
    runs.assert_same_bits(case, runs.run(case, y), paged, "the pages were permuted with the block table")
    # The same sequences in a contiguous cache (NaN past each length, as the decode op has them).
    p = {k: v for k, v in case.p.items() if k != "page"}
    contig = ops.make_case("attention.decode", backend, case.dtype, p, case.dist, case.seed)
    k = ref.gather_pages(x["k_cache"], x["block_table"]).astype(x["k_cache"].dtype)
    v = ref.gather_pages(x["v_cache"], x["block_table"]).astype(x["v_cache"].dtype)
    z = {n: t for n, t in x.items() if n not in ("k_cache", "v_cache", "block_table")}
    runs.assert_close(case, runs.run(contig, {**z, "k_cache": k, "v_cache": v}), paged,
                      "the paged cache was laid out contiguously")


@pytest.mark.parity_backends("triton", "torch")
@given(case=attn_cases("attention.decode_split"), other=st.integers(1, 9))
def test_split_kv_result_independent_of_splits(backend, case, other):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    alt = ops.make_case(case.op, backend, case.dtype, {**case.p, "splits": other}, case.dist, case.seed)
    a, b = runs.run(case, x), runs.run(alt, x)
    runs.assert_close(case, {"o": b["o"], "lse": b["lse"]}, {"o": a["o"], "lse": a["lse"]},
                      f"{other} splits were used instead of {case.p['splits']}")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.prefill", causal=["bottom_right"]))
def test_alignments_agree_when_square(backend, case):
    p = {**case.p, "sk": case.p["sq"]}
    br = ops.make_case(case.op, backend, case.dtype, p, case.dist, case.seed)
    tl = ops.make_case(case.op, backend, case.dtype, {**p, "causal": "top_left"}, case.dist, case.seed)
    x = runs.inputs_of(br)
    runs.assert_close(br, runs.run(tl, x), runs.run(br, x), "top_left alignment was used with s_q == s_k")


@pytest.mark.parity_backends("triton", "cpu", "torch", "sdpa-cpu")
@given(case=attn_cases("attention.prefill", causal=["bottom_right", "top_left", "none"]), seed=st.integers(0, 2**32 - 1))
def test_masked_keys_change_nothing(backend, case, seed):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    p = case.p
    keep = ref.mask(p["sq"], p["sk"], np.full(p["b"], p["sq"]), np.full(p["b"], p["sk"]), p["causal"], (p["wl"], p["wr"]))
    unread = ~keep.any(axis=1)  # b, s_k: keys no query may attend
    rng = np.random.default_rng(seed)
    y = dict(x)
    for name in ("k", "v"):
        t = x[name].astype(np.float64)
        t[unread] = rng.standard_normal(t[unread].shape) * 100.0
        y[name] = t.astype(x[name].dtype)
    runs.assert_same_bits(case, runs.run(case, y), runs.run(case, x), "keys outside the mask were changed")


# -- the same invariants on the golden, in float64 ------------------------------------------------
def _close(got, want, what):
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


@given(case=attn_cases("attention.decode_split"), other=st.integers(1, 9))
def test_golden_split_independent_of_splits_and_equal_to_decode(case, other):
    x = {k: (v.astype(np.float64) if v.dtype.kind not in "iu" else v) for k, v in runs.inputs_of(case).items()}
    kw = dict(causal=case.p["causal"], window=(case.p["wl"], case.p["wr"]), softcap=float(case.p["cap"]),
              sinks=x.get("sinks"))
    o1, l1, *_ = ref.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], case.p["splits"], **kw)
    o2, l2, *_ = ref.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], other, **kw)
    o3, l3, _ = ref.decode(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], **kw)
    for got, what in ((o2, "O with other splits"), (o3, "O of plain decode")):
        _close(got, o1, what)
    for got, what in ((l2, "LSE with other splits"), (l3, "LSE of plain decode")):
        _close(got, l1, what)


@given(case=attn_cases("attention.prefill"))
def test_golden_gqa_equals_mha(case):
    x = runs.inputs_of(case)
    q, k, v = (x[n].astype(np.float64) for n in ("q", "k", "v"))
    g = case.p["hq"] // case.p["hkv"]
    kw = dict(causal=case.p["causal"], window=(case.p["wl"], case.p["wr"]), softcap=float(case.p["cap"]))
    o1, l1, _ = ref.prefill(q, k, v, **kw)
    o2, l2, _ = ref.prefill(q, np.repeat(k, g, axis=2), np.repeat(v, g, axis=2), **kw)
    _close(o2, o1, "O of MHA with repeated KV")
    _close(l2, l1, "LSE of MHA with repeated KV")


def test_golden_fully_masked_rows_and_sinks():
    q = np.ones((1, 3, 1, 4))
    k = np.ones((1, 1, 1, 4))
    o, lse, lse_sink = ref.prefill(q, k, k, causal="bottom_right", sinks=np.array([0.5]))
    # s_q = 3 > s_k = 1: rows 0 and 1 see no key; the sink takes row 2's mass exp(0.5) too
    assert np.array_equal(o[0, :2], np.zeros((2, 1, 4))) and np.all(np.isneginf(lse[0, 0, :2]))
    assert np.array_equal(lse_sink[0, 0, :2], [0.5, 0.5])
    assert np.isclose(o[0, 2, 0, 0], np.exp(2.0) / (np.exp(2.0) + np.exp(0.5)))
