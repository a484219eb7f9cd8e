"""Session policy of kernel-parity's own test run (tests/ and property_tests/).

With PARITY_STRICT_SKIPS=1 (`make test` sets it) every skip is counted by reason at the end, and a
skip whose reason is not that this machine lacks a GPU (or cannot install Chromium) fails the run: in CI a test may skip only
where the machine cannot run the thing (the libggml peer is built by the test set-up; a missing
package or a skip by mistake must show as a failure, not as a quiet 's').
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

# what the machine cannot run: no GPU, or no Chromium where it cannot be installed (the browser test
# installs it with apt-get first); every other skip reason is a failure under the policy
GPU_ONLY = re.compile(r"CUDA|GPU|cuda|gpu|Hopper|sm_9|H100|H200|^chromium cannot be installed", re.I)


def _reason(rep) -> str:
    longrepr = rep.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PARITY_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reasons = Counter(_reason(r) for r in reporter.stats.get("skipped", []))
    bad = {r: n for r, n in reasons.items() if not GPU_ONLY.search(r)}
    lines = [f"skips: {sum(reasons.values())} ({len(reasons)} reasons); allowed only where the machine lacks a GPU"]
    lines += [f"  {n:4d} x {r[:160]}" for r, n in reasons.most_common()]
    if bad:
        lines.append(f"PARITY_STRICT_SKIPS: {sum(bad.values())} test(s) skipped for a reason other than a missing "
                     f"GPU: the run fails")
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config._parity_skip_lines = lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in getattr(config, "_parity_skip_lines", []):
        terminalreporter.write_line(line)


# Worker-seconds of the slowest files under `make test` (both workers busy, measured with --durations). xdist
# sends a worker one whole file at a time (--dist loadfile); by default it orders the files by their count of
# tests, which puts test_adopt's three tests of a minute, or test_executors' eighteen of three, wherever their
# count falls, and a late one leaves the other worker idle until it ends. With --no-loadscope-reorder (make
# test) the workers take the files in the order below: the slowest first, then the rest by count of tests as
# xdist would, so the run ends on files of seconds and both workers finish together. Any order is correct; only
# the wall time depends on it, so a stale entry costs seconds, never a result.
SLOW_FILES = {
    "tests/test_executors.py": 140,
    "tests/test_gluon.py": 110,
    "tests/test_plugin.py": 85,
    "property_tests/test_attention_bwd.py": 85,
    "tests/test_cli.py": 80,
    "property_tests/test_attention.py": 80,
    "property_tests/test_blocks.py": 50,
    "tests/test_mla_triton.py": 50,
    "tests/test_gate_baseline.py": 50,
    "tests/test_gate.py": 50,
    "tests/test_robustness.py": 50,
    "tests/test_mutants.py": 45,
    "tests/test_gemm_mmq.py": 45,
    "tests/test_adopt.py": 45,
    "property_tests/test_gemm.py": 45,
    "tests/test_gemm_triton.py": 40,
    "tests/test_sampling.py": 35,
    "property_tests/test_kvquant_prefill.py": 32,
    "tests/test_gemm_q8.py": 30,
    "property_tests/test_mla.py": 28,
    "tests/test_changes.py": 20,
    "tests/test_config.py": 20,
    "tests/test_reports.py": 20,
    "property_tests/test_kvquant_mla_dense.py": 18,
    "tests/test_bisect_shrink.py": 17,
    "tests/test_bench_gemm_bwd_script.py": 16,
    "property_tests/test_kvquant_mla.py": 16,
    "tests/test_metrics_fast.py": 16,
    "tests/test_new_user.py": 16,
    "property_tests/test_combine.py": 15,
    "property_tests/test_moe_experts_ggml.py": 14,
    "property_tests/test_norm.py": 14,
    "tests/test_bench_stream.py": 14,
    "property_tests/test_moe_experts.py": 14,
    "tests/test_attention_framework.py": 13,
    "property_tests/test_rope.py": 12,
    "property_tests/test_softmax.py": 12,
    "property_tests/test_kvquant_split.py": 11,
    "tests/test_mla_fused.py": 11,
}


def pytest_collection_modifyitems(session, config, items):
    """In an xdist worker (whose collection the controller schedules): the files slowest first (SLOW_FILES),
    each file's tests in their own order."""
    if not hasattr(config, "workerinput"):
        return
    count = Counter(item.nodeid.split("::", 1)[0] for item in items)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return -SLOW_FILES.get(path, 0), -count[path], first[path]

    items.sort(key=key)
