"""Run cases in worker processes: parallel, and isolated from crashes, exits and hangs.

Each worker evaluates whole input groups and reports every case as it starts and as soon as it
ends. If a worker dies (segfault, abort, exit(0) or any exit inside a kernel) the case it was
running is recorded as `crash`; if a case runs past `timeout` seconds (inputs and golden
included) the worker is killed and the case is a `timeout`. Either way the rest of that group
goes to a fresh worker and every completed result is kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Callable

from kernel_parity.conformance.case import Case
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.runner import dead_record, group_cases, largest_first

_POLL_S = 0.5


class WorkerSetupError(RuntimeError):
    """A worker's setup (e.g. installing a mutant) failed: no case result would mean anything."""


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def spawn_env(threads: int):
    """The thread variables a worker must be spawned with (the parent's own values win): NumPy's BLAS
    reads them once, when it loads, and a spawned worker loads NumPy while it unpickles its target,
    before any of its own code runs. Set only inside the worker, they came too late: each of 16 workers
    on a 32-core host ran OpenBLAS on 32 threads, and the float64 goldens ran 10x slower than alone."""
    saved = {var: os.environ.get(var) for var in THREAD_VARS}
    if threads:
        for var in THREAD_VARS:
            os.environ.setdefault(var, str(threads))
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _worker_main(conn, extra_backends: list[str], options: dict, threads: int, setup: tuple | None) -> None:
    if threads:  # cores / workers: BLAS and torch threads must not oversubscribe the cores (see spawn_env)
        for var in THREAD_VARS:
            os.environ.setdefault(var, str(threads))
    import warnings

    # NaN and inf from a wrong kernel are the verdict's business, not a warning on stderr
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    if setup is not None:  # e.g. a mutant's patched kernels, installed before anything imports them
        import importlib
        import traceback

        mod, fn, *args = setup
        try:
            getattr(importlib.import_module(mod), fn)(*args)
        except Exception as e:  # the run cannot mean anything: tell the parent, never pass for a crash
            conn.send(("fatal", f"worker setup {mod}.{fn} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.backends import Registry
    from kernel_parity.conformance.runner import Runner

    runner = Runner(Registry(extra=extra_backends), **options)
    while True:
        try:
            ids = conn.recv()
        except EOFError:
            return
        if ids is None:
            return
        cases = [ops.parse_case(i) for i in ids]
        runner.evaluate_group(cases, on_start=lambda c: conn.send(("start", c.id)),
                              on_result=lambda rec: conn.send(("result", rec)))
        _release_device_memory()
        conn.send(("done", None))


def _release_device_memory() -> None:
    """Workers share one GPU: a worker keeps no cached GPU memory between case groups, so one
    case's freed tensors never leave another worker's case out of memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _Worker:
    def __init__(self, ctx, extra_backends: list[str], options: dict, threads: int, setup: tuple | None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, extra_backends, options, threads, setup),
                                daemon=True)
        with spawn_env(threads):
            self.proc.start()
        child.close()
        self.group: list[str] = []  # ids sent and not yet returned
        self.current: str | None = None
        self.started = 0.0

    def send(self, ids: list[str]) -> None:
        self.group = list(ids)
        self.current = None
        self.conn.send(ids)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _dead_record(case_id: str, verdict: str, reason: str, origin_by_backend: dict[str, str]) -> CaseResult:
    from kernel_parity.conformance import ops

    case = ops.parse_case(case_id)
    return dead_record(case, verdict, reason, origin_by_backend.get(case.backend))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "worker process stopped answering"
    if code < 0:
        try:
            return f"worker process died from signal {signal.Signals(-code).name}"
        except ValueError:
            return f"worker process died from signal {-code}"
    return f"worker process exited with code {code}"


def run_isolated(cases: list[Case], *, jobs: int, extra_backends: list[str], recheck: bool = True,
                 timeout: float | None = None, on_result: Callable[[CaseResult], None] | None = None,
                 origins: dict[str, str] | None = None, diagnose: bool = True,
                 setup: tuple | None = None, stop: Callable[[], bool] | None = None,
                 overrides: dict[str, tuple] | None = None, bench: bool = False,
                 largest: bool = False) -> list[CaseResult]:
    """Evaluate `cases` in `jobs` worker processes; `setup` = (module, function, *args) runs first
    in every worker (before any kernel is imported). When `stop()` turns true (checked after each
    record) the run ends early: the workers are killed and the records so far returned. `largest`:
    the biggest case groups go first (whole runs end sooner), else the cases' order (a run that stops at
    its first failure, such as a mutant's, reaches the small cases first)."""
    ctx = mp.get_context("spawn")
    groups = group_cases(cases)
    pending = [[c.id for c in g] for g in (largest_first(groups) if largest else groups)]
    results: dict[str, CaseResult] = {}
    origins = origins or {}
    threads = max(1, _cores() // jobs) if jobs > 1 else 0
    options = {"recheck": recheck, "diagnose": diagnose, "overrides": overrides or {}, "bench": bench}
    workers = [_Worker(ctx, extra_backends, options, threads, setup) for _ in range(min(jobs, len(pending)) or 1)]
    idle = list(workers)

    def record(rec: CaseResult) -> None:
        results[rec.id] = rec
        if on_result:
            on_result(rec)

    def replace(w: _Worker, verdict: str, reason: str) -> None:
        victim = w.current or (w.group[0] if w.group else None)
        rest = [i for i in w.group if i != victim]
        w.kill()
        workers.remove(w)
        if victim is not None:
            record(_dead_record(victim, verdict, reason, origins))
        if rest:
            pending.insert(0, rest)
        fresh = _Worker(ctx, extra_backends, options, threads, setup)
        workers.append(fresh)
        idle.append(fresh)

    try:
        while (pending or len(idle) < len(workers)) and not (stop is not None and stop()):
            while pending and idle:
                idle.pop().send(pending.pop(0))
            busy = [w for w in workers if w not in idle]
            ready = wait([w.conn for w in busy], timeout=_POLL_S)
            now = time.monotonic()
            for w in busy:
                if w.conn in ready:
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(1)
                        replace(w, "crash", _exit_reason(w.proc.exitcode))
                        continue
                    if kind == "fatal":
                        raise WorkerSetupError(payload.splitlines()[0])
                    if kind == "start":
                        w.current, w.started = payload, now
                    elif kind == "result":
                        w.group = [i for i in w.group if i != payload.id]
                        w.current = None
                        record(payload)
                    elif kind == "done":
                        w.group, w.current = [], None
                        idle.append(w)
                elif timeout and w.current and now - w.started > timeout:
                    replace(w, "timeout", f"ran longer than {timeout:g} s and was killed")
    finally:
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            w.kill()
    return [results[c.id] for c in cases if c.id in results]
