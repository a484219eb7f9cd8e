"""Property tests of the quantized GEMM: every kernel vs the reference it claims, and the invariants.

- every backend's C against its claimed reference (L1 dequant or L2 emulated), every weight format;
- L2 == L1 when the activations are exactly representable in the activation format (integers
  times a power of two with amax = 127 x 2^e per block: Q8_0 / Q8_K codes are exact);
- gemm_nt is linear in A for fixed W (L1): C(a1 + a2) = C(a1) + C(a2), C(t a) = t C(a);
- a kernel's rows do not depend on the other rows of A (row i alone gives row i of the batch),
  except with a per-tensor activation scale, which couples them.
The backward (gemm.gemm_nt_backward):
- every backend's gradients against the golden (da, and dw / db for float32 W);
- the gradients are linear in dc: G(2^j dc) = 2^j G(dc) bit for bit (a power of two scales every
  product and partial sum exactly), G(dc1 + dc2) = G(dc1) + G(dc2) within the op's limits (fp32);
- da of a quantized weight is da of its dequantized float32 weight (the L1 meaning): bit for bit on the
  C kernel (the same panel arithmetic), within the op's limits on the others;
- db is the sum of dc over the rows (float64 sum of the fp32 / bf16 dc, within db's limits);
- the gradient of a batch is the sum of its parts': rows [0, r) and [r, M) differentiated apart give
  dw and db summing to the whole's (summed in float64) and da's rows (bit for bit on the C kernel).
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.ops.gemm import GGML_W, WFMTS
from kernel_parity.conformance.pytest_plugin import note_draw
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


def _q4_k(p):
    """triton-q8's formats: Q4_K or Q8_0 (picked by the drawn format's name, deterministically)."""
    return {**_shape(p), "wfmt": ("q4_k", "q8_0")[len(p["wfmt"]) % 2]}


@pytest.mark.parity_backends("triton-q8")
@settings(max_examples=6)  # the interpreter runs a program per row of A and tile of W: seconds each
@given(case=cases("gemm.gemm_nt", m=[1, 2, 5], n=(0, 5), k=(0, 1), transform=_q4_k))
def test_gemm_nt_q8(parity, backend, case):
    """triton-q8 (Q4_K x Q8_K, Q8_0 x Q8_0 activations) against its claimed reference, `emulated`."""
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends("triton-q8")
@settings(max_examples=3)
@given(case=cases("gemm.gemm_nt", m=[3], n=(0, 3), k=(0, 1), dtypes=("fp32",), transform=_q4_k),
       row=st.integers(0, 2))
def test_q8_row_alone_gives_that_row_bit_for_bit(parity, backend, case, row):
    """Each row of A is quantized and multiplied on its own (integer dots, then the same fp32 steps in the
    same order for every row of a tile): the same bits in any batch that takes the same kernel. M = 3 takes
    the tensor-core kernel (gemm_mmq.py, from MMQ_MIN_M rows; M = 1 takes the dp4a GEMV, whose fp32 sums
    run in another order), so the row is run alone as a batch of MMQ_MIN_M copies of itself. (On a GPU a
    batch whose tiles change the split-K count would also change the bits.)"""
    from kernel_parity.kernels.triton.gemm_mmq import MMQ_MIN_M

    case = case.with_backend(backend)
    rec, arrays = parity.arrays(case)
    assume(rec.verdict != "skip")
    one = dict(arrays["inputs"])
    copies = MMQ_MIN_M if case.p["m"] >= MMQ_MIN_M else 1
    one["a"] = np.ascontiguousarray(np.repeat(one["a"][row:row + 1], copies, axis=0))
    single = ops.make_case(case.op, backend, case.dtype, {**case.p, "m": copies}, case.dist, case.seed)
    alone = runs.run(single, one)
    assert np.array_equal(np.asarray(alone["c"])[0].view(np.uint8), np.asarray(alone["c"])[-1].view(np.uint8))
    alone = {"c": np.asarray(alone["c"])[:1]}
    runs.assert_same_bits(case, {"c": np.asarray(alone["c"])}, {"c": np.asarray(arrays["outputs"]["c"])[row:row + 1]},
                          f"row {row} of A is quantized and multiplied alone")


# -- gemm.gemm_nt_backward ---------------------------------------------------------------------------------
BWD = "gemm.gemm_nt_backward"
FEW = settings(max_examples=6)  # each example runs the kernels two or three times (the interpreter: seconds)


def _backend_takes(backend: str, case) -> None:
    """Reject a draw the backend has no path for (a weight format it does not decode, a dtype it does not
    take): drawn again, never a silent pass."""
    b = runs.registry().get(backend)
    if isinstance(getattr(b, "ops", None), dict) and case.op not in b.ops:
        pytest.skip(f"{b.name} has no kernel for {case.op}")  # the whole test, not one draw
    why = b.available() or b.supports(case.with_backend(backend))
    note_draw(why)
    assume(why is None)


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[1, 2, 5, 16, 17, 33], n=(0, 5), k=(0, 1), transform=_shape))
def test_gemm_nt_backward(parity, backend, case):
    _backend_takes(backend, case)
    parity.check(case.with_backend(backend))


@FEW
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[1, 3, 17], n=(0, 5), k=(0, 1), dtypes=("fp32", "bf16"), dists=("normal", "outlier"),
                  transform=_shape),
       j=st.sampled_from([-3, 2, 5]))
def test_backward_scales_with_dc(backend, case, j):
    """G(2^j dc) = 2^j G(dc), bit for bit: scaling by a power of two commutes with every rounding."""
    case = case.with_backend(backend)
    _backend_takes(backend, case)
    x = runs.inputs_of(case)
    base = runs.run(case, x)
    scaled = runs.run(case, {**x, "dc": (x["dc"] * np.float32(2.0 ** j)).astype(x["dc"].dtype)})
    want = {k: (np.asarray(v, dtype=np.float64) * 2.0 ** j).astype(np.asarray(v).dtype) for k, v in base.items()}
    runs.assert_same_bits(case, scaled, want, f"dc was scaled by 2^{j}")


@FEW
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[1, 3, 17], n=(0, 5), k=(0, 1), dtypes=("fp32",), transform=_shape),
       seed=st.integers(0, 2**32 - 1))
def test_backward_is_additive_in_dc(backend, case, seed):
    """G(dc1 + dc2) = G(dc1) + G(dc2) within the op's limits (fp32: the sums round once more)."""
    case = case.with_backend(backend)
    _backend_takes(backend, case)
    x = runs.inputs_of(case)
    dc2 = np.random.default_rng(seed).standard_normal(x["dc"].shape).astype(np.float32)
    g1, g2 = runs.run(case, x), runs.run(case, {**x, "dc": dc2})
    g12 = runs.run(case, {**x, "dc": (x["dc"].astype(np.float64) + dc2).astype(np.float32)})
    runs.assert_close(case, g12, {k: np.asarray(g1[k], dtype=np.float64) + np.asarray(g2[k], dtype=np.float64)
                                  for k in g1}, "dc was the sum of two cotangents")


@FEW
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[1, 5, 17], n=(0, 5), k=(0, 1), wfmt=[w for w in GGML_W], transform=_shape))
def test_da_of_a_quantized_weight_is_da_of_its_dequantized_weight(backend, case):
    case = case.with_backend(backend)
    _backend_takes(backend, case)
    x = runs.inputs_of(case)
    got = runs.run(case, x)
    plain = ops.make_case(BWD, backend, case.dtype, {**case.p, "wfmt": "f32", "bias": 0}, case.dist, case.seed)
    w32 = quant.dequantize(case.p["wfmt"], x["w"]).astype(np.float32)  # exact: ggml's values are fp32
    want = runs.run(plain, {"a": x["a"], "w": w32, "dc": x["dc"]})
    if backend == "triton":  # two kernels (the GGML decoder's tiles, the fp32 matmul's)
        runs.assert_close(case, {"da": got["da"]}, {"da": np.asarray(want["da"], dtype=np.float64)},
                          "W was given dequantized, as float32")
    else:
        runs.assert_same_bits(case, {"da": got["da"]}, {"da": want["da"]}, "W was given dequantized, as float32")


@FEW
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[1, 3, 17, 40], n=(0, 5), k=(0, 1), dtypes=("fp32", "bf16"), dists=("normal", "outlier"),
                  wfmt=["f32"], bias=[1], transform=_shape))
def test_db_is_the_sum_of_dc_over_rows(backend, case):
    case = case.with_backend(backend)
    _backend_takes(backend, case)
    x = runs.inputs_of(case)
    got = runs.run(case, x)
    runs.assert_close(case, {"db": got["db"]}, {"db": np.asarray(x["dc"], dtype=np.float64).sum(axis=0)},
                      "db was checked against the float64 sum of dc's rows")


@FEW
@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases(BWD, m=[2, 5, 17, 33], n=(0, 5), k=(0, 1), dtypes=("fp32",), wfmt=["f32"], bias=[1],
                  transform=_shape),
       cut=st.integers(1, 32))
def test_the_gradient_of_a_batch_is_the_sum_of_its_parts(backend, case, cut):
    """Rows [0, r) and [r, M) apart: dw and db add up (float64) to the whole batch's; da's rows are theirs."""
    case = case.with_backend(backend)
    _backend_takes(backend, case)
    x = runs.inputs_of(case)
    whole = runs.run(case, x)
    r = 1 + cut % (case.p["m"] - 1)
    parts = []
    for rows in (slice(0, r), slice(r, case.p["m"])):
        one = ops.make_case(BWD, backend, case.dtype, {**case.p, "m": rows.stop - rows.start}, case.dist, case.seed)
        parts.append(runs.run(one, {**x, "a": np.ascontiguousarray(x["a"][rows]),
                                    "dc": np.ascontiguousarray(x["dc"][rows])}))
    sums = {k: np.asarray(parts[0][k], dtype=np.float64) + np.asarray(parts[1][k], dtype=np.float64)
            for k in ("dw", "db")}
    runs.assert_close(case, {k: whole[k] for k in sums}, sums, f"rows [0, {r}) and [{r}, M) were summed")
    da = np.concatenate([np.asarray(parts[0]["da"]), np.asarray(parts[1]["da"])])
    if backend == "cpu":  # one row's da is its own panel dot on the C kernel
        runs.assert_same_bits(case, {"da": whole["da"]}, {"da": da}, f"rows [0, {r}) and [{r}, M) ran apart")
    else:  # the tile a row falls in may change the BLAS blocking of the interpreter's / eager matmul
        runs.assert_close(case, {"da": whole["da"]}, {"da": da.astype(np.float64)},
                          f"rows [0, {r}) and [{r}, M) ran apart")
