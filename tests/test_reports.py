"""Self-tests for the report writers: HTML, JUnit, Markdown, baseline diff, records round trip."""

from __future__ import annotations

import json
import math
import re
import struct
import xml.etree.ElementTree as ET

import pytest

from kernel_parity.reports import diff, html, junit, markdown, records

HEADER = {
    "package_version": "0.1.0", "git_commit": "0123456789abcdef", "device": "NVIDIA H100 80GB HBM3",
    "driver": "550.54", "python": "3.11.9", "platform": "linux-x86_64", "numpy": "2.1.0",
    "torch": "2.13.0", "triton": "3.4.0", "time": "2025-01-01T00:00:00Z",
    "command": "parity run --suite smoke", "suite": "smoke",
}
EVIL = "<script>alert(1)</script>"


def make_record(op: str = "softmax.softmax", backend: str = "triton", dtype: str = "fp16", *,
                n: int = 113, seed: int = 0, verdict: str = "pass", kind: str | None = None,
                reason: str | None = None, norm_err: float | None = 0.25, max_abs: float = 1e-3,
                nmse: float = 1e-7, cos_diff: float = 1e-7, max_ulp: float = 1.0,
                case_id: str | None = None, outputs: dict | None = None) -> dict:
    """A valid record of schema kernel-parity/results/1 with one numeric output "y"."""
    case_id = case_id or f"{op}/{backend}/{dtype}/rows=3,n={n}/normal/seed={seed}"
    failing = verdict in records.FAILING
    if outputs is None:
        outputs = {"y": {
            "dtype": dtype, "shape": [3, n], "exact": False,
            "metrics": {"numel": 3 * n, "max_abs": max_abs, "max_rel": 2 * max_abs, "rmse": max_abs / 3,
                        "nmse": nmse, "cos_diff": cos_diff, "max_ulp": max_ulp, "mismatch": 3 if failing else 0,
                        "mismatch_frac": 3 / (3 * n) if failing else 0.0, "max_ref": 1.0, "nonfinite_ref": 0},
            "limits": {"atol": 1e-2, "rtol": 7.8e-3, "cos_diff": 1e-4, "nmse": 1e-4},
            "layers": {"structure": {"ok": True, "detail": ""},
                       "numeric": {"ok": not failing, "detail": "3 elements outside tol" if failing else ""}},
            "worst": [{"index": [1, 17], "got": 0.51953, "expected": 0.50781, "abs": 1.2e-2, "rel": 2.3e-2}]
                     if failing else [],
            "noise": None,
        }}
    return {
        "id": case_id, "op": op, "backend": backend, "dtype": dtype, "dist": "normal", "seed": seed,
        "params": {"rows": 3, "n": n, "pad": 0}, "verdict": verdict, "kind": kind,
        "reason": reason, "message": f"{case_id}: {reason}\n  repro: parity repro {case_id}" if failing else None,
        "repro": f"parity repro {case_id}", "norm_err": None if verdict == "skip" else norm_err,
        "outputs": {} if verdict == "skip" else outputs,
        "layers": {"structure": "pass", "numeric": "fail" if failing else "pass"},
        "recheck": None, "timing": {"inputs_s": 1e-4, "golden_s": 2e-4, "kernel_s": 3e-5, "total_s": 0.001},
    }


def make_doc(results: list[dict]) -> dict:
    return {"schema": records.SCHEMA, "header": dict(HEADER), "results": results}


@pytest.fixture
def doc() -> dict:
    return make_doc([
        make_record(n=113), make_record(n=239), make_record(n=1024, norm_err=0.5),
        make_record("softmax.softmax", "triton", "bf16", verdict="fail", kind="numeric",
                    reason="y: 3/339 elements outside tol", norm_err=3.5),
        make_record("softmax.softmax", "torch", "fp32", verdict="skip", reason="torch not installed"),
        make_record("combine.lse_combine", "triton", "fp32", verdict="crash", reason="illegal memory access"),
        make_record("combine.lse_combine", "triton", "fp16", verdict="vacuous", reason="all splits empty"),
        make_record("combine.lse_combine", "triton", "bf16", verdict="flaky", reason="failed 1 of 3 seeds"),
        make_record("combine.lse_combine", "numpy", "fp64", verdict="timeout", reason="exceeded 60 s"),
        make_record("combine.lse_combine", "numpy", "fp32", verdict="error", reason="ValueError: d=7"),
    ])


# HTML

def test_html_renders_self_contained(doc: dict) -> None:
    page = html.render(doc)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link[^>]*stylesheet", page, re.I)
    assert "@import" not in page and "url(" not in page


def test_html_escapes_untrusted_text() -> None:
    page = html.render(make_doc([make_record(case_id=f"softmax.softmax/{EVIL}/fp16/n=1/normal/seed=0",
                                             verdict="fail", kind="numeric", reason=EVIL)]))
    assert EVIL not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_html_failures_before_passes_and_matrix_cell_class(doc: dict) -> None:
    page = html.render(doc)
    failures = page.index('id="failures"')
    assert failures < page.index('id="all"')
    assert page.index("softmax.softmax/triton/bf16/rows=3,n=113") < page.index("softmax.softmax/triton/fp16/rows=3,n=113")
    bf16_cell = re.search(r'<td class="c v-(\w+)" title="softmax\.softmax / triton / bf16', page)
    assert bf16_cell is not None and bf16_cell.group(1) == "fail"
    fp16_cell = re.search(r'<td class="c v-(\w+)" title="softmax\.softmax / triton / fp16[^>]*>([^<]*)<', page)
    assert fp16_cell is not None and fp16_cell.groups() == ("pass", "3/3")
    skip_cell = re.search(r'<td class="c v-(\w+)" title="softmax\.softmax / torch / fp32[^"]*'
                          r'skipped: torch not installed">skip<', page)
    assert skip_cell is not None and skip_cell.group(1) == "skip"
    assert '<span class="badge FAIL">FAIL</span>' in page


def test_html_nan_inf_and_missing_fields() -> None:
    nan_rec = make_record(verdict="fail", kind="numeric", reason="y has NaN", norm_err=math.nan,
                          max_abs=math.nan, cos_diff=math.inf)
    bare = {"id": "bare/case", "verdict": "error"}  # every optional field missing
    page = html.render({"schema": records.SCHEMA, "results": [nan_rec, bare]})
    assert ">nan<" in page and ">inf<" in page and "bare/case" in re.sub(r"<[^>]+>", "", page)


def test_html_error_vs_size_plot() -> None:
    recs = [make_record(n=n, norm_err=e) for n, e in ((10, 0.1), (1000, 0.3), (100000, 0.0), (50, math.inf))]
    page = html.render(make_doc(recs))
    assert page.count("<svg") == 1 and 'class="lim"' in page and "<title>" in page
    assert html.render(make_doc(recs[:2])).count("<svg") == 0  # fewer than 3 numeric cases


def test_known_failures_xfail_and_xpass() -> None:
    xfail = make_record(n=1, verdict="xfail", reason="known failure (cuDNN masked rows): y off")
    xfail["known"] = {"reason": "cuDNN masked rows", "seen": "torch 2.11, H200", "verdict": "fail"}
    xpass = make_record(n=2, verdict="xpass", reason="listed as a known failure but passes")
    doc = make_doc([xfail, xpass, make_record(n=3)])
    page = html.render(doc)
    assert '<span class="badge FAIL">FAIL</span>' in page
    assert page.index('id="failures"') < page.index(xpass["id"]) < page.index('id="known"')
    assert page.index('id="known"') < page.index("cuDNN masked rows") < page.index('id="skipped"')
    cell = re.search(r'<td class="c v-(\w+)" title="softmax\.softmax / triton / fp16[^>]*>([^<]*)<', page)
    assert cell is not None and cell.groups() == ("xpass", "1 xpass / 3 · 1 xfail")
    root = ET.fromstring(junit.render(doc))
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == \
        {"tests": "3", "failures": "1", "errors": "0", "skipped": "1"}


def test_html_passing_run_has_pass_badge() -> None:
    page = html.render(make_doc([make_record(), make_record(verdict="skip", reason="no GPU", n=7)]))
    assert '<span class="badge PASS">PASS</span>' in page and 'id="failures"' in page


# JUnit

def test_junit_parses_and_counts(doc: dict) -> None:
    root = ET.fromstring(junit.render(doc))
    assert root.tag == "testsuites"
    totals = {k: int(root.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert totals == {"tests": 10, "failures": 2, "errors": 3, "skipped": 1}
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert sorted(suites) == ["combine.lse_combine", "softmax.softmax"]
    assert sum(int(s.get("tests")) for s in suites.values()) == 10
    assert len(root.findall(".//testcase")) == 10
    failure = root.find(".//testcase[@name='softmax.softmax/triton/bf16/rows=3,n=113/normal/seed=0']/failure")
    assert failure is not None and failure.get("type") == "numeric" and "parity repro" in failure.text
    assert root.find(".//failure[@type='flaky']") is not None
    assert {e.get("type") for e in root.iter("error")} == {"crash", "timeout", "error"}
    assert root.find(".//skipped").get("message") == "torch not installed"
    assert "vacuous" in root.find(".//system-out").text
    case = root.find(".//testcase")
    assert case.get("classname") == "combine.lse_combine.triton"


def test_junit_escapes_and_strips_control_characters() -> None:
    rec = make_record(verdict="crash", reason=f"{EVIL} \x1b[31mboom\x00", case_id=f"a/{EVIL}&\"")
    root = ET.fromstring(junit.render(make_doc([rec])))
    err = root.find(".//error")
    assert err.get("message") == f"{EVIL} \\x1b[31mboom\\x00"
    assert root.find(".//testcase").get("name") == f"a/{EVIL}&\""


# Markdown

def test_markdown_failures_and_matrix(doc: dict) -> None:
    md = markdown.render(doc)
    assert "❌ **FAIL**" in md
    assert "`parity repro softmax.softmax/triton/bf16/rows=3,n=113/normal/seed=0`" in md
    assert "| op |" in md and "✅ 3/3" in md


def test_markdown_truncates_and_escapes() -> None:
    recs = [make_record(n=i + 1, verdict="fail", kind="numeric", reason=EVIL) for i in range(25)]
    md = markdown.render(make_doc(recs))
    assert md.count("repro: `parity repro") == markdown.MAX_FAILURES
    assert "… and 5 more" in md
    assert "<script>" not in md


# Baseline diff

def test_diff_regression_fix_growth_and_floor() -> None:
    old = make_doc([
        make_record(n=1), make_record(n=2, verdict="fail", kind="numeric", reason="x"),
        make_record(n=3, max_abs=1e-3), make_record(n=4, max_abs=1e-12, nmse=1e-20, cos_diff=1e-20),
        make_record(n=5),
    ])
    new = make_doc([
        make_record(n=1, verdict="fail", kind="numeric", reason="3/3 outside tol"),
        make_record(n=2), make_record(n=3, max_abs=8e-3),
        make_record(n=4, max_abs=5e-12, nmse=5e-20, cos_diff=5e-20),
        make_record(n=6),
    ])
    d = diff.compare(old, new)
    assert d.failed
    assert [c.id for c in d.regressions] == [old["results"][0]["id"]]
    assert [(c.old, c.new) for c in d.fixed] == [("fail", "pass")]
    assert [(g.id, g.output, g.metric, g.old, g.new) for g in d.grew] == [
        (new["results"][2]["id"], "y", "max_abs", 1e-3, 8e-3)]
    assert [c.id for c in d.added] == [new["results"][4]["id"]]
    assert [c.id for c in d.removed] == [old["results"][4]["id"]]
    text = d.render_text().splitlines()
    assert text[1].startswith("REGRESSION") and text[-1].startswith("FIXED")
    assert json.loads(json.dumps(d.to_dict()))["failed"] is True
    section = html.render(new, diff=d)
    assert 'id="diff"' in section and "regression" in diff.render_html_section(d)


def test_diff_norm_err_growth_and_nan() -> None:
    old = make_doc([make_record(n=1, norm_err=0.001), make_record(n=2, norm_err=0.05),
                    make_record(n=3, nmse=1e-7)])
    new = make_doc([make_record(n=1, norm_err=0.009), make_record(n=2, norm_err=0.5),
                    make_record(n=3, nmse=math.nan)])
    d = diff.compare(old, new)
    assert not d.failed
    assert sorted((g.id.split("n=")[1][0], g.metric) for g in d.grew) == [("2", "norm_err"), ("3", "nmse")]
    assert json.dumps(d.to_dict(), allow_nan=False)


# Records round trip

def test_records_round_trip_bit_exact(tmp_path) -> None:
    values = [0.1, 1 / 3, 5e-324, 1.7976931348623157e308, -0.0, math.nan, math.inf, -math.inf]
    rec = make_record(verdict="fail", kind="numeric", reason="r", norm_err=math.nan)
    rec["outputs"]["y"]["metrics"].update({f"m{i}": v for i, v in enumerate(values)})
    rec["outputs"]["y"]["worst"][0]["got"] = -math.inf
    path = tmp_path / "out.json"
    records.write(path, HEADER, [rec])
    back = records.load(path)
    metrics = back["results"][0]["outputs"]["y"]["metrics"]
    bits = [struct.pack("<d", metrics[f"m{i}"]) for i in range(len(values))]
    assert bits[:5] == [struct.pack("<d", v) for v in values[:5]]
    assert math.isnan(metrics["m5"]) and metrics["m6"] == math.inf and metrics["m7"] == -math.inf
    assert math.isnan(back["results"][0]["norm_err"])
    assert back["results"][0]["outputs"]["y"]["worst"][0]["got"] == -math.inf
    assert back["header"] == HEADER


def test_records_load_rejects_other_files(tmp_path) -> None:
    other = tmp_path / "package.json"
    other.write_text('{"name": "not-results"}')
    with pytest.raises(records.RecordsError, match=r"package\.json.*schema None.*kernel-parity/results/2"):
        records.load(other)
    with pytest.raises(records.RecordsError, match=r"does not exist"):
        records.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(records.RecordsError, match=r"line 1 is not valid JSON"):
        records.load(tmp_path / "bad.json")


def test_writers_write_atomically(tmp_path, doc: dict) -> None:
    for module, name in ((html, "r.html"), (junit, "r.xml"), (markdown, "r.md")):
        module.write(tmp_path / name, doc)
        assert (tmp_path / name).read_text(encoding="utf-8") == module.render(doc)
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.md", "r.xml"]
