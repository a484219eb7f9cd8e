"""The mutants catalogue against today's kernel sources, and `parity mutants` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance.cli import main
from kernel_parity.conformance.mutants import CLASSES, MutantError, catalogue, get, kernels_root

ROOT = Path(__file__).resolve().parent.parent
# The bug classes the gate must be shown to catch (issue: "cover at least").
REQUIRED = ("causal-alignment", "causal-off-by-one", "gqa-mapping", "window-edge", "softcap-order", "sink",
            "missing-rescale", "lse-base", "scale", "inf-minus-inf", "split-bounds", "read-past-end",
            "dropped-tail", "paged-write", "low-precision-accumulation", "truncated-constant", "masked-row",
            "write-offset", "tf32")


def test_every_mutant_applies_to_todays_sources():
    muts = catalogue()
    assert len(muts) >= 60
    assert {m.backend for m in muts} == {"triton", "cpu", "torch", "gluon"}
    assert all(m.gpu_only for m in muts if m.backend == "gluon")  # Gluon has no interpreter
    for m in muts:
        source = (kernels_root() / m.file).read_text()
        patched = m.patched(source)  # MutantError if the target text is gone or ambiguous
        assert patched != source
        if m.file.endswith(".py"):
            compile(patched, m.file, "exec")
    covered = {m.bug for m in muts}
    assert set(REQUIRED) <= covered, f"no mutant of class {sorted(set(REQUIRED) - covered)}"
    assert covered <= set(CLASSES)
    for m in muts:  # an equivalent mutant carries its argument
        assert m.equivalent is None or len(m.equivalent) > 20


def test_a_patch_whose_target_is_gone_fails_loudly(tmp_path):
    (tmp_path / "x.toml").write_text('[[mutant]]\nid = "gone"\nfile = "triton/softmax.py"\nbug = "scale"\n'
                                     'doc = "d"\nfind = "this text is not in the source"\nreplace = "x"\n')
    (m,) = catalogue(str(tmp_path))
    with pytest.raises(MutantError, match="its target text is gone"):
        m.patched((kernels_root() / m.file).read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.toml").write_text('[[mutant]]\nid = "Bad Id"\nfile = "triton/softmax.py"\nbug = "nope"\n'
                                  'doc = "d"\nfind = "a"\nreplace = "b"\n')
    with pytest.raises(MutantError, match="must be unique, lower-case"):
        catalogue(str(other))


def test_install_loads_the_patched_copy_in_a_fresh_process(tmp_path):
    m = get("tri-softmax-masked-row-nan")
    code = ("import inspect; from conformance.mutants import install; "
            f"install({m.id!r}, {str(tmp_path)!r}); import kernel_parity.kernels.triton.softmax as k; "
            "print(k.__file__); print('inv = 1.0 / s' in inspect.getsource(k))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path, has_bug = out.split()
    assert path.startswith(str(tmp_path)) and has_bug == "True"
    assert "inv = 1.0 / s\n" not in (kernels_root() / m.file).read_text()  # the real source is untouched


def test_parity_mutants_kills_with_case_layer_and_diagnosis(tmp_path, capsys):
    out, page = tmp_path / "m.json", tmp_path / "m.html"
    # the C mutant: kernels/cpu/kvcache.c builds in 0.2 s (softmax.c's mutants: 8 s, built fresh each run)
    code = main(["mutants", "--mutant", "tri-prefill-causal-top-left", "--mutant", "c-kvcache-write-offset",
                 "--mutant", "tri-prefill-tf32", "--json", str(out), "--html", str(page), "-q"])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["id"]: r for r in doc["mutants"]}
    causal = rows["tri-prefill-causal-top-left"]
    assert causal["status"] == "killed" and causal["by"] == "gate" and causal["layer"] == "numeric"
    assert causal["case"].startswith("attention.prefill/triton/")
    assert causal["diagnosis"] == "matches the other causal alignment: alignment bug"
    assert rows["c-kvcache-write-offset"]["status"] == "killed"
    assert rows["tri-prefill-tf32"]["status"] == "gpu-only"  # listed with its reason, not run on a CPU
    html = page.read_text()
    assert 'id="mutants"' in html and "tri-prefill-causal-top-left" in html
    assert "parity mutants: 3 mutants: 2 killed, 1 gpu-only" in capsys.readouterr().out


def test_props_kill_what_the_gate_lets_through(tmp_path):
    """An attention mutant against a suite of no attention case: the gate alone lets it through, --props kills
    it. The mutant drops prefill's last partial key tile: the first property test drawn (test_attention's
    prefill on triton) fails and shrinks in 13 s (the causal top-left mutant: 31 s, its failure needs s_q != s_k
    and shrinks longer)."""
    suite = tmp_path / "tiny.toml"  # a suite without an attention case: the gate cannot see the bug
    suite.write_text('[[cases]]\nop = "softmax.softmax"\nbackends = ["triton"]\ndtypes = ["fp32"]\n'
                     'params = [{rows = 2, n = 17, pad = 0}]\n')
    out = tmp_path / "m.json"
    code = main(["mutants", "--mutant", "tri-prefill-drop-last-tile", "--suite", str(suite), "--json", str(out),
                 "-q"])
    assert code == 1  # survived the gate alone
    assert main(["mutants", "--mutant", "tri-prefill-drop-last-tile", "--suite", str(suite), "--props",
                 "--json", str(out), "-q"]) == 0
    (row,) = json.loads(out.read_text())["mutants"]
    assert row["status"] == "killed" and row["by"] == "props"
    assert row["test"].startswith("property_tests/test_attention.py::")


def test_shards_split_the_selection_round_robin(capsys):
    """--shard I/N: N disjoint slices whose union is the selection, each listed by --list; 0/N is exit 2."""
    ids = [m.id for m in catalogue()]
    got = []
    for i in (1, 2, 3):
        assert main(["mutants", "--list", "--shard", f"{i}/3"]) == 0
        got.append([line.split()[0] for line in capsys.readouterr().out.splitlines()])
    assert sorted(sum(got, [])) == sorted(ids) and not set(got[0]) & set(got[1])
    assert got[0] == ids[0::3]
    assert main(["mutants", "--list", "--shard", "0/3"]) == 2
    assert "i must be in 1..N" in capsys.readouterr().err


def test_survivor_note_names_the_ops_that_ran_it():
    """A mutant that no case runs (its op's entries do not list its backend) must not read as tested: the note
    says no case ran; otherwise it names the ops whose cases ran, most first."""
    from kernel_parity.conformance.mutants.run import passed_note

    assert passed_note({}).startswith("no gate case ran")
    note = passed_note({"mla.decode": 24, "attention.prefill": 32, "a": 1, "b": 1, "c": 1})
    assert note.startswith("every gate case passed: 59 ran (attention.prefill 32, mla.decode 24")
    assert note.endswith("+1 ops)")
