"""CPU benchmarks for the softmax and combine families: goldens, our C kernels, torch eager.

Run: pytest benchmarks/test_bench_cpu_softmax.py --benchmark-only
(not part of `make test`). Groups:
- `golden ...`: the float64 goldens at large shapes; every gate runs them thousands of times.
- `softmax <dtype> <rows>x<n>`: kernels/cpu softmax (single-threaded) beside torch.softmax, with
  torch at its default thread count and at one thread (the like-for-like comparison).
- `combine <dtype> ...`: kernels/cpu lse_combine beside an eager torch merge.
A timing is a benchmark, never an assertion; each test checks only that the result is finite.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kernel_parity.kernels.cpu import loader  # noqa: E402
from kernel_parity.refimpl import combine as golden_combine  # noqa: E402
from kernel_parity.refimpl import softmax as golden_softmax  # noqa: E402

DTYPES = {"f32": (np.float32, torch.float32), "bf16": (ml_dtypes.bfloat16, torch.bfloat16)}
SOFTMAX_SHAPES = [(4096, 4096), (1024, 32768)]
COMBINE_SHAPE = (16, 4096, 128)  # splits, rows, d_v
TORCH_MODES = ["torch", "torch_1thread"]


@pytest.fixture(scope="module")
def cpu_kernels():
    try:
        from kernel_parity.kernels.cpu.combine import lse_combine
        from kernel_parity.kernels.cpu.softmax import online_softmax, softmax

        loader.load("softmax")
        loader.load("combine")
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    return {"softmax": softmax, "online_softmax": online_softmax, "lse_combine": lse_combine}


@contextlib.contextmanager
def torch_threads(mode: str):
    before = torch.get_num_threads()
    if mode == "torch_1thread":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _logits(rows: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((rows, n), dtype=np.float32) * 3).astype(dtype)


def _combine_inputs(dtype) -> tuple[np.ndarray, np.ndarray]:
    splits, rows, d_v = COMBINE_SHAPE
    rng = np.random.default_rng(0)
    o = rng.standard_normal((splits, rows, d_v), dtype=np.float32).astype(dtype)
    lse = (rng.standard_normal((splits, rows), dtype=np.float32) * 3).astype(np.float32)
    lse[rng.random((splits, rows)) < 0.1] = -np.inf  # some empty splits, as short sequences give
    return o, lse


def _torch_lse_combine(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager merge in fp32, the way a PyTorch user writes it (empty splits masked, not multiplied)."""
    m = lse.amax(0)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lse - m_safe)  # splits, rows; exp(-inf) = 0 for empty splits
    s = w.sum(0)
    w = torch.where(s > 0, w / s, 0.0)
    o_live = torch.where(torch.isneginf(lse)[..., None], 0.0, o.float())
    out = (w[..., None] * o_live).sum(0).to(o.dtype)
    return out, m_safe + torch.log(s)


# ---- goldens -------------------------------------------------------------------------------------


def test_golden_softmax(benchmark):
    benchmark.group = "golden softmax float64 256x32768"
    x = _logits(256, 32768, np.float32).astype(np.float64)
    y = benchmark(golden_softmax.softmax, x)
    assert np.isfinite(y).all()


def test_golden_online_softmax(benchmark):
    benchmark.group = "golden online_softmax float64 256x32768 tile=1024"
    x = _logits(256, 32768, np.float32).astype(np.float64)
    y, _ = benchmark(golden_softmax.online_softmax, x, 1024)
    assert np.isfinite(y).all()


def test_golden_lse_combine(benchmark):
    benchmark.group = "golden lse_combine float64 splits=16 rows=4096 d_v=128"
    o, lse = _combine_inputs(np.float32)
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    out, _ = benchmark(golden_combine.lse_combine, o, lse)
    assert np.isfinite(out).all()


# ---- softmax: kernels/cpu vs torch ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_softmax(benchmark, cpu_kernels, dtype, shape):
    benchmark.group = f"softmax {dtype} {shape[0]}x{shape[1]}"
    x = _logits(*shape, DTYPES[dtype][0])
    out = np.empty_like(x)
    y = benchmark(cpu_kernels["softmax"], x, out=out)
    assert np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_online_softmax(benchmark, cpu_kernels, dtype, shape):
    benchmark.group = f"softmax {dtype} {shape[0]}x{shape[1]}"
    x = _logits(*shape, DTYPES[dtype][0])
    out, lse = np.empty_like(x), np.empty(shape[0], np.float32)
    y, _ = benchmark(cpu_kernels["online_softmax"], x, 1024, out=out, out_lse=lse)
    assert np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_softmax(benchmark, dtype, shape, mode):
    benchmark.group = f"softmax {dtype} {shape[0]}x{shape[1]}"
    x = torch.from_numpy(_logits(*shape, np.float32)).to(DTYPES[dtype][1])
    out = torch.empty_like(x)
    with torch_threads(mode):
        y = benchmark(torch.softmax, x, -1, out=out)
    assert torch.isfinite(y).all()


# ---- combine: kernels/cpu vs torch ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_lse_combine(benchmark, cpu_kernels, dtype):
    benchmark.group = f"combine {dtype} splits=16 rows=4096 d_v=128"
    o, lse = _combine_inputs(DTYPES[dtype][0])
    out, out_lse = np.empty(o.shape[1:], o.dtype), np.empty(o.shape[1], np.float32)
    y, _ = benchmark(cpu_kernels["lse_combine"], o, lse, out=out, out_lse=out_lse)
    assert np.isfinite(y.astype(np.float32)).all()


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_lse_combine(benchmark, dtype, mode):
    benchmark.group = f"combine {dtype} splits=16 rows=4096 d_v=128"
    o, lse = _combine_inputs(np.float32)
    o_t, lse_t = torch.from_numpy(o).to(DTYPES[dtype][1]), torch.from_numpy(lse)
    with torch_threads(mode):
        y, _ = benchmark(_torch_lse_combine, o_t, lse_t)
    assert torch.isfinite(y).all()
