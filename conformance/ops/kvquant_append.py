"""kvquant.append_decode (issue 34): one decode step over a quantized paged KV cache, the write path and the read
path fused. Each sequence's new token (k_new, v_new (b, h_kv, d) in the test dtype) is quantized into the cache
at position seq_lens[b] (the length before the append; kvquant.update's rules: e4m3 / e5m2 / int8, static per
tensor / per kv head or dynamic per-(token, head) scales stored in scale caches, bit-exact), and its query q
(b, h_q, d) attends over the seq_lens[b] + 1 keys, the new one read back AS QUANTIZED (refimpl/kvquant_append.py:
vLLM's and FlashInfer's write-then-read order). Golden: kvquant.update's then kvquant.decode_paged's.

Outputs: O (b, h_q, d) in the test dtype, LSE (b, h_q) fp32 (natural log; every sequence has at least its new
key), and in place, bit-exact: k_cache, v_cache as bytes (uint8: float8 bit patterns or int8's two's
complement), for gran "token" the fp32 scale caches.

Limits: the caches bit-exact (kvquant.update's rule). O and LSE: kvquant.decode_paged's tiers as they are
(conformance/ops/attention.py `attention_tolerance`, production tier: bf16 O cos_diff 1e-5 as FlashMLA's test,
fp16 / fp32 the dtype defaults, the calibrated fp32 LSE, O's absolute error against 4 eps max|O|, the error
model's magnitudes; reduction length kv + 1 + d). The golden attends to the dequantized codes the write produced
(the same codes the kernel must write: bit-exact), so the cache's quantization error is not in the comparison,
only the kernel's arithmetic on the codes, as in kvquant.decode_paged. Never widened for a kernel. The eager
baseline (kernels/torch/kvquant_append.py) has attention's baseline tier for O / LSE, bit-exact caches.

Inputs (make_inputs):
- history lengths (`lengths`): "full" (every sequence kv cached tokens) or "ragged": kv, 0 (the new token the
  only key, on a fresh page), page - 1 (the new token on a page's last slot), page (the first slot of a fresh
  page), 1, 2 page - 1, 2 page, kv - 1, kv // 2, then kv (i + 1) / (i + 2), cut to [0, kv];
- pages shuffled (kvquant_decode's layout over seq_lens + 1 tokens: two unused pages, a trap page every unused
  table entry points at); every slot not holding a cached token is poisoned, the new token's slots included
  (NaN codes: e4m3 / e5m2 0x7F, int8 127; NaN token scales): a kernel that attends to the new slot before its
  write lands reads NaN, and a write to a wrong slot leaves a non-NaN where the golden keeps the poison (and the
  right slot's poison in O);
- neighbour separation (kvquant_decode.NEIGHBOUR): magnitude factors by kv-head parity ("tensor", "head") or
  (slot + head) parity ("token"), lo / hi classes >= 64x apart for K and >= 32x for V, V ~16x K; the new rows
  take their slot's factors, so neighbouring heads' static scales (and the new rows' dynamic ones) differ by
  orders of magnitude;
- `normal`: history ~ N(0, 1) x factors quantized at static scales calibrated at CLIP = 0.75 of the amax of the
  history and the new rows (saturated codes, the new rows' largest values saturate too) or dynamic token
  scales; int8 with 1% of its history codes -128; new rows N(0, 1) x factors;
- `grid`: history codes uniform over every finite code (subnormals, saturated, int8 -128), scales factor / FMAX;
  new rows with x / s log-uniform over the whole grid (e4m3 2^-18..1 of FMAX: subnormals and underflow to 0;
  e5m2 2^-32..1; int8 2^-9..1: zeros and the 0.5 midpoints' neighbourhood), 5% of the elements 1.5x past FMAX
  (saturated under static scales);
- `midpoints`: grid history; every new-row value x = s m with m a rounding midpoint of the code grid (ties: half to
  even decides the code) and the new row's scale s = c 2^k, c in {7, 13, 15} (kvquant.update's midpoints: x / s = m
  exactly while x * float32(1 / s) misses it for many), 2^k set by the row's neighbour factor (so the attention is
  conditioned as in the other dists); gran token: one element a row at +-FMAX s makes the dynamic scale s; only
  midpoints whose x is exact in the dtype (bf16 int8 per token: c = 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.ops.kvquant_decode import CLIP, INT8_MIN_SHARE, NAN_CODE, _factors, _grid_codes, _layout
from kernel_parity.conformance.ops.kvquant_update import C_SET, _midpoints
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.refimpl import kvquant as kq
from kernel_parity.refimpl.kvquant_append import append_decode as golden

GRID_OCTAVES = {"e4m3": 18.0, "e5m2": 32.0, "int8": 9.0}  # log2 span of the grid's new-row values below FMAX
GRID_OVER = 0.05  # share of the grid dist's new-row elements 1.5x past FMAX (saturated)

DISTS = {
    "normal": "history N(0, 1) x neighbour factors quantized at calibrated static scales (clipped at 0.75 amax of "
              "history and new rows) or dynamic token scales, int8 with 1% codes -128; new rows N(0, 1) x factors",
    "grid": "history codes uniform over every finite code, scales factor / FMAX; new rows log-uniform over the whole "
            "grid (subnormals, underflow), 5% past FMAX",
    "midpoints": "grid history; every new-row value x = s m with m a rounding midpoint of the code grid and the new "
                 "row's scale s = c 2^k, c in {7, 13, 15} (x / s = m exactly, x * (1 / s) misses it), 2^k near its "
                 "neighbour factor / FMAX; token gran: one element a row at FMAX s sets the scale",
}


def lengths(p: dict[str, Any]) -> np.ndarray:
    """(b,) int32 history lengths (before the append): the module docstring's pattern."""
    b, kv, page = p["b"], p["kv"], p["page"]
    if p["lens"] == "full":
        return np.full(b, kv, dtype=np.int32)
    head = [kv, 0, page - 1, page, 1, 2 * page - 1, 2 * page, kv - 1, kv // 2]
    pat = [head[i] if i < len(head) else (kv * (i + 1)) // (i + 2) for i in range(b)]
    return np.clip(np.asarray(pat, dtype=np.int64), 0, kv).astype(np.int32)


def _new_rows(rng, fn: np.ndarray, d: int, fmt: str, dist: str) -> np.ndarray:
    """(b, h, d) float64 new rows for factors fn (b, h): x / (factor / FMAX) spread as the dist says."""
    b, h = fn.shape
    if dist == "normal":
        return rng.standard_normal((b, h, d)) * fn[..., None]
    mag = np.exp2(-rng.uniform(0.0, GRID_OCTAVES[fmt], (b, h, d)))
    mag = np.where(rng.random((b, h, d)) < GRID_OVER, 1.5, mag)
    return rng.choice((-1.0, 1.0), (b, h, d)) * mag * fn[..., None]


def _midpoint_rows(rng, fn: np.ndarray, d: int, fmt: str, gran: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """midpoints: (x (b, h, d) float64 exact in the dtype where the grid allows, s (b, h) float64 scales c 2^k).

    kvquant.update's midpoints (conformance/ops/kvquant_update.py) at the neighbour factors' magnitudes: the
    attention stays conditioned like the other dists (|K| <= ~2 FMAX s, logits O(1..100))."""
    b, h = fn.shape
    fmax = kq.FMAX[fmt]
    if gran == "tensor":
        c = np.full((b, h), C_SET[0], dtype=np.float64)
    elif gran == "head":
        c = np.broadcast_to(rng.choice(np.array(C_SET, dtype=np.float64), size=(1, h)), (b, h))
    else:
        c = rng.choice(np.array(C_SET, dtype=np.float64), size=(b, h))
        if fmt == "int8" and dtype == "bf16":
            c = np.ones((b, h))  # 127 c is not a bf16 value for c > 1: FMAX s must be one to set the scale
    s = c * np.exp2(np.round(np.log2(fn / (fmax * c))))
    grid = _midpoints(fmt)
    m = np.ones((b, h, d))
    for sv in np.unique(s):  # the midpoints whose x = s m is exact in the dtype (range and mantissa)
        ok = grid[dt.round_to(sv * grid, dtype).astype(np.float64) == sv * grid]
        ok = ok[(np.float32(sv) * ok.astype(np.float32)).astype(np.float64) == sv * ok]
        sel = s == sv
        if ok.size:
            m[sel] = rng.choice(ok, size=(int(sel.sum()), d))
    m *= rng.choice((-1.0, 1.0), size=m.shape)
    if gran == "token":  # one element a row at +-FMAX: the dynamic scale is s exactly
        j = rng.integers(0, d, (b, h))
        np.put_along_axis(m, j[:, :, None], fmax * rng.choice((-1.0, 1.0), (b, h, 1)), axis=2)
    return s[:, :, None] * m, s


def _side(rng, which: str, shape: tuple, live: np.ndarray, new_slots: np.ndarray, p: dict[str, Any], dtype: str,
          dist: str) -> dict[str, np.ndarray]:
    """One of K / V: the cache (codes, poisoned off the history), its scale(s) and the new rows."""
    nb, page, h, d = shape
    fmt, gran = p["fmt"], p["gran"]
    fmax = np.float32(kq.FMAX[fmt])
    f = _factors(rng, which, (nb, page, h), gran)
    fn = f.reshape(nb * page, h)[new_slots].astype(np.float64)  # the new rows take their slot's factors
    if dist != "normal" and gran == "tensor":  # grid, midpoints: the one scale is head 0's factor / FMAX
        fn = np.full_like(fn, float(f[0, 0, 0]))
    if dist == "midpoints":
        x_new, s_new = _midpoint_rows(rng, fn, d, fmt, gran, dtype)
    else:
        x_new = _new_rows(rng, fn, d, fmt, dist)
    new = dt.round_to(x_new, dtype)
    nx = np.asarray(new, dtype=np.float64)
    out: dict[str, np.ndarray] = {f"{which}_new": new}
    if dist == "midpoints":  # grid history under the new rows' static scale (token gran: factor / FMAX)
        codes = _grid_codes(rng, shape, fmt)
        if gran == "token":
            scale = (f / fmax).astype(np.float32)
        else:
            scale = (s_new[0, :1] if gran == "tensor" else s_new[0]).astype(np.float32)
    elif dist == "grid":
        codes = _grid_codes(rng, shape, fmt)
        s = (f / fmax).astype(np.float32)
        scale = s[:1, 0, 0].copy() if gran == "tensor" else s[0, 0, :].copy() if gran == "head" else s
    elif dist == "normal":
        x = rng.standard_normal(shape, dtype=np.float32) * f[..., None]
        ax = np.where(live[..., None, None], np.abs(x), 0.0)
        if gran == "tensor":
            amax = max(float(ax.max()), float(np.abs(nx).max(initial=0.0)), 1e-30)
            scale = np.asarray([amax / fmax * CLIP], dtype=np.float32)
            codes = kq.quantize(x, scale, fmt)
        elif gran == "head":
            amax = np.maximum(np.maximum(ax.max(axis=(0, 1, 3)), np.abs(nx).max(axis=(0, 2), initial=0.0)), 1e-30)
            scale = (amax / fmax * CLIP).astype(np.float32)
            codes = kq.quantize(x, scale[None, None, :, None], fmt)
        else:
            scale = kq.dynamic_scale(x, fmt)
            codes = kq.quantize(x, scale[..., None], fmt)
        if fmt == "int8":
            codes[rng.random(shape) < INT8_MIN_SHARE] = -128
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    codes = np.ascontiguousarray(codes)
    dead = ~live  # the new slots are not live: poisoned until the kernel writes them
    if fmt == "int8":
        codes[dead] = 127
    else:
        codes.view(np.uint8)[dead] = NAN_CODE
    out[f"{which}_cache"] = codes
    if gran == "token":
        sc = np.array(scale, dtype=np.float32)
        sc[dead] = np.nan
        out[f"{which}_scale_cache"] = np.ascontiguousarray(sc)
    else:
        out[f"{which}_scale"] = np.ascontiguousarray(scale, dtype=np.float32)
    return out


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    L = lengths(p)
    page = p["page"]
    q = rng.standard_normal((p["b"], p["hq"], p["d"]))
    table, live = _layout(rng, L + 1, page, p["kv"] + 1)  # pages for history + the new token
    new_slots = table[np.arange(p["b"]), L // page].astype(np.int64) * page + L % page
    live.reshape(-1)[new_slots] = False  # the new slots: poisoned before the write
    shape = (live.shape[0], page, p["hkv"], p["d"])
    out = {"q": dt.round_to(q, dtype), "block_table": table, "seq_lens": L}
    for which in ("k", "v"):
        out.update(_side(rng, which, shape, live, new_slots, p, dtype, dist))
    return out


def _ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    token = p["gran"] == "token"
    res = golden(x["q"], x["k_new"], x["v_new"], np.asarray(x["k_cache"]), np.asarray(x["v_cache"]),
                 x["block_table"], x["seq_lens"], fmt=p["fmt"], gran=p["gran"],
                 k_scale=None if token else x["k_scale"], v_scale=None if token else x["v_scale"],
                 k_scale_cache=x["k_scale_cache"] if token else None,
                 v_scale_cache=x["v_scale_cache"] if token else None, absolute=absolute)
    if absolute:  # the error model of O and the LSE; the caches are bit-exact copies
        return res
    res["k_cache"] = res["k_cache"].view(np.uint8)
    res["v_cache"] = res["v_cache"].view(np.uint8)
    return res


def _shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    nb = int((-(-(lengths(p).astype(np.int64) + 1) // p["page"])).sum()) + 3  # _layout's pages
    shape = (nb, p["page"], p["hkv"], p["d"])
    out = {"o": (p["b"], p["hq"], p["d"]), "lse": (p["b"], p["hq"]), "k_cache": shape, "v_cache": shape}
    if p["gran"] == "token":
        out.update(k_scale_cache=shape[:3], v_scale_cache=shape[:3])
    return out


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    return None


def _keys(p: dict[str, Any]) -> int:
    return int(lengths(p).astype(np.int64).sum()) + p["b"]


def _bytes(p: dict[str, Any]) -> tuple[int, int]:
    """(read, written) by a kernel that reads each cached code and scale once and writes the new rows once."""
    keys = _keys(p) - p["b"]
    el = 2  # q, o and the new rows in bf16 / fp16
    token = p["gran"] == "token"
    scales = 2 * keys * p["hkv"] * 4 if token else 0
    read = 2 * keys * p["hkv"] * p["d"] + scales + p["b"] * (p["hq"] + 2 * p["hkv"]) * p["d"] * el
    written = p["b"] * p["hq"] * (p["d"] * el + 4) + 2 * p["b"] * p["hkv"] * (p["d"] + (4 if token else 0))
    return read, written


def _scale_cache(name: str):
    return lambda p: name if p["gran"] == "token" else None


APPEND_DECODE = OpSpec(
    name="kvquant.append_decode",
    golden=golden,
    reference=_ref,
    magnitude=lambda x, p: _ref(x, p, absolute=True),
    params=Schema(dict(
        b=Int(1, 256, doc="sequences (one new token each)"),
        hq=Int(1, 128, edges=(1, 4, 8, 32), doc="query heads"),
        hkv=Int(1, 128, edges=(1, 2, 8), doc="kv heads (divides hq)"),
        d=Int(1, 256, edges=(64, 128), doc="head dim"),
        kv=Int(0, 1 << 17, edges=(0, 16, 64, 32768), doc="longest history (cached tokens before the append)"),
        lens=OneOf("full", "ragged", doc="every sequence kv, or ragged (0, 1, page - 1, page, 2 page +- ..., kv - 1)"),
        page=OneOf(16, 64, doc="tokens per page"),
        fmt=OneOf(*kq.FORMATS, doc="cache format (refimpl/kvquant.py)"),
        gran=OneOf(*kq.GRANS, doc="scale granularity: static per tensor / per kv head, or dynamic per (slot, kv "
                   "head) written to the scale caches"),
    )),
    make_inputs=_inputs,
    output_shapes=_shapes,
    outputs={"o": Output("test", doc="attention output over history + the new token"),
             "lse": Output("fp32", doc="natural-log LSE of each query head"),
             "k_cache": Output("uint8", exact=True, inplace="k_cache", doc="K codes after the append (bytes)"),
             "v_cache": Output("uint8", exact=True, inplace="v_cache", doc="V codes after the append (bytes)"),
             "k_scale_cache": Output("fp32", exact=True, inplace=_scale_cache("k_scale_cache"),
                                     doc="gran token: K's per-(slot, head) scales after the append"),
             "v_scale_cache": Output("fp32", exact=True, inplace=_scale_cache("v_scale_cache"),
                                     doc="gran token: V's per-(slot, head) scales after the append")},
    tolerance=attention_tolerance(lambda p, out: p["kv"] + 1 + p["d"]),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"k_cache", "v_cache", "k_scale_cache", "v_scale_cache", "k_scale", "v_scale"}),
    flops=lambda p: 4.0 * _keys(p) * p["hq"] * p["d"],
    bytes_moved=_bytes,
    doc="One decode step over a quantized paged KV cache (e4m3 / e5m2 / int8; per-tensor, per-head or per-token "
        "fp32 scales): the new token's K / V quantized into the cache at seq_lens[b] (bit-exact, kvquant.update's "
        "rules) and attended over seq_lens[b] + 1 keys, read back as quantized: O (b, h_q, d), LSE (b, h_q).",
)

SPECS = (APPEND_DECODE,)
