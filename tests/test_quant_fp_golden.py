"""Self-tests of refimpl/quant_fp.py (FP8, DeepSeek block scaling, int4, MXFP4, NVFP4) and of the
torch baselines of kernels/torch/quant.py against it."""

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import quant_fp as qf

torch = pytest.importorskip("torch")
from kernel_parity.kernels.torch import quant as tq  # noqa: E402

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Edges: the e4m3fn tie 464 (-> 448), the first values past it, 480 (torch's NaN threshold), the
# e5m2 edges 61439 / 61440, subnormal ties, infinities, NaN of both signs, zeros.
EDGES = np.array([0.0, -0.0, 448, 449, 464, 464.00003, 465, 479.99997, 480, 481, -464, -465, 1e9, -1e9,
                  57344, 61439, 61440, 61441, 1e30, np.inf, -np.inf, np.nan, -np.nan,
                  2.0**-10, 1.5 * 2.0**-10, 2.0**-17, 3 * 2.0**-17, 1.0625, 1.1875], dtype=np.float32)


def _sweep(rng: np.random.Generator) -> np.ndarray:
    """Random float32 across 1e-12 .. 1e6 of both signs, plus EDGES."""
    x = rng.standard_normal(20000) * 10.0 ** rng.uniform(-12, 6, 20000)
    return np.concatenate([x.astype(np.float32), EDGES])


def _bits_equal_nan_by_class(golden: np.ndarray, got: np.ndarray, fmt: str) -> None:
    g, t = golden.view(np.uint8), got.view(np.uint8)
    gn, tn = np.isnan(golden.astype(np.float32)), np.isnan(got.astype(np.float32))
    assert (gn == tn).all(), f"fp8 {fmt}: NaN class differs at {np.flatnonzero(gn != tn)[:5]}"
    bad = (g != t) & ~gn
    assert not bad.any(), f"fp8 {fmt}: {bad.sum()} codes differ, first at {np.flatnonzero(bad)[:5]}"


def _torch_cast_saturates(fmt: str, device: str) -> bool:
    """torch <= 2.11 casts e4m3fn overflow to NaN; pytorch/pytorch#178817 made it saturate."""
    big = torch.tensor([1e6], device=device)  # past both formats' max
    return bool(torch.isfinite(big.to(TORCH_FP8[fmt]).float()).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [False, True])
def test_fp8_encode_matches_torch_bit_for_bit(fmt, saturate, device):
    x = _sweep(np.random.default_rng(1))
    got = tq.fp8_encode(torch.from_numpy(x).to(device), fmt, saturate)  # clamp + cast, or the native cast
    if not saturate:
        saturate = _torch_cast_saturates(fmt, device)  # the golden mode this torch's native cast is
    golden = qf.fp8_encode(x, fmt, saturate)
    _bits_equal_nan_by_class(golden, got.cpu().view(torch.uint8).numpy().view(qf.FP8[fmt]), fmt)
    assert (golden.view(np.uint8)[np.isnan(x)] & 0x7F == 0x7F).all()


def test_fp8_encode_edges_by_hand():
    e4 = qf.fp8_encode(np.array([464, 465, 480, -1e9, np.inf, 2.0**-10, 1.5 * 2.0**-10], np.float32), "e4m3")
    assert e4.view(np.uint8).tolist() == [0x7E, 0x7F, 0x7F, 0xFF, 0x7F, 0x00, 0x01]
    e4s = qf.fp8_encode(np.array([465, -480, np.inf, -np.inf, np.nan], np.float32), "e4m3", saturate=True)
    assert e4s.view(np.uint8).tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F]
    e5 = qf.fp8_encode(np.array([61439, 61440, -np.inf, np.nan], np.float32), "e5m2")
    assert e5.view(np.uint8).tolist() == [0x7B, 0x7C, 0xFC, 0x7F]
    assert qf.fp8_encode(np.array([1e9], np.float32), "e5m2", saturate=True).view(np.uint8)[0] == 0x7B
    # float64 input is rounded to float32 first: 1.0625 + 2^-40 -> 1.0625 -> tie -> 1.0 (RNE)
    assert qf.fp8_decode(qf.fp8_encode(np.array([1.0625 + 2.0**-40]), "e4m3"))[0] == 1.0


def test_fp8_decode_all_codes_exact():
    codes = np.arange(256, dtype=np.uint8)
    for fmt, td in TORCH_FP8.items():
        golden = qf.fp8_decode(codes.view(qf.FP8[fmt]))
        ref = torch.from_numpy(codes).view(td).double().numpy()
        assert np.array_equal(golden, ref, equal_nan=True), fmt


def _blocks_formula(x, bm, bk, floor, ub, ue8m0):
    """Float64 loop over blocks: the textbook statement of the recipe, block by block."""
    x = x.astype(np.float32)
    m, k = x.shape
    q = np.zeros((m, k))
    s = np.zeros((-(-m // bm), -(-k // bk)), dtype=np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            amax = max(float(np.abs(blk).max()), floor)
            amax = min(amax, ub) if ub else amax
            sc = np.float32(np.float32(amax) / np.float32(448.0))
            if ue8m0:
                sc = np.float32(2.0 ** np.ceil(np.log2(np.float64(sc))))
            y = np.clip((blk / sc).astype(np.float32), -448, 448)  # float32 division
            q[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            s[i, j] = sc
    return q, s


@pytest.mark.parametrize("bm,bk,ub,fmt", [(1, 128, None, "fp32"), (128, 128, None, "fp32"),
                                          (1, 128, None, "ue8m0"), (3, 32, 1200.0, "fp32"),
                                          (128, 128, None, "ue8m0")])
def test_fp8_blocks_vs_block_loop(bm, bk, ub, fmt):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((131, 300)) * 2.0 ** rng.integers(-20, 12, (131, 1))
    x[5] = 0.0  # an all-zero token: the amax floor keeps its scale finite
    x[7, 3] = 5000.0  # beyond scale_ub * 448 / amax: the clamp saturates
    q, s = qf.fp8_quantize_blocks(x, bm, bk, scale_ub=ub, scale_fmt=fmt)
    q_ref, s_ref = _blocks_formula(x, bm, bk, 1e-4, ub, fmt == "ue8m0")
    assert s.shape == s_ref.shape and np.array_equal(s, s_ref)
    assert np.array_equal(qf.fp8_decode(q), q_ref)
    assert np.isfinite(qf.fp8_dequantize_blocks(q, s, bm, bk)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ub,fmt,recip", [(None, "fp32", False), (1.5, "fp32", True), (None, "ue8m0", False)])
def test_fp8_blocks_round_trip_and_torch(ub, fmt, recip, device):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((70, 260)).astype(np.float32)
    x[3, :128] = 0.0
    for bm, bk in [(1, 128), (128, 128)]:
        kw = dict(scale_ub=ub, scale_fmt=fmt, reciprocal=recip)
        q, s = qf.fp8_quantize_blocks(x, bm, bk, **kw)
        tq_, ts = (t.cpu() for t in tq.fp8_quantize_blocks(torch.from_numpy(x).to(device), bm, bk, **kw))
        assert np.array_equal(ts.numpy(), s)
        assert np.array_equal(tq_.view(torch.uint8).numpy(), q.view(np.uint8))
        if ub is not None:
            continue  # saturated values are outside the round-trip bound
        d = qf.fp8_dequantize_blocks(q, s, bm, bk)
        sx = np.repeat(np.repeat(s, bm, 0), bk, 1)[:70, :260]
        # e4m3 RNE: half an ulp of 3 mantissa bits (2^-4 relative), or half the subnormal step 2^-9
        assert (np.abs(d - x) <= np.maximum(np.abs(x) * 2.0**-4, sx * 2.0**-10) * (1 + 1e-6)).all()
        assert np.array_equal(tq.fp8_dequantize_blocks(tq_, ts, bm, bk).numpy(), d.astype(np.float32))


def test_int4_gptq_layout_and_round_trip():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 256)) * 0.02
    p = qf.int4_quantize(w, 128, "gptq")
    assert p["qweight"].shape == (32, 24) and p["qweight"].dtype == np.int32
    assert p["qzeros"].shape == (2, 3) and p["scales"].shape == (2, 24) and p["scales"].dtype == np.float16
    q, z, s = qf.int4_unpack(p, "gptq")
    # element k of column n sits in word k // 8 at bits 4 (k % 8); zeros are stored minus one along N
    qw = p["qweight"].view(np.uint32)
    assert (qw[1, 5] >> 12) & 0xF == q[11, 5]
    assert ((p["qzeros"].view(np.uint32)[1, 2] >> 4 * 3) & 0xF) + 1 == z[1, 19]
    d = qf.int4_dequantize(p, "gptq")
    assert d.shape == (24, 256)
    assert (np.abs(d - w) <= np.repeat(s, 128, 0).T / 2 * (1 + 1e-12)).all()
    assert np.array_equal(qf.int4_quantize(d, 128, "gptq")["qweight"], p["qweight"])  # idempotent


def test_int4_awq_interleave():
    w = np.zeros((8, 128))
    w[:, 0], w[:, 2] = -1.0, 1.0  # every column's range is [-1, 1]: scale 2/15, zero point 8
    w[:, 1] = np.arange(8) / 7.0  # element 1 of column n: codes 8..15, one per output column
    p = qf.int4_quantize(w, 128, "awq")
    q, z, s = qf.int4_unpack(p, "awq")
    word = int(p["qweight"].view(np.uint32)[1, 0])
    nib = [(word >> 4 * i) & 0xF for i in range(8)]
    assert nib == [q[1, c] for c in (0, 2, 4, 6, 1, 3, 5, 7)]  # pack order 0,2,4,6,1,3,5,7
    assert len(set(nib)) == 8
    zw = int(p["qzeros"].view(np.uint32)[0, 0])
    assert [(zw >> 4 * i) & 0xF for i in range(8)] == [z[0, c] for c in (0, 2, 4, 6, 1, 3, 5, 7)]  # no -1
    g = qf.int4_unpack(qf.int4_quantize(w, 128, "gptq"), "gptq")
    assert np.array_equal(g[0], q)  # the same codes in both layouts (zero points >= 1 here)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_torch_dequant_vs_golden(order, dtype, device):
    rng = np.random.default_rng(5)
    p = qf.int4_quantize(rng.standard_normal((16, 256)) * 0.02, 128, order)
    p["qweight"] = rng.integers(0, 2**32, p["qweight"].shape, dtype=np.uint64).astype(np.uint32).view(np.int32)
    p["qzeros"] = rng.integers(0, 2**32, p["qzeros"].shape, dtype=np.uint64).astype(np.uint32).view(np.int32)
    golden = qf.int4_dequantize(p, order)
    got = tq.int4_dequantize(*(torch.from_numpy(p[k]).to(device) for k in ("qweight", "qzeros", "scales")),
                             order, dtype).cpu()
    # (q - z) is exact in either dtype and the product rounds once: the golden rounded to the dtype
    want = golden.astype(np.float32 if dtype == torch.float32 else np.float16)
    assert got.dtype == dtype and np.array_equal(got.numpy(), want)


def test_mxfp4_scale_rule_and_round_trip():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 96)) * 2.0 ** rng.integers(-30, 30, (4, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.arange(32) * 0.25  # amax 7.75: scale 2^(2 - 2) = 1, so values are the E2M1 grid
    packed, e = qf.mxfp4_quantize(x)
    assert packed.shape == (4, 48) and e.shape == (4, 3)
    eb = e.view(np.uint8).astype(int)
    amax = np.abs(x.reshape(4, 3, 32)).max(-1)
    want = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2 + 127, 0)
    assert np.array_equal(eb, want)
    d = qf.mxfp4_dequantize(packed, e)
    assert d[1, 1] == 0.0 and d[1, 3] == 1.0 and d[1, 5] == 1.0 and d[1, 7] == 2.0 and d[1, 10] == 2.0
    assert d[1, 14] == 4.0 and d[1, 20] == 4.0 and d[1, 31] == 6.0  # 3.5 -> 4, 5 -> 4 (RNE), 7.75 -> 6 (sat.)
    assert packed[1, 2] == 0x22  # elements 4, 5 = 1.0, 1.25 -> 1.0, 1.0: E2M1 code 0b0010 twice
    scale = np.repeat(2.0 ** (eb - 127.0), 32, 1)
    # one step: E2M1 spacing is 2^(exp-1) of the element; within the top binade 2 (x scale)
    assert (np.abs(d - x) <= np.maximum(np.abs(x) / 4, 0.25 * scale) + 2 * scale * (np.abs(x) > 6 * scale)).all()


def test_mxfp4_pair_packing_low_nibble_first():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 4.0, -1.0  # amax 4: scale 2^0; codes 0b0110 and 0b1010
    packed, _ = qf.mxfp4_quantize(x)
    assert packed[0, 0] == 0x06 | (0x0A << 4)


@pytest.mark.parametrize("global_scale", [False, True])
def test_nvfp4_round_trip(global_scale):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 64)) * 3).astype(np.float32)
    x[2, :16] = 0.0
    g = qf.nvfp4_per_tensor_scale(x) if global_scale else None
    packed, s = qf.nvfp4_quantize(x, g)
    assert packed.shape == (5, 32) and s.shape == (5, 4) and s.dtype == ml_dtypes.float8_e4m3fn
    d = qf.nvfp4_dequantize(packed, s, g)
    t = np.repeat(qf.fp8_decode(s) * (float(g) if g is not None else 1.0), 16, 1)
    assert (np.abs(d - x) <= np.maximum(np.abs(x) / 4, 0.25 * t) + 1e-6 * t).all()
    assert (d[2, :16] == 0).all()
    amax = np.abs(x.reshape(5, 4, 16)).max(-1)
    if g is None:  # single level: the block scale is e4m3(amax / 6) when in range
        want = (amax / np.float32(6)).clip(2**-6, 448).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(s.astype(np.float32), want.astype(np.float32))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        qf.mxfp4_quantize(np.zeros((2, 40)))
    with pytest.raises(ValueError, match="multiple of 16"):
        qf.nvfp4_quantize(np.zeros((2, 40)))
    with pytest.raises(ValueError, match="group"):
        qf.int4_quantize(np.zeros((8, 100)))
    with pytest.raises(ValueError, match="fp8 format"):
        qf.fp8_encode(np.zeros(3), "e3m4")
