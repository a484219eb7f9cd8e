"""Native CPU mixture-of-experts top-k routing (kernel in moe.c).

    route(logits, k, *, scoring="softmax", renormalize=True, bias=None, n_group=1, topk_group=1,
          routed_scaling=1.0, mask="-inf", out_weights=None, out_ids=None) -> (weights, ids)

    scores  = softmax(logits) | sigmoid(logits);  select = scores + bias (selection only)
    grouped : the topk_group best of n_group contiguous groups stay (group score: the sum of its two
              largest `select` with a bias, its largest without); other experts' `select` -> mask
    ids     = the k largest `select`;  weights = scores[ids] (/ their sum if renormalize) * routed_scaling

logits: (T, E) float32, any strides, finite or -inf (NaN / +inf refused). bias: (E,) float32, any
stride, or None. T may be 0. Returns weights (T, k) float32 and ids (T, k) int32 in rank order
(descending `select`, ties to the lower index; equal group scores likewise). `out_weights` /
`out_ids` are used when given (C-contiguous, of those shapes and dtypes).
mask: "-inf" (DeepSeek inference, vLLM, SGLang) or "zero" (Hugging Face's modeling_deepseek.py).
Arithmetic is float32 (moe.c); renormalize with a zero sum gives weights 0. The arguments are
refused (ValueError) under the golden's conditions: refimpl/moe.py, the float64 reference.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, check_status, element_strides, load

from kernel_parity.kernels.moe_args import MASKS, SCORINGS, check_route_args  # noqa: F401  (re-exported)

__all__ = ["route", "SCORINGS", "MASKS"]

_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_I64, _PTR, _INT, _FLT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe")
        lib.moe_route_kernel.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _INT,
                                         _I64, _I64, _FLT, _FLT, _PTR, _PTR]
        lib.moe_route_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def route(logits: np.ndarray, k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          mask: str = "-inf", out_weights: np.ndarray | None = None, out_ids: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k expert routing of each token of logits (T, E); returns (weights (T, k), ids (T, k))."""
    x = check_array("logits", logits, 2, "(T, E)", (_F32,))
    T, E = x.shape
    check_route_args(E, k, scoring, n_group, topk_group, mask)
    if E > np.iinfo(np.int32).max:
        raise ValueError(f"moe.route: E={E} does not fit the int32 ids")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("moe.route: logits must be finite or -inf")
    stride_t, stride_e = element_strides("logits", x)
    stride_b = 0
    if bias is not None:
        check_array("bias", bias, 1, "(E,)", (_F32,))
        if bias.shape != (E,):
            raise ValueError(f"bias must have shape ({E},), got {bias.shape}")
        (stride_b,) = element_strides("bias", bias)
    weights = np.empty((T, k), _F32) if out_weights is None else out_weights
    ids = np.empty((T, k), _I32) if out_ids is None else out_ids
    check_output("out_weights", weights, (T, k), _F32, "(T, k)")
    check_output("out_ids", ids, (T, k), _I32, "(T, k)")
    if not (weights.flags.c_contiguous and ids.flags.c_contiguous):
        raise ValueError("out_weights and out_ids must be C-contiguous")
    inputs = (x,) if bias is None else (x, bias)
    if np.may_share_memory(weights, ids) or any(np.may_share_memory(o, a) for o in (weights, ids) for a in inputs):
        raise ValueError("out_weights and out_ids must not overlap each other, logits or bias")
    if T == 0:
        return weights, ids
    status = _kernels().moe_route_kernel(
        x.ctypes.data, stride_t, stride_e, None if bias is None else bias.ctypes.data, stride_b, T, E, k,
        SCORINGS.index(scoring), int(bool(renormalize)), n_group, topk_group,
        -np.inf if mask == "-inf" else 0.0, float(routed_scaling), weights.ctypes.data, ids.ctypes.data)
    check_status(status, "moe_route_kernel")
    return weights, ids
