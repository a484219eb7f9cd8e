"""Property tests of the rotary family: every kernel vs the golden, and RoPE's invariants.

Kernel (every backend, or the --parity-backend plugins):
- rope.rope and rope.kv_update vs their goldens, over every style, end, table layout and position
  mode the spec has (kv_update with and without TensorRT-LLM's cache_loc and its q rotation) (shapes small: the Triton kernels run through the interpreter on CI);
- at position 0 RoPE is the identity: every position set to 0 gives x back, value for value;
- the dims outside the rotary part are x's, bit for bit.
- rope.rope_backward vs its golden (dx separate or written over dy, `inplace`); and the backward is the forward at the negated angle: each
  backend's dx equals its own rope.rope of dy with the table's sin negated, within the op's limits
  (the pass-through dims dy's, bit for bit).
Golden (float64):
- every pair keeps its norm;
- rotating by p and then by -p gives x back;
- q at m and k at n: their dot product depends on m - n only (the relative-position property);
- the backward is the adjoint of the forward, <RoPE(x), dy> = <x, dx>, and RoPE at -p of dy.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import kernel_parity.refimpl.rope as ref
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(t=(1, 16), h=(1, 4), d=[2, 4, 6, 16, 64, 64, 96, 128, 576], rot=(2, 128), maxseq=(1, 300),
             start=(0, 200))


def _valid(p):
    """rot even and <= d; start only with pos=offset; the table holds every position."""
    rot = max(2, min(p["rot"], p["d"]) // 2 * 2)
    start = p["start"] if p["pos"] == "offset" else 0
    return {**p, "rot": rot, "start": start, "maxseq": max(p["maxseq"], start + p["t"])}


def _partial(p):
    p = _valid(p)
    assume(p["d"] > 2)
    return {**p, "rot": min(p["rot"], (p["d"] - 1) // 2 * 2)}


KV_SMALL = dict(b=(1, 4), snew=(1, 8), hkv=(1, 4), d=[2, 16, 64, 96], smax=(1, 80), rows=(0, 6), hq=(0, 3))


def _kv_valid(p):
    """snew fits the cache; rows (cache_loc) 0 or at least b; hq (q rotated too) 0 to 3 query groups."""
    return {**p, "smax": max(p["smax"], p["snew"]), "rows": p["rows"] and max(p["rows"], p["b"]),
            "hq": p["hq"] * p["hkv"]}


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.rope", transform=_valid, **SMALL))
def test_rope(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.kv_update", transform=_kv_valid, **KV_SMALL))
def test_kv_update(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.rope", transform=_valid, **SMALL))
def test_position_zero_is_the_identity(backend, case):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    x["positions"] = np.zeros_like(x["positions"])
    y = runs.run(case, x)["y"]
    want = x["x"]
    bad = np.flatnonzero(y.astype(np.float64) != want.astype(np.float64))
    assert bad.size == 0, (f"{backend} rope at position 0 changed {bad.size} of {want.size} values "
                           f"(first at flat index {bad[0]})\n  repro: parity repro {case.id}  (positions set to 0)")


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.rope", transform=_partial, **SMALL))
def test_dims_outside_the_rotary_part_are_copied_bit_for_bit(parity, backend, case):
    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    p = case.p
    lo = 0 if p["at"] == "first" else p["d"] - p["rot"]
    keep = np.ones(p["d"], dtype=bool)
    keep[lo:lo + p["rot"]] = False
    x, y = a["inputs"]["x"][..., keep], a["outputs"]["y"][..., keep]
    bad = int(np.count_nonzero(np.ascontiguousarray(x).view(np.uint8) != np.ascontiguousarray(y).view(np.uint8)))
    assert bad == 0, f"{backend} rope changed {bad} bytes of the pass-through dims\n  repro: {rec.repro}"


# -- backward ------------------------------------------------------------------------------------------
def _stored_table(p):
    """A valid draw whose angles come from a stored table (theta's are built by the kernel)."""
    p = _valid(p)
    return {**p, "table": "cos_sin"} if p["table"] == "theta" else p


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.rope_backward", transform=_valid, **SMALL))
def test_rope_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("rope.rope_backward", transform=_stored_table, **SMALL))
def test_backward_is_the_forward_at_the_negated_angle(backend, case):
    """dx = rope.rope(dy) with sin -> -sin in the stored table (exact in every table dtype), on the
    same backend: within the backward's limits, and the pass-through dims bit for bit."""
    case = case.with_backend(backend)
    inputs = runs.inputs_of(case)
    fwd_in = {"x": inputs["dy"], "positions": inputs["positions"]}
    if "sin" in inputs:
        fwd_in.update(cos=inputs["cos"], sin=-inputs["sin"])
    else:
        table = inputs["table"].copy()
        table[..., 1] = -table[..., 1]
        fwd_in["table"] = table
    fwd_p = {k: v for k, v in case.p.items() if k != "inplace"}  # the backward's own param
    fwd = ops.make_case("rope.rope", case.backend, case.dtype, fwd_p, case.dist, case.seed)
    dx = runs.run(case, {**inputs, "dy": inputs["dy"].copy()})["dx"]  # inplace=1 writes dx over its dy
    y = runs.run(fwd, fwd_in)["y"]
    what = "compared with rope.rope of dy at the negated angle (sin negated in the table)"
    runs.assert_close(case, {"dx": dx}, {"dx": y.astype(np.float64)}, what)
    p = case.p
    lo = 0 if p["at"] == "first" else p["d"] - p["rot"]
    keep = np.ones(p["d"], dtype=bool)
    keep[lo:lo + p["rot"]] = False
    a, b = np.ascontiguousarray(dx[..., keep]), np.ascontiguousarray(inputs["dy"][..., keep])
    bad = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
    assert bad == 0, (f"{backend} rope_backward changed {bad} bytes of dy's pass-through dims\n"
                      f"  repro: parity repro {case.id}")


# -- golden invariants ----------------------------------------------------------------------------
def _golden_close(got, want, what):
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.metrics}"


@st.composite
def rotations(draw):
    """x (t, h, d) float64, positions, float64 tables of a theta / scaling, style, rot, end."""
    d = draw(st.sampled_from([2, 6, 16, 64, 96, 128]), label="d")
    rot = draw(st.integers(1, d // 2), label="rot/2") * 2
    maxseq = draw(st.integers(1, 5000), label="maxseq")
    theta = draw(st.sampled_from([10000.0, 500000.0, 1000000.0]), label="theta")
    scaling = draw(st.sampled_from(["none", "llama3"]), label="scaling")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    t, h = draw(st.integers(1, 6), label="t"), draw(st.integers(1, 3), label="h")
    cos, sin = ref.tables(maxseq, rot, theta, scaling)
    return dict(x=rng.standard_normal((t, h, d)), positions=rng.integers(0, maxseq, t), cos=cos, sin=sin,
                style=draw(st.sampled_from(ref.STYLES), label="style"), rot=rot,
                at=draw(st.sampled_from(ref.ENDS), label="at"))


def _pairs(y, style, rot, at):
    d = y.shape[-1]
    lo = 0 if at == "first" else d - rot
    part = y[..., lo:lo + rot]
    if style == "interleaved":
        return part[..., 0::2], part[..., 1::2]
    return part[..., : rot // 2], part[..., rot // 2:]


@given(r=rotations())
def test_golden_keeps_every_pair_norm(r):
    kw = dict(style=r["style"], rot=r["rot"], at=r["at"])
    y = ref.rope(r["x"], r["cos"], r["sin"], r["positions"], **kw)
    (a, b), (ya, yb) = _pairs(r["x"], **kw), _pairs(y, **kw)
    _golden_close(np.hypot(ya, yb), np.hypot(a, b), "pair norms after RoPE vs before")


@given(r=rotations())
def test_golden_rotating_by_p_then_minus_p_gives_x(r):
    kw = dict(style=r["style"], rot=r["rot"], at=r["at"])
    y = ref.rope(r["x"], r["cos"], r["sin"], r["positions"], **kw)
    back = ref.rope(y, r["cos"], -r["sin"], r["positions"], **kw)  # cos(-a) = cos a, sin(-a) = -sin a
    _golden_close(back, r["x"], "RoPE(-p) of RoPE(p) vs x")


@given(r=rotations(), where=st.floats(0.0, 1.0))
def test_golden_dot_products_depend_on_relative_position_only(r, where):
    """<RoPE(q, m), RoPE(k, n)> = <RoPE(q, m + s), RoPE(k, n + s)> for every head."""
    kw = dict(style=r["style"], rot=r["rot"], at=r["at"])
    q, k = r["x"], np.roll(r["x"], 1, axis=0)[::-1]
    m, n = r["positions"], r["positions"][::-1]
    lo, hi = -int(m.min()), r["cos"].shape[0] - 1 - int(m.max())  # shifts that keep m + s in the table
    shift = lo + int(round(where * (hi - lo)))
    dot = lambda mm, nn: np.einsum("thd,thd->th", ref.rope(q, r["cos"], r["sin"], mm, **kw),  # noqa: E731
                                   ref.rope(k, r["cos"], r["sin"], nn, **kw))
    _golden_close(dot(m + shift, n + shift), dot(m, n), f"q.k at (m + {shift}, n + {shift}) vs at (m, n)")


@given(r=rotations())
def test_golden_backward_is_the_adjoint_and_the_negated_angle(r):
    """<RoPE(x), dy> = <x, RoPE_backward(dy)> per head, and RoPE_backward(dy) = RoPE(dy) at -p."""
    kw = dict(style=r["style"], rot=r["rot"], at=r["at"])
    dy = np.random.default_rng(r["positions"].sum()).standard_normal(r["x"].shape)
    dx = ref.rope_backward(dy, r["cos"], r["sin"], r["positions"], **kw)
    y = ref.rope(r["x"], r["cos"], r["sin"], r["positions"], **kw)
    _golden_close(np.einsum("thd,thd->th", r["x"], dx), np.einsum("thd,thd->th", y, dy), "<x, dx> vs <RoPE(x), dy>")
    _golden_close(dx, ref.rope(dy, r["cos"], -r["sin"], r["positions"], **kw), "rope_backward(dy) vs RoPE(dy) at -p")
