"""Where case groups run: this host's worker processes, one worker per GPU of this host, or a Ray
cluster.

    --executor local (default)    conformance/parallel.py: --jobs isolated worker processes
    --devices all | 0,1           one isolated worker per GPU of this host (--jobs N: N per GPU), each
                                  started with CUDA_VISIBLE_DEVICES naming its GPU; no Ray. A machine
                                  without a GPU is exit 2, not a quiet CPU run.
    --executor ray [--address A]  one Ray task per case group; Ray places them over the cluster

Whatever the executor, a case group runs in an isolated worker process exactly as the local path
runs it (parallel.py's worker: the same records, the same `crash` and `timeout` verdicts with the
same reasons), and each record reaches `on_result` in this process as its case finishes: the results
stream, `--resume` and the reports do not know which executor ran.

Ray: each task is a streaming generator. It runs its group in an isolated worker that its Ray worker
process keeps for the tasks after it (started once per Ray worker, not per group), and yields each
case as it starts and each record as it ends. Ray places every task (one CPU each, and on a cluster
with GPUs 1/--jobs of a GPU each); at most `_WINDOW_PER_CPU` tasks per cluster CPU are submitted at a
time. A task whose Ray worker died (its node lost, its process killed, Ray's memory monitor) is
submitted again with the cases it had not finished; the case that was running when its Ray worker
died LOST_LIMIT times is recorded as `crash`, never retried forever. The isolated worker gets the
driver's thread settings (parallel.py's per-worker count, the BLAS and OpenMP variables), not Ray's
OMP_NUM_THREADS=1: a reduction's last bits depend on its thread count. `--address` is probed first
(TCP, `_PROBE_S`): ray.init waits without end for a cluster that is not there.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.parallel import THREAD_VARS
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.runner import group_cases, largest_first

LOST_LIMIT = 3  # Ray worker deaths while one case runs before that case is a `crash`
_WINDOW_PER_CPU = 4  # Ray tasks in flight per cluster CPU; the others wait here, not in Ray's queue
_WATCH_S = 1.0  # how often an isolated worker checks that the process that started it is alive
_PROBE_S = 5.0  # seconds to wait for a TCP answer at --address before ray.init
_RAY_STARTED = False  # this process called ray.init (and so shuts Ray down after the run)


@dataclass(frozen=True)
class Executor:
    kind: str = "local"  # "local", "devices" or "ray"
    address: str | None = None  # ray: ray.init's address (None: Ray's own search, else a new local cluster)
    devices: tuple[str, ...] = ()  # devices: each worker's CUDA_VISIBLE_DEVICES


# -- choosing ----------------------------------------------------------------------------------------
def choose(args: Any) -> Executor:
    """The executor the run flags ask for; UsageError (exit 2, one line) before anything runs for a
    flag that cannot be honoured. `--executor ray` connects to (or starts) the cluster here."""
    kind = getattr(args, "executor", None) or "local"
    address = getattr(args, "address", None)
    devices = getattr(args, "devices", None)
    if address is not None and kind != "ray":
        raise UsageError(f"--address {address!r} names a Ray cluster: add --executor ray")
    if kind == "ray" and devices is not None:
        raise UsageError("--devices spreads case groups over this host's GPUs without Ray; with --executor ray "
                         "Ray gives each task its GPU: drop --devices")
    if getattr(args, "no_isolate", False) and (kind != "local" or devices is not None):
        raise UsageError(f"--no-isolate runs cases in this process: it cannot be combined with "
                         f"{'--executor ray' if kind == 'ray' else '--devices'}")
    if kind == "ray":
        ex = Executor("ray", address=None if address in (None, "auto") else address)
        _connect(ex.address)
        return ex
    if devices is not None:
        return Executor("devices", devices=pick_devices(devices))
    return Executor()


def describe(ex: Executor, jobs: int) -> dict:
    """Where a run's cases ran, for its results header: the executor, its workers and, for
    --devices, each worker GPU's name (a two-GPU run is told apart from a one-GPU run of the same host)."""
    if ex.kind == "devices":
        names = []
        for k in range(len(ex.devices)):
            try:
                import torch

                names.append(torch.cuda.get_device_name(visible_gpus().index(ex.devices[k])))
            except Exception:
                names.append(None)
        return {"kind": "devices", "devices": list(ex.devices), "gpus": names, "jobs_per_device": jobs,
                "workers": len(ex.devices) * max(1, jobs)}
    if ex.kind == "ray":
        return {"kind": "ray", "address": ex.address, "jobs": jobs}
    return {"kind": "local", "jobs": jobs}


def gpu_count() -> int:
    """CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applied); 0 without torch or a driver."""
    try:
        import torch
    except Exception:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def visible_gpus() -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each GPU this process sees, in CUDA's order (cuda:0 first):
    a worker given one of them sees that GPU and no other."""
    n = gpu_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(n)]
    return [e.strip() for e in env.split(",")][:n]  # CUDA stops at the first entry it cannot use


def pick_devices(text: str) -> tuple[str, ...]:
    """`--devices all` or `--devices 0,1` (indices as this process numbers its GPUs) -> the
    CUDA_VISIBLE_DEVICES entry each worker gets."""
    if text != "all":
        try:
            picked = [int(x) for x in text.split(",")]
        except ValueError:
            raise UsageError(f"--devices {text!r} must be 'all' or GPU indices such as 0,1") from None
        if len(set(picked)) != len(picked):
            raise UsageError(f"--devices {text!r} names a GPU twice")
    visible = visible_gpus()
    if not visible:
        raise UsageError(f"--devices {text}: this machine has no CUDA GPU (torch sees none); run without --devices")
    if text == "all":
        return tuple(visible)
    missing = [i for i in picked if not 0 <= i < len(visible)]
    if missing:
        raise UsageError(f"--devices {text}: there is no GPU {missing[0]} here ({len(visible)} visible: "
                         f"{', '.join(map(str, range(len(visible))))})")
    return tuple(visible[i] for i in picked)


def _connect(address: str | None) -> None:
    """ray.init once per process: `address` as Ray takes it ("local": a new cluster for this run;
    None: RAY_ADDRESS or a cluster started on this machine, else a new local one)."""
    global _RAY_STARTED
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--executor ray needs the ray package: pip install 'kernel-parity[ray]'")
    import ray

    if ray.is_initialized():  # a program that called ray.init itself keeps its connection
        return
    if address not in (None, "local"):
        _probe(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except Exception as e:  # no cluster at that address, a version mismatch, ...
        raise UsageError(f"--address {address or 'auto'}: cannot connect to the Ray cluster: "
                         f"{type(e).__name__}: {_first_line(e)}") from None
    _RAY_STARTED = True


def _probe(address: str) -> None:
    """UsageError unless something answers at `address`'s host:port: ray.init waits without end for a
    cluster that is not there."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r} must be host:port, ray://host:port, 'local' or 'auto'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
    except OSError as e:
        raise UsageError(f"--address {address}: no Ray cluster answers there ({e.strerror or e})") from None


# -- running -----------------------------------------------------------------------------------------
def run(args: Any, cases: list[Case], *, jobs: int, extra_backends: list[str], timeout: float | None = None,
        on_result: Callable[[CaseResult], None] | None = None, origins: dict[str, str] | None = None,
        setup: tuple | None = None, stop: Callable[[], bool] | None = None, largest: bool = True,
        **runner_options: Any) -> list[CaseResult]:
    """Run `cases` on the executor the flags in `args` choose; each record goes to `on_result` as its
    case finishes. `runner_options` (recheck, diagnose, overrides, ...) configure the workers' Runner,
    as run_isolated takes them. `stop()`, checked after each record, ends the run early (local and
    --devices); `largest`: the biggest case groups first, else the cases' order. Returns the records
    in case order."""
    ex = choose(args)
    if ex.kind == "local":
        from kernel_parity.conformance.parallel import run_isolated

        return run_isolated(cases, jobs=jobs, extra_backends=extra_backends, timeout=timeout, on_result=on_result,
                            origins=origins, setup=setup, stop=stop, largest=largest, **runner_options)
    if stop is not None and ex.kind == "ray":
        raise UsageError("--executor ray runs every case it is given: a run that stops at its first failure "
                         "(parity mutants) takes --devices or local workers")
    results: dict[str, CaseResult] = {}

    def record(rec: CaseResult) -> None:
        results[rec.id] = rec
        if on_result is not None:
            on_result(rec)

    options = {**runner_options, "overrides": runner_options.get("overrides") or {}}
    grouped = group_cases(cases)
    groups = [[c.id for c in g] for g in (largest_first(grouped) if largest else grouped)]
    if ex.kind == "devices":
        _run_devices(ex.devices, groups, jobs, list(extra_backends), options, timeout, origins or {}, setup, record,
                     stop)
    else:
        _run_ray(groups, jobs, list(extra_backends), options, timeout, origins or {}, setup, record,
                 quiet=bool(getattr(args, "quiet", False)))
    return [results[c.id] for c in cases if c.id in results]


def worker_setup(device: str | None, *setup: Any) -> None:
    """First thing in every isolated worker these executors start: pin its GPU (before anything
    initialises CUDA), leave when the process that started it is gone (a killed Ray worker must not
    leave its case running), then the run's own setup (a mutant's kernels)."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="parity-parent-watch", daemon=True).start()
    if setup:
        mod, fn, *rest = setup
        getattr(importlib.import_module(mod), fn)(*rest)


def _setup_for(device: str | None, setup: tuple | None) -> tuple:
    return (__name__, "worker_setup", device, *(setup or ()))


class _Isolated:
    """One isolated worker process (parallel.py's), kept from one case group to the next. `run(ids)`
    yields ("start", id) and ("result", record) as the local path records them: a case whose worker
    died or hung is its `crash` or `timeout` record, and the rest of its group goes to a fresh worker."""

    def __init__(self, extra_backends: list[str], options: dict, threads: int, setup: tuple) -> None:
        self._args = (extra_backends, options, threads, setup)
        self._ctx = mp.get_context("spawn")
        self._worker: Any = None
        self.closed = False

    def run(self, ids: list[str], timeout: float | None, origins: dict[str, str]) -> Iterator[tuple[str, Any]]:
        from kernel_parity.conformance.parallel import _POLL_S, WorkerSetupError, _dead_record, _exit_reason, _Worker

        pending, finished = list(ids), False
        try:
            while pending and not self.closed:
                if self._worker is None:
                    self._worker = _Worker(self._ctx, *self._args)
                w = self._worker
                w.send(pending)
                pending = []
                while True:
                    if w.conn.poll(_POLL_S):
                        try:
                            kind, payload = w.conn.recv()
                        except (EOFError, OSError):
                            w.proc.join(1)
                            lost = ("crash", _exit_reason(w.proc.exitcode))
                        else:
                            if kind == "fatal":
                                raise WorkerSetupError(payload.splitlines()[0])
                            if kind == "start":
                                w.current, w.started = payload, time.monotonic()
                            elif kind == "result":
                                w.group = [i for i in w.group if i != payload.id]
                                w.current = None
                            else:  # "done"
                                w.group, w.current = [], None
                                break
                            yield kind, payload
                            continue
                    elif timeout and w.current and time.monotonic() - w.started > timeout:
                        lost = ("timeout", f"ran longer than {timeout:g} s and was killed")
                    else:
                        continue
                    victim = w.current or (w.group[0] if w.group else None)
                    pending = [i for i in w.group if i != victim]
                    self._drop()
                    if victim is not None:
                        yield "result", _dead_record(victim, *lost, origins)
                    break
            finished = True
        finally:
            if not finished:  # stopped mid-group (an error, a cancelled task): its worker is mid-case
                self._drop()

    def _drop(self) -> None:
        w, self._worker = self._worker, None
        if w is not None:
            w.kill()

    def close(self) -> None:
        self.closed = True
        w, self._worker = self._worker, None
        if w is not None:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
            w.kill()


# -- one worker per GPU of this host -------------------------------------------------------------------
def _run_devices(devices: tuple[str, ...], groups: list[list[str]], jobs: int, extra_backends: list[str],
                 options: dict, timeout: float | None, origins: dict[str, str], setup: tuple | None,
                 record: Callable[[CaseResult], None], stop: Callable[[], bool] | None = None) -> None:
    """`jobs` workers per device, each fed by a thread from one queue of case groups; records are
    handed to `record` in this thread as they arrive. Once `stop()` is true (checked after each
    record) no group is started and the workers are closed (their cases in flight are dropped)."""
    from kernel_parity.conformance.parallel import _cores

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for g in groups:
        todo.put(g)
    events: queue.SimpleQueue = queue.SimpleQueue()
    n = min(len(devices) * jobs, len(groups)) or 1
    threads = max(1, _cores() // n) if n > 1 else 0
    workers = [_Isolated(extra_backends, options, threads, _setup_for(devices[k % len(devices)], setup))
               for k in range(n)]

    def serve(w: _Isolated) -> None:
        try:
            while not w.closed and not (stop is not None and stop()):
                try:
                    ids = todo.get_nowait()
                except queue.Empty:
                    return
                for kind, payload in w.run(ids, timeout, origins):
                    if kind == "result":
                        events.put(("result", payload))
        except BaseException as e:  # a worker's setup failed: the run stops with it
            events.put(("fatal", e))
        finally:
            events.put(("exit", None))

    feeders = [threading.Thread(target=serve, args=(w,), name=f"parity-device-{k}", daemon=True)
               for k, w in enumerate(workers)]
    for t in feeders:
        t.start()
    running = len(feeders)
    try:
        while running:
            try:
                kind, payload = events.get(timeout=_WATCH_S)
            except queue.Empty:
                continue
            if kind == "exit":
                running -= 1
            elif kind == "fatal":
                raise payload
            else:
                record(payload)
                if stop is not None and stop():
                    break
    finally:
        for w in workers:
            w.close()
        for t in feeders:
            t.join(5)


# -- Ray -------------------------------------------------------------------------------------------------
_KEPT: tuple[tuple, _Isolated] | None = None  # in a Ray worker process: its isolated worker, and for what


def ray_group(ids: list[str], extra_backends: list[str], options: dict, timeout: float | None,
              origins: dict[str, str], setup: tuple | None, threads: int,
              threads_env: dict[str, str | None]) -> Iterator[tuple[str, Any]]:
    """The Ray task of one case group (a streaming generator): ("start", id) and ("result", record)
    as the isolated worker kept by this Ray worker process runs the group. `threads` (parallel.py's
    per-worker thread count) and `threads_env` (the driver's BLAS and OpenMP thread variables, None:
    unset, in place of Ray's OMP_NUM_THREADS=1) are those of the local run: a reduction's last bits
    depend on its thread count, and the records must be the local run's."""
    global _KEPT
    key = (repr(extra_backends), repr(options), repr(setup), threads, repr(sorted(threads_env.items())),
           os.environ.get("CUDA_VISIBLE_DEVICES"))
    if _KEPT is None or _KEPT[0] != key:  # Ray may hand this process a task of another GPU or run
        if _KEPT is not None:
            _KEPT[1].close()
        for var, value in threads_env.items():  # read by NumPy's BLAS as the isolated worker imports it
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        _KEPT = (key, _Isolated(extra_backends, options, threads, _setup_for(None, setup)))
    yield from _KEPT[1].run(ids, timeout, origins)


@dataclass
class _Flight:
    """A submitted task: the cases it has not recorded yet, and the one it is running."""

    ids: list[str]
    current: str | None = None


def _run_ray(groups: list[list[str]], jobs: int, extra_backends: list[str], options: dict,
             timeout: float | None, origins: dict[str, str], setup: tuple | None,
             record: Callable[[CaseResult], None], quiet: bool = False) -> None:
    global _RAY_STARTED
    import ray

    from kernel_parity.conformance.parallel import WorkerSetupError, _cores, _dead_record

    try:
        total = ray.cluster_resources()
        gpus = 1.0 / jobs if total.get("GPU", 0) >= 1 else 0  # --jobs workers share one GPU, as locally
        task = ray.remote(ray_group).options(num_cpus=1, num_gpus=gpus, max_retries=0, num_returns="streaming",
                                             name="parity-group")
        window = max(2, int(_WINDOW_PER_CPU * total.get("CPU", 1)))
        if not quiet:
            print(f"parity: ray: {len(groups)} case groups over a cluster of {total.get('CPU', 0):g} CPUs and "
                  f"{total.get('GPU', 0):g} GPUs", file=sys.stderr)
        threads = max(1, _cores() // jobs) if jobs > 1 else 0  # as run_isolated gives its workers
        threads_env = {var: os.environ.get(var) for var in THREAD_VARS}
        waiting = list(groups)
        flying: dict[Any, _Flight] = {}
        lost: dict[str, int] = {}  # case id -> Ray worker deaths while it ran
        while waiting or flying:
            while waiting and len(flying) < window:
                ids = waiting.pop(0)
                gen = task.remote(ids, extra_backends, options, timeout, origins, setup, threads, threads_env)
                flying[gen] = _Flight(ids)
            ready, _ = ray.wait(list(flying), num_returns=1, timeout=_WATCH_S)
            for gen in ready:
                f = flying[gen]
                try:
                    kind, payload = ray.get(next(gen))
                except StopIteration:  # the task ended; a group it did not finish goes again
                    del flying[gen]
                    if f.ids:
                        waiting.insert(0, f.ids)
                    continue
                except ray.exceptions.RayTaskError as e:  # our code raised on the cluster
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, WorkerSetupError):
                        raise cause from None
                    raise UsageError(f"--executor ray: a case group's task failed on the cluster (does every node "
                                     f"have kernel-parity and the plugins installed?): "
                                     f"{type(cause or e).__name__}: {_first_line(cause or e)}") from None
                except ray.exceptions.RayError as e:  # its Ray worker or its node is gone
                    del flying[gen]
                    if not f.ids:
                        continue
                    victim = f.current or f.ids[0]
                    lost[victim] = lost.get(victim, 0) + 1
                    rest = f.ids
                    if lost[victim] >= LOST_LIMIT:
                        rest = [i for i in f.ids if i != victim]
                        record(_dead_record(victim, "crash", f"its Ray worker died {LOST_LIMIT} times while it ran "
                                                             f"(last: {type(e).__name__}: {_first_line(e)})", origins))
                    if rest:
                        waiting.insert(0, rest)
                    if not quiet:
                        print(f"parity: ray: lost the worker running {victim} ({type(e).__name__}, "
                              f"{lost[victim]} of {LOST_LIMIT}): {len(rest)} unfinished cases of its group go again",
                              file=sys.stderr)
                    continue
                if kind == "start":
                    f.current = payload
                else:
                    f.ids = [i for i in f.ids if i != payload.id]
                    f.current = None
                    record(payload)
    finally:
        if _RAY_STARTED:
            _RAY_STARTED = False
            ray.shutdown()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""

