"""Run cases: inputs -> references -> backend -> layered verdict -> CaseResult.

Cases that share inputs (same op, dtype, params, dist, seed; different backends) are
evaluated as a group: inputs, references and the same-precision baseline run once per group,
and only when some backend of the group supports the case (`supports()` is asked first, so an
unsupported case costs no golden). A case that raises is recorded as `error` and the run goes
on, whether the kernel, the plugin's `supports()`/`available()`/`precondition()` or the input
builder raised; crashes, exits and hangs are isolated by conformance.parallel.

Around the kernel call the runner gathers the evidence the judge needs: canaries and padding
(`damage`), elements never written (for 8-bit and smaller types, whose every pattern is a value,
a second run under another poison tells them apart), inputs written that must stay untouched (an
op's declared in-place outputs excepted), elements the backend declares outside its contract, and
the baseline's error per output. Ops with a VJP golden get their gradients the same way: the
cotangents are drawn from the case seed and the backend's backward adapter fills gradient outputs.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from typing import Any, Callable, Iterable

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import golden_cache, ops, sampling
from kernel_parity.conformance.backends import NotProvided, Registry, claimed_reference
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import SpecError
from kernel_parity.conformance.inputs import clone, same_bits
from kernel_parity.conformance.judge import Evidence, diagnose, judge_case
from kernel_parity.conformance.poison import OutputRequest, is_poison, tensor_to_numpy
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.spec import OpSpec, float64_view

RECHECK_SEEDS = 3
DETERMINISM_ENV = "KERNEL_PARITY_DETERMINISM"  # "1": `--determinism` (Runner._determinism)
RECHECK_STRIDE = 1_000_003  # fresh seed k of a case with seed s is s + k * RECHECK_STRIDE
COTANGENT_STREAM = 0x636F74  # the cotangents of a case come from PCG64([seed, COTANGENT_STREAM])


def repro_command(case: Case, origin: str | None = None) -> str:
    cmd = f"parity repro {case.id}"
    return f"{cmd} --backend {origin}" if origin else cmd


def tier_of(spec: OpSpec, backend: str) -> str:
    """The tolerance tier a backend is judged by: only the op's own eager baseline is "baseline"."""
    return "baseline" if spec.baseline is not None and backend == spec.baseline else "production"


class Prepared:
    """Inputs, references and (for ops with a VJP) cotangents of one input group, computed once.

    At model sizes an op with row-independent outputs (`OpSpec.rows`) gets its references on a
    seeded sample of the rows (`sample`; conformance/sampling.py): `params` and `inputs64` are then
    those rows' alone, and the references' row axes are the sample's."""

    def __init__(self, spec: OpSpec, case: Case, inputs: dict[str, np.ndarray] | None = None) -> None:
        """`inputs`: the case's inputs as given (an exported repro's), instead of drawn from its seed."""
        self.spec = spec
        self.case = case
        p = case.p
        t0 = time.perf_counter()
        drawn = inputs is None  # not an exported repro's inputs: the group may come from / go to the cache
        variant = sampling.cache_variant(spec)
        cached = golden_cache.read(spec, case, variant) if drawn else None  # KERNEL_PARITY_GOLDEN_CACHE
        self.cache_read_s: float | None = None
        if cached is not None:
            inputs = cached["inputs"]
        elif inputs is None:
            rng = np.random.Generator(np.random.PCG64(case.seed))
            inputs = spec.make_inputs(p, case.dtype, case.dist, rng)
        self.inputs = inputs
        t1 = time.perf_counter()
        self.sample = sampling.choose(spec, case, self.inputs)
        if cached is not None and not sampling.same(self.sample, cached.get("sample")):
            cached = None  # written under another sample: recompute the references
        self.shapes = {k: tuple(v) for k, v in spec.output_shapes(p).items()}
        if cached is not None:
            self._sub_inputs()
            self.references, self.cotangents = cached["references"], cached["cotangents"]
            self._compute_magnitudes()  # not cached: recomputed from the inputs
            self.cache_read_s = t1 - t0
        else:
            self._compute_references()
            self.cotangents: dict[str, np.ndarray] = {}
        self.golden = self.references[spec.reference_name]
        if spec.vjp is not None:
            if cached is None:
                crng = np.random.Generator(np.random.PCG64([case.seed, COTANGENT_STREAM]))
                for name in spec.cotangent_of:
                    draw = crng.standard_normal(self.shapes[name])
                    self.cotangents[name] = dt.round_to(draw, spec.out_dtype(name, case.dtype))
                self.golden.update(spec.vjp(self.inputs64, p, float64_view(self.cotangents)))
            self.shapes.update({k: tuple(v) for k, v in (spec.gradient_shapes or (lambda _: {}))(p).items()})
        t2 = time.perf_counter()
        self.inputs_s, self.golden_s = t1 - t0, (0.0 if cached is not None else t2 - t1)
        if drawn and cached is None and golden_cache.directory() is not None:
            golden_cache.write(spec, case, self.inputs, self.references, self.cotangents, variant,
                               None if self.sample is None else self.sample.idx)
        self.out_dtypes = {k: spec.out_dtype(k, case.dtype) for k in self.shapes}
        self.pads = spec.output_pads(p) if spec.output_pads else {}
        self.inplace = {n: src for n, o in spec.outputs.items() if (src := o.inplace_of(p))}
        self._check_golden_shapes()
        self.baseline_err: dict[str, float] | None = None

    def _sub_inputs(self) -> None:
        """`params` and `inputs64`: the whole group's, or the sampled rows' alone."""
        spec, p = self.spec, self.case.p
        if self.sample is None:
            self.params, self.inputs64 = p, float64_view(self.inputs, spec.storage_inputs)
        else:
            self.params, sub = sampling.sub_inputs(spec, p, self.inputs, self.sample.idx)
            self.inputs64 = float64_view(sub, spec.storage_inputs)

    def _compute_references(self) -> None:
        self._sub_inputs()
        self.references = {name: dict(fn(self.inputs64, self.params))
                            for name, fn in self.spec.all_references().items()}
        self._compute_magnitudes()

    def _compute_magnitudes(self) -> None:
        """The error model's magnitudes (OpSpec.magnitude), on the same rows as the references."""
        fn = self.spec.magnitude
        self.magnitudes = {} if fn is None else dict(fn(self.inputs64, self.params))

    def golden_shape(self, name: str) -> tuple[int, ...]:
        """The shape of output `name` as the references hold it (the sample's rows when sampled)."""
        axis = self.row_axis(name)
        shape = self.shapes[name]
        return shape if axis is None else sampling.sub_shape(shape, axis, int(self.sample.idx.size))

    def row_axis(self, name: str) -> int | None:
        """The row axis of a sampled output (None: the output is judged whole)."""
        if self.sample is None:
            return None
        return self.spec.rows.outputs.get(name)

    def widen(self, outputs: dict[str, Any]) -> bool:
        """Add to the sample every row where a kernel output holds NaN, inf or the poison, and
        recompute the references on the larger sample: a non-finite value anywhere is judged as in
        a full run. True when the sample grew."""
        if self.sample is None:
            return False
        extra = sampling.flagged_rows(self.spec, self.sample, outputs)
        if not extra.size:
            return False
        t0 = time.perf_counter()
        self.sample = sampling.RowSample(self.sample.param, self.sample.n,
                                         np.union1d(self.sample.idx, extra).astype(np.int64))
        self._compute_references()
        self.golden = self.references[self.spec.reference_name]
        self.golden_s += time.perf_counter() - t0
        self._check_golden_shapes()
        self.baseline_err = None  # the baseline's error was measured on the smaller sample
        return True

    def _check_golden_shapes(self) -> None:
        for name in self.shapes:
            g = self.golden.get(name)
            want = self.golden_shape(name)
            if g is None or tuple(np.shape(g)) != want:
                raise SpecError(f"{self.spec.name}: golden output {name!r} has shape "
                                f"{None if g is None else np.shape(g)}, spec says {want}")


class _Hook(Exception):
    """A plugin hook (available, supports, precondition, outside_contract) raised."""

    def __init__(self, hook: str, exc: BaseException) -> None:
        super().__init__(f"{hook}() raised {type(exc).__name__}: {_first_line(exc)}")
        self.tb = traceback.format_exc()


def _call_hook(hook: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a plugin's bug is that case's error, never the run's end
        raise _Hook(hook, e) from None


class Runner:
    def __init__(self, registry: Registry | None = None, *, recheck: bool = True, noise: bool = True,
                 diagnose: bool = True, overrides: dict[str, tuple] | None = None, bench: bool = False) -> None:
        self.registry = registry or Registry()
        self.recheck = recheck
        self.bench = bench  # also time each judged case's kernel (rec.perf; conformance/bench.py)
        self.noise = noise
        self.diagnose = diagnose
        self.overrides = dict(overrides or {})  # op -> a repo's tolerance overrides ([tool.kernel-parity])
        self.capture: dict[str, dict] | None = None  # case id -> arrays, for `parity repro --export`
        # --determinism: every case's kernel also runs twice more on its own inputs (`_determinism`)
        self.determinism = os.environ.get(DETERMINISM_ENV) == "1"
        self._specs: dict[str, OpSpec] = {}

    def spec(self, op: str) -> OpSpec:
        """The op's spec with the repository's tolerance overrides on top of its own limits."""
        if op not in self._specs:
            spec = ops.get(op)
            extra = self.overrides.get(op)
            if extra:
                tol = dataclasses.replace(spec.tolerance, overrides=spec.tolerance.overrides + tuple(extra))
                spec = dataclasses.replace(spec, tolerance=tol)
            self._specs[op] = spec
        return self._specs[op]

    # -- public -------------------------------------------------------------------------
    def run(self, cases: Iterable[Case], on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
        results = []

        def keep(rec: CaseResult) -> None:
            results.append(rec)
            if on_result:
                on_result(rec)

        for group in group_cases(cases):
            self.evaluate_group(group, on_result=keep)
        return results

    def evaluate(self, case: Case, inputs: dict[str, np.ndarray] | None = None) -> CaseResult:
        """One case; `inputs` replaces the inputs drawn from its seed (a replayed export)."""
        return self.evaluate_group([case], inputs=inputs)[0]

    def evaluate_group(self, cases: list[Case], on_start: Callable[[Case], None] | None = None,
                       on_result: Callable[[CaseResult], None] | None = None,
                       inputs: dict[str, np.ndarray] | None = None) -> list[CaseResult]:
        """Evaluate cases sharing one input key; each record is handed to `on_result` when done."""
        spec = self.spec(cases[0].op)
        out: dict[Case, CaseResult] = {}
        prep: Prepared | None = None
        prep_error: tuple[str, str] | None = None
        ordered = sorted(cases, key=lambda c: c.backend != spec.baseline)  # baseline first
        for case in ordered:
            if on_start:
                on_start(case)
            rec = self._unsupported(case)
            if rec is None:
                if prep is None and prep_error is None:
                    try:
                        prep = Prepared(spec, case, inputs)
                    except SpecError:
                        raise
                    except Exception as e:  # the input builder or golden raised: the group errors
                        prep_error = (f"building inputs/golden raised {type(e).__name__}: {_first_line(e)}",
                                      traceback.format_exc())
                if prep_error is not None:
                    rec = self._error(case, prep_error[0], prep_error[1], {})
                else:
                    rec = self._one(case, spec, prep)
                    if self.recheck:
                        rec = self._recheck(case, rec, prep)
                    if self.determinism:
                        rec = self._determinism(case, rec, prep)
            out[case] = rec
            if on_result:
                on_result(rec)
        return [out[c] for c in cases]

    # -- one case -----------------------------------------------------------------------
    def _unsupported(self, case: Case) -> CaseResult | None:
        """A skip (or error, if a hook raised) record when the backend cannot run the case."""
        backend = self.registry.get(case.backend)
        origin = getattr(backend, "origin", None)
        try:
            why = _call_hook("available", backend.available) or _call_hook("supports", backend.supports, case)
        except _Hook as e:
            return self._error(case, f"{case.backend}: {e}", e.tb, {}, origin)
        if why:
            return _record(case, "skip", None, str(why), None, origin)
        return None

    def _call(self, backend: Any, case: Case, prep: Prepared, alt: bool = False):
        """Run the kernel once on fresh input copies: (outputs, request, the inputs it saw, kernel s)."""
        inputs = {k: clone(v) for k, v in prep.inputs.items()}
        req = OutputRequest({k: v for k, v in prep.shapes.items() if k in case_outputs(prep)},
                            prep.out_dtypes, dict(prep.pads), backend=backend,
                            device=getattr(backend, "device", "cpu"), alt=alt)
        t0 = time.perf_counter()
        raw = backend.run(case, inputs, req)
        outputs = {k: to_numpy(v) for k, v in (raw or {}).items()}
        for name, src in prep.inplace.items():  # the mutated input is the output, unless returned
            if name not in outputs:
                outputs[name] = inputs[src]
        return outputs, req, inputs, time.perf_counter() - t0

    def _one(self, case: Case, spec: OpSpec, prep: Prepared) -> CaseResult:
        t_start = time.perf_counter()
        backend = self.registry.get(case.backend)
        origin = getattr(backend, "origin", None)
        timing = {"inputs_s": prep.inputs_s, "golden_s": prep.golden_s, "kernel_s": 0.0}
        if prep.cache_read_s is not None:
            timing["cache_read_s"] = prep.cache_read_s
        try:
            why = _call_hook("precondition", getattr(backend, "precondition", _no_precondition), case, prep.inputs)
            excluded = _call_hook("outside_contract", _exclusions, backend, case, prep)
        except _Hook as e:
            return self._error(case, f"{case.backend}: {e}", e.tb, timing, origin)
        if why:
            return _record(case, "skip", None, f"precondition: {why}", None, origin, timing=timing)
        noise_base = self._baseline_errors(case, spec, prep) if self.noise else None
        try:
            outputs, req, inputs, timing["kernel_s"] = self._call(backend, case, prep)
            if prep.widen(outputs):  # non-finite rows outside the sample: their golden joins it
                noise_base = self._baseline_errors(case, spec, prep) if self.noise else None
            unwritten = self._unwritten(backend, case, prep, outputs)
            if spec.vjp is not None:
                outputs.update(self._gradients(backend, case, spec, prep, inputs))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a kernel that calls exit() is an error, not the run's end
            return self._error(case, f"{type(e).__name__}: {_first_line(e)}", traceback.format_exc(), timing, origin)
        if self.capture is not None:
            self.capture[case.id] = {"inputs": prep.inputs, "golden": prep.golden, "outputs": outputs,
                                     "magnitudes": getattr(prep, "magnitudes", None) or {}}
        touched = [k for k in inputs if k not in prep.inplace.values() and not same_bits(inputs[k], prep.inputs[k])]
        tier = tier_of(spec, case.backend)
        ev = Evidence(damage=req.damage(), unwritten=unwritten, touched=touched, excluded=excluded,
                      noise_base=noise_base, claimed=claimed_reference(backend, case))

        def diagnosis() -> tuple[list[str], str | None]:
            if not spec.diagnoses:
                return [], None
            if not self.diagnose:
                return [], "diagnoses switched off (--no-diagnose)"
            cost = prep.golden_s * len(spec.diagnoses)
            if cost > spec.diagnosis_budget_s:
                return [], (f"{len(spec.diagnoses)} alternative goldens would take ~{cost:.1f} s, "
                            f"over the op's budget of {spec.diagnosis_budget_s:g} s")
            return diagnose(case, spec, prep.inputs64, sampling.judged(prep, outputs), prep.golden, tier,
                            params=prep.params), None

        rec = judge_case(case, spec, prep, outputs, ev, repro_command(case, origin), tier, diagnosis)
        if prep.sample is not None:
            rec.sample = prep.sample.to_json()
        timing["total_s"] = time.perf_counter() - t_start
        rec.timing = timing
        if self.bench:
            try:
                rec.perf = self._time(backend, case, spec, prep)
            except Exception as e:  # a kernel that cannot be timed keeps its verdict; the record says why
                rec.perf = {"error": f"{type(e).__name__}: {_first_line(e)}"}
        if spec.baseline and case.backend == spec.baseline and prep.baseline_err is None:
            prep.baseline_err = _baseline_from(rec)
        return rec

    def _time(self, backend: Any, case: Case, spec: OpSpec, prep: Prepared) -> dict:
        """Median ms of the kernel on this case's inputs, and the bytes and flops of one call."""
        from kernel_parity.conformance import bench
        from kernel_parity.conformance.backends._torch import device_inputs
        from kernel_parity.conformance.poison import BenchRequest

        device = getattr(backend, "device", "cpu")
        inputs = {k: clone(v) for k, v in prep.inputs.items()}
        names = case_outputs(prep)
        req = BenchRequest({k: v for k, v in prep.shapes.items() if k in names}, prep.out_dtypes, dict(prep.pads),
                           backend=backend, device=device)
        split = (getattr(backend, "timed", None) or {}).get(case.op)
        what = None
        with device_inputs():
            if split is not None:  # e.g. an autograd backward: its forward once, untimed, then the backward
                call, what = split(case, inputs, req)
            else:
                call = lambda: backend.run(case, inputs, req)  # noqa: E731
            ms = bench.time_call(call, device)
        read, written, flops = bench.cost(spec, case.p, prep.inputs, {k: prep.shapes[k] for k in names},
                                          prep.out_dtypes)
        perf = {"ms": ms, "bytes_read": read, "bytes_written": written, "flops": flops, "on": str(device)}
        if what:
            perf["timed"] = what
        return perf

    def _unwritten(self, backend: Any, case: Case, prep: Prepared, outputs: dict) -> dict[str, int]:
        """Elements of each output still holding the poison. Where the dtype has no spare NaN
        pattern (8-bit and smaller, integers) a match may be a written value: those outputs are
        checked again in a second run under the alternate poison, and only elements poisoned in
        both runs count."""
        found: dict[str, np.ndarray] = {}
        for name, got in outputs.items():
            d = prep.out_dtypes.get(name)
            if d is None or name in prep.inplace or not isinstance(got, np.ndarray) or got.dtype != d.np:
                continue
            mask = is_poison(got, d)
            if d.poison_is_nan and mask.any():  # a NaN the golden has there too is the kernel's, not the poison
                mask &= ~sampling.golden_nan(prep, name)
            if mask.any():
                found[name] = mask
        ambiguous = [n for n in found if not prep.out_dtypes[n].poison_is_nan]
        if ambiguous:
            again, _, _, _ = self._call(backend, case, prep, alt=True)
            for name in ambiguous:
                got2 = again.get(name)
                if isinstance(got2, np.ndarray) and got2.shape == found[name].shape:
                    found[name] &= is_poison(got2, prep.out_dtypes[name], alt=True)
        return {n: int(m.sum()) for n, m in found.items() if m.any()}

    def _gradients(self, backend: Any, case: Case, spec: OpSpec, prep: Prepared, inputs: dict) -> dict:
        """The backend's gradients for the case's cotangents, or NotProvided without a backward adapter."""
        fn = (getattr(backend, "backward", None) or {}).get(case.op)
        if fn is None:
            why = f"{case.backend} has no backward adapter for {case.op}"
            return {g: NotProvided(why) for g in spec.gradients}
        req = OutputRequest({g: prep.shapes[g] for g in spec.gradients}, prep.out_dtypes, backend=backend,
                            device=getattr(backend, "device", "cpu"))
        cot = {k: clone(v) for k, v in prep.cotangents.items()}
        raw = fn(case, {k: clone(v) for k, v in prep.inputs.items()}, cot, req)
        grads = {k: to_numpy(v) for k, v in (raw or {}).items()}
        return grads

    def _baseline_errors(self, case: Case, spec: OpSpec, prep: Prepared) -> dict[str, float] | None:
        """max_abs of the same-precision baseline per output (None: no noise layer)."""
        if not spec.baseline or spec.tolerance.noise_factor(case.p) is None or case.backend == spec.baseline:
            return None
        if prep.baseline_err is None:
            base_case = case.with_backend(spec.baseline)
            try:
                base = self.registry.get(spec.baseline)
                unusable = base.available() or base.supports(base_case)
            except Exception:
                unusable = "the baseline backend cannot be asked"
            prep.baseline_err = {} if unusable else _baseline_from(self._one(base_case, spec, prep))
        return prep.baseline_err or None

    def _recheck(self, case: Case, rec: CaseResult, prep: Prepared | None = None) -> CaseResult:
        """Re-run a case within `borderline` of a limit on fresh seeds; `flaky` if they disagree.

        First the kernel runs twice more on the case's own inputs: a verdict this close to a limit
        could flip on run-to-run noise alone. Differing bits fail a backend that claims determinism
        (`Backend.deterministic`: kind `determinism`); for any other backend they are recorded
        (`recheck.same_inputs`) and the fresh seeds decide as before."""
        spec = self.spec(case.op)
        band = spec.tolerance.borderline
        ne = rec.norm_err
        numeric = rec.verdict == "pass" or (rec.verdict == "fail" and rec.kind in ("numeric", "noise"))
        if not numeric or ne is None or not (1.0 - band <= ne <= 1.0 + band):
            return rec
        differs = None if prep is None else self._run_to_run(case, prep)
        if differs and getattr(self.registry.get(case.backend), "deterministic", False):
            rec.recheck = {"same_inputs": differs}
            rec.verdict, rec.kind = "fail", "determinism"
            rec.reason = (f"{case.backend} claims run-to-run determinism, but two calls on the same inputs "
                          f"differ: {differs}")
            return rec
        seeds = [case.seed + k * RECHECK_STRIDE for k in range(1, RECHECK_SEEDS + 1)]
        inner = Runner(self.registry, recheck=False, noise=self.noise, diagnose=False, overrides=self.overrides)
        verdicts = [inner.evaluate(case.with_seed(s)).verdict for s in seeds]
        rec.recheck = {"seeds": seeds, "verdicts": verdicts}
        if prep is not None:
            rec.recheck["same_inputs"] = differs or "bit-identical"
        if any(v != rec.verdict for v in verdicts):
            rec.reason = (f"borderline (norm_err={ne:.3f}) and fresh seeds disagree: "
                          f"{rec.verdict} here, {', '.join(verdicts)} on seeds {', '.join(map(str, seeds))}")
            rec.verdict = "flaky"
        return rec

    def _determinism(self, case: Case, rec: CaseResult, prep: Prepared) -> CaseResult:
        """--determinism: the same-inputs check of `_recheck` on every judged case (not yet checked)."""
        if rec.verdict not in ("pass", "fail", "flaky", "xfail", "xpass") or (rec.recheck or {}).get("same_inputs"):
            return rec
        differs = self._run_to_run(case, prep)
        rec.recheck = {**(rec.recheck or {}), "same_inputs": differs or "bit-identical"}
        if differs and getattr(self.registry.get(case.backend), "deterministic", False):
            rec.verdict, rec.kind = "fail", "determinism"
            rec.reason = (f"{case.backend} claims run-to-run determinism, but two calls on the same inputs "
                          f"differ: {differs}")
        return rec

    def _run_to_run(self, case: Case, prep: Prepared) -> str | None:
        """Two more calls of the kernel on the case's inputs: None if every output has the same bits
        both times, else which outputs differ and in how many elements (a call that raises: None,
        the first call's record already says what the kernel does)."""
        backend = self.registry.get(case.backend)
        try:
            a = self._call(backend, case, prep)[0]
            b = self._call(backend, case, prep)[0]
        except Exception:
            return None
        diff = []
        for name in sorted(set(a) & set(b)):
            try:
                x, y = np.asarray(a[name]), np.asarray(b[name])
                if x.shape != y.shape or x.dtype != y.dtype:
                    diff.append(f"{name} (shape/dtype)")
                elif x.dtype == object:  # not an array of numbers (an adapter's extra value): compared as values
                    if not np.array_equal(x, y):
                        diff.append(f"{name} (values)")
                elif not same_bits(x, y):
                    xb, yb = (np.ascontiguousarray(v).view(np.uint8).reshape(v.size, -1) for v in (x, y))
                    diff.append(f"{name} ({int(np.count_nonzero((xb != yb).any(axis=1)))} of {x.size} elements)")
            except Exception:  # a check that cannot compare never decides a verdict
                continue
        return "; ".join(diff) or None

    def _error(self, case: Case, reason: str, tb: str, timing: dict, origin: str | None = None) -> CaseResult:
        repro = repro_command(case, origin)
        tail = "\n".join(tb.strip().splitlines()[-12:])
        message = f"{case.op}[{case.backend}] raised {reason}\n{tail}\n  repro: {repro}"
        return _record(case, "error", None, reason, message, origin, timing=timing)


def case_outputs(prep: Prepared) -> set[str]:
    """The outputs a forward call hands out buffers for (gradients come from the backward call)."""
    return {k for k in prep.shapes if k not in prep.spec.gradients}


def _no_precondition(case: Case, inputs: dict) -> None:
    return None


def _exclusions(backend: Any, case: Case, prep: Prepared) -> dict[str, tuple[np.ndarray, str]]:
    """The backend's `outside_contract(case, inputs)`, checked: output -> (bool mask, reason)."""
    fn = getattr(backend, "outside_contract", None)
    declared = fn(case, prep.inputs) if fn is not None else None
    out = {}
    for name, entry in (declared or {}).items():
        if name not in prep.shapes:
            raise ValueError(f"outside_contract names no output {name!r} (outputs: {', '.join(prep.shapes)})")
        mask, reason = entry
        m = np.asarray(mask, dtype=bool)
        try:
            np.broadcast_to(m, prep.shapes[name])
        except ValueError:
            raise ValueError(f"outside_contract mask for {name!r} has shape {m.shape}, "
                             f"not broadcastable to {prep.shapes[name]}") from None
        out[name] = (m, str(reason))
    return out


def _baseline_from(rec: CaseResult) -> dict[str, float]:
    if rec.verdict not in ("pass", "vacuous", "fail") or rec.layers.get("structure") == "fail":
        return {}
    return {k: o.metrics["max_abs"] for k, o in rec.outputs.items() if "max_abs" in o.metrics and not o.exact}


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
            origin: str | None, timing: dict | None = None) -> CaseResult:
    return CaseResult(id=case.id, op=case.op, backend=case.backend, dtype=case.dtype, params=case.p,
                      dist=case.dist, seed=case.seed, verdict=verdict, kind=kind, reason=reason, message=message,
                      repro=repro_command(case, origin), timing=dict(timing or {}))


def dead_record(case: Case, verdict: str, reason: str, origin: str | None) -> CaseResult:
    """The record of a case whose worker died (crash) or was killed (timeout)."""
    repro = repro_command(case, origin)
    return _record(case, verdict, None, reason, f"{case.op}[{case.backend}] {reason}\n  repro: {repro}", origin)


def group_cases(cases: Iterable[Case]) -> list[list[Case]]:
    """Cases grouped by input key, in first-seen order."""
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.input_key, []).append(c)
    return list(groups.values())


def _work(case: Case) -> int:
    """A rough size of a case: the product of its positive integer parameters (batch, lengths,
    heads, dims, ...). Only used to order groups, never to judge."""
    n = 1
    for _, v in case.params:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            n *= v
    return n


SCHEDULE_ENV = "KERNEL_PARITY_SCHEDULE"  # a results file whose records' timings order the groups


def _group_key(op: str, dtype: str, params_text: str, dist: str, seed: int) -> tuple:
    return (op, dtype, params_text, dist, int(seed))


def measured_seconds(path: str) -> dict[tuple, float]:
    """Seconds each input group took in an earlier run (its inputs and goldens once, then every
    record's own time), keyed like `_group_key`. Timings of the same selection on another machine
    still order groups well: what matters is which groups are the long ones."""
    from kernel_parity.reports import records

    doc = records.load(path)
    out: dict[tuple, float] = {}
    for r in doc["results"]:
        op, _, dtype, params, dist, seed = r["id"].split("/")
        key = _group_key(op, dtype, params, dist, int(seed.split("=", 1)[1]))
        t = r.get("timing") or {}
        first = key not in out
        out[key] = out.get(key, 0.0) + float(t.get("total_s", 0.0)) + (
            float(t.get("inputs_s", 0.0)) + float(t.get("golden_s", 0.0)) if first else 0.0)
    return out


def largest_first(groups: list[list[Case]], seconds: dict[tuple, float] | None = None) -> list[list[Case]]:
    """Groups ordered by their largest case, biggest first (ties keep their order): workers that
    pull from one queue then finish together instead of waiting on one big group started last.
    `seconds` (default: the results file named by KERNEL_PARITY_SCHEDULE, `--schedule`): groups an
    earlier run timed go first, longest first, then the others by size."""
    if seconds is None:
        path = os.environ.get(SCHEDULE_ENV)
        seconds = measured_seconds(path) if path else {}

    def key(g: list[Case]) -> tuple:
        c = g[0]
        t = seconds.get(_group_key(c.op, c.dtype, c.params_text, c.dist, c.seed))
        return (0, -t, 0) if t is not None else (1, 0.0, -max(_work(x) for x in g))

    return sorted(groups, key=key)
