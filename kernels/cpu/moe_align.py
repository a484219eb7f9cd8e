"""Native CPU MoE token alignment (vLLM's moe_align_block_size; kernel in moe_align.c, a counting sort).

    align(topk_ids, num_experts, block_size, *, out_sorted=None, out_expert_ids=None, out_post_pad=None)
        -> (sorted_ids (P,), expert_ids (ceil(P / B),), num_tokens_post_pad (1,)), all int32

topk_ids: (T, k) int32, any strides, every id in [0, num_experts); T may be 0. P = T k + E (B - 1).
sorted_ids: the slots t k + j grouped by expert (ascending expert, ascending slot within one), each expert's
segment padded to a multiple of B with the sentinel T k, the sentinel past num_tokens_post_pad too;
expert_ids: each block's expert, -1 past num_tokens_post_pad. The out_* buffers are used when given
(C-contiguous int32 of those shapes). Arguments are refused (ValueError) as kernels/moe_args.py says,
the golden's conditions (refimpl/moe_align.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernel_parity.kernels.cpu.loader import check_output, check_status, element_strides, load
from kernel_parity.kernels.moe_args import bad_id, check_align_args, out_sizes

__all__ = ["align"]

_I32 = np.dtype(np.int32)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe_align")
        lib.moe_align_kernel.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
        lib.moe_align_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _out(name: str, a: np.ndarray | None, n: int) -> np.ndarray:
    if a is None:
        return np.empty(n, _I32)
    check_output(name, a, (n,), _I32, f"({n},)")
    if not a.flags.c_contiguous:
        raise ValueError(f"moe.align: {name} must be C-contiguous")
    return a


def align(topk_ids: np.ndarray, num_experts: int, block_size: int, *, out_sorted: np.ndarray | None = None,
          out_expert_ids: np.ndarray | None = None, out_post_pad: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted_ids, expert_ids, num_tokens_post_pad) of topk_ids (T, k); module docstring."""
    if not isinstance(topk_ids, np.ndarray):
        raise ValueError(f"moe.align: topk_ids must be a (T, k) int32 array, got {type(topk_ids).__name__}")
    T, k, E, B = check_align_args(topk_ids.shape, topk_ids.dtype, num_experts, block_size)
    flat = topk_ids.reshape(-1)
    if flat.size:
        bad = (flat < 0) | (flat >= E)
        if bad.any():
            raise bad_id(flat[bad][0], E)
    P, nb = out_sizes(T, k, E, B)
    sorted_ids = _out("out_sorted", out_sorted, P)
    expert_ids = _out("out_expert_ids", out_expert_ids, nb)
    post_pad = _out("out_post_pad", out_post_pad, 1)
    outs = (sorted_ids, expert_ids, post_pad)
    if any(np.may_share_memory(a, b) for i, a in enumerate(outs) for b in (*outs[i + 1:], topk_ids)):
        raise ValueError("moe.align: out_sorted, out_expert_ids and out_post_pad must not overlap each other or "
                         "topk_ids")
    stride_t, stride_k = element_strides("topk_ids", topk_ids)
    status = _kernels().moe_align_kernel(topk_ids.ctypes.data, stride_t, stride_k, T, k, E, B,
                                         sorted_ids.ctypes.data, expert_ids.ctypes.data, post_pad.ctypes.data)
    check_status(status, "moe_align_kernel")
    return sorted_ids, expert_ids, post_pad
