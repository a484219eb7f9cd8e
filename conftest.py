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
