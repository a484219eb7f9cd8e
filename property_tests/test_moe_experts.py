"""Property tests of moe.experts (the fused MoE experts layer): every kernel vs the golden, and the layer's
invariants on the golden.

Kernel (every backend, or the --parity-backend plugins):
- moe.experts vs its golden over tokens (1 .. 12: partial and single-row blocks), odd hidden and intermediate
  sizes (partial tiles), 1 .. 8 experts, k 1 .. 4, 0 .. 2 shared experts, every dist and dtype; and with GPTQ
  int4 weights (D 128 / 256, F 128: the group's multiples); and with block-FP8 weights, w8a16 (fp8w) and w8a8 (fp8:
  x and act quantized per token per 128 columns, the act quantizer's flip bound in the magnitude), D and F 128 / 256.
Golden (float64):
- relabelling the experts (w13, w2 permuted along E, ids mapped alike) leaves out unchanged;
- a token's out is affine in its routing weights (linear in them, the shared experts the constant part);
- block FP8: out is linear in w2's block scales (a power of two on every scale of w2 scales out exactly, w8a16 and
  w8a8 alike: act is not touched), and w8a8's flip bound is zero for an act far from every midpoint (a test dtype of
  float64 act, none of its codes can move) only where it says so: never negative, and the w8a16 golden (act not
  quantized) differs from the w8a8 one.
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
FP8 = dict(t=(1, 10), d=[128, 256], f=[128, 256], e=(1, 4), k=(1, 3), shared=(0, 1), wfmt=["fp8w", "fp8"])


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


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=5)  # D, F 128-256: a Triton example is seconds on the interpreter
@given(case=cases("moe.experts", transform=_valid, **FP8))
def test_experts_fp8(parity, backend, case):
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


def _fp8(rng, t, e, k, s):
    """A layer with block-FP8 weights (two row and two column blocks a weight), x in bf16's values."""
    import ml_dtypes

    from kernel_parity.refimpl.quant_fp import fp8_quantize_blocks

    x, ids, w, w13, w2, shared = _layer(rng, t, 256, 128, e, k, s)
    x = x.astype(ml_dtypes.bfloat16).astype(np.float64)

    def q(a):
        parts = [fp8_quantize_blocks(m * (10.0 ** rng.integers(-2, 2)), 128, 128) for m in a]
        return np.stack([c for c, _ in parts]), np.stack([sc for _, sc in parts])

    return x, ids, w, q(w13), q(w2), {n: q(v) for n, v in shared.items()}


@settings(max_examples=10)
@given(t=st.integers(1, 6), e=st.integers(1, 4), k=st.integers(1, 3), s=st.integers(0, 1), j=st.integers(-20, 20),
       seed=st.integers(0, 2 ** 31), quant=st.sampled_from([None, "e4m3"]))
def test_golden_fp8_out_scales_with_w2s_block_scales(t, e, k, s, j, seed, quant):
    import ml_dtypes

    from kernel_parity.refimpl.moe_experts import BlockFP8

    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, (c13, s13), (c2, s2), sh = _fp8(rng, t, e, k, s)
    shb = {n: BlockFP8(*v) for n, v in sh.items()}
    def f(sc):
        return ref.experts(x, ids, w, BlockFP8(c13, s13), BlockFP8(c2, sc), act_dtype=ml_dtypes.bfloat16,
                           act_quant=quant, **shb)

    base = f(s2)
    scaled = f((s2.astype(np.float64) * 2.0 ** j).astype(np.float32))
    shared = 0.0 if not s else ref.experts(x, ids, 0 * w, BlockFP8(c13, s13), BlockFP8(c2, s2),
                                           act_dtype=ml_dtypes.bfloat16, act_quant=quant, **shb)
    np.testing.assert_allclose(scaled - shared, (base - shared) * 2.0 ** j, rtol=1e-12,
                               atol=1e-13 * (np.abs(base).max() + np.abs(scaled).max()))


@settings(max_examples=8)
@given(t=st.integers(1, 6), e=st.integers(1, 4), k=st.integers(1, 3), s=st.integers(0, 1), seed=st.integers(0, 2 ** 31))
def test_golden_w8a8_flip_bound_is_nonnegative_and_w8a8_differs_from_w8a16(t, e, k, s, seed):
    import ml_dtypes

    from kernel_parity.refimpl.moe_experts import BlockFP8

    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, b13, b2, sh = _fp8(rng, t, e, k, s)
    args = (x, ids, w, BlockFP8(*b13), BlockFP8(*b2))
    shb = {n: BlockFP8(*v) for n, v in sh.items()}
    q = ref.experts(*args, act_dtype=ml_dtypes.bfloat16, act_quant="e4m3", flip_bound=True, **shb)
    assert q.shape == (2, t, 256) and (q >= 0).all() and np.isfinite(q).all()
    a8 = ref.experts(*args, act_dtype=ml_dtypes.bfloat16, act_quant="e4m3", **shb)
    a16 = ref.experts(*args, act_dtype=ml_dtypes.bfloat16, **shb)
    assert not np.allclose(a8, a16, rtol=1e-3, atol=0)
