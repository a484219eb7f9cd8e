"""Property tests of moe.experts (the fused MoE experts layer): every kernel vs the golden, and the layer's
invariants on the golden.

Kernel (every backend, or the --parity-backend plugins):
- moe.experts vs its golden over tokens (1 .. 12: partial and single-row blocks), odd hidden and intermediate
  sizes (partial tiles), 1 .. 8 experts, k 1 .. 4, 0 .. 2 shared experts, every dist and dtype; and with GPTQ
  int4 weights (D 128 / 256, F 128: the group's multiples).
Golden (float64):
- relabelling the experts (w13, w2 permuted along E, ids mapped alike) leaves out unchanged;
- a token's out is affine in its routing weights (linear in them, the shared experts the constant part).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.moe as ref
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 12), d=[16, 33, 64, 80], f=[16, 40, 64, 72], e=(1, 8), k=(1, 4), shared=(0, 2), wfmt=["dense"])
INT4 = dict(t=(1, 12), d=[128, 256], f=[128], e=(1, 6), k=(1, 3), shared=(0, 1), wfmt=["int4"])


def _valid(p):
    """k within the experts."""
    return {**p, "k": min(p["k"], p["e"])}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: a Triton example is seconds (two GEMM kernels a block)
@given(case=cases("moe.experts", transform=_valid, **SMALL))
def test_experts(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=4)  # D 128-256: a Triton example is ~5 s on the interpreter
@given(case=cases("moe.experts", transform=_valid, **INT4))
def test_experts_int4(parity, backend, case):
    parity.check(case.with_backend(backend))


def _layer(rng, t, d, f, e, k, s):
    x = rng.normal(0, 1, (t, d))
    ids = np.argsort(rng.random((t, e)), axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.05, 1, (t, k))
    w13 = rng.normal(0, d ** -0.5, (e, 2 * f, d)) * (10.0 ** (np.arange(e) % 3 - 1))[:, None, None]
    w2 = rng.normal(0, f ** -0.5, (e, d, f))
    shared = dict(ws13=rng.normal(0, d ** -0.5, (s, 2 * f, d)), ws2=rng.normal(0, f ** -0.5, (s, d, f))) if s else {}
    return x, ids, w, w13, w2, shared


@given(t=st.integers(1, 9), e=st.integers(1, 8), k=st.integers(1, 4), s=st.integers(0, 2), seed=st.integers(0, 2 ** 31),
       data=st.data())
def test_golden_relabelling_experts_leaves_out(t, e, k, s, seed, data):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, w13, w2, shared = _layer(rng, t, 24, 20, e, k, s)
    perm = rng.permutation(e)  # new expert c is old expert perm[c]
    inv = np.argsort(perm)
    a = ref.experts(x, ids, w, w13, w2, **shared)
    b = ref.experts(x, inv[ids].astype(np.int32), w, w13[perm], w2[perm], **shared)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())


@given(t=st.integers(1, 9), e=st.integers(1, 8), k=st.integers(1, 4), s=st.integers(0, 2), seed=st.integers(0, 2 ** 31),
       act=st.sampled_from([None, np.float32, np.float16]))
def test_golden_out_is_affine_in_the_routing_weights(t, e, k, s, seed, act):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, w13, w2, shared = _layer(rng, t, 24, 20, e, k, s)
    v = rng.uniform(0.05, 1, (t, k))
    a, b = rng.uniform(-2, 2, 2)
    f = lambda ww: ref.experts(x, ids, ww, w13, w2, act_dtype=act, **shared)  # noqa: E731
    zero = f(np.zeros_like(w))
    lhs = f(a * w + b * v) - zero
    rhs = a * (f(w) - zero) + b * (f(v) - zero)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(rhs).max()))
