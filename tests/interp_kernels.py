"""Kernels of tests/test_attention_framework.py's interpreter test: imported inside the test, after the triton
backend has set the interpreter up (a jit'd helper has to be a module global)."""

import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2 + tl.full(x.shape, 1, x.dtype)


@triton.jit
def helper_kernel(X_ptr, Y_ptr, HELPERS: tl.constexpr, FAIL: tl.constexpr):
    offs = tl.program_id(0) * 8 + tl.arange(0, 8)
    v = tl.load(X_ptr + offs)
    for _ in tl.static_range(HELPERS):
        v = _twice(v)
    if FAIL:
        tl.static_assert(FAIL == 0, "fails on purpose")  # raises inside the launch
    tl.store(Y_ptr + offs, v)
