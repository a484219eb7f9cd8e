"""Op specs of the quantization family (stem `quant`): GGML block formats and FP8 block scaling.

- `quant.dequantize`  GGML bytes -> float32, bit-exact: the golden is exact in float64 and a
                      kernel's float32 is one rounding of it (ggml's `dequantize_row_*`); NaN and
                      inf from NaN/inf fp16 scales of random bytes are part of the answer
- `quant.quantize`    float32 -> GGML bytes, byte-exact with ggml's reference quantizers
- `quant.fp8_quantize` DeepSeek-V3 block scaling: x -> (e4m3 codes, float32 scales per block),
                      bit-exact

Byte layouts, rounding rules and the formats' vec_dot pairing: OPS.md (quant) and
research/quant-formats.md; the goldens' docstrings in refimpl/quant.py and refimpl/quant_fp.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.quant  # noqa: F401  (refimpl.quant below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol

GGML = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "iq4_nl")

# Byte offsets of each block's fp16 scale fields (d, and m / dmin / s where the format has one);
# q8_k's d is float32 at offset 0. Random bytes get these overwritten with chosen values.
FP16_FIELDS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q8_1": (0, 2),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,),
}

DEQUANT_DISTS = {
    "quantized": "bytes of N(0, 1) rows quantized by the golden quantizer",
    "random": "uniform random bytes with finite fp16 scales of either sign (subnormals included)",
    "special": "random bytes whose scale fields are NaN, +-inf, +-0 or subnormal in some blocks",
    "blockscale": "bytes of `blockscale` rows (QUANT_DISTS) quantized by the golden quantizer: every block's "
                  "d / dmin and every sub-block's scale and min differ from their neighbours'",
}

QUANT_DISTS = {
    "normal": "N(0, 1)",
    "mixed": "rows of: zeros, small integers, rounding ties (Q8 blocks of (k + 1/2) / 4 with amax 127/4), "
             "N(0,1) x 1e-6, x 1e4, Student-t(2) heavy tails, N(0,1) x 1e15 (the K-quant searches' float32 "
             "sums overflow), all-positive |N(0,1)| + 1/2 (a sub-block minimum above 0)",
    "outlier": "N(0, 1) with one element per block 50x larger (a block's scale set by one value)",
    "blockscale": "N(0, 1) x 10^(u + v): u ~ U(-2, 2) per block (32 or 256 elements), v ~ U(-1, 0) per 16 "
                  "elements, so every block's scale and every K-quant sub-block's scale and min differ from "
                  "their neighbours' (a kernel that reads a neighbour's is off by up to 10^4)",
}


def decade_factors(rng: np.random.Generator, rows: int, k: int, coarse: int, fine: int,
                   span: float = 4.0) -> np.ndarray:
    """(rows, k) factors 10^(u + v): u ~ U(-span / 2, span / 2) per run of `coarse` elements of a
    row, v ~ U(-1, 0) per run of `fine` (0: none). Neighbouring blocks of `coarse` elements differ
    by up to 10^span, neighbouring sub-blocks inside one by up to 10x (little enough that a K-quant's
    6-bit (Q2_K: 4-bit) sub-block scales, relative to the block's largest, stay nonzero)."""
    u = rng.uniform(-span / 2, span / 2, (rows, -(-k // coarse)))
    f = np.repeat(u, coarse, 1)[:, :k]
    if fine:
        f = f + np.repeat(rng.uniform(-1.0, 0.0, (rows, -(-k // fine))), fine, 1)[:, :k]
    return 10.0 ** f


def block_of(fmt: str) -> int:
    return refimpl.quant.FORMATS[fmt].block


def _row_bytes(fmt: str, k: int) -> int:
    f = refimpl.quant.FORMATS[fmt]
    return k // f.block * f.nbytes


def _check_k(p: dict[str, Any]) -> str | None:
    b = block_of(p["fmt"])
    if p["k"] % b:
        return f"k={p['k']} is not a multiple of {p['fmt']}'s block of {b} elements"
    return None


def quant_rows(rng: np.random.Generator, rows: int, k: int, dist: str, block: int) -> np.ndarray:
    """(rows, k) float32 values of one of QUANT_DISTS."""
    x = rng.standard_normal((rows, k))
    if dist == "outlier":
        nb = k // block
        pos = rng.integers(0, block, (rows, nb)) + np.arange(nb) * block
        np.put_along_axis(x, pos, np.take_along_axis(x, pos, 1) * 50.0, 1)
    elif dist == "mixed":
        kinds = np.arange(rows) % 8
        x[kinds == 0] = 0.0
        x[kinds == 1] = rng.integers(-8, 9, (int((kinds == 1).sum()), k))
        x[kinds == 2] = tie_rows(rng, int((kinds == 2).sum()), k)
        x[kinds == 3] *= 1e-6
        x[kinds == 4] *= 1e4
        x[kinds == 5] = rng.standard_t(2, (int((kinds == 5).sum()), k))
        x[kinds == 6] *= 1e15
        x[kinds == 7] = np.abs(x[kinds == 7]) + 0.5
    elif dist == "blockscale":
        x *= decade_factors(rng, rows, k, block, 16)
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return x.astype(np.float32)


def tie_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """(rows, k) values whose Q8_0 / Q8_1 codes are all rounding ties: every 32-block holds one
    +-127/4 (so d = amax / 127 = 1/4 exactly) and (j + 1/2) / 4 elsewhere (x / d = j + 1/2). Half
    away from zero and half to even then differ on about half the elements."""
    x = (rng.integers(-126, 126, (rows, k)) + 0.5) / 4.0
    x[:, ::32] = 127.0 / 4.0 * rng.choice([-1.0, 1.0], (rows, -(-k // 32)))
    return x


def random_blocks(rng: np.random.Generator, fmt: str, rows: int, k: int, special: bool) -> np.ndarray:
    """(rows, bytes) random blocks; scale fields finite (special=False) or sometimes NaN/inf/0."""
    f = refimpl.quant.FORMATS[fmt]
    nb = k // f.block
    data = rng.integers(0, 256, (rows, nb, f.nbytes), dtype=np.uint8)
    if fmt == "q8_k":
        d = (rng.uniform(0.5, 1.0, (rows, nb)) * 2.0 ** rng.integers(-12, 0, (rows, nb))).astype(np.float32)
        if special:
            pick = rng.random((rows, nb)) < 0.3
            d[pick] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, 1e-42], dtype=np.float32), int(pick.sum()))
        data[..., 0:4] = d[..., None].view(np.uint8).reshape(rows, nb, 4)
        return data.reshape(rows, nb * f.nbytes)
    for off in FP16_FIELDS[fmt]:
        mag = rng.uniform(0.5, 1.0, (rows, nb)) * 2.0 ** rng.integers(-24, 0, (rows, nb))
        v = (mag * rng.choice([-1.0, 1.0], (rows, nb))).astype(np.float16)
        if special:
            pick = rng.random((rows, nb)) < 0.3
            v[pick] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6e-8], dtype=np.float16), int(pick.sum()))
        data[..., off:off + 2] = v[..., None].view(np.uint8).reshape(rows, nb, 2)
    return data.reshape(rows, nb * f.nbytes)


def _dequant_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    fmt, rows, k = p["fmt"], p["rows"], p["k"]
    if dist in ("quantized", "blockscale"):
        data = refimpl.quant.quantize(fmt, quant_rows(rng, rows, k, "normal" if dist == "quantized" else dist,
                                                      block_of(fmt)))
    elif dist in ("random", "special"):
        data = random_blocks(rng, fmt, rows, k, special=dist == "special")
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return {"data": np.ascontiguousarray(data)}


def _dequant_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        return {"y": refimpl.quant.dequantize(p["fmt"], inputs["data"])}


def _quant_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": quant_rows(rng, p["rows"], p["k"], dist, block_of(p["fmt"]))}


def _quant_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"q": refimpl.quant.quantize(p["fmt"], inputs["x"].astype(np.float32)).astype(np.float64)}


_GGML_PARAMS = dict(
    fmt=OneOf(*GGML, doc="GGML block format"),
    rows=Int(1, 1 << 20, doc="rows (each quantized independently)"),
    k=Int(1, 1 << 20, edges=(32, 256, 4096), doc="elements per row, a multiple of the block"),
)

DEQUANTIZE = OpSpec(
    name="quant.dequantize",
    golden=refimpl.quant.dequantize,
    reference=_dequant_ref,
    params=Schema(dict(_GGML_PARAMS)),
    make_inputs=_dequant_inputs,
    output_shapes=lambda p: {"y": (p["rows"], p["k"])},
    outputs={"y": Output("fp32", exact=True, nan_bits=False,
                         doc="the float32 rounding of the exact value (ggml's dequantize_row_*)")},
    tolerance=Tol(noise_k=None),
    dtypes=("fp32",),
    dists=DEQUANT_DISTS,
    check=_check_k,
    doc="GGML block bytes -> float32 values, one rounding of the exact dequantized value.",
)

QUANTIZE = OpSpec(
    name="quant.quantize",
    golden=refimpl.quant.quantize,
    reference=_quant_ref,
    params=Schema(dict(_GGML_PARAMS)),
    make_inputs=_quant_inputs,
    output_shapes=lambda p: {"q": (p["rows"], _row_bytes(p["fmt"], p["k"]))},
    outputs={"q": Output("uint8", exact=True, doc="the blocks ggml's reference quantizer writes")},
    tolerance=Tol(noise_k=None),
    dtypes=("fp32",),
    dists=QUANT_DISTS,
    check=_check_k,
    baseline=None,
    backends=("cpu",),
    doc="float32 rows -> GGML block bytes, byte-exact with ggml's quantize_row_*_ref.",
)


# -- FP8 block scaling (DeepSeek-V3) ----------------------------------------------------------------
FP8_DISTS = {
    "normal": "N(0, 1)",
    "outlier": "N(0, 1) with a 100x value in some blocks (one value sets the block's scale)",
    "zeros": "N(0, 1) with some all-zero blocks (the 1e-4 amax floor keeps their scale finite)",
    "wide": "N(0, 1) x 2^U(-20, 20) per block (fp16: 2^U(-12, 8)): scales across the e4m3 and ue8m0 ranges",
}


def _fp8_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    m, k, bm, bk = p["m"], p["k"], p["bm"], p["bk"]
    x = rng.standard_normal((m, k))
    gm, gk = -(-m // bm), -(-k // bk)
    if dist == "outlier":
        hit = rng.random((gm, gk)) < 0.3
        rows = np.minimum(np.arange(gm) * bm + rng.integers(0, bm, gm), m - 1)
        cols = np.minimum(np.arange(gk) * bk + rng.integers(0, bk, gk), k - 1)
        sel = np.argwhere(hit)
        x[rows[sel[:, 0]], cols[sel[:, 1]]] *= 100.0
    elif dist in ("zeros", "wide"):
        per = np.repeat(np.repeat(rng.random((gm, gk)), bm, 0), bk, 1)[:m, :k]
        if dist == "zeros":
            x[per < 0.3] = 0.0
        else:  # fp16 holds 2^-24 .. 65504: a narrower exponent range keeps every value finite
            lo, hi = (-12, 8) if dtype == "fp16" else (-20, 20)
            x *= 2.0 ** np.floor(lo + per * (hi - lo))
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return {"x": dt.round_to(x, dtype)}


def _fp8_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    q, s = refimpl.quant.fp8_quantize(inputs["x"], p["bm"], p["bk"], scale_ub=p["ub"] or None,
                                      scale_fmt=p["sfmt"])
    return {"q": q.astype(np.float64), "scale": s.astype(np.float64)}


FP8_QUANTIZE = OpSpec(
    name="quant.fp8_quantize",
    golden=refimpl.quant.fp8_quantize,
    reference=_fp8_ref,
    params=Schema(dict(
        m=Int(1, 1 << 20, doc="rows (tokens, or weight rows)"),
        k=Int(1, 1 << 20, edges=(128, 7168), doc="columns (channels)"),
        bm=OneOf(1, 128, doc="block rows: 1 = per-token activation groups, 128 = weight blocks"),
        bk=OneOf(32, 64, 128, doc="block columns"),
        sfmt=OneOf("fp32", "ue8m0", doc="scale format: float32, or a power of two rounded up"),
        ub=OneOf(0, 1200, doc="scale upper bound on amax (MAX's dynamic activation scales), 0: none"),
    )),
    make_inputs=_fp8_inputs,
    output_shapes=lambda p: {"q": (p["m"], p["k"]),
                             "scale": (-(-p["m"] // p["bm"]), -(-p["k"] // p["bk"]))},
    outputs={"q": Output("fp8e4m3", exact=True, doc="x / scale rounded to e4m3 (RNE, saturating)"),
             "scale": Output("fp32", exact=True, doc="max(amax, 1e-4) [min ub] / 448 per block")},
    tolerance=Tol(noise_k=None),
    dtypes=("bf16", "fp32", "fp16"),
    dists=FP8_DISTS,
    baseline=None,
    backends=("triton", "torch"),
    doc="DeepSeek-V3 block scaling to float8 e4m3 with one float32 scale per (bm x bk) block.",
)

SPECS = (DEQUANTIZE, QUANTIZE, FP8_QUANTIZE)
