"""`parity sweep`: fresh seeds over a suite's combinations, false alarms counted."""

from __future__ import annotations

from kernel_parity.conformance import suites
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.sweep import summarize, sweep_cases
from kernel_parity.reports import records


def test_sweep_cases_spread_fresh_seeds_and_share_them_across_backends():
    base = suites.cases("smoke", suites.Filters(ops=("softmax.softmax",)))
    combos = {(c.dtype, c.params, c.dist) for c in base}
    cases = sweep_cases(base, start=1000, seeds=None, per_op=10)
    assert len({c.seed for c in cases}) == 10 and min(c.seed for c in cases) == 1000
    assert all(c.seed != 0 for c in cases)  # fresh: never the suite's own seed
    by_seed: dict[int, set] = {}
    for c in cases:
        by_seed.setdefault(c.seed, set()).add((c.dtype, c.params, c.dist, c.backend))
    assert all(len({k[:3] for k in v}) == 1 for v in by_seed.values())  # a seed is one input combination
    assert {k[:3] for v in by_seed.values() for k in v} == combos  # spread round-robin over them
    per = sweep_cases(base, start=7, seeds=3, per_op=None)
    assert len(per) == 3 * len(base)


def test_a_small_sweep_of_correct_kernels_has_no_false_alarm(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    code = main(["sweep", "--suite", "ci", "--op", "combine.lse_combine", "--op", "attention.decode",
                 "--backend", "cpu", "--backend", "torch", "--per-op", "40", "--start", "123", "--jobs", "2",
                 "--no-progress", "-q", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "from start seed 123 (replay: --start 123)" in printed
    doc = records.load(out)
    assert doc["header"]["sweep"]["start"] == 123 and len(doc["results"]) == 160
    rows = {(r["op"], r["backend"]): r for r in doc["complete"]["sweep"]["rows"]}
    assert rows[("attention.decode", "cpu")]["runs"] == 40
    assert all(r["failures"] == 0 and r["flaky"] == 0 and r["worst"] < 1.0 for r in rows.values())


def test_a_sweep_counts_failures_and_names_the_worst_case(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    code = main(["sweep", "--suite", "smoke", "--op", "softmax.softmax", "--backend", "tests.third_party:NOISY",
                 "--per-op", "6", "--start", "9", "--no-progress", "-q", "--json", str(out)])
    assert code == 1
    (row,) = summarize(records.load(out)["results"])
    assert row["runs"] == 6 and row["failures"] == 6 and row["worst"] > 1.0
    assert row["worst_id"].startswith("softmax.softmax/np_noisy/")
    assert "np_noisy" in capsys.readouterr().out
