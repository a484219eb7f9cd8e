"""Test dtypes: names, NumPy storage types, machine epsilon, rounding and ULP distance.

A case's dtype is a short name (`fp32`, `fp16`, `bf16`); inputs are drawn in float64 and
rounded to that storage type, and the golden sees the rounded values (exactly, as float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kernel_parity.conformance.errors import UsageError


@dataclass(frozen=True)
class DType:
    name: str  # canonical short name used in case ids
    np_type: type  # NumPy storage type (ml_dtypes for bf16, fp8, fp4, int4, e8m0)
    torch_name: str | None  # attribute of the torch module (None: torch has no such dtype)
    is_float: bool = True

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.np_type)

    @property
    def _info(self):
        return ml_dtypes.finfo(self.np_type) if self.is_float else ml_dtypes.iinfo(self.np_type)

    @property
    def eps(self) -> float:
        """Machine epsilon (spacing at 1.0) from the library; 0 for integers (exact)."""
        return float(self._info.eps) if self.is_float else 0.0

    @property
    def tiny(self) -> float:
        """Smallest positive normal number (1 for integers)."""
        return float(self._info.tiny) if self.is_float else 1.0

    @property
    def max(self) -> float:
        return float(self._info.max)

    @property
    def bits(self) -> int:
        """Width of a value (4 for int4 / fp4, which numpy stores one to a byte)."""
        return int(self._info.bits)

    @property
    def storage_bits(self) -> int:
        return 8 * self.np.itemsize

    @property
    def poison_is_nan(self) -> bool:
        """True when a NaN pattern no kernel computes by accident exists (16+ bits): one poison
        suffices. For 8- and 4-bit types and integers every pattern is a value a kernel may
        write, so an unwritten element is told apart by a second run under another poison."""
        return self.is_float and self.storage_bits >= 16


_ALL = [
    DType("fp64", np.float64, "float64"),
    DType("fp32", np.float32, "float32"),
    DType("fp16", np.float16, "float16"),
    DType("bf16", ml_dtypes.bfloat16, "bfloat16"),
    DType("fp8e4m3", ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
    DType("fp8e5m2", ml_dtypes.float8_e5m2, "float8_e5m2"),
    DType("e8m0", ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu"),
    DType("fp4e2m1", ml_dtypes.float4_e2m1fn, None),
    DType("int64", np.int64, "int64", is_float=False),
    DType("int32", np.int32, "int32", is_float=False),
    DType("int8", np.int8, "int8", is_float=False),
    DType("uint8", np.uint8, "uint8", is_float=False),
    DType("int4", ml_dtypes.int4, None, is_float=False),
    DType("uint4", ml_dtypes.uint4, None, is_float=False),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
ALIASES = {
    "float64": "fp64", "f64": "fp64", "double": "fp64",
    "float32": "fp32", "f32": "fp32", "float": "fp32",
    "float16": "fp16", "f16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8e4m3", "e4m3": "fp8e4m3", "fp8": "fp8e4m3",
    "float8_e5m2": "fp8e5m2", "e5m2": "fp8e5m2",
    "float8_e8m0fnu": "e8m0", "ue8m0": "e8m0",
    "float4_e2m1fn": "fp4e2m1", "fp4": "fp4e2m1", "e2m1": "fp4e2m1",
}
FLOAT_TEST_DTYPES = ("fp32", "fp16", "bf16")


def get(name: str) -> DType:
    """Look up a dtype by canonical name or alias; UsageError naming the value otherwise."""
    key = ALIASES.get(name, name)
    try:
        return DTYPES[key]
    except KeyError:
        known = ", ".join(DTYPES)
        raise UsageError(f"unknown dtype {name!r} (known: {known}; aliases like float16 work)") from None


def canonical(name: str) -> str:
    return get(name).name


def of_array(a: np.ndarray) -> DType:
    for d in _ALL:
        if a.dtype == d.np:
            return d
    raise ValueError(f"no test dtype for NumPy dtype {a.dtype}")


def round_to(x: np.ndarray, dtype: str | DType) -> np.ndarray:
    """Round float64 values to the storage dtype (round-to-nearest-even)."""
    d = dtype if isinstance(dtype, DType) else get(dtype)
    if not d.is_float:
        return np.asarray(x).astype(d.np)
    with np.errstate(over="ignore"):  # overflow to inf is what rounding does
        return np.asarray(x, dtype=np.float64).astype(d.np)


_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_SINT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
# differences of ordered integers of a width, held exactly by a wider type (64 bits: float64, below)
_DIFF = {8: np.int32, 16: np.int32, 32: np.int64}


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Map IEEE bit patterns to integers whose order is the order of the floats (-0 == +0):
    sign-magnitude to two's complement, (mag ^ s) - s with s = 0 or -1 the sign bit spread by an
    arithmetic shift (no branch, no where). Computed in the storage width, where |mag| < 2^(width-1)
    fits: a bf16 pass then moves 2 bytes an element, not 4 (model-size outputs make this a hot loop)."""
    v = bits.view(_SINT[width])
    s = v >> (width - 1)
    o = v & ((1 << (width - 1)) - 1)
    o ^= s
    o -= s
    return o


def ulp_distance(got: np.ndarray, expected_f64: np.ndarray, dtype: DType) -> np.ndarray:
    """Units in the last place between `got` (storage dtype) and the golden rounded to it.

    Both arrays must hold finite values; returns float64 distances.
    """
    return np.abs(_ulp_diff(got, expected_f64, dtype)).astype(np.float64)


def max_ulp_distance(got: np.ndarray, expected_f64: np.ndarray, dtype: DType,
                     where: np.ndarray | None = None) -> float:
    """max(ulp_distance(...)) without the float64 array of distances (0.0 for no elements).

    where: only the elements where it is True count (0.0 if none), the others left in place rather
    than copied out: `compare` asks this of every chunk of a model-size output."""
    if not np.size(got):
        return 0.0
    diff = _ulp_diff(got, expected_f64, dtype)
    if where is not None:
        skip = ~where
        if skip.any():
            diff[skip] = 0  # a distance's magnitude is >= 0: zeros leave the maximum of the rest as it is
    return float(max(diff.max(), -diff.min()))


def _ulp_diff(got: np.ndarray, expected_f64: np.ndarray, dtype: DType) -> np.ndarray:
    width = dtype.storage_bits
    u = _UINT[width]
    a = _ordered(np.ascontiguousarray(np.asarray(got, dtype=dtype.np)).view(u), width)
    b = _ordered(np.ascontiguousarray(round_to(expected_f64, dtype)).view(u), width)
    if width == 64:  # ordered int64s may be 2^64 apart: subtract in float64, as the distances are returned
        return a.astype(np.float64) - b.astype(np.float64)
    return np.subtract(a, b, dtype=_DIFF[width])
