"""Native FlashMLA split scheduler (kernel in mla_schedule.c): `get_mla_metadata` on the host.

    get_mla_metadata(seqlens, s_q, h_q, h_kv, sms) -> (meta (P, 8) int32, num_splits (b + 1,) int32)

seqlens: (b,) int32 >= 0, any stride; P = sms // h_kv // ceil(s_q h_q / h_kv / 64) >= 1 (FlashMLA's
num_sm_parts; FlashMLA reads sms from the device, here it is an argument). floor: the payload's 2 x 5
floor (FlashMLA's Apr 2025 scheduler; False: Feb 2025). Columns 5..7 of meta are written 0.
`out_meta` / `out_num_splits` are used when given (C-contiguous int32 of those shapes).
Conventions: refimpl/mla_schedule.py (the golden), conformance/ops/mla_schedule.py (the op).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_array, check_output, load

__all__ = ["get_mla_metadata", "num_sm_parts"]

BLOCK, FIXED_OVERHEAD = 64, 5
_I32 = np.dtype(np.int32)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("mla_schedule")
        lib.mla_num_sm_parts.argtypes = [_I64] * 4
        lib.mla_num_sm_parts.restype = _I64
        lib.mla_get_metadata.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR]
        lib.mla_get_metadata.restype = ctypes.c_int
        _lib = lib
    return _lib


def num_sm_parts(sms: int, s_q: int, h_q: int, h_kv: int = 1) -> int:
    if min(sms, s_q, h_q, h_kv) < 1 or h_q % h_kv:
        raise ValueError(f"need sms, s_q, h_q, h_kv >= 1 and h_q % h_kv == 0, got {sms}, {s_q}, {h_q}, {h_kv}")
    return int(_kernels().mla_num_sm_parts(sms, s_q, h_q, h_kv))


def get_mla_metadata(seqlens: np.ndarray, s_q: int, h_q: int, h_kv: int, sms: int, floor: bool = True,
                     out_meta: np.ndarray | None = None, out_num_splits: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    L = check_array("seqlens", seqlens, 1, "(b,)", (_I32,))
    b = L.shape[0]
    if b < 1 or (L < 0).any():
        raise ValueError(f"seqlens must be non-empty and >= 0, got shape {L.shape}")
    parts = num_sm_parts(sms, s_q, h_q, h_kv)
    if parts < 1:
        raise ValueError(f"num_sm_parts = {parts} for sms={sms}, s_q={s_q}, h_q={h_q}, h_kv={h_kv}")
    meta = np.empty((parts, 8), _I32) if out_meta is None else out_meta
    ns = np.empty(b + 1, _I32) if out_num_splits is None else out_num_splits
    check_output("out_meta", meta, (parts, 8), _I32, "(num_sm_parts, 8)")
    check_output("out_num_splits", ns, (b + 1,), _I32, "(b + 1,)")
    if not (meta.flags.c_contiguous and ns.flags.c_contiguous) or L.strides[0] % 4:
        raise ValueError("out_meta and out_num_splits must be C-contiguous, seqlens aligned")
    status = _kernels().mla_get_metadata(L.ctypes.data, L.strides[0] // 4, b, BLOCK, FIXED_OVERHEAD, parts,
                                         int(bool(floor)), meta.ctypes.data, ns.ctypes.data)
    if status == 4:
        raise ValueError("the total cost of seqlens overflows FlashMLA's int32 sum")
    if status != 0:
        raise RuntimeError(f"mla_get_metadata returned {status} (a block left unassigned)")
    return meta, ns
