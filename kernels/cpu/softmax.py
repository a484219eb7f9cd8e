"""Native CPU softmax and online (streaming) softmax over the last axis (kernels in softmax.c).

    softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m),   m = max_k x_k
    online_softmax: running max m and sum l over tiles, l rescaled by exp(m_old - m_new) per tile;
                    y = exp(x - m) / l, lse = m + ln l

x: (rows, n) float32, float16 or bfloat16; last-axis stride 1 element, row stride >= n elements
   (padding between rows is never read)
out: like x (same shape and dtype, last-axis stride 1, row stride >= n); allocated when None.
     May be x itself (in place); any other overlap with x is refused.
out_lse: (rows,) float32, any stride

Conventions: fp32 accumulation, one RNE rounding on store; all -inf rows give 0 (lse -inf);
natural log. Strided inputs are used as they are: a last-axis stride != 1 raises instead of copying.

Backward (softmax_backward, online_softmax_backward): dx = y (dy - sum_j dy_j y_j + dlse) from the
forward's output y and the cotangents dy (like y) and dlse ((rows,) float32, online form only);
dx like y. x and the LSE are not needed; a -inf logit (y = 0) and an all -inf row get dx = 0.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load, row_stride)

__all__ = ["softmax", "online_softmax", "softmax_backward", "online_softmax_backward"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("softmax")
        lib.softmax_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _I64, _I64]
        lib.online_softmax_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                                              _I64, _I64, _I64]
        lib.softmax_backward_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR,
                                                _I64, _I64, _I64]
        for fn in (lib.softmax_kernel, lib.online_softmax_kernel, lib.softmax_backward_kernel):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _check_x(x: np.ndarray) -> int:
    check_array("x", x, 2, "(rows, n)", tuple(DTYPE_CODES))
    return row_stride("x", x)


def _check_out(out: np.ndarray | None, x: np.ndarray, stride_x: int) -> tuple[np.ndarray, int]:
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)
    check_output("out", out, x.shape, x.dtype, "(rows, n)")
    stride_out = row_stride("out", out)
    same = out.ctypes.data == x.ctypes.data and (stride_out == stride_x or x.shape[0] <= 1)
    if not same and np.may_share_memory(out, x):
        raise ValueError("out overlaps x without being x itself; pass out=x for in place, or a "
                         "separate array")
    return out, stride_out


def _check_lse(out_lse: np.ndarray | None, rows: int, others: tuple[np.ndarray, ...]) -> tuple[np.ndarray, int]:
    if out_lse is None:
        out_lse = np.empty(rows, dtype=np.float32)
    check_output("out_lse", out_lse, (rows,), np.dtype(np.float32), "(rows,)")
    (stride,) = element_strides("out_lse", out_lse)
    if any(np.may_share_memory(out_lse, a) for a in others):
        raise ValueError("out_lse overlaps x or out")
    return out_lse, stride


def softmax(x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Row-wise softmax over the last axis of x (rows, n); returns out."""
    stride_x = _check_x(x)
    out, stride_out = _check_out(out, x, stride_x)
    rows, n = x.shape
    if rows == 0 or n == 0:
        return out
    status = _kernels().softmax_kernel(dtype_code(x.dtype), x.ctypes.data, stride_x,
                                       out.ctypes.data, stride_out, rows, n)
    check_status(status, "softmax_kernel")
    return out


def online_softmax(x: np.ndarray, tile: int, *, out: np.ndarray | None = None,
                   out_lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Streaming softmax over tiles of `tile` elements of x (rows, n); returns (out, out_lse).

    lse: (rows,) float32, natural log; -inf for an all -inf row (and for n == 0).
    """
    stride_x = _check_x(x)
    if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be an integer >= 1, got {tile!r}")
    out, stride_out = _check_out(out, x, stride_x)
    rows, n = x.shape
    out_lse, stride_lse = _check_lse(out_lse, rows, (x, out))
    if rows == 0:
        return out, out_lse
    status = _kernels().online_softmax_kernel(
        dtype_code(x.dtype), x.ctypes.data, stride_x, out.ctypes.data, stride_out,
        out_lse.ctypes.data, stride_lse, rows, n, min(int(tile), max(n, 1)))
    check_status(status, "online_softmax_kernel")
    return out, out_lse


def _backward(y: np.ndarray, dy: np.ndarray, dlse: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
    """dx = y (dy - sum(dy y) + dlse) into out (validated here); dlse None: no LSE cotangent."""
    check_array("y", y, 2, "(rows, n)", tuple(DTYPE_CODES))
    stride_y = row_stride("y", y)
    check_array("dy", dy, 2, "(rows, n)", (y.dtype,))
    if dy.shape != y.shape:
        raise ValueError(f"dy must have y's shape {y.shape}, got {dy.shape}")
    stride_dy = row_stride("dy", dy)
    if out is None:
        out = np.empty(y.shape, dtype=y.dtype)
    check_output("out", out, y.shape, y.dtype, "(rows, n)")
    stride_out = row_stride("out", out)
    rows, n = y.shape
    stride_dlse = 0
    if dlse is not None:
        check_array("dlse", dlse, 1, "(rows,)", (np.dtype(np.float32),))
        if dlse.shape != (rows,):
            raise ValueError(f"dlse must have shape ({rows},), got {dlse.shape}")
        (stride_dlse,) = element_strides("dlse", dlse)
    if any(np.may_share_memory(out, a) for a in (y, dy) + ((dlse,) if dlse is not None else ())):
        raise ValueError("out overlaps y, dy or dlse")
    if rows == 0 or n == 0:
        return out
    status = _kernels().softmax_backward_kernel(
        dtype_code(y.dtype), y.ctypes.data, stride_y, dy.ctypes.data, stride_dy,
        None if dlse is None else dlse.ctypes.data, stride_dlse, out.ctypes.data, stride_out, rows, n)
    check_status(status, "softmax_backward_kernel")
    return out


def softmax_backward(y: np.ndarray, dy: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Gradient of softmax: dx = y (dy - sum(dy y)) from y (rows, n) and dy like y; returns out."""
    return _backward(y, dy, None, out)


def online_softmax_backward(y: np.ndarray, dy: np.ndarray, dlse: np.ndarray, tile: int, *,
                            out: np.ndarray | None = None) -> np.ndarray:
    """Gradient of online softmax (outputs y and lse): dx = y (dy - sum(dy y) + dlse); returns out.

    tile: the forward's tile, validated; the gradient needs no running max, so no tiles (the row
    is summed once, then written)."""
    if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be an integer >= 1, got {tile!r}")
    if dlse is None:
        raise ValueError("dlse must be a (rows,) float32 array, got None")
    return _backward(y, dy, dlse, out)
