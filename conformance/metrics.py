"""Error metrics between a kernel output and its float64 golden. All arithmetic in float64.

    max_abs   = max |a - b|
    max_rel   = max |a - b| / max(|b|, rel_floor)
    rmse      = sqrt(mean((a - b)^2))
    nmse      = sum((a - b)^2) / sum(b^2)                       (llama.cpp test-backend-ops)
    cos_diff  = 1 - 2 sum(a b) / max(sum(a^2 + b^2), tiny)      (FlashMLA cal_diff)
    max_ulp   = max ULP distance between a and b rounded to a's dtype, over elements with |b| > atol
                (below atol the absolute error is what is judged, and subnormal ULPs mean little)
    mismatch  = count of |a - b| > atol + rtol |b|               (needs limits)
    numel_finite, sum_sq_ref = sum(b^2), sum_sq_both = sum(a^2 + b^2)   over the compared elements

a is the kernel output, b the golden. Values are compared only where both are finite; NaN,
+inf and -inf positions are compared separately and must match exactly. FlashMLA clamps the
cos_diff denominator at 1e-12, which makes the metric depend on the output's scale (an output
of magnitude 1e-7 would always fail); the clamp here is the smallest normal float64 instead,
and two all-zero tensors have cos_diff 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kernel_parity.conformance.dtypes import DType, max_ulp_distance

TINY = float(np.finfo(np.float64).tiny)
WORST_K = 5


_DOT_BLOCK = 8192


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """x . y (1-D float64) whose bits do not depend on how many threads the process's BLAS runs:
    OpenBLAS splits a long dot product over its threads, so np.dot's last bits followed each worker's
    share of the cores (a record then differed between a run in workers and one in-process, or between
    hosts). einsum per block of _DOT_BLOCK products (NumPy's own loop, one thread), then their sum."""
    m = x.size - x.size % _DOT_BLOCK
    s = float(np.einsum("ij,ij->i", x[:m].reshape(-1, _DOT_BLOCK), y[:m].reshape(-1, _DOT_BLOCK)).sum()) if m else 0.0
    return s + float(np.einsum("i,i->", x[m:], y[m:])) if m < x.size else s


@dataclass(frozen=True)
class Limits:
    """Numeric limits for one output in one dtype (tolerance layer 3)."""

    atol: float
    rtol: float
    cos_diff: float | None = None
    nmse: float | None = None
    atol_max_eps: float = 0.0  # adds this many eps(out dtype) x max|golden| to atol (scale-aware)
    # adds this many eps(fp32) x sqrt(reduction length) x max|golden| to atol: the absolute error
    # of an fp32 dot product of that length, for outputs that cancel (a GEMM's C); folded into
    # atol_max_eps by Tol.limits, which knows the length
    atol_acc: float = 0.0
    # adds this many (eps(fp32) x sqrt(reduction length))^2 to cos_diff (twice that to nmse): the
    # aggregate counterpart of atol_acc, for outputs whose every element may carry that relative
    # error (RoPE's fp32 angle p w, off by ~eps32 p); folded into cos_diff / nmse by Tol.limits
    agg_acc: float = 0.0

    def effective_atol(self, eps: float, max_ref: float) -> float:
        return self.atol + self.atol_max_eps * eps * max_ref


@dataclass
class Comparison:
    metrics: dict[str, float]
    anomaly_mismatch: int  # positions where NaN / +inf / -inf differ between a and b
    anomaly_detail: str
    worst: list[dict] = field(default_factory=list)
    elem_ratio: float = 0.0  # max |d| / (atol + rtol |b|): <= 1 means every element is within tol


def _anomaly_classes(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    c = np.zeros(x.shape, dtype=np.int8)
    c[np.isnan(x)] = 1
    c[np.isposinf(x)] = 2
    c[np.isneginf(x)] = 3
    return c


_CLASS_NAME = {0: "finite", 1: "NaN", 2: "+inf", 3: "-inf"}


def compare(got: np.ndarray, ref: np.ndarray, dtype: DType, limits: Limits | None,
            tol_dtype: DType | None = None) -> Comparison:
    """Compare a kernel output (storage dtype) with its golden (float64) of the same shape.

    tol_dtype: whose eps scales `limits.atol_max_eps` (default the output's own dtype).

    Outputs of 10^8 elements are judged here (models sizes), so every full pass counts: where
    both sides are finite everywhere (the common case) nothing is masked or copied.
    """
    with np.errstate(invalid="ignore"):  # signalling-NaN poison in fp16/bf16 casts with a warning
        a = np.asarray(got).astype(np.float64)
    b = np.asarray(ref, dtype=np.float64)
    n_bad_anom, anomaly_detail = 0, ""
    if np.isfinite(a).all() and np.isfinite(b).all():
        both = None  # every element compared: a and b themselves, no copies
        bad_anom = np.zeros(0, dtype=bool)
        af, bf, nonfinite_ref = a.reshape(-1), b.reshape(-1), 0
    else:
        ca, cb = _anomaly_classes(a), _anomaly_classes(b)
        bad_anom = ca != cb
        n_bad_anom = int(np.count_nonzero(bad_anom))
        if n_bad_anom:
            idx = np.argwhere(bad_anom)[0]
            i = tuple(int(v) for v in idx)
            anomaly_detail = (
                f"{n_bad_anom} element(s) differ in NaN/inf position, first at {list(i)}: "
                f"got {_CLASS_NAME[int(ca[i])]}, expected {_CLASS_NAME[int(cb[i])]}"
            )
        both = (ca == 0) & (cb == 0)
        af, bf, nonfinite_ref = a[both], b[both], int(np.count_nonzero(cb != 0))
    d = np.abs(af - bf)
    n = int(af.size)
    abs_b = np.abs(bf)
    max_ref = float(abs_b.max()) if n else 0.0
    atol = limits.effective_atol((tol_dtype or dtype).eps, max_ref) if limits else 0.0
    rtol = limits.rtol if limits else 0.0
    if n:
        max_abs = float(d.max())
        rel_floor = atol if atol > 0 else TINY
        max_rel = float((d / np.maximum(abs_b, rel_floor)).max())
        sq = _dot(d, d)
        rmse = float(np.sqrt(sq / n))
        bb = _dot(bf, bf)
        nmse = 0.0 if sq == 0 else (sq / bb if bb > 0 else float("inf"))
        denom = _dot(af, af) + bb
        cos_diff = 0.0 if denom == 0 else float(1.0 - 2.0 * _dot(af, bf) / max(denom, TINY))
        if dtype.is_float and dtype.bits == dtype.storage_bits and dtype.name != "e8m0":  # signed floats
            g = np.asarray(got).reshape(-1) if both is None else np.asarray(got)[both]
            if atol > 0:
                big = abs_b > atol
                max_ulp = max_ulp_distance(g[big], bf[big], dtype) if big.any() else 0.0
            else:  # every element with |b| > 0
                big = abs_b > 0
                max_ulp = (max_ulp_distance(g, bf, dtype) if big.all() else
                           max_ulp_distance(g[big], bf[big], dtype) if big.any() else 0.0)
        else:
            max_ulp = float("nan")
        allowed = abs_b
        allowed *= rtol  # abs_b is not needed after this: its buffer becomes the limit
        allowed += atol
        if atol > 0:  # every limit positive
            ratio = d / allowed
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(allowed > 0, d / np.where(allowed > 0, allowed, 1.0), np.where(d > 0, np.inf, 0.0))
        elem_ratio = float(ratio.max())
        mismatch = int(np.count_nonzero(d > allowed))
    else:
        max_abs = max_rel = rmse = nmse = cos_diff = max_ref = 0.0
        max_ulp = 0.0
        bb = denom = 0.0
        ratio = np.zeros(0)
        elem_ratio = 0.0
        mismatch = 0
    metrics = {
        "numel": int(a.size),
        "max_abs": max_abs,
        "max_rel": max_rel,
        "rmse": rmse,
        "nmse": nmse,
        "cos_diff": cos_diff,
        "max_ulp": max_ulp,
        "mismatch": mismatch + n_bad_anom,
        "mismatch_frac": (mismatch + n_bad_anom) / a.size if a.size else 0.0,
        "max_ref": max_ref,
        "atol_eff": atol,
        "nonfinite_ref": nonfinite_ref,
        # the sums behind nmse and cos_diff, for their absolute floor (tolerance.aggregate_limits)
        "numel_finite": n,
        "sum_sq_ref": bb,
        "sum_sq_both": denom,
    }
    return Comparison(metrics, n_bad_anom, anomaly_detail, _worst(a, b, bad_anom, both, ratio, d), elem_ratio)


def _worst(a, b, bad_anom, both, ratio, d) -> list[dict]:
    """At most WORST_K elements, each marked `out` (outside the elementwise tolerance, or a NaN/inf
    position that differs): anomaly mismatches first, then the out-of-tolerance elements by their
    error relative to the limit. Elements within tolerance are listed only when none is out (the
    nearest to their limit), so a failing element is never shown beside errors of 1e-233."""
    picks: list[tuple[tuple[int, ...], bool]] = [(tuple(int(v) for v in i), True)
                                                 for i in np.argwhere(bad_anom)[:WORST_K]]
    if len(picks) < WORST_K and ratio.size:
        flat_idx = None if both is None else np.flatnonzero(both.reshape(-1))  # None: all elements
        n_out = int(np.count_nonzero(ratio > 1.0))
        key = ratio if np.any(ratio > 0) else d
        k = min(WORST_K - len(picks), n_out if (n_out or picks) else key.size)
        if k > 0:
            order = np.argpartition(-key, k - 1)[:k] if k < key.size else np.arange(key.size)
            order = order[np.argsort(-key[order], kind="stable")]
            for o in order:
                if key[o] <= 0:
                    break
                flat = o if flat_idx is None else flat_idx[o]
                picks.append((tuple(int(v) for v in np.unravel_index(flat, a.shape)), bool(ratio[o] > 1.0)))
    out = []
    for i, is_out in picks:
        g, e = float(a[i]), float(b[i])
        ad = abs(g - e) if np.isfinite(g) and np.isfinite(e) else float("nan")
        rel = ad / abs(e) if np.isfinite(ad) and e != 0 else float("nan")
        out.append({"index": list(i), "got": g, "expected": e, "abs": ad, "rel": rel, "out": is_out})
    return out


def exact_mismatch(got: np.ndarray, expected: np.ndarray, nan_bits: bool = True) -> tuple[int, list[dict]]:
    """Bit-exact comparison of byte/integer (or bit-pattern) outputs of the same dtype.

    nan_bits=False: a NaN matches any NaN (payload and sign are not compared)."""
    g = np.ascontiguousarray(got)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.ascontiguousarray(expected).astype(g.dtype)
    both_nan = None
    if g.dtype.kind not in "iub":  # floats (ml_dtypes report kind "V"): compare bit patterns
        if not nan_bits:
            with np.errstate(invalid="ignore"):
                both_nan = np.isnan(g.astype(np.float64)) & np.isnan(e.astype(np.float64))
        g = g.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[g.dtype.itemsize])
        e = e.view(g.dtype)
    bad = g != e
    if both_nan is not None:
        bad &= ~both_nan
    n_bad = int(np.count_nonzero(bad))
    worst = []
    for i in np.argwhere(bad)[:WORST_K]:
        i = tuple(int(v) for v in i)
        worst.append({"index": list(i), "got": int(g[i]), "expected": int(e[i]), "abs": float("nan"),
                      "rel": float("nan"), "out": True})
    return n_bad, worst
