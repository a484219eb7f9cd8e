"""Attention backward on the CPU: dense prefill and packed varlen (kernel in attention_bwd.c).

    Delta_i = sum_c dO_ic O_ic - dL_i;   P_ij = exp(t_ij - L_i);   dS_ij = P_ij (dO_i . v_j - Delta_i) (1 - tanh^2)
    dq = scale dS K;   dk = scale dS^T Q;   dv = P^T dO   (dk, dv summed over each kv head's query heads)
    dsinks_h = -sum_{b, i} exp(S_h - L_i) Delta_i

q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v) (varlen: (total, h, d) rows packed by
    cu_seqlens_q / cu_seqlens_k (b + 1,) int32)
o, do: (b, s_q, h_q, d_v) in q's dtype: the forward output and its cotangent
lse: (b, h_q, s_q) float32 (varlen (h_q, total_q)): the forward's natural-log LSE *with the sink folded
    in* (-inf for a row with no key and no sink); dlse: its cotangent (same shape, float32) or None
sinks: (h_q,) float32 sink logits or None
returns {"dq", "dk", "dv"} in q's dtype and the inputs' shapes (and "dsinks" (h_q,) float32 with sinks);
    `out_*` buffers are used when given (last-axis stride 1)

Conventions (OPS.md, backward and attention): causal "none" | "bottom_right" | "top_left" per sequence,
window (left, right) inclusive, -1 unbounded, causal forcing right = 0; query head h reads kv head
h // (h_q // h_kv); fp32 accumulation, one rounding of each gradient; keys no query sees get zero
gradients, a row with no key dq = 0; the score matrix of a sequence and query head is materialised
(s_q x s_k fp32, twice), so this is a reference kernel for CPU sizes. `threads` > 1 spreads (sequence,
kv head) items over threads without changing the bits.
"""

from __future__ import annotations

import ctypes
import math
import numbers

import numpy as np

from kernel_parity.kernels.cpu.loader import (DTYPE_CODES, check_array, check_output, check_status, dtype_code,
                                              element_strides, load)

__all__ = ["prefill_backward", "varlen_backward"]

CAUSAL = {"none": 0, "bottom_right": 1, "top_left": 2}
_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


def _strided(name: str, fields: str) -> list:
    return [(name, _PTR), *((f"stride_{fields}_{x}", _I64) for x in "bsh")]


class _Params(ctypes.Structure):
    """attention_bwd.c's bwd_params, field for field."""
    _fields_ = [("dtype", _I64), *_strided("q", "q"), *_strided("k", "k"), *_strided("v", "v"), *_strided("o", "o"),
                *_strided("dout", "do"),
                ("lse", _PTR), *((f"stride_lse_{x}", _I64) for x in "bhs"),
                ("dlse", _PTR), *((f"stride_dlse_{x}", _I64) for x in "bhs"),
                ("sinks", _PTR), ("stride_sinks", _I64), ("cu_q", _PTR), ("cu_k", _PTR),
                *_strided("dq", "dq"), *_strided("dk", "dk"), *_strided("dv", "dv"),
                ("dsinks", _PTR), ("stride_dsinks", _I64),
                *[(n, _I64) for n in ("b", "s_q", "s_k", "h_q", "h_kv", "d", "d_v", "causal", "left", "right")],
                ("scale", _F64), ("softcap", _F64), ("threads", _I64)]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("attention_bwd")
        lib.attention_backward_kernel.argtypes = [ctypes.POINTER(_Params)]
        lib.attention_backward_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _rows(name: str, a: np.ndarray, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) element strides; the last axis must be unit-stride (no copy is made)."""
    strides = element_strides(name, a)
    if a.shape[-1] > 1 and a.size > 0 and strides[-1] != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got {strides[-1]} (strides {a.strides} bytes)")
    return (0, strides[0], strides[1]) if varlen else tuple(strides[:3])


def _check_options(causal, window, scale, softcap, threads) -> None:
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {tuple(CAUSAL)}, got {causal!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= -1 for x in window)):
        raise ValueError(f"window must be (left, right) ints >= -1 (-1 unbounded), got {window!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(softcap, numbers.Real) or not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")


def _launch(q, k, v, o, lse, do, dlse, cu_q, cu_k, *, b, s_q, s_k, scale, causal, window, softcap, sinks,
            out_dq, out_dk, out_dv, out_dsinks, threads) -> dict[str, np.ndarray]:
    varlen = cu_q is not None
    nd = 3 if varlen else 4
    lay = "(total, h, {})" if varlen else "(b, s, h, {})"
    check_array("q", q, nd, lay.format("d"), tuple(DTYPE_CODES))
    for name, a, w in (("k", k, "d"), ("v", v, "d_v"), ("o", o, "d_v"), ("do", do, "d_v")):
        check_array(name, a, nd, lay.format(w), (q.dtype,))
    h_q, d, h_kv, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if k.shape[-1] != d or v.shape[:-1] != k.shape[:-1] or o.shape != q.shape[:-1] + (d_v,) or do.shape != o.shape:
        raise ValueError(f"shapes do not agree: q {q.shape}, k {k.shape}, v {v.shape}, o {o.shape}, do {do.shape}")
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    lse_shape = (h_q, q.shape[0]) if varlen else (b, h_q, s_q)
    check_array("lse", lse, len(lse_shape), str(lse_shape), (_F32,))
    if lse.shape != lse_shape or (dlse is not None and (dlse.dtype != _F32 or dlse.shape != lse_shape)):
        raise ValueError(f"lse (and dlse) must be float32 {lse_shape}, got {lse.shape} "
                         f"{'' if dlse is None else f'/ {dlse.dtype} {dlse.shape}'}")
    if sinks is not None and (sinks.dtype != _F32 or sinks.shape != (h_q,)):
        raise ValueError(f"sinks must be float32 ({h_q},), got {sinks.dtype} {sinks.shape}")
    _check_options(causal, window, scale, softcap, threads)
    outs = {"dq": (out_dq, q.shape), "dk": (out_dk, k.shape), "dv": (out_dv, v.shape)}
    got = {}
    for name, (buf, shape) in outs.items():
        got[name] = np.empty(shape, dtype=q.dtype) if buf is None else buf
        check_output(f"out_{name}", got[name], shape, q.dtype, lay.format("d"))
    if sinks is not None:
        got["dsinks"] = np.empty(h_q, dtype=np.float32) if out_dsinks is None else out_dsinks
        check_output("out_dsinks", got["dsinks"], (h_q,), _F32, "(h_q,)")
    inputs = [a for a in (q, k, v, o, lse, do, dlse, sinks, cu_q, cu_k) if a is not None]
    for name, a in got.items():
        if any(np.may_share_memory(a, x) for x in inputs):
            raise ValueError(f"out_{name} overlaps an input")

    p = _Params(dtype=dtype_code(q.dtype), b=b, s_q=s_q, s_k=s_k, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v,
                causal=CAUSAL[causal], left=int(window[0]), right=int(window[1]),
                scale=float(1.0 / math.sqrt(d) if scale is None else scale), softcap=float(softcap),
                threads=int(threads))
    for field, name, a in (("q", "q", q), ("k", "k", k), ("v", "v", v), ("o", "o", o), ("dout", "do", do),
                           ("dq", "dq", got["dq"]), ("dk", "dk", got["dk"]), ("dv", "dv", got["dv"])):
        setattr(p, field, a.ctypes.data)
        for axis, stride in zip("bsh", _rows(name, a, varlen)):
            setattr(p, f"stride_{name}_{axis}", stride)
    for field, a in (("lse", lse), ("dlse", dlse)):
        if a is None:
            continue
        setattr(p, field, a.ctypes.data)
        strides = element_strides(field, a)
        for axis, stride in zip("bhs", (0, *strides) if varlen else strides):
            setattr(p, f"stride_{field}_{axis}", stride)
    if sinks is not None:
        p.sinks, (p.stride_sinks,) = sinks.ctypes.data, element_strides("sinks", sinks)
        p.dsinks, (p.stride_dsinks,) = got["dsinks"].ctypes.data, element_strides("out_dsinks", got["dsinks"])
    if varlen:
        p.cu_q, p.cu_k = cu_q.ctypes.data, cu_k.ctypes.data
    check_status(_kernels().attention_backward_kernel(ctypes.byref(p)), "attention_backward_kernel")
    return got


def prefill_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, lse: np.ndarray, do: np.ndarray,
                     dlse: np.ndarray | None = None, *, scale: float | None = None, causal: str = "none",
                     window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: np.ndarray | None = None,
                     out_dq: np.ndarray | None = None, out_dk: np.ndarray | None = None,
                     out_dv: np.ndarray | None = None, out_dsinks: np.ndarray | None = None,
                     threads: int = 1) -> dict[str, np.ndarray]:
    """Gradients of dense attention (module docstring); q (b, s_q, h_q, d), k / v (b, s_k, h_kv, d | d_v)."""
    check_array("q", q, 4, "(b, s_q, h_q, d)", tuple(DTYPE_CODES))
    check_array("k", k, 4, "(b, s_k, h_kv, d)", (q.dtype,))
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch {k.shape[0]} must equal q's b = {q.shape[0]}")
    return _launch(q, k, v, o, lse, do, dlse, None, None, b=q.shape[0], s_q=q.shape[1], s_k=k.shape[1], scale=scale,
                   causal=causal, window=window, softcap=softcap, sinks=sinks, out_dq=out_dq, out_dk=out_dk,
                   out_dv=out_dv, out_dsinks=out_dsinks, threads=threads)


def varlen_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray,
                    o: np.ndarray, lse: np.ndarray, do: np.ndarray, dlse: np.ndarray | None = None, *,
                    scale: float | None = None, causal: str = "none", window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sinks: np.ndarray | None = None, out_dq: np.ndarray | None = None,
                    out_dk: np.ndarray | None = None, out_dv: np.ndarray | None = None,
                    out_dsinks: np.ndarray | None = None, threads: int = 1) -> dict[str, np.ndarray]:
    """Gradients of packed variable-length attention; lse / dlse (h_q, total_q); empty sequences allowed."""
    check_array("q", q, 3, "(total_q, h_q, d)", tuple(DTYPE_CODES))
    check_array("k", k, 3, "(total_k, h_kv, d)", (q.dtype,))
    lens = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        check_array(name, cu, 1, "(b + 1,)", (_I32,))
        c = cu.astype(np.int64)
        if c.size < 1 or c[0] != 0 or (np.diff(c) < 0).any() or c[-1] != total:
            raise ValueError(f"{name} must run non-decreasing from 0 to {total}, got {cu}")
        lens.append(np.diff(c))
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} must both be (b + 1,)")
    return _launch(q, k, v, o, lse, do, dlse, np.ascontiguousarray(cu_seqlens_q), np.ascontiguousarray(cu_seqlens_k),
                   b=cu_seqlens_q.shape[0] - 1, s_q=int(lens[0].max(initial=0)), s_k=int(lens[1].max(initial=0)),
                   scale=scale, causal=causal, window=window, softcap=softcap, sinks=sinks, out_dq=out_dq,
                   out_dk=out_dk, out_dv=out_dv, out_dsinks=out_dsinks, threads=threads)
