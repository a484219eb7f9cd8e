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

Outputs of 10^8 elements (model sizes) are judged here, where whole-array float64 temporaries
cost more in page faults than in arithmetic. `compare` reads its inputs a chunk of _CHUNK
elements at a time into reused buffers, and every result keeps the bits of the whole-array
formula: maxima and counts do not depend on the split, the sums keep _dot's blocks (_BlockSums),
and the worst elements are those argpartition + a stable argsort over every element's key list.
They are found among the few largest keys (_Top); only when two of those tie does argpartition's
own choice among them decide, and every key is then built for it (O(numel) memory; rare).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kernel_parity.conformance.dtypes import DType, max_ulp_distance

TINY = float(np.finfo(np.float64).tiny)
WORST_K = 5

_DOT_BLOCK = 8192
# Elements per chunk, a multiple of _DOT_BLOCK so that a chunk ends on a block boundary. Its
# float64 buffers (512 KiB each) stay in L2 through the dozen passes made over them: 2^15 and 2^16
# timed alike on a 1.3e8-element bf16 output (2-core Xeon), 2^17 ~15% slower; smaller chunks pay
# Python's overhead per chunk.
_CHUNK = 8 * _DOT_BLOCK
_KEEP = WORST_K + 1  # keys kept for the worst list: one more than listed shows a tie at the cut


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
            tol_dtype: DType | None = None, magnitude: np.ndarray | None = None) -> Comparison:
    """Compare a kernel output (storage dtype) with its golden (float64) of the same shape.

    tol_dtype: whose eps scales `limits.atol_max_eps` (default the output's own dtype).
    magnitude: the error model's float64 magnitudes of the golden's elements (OpSpec.magnitude, same
    shape), or None. Given, each element's relative allowance is taken against m = max(|golden|,
    magnitude) (atol + rtol m: the same limit where the magnitude is |golden|, a wider one where the
    golden is a cancellation of larger terms), the worst elements carry their bound and magnitude, and
    the metrics gain `cond` = sum m^2 / sum golden^2 (>= 1), by which the aggregate limits scale
    (tolerance.aggregate_limits).

    Outputs of 10^8 elements are judged here (model sizes), so every full pass counts: one pass
    over the chunks when both sides are finite everywhere (the common case), nothing masked; a
    second, masked, when a NaN or inf turns up; one over the golden alone before either when atol
    scales with max|golden|.
    """
    g, r = np.asarray(got), np.asarray(ref)
    if g.size != r.size:
        raise ValueError(f"output of shape {g.shape} compared with a golden of shape {r.shape}")
    mag = None
    if magnitude is not None:
        mag = np.asarray(magnitude, dtype=np.float64)
        if mag.size != r.size:
            raise ValueError(f"magnitude of shape {mag.shape} for a golden of shape {r.shape}")
        mag = np.ascontiguousarray(mag).reshape(-1)
    scan = _scan(g, r, dtype, limits, tol_dtype, masked=False, mag=mag)
    if scan is None:  # a NaN or inf: values compared where both are finite, the rest by class
        scan = _scan(g, r, dtype, limits, tol_dtype, masked=True, mag=mag)
    n, anomalies = scan.n, scan.anomalies
    if n:
        max_abs = float(np.max(scan.max_abs))
        max_rel = float(np.max(scan.max_rel))
        max_ref = float(np.max(scan.max_ref))
        sq, bb, aa, ab = scan.sums.totals()
        rmse = float(np.sqrt(sq / n))
        nmse = 0.0 if sq == 0 else (sq / bb if bb > 0 else float("inf"))
        denom = aa + bb
        cos_diff = 0.0 if denom == 0 else float(1.0 - 2.0 * ab / max(denom, TINY))
        max_ulp = scan.max_ulp if scan.ulp_dtype is not None else float("nan")
        elem_ratio = float(np.max(scan.max_ratio))
        mismatch = scan.mismatch
    else:
        max_abs = max_rel = rmse = nmse = cos_diff = max_ref = 0.0
        max_ulp = 0.0
        bb = denom = 0.0
        elem_ratio = 0.0
        mismatch = 0
    n_bad_anom, anomaly_detail = (anomalies.count, anomalies.detail()) if anomalies is not None else (0, "")
    metrics = {
        "numel": int(g.size),
        "max_abs": max_abs,
        "max_rel": max_rel,
        "rmse": rmse,
        "nmse": nmse,
        "cos_diff": cos_diff,
        "max_ulp": max_ulp,
        "mismatch": mismatch + n_bad_anom,
        "mismatch_frac": (mismatch + n_bad_anom) / g.size if g.size else 0.0,
        "max_ref": max_ref,
        "atol_eff": scan.atol,
        "nonfinite_ref": anomalies.nonfinite_ref if anomalies is not None else 0,
        # the sums behind nmse and cos_diff, for their absolute floor (tolerance.aggregate_limits)
        "numel_finite": n,
        "sum_sq_ref": bb,
        "sum_sq_both": denom,
    }
    if mag is not None:  # the error model's conditioning of this output (>= 1; 1: as well-conditioned as |golden|)
        mm = scan.mag_sq if n else 0.0
        metrics["sum_sq_mag"] = mm
        metrics["max_mag"] = scan.mag_max if n else 0.0  # max of max(|golden|, magnitude): the noise floor's scale
        metrics["cond"] = mm / bb if bb > 0 else (1.0 if mm == 0 else float("inf"))
    return Comparison(metrics, n_bad_anom, anomaly_detail, _worst(g, r, scan), elem_ratio)


def _scan(g: np.ndarray, r: np.ndarray, dtype: DType, limits: Limits | None, tol_dtype: DType | None,
          masked: bool, mag: np.ndarray | None = None) -> _Scan | None:
    """Every chunk folded into one _Scan; None, unmasked, at the first NaN or inf on either side."""
    eps = (tol_dtype or dtype).eps if limits else 0.0
    if limits is None or limits.atol_max_eps == 0:
        atol = limits.effective_atol(eps, 0.0) if limits else 0.0  # 0 x max_ref: the same bits for any max_ref
    else:
        max_ref = _max_abs_ref(g, r, masked)
        if max_ref is None:
            return None
        atol = limits.effective_atol(eps, max_ref)
    scan = _Scan(dtype, atol, limits.rtol if limits else 0.0, masked, g.shape, mag)
    for chunk in _chunks(g, r, masked, scan.anomalies):
        if not scan.add(*chunk):
            return None
    return scan


def _flat(x: np.ndarray):
    """x in C order, to slice: a view when x is C-contiguous, else its flat iterator, whose slice
    copies just that many elements (a strided output is never copied whole)."""
    return x.reshape(-1) if x.flags.c_contiguous else x.flat


def _golden_flat(r: np.ndarray):
    """The golden in C order as the sums must see it. A float64 golden whose strides allow it is
    summed through a strided 1-D view (einsum adds a strided row in another order than a
    contiguous one, and np.asarray(ref).reshape(-1) is such a view); any other comes in copies."""
    if r.dtype == np.float64:
        try:
            return r.reshape(-1, copy=False)
        except ValueError:  # no 1-D view of these strides
            pass
    return _flat(r)


def _chunks(g: np.ndarray, r: np.ndarray, masked: bool, anomalies: _Anomalies | None = None):
    """(a, b, g, pos) per chunk, in C order: a and b in float64 (a contiguous, b as _golden_flat
    has it, contiguous once masked), g the output in its storage dtype (for max_ulp), pos the flat
    index of the chunk's first element or, masked, of each element.

    masked: only the elements finite in both are yielded; the others' classes go to `anomalies`."""
    gf, rf = _flat(g), _golden_flat(r)
    abuf = None if g.dtype == np.float64 else np.empty(min(g.size, _CHUNK))  # reused, as _Scan's buffers
    for start in range(0, g.size, _CHUNK):
        gc = gf[start:start + _CHUNK]
        if abuf is None:  # a float64 output is read in place
            a = gc
        else:
            a = abuf[:gc.size]
            with np.errstate(invalid="ignore"):  # signalling-NaN poison in fp16/bf16 casts with a warning
                np.copyto(a, gc, casting="unsafe")
        b = np.asarray(rf[start:start + _CHUNK], dtype=np.float64)
        if not masked:
            yield a, b, gc, start
            continue
        ca, cb = _anomaly_classes(a), _anomaly_classes(b)
        if anomalies is not None:
            anomalies.add(ca, cb, start)
        both = (ca == 0) & (cb == 0)
        if both.all():
            yield a, np.ascontiguousarray(b), gc, start
        else:
            idx = np.flatnonzero(both)
            yield a[idx], b[idx], gc[idx], start + idx


def _max_abs_ref(g: np.ndarray, r: np.ndarray, masked: bool) -> float | None:
    """max |b| over the compared elements (0.0 for none); None, unmasked, for a NaN or inf in b."""
    maxima = []
    if masked:
        maxima = [np.abs(b).max() for _, b, _, _ in _chunks(g, r, True) if b.size]
    else:  # the golden alone: the output is converted once, in the pass that follows
        rf = _flat(r)
        buf = np.empty(min(r.size, _CHUNK))
        for start in range(0, r.size, _CHUNK):
            b = np.asarray(rf[start:start + _CHUNK], dtype=np.float64)
            m = np.abs(b, out=buf[:b.size]).max()  # NaN propagates into the maximum
            if not np.isfinite(m):
                return None
            maxima.append(m)
    return float(np.max(maxima)) if maxima else 0.0


def _ratio(d: np.ndarray, allowed: np.ndarray, atol: float, out: np.ndarray) -> np.ndarray:
    """d / allowed, elementwise: inf where nothing is allowed but d > 0, 0 where d is 0 too."""
    if atol > 0:  # every limit positive
        return np.divide(d, allowed, out=out)
    with np.errstate(divide="ignore", invalid="ignore"):
        out[...] = np.where(allowed > 0, d / np.where(allowed > 0, allowed, 1.0), np.where(d > 0, np.inf, 0.0))
    return out


class _Anomalies:
    """NaN / +inf / -inf positions that differ between a and b, gathered chunk by chunk."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.count = 0
        self.nonfinite_ref = 0
        self.flats: list[int] = []  # the first WORST_K, listed first in the worst elements
        self.first: tuple[int, int, int] | None = None  # flat index, class in a, class in b

    def add(self, ca: np.ndarray, cb: np.ndarray, start: int) -> None:
        bad = np.flatnonzero(ca != cb)
        if bad.size:
            if self.first is None:
                self.first = (start + int(bad[0]), int(ca[bad[0]]), int(cb[bad[0]]))
            self.flats += [start + int(i) for i in bad[:WORST_K - len(self.flats)]]
            self.count += int(bad.size)
        self.nonfinite_ref += int(np.count_nonzero(cb))

    def detail(self) -> str:
        if not self.count:
            return ""
        flat, ca, cb = self.first
        return (f"{self.count} element(s) differ in NaN/inf position, first at {_index(flat, self.shape)}: "
                f"got {_CLASS_NAME[ca]}, expected {_CLASS_NAME[cb]}")


class _BlockSums:
    """_dot(d, d), _dot(b, b), _dot(a, a) and _dot(a, b) bit for bit, fed chunk by chunk: each
    chunk's whole blocks go through the same einsum, and their results through one `.sum()` at the
    end, then the last, partial block is added. einsum sums a row of a strided view in another
    order than a contiguous one, so each side keeps the layout _dot saw it in (_chunks)."""

    def __init__(self) -> None:
        self.blocks: tuple[list, ...] = ([], [], [], [])
        self.tail: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (a, b, d) after the last full block

    def add(self, a: np.ndarray, b: np.ndarray, d: np.ndarray) -> None:
        if self.tail is not None:  # masked chunks need not end on a block boundary
            a, b = np.concatenate((self.tail[0], a)), np.concatenate((self.tail[1], b))
            d = np.abs(a - b)
        m = a.size - a.size % _DOT_BLOCK
        if m:
            for acc, (x, y) in zip(self.blocks, ((d, d), (b, b), (a, a), (a, b))):
                acc.append(np.einsum("ij,ij->i", x[:m].reshape(-1, _DOT_BLOCK), y[:m].reshape(-1, _DOT_BLOCK)))
        # a and d live in buffers that the next chunk refills; b, a view of the golden or a fresh
        # array, keeps the strides its last block is summed with
        self.tail = (a[m:].copy(), b[m:], d[m:].copy()) if m < a.size else None

    def totals(self) -> list[float]:
        out = []
        for i, acc in enumerate(self.blocks):
            s = float(np.concatenate(acc).sum()) if acc else 0.0
            if self.tail is not None:
                a, b, d = self.tail
                x, y = ((d, d), (b, b), (a, a), (a, b))[i]
                s = s + float(np.einsum("i,i->", x, y))
            out.append(s)
        return out


class _Top:
    """The _KEEP largest positive keys seen so far, with their flat indices. The values are exact;
    of keys that tie at the cut any one is kept, which _worst notices (a tie among the top)."""

    def __init__(self) -> None:
        self.vals = np.zeros(0)
        self.flats = np.zeros(0, dtype=np.int64)
        self.floor = 0.0  # only keys above it can enter: 0, then the _KEEP-th largest once full

    def offer(self, key: np.ndarray, key_max: float, pos) -> None:
        if not key_max > self.floor:  # nothing enters: one comparison with the chunk's maximum
            return
        sel = np.flatnonzero(key > self.floor)
        vals = np.concatenate((self.vals, key[sel]))
        flats = np.concatenate((self.flats, pos + sel if isinstance(pos, int) else pos[sel]))
        if vals.size >= _KEEP:
            keep = np.argpartition(-vals, _KEEP - 1)[:_KEEP]
            vals, flats = vals[keep], flats[keep]
            self.floor = vals.min()
        self.vals, self.flats = vals, flats


class _Scan:
    """Every metric's partial result over the compared elements, fed a chunk at a time."""

    def __init__(self, dtype: DType, atol: float, rtol: float, masked: bool, shape: tuple[int, ...],
                 mag: np.ndarray | None = None) -> None:
        self.atol, self.rtol, self.masked = atol, rtol, masked
        self.mag = mag  # flat float64 magnitudes (compare's `magnitude`) or None
        self.mag_sq = 0.0
        self.mag_max = 0.0
        self.anomalies = _Anomalies(shape) if masked else None
        self.nonneg_limits = atol >= 0 and rtol >= 0
        self.rel_floor = atol if atol > 0 else TINY
        self.ulp_floor = atol if atol > 0 else 0.0  # max_ulp counts |b| > atol (> 0 without atol)
        signed_float = dtype.is_float and dtype.bits == dtype.storage_bits and dtype.name != "e8m0"
        self.ulp_dtype = dtype if signed_float else None
        self.n = 0
        self.max_abs: list = []  # per chunk
        self.max_rel: list = []
        self.max_ref: list = []
        self.max_ratio: list = []
        self.max_ulp = 0.0
        self.mismatch = 0
        self.n_out = 0  # ratio > 1
        self.any_pos = False  # any ratio > 0: the worst list ranks by ratio, else by d
        self.nan_ratio = False
        self.sums = _BlockSums()
        self.top = _Top()
        # d, |b| then the limit, the relative error then the ratio: reused chunk after chunk, where
        # fresh temporaries of 10^8 elements spent half their time in page faults
        self._buf = np.empty((3, min(math.prod(shape), _CHUNK)))

    def add(self, a: np.ndarray, b: np.ndarray, g: np.ndarray, pos) -> bool:
        """Fold in one chunk; False (unmasked) when it holds a NaN or an inf, for the masked pass."""
        if not a.size:
            return True
        d, absb, t = (x[:a.size] for x in self._buf)
        with np.errstate(invalid="ignore"):  # inf - inf, before the unmasked pass knows to give way
            np.abs(np.subtract(a, b, out=d), out=d)
        d_max = d.max()
        # a NaN or inf in a or b makes d's maximum NaN or inf (so can |a - b| overflowing)
        if not self.masked and not np.isfinite(d_max) and not (np.isfinite(a).all() and np.isfinite(b).all()):
            return False
        self.n += a.size
        self.max_abs.append(d_max)
        self.max_ref.append(np.abs(b, out=absb).max())
        small = absb.min()  # most chunks have no |b| below the floors: no clamp, no mask
        rel_den = absb if small >= self.rel_floor else np.maximum(absb, self.rel_floor, out=t)
        self.max_rel.append(np.divide(d, rel_den, out=t).max())
        self.sums.add(a, b, d)
        if self.ulp_dtype is not None:
            where = None if small > self.ulp_floor else absb > self.ulp_floor
            self.max_ulp = max(self.max_ulp, max_ulp_distance(g, b, self.ulp_dtype, where=where))
        allowed = absb  # |b| is not needed after this: its buffer becomes the limit
        if self.mag is not None:  # the error model: the allowance against max(|b|, magnitude)
            np.maximum(allowed, self.mag_at(pos, a.size), out=allowed)
            self.mag_sq += float(np.einsum("i,i->", allowed, allowed))
            self.mag_max = max(self.mag_max, float(allowed.max()))
        allowed *= self.rtol
        allowed += self.atol
        ratio = _ratio(d, allowed, self.atol, out=t)
        r_max = ratio.max()
        self.max_ratio.append(r_max)
        # d > allowed >= 0 makes d / allowed >= 1 (division rounds monotonically; inf where allowed
        # is 0): a chunk whose ratios are all below 1 holds no mismatch, nor anything out
        if not (r_max < 1.0 and self.nonneg_limits):
            self.mismatch += int(np.count_nonzero(d > allowed))
            self.n_out += int(np.count_nonzero(ratio > 1.0))
        if np.isnan(r_max):  # the maximum hides the rest; the worst list then takes the exact route
            self.nan_ratio = True
            self.any_pos = self.any_pos or bool(np.any(ratio > 0))
        else:
            self.any_pos = self.any_pos or bool(r_max > 0)
        self.top.offer(ratio, r_max, pos)
        return True

    def mag_at(self, pos, n: int) -> np.ndarray:
        """The magnitudes of a chunk: from flat index `pos` on (unmasked), or at the indices `pos`."""
        return self.mag[pos:pos + n] if isinstance(pos, (int, np.integer)) else self.mag[pos]

    def scale(self, b: np.ndarray, pos) -> np.ndarray:
        """What each element's relative allowance is taken against: |b|, or max(|b|, magnitude)."""
        absb = np.abs(b)
        return absb if self.mag is None else np.maximum(absb, self.mag_at(pos, b.size))

    def keys(self, g: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Every compared element's worst-list key (ratio, or d where no ratio is positive), and,
        masked, each one's flat index: what the whole-array selection ran on."""
        key = np.empty(self.n)
        flats = np.empty(self.n, dtype=np.int64) if self.masked else None
        i = 0
        for a, b, _, pos in _chunks(g, r, self.masked):
            n = a.size
            d = np.abs(a - b)
            key[i:i + n] = _ratio(d, self.scale(b, pos) * self.rtol + self.atol, self.atol, d) if self.any_pos else d
            if flats is not None:
                flats[i:i + n] = pos + np.arange(n) if isinstance(pos, int) else pos
            i += n
        return key, flats


def _worst(g: np.ndarray, r: np.ndarray, scan: _Scan) -> list[dict]:
    """At most WORST_K elements, each marked `out` (outside the elementwise tolerance, or a NaN/inf
    position that differs): anomaly mismatches first, then the out-of-tolerance elements by their
    error relative to the limit. Elements within tolerance are listed only when none is out (the
    nearest to their limit), so a failing element is never shown beside errors of 1e-233."""
    picks: list[tuple[int, bool]] = [(f, True) for f in scan.anomalies.flats] if scan.masked else []
    if len(picks) < WORST_K and scan.n:
        k = min(WORST_K - len(picks), scan.n_out if (scan.n_out or picks) else scan.n)
        if k > 0:
            picks += _ranked(g, r, scan, k)
    out = []
    for flat, is_out in picks:
        with np.errstate(invalid="ignore"):
            gv = float(_flat(g)[flat:flat + 1].astype(np.float64)[0])
        e = float(np.asarray(_flat(r)[flat:flat + 1], dtype=np.float64)[0])
        ad = abs(gv - e) if np.isfinite(gv) and np.isfinite(e) else float("nan")
        rel = ad / abs(e) if np.isfinite(ad) and e != 0 else float("nan")
        w = {"index": _index(flat, g.shape), "got": gv, "expected": e, "abs": ad, "rel": rel, "out": is_out}
        if scan.mag is not None:  # the element's bound and the magnitude term behind it
            m = float(scan.mag[flat])
            w["magnitude"], w["bound"] = m, scan.atol + scan.rtol * max(abs(e), m)
        out.append(w)
    return out


def _ranked(g: np.ndarray, r: np.ndarray, scan: _Scan, k: int) -> list[tuple[int, bool]]:
    """The k largest keys as argpartition(-key, k - 1) and a stable argsort pick them over all
    compared elements (key: the ratio, or d where no ratio is positive), keys <= 0 left out."""
    if scan.any_pos and not scan.nan_ratio:
        order = np.argsort(-scan.top.vals, kind="stable")[:k + 1]
        vals, flats = scan.top.vals[order], scan.top.flats[order]
        if not np.any(vals[1:] == vals[:-1]):  # no tie: the same elements whatever argpartition does with ties
            return [(int(f), bool(v > 1.0)) for f, v in zip(flats[:k], vals[:k])]
    elif not scan.any_pos and not np.max(scan.max_abs) > 0:  # every key (d) is 0: none listed
        return []
    # a tie among the largest keys (which of them argpartition puts first is its own business), a
    # NaN ratio, or keys of d: the whole-array selection, on every key
    key, flat_idx = scan.keys(g, r)
    order = np.argpartition(-key, k - 1)[:k] if k < key.size else np.arange(key.size)
    order = order[np.argsort(-key[order], kind="stable")]
    picks = []
    for o in order:
        if key[o] <= 0:
            break
        picks.append((int(o if flat_idx is None else flat_idx[o]), bool(scan.any_pos and key[o] > 1.0)))
    return picks


def _index(flat: int, shape: tuple[int, ...]) -> list[int]:
    return [int(v) for v in np.unravel_index(flat, shape)]


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
