"""Self-tests of the softmax and combine backward goldens (refimpl/softmax.py softmax_backward,
online_softmax_backward; refimpl/combine.py lse_combine_backward): the hand-written float64 VJPs
against torch autograd in float64 through an independent forward, and against central finite
differences of the forward goldens; -inf logits, all -inf rows, empty splits (NaN O) and all-empty
rows get exact zeros, never NaN.

Limits: autograd and the golden are two float64 evaluations of one formula (a few ulps of the
largest term, AUTOGRAD_REL); central differences with step FD_STEP are off by h^2 f''' / 6 ~ 1e-10
(truncation) plus eps64 / h ~ 1e-11 (rounding) relative to the gradient's scale (FD_REL)."""

from __future__ import annotations

import numpy as np
import pytest

import kernel_parity.refimpl.combine as comb
import kernel_parity.refimpl.softmax as sm

AUTOGRAD_REL = 1e-13
FD_STEP = 1e-5
FD_REL = 1e-7

SHAPES = [(1, 1), (3, 2), (4, 7), (5, 33)]  # rows, n
DISTS = ["normal", "masked", "wide"]


def _logits(rng: np.random.Generator, rows: int, n: int, dist: str) -> np.ndarray:
    """normal: N(0, 1); wide: N(0, 4) (peaked rows); masked: half the entries -inf, row 0 all -inf,
    row 1 a single finite entry."""
    x = rng.standard_normal((rows, n)) * (4.0 if dist == "wide" else 1.0)
    if dist == "masked":
        x[rng.random((rows, n)) < 0.5] = -np.inf
        x[0] = -np.inf
        if rows > 1:
            x[1] = -np.inf
            x[1, rng.integers(n)] = 0.5
    return x


def _case(rows: int, n: int, dist: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    return _logits(rng, rows, n, dist), rng.standard_normal((rows, n)), rng.standard_normal(rows)


def _close(got: np.ndarray, want: np.ndarray, rel: float, what: str) -> None:
    err = float(np.abs(got - want).max()) if got.size else 0.0
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    assert err <= rel * scale, f"{what}: max |d| = {err:.3g} (limit {rel:g} x {scale:.3g})"


def _torch_softmax_grad(x: np.ndarray, dy: np.ndarray, dlse: np.ndarray | None) -> np.ndarray:
    """Autograd in float64 through torch.softmax and torch.logsumexp (rows with a finite logit only:
    torch's gradient of an all -inf row is NaN, the convention's is 0)."""
    torch = pytest.importorskip("torch")
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    outs, cots = [torch.softmax(xt, dim=-1)], [torch.tensor(dy)]
    if dlse is not None:
        outs.append(torch.logsumexp(xt, dim=-1))
        cots.append(torch.tensor(dlse))
    (g,) = torch.autograd.grad(outs, xt, cots)
    return g.numpy()


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("rows,n", SHAPES)
@pytest.mark.parametrize("with_lse", [False, True], ids=["softmax", "with-lse"])
def test_softmax_golden_equals_torch_autograd_float64(rows, n, dist, with_lse):
    x, dy, dlse = _case(rows, n, dist)
    dl = dlse if with_lse else None
    got = sm.softmax_backward(x, dy, dlse=dl)
    live = ~np.isneginf(x).all(axis=-1)
    if live.any():
        want = _torch_softmax_grad(x[live], dy[live], None if dl is None else dl[live])
        _close(got[live], want, AUTOGRAD_REL, f"softmax_backward {rows}x{n} {dist} vs torch autograd")
    assert np.all(got[~live] == 0.0), "an all -inf row must get dx = 0"
    assert np.all(got[np.isneginf(x)] == 0.0), "a -inf logit must get dx = 0"
    assert np.isfinite(got).all()


def _softmax_loss(x: np.ndarray, dy: np.ndarray, dlse: np.ndarray | None) -> float:
    total = float(np.sum(dy * sm.softmax(x)))
    if dlse is not None:
        lse = sm.logsumexp(x)
        total += float(np.sum(np.where(np.isfinite(lse), lse * dlse, 0.0)))
    return total


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("rows,n", SHAPES[1:])
def test_softmax_golden_equals_finite_differences(rows, n, dist):
    """<dx, u> against (f(x + h u) - f(x - h u)) / 2h, f = <dy, softmax(x)> + <dlse, lse(x)>, for a
    direction u that moves only finite logits (a -inf logit stays -inf)."""
    x, dy, dlse = _case(rows, n, dist, seed=1)
    u = np.where(np.isneginf(x), 0.0, np.random.default_rng(2).standard_normal(x.shape))
    for dl in (None, dlse):
        got = sm.softmax_backward(x, dy, dlse=dl)
        fd = (_softmax_loss(x + FD_STEP * u, dy, dl) - _softmax_loss(x - FD_STEP * u, dy, dl)) / (2 * FD_STEP)
        an = float(np.sum(got * u))
        assert abs(fd - an) <= FD_REL * max(1.0, abs(an)), f"analytic {an:.12g}, finite differences {fd:.12g}"


@pytest.mark.parametrize("tile", [1, 3, 16, 1000])
def test_online_softmax_golden_is_softmax_with_the_lse_cotangent(tile):
    x, dy, dlse = _case(5, 33, "masked", seed=3)
    want = sm.softmax_backward(x, dy, dlse=dlse)
    assert np.array_equal(sm.online_softmax_backward(x, tile, dy, dlse), want)
    with pytest.raises(ValueError, match="tile"):
        sm.online_softmax_backward(x, 0, dy, dlse)


def test_softmax_golden_axis_and_row_sums():
    """Any axis; each row of dx sums to dlse (softmax's rows sum to 1), to 0 without it."""
    x, dy, dlse = _case(4, 7, "normal", seed=4)
    got = sm.softmax_backward(x, dy, dlse=dlse)
    _close(sm.softmax_backward(x.T, dy.T, axis=0, dlse=dlse).T, got, AUTOGRAD_REL, "axis 0 vs axis -1")
    _close(got.sum(axis=-1), dlse, AUTOGRAD_REL, "row sums of dx vs dlse")
    _close(sm.softmax_backward(x, dy).sum(axis=-1), np.zeros(4), AUTOGRAD_REL, "row sums of dx without dlse")


# ---- combine ------------------------------------------------------------------------------------
COMBINE = [(1, 1, 1), (3, 4, 5), (6, 5, 3), (2, 3, 16)]  # splits, rows, d_v


def _states(splits: int, rows: int, dv: int, empty: bool, seed: int = 0):
    """O_i ~ N(0, 1), LSE_i ~ N(0, 3); with `empty`, 30% of the splits empty (LSE -inf, O NaN), row 0
    all empty and row 1 one live split."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((splits, rows, dv))
    lse = rng.standard_normal((splits, rows)) * 3.0
    if empty:
        dead = rng.random((splits, rows)) < 0.3
        dead[:, 0] = True
        if rows > 1:
            dead[:, 1] = True
            dead[rng.integers(splits), 1] = False
        lse[dead] = -np.inf
        o[dead] = np.nan
    return o, lse, rng.standard_normal((rows, dv)), rng.standard_normal(rows)


def _torch_combine_grads(o, lse, do, dlse):
    """Autograd in float64 through torch.logsumexp over the splits and O = sum_i exp(LSE_i - LSE) O_i
    (an empty split's O enters as 0; rows with a live split only)."""
    torch = pytest.importorskip("torch")
    ot = torch.tensor(np.where(np.isnan(o), 0.0, o), requires_grad=True)
    lt = torch.tensor(lse, requires_grad=True)
    big = torch.logsumexp(lt, dim=0)
    merged = (torch.exp(lt - big)[..., None] * ot).sum(dim=0)
    g_o, g_l = torch.autograd.grad([merged, big], [ot, lt], [torch.tensor(do), torch.tensor(dlse)])
    return g_o.numpy(), g_l.numpy()


@pytest.mark.parametrize("empty", [False, True], ids=["live", "empty"])
@pytest.mark.parametrize("splits,rows,dv", COMBINE)
def test_combine_golden_equals_torch_autograd_float64(splits, rows, dv, empty):
    o, lse, do, dlse = _states(splits, rows, dv, empty)
    g_o, g_l = comb.lse_combine_backward(o, lse, do, dlse)
    live_row = ~np.isneginf(lse).all(axis=0)
    w_o, w_l = _torch_combine_grads(o[:, live_row], lse[:, live_row], do[live_row], dlse[live_row])
    _close(g_o[:, live_row], w_o, AUTOGRAD_REL, "do_parts vs torch autograd")
    _close(g_l[:, live_row], w_l, AUTOGRAD_REL, "dlse_parts vs torch autograd")
    dead = np.isneginf(lse)
    assert np.all(g_o[dead] == 0.0) and np.all(g_l[dead] == 0.0), "an empty split's gradients must be 0"
    assert np.isfinite(g_o).all() and np.isfinite(g_l).all(), "NaN leaked from an empty split's O"


def _combine_loss(o, lse, do, dlse) -> float:
    merged, big = comb.lse_combine(o, lse)
    return float(np.sum(merged * do) + np.sum(np.where(np.isfinite(big), big * dlse, 0.0)))


@pytest.mark.parametrize("empty", [False, True], ids=["live", "empty"])
@pytest.mark.parametrize("splits,rows,dv", COMBINE[1:])
def test_combine_golden_equals_finite_differences(splits, rows, dv, empty):
    """<grad, u> against central differences of the forward golden, for directions that move the
    live splits' O and LSE (an empty split stays empty, its NaN O untouched)."""
    o, lse, do, dlse = _states(splits, rows, dv, empty, seed=5)
    g_o, g_l = comb.lse_combine_backward(o, lse, do, dlse)
    rng = np.random.default_rng(6)
    live = ~np.isneginf(lse)
    u_o = np.where(live[..., None], rng.standard_normal(o.shape), 0.0)
    u_l = np.where(live, rng.standard_normal(lse.shape), 0.0)
    for name, (a, b) in {"O_i": ((o + FD_STEP * u_o, lse), (o - FD_STEP * u_o, lse)),
                         "LSE_i": ((o, lse + FD_STEP * u_l), (o, lse - FD_STEP * u_l))}.items():
        fd = (_combine_loss(*a, do, dlse) - _combine_loss(*b, do, dlse)) / (2 * FD_STEP)
        an = float(np.sum(np.where(live[..., None], g_o * u_o, 0.0)) if name == "O_i" else np.sum(g_l * u_l))
        assert abs(fd - an) <= FD_REL * max(1.0, abs(an)), f"d{name}: analytic {an:.12g}, finite differences {fd:.12g}"


def test_combine_golden_all_empty_rows_and_identities():
    """Every split empty (NaN O): zeros, never NaN. One split: dO_1 = dO, dLSE_1 = dLSE. And
    sum_i dLSE_i = dLSE (the weights sum to 1, sum_i w_i (O_i - O) = 0)."""
    o = np.full((3, 2, 4), np.nan)
    g_o, g_l = comb.lse_combine_backward(o, np.full((3, 2), -np.inf), np.ones((2, 4)), np.ones(2))
    assert np.array_equal(g_o, np.zeros((3, 2, 4))) and np.array_equal(g_l, np.zeros((3, 2)))
    o, lse, do, dlse = _states(1, 4, 5, False, seed=7)
    g_o, g_l = comb.lse_combine_backward(o, lse, do, dlse)
    assert np.array_equal(g_o[0], do) and np.array_equal(g_l[0], dlse)
    o, lse, do, dlse = _states(6, 5, 3, False, seed=8)
    _close(comb.lse_combine_backward(o, lse, do, dlse)[1].sum(axis=0), dlse, AUTOGRAD_REL, "sum_i dLSE_i vs dLSE")
    g_o, g_l = comb.lse_combine_backward(o, lse, do)
    _close(g_l.sum(axis=0), np.zeros(5), AUTOGRAD_REL, "sum_i dLSE_i without dLSE")
