"""The quantized KV cache goldens' formats (refimpl/kvquant.py: quantize, dynamic_scale, dequantize) against
independent transcriptions, and the write path's golden (refimpl/kvquant_update.py):

- torch's float32 division and float8 casts with a clamp (e4m3fn / e5m2), torch.round for int8 (half to even);
- ml_dtypes' casts of every finite code (round trip) and of every midpoint between neighbouring codes (ties to the
  even code);
- vLLM's semantics (scaled_vec_conversion: x / scale in float32, __nv_cvt_float_to_fp8 with __NV_SATFINITE)
  written out in exact rational arithmetic: the float32 quotient rounded to the nearest grid value, ties to the
  code whose last mantissa bit is 0, saturating at +-FMAX;
- dynamic_scale against torch's amax / FMAX in float32; dequantize exact (Fractions);
- the conventions that separate kernels: the IEEE division vs a reciprocal multiply at midpoints;
- update: slots written, -1 skipped, the rest of the cache and scale cache untouched, refusals; the kernels'
  argument refusals (cpu, torch).
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import kvquant as kq

torch = pytest.importorskip("torch")

FP8 = ("e4m3", "e5m2")
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _grid(fmt: str) -> np.ndarray:
    """Every finite code value of the format, ascending (+0 once)."""
    v = np.arange(256, dtype=np.uint8).view(kq.STORAGE[fmt]).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def _values(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """float32 quotients that exercise everything: random magnitudes over the whole range and past FMAX, the
    codes, the midpoints and their float32 neighbours, subnormals, zeros."""
    g = _grid(fmt)
    mid = (g[:-1] + g[1:]) / 2
    top = kq.FMAX[fmt]
    parts = [rng.standard_normal(4000) * np.exp2(rng.uniform(-30, np.log2(top) + 3, 4000)), g, mid,
             np.nextafter(mid.astype(np.float32), np.float32(np.inf)).astype(np.float64),
             np.nextafter(mid.astype(np.float32), np.float32(-np.inf)).astype(np.float64),
             np.array([0.0, -0.0, top, -top, top * 1.03, -top * 1.03, top * 1e6, -top * 1e6, 1e-45, -1e-45])]
    return np.concatenate(parts).astype(np.float32)


def _vllm_fp8(v: np.ndarray, fmt: str) -> np.ndarray:
    """__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt) in exact arithmetic: the nearest grid value, ties to the
    even code (last mantissa bit 0), saturating; returned as bit patterns (uint8)."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(kq.STORAGE[fmt]).astype(np.float64)
    finite = np.isfinite(vals)
    table = sorted((Fraction(float(vals[c])), int(c)) for c in codes[finite] if not (vals[c] == 0 and c & 0x80))
    fr = [t[0] for t in table]
    top = fr[-1]
    out = np.empty(v.shape, dtype=np.uint8)
    for i, x in enumerate(v.tolist()):
        q = Fraction(x)
        neg = q < 0 or (q == 0 and np.signbit(np.float32(x)))
        a = min(abs(q), top)  # __NV_SATFINITE
        j = int(np.searchsorted(np.array(fr, dtype=object), a, side="left"))  # fr[j] >= a
        if fr[min(j, len(fr) - 1)] == a:
            c = table[j][1]
        else:
            lo, hi = table[j - 1], table[j]
            dlo, dhi = a - lo[0], hi[0] - a
            c = lo[1] if dlo < dhi or (dlo == dhi and lo[1] % 2 == 0) else hi[1]
        out[i] = c | (0x80 if neg else 0)
    return out


@pytest.mark.parametrize("fmt", FP8)
def test_quantize_matches_torch_cast_with_clamp(fmt):
    rng = np.random.default_rng(1)
    x = _values(fmt, rng)
    for s in (np.float32(1.0), np.float32(7 * 2.0**-5), np.float32(0.0123)):
        v = torch.from_numpy(x) / torch.tensor(s)  # torch's float32 division (IEEE)
        want = v.clamp(-kq.FMAX[fmt], kq.FMAX[fmt]).to(TORCH_FP8[fmt]).view(torch.uint8).numpy()
        got = kq.quantize(x, s, fmt).view(np.uint8)
        assert np.array_equal(got, want), f"{fmt} scale {s}: {np.count_nonzero(got != want)} codes differ from torch"


def test_quantize_int8_matches_torch_round_half_even():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(5000) * 100, np.arange(-140, 140) + 0.5, [1e9, -1e9, 0.0]])
    x = x.astype(np.float32)
    for s in (np.float32(1.0), np.float32(0.37)):
        v = torch.from_numpy(x) / torch.tensor(s)
        want = torch.round(v).clamp(-128, 127).to(torch.int8).numpy()
        assert np.array_equal(kq.quantize(x, s, "int8"), want)
    assert kq.quantize(np.float32([0.5, 1.5, 2.5, -0.5, -2.5]), 1.0, "int8").tolist() == [0, 2, 2, 0, -2]


@pytest.mark.parametrize("fmt", FP8)
def test_quantize_matches_vllm_satfinite_in_exact_arithmetic(fmt):
    rng = np.random.default_rng(3)
    x = _values(fmt, rng)
    s = np.float32(5 * 2.0**-3)
    v = (x / s).astype(np.float32)  # scaled_vec_conversion: x / scale in float32
    assert np.array_equal(kq.quantize(x, s, fmt).view(np.uint8), _vllm_fp8(v, fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_every_code_round_trips_and_every_midpoint_ties_to_even(fmt):
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(kq.STORAGE[fmt]).astype(np.float32)
    ok = np.isfinite(vals)
    assert np.array_equal(kq.quantize(vals[ok], 1.0, fmt).view(np.uint8), codes[ok])  # -0 kept too
    g = _grid(fmt)
    mid = ((g[:-1] + g[1:]) / 2).astype(np.float32)
    q = kq.quantize(mid, 1.0, fmt).view(np.uint8)
    assert (q & 1 == 0).all(), "a midpoint rounded to an odd code"
    assert np.array_equal(np.abs(kq.quantize(np.float32([1e30, -1e30]), 1.0, fmt).astype(np.float64)),
                          [kq.FMAX[fmt]] * 2), "no saturation"
    assert not np.isnan(kq.quantize(np.float32([1e30, -1e30]), 1e-5, fmt).astype(np.float32)).any()


def test_subnormal_codes():
    # e4m3's smallest subnormal 2^-9, midpoint 2^-10 ties to 0; 3 * 2^-10 ties to 2^-8 (even code 2)
    q = kq.quantize(np.float32([2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-11, -(2.0**-10)]), 1.0, "e4m3")
    assert q.view(np.uint8).tolist() == [1, 0, 2, 0, 0x80]
    q = kq.quantize(np.float32([2.0**-16, 2.0**-17, 3 * 2.0**-17]), 1.0, "e5m2")
    assert q.view(np.uint8).tolist() == [1, 0, 2]


@pytest.mark.parametrize("fmt", kq.FORMATS)
def test_dynamic_scale_matches_torch_and_zero_rows(fmt):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 3, 64)) * 10.0 ** rng.uniform(-3, 3, (6, 3, 1))).astype(ml_dtypes.bfloat16)
    x[2, 1] = 0
    want = (torch.from_numpy(x.astype(np.float32)).abs().amax(dim=-1) / kq.FMAX[fmt]).numpy()
    s = kq.dynamic_scale(x, fmt)
    assert s.dtype == np.float32 and np.array_equal(s, want)
    assert s[2, 1] == 0
    q = kq.quantize(x, s[:, :, None], fmt)
    assert (q[2, 1].view(np.uint8) == 0).all()
    top = np.abs(q.astype(np.float32)).max(axis=-1)
    assert (top[s > 0] == kq.FMAX[fmt]).all(), "a row's amax element does not map to +-FMAX"


def test_dequantize_is_exact():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)[:120]
    s = np.float32(0.1)
    got = kq.dequantize(codes, s)
    for c, g in zip(codes.astype(np.float64), got):
        assert Fraction(float(g)) == Fraction(float(c)) * Fraction(float(s))


def test_division_not_a_reciprocal_multiply():
    """x = s * m with m a midpoint: x / s = m exactly (ties to even); x * float32(1 / s) misses m at some."""
    g = _grid("e4m3")
    mid = ((g[:-1] + g[1:]) / 2)[g[:-1] >= 0]
    s = np.float32(7 * 2.0**-4)
    x = (mid * 7 * 2.0**-4).astype(np.float32)
    exact = x.astype(np.float64) == mid * 7 * 2.0**-4
    x = x[exact]
    good = kq.quantize(x, s, "e4m3").view(np.uint8)
    recip = np.clip(x * (np.float32(1) / s), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert (good != recip).sum() >= 5


# -- refimpl/kvquant_update.py ------------------------------------------------------------------------------
def _cache(fmt, rng, shape=(3, 4, 2, 8)):
    return rng.integers(0, 0x70, shape).astype(np.uint8).view(kq.STORAGE[fmt])


@pytest.mark.parametrize("fmt", kq.FORMATS)
@pytest.mark.parametrize("gran", ("tensor", "head", "token"))
def test_update_writes_the_mapped_slots_only(fmt, gran):
    rng = np.random.default_rng(5)
    cache = _cache(fmt, rng)
    new = rng.standard_normal((5, 2, 8)).astype(np.float32)
    slots = np.array([7, -1, 0, 11, -1])
    scale = {"tensor": np.float32([0.01]), "head": np.float32([0.01, 3.0]), "token": None}[gran]
    sc = rng.random((3, 4, 2)).astype(np.float32) if gran == "token" else None
    out, sc_out = kq.update(cache, new, slots, fmt=fmt, gran=gran, scale=scale, scale_cache=sc)
    flat, old = out.reshape(12, 2, 8).view(np.uint8), cache.reshape(12, 2, 8).view(np.uint8)
    written = [7, 0, 11]
    for t, slot in zip((0, 2, 3), written):
        s = kq.dynamic_scale(new[t], fmt)[:, None] if gran == "token" else (scale[:, None] if gran == "head"
                                                                             else scale)
        assert np.array_equal(flat[slot], kq.quantize(new[t], s, fmt).view(np.uint8))
        if gran == "token":
            assert np.array_equal(sc_out.reshape(12, 2)[slot], kq.dynamic_scale(new[t], fmt))
    rest = np.setdiff1d(np.arange(12), written)
    assert np.array_equal(flat[rest], old[rest]), "a slot no token maps to changed"
    if gran == "token":
        assert np.array_equal(sc_out.reshape(12, 2)[rest], sc.reshape(12, 2)[rest])
    else:
        assert sc_out is None


@pytest.mark.parametrize("bad, match", [
    (dict(slot_mapping=np.array([1, 1])), "distinct"),
    (dict(slot_mapping=np.array([1, 12])), r"-1 or in \[0, 12\)"),
    (dict(slot_mapping=np.array([-2, 1])), r"-1 or in"),
    (dict(scale=np.float32([0.0])), "finite and > 0"),
    (dict(scale=np.float32([0.1, 0.2])), r"shape \(1,\)"),
    (dict(new=np.full((2, 2, 8), np.nan, np.float32)), "finite"),
    (dict(fmt="e3m4"), "fmt"),
    (dict(gran="block"), "gran"),
    (dict(scale_cache=np.zeros((3, 4, 2), np.float32)), "static scales"),
])
def test_update_refusals(bad, match):
    rng = np.random.default_rng(6)
    args = dict(cache=_cache("e4m3", rng), new=np.ones((2, 2, 8), np.float32), slot_mapping=np.array([0, 5]),
                fmt="e4m3", gran="tensor", scale=np.float32([0.1]), scale_cache=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kq.update(args.pop("cache"), args.pop("new"), args.pop("slot_mapping"), **args)


_BAD = [(dict(fmt="e3m4"), "fmt"), (dict(gran="block"), "gran"), (dict(scale="wrong shape"), "scale"),
        (dict(gran="token"), "scale"), (dict(cache="int8"), "cache"), (dict(new="nan"), "finite")]


# the torch kernel does not look for NaN in `new` (a device sync), as the Triton one: that refusal is the C wrapper's
@pytest.mark.parametrize("backend, bad, match", [(b, bad, m) for b in ("cpu", "torch") for bad, m in _BAD
                                                 if not (b == "torch" and bad.get("new"))])
def test_kernels_refuse_bad_arguments(backend, bad, match):
    rng = np.random.default_rng(7)
    cache = _cache("e4m3", rng)
    new = np.ones((2, 2, 8), np.float32)
    slots = np.array([0, 5], dtype=np.int64)
    scale = np.float32([0.1])
    if bad.get("scale") == "wrong shape":
        scale = np.float32([0.1, 0.2, 0.3])
    if bad.get("cache") == "int8":
        cache = cache.view(np.int8)
    fmt, gran = bad.get("fmt", "e4m3"), bad.get("gran", "tensor")
    if bad.get("new") == "nan":
        new[1, 0, 3] = np.nan
    if backend == "cpu":
        from kernel_parity.kernels.cpu.kvquant import update
    else:
        from kernel_parity.kernels.torch.kvquant import update

        cache = torch.from_numpy(cache.view(np.uint8)).view(torch.int8 if bad.get("cache") else torch.float8_e4m3fn)
        new, slots, scale = torch.from_numpy(new), torch.from_numpy(slots), torch.from_numpy(scale)
    with pytest.raises(ValueError, match=match):
        update(cache, new, slots, fmt, gran, scale=scale)
