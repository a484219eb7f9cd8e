"""Baseline diff: what changed between two results documents, matched by case id.

- regressions: a case that did not fail (pass, vacuous, skip) now fails (fail, error, crash,
  timeout, flaky);
- fixed: a case that failed now passes;
- changed: any other verdict change (pass -> skip loses coverage, fail -> crash, skip -> pass, ...);
- grew: a case that still passes (or is vacuous) whose error grew: new > growth * old for a metric
  of an output, or for the record's norm_err, and new is above the metric's floor (FLOORS);
- slower: with `slowdown` (parity gate --bench) and both runs timed on the same device, a case whose
  kernel time (perf.ms) grew past slowdown x the baseline's;
- added / removed: ids only in the new / only in the old document.

`Diff.failed` is True when there are regressions, errors that grew past the factor (a kernel made
less accurate, still inside its tolerance, fails the gate against its baseline) or slowdowns;
changed, fixed, added and removed are information.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from kernel_parity.reports import records

# Growth below these values is rounding noise, not a trend worth a line in the diff:
FLOORS: dict[str, float] = {
    # 1e-6 x max(1, |ref| max): about 8 fp32 ulp at unit scale; scaled by the output's magnitude
    # so logits of size 1e3 don't flag fp32 reordering noise.
    "max_abs": 1e-6,
    # relative rms error 1e-7 (nmse is squared): one fp32 rounding. fp32 limits are ~1e-12, so
    # growth well inside an fp32 budget still shows; float64-vs-float64 noise (~1e-30) never does.
    "nmse": 1e-14,
    # 1 - cos ~ nmse / 2 for small errors: same scale as nmse; well above float64's 1e-16
    # cancellation in 1 - cos.
    "cos_diff": 1e-14,
    # a few ulp move with any reordering of a reduction.
    "max_ulp": 4.0,
    # 1% of the tolerance budget (norm_err is already error / limit).
    "norm_err": 0.01,
}
GROWTH_METRICS = ("max_abs", "nmse", "cos_diff", "max_ulp")
KINDS = ("regression", "grew", "slower", "changed", "removed", "added", "fixed")  # most severe first


@dataclass(frozen=True)
class Change:
    """A case whose verdict changed, or that exists on one side only (old or new is None)."""

    id: str
    old: str | None
    new: str | None
    reason: str | None = None  # the reason on the side that has one (new first)


@dataclass(frozen=True)
class Growth:
    """A metric that grew by more than the growth factor while the case still passes."""

    id: str
    output: str | None  # None for the record's norm_err
    metric: str
    old: float
    new: float

    @property
    def ratio(self) -> float:
        if math.isnan(self.new) or math.isnan(self.old):
            return math.nan
        return self.new / self.old if self.old > 0 else math.inf


@dataclass
class Diff:
    growth: float = 4.0
    regressions: list[Change] = field(default_factory=list)
    fixed: list[Change] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    grew: list[Growth] = field(default_factory=list)
    added: list[Change] = field(default_factory=list)
    removed: list[Change] = field(default_factory=list)
    old_header: dict = field(default_factory=dict)
    new_header: dict = field(default_factory=dict)
    slowdown: float | None = None
    slower: list[Growth] = field(default_factory=list)
    perf_note: str | None = None  # why times were not compared (other devices, no times)

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.grew or self.slower)

    def counts(self) -> dict[str, int]:
        return {"regression": len(self.regressions), "grew": len(self.grew), "slower": len(self.slower),
                "changed": len(self.changed), "removed": len(self.removed),
                "added": len(self.added), "fixed": len(self.fixed)}

    def entries(self) -> Iterator[tuple[str, str, str]]:
        """(kind, id, detail), most severe first: regressions, grew, changed, removed, added, fixed."""
        for c in self.regressions:
            yield "regression", c.id, _change_text(c)
        for g in sorted(self.grew, key=_growth_order):
            where = f"{g.output}.{g.metric}" if g.output is not None else g.metric
            ratio = ("nan" if math.isnan(g.ratio) else "was 0" if math.isinf(g.ratio)
                     else f"{g.ratio:.3g}x")
            yield "grew", g.id, f"{where} {_num(g.old)} -> {_num(g.new)} ({ratio})"
        for g in sorted(self.slower, key=_growth_order):
            yield "slower", g.id, f"kernel {_num(g.old)} ms -> {_num(g.new)} ms ({g.ratio:.3g}x > {self.slowdown:g}x)"
        for kind, changes in (("changed", self.changed), ("removed", self.removed),
                              ("added", self.added), ("fixed", self.fixed)):
            for c in changes:
                yield kind, c.id, _change_text(c)

    def summary_line(self) -> str:
        base = self.old_header.get("git_commit") or "?"
        head = self.new_header.get("git_commit") or "?"
        parts = ", ".join(f"{k}: {n}" for k, n in self.counts().items())
        note = f"; {self.perf_note}" if self.perf_note else ""
        return f"baseline diff {base[:12]} -> {head[:12]} (growth > {self.growth:g}x): {parts}{note}"

    def render_text(self) -> str:
        """One summary line, then one line per entry, most severe first."""
        lines = [self.summary_line()]
        lines += [f"{kind.upper():<10} {case_id}  {detail}" for kind, case_id, detail in self.entries()]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        """JSON-safe (non-finite floats as "nan"/"inf", as in results documents)."""
        keep = ("git_commit", "time", "suite", "device")
        return records.encode({
            "growth": self.growth, "failed": self.failed,
            "old": {k: self.old_header.get(k) for k in keep},
            "new": {k: self.new_header.get(k) for k in keep},
            "slowdown": self.slowdown, "perf_note": self.perf_note,
            **{name: [asdict(x) for x in getattr(self, name)]
               for name in ("regressions", "fixed", "changed", "grew", "slower", "added", "removed")},
        })


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _change_text(c: Change) -> str:
    if c.old is None:
        text = f"new case: {c.new}"
    elif c.new is None:
        text = f"gone (was {c.old})"
    else:
        text = f"{c.old} -> {c.new}"
    return f"{text}: {c.reason}" if c.reason else text


def _growth_order(g: Growth) -> tuple:
    r = g.ratio
    return (-(math.inf if math.isnan(r) else r), g.id, g.output or "", g.metric)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _grew(old: Any, new: Any, growth: float, floor: float) -> bool:
    """new > growth * old and new > floor; a metric that became NaN counts, one that was NaN not."""
    if not (_is_num(old) and _is_num(new)) or math.isnan(old):
        return False
    if math.isnan(new):
        return True
    return new > floor and new > growth * old


def _growths(old: dict, new: dict, growth: float) -> list[Growth]:
    out: list[Growth] = []
    case_id = str(new["id"])
    if _grew(old.get("norm_err"), new.get("norm_err"), growth, FLOORS["norm_err"]):
        out.append(Growth(case_id, None, "norm_err", float(old["norm_err"]), float(new["norm_err"])))
    old_outs = old.get("outputs") or {}
    for name, o_new in (new.get("outputs") or {}).items():
        if name not in old_outs:
            continue
        m_old = old_outs[name].get("metrics") or {}
        m_new = o_new.get("metrics") or {}
        for metric in GROWTH_METRICS:
            floor = FLOORS[metric]
            if metric == "max_abs" and _is_num(m_new.get("max_ref")) and math.isfinite(m_new["max_ref"]):
                floor *= max(1.0, abs(m_new["max_ref"]))
            if _grew(m_old.get(metric), m_new.get(metric), growth, floor):
                out.append(Growth(case_id, name, metric, float(m_old[metric]), float(m_new[metric])))
    return out


def _ms(rec: dict) -> float | None:
    perf = rec.get("perf")
    ms = perf.get("ms") if isinstance(perf, dict) else None
    return float(ms) if _is_num(ms) and ms > 0 else None


def compare(old: dict, new: dict, *, growth: float = 4.0, slowdown: float | None = None) -> Diff:
    """Diff two results documents (as from records.load), matching records by id; with `slowdown`,
    also the kernel times of records timed on the same device (module docstring)."""
    olds = {str(r["id"]): r for r in old.get("results") or []}
    news = {str(r["id"]): r for r in new.get("results") or []}
    d = Diff(growth=growth, old_header=old.get("header") or {}, new_header=new.get("header") or {},
             slowdown=slowdown)
    same_device = d.old_header.get("device") == d.new_header.get("device")
    if slowdown and not same_device:
        d.perf_note = (f"times not compared: the baseline ran on {d.old_header.get('device')}, this run on "
                       f"{d.new_header.get('device')}")
    for case_id, n in news.items():
        o = olds.get(case_id)
        if o is None:
            d.added.append(Change(case_id, None, n["verdict"], n.get("reason")))
            continue
        vo, vn = o["verdict"], n["verdict"]
        if vo != vn:
            change = Change(case_id, vo, vn, n.get("reason") or o.get("reason"))
            if vn in records.FAILING and vo not in records.FAILING:
                d.regressions.append(change)
            elif vo in records.FAILING and vn == "pass":
                d.fixed.append(change)
            else:
                d.changed.append(change)
        if vn in ("pass", "vacuous") and vo in ("pass", "vacuous"):
            d.grew.extend(_growths(o, n, growth))
            t_old, t_new = _ms(o), _ms(n)
            if slowdown and same_device and t_old and t_new and t_new > slowdown * t_old:
                d.slower.append(Growth(case_id, None, "ms", t_old, t_new))
    d.removed = [Change(i, r["verdict"], None, r.get("reason"))
                 for i, r in olds.items() if i not in news]
    rank = records.VERDICTS.index
    d.regressions.sort(key=lambda c: (rank(c.new) if c.new in records.VERDICTS else 0, c.id))
    for lst in (d.fixed, d.changed, d.added, d.removed):
        lst.sort(key=lambda c: c.id)
    return d


def render_html_section(diff: Diff) -> str:
    """The "Baseline diff" section alone (html.render(doc, diff) embeds the same section)."""
    from kernel_parity.reports import html  # local: html imports nothing from here

    return html.render_diff_section(diff)
