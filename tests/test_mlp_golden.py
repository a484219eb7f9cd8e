"""The gated-MLP golden (refimpl/mlp.py) against element loops over Python's math module and against
torch in float64.

The loops are the textbook formulas, one element at a time: silu g / (1 + e^-g), tanh GELU
0.5 g (1 + tanh(x)), erf GELU g erfc(-g / sqrt 2) / 2. Where a textbook form cancels in float64
(1 + tanh(x) for g < -3, 1 + erf for g < -1) the golden is held to the loop's own absolute error
there, and to a non-cancelling loop (2 e^2x / (1 + e^2x), math.erfc) to full relative precision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kernel_parity.refimpl.mlp as ref

G = np.concatenate([np.linspace(-37.0, 12.0, 1961), [-1e-300, 0.0, 1e-300, 1e-8, -1e-8]])  # Phi(-37) ~ 6e-300: normal
RTOL = 1e-13  # a handful of float64 ulps: both sides are float64 evaluations of one function


def _close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL, atol: float = 0.0, what: str = "") -> None:
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, worst at g={G[np.argmax(err)]!r}: "
                           f"{got[np.argmax(err)]!r} vs {want[np.argmax(err)]!r}")


def _loop(f, g: np.ndarray) -> np.ndarray:
    return np.array([f(float(x)) for x in g])


def _tanh_x(g: float) -> float:
    return math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)


def test_silu_against_math_loop():
    g = np.concatenate([G, np.linspace(-700.0, 700.0, 101)])
    want = _loop(lambda x: x / (1.0 + math.exp(-x)), g)
    got = ref.silu(g)
    err = np.abs(got - want)
    assert np.all(err <= RTOL * np.abs(want)), f"silu off by {err.max()!r} at g={g[np.argmax(err)]!r}"


def test_std_normal_cdf_against_math_erfc():
    want = _loop(lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0)), G)
    _close(ref.std_normal_cdf(G), want, what="Phi vs math.erfc")
    upper = G > -1.0  # 1 + erf does not cancel here: the textbook form agrees too
    want_erf = _loop(lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))), G[upper])
    _close(ref.std_normal_cdf(G[upper]), want_erf, rtol=1e-12, what="Phi vs 1 + math.erf")


def test_gelu_erf_against_math_loop():
    want = _loop(lambda x: x * 0.5 * math.erfc(-x / math.sqrt(2.0)), G)
    _close(ref.gelu(G, "erf"), want, what="erf GELU vs g erfc(-g / sqrt 2) / 2")


def test_gelu_tanh_against_math_loop():
    got = ref.gelu(G, "tanh")
    textbook = _loop(lambda x: 0.5 * x * (1.0 + math.tanh(_tanh_x(x))), G)
    mild = G >= -3.0  # 1 + tanh(x) >= 2e-3: cancellation costs < 1e-13 relative
    _close(got[mild], textbook[mild], rtol=1e-12, what="tanh GELU vs 0.5 g (1 + math.tanh)")
    # below, the textbook loop keeps only an absolute error of ~|g| eps64; the golden is within it
    _close(got[~mild], textbook[~mild], rtol=0.0, atol=4.0 * np.finfo(np.float64).eps * 37.0,
           what="tanh GELU vs the cancelling textbook form")
    # and to full relative precision against 1 + tanh(x) = 2 e^2x / (1 + e^2x) (x < 0: no overflow)
    stable = _loop(lambda x: 0.5 * x * 2.0 * math.exp(2.0 * _tanh_x(x)) / (1.0 + math.exp(2.0 * _tanh_x(x))),
                   G[~mild])
    _close(got[~mild], stable, what="tanh GELU tail vs 2 e^2x / (1 + e^2x)")


def test_swiglu_geglu_and_the_fused_split():
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((3, 7)) * 4.0, rng.standard_normal((3, 7))
    h = np.concatenate([g, u], axis=-1)
    gate, up = ref.split(h)
    assert np.array_equal(gate, g) and np.array_equal(up, u)  # gate first
    assert np.array_equal(ref.swiglu(gate, up), ref.silu(g) * u)
    for approx in ref.GELU_APPROX:
        assert np.array_equal(ref.geglu(gate, up, approx), ref.gelu(g, approx) * u)
    with pytest.raises(ValueError, match="even width"):
        ref.split(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="unknown gelu approximation"):
        ref.gelu(g, "sigmoid")


def test_goldens_against_torch_float64():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    g = G[(G >= -3.0) & (G <= 12.0)]  # torch's float64 forms 1 + erf and 1 + tanh: no cancellation here
    t = torch.tensor(g, dtype=torch.float64)
    _close(ref.silu(g), F.silu(t).numpy(), rtol=1e-14, what="silu vs torch float64")
    _close(ref.gelu(g, "erf"), F.gelu(t).numpy(), rtol=1e-12, what="erf GELU vs torch float64")
    _close(ref.gelu(g, "tanh"), F.gelu(t, approximate="tanh").numpy(), rtol=1e-12, what="tanh GELU vs torch float64")
