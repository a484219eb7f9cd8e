"""Markdown summary for a PR comment or a CI step summary ($GITHUB_STEP_SUMMARY), rendered from a
results document (`reports.records`): badge line, verdict counts, a compact op x backend x dtype
matrix, and the first MAX_FAILURES failures with their reason and repro command.

Text from the document is escaped: HTML-significant characters become entities outside code spans,
code spans pick a fence longer than any backtick run inside, and table cells escape '|'.
"""

from __future__ import annotations

import os
import re

from kernel_parity.reports import records

MAX_FAILURES = 20
MARK = {"pass": "✅", "fail": "❌", "error": "🟠", "crash": "💥", "timeout": "⏱️",
        "flaky": "🟣", "vacuous": "🟡", "skip": "⚪", "xfail": "🔕", "xpass": "❗",
        "notrun": "⏸️"}
_MD_SPECIAL = re.compile(r"([\\`*_\[\]#|~])")


def _text(s: object) -> str:
    """Plain text: one line, HTML entities for < > &, markdown punctuation backslash-escaped."""
    s = " ".join(str(s).split())
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s)


def _code(s: object, in_table: bool = False) -> str:
    """A code span holding `s` verbatim (one line)."""
    s = " ".join(str(s).split())
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    span = f"{fence}{pad}{s}{pad}{fence}"
    return span.replace("|", "\\|") if in_table else span


def _matrix(results: list[dict], plan: dict | None = None) -> list[str]:
    ops, columns, cells = records.matrix(results, plan)
    if not ops:
        return []
    heads = [f"{_text(b)} {_text(d)}" for b, dts in columns for d in dts]
    lines = ["| op | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for op in ops:
        row = []
        for b, dts in columns:
            for d in dts:
                cell = cells.get((op, b, d))
                row.append("" if cell is None else f"{MARK.get(cell.worst, '?')} {_text(cell.text)}")
        lines.append(f"| {_code(op, in_table=True)} | " + " | ".join(row) + " |")
    return lines


def render(doc: dict) -> str:
    header = doc.get("header") or {}
    results = doc.get("results") or []
    counts = records.summary(results)
    ok = records.doc_passed(doc)
    badge = "✅ **PASS**" if ok else "❌ **FAIL**"
    suite = _text(header.get("suite") or "results")
    lines = [f"### kernel-parity {suite}: {badge}", ""]
    status = records.status_line(doc)
    if status:
        lines += [f"**{_text(status)}**", ""]
    for label in records.stale_entries(doc):
        lines += [f"**stale known-failures entry:** {_code(label)}", ""]
    where = [f"{_text(header[k])}" for k in ("device", "driver") if header.get(k)]
    if header.get("git_commit"):
        where.append(f"commit {_code(str(header['git_commit'])[:12])}")
        if str(header["git_commit"]).endswith("-dirty") and header.get("git_tree"):
            where.append(f"tree {_code(str(header['git_tree'])[:12])}")
    if header.get("time"):
        where.append(_text(header["time"]))
    if where:
        lines += [" · ".join(where), ""]
    verdicts = [f"{MARK.get(v, '')} {counts[v]} {v}" for v in records.VERDICTS if counts.get(v)]
    lines += [f"**{len(results)} cases:** " + (", ".join(verdicts) or "none"), ""]
    lines += _matrix(results, records.plan_of(doc))

    failures = sorted((r for r in results if r.get("verdict") in records.FAILING),
                      key=lambda r: (records.VERDICTS.index(r["verdict"]), str(r.get("id"))))
    if failures:
        lines += ["", f"#### Failures ({len(failures)})", ""]
        for r in failures[:MAX_FAILURES]:
            kind = f" ({_text(r['kind'])})" if r.get("kind") else ""
            reason = f": {_text(r['reason'])}" if r.get("reason") else ""
            lines.append(f"- {MARK.get(r['verdict'], '')} **{r['verdict']}**{kind} "
                         f"{_code(r.get('id') or '?')}{reason}")
            if r.get("repro"):
                lines.append(f"  repro: {_code(r['repro'])}")
        if len(failures) > MAX_FAILURES:
            lines.append(f"- … and {len(failures) - MAX_FAILURES} more (see the HTML report)")
    return "\n".join(lines) + "\n"


def write(path: str | os.PathLike, doc: dict) -> None:
    records.atomic_write_text(path, render(doc))
