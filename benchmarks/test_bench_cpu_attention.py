"""CPU benchmarks for the attention family: our C kernels, torch SDPA, and the float64 golden.

Run: pytest benchmarks/test_bench_cpu_attention.py --benchmark-only -p no:cacheprovider
(not part of `make test`). Groups:
- `decode <dtype> b=8 hq=32 hkv=8 d=128 kv=2048 sq=1`: kernels/cpu attention.decode (1 and 2
  threads) beside torch.nn.functional.scaled_dot_product_attention, whose variants are
  - `torch_gqa_view`: enable_gqa=True on the transposed view of our (b, s, h_kv, d) cache (the same
    bytes our kernel reads; whatever SDPA does with the strides is timed),
  - `torch_gqa_bhsd`: enable_gqa=True on a contiguous (b, h_kv, s, d) copy, torch's own layout,
  - `torch_expanded`: K/V repeated to h_q heads beforehand (b, h_q, s, d), 4x the bytes per call;
  each at torch's default thread count and at one thread (the like-for-like comparison with ours).
- `prefill <dtype> b=1 h=8 s=512 d=64 causal`: attention.prefill beside SDPA is_causal=True.
- `golden attention.decode float64 ...`: refimpl at the decode shape; every gate runs the goldens
  thousands of times (at smaller shapes), so their speed is the gate's speed.
A timing is a benchmark, never an assertion; each test checks only that the result is finite.
"""

from __future__ import annotations

import contextlib
import functools

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kernel_parity.kernels.cpu import loader  # noqa: E402
from kernel_parity.refimpl import attention as golden  # noqa: E402

DTYPES = {"f32": (np.float32, torch.float32), "bf16": (ml_dtypes.bfloat16, torch.bfloat16)}
DECODE = dict(b=8, hq=32, hkv=8, d=128, kv=2048, sq=1)
PREFILL = dict(b=1, h=8, s=512, d=64)
DECODE_GROUP = "decode {} b=8 hq=32 hkv=8 d=128 kv=2048 sq=1"
PREFILL_GROUP = "prefill {} b=1 h=8 s=512 d=64 causal"
TORCH_MODES = ["torch", "torch_1thread"]
TORCH_DECODE = ["torch_gqa_view", "torch_gqa_bhsd", "torch_expanded"]


@pytest.fixture(scope="module")
def cpu_attention():
    try:
        from kernel_parity.kernels.cpu import attention

        loader.load("attention")
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    return attention


@contextlib.contextmanager
def torch_threads(mode: str):
    before = torch.get_num_threads()
    if mode == "torch_1thread":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=2)
def _decode_inputs(dtype: str) -> tuple[np.ndarray, ...]:
    """q (b, 1, hq, d), caches (b, kv, hkv, d) all valid, seqlens (b,) = kv."""
    p, rng = DECODE, np.random.default_rng(0)
    np_dt = DTYPES[dtype][0]
    q = rng.standard_normal((p["b"], p["sq"], p["hq"], p["d"]), dtype=np.float32).astype(np_dt)
    k = rng.standard_normal((p["b"], p["kv"], p["hkv"], p["d"]), dtype=np.float32).astype(np_dt)
    v = rng.standard_normal((p["b"], p["kv"], p["hkv"], p["d"]), dtype=np.float32).astype(np_dt)
    return q, k, v, np.full(p["b"], p["kv"], dtype=np.int32)


def _prefill_inputs(dtype: str) -> tuple[np.ndarray, ...]:
    p, rng = PREFILL, np.random.default_rng(1)
    shape = (p["b"], p["s"], p["h"], p["d"])
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype][0]) for _ in range(3))


def _to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    """(b, s, h, d) numpy -> torch (b, h, s, d) view of the same layout, in the torch dtype."""
    t = torch.from_numpy(a.astype(np.float32)).to(DTYPES[dtype][1])
    return t.transpose(1, 2)


# ---- golden -------------------------------------------------------------------------------------


def test_golden_decode(benchmark):
    benchmark.group = "golden attention.decode float64 b=8 hq=32 hkv=8 d=128 kv=2048 sq=1"
    q, k, v, seqlens = (a.astype(np.float64) if a.dtype != np.int32 else a for a in _decode_inputs("f32"))
    o, _, _ = benchmark.pedantic(golden.decode, args=(q, k, v, seqlens), rounds=3, iterations=1)
    assert np.isfinite(o).all()


# ---- decode: kernels/cpu vs torch SDPA ------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_decode(benchmark, cpu_attention, dtype, threads):
    benchmark.group = DECODE_GROUP.format(dtype)
    q, k, v, seqlens = _decode_inputs(dtype)
    out, lse = np.empty_like(q), np.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    o, _ = benchmark(cpu_attention.decode, q, k, v, seqlens, out=out, out_lse=lse, threads=threads)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("variant", TORCH_DECODE)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_decode(benchmark, dtype, variant, mode):
    benchmark.group = DECODE_GROUP.format(dtype)
    q, k, v = (_to_torch(a, dtype) for a in _decode_inputs(dtype)[:3])  # (b, h, s, d)
    kw = {"enable_gqa": True}
    if variant == "torch_gqa_bhsd":
        k, v = k.contiguous(), v.contiguous()
    elif variant == "torch_expanded":
        rep = DECODE["hq"] // DECODE["hkv"]
        k, v = k.repeat_interleave(rep, dim=1).contiguous(), v.repeat_interleave(rep, dim=1).contiguous()
        kw = {}
    with torch_threads(mode):
        o = benchmark(F.scaled_dot_product_attention, q, k, v, **kw)
    assert torch.isfinite(o).all()


# ---- prefill: kernels/cpu vs torch SDPA ---------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_prefill(benchmark, cpu_attention, dtype, threads):
    benchmark.group = PREFILL_GROUP.format(dtype)
    q, k, v = _prefill_inputs(dtype)
    out, lse = np.empty_like(q), np.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    o, _ = benchmark(cpu_attention.prefill, q, k, v, causal="bottom_right", out=out, out_lse=lse,
                     threads=threads)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_prefill(benchmark, dtype, mode):
    benchmark.group = PREFILL_GROUP.format(dtype)
    q, k, v = (_to_torch(a, dtype).contiguous() for a in _prefill_inputs(dtype))
    with torch_threads(mode):
        o = benchmark(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert torch.isfinite(o).all()
