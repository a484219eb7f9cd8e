"""The layered tolerance policy, declared as data in each op spec, and the layers themselves: the
judge (conformance/judge.py) runs them in this order for every output.

Layers (each one's outcome is recorded per output):
1. structure  shape, dtype, NaN/inf positions, unwritten (still poisoned) elements, canaries,
              inputs left untouched
2. exact      bit-exact outputs
3. numeric    every element |a - b| <= atol + rtol |b|, plus aggregate cos_diff and nmse limits;
              rtol = the dtype's rtol + acc_coeff * eps(fp32) * sqrt(accumulation length).
              An op with an error model (`OpSpec.magnitude`: per element, the root-sum-square of
              the magnitudes of the terms the golden sums, what its rounding errors scale with) is
              judged against m = max(|b|, magnitude) instead: atol + rtol m elementwise, and the
              aggregate limits times max(1, cond / COND_RANDOM), cond = sum m^2 / sum b^2 (1 for a
              well-conditioned output, ~1.5 for sums of random-sign terms: today's limits for both;
              more where the golden is a cancellation of larger terms, which no limit on |b| sees);
              the noise layer's floor then scales with max m instead of max |b|.
              A compute-precision term (`<output>@fp32` beside the output's magnitude: E, the
              error a kernel's fp32 arithmetic adds is ~u32 E, u32 = 2^-24, whatever the output's
              dtype; the logits' rounding carried through P, ~u32 |s| per probability) joins in
              quadrature as COMPUTE_K u32 E / rtol: m = sqrt(max(|b|, magnitude)^2 + (K u32 E /
              rtol)^2), so the bound gains ~K u32 E, in fp32 and 16-bit outputs alike; cond leaves
              it out, and the aggregate limits add the cos_diff / nmse of COMPUTE_K_AGG u32 E
              The aggregate limits have an absolute floor derived from the elementwise one: they
              never fail an output whose RMS error is at most AGG_FLOOR * atol (the absolute part),
              so an output that passes elementwise by orders of magnitude (one LSE value off by
              3e-8 against atol 1e-5) cannot fail on them, whatever its scale
4. noise      FlashAttention's method: max_abs(kernel) <= k * max_abs(same-dtype baseline) + floor,
              floor = max(floor_ulps * (eps(out) + acc_coeff * eps(fp32) * sqrt(acc len)) * max |golden|,
                          AGG_FLOOR * atol), never zero
5. trust      `vacuous` when an all-zero output would pass layer 3 on a non-zero golden
6. borderline a case within `borderline` (10%) of a limit is re-run on fresh seeds; `flaky` if
              the verdicts disagree (done by the runner)

Limits come in two declared tiers per op and dtype. `production` holds our kernels and every
plugin: at least as strict as the strictest peer's own test of the op. `baseline` holds only the
op's eager same-precision baseline (`OpSpec.baseline`, the torch backend), which rounds where a
fused kernel does not; it is declared with its reason (`Tier`) and never loosens the limits of any
other backend.

No tolerance scales with numel; the accumulation length is a reduction length (row length,
number of splits), which sets how much fp32 rounding a correct kernel accumulates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from kernel_parity.conformance.dtypes import DTYPES, DType
from kernel_parity.conformance.metrics import Limits, exact_mismatch
from kernel_parity.conformance.results import LAYERS  # noqa: F401  (the order the judge runs them in)

# Per output dtype. atol/rtol: torch.testing.assert_close defaults (PyTorch's per-dtype table).
# cos_diff: about 8x the worst case of one correct rounding to the dtype ((eps/2)^2 / 2) for
# fp16, 2.6x for bf16 (FlashMLA holds bf16 attention outputs to 1e-5); fp32 is set by fp32
# accumulation instead: the worst measured over 6000 softmax-family runs was 1.7e-14
# (`parity calibrate`), 60x under the limit. nmse ~ 2 cos_diff for small errors.
DTYPE_DEFAULTS: dict[str, Limits] = {
    "fp64": Limits(atol=1e-7, rtol=1e-7, cos_diff=1e-20, nmse=2e-20),
    "fp32": Limits(atol=1e-5, rtol=1.3e-6, cos_diff=1e-12, nmse=2e-12),
    "fp16": Limits(atol=1e-5, rtol=1e-3, cos_diff=1e-6, nmse=2e-6),
    "bf16": Limits(atol=1e-5, rtol=1.6e-2, cos_diff=2e-5, nmse=4e-5),
    # 8- and 4-bit floats: atol/rtol are TransformerEngine's FP8 and FP4 test limits; cos_diff is
    # 2.6x the worst case of one correct rounding, (eps/2)^2 / 2, as for bf16 above.
    "fp8e4m3": Limits(atol=0.0675, rtol=0.125, cos_diff=5e-3, nmse=1e-2),
    "fp8e5m2": Limits(atol=0.125, rtol=0.25, cos_diff=2e-2, nmse=4e-2),
    "fp4e2m1": Limits(atol=0.125, rtol=0.25, cos_diff=8e-2, nmse=0.16),
    # e8m0 (power-of-two scales) and the integer types have no numeric limits: their outputs are
    # bit-exact, and a numeric output of such a dtype is an error (never limits of zero).
}

# Float64 self-checks of the goldens against each other (online vs textbook, combine vs
# whole-row attention): both sides are float64 with O(n) operations, so agreement to a few
# hundred eps(fp64) is expected; anything looser would hide a wrong formula.
GOLDEN_SELF_CHECK = Limits(atol=1e-12, rtol=1e-11)

# Aggregate floor: RMS error <= AGG_FLOOR * atol passes cos_diff and nmse (see layer 3 above).
AGG_FLOOR = 0.1

# The compute-precision term of the error model (layer 3, docstring): an op's magnitude function may
# return `<output>@fp32` = E beside the output, the absolute error its fp32 compute adds being ~u32 E
# (P's relative error from a logit's rounding, ~u32 sigma, carried through the sums that read P; sigma is
# a per-logit scale: on the blocks' fp32 pipeline the measured |ds| / (u32 sigma) is 0.14-0.15 RMS, 0.40-0.42
# at the 99th percentile and 0.66-0.90 at the largest, normal and `heads` inputs alike). Elementwise it
# joins the magnitude in quadrature as COMPUTE_K u32 E / rtol (dividing by the output's rtol makes it
# dtype-independent: a bf16 output's bound grows by the same absolute ~K u32 E as an fp32 one's); the
# aggregate limits do not scale with it through cond (an ordinary output keeps its limits) but gain the
# cos_diff / nmse of an error of COMPUTE_K_AGG u32 E on every element (`compute_sq`, 3x the measured RMS).
COMPUTE_SUFFIX = "@fp32"
U32 = 2.0 ** -24
COMPUTE_K = 2.0
COMPUTE_K_AGG = 0.5


@dataclass
class ComputeTerm:
    """An output's magnitudes with its compute-precision term joined (`mag`, elementwise), and the sums the
    aggregate limits take: sum max(|golden|, magnitude)^2 (cond without the term) and sum (K_AGG u32 E)^2."""

    mag: np.ndarray
    base_sq: float
    compute_sq: float


def with_compute_term(ref: np.ndarray, mag: np.ndarray | None, comp: np.ndarray, rtol: float) -> ComputeTerm:
    """sqrt(max(|ref|, mag)^2 + (COMPUTE_K u32 E / rtol)^2) per element, 0 where the golden is not finite
    (those elements are judged by class), with the sums of `ComputeTerm`."""
    r = np.asarray(ref, dtype=np.float64)
    fin = np.isfinite(r)
    base = np.where(fin, np.abs(r), 0.0)
    if mag is not None:
        base = np.maximum(base, np.where(fin, np.asarray(mag, dtype=np.float64).reshape(r.shape), 0.0))
    e = np.where(fin, np.asarray(comp, dtype=np.float64).reshape(r.shape), 0.0)
    base_sq = float(np.sum(base * base))
    compute_sq = float(np.sum(np.square(COMPUTE_K_AGG * U32 * e)))
    if rtol <= 0:
        return ComputeTerm(base, base_sq, compute_sq)
    t = (COMPUTE_K * U32 / rtol) * e
    return ComputeTerm(np.sqrt(base * base + t * t), base_sq, compute_sq)
TIERS = ("production", "baseline")
LIMIT_FIELDS = ("atol", "rtol", "cos_diff", "nmse", "atol_max_eps", "atol_acc", "agg_acc")  # what an Override may set


@dataclass(frozen=True)
class Override:
    """Change some limits for one output and/or dtype; `reason` is required."""

    reason: str
    output: str | None = None
    dtype: str | None = None
    atol: float | None = None
    rtol: float | None = None
    cos_diff: float | None = None
    nmse: float | None = None
    atol_max_eps: float | None = None
    atol_acc: float | None = None
    agg_acc: float | None = None

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("a tolerance override needs a reason")

    def applies(self, output: str, dtype: str) -> bool:
        return self.output in (None, output) and self.dtype in (None, dtype)


@dataclass(frozen=True)
class Tier:
    """The eager baseline's tier: overrides on top of production's, and why it may be looser."""

    reason: str
    overrides: tuple[Override, ...] = ()

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("a tolerance tier needs a reason")


@dataclass(frozen=True)
class Tol:
    """An op's tolerance policy. `acc_len(params, output)` gives the reduction length.

    `overrides` make the production tier; `baseline` (a Tier) adds overrides for the op's eager
    baseline backend only."""

    acc_len: Callable[[dict[str, Any], str], int] | None = None
    acc_coeff: float = 1.0
    overrides: tuple[Override, ...] = ()
    baseline: Tier | None = None
    noise_k: float | Callable[[dict[str, Any]], float] | None = 2.0  # a number, or one per case
    grad_noise_k: float = 3.0  # FlashAttention: gradients within 3x the same-precision baseline's error
    floor_ulps: float = 2.0
    borderline: float = 0.1

    def limits(self, output: str, out_dtype: DType, params: dict[str, Any], tier: str = "production") -> Limits:
        if tier not in TIERS:
            raise ValueError(f"unknown tolerance tier {tier!r} (tiers: {', '.join(TIERS)})")
        if out_dtype.name not in DTYPE_DEFAULTS:
            raise KeyError(f"no default limits for output dtype {out_dtype.name!r}: declare them in "
                           f"DTYPE_DEFAULTS (limits of zero would pass nothing, a missing row must fail)")
        base = DTYPE_DEFAULTS[out_dtype.name]
        tiered = self.overrides + (self.baseline.overrides if tier == "baseline" and self.baseline else ())
        for o in tiered:
            if o.applies(output, out_dtype.name):
                base = replace(
                    base,
                    **{k: getattr(o, k) for k in LIMIT_FIELDS if getattr(o, k) is not None},
                )
        if self.acc_len is not None:
            n = max(1, int(self.acc_len(params, output)))
            acc = DTYPES["fp32"].eps * math.sqrt(n)
            agg = base.agg_acc * acc * acc
            base = replace(base, rtol=base.rtol + self.acc_coeff * acc,
                           atol_max_eps=base.atol_max_eps + base.atol_acc * acc / out_dtype.eps, atol_acc=0.0,
                           cos_diff=None if base.cos_diff is None else base.cos_diff + agg,
                           nmse=None if base.nmse is None else base.nmse + 2.0 * agg, agg_acc=0.0)
        return base

    def noise_factor(self, params: dict[str, Any], gradient: bool = False) -> float | None:
        if self.noise_k is None:
            return None
        if gradient:
            return self.grad_noise_k
        return self.noise_k(params) if callable(self.noise_k) else self.noise_k

    def noise_floor(self, out_dtype: DType, max_ref: float, atol: float = 0.0,
                    params: dict[str, Any] | None = None, output: str | None = None) -> float:
        """The noise layer's floor, never zero:

        floor_ulps x (eps(out) + acc_coeff x eps(fp32) x sqrt(accumulation length)) x max|golden|,
        the rounding of the output plus the fp32 accumulation allowance that layer 3's rtol also
        carries: in fp32 the eager baseline accumulates as precisely as a fused kernel, so the
        2x rule alone compares two random errors of one scale and fails on some seeds (seen: a
        d=256 fp32 prefill at 3.2x eager's max_abs, 11 ulp of max|O|, on 1 seed in 4). And never
        below AGG_FLOOR x atol, the absolute floor the aggregate limits share."""
        rel = out_dtype.eps
        if self.acc_len is not None and params is not None and output is not None:
            rel += self.acc_coeff * DTYPES["fp32"].eps * math.sqrt(max(1, int(self.acc_len(params, output))))
        return max(self.floor_ulps * rel * max(max_ref, out_dtype.tiny), AGG_FLOOR * atol)


@dataclass
class LayerResult:
    ok: bool | None  # None: not applicable
    detail: str = ""


@dataclass
class OutputJudgement:
    layers: dict[str, LayerResult] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)  # measured / limit, per check
    vacuous: bool = False

    @property
    def norm_err(self) -> float:
        return max(self.ratios.values(), default=0.0)


# what cond a sum of random-sign terms reaches by chance (aggregate_limits)
COND_RANDOM = 2.0


def aggregate_limits(m: dict[str, float], lim: Limits) -> tuple[float | None, float | None]:
    """(cos_diff, nmse) limits in force: the declared ones, raised to the absolute floor.

    The floor is the value each metric takes when every compared element is off by
    AGG_FLOOR * atol: sum(d^2) = n (AGG_FLOOR atol)^2 over sum(a^2 + b^2) (cos_diff) or sum(b^2)
    (nmse), with the sums `compare` recorded."""
    floor_sq = m.get("numel_finite", m["numel"]) * (AGG_FLOOR * lim.atol) ** 2
    # the error model (OpSpec.magnitude): errors scale with the magnitudes m >= |golden|, so the
    # relative norms may be `cond` = sum m^2 / sum golden^2 times those of a well-conditioned output.
    # The magnitudes are root-sum-squares of the terms (the standard deviation of their independent
    # roundings): a sum of random-sign terms has E (sum t)^2 = sum t^2, i.e. cond ~1.5 (E max(z^2, 1)
    # = 1.48 for a Gaussian z) with no cancellation at all; only cond beyond COND_RANDOM scales them,
    # so an ordinary output keeps today's limits
    cond = max(1.0, m.get("cond", 1.0) / COND_RANDOM)
    extra = m.get("compute_sq", 0.0)  # the compute-precision term's (COMPUTE_K_AGG), on top
    cos = nmse = None
    if lim.cos_diff is not None:
        denom = m.get("sum_sq_both", 0.0)
        cos = max(lim.cos_diff * cond, floor_sq / denom) + extra / denom if denom > 0 else math.inf
    if lim.nmse is not None:
        bb = m.get("sum_sq_ref", 0.0)
        nmse = max(lim.nmse * cond, floor_sq / bb) + extra / bb if bb > 0 else math.inf
    return cos, nmse


def numeric_layer(m: dict[str, float], elem_ratio: float, lim: Limits) -> tuple[LayerResult, dict[str, float]]:
    ratios = {"elementwise": elem_ratio}
    bad = []
    if m["mismatch"] > 0 and elem_ratio > 1.0:
        bad.append(f"{m['mismatch']}/{m['numel']} elements outside atol={m['atol_eff']:.3g} rtol={lim.rtol:.3g}")
    cos_lim, nmse_lim = aggregate_limits(m, lim)
    if cos_lim is not None:
        ratios["cos_diff"] = m["cos_diff"] / cos_lim if m["cos_diff"] > 0 else 0.0
        if m["cos_diff"] > cos_lim:
            bad.append(f"cos_diff={m['cos_diff']:.3g} > {cos_lim:.3g}")
    if nmse_lim is not None:
        # an all-zero golden (e.g. dq of rows that see one key) has no nmse to judge (limit inf): the
        # elementwise layer judges it, and its ratio is 0, not inf / inf (a passing case's norm_err)
        ratios["nmse"] = (0.0 if m["nmse"] <= 0 or math.isinf(nmse_lim)
                          else (m["nmse"] / nmse_lim) if math.isfinite(m["nmse"]) else math.inf)
        if m["nmse"] > nmse_lim:
            bad.append(f"nmse={m['nmse']:.3g} > {nmse_lim:.3g}")
    return LayerResult(not bad, "; ".join(bad)), ratios


def noise_layer(err: float, baseline_err: float, k: float, floor: float) -> tuple[LayerResult, dict[str, float]]:
    limit = k * baseline_err + floor
    ratio = err / limit
    ok = err <= limit
    detail = f"max_abs={err:.3g} vs {k:g} x baseline {baseline_err:.3g} + floor {floor:.3g} = {limit:.3g}"
    return LayerResult(ok, detail), {"noise": ratio}


def zero_output_passes(ref_finite_abs_max: float, atol_eff: float, lim: Limits, has_nonzero: bool,
                       rms_ref: float | None = None) -> bool:
    """Would an all-zero output pass layer 3? (cos_diff of 0 vs non-zero is 1, nmse is 1; both
    fail their limits unless the absolute floor raises those to 1, i.e. RMS(ref) <= AGG_FLOOR atol.)"""
    if not has_nonzero:
        return False
    if ref_finite_abs_max > atol_eff / max(1e-300, 1.0 - min(lim.rtol, 0.999999)):
        return False
    aggregate_floor_passes = rms_ref is not None and rms_ref <= AGG_FLOOR * lim.atol
    if lim.cos_diff is not None and lim.cos_diff < 1.0 and not aggregate_floor_passes:
        return False
    if lim.nmse is not None and lim.nmse < 1.0 and not aggregate_floor_passes:
        return False
    return True


# -- layer 1: structure -------------------------------------------------------------------------------
def shape_layer(got: Any, want_shape: tuple[int, ...]) -> str | None:
    """Why the output cannot be compared at all (missing, wrong shape), or None."""
    if got is None:
        return "output missing: the backend returned no such tensor"
    if tuple(np.shape(got)) != tuple(want_shape):
        return f"shape {tuple(np.shape(got))}, expected {tuple(want_shape)}"
    return None


def structure_checks(got: np.ndarray, want: DType, damage: str | None, unwritten: int) -> list[str]:
    """dtype, canaries and padding, elements never written (NaN/inf positions come with layer 3)."""
    out = []
    if got.dtype != want.np:
        out.append(f"dtype {got.dtype}, expected {want.name}")
    if damage:
        out.append(damage)
    if unwritten:
        out.append(f"{unwritten} element(s) never written (still hold the poison pattern)")
    return out


def exclude(got: np.ndarray, ref: np.ndarray, mask: np.ndarray, reason: str) -> tuple:
    """Elements outside a backend's declared contract are not judged: the golden takes the
    kernel's value there (any value, NaN or unwritten included), and they are counted."""
    m = np.broadcast_to(mask, ref.shape)
    n = int(np.count_nonzero(m))
    if n == 0:
        return got, ref, None
    with np.errstate(invalid="ignore"):
        ref = np.where(m, np.asarray(got).astype(np.float64), ref)
    return got, ref, {"elements": n, "reason": str(reason)}


# -- layer 2: exact -------------------------------------------------------------------------------------
def exact_layer(got: np.ndarray, ref: np.ndarray, nan_bits: bool = True) -> tuple[LayerResult, dict, list]:
    n_bad, worst = exact_mismatch(got, ref, nan_bits)
    metrics = {"numel": int(got.size), "mismatch": n_bad, "mismatch_frac": n_bad / max(1, got.size)}
    detail = f"{n_bad}/{got.size} elements differ from the golden bit for bit" if n_bad else ""
    return LayerResult(n_bad == 0, detail), metrics, worst


# -- layer 5: trust --------------------------------------------------------------------------------------
def trust_layer(ref: np.ndarray, m: dict[str, float], lim: Limits) -> tuple[LayerResult, bool]:
    # any finite non-zero element: a chunk of the golden at a time, stopping at the first found (a
    # golden nearly always has one in its first chunk) rather than two golden-sized masks and a copy
    ref = np.asarray(ref)
    flat = ref.reshape(-1) if ref.flags.c_contiguous else ref.flat  # a strided golden: copies of a chunk
    chunks = (flat[i:i + 65536] for i in range(0, ref.size, 65536))
    has_nonzero = any(bool(np.any(np.isfinite(c) & (c != 0))) for c in chunks)
    n_fin = m["numel_finite"]
    rms_ref = math.sqrt(m["sum_sq_ref"] / n_fin) if n_fin else 0.0
    vacuous = zero_output_passes(m["max_ref"], m["atol_eff"], lim, has_nonzero, rms_ref)
    detail = "an all-zero output would pass: the reference is below the tolerance" if vacuous else ""
    return LayerResult(not vacuous, detail), vacuous
