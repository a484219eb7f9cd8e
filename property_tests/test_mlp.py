"""Property tests of the gated-MLP activations: every kernel vs the golden, and invariants.

- kernel vs golden for SwiGLU and GeGLU (both layouts, both GELU forms, every distribution);
- the split layout gives the fused layout's result on the same values (bit for bit for our kernels);
- y(g, 0) = 0: the up projection multiplies the activation (an up of zeros leaves nothing);
- linearity in up: y(g, 2u) = 2 y(g, u) bit for bit wherever y and 2 y are normal numbers of the
  output dtype (scaling by 2 is exact in every float format; among subnormals the grid is absolute).
Backward (mlp.swiglu_backward, mlp.geglu_backward):
- every kernel vs the golden (both layouts, both GELUs, every distribution);
- linear in the cotangent: dy scaled by 2^k scales every gradient by 2^k, within the op's limits on
  every backend and bit for bit on ours wherever both are normal numbers of the output dtype;
- dup is the forward's y with up replaced by dy (dup = dy act(g)), within the op's limits.
Shapes stay small: the Triton kernels run through the interpreter on CI.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
OPS = ("mlp.swiglu", "mlp.geglu")
SMALL = dict(t=(1, 6), i=(1, 300))
# Our kernels run one code path for both layouts (the fused entry points pass two views of h), so
# there the layouts must agree bit for bit. Eager torch need not: on the CPU F.silu takes a scalar
# loop for a strided view and a vectorised one for contiguous memory (different fp32 bits), so
# others are held to the op's limits.
ONE_PATH = ("triton", "cpu")


def _up_scaled(inputs: dict[str, np.ndarray], c: float) -> dict[str, np.ndarray]:
    """The inputs with the up values multiplied by c (exact for c = 0 or a power of two), same dtypes."""
    out = {k: v.copy() for k, v in inputs.items()}
    if "h" in out:
        h = out["h"]
        i = h.shape[1] // 2
        h[:, i:] = (h[:, i:].astype(np.float64) * c).astype(h.dtype)
    else:
        out["up"] = (out["up"].astype(np.float64) * c).astype(out["up"].dtype)
    return out


def _arrays(parity, case):
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")  # a draw the backend cannot run (a plugin's unsupported form) is rejected
    return rec, a


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("mlp.swiglu", **SMALL))
def test_swiglu(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("mlp.geglu", **SMALL))
def test_geglu(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(by_op={op: BACKENDS for op in OPS})
@given(data=cases("mlp.geglu", layout=("fused",), **SMALL))
def test_split_layout_equals_fused(parity, op, backend, data):
    """The same gate and up values as one fused h or as two tensors: the same bits out."""
    p = {k: v for k, v in data.p.items() if op == "mlp.geglu" or k != "approx"}
    fused = ops.make_case(op, backend, data.dtype, p, data.dist, data.seed)
    rec, a = _arrays(parity, fused)
    h = a["inputs"]["h"]
    i = h.shape[1] // 2
    split = ops.make_case(op, backend, data.dtype, {**p, "layout": "split"}, data.dist, data.seed)
    got = runs.run(split, {"gate": np.ascontiguousarray(h[:, :i]), "up": np.ascontiguousarray(h[:, i:])})
    what = f"the fused h was passed as separate gate and up ({rec.repro})"
    runs.assert_close(split, got, a["outputs"], what)
    if backend in ONE_PATH:
        runs.assert_same_bits(split, a["outputs"], got, what)


@pytest.mark.parity_backends(by_op={op: BACKENDS for op in OPS})
@given(data=cases("mlp.geglu", **SMALL))
def test_zero_up_gives_zero(parity, op, backend, data):
    p = {k: v for k, v in data.p.items() if op == "mlp.geglu" or k != "approx"}
    case = ops.make_case(op, backend, data.dtype, p, data.dist, data.seed)
    y = runs.run(case, _up_scaled(runs.inputs_of(case), 0.0))["y"].astype(np.float64)
    bad = np.argwhere(y != 0)
    assert bad.size == 0, (f"{backend} {op}: y(g, 0) != 0 at {len(bad)} elements, first y{tuple(bad[0])} = "
                           f"{y[tuple(bad[0])]!r}\n  repro: parity repro {case.id} (with up = 0)")


@pytest.mark.parity_backends(by_op={op: BACKENDS for op in OPS})
@given(data=cases("mlp.geglu", **SMALL))
def test_linear_in_up(parity, op, backend, data):
    """y(g, 2u) = 2 y(g, u), exactly, wherever y and 2 y are normal numbers of the output dtype."""
    p = {k: v for k, v in data.p.items() if op == "mlp.geglu" or k != "approx"}
    case = ops.make_case(op, backend, data.dtype, p, data.dist, data.seed)
    rec, a = _arrays(parity, case)
    y = a["outputs"]["y"].astype(np.float64)
    y2 = runs.run(case, _up_scaled(a["inputs"], 2.0))["y"].astype(np.float64)
    d = get_dtype(data.dtype)
    normal = np.isfinite(2 * y) & (np.abs(y) >= d.tiny) & (np.abs(2 * y) <= d.max)  # both on the relative grid
    bad = np.argwhere(normal & (y2 != 2 * y))
    assert bad.size == 0, (f"{backend} {op}: y(g, 2u) != 2 y(g, u) at {len(bad)} elements, first "
                           f"y{tuple(bad[0])}: {y2[tuple(bad[0])]!r} vs 2 x {y[tuple(bad[0])]!r}\n  repro: {rec.repro}")


# -- backward --------------------------------------------------------------------------------------------
BWD_OPS = ("mlp.swiglu_backward", "mlp.geglu_backward")


def _bwd_case(op: str, backend: str, data):
    """`data` (a mlp.geglu_backward draw) as a case of `op`: SwiGLU drops `approx`."""
    p = {k: v for k, v in data.p.items() if op == "mlp.geglu_backward" or k != "approx"}
    return ops.make_case(op, backend, data.dtype, p, data.dist, data.seed)


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("mlp.swiglu_backward", **SMALL))
def test_swiglu_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("mlp.geglu_backward", **SMALL))
def test_geglu_backward(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(by_op={op: BACKENDS for op in BWD_OPS})
@given(data=cases("mlp.geglu_backward", **SMALL), k=st.integers(1, 4))
def test_backward_is_linear_in_the_cotangent(op, backend, data, k):
    case = _bwd_case(op, backend, data)
    inputs = runs.inputs_of(case)
    scaled = dict(inputs, dy=(inputs["dy"].astype(np.float64) * 2.0**k).astype(inputs["dy"].dtype))
    a, b = runs.run(case, inputs), runs.run(case, scaled)
    what = f"the cotangent dy was scaled by 2^{k}"
    runs.assert_close(case, b, {n: v.astype(np.float64) * 2.0**k for n, v in a.items()}, what)
    if backend in ONE_PATH:
        d = get_dtype(case.dtype)
        for name, v in a.items():
            x, x2 = v.astype(np.float64), b[name].astype(np.float64)
            normal = np.isfinite(x2) & (np.abs(x) >= d.tiny) & (np.abs(x * 2.0**k) <= d.max)
            bad = np.argwhere(normal & (x2 != x * 2.0**k))
            assert bad.size == 0, (f"{backend} {op} {name}: not exactly 2^{k} x when {what}, at {len(bad)} "
                                   f"elements, first {tuple(bad[0])}\n  repro: parity repro {case.id}")


@pytest.mark.parity_backends(by_op={op: BACKENDS for op in BWD_OPS})
@given(data=cases("mlp.geglu_backward", **SMALL))
def test_dup_is_the_forward_with_up_replaced_by_dy(op, backend, data):
    case = _bwd_case(op, backend, data)
    inputs = runs.inputs_of(case)
    fwd = ops.make_case(op.removesuffix("_backward"), backend, case.dtype, case.p, case.dist, case.seed)
    if "h" in inputs:
        i = case.p["i"]
        h = inputs["h"].copy()
        h[:, i:] = inputs["dy"]
        y = runs.run(fwd, {"h": h})["y"]
        got = {"dh": runs.run(case, inputs)["dh"][:, i:]}
        runs.assert_close(case, {"dup": got["dh"]}, {"dup": y.astype(np.float64)}, "dup vs y with up := dy")
    else:
        y = runs.run(fwd, {"gate": inputs["gate"], "up": inputs["dy"]})["y"]
        runs.assert_close(case, {"dup": runs.run(case, inputs)["dup"]}, {"dup": y.astype(np.float64)},
                          "dup vs y with up := dy")
