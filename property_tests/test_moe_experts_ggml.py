"""Property tests of moe.experts with GGML expert weights (wfmt q8_0 / q4_0 / q4_k / q6_k, w-only): every kernel vs
the golden, and the golden's invariants.

Kernel (every backend, or the --parity-backend plugins):
- the 32-element formats (q8_0, q4_0) over tokens 1 .. 10, D and F 32 .. 128 (one to four blocks a row; partial
  64-column tiles), 1 .. 6 experts, k 1 .. 3, 0 .. 1 shared experts, every dtype and dist; the K-quants (q4_k,
  q6_k) at D, F 256 / 512.
Golden (float64):
- relabelling the experts (the blocks permuted along E, ids mapped alike) leaves out unchanged;
- q8_0 / q4_0 values are d x code: doubling every block scale d of w2 (its fp16 exponent + 1) doubles the routed
  experts' output exactly (act untouched), the shared experts' part unchanged;
- the golden on GGMLWeight equals the golden on the dense float64 dequantization (what the weight means).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import quant
from kernel_parity.refimpl.moe_experts import GGMLWeight, experts

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 10), d=[32, 64, 96, 128], f=[32, 64, 96], e=(1, 6), k=(1, 3), shared=(0, 1),
             wfmt=["q8_0", "q4_0"])
KQ = dict(t=(1, 6), d=[256, 512], f=[256], e=(1, 3), k=(1, 2), shared=(0, 1), wfmt=["q4_k", "q6_k"])


def _valid(p):
    """k within the experts."""
    return {**p, "k": min(p["k"], p["e"])}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=6)  # the interpreter: a Triton example is ~0.5-1 s at these sizes
@given(case=cases("moe.experts", transform=_valid, **SMALL))
def test_experts_ggml_32_blocks(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=3)  # D 256-512: a Triton example is seconds on the interpreter
@given(case=cases("moe.experts", transform=_valid, **KQ))
def test_experts_ggml_kquants(parity, backend, case):
    parity.check(case.with_backend(backend))


def _layer(rng, fmt, t, e, k, s, d=64, f=32):
    x = rng.normal(0, 1, (t, d))
    ids = np.argsort(rng.random((t, e)), axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.05, 1, (t, k))

    def q(n, kk, lead):
        return np.stack([quant.quantize(fmt, (rng.normal(0, kk ** -0.5, (n, kk)) * 10.0 ** (i % 3 - 1))
                                        .astype(np.float32)) for i in range(lead)])

    sh = dict(ws13=GGMLWeight(fmt, q(2 * f, d, s)), ws2=GGMLWeight(fmt, q(d, f, s))) if s else {}
    return x, ids, w, q(2 * f, d, e), q(d, f, e), sh


@settings(max_examples=10)
@given(fmt=st.sampled_from(["q8_0", "q4_0", "q4_k", "q6_k"]), t=st.integers(1, 8), e=st.integers(1, 5),
       k=st.integers(1, 3), s=st.integers(0, 1), seed=st.integers(0, 2 ** 31))
def test_golden_ggml_relabelling_and_dense_meaning(fmt, t, e, k, s, seed):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    d, f = (64, 32) if quant.FORMATS[fmt].block == 32 else (256, 256)
    x, ids, w, b13, b2, sh = _layer(rng, fmt, t, e, k, s, d, f)
    a = experts(x, ids, w, GGMLWeight(fmt, b13), GGMLWeight(fmt, b2), act_dtype=np.float32, **sh)
    perm = rng.permutation(e)
    b = experts(x, np.argsort(perm)[ids].astype(np.int32), w, GGMLWeight(fmt, b13[perm]), GGMLWeight(fmt, b2[perm]),
                act_dtype=np.float32, **sh)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())
    dense = lambda b_: np.stack([quant.dequantize(fmt, m) for m in b_])  # noqa: E731
    shd = {n: np.stack([v[i] for i in range(v.shape[0])]) for n, v in sh.items()}
    c = experts(x, ids, w, dense(b13), dense(b2), act_dtype=np.float32, **shd)
    np.testing.assert_array_equal(a, c)


@settings(max_examples=10)
@given(fmt=st.sampled_from(["q8_0", "q4_0"]), t=st.integers(1, 8), e=st.integers(1, 5), k=st.integers(1, 3),
       s=st.integers(0, 1), seed=st.integers(0, 2 ** 31))
def test_golden_ggml_out_doubles_with_w2s_block_scales(fmt, t, e, k, s, seed):
    rng = np.random.default_rng(seed)
    k = min(k, e)
    x, ids, w, b13, b2, sh = _layer(rng, fmt, t, e, k, s)
    nb = quant.FORMATS[fmt].nbytes
    blocks = b2.reshape(*b2.shape[:2], -1, nb).copy()
    bits = blocks[..., 0:2].copy().view("<u2")
    exp = (bits >> 10) & 0x1F
    if ((exp == 0) | (exp >= 0x1E)).any():  # a subnormal or near-overflow scale: doubling is not an exponent step
        return
    blocks[..., 0:2] = (bits + 0x400).view(np.uint8)
    b2x = blocks.reshape(b2.shape)
    np.testing.assert_array_equal(quant.dequantize(fmt, b2x), 2 * quant.dequantize(fmt, b2))
    def g(ww, bb):
        return experts(x, ids, ww, GGMLWeight(fmt, b13), GGMLWeight(fmt, bb), act_dtype=np.float32, **sh)

    shared = g(0 * w, b2)
    np.testing.assert_allclose(g(w, b2x) - shared, 2 * (g(w, b2) - shared), rtol=1e-12,
                               atol=1e-12 * np.abs(g(w, b2)).max())
