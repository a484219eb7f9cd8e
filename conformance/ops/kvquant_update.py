"""Op spec of `kvquant.update`: the write path of a quantized paged KV cache (quantize on append), vLLM's
reshape_and_cache_flash with an fp8 (e4m3 / e5m2) or int8 cache and k_scale / v_scale; the golden is
refimpl/kvquant_update.py (formats and rounding: refimpl/kvquant.py).

Inputs: k_new, v_new (n, hkv, d) in the test dtype; slot_mapping (n,) int64, distinct slots drawn at random
over the whole cache (num_blocks = `blocks`, `page` slots each) with `pad` tokens at -1 (padding: not
written); k_cache, v_cache (blocks, page, hkv, d) of the format's storage type holding random finite old codes
(canaries: every slot the batch does not map to must keep its bits). gran "tensor": k_scale, v_scale (1,)
fp32; "head": (hkv,) fp32 (static scales, K's and V's drawn apart); "token": the dynamic scales are computed
and written into k_scale_cache, v_scale_cache (blocks, page, hkv) fp32, whose old contents are random
positive canaries.

Outputs, all bit-exact and in place (Output.inplace: the kernel writes the caches it is handed): k_cache,
v_cache as their bytes (uint8: the float8 bit patterns, or int8's two's complement; one output dtype for the
three formats, and the exact judge compares the bits of floats anyway), and for gran "token" the two fp32
scale caches.

Neighbour separation (every dist): neighbouring kv heads' magnitudes (and, for static per-head scales, their
scales) differ by 10^3 to 10^4 (fp16, whose range is narrower: 10^1 to 10^2; midpoints / tiny: power-of-two
scale factors 2^20 and more apart, fp16 2^1 (e5m2) to 2^9), and for gran "token" neighbouring tokens' too,
so a kernel that takes the neighbouring head's scale, the neighbouring token's amax or the whole token's
amax saturates or underflows whole rows. Static scales are drawn a little below amax / FMAX (0.7 to 0.9 of it), so each row's largest
values saturate.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol
from kernel_parity.refimpl import kvquant as kq

DISTS = {
    "normal": "N(0, 1) times a level per (token, head): neighbouring heads 10^3-10^4 apart (fp16: 10^1-10^2; gran "
              "head, token), tokens too (gran token); static scales 0.7-0.9 of amax / FMAX (the largest values "
              "saturate)",
    "outliers": "normal with 3 channels (d indices) x100 in every row; static scales calibrated without them, so "
                "they saturate (dynamic scales follow them)",
    "midpoints": "every value x = s * m with m a rounding midpoint of the code grid (ties: round half to even) and "
                 "s = c * 2^k, c in {7, 13, 15} (token gran: set by one element at FMAX * s), so that x / s = m "
                 "exactly while x * (1 / s) misses it; only midpoints whose product is exact in the test dtype",
    "zeros": "normal with about a third of the (token, head) rows all zero (dynamic scale 0, codes 0)",
    "tiny": "|x / s| far below 1: e4m3 2^-12..2^-5 (subnormals, underflow to 0), e5m2 2^-19..2^-13, int8 "
            "0..1.5 (0 and the 0.5 midpoint); token gran: one element a row at FMAX * s sets the scale",
}

# the odd factors of the midpoints' scales: x * float32(1 / s) misses x / s = m for 60% (7), 26% (15) and 8%
# (13) of e4m3's bf16-exact midpoints (3 and 5: never, 3 * float32(1/3) rounds back to 1); gran tensor takes 7
C_SET = (7, 13, 15)
OUTLIER_CHANNELS = 3
OUTLIER_GAIN = 100.0
FP16_TOP = 60000.0


def _levels(rng: np.random.Generator, count: int, lo: float, hi: float) -> np.ndarray:
    """count exponents alternating between the bands [lo, lo + 0.5] and [hi - 0.5, hi] (random phase):
    neighbours at least hi - lo - 1 decades apart."""
    phase = int(rng.integers(0, 2))
    high = (np.arange(count) + phase) % 2 == 1
    return np.where(high, rng.uniform(hi - 0.5, hi, count), rng.uniform(lo, lo + 0.5, count))


def _span(dtype: str) -> float:
    """Half the decades a head's (or token's) level may move: fp16's range is narrow."""
    return 1.0 if dtype == "fp16" else 2.0


def _magnitudes(p: dict[str, Any], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """(n, hkv) levels: neighbouring heads (head, token gran) and tokens (token gran) orders of magnitude apart."""
    n, h, gran, w = p["n"], p["hkv"], p["gran"], _span(dtype)
    e_t = _levels(rng, n, -w, w) if gran == "token" else _levels(rng, n, -0.25, 0.25)
    e_h = _levels(rng, h, -w, w) if gran != "tensor" else np.zeros(h)
    return 10.0 ** (e_t[:, None] + e_h[None, :])


def _static_scales(x: np.ndarray, gran: str, fmt: str, rng: np.random.Generator) -> np.ndarray:
    """fp32 scales a little below amax / FMAX: (1,) for tensor, (hkv,) for head (an all-zero head: 0.7-0.9)."""
    a = np.abs(x.astype(np.float64))
    amax = a.max(axis=(0, 1, 2), keepdims=False)[None] if gran == "tensor" else a.max(axis=(0, 2))
    amax = np.where(amax > 0, amax, kq.FMAX[fmt])
    return (amax / kq.FMAX[fmt] * rng.uniform(0.7, 0.9, amax.shape)).astype(np.float32)


def _midpoints(fmt: str) -> np.ndarray:
    """Every positive rounding midpoint of the format's grid below FMAX (int8: j + 0.5 for j in [0, 126])."""
    if fmt == "int8":
        return np.arange(127) + 0.5
    codes = np.arange(256, dtype=np.uint8).view(kq.STORAGE[fmt]).astype(np.float64)
    vals = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    return (vals[:-1] + vals[1:]) / 2


def _power_scales(p: dict[str, Any], dtype: str, rng: np.random.Generator, c_set: tuple[int, ...]) -> np.ndarray:
    """(n, hkv) float64 scales c * 2^k: k alternating between far-apart bands over heads (and tokens for
    gran token), one scale for the whole tensor for gran tensor."""
    n, h, fmt, gran = p["n"], p["hkv"], p["fmt"], p["gran"]
    if dtype == "fp16":  # x = s * m within fp16: s * FMAX <= 65504, s * the smallest midpoint >= 2^-24
        lo, hi = {"e4m3": (-12, 3), "e5m2": (-7, -4), "int8": (-12, 5)}[fmt]
    else:
        lo, hi = -24, 16
    band = max(1, (hi - lo) // 4)

    def ks(count: int) -> np.ndarray:
        phase = int(rng.integers(0, 2))
        high = (np.arange(count) + phase) % 2 == 1
        return np.where(high, rng.integers(hi - band, hi + 1, count), rng.integers(lo, lo + band + 1, count))

    if gran == "tensor":
        k = np.full((n, h), ks(1)[0])
    elif gran == "head":
        k = np.broadcast_to(ks(h)[None, :], (n, h))
    else:
        k = ks(n)[:, None] + ks(h)[None, :] - (hi + lo) // 2
        k = np.clip(k, lo, hi)
    c = rng.choice(np.array(c_set), size=(1, h) if gran == "head" else (n, h))
    if gran == "tensor":
        c = np.full((1, 1), c_set[0])
    return np.broadcast_to(c * np.exp2(k.astype(np.float64)), (n, h))


def _from_grid(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """midpoints / tiny: (x (n, hkv, d) float64 exact in the dtype, s (n, hkv) float64 the intended scales)."""
    n, h, d, fmt, gran = p["n"], p["hkv"], p["d"], p["fmt"], p["gran"]
    c_set = C_SET
    if gran == "token" and fmt == "int8" and dtype == "bf16":
        c_set = (1,)  # 127 * c is not a bf16 value for c > 1: FMAX * s must be one to set the scale
    s = _power_scales(p, dtype, rng, c_set)
    if dist == "midpoints":
        grid = _midpoints(fmt)
        m = np.empty((n, h, d))
        for c in np.unique(s):  # the midpoints m with c * 2^k * m exact in the dtype (k's range kept)
            ok = grid[dt.round_to(c * grid, dtype).astype(np.float64) == c * grid]
            ok = ok[(np.float32(c) * ok.astype(np.float32)).astype(np.float64) == c * ok]
            if ok.size == 0:
                ok = np.array([1.0])
            sel = s == c
            m[sel] = rng.choice(ok, size=(int(sel.sum()), d))
    else:
        lo, hi = {"e4m3": (-12, -5), "e5m2": (-19, -13), "int8": (-8, 0.58)}[fmt]
        m = np.exp2(rng.uniform(lo, hi, (n, h, d)))
    m *= rng.choice((-1.0, 1.0), size=m.shape)
    if gran == "token":  # one element a row at +-FMAX: the dynamic scale is s exactly
        j = rng.integers(0, d, (n, h))
        np.put_along_axis(m, j[:, :, None], kq.FMAX[fmt] * rng.choice((-1.0, 1.0), (n, h, 1)), axis=2)
    x = dt.round_to(s[:, :, None] * m, dtype).astype(np.float64)
    return x, s


def _cache_codes(fmt: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random finite old codes of the format (the canaries)."""
    codes = np.arange(256, dtype=np.uint8)
    if fmt != "int8":
        codes = codes[np.isfinite(codes.view(kq.STORAGE[fmt]).astype(np.float32))]
    return rng.choice(codes, size=shape).astype(np.uint8).view(kq.STORAGE[fmt])


def _slots(p: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    n, pad = p["n"], p["pad"]
    slots = np.full(n, -1, dtype=np.int64)
    real = rng.permutation(n)[: n - pad]
    slots[np.sort(real)] = rng.choice(p["blocks"] * p["page"], n - pad, replace=False)
    return slots


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n, h, d, fmt, gran = p["n"], p["hkv"], p["d"], p["fmt"], p["gran"]
    cache_shape = (p["blocks"], p["page"], h, d)
    out: dict[str, np.ndarray] = {"slot_mapping": _slots(p, rng)}
    for kv in ("k", "v"):
        out[f"{kv}_cache"] = _cache_codes(fmt, cache_shape, rng)
        if dist in ("midpoints", "tiny"):
            x, s = _from_grid(p, dtype, dist, rng)
            scale = s[0, :1] if gran == "tensor" else s[0]
        else:
            x = rng.standard_normal((n, h, d)) * _magnitudes(p, dtype, rng)[:, :, None]
            if dist == "zeros":
                zero = rng.random((n, h)) < 0.35
                zero[rng.integers(0, n), rng.integers(0, h)] = True
                x[zero] = 0.0
            x = dt.round_to(x, dtype).astype(np.float64)
            scale = _static_scales(x, gran, fmt, rng) if gran != "token" else None
            if dist == "outliers":
                ch = rng.choice(d, min(d, OUTLIER_CHANNELS), replace=False)
                x[:, :, ch] *= OUTLIER_GAIN
                if dtype == "fp16":  # levels up to 10^2 x 100 x a 6-sigma draw: stay below fp16's 65504
                    x = np.clip(x, -FP16_TOP, FP16_TOP)
                x = dt.round_to(x, dtype).astype(np.float64)
        out[f"{kv}_new"] = dt.round_to(x, dtype)
        if gran == "token":
            out[f"{kv}_scale_cache"] = (10.0 ** rng.uniform(-3, 3, cache_shape[:3])).astype(np.float32)
        else:
            out[f"{kv}_scale"] = np.asarray(scale, dtype=np.float32)
    return out


def _ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    from kernel_parity.refimpl.kvquant_update import update

    res = {}
    for kv in ("k", "v"):
        cache, sc = update(np.asarray(x[f"{kv}_cache"]), x[f"{kv}_new"], x["slot_mapping"], fmt=p["fmt"],
                           gran=p["gran"], scale=x.get(f"{kv}_scale"), scale_cache=x.get(f"{kv}_scale_cache"))
        res[f"{kv}_cache"] = cache.view(np.uint8)
        if sc is not None:
            res[f"{kv}_scale_cache"] = sc
    return res


def _shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shape = (p["blocks"], p["page"], p["hkv"], p["d"])
    out = {"k_cache": shape, "v_cache": shape}
    if p["gran"] == "token":
        out.update(k_scale_cache=shape[:3], v_scale_cache=shape[:3])
    return out


def _check(p: dict[str, Any]) -> str | None:
    if p["pad"] > p["n"]:
        return f"pad={p['pad']} padding tokens exceed n={p['n']} (expected pad <= n)"
    if p["n"] - p["pad"] > p["blocks"] * p["page"]:
        return (f"n - pad = {p['n'] - p['pad']} tokens do not fit blocks x page = {p['blocks'] * p['page']} slots "
                f"(expected more blocks)")
    return None


def _scale_cache(name: str):
    return lambda p: name if p["gran"] == "token" else None


UPDATE = OpSpec(
    name="kvquant.update", golden=kq.update, reference=_ref,
    params=Schema(dict(
        n=Int(1, 1 << 17, edges=(1, 2, 256), doc="new tokens (a decode batch, a prefill chunk)"),
        hkv=Int(1, 128, edges=(1, 8)), d=Int(1, 576, edges=(64, 128)),
        page=Int(1, 1024, edges=(16,), doc="slots a cache block (page)"),
        blocks=Int(1, 1 << 20, doc="cache blocks (num_blocks)"),
        pad=Int(0, 1 << 17, edges=(0, 1), doc="tokens of slot -1 (padding, not written)"),
        fmt=OneOf(*kq.FORMATS, doc="cache format: float8 e4m3 / e5m2 (saturating), int8"),
        gran=OneOf("tensor", "head", "token", doc="scale granularity: static per tensor / per kv head, or dynamic "
                   "per (token, head) written to a scale cache"),
    )),
    make_inputs=_inputs,
    output_shapes=_shapes,
    outputs={"k_cache": Output("uint8", exact=True, inplace="k_cache", doc="K codes after the write (bytes)"),
             "v_cache": Output("uint8", exact=True, inplace="v_cache", doc="V codes after the write (bytes)"),
             "k_scale_cache": Output("fp32", exact=True, inplace=_scale_cache("k_scale_cache"),
                                     doc="gran token: K's per-(slot, head) scales after the write"),
             "v_scale_cache": Output("fp32", exact=True, inplace=_scale_cache("v_scale_cache"),
                                     doc="gran token: V's per-(slot, head) scales after the write")},
    tolerance=Tol(noise_k=None), dists=DISTS, check=_check, baseline=None,
    storage_inputs=frozenset({"k_cache", "v_cache", "k_scale_cache", "v_scale_cache", "k_scale", "v_scale"}),
    doc="Quantize-on-append into a paged fp8 (e4m3 / e5m2) or int8 KV cache (vLLM's reshape_and_cache_flash with "
        "k_scale / v_scale): x / s (IEEE fp32), saturate, round to nearest even; static per-tensor / per-head or "
        "dynamic per-token scales (written to a scale cache); slot -1 skipped; bit-exact.",
)

SPECS = (UPDATE,)
