"""Native CPU backward of the fused MoE experts layer (kernel in moe_experts_grad.c).

    experts_backward(x, ids, weights, w13, w2, dout, *, ws13=None, ws2=None, out=None) -> {name: array}

x, dout (T, D), w13 (E, 2F, D), w2 (E, D, F), ws13 (S, 2Fs, D), ws2 (S, D, Fs): one dtype of float32 / float16 /
bfloat16, C-contiguous (dense weights only: int4 weights have no gradient); ids (T, k) int32 in [0, E); weights
(T, k) float32. Returns {"dx": (T, D) x's dtype, "dweights": (T, k), "dw13": (E, 2F, D), "dw2": (E, D, F)} and with
shared experts "dws13", "dws2", float32; `out` may hold C-contiguous buffers for any of them (used as given).
act is recomputed and rounded to x's dtype as the forward's (refimpl/moe_experts_grad.py); arithmetic float32
(moe_experts_grad.c). Bad arguments: ValueError naming them.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_output, check_status, dtype_code, load
from kernel_parity.kernels.cpu.moe_experts import check_experts_args

__all__ = ["experts_backward", "check_backward_args", "grad_shapes"]

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe_experts_grad")
        lib.moe_experts_grad_kernel.argtypes = [_PTR] * 8 + [_I64] * 7 + [_INT] + [_PTR] * 6
        lib.moe_experts_grad_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def check_backward_args(x, ids, weights, w13, w2, dout, ws13=None, ws2=None) -> tuple[int, ...]:
    """(T, D, E, F, k, S, Fs) of valid moe.experts_backward arguments (shapes; any array type, dense weights);
    ValueError (one line naming the argument and what was expected) otherwise."""
    for name, w in (("w13", w13), ("w2", w2), ("ws13", ws13), ("ws2", ws2)):
        if isinstance(w, dict):
            raise ValueError(f"moe.experts_backward: {name} must be dense (int4 weights have no gradient)")
    dims = check_experts_args(x, ids, weights, w13, w2, ws13, ws2)
    if tuple(getattr(dout, "shape", ())) != tuple(x.shape):
        raise ValueError(f"moe.experts_backward: dout must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(getattr(dout, 'shape', ()))}")
    return dims


def grad_shapes(t: int, d: int, e: int, f: int, k: int, s: int, fs: int) -> dict[str, tuple[int, ...]]:
    shapes = {"dx": (t, d), "dweights": (t, k), "dw13": (e, 2 * f, d), "dw2": (e, d, f)}
    if s:
        shapes.update(dws13=(s, 2 * fs, d), dws2=(s, d, fs))
    return shapes


def experts_backward(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w13: np.ndarray, w2: np.ndarray,
                     dout: np.ndarray, *, ws13: np.ndarray | None = None, ws2: np.ndarray | None = None,
                     out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The gradients of x, the routing weights, w13, w2 (and ws13, ws2) for the cotangent dout (module docstring)."""
    t, d, e, f, k, s, fs = check_backward_args(x, ids, weights, w13, w2, dout, ws13, ws2)
    if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
        raise ValueError("moe.experts_backward: x must be a C-contiguous numpy array")
    try:
        dt = dtype_code(x.dtype)
    except KeyError:
        raise ValueError(f"moe.experts_backward: x dtype must be float32, float16 or bfloat16, got {x.dtype}") from None
    named = {"dout": dout, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if s else {})}
    for name, a in named.items():
        if not isinstance(a, np.ndarray) or a.dtype != x.dtype or not a.flags.c_contiguous:
            raise ValueError(f"moe.experts_backward: {name} must be a C-contiguous numpy array of x's dtype {x.dtype}, "
                             f"got {getattr(a, 'dtype', type(a).__name__)}")
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.flags.c_contiguous):
        raise ValueError("moe.experts_backward: ids must be a C-contiguous int32 numpy array")
    if not (isinstance(weights, np.ndarray) and weights.dtype == np.float32 and weights.flags.c_contiguous):
        raise ValueError("moe.experts_backward: weights must be a C-contiguous float32 numpy array")
    if ids.size and (ids.min() < 0 or ids.max() >= e):
        raise ValueError(f"moe.experts_backward: ids must be in [0, E={e}), got [{ids.min()}, {ids.max()}]")
    out = dict(out or {})
    res = {}
    for name, shape in grad_shapes(t, d, e, f, k, s, fs).items():
        want = x.dtype if name == "dx" else np.dtype(np.float32)
        a = out.pop(name, None)
        a = np.empty(shape, want) if a is None else a
        check_output(name, a, shape, want, "")
        if not a.flags.c_contiguous:
            raise ValueError(f"moe.experts_backward: {name} must be C-contiguous")
        if any(np.may_share_memory(a, b) for b in (x, ids, weights, dout, *named.values())):
            raise ValueError(f"moe.experts_backward: {name} must not overlap the inputs")
        res[name] = a
    if out:
        raise ValueError(f"moe.experts_backward: no output named {sorted(out)} (outputs: {', '.join(res)})")
    if t == 0:
        for name in ("dw13", "dw2", "dws13", "dws2"):
            if name in res:
                res[name][...] = 0.0
        return res
    ptr = lambda name: res[name].ctypes.data if name in res else None  # noqa: E731
    status = _kernels().moe_experts_grad_kernel(
        x.ctypes.data, ids.ctypes.data, weights.ctypes.data, w13.ctypes.data, w2.ctypes.data,
        ws13.ctypes.data if s else None, ws2.ctypes.data if s else None, dout.ctypes.data, t, d, e, f, k, s, fs, dt,
        ptr("dx"), ptr("dweights"), ptr("dw13"), ptr("dw2"), ptr("dws13"), ptr("dws2"))
    check_status(status, "moe_experts_grad_kernel")
    return res
