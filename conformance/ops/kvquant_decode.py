"""kvquant.decode_paged (issue 34): paged decode attention over a quantized KV cache, the read path.

One new token a sequence (q (b, h_q, d) in the test dtype) attends over its cached keys, held as codes of
refimpl/kvquant.py's formats (e4m3, e5m2, int8) with fp32 scales per tensor, per kv head or per (slot, kv head)
(`gran`), in shuffled pages through a block table. The golden (refimpl/kvquant_decode.py) dequantizes exactly
(float64 code x scale) and runs refimpl.attention.decode_paged's float64 math: O (b, h_q, d) in the test dtype,
LSE (b, h_q) fp32, natural log, -inf for a sequence with no key (attention.decode_paged's conventions: GQA
h -> h // (h_q / h_kv), softmax scale 1/sqrt(d)).

What is compared: the kernel's arithmetic on the codes, not the cache's quantization error (the golden reads
the same codes; kvquant.update answers for how they were written). So the limits are attention.decode_paged's
own (conformance/ops/attention.py `attention_tolerance`, production tier: bf16 O cos_diff 1e-5 as FlashMLA's
test, fp16 / fp32 the dtype defaults, the calibrated fp32 LSE, O's absolute error against 4 eps max|O|, the
error model's magnitudes): a dequantized cache is a float cache whose values are exact in bf16 / fp16 / fp32
(an e4m3 / e5m2 / int8 code times an fp32 scale), and a kernel that takes the scales out of its dot products
(logits s_k(j) (q . codes_j), O = sum_j p_j s_v(j) codes_j) rounds no more than a float-cache kernel does.
Never widened for a kernel. The eager baseline (kernels/torch/kvquant_decode.py) has attention's baseline tier.

Inputs (make_inputs):
- pages shuffled (the layout of attention_inputs.paged_cache: a sequence's pages never physically
  adjacent but by chance, two unused pages, a trap page every unused table entry points at); every slot not
  holding a live token is poisoned: NaN codes (e4m3 / e5m2: 0x7F), int8 codes 127, and NaN token scales;
- lengths: `full` (every sequence kv) or `ragged`: kv, 1, page + 1, page - 1, page, kv - 1, 0, kv // 2, 2 page
  + 1, ... (cut to [0, kv]): single-token and empty sequences, page boundaries +-1;
- neighbour separation (NEIGHBOUR): each element's magnitude carries a factor set by the parity of its kv head
  ("tensor", "head") or of (slot in its page + kv head) ("token"), lo / hi classes >= 64x apart for K and >= 32x
  for V, and V as a whole ~16x K: a kernel that reads the neighbouring head's scale, the neighbouring slot's
  scale, or K's scale for V is off by an order of magnitude;
- `normal`: K, V ~ N(0, 1) x the factors, quantized by refimpl.kvquant.quantize: "tensor" / "head" at a static
  scale calibrated at CLIP = 0.75 of amax / FMAX (saturated codes: +-448, +-57344, int8 -128 and 127), "token"
  at dynamic_scale (amax / FMAX), int8 with 1% of its codes set to -128 (a code the read path must take);
- `grid`: codes drawn uniformly over every finite code of the format (subnormals, +-0, saturated, int8 -128),
  scales (factor / FMAX) with the same neighbour classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.refimpl import kvquant as kq
from kernel_parity.refimpl.kvquant_decode import decode_paged as golden

CLIP = 0.75  # a static scale calibrated below amax / FMAX: the largest values saturate
# (log2 lo range, log2 hi range) of the magnitude factors, K and V: neighbours >= 64x (K), >= 32x (V) apart
NEIGHBOUR = {"k": ((-8.0, -6.0), (0.0, 1.0)), "v": ((-4.0, -2.0), (3.0, 5.0))}
INT8_MIN_SHARE = 0.01
NAN_CODE = 0x7F  # NaN in float8_e4m3fn and in float8_e5m2

DISTS = {
    "normal": "K, V ~ N(0, 1) x neighbour factors, quantized at calibrated static scales (clipped at 0.75 amax) or "
              "dynamic token scales; int8 with 1% codes at -128",
    "grid": "codes uniform over every finite code of the format (subnormals, saturated, int8 -128); scales with "
            "the same neighbour factors",
}


def lengths(b: int, kv: int, mode: str, page: int) -> np.ndarray:
    """(b,) int32 cached tokens a sequence: all kv ("full"), or the ragged pattern of the module docstring."""
    if mode == "full":
        return np.full(b, kv, dtype=np.int32)
    head = [kv, 1, page + 1, page - 1, page, kv - 1, 0, kv // 2, 2 * page + 1]
    pat = [head[i] if i < len(head) else (kv * (i + 1)) // (i + 2) for i in range(b)]
    return np.clip(np.asarray(pat, dtype=np.int64), 0, kv).astype(np.int32)


def _factors(rng: np.random.Generator, which: str, shape: tuple[int, int, int], gran: str) -> np.ndarray:
    """(num_blocks, page, h_kv) float32 magnitude factors, lo / hi class by head parity or (slot + head) parity."""
    nb, page, h = shape
    (lo0, lo1), (hi0, hi1) = NEIGHBOUR[which]
    cls = np.broadcast_to(np.arange(h)[None, None, :] % 2, shape)
    if gran == "token":
        cls = (np.arange(page)[None, :, None] + np.arange(h)[None, None, :]) % 2
        cls = np.broadcast_to(cls, shape)
    if gran == "token":
        e = np.where(cls == 1, rng.uniform(hi0, hi1, shape), rng.uniform(lo0, lo1, shape))
    else:  # one factor a head (the same for every slot): the per-head scale follows it
        per_head = np.where(np.arange(h) % 2 == 1, rng.uniform(hi0, hi1, h), rng.uniform(lo0, lo1, h))
        e = np.broadcast_to(per_head[None, None, :], shape)
    return np.exp2(e).astype(np.float32)


def _grid_codes(rng: np.random.Generator, shape: tuple, fmt: str) -> np.ndarray:
    if fmt == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    bits = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(bits.view(kq.STORAGE[fmt]).astype(np.float32))
    return rng.choice(bits[finite], size=shape).view(kq.STORAGE[fmt])


def _cache(rng, which, shape, live, fmt, gran, dist):
    """(codes, scale) of one cache (K or V): codes (num_blocks, page, h_kv, d) of STORAGE[fmt], poisoned where
    not live; scale (1,), (h_kv,) or (num_blocks, page, h_kv) fp32 (NaN where not live)."""
    nb, page, h, d = shape
    f = _factors(rng, which, (nb, page, h), gran)
    fmax = np.float32(kq.FMAX[fmt])
    if dist == "grid":
        codes = _grid_codes(rng, shape, fmt)
        s = (f / fmax).astype(np.float32)
        if gran == "tensor":
            scale = s[:1, 0, 0].copy()
        elif gran == "head":
            scale = s[0, 0, :].copy()
        else:
            scale = s
    elif dist == "normal":
        x = rng.standard_normal(shape, dtype=np.float32) * f[..., None]
        ax = np.where(live[..., None, None], np.abs(x), 0.0)
        if gran == "tensor":
            scale = np.asarray([max(ax.max(), 1e-30) / fmax * CLIP], dtype=np.float32)
            codes = kq.quantize(x, scale, fmt)
        elif gran == "head":
            scale = (np.maximum(ax.max(axis=(0, 1, 3)), 1e-30) / fmax * CLIP).astype(np.float32)
            codes = kq.quantize(x, scale[None, None, :, None], fmt)
        else:
            scale = kq.dynamic_scale(x, fmt)
            codes = kq.quantize(x, scale[..., None], fmt)
            if fmt == "int8":
                codes[rng.random(shape) < INT8_MIN_SHARE] = -128
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    codes = np.ascontiguousarray(codes)
    dead = ~live
    if fmt == "int8":
        codes[dead] = 127
    else:
        codes.view(np.uint8)[dead] = NAN_CODE
    if gran == "token":
        scale = np.array(scale, dtype=np.float32)
        scale[dead] = np.nan
    return codes, np.ascontiguousarray(scale, dtype=np.float32)


def _layout(rng: np.random.Generator, L: np.ndarray, page: int, kv: int):
    """Shuffled pages: (block_table (b, max_pages) int32, live (num_blocks, page) bool)."""
    b = L.size
    max_pages = max(1, -(-kv // page))
    used = [-(-int(n) // page) for n in L]
    nb = sum(used) + 3  # + two unused pages + the trap page
    perm = rng.permutation(nb)
    trap = int(perm[-1])
    table = np.full((b, max_pages), trap, dtype=np.int32)
    live = np.zeros((nb, page), dtype=bool)
    nxt = 0
    for i in range(b):  # the layout only: which physical page holds which logical one
        for blk in range(used[i]):
            phys = int(perm[nxt])
            nxt += 1
            table[i, blk] = phys
            live[phys, : min(page, int(L[i]) - blk * page)] = True
    return table, live


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    L = lengths(p["b"], p["kv"], p["lens"], p["page"])
    q = rng.standard_normal((p["b"], p["hq"], p["d"]))
    table, live = _layout(rng, L, p["page"], p["kv"])
    shape = (live.shape[0], p["page"], p["hkv"], p["d"])
    kc, ks = _cache(rng, "k", shape, live, p["fmt"], p["gran"], dist)
    vc, vs = _cache(rng, "v", shape, live, p["fmt"], p["gran"], dist)
    return {"q": dt.round_to(q, dtype), "k_cache": kc, "v_cache": vc, "k_scale": ks, "v_scale": vs,
            "block_table": table, "seq_lens": L}


def _ref(x: dict[str, np.ndarray], p: dict[str, Any], absolute: bool = False) -> dict[str, np.ndarray]:
    o, lse = golden(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["block_table"],
                    x["seq_lens"], absolute=absolute)
    return {"o": o, "lse": lse}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    if p["kv"] < 1:
        return f"kv={p['kv']} must be >= 1 (the longest sequence)"
    return None


def _bytes(p: dict[str, Any]) -> tuple[int, int]:
    """(read, written) by a kernel that reads each live code and scale once: the decode's read ceiling."""
    keys = int(lengths(p["b"], p["kv"], p["lens"], p["page"]).sum())
    el = 2  # q and o in bf16 / fp16
    scales = 2 * keys * p["hkv"] * 4 if p["gran"] == "token" else 0
    return 2 * keys * p["hkv"] * p["d"] + scales + p["b"] * p["hq"] * p["d"] * el, \
        p["b"] * p["hq"] * (p["d"] * el + 4)


DECODE_PAGED = OpSpec(
    name="kvquant.decode_paged",
    golden=golden,
    reference=_ref,
    magnitude=lambda x, p: _ref(x, p, absolute=True),
    params=Schema(dict(
        b=Int(1, 256, doc="sequences (one new token each)"),
        hq=Int(1, 128, edges=(1, 4, 8, 32), doc="query heads"),
        hkv=Int(1, 128, edges=(1, 2, 8), doc="kv heads (divides hq)"),
        d=Int(1, 256, edges=(64, 128), doc="head dim"),
        kv=Int(1, 1 << 17, edges=(16, 64, 32768), doc="longest cached sequence"),
        lens=OneOf("full", "ragged", doc="every sequence kv, or ragged (0, 1, page +- 1, kv - 1, ...)"),
        page=OneOf(16, 64, doc="tokens per page"),
        fmt=OneOf(*kq.FORMATS, doc="code format (refimpl/kvquant.py)"),
        gran=OneOf(*kq.GRANS, doc="scale granularity: per tensor, per kv head, per (slot, kv head)"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"o": (p["b"], p["hq"], p["d"]), "lse": (p["b"], p["hq"])},
    outputs={"o": Output("test", doc="attention output"),
             "lse": Output("fp32", doc="natural-log LSE of each query head; -inf for a sequence with no key")},
    tolerance=attention_tolerance(lambda p, out: p["kv"] + p["d"]),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"k_cache", "v_cache"}),
    flops=lambda p: 4.0 * float(lengths(p["b"], p["kv"], p["lens"], p["page"]).sum()) * p["hq"] * p["d"],
    bytes_moved=_bytes,
    doc="Paged decode over a quantized KV cache (e4m3 / e5m2 / int8 codes; per-tensor, per-head or per-token fp32 "
        "scales): O (b, h_q, d), LSE (b, h_q), as attention.decode_paged on the exactly dequantized cache.",
)

SPECS = (DECODE_PAGED,)

