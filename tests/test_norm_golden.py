"""The normalisation goldens (refimpl/norm.py) against row loops over Python's math module and
against torch's F.rms_norm / F.layer_norm in float64, plus their conventions (padding lanes,
Gemma's offset, the residual form, eps inside the square root).

The loops are the textbook formulas one row at a time with math.fsum sums, so they are correctly
rounded sums of the float64 values; both sides are float64 evaluations of one formula, held to a
few hundred float64 ulps (tolerance.GOLDEN_SELF_CHECK).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kernel_parity.refimpl.norm as ref
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.ops.norm import _rows
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK

SHAPES = [(1, 1, 0), (3, 2, 1), (4, 17, 16), (5, 113, 0), (2, 1000, 3)]  # rows, n, pad
DISTS = ["normal", "tiny", "scales", "outlier", "shifted"]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


def _aligned(rng: np.random.Generator, rows: int, n: int, pad: int, dist: str) -> np.ndarray:
    x = np.zeros((rows, n + pad))
    x[:, :n] = _rows(rng, rows, n, dist)
    return x


def _rms_loop(x, w, eps, n, gemma, r):
    rows, aw = x.shape
    y, h, rstd = np.zeros((rows, aw)), np.zeros((rows, aw)), np.zeros(rows)
    for i in range(rows):
        hv = [x[i, j] + (r[i, j] if r is not None else 0.0) for j in range(n)]
        rs = 1.0 / math.sqrt(math.fsum(v * v for v in hv) / n + eps)
        for j in range(n):
            g = (1.0 + w[j]) if gemma else w[j]
            y[i, j] = hv[j] * rs * g
            h[i, j] = hv[j]
        rstd[i] = rs
    return y, h, rstd


def _ln_loop(x, w, b, eps, n):
    rows, aw = x.shape
    y, mean, rstd = np.zeros((rows, aw)), np.zeros(rows), np.zeros(rows)
    for i in range(rows):
        m = math.fsum(x[i, :n]) / n
        rs = 1.0 / math.sqrt(math.fsum((v - m) ** 2 for v in x[i, :n]) / n + eps)
        for j in range(n):
            y[i, j] = (x[i, j] - m) * rs * w[j] + (b[j] if b is not None else 0.0)
        mean[i], rstd[i] = m, rs
    return y, mean, rstd


@pytest.mark.parametrize("rows, n, pad", SHAPES)
@pytest.mark.parametrize("dist", [d for d in DISTS if d != "shifted"])
@pytest.mark.parametrize("gemma, residual", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_rms_norm_against_row_loop(rows, n, pad, dist, gemma, residual):
    rng = np.random.default_rng(rows * 1000 + n)
    x = _aligned(rng, rows, n, pad, dist)
    r = _aligned(rng, rows, n, pad, "normal") if residual else None
    w = np.concatenate([rng.standard_normal(n) * 0.1 + (0.0 if gemma else 1.0), np.zeros(pad)])
    for eps in (1e-6, 1.0):
        got = ref.rms_norm(x, w, eps, n=n, gemma=bool(gemma), residual=r)
        y, h, rstd = _rms_loop(x, w, eps, n, gemma, r)
        _close(got["y"], y, f"rms_norm y (eps={eps})")
        _close(got["rstd"], rstd, f"rms_norm rstd (eps={eps})")
        assert ("h" in got) == bool(residual)
        if residual:
            _close(got["h"], h, "rms_norm h")


@pytest.mark.parametrize("rows, n, pad", SHAPES)
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("bias", [0, 1])
def test_layer_norm_against_row_loop(rows, n, pad, dist, bias):
    rng = np.random.default_rng(rows * 1000 + n + 7)
    x = _aligned(rng, rows, n, pad, dist)
    w = np.concatenate([1.0 + 0.1 * rng.standard_normal(n), np.zeros(pad)])
    b = np.concatenate([rng.standard_normal(n), np.zeros(pad)]) if bias else None
    for eps in (1e-5, 1.0):
        got = ref.layer_norm(x, w, b, eps, n=n)
        y, mean, rstd = _ln_loop(x, w, b, eps, n)
        _close(got["y"], y, f"layer_norm y (eps={eps})")
        _close(got["mean"], mean, "layer_norm mean")
        _close(got["rstd"], rstd, f"layer_norm rstd (eps={eps})")


@pytest.mark.parametrize("dist", DISTS)
def test_goldens_against_torch_float64(dist):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    rng = np.random.default_rng(11)
    x = _rows(rng, 6, 300, dist)
    w, b = 1.0 + 0.1 * rng.standard_normal(300), rng.standard_normal(300)
    t = {k: torch.from_numpy(v) for k, v in dict(x=x, w=w, b=b).items()}
    for eps in (1e-6, 1e-2, 1.0):
        if dist != "shifted":
            want = F.rms_norm(t["x"], (300,), t["w"], eps).numpy()
            _close(ref.rms_norm(x, w, eps)["y"], want, f"rms_norm vs F.rms_norm float64 (eps={eps})")
            gem = F.rms_norm(t["x"], (300,), 1.0 + t["w"], eps).numpy()
            _close(ref.rms_norm(x, w, eps, gemma=True)["y"], gem, f"gemma rms_norm vs F.rms_norm(1 + w) (eps={eps})")
        want, mean, rstd = torch.native_layer_norm(t["x"], (300,), t["w"], t["b"], eps)
        got = ref.layer_norm(x, w, b, eps)
        _close(got["y"], want.numpy(), f"layer_norm vs F.layer_norm float64 (eps={eps})")
        _close(got["mean"], mean.numpy()[:, 0], "layer_norm mean vs torch")
        _close(got["rstd"], rstd.numpy()[:, 0], "layer_norm rstd vs torch")


def test_padding_lanes_are_neither_read_nor_written():
    rng = np.random.default_rng(3)
    x = _aligned(rng, 4, 10, 6, "normal")
    r = _aligned(rng, 4, 10, 6, "normal")
    w = np.concatenate([rng.standard_normal(10), np.zeros(6)])
    dirty = x.copy()
    dirty[:, 10:] = 1e6  # the padding is not read: garbage there changes nothing
    for xx in (x, dirty):
        out = ref.rms_norm(xx, w, 1e-6, n=10, residual=r)
        assert np.array_equal(out["y"], ref.rms_norm(x, w, 1e-6, n=10, residual=r)["y"])
        assert np.all(out["y"][:, 10:] == 0) and np.all(out["h"][:, 10:] == 0)
        ln = ref.layer_norm(xx, w, w, 1e-5, n=10)
        assert np.array_equal(ln["y"], ref.layer_norm(x, w, w, 1e-5, n=10)["y"])
        assert np.all(ln["y"][:, 10:] == 0)
    # the real width is the whole row by default; a weight of n lanes is accepted
    assert np.array_equal(ref.rms_norm(x[:, :10], w[:10], 1e-6)["y"], ref.rms_norm(x, w, 1e-6, n=10)["y"][:, :10])


def test_conventions():
    rng = np.random.default_rng(5)
    x, r, w = rng.standard_normal((3, 40)), rng.standard_normal((3, 40)), rng.standard_normal(40)
    # Gemma's (1 + w) is the plain form with the weight 1 + w
    _close(ref.rms_norm(x, w, 1e-6, gemma=True)["y"], ref.rms_norm(x, 1.0 + w, 1e-6)["y"], "gemma vs 1 + w")
    # the fused residual form is the plain form on x + r, and h = x + r
    fused = ref.rms_norm(x, w, 1e-6, residual=r)
    _close(fused["y"], ref.rms_norm(x + r, w, 1e-6)["y"], "residual form vs x + r")
    assert np.array_equal(fused["h"], x + r)
    # eps inside the square root: an all-zero row has rstd 1 / sqrt(eps); a row of tiny norm is
    # scaled by 1 / sqrt(ms + eps), not 1 / (sqrt(ms) + eps)
    z = np.zeros((1, 8))
    assert ref.rms_norm(z, None, 1e-6)["rstd"][0] == pytest.approx(1e3, rel=1e-15)
    tiny = np.full((1, 4), 1e-4)
    assert ref.rms_norm(tiny, None, 1e-6)["rstd"][0] == pytest.approx(1.0 / math.sqrt(1e-8 + 1e-6), rel=1e-15)
    # LayerNorm: biased variance (divides by n); a constant row gives y = b
    row = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert ref.layer_norm(row, None, None, 0.0)["rstd"][0] == pytest.approx(1.0 / math.sqrt(1.25), rel=1e-15)
    const = ref.layer_norm(np.full((2, 5), 7.0), None, np.arange(5.0), 1e-5)
    assert np.array_equal(const["y"], np.tile(np.arange(5.0), (2, 1)))


@pytest.mark.parametrize("bad", [0, 11])
def test_bad_real_width_is_a_value_error(bad):
    with pytest.raises(ValueError, match="real width"):
        ref.rms_norm(np.zeros((2, 10)), None, 1e-6, n=bad)
    with pytest.raises(ValueError, match="real width"):
        ref.layer_norm(np.zeros((2, 10)), None, None, 1e-6, n=bad)


@pytest.mark.parametrize("residual", [False, True])
def test_statistics_alone_are_the_forward_bits(residual, monkeypatch):
    """rms_rstd / layer_norm_stats (a backward's inputs: the statistics without the forward's y), over
    runs of rows, give the forward's rstd and mean bit for bit: padding lanes, leading axes, tiny rows,
    rows past a run's end."""
    from kernel_parity.refimpl import norm as N

    monkeypatch.setattr(N, "_STAT_ROWS", 3)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 5, 40)) * 10.0 ** rng.uniform(-6, 3, (2, 5, 1))
    x[0, 1] = 0.0
    x[..., 37:] = np.nan  # padding: never read
    r = rng.standard_normal(x.shape) if residual else None
    fwd = N.rms_norm(x, None, 1e-2, n=37, residual=r)
    assert np.array_equal(N.rms_rstd(x, 1e-2, n=37, residual=r), fwd["rstd"])
    mean, rstd = N.layer_norm_stats(x, 1e-2, n=37)
    ln = N.layer_norm(x, None, None, 1e-2, n=37)
    assert np.array_equal(mean, ln["mean"]) and np.array_equal(rstd, ln["rstd"])
    assert rstd.shape == (2, 5) and np.isfinite(rstd).all()
