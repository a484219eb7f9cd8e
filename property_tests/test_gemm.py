"""Property tests of the quantized GEMM: every kernel vs the reference it claims, and the invariants.

- every backend's C against its claimed reference (L1 dequant or L2 emulated), every weight format;
- L2 == L1 when the activations are exactly representable in the activation format (integers
  times a power of two with amax = 127 x 2^e per block: Q8_0 / Q8_K codes are exact);
- gemm_nt is linear in A for fixed W (L1): C(a1 + a2) = C(a1) + C(a2), C(t a) = t C(a);
- a kernel's rows do not depend on the other rows of A (row i alone gives row i of the batch),
  except with a per-tensor activation scale, which couples them.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.ops.gemm import GGML_W, WFMTS
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import gemm, quant

K_CHOICES = [256, 512]  # multiples of every block (32, 128, 256)


def _shape(p):
    return {**p, "k": K_CHOICES[p["k"] % 2], "n": 8 * (1 + p["n"] % 6)}


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("gemm.gemm_nt", m=[1, 2, 5, 16, 17, 33], n=(0, 5), k=(0, 1), transform=_shape))
def test_gemm_nt(parity, backend, case):
    parity.check(case.with_backend(backend))


def _representable(rng, m: int, k: int, block: int) -> np.ndarray:
    """Rows whose blocks are integers in [-127, 127] times 2^e with one element at +-127: the Q8
    quantizers reproduce them exactly (d = 2^e, codes = the integers)."""
    codes = rng.integers(-126, 127, (m, k // block, block)).astype(np.float64)
    codes[..., 0] = 127.0 * rng.choice([-1.0, 1.0], (m, k // block))
    return (codes * 2.0 ** rng.integers(-6, 2, (m, k // block, 1))).reshape(m, k)


# q4_1 / q5_1 are left out: Q8_1's stored s = fp16(d sum(q)) rounds the mins term, L2 != L1 by design
@given(wfmt=st.sampled_from([w for w in GGML_W if w not in ("q4_1", "q5_1")]), seed=st.integers(0, 2**32 - 1))
def test_emulated_equals_dequant_on_representable_activations(wfmt, seed):
    rng = np.random.default_rng(seed)
    block = quant.FORMATS[quant.FORMATS[wfmt].vec_dot].block
    a = _representable(rng, 3, 512, block)
    w = quant.quantize(wfmt, (rng.standard_normal((5, 512)) * 0.02).astype(np.float32))
    l1 = gemm.dequant_reference(a, wfmt, {"w": w})
    l2 = gemm.emulated_reference(a, wfmt, {"w": w})
    scale = np.abs(a) @ np.abs(quant.dequantize(wfmt, w)).T
    assert np.all(np.abs(l1 - l2) <= GOLDEN_SELF_CHECK.rtol * scale), f"{wfmt}: L2 != L1 on exact activations (seed={seed})"


@given(wfmt=st.sampled_from([w for w in WFMTS if w == "f32" or w in GGML_W]), seed=st.integers(0, 2**32 - 1),
       t=st.sampled_from([-3.0, 0.5, 2.0]))
def test_dequant_reference_is_linear_in_a(wfmt, seed, t):
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((6, 256)) * 0.02).astype(np.float32)
    weights = {"w": dense if wfmt == "f32" else quant.quantize(wfmt, dense)}
    a1, a2 = rng.standard_normal((2, 3, 256))
    c = lambda a: gemm.dequant_reference(a, wfmt, weights)  # noqa: E731
    scale = (np.abs(a1) + np.abs(a2)) @ np.abs(gemm.dequantize_weight(wfmt, weights, 256)).T
    assert np.all(np.abs(c(a1 + a2) - (c(a1) + c(a2))) <= GOLDEN_SELF_CHECK.rtol * scale)
    assert np.all(np.abs(c(t * a1) - t * c(a1)) <= GOLDEN_SELF_CHECK.rtol * np.abs(t) * scale)


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("gemm.gemm_nt", m=[5, 17], n=(0, 3), k=(0, 1), dtypes=("fp32",), transform=_shape),
       row=st.integers(0, 4))
def test_a_row_alone_gives_that_row(parity, backend, case, row):
    """Bit for bit on the C kernel (its row arithmetic does not depend on M); within the op's limits
    elsewhere (Triton's M = 1 GEMV and its M > 1 dot path round differently)."""
    assume(case.p["wfmt"] != "fp8_tensor")  # one activation scale for the whole of A couples its rows
    case = case.with_backend(backend)
    rec, arrays = parity.arrays(case)
    assume(rec.verdict != "skip")  # a format this backend has no path for: draw another
    one = dict(arrays["inputs"])
    one["a"] = np.ascontiguousarray(one["a"][row:row + 1])
    single = ops.make_case(case.op, backend, case.dtype, {**case.p, "m": 1}, case.dist, case.seed)
    alone = runs.run(single, one)
    got, want = {"c": np.asarray(alone["c"])}, {"c": np.asarray(arrays["outputs"]["c"])[row:row + 1]}
    if backend == "cpu":
        runs.assert_same_bits(case, got, want, f"row {row} of A is multiplied alone")
    else:
        runs.assert_close(single, got, want, f"row {row} of A is multiplied alone")
