"""ctypes wrapper of kernels/cpu/mlp.c: SwiGLU and GeGLU on NumPy arrays, fused or split inputs.

    swiglu(gate, up)        = silu(gate) * up
    geglu(gate, up, approx) = gelu(gate) * up, GELU "tanh" (approximation) or "erf" (exact)
    *_fused(h)              : the same on a fused gate-first projection h (t, 2i): gate = h[:, :i],
                              up = h[:, i:] (two views of h, no copy)

Arrays are (t, i) float32 / float16 / bfloat16 (ml_dtypes), one dtype for all, last-axis stride 1
and any row strides; fp32 arithmetic inside (see mlp.c). `out` (t, i) is allocated when None and
may not overlap the inputs. Bad shapes, dtypes, strides or approximations are ValueErrors naming
them. Nothing happens at import.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              load, row_stride)

__all__ = ["swiglu", "swiglu_fused", "geglu", "geglu_fused"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
ACTIVATIONS = {"silu": 0, "tanh": 1, "erf": 2}
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("mlp")
        lib.glu_kernel.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64]
        lib.glu_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _halves(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    check_array("h", h, 2, "(t, 2i)", tuple(DTYPE_CODES))
    if h.shape[1] % 2:
        raise ValueError(f"a fused gate/up projection h has an even width 2i, got shape {h.shape}")
    i = h.shape[1] // 2
    return h[:, :i], h[:, i:]


def _run(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None, act: str) -> np.ndarray:
    check_array("gate", gate, 2, "(t, i)", tuple(DTYPE_CODES))
    check_array("up", up, 2, "(t, i)", tuple(DTYPE_CODES))
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"up must match gate: gate {gate.shape} {gate.dtype}, up {up.shape} {up.dtype}")
    stride_g, stride_u = row_stride("gate", gate), row_stride("up", up)
    if out is None:
        out = np.empty(gate.shape, dtype=gate.dtype)
    check_output("out", out, gate.shape, gate.dtype, "(t, i)")
    stride_y = row_stride("out", out)
    if np.may_share_memory(out, gate) or np.may_share_memory(out, up):
        raise ValueError("out overlaps gate or up; pass a separate array")
    t, i = gate.shape
    if t == 0 or i == 0:
        return out
    status = _kernels().glu_kernel(dtype_code(gate.dtype), ACTIVATIONS[act], gate.ctypes.data, stride_g,
                                   up.ctypes.data, stride_u, out.ctypes.data, stride_y, t, i)
    check_status(status, "glu_kernel")
    return out


def _gelu(approx: str) -> str:
    if approx not in ("tanh", "erf"):
        raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")
    return approx


def swiglu(gate: np.ndarray, up: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up; gate, up: (t, i). Returns out."""
    return _run(gate, up, out, "silu")


def swiglu_fused(h: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """silu(h[:, :i]) * h[:, i:] of a fused gate-first projection h (t, 2i). Returns out (t, i)."""
    gate, up = _halves(h)
    return _run(gate, up, out, "silu")


def geglu(gate: np.ndarray, up: np.ndarray, approx: str = "tanh", *, out: np.ndarray | None = None) -> np.ndarray:
    """gelu(gate) * up with the named GELU; gate, up: (t, i). Returns out."""
    return _run(gate, up, out, _gelu(approx))


def geglu_fused(h: np.ndarray, approx: str = "tanh", *, out: np.ndarray | None = None) -> np.ndarray:
    """gelu(h[:, :i]) * h[:, i:] of a fused gate-first projection h (t, 2i). Returns out (t, i)."""
    gate, up = _halves(h)
    return _run(gate, up, out, _gelu(approx))
