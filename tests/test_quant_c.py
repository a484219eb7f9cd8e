"""Native CPU GGML quantizers, dequantizers and integer GEMM (kernels/cpu/quant.c, gemm.c) against
their oracles: the goldens refimpl/quant.py and refimpl/gemm.py (what CI runs), gguf-py, and libggml
(conformance/backends/libggml.py; those tests skip unless KERNEL_PARITY_LIBGGML is set).

quantize is byte-exact and dequantize bit-exact; gemm_nt is checked bit for bit against a float32
emulation of the rounding sequence gemm.c documents, against the float64 L2 emulation within the
accumulation tolerance below, and across its ISA paths.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.kernels.cpu import loader
from kernel_parity.refimpl import gemm as golden_gemm
from kernel_parity.refimpl import quant as golden

try:
    from kernel_parity.kernels.cpu import gemm as cgemm
    from kernel_parity.kernels.cpu import quant as cquant

    cquant._kernels()
    cgemm._kernels()
    _UNAVAILABLE = None
except loader.CompilerUnavailable as e:  # no compiler: every test here skips with the reason
    _UNAVAILABLE = str(e)

pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"kernels/cpu unavailable: {_UNAVAILABLE}")

FORMATS = list(golden.FORMATS)
WEIGHTS = ["f32", *golden_gemm.GGML_W]
# gguf-py 0.19 has NumPy quantizers for the legacy formats only, dequantizers for all weight formats.
GGUF_QUANTIZE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
GGUF_DEQUANTIZE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl")

# gemm_nt against the float64 L2 emulation, relative to sum_k |a_k| |w_k| (dequantized): the float32
# roundings of gemm.c's header on K <= 1056 here, at most ~20 roundings deep (5 blocks per lane plus
# the 3-level lane sum; 3 super-blocks; f32: 66 lane steps plus the sum), each <= 2^-24 of a partial
# sum bounded by that scale: 66 * 2^-24 = 4e-6. Measured: <= 6e-8.
GEMM_L2_REL = 4e-6
# libggml's vec_dot (AVX2 build) sums the same exact integer block terms with its own float32 order
# (8 lanes of partial products, FMA): both within GEMM_L2_REL of the exact sum.
GEMM_GGML_REL = 2 * GEMM_L2_REL

K_BLOCK32 = 1056  # 33 blocks of 32: four groups of 8 plus a one-block tail
K_KQUANT = 768  # 3 super-blocks


def _repro(test: str, fmt: str) -> str:
    return f"  repro: pytest tests/test_quant_c.py -k '{test} and {fmt}'"


def _inputs(k: int, seed: int) -> np.ndarray:
    """Rows that reach each branch of the reference quantizers: N(0, 1), zeros, half zeros, integer
    ties, tiny and large scales, a heavy tail, ramps, one-signed rows, sparse rows, +-0.5 ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((20, k)).astype(np.float32)
    x[1] = 0
    x[2, : k // 2] = 0
    x[3] = np.round(x[3] * 4)
    x[4] *= 1e-6
    x[5] *= 1e4
    x[6] = rng.standard_cauchy(k).astype(np.float32)
    x[7] = np.linspace(-1, 1, k, dtype=np.float32)
    x[8] = np.abs(x[8])
    x[9] = -np.abs(x[9])
    x[10, ::3] = 0
    x[11] = 0.5 * np.sign(x[11])
    x[12] = rng.integers(-8, 9, k) / 8
    x[13] *= 0.02
    x[14] = rng.uniform(-1, 1, k) + 0.7
    x[15] = rng.standard_t(3, k)
    x[16] *= rng.uniform(0, 1, k) ** 8
    x[17] = (rng.integers(-20, 20, k) / 4).astype(np.float32)
    x[18, k // 3:] = 0
    return x


def _k(fmt: str) -> int:
    return K_KQUANT if golden.FORMATS[fmt].block == 256 else K_BLOCK32


def _assert_bytes_equal(got: np.ndarray, expected: np.ndarray, fmt: str, what: str, repro: str,
                        skip_blocks: np.ndarray | None = None) -> None:
    nbytes = golden.FORMATS[fmt].nbytes
    g, e = got.reshape(-1, nbytes), expected.reshape(-1, nbytes)
    bad = (g != e).any(axis=1)
    if skip_blocks is not None:
        bad &= ~skip_blocks.reshape(-1)
    if bad.any():
        lines = [f"{what} {fmt}: {int(bad.sum())}/{bad.size} blocks differ (byte-exact expected)"]
        per_row = got.shape[-1] // nbytes
        for i in np.flatnonzero(bad)[:5]:
            j = int(np.flatnonzero(g[i] != e[i])[0])
            lines.append(f"  row {i // per_row} block {i % per_row} byte {j}: got {g[i, j]:#04x}, "
                         f"expected {e[i, j]:#04x}")
        pytest.fail("\n".join(lines + [repro]))


def _assert_bits_equal(got: np.ndarray, expected: np.ndarray, what: str, repro: str) -> None:
    """float32 arrays equal bit for bit, NaN matching NaN (payloads are not specified)."""
    g, e = got.astype(np.float32), expected.astype(np.float32)
    bad = (g.view(np.uint32) != e.view(np.uint32)) & ~(np.isnan(g) & np.isnan(e))
    if bad.any():
        lines = [f"{what}: {int(bad.sum())}/{bad.size} elements differ (bit-exact expected)"]
        for idx in list(zip(*np.nonzero(bad)))[:5]:
            lines.append(f"  {list(map(int, idx))}: got {g[idx]!r}, expected {e[idx]!r}")
        pytest.fail("\n".join(lines + [repro]))


def _assert_rel(got: np.ndarray, expected: np.ndarray, scale: np.ndarray, tol: float, what: str,
                repro: str) -> None:
    rel = np.abs(got.astype(np.float64) - expected) / scale
    if not (rel <= tol).all():
        idx = np.unravel_index(np.nanargmax(np.where(np.isnan(rel), np.inf, rel)), rel.shape)
        pytest.fail(f"{what}: max |err| / sum|a||w| = {np.nanmax(rel):.3g} > {tol:.1g}\n"
                    f"  C{list(map(int, idx))} = {got[idx]!r}, expected {expected[idx]!r}\n{repro}")


# ---- quantize / dequantize ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_golden(fmt):
    x = _inputs(_k(fmt), seed=1)
    _assert_bytes_equal(cquant.quantize(fmt, x), golden.quantize(fmt, x), fmt, "quant.quantize[cpu] vs golden",
                        _repro("test_quantize_matches_golden", fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_strided_rows_and_out(fmt):
    """A row stride > K is read as it is (no copy) and `out` rows may be strided too."""
    k = _k(fmt)
    base = _inputs(2 * k, seed=2)
    x = base[:, :k]
    nbytes = k // golden.FORMATS[fmt].block * golden.FORMATS[fmt].nbytes
    out = np.zeros((x.shape[0], nbytes + 7), np.uint8)[:, :nbytes]
    got = cquant.quantize(fmt, x, out=out)
    assert got is out
    _assert_bytes_equal(out, golden.quantize(fmt, np.ascontiguousarray(x)), fmt, "quant.quantize[cpu] strided",
                        _repro("test_quantize_strided_rows_and_out", fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_golden(fmt):
    """On quantized data and on random bytes (NaN/inf fp16 scales included)."""
    x = _inputs(_k(fmt), seed=3)
    q = golden.quantize(fmt, x)
    rnd = np.random.default_rng(4).integers(0, 256, q.shape, dtype=np.uint8)
    with np.errstate(all="ignore"):
        for data, name in ((q, "quantized"), (rnd, "random bytes")):
            _assert_bits_equal(cquant.dequantize(fmt, data), golden.dequantize(fmt, data),
                               f"quant.dequantize[cpu] {fmt} vs golden on {name}",
                               _repro("test_dequantize_matches_golden", fmt))


@pytest.mark.parametrize("fmt", GGUF_QUANTIZE)
def test_quantize_matches_gguf(fmt):
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    x = _inputs(K_BLOCK32, seed=5)
    expected = quants.quantize(x, getattr(GGMLQuantizationType, fmt.upper()))
    _assert_bytes_equal(cquant.quantize(fmt, x), expected, fmt, "quant.quantize[cpu] vs gguf-py",
                        _repro("test_quantize_matches_gguf", fmt))


@pytest.mark.parametrize("fmt", GGUF_DEQUANTIZE)
def test_dequantize_matches_gguf(fmt):
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    q = golden.quantize(fmt, _inputs(_k(fmt), seed=6))
    expected = quants.dequantize(q, getattr(GGMLQuantizationType, fmt.upper()))
    _assert_bits_equal(cquant.dequantize(fmt, q), expected, f"quant.dequantize[cpu] {fmt} vs gguf-py",
                       _repro("test_dequantize_matches_gguf", fmt))


def _libggml():
    from kernel_parity.conformance.backends import libggml

    why = libggml.available()
    if why:
        pytest.skip(f"libggml oracle: {why}")
    return libggml


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_libggml(fmt):
    """quantize_row_<fmt>_ref, with larger magnitudes than the golden test (1e30 rows included).
    iq4_nl blocks with max|x| < 1e-15 are left out: ggml writes uninitialised codes there."""
    lib = _libggml()
    x = np.concatenate([_inputs(_k(fmt), seed=7), _inputs(_k(fmt), seed=8)[:4] * np.float32(1e30)])
    got, expected = cquant.quantize(fmt, x), lib.quantize_ref(fmt, x)
    skip = None
    if fmt == "iq4_nl":
        skip = (np.abs(x).reshape(x.shape[0], -1, 32).max(axis=-1) < 1e-15)
    _assert_bytes_equal(got, expected, fmt, "quant.quantize[cpu] vs libggml _ref",
                        _repro("test_quantize_matches_libggml", fmt), skip)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "q8_1"])  # ggml has no dequantize_row_q8_1
def test_dequantize_matches_libggml(fmt):
    lib = _libggml()
    q = golden.quantize(fmt, _inputs(_k(fmt), seed=9))
    rnd = np.random.default_rng(10).integers(0, 256, q.shape, dtype=np.uint8)
    for data, name in ((q, "quantized"), (rnd, "random bytes")):
        _assert_bits_equal(cquant.dequantize(fmt, data), lib.dequantize(fmt, data),
                           f"quant.dequantize[cpu] {fmt} vs libggml on {name}",
                           _repro("test_dequantize_matches_libggml", fmt))


def test_quant_bad_input():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="'q7_0'"):
        cquant.quantize("q7_0", x)
    with pytest.raises(ValueError, match=r"q4_k: K must be a multiple of its block size 256, got K = 64"):
        cquant.quantize("q4_k", x)
    with pytest.raises(ValueError, match="dtype"):
        cquant.quantize("q4_0", x.astype(np.float64))
    with pytest.raises(ValueError, match="whole number of 18-byte blocks"):
        cquant.dequantize("q4_0", np.zeros((2, 20), np.uint8))


# ---- gemm ---------------------------------------------------------------------------------------------


def _gemm_case(wfmt: str, m: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = K_KQUANT if wfmt.endswith("_k") else K_BLOCK32
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[0, : k // 3] = 0  # a row with zero blocks (d = 0)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    w[-1, 40:300] *= 50  # a row with outliers
    bias = rng.standard_normal(n).astype(np.float32)
    return a, (w if wfmt == "f32" else golden.quantize(wfmt, w)), bias


def _emulate_float32(a: np.ndarray, wfmt: str, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """gemm.c's documented rounding sequence in NumPy float32 (integer block sums from the golden's
    block fields): what gemm_nt must equal bit for bit."""
    f32 = np.float32
    if wfmt == "f32":
        p = a[:, None, :] * w[None, :, :]  # M, N, K: one rounding per product
        k = a.shape[1]
        kv = k - k % 16
        lanes = np.zeros(p.shape[:2] + (16,), f32)
        for i in range(0, kv, 16):
            lanes = lanes + p[:, :, i:i + 16]
        h = lanes[..., :8] + lanes[..., 8:]
        h = h[..., :4] + h[..., 4:]
        h = h[..., :2] + h[..., 2:]
        c = h[..., 0] + h[..., 1]
        for i in range(kv, k):
            c = c + p[:, :, i]
    else:
        act = cgemm.act_format(wfmt)
        fa = golden.block_fields(act, cquant.quantize(act, a))  # M, nb
        fw = golden.block_fields(wfmt, w)  # N, nb
        da = fa.d.astype(f32)[:, None, :]  # M, 1, nb
        dw = fw.d.astype(f32)[None, :, :]  # 1, N, nb
        nb = fa.codes.shape[1]
        if fw.scales is None:
            isum = np.einsum("mbi,nbi->mnb", fa.codes, fw.codes)
            blk = (dw * da) * isum.astype(f32)
            if fw.m is not None:
                blk = blk + fw.m.astype(f32)[None] * fa.s.astype(f32)[:, None]
            lanes = np.zeros(blk.shape[:2] + (8,), f32)
            for b in range(nb):
                lanes[..., b % 8] = lanes[..., b % 8] + blk[..., b]
            c = ((lanes[..., 0] + lanes[..., 4]) + (lanes[..., 2] + lanes[..., 6])) + (
                (lanes[..., 1] + lanes[..., 5]) + (lanes[..., 3] + lanes[..., 7]))
        else:
            nsub = fw.scales.shape[-1]
            ca = fa.codes.reshape(*fa.codes.shape[:2], nsub, -1)
            cw = fw.codes.reshape(*fw.codes.shape[:2], nsub, -1)
            isum = np.einsum("mbsi,nbsi,nbs->mnb", ca, cw, fw.scales)
            blk = (dw * da) * isum.astype(f32)
            if fw.mins is not None:
                bsums = fa.bsums.reshape(*fa.bsums.shape[:2], nsub, -1).sum(-1)
                msum = np.einsum("mbs,nbs->mnb", bsums, fw.mins)
                blk = blk - (fw.dmin.astype(f32)[None] * da) * msum.astype(f32)
            c = np.zeros(blk.shape[:2], f32)
            for b in range(nb):
                c = c + blk[..., b]
    return c if bias is None else c + bias


def _scale(a: np.ndarray, wfmt: str, w: np.ndarray) -> np.ndarray:
    """sum_k |a_k| |w_k| with the dequantized weight: the scale of each C element's error."""
    wd = golden_gemm.dequantize_weight(wfmt, {"w": w}, a.shape[1])
    return np.abs(a.astype(np.float64)) @ np.abs(wd).T


@pytest.mark.parametrize("wfmt", WEIGHTS)
def test_gemm_equals_float32_formula(wfmt):
    """Bit for bit the float32 rounding sequence of gemm.c's header; M = 5 and N = 19 exercise the
    2 x 4 tile, the 8 x 1 tile of the leftover row and the partial tiles at the N edge."""
    a, w, bias = _gemm_case(wfmt, 5, 19, seed=11)
    for b in (None, bias):
        _assert_bits_equal(cgemm.gemm_nt(a, wfmt, w, b), _emulate_float32(a, wfmt, w, b),
                           f"gemm.gemm_nt[cpu] {wfmt} vs its float32 formula (bias={b is not None})",
                           _repro("test_gemm_equals_float32_formula", wfmt))


@pytest.mark.parametrize("wfmt", WEIGHTS)
def test_gemm_close_to_golden_l2(wfmt):
    a, w, bias = _gemm_case(wfmt, 4, 9, seed=12)
    expected = golden_gemm.emulated_reference(a, wfmt, {"w": w}, bias)
    _assert_rel(cgemm.gemm_nt(a, wfmt, w, bias), expected, _scale(a, wfmt, w), GEMM_L2_REL,
                f"gemm.gemm_nt[cpu] {wfmt} vs golden L2 (emulated)", _repro("test_gemm_close_to_golden_l2", wfmt))


@pytest.mark.parametrize("wfmt", WEIGHTS)
def test_gemm_isa_paths_identical(wfmt):
    """Every SIMD path this machine has (AVX-512 VNNI, AVX2, scalar) gives the same bits."""
    a, w, _ = _gemm_case(wfmt, 6, 17, seed=13)
    top = cgemm.isa()
    try:
        results = {}
        for cap in range(top, -1, -1):
            assert cgemm.isa(cap) == cap
            results[cap] = cgemm.gemm_nt(a, wfmt, w)
    finally:
        cgemm.isa(2)
    for cap, got in results.items():
        _assert_bits_equal(got, results[top], f"gemm.gemm_nt[cpu] {wfmt} isa {cap} vs isa {top}",
                           _repro("test_gemm_isa_paths_identical", wfmt))


@pytest.mark.parametrize("wfmt", ["f32", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_gemm_rows_independent(wfmt):
    """A row's result does not depend on M, on which tile computed it, or on a row stride > K."""
    a, w, bias = _gemm_case(wfmt, 9, 11, seed=14)
    full = cgemm.gemm_nt(a, wfmt, w, bias)
    padded = np.zeros((a.shape[0], a.shape[1] + 32), np.float32)
    padded[:, :a.shape[1]] = a
    out = np.full((a.shape[0], 16), np.nan, np.float32)[:, :11]
    cgemm.gemm_nt(padded[:, :a.shape[1]], wfmt, w, bias, out=out)
    _assert_bits_equal(out, full, f"gemm.gemm_nt[cpu] {wfmt} strided vs contiguous",
                       _repro("test_gemm_rows_independent", wfmt))
    for m in (0, 4, 8):
        _assert_bits_equal(cgemm.gemm_nt(a[m:m + 1], wfmt, w, bias)[0], full[m],
                           f"gemm.gemm_nt[cpu] {wfmt} row {m} alone vs in M = 9",
                           _repro("test_gemm_rows_independent", wfmt))


@pytest.mark.parametrize("wfmt", golden_gemm.GGML_W)
def test_gemm_close_to_libggml_vec_dot(wfmt):
    """ggml's own vec_dot on the same reference-quantized activations (the CPU backend's x86
    from_float rounds differently, so its mul_mat is not the reference here)."""
    lib = _libggml()
    import ctypes

    a, w, _ = _gemm_case(wfmt, 3, 7, seed=15)
    act = cgemm.act_format(wfmt)
    aq = lib.quantize_ref(act, a)
    cpu = lib._libs()[1]  # the ggml-cpu library the oracle loaded (initialised)
    pair = f"{lib._c_name(wfmt)}_{lib._c_name(act)}"
    fn = getattr(cpu, f"ggml_vec_dot_{pair}")
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    expected = np.empty((a.shape[0], w.shape[0]), np.float32)
    s = np.zeros(1, np.float32)
    for i in range(a.shape[0]):
        for j in range(w.shape[0]):
            fn(a.shape[1], s.ctypes.data, 0, w[j].ctypes.data, 0, aq[i].ctypes.data, 0, 1)
            expected[i, j] = s[0]
    _assert_rel(cgemm.gemm_nt(a, wfmt, w), expected.astype(np.float64), _scale(a, wfmt, w), GEMM_GGML_REL,
                f"gemm.gemm_nt[cpu] {wfmt} vs libggml ggml_vec_dot_{pair}",
                _repro("test_gemm_close_to_libggml_vec_dot", wfmt))


def test_gemm_bad_input():
    a = np.zeros((2, 288), np.float32)
    w4k = np.zeros((3, 144), np.uint8)
    with pytest.raises(ValueError, match=r"gemm_nt q4_k: K must be a multiple of 256 for a K-quant, got K = 288"):
        cgemm.gemm_nt(a, "q4_k", w4k)
    with pytest.raises(ValueError, match=r"gemm_nt q4_0: K must be a multiple of 32 for a 32-block format, got K = 48"):
        cgemm.gemm_nt(np.zeros((2, 48), np.float32), "q4_0", np.zeros((3, 27), np.uint8))
    for fmt in ("q7_0", "q8_k", "q8_1", "bf16"):
        with pytest.raises(ValueError, match=f"unsupported weight format '{fmt}'"):
            cgemm.gemm_nt(a, fmt, w4k)
    with pytest.raises(ValueError, match=r"gemm_nt q4_0: w must be \(N, 162\) uint8 for K = 288"):
        cgemm.gemm_nt(a, "q4_0", np.zeros((3, 160), np.uint8))
    with pytest.raises(ValueError, match=r"bias must be \(N,\) = \(3,\)"):
        cgemm.gemm_nt(a, "f32", np.zeros((3, 288), np.float32), bias=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="gemm_nt f32: w must be"):
        cgemm.gemm_nt(a, "f32", np.zeros((3, 256), np.float32))


def test_gemm_empty():
    w = golden.quantize("q8_0", np.ones((3, 64), np.float32))
    assert cgemm.gemm_nt(np.zeros((0, 64), np.float32), "q8_0", w).shape == (0, 3)
    bias = np.arange(3, dtype=np.float32)
    got = cgemm.gemm_nt(np.zeros((2, 0), np.float32), "q8_0", np.zeros((3, 0), np.uint8), bias)
    assert np.array_equal(got, np.broadcast_to(bias, (2, 3)))
