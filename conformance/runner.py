"""Run cases: inputs -> golden -> backend -> metrics -> layered verdict -> result record.

Cases that share inputs (same op, dtype, params, dist, seed; different backends) are
evaluated as a group: inputs, golden and the same-precision baseline run once per group.
A case that raises is recorded as `error` and the run goes on; crashes and timeouts are
isolated by conformance.parallel when asked for.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Iterable

import numpy as np

from conformance import ops
from conformance.backends import NotProvided, Registry
from conformance.case import Case
from conformance.errors import SpecError
from conformance.inputs import clone, same_bits
from conformance.judge import diagnose, judge_case
from conformance.poison import OutputRequest, tensor_to_numpy
from conformance.spec import OpSpec, float64_view

RECHECK_SEEDS = 3
RECHECK_STRIDE = 1_000_003  # fresh seed k of a case with seed s is s + k * RECHECK_STRIDE


def repro_command(case: Case, origin: str | None = None) -> str:
    cmd = f"parity repro {case.id}"
    return f"{cmd} --backend {origin}" if origin else cmd


class Prepared:
    """Inputs and golden of one input group (computed once, shared by every backend)."""

    def __init__(self, spec: OpSpec, case: Case) -> None:
        self.spec = spec
        p = case.p
        t0 = time.perf_counter()
        rng = np.random.Generator(np.random.PCG64(case.seed))
        self.inputs = spec.make_inputs(p, case.dtype, case.dist, rng)
        t1 = time.perf_counter()
        self.golden = spec.reference(float64_view(self.inputs), p)
        t2 = time.perf_counter()
        self.inputs_s, self.golden_s = t1 - t0, t2 - t1
        self.shapes = {k: tuple(v) for k, v in spec.output_shapes(p).items()}
        self.out_dtypes = {k: o.resolve(case.dtype) for k, o in spec.outputs.items()}
        self.pads = spec.output_pads(p) if spec.output_pads else {}
        for name, shape in self.shapes.items():
            g = self.golden.get(name)
            if g is None or tuple(np.shape(g)) != shape:
                raise SpecError(f"{spec.name}: golden output {name!r} has shape "
                                f"{None if g is None else np.shape(g)}, spec says {shape}")
        self.baseline_err: dict[str, float] | None = None


class Runner:
    def __init__(self, registry: Registry | None = None, *, recheck: bool = True, noise: bool = True) -> None:
        self.registry = registry or Registry()
        self.recheck = recheck
        self.noise = noise
        self.capture: dict[str, dict] | None = None  # case id -> arrays, for `parity repro --export`

    # -- public -------------------------------------------------------------------------
    def run(self, cases: Iterable[Case], on_result: Callable[[dict], None] | None = None) -> list[dict]:
        results = []
        for group in group_cases(cases):
            for rec in self.evaluate_group(group):
                results.append(rec)
                if on_result:
                    on_result(rec)
        return results

    def evaluate(self, case: Case) -> dict:
        return self.evaluate_group([case])[0]

    def evaluate_group(self, cases: list[Case], on_start: Callable[[Case], None] | None = None) -> list[dict]:
        spec = ops.get(cases[0].op)
        try:
            prep = Prepared(spec, cases[0])
        except SpecError:
            raise
        except Exception as e:  # the input builder or golden raised: every case of the group errors
            msg = f"building inputs/golden raised {type(e).__name__}: {e}"
            return [self._error(c, msg, traceback.format_exc(), {}) for c in cases]
        ordered = sorted(cases, key=lambda c: c.backend != spec.baseline)  # baseline first
        out = {}
        for case in ordered:
            if on_start:
                on_start(case)
            rec = self._one(case, spec, prep)
            if self.recheck:
                rec = self._recheck(case, rec)
            out[case] = rec
        return [out[c] for c in cases]

    # -- one case -----------------------------------------------------------------------
    def _one(self, case: Case, spec: OpSpec, prep: Prepared) -> dict:
        t_start = time.perf_counter()
        backend = self.registry.get(case.backend)
        origin = getattr(backend, "origin", None)
        timing = {"inputs_s": prep.inputs_s, "golden_s": prep.golden_s, "kernel_s": 0.0}
        why = backend.available() or backend.supports(case)
        if why:
            return _record(case, "skip", None, why, None, origin, timing=timing)
        noise_base = self._baseline_errors(case, spec, prep) if self.noise else None
        inputs = {k: clone(v) for k, v in prep.inputs.items()}
        req = OutputRequest(prep.shapes, prep.out_dtypes, dict(prep.pads))
        try:
            t0 = time.perf_counter()
            raw = backend.run(case, inputs, req)
            outputs = {k: to_numpy(v) for k, v in (raw or {}).items()}
            timing["kernel_s"] = time.perf_counter() - t0
        except Exception as e:
            return self._error(case, f"{type(e).__name__}: {_first_line(e)}", traceback.format_exc(), timing, origin)
        if self.capture is not None:
            self.capture[case.id] = {"inputs": prep.inputs, "golden": prep.golden, "outputs": outputs}
        damage = req.damage()
        touched = [k for k in inputs if not same_bits(inputs[k], prep.inputs[k])]
        rec = judge_case(case, spec, prep, outputs, damage, touched, noise_base, repro_command(case, origin))
        if rec["verdict"] == "fail" and rec["kind"] in ("structural", "numeric") and spec.diagnoses:
            found = diagnose(case, spec, float64_view(prep.inputs), outputs)
            if found:
                rec["diagnosis"] = found
                rec["reason"] = f"{rec['reason']} [{found[0]}]"
                rec["message"] = "\n".join([rec["message"].rsplit("\n", 1)[0]]
                                           + [f"  diagnosis: {f}" for f in found]
                                           + [rec["message"].rsplit("\n", 1)[1]])
        timing["total_s"] = time.perf_counter() - t_start
        rec["timing"] = timing
        if spec.baseline and case.backend == spec.baseline and prep.baseline_err is None:
            prep.baseline_err = _baseline_from(rec)
        return rec

    def _baseline_errors(self, case: Case, spec: OpSpec, prep: Prepared) -> dict[str, float] | None:
        """max_abs of the same-precision baseline per output (None: no noise layer)."""
        if not spec.baseline or spec.tolerance.noise_factor(case.p) is None or case.backend == spec.baseline:
            return None
        if prep.baseline_err is None:
            base_case = case.with_backend(spec.baseline)
            try:
                base = self.registry.get(spec.baseline)
            except Exception:
                prep.baseline_err = {}
                return None
            if base.available() or base.supports(base_case):
                prep.baseline_err = {}
            else:
                prep.baseline_err = _baseline_from(self._one(base_case, spec, prep))
        return prep.baseline_err or None

    def _recheck(self, case: Case, rec: dict) -> dict:
        """Re-run a case within `borderline` of a limit on fresh seeds; `flaky` if they disagree."""
        spec = ops.get(case.op)
        band = spec.tolerance.borderline
        ne = rec.get("norm_err")
        numeric = rec["verdict"] == "pass" or (rec["verdict"] == "fail" and rec.get("kind") in ("numeric", "noise"))
        if not numeric or ne is None or not (1.0 - band <= ne <= 1.0 + band):
            return rec
        seeds = [case.seed + k * RECHECK_STRIDE for k in range(1, RECHECK_SEEDS + 1)]
        inner = Runner(self.registry, recheck=False, noise=self.noise)
        verdicts = [inner.evaluate(case.with_seed(s))["verdict"] for s in seeds]
        rec["recheck"] = {"seeds": seeds, "verdicts": verdicts}
        if any(v != rec["verdict"] for v in verdicts):
            rec["reason"] = (f"borderline (norm_err={ne:.3f}) and fresh seeds disagree: "
                             f"{rec['verdict']} here, {', '.join(verdicts)} on seeds {', '.join(map(str, seeds))}")
            rec["verdict"] = "flaky"
        return rec

    def _error(self, case: Case, reason: str, tb: str, timing: dict, origin: str | None = None) -> dict:
        repro = repro_command(case, origin)
        tail = "\n".join(tb.strip().splitlines()[-12:])
        message = f"{case.op}[{case.backend}] raised {reason}\n{tail}\n  repro: {repro}"
        return _record(case, "error", None, reason, message, origin, timing=timing)


def _baseline_from(rec: dict) -> dict[str, float]:
    if rec["verdict"] not in ("pass", "vacuous", "fail") or rec["layers"].get("structure") == "fail":
        return {}
    return {k: o["metrics"]["max_abs"] for k, o in rec["outputs"].items() if "metrics" in o and not o.get("exact")}


def to_numpy(v: Any) -> Any:
    if isinstance(v, (np.ndarray, NotProvided)):
        return v
    if hasattr(v, "detach") and hasattr(v, "dtype"):
        return tensor_to_numpy(v)
    return np.asarray(v)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else ""


def _record(case: Case, verdict: str, kind: str | None, reason: str | None, message: str | None,
            origin: str | None, **extra: Any) -> dict:
    rec = {
        "id": case.id, "op": case.op, "backend": case.backend, "dtype": case.dtype,
        "params": case.p, "dist": case.dist, "seed": case.seed,
        "verdict": verdict, "kind": kind, "reason": reason, "message": message,
        "repro": repro_command(case, origin), "norm_err": None, "outputs": {}, "layers": {},
        "recheck": None, "timing": {},
    }
    rec.update(extra)
    return rec


def group_cases(cases: Iterable[Case]) -> list[list[Case]]:
    """Cases grouped by input key, in first-seen order."""
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.input_key, []).append(c)
    return list(groups.values())

