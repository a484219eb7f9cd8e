"""Native CPU backward of MoE routing weights (kernel in moe_grad.c).

    route_backward(logits, ids, grad_w, *, scoring="softmax", renormalize=True, bias=None, n_group=1,
                   topk_group=1, routed_scaling=1.0, mask="-inf", out=None) -> grad_logits

    g_s    = c (grad_w_j / S - D / S^2) at ids_j (renormalize; S, D: sums over the chosen) | c grad_w_j
    grad   = s (g_s - sum g_s s) (softmax) | g_s s (1 - s) (sigmoid)

logits: (T, E) float32, any strides, finite or -inf (NaN / +inf refused). ids: (T, k) int32, the
forward's choice, distinct per token and in [0, E); grad_w: (T, k) float32, its weights' cotangent in
the order of ids; both any strides. bias: (E,) float32 or None,
and the grouping: checked, no part in the gradient (the choice is given). T may be 0. Returns
grad_logits (T, E) float32 (`out` used when given: C-contiguous of that shape and dtype). Arithmetic
is float32 (moe_grad.c). The arguments are refused (ValueError) under the golden's conditions:
refimpl/moe_grad.py, the float64 reference.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, check_status, element_strides, load

from kernel_parity.kernels.moe_args import SCORINGS, check_route_args

__all__ = ["route_backward"]

_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe_grad")
        lib.moe_route_backward_kernel.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64,
                                                  _I64, _INT, _INT, _FLT, _PTR]
        lib.moe_route_backward_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def route_backward(logits: np.ndarray, ids: np.ndarray, grad_w: np.ndarray, *, scoring: str = "softmax",
                   renormalize: bool = True, bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1,
                   routed_scaling: float = 1.0, mask: str = "-inf", out: np.ndarray | None = None) -> np.ndarray:
    """grad_logits (T, E) float32 of the routing weights' cotangent grad_w (T, k), the choice ids given."""
    x = check_array("logits", logits, 2, "(T, E)", (_F32,))
    T, E = x.shape
    check_array("ids", ids, 2, "(T, k)", (_I32,))
    if ids.shape[0] != T:
        raise ValueError(f"moe.route_backward: ids must be ({T}, k), got shape {ids.shape}")
    k = ids.shape[1]
    check_array("grad_w", grad_w, 2, "(T, k)", (_F32,))
    if grad_w.shape != (T, k):
        raise ValueError(f"moe.route_backward: grad_w must be ({T}, {k}) like ids, got shape {grad_w.shape}")
    check_route_args(E, k, scoring, n_group, topk_group, mask)
    if bias is not None:
        check_array("bias", bias, 1, "(E,)", (_F32,))
        if bias.shape != (E,):
            raise ValueError(f"moe.route_backward: bias must have shape ({E},), got {bias.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("moe.route_backward: logits must be finite or -inf")
    if not np.isfinite(grad_w).all():
        raise ValueError("moe.route_backward: grad_w must be finite")
    if T and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"moe.route_backward: ids must be in [0, {E}), got [{ids.min()}, {ids.max()}]")
    if T and k > 1 and (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any():
        raise ValueError("moe.route_backward: a token's ids must be distinct (the forward's choice)")
    stride_t, stride_e = element_strides("logits", x)
    stride_it, stride_ik = element_strides("ids", ids)
    stride_wt, stride_wk = element_strides("grad_w", grad_w)
    grad = np.empty((T, E), _F32) if out is None else out
    check_output("out", grad, (T, E), _F32, "(T, E)")
    if not grad.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if any(np.may_share_memory(grad, a) for a in (x, ids, grad_w)):
        raise ValueError("out must not overlap logits, ids or grad_w")
    if T == 0:
        return grad
    status = _kernels().moe_route_backward_kernel(
        x.ctypes.data, stride_t, stride_e, ids.ctypes.data, stride_it, stride_ik, grad_w.ctypes.data, stride_wt,
        stride_wk, T, E, k, SCORINGS.index(scoring), int(bool(renormalize)), float(routed_scaling), grad.ctypes.data)
    check_status(status, "moe_route_backward_kernel")
    return grad
