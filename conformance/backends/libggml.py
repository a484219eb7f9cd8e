"""libggml through ctypes: the third-party oracle for the GGML block formats (verification only).

The shared libraries come from the environment variable KERNEL_PARITY_LIBGGML: a directory
holding libggml-base.so and libggml-cpu.so, or a ggml CMake build tree (searched in ., src/,
src/ggml-cpu/, bin/, lib/). Nothing is read or loaded at import; the first call reads the variable
and loads them (once per process).

- `quantize(fmt, x)`: `ggml_quantize_chunk(type, x, ..., imatrix=NULL)`, what llama-quantize writes
  without an importance matrix. Its iq4_nl path (ntry = 7) is not the `_ref` one. The activation
  formats q8_1 and q8_k have no chunk quantizer (ggml asserts): they raise ValueError here.
- `quantize_ref(fmt, x)`: `quantize_row_<fmt>_ref`, for all 13 formats. The output buffer is zeroed
  first, so bytes ggml leaves unwritten (q8_k bsums of a zero block) read 0; iq4_nl's codes of a
  block with max|x| < 1e-15 are whatever ggml leaves there (stale codes), d = 0.
- `quantize_cpu(fmt, x)`: the CPU backend's `from_float` (`ggml_get_type_traits_cpu`), the
  activation quantizer `ggml_mul_mat` uses; on x86 AVX2 q8_0/q8_1 round half to even with
  127/amax, which is not the ref's roundf.
- `dequantize(fmt, data)`: `dequantize_row_<fmt>` to float32 (q8_1 has none: ValueError).
- `gemm_nt(fmt, a, w)`: C[m, n] = dot(W[n], A[m]) as ggml's CPU computes it: each A row converted
  with `from_float` of the weight type's `vec_dot_type`, then one `vec_dot` call per (n, m) over K.
  This is the per-row kernel of ggml_compute_forward_mul_mat, without the repacked (Q4_0x8 etc.),
  llamafile sgemm or AMX paths a graph may pick instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from kernel_parity.refimpl.quant import FORMATS

ENV = "KERNEL_PARITY_LIBGGML"
TYPE_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q8_1": 9, "q2_k": 10, "q3_k": 11,
            "q4_k": 12, "q5_k": 13, "q6_k": 14, "q8_k": 15, "iq4_nl": 20}
_NAMES = {v: k for k, v in TYPE_IDS.items()}
_SUBDIRS = (".", "src", "src/ggml-cpu", "bin", "lib")

_ROW_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)  # (src, dst, k)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _TraitsCpu(ctypes.Structure):
    """struct ggml_type_traits_cpu (include/ggml-cpu.h)."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


def _find(root: Path, name: str) -> Path | None:
    for sub in _SUBDIRS:
        p = root / sub / name
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL, ctypes.CDLL] | str:
    """(base, cpu) libraries, or the reason they cannot be loaded."""
    root = os.environ.get(ENV)
    if not root:
        return f"{ENV} is not set (a directory with libggml-base.so and libggml-cpu.so, or a ggml build tree)"
    paths = {n: _find(Path(root), f"lib{n}.so") for n in ("ggml-base", "ggml-cpu")}
    missing = [f"lib{n}.so" for n, p in paths.items() if p is None]
    if missing:
        return f"{ENV}={root}: {', '.join(missing)} not found under {', '.join(_SUBDIRS)}"
    try:
        base = ctypes.CDLL(str(paths["ggml-base"]), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(paths["ggml-cpu"]), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return f"{ENV}={root}: cannot load libggml: {e}"
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()  # fp16 tables and CPU feature detection, before any CPU trait is used
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return base, cpu


def available() -> str | None:
    """None when libggml can be used, else one line saying why not."""
    lib = _load()
    return lib if isinstance(lib, str) else None


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    lib = _load()
    if isinstance(lib, str):
        raise RuntimeError(f"libggml unavailable: {lib}")
    return lib


def _c_name(fmt: str) -> str:
    """ggml's spelling in symbol names: q4_K, iq4_nl, q8_0."""
    return fmt[:-1] + "K" if fmt.endswith("_k") else fmt


def _rows(fmt: str, x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...], int]:
    if fmt not in TYPE_IDS:
        raise ValueError(f"unknown quant format {fmt!r}; known formats: {', '.join(TYPE_IDS)}")
    f = FORMATS[fmt]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % f.block:
        raise ValueError(f"{fmt}: K = {x.shape[-1] if x.ndim else 0} is not a multiple of the block size {f.block}")
    return x.reshape(-1, x.shape[-1]), x.shape[:-1], x.shape[-1] // f.block * f.nbytes


def _row_fn(lib: ctypes.CDLL, name: str) -> ctypes._CFuncPtr:
    return _ROW_FN(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)


def quantize(fmt: str, x: np.ndarray) -> np.ndarray:
    """ggml_quantize_chunk with imatrix NULL. x: (..., K) float32 -> (..., K // block * nbytes) uint8."""
    if fmt in ("q8_1", "q8_k"):
        raise ValueError(f"{fmt}: ggml_quantize_chunk has no {fmt} path (an activation format; ggml "
                         "would abort): use quantize_ref")
    rows, lead, nbytes = _rows(fmt, x)
    base, _ = _libs()
    out = np.zeros((rows.shape[0], nbytes), np.uint8)
    if rows.size:
        base.ggml_quantize_chunk(TYPE_IDS[fmt], rows.ctypes.data, out.ctypes.data, 0, rows.shape[0],
                                 rows.shape[1], None)
    return out.reshape(*lead, nbytes)


def quantize_ref(fmt: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """quantize_row_<fmt>_ref, row by row. x: (..., K) float32 -> (..., K // block * nbytes) uint8.

    out: None (a zeroed buffer, so bytes ggml leaves unwritten read 0), or a C-contiguous uint8
    buffer of that shape that ggml writes into as it is (bytes it never writes keep their value)."""
    rows, lead, nbytes = _rows(fmt, x)
    fn = _row_fn(_libs()[0], f"quantize_row_{_c_name(fmt)}_ref")
    if out is None:
        out = np.zeros((*lead, nbytes), np.uint8)
    if out.shape != (*lead, nbytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"{fmt}: out must be C-contiguous uint8 {(*lead, nbytes)}, got {out.dtype} {out.shape}")
    flat = out.reshape(-1, nbytes)
    for r in range(rows.shape[0]):  # one call per row, as ggml's from_float_ref is used
        fn(rows[r].ctypes.data, flat[r].ctypes.data, rows.shape[1])
    return out


def _traits_cpu(fmt: str) -> _TraitsCpu:
    return _libs()[1].ggml_get_type_traits_cpu(TYPE_IDS[fmt]).contents


def vec_dot_type(fmt: str) -> str:
    """The activation format the CPU backend pairs with `fmt` in a dot product."""
    t = _traits_cpu(fmt).vec_dot_type
    return _NAMES.get(t, f"ggml type {t}")


def quantize_cpu(fmt: str, x: np.ndarray) -> np.ndarray:
    """The CPU backend's from_float for `fmt`. x: (..., K) float32 -> (..., K // block * nbytes) uint8."""
    rows, lead, nbytes = _rows(fmt, x)
    ptr = _traits_cpu(fmt).from_float
    if not ptr:
        raise ValueError(f"{fmt}: the CPU backend has no from_float")
    fn = _ROW_FN(ptr)
    out = np.zeros((rows.shape[0], nbytes), np.uint8)
    for r in range(rows.shape[0]):
        fn(rows[r].ctypes.data, out[r].ctypes.data, rows.shape[1])
    return out.reshape(*lead, nbytes)


def dequantize(fmt: str, data: np.ndarray) -> np.ndarray:
    """dequantize_row_<fmt>. data: (..., nblocks * nbytes) uint8 -> (..., nblocks * block) float32."""
    if fmt not in TYPE_IDS:
        raise ValueError(f"unknown quant format {fmt!r}; known formats: {', '.join(TYPE_IDS)}")
    if fmt == "q8_1":
        raise ValueError("q8_1: libggml has no dequantize_row_q8_1")
    f = FORMATS[fmt]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.ndim == 0 or data.shape[-1] % f.nbytes:
        raise ValueError(f"{fmt}: byte length {data.shape[-1] if data.ndim else 0} is not a multiple of {f.nbytes}")
    n = data.shape[-1] // f.nbytes * f.block
    out = np.empty((*data.shape[:-1], n), np.float32)
    if out.size:
        fn = _row_fn(_libs()[0], f"dequantize_row_{_c_name(fmt)}")
        fn(data.ctypes.data, out.ctypes.data, out.size)
    return out


def gemm_nt(fmt: str, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """C = A @ W^T with W in `fmt`, as ggml's CPU: from_float(vec_dot_type) on A, then vec_dot.

    a: (M, K) float32 activations
    w: (N, K // block * nbytes) uint8, rows of `fmt` blocks
    returns: (M, N) float32
    """
    tw = _traits_cpu(fmt)
    if not tw.vec_dot:
        raise ValueError(f"{fmt}: the CPU backend has no vec_dot")
    act = _NAMES.get(tw.vec_dot_type)
    if act is None:
        raise ValueError(f"{fmt}: vec_dot_type {tw.vec_dot_type} is not a block format here")
    a = np.ascontiguousarray(a, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.uint8)
    m, k = a.shape
    if w.shape[-1] != k // FORMATS[fmt].block * FORMATS[fmt].nbytes or k % FORMATS[fmt].block:
        raise ValueError(f"{fmt}: W rows of {w.shape[-1]} bytes do not hold K = {k} elements")
    aq = quantize_cpu(act, a)
    dot = _VEC_DOT(tw.vec_dot)
    out = np.empty((m, w.shape[0]), np.float32)
    s = ctypes.c_float()
    ps = ctypes.addressof(s)
    for i in range(m):
        pa = aq.ctypes.data + i * aq.strides[0]
        for j in range(w.shape[0]):
            dot(k, ps, 0, w.ctypes.data + j * w.strides[0], 0, pa, 0, 1)  # nrc = 1: one dot
            out[i, j] = s.value
    return out


# -- the plugin backend ---------------------------------------------------------------------------
def _bk_quantize(case, inputs, out):
    q = out.numpy("q")
    quantize_ref(case.p["fmt"], inputs["x"], out=q)  # into the poisoned buffer: unwritten bytes show
    return {"q": q}


def _bk_dequantize(case, inputs, out):
    y = out.numpy("y")
    y[...] = dequantize(case.p["fmt"], inputs["data"])
    return {"y": y}


def _bk_gemm(case, inputs, out):
    c = out.numpy("c")
    c[...] = gemm_nt(case.p["wfmt"], inputs["a"], inputs["w"])
    if "bias" in inputs:
        c += inputs["bias"]  # ggml adds a bias as a separate float32 op after mul_mat
    return {"c": c}


class GgmlBackend:
    """libggml's CPU kernels as a third-party backend `ggml` (entry point; needs KERNEL_PARITY_LIBGGML).

    quant.quantize: the `_ref` quantizers; quant.dequantize: `dequantize_row_*`; gemm.gemm_nt: the
    CPU `from_float` + `vec_dot` path, which on x86 quantizes activations with round-half-even and
    127/amax (it claims the `emulated_x86` reference)."""

    name = "ggml"
    device = "cpu"
    dtypes = ("fp32",)
    origin = None
    doc = "libggml (llama.cpp's ggml, CPU): reference quantizers, dequantizers, vec_dot GEMM"
    ops = {"quant.quantize": _bk_quantize, "quant.dequantize": _bk_dequantize, "gemm.gemm_nt": _bk_gemm}
    claims = {"gemm.gemm_nt": "emulated_x86"}

    def available(self) -> str | None:
        return available()

    def supports(self, case) -> str | None:
        if case.op not in self.ops:
            return f"ggml has no kernel for {case.op} here"
        if case.dtype != "fp32":
            return f"ggml's CPU kernels take float32 here, not {case.dtype}"
        if case.op == "quant.dequantize" and case.p["fmt"] == "q8_1":
            return "libggml has no dequantize_row_q8_1"
        if case.op == "gemm.gemm_nt":
            import platform

            if case.p["wfmt"] not in TYPE_IDS or case.p["wfmt"] in ("q8_1", "q8_k"):
                return f"ggml has no {case.p['wfmt']} weight type here"
            if platform.machine() not in ("x86_64", "AMD64"):
                return "the emulated_x86 claim holds for ggml's x86 activation quantizer only"
        return None

    def run(self, case, inputs, out):
        return self.ops[case.op](case, inputs, out)

    def describe(self) -> str:
        return "ggml (cpu, libggml via KERNEL_PARITY_LIBGGML)"


GGML = GgmlBackend
