"""Golden GGML block formats: byte-exact quantizers and exact float64 dequantizers.

A row of K elements is K / block consecutive blocks, each a packed little-endian C struct
(OPS.md "quant", research/quant-formats.md §1). Every block stores integer codes and one or two
fp16 scales (Q8_K: a float32 scale); dequantization is

    y = d * c                            q4_0, q5_0, q8_0, q8_1, iq4_nl, q8_k
    y = d * c + m                        q4_1, q5_1
    y = (d * sc_j) * c                   q3_k, q6_k      (j: sub-block of 16)
    y = (d * sc_j) * c - dmin * m_j      q2_k (16), q4_k, q5_k (32)

with the codes c and sub-block scales sc_j, m_j that `block_fields` returns (q4_0: c = q - 8,
q5_0: q - 16, iq4_nl: kvalues_iq4nl[q], q3_k: c in [-4, 3], q6_k: c = q - 32, ...).

Conventions:
- `dequantize` is exact: each product has at most 25 significant bits and each sum spans at most
  51, so float64 holds the real value and `.astype(np.float32)` is the single rounding ggml's
  `dequantize_row_*` makes: bit-identical to it. Arbitrary bytes never raise: NaN/inf fp16 (or
  Q8_K float32) scales propagate by IEEE float64 arithmetic on the same expression, evaluated in
  the same association as ggml's C, so NaN appears exactly where ggml's float32 gives NaN
  (inf * 0 codes, inf - inf) and inf where it gives inf; NaN payload and sign are not specified.
  Float64 never overflows here, float32 can only for Q8_K (|d| > 2.6e36), and the cast gives that
  same inf.
- `quantize` reproduces ggml's reference quantizers `quantize_row_<fmt>_ref` byte for byte: float32
  arithmetic in C's order, sequential sums, C's rounding primitives (`quant_search`), fp16 scales
  rounded to nearest even when stored. It is what `ggml_quantize_chunk` (llama-quantize without an
  imatrix) writes for every format here except iq4_nl, where the chunk path runs a 7-step scale
  search (`quantize_iq4_nl`, ntry = 7) and the `_ref` path does not (ntry = -1).
- Byte-exact means one deliberate deviation: where ggml writes memory it never initialised, the
  golden writes zeros (iq4_nl: the codes of a block with max|x| < 1e-15, whose stored d is 0, are
  left from the previous block or the stack; q8_k: the bsums of an all-zero block).
- Inputs with NaN/inf never raise; their bytes follow the emulated C arithmetic but are not a
  contract (C would hit undefined conversions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl import quant_bits as qb
from kernel_parity.refimpl import quant_kquants as kq
from kernel_parity.refimpl import quant_search as qs
from kernel_parity.refimpl.quant_search import F32
from kernel_parity.refimpl.threads import on_threads, threads

U8 = NDArray[np.uint8]
F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


@dataclass(frozen=True)
class Format:
    """One GGML block format: `block` elements stored in `nbytes` bytes; `vec_dot` is the activation
    format ggml's CPU quantizes the other operand to for a dot product (None: activation format)."""

    name: str
    block: int
    nbytes: int
    vec_dot: str | None


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("q4_0", 32, 18, "q8_0"),
    Format("q4_1", 32, 20, "q8_1"),
    Format("q5_0", 32, 22, "q8_0"),
    Format("q5_1", 32, 24, "q8_1"),
    Format("q8_0", 32, 34, "q8_0"),
    Format("q8_1", 32, 36, None),
    Format("q2_k", 256, 84, "q8_k"),
    Format("q3_k", 256, 110, "q8_k"),
    Format("q4_k", 256, 144, "q8_k"),
    Format("q5_k", 256, 176, "q8_k"),
    Format("q6_k", 256, 210, "q8_k"),
    Format("q8_k", 256, 292, None),
    Format("iq4_nl", 32, 18, "q8_0"),
)}


@dataclass(frozen=True)
class BlockFields:
    """The stored fields of each block, decoded: what an integer dot product works on.

    codes:  (..., nblocks, block) int64, the integer c of the dequantization formula (module doc)
    d:      (..., nblocks) float64, the super-scale (fp16; q8_k: float32)
    m:      (..., nblocks) float64, the added min of q4_1/q5_1, else None
    s:      (..., nblocks) float64, q8_1's stored fp16(d * sum(codes)), else None
    dmin:   (..., nblocks) float64, the min super-scale of q2_k/q4_k/q5_k, else None
    scales: (..., nblocks, nsub) int64, the K-quants' sub-block scales sc_j (q3_k: already minus 32,
            in [-32, 31]; q6_k: int8), else None; sub-block j covers codes[..., j*block/nsub : ...]
    mins:   (..., nblocks, nsub) int64, m_j of q2_k/q4_k/q5_k, else None
    bsums:  (..., nblocks, 16) int64, q8_k's stored sums of 16 consecutive codes, else None
    """

    codes: I64
    d: F64
    m: F64 | None = None
    s: F64 | None = None
    dmin: F64 | None = None
    scales: I64 | None = None
    mins: I64 | None = None
    bsums: I64 | None = None


def _format(fmt: str) -> Format:
    f = FORMATS.get(fmt)
    if f is None:
        raise ValueError(f"unknown quant format {fmt!r}; known formats: {', '.join(FORMATS)}")
    return f


def _blocks(fmt: str, data: NDArray) -> tuple[Format, U8, tuple[int, ...]]:
    """Validate `data` and view it as (B, nbytes) blocks; returns the batch shape (..., nblocks)."""
    f = _format(fmt)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise ValueError(f"{fmt}: data must be uint8 bytes, got {data.dtype}")
    if data.ndim == 0 or data.shape[-1] % f.nbytes:
        n = data.shape[-1] if data.ndim else 0
        raise ValueError(f"{fmt}: byte length {n} is not a multiple of {f.nbytes} "
                         f"(the bytes of one block of {f.block} elements)")
    lead = (*data.shape[:-1], data.shape[-1] // f.nbytes)
    return f, np.ascontiguousarray(data).reshape(-1, f.nbytes), lead


# ---- 32-element formats: fields and dequantization ----------------------------------------------


def _f16(blocks: U8, col: int) -> F64:
    """The fp16 stored at byte offset 2*col of every block, as float64 (exact)."""
    return blocks.view("<f2")[:, col].astype(np.float64)


def _nibbles(qs_: U8) -> qb.W:
    """qs (B, 16) -> (B, 4) words of codes: the low nibble of qs[j] is element j, the high j + 16."""
    return np.concatenate(qb.nibbles(qb.words(qs_)), axis=1)


def _high_bits(qh: U8) -> qb.W:
    """qh (B, 4) bytes of a little-endian u32 -> (B, 4) words, byte e = bit e of qh as 0/0x10."""
    return qb.words(np.unpackbits(qh, axis=-1, bitorder="little")) << np.uint64(4)


def _small_fields(fmt: str, b: U8) -> tuple[NDArray, dict[str, F64]]:
    """(codes (B, 32) int8/uint8, {field: (B,) float64}) of a 32-element format."""
    if fmt == "q4_0":
        return qb.offset_codes(_nibbles(b[:, 2:18]), 4), {"d": _f16(b, 0)}
    if fmt == "iq4_nl":
        return qs.KVALUES_IQ4NL[_nibbles(b[:, 2:18]).view(np.uint8)], {"d": _f16(b, 0)}
    if fmt == "q4_1":
        return _nibbles(b[:, 4:20]).view(np.uint8), {"d": _f16(b, 0), "m": _f16(b, 1)}
    if fmt == "q5_0":
        return qb.offset_codes(_nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6]), 5), {"d": _f16(b, 0)}
    if fmt == "q5_1":
        c = (_nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8])).view(np.uint8)
        return c, {"d": _f16(b, 0), "m": _f16(b, 1)}
    if fmt == "q8_0":
        return b[:, 2:34].view(np.int8), {"d": _f16(b, 0)}
    # q8_1
    return b[:, 4:36].view(np.int8), {"d": _f16(b, 0), "s": _f16(b, 1)}


def _dequantize_small(fmt: str, b: U8) -> F64:
    c, fld = _small_fields(fmt, b)
    y = np.multiply(c, fld["d"][:, None])  # d * c (int8 codes cast in the ufunc loop)
    if "m" in fld:
        y += fld["m"][:, None]
    return y


# ---- public API ----------------------------------------------------------------------------------


def dequantize(fmt: str, data: NDArray) -> F64:
    """Exact float64 values of GGML blocks (formulas in the module docstring).

    fmt:  a key of FORMATS
    data: (..., nblocks * nbytes) uint8, rows of consecutive packed blocks
    returns: (..., nblocks * block) float64; `.astype(np.float32)` is ggml's `dequantize_row_*`
             bit for bit (NaN as positions); any bytes are accepted
    """
    f, b, lead = _blocks(fmt, data)
    if b.shape[0] == 0:
        return np.zeros((*lead[:-1], lead[-1] * f.block))
    with np.errstate(all="ignore"):  # NaN/inf scales from arbitrary bytes follow IEEE
        if f.block == 256:
            y = kq.dequantize(fmt, b)
        else:
            y = _dequantize_small(fmt, b)
    return y.reshape(*lead[:-1], lead[-1] * f.block)


def block_fields(fmt: str, data: NDArray) -> BlockFields:
    """Integer codes and scales of every block (see BlockFields), for emulated integer dot products.

    fmt:  a key of FORMATS
    data: (..., nblocks * nbytes) uint8
    returns: BlockFields with leading shape (..., nblocks); `dequantize` equals the module
             docstring's formula evaluated on these fields in float64
    """
    f, b, lead = _blocks(fmt, data)
    if b.shape[0] == 0:  # one real block gives the fields' trailing shapes
        full = block_fields(fmt, np.zeros(f.nbytes, np.uint8))
        return BlockFields(**{k: None if v is None else np.zeros((*lead, *v.shape[1:]), v.dtype)
                              for k, v in vars(full).items()})
    if f.block == 256:
        c, fld = kq.fields(fmt, b)
    else:
        c, fld = _small_fields(fmt, b)
    out = {k: (v.astype(np.float64) if k in ("d", "m", "s", "dmin") else v.astype(np.int64))
           .reshape(*lead, *v.shape[1:]) for k, v in fld.items()}
    return BlockFields(codes=c.astype(np.int64).reshape(*lead, f.block), **out)


def quantize(fmt: str, x: NDArray) -> U8:
    """ggml's reference quantizer `quantize_row_<fmt>_ref`, byte for byte.

    fmt: a key of FORMATS
    x:   (..., K) float32 (other real dtypes are converted to float32 first), K a multiple of the
         block size
    returns: (..., K // block * nbytes) uint8

    Rounding (research/quant-formats.md §1.4): q4_0/q5_0 truncate x*id + 8.5 (16.5) with the
    unrounded float32 id = 1/d; q4_1/q5_1 truncate (x - min)*id + 0.5; q8_0/q8_1 use roundf (half
    away from zero), q8_1 stores s = fp16(d * sum(q)); iq4_nl picks the nearest table value for
    x / (max / -127) and stores d = fp16(sum w q x / sum w q^2), w = x^2; the K-quants search the
    sub-block scales (make_qkx2_quants, make_q3_quants, make_qx_quants), quantize them against
    the fp16-rounded super-scales and recompute the codes from the stored scales; q8_k rounds
    -127/max * x half to even and stores bsums. Ties to even are `nearest_int`'s.
    """
    f = _format(fmt)
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % f.block:
        k = x.shape[-1] if x.ndim else 0
        raise ValueError(f"{fmt}: K = {k} is not a multiple of the block size {f.block}")
    lead = x.shape[:-1]
    nb = x.shape[-1] // f.block
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, f.block)
    if blocks.shape[0] == 0:
        return np.zeros((*lead, nb * f.nbytes), np.uint8)
    return _by_chunks(fmt, f, blocks).reshape(*lead, nb * f.nbytes)


# Blocks are quantized independently, so a tensor is cut into runs of blocks: a run's float64
# temporaries fit in cache (a models-size weight, Q4_K 14336 x 4096 = 230K super-blocks, quantized
# whole was 3x slower on one core, and memory-bound when every worker does it at once), and runs go
# to threads where the worker has more than one (NumPy releases the GIL in its array loops). The
# same bytes either way.
CHUNK_BLOCKS = 1 << 10


def _by_chunks(fmt: str, f: Any, blocks: NDArray) -> U8:
    def one(b: NDArray) -> U8:
        with np.errstate(all="ignore"):  # per thread: NumPy's error state is thread-local
            return kq.quantize(fmt, b) if f.block == 256 else _quantize_small(fmt, b)

    n = blocks.shape[0]
    step = CHUNK_BLOCKS * (256 // f.block)  # small-block formats: the same bytes per run
    if n <= step:
        return one(blocks)
    return np.concatenate(on_threads(one, [blocks[i:i + step] for i in range(0, n, step)]))


def quantize_x86(fmt: str, x: NDArray) -> U8:
    """The activation quantizer of ggml's CPU backend on x86 AVX/AVX2 (`from_float` of q8_0, q8_1,
    q8_k), which `ggml_mul_mat` applies to the float32 operand; byte for byte.

    q8_0/q8_1 differ from the reference: id = 127/amax (not 1/d), codes rounded half to even
    (`_mm256_round_ps`), q8_1's s = fp16(d * sum(q)) from the same codes. d = fp16(amax/127) as in
    the reference. q8_k is the reference (`quantize_row_q8_K` calls `_ref`).

    fmt: "q8_0", "q8_1" or "q8_k"
    x:   (..., K) float32, K a multiple of the block size
    returns: (..., K // block * nbytes) uint8
    """
    if fmt not in ("q8_0", "q8_1", "q8_k"):
        raise ValueError(f"quantize_x86: {fmt!r} is not an activation format; use q8_0, q8_1 or q8_k")
    if fmt == "q8_k":
        return quantize(fmt, x)
    f = FORMATS[fmt]
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % f.block:
        k = x.shape[-1] if x.ndim else 0
        raise ValueError(f"{fmt}: K = {k} is not a multiple of the block size {f.block}")
    lead, nb = x.shape[:-1], x.shape[-1] // f.block
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, f.block)
    with np.errstate(all="ignore"):
        amax = np.abs(b).max(axis=1) if b.size else np.zeros(0, np.float32)
        d = amax / F32(127)
        idv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(np.float32)
        q = np.clip(np.rint(b * idv[:, None]), -128, 127).astype(np.int8)  # packs saturate
        s = q.astype(np.int32).sum(axis=1).astype(np.float32) * d if fmt == "q8_1" else None
    return _pack_small(fmt, d, q.view(np.uint8), s).reshape(*lead, nb * f.nbytes)


# ---- 32-element formats: quantizers --------------------------------------------------------------


def _pack_small(fmt: str, d: NDArray, codes: U8, second: NDArray | None = None) -> U8:
    """Write blocks: d (and m or s) as fp16 bits, then qh (5-bit formats) and qs."""
    f = FORMATS[fmt]
    out = np.zeros((codes.shape[0], f.nbytes), np.uint8)
    out16 = out.view("<u2")
    out16[:, 0] = qs.fp16_bits(d)
    pos = 2
    if second is not None:
        out16[:, 1] = qs.fp16_bits(second)
        pos = 4
    if fmt in ("q8_0", "q8_1"):
        out[:, pos:] = codes
        return out
    if fmt in ("q5_0", "q5_1"):
        out[:, pos:pos + 4] = np.packbits((codes >> 4) & 1, axis=-1, bitorder="little")
        pos += 4
    lo = codes[:, :16] & 0x0F if fmt.startswith("q5") else codes[:, :16]  # C masks only for Q5
    out[:, pos:] = lo | (codes[:, 16:] << 4)
    return out


def _quantize_small(fmt: str, x: NDArray[np.float32]) -> U8:
    """x: (B, 32) float32 blocks -> (B, nbytes)."""
    if fmt in ("q4_0", "q5_0"):
        half = 8 if fmt == "q4_0" else 16
        _, mx = qs.signed_absmax(x, axis=1)
        d = mx / F32(-half)
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(np.float32)
        q = np.minimum(2 * half - 1, qs.trunc_int8(x * idv[:, None] + F32(half + 0.5)))
        return _pack_small(fmt, d, q.astype(np.uint8))
    if fmt in ("q4_1", "q5_1"):
        nmax = 15 if fmt == "q4_1" else 31
        mn, mx = qs.first_min_max(x, axis=1)
        d = (mx - mn) / F32(nmax)
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(np.float32)
        v = (x - mn[:, None]) * idv[:, None] + F32(0.5)
        q = np.minimum(15, qs.trunc_int8(v)).astype(np.uint8) if nmax == 15 else qs.trunc_uint8(v)
        return _pack_small(fmt, d, q, mn)
    if fmt in ("q8_0", "q8_1"):
        d = np.abs(x).max(axis=1) / F32(127)
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(np.float32)
        q = qs.trunc_int8(qs.roundf(x * idv[:, None]))
        s = None
        if fmt == "q8_1":  # int sum of the stored codes, converted to float, times d
            s = q.astype(np.int32).sum(axis=1).astype(np.float32) * d
        return _pack_small(fmt, d, q.view(np.uint8), s)
    # iq4_nl, the _ref path (ntry = -1): one pass of codes, then the weighted least-squares d
    xt = np.ascontiguousarray(x.T)  # 32, B: element-major for the sequential sums
    amax, mx = qs.signed_absmax(xt)
    idv = F32(1) / (mx / F32(-127))
    L = qs.iq4_nl_index(idv * xt)
    q = qs.KVALUES_IQ4NL[L].astype(np.float32)
    wq = xt * xt * q
    sumqx, sumq2 = qs.seq_sum(wq * xt), qs.seq_sum(wq * q)
    d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(np.float32)
    zero = amax < qs.GROUP_MAX_EPS
    d = np.where(zero, F32(0), d)
    L = np.where(zero, 0, L)  # ggml leaves these codes unwritten; d = 0 makes them meaningless
    return _pack_small("q4_0", d, np.ascontiguousarray(L.T))


# FP8 block scaling, int4 groups, MXFP4 and NVFP4 (refimpl/quant_fp.py), under the family's stem.
# `fp8_quantize` is the golden of the op quant.fp8_quantize (DeepSeek-V3 block scaling).
from kernel_parity.refimpl.quant_fp import (  # noqa: E402
    fp4_unpack, fp8_decode, fp8_dequantize_blocks, fp8_encode, int4_dequantize, int4_quantize, int4_unpack,
    mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_per_tensor_scale, nvfp4_quantize)
from kernel_parity.refimpl.quant_fp import fp8_quantize_blocks as fp8_quantize  # noqa: E402

__all__ = ["FORMATS", "Format", "BlockFields", "dequantize", "quantize", "quantize_x86", "block_fields",
           "fp8_encode", "fp8_decode", "fp8_quantize", "fp8_dequantize_blocks", "int4_quantize", "int4_unpack",
           "int4_dequantize", "mxfp4_quantize", "mxfp4_dequantize", "nvfp4_quantize", "nvfp4_dequantize",
           "nvfp4_per_tensor_scale", "fp4_unpack"]
