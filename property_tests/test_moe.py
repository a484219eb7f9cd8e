"""Property tests of the MoE family: every kernel vs the golden, and routing's invariants.

Kernel (every backend, or the --parity-backend plugins):
- moe.route vs its golden over scorings, renormalisation, bias, grouping (groups of 1-8, kept 1-all), masks, the
  routed scaling and every dist (shapes small: the Triton kernel runs through the interpreter on CI);
- each token's ids are k distinct experts in [0, E), and with renormalisation its weights sum to the routed
  scaling (within fp32);
- relabelling the experts inside each group (the logits' columns and the bias permuted alike) relabels the
  chosen ids the same way and leaves their weights (tokens without ties).
Golden (float64):
- a kept group never loses an expert to a dropped one under mask -inf; the weights are the unbiased scores.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernel_parity.refimpl.moe as ref
from kernel_parity.conformance.ops.moe_route import route_args
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 9), e=[1, 2, 6, 8, 16, 24, 60, 64, 128, 256], k=(1, 8), groups=[1, 1, 2, 4, 8], kept=(1, 8))


def _valid(p):
    """groups dividing e, kept <= groups, k within the kept experts, mask -inf without groups."""
    g = p["groups"] if p["e"] % p["groups"] == 0 else 1
    kept = min(p["kept"], g)
    k = max(1, min(p["k"], kept * (p["e"] // g)))
    return {**p, "groups": g, "kept": kept, "k": k, "mask": p["mask"] if g > 1 else "-inf"}


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("moe.route", transform=_valid, **SMALL))
def test_route(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("moe.route", transform=_valid, **SMALL))
def test_ids_distinct_in_range_and_weights_sum_to_the_scaling(backend, case):
    case = case.with_backend(backend)
    got = runs.run(case, runs.inputs_of(case))
    ids, w = np.asarray(got["ids"]), np.asarray(got["weights"], dtype=np.float64)
    e = case.p["e"]
    assert ((ids >= 0) & (ids < e)).all(), f"{backend}: an expert id outside [0, {e})  repro: parity repro {case.id}"
    assert all(len(set(r)) == len(r) for r in ids.tolist()), f"{backend}: a token chose an expert twice  " \
        f"repro: parity repro {case.id}"
    if case.p["renorm"]:
        want = float(case.p["rscale"])
        assert np.allclose(w.sum(axis=-1), want, rtol=1e-5, atol=0), \
            f"{backend}: renormalised weights sum to {w.sum(axis=-1)}, not {want}  repro: parity repro {case.id}"


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("moe.route", transform=_valid, dists=("normal", "last", "peaked"), **SMALL), data=st.data())
def test_relabelling_experts_within_groups_relabels_the_ids(backend, case, data):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    e, g = case.p["e"], case.p["groups"]
    size = e // g
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="perm_seed"))
    perm = np.concatenate([j * size + rng.permutation(size) for j in range(g)])  # new column c holds old perm[c]
    y = dict(x, logits=np.ascontiguousarray(x["logits"][:, perm]))
    if "bias" in x:
        y["bias"] = np.ascontiguousarray(x["bias"][perm])
    a, b = runs.run(case, x), runs.run(case, y)
    mapped = np.sort(perm[np.asarray(b["ids"])], axis=-1)
    assert np.array_equal(mapped, np.asarray(a["ids"])), \
        f"{backend}: relabelled experts chose other experts  repro: parity repro {case.id}"
    order = np.argsort(perm[np.asarray(b["ids"])], axis=-1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(b["weights"]), order, axis=-1), a["weights"],
                               rtol=1e-6, atol=0, err_msg=f"repro: parity repro {case.id}")


@given(t=st.integers(1, 6), seed=st.integers(0, 2 ** 31), data=st.data())
def test_golden_grouped_choice_stays_in_kept_groups_and_weighs_unbiased(t, seed, data):
    rng = np.random.default_rng(seed)
    g = data.draw(st.sampled_from([2, 4, 8]), label="groups")
    kept = data.draw(st.integers(1, g), label="kept")
    e = g * data.draw(st.integers(2, 8), label="size")
    k = data.draw(st.integers(1, kept * (e // g)), label="k")
    logits, bias = rng.normal(0, 1.5, (t, e)), rng.normal(0, 0.3, e)
    w, ids, _ = ref.route(logits, k, scoring="sigmoid", renormalize=False, bias=bias, n_group=g, topk_group=kept)
    assert all(len(set(r)) <= kept for r in (ids // (e // g)).tolist())
    np.testing.assert_allclose(w, 1 / (1 + np.exp(-np.take_along_axis(logits, ids.astype(np.int64), axis=-1))),
                               rtol=1e-15)


def test_route_args_are_the_goldens_keywords():
    p = {"scoring": "sigmoid", "renorm": 0, "groups": 8, "kept": 4, "rscale": "2.5", "mask": "zero"}
    assert route_args(p) == dict(scoring="sigmoid", renormalize=False, n_group=8, topk_group=4, routed_scaling=2.5,
                                 mask="zero")
