"""Property tests of kvquant.chunked_prefill (packed query chunks over a quantized paged KV cache): every kernel
vs the golden, and the op's invariants.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.chunked_prefill vs its golden over every format x granularity, GQA groups 1-4, head dims 16-128, pages
  of 16 / 64, ragged and full (chunk, history) pairs up to 24 queries over 120 cached tokens, both dists;
- scaling every K scale by c is scaling the query by c (c a power of two: q c and s_k c are exact, the logits
  the same);
- the physical pages permuted (codes and token scales) with the block table renamed to match give the same
  bits: the kernel follows the table, not the layout.
Golden:
- with one query a sequence, the op is kvquant.decode_paged on the same cache (seq_lens = hist + 1, LSE
  transposed), golden against golden, bit for bit in float64.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.conformance.ops.kvquant_prefill import CHUNKED_PREFILL, lengths
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import kvquant

BACKENDS = ("triton", "cpu", "torch")
OP = "kvquant.chunked_prefill"
SMALL = dict(b=(1, 8), sq=(1, 24), hist=(0, 120), hq=(1, 8), hkv=[1, 1, 2, 4], d=[16, 32, 64, 128])


def _valid(p):
    """hq a multiple of hkv: hq = hkv x a group of 1, 2 or 4 (hq drawn in [1, 8] picks it)."""
    group = [1, 2, 4][p["hq"] % 3]
    return {**p, "hq": p["hkv"] * group}


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, **SMALL))
def test_chunked_prefill(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, **SMALL), e=st.sampled_from([-2, -1, 1, 2]))
def test_k_scales_times_c_is_q_times_c(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    c = np.float32(2.0 ** e)
    by_k = dict(x, k_scale=np.ascontiguousarray(x["k_scale"] * c))
    by_q = dict(x, q=np.ascontiguousarray(x["q"] * x["q"].dtype.type(c)))
    runs.assert_close(case, runs.run(case, by_k), runs.run(case, by_q),
                      f"the K scales were scaled by {c} (against q scaled by {c})")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, **SMALL), seed=st.integers(0, 2**32 - 1))
def test_pages_moved_give_the_same_bits(backend, case, seed):
    """The physical pages permuted (codes, and token scales with them) and the block table renamed to match:
    a kernel that follows the table gives the same bits."""
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    nb = x["k_cache"].shape[0]
    perm = np.random.default_rng(seed).permutation(nb)  # new page perm[i] holds old page i
    inv = np.argsort(perm)
    moved = dict(x, k_cache=np.ascontiguousarray(x["k_cache"][inv]), v_cache=np.ascontiguousarray(x["v_cache"][inv]),
                 block_table=perm[x["block_table"]].astype(np.int32))
    if x["k_scale"].ndim == 3:
        moved.update(k_scale=np.ascontiguousarray(x["k_scale"][inv]), v_scale=np.ascontiguousarray(x["v_scale"][inv]))
    runs.assert_same_bits(case, runs.run(case, x), runs.run(case, moved), "the pages were moved (table renamed)")


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(kvquant.FORMATS), gran=st.sampled_from(kvquant.GRANS),
       lens=st.sampled_from(["full", "ragged"]), dist=st.sampled_from(["normal", "grid"]), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       hist=st.integers(0, 90), page=st.sampled_from([16, 64]), seed=st.integers(0, 2**32 - 1))
def test_one_query_chunks_are_decode_paged(fmt, gran, lens, dist, hkv, group, hist, page, seed):
    p = dict(b=8, sq=1, hist=hist, hq=hkv * group, hkv=hkv, d=32, lens=lens, page=page, fmt=fmt, gran=gran)
    x = CHUNKED_PREFILL.make_inputs(p, "fp32", dist, np.random.default_rng(seed))
    o, lse = kvquant.chunked_prefill(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"],
                                     x["cu_seqlens_q"], x["hist"], x["block_table"])
    lq, hs = lengths(p)
    one = lq == 1
    assert int(one.sum()) == o.shape[0]
    do, dl = kvquant.decode_paged(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"],
                                  x["block_table"][one], (hs[one] + 1).astype(np.int32))
    np.testing.assert_array_equal(o, do)
    np.testing.assert_array_equal(lse, dl.T)
