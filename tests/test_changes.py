"""`parity gate --changed-since REF`: changed files map to the op families they can move, with the
reason; a framework change selects every family; documentation selects none; the gate runs the
selected families thoroughly (extra fresh seeds) and the others on the smoke suite, and says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kernel_parity.conformance import changes, ops
from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

STEMS = sorted({s.stem for s in ops.all_specs().values()})


def test_a_kernel_file_selects_its_family_and_the_families_that_import_it():
    sel = changes.select(["kernels/triton/softmax.py"], STEMS)
    assert sel.everything is None
    assert sel.families["softmax"][0] == "kernels/triton/softmax.py is its own file"
    # the attention and combine Triton kernels import softmax.py's constants and helpers
    assert any("kernels/triton/combine.py imports kernels/triton/softmax.py" in r for r in sel.families["combine"])
    assert "quant" not in sel.families and "norm" not in sel.families


def test_variant_files_header_goldens_and_plugins():
    sel = changes.select(["kernels/triton/gemm_gemv.py"], STEMS)
    assert "gemm" in sel.families and "gemm_gemv" not in sel.families
    sel = changes.select(["kernels/cpu/quant.h"], STEMS)
    assert {"quant", "gemm"} <= set(sel.families)  # quant.c and gemm.c include it
    sel = changes.select(["refimpl/norm.py"], STEMS)
    assert "norm" in sel.families and "blocks" in sel.families  # the blocks' golden composes it
    sel = changes.select(["vendor/mine.c"], STEMS, {"mine": (["vendor/*.c"], ["softmax"])})
    assert sel.families == {"softmax": ["vendor/mine.c is a source of the plugin backend mine"]}


def test_framework_selects_everything_and_docs_nothing():
    assert changes.select(["conformance/judge.py"], STEMS).everything
    sel = changes.select(["README.md", "benchmarks/gpu_norm.py", "tests/test_cli.py"], STEMS)
    assert sel.everything is None and not sel.families


def test_git_changed_reads_the_working_tree_and_refuses_bad_refs(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "0")
    (repo / "kernels").mkdir()
    (repo / "kernels" / "x.py").write_text("x = 1\n")
    assert changes.git_changed("HEAD", repo) == ["kernels/x.py"]  # untracked counts
    with pytest.raises(Exception, match="--changed-since 'nope'"):
        changes.git_changed("nope", repo)
    with pytest.raises(Exception, match="is not a git revision"):
        changes.git_changed("--all", repo)


def test_the_gate_runs_the_selected_family_thoroughly_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(changes, "git_changed", lambda ref, root=changes.ROOT: ["kernels/cpu/softmax.c"])
    out = tmp_path / "g.jsonl"
    code = main(["gate", "--changed-since", "HEAD", "--backend", "cpu", "--op", "softmax,kvcache",
                 "--thorough-seeds", "1", "--no-progress", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "parity: softmax: thorough (kernels/cpu/softmax.c is its own file" in text
    assert "quick (the smoke suite): " in text and "kvcache" in text
    doc = records.load(out)
    soft = [r for r in doc["results"] if r["op"].startswith("softmax.")]
    kv = [r for r in doc["results"] if r["op"].startswith("kvcache.")]
    assert soft and kv and {r["seed"] for r in soft} >= {0, 7_000_003}  # the ci cases and one fresh seed each
    assert doc["header"]["changed_since"]["thorough"] == ["softmax"]
    assert all(len(r["params"]) for r in kv)
