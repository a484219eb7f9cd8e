"""Property tests of the quantization family: every kernel vs the golden, and the formats' invariants.

- dequantize, quantize and FP8 block quantization of every backend equal the golden bit for bit;
- random bytes (NaN / inf / subnormal fp16 scales included) dequantize without raising, and the
  golden's float64 result says what a kernel must produce (the `special` distribution);
- quantize -> dequantize is within the format's step in every block (blocks with fp16-normal
  scales: a subnormal or underflowed stored scale is coarser than the step the codes assumed);
- the legacy formats' quantizers are idempotent on dequantized values (the K-quants' scale searches,
  Q8_1's s from the unrounded d and Q8_K's reciprocal d are not, by design);
- FP8 block scaling: dequantized blocks are within half an e4m3 step of x (|x| <= 448 s).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_parity.refimpl import quant
from kernel_parity.conformance.ops.quant import GGML
from kernel_parity.property_tests.strategies import cases

# |dequantize(quantize(x)) - x| <= BOUND x the block's step (d; the largest sub-block d * sc_j for
# the K-quants), for blocks of N(0, 1) x 10^U(-2, 2) values:
# - half a step (round to nearest), plus the fp16 rounding of the stored scale: 0.56
# - q4_0 / q5_0: the positive extreme of a block whose largest magnitude is negative clamps one
#   level short (codes -8..7 for d = max / -8): 1.01
# - the K-quants' least-squares scale and min fits give up the extremes for the RMS error: 0.9
#   of the largest sub-block step (measured at most 0.86 over 1M blocks)
# - iq4_nl: non-uniform levels (-127..113, gaps up to 24) with a refitted scale: 18 |d| (measured 16.7)
BOUND = {"q8_0": 0.56, "q8_1": 0.56, "q8_k": 0.56, "q4_1": 0.56, "q5_1": 0.56, "q6_k": 0.56,
         "q4_0": 1.01, "q5_0": 1.01, "q2_k": 0.9, "q3_k": 0.9, "q4_k": 0.9, "q5_k": 0.9, "iq4_nl": 18.0}
IDEMPOTENT = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def _blocks(p):
    """k as a whole number of the format's blocks (1..8 of them)."""
    return {**p, "k": quant.FORMATS[p["fmt"]].block * (1 + p["k"] % 8)}


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("quant.dequantize", rows=(1, 4), k=(0, 7), transform=_blocks))
def test_dequantize(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends("cpu")
@given(case=cases("quant.quantize", rows=(1, 8), k=(0, 3), transform=_blocks))
def test_quantize(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends("triton", "torch")
@given(case=cases("quant.fp8_quantize", m=(1, 20), k=(1, 300)))
def test_fp8_quantize(parity, backend, case):
    parity.check(case.with_backend(backend))


def _rows(seed: int, rows: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-2, 2, (rows, 1))).astype(np.float32)


def _step(fmt: str, q: np.ndarray) -> np.ndarray:
    f = quant.block_fields(fmt, q)
    d = np.abs(f.d)
    return d if f.scales is None else np.abs(f.scales).max(-1) * d


@given(fmt=st.sampled_from(GGML), seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6))
def test_round_trip_error_within_the_step(fmt, seed, rows):
    f = quant.FORMATS[fmt]
    x = _rows(seed, rows, 2 * 256)
    q = quant.quantize(fmt, x)
    err = np.abs(quant.dequantize(fmt, q) - x).reshape(rows, -1, f.block).max(-1)
    step = _step(fmt, q)
    normal = step >= np.finfo(np.float16).tiny  # a subnormal stored scale is coarser than the codes assumed
    bad = normal & (err > BOUND[fmt] * step)
    assert not bad.any(), (f"{fmt}: a block's round-trip error {err[bad].max():.3g} exceeds {BOUND[fmt]} x its "
                           f"step {step[bad][np.argmax(err[bad])]:.3g} (seed={seed}, rows={rows})")


@given(fmt=st.sampled_from(IDEMPOTENT), seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6))
def test_quantize_is_idempotent_on_dequantized_values(fmt, seed, rows):
    q = quant.quantize(fmt, _rows(seed, rows, 256))
    again = quant.quantize(fmt, quant.dequantize(fmt, q).astype(np.float32))
    f = quant.FORMATS[fmt]
    same = (q == again).reshape(rows, -1, f.nbytes).all(-1)
    normal = np.abs(quant.block_fields(fmt, q).d) >= np.finfo(np.float16).tiny
    assert (same | ~normal).all(), f"{fmt}: quantize(dequantize(q)) != q in {int((~same & normal).sum())} block(s) (seed={seed})"


@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from(GGML))
def test_random_bytes_dequantize_without_raising(seed, fmt):
    from kernel_parity.conformance.ops.quant import random_blocks

    data = random_blocks(np.random.default_rng(seed), fmt, 3, 512, special=True)
    with np.errstate(all="ignore"):
        y = quant.dequantize(fmt, data)
    assert y.shape == (3, 512) and y.dtype == np.float64


@given(seed=st.integers(0, 2**32 - 1), bm=st.sampled_from([1, 128]), bk=st.sampled_from([32, 128]))
def test_fp8_block_round_trip_within_half_a_step(seed, bm, bk):
    x = _rows(seed, 130, 300)
    q, s = quant.fp8_quantize(x, bm, bk)
    y = quant.fp8_dequantize_blocks(q, s, bm, bk)
    sx = np.repeat(np.repeat(s.astype(np.float64), bm, 0), bk, 1)[: x.shape[0], : x.shape[1]]
    v = np.abs(x / sx)  # the value e4m3 rounds: its spacing is 2^(e - 3), 2^-9 below 2^-6
    half = np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 4) * sx
    assert np.all(np.abs(y - x) <= half * (1 + 1e-6)), f"fp8 round trip beyond half an e4m3 step (seed={seed})"
