"""Make the Triton interpreter compute bfloat16 the way the GPU does.

Seen with Triton 3.9's interpreter (TRITON_INTERPRET=1): `x.to(tl.bfloat16)` truncates the
fp32 mantissa (round toward zero) where the GPU's `cvt.rn.bf16.f32` rounds to nearest even, and
the explicit `fp_downcast_rounding="rtne"` path rounds half up without ties-to-even or a carry
into the exponent. A kernel that is right on the GPU then shows a one-ulp bias on the CPU (a
1.0000153 -> bf16 of 1.0 instead of 1.0078125), enough to fail bf16 cos_diff limits: the
interpreter, not the kernel, is wrong. Its `tl.dot` on bfloat16 operands multiplies the raw
uint16 bit patterns (a 16x16 product of N(0, 1) values came out 2.6e10 off), where the GPU's
tensor cores multiply the values and accumulate in fp32. Its fp32 -> fp8 (e4m3, e5m2) casts
drop the rounding carry into the exponent (7.9 -> 4.0), round ties away from zero and lose the
sign of zero, where the GPU's `cvt.rn.satfinite` rounds to nearest even and saturates.

`ensure_bf16()` probes each behaviour with a tiny kernel and, only where the probe shows the
defect, replaces that piece of the interpreter's builder: fp32 -> bf16 conversions with
ml_dtypes' correctly rounded cast, bf16 dot operands widened to fp32 (exact) before the
product, and fp32/fp16/bf16 -> fp8 casts through ml_dtypes after a saturating clamp. The backend's description lists the fixes in place.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_PROBE_IN = 1.0 + 2.0**-8 + 2.0**-12  # just above the halfway point between 1 and 1 + 2^-7
_PROBE_RNE = 1.0 + 2.0**-7


def _probe() -> float:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(X_ptr, Y_ptr):
        tl.store(Y_ptr, tl.load(X_ptr).to(tl.bfloat16))

    x = torch.tensor([_PROBE_IN], dtype=torch.float32)
    y = torch.empty(1, dtype=torch.bfloat16)
    _probe_kernel[(1,)](x, y)
    return float(y.float()[0])


def _probe_dot() -> bool:
    """True if a bf16 tl.dot of small integers is exact (what the GPU computes)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _dot_probe_kernel(A_ptr, B_ptr, C_ptr):
        offs = tl.arange(0, 16)
        a = tl.load(A_ptr + offs[:, None] * 16 + offs[None, :])
        b = tl.load(B_ptr + offs[:, None] * 16 + offs[None, :])
        tl.store(C_ptr + offs[:, None] * 16 + offs[None, :], tl.dot(a, b))

    a = (torch.arange(256, dtype=torch.float32).reshape(16, 16) % 7 - 3).to(torch.bfloat16)
    c = torch.empty(16, 16, dtype=torch.float32)
    _dot_probe_kernel[(1,)](a, a, c)
    return bool(torch.equal(c, a.float() @ a.float()))


def _install_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h: "interp.TensorHandle") -> "interp.TensorHandle":
        if h.dtype.scalar != tl.bfloat16:
            return h
        # bf16 is the top half of an fp32; C order, because a transposed operand (tl.trans) kept in
        # its strides leaves numpy's BLAS path (measured 30 ms instead of 0.04 for a 64 x 128 x 64 dot)
        bits = np.asarray(h.data).astype(np.uint32, order="C") << 16
        return interp.TensorHandle(bits.view(np.float32), tl.float32)

    def fixed_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = fixed_dot
    builder._kernel_parity_bf16_dot = True


def _install() -> None:
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def to_bf16(src: "interp.TensorHandle", rtz: bool) -> "interp.TensorHandle":
        x = np.asarray(src.data, dtype=np.float32)
        if rtz:
            bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        else:
            bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        return interp.TensorHandle(bits, tl.bfloat16)

    def fixed_cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src, rtz=False)
        return cast_impl(self, src, dst_type)

    def fixed_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src, rtz=rounding_mode == ir.ROUNDING_MODE.RTZ)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = fixed_cast_impl
    builder.create_fp_to_fp = fixed_fp_to_fp
    builder._kernel_parity_bf16_rne = True


_FP8 = {}  # tl dtype name -> (ml_dtypes type, max finite), filled on first use


def _fp8_types() -> dict:
    import triton.language as tl

    if not _FP8:
        _FP8.update({tl.float8e4nv: (ml_dtypes.float8_e4m3fn, 448.0), tl.float8e5: (ml_dtypes.float8_e5m2, 57344.0)})
    return _FP8


def _probe_fp8() -> bool:
    """True if fp32 -> e4m3 rounds to nearest even with the carry into the exponent (7.9 -> 8),
    keeps the sign of zero (-2^-12 -> -0) and saturates (500 -> 448), as the GPU's cvt.rn.satfinite."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_probe_kernel(X_ptr, Y_ptr):
        offs = tl.arange(0, 4)
        tl.store(Y_ptr + offs, tl.load(X_ptr + offs).to(tl.float8e4nv))

    x = torch.tensor([7.9, -(2.0**-12), 500.0, 0.3], dtype=torch.float32)
    y = torch.empty(4, dtype=torch.float8_e4m3fn)
    _fp8_probe_kernel[(1,)](x, y)
    want = x.numpy().clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return bool(np.array_equal(y.view(torch.uint8).numpy(), want))


def _install_fp8() -> None:
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    types = _fp8_types()

    def to_fp8(src: "interp.TensorHandle", dst: object) -> "interp.TensorHandle":
        np_type, top = types[dst]
        x = np.asarray(src.data).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            bits = np.clip(x, -top, top).astype(np_type).view(np.uint8)  # NaN stays NaN
        return interp.TensorHandle(bits, dst)

    def converts(src, dst_type) -> bool:
        import triton.language as tl

        return dst_type.scalar in types and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16)

    def fixed_cast_impl(self, src, dst_type):
        return to_fp8(src, dst_type.scalar) if converts(src, dst_type) else cast_impl(self, src, dst_type)

    def fixed_fp_to_fp(self, src, dst_type, rounding_mode):
        if converts(src, dst_type):
            return to_fp8(src, dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = fixed_cast_impl
    builder.create_fp_to_fp = fixed_fp_to_fp
    builder._kernel_parity_fp8 = True


def _install_patch_once() -> None:
    """Patch triton.language once a launch, not again at every @triton.jit helper call.

    The interpreter swaps triton.language's builtins for interpreted ones when a launch starts (and puts them back
    when it ends), and again, through inspect.getmembers over the whole package, on every call of a jit'd helper
    inside the kernel, keeping nothing new: the builtins it finds are the launch's already. A kernel whose loop calls
    helpers spent ~18% of its interpreted time there (attention.decode_split's ci cases: 17.6 of 99 s). Now a
    helper call inside a launch skips the patch when the launch has patched every triton.language module the
    helper's globals see (tl, tl.core); anything else patches as before. Computation is untouched: the same
    interpreted builtins run."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp._patch_lang
    if getattr(original, "_kernel_parity_once", False) or not hasattr(interp, "_LangPatchScope"):
        return
    active: list[set[int]] = []  # the lang modules each running launch patched, innermost last

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def patch_lang(fn):
        seen = langs(fn)
        if active and seen <= active[-1]:  # a helper inside a launch: its modules are patched
            return interp._LangPatchScope()
        scope = original(fn)
        if active:  # a helper seeing a module the launch did not patch: patched as before (kept to the end)
            active[-1] |= seen
            return scope
        active.append(seen)
        restore = scope.restore

        def restore_and_pop() -> None:
            active.pop()
            restore()

        scope.restore = restore_and_pop
        return scope

    patch_lang._kernel_parity_once = True
    interp._patch_lang = patch_lang


def _install_np_dtype_table() -> None:
    """The interpreter's dtype -> NumPy dtype map, built once: its `_get_np_dtype` builds a 17-entry dict (17
    dtype hashes) at every call, ~300,000 calls in attention.decode_split's ci cases (7% of their interpreted time).
    The table holds the original's own answer for every triton.language dtype; anything else asks the original."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = getattr(interp, "_get_np_dtype", None)
    if original is None or getattr(original, "_kernel_parity_table", False):
        return
    table = {}
    for value in vars(tl).values():
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = original(value)
            except (KeyError, TypeError):
                pass

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            element = tt_dtype.element_ty
            if not isinstance(element, tl.pointer_type) and element in table:
                return table[element]
        elif not isinstance(tt_dtype, tl.pointer_type) and tt_dtype in table:
            return table[tt_dtype]
        return original(tt_dtype)

    get_np_dtype._kernel_parity_table = True
    interp._get_np_dtype = get_np_dtype


def ensure_bf16() -> str | None:
    """Probe, fix what is broken; returns a note for the backend description (None: nothing fixed)."""
    from triton.runtime import interpreter as interp

    _install_patch_once()
    _install_np_dtype_table()
    builder = interp.InterpreterBuilder
    notes = []
    if getattr(builder, "_kernel_parity_bf16_rne", False) or _probe() != _PROBE_RNE:
        if not getattr(builder, "_kernel_parity_bf16_rne", False):
            _install()
            if _probe() != _PROBE_RNE:  # pragma: no cover - the fix did not take
                raise RuntimeError("could not make the Triton interpreter round fp32 -> bf16 to nearest even")
        notes.append("fp32->bf16 rounding fixed to nearest-even")
    if getattr(builder, "_kernel_parity_bf16_dot", False) or not _probe_dot():
        if not getattr(builder, "_kernel_parity_bf16_dot", False):
            _install_dot()
            if not _probe_dot():  # pragma: no cover
                raise RuntimeError("could not make the Triton interpreter's bf16 tl.dot exact")
        notes.append("bf16 dot operands widened to fp32")
    if getattr(builder, "_kernel_parity_fp8", False) or not _probe_fp8():
        if not getattr(builder, "_kernel_parity_fp8", False):
            _install_fp8()
            if not _probe_fp8():  # pragma: no cover
                raise RuntimeError("could not make the Triton interpreter's fp32 -> fp8 cast round to nearest even")
        notes.append("fp32->fp8 casts fixed to nearest-even, saturating, signed zeros")
    return "; ".join(notes) or None
