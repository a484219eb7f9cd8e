"""Input building blocks: value draws rounded to the test dtype, padded storage, cloning.

Every draw is float64 from the case's Generator, then rounded to the storage dtype; the
golden sees the rounded values. Padding around a tensor (row-stride padding) holds NaN so a
kernel that reads it produces NaN where the golden has none: a structural failure, not noise.
"""

from __future__ import annotations

import functools
import statistics

import numpy as np

from kernel_parity.conformance import dtypes as dt


QUANTILES = 1 << 16


@functools.lru_cache(maxsize=None)
def normal_quantiles() -> np.ndarray:
    """(65536,) float64 N(0, 1) quantiles at (i + 1/2) / 65536, from Python's statistics.NormalDist
    (the same bits on every machine, unlike a vectorised libm), +-4.3 at the ends."""
    nd = statistics.NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / QUANTILES) for i in range(QUANTILES)])


def table_draw(rng: np.random.Generator, n: int, table: np.ndarray) -> np.ndarray:
    """`n` entries of a 65536-entry `table` (a distribution's quantiles, already rounded to the storage
    dtype), indexed by the 16-bit quarters of the generator's raw 64-bit words. For caches of 10^8-10^9
    values: ~4 ns a value against ~20 for standard_normal then a rounding pass, and no float64 copy."""
    return np.take(table, table_words(rng, n))


def table_words(rng: np.random.Generator, n: int) -> np.ndarray:
    """`table_draw`'s `n` 16-bit indices: consecutive calls with n a multiple of 4 index as one call would."""
    words = rng.bit_generator.random_raw(-(-n // 4)).astype("<u8", copy=False)
    return words.view("<u2")[:n]


def draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float = 1.0) -> np.ndarray:
    """float64 values of one named kind."""
    if kind == "normal":
        return rng.standard_normal(shape) * scale
    if kind == "uniform":
        return rng.uniform(-1.0, 1.0, shape) * scale
    if kind == "small_int":
        return rng.integers(-4, 5, shape).astype(np.float64) * scale
    raise ValueError(f"unknown draw kind {kind!r}")


def padded(values: np.ndarray, pad: int, dtype: dt.DType, fill: float = np.nan) -> np.ndarray:
    """Store `values` (…, n) in a buffer of row length n + pad filled with `fill`; return the view."""
    if pad == 0:
        return np.ascontiguousarray(dt.round_to(values, dtype))
    buf = np.full(values.shape[:-1] + (values.shape[-1] + pad,), fill, dtype=np.float64)
    buf = dt.round_to(buf, dtype)
    view = buf[..., : values.shape[-1]]
    view[...] = dt.round_to(values, dtype)
    return view


def clone(a: np.ndarray) -> np.ndarray:
    """Deep copy that keeps the strides and the padding of a view into a larger buffer."""
    base = a.base if isinstance(a.base, np.ndarray) else None
    if base is None or base.base is not None or not base.flags.c_contiguous:
        return a.copy()
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    b = base.copy()
    return np.ndarray(a.shape, a.dtype, buffer=b, offset=offset, strides=a.strides)


def storage(a: np.ndarray) -> np.ndarray:
    """The whole buffer a view lives in (itself when it owns its data)."""
    base = a.base if isinstance(a.base, np.ndarray) else None
    return base if base is not None and base.base is None and base.flags.c_contiguous else a


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    sa, sb = storage(a), storage(b)
    if sa.nbytes != sb.nbytes:
        return False
    return bool(np.array_equal(np.ascontiguousarray(sa).view(np.uint8), np.ascontiguousarray(sb).view(np.uint8)))
