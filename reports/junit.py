"""JUnit XML for CI systems, rendered from a results document (`reports.records`).

One <testsuite> per op, one <testcase classname="<op>.<backend>" name="<id>"> per record:
fail and flaky -> <failure> (type = kind, or "flaky"), error/crash/timeout -> <error> (type =
verdict), skip -> <skipped>, vacuous passes with a <system-out> saying so. An incomplete file adds
an <error type="incomplete"> and each stale known-failures entry a <failure type="stale"> in a
"kernel-parity.run" suite, so CI never reads an unfinished or stale run as green. Header fields become
<properties> of every suite. ElementTree does the escaping; characters XML 1.0 cannot hold
(ANSI escapes from a crash log, NUL) are written as \\xNN.
"""

from __future__ import annotations

import math
import os
import re
import xml.etree.ElementTree as ET

from kernel_parity.reports import records

HEADER_PROPERTIES = ("package_version", "git_commit", "git_tree", "device", "driver", "python", "platform",
                     "numpy", "torch", "triton", "time", "command", "suite")
_ERRORS = frozenset({"error", "crash", "timeout"})
_FAILURES = frozenset({"fail", "flaky"})
_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: object) -> str:
    return _ILLEGAL_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def _seconds(r: dict) -> float:
    t = (r.get("timing") or {}).get("total_s")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 else 0.0


def _body(r: dict) -> str:
    """The failure text: the message (what, where, repro), with the repro appended if missing."""
    text = r.get("message") or r.get("reason") or ""
    repro = r.get("repro")
    if repro and repro not in text:
        text = f"{text}\nrepro: {repro}" if text else f"repro: {repro}"
    return _clean(text)


def _testcase(r: dict) -> ET.Element:
    op, backend, _ = records.cell_key(r)
    tc = ET.Element("testcase", classname=_clean(f"{op}.{backend}"), name=_clean(r.get("id") or "?"),
                    time=f"{_seconds(r):.6f}")
    verdict, reason = r.get("verdict"), _clean(r.get("reason") or "")
    if verdict in _FAILURES:
        kind = "flaky" if verdict == "flaky" else (r.get("kind") or "fail")
        ET.SubElement(tc, "failure", message=reason, type=_clean(kind)).text = _body(r)
    elif verdict in _ERRORS:
        ET.SubElement(tc, "error", message=reason, type=verdict).text = _body(r)
    elif verdict == "skip":
        ET.SubElement(tc, "skipped", message=reason)
    elif verdict == "vacuous":
        note = "vacuous: the case passed without exercising the kernel's numerics"
        ET.SubElement(tc, "system-out").text = _clean(f"{note}: {reason}" if reason else note)
    elif verdict == "xfail":  # a listed known failure: reported, not a CI failure
        ET.SubElement(tc, "skipped", message=_clean(f"xfail: {reason}"))
    elif verdict == "xpass":
        ET.SubElement(tc, "failure", message=reason, type="xpass").text = _body(r)
    elif verdict != "pass":
        ET.SubElement(tc, "error", message=_clean(f"unknown verdict {verdict!r}"), type="unknown")
    return tc


def _counts(recs: list[dict]) -> dict[str, str]:
    v = [r.get("verdict") for r in recs]
    return {
        "tests": str(len(v)),
        "failures": str(sum(x in _FAILURES or x == "xpass" for x in v)),
        "errors": str(sum(x not in _FAILURES and x not in ("pass", "vacuous", "skip", "xfail", "xpass") for x in v)),
        "skipped": str(v.count("skip") + v.count("xfail")),
        "time": f"{sum(_seconds(r) for r in recs):.6f}",
    }


def to_element(doc: dict) -> ET.Element:
    header = doc.get("header") or {}
    results = doc.get("results") or []
    root = ET.Element("testsuites", name=_clean(f"kernel-parity {header.get('suite') or ''}".strip()),
                      **_counts(results))
    by_op: dict[str, list[dict]] = {}
    for r in results:
        by_op.setdefault(records.cell_key(r)[0], []).append(r)
    for op in sorted(by_op):
        suite = ET.SubElement(root, "testsuite", name=_clean(op), **_counts(by_op[op]))
        if header.get("time"):
            suite.set("timestamp", _clean(header["time"]))
        if header.get("device"):
            suite.set("hostname", _clean(header["device"]))
        props = ET.SubElement(suite, "properties")
        for key in HEADER_PROPERTIES:
            if header.get(key) is not None:
                ET.SubElement(props, "property", name=key, value=_clean(header[key]))
        suite.extend(_testcase(r) for r in by_op[op])
    status, stale = records.status_line(doc), records.stale_entries(doc)
    if status or stale:  # the run itself did not pass: CI must see a failing test for it
        suite = ET.SubElement(root, "testsuite", name="kernel-parity.run", tests=str(bool(status) + len(stale)),
                              failures=str(len(stale)), errors=str(int(bool(status))), skipped="0", time="0")
        if status:
            tc = ET.SubElement(suite, "testcase", classname="kernel-parity.run", name="complete", time="0")
            ET.SubElement(tc, "error", message=_clean(status), type="incomplete").text = _clean(status)
        for label in stale:
            tc = ET.SubElement(suite, "testcase", classname="kernel-parity.run", name=_clean(f"known:{label}"),
                               time="0")
            ET.SubElement(tc, "failure", message="stale known-failures entry: it matches no case that ran",
                          type="stale").text = _clean(label)
    return root


def render(doc: dict) -> str:
    """The JUnit XML document (UTF-8 text with an XML declaration)."""
    root = to_element(doc)
    ET.indent(root, space=" ")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write(path: str | os.PathLike, doc: dict) -> None:
    records.atomic_write_text(path, render(doc))
