"""Byte-addressed loads shared by the GGML weight kernels (gemm.py's tiled and tensor-core kernels,
gemm_gemv.py's streaming GEMV): a block's fp16 scale or 32-bit word read at its byte address in one
load, instead of assembling it from bytes. Below both modules, so neither imports the other for them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian fp16 at the 2-byte-aligned byte address ptr, as fp32: one 16-bit load.
    Each thread reloads the scales of every (row, group) it holds (the tile's layout replicates
    them across the threads sharing a group), so one load instead of two bytes matters."""
    h = tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32_at(ptr, mask):
    """The little-endian uint32 at the 4-byte-aligned byte address ptr."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint32)), mask=mask, other=0)
