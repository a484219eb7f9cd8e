"""Native CPU backward of RMSNorm and LayerNorm over the real lanes of aligned rows (norm_backward.c).

    rms_norm_backward:   dx = rstd (g dy - h rstd^2 mean(h g dy)) (+ dh),  dw = sum over rows of dy h rstd
    layer_norm_backward: dx = rstd (d - mean(d) - xhat mean(d xhat)),  d = w dy;  dw = sum dy xhat, db = sum dy

x, residual, dy, dh: (rows, aw) float32, float16 or bfloat16 (one dtype), last-axis stride 1, row
   stride >= aw elements; lanes [n, aw) are padding, never read
w: (>= n,) of x's dtype, stride 1 (lanes [0, n) used); rstd, mean: (rows,) float32, any stride: the
   forward's statistics
out_dx: (rows, aw) of x's dtype, padding lanes written as +0; out_dw, out_db: (aw_w,) of x's dtype
   (w's length), zeros past n; each allocated when None. Outputs may not overlap the inputs or
   each other.

fp32 arithmetic with double block sums, one RNE rounding on store (norm_backward.c). Bad shapes,
dtypes, strides or overlaps are ValueErrors naming them; nothing happens at import.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load, row_stride)

__all__ = ["rms_norm_backward", "layer_norm_backward"]

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_F32 = np.dtype(np.float32)
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("norm_backward")
        lib.rms_norm_backward_kernel.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR,
                                                 _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT]
        lib.layer_norm_backward_kernel.argtypes = [_INT, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR,
                                                   _I64, _PTR, _PTR, _I64, _I64, _I64]
        for fn in (lib.rms_norm_backward_kernel, lib.layer_norm_backward_kernel):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _rows_like(what: str, name: str, a: np.ndarray, x: np.ndarray) -> int:
    check_array(name, a, 2, "(rows, aligned width)", (x.dtype,))
    if a.shape != x.shape:
        raise ValueError(f"{what}: {name} must have x's shape {x.shape}, got {a.shape}")
    return row_stride(f"{what}: {name}", a, "the aligned width")


def _check_common(what: str, x: np.ndarray, w: np.ndarray, dy: np.ndarray, n: int | None,
                  stats: dict[str, np.ndarray]) -> tuple[int, int, int, dict[str, int]]:
    """(n, x's row stride, dy's row stride, each statistic's stride)."""
    check_array("x", x, 2, "(rows, aligned width)", tuple(DTYPE_CODES))
    rows, aw = x.shape
    n = aw if n is None else n
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not 1 <= n <= aw:
        raise ValueError(f"{what}: real width n={n!r} must be an integer in [1, {aw}] (x's aligned width)")
    check_array("w", w, 1, "(>= n,)", (x.dtype,))
    if w.shape[0] < n:
        raise ValueError(f"{what}: w must have at least n={n} lanes, got {w.shape}")
    if n > 1 and element_strides(f"{what}: w", w)[0] != 1:
        raise ValueError(f"{what}: w stride must be 1 element")
    strides = {}
    for name, a in stats.items():
        check_array(name, a, 1, f"({rows},)", (_F32,))
        if a.shape != (rows,):
            raise ValueError(f"{what}: {name} must have shape ({rows},), got {a.shape}")
        strides[name] = element_strides(f"{what}: {name}", a)[0]
    return int(n), row_stride(f"{what}: x", x, "the aligned width"), _rows_like(what, "dy", dy, x), strides


def _outputs(what: str, x: np.ndarray, w: np.ndarray, reads: list[np.ndarray], out_dx: np.ndarray | None,
             grads: dict[str, np.ndarray | None]) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
    """dx (rows, aw) and the weight-like gradients (w's shape), allocated when None, overlapping nothing."""
    writes = list(reads)
    if out_dx is None:
        out_dx = np.empty(x.shape, dtype=x.dtype)
    check_output("out_dx", out_dx, x.shape, x.dtype, "(rows, aligned width)")
    stride = row_stride(f"{what}: out_dx", out_dx, "the aligned width")
    outs = {}
    for name, a in [("out_dx", out_dx)] + [(k, grads[k]) for k in grads]:
        if name != "out_dx":
            a = np.empty(w.shape, dtype=x.dtype) if a is None else a
            check_output(name, a, w.shape, x.dtype, "(w's lanes,)")
            if a.shape[0] > 1 and element_strides(f"{what}: {name}", a)[0] != 1:
                raise ValueError(f"{what}: {name} stride must be 1 element")
            outs[name] = a
        if any(np.may_share_memory(a, o) for o in writes):
            raise ValueError(f"{what}: {name} overlaps an input or another output; pass separate arrays")
        writes.append(a)
    return out_dx, stride, outs


def rms_norm_backward(x: np.ndarray, w: np.ndarray, rstd: np.ndarray, dy: np.ndarray, *, n: int | None = None,
                      gemma: bool = False, residual: np.ndarray | None = None, dh: np.ndarray | None = None,
                      out_dx: np.ndarray | None = None, out_dw: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dw) of RMSNorm (module docstring); with the residual, dx is r's gradient too and includes dh."""
    what = "rms_norm_backward"
    n, sx, sdy, st = _check_common(what, x, w, dy, n, {"rstd": rstd})
    if (residual is None) != (dh is None):
        raise ValueError(f"{what}: dh is the cotangent of h = x + residual: give both or neither")
    sr = _rows_like(what, "residual", residual, x) if residual is not None else 0
    sdh = _rows_like(what, "dh", dh, x) if dh is not None else 0
    reads = [a for a in (x, w, rstd, dy, residual, dh) if a is not None]
    out_dx, sdx, outs = _outputs(what, x, w, reads, out_dx, {"out_dw": out_dw})
    dw = outs["out_dw"]
    rows, aw = x.shape
    status = _kernels().rms_norm_backward_kernel(
        dtype_code(x.dtype), x.ctypes.data, sx, residual.ctypes.data if residual is not None else 0, sr, w.ctypes.data,
        rstd.ctypes.data, st["rstd"], dy.ctypes.data, sdy, dh.ctypes.data if dh is not None else 0, sdh,
        out_dx.ctypes.data, sdx, dw.ctypes.data, rows, n, aw, int(bool(gemma)))
    check_status(status, "rms_norm_backward_kernel")
    dw[n:] = 0  # the kernel writes lanes [0, n)
    return out_dx, dw


def layer_norm_backward(x: np.ndarray, w: np.ndarray, mean: np.ndarray, rstd: np.ndarray, dy: np.ndarray, *,
                        n: int | None = None, out_dx: np.ndarray | None = None, out_dw: np.ndarray | None = None,
                        out_db: np.ndarray | None = None, bias: bool | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(dx, dw, db) of LayerNorm (module docstring); db is computed when out_db is given or bias=True."""
    what = "layer_norm_backward"
    n, sx, sdy, st = _check_common(what, x, w, dy, n, {"mean": mean, "rstd": rstd})
    want_db = out_db is not None or bool(bias)
    grads = {"out_dw": out_dw, **({"out_db": out_db} if want_db else {})}
    out_dx, sdx, outs = _outputs(what, x, w, [x, w, mean, rstd, dy], out_dx, grads)
    dw, db = outs["out_dw"], outs.get("out_db")
    rows, aw = x.shape
    status = _kernels().layer_norm_backward_kernel(
        dtype_code(x.dtype), x.ctypes.data, sx, w.ctypes.data, mean.ctypes.data, st["mean"], rstd.ctypes.data,
        st["rstd"], dy.ctypes.data, sdy, out_dx.ctypes.data, sdx, dw.ctypes.data,
        db.ctypes.data if db is not None else 0, rows, n, aw)
    check_status(status, "layer_norm_backward_kernel")
    for g in (dw, db):  # the kernel writes lanes [0, n)
        if g is not None:
            g[n:] = 0
    return out_dx, dw, db
