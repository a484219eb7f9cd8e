"""CPU benchmarks for the GGML block-format goldens (refimpl/quant.py) beside gguf-py's NumPy codecs.

Run: pytest benchmarks/test_bench_cpu_quant.py --benchmark-only
(not part of `make test`). Groups:
- `dequantize <fmt> 4096x4096`: the golden (exact float64) beside `gguf.quants.dequantize`
  (float32), on the same bytes. Goldens are run thousands of times; this is their speed.
- `quantize <fmt> 256x4096`: the golden reference quantizers (float32 C arithmetic emulated in
  NumPy, vectorised over blocks) beside gguf-py's where it has one (q4_0 q4_1 q5_0 q5_1 q8_0).
Each test records Melem/s (median) in extra_info. A timing is a benchmark, never an assertion.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kernel_parity.refimpl import quant

DEQ_SHAPE = (4096, 4096)
Q_SHAPE = (256, 4096)
DEQ_FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl"]
GGUF_QUANTIZE = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]


def _weights(shape: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


@functools.lru_cache(maxsize=None)
def _bytes(fmt: str) -> np.ndarray:
    """4096 x 4096 N(0, 1) weights in `fmt`, quantized once by the golden (byte-exact with ggml)."""
    return quant.quantize(fmt, _weights(DEQ_SHAPE))


def _gguf_type(fmt: str):
    gguf = pytest.importorskip("gguf")
    return gguf, gguf.GGMLQuantizationType[fmt.upper()]


def _rate(benchmark, n: int) -> None:
    benchmark.extra_info["Melem/s (median)"] = round(n / benchmark.stats.stats.median / 1e6, 1)


@pytest.mark.parametrize("fmt", DEQ_FORMATS)
def test_golden_dequantize(benchmark, fmt):
    benchmark.group = f"dequantize {fmt} 4096x4096"
    data = _bytes(fmt)
    y = benchmark(quant.dequantize, fmt, data)
    _rate(benchmark, y.size)
    assert y.dtype == np.float64 and np.isfinite(y).all()


@pytest.mark.parametrize("fmt", DEQ_FORMATS)
def test_gguf_dequantize(benchmark, fmt):
    benchmark.group = f"dequantize {fmt} 4096x4096"
    gguf, qtype = _gguf_type(fmt)
    data = _bytes(fmt)
    y = benchmark(gguf.quants.dequantize, data, qtype)
    _rate(benchmark, y.size)
    assert y.dtype == np.float32 and np.isfinite(y).all()


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_golden_quantize(benchmark, fmt):
    benchmark.group = f"quantize {fmt} 256x4096"
    x = _weights(Q_SHAPE)
    q = benchmark.pedantic(quant.quantize, args=(fmt, x), rounds=3, iterations=1, warmup_rounds=1)
    _rate(benchmark, x.size)
    assert q.shape == (Q_SHAPE[0], Q_SHAPE[1] // quant.FORMATS[fmt].block * quant.FORMATS[fmt].nbytes)


@pytest.mark.parametrize("fmt", GGUF_QUANTIZE)
def test_gguf_quantize(benchmark, fmt):
    benchmark.group = f"quantize {fmt} 256x4096"
    gguf, qtype = _gguf_type(fmt)
    x = _weights(Q_SHAPE)
    q = benchmark.pedantic(gguf.quants.quantize, args=(x, qtype), rounds=3, iterations=1, warmup_rounds=1)
    _rate(benchmark, x.size)
    assert q.dtype == np.uint8
