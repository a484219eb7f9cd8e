"""Native CPU quantized GEMM, C = A @ W^T (+ bias), the integer path of ggml's CPU backend (gemm.c).

    C[m, n] = sum_b blk(W[n], Q(A[m]), b) (+ bias[n])

a: (M, K) float32; last-axis stride 1, any row stride
w: (N, K // block * nbytes) uint8 for a quantized wfmt, (N, K) float32 for "f32"; last-axis stride 1
bias: (N,) float32 or None
out: (M, N) float32, last-axis stride 1; allocated when None

Weight formats (`WEIGHT_FORMATS`, name -> activation format): q4_0 q5_0 q8_0 iq4_nl -> q8_0,
q4_1 q5_1 -> q8_1, q2_k q3_k q4_k q5_k q6_k -> q8_k, and f32 (plain float32 dot products).
K: a multiple of 32 for the 32-block formats, of 256 for the K-quants.

Conventions (gemm.c's header says where each float32 rounding happens):
- Q(A[m]) is ggml's reference quantizer of the vec_dot type (roundf for Q8_0/Q8_1, nearest_int for
  Q8_K), i.e. quant.quantize(act_format(wfmt), a); the integer block sums are exact;
- 32-blocks: blk = (dw * da) * isum (+ mw * sa), summed in 8 float32 lanes (block b in lane b % 8),
  lanes added pairwise; K-quants: blk = (dw * da) * isum - (dmin * da) * msum (bsums trick for the
  mins), summed in block order; f32: 16 lanes, pairwise, then the tail;
- bias added last (one rounding). Deterministic: every ISA path (AVX-512 VNNI, AVX2, scalar) gives
  the same bits, and the result of a row does not depend on M, N or the other rows.

`gemm_nt_backward` (gemm_bwd.c, its arithmetic in gemm_bwd.h) is the VJP: da = dc W (a GGML W dequantized
as ggml's dequantize_row_*), dw = dc^T A and db = the sum of dc's rows for float32 W; float32 storage and
sums, each in its reduction index's order, the same bits on every ISA path.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, element_strides, load
from kernel_parity.kernels.cpu.quant import FORMATS

__all__ = ["WEIGHT_FORMATS", "act_format", "gemm_nt", "gemm_nt_backward", "isa"]

# weight format -> activation (vec_dot) format, as ggml-cpu's type_traits_cpu[...].vec_dot_type
WEIGHT_FORMATS: dict[str, str] = {
    "f32": "f32",
    "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0", "iq4_nl": "q8_0",
    "q4_1": "q8_1", "q5_1": "q8_1",
    "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k",
}

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib: ctypes.CDLL | None = None
_bwd: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("gemm")
        lib.gemm_q_kernel.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64]
        lib.gemm_f32_kernel.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64]
        lib.gemm_isa.argtypes = []
        lib.kp_set_isa_cap.argtypes = [ctypes.c_int]
        for fn in (lib.gemm_q_kernel, lib.gemm_f32_kernel, lib.gemm_isa, lib.kp_set_isa_cap):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def act_format(wfmt: str) -> str:
    """The activation format the integer path quantizes A to for weights in `wfmt`."""
    if not isinstance(wfmt, str) or wfmt not in WEIGHT_FORMATS:
        raise ValueError(f"gemm_nt: unsupported weight format {wfmt!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[wfmt]


def isa(cap: int | None = None) -> int:
    """The SIMD path gemm_nt runs: 2 AVX-512 VNNI, 1 AVX2, 0 scalar. `cap` first lowers the highest
    allowed path (process-wide, not thread-safe; for tests that compare the paths)."""
    lib = _kernels()
    if cap is not None:
        lib.kp_set_isa_cap(int(cap))
    return lib.gemm_isa()


def _unit_rows(name: str, a: np.ndarray) -> int:
    stride_row, stride_col = element_strides(name, a)
    if a.size and a.shape[1] > 1 and stride_col != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got {stride_col} "
                         f"(strides {a.strides} bytes); no copy is made")
    return stride_row


def gemm_nt(a: np.ndarray, wfmt: str, w: np.ndarray, bias: np.ndarray | None = None,
            out: np.ndarray | None = None) -> np.ndarray:
    """C = A @ W^T (+ bias) with W (N, K) stored in `wfmt`; returns out (M, N) float32."""
    act_format(wfmt)
    f32 = np.dtype(np.float32)
    check_array("a", a, 2, "(M, K)", (f32,))
    m, k = a.shape
    if wfmt == "f32":
        check_array("w", w, 2, "(N, K)", (f32,))
        n = w.shape[0]
        if w.shape[1] != k:
            raise ValueError(f"gemm_nt f32: w must be (N, K) with K = {k} (from a), got shape {w.shape}")
    else:
        type_id, qk, nbytes = FORMATS[wfmt]
        if k % qk:
            kind = "K-quant" if qk == 256 else "32-block format"
            raise ValueError(f"gemm_nt {wfmt}: K must be a multiple of {qk} for a {kind}, got K = {k}")
        check_array("w", w, 2, "(N, K // block * nbytes)", (np.dtype(np.uint8),))
        n = w.shape[0]
        if w.shape[1] != k // qk * nbytes:
            raise ValueError(f"gemm_nt {wfmt}: w must be (N, {k // qk * nbytes}) uint8 for K = {k} "
                             f"({nbytes} bytes per {qk} elements), got shape {w.shape}")
    if bias is not None:
        check_array("bias", bias, 1, "(N,)", (f32,))
        if bias.shape[0] != n:
            raise ValueError(f"gemm_nt: bias must be (N,) = ({n},), got shape {bias.shape}")
        if bias.size and not bias.flags.c_contiguous:
            raise ValueError(f"bias must be contiguous, got strides {bias.strides}; no copy is made")
    if out is None:
        out = np.empty((m, n), dtype=f32)
    check_output("out", out, (m, n), f32, "(M, N)")
    stride_a, stride_w, stride_out = _unit_rows("a", a), _unit_rows("w", w), _unit_rows("out", out)
    if m == 0 or n == 0:
        return out
    if any(np.may_share_memory(out, x) for x in (a, w) + (() if bias is None else (bias,))):
        raise ValueError("out overlaps a, w or bias; pass a separate array")
    if k == 0:
        out[...] = 0.0 if bias is None else bias
        return out
    bias_ptr = None if bias is None else bias.ctypes.data
    lib = _kernels()
    if wfmt == "f32":
        status = lib.gemm_f32_kernel(a.ctypes.data, stride_a, w.ctypes.data, stride_w, bias_ptr,
                                     out.ctypes.data, stride_out, m, n, k)
    else:
        status = lib.gemm_q_kernel(type_id, a.ctypes.data, stride_a, w.ctypes.data, stride_w, bias_ptr,
                                   out.ctypes.data, stride_out, m, n, k)
    if status == 2:
        raise MemoryError(f"gemm_nt {wfmt}: out of memory for the unpacked panels")
    if status == 1:
        raise ValueError(f"gemm_nt: weight format {wfmt!r} is not supported by the compiled kernel")
    if status != 0:
        raise RuntimeError(f"gemm_q_kernel returned {status} for {wfmt}")
    return out


def _backward_kernel() -> ctypes.CDLL:
    global _bwd
    if _bwd is None:
        lib = load("gemm_bwd")
        lib.gemm_nt_backward.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                                         _PTR, _I64, _I64, _I64]
        lib.gemm_nt_backward.restype = ctypes.c_int
        _bwd = lib
    return _bwd


def gemm_nt_backward(a: np.ndarray, wfmt: str, w: np.ndarray, dc: np.ndarray, *, bias: bool = False,
                     out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The VJP of C = A @ W^T (+ bias) (gemm_bwd.c, float32 arithmetic):

        da = dc @ W (M, K), W dequantized for a GGML format;  dw = dc^T @ A (N, K) and db = sum_m dc (N,)
        for "f32" weights only (db when `bias`)

    a: (M, K) float32, w as `gemm_nt`'s, dc: (M, N) float32 (last-axis stride 1, any row stride)
    out: preallocated {"da", "dw", "db"} (any subset; the rest are allocated)
    returns {"da"} (+ {"dw"} (+ {"db"}) for "f32")
    """
    act_format(wfmt)
    f32 = np.dtype(np.float32)
    check_array("a", a, 2, "(M, K)", (f32,))
    check_array("dc", dc, 2, "(M, N)", (f32,))
    m, k = a.shape
    n = dc.shape[1]
    if dc.shape[0] != m:
        raise ValueError(f"gemm_nt_backward: dc must be (M, N) with M = {m} (from a), got shape {dc.shape}")
    if wfmt == "f32":
        check_array("w", w, 2, "(N, K)", (f32,))
        if w.shape != (n, k):
            raise ValueError(f"gemm_nt_backward f32: w must be (N, K) = ({n}, {k}), got shape {w.shape}")
        type_id, row_bytes = 0, 4
    else:
        type_id, qk, nbytes = FORMATS[wfmt]
        if k % qk:
            raise ValueError(f"gemm_nt_backward {wfmt}: K must be a multiple of {qk}, got K = {k}")
        check_array("w", w, 2, "(N, K // block * nbytes)", (np.dtype(np.uint8),))
        if w.shape != (n, k // qk * nbytes):
            raise ValueError(f"gemm_nt_backward {wfmt}: w must be ({n}, {k // qk * nbytes}) uint8, got {w.shape}")
        row_bytes = 1
    shapes = {"da": (m, k)}
    if wfmt == "f32":
        shapes["dw"] = (n, k)
        if bias:
            shapes["db"] = (n,)
    res = dict(out or {})
    unknown = set(res) - set(shapes)
    if unknown:
        raise ValueError(f"out names {', '.join(sorted(unknown))}, not among this call's gradients {', '.join(shapes)}")
    for name, shape in shapes.items():
        if name not in res:
            res[name] = np.empty(shape, dtype=f32)
        check_output(f"out[{name!r}]", res[name], shape, f32, str(shape))
    if "db" in res and res["db"].size and not res["db"].flags.c_contiguous:
        raise ValueError(f"out['db'] must be contiguous, got strides {res['db'].strides}; no copy is made")
    strides = {name: _unit_rows(name, x) for name, x in (("a", a), ("w", w), ("dc", dc), ("da", res["da"]))}
    dw = res.get("dw")
    stride_dw = _unit_rows("dw", dw) if dw is not None else 0
    for name, x in res.items():
        if any(np.may_share_memory(x, y) for y in (a, w, dc)):
            raise ValueError(f"out[{name!r}] overlaps a, w or dc; pass a separate array")
    if m == 0 or n == 0 or k == 0:
        for x in res.values():
            x[...] = 0.0
        return res
    status = _backward_kernel().gemm_nt_backward(
        type_id, a.ctypes.data, strides["a"], w.ctypes.data, strides["w"] * row_bytes, dc.ctypes.data, strides["dc"],
        res["da"].ctypes.data, strides["da"], None if dw is None else dw.ctypes.data, stride_dw,
        res["db"].ctypes.data if "db" in res else None, m, n, k)
    if status == 2:
        raise MemoryError(f"gemm_nt_backward {wfmt}: out of memory for the dequantized weight panel")
    if status != 0:
        raise RuntimeError(f"gemm_nt_backward returned {status} for {wfmt}")
    return res
