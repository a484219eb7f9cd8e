"""Native CPU split-KV (flash-decoding) merge of partial attention states (kernel in combine.c).

    M   = max_i LSE_i
    LSE = M + ln sum_i exp(LSE_i - M)
    O   = sum_i exp(LSE_i - LSE) O_i

o_parts: (splits, rows, d_v) float32, float16 or bfloat16; last-axis stride 1 element, split and
         row strides any whole number of elements
lse_parts: (splits, rows) float32, natural log, -inf for an empty split; any strides
out: (rows, d_v) o_parts' dtype, last-axis stride 1, row stride >= d_v; allocated when None
out_lse: (rows,) float32, any stride; allocated when None

Conventions: fp32 accumulation, one RNE rounding on store. An empty split's O may hold NaN or
garbage and is never read; a row with every split empty gives O = 0, LSE = -inf. Outputs may not
overlap the inputs. Strided inputs are used as they are: a last-axis stride != 1 raises instead of
copying.

Backward (lse_combine_backward): with w_i = exp(LSE_i - LSE), dO_i = w_i dO and
dLSE_i = w_i (dO . (O_i - O) + dLSE), from the splits' states and the cotangents do (rows, d_v)
in o_parts' dtype and dlse (rows,) float32; the weights and dO . O are rebuilt from the splits, so
the merged outputs are not needed. An empty split's gradients are exact zeros.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                element_strides, load, unit_last_strides)

__all__ = ["lse_combine", "lse_combine_backward"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_F32 = np.dtype(np.float32)
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("combine")
        lib.lse_combine_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR,
                                           _I64, _PTR, _I64, _I64, _I64, _I64]
        lib.lse_combine_kernel.restype = ctypes.c_int
        lib.lse_combine_backward_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR,
                                                    _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64,
                                                    _I64, _I64, _I64]
        lib.lse_combine_backward_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def lse_combine(o_parts: np.ndarray, lse_parts: np.ndarray, *, out: np.ndarray | None = None,
                out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge `splits` partial states along the leading axis; returns (out, out_lse)."""
    check_array("o_parts", o_parts, 3, "(splits, rows, d_v)", tuple(DTYPE_CODES))
    check_array("lse_parts", lse_parts, 2, "(splits, rows)", (_F32,))
    splits, rows, d_v = o_parts.shape
    if lse_parts.shape != (splits, rows):
        raise ValueError(f"lse_parts shape must be (splits, rows) = {(splits, rows)} to match "
                         f"o_parts {o_parts.shape}, got {lse_parts.shape}")
    stride_o_split, stride_o_row, stride_o_col = element_strides("o_parts", o_parts)
    if d_v > 1 and o_parts.size > 0 and stride_o_col != 1:
        raise ValueError(f"o_parts last-axis stride must be 1 element, got {stride_o_col} "
                         f"(strides {o_parts.strides} bytes); no copy is made")
    stride_lse_split, stride_lse_row = element_strides("lse_parts", lse_parts)

    if out is None:
        out = np.empty((rows, d_v), dtype=o_parts.dtype)
    check_output("out", out, (rows, d_v), o_parts.dtype, "(rows, d_v)")
    stride_out_row, stride_out_col = element_strides("out", out)
    if d_v > 1 and out.size > 0 and stride_out_col != 1:
        raise ValueError(f"out last-axis stride must be 1 element, got {stride_out_col} "
                         f"(strides {out.strides} bytes)")
    if rows > 1 and out.size > 0 and stride_out_row < d_v:
        raise ValueError(f"out row stride must be >= d_v = {d_v} elements, got {stride_out_row} "
                         f"(strides {out.strides} bytes)")
    if out_lse is None:
        out_lse = np.empty(rows, dtype=np.float32)
    check_output("out_lse", out_lse, (rows,), _F32, "(rows,)")
    (stride_out_lse,) = element_strides("out_lse", out_lse)
    for name, a, others in (("out", out, (o_parts, lse_parts)),
                            ("out_lse", out_lse, (o_parts, lse_parts, out))):
        if any(np.may_share_memory(a, b) for b in others):
            raise ValueError(f"{name} overlaps an input or the other output")
    if rows == 0:
        return out, out_lse

    status = _kernels().lse_combine_kernel(
        dtype_code(o_parts.dtype), o_parts.ctypes.data, stride_o_split, stride_o_row,
        lse_parts.ctypes.data, stride_lse_split, stride_lse_row, out.ctypes.data, stride_out_row,
        out_lse.ctypes.data, stride_out_lse, splits, rows, d_v)
    check_status(status, "lse_combine_kernel")
    return out, out_lse


def lse_combine_backward(o_parts: np.ndarray, lse_parts: np.ndarray, do: np.ndarray, dlse: np.ndarray, *,
                         out: np.ndarray | None = None, out_dlse: np.ndarray | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of lse_combine: returns (out (splits, rows, d_v) in o_parts' dtype, out_dlse
    (splits, rows) float32); both outputs any strides with a unit last axis for out."""
    check_array("o_parts", o_parts, 3, "(splits, rows, d_v)", tuple(DTYPE_CODES))
    check_array("lse_parts", lse_parts, 2, "(splits, rows)", (_F32,))
    splits, rows, d_v = o_parts.shape
    if lse_parts.shape != (splits, rows):
        raise ValueError(f"lse_parts shape must be (splits, rows) = {(splits, rows)} to match "
                         f"o_parts {o_parts.shape}, got {lse_parts.shape}")
    check_array("do", do, 2, "(rows, d_v)", (o_parts.dtype,))
    if do.shape != (rows, d_v):
        raise ValueError(f"do shape must be (rows, d_v) = {(rows, d_v)}, got {do.shape}")
    check_array("dlse", dlse, 1, "(rows,)", (_F32,))
    if dlse.shape != (rows,):
        raise ValueError(f"dlse shape must be (rows,) = ({rows},), got {dlse.shape}")
    s_o_split, s_o_row, _ = unit_last_strides("o_parts", o_parts)
    s_lse_split, s_lse_row = element_strides("lse_parts", lse_parts)
    s_do_row, _ = unit_last_strides("do", do)
    (s_dlse,) = element_strides("dlse", dlse)
    if out is None:
        out = np.empty((splits, rows, d_v), dtype=o_parts.dtype)
    check_output("out", out, (splits, rows, d_v), o_parts.dtype, "(splits, rows, d_v)")
    s_out_split, s_out_row, _ = unit_last_strides("out", out)
    if out_dlse is None:
        out_dlse = np.empty((splits, rows), dtype=np.float32)
    check_output("out_dlse", out_dlse, (splits, rows), _F32, "(splits, rows)")
    s_dl_split, s_dl_row = element_strides("out_dlse", out_dlse)
    for name, a, others in (("out", out, (o_parts, lse_parts, do, dlse)),
                            ("out_dlse", out_dlse, (o_parts, lse_parts, do, dlse, out))):
        if any(np.may_share_memory(a, b) for b in others):
            raise ValueError(f"{name} overlaps an input or the other output")
    if rows == 0 or splits == 0:
        return out, out_dlse
    status = _kernels().lse_combine_backward_kernel(
        dtype_code(o_parts.dtype), o_parts.ctypes.data, s_o_split, s_o_row, lse_parts.ctypes.data,
        s_lse_split, s_lse_row, do.ctypes.data, s_do_row, dlse.ctypes.data, s_dlse, out.ctypes.data,
        s_out_split, s_out_row, out_dlse.ctypes.data, s_dl_split, s_dl_row, splits, rows, d_v)
    check_status(status, "lse_combine_backward_kernel")
    return out, out_dlse
