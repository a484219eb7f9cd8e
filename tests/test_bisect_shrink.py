"""`parity bisect` finds a deliberately broken commit in a scratch repository (a plugin backend whose
kernel loses its max subtraction three commits in), and `parity shrink` reduces a failing case to the
smallest shape that fails the same way, which the HTML report shows beside the original."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance.cli import main
from kernel_parity.reports import html, records

KERNEL = '''import numpy as np

from kernel_parity.conformance.backends import Backend


def _softmax(case, inputs, out):
    x = inputs["x"].astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    y = out.numpy("y")
    y[...] = (e / e.sum(axis=-1, keepdims=True)).astype(y.dtype)
    return {"y": y}


BACKEND = Backend(name="scratch", ops={"softmax.softmax": _softmax}, dtypes=("fp32",))
'''
CASE = "softmax.softmax/scratch/fp32/rows=3,n=100,pad=0/large/seed=0"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    repo = tmp_path / "scratch"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "scratch_kernel.py").write_text(KERNEL)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a good softmax")
    commits = [_git(repo, "rev-parse", "HEAD")]
    for i, text in enumerate((KERNEL + "# notes\n", KERNEL.replace("x - x.max(axis=-1, keepdims=True)", "x"),
                              KERNEL.replace("x - x.max(axis=-1, keepdims=True)", "x") + "# more notes\n")):
        (repo / "scratch_kernel.py").write_text(text)
        _git(repo, "commit", "-q", "-am", f"change {i + 1}")
        commits.append(_git(repo, "rev-parse", "HEAD"))
    monkeypatch.chdir(repo)
    return repo, commits


def test_bisect_finds_the_broken_commit(scratch, capsys):
    repo, commits = scratch
    code = main(["bisect", CASE, "--good", commits[0], "--bad", commits[-1], "--backend", "scratch_kernel:BACKEND"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"first commit where the case fails: {commits[2]}" in out  # "change 2" dropped the max
    assert commits[2][:12] in out and "fail" in out  # the error at every commit tried is printed
    assert _git(repo, "status", "--porcelain") == ""  # the working tree is untouched
    assert len(_git(repo, "worktree", "list").splitlines()) == 1  # its temporary worktree is gone


def test_bisect_refuses_a_good_commit_that_fails(scratch, capsys):
    repo, commits = scratch
    assert main(["bisect", CASE, "--good", commits[2], "--bad", commits[3],
                 "--backend", "scratch_kernel:BACKEND"]) == 2
    assert "the case fails there" in capsys.readouterr().err
    assert main(["bisect", CASE, "--good", "nope", "--bad", commits[3]]) == 2


def test_shrink_finds_the_smallest_failing_shape_and_the_report_shows_it(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    case = "softmax.softmax/np_no_max/fp32/rows=7,n=4099,pad=0/large/seed=3"
    assert main(["shrink", case, "--backend", "tests.third_party:NO_MAX", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "shrunk to softmax.softmax/np_no_max/fp32/rows=1,n=1,pad=0/large/seed=3" in text
    doc = records.load(out)
    original = next(r for r in doc["results"] if r["id"] == case)
    assert original["shrunk"]["id"].endswith("rows=1,n=1,pad=0/large/seed=3")
    page = html.render(doc)
    assert "smallest case failing the same way" in page
    assert main(["shrink", "softmax.softmax/cpu/fp32/rows=2,n=8,pad=0/normal/seed=0"]) == 2  # passes: nothing to shrink
