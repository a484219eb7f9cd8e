"""The GEMM's backward golden (refimpl.gemm.gemm_nt_backward) against central differences of the forward
golden and against torch autograd, both in float64; and the spec's reference through a quantized weight.

- Central differences: L = sum(dc C) differentiated along random directions of A, W and the bias by the
  fourth-order stencil (exact here up to rounding: C is linear in each), against <gradient, direction>.
- torch autograd in float64 of a @ w.T (+ b): da, dw, db, every element, to tolerance.GOLDEN_SELF_CHECK.
- gemm.gemm_nt_backward's reference: da through the dequantized weight (L1) for every weight format,
  equal to the golden on the float64 dequantization; dw and db only for float32 weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.ops.gemm import WFMTS, dequantized_weight
from kernel_parity.conformance.runner import Prepared
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.refimpl import gemm

torch = pytest.importorskip("torch")
FD_STEP = 1e-3
FD_RTOL = 1e-9
FD_ROUND = 64 * np.finfo(np.float64).eps


def _close(got, want, what):
    cmp = compare(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), get_dtype("fp64"),
                  GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


@pytest.mark.parametrize("m, n, k, bias", [(1, 1, 1, True), (5, 7, 33, True), (17, 40, 64, False), (3, 129, 5, True)])
def test_gemm_nt_backward_against_central_differences_and_autograd(m, n, k, bias):
    rng = np.random.default_rng(m * 1000 + n)
    x = {"a": rng.standard_normal((m, k)), "w": rng.standard_normal((n, k)) * 0.02, "bias": rng.standard_normal(n)}
    dc = rng.standard_normal((m, n))
    g = gemm.gemm_nt_backward(x["a"], x["w"], dc, bias=bias)
    assert set(g) == ({"da", "dw", "db"} if bias else {"da", "dw"})

    def loss(inputs):
        return dc * gemm.gemm_nt(inputs["a"], inputs["w"], inputs["bias"] if bias else None)

    for gname, name in (("da", "a"), ("dw", "w"), ("db", "bias")):
        if gname not in g:
            continue
        v = rng.standard_normal(x[name].shape)

        def at(e):
            return float(np.sum(loss({**x, name: x[name] + e * v})))

        fd = (-at(2 * FD_STEP) + 8 * at(FD_STEP) - 8 * at(-FD_STEP) + at(-2 * FD_STEP)) / (12 * FD_STEP)
        an = float(np.sum(g[gname] * v))
        bound = FD_RTOL * float(np.sum(np.abs(g[gname] * v))) + FD_ROUND * float(np.sum(np.abs(loss(x)))) / FD_STEP
        assert abs(fd - an) <= bound, f"{gname}: differences {fd!r}, VJP {an!r}"
    t = {name: torch.tensor(v, requires_grad=True) for name, v in x.items()}
    c = t["a"] @ t["w"].T + (t["bias"] if bias else 0.0)
    c.backward(torch.tensor(dc))
    for gname, name in (("da", "a"), ("dw", "w"), ("db", "bias")):
        if gname in g:
            _close(g[gname], t[name].grad.numpy(), gname)


@pytest.mark.parametrize("wfmt", WFMTS)
def test_backward_reference_is_da_through_the_dequantized_weight(wfmt):
    spec = ops.get("gemm.gemm_nt_backward")
    p = {"m": 3, "n": 16, "k": 256, "wfmt": wfmt, "bias": 1}
    prep = Prepared(spec, ops.make_case(spec.name, "torch", "bf16" if wfmt.startswith("fp8") else "fp32", p,
                                        "normal", 5))
    x = prep.inputs64
    want = gemm.gemm_nt_backward(x["a"], dequantized_weight(x, p), x["dc"], bias=True)
    names = {"da", "dw", "db"} if wfmt == "f32" else {"da"}
    assert set(prep.golden) == names, f"{wfmt}: the outputs of a {wfmt} weight are {sorted(names)}"
    for name in names:
        _close(prep.golden[name], want[name], f"{wfmt} {name}")
