"""ctypes wrapper of kernels/cpu/mlp.c: SwiGLU and GeGLU on NumPy arrays, fused or split inputs.

    swiglu(gate, up)        = silu(gate) * up
    geglu(gate, up, approx) = gelu(gate) * up, GELU "tanh" (approximation) or "erf" (exact)
    *_fused(h)              : the same on a fused gate-first projection h (t, 2i): gate = h[:, :i],
                              up = h[:, i:] (two views of h, no copy)
    glu_backward(op, gate, up, dy, approx) -> (dgate, dup) = (dy up act'(gate), dy act(gate))
    glu_backward_fused(op, h, dy, approx)  -> dh (t, 2i) = [dgate, dup], written through two views

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

__all__ = ["swiglu", "swiglu_fused", "geglu", "geglu_fused", "glu_backward", "glu_backward_fused"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
ACTIVATIONS = {"silu": 0, "tanh": 1, "erf": 2}
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("mlp")
        lib.glu_kernel.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64]
        lib.glu_kernel.restype = ctypes.c_int
        lib.glu_backward_kernel.argtypes = [ctypes.c_int, ctypes.c_int] + [_PTR, _I64] * 5 + [_I64, _I64]
        lib.glu_backward_kernel.restype = ctypes.c_int
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


def _act(op: str, approx: str) -> str:
    if op == "swiglu":
        return "silu"
    if op != "geglu":
        raise ValueError(f"unknown gated activation {op!r} (swiglu, geglu)")
    return _gelu(approx)


def _run_backward(act: str, gate: np.ndarray, up: np.ndarray, dy: np.ndarray, dgate: np.ndarray | None,
                  dup: np.ndarray | None, owner: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """dgate, dup written by glu_backward_kernel; `owner` is the fused dh the two are views of."""
    check_array("gate", gate, 2, "(t, i)", tuple(DTYPE_CODES))
    for name, a in (("up", up), ("dy", dy)):
        check_array(name, a, 2, "(t, i)", (gate.dtype,))
        if a.shape != gate.shape:
            raise ValueError(f"{name} must match gate's shape {gate.shape}, got {a.shape}")
    outs = []
    for name, a in (("dgate", dgate), ("dup", dup)):
        a = np.empty(gate.shape, dtype=gate.dtype) if a is None else a
        check_output(name if owner is None else "out", a, gate.shape, gate.dtype, "(t, i)")
        outs.append((a, row_stride(name, a)))
    for (a, _), name in zip(outs, ("dgate", "dup")):
        if any(np.may_share_memory(a, b) for b in (gate, up, dy)):
            raise ValueError(f"{name if owner is None else 'out'} overlaps an input; pass a separate array")
    if owner is None and np.may_share_memory(outs[0][0], outs[1][0]):
        raise ValueError("dgate and dup overlap; pass separate arrays")
    t, i = gate.shape
    if t and i:
        (dg, sdg), (du, sdu) = outs
        status = _kernels().glu_backward_kernel(
            dtype_code(gate.dtype), ACTIVATIONS[act], gate.ctypes.data, row_stride("gate", gate), up.ctypes.data,
            row_stride("up", up), dy.ctypes.data, row_stride("dy", dy), dg.ctypes.data, sdg, du.ctypes.data, sdu, t, i)
        check_status(status, "glu_backward_kernel")
    return outs[0][0], outs[1][0]


def glu_backward(op: str, gate: np.ndarray, up: np.ndarray, dy: np.ndarray, approx: str = "tanh", *,
                 out_dgate: np.ndarray | None = None, out_dup: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(dgate, dup) of swiglu / geglu (`op`; GELU `approx`) for the cotangent dy; all (t, i)."""
    return _run_backward(_act(op, approx), gate, up, dy, out_dgate, out_dup)


def glu_backward_fused(op: str, h: np.ndarray, dy: np.ndarray, approx: str = "tanh", *,
                       out: np.ndarray | None = None) -> np.ndarray:
    """dh (t, 2i) = [dgate, dup] of the fused gate-first projection h (t, 2i); dy: (t, i)."""
    gate, up = _halves(h)
    if out is None:
        out = np.empty(h.shape, dtype=h.dtype)
    check_output("out", out, h.shape, h.dtype, "(t, 2i)")
    i = h.shape[1] // 2
    _run_backward(_act(op, approx), gate, up, dy, out[:, :i], out[:, i:], owner=out)
    return out
