"""Property tests of kvquant.decode_paged (paged decode over a quantized KV cache): every kernel vs the golden,
and the op's scale invariants.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.decode_paged vs its golden over every format x granularity, GQA groups 1-8, head dims 16-128, pages of
  16 / 64, ragged and full lengths up to 300 keys (past the interpreter's 256-key split) and both dists;
- scaling every K scale by c is scaling the softmax scale by c: the same outputs as the query scaled by c (c a power
  of two, so q c and s_k c are exact and the two runs see the same logits);
- scaling every V scale by c scales O by c and leaves the LSE (c a power of two: O c is exact in every dtype).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(b=(1, 5), hq=(1, 8), hkv=[1, 1, 2, 4], d=[16, 32, 64, 128], kv=(1, 300))
FEW = settings(max_examples=8)  # the interpreter: a Triton example is ~1 s (a program per kv head and split)


def _valid(p):
    """hq a multiple of hkv: hq = hkv x a group of 1, 2 or 4 (hq drawn in [1, 8] picks it)."""
    group = [1, 2, 4][p["hq"] % 3]
    return {**p, "hq": p["hkv"] * group}


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_paged", transform=_valid, **SMALL))
def test_decode_paged(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_paged", transform=_valid, **SMALL), e=st.sampled_from([-2, -1, 1, 2]))
def test_k_scales_times_c_is_softmax_scale_times_c(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    c = np.float32(2.0 ** e)
    by_k = dict(x, k_scale=np.ascontiguousarray(x["k_scale"] * c))
    by_q = dict(x, q=np.ascontiguousarray(x["q"] * x["q"].dtype.type(c)))
    runs.assert_close(case, runs.run(case, by_k), runs.run(case, by_q),
                      f"the K scales were scaled by {c} (against q scaled by {c})")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_paged", transform=_valid, **SMALL), e=st.sampled_from([-2, -1, 1, 2]))
def test_v_scales_times_c_scale_o_by_c(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    c = 2.0 ** e
    a = runs.run(case, x)
    b = runs.run(case, dict(x, v_scale=np.ascontiguousarray(x["v_scale"] * np.float32(c))))
    want = {"o": np.asarray(a["o"], dtype=np.float64) * c, "lse": np.asarray(a["lse"], dtype=np.float64)}
    runs.assert_close(case, b, want, f"the V scales were scaled by {c} (O should scale by {c}, LSE stay)")
