"""`parity calibrate OP`: measure errors over many seeds and print the limits they suggest.

For every backend and output dtype, over the suite's parameter sets x distributions x
`--seeds` seeds: the quantiles of max_ulp, cos_diff, nmse and the noise ratio, and the
smallest rtol (at the declared atol) that every element would have needed. The suggestion is
2x the worst rtol observed and 4x the worst cos_diff / nmse: headroom for unseen seeds, never
a limit that grows with numel. Tolerances stay data in the spec: this prints, it edits nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.errors import EXIT_OK
from kernel_parity.conformance.session import open_session, progress
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.suites import Filters


def _needed_rtol(got: np.ndarray, ref: np.ndarray, atol: float) -> float:
    a, b = got.astype(np.float64), np.asarray(ref, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b) & (b != 0)
    if not ok.any():
        return 0.0
    with np.errstate(over="ignore"):
        need = (np.abs(a[ok] - b[ok]) - atol) / np.abs(b[ok])
    return float(max(0.0, need.max()))


def calibrate(args: Any, command: str = "") -> int:
    spec = ops.get(args.op)
    session = open_session(args.backend)
    names = session.backend_names
    base = suites.cases(args.suite or suites.DEFAULT_SUITE, Filters((spec.name,), tuple(names), tuple(args.dtype)))
    if not base:
        raise UsageError(f"no cases of {spec.name} in the suite match the filters")
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    cases = list(dict.fromkeys(c.with_seed(s) for c in base for s in range(args.seeds)))
    runner = session.runner(recheck=False)
    runner.capture = {}
    stats: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    verdicts: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    bar = progress(len(cases), disable=args.no_progress)

    def collect(rec: dict) -> None:
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
            if arrays is not None and name in arrays["outputs"]:
                s["rtol_needed"].append(_needed_rtol(arrays["outputs"][name], arrays["golden"][name], m["atol_eff"]))
            s["rtol_declared"].append(o["limits"]["rtol"])

    runner.run(cases, on_result=collect)
    bar.close()
    print(f"calibrate {spec.name}: {len(cases)} runs ({len(base)} cases x {args.seeds} seeds)")
    print(f"{'backend':<10} {'output':<6} {'dtype':<5} {'runs':>5} {'max_ulp p50/p99/max':>22} "
          f"{'cos_diff max':>13} {'nmse max':>10} {'noise max':>10} {'rtol need':>10} {'declared':>9} {'suggest':>9}")
    for key in sorted(stats):
        s = stats[key]
        ulp = np.asarray(s["max_ulp"])
        q = lambda v, p: float(np.percentile(v, p)) if len(v) else float("nan")  # noqa: E731
        need = max(s["rtol_needed"], default=0.0)
        noise = max(s["noise_ratio"], default=float("nan"))
        print(f"{key[0]:<10} {key[1]:<6} {key[2]:<5} {len(ulp):>5} "
              f"{q(ulp, 50):>6.0f}/{q(ulp, 99):>6.0f}/{ulp.max():>7.0f} "
              f"{max(s['cos_diff']):>13.3g} {max(s['nmse']):>10.3g} {noise:>10.3g} {need:>10.3g} "
              f"{min(s['rtol_declared']):>9.3g} {2 * need:>9.3g}   verdicts {dict(verdicts[key])}")
    return EXIT_OK
