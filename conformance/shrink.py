"""`parity shrink ID`: the smallest shape of a failing case that fails the same way.

    parity shrink 'softmax.softmax/mine/fp16/rows=64,n=4099,pad=0/large/seed=3' --backend mod:obj
    parity shrink --results run.jsonl --json shrunk.jsonl     # every failure of a results file

The case keeps its op, backend, dtype, distribution and seed; every integer parameter may shrink
toward its lower bound (never above the original value), the others stay. Hypothesis draws shapes
and shrinks (its shrinker, not ours) to a minimal one whose record fails *the same way*: the same
verdict, the same failing layers (structure / exact / numeric / noise), the same diagnosis and the
same first diverging stage; a draw the op's constraints reject, or that the backend does not
support, is rejected, never counted. The smallest is printed as a case id with its repro line;
with --json the original record carries `shrunk` (id, verdict, kind, norm_err, reason) and the
shrunk record follows it, so the HTML report shows the smallest case beside the original.
"""

from __future__ import annotations

import sys
from typing import Any

from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import EXIT_FAIL, UsageError
from kernel_parity.conformance.params import Int
from kernel_parity.conformance.results import FAILING, CaseResult
from kernel_parity.conformance.session import open_session


def signature(rec: CaseResult) -> tuple:
    """How a case fails: verdict, failing layers, diagnosis, first diverging stage (an error's
    exception type stands in for the layers)."""
    failed = tuple(sorted(k for k, v in rec.layers.items() if v == "fail"))
    if rec.verdict in ("error", "crash", "timeout"):
        failed = ((rec.reason or "").split(":", 1)[0],)
    return (rec.verdict, rec.kind, failed, tuple(rec.diagnosis or ()), rec.first_divergence)


def shrink_case(case: Case, runner: Any, max_examples: int = 100) -> tuple[CaseResult, CaseResult | None]:
    """(the original record, the smallest record failing the same way, or None when no smaller one
    was found). UsageError when the case does not fail."""
    from hypothesis import Phase, assume, find, settings
    from hypothesis import strategies as st
    from hypothesis.errors import NoSuchExample

    spec = ops.get(case.op)
    original = runner.evaluate(case)
    if original.verdict not in FAILING:
        raise UsageError(f"case {case.id!r} does not fail ({original.verdict}): nothing to shrink")
    want = signature(original)
    p0 = case.p
    draws = {k: (st.integers(min_value=param.lo, max_value=p0[k]) if isinstance(param, Int) else st.just(p0[k]))
             for k, param in spec.params.params.items() if k in p0}
    seen: dict[Case, CaseResult] = {case: original}

    def fails_the_same_way(p: dict) -> bool:
        try:
            candidate = ops.make_case(case.op, case.backend, case.dtype, {**p0, **p}, case.dist, case.seed)
        except UsageError:
            assume(False)  # the op's constraints reject this shape
        if candidate not in seen:
            seen[candidate] = runner.evaluate(candidate)
        rec = seen[candidate]
        assume(rec.verdict != "skip")
        return signature(rec) == want

    config = settings(max_examples=max_examples, database=None, deadline=None, derandomize=True,
                      phases=[Phase.generate, Phase.shrink], suppress_health_check=list(_health_checks()))
    try:
        smallest = find(st.fixed_dictionaries(draws), fails_the_same_way, settings=config)
    except NoSuchExample:
        return original, None
    best = ops.make_case(case.op, case.backend, case.dtype, {**p0, **smallest}, case.dist, case.seed)
    if best == case or _size(best) >= _size(case):
        return original, None
    return original, seen[best]


def _size(case: Case) -> tuple:
    return tuple(v for _, v in case.params if isinstance(v, int))


def _health_checks() -> list:
    from hypothesis import HealthCheck

    return [h for h in HealthCheck]


def note(original: CaseResult, smallest: CaseResult | None) -> dict | None:
    if smallest is None:
        return None
    return {"id": smallest.id, "verdict": smallest.verdict, "kind": smallest.kind,
            "norm_err": smallest.norm_err, "reason": smallest.reason, "repro": smallest.repro}


def shrink(args: Any, command: str = "") -> int:
    from kernel_parity.reports import records

    if bool(args.case_id) == bool(args.results):
        raise UsageError("shrink takes one case id, or --results FILE (every failing case of it)")
    session = open_session(args.backend)
    runner = session.runner(recheck=False)
    if args.results:
        try:
            doc = records.load(args.results)
        except records.RecordsError as e:
            raise UsageError(f"--results: {e}") from None
        header = doc["header"]
        failing = [r for r in doc["results"] if r["verdict"] in FAILING][: args.limit]
        if not failing:
            raise UsageError(f"--results {args.results!r} holds no failing case to shrink")
        cases = [ops.parse_case(r["id"]) for r in failing]
        base = [CaseResult.from_json(r) for r in doc["results"]]
    else:
        header = None
        cases = [ops.parse_case(args.case_id)]
        base = []
    out: list[CaseResult] = []
    found = 0
    for case in cases:
        session.registry.get(case.backend)  # an unknown backend is exit 2, before any work
        original, smallest = shrink_case(case, runner, args.max_examples)
        original.shrunk = note(original, smallest)
        if smallest is None:
            print(f"{case.id}: no smaller shape fails the same way ({original.verdict}: {original.reason})")
        else:
            found += 1
            print(f"{case.id}\n  shrunk to {smallest.id}\n  {smallest.verdict}: {smallest.reason}\n"
                  f"  repro: {smallest.repro}")
        out.append(original)
        if smallest is not None:
            out.append(smallest)
    if args.json:
        from kernel_parity.conformance import env

        by_id = {r.id: r for r in out}
        merged = [by_id.pop(r.id, r) for r in base] + list(by_id.values()) if base else out
        try:
            records.write(args.json, header or env.header(command), [r.to_json() for r in merged])
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    print(f"parity shrink: {found} of {len(cases)} failing cases shrunk", file=sys.stderr)
    return EXIT_FAIL  # the cases fail: shrinking explains, it fixes nothing
