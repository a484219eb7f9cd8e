"""The MoE routing golden (refimpl/moe.py) against plain torch transcriptions of the routers it names, in float64:
Mixtral's (softmax, top-k, renormalised), Qwen3-MoE's without renormalisation, DeepSeek-V3's gate (sigmoid, the
score-correction bias for the choice only, 8 groups of 32 ranked by their two best, 4 kept, top-8, renormalised,
x 2.5) as its inference code and vLLM's grouped_topk write it; and its declared conventions: ties to the lower
index, a dropped group's experts at -inf or 0, margins, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.refimpl import moe

torch = pytest.importorskip("torch")


def _as_sets(ids):
    return [set(r) for r in np.asarray(ids).tolist()]


def _torch_softmax_topk(logits, k, renorm):
    s = torch.softmax(torch.from_numpy(logits), dim=-1)
    w, i = torch.topk(s, k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.numpy(), i.numpy()


def _torch_deepseek(logits, bias, k, n_group, topk_group, scale, fill=float("-inf")):
    """DeepSeek-V3's gate as its inference code writes it (sigmoid, bias for the choice, grouped top-k)."""
    x = torch.from_numpy(logits)
    scores = x.sigmoid()
    original = scores
    s = scores + torch.from_numpy(bias)
    T = x.shape[0]
    g = s.view(T, n_group, -1)
    group_scores = g.topk(2, dim=-1)[0].sum(dim=-1)
    idx = group_scores.topk(topk_group, dim=-1)[1]
    drop = torch.ones(T, n_group, dtype=torch.bool).scatter_(1, idx, False)
    s = g.masked_fill(drop.unsqueeze(-1), fill).flatten(1)
    ids = torch.topk(s, k, dim=-1)[1]
    w = original.gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True)
    return (w * scale).numpy(), ids.numpy()


@pytest.mark.parametrize("E,k,renorm", [(8, 2, True), (128, 8, False), (60, 4, True)])
def test_softmax_routing_matches_torch(E, k, renorm):
    """Mixtral-8x7B (8 experts, top-2, renormalised), Qwen3-30B-A3B's shape (128, top-8) without renormalisation,
    Qwen1.5-MoE's 60: continuous random logits (no ties), same expert sets and weights."""
    logits = np.random.default_rng(E).normal(0, 2, (64, E))
    w, ids, margin = moe.route(logits, k, scoring="softmax", renormalize=renorm)
    tw, tids = _torch_softmax_topk(logits, k, renorm)
    assert _as_sets(ids) == _as_sets(tids)
    np.testing.assert_allclose(np.sort(w, axis=-1), np.sort(tw, axis=-1), rtol=1e-14, atol=0)
    assert (margin > 0).all() and np.isfinite(margin).all()
    if renorm:
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-14)


def test_mixtral_renormalised_equals_softmax_over_the_chosen_logits():
    logits = np.random.default_rng(1).normal(0, 3, (32, 8))
    w, ids, _ = moe.route(logits, 2)
    chosen = np.take_along_axis(logits, ids.astype(np.int64), axis=-1)
    e = np.exp(chosen - chosen.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(w, e / e.sum(axis=-1, keepdims=True), rtol=1e-14)


@pytest.mark.parametrize("fill,mask", [(float("-inf"), "-inf"), (0.0, "zero")])
def test_deepseek_v3_grouped_routing_matches_its_gate(fill, mask):
    """DeepSeek-V3: 256 experts, 8 groups, 4 kept, top-8, bias for the choice only, routed scaling 2.5."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, (128, 256))
    bias = rng.normal(0, 0.3, 256)
    w, ids, margin = moe.route(logits, 8, scoring="sigmoid", bias=bias, n_group=8, topk_group=4, routed_scaling=2.5,
                               mask=mask)
    tw, tids = _torch_deepseek(logits, bias, 8, 8, 4, 2.5, fill)
    assert _as_sets(ids) == _as_sets(tids)
    np.testing.assert_allclose(np.sort(w, axis=-1), np.sort(tw, axis=-1), rtol=1e-14)
    np.testing.assert_allclose(w.sum(axis=-1), 2.5, rtol=1e-14)
    assert (ids // 32 < 8).all() and all(len(set(r)) <= 4 for r in (ids // 32).tolist())  # at most 4 groups
    assert (margin > 0).all()


def test_the_bias_chooses_but_never_weighs():
    """A bias that lifts expert 0 into the top-k makes it chosen with its unbiased sigmoid as its weight."""
    logits = np.array([[-3.0, 0.1, 0.2, 0.3]])
    bias = np.array([10.0, 0.0, 0.0, 0.0])
    w, ids, _ = moe.route(logits, 2, scoring="sigmoid", bias=bias, renormalize=False)
    assert ids.tolist() == [[0, 3]]
    np.testing.assert_allclose(w, [[1 / (1 + np.exp(3.0)), 1 / (1 + np.exp(-0.3))]], rtol=1e-15)


def test_ties_go_to_the_lower_index_and_give_zero_margin():
    logits = np.zeros((3, 6))
    logits[1, [2, 4]] = 1.0  # two equal leaders, then four equal rest
    logits[2] = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    w, ids, margin = moe.route(logits, 2)
    assert ids.tolist() == [[0, 1], [2, 4], [1, 2]]
    np.testing.assert_allclose(w[0], [0.5, 0.5], rtol=1e-15)
    assert margin.tolist()[0] == 0.0 and margin[1] > 0 and margin[2] == 0.0


def test_group_ties_and_the_group_score_without_bias_is_the_max():
    """Without a bias a group's score is its best expert: groups {0,1} and {2,3}; group 1's best (2.0) beats group
    0's best (1.5) although group 0's two sum to more."""
    logits = np.array([[1.5, 1.4, 2.0, -5.0], [1.0, 0.0, 1.0, 0.0]])
    _, ids, margin = moe.route(logits, 1, scoring="sigmoid", n_group=2, topk_group=1)
    assert ids.tolist() == [[2], [0]]  # row 1: equal groups, the lower one kept
    assert margin[1] == 0.0


def test_a_dropped_group_at_zero_can_beat_a_kept_negative_expert():
    """mask 'zero' (Hugging Face's modeling_deepseek.py) against '-inf': a bias makes the kept group's second
    expert negative, so with 0 a dropped group's expert (select 0) outranks it."""
    logits = np.array([[3.0, 0.0, -1.0, -1.0]])
    bias = np.array([0.0, -0.9, 0.0, 0.0])  # select: [0.95, -0.4, 0.27, 0.27]; groups: 0.55 vs 0.54
    _, ids_inf, _ = moe.route(logits, 2, scoring="sigmoid", bias=bias, n_group=2, topk_group=1, mask="-inf")
    _, ids_zero, _ = moe.route(logits, 2, scoring="sigmoid", bias=bias, n_group=2, topk_group=1, mask="zero")
    assert ids_inf.tolist() == [[0, 1]] and ids_zero.tolist() == [[0, 2]]


def test_neg_inf_logits_and_zero_sums():
    logits = np.array([[-np.inf, 0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf, -np.inf]])
    w, ids, _ = moe.route(logits, 2)
    assert ids.tolist()[0] == [3, 1] and np.isfinite(w).all()
    np.testing.assert_array_equal(w[1], [0.0, 0.0])  # all experts impossible: softmax 0, weights 0, not NaN


@pytest.mark.parametrize("kw,match", [
    (dict(k=0), "k=0"), (dict(k=9), "k=9"), (dict(k=2, scoring="relu"), "scoring"),
    (dict(k=2, n_group=3), "n_group"), (dict(k=2, n_group=2, topk_group=3), "topk_group"),
    (dict(k=5, n_group=2, topk_group=1), "k=5"), (dict(k=2, mask="nan"), "mask"),
])
def test_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        moe.route(np.zeros((2, 8)), **kw)


def test_refuses_nan_and_bad_shapes():
    with pytest.raises(ValueError, match="finite"):
        moe.route(np.array([[0.0, np.nan]]), 1)
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        moe.route(np.zeros(8), 1)


def test_vectorised_over_tokens():
    """One call over 4096 tokens x 256 experts (DeepSeek-V3's routing of a prefill chunk) equals the row-by-row
    calls, and takes well under a second (the gate calls it per case)."""
    rng = np.random.default_rng(7)
    logits, bias = rng.normal(0, 1, (4096, 256)), rng.normal(0, 0.1, 256)
    kw = dict(scoring="sigmoid", bias=bias, n_group=8, topk_group=4, routed_scaling=2.5)
    w, ids, margin = moe.route(logits, 8, **kw)
    for t in (0, 1, 4095):
        w1, i1, m1 = moe.route(logits[t:t + 1], 8, **kw)
        np.testing.assert_array_equal(ids[t:t + 1], i1)
        np.testing.assert_array_equal(w[t:t + 1], w1)
        np.testing.assert_array_equal(margin[t:t + 1], m1)


@pytest.mark.parametrize("kw", [dict(k=0), dict(k=9), dict(k=2, scoring="relu"), dict(k=2, n_group=3),
                                dict(k=2, n_group=2, topk_group=3), dict(k=5, n_group=2, topk_group=1),
                                dict(k=2, mask="nan")])
def test_the_cpu_and_torch_kernels_refuse_as_the_golden_does(kw):
    """The kernels' shared rules (kernels/moe_args.py) and the golden's own: the same refusals, the same line."""
    from kernel_parity.kernels.cpu import moe as cpu
    from kernel_parity.kernels.torch import moe as eager

    msgs = set()
    for f, x in ((moe.route, np.zeros((2, 8))), (cpu.route, np.zeros((2, 8), np.float32)),
                 (eager.route, torch.zeros(2, 8))):
        with pytest.raises(ValueError) as e:
            f(x, **kw)
        msgs.add(str(e.value))
    assert len(msgs) == 1, msgs
