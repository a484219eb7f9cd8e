"""[tool.kernel-parity], parity config, known failures scoped to their owner, shards and merge."""

from __future__ import annotations

import pytest

from kernel_parity.conformance import known
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.results import CaseResult
from kernel_parity.reports import records

SMOKE = ["--suite", "smoke", "--op", "softmax.softmax", "--backend", "cpu", "--no-progress", "-q"]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parity: error:"), err
    return err


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _pyproject(repo, table: str) -> None:
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.kernel-parity]\n' + table)


@pytest.mark.parametrize("table, needle", [
    ('bogus = 1\n', "unknown key 'bogus'"),
    ('backends = "cpu"\n', "backends must be a list of backend names"),
    ('suites = [1]\n', "suites must be a list of suite names"),
    ('baseline = 5\n', "baseline must be a path"),
    ('[[tool.kernel-parity.tolerance]]\nop = "softmax.softmax"\nrtol = 0.1\n', "reason must be a non-empty string"),
    ('[[tool.kernel-parity.tolerance]]\nop = "softmax.softmax"\nreason = "r"\n', "changes no limit"),
    ('[[tool.kernel-parity.tolerance]]\nop = "softmax.softmax"\nreason = "r"\nrtol = -1\n', "rtol must be a finite number"),
    ('[[tool.kernel-parity.tolerance]]\nop = "nope.op"\nreason = "r"\nrtol = 0.1\n', "unknown op 'nope.op'"),
    ('[[tool.kernel-parity.tolerance]]\nop = "softmax.softmax"\noutput = "z"\nreason = "r"\nrtol = 0.1\n',
     "has no output 'z'"),
    ('backends = ["nope"]\n', "unknown backend 'nope'"),
])
def test_bad_configuration_is_exit_2_naming_the_key(repo, capsys, table, needle):
    _pyproject(repo, table)
    assert main(["config"]) == 2
    assert needle in _err(capsys)
    assert main(["run", "--no-progress", "-q"]) == 2
    assert needle in _err(capsys)


def test_config_values_and_their_sources(repo, capsys):
    (repo / "known.toml").write_text("")
    (repo / "s.toml").write_text('[[cases]]\nop = "softmax.softmax"\nbackends = ["cpu"]\ndtypes = ["fp32"]\n'
                                 'params = [{rows = 2, n = 9, pad = 0}]\n')
    _pyproject(repo, 'backends = ["cpu"]\nsuites = ["s.toml"]\nknown_failures = "known.toml"\n'
                     '[[tool.kernel-parity.tolerance]]\nop = "softmax.softmax"\nrtol = 0.5\nreason = "why not"\n')
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "backends        ['cpu']" in out and "pyproject.toml [tool.kernel-parity].backends" in out
    assert str(repo / "s.toml") in out and str(repo / "known.toml") in out
    assert "why not" in out
    assert main(["config", "--backend", "torch"]) == 0
    assert "command line (--backend)" in capsys.readouterr().out
    # `parity run` with no flags takes the table: its suite, its backend, its override
    out = repo / "r.jsonl"
    assert main(["run", "--no-progress", "-q", "--json", str(out)]) == 0
    doc = records.load(out)
    assert [r["id"] for r in doc["results"]] == ["softmax.softmax/cpu/fp32/rows=2,n=9,pad=0/normal/seed=0"]
    assert doc["results"][0]["outputs"]["y"]["limits"]["rtol"] >= 0.5  # the override, on top of the spec
    assert doc["header"]["tolerance_overrides"] == [{"op": "softmax.softmax", "output": None, "dtype": None,
                                                     "reason": "why not", "rtol": 0.5}]


def test_the_packages_known_failures_apply_to_its_own_backends_only():
    own = known.Entry("softmax.softmax", "cpu", "*", "ours", package=True)
    plugin = known.Entry("softmax.softmax", "np_noisy", "*", "a user's entry for its own backend")
    theirs_named_like_ours = known.Entry("softmax.softmax", "np_noisy", "*", "ours", package=True)

    def rec(backend):
        return CaseResult(id=f"softmax.softmax/{backend}/fp32/rows=1,n=1,pad=0/normal/seed=0", op="softmax.softmax",
                          backend=backend, dtype="fp32", params={}, dist="normal", seed=0, verdict="fail")

    r = rec("cpu")
    known.apply_one(r, [own])
    assert r.verdict == "xfail"
    r = rec("np_noisy")
    known.apply_one(r, [theirs_named_like_ours])
    assert r.verdict == "fail"  # kernel-parity's list never touches a plugin's results
    known.apply_one(r, [plugin])
    assert r.verdict == "xfail"
    assert known.stale([rec("np_noisy")], [theirs_named_like_ours]) == []


def test_shards_partition_the_cases_and_merge_joins_them(tmp_path, capsys):
    runs = []
    for i in (1, 2, 3):
        out = tmp_path / f"s{i}.jsonl"
        assert main(["run", "--suite", "smoke", "--backend", "cpu", "--no-progress", "-q", "--shard", f"{i}/3",
                     "--json", str(out)]) == 0
        runs.append({r["id"] for r in records.load(out)["results"]})
    full = tmp_path / "full.jsonl"
    assert main(["run", "--suite", "smoke", "--backend", "cpu", "--no-progress", "-q", "--json", str(full)]) == 0
    every = {r["id"] for r in records.load(full)["results"]}
    assert all(runs) and set.union(*runs) == every and sum(map(len, runs)) == len(every)  # disjoint, complete
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", *(str(tmp_path / f"s{i}.jsonl") for i in (1, 2, 3)), "--json", str(merged), "-q",
                 "--md", str(tmp_path / "m.md")]) == 0
    doc = records.load(merged)
    assert {r["id"] for r in doc["results"]} == every and doc["complete"] is not None
    assert doc["header"]["planned"] == len(every)
    # an unfinished shard keeps the merge unfinished
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join((tmp_path / "s1.jsonl").read_text().splitlines(keepends=True)[:-1]))
    assert main(["merge", str(cut), str(tmp_path / "s2.jsonl"), "--json", str(tmp_path / "m2.jsonl"), "-q"]) == 1
    assert records.load(tmp_path / "m2.jsonl")["complete"] is None
    capsys.readouterr()
    assert main(["run", "--suite", "smoke", "--shard", "4/3"]) == 2
    assert "i must be in 1..N" in _err(capsys)
