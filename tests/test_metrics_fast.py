"""compare() and trust_layer() against the whole-array implementation they replaced, kept below
verbatim (renamed) as the oracle: every metric bit for bit, the same worst elements in the same
order, the same elem_ratio, anomaly detail and trust verdict, over random cases that cross the
chunk and block boundaries, carry NaN / inf, zeros and ties, and come strided."""

import math

import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import metrics
from kernel_parity.conformance.dtypes import DType, round_to
from kernel_parity.conformance.metrics import TINY, WORST_K, _CLASS_NAME, Comparison, Limits, compare
from kernel_parity.conformance.tolerance import LayerResult, trust_layer, zero_output_passes

# -- the oracle: conformance/metrics.py, dtypes.py (ULP helpers) and tolerance.trust_layer as of a1c10f4 ----
_DOT_BLOCK = 8192
_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def _old_dot(x: np.ndarray, y: np.ndarray) -> float:
    """x . y (1-D float64) whose bits do not depend on how many threads the process's BLAS runs:
    OpenBLAS splits a long dot product over its threads, so np.dot's last bits followed each worker's
    share of the cores (a record then differed between a run in workers and one in-process, or between
    hosts). einsum per block of _DOT_BLOCK products (NumPy's own loop, one thread), then their sum."""
    m = x.size - x.size % _DOT_BLOCK
    s = float(np.einsum("ij,ij->i", x[:m].reshape(-1, _DOT_BLOCK), y[:m].reshape(-1, _DOT_BLOCK)).sum()) if m else 0.0
    return s + float(np.einsum("i,i->", x[m:], y[m:])) if m < x.size else s


def _old_anomaly_classes(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    c = np.zeros(x.shape, dtype=np.int8)
    c[np.isnan(x)] = 1
    c[np.isposinf(x)] = 2
    c[np.isneginf(x)] = 3
    return c


def old_compare(got: np.ndarray, ref: np.ndarray, dtype: DType, limits: Limits | None,
                tol_dtype: DType | None = None) -> Comparison:
    """Compare a kernel output (storage dtype) with its golden (float64) of the same shape.

    tol_dtype: whose eps scales `limits.atol_max_eps` (default the output's own dtype).

    Outputs of 10^8 elements are judged here (models sizes), so every full pass counts: where
    both sides are finite everywhere (the common case) nothing is masked or copied.
    """
    with np.errstate(invalid="ignore"):  # signalling-NaN poison in fp16/bf16 casts with a warning
        a = np.asarray(got).astype(np.float64)
    b = np.asarray(ref, dtype=np.float64)
    n_bad_anom, anomaly_detail = 0, ""
    if np.isfinite(a).all() and np.isfinite(b).all():
        both = None  # every element compared: a and b themselves, no copies
        bad_anom = np.zeros(0, dtype=bool)
        af, bf, nonfinite_ref = a.reshape(-1), b.reshape(-1), 0
    else:
        ca, cb = _old_anomaly_classes(a), _old_anomaly_classes(b)
        bad_anom = ca != cb
        n_bad_anom = int(np.count_nonzero(bad_anom))
        if n_bad_anom:
            idx = np.argwhere(bad_anom)[0]
            i = tuple(int(v) for v in idx)
            anomaly_detail = (
                f"{n_bad_anom} element(s) differ in NaN/inf position, first at {list(i)}: "
                f"got {_CLASS_NAME[int(ca[i])]}, expected {_CLASS_NAME[int(cb[i])]}"
            )
        both = (ca == 0) & (cb == 0)
        af, bf, nonfinite_ref = a[both], b[both], int(np.count_nonzero(cb != 0))
    d = np.abs(af - bf)
    n = int(af.size)
    abs_b = np.abs(bf)
    max_ref = float(abs_b.max()) if n else 0.0
    atol = limits.effective_atol((tol_dtype or dtype).eps, max_ref) if limits else 0.0
    rtol = limits.rtol if limits else 0.0
    if n:
        max_abs = float(d.max())
        rel_floor = atol if atol > 0 else TINY
        max_rel = float((d / np.maximum(abs_b, rel_floor)).max())
        sq = _old_dot(d, d)
        rmse = float(np.sqrt(sq / n))
        bb = _old_dot(bf, bf)
        nmse = 0.0 if sq == 0 else (sq / bb if bb > 0 else float("inf"))
        denom = _old_dot(af, af) + bb
        cos_diff = 0.0 if denom == 0 else float(1.0 - 2.0 * _old_dot(af, bf) / max(denom, TINY))
        if dtype.is_float and dtype.bits == dtype.storage_bits and dtype.name != "e8m0":  # signed floats
            g = np.asarray(got).reshape(-1) if both is None else np.asarray(got)[both]
            if atol > 0:
                big = abs_b > atol
                max_ulp = _old_max_ulp_distance(g[big], bf[big], dtype) if big.any() else 0.0
            else:  # every element with |b| > 0
                big = abs_b > 0
                max_ulp = (_old_max_ulp_distance(g, bf, dtype) if big.all() else
                           _old_max_ulp_distance(g[big], bf[big], dtype) if big.any() else 0.0)
        else:
            max_ulp = float("nan")
        allowed = abs_b
        allowed *= rtol  # abs_b is not needed after this: its buffer becomes the limit
        allowed += atol
        if atol > 0:  # every limit positive
            ratio = d / allowed
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(allowed > 0, d / np.where(allowed > 0, allowed, 1.0), np.where(d > 0, np.inf, 0.0))
        elem_ratio = float(ratio.max())
        mismatch = int(np.count_nonzero(d > allowed))
    else:
        max_abs = max_rel = rmse = nmse = cos_diff = max_ref = 0.0
        max_ulp = 0.0
        bb = denom = 0.0
        ratio = np.zeros(0)
        elem_ratio = 0.0
        mismatch = 0
    metrics = {
        "numel": int(a.size),
        "max_abs": max_abs,
        "max_rel": max_rel,
        "rmse": rmse,
        "nmse": nmse,
        "cos_diff": cos_diff,
        "max_ulp": max_ulp,
        "mismatch": mismatch + n_bad_anom,
        "mismatch_frac": (mismatch + n_bad_anom) / a.size if a.size else 0.0,
        "max_ref": max_ref,
        "atol_eff": atol,
        "nonfinite_ref": nonfinite_ref,
        # the sums behind nmse and cos_diff, for their absolute floor (tolerance.aggregate_limits)
        "numel_finite": n,
        "sum_sq_ref": bb,
        "sum_sq_both": denom,
    }
    return Comparison(metrics, n_bad_anom, anomaly_detail, _old_worst(a, b, bad_anom, both, ratio, d), elem_ratio)


def _old_worst(a, b, bad_anom, both, ratio, d) -> list[dict]:
    """At most WORST_K elements, each marked `out` (outside the elementwise tolerance, or a NaN/inf
    position that differs): anomaly mismatches first, then the out-of-tolerance elements by their
    error relative to the limit. Elements within tolerance are listed only when none is out (the
    nearest to their limit), so a failing element is never shown beside errors of 1e-233."""
    picks: list[tuple[tuple[int, ...], bool]] = [(tuple(int(v) for v in i), True)
                                                 for i in np.argwhere(bad_anom)[:WORST_K]]
    if len(picks) < WORST_K and ratio.size:
        flat_idx = None if both is None else np.flatnonzero(both.reshape(-1))  # None: all elements
        n_out = int(np.count_nonzero(ratio > 1.0))
        key = ratio if np.any(ratio > 0) else d
        k = min(WORST_K - len(picks), n_out if (n_out or picks) else key.size)
        if k > 0:
            order = np.argpartition(-key, k - 1)[:k] if k < key.size else np.arange(key.size)
            order = order[np.argsort(-key[order], kind="stable")]
            for o in order:
                if key[o] <= 0:
                    break
                flat = o if flat_idx is None else flat_idx[o]
                picks.append((tuple(int(v) for v in np.unravel_index(flat, a.shape)), bool(ratio[o] > 1.0)))
    out = []
    for i, is_out in picks:
        g, e = float(a[i]), float(b[i])
        ad = abs(g - e) if np.isfinite(g) and np.isfinite(e) else float("nan")
        rel = ad / abs(e) if np.isfinite(ad) and e != 0 else float("nan")
        out.append({"index": list(i), "got": g, "expected": e, "abs": ad, "rel": rel, "out": is_out})
    return out


def _old_ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Map IEEE bit patterns to integers whose order is the order of the floats (-0 == +0):
    sign-magnitude to two's complement, (mag ^ -s) + s with s the sign bit (no branch, no where)."""
    if width < 64:
        b = bits.astype(np.int32 if width < 32 else np.int64)
        s = b >> (width - 1)
        return ((b & ((1 << (width - 1)) - 1)) ^ -s) + s
    b = bits.view(np.int64)
    s = (b >> 63) & 1
    return ((b & np.int64(0x7FFFFFFFFFFFFFFF)) ^ -s) + s


def _old_max_ulp_distance(got: np.ndarray, expected_f64: np.ndarray, dtype: DType) -> float:
    """max(ulp_distance(...)) without the float64 array of distances (0.0 for no elements)."""
    if not np.size(got):
        return 0.0
    diff = _old_ulp_diff(got, expected_f64, dtype)
    return float(max(diff.max(), -diff.min()))


def _old_ulp_diff(got: np.ndarray, expected_f64: np.ndarray, dtype: DType) -> np.ndarray:
    width = dtype.storage_bits
    u = _UINT[width]
    a = _old_ordered(np.ascontiguousarray(np.asarray(got, dtype=dtype.np)).view(u), width)
    b = _old_ordered(np.ascontiguousarray(round_to(expected_f64, dtype)).view(u), width)
    if width == 64:  # ordered int64s may be 2^64 apart: subtract in float64, as the distances are returned
        return a.astype(np.float64) - b.astype(np.float64)
    return a - b


def old_trust_layer(ref: np.ndarray, m: dict[str, float], lim: Limits) -> tuple[LayerResult, bool]:
    finite = np.isfinite(ref)
    has_nonzero = bool(np.any(ref[finite] != 0))
    n_fin = m["numel_finite"]
    rms_ref = math.sqrt(m["sum_sq_ref"] / n_fin) if n_fin else 0.0
    vacuous = zero_output_passes(m["max_ref"], m["atol_eff"], lim, has_nonzero, rms_ref)
    detail = "an all-zero output would pass: the reference is below the tolerance" if vacuous else ""
    return LayerResult(not vacuous, detail), vacuous


# -- the cases ---------------------------------------------------------------------------------------------
C = metrics._CHUNK
SIZES = (0, 1, 7, 8191, 8192, 8193, C - 1, C, C + 1, C + _DOT_BLOCK + 5, 2 * C + 3)
DTYPES = ("bf16", "fp16", "fp32", "fp64", "fp8e4m3")
LIMITS = {
    "none": None,
    "rtol_only": Limits(atol=0.0, rtol=1e-2),
    "atol_rtol": Limits(atol=1e-5, rtol=1.6e-2, cos_diff=2e-5, nmse=4e-5),
    "atol_only": Limits(atol=1e-3, rtol=0.0),
    "scaled_atol": Limits(atol=1e-5, rtol=1e-3, atol_max_eps=4.0),  # atol from max|golden|: a pass first
}
KINDS = ("noise", "ties", "equal", "zeros", "outliers", "nan_inf", "nan_ref", "tiny")


def _data(kind: str, dtype: DType, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(got in dtype's storage type, golden in float64), both 1-D of n elements."""
    scale = 8.0 if dtype.name.startswith("fp8") else 1.0
    ref = rng.standard_normal(n) * scale
    if kind == "ties":  # few distinct golden values and one relative error: many equal errors
        ref = rng.integers(-3, 4, n) * 0.37 * scale
    if kind == "tiny":  # around atol, subnormal and zero goldens
        ref = ref * np.array([1e-6, 1e-3, 1e-310, 0.0])[rng.integers(0, 4, n)]
    if kind == "zeros":
        ref = np.zeros(n)
    noise = 1.0 + rng.standard_normal(n) * 4e-3 if kind != "ties" else 1.0 + 1e-2
    got = round_to(ref * noise, dtype)
    if kind == "equal":
        ref = got.astype(np.float64)
    if kind == "zeros" and n:
        got[rng.integers(0, n, 3)] = round_to(np.array([1e-3, -2e-3, 1e-3]), dtype)
    if kind == "outliers" and n:
        i = rng.integers(0, n, 8)
        got[i] = round_to(ref[i] + np.array([1.0, -1.0, 0.5, 0.5, 2.0, 2.0, -0.25, 3.0]) * scale, dtype)
    if kind in ("nan_inf", "nan_ref") and n:
        specials = np.array([np.nan, np.inf, -np.inf])  # e4m3fn rounds inf to NaN: it has no inf
        ref[rng.integers(0, n, 5)] = specials[rng.integers(0, 3, 5)]
        if kind == "nan_inf":
            got[rng.integers(0, n, 5)] = round_to(specials[rng.integers(0, 3, 5)], dtype)
            both = rng.integers(0, n, 2)  # positions where the two agree
            ref[both], got[both] = np.nan, round_to(np.full(2, np.nan), dtype)
    return got, ref


def _same(x, y) -> bool:
    """Equal as the record stores them: same type and bits (NaN equals NaN, -0.0 is not 0.0)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1.0, x) == math.copysign(1.0, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return x == y


def assert_same_as_before(got, ref, dtype: DType, limits, tol_dtype=None, repro: str = "") -> None:
    want = old_compare(got, ref, dtype, limits, tol_dtype)
    have = compare(got, ref, dtype, limits, tol_dtype)
    bad = [k for k in want.metrics if not _same(want.metrics.get(k), have.metrics.get(k))]
    assert not bad and have.metrics.keys() == want.metrics.keys(), (
        f"compare() metrics differ from the whole-array oracle: {bad}\n"
        + "".join(f"  {k}: {have.metrics.get(k)!r}, expected {want.metrics[k]!r}\n" for k in bad) + f"  repro: {repro}")
    assert _same(have.worst, want.worst), f"worst list differs\n  {have.worst}\n  expected {want.worst}\n  repro: {repro}"
    assert _same(have.elem_ratio, want.elem_ratio), f"elem_ratio {have.elem_ratio!r}, expected {want.elem_ratio!r}  repro: {repro}"
    assert (have.anomaly_mismatch, have.anomaly_detail) == (want.anomaly_mismatch, want.anomaly_detail), repro
    if limits is not None:
        assert trust_layer(ref, have.metrics, limits) == old_trust_layer(ref, want.metrics, limits), repro


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_compare_matches_the_whole_array_oracle(kind, n):
    """Every dtype and limit set over one (kind, size): 25 comparisons, data drawn per dtype."""
    rng = np.random.default_rng([n, KINDS.index(kind)])
    for name in DTYPES:
        dtype = dt.get(name)
        got, ref = _data(kind, dtype, n, rng)
        for lname, lim in LIMITS.items():
            assert_same_as_before(got, ref, dtype, lim, repro=f"_data({kind!r}, {name}, {n}) limits={lname}")


@pytest.mark.parametrize("seed", range(6))
def test_shapes_strides_and_tol_dtype(seed):
    """2-D outputs, strided and transposed views of both sides, tol_dtype other than the output's."""
    rng = np.random.default_rng(100 + seed)
    dtype = dt.get(DTYPES[seed % len(DTYPES)])
    kind = KINDS[seed % len(KINDS)]
    got, ref = _data(kind, dtype, 600 * 520, rng)
    got, ref = got.reshape(600, 520), ref.reshape(600, 520)
    lim = LIMITS["scaled_atol"] if seed % 2 else LIMITS["atol_rtol"]
    views = {"contiguous": (got, ref), "strided": (got[:, ::2], ref[:, ::2]), "transposed": (got.T, ref.T),
             "mixed": (got[::3], np.ascontiguousarray(ref[::3]))}
    for vname, (g, r) in views.items():
        assert g.flags.c_contiguous == (vname == "contiguous")
        assert_same_as_before(g, r, dtype, lim, tol_dtype=dt.get("fp32"), repro=f"seed={seed} {vname}")
        assert_same_as_before(g, r, dtype, lim, repro=f"seed={seed} {vname}")


@pytest.mark.parametrize("n", SIZES[1:])
def test_strided_and_reversed_goldens(n):
    """A float64 golden seen through a strided or reversed 1-D view is summed with its strides (as
    the whole-array code summed it); a float32 golden is converted."""
    rng = np.random.default_rng([n, 99])
    bf = dt.get("bf16")
    wide = rng.standard_normal((n, 2))
    ref = wide[:, 1]
    got = np.empty((n, 3), dtype=bf.np)
    got[:, 2] = round_to(ref * (1 + rng.standard_normal(n) * 4e-3), bf)
    cases = {"strided": (got[:, 2], ref), "reversed": (got[::-1, 2], ref[::-1]),
             "float32 golden": (got[:, 2], ref.astype(np.float32))}
    for cname, (g, r) in cases.items():
        for lname in ("atol_rtol", "scaled_atol"):
            assert_same_as_before(g, r, bf, LIMITS[lname], repro=f"n={n} {cname} {lname}")


def test_scalar_and_other_dtypes():
    """A 0-d output; dtypes without a ULP metric (NaN); an fp8 golden beyond the format's range."""
    for name in ("bf16", "fp32", "fp64"):
        d = dt.get(name)
        assert_same_as_before(round_to(np.array(1.5), d), np.array(1.25), d, LIMITS["atol_rtol"], repro=name)
        assert_same_as_before(round_to(np.array(np.nan), d), np.array(1.25), d, LIMITS["atol_rtol"], repro=name)
    rng = np.random.default_rng(7)
    for name in ("fp4e2m1", "fp8e5m2", "int8"):
        d = dt.get(name)
        ref = np.round(rng.standard_normal(3 * C) * 4)
        assert_same_as_before(round_to(ref * 1.1, d), ref, d, LIMITS["atol_rtol"], repro=name)
    ref = rng.standard_normal(C + 9) * 300.0  # e4m3fn's largest value is 448: the golden rounds to NaN
    e4m3 = dt.get("fp8e4m3")
    assert_same_as_before(round_to(np.clip(ref, -448, 448), e4m3), ref, e4m3, LIMITS["atol_rtol"], repro="e4m3 range")


def test_overflowing_difference_stays_in_the_fast_path():
    """fp64 values of opposite sign near the top of the range: |a - b| is inf with both sides finite."""
    ref = np.full(C + 3, 1.5e308)
    got = ref.copy()
    got[[5, C + 1]] = -1.5e308
    f64 = dt.get("fp64")
    for lim in LIMITS.values():
        assert_same_as_before(got, ref, f64, lim, repro="overflow")


def test_ties_at_the_cut_and_above_it():
    """Equal ratios among the listed elements and at the cut: the exact whole-array selection."""
    rng = np.random.default_rng(11)
    n = 3 * C + 17
    ref = rng.standard_normal(n)
    got = round_to(ref, dt.get("fp32"))
    f32 = dt.get("fp32")
    for idx in ([3, C + 5, 2 * C + 7], [1, 2, 3, 4, 5, 6, 7], [n - 1, 0]):
        g = got.copy()
        g[idx] = np.float32(ref[0] + 1.0)  # the same error where the goldens agree
        r = ref.copy()
        r[idx] = ref[0]
        for lim in LIMITS.values():
            assert_same_as_before(g, r, f32, lim, repro=f"ties at {idx}")
        g[[10, C + 9]], r[[10, 2 * C]] = np.nan, np.nan  # masked: the compared elements shift
        for lim in LIMITS.values():
            assert_same_as_before(g, r, f32, lim, repro=f"ties at {idx}, NaN")


def test_all_inf_ratios_without_limits_and_nan_ratio():
    """No limits: every non-zero error has ratio inf (all tie); an inf limit and an inf error: NaN."""
    rng = np.random.default_rng(12)
    ref = rng.standard_normal(2 * C + 1)
    bf = dt.get("bf16")
    assert_same_as_before(round_to(ref * 1.01, bf), ref, bf, None, repro="inf ties")
    big = np.full(C + 5, 1e308)
    got = big.copy()
    got[3] = -1e308
    assert_same_as_before(got, big, dt.get("fp64"), Limits(atol=1e-5, rtol=10.0), repro="inf / inf ratio")
    big[[9, C + 2]], got[[9, C + 2]] = 1.0, [2.0, 1.5]  # and positive ratios beside the NaN
    assert_same_as_before(got, big, dt.get("fp64"), Limits(atol=1e-5, rtol=10.0), repro="inf / inf ratio")


def test_subnormal_errors_whose_ratio_underflows():
    """d > 0 with every ratio 0 (d / allowed underflows): the worst list ranks by d."""
    ref = np.full(C + 11, 1e-300)
    got = ref.copy()
    got[[4, C + 2]] = [1e-300 + 5e-324 * 3, 1e-300 - 5e-324 * 7]
    assert_same_as_before(got, ref, dt.get("fp64"), Limits(atol=1e30, rtol=0.0), repro="underflow")


def test_model_size_slice():
    """About 3M elements (23 chunks), bf16 with outliers, then with NaN / inf across chunk borders."""
    rng = np.random.default_rng(13)
    bf = dt.get("bf16")
    for kind in ("outliers", "nan_inf"):
        got, ref = _data(kind, bf, 7 * 428_573, rng)
        assert_same_as_before(got.reshape(-1, 7), ref.reshape(-1, 7), bf, LIMITS["atol_rtol"], repro=kind)
        assert_same_as_before(got, ref, bf, LIMITS["scaled_atol"], repro=kind)


def test_trust_layer_matches_on_zero_and_nonfinite_goldens():
    lim = LIMITS["atol_rtol"]
    f32 = dt.get("fp32")
    for ref in (np.zeros(C + 3), np.array([np.nan, np.inf, 0.0]), np.array([np.nan, 1e-7]),
                np.r_[np.zeros(2 * C), 1e-9], np.zeros((5, 0)), np.full((300, 400), 1e-7)[:, ::3]):
        got = round_to(ref, f32)
        m = old_compare(got, ref, f32, lim).metrics
        assert trust_layer(ref, m, lim) == old_trust_layer(ref, m, lim)
