"""CPU benchmarks for MLA decode: our C kernel, the eager torch baseline, and the float64 golden.

Run: pytest benchmarks/test_bench_cpu_mla.py --benchmark-only -p no:cacheprovider
(not part of `make test`). Groups:
- `mla decode <dtype> b=4 hq=16 d=576 dv=512 kv=2048 page=64 sq=1` (FlashMLA's layout: one latent
  kv head, values the first 512 dims of the key rows, pages in shuffled order):
  - `test_cpu_mla`: kernels/cpu mla.mla_decode at 1 and 2 threads;
  - `test_cpu_attention_paged`: kernels/cpu attention.decode_paged with h_kv = 1 and
    v_cache = kv_cache[..., :512], the generic kernel mla.c matches bit for bit;
  - `test_torch_mla`: kernels/torch mla.decode, the eager same-precision baseline the gate runs
    (page gather, logits and softmax in the dtype, plus the fp32 LSE pass);
  - `test_torch_dense`: only the O path of that baseline on rows already gathered into a
    contiguous (b, kv, d) tensor (two bmm and a softmax in the dtype): torch's floor for this work;
  each torch variant at torch's default thread count and at one thread (like-for-like with ours).
- `golden mla.decode float64 ...`: refimpl at the same shape; the gate runs the golden on every case.
A timing is a benchmark, never an assertion; each test checks only that the result is finite.
"""

from __future__ import annotations

import contextlib
import functools

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kernel_parity.kernels.cpu import loader  # noqa: E402
from kernel_parity.kernels.torch import mla as torch_mla  # noqa: E402
from kernel_parity.refimpl import mla as golden  # noqa: E402

DTYPES = {"f32": (np.float32, torch.float32), "bf16": (ml_dtypes.bfloat16, torch.bfloat16)}
P = dict(b=4, hq=16, d=576, dv=512, kv=2048, page=64, sq=1)
GROUP = "mla decode {} b=4 hq=16 d=576 dv=512 kv=2048 page=64 sq=1"
SCALE = 576**-0.5
TORCH_MODES = ["torch", "torch_1thread"]


@pytest.fixture(scope="module")
def cpu():
    try:
        from kernel_parity.kernels.cpu import attention, mla

        loader.load("mla")
        loader.load("attention")
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    return mla, attention


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
def _inputs(dtype: str) -> tuple[np.ndarray, ...]:
    """q (b, 1, hq, d), kv_cache (b * kv / page, page, 1, d) all valid, block_table shuffled, seqlens = kv."""
    rng, np_dt = np.random.default_rng(0), DTYPES[dtype][0]
    blocks = P["b"] * P["kv"] // P["page"]
    q = rng.standard_normal((P["b"], P["sq"], P["hq"], P["d"]), dtype=np.float32).astype(np_dt)
    kv = rng.standard_normal((blocks, P["page"], 1, P["d"]), dtype=np.float32).astype(np_dt)
    table = rng.permutation(blocks).astype(np.int32).reshape(P["b"], -1)
    return q, kv, table, np.full(P["b"], P["kv"], dtype=np.int32)


def _to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(a) if a.dtype == np.int32 else torch.from_numpy(a.astype(np.float32)).to(DTYPES[dtype][1])


# ---- golden -------------------------------------------------------------------------------------


def test_golden_decode(benchmark):
    benchmark.group = "golden mla.decode float64 b=4 hq=16 d=576 dv=512 kv=2048 sq=1"
    q, kv, table, seqlens = _inputs("f32")
    o, _ = benchmark.pedantic(golden.decode, args=(q.astype(np.float64), kv.astype(np.float64), table, seqlens,
                                                   SCALE), rounds=3, iterations=1)
    assert np.isfinite(o).all()


# ---- kernels/cpu ----------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_mla(benchmark, cpu, dtype, threads):
    benchmark.group = GROUP.format(dtype)
    q, kv, table, seqlens = _inputs(dtype)
    out = np.empty((P["b"], P["sq"], P["hq"], P["dv"]), q.dtype)
    lse = np.empty((P["b"], P["hq"], P["sq"]), np.float32)
    o, _ = benchmark(cpu[0].mla_decode, q, kv, table, seqlens, SCALE, P["dv"], True, out, lse, threads=threads)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_attention_paged(benchmark, cpu, dtype):
    benchmark.group = GROUP.format(dtype)
    q, kv, table, seqlens = _inputs(dtype)
    out = np.empty((P["b"], P["sq"], P["hq"], P["dv"]), q.dtype)
    lse = np.empty((P["b"], P["hq"], P["sq"]), np.float32)
    o, _ = benchmark(cpu[1].decode_paged, q, kv, kv[..., :P["dv"]], table, seqlens, scale=SCALE, out=out,
                     out_lse=lse)
    assert np.isfinite(o.astype(np.float32)).all()


# ---- torch ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_mla(benchmark, dtype, mode):
    benchmark.group = GROUP.format(dtype)
    q, kv, table, seqlens = (_to_torch(a, dtype) for a in _inputs(dtype))
    with torch_threads(mode):
        o, _ = benchmark(torch_mla.decode, q, kv, table, seqlens, SCALE, P["dv"])
    assert torch.isfinite(o).all()


def _dense_o(q: torch.Tensor, rows: torch.Tensor, dv: int) -> torch.Tensor:
    b, s_q, h, d = q.shape
    s = (q.reshape(b, s_q * h, d) @ rows.transpose(1, 2)) * SCALE
    return torch.softmax(s, dim=-1) @ rows[..., :dv]


@pytest.mark.parametrize("mode", TORCH_MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_dense(benchmark, dtype, mode):
    benchmark.group = GROUP.format(dtype)
    q, kv, table, _ = (_to_torch(a, dtype) for a in _inputs(dtype))
    rows = kv[table.long()].reshape(P["b"], P["kv"], P["d"]).contiguous()  # gathered once, outside the timing
    with torch_threads(mode):
        o = benchmark(_dense_o, q, rows, P["dv"])
    assert torch.isfinite(o).all()
