"""Property tests of MLA decode: every kernel vs the golden, and the op's invariants.

- permuting the cache pages (with the block table) changes nothing, bit for bit;
- sparse decode over a list of every visible key equals dense decode (kernel vs kernel, within
  the op's limits): the top-k path and the paged path compute one function;
- the Triton split-KV result does not depend on the partition: uniform splits, FlashMLA's
  scheduler (the golden of get_mla_metadata, turned into token ranges) or one split;
- FlashMLA's scheduler (golden) assigns every 64-token block of every request exactly once, on
  block edges, with bounded splits, for any lengths and SM-part counts; so does our host scheduler;
- the fused FP8 decode branch (RoPE + RMSNorm written into the cache, FP8 projections) vs its golden,
  the cache after the call included.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.ops.mla import DISTS, PAGE
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import mla as ref

SMALL = dict(b=(1, 4), hq=[1, 2, 4, 16], kv=(0, 200), hkv=[1], dists=tuple(DISTS))  # not the extreme logits ci judges
HEADS = {**SMALL, "hkv": [1, 2, 4]}  # FlashMLA's h_kv latent heads (hq drawn per kv head)


def _causal(p):
    """causal only with two new tokens; hq as hq kv heads' worth of query heads (hq % hkv == 0)."""
    return {**p, "causal": p["causal"] if p["sq"] == 2 else 0, "hq": p["hq"] * p.get("hkv", 1)}


@pytest.mark.parity_backends("triton", "cpu")
@given(case=cases("mla.decode", transform=_causal, **HEADS))
def test_decode(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends("triton")
@given(case=cases("mla.decode_sparse", topk=(1, 300), **SMALL))
def test_decode_sparse(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("mla.decode", transform=_causal, **HEADS), seed=st.integers(0, 2**32 - 1))
def test_permuting_pages_changes_nothing(parity, backend, case, seed):
    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    x = dict(a["inputs"])
    perm = np.random.default_rng(seed).permutation(x["kv_cache"].shape[0])
    inv = np.argsort(perm)
    x["kv_cache"] = np.ascontiguousarray(x["kv_cache"][perm])  # new block i holds old block perm[i]
    table = x["block_table"]
    live = table != 2147480000
    x["block_table"] = np.where(live, inv[np.where(live, table, 0)], table).astype(np.int32)
    runs.assert_same_bits(case, runs.run(case, x), a["outputs"], f"the pages were permuted by seed {seed}")


@pytest.mark.parity_backends("triton", "torch")
@given(case=cases("mla.decode", sq=[1], lens=["full", "ragged"], causal=[0], **SMALL))
def test_sparse_over_every_visible_key_equals_dense(parity, backend, case):
    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    x = a["inputs"]
    b, L = x["q"].shape[0], x["seqlens"]
    k = max(1, int(L.max()))
    tok = np.arange(k)
    slots = x["block_table"][:, np.minimum(tok // PAGE, x["block_table"].shape[1] - 1)].astype(np.int64) * PAGE + tok % PAGE
    idx = np.where(tok[None, :] < L[:, None], slots, -1).astype(np.int32)[:, None, :]
    p = {**case.p, "topk": k, "topk_len": "full"}
    p.pop("causal")
    sparse = ops.make_case("mla.decode_sparse", backend, case.dtype, p, case.dist, case.seed)
    got = runs.run(sparse, {"q": x["q"], "kv_cache": x["kv_cache"], "indices": idx,
                            "topk_length": np.full(b, k, dtype=np.int32)})
    runs.assert_close(case, got, a["outputs"], "the same keys were listed as a top-k index list")


@pytest.mark.parity_backends("triton")
@given(case=cases("mla.decode", transform=_causal, b=(1, 4), hq=[1, 4], kv=(1, 300), hkv=[1, 2], dists=tuple(DISTS)),
       parts=st.integers(1, 9), how=st.sampled_from(["uniform", "flashmla"]))
def test_triton_split_kv_independent_of_the_partition(parity, backend, case, parts, how):
    from kernel_parity.conformance.backends._torch import to_torch
    from kernel_parity.conformance.ops.mla import DV, SCALES
    from kernel_parity.kernels.triton.mla import mla_decode, mla_splits

    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    x = {k: to_torch(v, "cpu") for k, v in a["inputs"].items()}
    kw = dict(d_v=DV, causal=bool(case.p["causal"]))
    if how == "uniform":
        kw["num_splits"] = parts
    else:
        meta, num_splits = ref.schedule(a["inputs"]["seqlens"], case.p["sq"], case.p["hq"], parts)
        kw["splits"] = mla_splits(ref.partitions(meta, num_splits, a["inputs"]["seqlens"]))
    o, lse = mla_decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], SCALES[case.p["scale"]], **kw)
    got = {"o": runs.to_numpy(o), "lse": runs.to_numpy(lse)}
    runs.assert_close(case, got, a["outputs"], f"split {how} into {parts} parts")


@given(seqlens=st.lists(st.integers(0, 5000), min_size=1, max_size=40), parts=st.integers(1, 132),
       s_q=st.sampled_from([1, 2]), h_q=st.sampled_from([16, 64, 128]))
def test_flashmla_schedule_assigns_every_block_once(seqlens, parts, s_q, h_q):
    L = np.asarray(seqlens, dtype=np.int32)
    meta, num_splits = ref.schedule(L, s_q, h_q, parts)
    assert ref.check_schedule(meta, num_splits, L) == [], f"seqlens={seqlens} parts={parts}"


@example(seqlens=[4097], parts=65)  # one request, more parts than MAX_SPLITS: found by this test
@given(seqlens=st.lists(st.integers(0, 5000), min_size=1, max_size=40), parts=st.integers(1, 132))
def test_our_host_schedule_covers_every_page_once(seqlens, parts):
    from kernel_parity.kernels.triton.mla import MAX_SPLITS, mla_schedule

    bounds = mla_schedule(seqlens, parts).numpy()
    assert bounds.shape[1] - 1 <= MAX_SPLITS
    for i, n in enumerate(seqlens):
        b = bounds[i]
        assert b[0] == 0 and np.all(np.diff(b) >= 0), f"request {i}: boundaries {b.tolist()} not increasing from 0"
        assert b[-1] >= n, f"request {i}: boundaries end at {b[-1]} < length {n}"
        inner = b[(b > 0) & (b < n)]
        assert np.all(inner % PAGE == 0), f"request {i}: a boundary off a page edge: {b.tolist()}"


@pytest.mark.parity_backends("triton")
@given(case=cases("mla.decode_fused_fp8", b=(1, 3), hq=[1, 2, 4], kv=(0, 130), gran=["1x128x128"], mask=["causal"],
                   dtypes=("bf16",)))
def test_decode_fused_fp8(parity, backend, case):
    """The fused branch (RoPE + RMSNorm written back into the cache, FP8 projections, decode) vs the
    golden, the cache after the call included (an in-place output of the op), and with qrope q after the
    call (its rope part rotated in place; without qrope q must stay untouched)."""
    parity.check(case.with_backend(backend))
