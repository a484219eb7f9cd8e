"""Golden quantized KV caches (issue 34): the cache formats, and the family's ops (re-exported below).

    codes  = Q(float32(x) / float32(s))          the write path (quantize on append)
    x^     = float64(codes) * float64(s)         the read path (dequantize inside the attention), exact

Formats (`fmt`), the code grid Q and its largest magnitude FMAX:
- "e4m3": float8_e4m3fn, FMAX 448: clamp to +-448, then round to nearest even (vLLM's
  `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, E4M3)`, FlashInfer's, TensorRT-LLM's);
- "e5m2": float8_e5m2, FMAX 57344, the same with e5m2's grid;
- "int8": int8, FMAX 127: round half to even (`nearbyint`), then clamp to [-128, 127] (vLLM's
  `float_to_int8_rn`).
Scale granularities (`gran`), the scale of a cached element (slot, head, dim):
- "tensor": one fp32 scale for all of K (k_scale) and one for V (v_scale), static (calibrated; vLLM's
  and TensorRT-LLM's k_scale / v_scale, FlashInfer's);
- "head": one static fp32 scale per kv head, (h_kv,);
- "token": one fp32 scale per (slot, kv head), dynamic: computed on append as s = float32(amax over the
  head's d values) / FMAX (an IEEE float32 division), stored beside the codes in a scale cache
  (num_blocks, page, h_kv). A row of zeros has s = 0 and codes 0 (no division by zero).
x / s is the IEEE float32 division (correctly rounded), so the codes are bit-exact functions of the
float32 inputs: a kernel that multiplies by a float32 reciprocal instead differs at some elements.
The dequantization is exact in float64 (an e4m3 / e5m2 / int8 code times a float32 scale).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]

FORMATS = ("e4m3", "e5m2", "int8")
GRANS = ("tensor", "head", "token")
FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
STORAGE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "int8": np.int8}


def _fmt(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"kvquant: fmt={fmt!r} must be one of {', '.join(FORMATS)}")
    return fmt


def quantize(x: NDArray, scale: NDArray | float, fmt: str) -> NDArray:
    """Codes of x (any float array) at `scale` (float32, broadcast against x): Q(float32(x) / float32(s)).

    Returns an array of STORAGE[fmt] (float8_e4m3fn, float8_e5m2 or int8). Where s == 0 the code is 0."""
    fmt = _fmt(fmt)
    x32 = np.asarray(x, dtype=np.float32)
    s32 = np.broadcast_to(np.asarray(scale, dtype=np.float32), x32.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s32 == 0, np.float32(0), x32 / np.where(s32 == 0, np.float32(1), s32)).astype(np.float32)
    if fmt == "int8":
        return np.clip(np.rint(v), -128, 127).astype(np.int8)
    return np.clip(v, -FMAX[fmt], FMAX[fmt]).astype(STORAGE[fmt])


def dynamic_scale(x: NDArray, fmt: str, axis: int = -1) -> F32:
    """The "token" granularity's scale: float32(amax of x along `axis`) / FMAX, an IEEE float32 division."""
    fmt = _fmt(fmt)
    amax = np.max(np.abs(np.asarray(x, dtype=np.float32)), axis=axis)
    return (amax / np.float32(FMAX[fmt])).astype(np.float32)


def dequantize(codes: NDArray, scale: NDArray | float) -> F64:
    """float64(codes) * float64(scale), exact (scale broadcast against the codes)."""
    return np.asarray(codes).astype(np.float64) * np.asarray(scale, dtype=np.float64)


# The family's ops live in their own modules, re-exported here: refimpl.kvquant.<op> is the golden
from kernel_parity.refimpl.kvquant_update import update  # noqa: E402,F401  (kvquant.update)
from kernel_parity.refimpl.kvquant_decode import decode_paged  # noqa: E402,F401  (kvquant.decode_paged)
from kernel_parity.refimpl.kvquant_mla import mla_sparse  # noqa: E402,F401  (kvquant.mla_sparse)
from kernel_parity.refimpl.kvquant_prefill import chunked_prefill  # noqa: E402,F401  (kvquant.chunked_prefill)
from kernel_parity.refimpl.kvquant_append import append_decode  # noqa: E402,F401  (kvquant.append_decode)
from kernel_parity.refimpl.kvquant_mla_dense import mla_decode, mla_pack  # noqa: E402,F401  (kvquant.mla_decode, mla_pack)
from kernel_parity.refimpl.kvquant_split import decode, decode_split  # noqa: E402,F401  (kvquant.decode, decode_split)
