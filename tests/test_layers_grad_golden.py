"""The layer families' backward goldens (refimpl/norm.py, rope.py, mlp.py `*_backward`) against
central differences of their forward goldens and against torch autograd, both in float64.

- Central differences: the loss L = sum(dy y) (+ sum(dh h)) differentiated along random directions of
  each input by the fourth-order stencil (-L(2e) + 8 L(e) - 8 L(-e) + L(-2e)) / 12e, against
  <gradient, direction>. Directions are scaled to each row's own size (a tiny row moved by a unit
  step would leave the region where its Taylor series converges).
- torch autograd in float64 through F.rms_norm, F.layer_norm, HF's and Meta's rotations, F.silu and
  F.gelu: every element, held to tolerance.GOLDEN_SELF_CHECK (two float64 evaluations of one formula).
- Conventions: padded lanes get exact zero gradients and the cotangents' padding lanes are never
  read; Gemma's (1 + w) scales dy while dw keeps its formula; the residual's x and r share dx, which
  carries dh; RoPE's backward is RoPE at the negated angle and undoes the forward; GELU's tails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kernel_parity.refimpl.mlp as mlp
import kernel_parity.refimpl.norm as norm
import kernel_parity.refimpl.rope as rope
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import Limits, compare
from kernel_parity.conformance.ops.norm import _rows
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK

torch = pytest.importorskip("torch")
F = torch.nn.functional

# The stencil's own error: truncation ~ (step / scale)^4 = 1e-12 of sum |gradient x direction| at a
# step of 1e-3 of the local scale, held at 1e-8 (a VJP that drops a term passes only if that term is
# below 1e-8 of the others; every term of these formulas is far larger), plus the rounding of the
# loss itself, ~eps64 sum |dy y| per evaluation, amplified by the stencil's 18 / 12 step.
FD_STEP = 1e-3
FD_RTOL = 1e-8
FD_ROUND = 64 * np.finfo(np.float64).eps


def _close(got, want, what):
    cmp = compare(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), get_dtype("fp64"),
                  GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


def _directional(loss, inputs: dict, name: str, v: np.ndarray) -> float:
    """d/de loss(inputs with inputs[name] + e v) at e = 0, the fourth-order central stencil."""
    def at(e):
        return float(np.sum(loss({**inputs, name: inputs[name] + e * v})))
    return (-at(2 * FD_STEP) + 8 * at(FD_STEP) - 8 * at(-FD_STEP) + at(-2 * FD_STEP)) / (12 * FD_STEP)


def _check_fd(loss, inputs: dict, grads: dict, rng, scale: dict | None = None, directions: int = 3):
    """<grads[name], v> against the stencil along `directions` random v per differentiable input;
    `loss(inputs)` returns the terms whose sum is the loss (their magnitudes bound its rounding)."""
    for name, g in grads.items():
        for k in range(directions):
            v = rng.standard_normal(np.shape(inputs[name])) * (1.0 if scale is None else scale.get(name, 1.0))
            fd = _directional(loss, inputs, name, v)
            an = float(np.sum(g * v))
            rounding = FD_ROUND * float(np.sum(np.abs(loss(inputs)))) / FD_STEP
            bound = FD_RTOL * float(np.sum(np.abs(g * v))) + rounding
            assert abs(fd - an) <= bound, f"d{name} along direction {k}: differences {fd!r}, VJP {an!r}"


def _t(a):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


# -- RMSNorm -----------------------------------------------------------------------------------------
RMS_CASES = [  # rows, n, pad, dist, eps, gemma, residual
    (1, 1, 0, "normal", 1e-6, 0, 0), (3, 2, 1, "normal", 1e-5, 1, 1), (4, 17, 16, "scales", 1e-6, 0, 1),
    (6, 33, 3, "tiny", 1e-6, 0, 0), (6, 33, 0, "tiny", 1.0, 1, 1), (5, 64, 0, "outlier", 1e-2, 1, 0),
]


def _rms_inputs(rows, n, pad, dist, gemma, residual, seed):
    rng = np.random.default_rng(seed)
    aw = n + pad
    x = np.zeros((rows, aw))
    x[:, :n] = _rows(rng, rows, n, dist)
    w = np.zeros(aw)
    w[:n] = rng.standard_normal(n) * 0.1 + (0.0 if gemma else 1.0)
    out = {"x": x, "w": w, "dy": rng.standard_normal((rows, aw))}  # dy's padding lanes hold values
    if residual:
        r = np.zeros((rows, aw))
        r[:, :n] = _rows(rng, rows, n, dist if dist != "tiny" else "normal") * (1e-4 if dist == "tiny" else 1.0)
        out.update(r=r, dh=rng.standard_normal((rows, aw)))
    return out


@pytest.mark.parametrize("rows, n, pad, dist, eps, gemma, residual", RMS_CASES)
def test_rms_norm_backward(rows, n, pad, dist, eps, gemma, residual):
    a = _rms_inputs(rows, n, pad, dist, gemma, residual, seed=rows * 100 + n)
    kw = dict(n=n, gemma=bool(gemma))
    g = norm.rms_norm_backward(a["x"], a["w"], a["dy"], eps, residual=a.get("r"), dh=a.get("dh"), **kw)
    assert set(g) == {"dx", "dw"} and g["dx"].shape == a["x"].shape and g["dw"].shape == a["w"].shape
    assert not g["dx"][:, n:].any() and not g["dw"][n:].any(), "padding lanes must get exact zero gradients"

    def loss(v):
        out = norm.rms_norm(v["x"], v["w"], eps, residual=v.get("r"), **kw)
        terms = a["dy"][:, :n] * out["y"][:, :n]
        return np.concatenate([terms, a["dh"][:, :n] * out["h"][:, :n]]) if residual else terms

    h = a["x"] + (a["r"] if residual else 0.0)
    row = np.maximum(np.sqrt(np.mean(h[:, :n] ** 2, axis=1, keepdims=True)), math.sqrt(eps))  # each row's scale
    grads = {"x": g["dx"], "w": g["dw"]}
    if residual:
        grads["r"] = g["dx"]  # h = x + r: r's gradient is x's
    _check_fd(loss, {k: a[k] for k in ("x", "w", "r") if k in a}, grads, np.random.default_rng(7),
              scale={"x": row, "r": row, "w": 0.1})

    # torch autograd through F.rms_norm on the real lanes, (1 + w) folded in float64 (exact)
    x, w = _t(a["x"]), _t(a["w"])
    r = _t(a["r"]) if residual else None
    hs = (x if r is None else x + r)[:, :n]
    y = F.rms_norm(hs, (n,), (1.0 + w[:n]) if gemma else w[:n], eps)
    outs, cots = [y], [torch.tensor(a["dy"][:, :n])]
    if residual:
        outs.append(hs)
        cots.append(torch.tensor(a["dh"][:, :n]))
    want = torch.autograd.grad(outs, [x, w] + ([r] if residual else []), cots)
    _close(g["dx"], want[0].numpy(), "dx vs torch autograd")
    _close(g["dw"], want[1].numpy(), "dw vs torch autograd")
    if residual:
        _close(g["dx"], want[2].numpy(), "dr (= dx) vs torch autograd")


def test_rms_norm_backward_conventions():
    a = _rms_inputs(4, 17, 5, "normal", 1, 1, seed=3)
    base = norm.rms_norm_backward(a["x"], a["w"], a["dy"], 1e-6, n=17, gemma=True, residual=a["r"], dh=a["dh"])
    # the cotangents' padding lanes are never read
    dy, dh = a["dy"].copy(), a["dh"].copy()
    dy[:, 17:], dh[:, 17:] = 1e30, -7.0
    other = norm.rms_norm_backward(a["x"], a["w"], dy, 1e-6, n=17, gemma=True, residual=a["r"], dh=dh)
    assert all(np.array_equal(base[k], other[k]) for k in base)
    # Gemma's (1 + w) scales dy in dx; dw has one formula either way
    plain = norm.rms_norm_backward(a["x"], 1.0 + a["w"], a["dy"], 1e-6, n=17, residual=a["r"], dh=a["dh"])
    _close(base["dx"], plain["dx"], "gemma dx vs dx with the weight 1 + w")
    _close(base["dw"], plain["dw"] * (np.arange(22) < 17), "gemma dw vs plain dw")
    # dx of the fused residual form = dx of the plain form on h = x + r, plus dh
    alone = norm.rms_norm_backward(a["x"] + a["r"], a["w"], a["dy"], 1e-6, n=17, gemma=True)
    _close(base["dx"][:, :17], alone["dx"][:, :17] + a["dh"][:, :17], "residual dx vs plain dx on x + r, + dh")
    # OPS.md's form: dx = rstd (w dy - x rstd^2 mean(x w dy)); dw = sum over rows of dy x rstd
    x, w, dyr = a["x"][:, :17], a["w"][:17], a["dy"][:, :17]
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)
    ops_dx = rstd * (w * dyr - x * rstd ** 2 * np.mean(x * w * dyr, axis=1, keepdims=True))
    mine = norm.rms_norm_backward(a["x"], a["w"], a["dy"], 1e-6, n=17)
    _close(mine["dx"][:, :17], ops_dx, "dx vs OPS.md's formula")
    _close(mine["dw"][:17], np.sum(dyr * x * rstd, axis=0), "dw vs OPS.md's formula")
    with pytest.raises(ValueError, match="dh .* without a residual"):
        norm.rms_norm_backward(a["x"], a["w"], a["dy"], 1e-6, dh=a["dh"])


def test_rms_norm_dx_is_orthogonal_to_x_up_to_eps():
    """sum(dx x) = eps rstd^2 sum(dy y) per row (exact algebra: the scale direction of h moves y
    only through eps's share); zero rows and eps = 1 included."""
    for dist, eps in (("normal", 1e-6), ("tiny", 1.0), ("scales", 1e-2)):
        a = _rms_inputs(6, 40, 3, dist, 0, 0, seed=11)
        g = norm.rms_norm_backward(a["x"], a["w"], a["dy"], eps, n=40)
        y = norm.rms_norm(a["x"], a["w"], eps, n=40)
        rstd = y["rstd"]
        _close(np.sum(g["dx"] * a["x"], axis=1), eps * rstd ** 2 * np.sum(a["dy"][:, :40] * y["y"][:, :40], axis=1),
               f"sum(dx x) vs eps rstd^2 sum(dy y) ({dist}, eps {eps})")


# -- LayerNorm -----------------------------------------------------------------------------------------
LN_CASES = [  # rows, n, pad, dist, eps, bias
    (1, 1, 0, "normal", 1e-5, 1), (3, 2, 1, "normal", 1e-6, 0), (4, 17, 16, "scales", 1e-5, 1),
    (6, 33, 3, "tiny", 1.0, 1), (4, 40, 0, "shifted", 1e-5, 1), (5, 64, 2, "outlier", 1e-2, 0),
]


@pytest.mark.parametrize("rows, n, pad, dist, eps, bias", LN_CASES)
def test_layer_norm_backward(rows, n, pad, dist, eps, bias):
    rng = np.random.default_rng(rows * 100 + n)
    aw = n + pad
    a = {"x": np.zeros((rows, aw)), "w": np.zeros(aw), "b": np.zeros(aw)}
    a["x"][:, :n] = _rows(rng, rows, n, dist)
    a["w"][:n] = 1.0 + 0.1 * rng.standard_normal(n)
    a["b"][:n] = rng.standard_normal(n)
    dy = rng.standard_normal((rows, aw))
    b = a["b"] if bias else None
    g = norm.layer_norm_backward(a["x"], a["w"], b, dy, eps, n=n)
    assert set(g) == ({"dx", "dw", "db"} if bias else {"dx", "dw"})
    assert not g["dx"][:, n:].any() and not g["dw"][n:].any()
    dy2 = dy.copy()
    dy2[:, n:] = np.nan
    assert all(np.array_equal(g[k], norm.layer_norm_backward(a["x"], a["w"], b, dy2, eps, n=n)[k]) for k in g)

    def loss(v):
        return dy[:, :n] * norm.layer_norm(v["x"], v["w"], v.get("b"), eps, n=n)["y"][:, :n]

    spread = np.std(a["x"][:, :n], axis=1, keepdims=True)
    row = np.maximum(spread, math.sqrt(eps))
    grads = {"x": g["dx"], "w": g["dw"], **({"b": g["db"]} if bias else {})}
    _check_fd(loss, {k: a[k] for k in grads}, grads, np.random.default_rng(5), scale={"x": row, "w": 0.1})

    x, w = _t(a["x"]), _t(a["w"])
    bt = _t(a["b"]) if bias else None
    y = F.layer_norm(x[:, :n], (n,), w[:n], bt[:n] if bias else None, eps)
    want = torch.autograd.grad([y], [x, w] + ([bt] if bias else []), [torch.tensor(dy[:, :n])])
    for name, got, ref in zip(("dx", "dw", "db"), (g["dx"], g["dw"], g.get("db")), want):
        _close(got, ref.numpy(), f"{name} vs torch autograd")


# -- RoPE ----------------------------------------------------------------------------------------------
def _torch_rope(x, cos, sin, pos, style, rot, at):
    """HF's rotate_half (half pairs) or Meta's complex product (interleaved), float64, partial rotary."""
    d = x.shape[-1]
    lo = 0 if at == "first" else d - rot
    c, s = torch.tensor(cos)[pos][:, None, :], torch.tensor(sin)[pos][:, None, :]
    part = x[..., lo:lo + rot]
    if style == "half":
        x1, x2 = part.chunk(2, dim=-1)
        rotated = part * torch.cat((c, c), -1) + torch.cat((-x2, x1), -1) * torch.cat((s, s), -1)
    else:
        z = torch.view_as_complex(part.reshape(*part.shape[:-1], -1, 2).contiguous())
        rotated = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    return torch.cat((x[..., :lo], rotated, x[..., lo + rot:]), dim=-1)


ROPE_CASES = [  # d, rot, style, at, theta, scaling
    (64, 64, "half", "first", 10000.0, "none"), (64, 64, "interleaved", "first", 500000.0, "llama3"),
    (64, 32, "half", "last", 1e6, "none"), (96, 24, "interleaved", "first", 10000.0, "llama3"),
    (576, 64, "interleaved", "last", 10000.0, "none"), (2, 2, "half", "first", 10000.0, "none"),
]


@pytest.mark.parametrize("d, rot, style, at, theta, scaling", ROPE_CASES)
def test_rope_backward(d, rot, style, at, theta, scaling):
    rng = np.random.default_rng(d + rot)
    t, h, maxseq = 5, 3, 9000
    cos, sin = rope.tables(maxseq, rot, theta, scaling)
    pos = rng.integers(0, maxseq, t)
    x, dy = rng.standard_normal((t, h, d)), rng.standard_normal((t, h, d))
    kw = dict(style=style, rot=rot, at=at)
    dx = rope.rope_backward(dy, cos, sin, pos, **kw)
    _close(dx, rope.rope(dy, cos, -sin, pos, **kw), "rope_backward vs RoPE at the negated angle")
    _close(rope.rope_backward(rope.rope(x, cos, sin, pos, **kw), cos, sin, pos, **kw), x,
           "rope_backward(rope(x)) vs x")
    lo = 0 if at == "first" else d - rot
    keep = np.ones(d, dtype=bool)
    keep[lo:lo + rot] = False
    assert np.array_equal(dx[..., keep], dy[..., keep]), "the pass-through dims' gradient is dy, exactly"

    def loss(v):
        return dy * rope.rope(v["x"], cos, sin, pos, **kw)

    _check_fd(loss, {"x": x}, {"x": dx}, np.random.default_rng(1))
    xt = _t(x)
    (want,) = torch.autograd.grad([_torch_rope(xt, cos, sin, torch.tensor(pos), style, rot, at)], [xt],
                                  [torch.tensor(dy)])
    _close(dx, want.numpy(), "dx vs torch autograd")


# -- gated MLP ------------------------------------------------------------------------------------------
def _gates(rng):
    """Gates over the whole line: N(0, 1), N(0, 30) and the tails +-3 .. +-60 exactly."""
    tails = np.array([-60.0, -40.0, -20.0, -10.0, -7.0, -5.0, -3.0, 3.0, 5.0, 7.0, 10.0, 20.0, 40.0, 60.0])
    return np.concatenate([rng.standard_normal(40), 30.0 * rng.standard_normal(40), tails])


@pytest.mark.parametrize("op, approx", [("swiglu", None), ("geglu", "tanh"), ("geglu", "erf")])
def test_glu_backward(op, approx):
    rng = np.random.default_rng(len(op) + len(approx or ""))
    g = _gates(rng)
    u, dy = 100.0 * rng.standard_normal(g.shape), rng.standard_normal(g.shape)
    extra = {} if approx is None else {"approx": approx}
    fwd, bwd = getattr(mlp, op), getattr(mlp, f"{op}_backward")
    grads = bwd(g, u, dy, **extra)
    assert set(grads) == {"dgate", "dup"}
    _close(grads["dup"], dy * fwd(g, np.ones_like(g), **extra), "dup vs dy act(gate)")

    def loss(v):
        return dy * fwd(v["gate"], v["up"], **extra)

    _check_fd(loss, {"gate": g, "up": u}, {"gate": grads["dgate"], "up": grads["dup"]}, np.random.default_rng(2))
    gt, ut = _t(g), _t(u)
    act = F.silu(gt) if op == "swiglu" else F.gelu(gt, approximate="tanh" if approx == "tanh" else "none")
    want = torch.autograd.grad([act * ut], [gt, ut], [torch.tensor(dy)])
    _close(grads["dgate"], want[0].numpy(), "dgate vs torch autograd")
    _close(grads["dup"], want[1].numpy(), "dup vs torch autograd")


def test_activation_derivatives_in_the_tails():
    """silu', both gelu' against the derivative of the float64 activations by the stencil at single
    points deep in the tails, where 1 - sigmoid and 1 + erf would cancel; no NaN or inf anywhere."""
    g = np.array([-700.0, -100.0, -38.0, -12.0, -6.0, -2.5, -1e-3, 0.0, 1e-3, 2.5, 6.0, 12.0, 38.0, 100.0, 700.0])
    for name, f, df in (("silu", mlp.silu, mlp.silu_grad),
                        ("gelu tanh", lambda v: mlp.gelu(v, "tanh"), lambda v: mlp.gelu_grad(v, "tanh")),
                        ("gelu erf", lambda v: mlp.gelu(v, "erf"), lambda v: mlp.gelu_grad(v, "erf"))):
        d = df(g)
        assert np.all(np.isfinite(d)), f"{name}' not finite at {g[~np.isfinite(d)]}"
        e = 1e-4 * np.maximum(1.0, np.abs(g))
        fd = (-f(g + 2 * e) + 8 * f(g + e) - 8 * f(g - e) + f(g - 2 * e)) / (12 * e)
        _close(d, fd, f"{name}' vs the stencil")  # both are below GOLDEN_SELF_CHECK's atol where they vanish
    s = mlp.sigmoid_grad(np.array([0.0, 40.0, -40.0, 800.0]))
    assert s[0] == 0.25 and s[1] == s[2] > 0.0 and s[3] == 0.0  # symmetric, and never 1 - 1
