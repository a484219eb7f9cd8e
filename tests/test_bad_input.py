"""Bad input everywhere is exit 2 with one line naming the file, key or flag: never a traceback,
never a silent wrong answer, never half-written output. Hypothesis draws the bad inputs: CLI
flags, suite TOML contents, results and baseline files, case ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _usage_error(capsys, argv: list[str]) -> str:
    """Run `parity argv`; assert exit 2 and one error line; return it."""
    code = main(argv)
    cap = capsys.readouterr()
    assert code == 2, f"parity {argv} exited {code}\n{cap.out}\n{cap.err}"
    err = cap.err.strip()
    assert "Traceback" not in cap.err and "Traceback" not in cap.out
    assert len(err.splitlines()) == 1 and err.startswith("parity: error: "), err
    return err


# -- flags ---------------------------------------------------------------------------------------
BAD_FLAGS = [
    ("--jobs", ["0", "-1", "x", "1.5", ""]),
    ("--timeout", ["-1", "0", "nan", "inf", "-inf", "x", ""]),
    ("--scale", ["x", "", "CPU"]),
    ("--dtype", ["fp8", "x", "float128", ""]),
    ("--op", ["nope", "softmax.nope", ""]),
    ("--dist", ["nope"]),
    ("--backend", ["nope", "nomodule_xyz:OBJ", "tests.third_party:MISSING", ":", "tests.third_party:"]),
    ("--suite", ["nope", "/nonexistent/x.toml", "conformance", "a\0b"]),
    ("--known-failures", ["/nonexistent/k.toml", ".", ""]),
]
GATE_FLAGS = [("--growth", ["0", "-2", "nan", "x"]), ("--baseline", ["/nonexistent/b.jsonl", ".", "pyproject.toml"])]
SWEEP_FLAGS = [("--per-op", ["0", "-3", "x"]), ("--seeds", ["0", "x"]), ("--start", ["-1", "x"])]


@st.composite
def bad_argv(draw):
    cmd = draw(st.sampled_from(["run", "gate", "sweep"]))
    pool = BAD_FLAGS + (GATE_FLAGS if cmd == "gate" else SWEEP_FLAGS if cmd == "sweep" else [])
    flag, values = draw(st.sampled_from(pool))
    value = draw(st.sampled_from(values))
    return cmd, flag, value


@FAST
@given(bad=bad_argv())
def test_bad_flags_are_exit_2_naming_the_flag(capsys, tmp_path_factory, bad):
    cmd, flag, value = bad
    out = tmp_path_factory.mktemp("o") / "r.jsonl"
    err = _usage_error(capsys, [cmd, "--suite", "smoke", "--op", "softmax.softmax", "--no-progress", "-q",
                                "--json", str(out), flag, value] if flag != "--suite" else
                       [cmd, "--no-progress", "-q", "--json", str(out), flag, value])
    name = flag.lstrip("-")
    assert name in err or repr(value) in err or value in err, err
    assert not out.exists()  # nothing written


def test_unknown_flags_and_subcommands(capsys):
    assert "unrecognized arguments" in _usage_error(capsys, ["run", "--bogus"])
    assert "invalid choice" in _usage_error(capsys, ["nope"])
    assert "--timeout" in _usage_error(capsys, ["gate", "--timeout", "nan"])


# -- suite TOML ------------------------------------------------------------------------------------
VALID_ENTRY = {"op": "softmax.softmax", "backends": ["cpu"], "dtypes": ["fp32"], "dists": ["normal"],
               "seeds": [0], "params": [{"rows": 2, "n": 5, "pad": 0}]}
WRONG = {  # key -> values that are wrong for it (type or content)
    "op": [5, ["softmax.softmax"], "", "softmax.nope", {"a": 1}],
    "backends": ["cpu", 5, [], [1], ["nope"], {"a": "b"}],
    "dtypes": ["fp32", 5, [], ["f"], ["fp8"], [1.5]],
    "dists": ["normal", [], ["nope"], [3]],
    "seeds": ["0", 1.5, -1, [], ["a"], [-1], [1.5], {"a": 1}],
    "params": [5, "x", [1], [{"rows": 1.5, "n": 5, "pad": 0}], [{"rows": 0, "n": 5, "pad": 0}],
               [{"zz": 1, "rows": 2, "n": 5, "pad": 0}], [{"rows": 2}], [[1, 2]], [{"rows": [1], "n": 5, "pad": 0}]],
    "grid": [5, "x", {"rows": 1.5}, {"rows": []}, {"rows": [[1]]}],
    "cpu": [5, {"rows": 1.5}, {"rows": [1]}],
    "bogus_key": [1, "x"],
}
TOP_WRONG = {"cases": ["x", 5, [1], {"op": "x"}], "include": ["ci", [1], ["nope"]], "description": [5, ["x"]],
             "bogus": [1]}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml(doc: dict) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if k != "cases"]
    cases = doc.get("cases")
    if isinstance(cases, list) and all(isinstance(c, dict) for c in cases):
        for c in cases:
            lines.append("[[cases]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in c.items()]
    elif cases is not None:
        lines.insert(0, f"cases = {_toml_value(cases)}")
    return "\n".join(lines) + "\n"


@st.composite
def bad_suite(draw):
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(TOP_WRONG)))
        return {"description": "x", key: draw(st.sampled_from(TOP_WRONG[key]))}, key
    key = draw(st.sampled_from(sorted(WRONG)))
    entry = dict(VALID_ENTRY)
    if key == "params" or draw(st.booleans()):
        entry.pop("params")
    entry[key] = draw(st.sampled_from(WRONG[key]))
    if key in ("grid", "cpu") and "params" not in entry:
        entry["params"] = VALID_ENTRY["params"]
    if key == "op" and draw(st.booleans()):
        entry.pop("op")
    return {"cases": [entry]}, key


@FAST
@given(bad=bad_suite())
def test_bad_suite_files_are_exit_2_naming_the_file_and_key(capsys, tmp_path_factory, bad):
    doc, key = bad
    d = tmp_path_factory.mktemp("s")
    path = d / "suite.toml"
    path.write_text(_toml(doc))
    out = d / "r.jsonl"
    err = _usage_error(capsys, ["run", "--suite", str(path), "--no-progress", "-q", "--json", str(out)])
    assert "suite.toml" in err or (key == "include" and "nope" in err), err
    assert not out.exists()


def test_a_suite_that_is_not_toml_or_not_a_file(capsys, tmp_path):
    (tmp_path / "x.toml").write_text("[[cases]\nop = ")
    assert "is not valid TOML" in _usage_error(capsys, ["run", "--suite", str(tmp_path / "x.toml")])
    (tmp_path / "d.toml").mkdir()
    assert "is not a file" in _usage_error(capsys, ["run", "--suite", str(tmp_path / "d.toml")])
    (tmp_path / "loop.toml").write_text(f'include = ["{tmp_path / "loop.toml"}"]\n')
    assert "includes itself" in _usage_error(capsys, ["run", "--suite", str(tmp_path / "loop.toml")])


# -- results and baseline files --------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_results(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.jsonl"
    assert main(["run", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu", "--dtype", "fp32",
                 "--no-progress", "-q", "--no-isolate", "--json", str(path)]) == 0
    return path


RECORD_WRONG = {"id": [5, None, ""], "verdict": ["passed", 1, None], "kind": ["weird", 3], "seed": [-1, "0", 1.5],
                "params": ["x", [1]], "outputs": ["x", [1], {"y": 5}, {"y": {"metrics": {"max_abs": "big"}}}],
                "norm_err": ["x", [1]], "timing": [None, 5], "recheck": ["x"], "message": [5], "tier": ["lenient"]}


@st.composite
def bad_results(draw):
    how = draw(st.sampled_from(["record", "drop", "header", "schema", "garbage", "empty", "no-results"]))
    if how == "record":
        key = draw(st.sampled_from(sorted(RECORD_WRONG)))
        return how, key, draw(st.sampled_from(RECORD_WRONG[key]))
    if how == "drop":
        return how, draw(st.sampled_from(["id", "verdict", "outputs", "op", "seed", "layers"])), None
    return how, None, None


def _corrupt(text: str, how: str, key, value) -> str:
    lines = text.splitlines()
    head, recs, tail = json.loads(lines[0]), [json.loads(x) for x in lines[1:-1]], lines[-1]
    if how == "record":
        recs[0][key] = value
    elif how == "drop":
        recs[0].pop(key)
    elif how == "header":
        head["header"] = ["not", "an", "object"]
    elif how == "schema":
        head["schema"] = "kernel-parity/results/1"
    elif how == "garbage":
        return text.replace(lines[1], lines[1][: len(lines[1]) // 2] + "}{", 1)
    elif how == "empty":
        return "\n\n"
    elif how == "no-results":
        recs = []
    return "\n".join([json.dumps(head)] + [json.dumps(r) for r in recs] + [tail]) + "\n"


@FAST
@given(bad=bad_results(), use=st.sampled_from(["report", "diff", "baseline"]))
def test_bad_results_files_are_exit_2_naming_the_file(capsys, tmp_path_factory, good_results, bad, use):
    d = tmp_path_factory.mktemp("r")
    path = d / "bad.jsonl"
    path.write_text(_corrupt(good_results.read_text(), *bad))
    out = d / "out.html"
    argv = {"report": ["report", str(path), "--html", str(out)],
            "diff": ["diff", str(good_results), str(path)],
            "baseline": ["gate", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu",
                         "--no-progress", "-q", "--baseline", str(path), "--html", str(out)]}[use]
    err = _usage_error(capsys, argv)
    assert "bad.jsonl" in err, err
    assert not out.exists()


@FAST
@given(cut=st.floats(0.0, 0.97))
def test_a_truncated_baseline_is_exit_2(capsys, tmp_path_factory, good_results, cut):
    data = good_results.read_bytes()
    path = tmp_path_factory.mktemp("t") / "cut.jsonl"
    path.write_bytes(data[: int(len(data) * cut)])
    err = _usage_error(capsys, ["gate", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu",
                                "--no-progress", "-q", "--baseline", str(path)])
    assert "cut.jsonl" in err


def test_gzip_results_read_as_plain_and_a_damaged_one_is_exit_2(capsys, tmp_path, good_results):
    """Committed baselines are kept as .jsonl.gz: the same records, and a cut gzip file is exit 2 naming it."""
    import gzip

    packed = gzip.compress(good_results.read_bytes())
    (tmp_path / "good.jsonl.gz").write_bytes(packed)
    assert records.load(tmp_path / "good.jsonl.gz")["results"] == records.load(good_results)["results"]
    assert main(["diff", str(good_results), str(tmp_path / "good.jsonl.gz")]) == 0
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    err = _usage_error(capsys, ["report", str(tmp_path / "cut.jsonl.gz"), "--md", str(tmp_path / "r.md")])
    assert "cut.jsonl.gz" in err and "gzip" in err, err
    assert not (tmp_path / "r.md").exists()


def test_a_results_file_without_results_never_renders_green(tmp_path, good_results):
    lines = good_results.read_text().splitlines()
    (tmp_path / "header-only.jsonl").write_text(lines[0] + "\n")
    doc = records.load(tmp_path / "header-only.jsonl")  # a run killed before its first case
    assert records.status_line(doc).startswith("incomplete: 0 of")
    assert main(["report", str(tmp_path / "header-only.jsonl"), "--md", str(tmp_path / "r.md")]) == 1
    assert "FAIL" in (tmp_path / "r.md").read_text()


# -- case ids --------------------------------------------------------------------------------------
GOOD_ID = "softmax.softmax/cpu/fp32/rows=3,n=113,pad=0/normal/seed=0"
ID_WRONG = {
    0: ["", "nope", "softmax", "softmax.nope", "softmax.softmax ", "a b"],
    1: ["", "nope", "x:y", "a b"],
    2: ["", "fp8", "int32", "x"],
    3: ["", "rows=3", "rows=3,n=113", "rows=3,n=113,pad=0,zz=1", "rows=0,n=113,pad=0", "rows=+3,n=113,pad=0",
        "rows=03,n=113,pad=0", "rows=3,n=1_13,pad=0", "rows=3,rows=3,n=113,pad=0", "rows=3,n=113,pad=2",
        "rows,n=113,pad=0", "=3,n=113,pad=0"],
    4: ["", "nope", "NORMAL"],
    5: ["", "seed", "seed=", "seed=-1", "seed=01", "seed=x", "seed=1.0", "seed=99999999999999999999"],
}


@st.composite
def bad_id(draw):
    parts = GOOD_ID.split("/")
    how = draw(st.sampled_from(["field", "count"]))
    if how == "count":
        n = draw(st.sampled_from([1, 2, 5, 7]))
        parts = (parts + ["extra"])[:n] if n <= 7 else parts
        return "/".join(parts)
    i = draw(st.sampled_from(sorted(ID_WRONG)))
    parts[i] = draw(st.sampled_from(ID_WRONG[i]))
    return "/".join(parts)


@FAST
@given(case_id=bad_id())
def test_bad_case_ids_are_exit_2(capsys, case_id):
    err = _usage_error(capsys, ["repro", case_id])
    assert "case id" in err or "parameter" in err or "unknown" in err or "does not support" in err \
        or "has no" in err or "needs" in err, err
