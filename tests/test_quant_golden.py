"""Self-tests of the GGML block-format goldens (refimpl/quant.py) against gguf-py and libggml.

- gguf-py (NumPy, float32): dequantize bit for bit for every format it has (all but q8_1, whose
  gguf size is an old 40-byte layout, and q8_k), on quantized data and on random bytes with NaN,
  inf and subnormal fp16 scales; quantize byte for byte for q4_0 q4_1 q5_0 q5_1 q8_0.
- libggml (ctypes, conformance/backends/libggml.py, found through KERNEL_PARITY_LIBGGML; skipped
  with the reason otherwise): every format's `quantize_row_*_ref` and `ggml_quantize_chunk`,
  `dequantize_row_*`, the x86 activation quantizers, and `vec_dot` against an integer dot product
  written on `block_fields`.
- Properties: `block_fields` reproduce `dequantize`; round trips stay within the format's step.
Rows: random normal, zero, integer, exact ties, scaled 1e-6 and 1e4, heavy-tailed, constant,
half-zero, one-signed, a quarter grid. Fixed seeds.
Repro: KERNEL_PARITY_LIBGGML=<ggml build> pytest tests/test_quant_golden.py -k <format>
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance.backends import libggml
from kernel_parity.refimpl import quant
from kernel_parity.refimpl import quant_kquants as kq

ALL = list(quant.FORMATS)
GGUF = [f for f in ALL if f not in ("q8_1", "q8_k")]  # gguf-py has no NumPy codec for these two
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]  # gguf-py quantizes these
WEIGHTS = [f for f, F in quant.FORMATS.items() if F.vec_dot is not None]
# byte offsets of the fp16 scale fields (q8_k: its float32 d at 0 is handled apart)
SCALE_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
                "q8_1": (0, 2), "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
                "q6_k": (208,), "iq4_nl": (0,)}
SPECIAL_F16 = (0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x0001, 0x8001, 0x7BFF, 0x0000)
SPECIAL_F32 = (0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x7F7FFFFF, 0x80000000)
FP16_SLACK = 2.0 ** -10  # twice fp16's relative rounding: the legacy codes use the unrounded d


def rows(k: int = 1024, seed: int = 0) -> np.ndarray:
    """(12, k) float32 test rows, each a case the quantizers treat specially."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, k)).astype(np.float32)
    x[1] = 0.0
    x[2] = rng.integers(-8, 8, k)
    x[3] = np.tile(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 1.0, -1.0], np.float32), k // 8)
    x[4] *= 1e-6  # fp16 subnormal scales
    x[5] *= 1e4
    x[6] = rng.standard_t(1.5, k)
    x[7], x[8] = 3.0, -3.0  # flat sub-blocks in the K-quant searches
    x[9, : k // 2] = 0.0  # zero sub-blocks beside live ones
    x[10] = np.abs(x[10])
    x[11] = np.round(x[11] * 4) / 4
    return x


def random_blocks(fmt: str, nblocks: int = 64, seed: int = 1) -> np.ndarray:
    """(nblocks * nbytes,) random bytes; the first blocks get NaN/inf/subnormal/max scales."""
    f = quant.FORMATS[fmt]
    b = np.random.default_rng(seed).integers(0, 256, (nblocks, f.nbytes), dtype=np.uint8)
    if fmt == "q8_k":
        b[: len(SPECIAL_F32)].view("<u4")[:, 0] = SPECIAL_F32
    else:
        for i, off in enumerate(SCALE_FIELDS[fmt]):
            rows_ = slice(i * len(SPECIAL_F16), (i + 1) * len(SPECIAL_F16))
            b[rows_, off:off + 2] = np.array(SPECIAL_F16, "<u2").view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def assert_same_f32(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit-identical float32, NaN compared as positions."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(got) | np.isnan(want)
    bad = (np.isnan(got) != np.isnan(want)) | (~nan & (got.view(np.uint32) != want.view(np.uint32)))
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{name}: {bad.sum()}/{bad.size} values differ; first at {tuple(i)}: "
                             f"{got[tuple(i)]!r} vs {want[tuple(i)]!r}")


def assert_same_bytes(name: str, fmt: str, got: np.ndarray, want: np.ndarray) -> None:
    nbytes = quant.FORMATS[fmt].nbytes
    bad = (got != want).reshape(*got.shape[:-1], -1, nbytes)
    if bad.any():
        blk = np.argwhere(bad.any(-1))[0]
        raise AssertionError(f"{name}: {bad.sum()} bytes in {bad.any(-1).sum()} blocks differ; first block "
                             f"{tuple(blk)}: {got.reshape(bad.shape)[tuple(blk)].tolist()} vs "
                             f"{want.reshape(bad.shape)[tuple(blk)].tolist()}")


@pytest.fixture(scope="module")
def gguf():
    mod = pytest.importorskip("gguf")
    return mod


@pytest.fixture(scope="module")
def ggml():
    why = libggml.available()
    if why:
        pytest.skip(f"libggml unavailable: {why}")
    return libggml


def gguf_dequantize(gguf, fmt: str, data: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt.upper()])


# ---- the table and the errors --------------------------------------------------------------------


def test_format_table():
    assert ALL == ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k", "q4_k", "q5_k",
                   "q6_k", "q8_k", "iq4_nl"]
    assert {f: F.vec_dot for f, F in quant.FORMATS.items()} == {
        "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1",
        "q5_1": "q8_1", "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k",
        "q6_k": "q8_k", "q8_1": None, "q8_k": None}
    assert all(kq.NBYTES[f] == F.nbytes for f, F in quant.FORMATS.items() if F.block == 256)


def test_errors_name_the_format_and_the_multiple():
    with pytest.raises(ValueError, match="unknown quant format 'q4_2'; known formats: q4_0, q4_1"):
        quant.quantize("q4_2", np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="q4_k: K = 300 is not a multiple of the block size 256"):
        quant.quantize("q4_k", np.zeros((2, 300), np.float32))
    with pytest.raises(ValueError, match="q8_0: byte length 35 is not a multiple of 34"):
        quant.dequantize("q8_0", np.zeros(35, np.uint8))
    with pytest.raises(ValueError, match="q8_0: data must be uint8"):
        quant.block_fields("q8_0", np.zeros(34, np.int8))


@pytest.mark.parametrize("fmt", ALL)
def test_shapes(fmt):
    f = quant.FORMATS[fmt]
    x = rows(2 * 256)[:6].reshape(2, 3, -1)
    q = quant.quantize(fmt, x)
    assert q.shape == (2, 3, 512 // f.block * f.nbytes) and q.dtype == np.uint8
    assert quant.dequantize(fmt, q).shape == x.shape
    assert np.array_equal(q[1, 2], quant.quantize(fmt, x[1, 2]))  # rows are independent
    assert quant.quantize(fmt, np.zeros((0, 256), np.float32)).shape == (0, 256 // f.block * f.nbytes)
    assert quant.dequantize(fmt, np.zeros((4, 0), np.uint8)).shape == (4, 0)


# ---- against gguf-py -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", GGUF)
def test_dequantize_matches_gguf_on_quantized_rows(gguf, fmt):
    q = quant.quantize(fmt, rows())
    assert_same_f32(f"dequantize {fmt} vs gguf", quant.dequantize(fmt, q), gguf_dequantize(gguf, fmt, q))


@pytest.mark.parametrize("fmt", GGUF)
def test_dequantize_matches_gguf_on_random_bytes(gguf, fmt):
    b = random_blocks(fmt)
    y = quant.dequantize(fmt, b)
    assert np.isnan(y).any() and np.isinf(y).any()  # the special scales reached the output
    assert_same_f32(f"dequantize {fmt} random bytes vs gguf", y, gguf_dequantize(gguf, fmt, b))


@pytest.mark.parametrize("fmt", LEGACY)
def test_quantize_matches_gguf(gguf, fmt):
    x = rows()
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt.upper()])
    assert_same_bytes(f"quantize {fmt} vs gguf", fmt, quant.quantize(fmt, x), want)


# ---- properties ----------------------------------------------------------------------------------


def from_fields(fl: quant.BlockFields) -> np.ndarray:
    """The module docstring's dequantization formula on BlockFields, float64."""
    c = fl.codes.astype(np.float64)
    if fl.scales is None:
        y = fl.d[..., None] * c
        return y + fl.m[..., None] if fl.m is not None else y
    nsub = fl.scales.shape[-1]
    c = c.reshape(*c.shape[:-1], nsub, -1)
    y = (fl.d[..., None] * fl.scales)[..., None] * c
    if fl.mins is not None:
        y = y - (fl.dmin[..., None] * fl.mins)[..., None]
    return y.reshape(*y.shape[:-2], -1)


@pytest.mark.parametrize("fmt", ALL)
def test_block_fields_give_dequantize(fmt):
    for data in (quant.quantize(fmt, rows()), random_blocks(fmt)):
        with np.errstate(all="ignore"):
            want = quant.dequantize(fmt, data).reshape(-1)
            got = from_fields(quant.block_fields(fmt, data)).reshape(-1)
        assert np.array_equal(got, want, equal_nan=True), fmt
    x = rows()
    fl = quant.block_fields(fmt, quant.quantize(fmt, x))
    if fmt == "q8_k":
        assert np.array_equal(fl.bsums, fl.codes.reshape(*fl.codes.shape[:-1], 16, 16).sum(-1))
    if fmt == "q8_1":  # s = fp16(sum(q) * d) with the float32 d = amax / 127, before its fp16 rounding
        d32 = np.abs(x).reshape(*fl.d.shape, 32).max(-1) / np.float32(127)
        with np.errstate(over="ignore"):  # the 1e4 row's s overflows fp16 to inf, in ggml too
            s = (fl.codes.sum(-1).astype(np.float32) * d32).astype(np.float16)
        assert np.array_equal(fl.s, s.astype(np.float64))


@pytest.mark.parametrize("fmt", ALL)
def test_round_trip_within_the_step(fmt):
    """|dequantize(quantize(x)) - x| <= factor * step (+ the fp16 rounding of the scales).
    step = |d| for the 32-element formats (q4_0/q5_0: a full step at the clamped top code, else
    half); |d| * max_j |sc_j| for the K-quants (sub-block scales are searched, not nearest);
    iq4_nl: the table's largest gap is 24/127 of max|x|, and d is refitted after the choice.
    The 1e-6 row is left out: its fp16 scales are subnormal, with few significant bits."""
    x = np.delete(rows(), 4, axis=0)
    f = quant.FORMATS[fmt]
    q = quant.quantize(fmt, x)
    err = np.abs(quant.dequantize(fmt, q) - x).reshape(x.shape[0], -1, f.block)
    fl = quant.block_fields(fmt, q)
    if fmt == "iq4_nl":
        bound = 0.15 * np.abs(x).reshape(err.shape).max(-1, keepdims=True)
    elif fl.scales is not None:  # plus the min's grid step and its fp16 rounding (q2/q4/q5_k)
        bound = (np.abs(fl.d) * np.abs(fl.scales).max(-1))[..., None]
        if fl.mins is not None:
            bound = bound + (np.abs(fl.dmin) * (1 + FP16_SLACK * fl.mins.max(-1)))[..., None]
    else:
        factor = 1.0 if fmt in ("q4_0", "q5_0") else 0.5
        m = np.abs(fl.m[..., None]) if fl.m is not None else 0.0
        bound = factor * np.abs(fl.d)[..., None] + FP16_SLACK * ((np.abs(fl.codes) + 1) * np.abs(fl.d)[..., None] + m)
    bad = err > bound
    assert not bad.any(), f"{fmt}: {bad.sum()} elements beyond the step, first at {tuple(np.argwhere(bad)[0])}"


# ---- against libggml -----------------------------------------------------------------------------


def unwritten_iq4_nl_codes(x: np.ndarray) -> np.ndarray:
    """(rows, nblocks, 18) mask of the bytes ggml's iq4_nl ref leaves unwritten: the codes of a
    block with max|x| < 1e-15 (d = 0)."""
    zero = np.abs(x).reshape(x.shape[0], -1, 32).max(-1) < 1e-15
    mask = np.zeros((*zero.shape, 18), bool)
    mask[zero, 2:] = True
    return mask.reshape(x.shape[0], -1)


@pytest.mark.parametrize("fmt", ALL)
def test_quantize_matches_libggml_ref(ggml, fmt):
    x = np.concatenate([rows(4096, seed=0), rows(4096, seed=1), rows(4096, seed=2)])
    got, want = quant.quantize(fmt, x), ggml.quantize_ref(fmt, x)
    if fmt == "iq4_nl":
        want = np.where(unwritten_iq4_nl_codes(x), 0, want)
    assert_same_bytes(f"quantize {fmt} vs quantize_row_{fmt}_ref", fmt, got, want)


@pytest.mark.parametrize("fmt", [f for f in ALL if f not in ("q8_1", "q8_k", "iq4_nl")])
def test_quantize_matches_ggml_quantize_chunk(ggml, fmt):
    """What llama-quantize writes without an imatrix (iq4_nl: the chunk path searches 7 more scales)."""
    x = rows()
    assert_same_bytes(f"quantize {fmt} vs ggml_quantize_chunk", fmt, quant.quantize(fmt, x), ggml.quantize(fmt, x))


@pytest.mark.parametrize("fmt", [f for f in ALL if f != "q8_1"])  # ggml has no dequantize_row_q8_1
def test_dequantize_matches_libggml(ggml, fmt):
    for data in (quant.quantize(fmt, rows()), random_blocks(fmt)):
        with np.errstate(all="ignore"):
            assert_same_f32(f"dequantize {fmt} vs dequantize_row_{fmt}", quant.dequantize(fmt, data),
                            ggml.dequantize(fmt, data))


@pytest.mark.parametrize("fmt", ["q8_0", "q8_1", "q8_k"])
def test_quantize_x86_matches_the_cpu_from_float(ggml, fmt):
    x = rows()
    assert_same_bytes(f"quantize_x86 {fmt} vs CPU from_float", fmt, quant.quantize_x86(fmt, x),
                      ggml.quantize_cpu(fmt, x))


@pytest.mark.parametrize("fmt", WEIGHTS)
def test_integer_dot_on_block_fields_matches_vec_dot(ggml, fmt):
    """sum_b d_w d_a (integer block dot) in float64 vs ggml's vec_dot, which differs only by
    float32 rounding: a handful of roundings per block (scale products, sub-block sums, the running
    sums; a K-quant block's scale and min parts are accumulated apart), each <= 2^-24 relative, so
    |diff| <= 16 * nblocks * 2^-24 * sum of |parts|. A wrong code, scale or bsum is off by a whole
    term (>= 1e-3 relative here)."""
    rng = np.random.default_rng(3)
    f = quant.FORMATS[fmt]
    assert ggml.vec_dot_type(fmt) == f.vec_dot  # FORMATS' pairing is the CPU backend's
    a = rng.standard_normal((3, 512)).astype(np.float32)
    w = ggml.quantize(fmt, (rng.standard_normal((5, 512)) * 0.02).astype(np.float32))
    act = quant.block_fields(f.vec_dot, ggml.quantize_cpu(f.vec_dot, a))
    wt = quant.block_fields(fmt, w)
    if f.block == 32:
        parts = [np.einsum("nbk,mbk->mnb", wt.codes, act.codes) * wt.d[None] * act.d[:, None]]
        if wt.m is not None:
            parts.append(wt.m[None] * act.s[:, None])
    else:
        nsub = wt.scales.shape[-1]
        isub = np.einsum("nbjk,mbjk->mnbj", wt.codes.reshape(5, -1, nsub, 256 // nsub),
                         act.codes.reshape(3, -1, nsub, 256 // nsub))
        parts = [(isub * wt.scales[None]).sum(-1) * wt.d[None] * act.d[:, None]]
        if wt.mins is not None:  # the bsums trick: the min term needs only 16-element code sums
            bs = act.bsums.reshape(3, -1, nsub, 16 // nsub).sum(-1)
            parts.append(-(wt.mins[None] * bs[:, None]).sum(-1) * wt.dmin[None] * act.d[:, None])
    want = sum(parts).sum(-1)  # M, N
    got = ggml.gemm_nt(fmt, a, w)
    bound = 16 * parts[0].shape[-1] * 2.0 ** -24 * sum(np.abs(p) for p in parts).sum(-1)
    assert (np.abs(got - want) <= bound).all(), f"{fmt}: max |diff| {np.abs(got - want).max():.3g}"


def test_libggml_refuses_what_ggml_lacks(ggml):
    with pytest.raises(ValueError, match="q8_k: ggml_quantize_chunk has no q8_k path"):
        ggml.quantize("q8_k", np.zeros(256, np.float32))
    with pytest.raises(ValueError, match="q8_1: libggml has no dequantize_row_q8_1"):
        ggml.dequantize("q8_1", np.zeros(36, np.uint8))
    with pytest.raises(ValueError, match="q4_k: K = 32 is not a multiple of the block size 256"):
        ggml.quantize_ref("q4_k", np.zeros(32, np.float32))


@pytest.mark.parametrize("fmt", sorted(quant.FORMATS))
def test_quantize_on_threads_writes_the_same_bytes(fmt, monkeypatch):
    """A tensor quantized in runs of blocks on several threads is byte for byte the one-call result
    (blocks are independent; NumPy's error state is set in each thread)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((29, 512)) * rng.choice([1e-4, 1.0, 300.0], (29, 1))).astype(np.float32)
    x[2] = 0.0
    x[4, :9] = 1e-30
    monkeypatch.setattr(quant, "CHUNK_BLOCKS", 1 << 30)
    whole = quant.quantize(fmt, x)
    monkeypatch.setattr(quant, "CHUNK_BLOCKS", 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert np.array_equal(quant.quantize(fmt, x), whole)
