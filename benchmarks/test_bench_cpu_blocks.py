"""CPU benchmark of the fused decode attention block against the same block run stage by stage with our
own C kernels (the seed's claim: 5-10x from fusion).

Run: pytest benchmarks/test_bench_cpu_blocks.py --benchmark-only -p no:cacheprovider
(not part of `make test`). Group `decode block <fmt> E=4096 hq=32 hkv=8 d=128 kv=1024` (Llama-3-8B's
attention layer, one token at position 1024 of a 2048-slot head-major cache, Q/K/V/O weights in Q8_0 or
fp32), single-threaded:
- `test_fused`: kernels/cpu blocks.attention_decode, the one-pass block (norm, Q/K/V, RoPE, the cache
  write, attention over 1025 keys, W_o, residual; every stage output written too);
- `test_fused_no_history`: the same call at position 0 (one key): the block without its attention;
- `test_staged`: the block as separate calls of our C kernels: norm.rms_norm, gemm.gemm_nt (q, k, v),
  rope.rope (q, k), the cache row stores, attention.decode (over a (1, cap, h_kv, d) view of the
  head-major caches, no copy), gemm.gemm_nt (W_o), the residual add;
- `test_staged_gemms`: only the four gemm_nt calls of the staged block: the weight stream, which is
  the cost of decode (45 MB of Q8_0 weights per token against ~50 KB of intermediates).
A timing is a benchmark, never an assertion; each test checks only that the result is finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernel_parity.kernels.cpu import loader
from kernel_parity.refimpl import quant, rope as rope_ref

E, HQ, HKV, D, POS, CAP, THETA, EPS = 4096, 32, 8, 128, 1024, 2048, 500000.0, 1e-5
FORMATS = ["q8_0", "f32"]


@pytest.fixture(scope="module")
def kernels():
    try:
        from kernel_parity.kernels.cpu import attention, blocks, gemm, norm, rope

        for stem in ("blocks", "gemm", "attention", "norm", "rope"):
            loader.load(stem)
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    return {"blocks": blocks, "gemm": gemm, "attention": attention, "norm": norm, "rope": rope}


@pytest.fixture(scope="module", params=FORMATS)
def layer(request):
    """Weights of one format, the token, its residual and caches with POS tokens of history."""
    fmt = request.param
    rng = np.random.default_rng(0)

    def weight(n: int, k: int) -> np.ndarray:
        w = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)
        return w if fmt == "f32" else quant.quantize(fmt, w)

    cache = np.full((2, HKV, CAP, D), np.nan, np.float32)
    cache[:, :, :POS] = rng.standard_normal((2, HKV, POS, D))
    cos, sin = (t.astype(np.float32) for t in rope_ref.tables(CAP, D, THETA))
    return dict(fmt=fmt, wq=weight(HQ * D, E), wk=weight(HKV * D, E), wv=weight(HKV * D, E), wo=weight(E, HQ * D),
                x=rng.standard_normal(E).astype(np.float32), r=rng.standard_normal(E).astype(np.float32),
                gamma=(1 + 0.1 * rng.standard_normal(E)).astype(np.float32), k_cache=cache[0], v_cache=cache[1],
                cos=cos, sin=sin)


def _group(benchmark, layer):
    benchmark.group = f"decode block {layer['fmt']} E={E} hq={HQ} hkv={HKV} d={D} kv={POS}"


def _fused(kernels, L, pos):
    f = L["fmt"]
    return kernels["blocks"].attention_decode(
        L["x"], L["gamma"], EPS, (f, L["wq"]), (f, L["wk"]), (f, L["wv"]), (f, L["wo"]), L["k_cache"], L["v_cache"],
        L["cos"], L["sin"], pos, n=E, h_q=HQ, h_kv=HKV, d=D, residual=L["r"])["out"]


def test_fused(benchmark, kernels, layer):
    _group(benchmark, layer)
    assert np.isfinite(benchmark(_fused, kernels, layer, POS)).all()


def test_fused_no_history(benchmark, kernels, layer):
    _group(benchmark, layer)
    assert np.isfinite(benchmark(_fused, kernels, layer, 0)).all()


def _staged(k, L):
    f, pos = L["fmt"], np.array([POS], np.int32)
    nrm, _, _ = k["norm"].rms_norm(L["x"][None], L["gamma"], EPS)
    q = k["gemm"].gemm_nt(nrm, f, L["wq"]).reshape(1, HQ, D)
    kk = k["gemm"].gemm_nt(nrm, f, L["wk"]).reshape(1, HKV, D)
    v = k["gemm"].gemm_nt(nrm, f, L["wv"]).reshape(1, HKV, D)
    q = k["rope"].rope(q, pos, cos=L["cos"], sin=L["sin"], style="half")
    kk = k["rope"].rope(kk, pos, cos=L["cos"], sin=L["sin"], style="half")
    L["k_cache"][:, POS], L["v_cache"][:, POS] = kk[0], v[0]
    o, _ = k["attention"].decode(q[None], L["k_cache"].transpose(1, 0, 2)[None], L["v_cache"].transpose(1, 0, 2)[None],
                                 np.array([POS + 1], np.int32), scale=1.0 / math.sqrt(D))
    return k["gemm"].gemm_nt(o.reshape(1, HQ * D), f, L["wo"])[0] + L["r"]


def test_staged(benchmark, kernels, layer):
    _group(benchmark, layer)
    assert np.isfinite(benchmark(_staged, kernels, layer)).all()


def test_staged_gemms(benchmark, kernels, layer):
    _group(benchmark, layer)
    f, g = layer["fmt"], kernels["gemm"].gemm_nt
    a, o = np.ones((1, E), np.float32), np.ones((1, HQ * D), np.float32)

    def gemms():
        return (g(a, f, layer["wq"]).sum() + g(a, f, layer["wk"]).sum() + g(a, f, layer["wv"]).sum()
                + g(o, f, layer["wo"]).sum())

    assert np.isfinite(benchmark(gemms))
