"""Turn one backend's outputs into a verdict, layer by layer (see conformance/tolerance.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernel_parity.conformance.backends import NotProvided
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.metrics import compare, exact_mismatch
from kernel_parity.conformance.poison import is_poison
from kernel_parity.conformance.tolerance import (LayerResult, OutputJudgement, aggregate_limits, noise_layer, numeric_layer,
                                   zero_output_passes)

LAYERS = ("structure", "exact", "numeric", "noise", "trust")
MAX_WORST_LINES = 5


def judge_case(case: Case, spec: Any, prep: Any, outputs: dict[str, np.ndarray], damage: dict[str, str],
               touched: list[str], noise_base: dict[str, float] | None, repro: str, tier: str = "production",
               excluded: dict[str, tuple[np.ndarray, str]] | None = None) -> dict:
    """The record of one backend's outputs. `excluded`: output -> (mask, reason) of elements the
    backend declares outside its contract; they are reported, not judged."""
    p = case.p
    excluded = excluded or {}
    rec_outputs: dict[str, dict] = {}
    judgements: dict[str, OutputJudgement] = {}
    problems: list[tuple[str, str, str]] = []  # (kind, output, detail)
    for name in prep.shapes:
        want_shape, want_dtype = prep.shapes[name], prep.out_dtypes[name]
        exact = spec.outputs[name].exact
        j = OutputJudgement()
        judgements[name] = j
        orec: dict[str, Any] = {"dtype": want_dtype.name, "shape": list(want_shape), "exact": exact}
        rec_outputs[name] = orec
        got = outputs.get(name)
        if isinstance(got, NotProvided):
            orec["not_provided"] = got.reason
            j.layers["structure"] = LayerResult(None, f"not provided: {got.reason}")
            orec["layers"] = {"structure": {"ok": None, "detail": f"not provided: {got.reason}"}}
            continue
        if got is None:
            j.layers["structure"] = LayerResult(False, "output missing")
            problems.append(("structural", name, "output missing: the backend returned no such tensor"))
            continue
        if tuple(got.shape) != want_shape:
            j.layers["structure"] = LayerResult(False, f"shape {tuple(got.shape)}, expected {want_shape}")
            problems.append(("structural", name, f"shape {tuple(got.shape)}, expected {want_shape}"))
            continue
        ref = np.asarray(prep.golden[name])
        got = spec.outputs[name].accept_any(got, ref)
        if name in excluded:
            got, ref, orec["outside_contract"] = _exclude(name, got, ref, *excluded[name])
        structure = []
        if got.dtype != want_dtype.np:
            structure.append(f"dtype {got.dtype}, expected {want_dtype.name}")
        if name in damage:
            structure.append(damage[name])
        if got.dtype == want_dtype.np and want_dtype.is_float:
            unwritten = int(np.count_nonzero(is_poison(got, want_dtype) & ~np.isnan(ref)))
            if unwritten:
                structure.append(f"{unwritten} element(s) never written (still hold the poison pattern)")
        if exact:
            n_bad, worst = exact_mismatch(got, ref)
            orec["worst"] = worst
            orec["metrics"] = {"numel": int(got.size), "mismatch": n_bad, "mismatch_frac": n_bad / max(1, got.size)}
            j.layers["structure"] = LayerResult(not structure, "; ".join(structure))
            j.layers["exact"] = LayerResult(n_bad == 0, f"{n_bad}/{got.size} elements differ bitwise" if n_bad else "")
            for s in structure:
                problems.append(("structural", name, s))
            if n_bad:
                problems.append(("exact", name, f"{n_bad}/{got.size} elements differ from the golden bit for bit"))
                j.ratios["exact"] = float("inf")
            orec["layers"] = {k: {"ok": v.ok, "detail": v.detail} for k, v in j.layers.items()}
            continue
        tol_dtype = spec.outputs[name].tolerance_dtype(case.dtype)
        lim = spec.tolerance.limits(name, tol_dtype, p, tier)
        cmp = compare(got, ref, want_dtype, lim, tol_dtype)
        if cmp.anomaly_mismatch:
            structure.append(cmp.anomaly_detail)
        j.layers["structure"] = LayerResult(not structure, "; ".join(structure))
        for s in structure:
            problems.append(("structural", name, s))
        num, ratios = numeric_layer(cmp.metrics, cmp.elem_ratio, lim)
        j.layers["numeric"] = num
        j.ratios.update(ratios)
        if not num.ok:
            problems.append(("numeric", name, num.detail))
        orec["metrics"] = cmp.metrics
        cos_eff, nmse_eff = aggregate_limits(cmp.metrics, lim)
        orec["limits"] = {"atol": cmp.metrics["atol_eff"], "rtol": lim.rtol, "cos_diff": lim.cos_diff,
                          "nmse": lim.nmse, "cos_diff_eff": cos_eff, "nmse_eff": nmse_eff}
        orec["worst"] = cmp.worst
        orec["noise"] = None
        k = spec.tolerance.noise_factor(p)
        if noise_base and name in noise_base and k is not None:
            floor = spec.tolerance.noise_floor(tol_dtype, cmp.metrics["max_ref"], lim.atol, p, name)
            nl, nr = noise_layer(cmp.metrics["max_abs"], noise_base[name], k, floor)
            j.layers["noise"] = nl
            j.ratios.update(nr)
            orec["noise"] = {"err": cmp.metrics["max_abs"], "baseline_err": noise_base[name], "k": k,
                             "floor": floor, "limit": k * noise_base[name] + floor}
            if not nl.ok:
                problems.append(("noise", name, nl.detail))
        else:
            j.layers["noise"] = LayerResult(None, "no same-precision baseline for this case")
        finite = np.isfinite(ref)
        has_nonzero = bool(np.any(ref[finite] != 0))
        n_fin = cmp.metrics["numel_finite"]
        rms_ref = math.sqrt(cmp.metrics["sum_sq_ref"] / n_fin) if n_fin else 0.0
        j.vacuous = zero_output_passes(cmp.metrics["max_ref"], cmp.metrics["atol_eff"], lim, has_nonzero, rms_ref)
        j.layers["trust"] = LayerResult(
            not j.vacuous, "an all-zero output would pass: the reference is below the tolerance" if j.vacuous else "")
        orec["layers"] = {k_: {"ok": v.ok, "detail": v.detail} for k_, v in j.layers.items()}
    if touched:
        problems.append(("structural", "inputs", f"the kernel wrote into input(s) {', '.join(touched)}"))
    rec = _verdict(case, spec, prep, rec_outputs, judgements, problems, outputs, repro)
    rec["tier"] = tier
    return rec


def _exclude(name: str, got: np.ndarray, ref: np.ndarray, mask: np.ndarray, reason: str) -> tuple:
    """Elements outside a backend's declared contract are not judged: the golden takes the
    kernel's value there (any value, NaN or unwritten included), and they are counted."""
    m = np.broadcast_to(mask, ref.shape)
    n = int(np.count_nonzero(m))
    if n == 0:
        return got, ref, None
    with np.errstate(invalid="ignore"):
        ref = np.where(m, np.asarray(got).astype(np.float64), ref)
    return got, ref, {"elements": n, "reason": str(reason)}


def _verdict(case, spec, prep, rec_outputs, judgements, problems, outputs, repro) -> dict:
    kinds = [k for k, _, _ in problems]
    kind = next((k for k in ("structural", "exact", "numeric", "noise") if k in kinds), None)
    vacuous = any(j.vacuous for j in judgements.values())
    verdict = "fail" if kind else ("vacuous" if vacuous else "pass")
    layers = {}
    for layer in LAYERS:
        oks = [j.layers[layer].ok for j in judgements.values() if layer in j.layers]
        oks = [o for o in oks if o is not None]
        layers[layer] = "n/a" if not oks else ("pass" if all(oks) else "fail")
    if any(n == "inputs" for _, n, _ in problems):
        layers["structure"] = "fail"
    norm = max((j.norm_err for j in judgements.values()), default=0.0)
    reason = message = None
    if kind:
        first = next(p for p in problems if p[0] == kind)
        reason = f"{first[1]}: {first[2]}"
        message = failure_message(case, spec, prep, rec_outputs, problems, repro)
    elif vacuous:
        reason = "the reference is below the tolerance: an all-zero output would pass"
    return {
        "id": case.id, "op": case.op, "backend": case.backend, "dtype": case.dtype, "params": case.p,
        "dist": case.dist, "seed": case.seed, "verdict": verdict, "kind": kind, "reason": reason,
        "message": message, "repro": repro, "norm_err": norm, "outputs": rec_outputs, "layers": layers,
        "recheck": None, "timing": {},
    }


def failure_message(case, spec, prep, rec_outputs, problems, repro) -> str:
    """First line what failed, then where (worst elements, NaN first), then how to reproduce."""
    lines = []
    shown: set[str] = set()
    for kind, name, detail in problems:
        orec = rec_outputs.get(name, {})
        m = orec.get("metrics", {})
        dtype = f" ({orec['dtype']})" if orec.get("dtype") else ""
        head = f"{case.op}[{case.backend}] {name}{dtype}: {detail}"
        if kind in ("numeric", "noise") and "max_abs" in m and "max_abs=" not in detail:
            head += f"; max_abs={m['max_abs']:.3g}"
        lines.append(head)
        if name in shown:
            continue
        shown.add(name)
        for w in orec.get("worst", [])[:MAX_WORST_LINES]:
            idx = ", ".join(map(str, w["index"]))
            lines.append(f"  {name}[{idx}] = {w['got']:.6g}, expected {w['expected']:.6g}"
                         f"  |d|={w['abs']:.2g} rel={w['rel']:.2g}")
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)


def diagnose(case: Case, spec: Any, inputs64: dict, outputs: dict[str, Any], original: dict[str, Any],
             tier: str = "production") -> list[str]:
    """Labels of the alternative semantics (spec.diagnoses) whose golden the kernel's outputs match.

    An output matches when its NaN/inf positions agree and it passes layer 3 against the
    alternative golden; outputs the backend did not provide are ignored. `original` is the
    golden already computed for the case (an alternative equal to it tells nothing apart).
    """
    p = case.p
    found = []
    for d in spec.diagnoses:
        alt = d.alter(p)
        if alt is None:
            continue
        try:
            golden = spec.reference(inputs64, alt)
        except Exception:  # an alternative the golden cannot express is simply not a match
            continue
        if all(np.array_equal(golden[n], original[n], equal_nan=True) for n in golden):
            continue  # the alternative means the same thing for this case: it tells nothing apart
        compared = 0
        ok = True
        for name, out in spec.outputs.items():
            got = outputs.get(name)
            if got is None or isinstance(got, NotProvided) or out.exact:
                continue
            tol_dtype = out.tolerance_dtype(case.dtype)
            lim = spec.tolerance.limits(name, tol_dtype, p, tier)
            ref = np.asarray(golden[name])
            got = out.accept_any(got, ref)
            cmp = compare(got, ref, out.resolve(case.dtype), lim, tol_dtype)
            layer, _ = numeric_layer(cmp.metrics, cmp.elem_ratio, lim)
            compared += 1
            if cmp.anomaly_mismatch or not layer.ok:
                ok = False
                break
        if ok and compared:
            found.append(d.label)
    return found
