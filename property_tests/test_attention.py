"""Property tests of the attention family: every kernel vs the golden, and the invariants

- GQA equals MHA with the KV heads repeated;
- a paged cache equals the contiguous one, and permuting the pages (with the table) changes
  nothing, bit for bit;
- the split-KV result does not depend on the number of splits, nor on the partition (equal
  counts, fixed blocks, explicit boundaries);
- bottom-right and top-left alignment agree when s_q == s_k;
- keys outside the window or the causal mask change nothing, bit for bit;
- chunked prefill: two chunks of each sequence (the second after the first's keys) equal one
  chunk of the whole, and a paged cache equals the contiguous one, bit for bit.

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
from kernel_parity.conformance.ops.attention_inputs import DISTS, cu_seqlens, value_dim
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases


def heads(p):
    """hq is drawn as a group size: hq = hkv * group keeps every draw valid; an aliased V (vk=1)
    is at most d wide; a block partition gets blk > 0 and enough splits to cover kv."""
    p = {**p, "hq": p["hkv"] * p["hq"]}
    if p["causal"] != "none":
        p["wr"] = min(p["wr"], 0)
    if p.get("vk"):
        p["dv"] = min(p["dv"], p["d"])
    if "part" in p:
        p["blk"] = p["blk"] if p["part"] == "block" else 0
        if p["part"] == "block":
            p["splits"] = max(p["splits"], -(-p["kv"] // p["blk"]))
    return p


MASKS = dict(wl=[-1, -1, 0, 1, 3, 9], wr=[-1, -1, 0, 2], cap=[0, 0, 30], sink=[0, 1])
HEADS = dict(hq=(1, 4), hkv=[1, 2], d=[16, 32, 64, 96], dv=[0, 0, 0, 16, 48])
ALIAS = dict(vk=[0, 0, 1])
PARTS = dict(part=["equal", "block", "bounds"], blk=[16, 64])
SMALL = {
    "attention.prefill": dict(b=(1, 2), sq=(1, 24), sk=(1, 40), **HEADS, **MASKS),
    "attention.varlen": dict(b=(1, 4), sq=(1, 16), sk=(1, 24), **HEADS, **MASKS),
    "attention.decode": dict(b=(1, 3), sq=(1, 4), kv=(0, 64), **HEADS, **ALIAS, **MASKS),
    "attention.decode_paged": dict(b=(1, 3), sq=(1, 4), kv=(0, 80), **HEADS, **ALIAS, **MASKS),
    "attention.decode_split": dict(b=(1, 3), sq=(1, 4), kv=(0, 64), splits=(1, 9), **HEADS, **ALIAS, **PARTS,
                                   page=[0, 0, 16, 64], **MASKS),
    "attention.chunked_prefill": dict(b=(1, 4), sq=(1, 20), hist=(0, 40), hq=(1, 4), hkv=[1, 2], d=[16, 32, 64],
                                      page=[0, 16, 64], **MASKS),
}
BACKENDS = {
    "attention.prefill": ("triton", "cpu", "sdpa-cpu"),
    "attention.varlen": ("triton",),
    "attention.decode": ("triton", "cpu"),
    "attention.decode_paged": ("triton", "cpu"),
    "attention.decode_split": ("triton",),
    "attention.chunked_prefill": ("triton", "cpu"),
}


def attn_cases(op, **over):
    # DISTS, not the extreme logits (attention_inputs.EXTREME), which ci judges: their exact-tie, one-hot rows
    # are not what these invariants (other partitions, other chunkings) are about
    return cases(op, transform=heads, **{"dists": tuple(DISTS), **SMALL[op], **over})


@pytest.mark.parity_backends(by_op=BACKENDS)
@given(data=st.data())
def test_attention(parity, op, backend, data):
    parity.check(data.draw(attn_cases(op)).with_backend(backend))


# -- invariants on the kernels ------------------------------------------------------------------
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.decode", hkv=[2], hq=(2, 4), vk=[0]))
def test_gqa_equals_mha_with_repeated_kv(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    g = case.p["hq"] // case.p["hkv"]
    mha = ops.make_case(case.op, backend, case.dtype, {**case.p, "hkv": case.p["hq"]}, case.dist, case.seed)
    y = {**x, "k_cache": np.repeat(x["k_cache"], g, axis=2), "v_cache": np.repeat(x["v_cache"], g, axis=2)}
    runs.assert_close(case, runs.run(mha, y), runs.run(case, x), f"the {case.p['hkv']} kv heads were repeated {g}x")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.decode_paged", vk=[0]), perm_seed=st.integers(0, 2**32 - 1))
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
@given(case=attn_cases("attention.decode_split", part=["equal"]), other=st.integers(1, 9))
def test_split_kv_result_independent_of_splits(backend, case, other):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    alt = ops.make_case(case.op, backend, case.dtype, {**case.p, "splits": other}, case.dist, case.seed)
    a, b = runs.run(case, x), runs.run(alt, x)
    runs.assert_close(case, {"o": b["o"], "lse": b["lse"]}, {"o": a["o"], "lse": a["lse"]},
                      f"{other} splits were used instead of {case.p['splits']}")


def _partitions(p):
    """(part, blk, splits) of the three partitions of a decode_split case's keys."""
    blk = p.get("blk") or 16
    return (("equal", 0, p["splits"]), ("block", blk, max(-(-p["kv"] // blk), 1)), ("bounds", 0, p["splits"]))


@pytest.mark.parity_backends("triton", "torch")
@given(case=attn_cases("attention.decode_split"))
def test_split_kv_result_independent_of_partition(backend, case):
    p = case.p
    made = {part: ops.make_case(case.op, backend, case.dtype, {**p, "part": part, "blk": blk, "splits": n},
                                case.dist, case.seed) for part, blk, n in _partitions(p)}
    x = runs.inputs_of(made["bounds"])  # q, k, v are drawn before the boundaries: the same for all three
    got = {part: runs.run(c, x) for part, c in made.items()}
    for part in ("block", "bounds"):
        runs.assert_close(made[part], {n: got[part][n] for n in ("o", "lse")}, {n: got["equal"][n] for n in ("o", "lse")},
                          f"the keys were split by part={part} instead of equal counts")


def _two_chunks(case, x, cut):
    """Cases and inputs of the first `cut` queries of every chunk and of the rest (lens=full). Causal
    only: without the mask the first part's queries would also see the second part's keys."""
    p, b = case.p, case.p["b"]
    q = x["q"].reshape(b, p["sq"], *x["q"].shape[1:])
    out = []
    for lo, hi in ((0, cut), (cut, p["sq"])):
        sub = ops.make_case(case.op, case.backend, case.dtype, {**p, "sq": hi - lo, "hist": p["hist"] + lo},
                            case.dist, case.seed)
        y = {**x, "q": np.ascontiguousarray(q[:, lo:hi].reshape(-1, *q.shape[2:])),
             "cu_seqlens_q": cu_seqlens(np.full(b, hi - lo)), "hist": (x["hist"] + lo).astype(np.int32)}
        out.append((sub, y, hi - lo))
    return out


def _join(parts, b):
    """o (total_q, h, d_v) and lse (h, total_q) of chunk parts, sequence by sequence."""
    o = np.concatenate([r["o"].reshape(b, n, *r["o"].shape[1:]) for r, n in parts], axis=1)
    lse = np.concatenate([r["lse"].reshape(r["lse"].shape[0], b, n) for r, n in parts], axis=2)
    return {"o": o.reshape(-1, *o.shape[2:]), "lse": lse.reshape(lse.shape[0], -1)}


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.chunked_prefill", lens=["full"], sq=(2, 20), causal=["bottom_right"]), cut=st.integers(1, 19))
def test_chunked_prefill_in_two_chunks_equals_one(backend, case, cut):
    case = case.with_backend(backend)
    cut = min(cut, case.p["sq"] - 1)
    x = runs.inputs_of(case)
    parts = [(runs.run(sub, y), n) for sub, y, n in _two_chunks(case, x, cut)]
    runs.assert_close(case, _join(parts, case.p["b"]), runs.run(case, x),
                      f"each chunk was prefilled in two, the second after the first {cut} queries")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=attn_cases("attention.chunked_prefill", page=[16, 64]))
def test_chunked_prefill_paged_equals_contiguous_bit_for_bit(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    contig = ops.make_case(case.op, backend, case.dtype, {**case.p, "page": 0}, case.dist, case.seed)
    y = {n: t for n, t in x.items() if n != "block_table"}
    for name in ("k_cache", "v_cache"):  # the logical cache, NaN where the pages were
        y[name] = ref.gather_pages(x[name], x["block_table"]).astype(x[name].dtype)
    runs.assert_same_bits(case, runs.run(contig, y), runs.run(case, x), "the paged cache was laid out contiguously")


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


@given(case=attn_cases("attention.decode_split", part=["equal"], vk=[0]), other=st.integers(1, 9))
def test_golden_split_independent_of_splits_and_equal_to_decode(case, other):
    x = {k: (v.astype(np.float64) if v.dtype.kind not in "iu" else v) for k, v in runs.inputs_of(case).items()}
    kw = dict(causal=case.p["causal"], window=(case.p["wl"], case.p["wr"]), softcap=float(case.p["cap"]),
              sinks=x.get("sinks"))
    bt = x.get("block_table")  # page > 0: the split golden reads pages, plain decode their gathered cache
    loc = x.get("cache_loc")  # rows > 0: sequence b's cache (or table row) is row cache_loc[b]
    o1, l1, *_ = ref.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], case.p["splits"], block_table=bt,
                                  cache_loc=loc, **kw)
    o2, l2, *_ = ref.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], other, block_table=bt,
                                  cache_loc=loc, **kw)
    if bt is not None and loc is not None:
        bt, loc = bt[loc], None  # the sequences' own table rows; plain decode reads their gathered pages
    kc, vc = (x[n] if bt is None else ref.gather_pages(x[n], bt) for n in ("k_cache", "v_cache"))
    o3, l3, _ = ref.decode(x["q"], kc, vc, x["seqlens"], cache_loc=loc, **kw)
    for got, what in ((o2, "O with other splits"), (o3, "O of plain decode")):
        _close(got, o1, what)
    for got, what in ((l2, "LSE with other splits"), (l3, "LSE of plain decode")):
        _close(got, l1, what)


@given(case=attn_cases("attention.decode_split"))
def test_golden_split_independent_of_partition(case):
    p = case.p
    x = ops.make_case(case.op, case.backend, case.dtype, {**p, "part": "bounds", "blk": 0}, case.dist, case.seed)
    x = {k: (v.astype(np.float64) if v.dtype.kind not in "iu" else v) for k, v in runs.inputs_of(x).items()}
    v = x["v_cache"] if "v_cache" in x else x["k_cache"][..., :value_dim(p)]
    kw = dict(causal=p["causal"], window=(p["wl"], p["wr"]), softcap=float(p["cap"]), sinks=x.get("sinks"))
    got = {}
    for part, blk, n in _partitions(p):
        bounds = x["split_bounds"] if part == "bounds" else None
        got[part] = ref.decode_split(x["q"], x["k_cache"], v, x["seqlens"], n, block=blk or None, bounds=bounds,
                                     block_table=x.get("block_table"), cache_loc=x.get("cache_loc"), **kw)
    for part in ("block", "bounds"):
        _close(got[part][0], got["equal"][0], f"O with part={part}")
        _close(got[part][1], got["equal"][1], f"LSE with part={part}")


@given(case=attn_cases("attention.chunked_prefill", lens=["full"], sq=(2, 20), causal=["bottom_right"]), cut=st.integers(1, 19))
def test_golden_chunked_prefill_in_two_chunks_equals_one(case, cut):
    cut = min(cut, case.p["sq"] - 1)
    kw = dict(causal=case.p["causal"], window=(case.p["wl"], case.p["wr"]), softcap=float(case.p["cap"]))

    def golden(y):
        y = {k: (v.astype(np.float64) if v.dtype.kind not in "iu" else v) for k, v in y.items()}
        o, lse, _ = ref.chunked_prefill(y["q"], y["k_cache"], y["v_cache"], y["cu_seqlens_q"], y["hist"],
                                        y.get("block_table"), sinks=y.get("sinks"), cache_loc=y.get("cache_loc"), **kw)
        return {"o": o, "lse": lse}

    x = runs.inputs_of(case)
    joined = _join([(golden(y), n) for _, y, n in _two_chunks(case, x, cut)], case.p["b"])
    whole = golden(x)
    _close(joined["o"], whole["o"], f"O of two chunks cut at {cut}")
    _close(joined["lse"], whole["lse"], f"LSE of two chunks cut at {cut}")


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
