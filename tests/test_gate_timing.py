"""benchmarks/gate_timing.py: where a run's time went, per op, from its records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gate_timing  # noqa: E402

from kernel_parity.reports import records  # noqa: E402

ONE_GPU = Path(__file__).resolve().parents[1] / "reports/baselines/models-h200x2-1gpu.jsonl.gz"


def test_inputs_and_goldens_count_once_per_group_kernels_and_judging_per_record():
    rows = gate_timing.where(records.load(ONE_GPU))
    total = rows["total"]
    assert (total["records"], total["groups"], total["sampled"]) == (1498, 463, 0)
    assert total["inputs_s"] == pytest.approx(1991.8, abs=0.1)
    assert total["golden_s"] == pytest.approx(1374.2, abs=0.1)
    assert total["kernel_s"] == pytest.approx(355.8, abs=0.1)
    assert total["judge_s"] == pytest.approx(3610.6, abs=0.1)
    assert next(iter(rows)) == "mla.decode"  # the most expensive op first


def test_the_script_prints_a_table_and_busy_share(capsys):
    assert gate_timing.main([str(ONE_GPU)]) == 0
    out = capsys.readouterr().out
    assert "mla.decode" in out and "% busy" in out


def test_a_file_that_is_not_results_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text("{}\n")
    assert gate_timing.main([str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
