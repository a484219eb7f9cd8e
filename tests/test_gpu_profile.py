"""benchmarks/gpu_profile.py on a machine without a GPU: ncu's raw CSV parsed into the summary, and bad
arguments are exit 2 with one line (the profiles themselves need a GPU and ncu)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_profile  # noqa: E402

RAW = "\n".join([
    "==PROF== Disconnected from process 1",
    '"ID","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",'
    '"sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active","launch__registers_per_thread"',
    '"","","us","%","inst","inst","%","%","register/thread"',
    '"0","_attn_fwd","4,970.50","61.2","0.8","2.5","55.1","12.0","168"',
])


def test_raw_page_parses_into_the_summary():
    (k,) = gpu_profile.parse_raw(RAW)
    assert k["kernel"] == "_attn_fwd" and k["duration"] == 4970.5 and k["duration_unit"] == "us"
    assert k["sm_throughput_pct"] == 61.2 and k["registers"] == 168
    assert list(k["stalls_top"]) == ["barrier", "long_scoreboard"]  # ranked, largest first
    assert k["pipes_top"] == {"pipe_tensor_op_gmma_cycles_active": 55.1, "inst_executed_pipe_alu": 12.0}
    assert gpu_profile.parse_raw("==PROF== nothing profiled") == []


@pytest.mark.parametrize("argv, needle", [
    (["--targets", "attn-d128,nope"], "unknown target(s) nope"),
    (["--target", "nope"], "unknown target 'nope'"),
])
def test_bad_targets_are_exit_2_with_one_line(argv, needle):
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_every_target_is_listed():
    run = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and len(run.stdout.splitlines()) == len(gpu_profile.TARGETS)
