"""Native CPU MoE layer end to end: the router GEMM (moe_layer.c), then the CPU routing and experts kernels.

    layer(x, wg, w13, w2, k, *, scoring, renormalize, bias, n_group, topk_group, routed_scaling, mask, ws13, ws2)
        -> (out (T, D) x's dtype, weights (T, k) float32, ids (T, k) int32 in rank order)

1. moe_layer.c `moe_router_gemm_kernel`: logits (T, E) float32 = x @ wg^T, float32 sums in index order, kept in
   float32 (the op's declared path, refimpl/moe_layer.py).
2. kernels/cpu/moe.py `route` (moe.c) on the float32 logits.
3. kernels/cpu/moe_experts.py `experts` (moe_experts.c), the shared experts with them.
x (T, D), wg (E, D), w13 (E, 2F, D), w2 (E, D, F), ws13 / ws2: one dtype of float32 / float16 / bfloat16,
C-contiguous; bias (E,) float32 or None. Bad arguments: ValueError in one line (the router's here, the rest by
the kernels called).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_status, dtype_code, load
from kernel_parity.kernels.cpu.moe import route
from kernel_parity.kernels.cpu.moe_experts import experts

__all__ = ["layer", "router_logits"]

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe_layer")
        lib.moe_router_gemm_kernel.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _INT, _PTR]
        lib.moe_router_gemm_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def router_logits(x: np.ndarray, wg: np.ndarray) -> np.ndarray:
    """(T, E) float32 logits x @ wg^T (module docstring, step 1)."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or not x.flags.c_contiguous:
        got = (x.shape, x.dtype) if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"moe.layer: x must be a C-contiguous (T, D) numpy array, got {got}")
    try:
        dt = dtype_code(x.dtype)
    except KeyError:
        raise ValueError(f"moe.layer: x dtype must be float32, float16 or bfloat16, got {x.dtype}") from None
    t, d = x.shape
    if (not isinstance(wg, np.ndarray) or wg.ndim != 2 or wg.shape[1] != d or wg.shape[0] < 1
            or wg.dtype != x.dtype or not wg.flags.c_contiguous):
        got = (wg.shape, wg.dtype) if isinstance(wg, np.ndarray) else type(wg).__name__
        raise ValueError(f"moe.layer: wg must be a C-contiguous (E, D={d}) numpy array of x's dtype {x.dtype}, "
                         f"got {got}")
    e = wg.shape[0]
    logits = np.empty((t, e), np.float32)
    if t:
        check_status(_kernels().moe_router_gemm_kernel(x.ctypes.data, wg.ctypes.data, t, d, e, dt,
                                                       logits.ctypes.data), "moe_router_gemm_kernel")
    return logits


def layer(x: np.ndarray, wg: np.ndarray, w13: np.ndarray, w2: np.ndarray, k: int, *, scoring: str = "softmax",
          renormalize: bool = True, bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling: float = 1.0, mask: str = "-inf", ws13: np.ndarray | None = None,
          ws2: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out (T, D) in x's dtype, weights (T, k) float32, ids (T, k) int32 in rank order): module docstring."""
    logits = router_logits(x, wg)
    if np.ndim(w13) != 3 or np.shape(w13)[0] != wg.shape[0]:
        raise ValueError(f"moe.layer: w13 must be (E={wg.shape[0]}, 2F, D) like the router's experts, got shape "
                         f"{np.shape(w13)}")
    weights, ids = route(logits, k, scoring=scoring, renormalize=renormalize, bias=bias, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, mask=mask)
    out = experts(x, ids, weights, w13, w2, ws13=ws13, ws2=ws2)
    return out, weights, ids
