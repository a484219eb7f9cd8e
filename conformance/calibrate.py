"""`parity calibrate OP`: measure errors over many seeds and print the limits they suggest.

The cases come from the same selection every command resolves (conformance/commands.py):
`--suite`, else the repository's `[tool.kernel-parity].suites`, else ci; `--backend`, else the
configured backends, else the suite's own; the repository's tolerance overrides apply. For every
backend, output and dtype, over the suite's parameter sets x distributions x `--seeds` seeds: the
quantiles of max_ulp, the worst cos_diff, nmse and noise ratio, and the smallest rtol (at the
declared atol) every element would have needed: relative to |golden|, or for an output the op's error
model judges (`OpSpec.magnitude`), relative to max(|golden|, magnitude): the measured c of the bound
atol + c m, against the declared rtol (the model's c), with the outputs' cond.

Suggestions are never degenerate: rtol is 2x the worst needed, and never below one unit of the
output dtype's eps (a computation rounds at least once; "rtol 0" would fail the first seed whose
error lands above atol); cos_diff and nmse are 4x the worst seen, never below the aggregate floor
the judge already applies. An output without a same-precision baseline has no noise ratio ("—").
Headroom for unseen seeds, never a limit that grows with numel. Tolerances stay data in the spec:
this prints (and with --json writes) suggestions, it edits nothing.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.errors import EXIT_OK, UsageError
from kernel_parity.conformance.session import open_session, progress


def _needed_rtol(got: np.ndarray, ref: np.ndarray, atol: float, magnitude: np.ndarray | None = None) -> float:
    """The smallest rtol every element needs at `atol`: against |golden|, or, for an op with an error
    model, against max(|golden|, magnitude) (the c of the model's bound atol + c m)."""
    a, b = got.astype(np.float64), np.asarray(ref, dtype=np.float64)
    m = np.abs(b) if magnitude is None or np.shape(magnitude) != b.shape else np.maximum(np.abs(b), magnitude)
    ok = np.isfinite(a) & np.isfinite(b) & (m != 0)
    if not ok.any():
        return 0.0
    with np.errstate(over="ignore"):
        need = (np.abs(a[ok] - b[ok]) - atol) / m[ok]
    return float(max(0.0, need.max()))


def suggestion(need: float, cos_worst: float, nmse_worst: float, dtype: str) -> dict[str, Any]:
    """The limits a calibration suggests, each with how it was derived (never 0)."""
    eps = dt.get(dtype).eps if dtype in dt.DTYPES else float(np.finfo(np.float32).eps)
    rtol = 2 * need
    out = {"rtol": max(rtol, eps), "rtol_from": "2 x the worst needed" if rtol >= eps else
           f"1 eps of {dtype} (every element was within atol, or needed less than one rounding)"}
    out["cos_diff"] = 4 * cos_worst if cos_worst > 0 else None
    out["nmse"] = 4 * nmse_worst if nmse_worst > 0 else None
    return out


def calibrate(args: Any, command: str = "") -> int:
    from kernel_parity.conformance.commands import Selection, select_cases

    spec = ops.get(args.op)
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    session = open_session(args.backend)
    sel_args = SimpleNamespace(suite=args.suite, op=[spec.name], backend=list(args.backend), dtype=list(args.dtype),
                               dist=[], scale=getattr(args, "scale", "auto"), shard=None)
    sel = Selection.from_args(sel_args, session)
    try:
        base = select_cases(sel, session)
    except UsageError as e:
        raise UsageError(f"calibrate {spec.name}: {e}") from None
    cases = list(dict.fromkeys(c.with_seed(s) for c in base for s in range(args.seeds)))
    runner = session.runner(recheck=False)
    runner.capture = {}
    stats: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    verdicts: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    bar = progress(len(cases), disable=args.no_progress)

    def collect(rec: Any) -> None:
        bar.update(1)
        rec = rec.to_json()
        arrays = runner.capture.pop(rec["id"], None)
        for name, o in rec["outputs"].items():
            key = (rec["backend"], name, o["dtype"])
            verdicts[key][rec["verdict"]] += 1
            m = o.get("metrics")
            if not m or "cos_diff" not in m:
                continue
            s = stats[key]
            for k in ("max_ulp", "cos_diff", "nmse"):
                s[k].append(m[k])
            if o.get("noise"):
                s["noise_ratio"].append(o["noise"]["err"] / o["noise"]["limit"])
            if "cond" in m:  # the op's error model judged this output
                s["cond"].append(m["cond"])
            if arrays is not None and name in arrays["outputs"]:
                s["rtol_needed"].append(_needed_rtol(arrays["outputs"][name], arrays["golden"][name], m["atol_eff"],
                                                     arrays.get("magnitudes", {}).get(name)))
            s["rtol_declared"].append(o["limits"]["rtol"])

    runner.run(cases, on_result=collect)
    bar.close()
    print(f"calibrate {spec.name}: {len(cases)} runs ({len(base)} cases of suite {sel.label!r} x {args.seeds} seeds)")
    print(f"{'backend':<10} {'output':<6} {'dtype':<5} {'runs':>5} {'max_ulp p50/p99/max':>22} "
          f"{'cos_diff max':>13} {'nmse max':>10} {'noise max':>10} {'rtol need':>10} {'declared':>9} {'suggest':>9}")
    rows = []
    for key in sorted(stats):
        s = stats[key]
        ulp = np.asarray(s["max_ulp"], dtype=np.float64)
        finite = ulp[np.isfinite(ulp)]

        def q(p: float) -> float:
            return float(np.percentile(finite, p)) if finite.size else math.nan

        need = max(s["rtol_needed"], default=0.0)
        noise = max(s["noise_ratio"]) if s["noise_ratio"] else None
        sug = suggestion(need, max(s["cos_diff"]), max(s["nmse"]), key[2])
        ulp_text = (f"{q(50):>6.0f}/{q(99):>6.0f}/{finite.max():>7.0f}" if finite.size else f"{'—':>22}")
        print(f"{key[0]:<10} {key[1]:<6} {key[2]:<5} {len(ulp):>5} {ulp_text} "
              f"{max(s['cos_diff']):>13.3g} {max(s['nmse']):>10.3g} "
              f"{('—' if noise is None else f'{noise:.3g}'):>10} {need:>10.3g} "
              f"{min(s['rtol_declared']):>9.3g} {sug['rtol']:>9.3g}   verdicts {dict(verdicts[key])}")
        if sug["rtol"] > 2 * need:
            print(f"{'':<10} suggested rtol is {sug['rtol_from']}")
        cond = s.get("cond") or []
        if cond:
            print(f"{'':<10} error model: rtol need is against max(|golden|, magnitude); cond median "
                  f"{float(np.median(cond)):.3g}, max {max(cond):.3g} (limits scale by max(1, cond / 2))")
        rows.append({"backend": key[0], "output": key[1], "dtype": key[2], "runs": int(len(ulp)),
                     "max_ulp": {"p50": q(50), "p99": q(99), "max": float(finite.max()) if finite.size else None},
                     "cos_diff_max": max(s["cos_diff"]), "nmse_max": max(s["nmse"]), "noise_ratio_max": noise,
                     "rtol_needed": need, "rtol_declared": min(s["rtol_declared"]), "suggest": sug,
                     "error_model": ({"cond_median": float(np.median(cond)), "cond_max": max(cond)} if cond else None),
                     "verdicts": dict(verdicts[key])})
    if getattr(args, "json", None):
        from kernel_parity.reports import files, records

        doc = {"schema": "kernel-parity/calibrate/1", "op": spec.name, "suite": sel.label, "seeds": args.seeds,
               "cases": len(base), "command": command, "rows": rows}
        try:
            files.write_text(args.json, json.dumps(records.encode(doc), indent=1) + "\n")
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    return EXIT_OK
