"""The one result type: `CaseResult` (one per case) and `OutputResult` (one per output tensor),
and the verdict vocabulary every other module imports.

The runner, the judge and the worker pool build and pass CaseResults; a results file holds their
JSON form (`to_json`), one line each, and reading one back (`from_json`) validates every key, so a
file of the right schema string but the wrong shape is a one-line `ResultsError`, never a green page.
The schema is versioned: `SCHEMA` names it in every results file's header line.

Verdicts: pass, fail (kind: structural | exact | numeric | noise | determinism: a backend that claims
run-to-run determinism gave other bits on the same inputs), error (the kernel or a plugin
hook raised), crash, timeout, skip (with its reason), vacuous (a zero output would pass), flaky (a
borderline case whose fresh seeds disagree), xfail / xpass (a listed known failure that fails /
passes). FAILING verdicts fail the gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SCHEMA = "kernel-parity/results/2"
VERDICTS = ("fail", "error", "crash", "timeout", "flaky", "xpass", "xfail", "vacuous", "skip", "pass")  # worst first
FAILING = frozenset({"fail", "error", "crash", "timeout", "flaky", "xpass"})
KINDS = ("structural", "exact", "numeric", "noise", "determinism")
TIERS = ("production", "baseline")
LAYERS = ("structure", "exact", "numeric", "noise", "trust")


class ResultsError(ValueError):
    """A result record of the wrong shape (names where, the key, and what was expected)."""


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "a list",
               type(None): "null", bool: "a boolean"}


def _is(x: Any, types: tuple[type, ...]) -> bool:
    return isinstance(x, types) and not (isinstance(x, bool) and bool not in types)


def _expect(types: tuple[type, ...]) -> str:
    names = []
    for t in types:
        n = _TYPE_NAMES.get(t, t.__name__)
        if n not in names and not (t is int and float in types):
            names.append(n)
    return " or ".join(names)


def _want(d: dict, key: str, types: tuple[type, ...], where: str, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise ResultsError(f"{where}: lacks {key!r}")
        return default
    v = d[key]
    if not _is(v, types):
        raise ResultsError(f"{where}: {key!r} must be {_expect(types)}, got {v!r:.60}")
    return v


_NUM = (int, float)
_OPT_NUM = (int, float, type(None))


def _numbers(d: Any, key: str, where: str) -> dict | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ResultsError(f"{where}: {key!r} must be an object or null")
    for k, v in d.items():
        if not _is(v, _OPT_NUM):
            raise ResultsError(f"{where}: {key}.{k} must be a number, got {v!r:.40}")
    return dict(d)


@dataclass
class OutputResult:
    """What one output tensor of a case measured and how each tolerance layer judged it."""

    dtype: str
    shape: list[int]
    exact: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    limits: dict[str, float | None] | None = None
    layers: dict[str, dict] = field(default_factory=dict)  # layer -> {"ok": bool | None, "detail": str}
    worst: list[dict] = field(default_factory=list)  # at most 5: index, got, expected, abs, rel, out
    noise: dict[str, float] | None = None
    not_provided: str | None = None  # the backend does not compute this output (why)
    outside_contract: dict | None = None  # {"elements", "reason"}: elements the backend does not promise
    reference: str | None = None  # the reference that judged it (ops with several)
    references: dict[str, dict] | None = None  # every reference's metrics: name -> metrics
    stage: int | None = None  # position in the op's ordered intermediates, if it is one

    def to_json(self) -> dict:
        # field by field, not dataclasses.asdict: its deep copy of every metrics dict and worst
        # element was 80% of the time `parity report` took to read a 20,000-case file; a shallow copy
        # of each dict and list (their values are scalars, or the worst elements' small dicts, copied
        # too) keeps an edit of the JSON from reaching the record
        return {k: _copy(v) for k in _OUTPUT_FIELDS if (v := getattr(self, k)) is not None}

    @staticmethod
    def from_json(d: Any, where: str) -> "OutputResult":
        if not isinstance(d, dict):
            raise ResultsError(f"{where} must be an object")
        unknown = d.keys() - _OUTPUT_FIELDS
        if unknown:
            raise ResultsError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        shape = _want(d, "shape", (list,), where, [])
        if not all(_is(s, (int,)) for s in shape):
            raise ResultsError(f"{where}: 'shape' must be a list of integers")
        layers = _want(d, "layers", (dict,), where, {})
        if not all(isinstance(v, dict) for v in layers.values()):
            raise ResultsError(f"{where}: 'layers' must map layer names to objects")
        worst = _want(d, "worst", (list,), where, [])
        if not all(isinstance(w, dict) for w in worst):
            raise ResultsError(f"{where}: 'worst' must be a list of objects")
        refs = _want(d, "references", (dict, type(None)), where, None)
        return OutputResult(
            dtype=_want(d, "dtype", (str,), where, "?"), shape=list(shape),
            exact=_want(d, "exact", (bool,), where, False),
            metrics=_numbers(d.get("metrics", {}), "metrics", where) or {},
            limits=_numbers(d.get("limits"), "limits", where), layers=dict(layers), worst=list(worst),
            noise=_numbers(d.get("noise"), "noise", where),
            not_provided=_want(d, "not_provided", (str, type(None)), where, None),
            outside_contract=_want(d, "outside_contract", (dict, type(None)), where, None),
            reference=_want(d, "reference", (str, type(None)), where, None),
            references={k: _numbers(v, f"references.{k}", where) or {} for k, v in refs.items()} if refs else None,
            stage=_want(d, "stage", (int, type(None)), where, None),
        )


_OUTPUT_FIELDS = tuple(f.name for f in fields(OutputResult))  # fields() is slow: read once


def _copy(v: Any) -> Any:
    if type(v) is dict:
        return {k: dict(x) if type(x) is dict else x for k, x in v.items()}
    if type(v) is list:
        return [dict(x) if type(x) is dict else x for x in v]
    return v


@dataclass
class CaseResult:
    """One case's record: identity, verdict, per-output measurements, timing."""

    id: str
    op: str
    backend: str
    dtype: str
    params: dict[str, Any]
    dist: str
    seed: int
    verdict: str
    kind: str | None = None  # for fail: structural | exact | numeric | noise | determinism
    tier: str | None = None  # the limits that judged it: production | baseline
    reason: str | None = None  # one line
    message: str | None = None  # first line what, then where (worst elements), then the repro line
    repro: str = ""
    norm_err: float | None = None  # worst error / its limit over every output and layer (<= 1 passes)
    outputs: dict[str, OutputResult] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)  # layer -> pass | fail | n/a (worst over outputs)
    # {"seeds": [...], "verdicts": [...]} for a borderline case; "same_inputs": "bit-identical" or which outputs
    # differed between two more calls on the case's own inputs (borderline cases, and every case with --determinism)
    recheck: dict | None = None
    timing: dict[str, float] = field(default_factory=dict)
    diagnosis: list[str] | None = None  # the alternative semantics the kernel matches
    diagnosis_skipped: str | None = None
    first_divergence: str | None = None  # the first intermediate stage that fails (fused ops)
    known: dict | None = None  # the known-failures entry that matched: reason, seen, verdict
    shrunk: dict | None = None  # `parity shrink`: the smallest case failing the same way (id, verdict, kind, ...)
    perf: dict | None = None  # `parity bench`: time, throughput, ceilings and ratios measured in the run
    sample: dict | None = None  # judged on a sample of rows: {"param", "rows", "of"} (conformance/sampling.py)

    @property
    def failing(self) -> bool:
        return self.verdict in FAILING

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in _CASE_FIELDS}
        d["outputs"] = {k: o.to_json() for k, o in self.outputs.items()}
        for k in ("diagnosis", "diagnosis_skipped", "first_divergence", "known", "shrunk", "perf", "sample"):
            if d[k] is None:
                del d[k]
        return d

    @staticmethod
    def from_json(d: Any, where: str = "record") -> "CaseResult":
        """Validate and build; ResultsError naming `where` and the key otherwise. Every field is
        required but tier (absent from schema-1 files) and those written only when set
        (diagnosis, diagnosis_skipped, first_divergence, known, shrunk, perf)."""
        if not isinstance(d, dict):
            raise ResultsError(f"{where}: a record must be a JSON object, got {_TYPE_NAMES.get(type(d), type(d).__name__)}")
        unknown = d.keys() - _CASE_FIELDS
        if unknown:
            raise ResultsError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        rid = _want(d, "id", (str,), where)
        if not rid:
            raise ResultsError(f"{where}: 'id' is empty")
        verdict = _want(d, "verdict", (str,), where)
        if verdict not in VERDICTS:
            raise ResultsError(f"{where}: 'verdict' {verdict!r} is not one of {', '.join(VERDICTS)}")
        kind = _want(d, "kind", (str, type(None)), where)
        if kind is not None and kind not in KINDS:
            raise ResultsError(f"{where}: 'kind' {kind!r} is not one of {', '.join(KINDS)} or null")
        tier = _want(d, "tier", (str, type(None)), where, None)
        if tier is not None and tier not in TIERS:
            raise ResultsError(f"{where}: 'tier' {tier!r} is not one of {', '.join(TIERS)} or null")
        seed = _want(d, "seed", (int,), where)
        if seed < 0:
            raise ResultsError(f"{where}: 'seed' must be >= 0, got {seed}")
        outputs = _want(d, "outputs", (dict,), where)
        diagnosis = _want(d, "diagnosis", (list, type(None)), where, None)
        if diagnosis is not None and not all(isinstance(x, str) for x in diagnosis):
            raise ResultsError(f"{where}: 'diagnosis' must be a list of strings")
        return CaseResult(
            id=rid, op=_want(d, "op", (str,), where), backend=_want(d, "backend", (str,), where),
            dtype=_want(d, "dtype", (str,), where), params=dict(_want(d, "params", (dict,), where)),
            dist=_want(d, "dist", (str,), where), seed=seed, verdict=verdict, kind=kind, tier=tier,
            reason=_want(d, "reason", (str, type(None)), where),
            message=_want(d, "message", (str, type(None)), where),
            repro=_want(d, "repro", (str,), where),
            norm_err=_want(d, "norm_err", _OPT_NUM, where),
            outputs={k: OutputResult.from_json(v, f"{where} output {k!r}") for k, v in outputs.items()},
            layers=dict(_want(d, "layers", (dict,), where)),
            recheck=_want(d, "recheck", (dict, type(None)), where),
            timing=_numbers(_want(d, "timing", (dict,), where), "timing", where) or {},
            diagnosis=list(diagnosis) if diagnosis is not None else None,
            diagnosis_skipped=_want(d, "diagnosis_skipped", (str, type(None)), where, None),
            first_divergence=_want(d, "first_divergence", (str, type(None)), where, None),
            known=_want(d, "known", (dict, type(None)), where, None),
            shrunk=_want(d, "shrunk", (dict, type(None)), where, None),
            perf=_want(d, "perf", (dict, type(None)), where, None),
            sample=_want(d, "sample", (dict, type(None)), where, None),
        )


_CASE_FIELDS = tuple(f.name for f in fields(CaseResult))


def counts(results: list[CaseResult] | list[dict]) -> dict[str, int]:
    """verdict -> count, every verdict present (zeros included), in VERDICTS order."""
    out = {v: 0 for v in VERDICTS}
    for r in results:
        v = r.verdict if isinstance(r, CaseResult) else r["verdict"]
        out[v] = out.get(v, 0) + 1
    return out


def finite_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None
