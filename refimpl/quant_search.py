"""The float32 arithmetic of ggml's reference quantizers, emulated bit for bit in NumPy.

Two parts, both used by `refimpl.quant` and `refimpl.quant_kquants`:
- C primitives: `nearest_int` (the 1.5 * 2^23 trick, round half to even; `nearest_code` clamps it
  and returns float32 codes), `roundf` (half away from zero), `trunc_int8`/`trunc_uint8` (a C float -> int8/uint8 cast: truncation to int32, then the
  low byte), `fp16_bits`/`fp16_value` (ggml's fp32 <-> fp16), `seq_sum` (a C `for` loop sum).
- The scale searches of `ggml-quants.c` (K-quants, IQ4_NL): `make_qkx2_quants` (Q2_K, Q4_K, Q5_K),
  `make_q3_quants` (Q3_K), `make_qx_quants` (Q6_K), `iq4_nl_index` (`best_index_int8`).

Conventions:
- Sub-blocks are laid out element-major, `x: (n, S)`: row i holds element i of all S sub-blocks, so a
  C loop over the n elements of one sub-block is a loop over rows, each step vectorised over the S
  sub-blocks. Every sum a C loop accumulates is accumulated in that order (`np.sum` is pairwise and
  would round differently).
- All arithmetic is float32 in the order the C expression evaluates it (`w*x[i]*l` is `(w*x)*l`,
  int operands converted to float first). ggml's CMake compiles libggml-base (ggml-quants.c) with
  no -march flag, so on x86-64 nothing is fused into an FMA: NumPy's separately rounded float32
  operations are the same operations. (A build whose C compiler contracts a*b + c, e.g. with
  -march=native or on aarch64 where FMA is baseline, may differ in rare ties.)
- Lanes the C returns early from (all-zero or flat sub-blocks) are computed on with a harmless
  substitute divisor and masked at the end, so no NaN reaches `nearest_code`'s fast path.
- A search's early exit (`if (!n_changed) break;`) is dropped where the iteration is a pure function
  of its state, so further iterations change nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F32 = np.float32
A32 = NDArray[np.float32]
AI = NDArray[np.int32]

GROUP_MAX_EPS = F32(1e-15)  # ggml's "all zero" threshold of a sub-block
_MAGIC = F32(12582912.0)  # 1.5 * 2^23: f + MAGIC has ulp 1, its mantissa holds round(f) + 2^22

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_KV32 = KVALUES_IQ4NL.astype(np.float32)


# ---- C primitives --------------------------------------------------------------------------------


def nearest_int(f: A32) -> AI:
    """ggml's `nearest_int`: bits(f + 1.5 * 2^23) & 0x7fffff - 0x400000.

    Round half to even for |f| <= 2^22 - 1; outside that range (where C's assert is compiled out
    under NDEBUG) the same bit arithmetic is reproduced, garbage included.
    """
    v = (np.asarray(f, np.float32) + _MAGIC).view(np.int32)
    return (v & 0x7FFFFF) - 0x400000


def nearest_code(f: A32, lo: int, hi: int) -> A32:
    """clamp(nearest_int(f), lo, hi) as float32 codes, exactly.

    Where |f| <= 2^22 - 1 everywhere (the usual case) the trick is done in float:
    (f + 1.5 * 2^23) - 1.5 * 2^23 is the integer the bits encode; otherwise `nearest_int`'s bits.
    """
    f = np.asarray(f, np.float32)
    if f.size and np.abs(f).max() <= F32(4194303):  # False for NaN too
        r = f + _MAGIC
        r -= _MAGIC
        return np.clip(r, F32(lo), F32(hi), out=r)
    return np.clip(nearest_int(f), lo, hi).astype(np.float32)


_BELOW_HALF = np.nextafter(F32(0.5), F32(0))  # 0.5 - 2^-25


def roundf(v: A32) -> A32:
    """C `roundf`: round half away from zero, as trunc(v + copysign(0.5 - 2^-25, v)) in float32.

    Below a tie the sum stays under the next integer; at a tie (k + 0.5) the exact sum
    k + 1 - 2^-25 rounds (to nearest even) up to k + 1. Checked against the trunc/fraction form on
    every float32 with |v| < 300 (codes here are |v| <= 127.5).
    """
    h = np.copysign(_BELOW_HALF, v).astype(np.float32)
    h += v
    return np.trunc(h, out=h)


def trunc_int8(v: A32) -> NDArray[np.int8]:
    """C `(int8_t)v` as GCC on x86 compiles it: truncate to int32 (cvttss2si), keep the low byte."""
    with np.errstate(invalid="ignore"):
        return v.astype(np.int32).astype(np.int8)


def trunc_uint8(v: A32) -> NDArray[np.uint8]:
    """C `(uint8_t)v`: truncate to int32, keep the low byte."""
    with np.errstate(invalid="ignore"):
        return v.astype(np.int32).astype(np.uint8)


def fp16_bits(x: A32) -> NDArray[np.uint16]:
    """ggml's fp32 -> fp16 (`GGML_FP32_TO_FP16`): round to nearest even, overflow -> inf,
    NaN -> 0x7E00 with the sign kept (NumPy would keep payload bits)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        sign = ((x.view(np.uint32) >> 16) & 0x8000).astype(np.uint16)
        h = np.where(nan, sign | np.uint16(0x7E00), h)
    return h


def fp16_value(h: NDArray[np.uint16]) -> A32:
    """fp16 bits -> float32 (exact)."""
    return np.asarray(h, np.uint16).view(np.float16).astype(np.float32)


def seq_sum(terms: A32, first: bool = False) -> A32:
    """sum_i terms[i] along axis 0, accumulated left to right in float32, like a C loop.

    first=False starts from `float s = 0;` (+0), first=True from `s = terms[0]` (as
    make_qkx2_quants does); the two differ only in the sign of an exactly zero sum.
    """
    acc = terms[0].copy() if first else np.zeros(terms.shape[1:], np.float32)
    for t in terms[1:] if first else terms:
        acc += t
    return acc


def signed_absmax(x: A32, axis: int = 0) -> tuple[A32, A32]:
    """(amax, max) of a C loop `if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }` from
    amax = max = 0: the first element of largest magnitude, and +0 when every element is zero. NaN
    (a sub-block scale whose float32 sums overflowed) is skipped, as the comparison skips it."""
    ax = np.abs(x)
    ax = np.where(np.isnan(ax), F32(-1), ax)  # `fabsf(NaN) > amax` is false: a NaN is never chosen
    i = np.expand_dims(np.argmax(ax, axis=axis), axis)
    amax = np.maximum(np.take_along_axis(ax, i, axis).squeeze(axis), F32(0))
    mx = np.take_along_axis(x, i, axis).squeeze(axis)
    return amax, np.where(amax > 0, mx, F32(0)).astype(np.float32)


def first_min_max(x: A32, axis: int = 0) -> tuple[A32, A32]:
    """(min, max) of a C loop `if (x[i] < min) min = x[i]; if (x[i] > max) max = x[i];` started at
    x[0] (or at +-FLT_MAX): the first occurrence of each extreme, which fixes the sign of a zero."""
    lo = np.take_along_axis(x, np.expand_dims(np.argmin(x, axis=axis), axis), axis).squeeze(axis)
    hi = np.take_along_axis(x, np.expand_dims(np.argmax(x, axis=axis), axis), axis).squeeze(axis)
    return lo, hi


# ---- scale searches ------------------------------------------------------------------------------


def make_qkx2_quants(x: A32, w: A32, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[A32, A32, A32]:
    """Weighted least-squares fit x ~ scale * L - the_min, L in [0, nmax], of `make_qkx2_quants`.

    Start from iscale = nmax / (max - min) (min clamped to <= 0), error sum_i w_i * err_i with
    err = (scale*L + min - x)^2 (|.| if use_mad); then for is = 0..nstep try
    iscale = (rmin + rdelta*is + nmax) / (max - min), codes L = clamp(nearest_int(iscale*(x - min))),
    the closed-form weighted fit (scale, min) of x on L (min forced <= 0), keep it if its error is
    strictly smaller; a kept fit's min is the min of the following steps' iscale and x - min.

    x, w: (n, S) float32, S sub-blocks of n elements, element-major
    returns: (scale (S,), the_min (S,) = -min >= 0, L (n, S) float32 integer codes)
    A flat sub-block (max == min after the clamp) gives scale 0, L 0, the_min = -min.
    """
    with np.errstate(all="ignore"):  # flat sub-blocks divide by zero; they are masked at the end
        mn, mx = first_min_max(x)
        sum_w = seq_sum(w, first=True)
        sum_x = seq_sum(w * x, first=True)  # sum_w = w[0], sum_x = sum_w*x[0], then += w*x[i]
        mn = np.where(mn > 0, F32(0), mn).astype(np.float32)
        flat = mx == mn
        live = ~flat
        mx = np.where(flat, mn + F32(1), mx)  # flat lanes compute finite junk, masked at the end
        nm = F32(nmax)

        def codes(iscale: A32, m: A32) -> A32:
            f = x - m
            f *= iscale
            return nearest_code(f, 0, nmax)

        def error(scale: A32, m: A32, L: A32) -> A32:
            e = L * scale  # diff = scale*L + min - x; then |diff| or diff^2, times w
            e += m
            e -= x
            if use_mad:
                np.abs(e, out=e)
            else:
                e *= e
            e *= w
            return seq_sum(e)

        iscale = nm / (mx - mn)
        scale = F32(1) / iscale
        L = codes(iscale, mn)
        best = error(scale, mn, L)
        for step in range(nstep + 1):
            # min is the search's state: a better fit replaces it for the following steps
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + nm) / (mx - mn)
            La = codes(iscale, mn)
            wl = w * La
            sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * La), seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            t_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            t_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = t_min > 0
            t_min = np.where(pos, F32(0), t_min)
            t_scale = np.where(pos, sum_xl / sum_l2, t_scale)
            cur = error(t_scale, t_min, La)
            take = (D > 0) & (cur < best) & live
            L = np.where(take, La, L)
            best = np.where(take, cur, best)
            scale = np.where(take, t_scale, scale)
            mn = np.where(take, t_min, mn)
        scale = np.where(flat, F32(0), scale).astype(np.float32)
        L = np.where(flat, F32(0), L).astype(np.float32)
        return scale, (-mn).astype(np.float32), L


def make_q3_quants(x: A32, nmax: int = 4) -> tuple[A32, A32]:
    """Symmetric fit of `make_q3_quants(n, nmax, x, L, do_rmse=true)` with weights x^2.

    L = clamp(nearest_int(-nmax/max * x), -nmax, nmax-1); then up to 5 sweeps over the elements,
    each re-deriving one code from the others' fit, new_l = nearest_int(x_i * sl2 / slx), kept when it
    raises sumlx^2 / suml2. Returns scale = sumlx / suml2.

    x: (n, S) float32
    returns: (scale (S,), L (n, S) float32 codes in [0, 2*nmax-1]); a sub-block with
             max|x| < 1e-15 gives scale 0 and L 0 (not nmax: the C returns before the offset)
    """
    with np.errstate(all="ignore"):
        amax, mx = signed_absmax(x)
        zero = amax < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx)  # zero lanes compute finite junk, masked at the end
        iscale = F32(-nmax) / mx
        L = nearest_code(iscale * x, -nmax, nmax - 1)
        w = x * x
        wx = w * x
        sumlx, suml2 = seq_sum(wx * L), seq_sum(w * L * L)
        for _ in range(5):  # early exit dropped: a sweep that changes nothing is a fixed point
            for i in range(x.shape[0]):
                slx = sumlx - wx[i] * L[i]
                sl2 = suml2 - w[i] * L[i] * L[i]
                pos = slx > 0  # the C skips the element otherwise; a finite divisor keeps NaN out
                new_l = nearest_code(x[i] * sl2 / np.where(pos, slx, F32(1)), -nmax, nmax - 1)
                slx_n = slx + wx[i] * new_l
                sl2_n = sl2 + w[i] * new_l * new_l
                take = (pos & (new_l != L[i]) & (sl2_n > 0)
                        & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n))
                L[i] = np.where(take, new_l, L[i])
                sumlx = np.where(take, slx_n, sumlx)
                suml2 = np.where(take, sl2_n, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(np.float32)
        L = L + F32(nmax)
        return np.where(zero, F32(0), scale).astype(np.float32), np.where(zero, F32(0), L)


def make_qx_quants(x: A32, nmax: int = 32) -> tuple[A32, A32]:
    """Symmetric fit of `make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)` (weights x^2).

    Codes l = clamp(nearest_int(iscale*x), -nmax, nmax-1) for iscale = -nmax/max and for the 18 trial
    iscale = -(nmax + 0.1*is)/max, is = -9..9 (is != 0); a trial replaces the current fit when
    sumlx^2 > best * suml2, best = scale * sumlx, scale = sumlx / suml2.

    x: (n, S) float32
    returns: (scale (S,), L (n, S) float32 codes l + nmax in [0, 2*nmax-1]); max|x| < 1e-15 -> 0, 0
    """
    with np.errstate(all="ignore"):
        amax, mx = signed_absmax(x)
        zero = amax < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx)  # zero lanes compute finite junk, masked at the end
        w = x * x
        wx = w * x

        def trial(iscale: A32) -> tuple[A32, A32, A32]:
            l = nearest_code(iscale * x, -nmax, nmax - 1)
            return l, seq_sum(wx * l), seq_sum(w * l * l)

        l, sumlx, suml2 = trial(F32(-nmax) / mx)
        L = l + F32(nmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(np.float32)
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            l, sumlx, suml2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(take, l + F32(nmax), L)
            scale = np.where(take, sumlx / suml2, scale).astype(np.float32)
            best = np.where(take, scale * sumlx, best)
        return np.where(zero, F32(0), scale).astype(np.float32), np.where(zero, F32(0), L)


def iq4_nl_index(al: A32) -> NDArray[np.uint8]:
    """`best_index_int8(16, kvalues_iq4nl, al)`: index of the nearest table value; an exact tie
    (al - lo == hi - al, each difference rounded in float32) goes to the higher index."""
    mu = np.clip(np.searchsorted(_KV32, al, side="right"), 1, 15)  # first value > al
    lo, hi = _KV32[mu - 1], _KV32[mu]
    with np.errstate(invalid="ignore"):
        idx = np.where(al - lo < hi - al, mu - 1, mu)
    idx = np.where(al <= _KV32[0], 0, np.where(al >= _KV32[15], 15, idx))
    return idx.astype(np.uint8)
