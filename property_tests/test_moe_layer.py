"""Property tests of moe.layer (the MoE layer end to end): every kernel vs the golden, and the layer's invariants.

Kernel (every backend, or the --parity-backend plugins):
- moe.layer vs its golden over tokens (1 .. 12), odd hidden and intermediate sizes (partial router and expert
  tiles), 1 .. 16 experts, softmax / sigmoid scoring, renormalisation, bias, grouping, masks, routed scaling,
  0 .. 2 shared experts, every dist and dtype;
- each token's ids are k distinct experts in [0, E), and with renormalisation its weights sum to the routed
  scaling (within fp32);
- an expert no token chose can hold any weights: out, ids and weights stay bit for bit (the layer reads only the
  chosen experts);
- relabelling the experts inside each group (Wg's rows, the bias, w13 and w2 permuted alike) relabels the chosen
  ids the same way and leaves out and the weights within the op's limits.
Golden (float64):
- out is the routed experts' output at the golden's own ids and weights (moe.experts' golden), plus the shared ones.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 12), d=[16, 33, 64, 80], f=[16, 40, 64], e=[1, 2, 4, 6, 8, 16], k=(1, 4), groups=[1, 1, 2, 4],
             kept=(1, 4), shared=(0, 2))


def _valid(p):
    """groups dividing e, kept <= groups, k within the kept experts, mask -inf without groups."""
    g = p["groups"] if p["e"] % p["groups"] == 0 else 1
    kept = min(p["kept"], g)
    k = max(1, min(p["k"], kept * (p["e"] // g)))
    return {**p, "groups": g, "kept": kept, "k": k, "mask": p["mask"] if g > 1 else "-inf"}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=6)  # the interpreter: a Triton example is seconds (router, route, align, two GEMMs)
@given(case=cases("moe.layer", transform=_valid, **SMALL))
def test_layer(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=4)
@given(case=cases("moe.layer", transform=_valid, **SMALL))
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
@settings(max_examples=4)
@given(case=cases("moe.layer", transform=_valid, dists=("skew",), **dict(SMALL, e=[6, 8, 16])), data=st.data())
def test_unchosen_experts_weights_change_nothing(backend, case, data):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    a = runs.run(case, x)
    unchosen = np.setdiff1d(np.arange(case.p["e"]), np.asarray(a["ids"]))
    if unchosen.size == 0:
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="noise_seed"))
    y = dict(x)
    for name in ("w13", "w2"):
        w = x[name].copy()
        w[unchosen] = (rng.normal(0, 3, w[unchosen].shape)).astype(w.dtype)
        y[name] = w
    b = runs.run(case, y)
    runs.assert_same_bits(case, a, b, f"experts {unchosen.tolist()} (no token chose them) got other weights")


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=4)
@given(case=cases("moe.layer", transform=_valid, dists=("normal",), **SMALL), data=st.data())
def test_relabelling_experts_within_groups_relabels_the_ids(backend, case, data):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    e, g = case.p["e"], case.p["groups"]
    size = e // g
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="perm_seed"))
    perm = np.concatenate([j * size + rng.permutation(size) for j in range(g)])  # new expert c is old perm[c]
    y = dict(x)
    for name in ("wg", "w13", "w2", "bias"):
        if name in x:
            y[name] = np.ascontiguousarray(x[name][perm])
    a, b = runs.run(case, x), runs.run(case, y)
    mapped = np.sort(perm[np.asarray(b["ids"])], axis=-1)
    assert np.array_equal(mapped, np.asarray(a["ids"])), \
        f"{backend}: relabelled experts chose other experts  repro: parity repro {case.id}"
    order = np.argsort(perm[np.asarray(b["ids"])], axis=-1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(b["weights"]), order, axis=-1), a["weights"],
                               rtol=1e-5, atol=1e-6, err_msg=f"repro: parity repro {case.id}")
    runs.assert_close(case, {"out": b["out"]}, {"out": np.asarray(a["out"])}, "the experts were relabelled")


@given(seed=st.integers(0, 2 ** 31), k=st.integers(1, 3), s=st.integers(0, 2),
       scoring=st.sampled_from(["softmax", "sigmoid"]), renorm=st.booleans())
def test_golden_out_is_the_experts_at_its_own_routing(seed, k, s, scoring, renorm):
    from kernel_parity.refimpl import moe_experts as mx
    from kernel_parity.refimpl import moe_layer as ml

    rng = np.random.default_rng(seed)
    t, d, f, e = 7, 24, 16, 6
    x, wg = rng.normal(0, 1, (t, d)), rng.normal(0, 0.3, (e, d))
    w13, w2 = rng.normal(0, 0.2, (e, 2 * f, d)), rng.normal(0, 0.25, (e, d, f))
    sh = dict(ws13=rng.normal(0, 0.2, (s, 2 * f, d)), ws2=rng.normal(0, 0.25, (s, d, f))) if s else {}
    out, w, ids, _ = ml.layer(x, wg, w13, w2, k, scoring=scoring, renormalize=renorm, **sh)
    np.testing.assert_array_equal(out, mx.experts(x, ids, w, w13, w2, **sh))
    if renorm:
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-14)
