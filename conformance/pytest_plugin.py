"""pytest plugin: `pytest --parity-json PATH --parity-html PATH [--parity-junit PATH] [--parity-md PATH]`.

Tests check cases through the `parity` fixture; every result is collected and, when one of
the options is given, written at the end of the session as the same reports `parity run`
writes. Like pytest-html: the options always exist, the collector registers only when asked,
state lives in `config.stash`, and one summary line is printed at the end.

The fixture runs in the same session as the CLI (conformance/session.py): the repository's
`[tool.kernel-parity]` table, its backends and tolerance overrides, and the known failures
applied exactly as `parity gate` applies them (a listed failure is an xfail, a listed case that
passes fails). Under pytest-xdist (`pytest -n N`) each worker sends its records to the controller
(`workeroutput`), which merges them and writes the reports once.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernel_parity.conformance.results import CaseResult
from kernel_parity.reports import records

_COLLECTOR = pytest.StashKey["Collector"]()
_SESSION = pytest.StashKey[Any]()
_RUNNER = pytest.StashKey[Any]()
_OPTIONS = ("json", "html", "junit", "md")
_WORKER_KEY = "kernel_parity_records"


class ParityFailure(AssertionError):
    """A case that did not pass: the message is the framework's failure message with its repro line."""


class Collector:
    """Records of the cases checked in this session.

    Inside a Hypothesis test, records wait until the test ends: a passing test keeps every
    example; a failing one keeps the examples generated before its first failure and the final
    (shrunk) failing example, not the shrinking steps in between."""

    def __init__(self) -> None:
        self.results: dict[str, CaseResult] = {}  # by id: hypothesis may replay an example
        self.pending: list[tuple[CaseResult, bool]] | None = None  # (record, final example?) of the running test

    def add(self, rec: CaseResult, final: bool | None = None) -> None:
        if final is None or self.pending is None:
            self.results[rec.id] = rec
        else:
            self.pending.append((rec, final))

    def begin(self) -> None:
        self.pending = []

    def end(self) -> None:
        pending, self.pending = self.pending or [], None
        if any(final for _, final in pending):
            first_bad = next((i for i, (r, _) in enumerate(pending) if r.failing), len(pending))
            pending = pending[:first_bad] + [(r, f) for r, f in pending[first_bad:] if f]
        for rec, _ in pending:
            self.results[rec.id] = rec


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernel-parity", "kernel-parity reports")
    for what in _OPTIONS:
        group.addoption(f"--parity-{what}", metavar="PATH", default=None,
                        help=f"write the kernel-parity {what.upper()} report of the cases checked in this run")
    group.addoption("--parity-backend", metavar="MODULE:OBJECT", action="append", default=[],
                    help="make a third-party backend available to the `parity` fixture (repeatable)")
    group.addoption("--parity-known-failures", metavar="TOML", default=None,
                    help="this repository's known-failures file (default: [tool.kernel-parity] known_failures)")
    group.addoption("--parity-mutant", metavar="ID", default=None,
                    help="run against a seeded bug of our kernels (conformance/mutants; used by parity mutants --props)")
    group.addoption("--parity-mutant-root", metavar="DIR", default=None, help="where --parity-mutant's patched copy lives")


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    mutant = config.getoption("parity_mutant")
    if mutant:  # before any test module imports a kernel
        import tempfile

        from kernel_parity.conformance.mutants import install

        root = config.getoption("parity_mutant_root") or tempfile.mkdtemp(prefix="kp-mutant-")
        install(mutant, root)
    if any(config.getoption(f"parity_{w}") for w in _OPTIONS):
        if not _is_worker(config):  # a worker's records travel to the controller; only it writes
            files_check = {f"--parity-{w}": config.getoption(f"parity_{w}") for w in _OPTIONS}
            from kernel_parity.reports import files

            try:
                files.check_outputs(files_check)
            except files.OutputPathError as e:
                raise pytest.UsageError(str(e)) from None
        config.stash[_COLLECTOR] = Collector()
        if config.pluginmanager.hasplugin("xdist") and not _is_worker(config):
            config.pluginmanager.register(_XdistController(config), "kernel-parity-xdist")


class _XdistController:
    """Merges the records each xdist worker sends when it finishes."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        collector = self.config.stash.get(_COLLECTOR, None)
        payload = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
        if collector is None or not payload:
            return
        for d in payload:
            rec = CaseResult.from_json(d, f"xdist worker {getattr(node, 'gateway', None) and node.gateway.id}")
            collector.results[rec.id] = rec


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    collector = item.config.stash.get(_COLLECTOR, None)
    if collector is not None:
        collector.begin()
    global _CURRENT_DRAWS
    draws = _CURRENT_DRAWS = _Draws()
    try:
        return (yield)
    except Exception as e:
        why = draws.all_skipped()
        # Hypothesis gives up on a test that rejects every draw: Unsatisfiable, or a filter_too_much health check
        if why and type(e).__name__ in ("Unsatisfiable", "FailedHealthCheck"):
            pytest.skip(f"every case this test drew is one the backend does not run ({draws.runs} drawn): {why}")
        raise
    finally:
        _CURRENT_DRAWS = None
        if collector is not None:
            collector.end()


_CURRENT_DRAWS: _Draws | None = None


def note_draw(skipped: str | None) -> None:
    """Tell the running test's tally that one of its cases ran (None) or was one its backend does not run
    (the reason): property helpers that run kernels outside the `parity` fixture call it (runs.run)."""
    if _CURRENT_DRAWS is not None:
        _CURRENT_DRAWS.add(skipped)


class _Draws:
    """The verdicts of one test's cases: a test whose every case was a skip of its backend (a plugin that
    runs only some dtypes or shapes of an op: gluon's GEMM is FP8 only, a property drawn in fp32) is skipped
    with the backend's reason when Hypothesis gives up, not failed."""

    def __init__(self) -> None:
        self.runs = 0
        self.skips: dict[str, int] = {}

    def add(self, skipped: str | None) -> None:
        self.runs += 1
        if skipped is not None:
            self.skips[skipped] = self.skips.get(skipped, 0) + 1

    def all_skipped(self) -> str | None:
        """The commonest skip reason when every case drawn was a skip; None otherwise."""
        if not self.runs or sum(self.skips.values()) != self.runs:
            return None
        return max(self.skips, key=self.skips.__getitem__)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    collector = config.stash.get(_COLLECTOR, None)
    if collector is None:
        return
    results = [r.to_json() for r in collector.results.values()]
    if _is_worker(config):
        config.workeroutput[_WORKER_KEY] = results
        return
    from kernel_parity.conformance import env

    header = env.header("pytest " + " ".join(config.invocation_params.args), None)
    doc = {"schema": records.SCHEMA, "header": header, "results": results}
    if config.getoption("parity_json"):
        records.write(config.getoption("parity_json"), header, results)
    if config.getoption("parity_html"):
        from kernel_parity.reports import html

        html.write(config.getoption("parity_html"), doc)
    if config.getoption("parity_junit"):
        from kernel_parity.reports import junit

        junit.write(config.getoption("parity_junit"), doc)
    if config.getoption("parity_md"):
        from kernel_parity.reports import markdown

        markdown.write(config.getoption("parity_md"), doc)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    collector = config.stash.get(_COLLECTOR, None)
    if collector is None or _is_worker(config):
        return
    counts = records.summary([r.to_json() for r in collector.results.values()])
    parts = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    written = ", ".join(str(config.getoption(f"parity_{w}")) for w in _OPTIONS if config.getoption(f"parity_{w}"))
    terminalreporter.write_line(f"kernel-parity: {len(collector.results)} cases ({parts or 'none'}) -> {written}")


class Parity:
    """The `parity` fixture: check a case against its golden, record it, assert it passed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @property
    def session(self) -> Any:
        s = self.config.stash.get(_SESSION, None)
        if s is None:
            from kernel_parity.conformance.errors import UsageError
            from kernel_parity.conformance.session import open_session

            try:
                s = open_session(self.config.getoption("parity_backend"),
                                 self.config.getoption("parity_known_failures"))
            except UsageError as e:
                raise pytest.UsageError(str(e)) from None
            self.config.stash[_SESSION] = s
            self.config.stash[_RUNNER] = s.runner()
        return s

    @property
    def runner(self) -> Any:
        self.session  # noqa: B018  (opens the session on first use)
        return self.config.stash[_RUNNER]

    def evaluate(self, case: Any) -> CaseResult:
        """Run a case, apply the known failures as the CLI does, and record it (no assertion)."""
        from kernel_parity.conformance import known

        rec = self.runner.evaluate(case)
        known.apply_one(rec, self.session.entries)
        note_draw(rec.reason if rec.verdict == "skip" else None)
        collector = self.config.stash.get(_COLLECTOR, None)
        if collector is not None:
            collector.add(rec, _final_example())
        return rec

    def _require(self, case: Any) -> None:
        """Skip the whole test when its backend has no kernel for the op or cannot run on this
        machine at all (rejecting every draw instead would end in Hypothesis' Unsatisfiable)."""
        backend = self.runner.registry.get(case.backend)
        if isinstance(getattr(backend, "ops", None), dict) and case.op not in backend.ops:
            pytest.skip(f"{backend.name} has no kernel for {case.op}")
        why = _unavailable(backend)
        if why:
            pytest.skip(f"{backend.name} is unavailable: {why}")

    def arrays(self, case: Any) -> tuple[CaseResult, dict]:
        """Run and record a case; also return its arrays {"inputs", "golden", "outputs"}."""
        self._require(case)
        runner = self.runner
        runner.capture = {}
        try:
            rec = self.evaluate(case)
            return rec, runner.capture.get(case.id, {})
        finally:
            runner.capture = None

    def check(self, case: Any) -> CaseResult:
        """Run, record, steer hypothesis toward the worst error, and assert the verdict."""
        __tracebackhide__ = True
        self._require(case)
        rec = self.evaluate(case)
        _hypothesis_hooks(rec)
        if rec.verdict == "skip":
            pytest.skip(rec.reason)
        if rec.verdict == "xfail":
            pytest.xfail(rec.reason)
        assert_verdict(rec)
        return rec


def _unavailable(backend: Any) -> str | None:
    """The backend's `available()` reason (a hook that raises is that reason)."""
    try:
        return backend.available()
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        return f"available() raised {type(e).__name__}: {e}"


def _final_example() -> bool | None:
    """None outside a Hypothesis test; else whether this is the final (reported) example."""
    try:
        from hypothesis.control import current_build_context, currently_in_test_context
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return None
    if not currently_in_test_context():
        return None
    return bool(current_build_context().is_final)


def _hypothesis_hooks(rec: CaseResult) -> None:
    try:
        from hypothesis import assume, note, target
        from hypothesis.control import currently_in_test_context
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return
    if not currently_in_test_context():
        return
    note(f"case {rec.id}\n  repro: {rec.repro}")
    if rec.verdict == "skip":
        assume(False)  # an unsupported draw is rejected, not counted as a pass
    if rec.norm_err is not None:
        target(min(float(rec.norm_err), 1e6), label="normalised error")


def assert_verdict(rec: CaseResult) -> None:
    """Raise ParityFailure unless the case passed (vacuous, skip and xfail do not fail)."""
    __tracebackhide__ = True
    if rec.failing:
        body = rec.message or f"{rec.op}[{rec.backend}] {rec.verdict}: {rec.reason}"
        if "repro:" not in body:
            body += f"\n  repro: {rec.repro}"
        raise ParityFailure(f"{rec.verdict}: {rec.id}\n{body}")


@pytest.fixture(scope="session")
def parity(request: pytest.FixtureRequest) -> Parity:
    return Parity(request.config)
