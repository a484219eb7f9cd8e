"""The layered tolerance policy, declared as data in each op spec.

Layers (each one's outcome is recorded per output):
1. structure  shape, dtype, NaN/inf positions, unwritten (still poisoned) elements, canaries,
              inputs left untouched
2. exact      bit-exact outputs
3. numeric    every element |a - b| <= atol + rtol |b|, plus aggregate cos_diff and nmse limits;
              rtol = the dtype's rtol + acc_coeff * eps(fp32) * sqrt(accumulation length)
4. noise      FlashAttention's method: max_abs(kernel) <= k * max_abs(same-dtype baseline) + floor,
              floor = floor_ulps * eps(out dtype) * max |golden| (never zero)
5. trust      `vacuous` when an all-zero output would pass layer 3 on a non-zero golden
6. borderline a case within `borderline` (10%) of a limit is re-run on fresh seeds; `flaky` if
              the verdicts disagree (done by the runner)

No tolerance scales with numel; the accumulation length is a reduction length (row length,
number of splits), which sets how much fp32 rounding a correct kernel accumulates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from conformance.dtypes import DTYPES, DType
from conformance.metrics import Limits

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
}

# Float64 self-checks of the goldens against each other (online vs textbook, combine vs
# whole-row attention): both sides are float64 with O(n) operations, so agreement to a few
# hundred eps(fp64) is expected; anything looser would hide a wrong formula.
GOLDEN_SELF_CHECK = Limits(atol=1e-12, rtol=1e-11)


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

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("a tolerance override needs a reason")

    def applies(self, output: str, dtype: str) -> bool:
        return self.output in (None, output) and self.dtype in (None, dtype)


@dataclass(frozen=True)
class Tol:
    """An op's tolerance policy. `acc_len(params, output)` gives the reduction length."""

    acc_len: Callable[[dict[str, Any], str], int] | None = None
    acc_coeff: float = 1.0
    overrides: tuple[Override, ...] = ()
    noise_k: float | Callable[[dict[str, Any]], float] | None = 2.0  # a number, or one per case
    floor_ulps: float = 2.0
    borderline: float = 0.1

    def limits(self, output: str, out_dtype: DType, params: dict[str, Any]) -> Limits:
        base = DTYPE_DEFAULTS.get(out_dtype.name, Limits(atol=0.0, rtol=0.0))
        for o in self.overrides:
            if o.applies(output, out_dtype.name):
                base = replace(
                    base,
                    **{k: getattr(o, k) for k in ("atol", "rtol", "cos_diff", "nmse", "atol_max_eps") if getattr(o, k) is not None},
                )
        if self.acc_len is not None:
            n = max(1, int(self.acc_len(params, output)))
            base = replace(base, rtol=base.rtol + self.acc_coeff * DTYPES["fp32"].eps * math.sqrt(n))
        return base

    def noise_factor(self, params: dict[str, Any]) -> float | None:
        return self.noise_k(params) if callable(self.noise_k) else self.noise_k

    def noise_floor(self, out_dtype: DType, max_ref: float) -> float:
        return self.floor_ulps * out_dtype.eps * max(max_ref, out_dtype.tiny)


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


def numeric_layer(m: dict[str, float], elem_ratio: float, lim: Limits) -> tuple[LayerResult, dict[str, float]]:
    ratios = {"elementwise": elem_ratio}
    bad = []
    if m["mismatch"] > 0 and elem_ratio > 1.0:
        bad.append(f"{m['mismatch']}/{m['numel']} elements outside atol={m['atol_eff']:.3g} rtol={lim.rtol:.3g}")
    if lim.cos_diff is not None:
        ratios["cos_diff"] = m["cos_diff"] / lim.cos_diff
        if m["cos_diff"] > lim.cos_diff:
            bad.append(f"cos_diff={m['cos_diff']:.3g} > {lim.cos_diff:.3g}")
    if lim.nmse is not None:
        ratios["nmse"] = (m["nmse"] / lim.nmse) if math.isfinite(m["nmse"]) else math.inf
        if m["nmse"] > lim.nmse:
            bad.append(f"nmse={m['nmse']:.3g} > {lim.nmse:.3g}")
    return LayerResult(not bad, "; ".join(bad)), ratios


def noise_layer(err: float, baseline_err: float, k: float, floor: float) -> tuple[LayerResult, dict[str, float]]:
    limit = k * baseline_err + floor
    ratio = err / limit
    ok = err <= limit
    detail = f"max_abs={err:.3g} vs {k:g} x baseline {baseline_err:.3g} + floor {floor:.3g} = {limit:.3g}"
    return LayerResult(ok, detail), {"noise": ratio}


def zero_output_passes(ref_finite_abs_max: float, atol_eff: float, lim: Limits, has_nonzero: bool) -> bool:
    """Would an all-zero output pass layer 3? (cos_diff of 0 vs non-zero is 1, nmse is 1.)"""
    if not has_nonzero:
        return False
    if ref_finite_abs_max > atol_eff / max(1e-300, 1.0 - min(lim.rtol, 0.999999)):
        return False
    if lim.cos_diff is not None and lim.cos_diff < 1.0:
        return False
    if lim.nmse is not None and lim.nmse < 1.0:
        return False
    return True
