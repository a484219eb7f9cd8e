"""Property tests of moe.route_backward (the backward of MoE routing weights): kernels vs the golden, the golden
vs finite differences of the forward golden, and the op's invariants.

Kernel (every backend, or the --parity-backend plugins):
- moe.route_backward vs its golden over scorings, renormalisation, bias, grouping, masks, the routed scaling and
  every dist (shapes small: the Triton kernel runs through the interpreter on CI);
- softmax rows of the gradient sum to 0 (the softmax is invariant to a shift of a row's logits), within fp32;
- the grouping and the bias change nothing given the ids: the same inputs under other (valid) groups, kept,
  mask and without the bias give the same gradient, bit for bit.
Golden (float64):
- central differences of refimpl.moe.route's weights (the choice held: tokens whose choice a step could move
  are kept away by the margin) against route_backward, with the loss sum grad_w w;
- softmax with renormalisation: every unchosen expert's gradient is exactly 0, and the chosen ones are the
  backward of the softmax of the chosen logits alone;
- linear in grad_w, and routed_scaling c scales it by c.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import kernel_parity.refimpl.moe as ref
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.ops.moe_route import route_args
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl.moe_grad import route_backward_error_model

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 9), e=[1, 2, 6, 8, 16, 24, 60, 64, 128, 256], k=(1, 8), groups=[1, 1, 2, 4, 8], kept=(1, 8))
OP = "moe.route_backward"


def _valid(p):
    """groups dividing e, kept <= groups, k within the kept experts, mask -inf without groups."""
    g = p["groups"] if p["e"] % p["groups"] == 0 else 1
    kept = min(p["kept"], g)
    k = max(1, min(p["k"], kept * (p["e"] // g)))
    return {**p, "groups": g, "kept": kept, "k": k, "mask": p["mask"] if g > 1 else "-inf"}


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, **SMALL))
def test_route_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, scoring=["softmax"], **SMALL))
def test_softmax_gradient_rows_sum_to_zero(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    got = np.asarray(runs.run(case, x)["grad_logits"], dtype=np.float64)
    mag, _ = route_backward_error_model(x["logits"].astype(np.float64), x["ids"], x["grad_w"],
                                        bias=x.get("bias"), **route_args(case.p))
    # each element carries a few u32 of its magnitude (the op's error model); their sum at most the sum of those
    bound = 64 * 2.0 ** -24 * mag.sum(axis=-1) + 1e-30
    assert (np.abs(got.sum(axis=-1)) <= bound).all(), \
        f"{backend}: softmax gradient rows sum to {got.sum(axis=-1)}, not 0  repro: parity repro {case.id}"


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases(OP, transform=_valid, e=[8, 16, 64], k=(1, 4), groups=[2, 4, 8], kept=(1, 8), t=(1, 6)),
       data=st.data())
def test_grouping_and_bias_change_nothing_given_the_ids(backend, case, data):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    a = np.asarray(runs.run(case, x)["grad_logits"])
    # other routing params the same ids stay valid under: no grouping, no bias, the other mask
    other = {**case.p, "groups": 1, "kept": 1, "mask": "-inf", "bias": 0}
    y = {k: v for k, v in x.items() if k != "bias"}
    b = np.asarray(runs.run(Case.make(case.op, backend, case.dtype, other, case.dist, case.seed), y)["grad_logits"])
    assert np.array_equal(a, b), f"{backend}: the grouping or the bias changed the gradient  repro: parity repro " \
        f"{case.id}"


def _loss_weights(logits, ids, k, kw):
    """The forward golden's weights of the experts `ids` (T, k) at these logits, or None where its choice moved."""
    w, got, _ = ref.route(logits, k, **kw)
    order_got, order_ids = np.argsort(got, axis=-1), np.argsort(ids, axis=-1)
    if not np.array_equal(np.take_along_axis(got, order_got, -1), np.take_along_axis(ids, order_ids, -1)):
        return None
    out = np.empty_like(w)
    np.put_along_axis(out, order_ids, np.take_along_axis(w, order_got, -1), axis=-1)
    return out


@given(seed=st.integers(0, 2 ** 31), scoring=st.sampled_from(["softmax", "sigmoid"]), renorm=st.booleans(),
       bias=st.booleans(), rscale=st.sampled_from([1.0, 2.5]), data=st.data())
def test_golden_matches_central_differences_of_the_forward(seed, scoring, renorm, bias, rscale, data):
    rng = np.random.default_rng(seed)
    e = data.draw(st.sampled_from([2, 4, 6, 8, 16]), label="e")
    g = data.draw(st.sampled_from([d for d in (1, 2, 4) if e % d == 0]), label="groups")
    kept = data.draw(st.integers(1, g), label="kept")
    k = data.draw(st.integers(1, kept * (e // g)), label="k")
    t = 3
    logits = rng.normal(0, 1.5, (t, e))
    kw = dict(scoring=scoring, renormalize=renorm, bias=rng.normal(0, 0.3, e) if bias else None, n_group=g,
              topk_group=kept, routed_scaling=rscale)
    _, ids, margin = ref.route(logits, k, **kw)
    assume((margin > 1e-3).all())
    gw = rng.normal(0, 1, (t, k)) * np.where(np.arange(k) % 2 == 0, 1.0, 1e-3)
    want = ref.route_backward(logits, ids, gw, **kw)
    h = 1e-5
    fd = np.zeros_like(logits)
    for j in range(e):
        up, dn = logits.copy(), logits.copy()
        up[:, j] += h
        dn[:, j] -= h
        wu, wd = _loss_weights(up, ids, k, kw), _loss_weights(dn, ids, k, kw)
        assert wu is not None and wd is not None, "a step of 1e-5 moved a choice decided by a margin > 1e-3"
        fd[:, j] = ((wu - wd) * gw).sum(axis=-1) / (2 * h)
    scale = np.abs(want).max() + np.abs(gw).max() * rscale
    np.testing.assert_allclose(want, fd, rtol=1e-6, atol=1e-8 * scale)


@given(seed=st.integers(0, 2 ** 31), e=st.sampled_from([2, 8, 60, 128, 256]), data=st.data())
def test_golden_softmax_renormalised_unchosen_exact_zero_and_chosen_softmax(seed, e, data):
    rng = np.random.default_rng(seed)
    k = data.draw(st.integers(1, min(e, 8)), label="k")
    c = data.draw(st.sampled_from([1.0, 2.5]), label="rscale")
    logits = rng.normal(0, 3, (5, e))
    _, ids, _ = ref.route(logits, k)
    gw = rng.normal(0, 1, (5, k))
    grad = ref.route_backward(logits, ids, gw, routed_scaling=c)
    idx = ids.astype(np.int64)
    unchosen = np.ones_like(grad, dtype=bool)
    np.put_along_axis(unchosen, idx, False, axis=-1)
    assert (grad[unchosen] == 0.0).all()
    # the chosen: the backward of c softmax(l[ids]) alone, in float64
    lc = np.take_along_axis(logits, idx, axis=-1)
    p = np.exp(lc - lc.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    want = c * p * (gw - (gw * p).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.take_along_axis(grad, idx, axis=-1), want, rtol=1e-12,
                               atol=1e-15 * c * np.abs(gw).max())


@given(seed=st.integers(0, 2 ** 31), scoring=st.sampled_from(["softmax", "sigmoid"]), renorm=st.booleans())
def test_golden_linear_in_grad_w_and_the_scaling(seed, scoring, renorm):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (4, 16))
    _, ids, _ = ref.route(logits, 4, scoring=scoring, renormalize=renorm)
    a, b = rng.normal(0, 1, (4, 4)), rng.normal(0, 1, (4, 4))
    kw = dict(scoring=scoring, renormalize=renorm)
    ga, gb = ref.route_backward(logits, ids, a, **kw), ref.route_backward(logits, ids, b, **kw)
    scale = np.abs(ga).max() + np.abs(gb).max()
    np.testing.assert_allclose(ref.route_backward(logits, ids, 2 * a - b, **kw), 2 * ga - gb, rtol=0,
                               atol=1e-14 * scale)
    np.testing.assert_allclose(ref.route_backward(logits, ids, a, routed_scaling=2.5, **kw), 2.5 * ga, rtol=1e-14,
                               atol=1e-14 * 2.5 * np.abs(ga).max())  # s (g - r) cancels: relative to the row
