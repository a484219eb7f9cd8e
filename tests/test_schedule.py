"""`--schedule RESULTS`: case groups ordered by the seconds an earlier run measured, longest first."""

from __future__ import annotations

import json

from kernel_parity.conformance import cli, suites
from kernel_parity.conformance.runner import Runner, group_cases, largest_first, measured_seconds


def test_groups_an_earlier_run_timed_go_first_longest_first(tmp_path):
    cases = suites.cases("ci", suites.Filters(ops=("softmax.softmax",), backends=("cpu", "torch")))
    groups = group_cases(cases)
    slow, slower = groups[-1], groups[-2]
    lines = [json.dumps({"schema": "kernel-parity/results/2", "header": {"planned": None}})]
    for g, t in ((slow, 1.0), (slower, 3.0)):
        for rec in Runner(recheck=False).run(g):  # inputs and golden count once per group, then each record
            rec.timing = {"inputs_s": 1.0, "golden_s": 1.0, "total_s": t}
            lines.append(json.dumps(rec.to_json()))
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(lines) + "\n")
    seconds = measured_seconds(str(path))
    assert seconds[(slower[0].op, slower[0].dtype, slower[0].params_text, slower[0].dist, slower[0].seed)] == \
        2.0 + 3.0 * len(slower)
    ordered = largest_first(groups, seconds)
    assert ordered[0] == slower and ordered[1] == slow
    assert ordered[2:] == largest_first([g for g in groups if g not in (slow, slower)], {})


def test_a_schedule_that_is_not_a_results_file_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["run", "--suite", "smoke", "--schedule", str(bad)]) == 2
    assert "--schedule" in capsys.readouterr().err
