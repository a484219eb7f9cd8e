"""Property tests of moe.experts_backward (the fused MoE experts layer's backward): every kernel vs the golden, and
the golden's invariants.

Kernel (every backend, or the --parity-backend plugins):
- moe.experts_backward vs its golden over tokens (1 .. 12: partial and single-row blocks), odd hidden and
  intermediate sizes (partial tiles), 1 .. 8 experts, k 1 .. 3, 0 .. 1 shared experts, every dist and dtype.
Golden (float64):
- every gradient equals the central finite difference of the forward golden's <dout, out> (refimpl.moe.experts,
  act not rounded) on tiny shapes: dx, dweights, dw13, dw2, dws13, dws2;
- every gradient is linear in dout (act's rounding included: it does not depend on dout);
- an expert no slot chose has dw13 = dw2 = 0 exactly.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.moe as ref
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 12), d=[16, 33, 64, 80], f=[16, 40, 64, 72], e=(1, 8), k=(1, 3), shared=(0, 1))


def _valid(p):
    """k within the experts."""
    return {**p, "k": min(p["k"], p["e"])}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: four Triton kernels an example
@given(case=cases("moe.experts_backward", transform=_valid, **SMALL))
def test_experts_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


def _layer(rng, t, d, f, e, k, s):
    x = rng.normal(0, 1, (t, d))
    ids = np.argsort(rng.random((t, e)), axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.05, 1, (t, k))
    w13 = rng.normal(0, d ** -0.5, (e, 2 * f, d)) * np.sqrt(10.0 ** (np.arange(e) % 3 - 1))[:, None, None]
    w2 = rng.normal(0, f ** -0.5, (e, d, f)) * (10.0 ** (np.arange(e) % 3 - 1))[:, None, None]
    shared = dict(ws13=rng.normal(0, d ** -0.5, (s, 2 * f, d)), ws2=rng.normal(0, f ** -0.5, (s, d, f))) if s else {}
    return x, ids, w, w13, w2, shared


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 4), e=st.integers(1, 4), k=st.integers(1, 2), s=st.integers(0, 1),
       seed=st.integers(0, 2 ** 31))
def test_golden_matches_central_finite_differences(t, e, k, s, seed):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    d, f = 5, 3
    x, ids, w, w13, w2, shared = _layer(rng, t, d, f, e, k, s)
    dout = rng.normal(0, 1, (t, d))
    args = {"x": x, "weights": w, "w13": w13, "w2": w2, **shared}
    grads = ref.experts_backward(x, ids, w, w13, w2, dout, **shared)

    def loss(name, a):
        kw = {**args, name: a}
        return float(np.sum(dout * ref.experts(kw["x"], ids, kw["weights"], kw["w13"], kw["w2"], ws13=kw.get("ws13"),
                                               ws2=kw.get("ws2"))))

    h = 1e-6
    for name, grad in (("x", "dx"), ("weights", "dweights"), ("w13", "dw13"), ("w2", "dw2"), ("ws13", "dws13"),
                       ("ws2", "dws2")):
        if name not in args:
            assert grad not in grads
            continue
        a = args[name]
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            up, dn = a.copy(), a.copy()
            up[i] += h
            dn[i] -= h
            num[i] = (loss(name, up) - loss(name, dn)) / (2 * h)
        scale = max(1.0, np.abs(grads[grad]).max())
        np.testing.assert_allclose(grads[grad], num, rtol=1e-6, atol=1e-6 * scale, err_msg=grad)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 9), e=st.integers(1, 8), k=st.integers(1, 4), s=st.integers(0, 2),
       seed=st.integers(0, 2 ** 31), act=st.sampled_from([None, np.float32, np.float16]))
def test_golden_is_linear_in_dout(t, e, k, s, seed, act):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, w13, w2, shared = _layer(rng, t, 24, 20, e, k, s)
    d1, d2 = rng.normal(0, 1, (2, t, 24))
    a, b = rng.uniform(-2, 2, 2)
    g = lambda dy: ref.experts_backward(x, ids, w, w13, w2, dy, act_dtype=act, **shared)  # noqa: E731
    lhs, g1, g2 = g(a * d1 + b * d2), g(d1), g(d2)
    for name in lhs:
        rhs = a * g1[name] + b * g2[name]
        np.testing.assert_allclose(lhs[name], rhs, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(rhs).max()),
                                   err_msg=name)


@given(t=st.integers(1, 9), e=st.integers(2, 8), seed=st.integers(0, 2 ** 31))
def test_golden_empty_expert_has_zero_weight_gradients(t, e, seed):
    rng = np.random.default_rng(seed)
    x, ids, w, w13, w2, _ = _layer(rng, t, 16, 8, e, 1, 0)
    ids[:] = rng.integers(0, e - 1, (t, 1))  # expert e - 1 gets no token
    g = ref.experts_backward(x, ids, w, w13, w2, rng.normal(0, 1, (t, 16)))
    for name in ("dw13", "dw2"):
        unused = np.setdiff1d(np.arange(e), ids)
        assert np.all(g[name][unused] == 0.0)
        assert np.all(np.abs(g[name][np.unique(ids)]).max(axis=(1, 2)) > 0)
