"""Native CPU GGML block quantizers and dequantizers (kernels in quant.c, layouts in quant.h).

    quantize(fmt, x)[r]    = ggml's quantize_row_<fmt>_ref(x[r])          (bytes, exact)
    dequantize(fmt, q)[r]  = ggml's dequantize_row_<fmt>(q[r])            (float32, exact)

x: (rows, K) float32; last-axis stride 1, any row stride
q: (rows, K // block * nbytes) uint8; last-axis stride 1, any row stride
out: quantize (rows, K // block * nbytes) uint8, dequantize (rows, K) float32; allocated when None

Formats (`FORMATS`: name -> (ggml type id, elements per block, bytes per block)): q4_0 q4_1 q5_0 q5_1
q8_0 q8_1 iq4_nl (32-blocks) and q2_k q3_k q4_k q5_k q6_k q8_k (256-blocks). K must be a multiple of
the block size.

Conventions: the reference quantizers of ggml-quants.c in their float32 operation order (nearest_int
round half to even, roundf half away from zero for Q8_0/Q8_1, truncation of x * id + 8.5 / 16.5 for
Q4_0/Q5_0, fp16 scales rounded to nearest even, K-quant codes recomputed from the fp16-rounded
scales); byte-exact with libggml and with the golden refimpl/quant.py. Where ggml writes memory it
never initialised, zeros (as the golden): the bsums of an all-zero Q8_K block, the indices of an
IQ4_NL block with max |x| < 1e-15 (d = 0). The dequantized value is one float32 rounding of the exact
value d * sc * q - dmin * m (bit-identical to ggml's dequantize_row_*).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, load, unit_last_strides

__all__ = ["FORMATS", "format_info", "quantize", "dequantize", "row_bytes"]

# name -> (ggml type id, elements per block, bytes per block)
FORMATS: dict[str, tuple[int, int, int]] = {
    "q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34), "q8_1": (9, 32, 36), "iq4_nl": (20, 32, 18),
    "q2_k": (10, 256, 84), "q3_k": (11, 256, 110), "q4_k": (12, 256, 144), "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210), "q8_k": (15, 256, 292),
}

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("quant")
        for fn in (lib.quant_quantize, lib.quant_dequantize):
            fn.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _I64, _I64]
            fn.restype = ctypes.c_int
        lib.quant_block_size.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.quant_block_size.restype = ctypes.c_int
        _lib = lib
    return _lib


def format_info(fmt: str) -> tuple[int, int, int]:
    """(ggml type id, elements per block, bytes per block) of `fmt`; ValueError naming an unknown one."""
    info = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if info is None:
        raise ValueError(f"unknown quantization format {fmt!r}; supported: {', '.join(FORMATS)}")
    return info


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one quantized row of k elements; ValueError unless k is a whole number of blocks."""
    _, qk, nbytes = format_info(fmt)
    if k % qk:
        raise ValueError(f"{fmt}: K must be a multiple of its block size {qk}, got K = {k}")
    return k // qk * nbytes


def _check_disjoint(out: np.ndarray, src: np.ndarray) -> None:
    if np.may_share_memory(out, src):
        raise ValueError("out overlaps the input; pass a separate array")


def quantize(fmt: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ggml reference quantization of each row of x (rows, K) float32 -> (rows, row_bytes) uint8."""
    type_id, _, _ = format_info(fmt)
    check_array("x", x, 2, "(rows, K)", (np.dtype(np.float32),))
    rows, k = x.shape
    shape = (rows, row_bytes(fmt, k))
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    check_output("out", out, shape, np.dtype(np.uint8), "(rows, row_bytes)")
    stride_x, stride_out = unit_last_strides("x", x)[0], unit_last_strides("out", out)[0]
    if rows == 0 or k == 0:
        return out
    _check_disjoint(out, x)
    status = _kernels().quant_quantize(type_id, x.ctypes.data, stride_x, out.ctypes.data, stride_out, rows, k)
    _check(status, "quant_quantize", fmt)
    return out


def dequantize(fmt: str, data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ggml dequantization of each row of data (rows, row_bytes) uint8 -> (rows, K) float32."""
    type_id, qk, nbytes = format_info(fmt)
    check_array("data", data, 2, "(rows, row_bytes)", (np.dtype(np.uint8),))
    rows, nbytes_row = data.shape
    if nbytes_row % nbytes:
        raise ValueError(f"{fmt}: data rows must be a whole number of {nbytes}-byte blocks, "
                         f"got {nbytes_row} bytes")
    k = nbytes_row // nbytes * qk
    if out is None:
        out = np.empty((rows, k), dtype=np.float32)
    check_output("out", out, (rows, k), np.dtype(np.float32), "(rows, K)")
    stride_d, stride_out = unit_last_strides("data", data)[0], unit_last_strides("out", out)[0]
    if rows == 0 or k == 0:
        return out
    _check_disjoint(out, data)
    status = _kernels().quant_dequantize(type_id, data.ctypes.data, stride_d, out.ctypes.data, stride_out,
                                         rows, k)
    _check(status, "quant_dequantize", fmt)
    return out


def _check(status: int, kernel: str, fmt: str) -> None:
    if status == 1:
        raise ValueError(f"{kernel}: format {fmt!r} is not supported by the compiled kernel")
    if status == 3:
        raise ValueError(f"{kernel}: {fmt}: K is not a multiple of the block size")
    if status != 0:
        raise RuntimeError(f"{kernel} returned {status} for {fmt}")
