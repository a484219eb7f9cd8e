"""Native CPU RMSNorm and LayerNorm over the real lanes of aligned rows (kernels in norm.c).

    rms_norm:    y = h / sqrt(mean(h^2) + eps) * g,    h = x (+ r),   g = w or (1 + w) (Gemma)
    layer_norm:  y = (x - mean) / sqrt(var + eps) * w (+ b),          var biased (divides by n)

x, residual: (rows, aw) float32, float16 or bfloat16; last-axis stride 1 element, row stride >= aw
   elements; lanes [n, aw) are padding, never read
w, b: (>= n,) of x's dtype, stride 1 (lanes [0, n) used), or None
out, out_h: (rows, aw) of x's dtype, last-axis stride 1, row stride >= aw; allocated when None;
   padding lanes written as +0. They may not overlap the inputs or each other.
out_rstd, out_mean: (rows,) float32, any stride, or None (not computed)

Conventions: fp32 accumulation (LayerNorm's mean in double), one RNE rounding on store; eps inside
the square root; h = x + r summed in fp32 and normalised unrounded. Strided inputs are used as
they are: a last-axis stride != 1 raises instead of copying.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load, row_stride)

__all__ = ["rms_norm", "layer_norm"]

_I64, _PTR, _F64, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("norm")
        lib.rms_norm_kernel.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                                        _I64, _I64, _I64, _F64, _INT]
        lib.layer_norm_kernel.argtypes = [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                                          _I64, _I64, _I64, _F64]
        for fn in (lib.rms_norm_kernel, lib.layer_norm_kernel):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _check_x(what: str, x: np.ndarray, n: int | None, eps: float) -> tuple[int, int]:
    check_array("x", x, 2, "(rows, aligned width)", tuple(DTYPE_CODES))
    aw = x.shape[1]
    n = aw if n is None else n
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not 1 <= n <= aw:
        raise ValueError(f"{what}: real width n={n!r} must be an integer in [1, {aw}] (x's aligned width)")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating)) \
            or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{what}: eps={eps!r} must be a finite number >= 0")
    return int(n), row_stride(f"{what}: x", x, "the aligned width")


def _check_vector(what: str, name: str, a: np.ndarray | None, n: int, x: np.ndarray) -> int:
    """Address of a per-lane vector (weight, bias) of x's dtype with >= n lanes, stride 1; 0 for None."""
    if a is None:
        return 0
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.shape[0] < n:
        shape = a.shape if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what}: {name} must be a 1-D numpy.ndarray with at least n={n} lanes, got {shape}")
    if a.dtype != x.dtype:
        raise ValueError(f"{what}: {name} dtype must be x's ({x.dtype}), got {a.dtype}")
    (stride,) = element_strides(f"{what}: {name}", a)
    if n > 1 and stride != 1:
        raise ValueError(f"{what}: {name} stride must be 1 element, got {stride}")
    return a.ctypes.data


def _check_rows(what: str, name: str, a: np.ndarray | None, x: np.ndarray,
                writes: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """An output row tensor like x (allocated when None) that overlaps nothing in `writes`."""
    if a is None:
        a = np.zeros(x.shape, dtype=x.dtype)
    check_output(name, a, x.shape, x.dtype, "(rows, aligned width)")
    stride = row_stride(f"{what}: {name}", a, "the aligned width")
    if any(np.may_share_memory(a, o) for o in writes):
        raise ValueError(f"{what}: {name} overlaps an input or another output; pass separate arrays")
    writes.append(a)
    return a, stride


def _check_stat(what: str, name: str, a: np.ndarray | None, rows: int, writes: list[np.ndarray]) -> tuple[int, int]:
    """(address, stride) of an optional (rows,) float32 output; (0, 0) for None."""
    if a is None:
        return 0, 0
    check_output(name, a, (rows,), np.dtype(np.float32), "(rows,)")
    (stride,) = element_strides(f"{what}: {name}", a)
    if any(np.may_share_memory(a, o) for o in writes):
        raise ValueError(f"{what}: {name} overlaps an input or another output")
    writes.append(a)
    return a.ctypes.data, stride


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float, *, n: int | None = None, gemma: bool = False,
             residual: np.ndarray | None = None, out: np.ndarray | None = None, out_h: np.ndarray | None = None,
             out_rstd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """RMSNorm of the real lanes of x (rows, aw); returns (out, out_h or None, out_rstd or None)."""
    what = "rms_norm"
    n, stride_x = _check_x(what, x, n, eps)
    w_ptr = _check_vector(what, "w", w, n, x)
    if gemma and w is None:
        raise ValueError(f"{what}: gemma=True needs a weight w (it applies 1 + w)")
    writes: list[np.ndarray] = []
    inputs = [x] + [a for a in (residual, w) if a is not None]
    stride_r = 0
    if residual is not None:
        check_array("residual", residual, 2, "(rows, aligned width)", (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"{what}: residual must have x's shape {x.shape}, got {residual.shape}")
        stride_r = row_stride(f"{what}: residual", residual, "the aligned width")
    elif out_h is not None:
        raise ValueError(f"{what}: out_h given without a residual (h = x + residual)")
    writes.extend(inputs)
    out, stride_y = _check_rows(what, "out", out, x, writes)
    stride_h = 0
    if residual is not None:
        out_h, stride_h = _check_rows(what, "out_h", out_h, x, writes)
    rstd_ptr, stride_rstd = _check_stat(what, "out_rstd", out_rstd, x.shape[0], writes)
    rows, aw = x.shape
    if rows == 0:
        return out, out_h, out_rstd
    status = _kernels().rms_norm_kernel(
        dtype_code(x.dtype), x.ctypes.data, stride_x, residual.ctypes.data if residual is not None else 0, stride_r,
        w_ptr, out.ctypes.data, stride_y, out_h.ctypes.data if out_h is not None else 0, stride_h,
        rstd_ptr, stride_rstd, rows, n, aw, float(eps), int(bool(gemma)))
    check_status(status, "rms_norm_kernel")
    return out, out_h, out_rstd


def layer_norm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float, *, n: int | None = None,
               out: np.ndarray | None = None, out_mean: np.ndarray | None = None,
               out_rstd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """LayerNorm of the real lanes of x (rows, aw); returns (out, out_mean or None, out_rstd or None)."""
    what = "layer_norm"
    n, stride_x = _check_x(what, x, n, eps)
    w_ptr = _check_vector(what, "w", w, n, x)
    b_ptr = _check_vector(what, "b", b, n, x)
    writes = [x] + [a for a in (w, b) if a is not None]
    out, stride_y = _check_rows(what, "out", out, x, writes)
    mean_ptr, stride_mean = _check_stat(what, "out_mean", out_mean, x.shape[0], writes)
    rstd_ptr, stride_rstd = _check_stat(what, "out_rstd", out_rstd, x.shape[0], writes)
    rows, aw = x.shape
    if rows == 0:
        return out, out_mean, out_rstd
    status = _kernels().layer_norm_kernel(
        dtype_code(x.dtype), x.ctypes.data, stride_x, w_ptr, b_ptr, out.ctypes.data, stride_y,
        mean_ptr, stride_mean, rstd_ptr, stride_rstd, rows, n, aw, float(eps))
    check_status(status, "layer_norm_kernel")
    return out, out_mean, out_rstd
