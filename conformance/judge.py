"""Turn one backend's outputs into a CaseResult: the tolerance layers of conformance/tolerance.py,
run in order (structure -> exact -> numeric -> noise -> trust) for every output, then the
diagnosis step on a failure, then the message, built once.

Every output is judged against one reference (the op's main golden, the output's declared
reference, or the one the backend claims for this op); the error against every other reference
the op has is measured and recorded beside it. For a fused op with ordered stages, the record
names the first stage that diverges (then the final outputs, in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kernel_parity.conformance import sampling
from kernel_parity.conformance import tolerance as layers
from kernel_parity.conformance.backends import NotProvided
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.results import CaseResult, OutputResult
from kernel_parity.conformance.tolerance import LayerResult, OutputJudgement

MAX_WORST_LINES = 5
REFERENCE_METRICS = ("max_abs", "max_rel", "nmse", "cos_diff", "max_ulp", "mismatch")


@dataclass
class Evidence:
    """What the runner saw around the kernel call, beyond its outputs."""

    damage: dict[str, str] = field(default_factory=dict)  # output -> canary/padding overwritten
    unwritten: dict[str, int] = field(default_factory=dict)  # output -> elements still poisoned
    touched: list[str] = field(default_factory=list)  # inputs written that must stay untouched
    excluded: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # outside the contract
    noise_base: dict[str, float] | None = None  # output -> the baseline's max_abs
    claimed: str | None = None  # the reference the backend claims for this op


def judge_case(case: Case, spec: Any, prep: Any, outputs: dict[str, Any], ev: Evidence, repro: str,
               tier: str = "production", diagnose: Callable[[], tuple[list[str], str | None]] | None = None
               ) -> CaseResult:
    p = case.p
    results: dict[str, OutputResult] = {}
    judgements: dict[str, OutputJudgement] = {}
    problems: list[tuple[str, str, str]] = []  # (kind, output, detail)
    order = _judging_order(spec, prep)
    for name in order:
        orec, j, probs = _judge_output(case, spec, prep, name, outputs.get(name), ev, tier)
        results[name], judgements[name] = orec, j
        problems.extend(probs)
    if ev.touched:
        problems.append(("structural", "inputs", f"the kernel wrote into input(s) {', '.join(ev.touched)}"))
    kinds = [k for k, _, _ in problems]
    kind = next((k for k in ("structural", "exact", "numeric", "noise") if k in kinds), None)
    vacuous = any(j.vacuous for j in judgements.values())
    verdict = "fail" if kind else ("vacuous" if vacuous else "pass")
    rec = CaseResult(id=case.id, op=case.op, backend=case.backend, dtype=case.dtype, params=case.p,
                     dist=case.dist, seed=case.seed, verdict=verdict, kind=kind, tier=tier, repro=repro,
                     norm_err=max((j.norm_err for j in judgements.values()), default=0.0), outputs=results,
                     layers=_layer_summary(judgements, problems))
    failed = {n for k, n, _ in problems if k in ("structural", "exact", "numeric")}
    rec.first_divergence = next((n for n in order if n in failed), None) if spec.stages else None
    if kind:
        first = next(pr for pr in problems if pr[0] == kind)
        rec.reason = f"{first[1]}: {first[2]}"
        if kind in ("structural", "numeric") and diagnose is not None:  # the diagnosis step
            rec.diagnosis, rec.diagnosis_skipped = diagnose()
            rec.diagnosis = rec.diagnosis or None
            if rec.diagnosis:
                rec.reason = f"{rec.reason} [{rec.diagnosis[0]}]"
        if rec.first_divergence and rec.first_divergence in spec.stages:
            rec.reason = f"{rec.reason} (first divergence: stage {rec.first_divergence!r})"
        rec.message = failure_message(case, results, problems, rec.diagnosis or [], repro,
                                      getattr(prep, "sample", None))
    elif vacuous:
        rec.reason = "the reference is below the tolerance: an all-zero output would pass"
    return rec


def _judging_order(spec: Any, prep: Any) -> list[str]:
    """Stages in pipeline order, then the final outputs, then gradients."""
    names = list(prep.shapes)
    stages = [s for s in spec.stages if s in prep.shapes]
    grads = [n for n in names if n in spec.gradients]
    final = [n for n in names if n not in stages and n not in grads]
    return stages + final + grads


def reference_for(spec: Any, name: str, claimed: str | None, refs: dict[str, dict]) -> str:
    """The reference that judges output `name`: the backend's claim, the output's own, the main."""
    if claimed is not None and name in refs.get(claimed, {}):
        return claimed
    declared = spec.all_outputs()[name].reference
    if declared is not None and name in refs.get(declared, {}):
        return declared
    return spec.reference_name


def _judge_output(case: Case, spec: Any, prep: Any, name: str, got: Any, ev: Evidence, tier: str):
    want_shape, want_dtype = prep.shapes[name], prep.out_dtypes[name]
    out = spec.all_outputs()[name]
    j = OutputJudgement()
    problems: list[tuple[str, str, str]] = []
    orec = OutputResult(dtype=want_dtype.name, shape=list(want_shape), exact=out.exact,
                        stage=spec.stages.index(name) if name in spec.stages else None)

    def finish():
        orec.layers = {k: {"ok": v.ok, "detail": v.detail} for k, v in j.layers.items()}
        return orec, j, problems

    if isinstance(got, NotProvided):
        orec.not_provided = got.reason
        j.layers["structure"] = LayerResult(None, f"not provided: {got.reason}")
        return finish()
    shape_problem = layers.shape_layer(got, want_shape)
    if shape_problem:
        j.layers["structure"] = LayerResult(False, shape_problem)
        problems.append(("structural", name, shape_problem))
        return finish()
    ref_name = reference_for(spec, name, ev.claimed, prep.references)
    if len(prep.references) > 1:
        orec.reference = ref_name
    ref = np.asarray(prep.references[ref_name][name])
    axis = prep.row_axis(name) if hasattr(prep, "row_axis") else None
    if axis is not None:  # judged on the sampled rows (conformance/sampling.py)
        got = sampling.take_rows(got, prep.sample.idx, axis)
    got = out.accept_any(got, ref)
    if name in ev.excluded:
        mask, why = ev.excluded[name]
        if axis is not None:
            mask = sampling.take_rows(np.broadcast_to(mask, want_shape), prep.sample.idx, axis)
        got, ref, orec.outside_contract = layers.exclude(got, ref, mask, why)
    structure = layers.structure_checks(got, want_dtype, ev.damage.get(name), ev.unwritten.get(name, 0))
    if out.exact:  # layer 2
        ex, metrics, worst = layers.exact_layer(got, ref, out.nan_bits)
        orec.metrics, orec.worst = metrics, worst
        j.layers["structure"] = LayerResult(not structure, "; ".join(structure))
        j.layers["exact"] = ex
        problems += [("structural", name, s) for s in structure]
        if not ex.ok:
            problems.append(("exact", name, ex.detail))
            j.ratios["exact"] = float("inf")
        return finish()
    tol_dtype = spec.tol_dtype(name, case.dtype)
    lim = spec.tolerance.limits(name, tol_dtype, case.p, tier)
    mags = getattr(prep, "magnitudes", None) or {}
    mag = mags.get(name)
    comp = mags.get(name + layers.COMPUTE_SUFFIX)
    if mag is not None and name in ev.excluded:  # as the golden: excluded elements judged against |golden|
        mag = np.where(np.broadcast_to(mask, np.shape(mag)), 0.0, mag)
    term = None
    if comp is not None:  # the error model's compute-precision term (tolerance.with_compute_term)
        if name in ev.excluded:
            comp = np.where(np.broadcast_to(mask, np.shape(comp)), 0.0, comp)
        term = layers.with_compute_term(ref, mag, comp, lim.rtol)
        mag = term.mag
    cmp = compare(got, ref, want_dtype, lim, tol_dtype, magnitude=mag)
    if term is not None:  # cond without the term; the aggregate limits add its own allowance
        bb = cmp.metrics.get("sum_sq_ref", 0.0)
        cmp.metrics["cond"] = term.base_sq / bb if bb > 0 else 1.0
        cmp.metrics["compute_sq"] = term.compute_sq
    if cmp.anomaly_mismatch:
        structure.append(cmp.anomaly_detail)
    j.layers["structure"] = LayerResult(not structure, "; ".join(structure))  # layer 1
    problems += [("structural", name, s) for s in structure]
    num, ratios = layers.numeric_layer(cmp.metrics, cmp.elem_ratio, lim)  # layer 3
    j.layers["numeric"] = num
    j.ratios.update(ratios)
    if not num.ok:
        problems.append(("numeric", name, num.detail))
    orec.metrics, orec.worst = cmp.metrics, cmp.worst
    if axis is not None:
        for w in orec.worst:
            w["index"] = sampling.full_index(prep, name, w["index"])
    cos_eff, nmse_eff = layers.aggregate_limits(cmp.metrics, lim)
    orec.limits = {"atol": cmp.metrics["atol_eff"], "rtol": lim.rtol, "cos_diff": lim.cos_diff, "nmse": lim.nmse,
                   "cos_diff_eff": cos_eff, "nmse_eff": nmse_eff}
    if len(prep.references) > 1:  # every reference's error, the judging one included
        orec.references = {}
        for rname, rout in prep.references.items():
            if name in rout:
                other = cmp if rname == ref_name else compare(got, np.asarray(rout[name]), want_dtype, lim, tol_dtype,
                                                              magnitude=mag)
                orec.references[rname] = {k: other.metrics[k] for k in REFERENCE_METRICS}
    k = spec.tolerance.noise_factor(case.p, gradient=name in spec.gradients)
    base = (ev.noise_base or {}).get(name)
    if base is not None and k is not None:  # layer 4
        # the error model's scale where the op has one: the rounding of the magnitudes, not of |golden| alone
        floor = spec.tolerance.noise_floor(tol_dtype, cmp.metrics.get("max_mag", cmp.metrics["max_ref"]), lim.atol,
                                           case.p, name)
        nl, nr = layers.noise_layer(cmp.metrics["max_abs"], base, k, floor)
        j.layers["noise"] = nl
        j.ratios.update(nr)
        orec.noise = {"err": cmp.metrics["max_abs"], "baseline_err": base, "k": k, "floor": floor,
                      "limit": k * base + floor}
        if not nl.ok:
            problems.append(("noise", name, nl.detail))
    else:
        j.layers["noise"] = LayerResult(None, "no same-precision baseline for this case")
    j.layers["trust"], j.vacuous = layers.trust_layer(ref, cmp.metrics, lim)  # layer 5
    return finish()


def _layer_summary(judgements: dict[str, OutputJudgement], problems: list) -> dict[str, str]:
    out = {}
    for layer in layers.LAYERS:
        oks = [j.layers[layer].ok for j in judgements.values() if layer in j.layers]
        oks = [o for o in oks if o is not None]
        out[layer] = "n/a" if not oks else ("pass" if all(oks) else "fail")
    if any(n == "inputs" for _, n, _ in problems):
        out["structure"] = "fail"
    return out


def failure_message(case: Case, outputs: dict[str, OutputResult], problems: list, diagnosis: list[str],
                    repro: str, sample: Any = None) -> str:
    """First line what failed, then where (worst elements, NaN first), the diagnosis, the sample the
    values were judged on, then the repro."""
    lines = []
    shown: set[str] = set()
    for kind, name, detail in problems:
        orec = outputs.get(name)
        m = orec.metrics if orec else {}
        dtype = f" ({orec.dtype})" if orec else ""
        head = f"{case.op}[{case.backend}] {name}{dtype}: {detail}"
        if kind in ("numeric", "noise") and "max_abs" in m and "max_abs=" not in detail:
            head += f"; max_abs={m['max_abs']:.3g}"
        lines.append(head)
        if name in shown or orec is None:
            continue
        shown.add(name)
        for w in orec.worst[:MAX_WORST_LINES]:
            idx = ", ".join(map(str, w["index"]))
            mark = "" if w.get("out", True) else "  (within tolerance)"
            model = (f" bound={w['bound']:.2g} (magnitude {w['magnitude']:.2g})" if "bound" in w else "")
            lines.append(f"  {name}[{idx}] = {w['got']:.6g}, expected {w['expected']:.6g}"
                         f"  |d|={w['abs']:.2g} rel={w['rel']:.2g}{model}{mark}")
    lines += [f"  diagnosis: {d}" for d in diagnosis]
    if sample is not None:
        lines.append(f"  judged on a sample of {sample.idx.size} of {sample.n} rows ({sample.param}; the whole "
                     f"outputs scanned for NaN / inf / unwritten; --sample off judges every row)")
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)


def diagnose(case: Case, spec: Any, inputs64: dict, outputs: dict[str, Any], original: dict[str, Any],
             tier: str = "production", params: dict[str, Any] | None = None) -> list[str]:
    """Labels of the alternative semantics (spec.diagnoses) whose golden the kernel's outputs match.

    An output matches when its NaN/inf positions agree and it passes layer 3 against the
    alternative golden; outputs the backend did not provide are ignored. `original` is the
    golden already computed for the case (an alternative equal to it tells nothing apart).
    `params`: those the inputs stand for (a sampled group's rows alone), default the case's.
    """
    p = case.p if params is None else params
    found = []
    for d in spec.diagnoses:
        alt = d.alter(p)
        if alt is None:
            continue
        try:
            golden = spec.reference(inputs64, alt)
        except Exception:  # an alternative the golden cannot express is simply not a match
            continue
        if all(np.array_equal(golden[n], original[n], equal_nan=True) for n in golden if n in original):
            continue  # the alternative means the same thing for this case: it tells nothing apart
        compared = 0
        ok = True
        for name, out in spec.outputs.items():
            got = outputs.get(name)
            if got is None or isinstance(got, NotProvided) or out.exact or name not in golden:
                continue
            tol_dtype = spec.tol_dtype(name, case.dtype)
            lim = spec.tolerance.limits(name, tol_dtype, p, tier)
            ref = np.asarray(golden[name])
            got = out.accept_any(got, ref)
            cmp = compare(got, ref, spec.out_dtype(name, case.dtype), lim, tol_dtype)
            layer, _ = layers.numeric_layer(cmp.metrics, cmp.elem_ratio, lim)
            compared += 1
            if cmp.anomaly_mismatch or not layer.ok:
                ok = False
                break
        if ok and compared:
            found.append(d.label)
    return found
