"""kernels/triton/gemm_mmq.py (int8 tensor-core GEMM over Q4_K / Q8_0 weights) against refimpl/ and gemm_q8.

Triton interpreter on CPU: tl.dot(int8, int8) -> int32 is numpy's integer matmul here, so these tests
check every index, byte split, scale decode and mask of the kernels, not the GPU's instruction choice.
The products against the `emulated` golden (M from 2 to 33: one and two BLOCK_M tiles, N across a
partial BLOCK_N tile, Q8_0 block counts that leave a tail after the NB-block loop); against gemm_q8's
dp4a kernel on the very same quantized activations; the element order of the int16-split Q8_0 codes and
of the Q4_K nibbles (one-hot rows of A read single weights); scales decades apart from block to block and
row to row in both A and W (a kernel that took a neighbour's scale fails); the store of rows past the
tile into a strided out; and the launcher's errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton
torch = pytest.importorskip("torch")
_why = interpreter_ready()
if _why:
    pytest.skip(_why, allow_module_level=True)

from kernel_parity import refimpl  # noqa: E402
import kernel_parity.refimpl.gemm  # noqa: E402,F401
import kernel_parity.refimpl.quant  # noqa: E402,F401
from kernel_parity.kernels.triton import gemm_mmq, gemm_q8  # noqa: E402

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}
QK = {"q4_k": 256, "q8_0": 32}


def _activations(rng, m: int, k: int) -> np.ndarray:
    a = rng.standard_normal((m, k)).astype(np.float32)
    blk = 256 if k % 256 == 0 else 32  # each block of A on its own scale, decades apart
    a *= np.exp(rng.uniform(-4, 4, (m, k // blk, 1))).astype(np.float32).repeat(blk, axis=2).reshape(m, k)
    return a


def _weights(rng, fmt: str, n: int, k: int, spread: float = 3.0) -> np.ndarray:
    """Quantized (N, K / QK * bytes) weights whose blocks (each row's, each block's) are on scales up to
    e^(2 spread) apart; Q4_K's 32-element sub-blocks also get their own scale and offset, so that their
    6-bit scales and mins differ."""
    qk = QK[fmt]
    wf = rng.standard_normal((n, k // qk, qk)).astype(np.float32)
    if fmt == "q4_k":
        sub = wf.reshape(n, k // 32, 32)
        sub *= np.exp(rng.uniform(-1.5, 1.5, (n, k // 32, 1))).astype(np.float32)
        sub += rng.uniform(-2, 2, (n, k // 32, 1)).astype(np.float32)
    wf *= np.exp(rng.uniform(-spread, spread, (n, k // qk, 1))).astype(np.float32)
    return refimpl.quant.quantize(fmt, wf.reshape(-1, qk)).reshape(n, -1)


def _quantize(fmt: str, a: torch.Tensor) -> tuple:
    return gemm_q8.quantize_q8_k(a) if fmt == "q4_k" else gemm_q8.quantize_q8_0(a)


def _mmq(fmt: str, a: torch.Tensor, w: np.ndarray, bias=None, out=None, config=None) -> torch.Tensor:
    """gemm_nt_q8's steps with launch_mmq in place of launch_gemv (arguments valid by construction)."""
    m, n = a.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=a.dtype) if out is None else out
    gemm_mmq.launch_mmq(fmt, _quantize(fmt, a), torch.from_numpy(w), bias, out,
                        config or gemm_mmq.default_config(fmt, m, n))
    return out


def _bytes(fmt: str) -> int:
    return 144 if fmt == "q4_k" else 34


def _magnitude(fmt: str, a_in: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|A| @ |dequant(W)|^T: the scale of fp32 summation-order errors."""
    wd = refimpl.quant.dequantize(fmt, w.reshape(-1, _bytes(fmt))).reshape(w.shape[0], -1)
    return np.abs(a_in).astype(np.float64) @ np.abs(wd).astype(np.float64).T


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt, m, n, k, bias", [
    ("q8_0", 2, 19, 224, True), ("q8_0", 5, 70, 224, False), ("q8_0", 17, 19, 288, True),
    ("q8_0", 33, 19, 96, False),
    ("q4_k", 2, 19, 512, False), ("q4_k", 5, 70, 256, True), ("q4_k", 17, 19, 768, True),
    ("q4_k", 33, 19, 512, False)])
def test_mmq_matches_emulated_golden(dtype, fmt, m, n, k, bias):
    """The default config for each M (BLOCK_M 16 up to M = 16, then 32: M = 17 and 33 take two row tiles);
    Q8_0 K / 32 = 7, 9, 3 blocks: odd, a tail after the NB = 2 loop; N = 70: a partial second W tile."""
    rng = np.random.default_rng(m * 1000 + n + k)
    a = torch.from_numpy(_activations(rng, m, k)).to(TORCH[dtype])
    a_in = a.float().numpy()  # the activations as the kernel sees them
    w = _weights(rng, fmt, n, k)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    got = _mmq(fmt, a, w, None if b is None else torch.from_numpy(b))
    assert got.dtype == a.dtype and tuple(got.shape) == (m, n)
    ref = refimpl.gemm.emulated_reference(a_in, fmt, {"w": w}, b)
    deq = refimpl.gemm.dequant_reference(a_in, fmt, {"w": w}, b)
    g = got.double().numpy()
    out_rel = {"fp32": 0.0, "bf16": 2.0**-8}[dtype]  # one rounding to the output dtype
    mag = _magnitude(fmt, a_in, w)
    assert np.all(np.abs(g - ref) <= out_rel * np.abs(ref) + 1e-5 * mag + (np.abs(b) * 1e-7 if bias else 0))
    # and it is not the dequantized product: the activation quantization shows (the kernel claims L2)
    assert np.abs(ref - deq).max() > 10 * np.abs(g - ref).max() or dtype != "fp32"


@pytest.mark.parametrize("fmt, m, n, k, config", [
    ("q8_0", 4, 70, 224, None), ("q8_0", 16, 19, 288, (64, 16, 4, 4, 3)), ("q8_0", 20, 19, 160, (128, 32, 1, 8, 2)),
    ("q4_k", 4, 70, 256, None), ("q4_k", 16, 19, 768, (64, 16, 2, 4, 3)), ("q4_k", 20, 19, 512, (128, 32, 1, 8, 2)),
    # split-K: 9 Q8_0 blocks in splits of 4, 4, 1 (NB 2: a leftover block in the first two), 5 Q4_K blocks
    # in 3 + 2 (NB 2: a leftover in the first), partials reduced with the bias
    ("q8_0", 5, 19, 288, (16, 16, 2, 1, 2, 3)), ("q4_k", 5, 19, 1280, (32, 16, 2, 2, 2, 2)),
    ("q8_0", 3, 70, 224, (64, 16, 1, 4, 3, 7)),  # one block a split
    ("q4_k", 17, 19, 1280, (64, 32, 1, 4, 3, 3))])  # 5 Q4_K blocks in 2 + 2 + 1, M 17 in 32-row tiles
def test_mmq_matches_dp4a_kernel(fmt, m, n, k, config):
    """launch_mmq and gemm_q8.launch_gemv on the same quantized tuple: the same integer sums and scale
    products, so equal up to fp32 summation order (NB = 4 over 9 Q8_0 blocks, NB = 2 over 3 Q4_K blocks:
    tails after the main loop; BLOCK_N 128)."""
    rng = np.random.default_rng(k + 7 * m)
    a = torch.from_numpy(_activations(rng, m, k))
    w = _weights(rng, fmt, n, k)
    quantized = _quantize(fmt, a)
    wt = torch.from_numpy(w)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    want = torch.empty((m, n))
    gemm_q8.launch_gemv(fmt, quantized, wt, b, want, gemm_q8.default_config(fmt, m, n))
    got = torch.empty((m, n))
    gemm_mmq.launch_mmq(fmt, quantized, wt, b, got, config or gemm_mmq.default_config(fmt, m, n))
    mag = _magnitude(fmt, a.numpy(), w)
    assert np.all(np.abs(got.double().numpy() - want.double().numpy()) <= 1e-5 * mag + 1e-6 * np.abs(b.numpy()))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_one_hot_rows_read_each_weight_in_place(fmt):
    """Row m of A is 1 at column k_m and 0 elsewhere: its quantized dot with row n of W is W[n, k_m]
    (Q8_0: code 127, d = fp16(1/127); Q8_K: code -127, d = -1/127, a sum of -127 in k_m's sub-block)
    up to fp32 rounding. Q8_0: 64 rows read columns 0-63, every code of two blocks (the two bytes of each
    int16 word); Q4_K: 32 rows read one column of each nibble position and sub-block, so any reordering shows."""
    rng = np.random.default_rng(11)
    k, n = (64, 70) if fmt == "q8_0" else (512, 19)
    i = np.arange(64 if fmt == "q8_0" else 32)
    # Q4_K: two columns in each of the 16 sub-blocks of both 256-blocks, at byte positions l = i % 16
    # (even i) and 16 + i % 16 (odd i) of their 32-byte chunk
    cols = i if fmt == "q8_0" else i * 16 + i % 16
    a = np.zeros((len(i), k), dtype=np.float32)
    a[i, cols] = 1.0
    w = _weights(rng, fmt, n, k)
    wd = refimpl.quant.dequantize(fmt, w.reshape(-1, _bytes(fmt))).reshape(n, k)
    got = _mmq(fmt, torch.from_numpy(a), w).double().numpy()
    d_a = float(np.float16(1 / 127)) * 127 if fmt == "q8_0" else 1.0  # Q8_0's d is rounded to fp16
    want = wd[:, cols].T.astype(np.float64) * d_a
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_neighbour_scales_are_kept_apart(fmt):
    """Each block of each row of W on a scale up to e^8 from its neighbours (and Q4_K's sub-blocks on their
    own scales and offsets), each block of A on one up to e^8 from its neighbours, A's Q8_K sub-blocks with
    their own offsets (their code sums differ): reading a neighbouring block's, sub-block's or row's scale,
    min or code sum is off by far more than the tolerance. K = 9 Q8_0 blocks (NB = 2: loop and tail) or 3
    Q4_K blocks; M = 17, N = 70: two tiles each way."""
    rng = np.random.default_rng(5)
    m, n = 17, 70
    k = 288 if fmt == "q8_0" else 768
    a = rng.standard_normal((m, k)).astype(np.float32) + rng.uniform(-2, 2, (m, k // 32, 1)).astype(
        np.float32).repeat(32, axis=2).reshape(m, k)
    blk = QK[fmt]
    a *= np.exp(rng.uniform(-4, 4, (m, k // blk, 1))).astype(np.float32).repeat(blk, axis=2).reshape(m, k)
    w = _weights(rng, fmt, n, k, spread=4.0)
    got = _mmq(fmt, torch.from_numpy(a), w).double().numpy()
    ref = refimpl.gemm.emulated_reference(a, fmt, {"w": w})
    assert np.all(np.abs(got - ref) <= 1e-5 * _magnitude(fmt, a, w))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_rows_past_the_tile_and_strided_out(fmt):
    """M = 17, N = 70 (BLOCK_M 16, BLOCK_N 64: partial tiles both ways) into a column-major window of a
    NaN-filled buffer: every entry of out written with the product, nothing around it."""
    rng = np.random.default_rng(3)
    m, n, k = 17, 70, (96 if fmt == "q8_0" else 256)
    a = torch.from_numpy(_activations(rng, m, k))
    w = _weights(rng, fmt, n, k)
    buf = torch.full((n + 3, m + 5), float("nan"))
    out = buf.t()[2:2 + m, 1:1 + n]  # (m, n), strides (1, m + 5)
    got = _mmq(fmt, a, w, out=out, config=(64, 16, 2, 4, 3))
    assert got is out
    ref = refimpl.gemm.emulated_reference(a.numpy(), fmt, {"w": w})
    assert np.all(np.abs(out.double().numpy() - ref) <= 1e-5 * _magnitude(fmt, a.numpy(), w))
    inside = torch.zeros_like(buf, dtype=torch.bool)
    inside.t()[2:2 + m, 1:1 + n] = True
    assert torch.isnan(buf[~inside]).all()


def test_default_config():
    assert gemm_mmq.MMQ_MIN_M == 2
    assert gemm_mmq.default_config("q8_0", 2, 4096) == (64, 16, 1, 4, 3)
    assert gemm_mmq.default_config("q8_0", 16, 4096) == (64, 16, 1, 4, 3)
    assert gemm_mmq.default_config("q4_k", 4, 14336) == (32, 16, 1, 2, 3)
    assert gemm_mmq.default_config("q4_k", 17, 4096) == (32, 32, 1, 2, 3)
    cpu = torch.device("cpu")
    assert gemm_mmq.auto_splits(224, 128, 1, cpu) == 1  # the interpreter: never split


@pytest.mark.parametrize("fmt, offset, stride, config, match", [
    ("q8_0", 1, 34, None, "2-byte aligned"),  # row addresses odd
    ("q8_0", 0, 35, None, "2-byte aligned"),  # row stride odd
    ("q4_k", 2, 144, None, "4-byte aligned"),
    ("q4_k", 0, 146, None, "4-byte aligned"),
    ("q4_k", 0, 144, (64, 8, 1, 4, 3), "BLOCK_M >= 16"),
    ("q8_0", 0, 34, (64, 16, 0, 4, 3), "NB >= 1"),
    ("q8_0", 0, 34, (64, 16, 1, 4, 3, 0), "SPLIT_K >= 1"),
    ("q6_k", 0, 210, None, "not one of"),
])
def test_launcher_errors(fmt, offset, stride, config, match):
    """Weights launch_mmq's word loads cannot read (gemm_nt_q8's checks reject them before; launch_mmq
    rejects them too rather than read misaligned words) and tiles tl.dot cannot take."""
    n, nbytes = 3, {"q4_k": 144, "q8_0": 34, "q6_k": 210}[fmt]
    raw = torch.zeros(offset + n * stride, dtype=torch.uint8)
    w = raw[offset:].as_strided((n, nbytes), (stride, 1))
    a = torch.zeros((2, 256))
    quantized = gemm_q8.quantize_q8_k(a) if fmt == "q4_k" else gemm_q8.quantize_q8_0(a[:, :32])
    with pytest.raises(ValueError, match=match):
        gemm_mmq.launch_mmq(fmt, quantized, w, None, torch.empty((2, n)), config or (64, 16, 1, 4, 3))


def test_auto_splits_fill_the_gpu(monkeypatch):
    """On a GPU (132 SMs here, faked): splits until ~SPLIT_PROGRAMS_PER_SM programs an SM, never below two NB
    steps of blocks a split, never above MAX_SPLITS; a grid that fills the GPU alone is not split."""
    monkeypatch.setattr(gemm_mmq, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert gemm_mmq.SPLIT_PROGRAMS_PER_SM == 6
    assert gemm_mmq.auto_splits(224, 128, 1, cuda) == 4  # Q8_0 14336 x 4096 in 64-row tiles: 792 / 224
    assert gemm_mmq.auto_splits(448, 16, 1, cuda) == 2  # Q4_K in 32-row tiles
    assert gemm_mmq.auto_splits(64, 6, 1, cuda) == 3  # K of 6 blocks: 2 blocks a split at least
    assert gemm_mmq.auto_splits(8, 1024, 1, cuda) == gemm_mmq.MAX_SPLITS
    assert gemm_mmq.auto_splits(1000, 128, 1, cuda) == 1


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_empty_k_gives_the_bias(fmt):
    """K = 0: no block to read (an empty loop); out is the bias, or zeros without one."""
    a = torch.zeros((3, 0))
    w = torch.zeros((5, 0), dtype=torch.uint8)
    b = torch.arange(5, dtype=torch.float32)
    quantized = gemm_q8.quantize_q8_k(a) if fmt == "q4_k" else gemm_q8.quantize_q8_0(a)
    for bias, want in ((b, b.expand(3, 5)), (None, torch.zeros((3, 5)))):
        out = torch.full((3, 5), float("nan"))
        gemm_mmq.launch_mmq(fmt, quantized, w, bias, out, (64, 16, 1, 4, 3))
        assert torch.equal(out, want)
