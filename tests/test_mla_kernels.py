"""Native CPU and eager torch MLA decode (kernels/cpu/mla.py, kernels/torch/mla.py) against the
float64 goldens of refimpl/mla.py, on the inputs rounded to the test dtype.

Caches are FlashMLA's test caches: shuffled pages, NaN in every row past a request's length and in
pages no request owns, unused block-table entries poisoned with 2147480000; lengths 0, 1, 63, 64,
65, 200 around the 64-token page. The C kernel is also checked bit for bit against
kernels/cpu/attention.decode_paged with h_kv = 1 (the same operations in the same order, which
mla.c documents) and across thread counts and ISA paths.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.kernels.cpu import loader
from kernel_parity.refimpl import mla as golden
from kernel_parity.refimpl import quant_fp as qf

torch = pytest.importorskip("torch")

from kernel_parity.kernels.torch import mla as tmla  # noqa: E402

try:
    from kernel_parity.kernels.cpu import attention as cattention
    from kernel_parity.kernels.cpu import mla as cmla

    cmla._kernels()
    _UNAVAILABLE = None
except loader.CompilerUnavailable as e:  # no compiler: the C tests skip with the reason
    _UNAVAILABLE = str(e)
needs_c = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"kernels/cpu unavailable: {_UNAVAILABLE}")

DTYPES = {"f32": (np.float32, torch.float32), "bf16": (ml_dtypes.bfloat16, torch.bfloat16),
          "f16": (np.float16, torch.float16)}
D, D_V, PAGE = 576, 512, 64
SEQLENS = (0, 1, 63, 64, 65, 200)
POISON_BLOCK = 2147480000  # FlashMLA's tests fill unused block-table entries with it

# Tolerances: |got - want| <= atol * max|want| + rtol * |want| per element; LSE (fp32 everywhere)
# |got - want| <= lse * max|want|. One line each, with its reason; "measured" is the worst case
# over this file's cases.
# C: the golden sees the same rounded inputs, so the error is fp32 accumulation plus one rounding.
C_ATOL = 1e-5  # fp32 sums of <= 576-term dot products and <= 200-key P V: measured 6.6e-7
C_RTOL = {"f32": 0.0, "bf16": 2.0**-8, "f16": 2.0**-11}  # the final rounding: half an ulp, relative
C_LSE = 1e-6  # m + ln l in double, rounded once, over fp32 scores: measured 9.2e-8
# torch: logits and probabilities rounded to the dtype (attention_ref(upcast=False)): measured
# bf16 1.7e-3 (dense) / 3.9e-3 (sparse: 40 keys, larger weights each), f16 3.9e-4 / 6.0e-4, f32 3.3e-7.
TORCH_ATOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 2e-3}
TORCH_LSE = 1e-6  # the fp32 upcast path: measured 1.5e-7
# fused FP8: adds q_lat, the new cache rows and O_lat in the dtype, and fp8 codes that flip where
# those roundings cross a quantization boundary (one e4m3 step, 1/8 relative, on that element):
# measured bf16 1.7e-2, f16 3.2e-3, f32 2.6e-7 (float32 quantizer inputs equal the golden's).
FUSED_ATOL = {"f32": 1e-5, "bf16": 5e-2, "f16": 1e-2}
# the new cache rows: F.rms_norm in the dtype rounds x / rms and the gamma product, RoPE rounds
# once: measured bf16 1.7e-3, f16 3.7e-4, f32 1.2e-7; two half-ulps of the largest row element.
FUSED_CACHE_ATOL = {"f32": 1e-6, "bf16": 2.0**-7, "f16": 2.0**-10}


def assert_close(got, want, atol: float, rtol: float, what: str, repro: str) -> None:
    """Elementwise |got - want| <= atol max|want| + rtol |want|; infinities and NaN at the same places."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}\n  repro: {repro}"
    fin = np.isfinite(want) & np.isfinite(got)
    special = ~fin & ~((got == want) | (np.isnan(got) & np.isnan(want)))  # inf or NaN on one side only
    scale = np.abs(want[np.isfinite(want)]).max(initial=0.0)
    err = np.abs(np.where(fin, got, 0.0) - np.where(fin, want, 0.0))
    bad = special | (err > atol * scale + rtol * np.abs(np.where(fin, want, 0.0)))
    if bad.any():
        order = np.argsort(~np.isnan(got[bad]), kind="stable")[:5]  # NaN first
        lines = [f"  {what}{list(map(int, i))} = {got[tuple(i)]:.6g}, expected {want[tuple(i)]:.6g}  "
                 f"|d|={err[tuple(i)]:.2e}" for i in np.argwhere(bad)[order]]
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.size} elements outside tol (atol={atol:g} x "
                             f"max|want|={scale:.3g}, rtol={rtol:g})\n" + "\n".join(lines) + f"\n  repro: {repro}")


def _repro(request) -> str:
    return f"pytest '{request.node.nodeid}'"


def _paged(rng, seqlens, np_dtype, page=PAGE, d=D):
    """A cache with each request's tokens in shuffled pages, NaN past each length and in two pages
    no request owns, unused table entries poisoned. Returns (cache, block_table)."""
    seqlens = np.asarray(seqlens, dtype=np.int32)
    nblk = -(-seqlens // page)
    ids = rng.permutation(int(nblk.sum()) + 2).astype(np.int32)
    cache = np.full((ids.size, page, 1, d), np.nan, dtype=np.float32)
    table = np.full((seqlens.size, int(nblk.max(initial=0)) + 1), POISON_BLOCK, dtype=np.int32)
    start = np.concatenate([[0], np.cumsum(nblk)])
    for i in range(seqlens.size):  # test setup: a loop over a few requests
        table[i, : nblk[i]] = ids[start[i]:start[i + 1]]
        rows = rng.standard_normal((seqlens[i], d), dtype=np.float32)
        flat = cache[table[i, : nblk[i]]].reshape(-1, d)
        flat[: seqlens[i]] = rows
        cache[table[i, : nblk[i]]] = flat.reshape(-1, page, 1, d)
    return cache.astype(np_dtype), table


def _case(dtype: str, s_q: int, h_q: int, seed: int, seqlens=SEQLENS, page=PAGE, d=D):
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype][0]
    cache, table = _paged(rng, seqlens, np_dtype, page, d)
    q = rng.standard_normal((len(seqlens), s_q, h_q, d), dtype=np.float32).astype(np_dtype)
    return q, cache, table, np.asarray(seqlens, dtype=np.int32)


def _t(a: np.ndarray, dtype: str):
    """numpy (float of any width, int) -> torch, exactly (the values are representable)."""
    if a.dtype.kind in "iu":
        return torch.from_numpy(a)
    return torch.from_numpy(a.astype(np.float32)).to(DTYPES[dtype][1])


def _f64(*arrays):
    return tuple(a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 else a
                 for a in arrays)


# ---- C: kernels/cpu/mla.py --------------------------------------------------------------------

SHAPES = [(1, True, 16), (2, True, 5), (3, False, 3)]  # s_q, causal, h_q (5 and 15 rows: a 1-row tile tail)


@needs_c
@pytest.mark.parametrize("s_q,causal,h_q", SHAPES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_c_decode(request, dtype, s_q, causal, h_q):
    q, cache, table, seqlens = _case(dtype, s_q, h_q, seed=1)
    o, lse = cmla.mla_decode(q, cache, table, seqlens, D**-0.5, D_V, causal)
    o_ref, lse_ref = golden.decode(*_f64(q, cache), table, seqlens, D**-0.5, D_V, causal)
    assert_close(o.astype(np.float64), o_ref, C_ATOL, C_RTOL[dtype], "mla_decode[cpu] O", _repro(request))
    assert_close(lse, lse_ref, C_LSE, 0.0, "mla_decode[cpu] LSE", _repro(request))


@needs_c
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_c_decode_odd_dims_and_page(request, dtype):
    """d % 16 = 3 (the dot products' scalar tail), d_v = 50 (16-column tiles and single columns), page 16."""
    q, cache, table, seqlens = _case(dtype, 2, 3, seed=2, seqlens=(17, 0, 33, 64), page=16, d=83)
    o, lse = cmla.mla_decode(q, cache, table, seqlens, 0.3, 50)
    o_ref, lse_ref = golden.decode(*_f64(q, cache), table, seqlens, 0.3, 50)
    assert_close(o.astype(np.float64), o_ref, C_ATOL, C_RTOL[dtype], "mla_decode[cpu] O", _repro(request))
    assert_close(lse, lse_ref, C_LSE, 0.0, "mla_decode[cpu] LSE", _repro(request))


@needs_c
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_c_bits_equal_attention_decode_paged(dtype):
    q, cache, table, seqlens = _case(dtype, 2, 6, seed=3)
    o, lse = cmla.mla_decode(q, cache, table, seqlens, 0.07, D_V)
    o_ref, lse_ref = cattention.decode_paged(q, cache, cache[..., :D_V], table, seqlens, scale=0.07)
    assert np.array_equal(o.view(np.uint8), o_ref.view(np.uint8)), "mla_decode O bits != attention.decode_paged"
    assert np.array_equal(lse.view(np.uint32), lse_ref.view(np.uint32)), "mla_decode LSE bits != attention"


@needs_c
def test_c_bits_independent_of_threads_and_isa():
    """140 rows per request: over ITEM_ROWS, so a request is split in row chunks, more with threads."""
    q, cache, table, seqlens = _case("bf16", 2, 70, seed=4, seqlens=(100, 1, 0))
    lib = cmla._kernels()
    want = cmla.mla_decode(q, cache, table, seqlens, 0.05, D_V)
    try:
        for cap in (0, 1, 2):
            lib.kp_set_isa_cap(cap)
            for threads in (1, 2, 7):
                o, lse = cmla.mla_decode(q, cache, table, seqlens, 0.05, D_V, threads=threads)
                assert np.array_equal(o.view(np.uint16), want[0].view(np.uint16)), f"O bits: isa cap {cap}, {threads} threads"
                assert np.array_equal(lse.view(np.uint32), want[1].view(np.uint32)), f"LSE bits: isa cap {cap}, {threads} threads"
    finally:
        lib.kp_set_isa_cap(2)


@needs_c
def test_c_out_buffers_and_strided_inputs():
    q, cache, table, seqlens = _case("f32", 2, 4, seed=5)
    want = cmla.mla_decode(q, cache, table, seqlens, 0.1, D_V)
    qs = np.zeros((q.shape[0], q.shape[1], 2 * q.shape[2], D), np.float32)[:, :, ::2]  # head stride 2 d
    qs[...] = q
    out = np.zeros((q.shape[0], 2, q.shape[1], q.shape[2], D_V), np.float32)[:, 1]
    out_lse = np.zeros((q.shape[0], q.shape[1], q.shape[2]), np.float32).transpose(0, 2, 1)
    o, lse = cmla.mla_decode(qs, cache, table, seqlens, 0.1, D_V, True, out, out_lse)
    assert o is out and lse is out_lse
    assert np.array_equal(o, want[0]) and np.array_equal(lse, want[1])


def _bad_inputs():
    q, cache, table, seqlens = _case("f32", 1, 2, seed=6, seqlens=(65, 3))
    bf = cache.astype(ml_dtypes.bfloat16)
    three_heads = np.concatenate([cache, cache, cache], axis=2)  # h_kv = 3 does not divide h_q = 2
    far = table.copy()
    far[0, 1] = cache.shape[0]  # a used page past the cache
    return {
        "kv head": ((q, three_heads, table, seqlens, 0.1), "h_kv = 3 latent kv heads must divide h_q = 2"),
        "dims": ((q[..., :500], cache, table, seqlens, 0.1, 400), "head dim 576 must equal q's d = 500"),
        "dtype": ((q, bf, table, seqlens, 0.1), "kv_cache dtype must be one of float32"),
        "d_v": ((q, cache, table, seqlens, 0.1, 577), r"d_v must be an int in \[1, d = 576\]"),
        "scale": ((q, cache, table, seqlens, float("nan")), "scale must be a finite number"),
        "causal": ((q, cache, table, seqlens, 0.1, 512, "bottom_right"), "causal must be a bool"),
        "seqlens": ((q, cache, table, np.array([65, 200], np.int32), 0.1), r"seqlens must lie in \[0, 192\]"),
        "seqlens dtype": ((q, cache, table, seqlens.astype(np.int64), 0.1), "seqlens dtype must be one of int32"),
        "table": ((q, cache, far, seqlens, 0.1), r"block_table\[0, 1\] = \d+ must lie in \[0, "),
        "stride": ((np.asfortranarray(q), cache, table, seqlens, 0.1), "last-axis stride must be 1"),
        "out": ((q, cache, table, seqlens, 0.1, 512, True, np.empty((2, 1, 2, 511), np.float32)),
                r"out must have shape \(2, 1, 2, 512\)"),
    }


@needs_c
@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_c_rejects_bad_inputs(name):
    args, match = _bad_inputs()[name]
    with pytest.raises(ValueError, match=match):
        cmla.mla_decode(*args)


# ---- torch: kernels/torch/mla.py -------------------------------------------------------------


@pytest.mark.parametrize("s_q,causal,h_q", SHAPES[:2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_decode(request, dtype, s_q, causal, h_q):
    q, cache, table, seqlens = _case(dtype, s_q, h_q, seed=7)
    o, lse = tmla.decode(_t(q, dtype), _t(cache, dtype), _t(table, dtype), _t(seqlens, dtype), D**-0.5, D_V, causal)
    o_ref, lse_ref = golden.decode(*_f64(q, cache), table, seqlens, D**-0.5, D_V, causal)
    assert o.dtype == DTYPES[dtype][1] and lse.dtype == torch.float32
    assert_close(o.double().numpy(), o_ref, TORCH_ATOL[dtype], 0.0, "mla.decode[torch] O", _repro(request))
    assert_close(lse.double().numpy(), lse_ref, TORCH_LSE, 0.0, "mla.decode[torch] LSE", _repro(request))


def _sparse_case(dtype: str, seed: int):
    """Indices over every owned row and some NaN ones (never used), -1 padding, duplicates, topk_length
    0 / 1 / partial / full."""
    q, cache, table, seqlens = _case(dtype, 2, 4, seed=seed)
    rng = np.random.default_rng(seed)
    live = np.flatnonzero(np.isfinite(cache.astype(np.float32)).all(axis=(2, 3)).reshape(-1))
    idx = rng.choice(live, size=(len(seqlens), 2, 40)).astype(np.int32)
    idx[:, :, ::7] = -1  # padding inside the list
    idx[3, 0, 5] = idx[3, 0, 6]  # a slot listed twice
    topk = np.array([40, 0, 1, 17, 40, 3], np.int32)  # request 1: every row empty
    dead = np.flatnonzero(~np.isfinite(cache.astype(np.float32)).all(axis=(2, 3)).reshape(-1))
    idx[2, :, 0] = live[0]
    idx[2, :, 1:] = dead[:39]  # past topk_length: NaN rows, never read
    return q, cache, idx, topk


@pytest.mark.parametrize("sink", [None, "sink"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_decode_sparse(request, dtype, sink):
    q, cache, idx, topk = _sparse_case(dtype, seed=8)
    sinks = np.array([0.5, -1.0, np.inf, 2.0], np.float32) if sink else None  # +inf: O = 0; exact in every dtype
    o, lse = tmla.decode_sparse(_t(q, dtype), _t(cache, dtype), _t(idx, dtype), _t(topk, dtype), 0.05, D_V,
                                attn_sink=None if sinks is None else torch.from_numpy(sinks))
    o_ref, lse_ref = golden.decode_sparse(*_f64(q, cache), idx, topk, 0.05, D_V, attn_sink=sinks)
    assert_close(o.double().numpy(), o_ref, TORCH_ATOL[dtype], 0.0, "mla.decode_sparse[torch] O", _repro(request))
    assert_close(lse.double().numpy(), lse_ref, TORCH_LSE, 0.0, "mla.decode_sparse[torch] LSE", _repro(request))


def _fused_case(dtype: str, seed: int):
    """MAX's shapes scaled down in heads: 4 requests with 1-3 new tokens after 5, 70, 0, 64 cached."""
    rng = np.random.default_rng(seed)
    h, d_c, d_r, dn, dv = 4, 512, 64, 128, 128
    cache_lengths, n = np.array([5, 70, 0, 64], np.int32), np.array([1, 2, 1, 3])
    cache, table = _paged(rng, cache_lengths + n, DTYPES[dtype][0])
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    ang = np.arange(200)[:, None] * 10000.0 ** (-np.arange(0, d_r, 2) / d_r)
    freqs = np.stack([np.cos(ang), np.sin(ang)], -1).reshape(200, d_r).astype(np.float32)

    def weights(rows, cols):
        q_s = [qf.fp8_quantize_blocks(rng.standard_normal((rows, cols)) * 0.05, 128, 128) for _ in range(h)]
        return np.stack([a for a, _ in q_s]), np.stack([s for _, s in q_s])

    (w_uk, s_uk), (w_uv, s_uv) = weights(d_c, dn), weights(dv, d_c)
    q = rng.standard_normal((off[-1], h, dn + d_r), dtype=np.float32).astype(DTYPES[dtype][0])
    gamma = (1 + 0.1 * rng.standard_normal(d_c)).astype(DTYPES[dtype][0])
    return dict(q=q, input_row_offsets=off, freqs_cis=freqs, gamma=gamma, epsilon=1e-6, w_uk=w_uk, w_uk_scale=s_uk,
                w_uv=w_uv, w_uv_scale=s_uv, kv_cache=cache[:, :, 0], block_table=table, cache_lengths=cache_lengths,
                scale=192**-0.5)


def _fused_torch_args(kw: dict, dtype: str) -> dict:
    out = {}
    for k, v in kw.items():
        if isinstance(v, np.ndarray) and "float8" in v.dtype.name:
            out[k] = torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn)
        elif isinstance(v, np.ndarray) and k in ("q", "kv_cache", "gamma"):
            out[k] = _t(v, dtype)
        elif isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("sink", [None, "sink"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_decode_fused_fp8(request, dtype, sink):
    kw = _fused_case(dtype, seed=9)
    sinks = np.array([0.3, -2.0, 1.0, 0.0], np.float32) if sink else None  # exact in every dtype
    targs = _fused_torch_args(kw, dtype)
    out, after = tmla.decode_fused_fp8(**targs, attn_sink=None if sinks is None else torch.from_numpy(sinks))
    out_ref, after_ref = golden.decode_fused_fp8(**{k: _f64(v)[0] if isinstance(v, np.ndarray) and "float8" not in
                                                     v.dtype.name else v for k, v in kw.items()}, attn_sink=sinks)
    assert out.dtype == DTYPES[dtype][1] and after.shape == kw["kv_cache"].shape
    assert_close(after.double().numpy(), after_ref, FUSED_CACHE_ATOL[dtype], 0.0, "decode_fused_fp8[torch] cache",
                 _repro(request))
    assert_close(out.double().numpy(), out_ref, FUSED_ATOL[dtype], 0.0, "decode_fused_fp8[torch] out", _repro(request))
    assert torch.equal(targs["kv_cache"].nan_to_num(), _t(kw["kv_cache"], dtype).nan_to_num()), "input cache changed"


def test_torch_decode_fused_fp8_inplace_writes_the_cache():
    kw = _fused_torch_args(_fused_case("bf16", seed=10), "bf16")
    out, after = tmla.decode_fused_fp8(**{**kw, "kv_cache": kw["kv_cache"].clone()})
    cache = kw["kv_cache"].clone()
    out2, after2 = tmla.decode_fused_fp8(**{**kw, "kv_cache": cache}, inplace=True)
    assert after2 is not None and after2.data_ptr() == cache.data_ptr()
    assert torch.equal(out, out2) and torch.equal(after.nan_to_num(), cache.nan_to_num())
