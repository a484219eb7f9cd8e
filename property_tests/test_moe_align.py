"""Property tests of moe.align (vLLM's moe_align_block_size): every kernel vs the golden, and the op's invariants.

Kernel (every backend, or the --parity-backend plugins):
- moe.align vs its golden over T, E (1 to DeepSeek-V3's 256), k, B (1, odd, vLLM's 16 / 64) and every dist;
- the outputs' invariants, checked on the kernel's own outputs (no golden): every slot t k + j appears exactly
  once in sorted_ids, every other entry is the sentinel T k; each expert's segment is a whole number of blocks,
  holds that expert's slots only, in ascending order, and its blocks are labelled with it; num_tokens_post_pad
  is the sum of the segments, every block from it on is -1 and every entry the sentinel;
- relabelling the experts (topk_ids through a permutation) moves whole segments: an expert's slots stay the
  same set, in the same order.
Golden: tokens appended after the others leave every expert's earlier slots first in its segment (stability).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.moe as ref
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 40), e=[1, 2, 3, 8, 16, 60, 128, 256], k=(1, 8), b=[1, 2, 7, 16, 64])


def _valid(p):
    """k <= e (a token's experts are distinct)."""
    return {**p, "k": min(p["k"], p["e"])}


def _segments(sorted_ids, expert_ids, total, n, B):
    """{expert: its slots in segment order}, checking the invariants on the way (assertion messages say which)."""
    sorted_ids, expert_ids = np.asarray(sorted_ids), np.asarray(expert_ids)
    assert total % B == 0, f"num_tokens_post_pad {total} not a multiple of B={B}"
    assert (sorted_ids[total:] == n).all(), "an entry past num_tokens_post_pad is not the sentinel"
    assert (expert_ids[total // B:] == -1).all(), "a block past num_tokens_post_pad is not -1"
    body = sorted_ids[:total]
    real = body[body != n]
    assert np.array_equal(np.sort(real), np.arange(n)), "the slots do not appear exactly once each"
    segs: dict[int, list[int]] = {}
    labels = expert_ids[: total // B]
    assert (np.diff(labels) >= 0).all() and (labels >= 0).all(), f"experts' blocks not in expert order: {labels}"
    for i, e in enumerate(labels.tolist()):
        block = body[i * B:(i + 1) * B]
        segs.setdefault(e, []).extend(block[block != n].tolist())
    for e, slots in segs.items():
        assert slots, f"expert {e} has a block without a slot"
        assert slots == sorted(slots), f"expert {e}'s slots not ascending: {slots}"
    for i, e in enumerate(labels.tolist()):  # the padding is at the segment's end: no sentinel before a slot
        block = body[i * B:(i + 1) * B]
        nxt = labels[i + 1] if i + 1 < labels.size else -2
        if nxt == e:
            assert (block != n).all(), f"expert {e}'s block {i} has padding before its next block"
        else:
            pad = block == n
            assert not (pad[:-1] & ~pad[1:]).any(), f"expert {e}'s last block has a slot after its padding"
    return segs


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("moe.align", transform=_valid, **SMALL))
def test_align(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("moe.align", transform=_valid, **SMALL))
def test_every_slot_once_in_its_experts_whole_blocks(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    got = runs.run(case, x)
    ids = np.asarray(x["topk_ids"])
    n, B = ids.size, case.p["b"]
    total = int(np.asarray(got["num_tokens_post_pad"])[0])
    try:
        segs = _segments(got["sorted_ids"], got["expert_ids"], total, n, B)
    except AssertionError as err:
        raise AssertionError(f"{backend}: {err}  repro: parity repro {case.id}") from None
    flat = ids.reshape(-1)
    for e, slots in segs.items():
        assert (flat[slots] == e).all(), f"{backend}: expert {e}'s segment holds another's slot  " \
            f"repro: parity repro {case.id}"
    counts = np.bincount(flat, minlength=case.p["e"])
    assert total == int((-(-counts // B) * B).sum()), f"{backend}: num_tokens_post_pad {total}  " \
        f"repro: parity repro {case.id}"
    assert set(segs) == set(np.flatnonzero(counts).tolist()), f"{backend}: experts with blocks are not the " \
        f"experts with tokens  repro: parity repro {case.id}"


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=10)  # the interpreter: four kernels a call, each example two calls
@given(case=cases("moe.align", transform=_valid, dists=("uniform", "skew", "aligned"), **SMALL), data=st.data())
def test_relabelling_experts_moves_whole_segments(backend, case, data):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    e, n, B = case.p["e"], np.asarray(x["topk_ids"]).size, case.p["b"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="perm_seed"))
    perm = rng.permutation(e).astype(np.int32)  # expert i becomes perm[i]
    y = dict(x, topk_ids=np.ascontiguousarray(perm[np.asarray(x["topk_ids"])]))
    a, b = runs.run(case, x), runs.run(case, y)
    sa = _segments(a["sorted_ids"], a["expert_ids"], int(np.asarray(a["num_tokens_post_pad"])[0]), n, B)
    sb = _segments(b["sorted_ids"], b["expert_ids"], int(np.asarray(b["num_tokens_post_pad"])[0]), n, B)
    assert {int(perm[k]): v for k, v in sa.items()} == sb, \
        f"{backend}: relabelled experts got other slots  repro: parity repro {case.id}"


@given(t=st.integers(1, 30), more=st.integers(1, 30), e=st.integers(1, 20), b=st.sampled_from([1, 3, 16]),
       seed=st.integers(0, 2 ** 31))
def test_golden_appended_tokens_come_after_in_every_segment(t, more, e, b, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, e + 1))
    ids = rng.integers(0, e, (t + more, k)).astype(np.int32)
    s1, x1, p1 = ref.align(ids[:t], e, b)
    s2, x2, p2 = ref.align(ids, e, b)
    n1, n2 = t * k, (t + more) * k
    seg1 = _segments(s1, x1, int(p1[0]), n1, b)
    seg2 = _segments(s2, x2, int(p2[0]), n2, b)
    for ex, slots in seg1.items():
        assert seg2[ex][: len(slots)] == slots
