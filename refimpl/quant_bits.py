"""Unpacking GGML code bytes eight at a time (SWAR on uint64 words), for the dequantizers' speed.

A block's packed codes are viewed as little-endian uint64 words: byte i of a word is byte i of
memory, so a per-byte mask or shift applied to the word (with the mask repeated in every byte,
`rep(m)`) acts on eight codes at once and never carries across bytes. The results are viewed back
as uint8/int8 codes in element order. Why: the uint8 passes would otherwise cost as much as the
float64 products of the dequantization itself.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

W = NDArray[np.uint64]


def rep(byte: int) -> np.uint64:
    """The word holding `byte` in each of its 8 bytes."""
    return np.uint64(0x0101010101010101 * byte)


def words(b: NDArray[np.uint8]) -> W:
    """(B, 8n) bytes (any strides) -> (B, n) little-endian uint64 words (a contiguous copy)."""
    return np.ascontiguousarray(b).view("<u8")


def nibbles(q: W) -> tuple[W, W]:
    """(low, high) nibbles of every byte of q, each in the low half of its byte."""
    return q & rep(0x0F), (q >> np.uint64(4)) & rep(0x0F)


def bit_planes(q: W, nbits: int, count: int) -> W:
    """Fields of `nbits` bits at bits nbits*t of every byte, t = 0..count-1.

    q: (..., n) words -> (..., count, n): plane t holds (byte >> nbits*t) & (2^nbits - 1) per byte
    """
    n = q.shape[-1]
    # a full (count, n) shift table and contiguous copies of q: the ufunc loops then run over
    # count * n elements per block instead of n (broadcasting would run NumPy's inner loop per n)
    shifts = np.repeat(np.arange(count, dtype=np.uint64) * np.uint64(nbits), n).reshape(count, n)
    planes = np.repeat(q[..., None, :], count, axis=-2)
    planes >>= shifts
    planes &= rep((1 << nbits) - 1)
    return planes


def offset_codes(c: W, bits: int) -> NDArray[np.int8]:
    """Bytes c in [0, 2^bits) -> int8 c - 2^(bits-1), eight at a time: c ^ sign is c - 2^(bits-1)
    modulo 2^bits, then the sign bit is copied into the bits above it (no byte overflows)."""
    sign = 1 << (bits - 1)
    v = c ^ rep(sign)
    v |= (v & rep(sign)) * np.uint64((256 - 2 * sign) // sign)
    return v.view(np.int8)
