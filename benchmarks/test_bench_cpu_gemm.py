"""CPU benchmarks for the quant and gemm families: our C integer GEMM against torch on the
dequantized weights, and quantize / dequantize throughput.

Run: pytest benchmarks/test_bench_cpu_gemm.py --benchmark-only
(not part of `make test`). Groups:
- `gemm M=<M> N=K=4096`: kernels/cpu gemm_nt (single-threaded; activations quantized to Q8_K / Q8_0
  inside the call, weights unpacked inside the call) for Q4_K, Q6_K, Q8_0, Q4_0 weights, beside
  torch.matmul of the float32 dequantized weight at torch's default thread count and at one thread
  (the like-for-like comparison). M = 1 is the GEMV of token generation, 32 and 128 are prefill.
- `quantize <rows>x4096` / `dequantize 4096x4096`: kernels/cpu quant against gguf-py (NumPy) where it
  has the format. The K-quant reference quantizers search scales per sub-block and are slow in any
  implementation, hence fewer rows.
A timing is a benchmark, never an assertion; each test checks only that the result is finite.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kernel_parity.kernels.cpu import loader  # noqa: E402

N = K = 4096
GEMM_FORMATS = ["q4_k", "q6_k", "q8_0", "q4_0"]
GEMM_M = [1, 32, 128]
TORCH_MODES = ["torch", "torch_1thread"]
QUANT_FORMATS = ["q4_k", "q6_k", "q8_0", "q4_0"]
QUANT_ROWS = {"q4_k": 256, "q6_k": 256, "q8_0": 4096, "q4_0": 4096}
GGUF_QUANTIZE = ("q8_0", "q4_0")


@pytest.fixture(scope="module")
def cpu_kernels():
    try:
        from kernel_parity.kernels.cpu import gemm, quant

        loader.load("quant")
        loader.load("gemm")
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    return {"gemm_nt": gemm.gemm_nt, "quantize": quant.quantize, "dequantize": quant.dequantize}


@contextlib.contextmanager
def torch_threads(mode: str):
    before = torch.get_num_threads()
    if mode == "torch_1thread":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _float_weight() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((N, K), dtype=np.float32) * 0.02).astype(np.float32)


@pytest.fixture(scope="module")
def weights(cpu_kernels):
    """fmt -> (N, K) quantized by our quantizer (once: the K-quant ones take about a second)."""
    w = _float_weight()
    return {fmt: cpu_kernels["quantize"](fmt, w) for fmt in GEMM_FORMATS}


def _activations(m: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((m, K), dtype=np.float32)


# ---- gemm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", GEMM_M)
@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_cpu_gemm(benchmark, cpu_kernels, weights, fmt, m):
    benchmark.group = f"gemm M={m} N=K={N}"
    a, out = _activations(m), np.empty((m, N), np.float32)
    c = benchmark(cpu_kernels["gemm_nt"], a, fmt, weights[fmt], out=out)
    assert np.isfinite(c).all()


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("m", GEMM_M)
def test_torch_matmul_dequantized(benchmark, cpu_kernels, weights, m, mode):
    """torch's float32 GEMM on the dequantized Q4_K weight (any format's timing is the same)."""
    benchmark.group = f"gemm M={m} N=K={N}"
    w = torch.from_numpy(cpu_kernels["dequantize"]("q4_k", weights["q4_k"]))
    a, out = torch.from_numpy(_activations(m)), torch.empty(m, N)
    with torch_threads(mode):
        c = benchmark(torch.matmul, a, w.T, out=out)
    assert torch.isfinite(c).all()


# ---- quantize / dequantize ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_cpu_quantize(benchmark, cpu_kernels, fmt):
    rows = QUANT_ROWS[fmt]
    benchmark.group = f"quantize {fmt} {rows}x{K}"
    x = _float_weight()[:rows]
    q = benchmark(cpu_kernels["quantize"], fmt, x)
    assert q.shape[0] == rows


@pytest.mark.parametrize("fmt", GGUF_QUANTIZE)
def test_gguf_quantize(benchmark, fmt):
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    rows = QUANT_ROWS[fmt]
    benchmark.group = f"quantize {fmt} {rows}x{K}"
    x = _float_weight()[:rows]
    q = benchmark(quants.quantize, x, getattr(GGMLQuantizationType, fmt.upper()))
    assert q.shape[0] == rows


@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_cpu_dequantize(benchmark, cpu_kernels, weights, fmt):
    benchmark.group = f"dequantize {fmt} {N}x{K}"
    out = np.empty((N, K), np.float32)
    y = benchmark(cpu_kernels["dequantize"], fmt, weights[fmt], out=out)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_gguf_dequantize(benchmark, weights, fmt):
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    benchmark.group = f"dequantize {fmt} {N}x{K}"
    y = benchmark(quants.dequantize, weights[fmt], getattr(GGMLQuantizationType, fmt.upper()))
    assert np.isfinite(y).all()
