"""--executor ray and --devices (conformance/executors.py): the records of a Ray run are a local run's,
a Ray worker killed mid-run loses no case, and a flag that cannot be honoured is exit 2 with one line.

The Ray tests share one local cluster on CPU (started once for the module; Ray's start-up is slow).
The backend below runs in an isolated worker whose parent is a Ray worker process, and kills that
parent: the way a node or a worker dies on a real cluster.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kernel_parity.conformance import executors, suites
from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parent.parent
HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray is not installed")

# a few hundred fast cases over five op families, among them float64 and float32 reductions whose
# last bits depend on the worker's thread count (gemm backward, the kv cache, the MLP block backward)
SELECTION = ["--suite", "ci", "--op", "softmax.*", "--op", "combine.*", "--op", "gemm.gemm_nt_backward",
             "--op", "rope.kv_update", "--backend", "cpu", "--dtype", "fp32", "--no-progress", "-q"]
SOFTMAX_CI = ["--suite", "ci", "--op", "softmax.softmax", "--dtype", "fp32", "--dist", "normal", "--no-progress", "-q"]
N_SOFTMAX_CI = len(suites.cases("ci", suites.Filters(ops=("softmax.softmax",), backends=("cpu",), dtypes=("fp32",),
                                                     dists=("normal",))))
KILL_ONCE_N, KILL_ALWAYS_N = 17, 239  # softmax.softmax ci cases (params n) whose kernel kills its Ray worker


def _softmax(inputs, out):
    """A correct softmax of the case's x into its y (the test backends' own work)."""
    x = inputs["x"].astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    y = out.numpy("y")
    y[...] = (e / e.sum(axis=-1, keepdims=True)).astype(y.dtype)
    return {"y": y}


# -- a backend that kills the Ray worker running it -------------------------------------------------------
def _kill_ray_worker() -> None:
    parent = os.getppid()
    cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ")
    if b"ray::" not in cmdline and b"default_worker" not in cmdline:  # never the test process itself
        raise RuntimeError(f"not run under a Ray worker: parent {parent} is {cmdline[:80]!r}")
    os.kill(parent, signal.SIGKILL)
    time.sleep(60)  # mid-case when its Ray worker dies; executors.worker_setup's watch ends this process


def _kills(case, inputs, out):
    n = case.p["n"]
    marker = Path(os.environ["KP_TEST_RAY_DIR"]) / f"killed-n{n}"
    if n == KILL_ALWAYS_N or (n == KILL_ONCE_N and not marker.exists()):
        with marker.open("a") as f:
            f.write("x")
        _kill_ray_worker()
    return _softmax(inputs, out)


KILLS_RAY_WORKER = Backend(name="np_kills_ray_worker", device="cpu", ops={"softmax.softmax": _kills},
                           doc="test backend: kills its Ray worker on two cases")


def _spy(case, inputs, out):
    """A correct softmax that notes which GPU its worker was given (CUDA_VISIBLE_DEVICES)."""
    with open(Path(os.environ["KP_TEST_DEVICES_DIR"]) / str(os.getpid()), "a") as f:
        f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + "\n")
    return _softmax(inputs, out)


DEVICE_SPY = Backend(name="np_device_spy", device="cpu", ops={"softmax.softmax": _spy},
                     doc="test backend: notes each worker's CUDA_VISIBLE_DEVICES")


STALL_N = 239  # the softmax.softmax ci case whose kernel stalls on its first Ray node (the test removes that node)


def _node_spy(case, inputs, out):
    """A correct softmax that notes the Ray node (its raylet's pid) each case ran on; on a cluster the
    case STALL_N stalls the first time, after saying where, until the test removes its node."""
    shared, node = Path(os.environ["KP_TEST_NODES_DIR"]), os.environ.get("RAY_RAYLET_PID", "local")
    with open(shared / f"ran-{node}", "a") as f:
        f.write(case.id + "\n")
    if case.p["n"] == STALL_N and node != "local" and not (shared / "stalled").exists():
        tmp = shared / f"stalled-{node}.tmp"  # written whole, then renamed: the test reads it once it exists
        tmp.write_text(node)
        os.replace(tmp, shared / "stalled")
        time.sleep(120)  # ended with its node: executors.worker_setup's watch sees its Ray worker go
    return _softmax(inputs, out)


NODE_SPY = Backend(name="np_node_spy", device="cpu", ops={"softmax.softmax": _node_spy},
                   doc="test backend: notes each case's Ray node; one case stalls on its first node")


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster (2 CPUs) for the module; this process is its driver. Yields its address."""
    if not HAS_RAY:
        pytest.skip("ray is not installed")
    import ray

    shared = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as mp:  # the raylet and every worker inherit these
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        mp.setenv("KP_TEST_RAY_DIR", str(shared))
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def _comparable(path: Path) -> dict[str, dict]:
    """id -> record, less the wall-clock timings (the only field two runs of one case may differ in)."""
    doc = records.load(path)
    assert doc["complete"] is not None, f"{path}: the run did not finish"
    return {r["id"]: {k: v for k, v in r.items() if k != "timing"} for r in doc["results"]}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """SELECTION run locally on two workers, the records (_comparable) that the Ray run, the `--address local`
    run and the golden cache's runs are compared with: their selections are parts of it (SOFTMAX_CI and the
    LSE combine's backward, cpu), and a case's record does not depend on what else its run selected (each
    input group runs alone), so one local run serves the three tests (two runs and four workers fewer)."""
    from kernel_parity.conformance import golden_cache

    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(golden_cache.ENV, raising=False)
        assert main(["run", *SELECTION, "--jobs", "2", "--json", str(out)]) == 0
    return _comparable(out)


def _part(recs: dict[str, dict], *ops: str) -> dict[str, dict]:
    """The records of a SOFTMAX_CI-filtered run (fp32, normal, cpu) of these ops, out of local_run's."""
    return {i: r for i, r in recs.items() if r["op"] in ops and r["dist"] == "normal" and r["dtype"] == "fp32"
            and r["backend"] == "cpu"}


def _cli(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernel_parity.conformance.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# -- tests ------------------------------------------------------------------------------------------------
@needs_ray
def test_ray_run_on_a_local_cluster_gives_the_records_of_a_local_run(cluster, local_run, tmp_path):
    on_ray = tmp_path / "ray.jsonl"
    # a separate driver process connecting to the cluster by its address, as `parity run` on a laptop would
    done = _cli("run", *SELECTION, "--jobs", "2", "--executor", "ray", "--address", cluster, "--json", str(on_ray))
    assert done.returncode == 0, done.stderr
    a, b = local_run, _comparable(on_ray)
    assert len(a) >= 200 and len({i.split("/")[0].split(".")[0] for i in a}) >= 4
    assert sorted(b) == sorted(a)
    differ = [i for i in a if a[i] != b[i]]
    assert not differ, f"{len(differ)} of {len(a)} records differ from the local run's, first: {differ[0]}\n" \
                       f"  local: {json.dumps(a[differ[0]])[:400]}\n  ray:   {json.dumps(b[differ[0]])[:400]}"


@needs_ray
def test_address_local_starts_a_cluster_for_the_run_and_shuts_it_down(local_run, tmp_path):
    """`--address local`: a new cluster for this run alone (not the module's), gone when the run ends."""
    on_ray = tmp_path / "ray.jsonl"
    argv = [*SOFTMAX_CI, "--backend", "cpu", "--jobs", "2"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    done = _cli("run", *argv, "--executor", "ray", "--address", "local", "--json", str(on_ray), env=env)
    assert done.returncode == 0, done.stderr
    a, b = _part(local_run, "softmax.softmax"), _comparable(on_ray)
    assert len(a) == N_SOFTMAX_CI and a == b
    head = records.load(on_ray)["header"]["executor"]
    assert head == {"kind": "ray", "address": "local", "jobs": 2}


@needs_ray
def test_a_killed_ray_worker_loses_no_case(cluster, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    marker_dir = Path(os.environ.get("KP_TEST_RAY_DIR") or "")
    not_quiet = [a for a in SOFTMAX_CI if a != "-q"]  # the lost workers are told on stderr
    code = main(["run", *not_quiet, "--backend", "tests.test_executors:KILLS_RAY_WORKER", "--executor", "ray",
                 "--jobs", "2", "--timeout", "120", "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err  # the case that kills every Ray worker running it is a crash
    doc = records.load(out)
    assert doc["complete"] is not None
    by_n = {}
    for r in doc["results"]:
        by_n.setdefault(r["params"]["n"], []).append(r)
    assert len(doc["results"]) == N_SOFTMAX_CI and all(len(rs) == 1 for rs in by_n.values())
    once, always = by_n[KILL_ONCE_N][0], by_n[KILL_ALWAYS_N][0]
    assert marker_dir.joinpath(f"killed-n{KILL_ONCE_N}").read_text() == "x"  # it did kill a worker, once
    assert once["verdict"] == "pass"  # and was run again on another
    assert marker_dir.joinpath(f"killed-n{KILL_ALWAYS_N}").read_text() == "x" * executors.LOST_LIMIT
    assert always["verdict"] == "crash"
    assert f"its Ray worker died {executors.LOST_LIMIT} times" in always["reason"]
    rest = [r for n, rs in by_n.items() if n not in (KILL_ONCE_N, KILL_ALWAYS_N) for r in rs]
    assert rest and {r["verdict"] for r in rest} == {"pass"}
    assert f"lost the worker running {once['id']}" in err


def test_devices_run_one_worker_per_gpu_with_the_records_of_a_local_run(tmp_path, monkeypatch):
    """Two GPUs as CUDA would number them, on a machine with none: each worker is started with its
    CUDA_VISIBLE_DEVICES (which a CPU kernel ignores), so the path runs in CI without a GPU."""
    monkeypatch.setattr(executors, "visible_gpus", lambda: ["0", "1"])
    spied = tmp_path / "spy"
    spied.mkdir()
    monkeypatch.setenv("KP_TEST_DEVICES_DIR", str(spied))
    argv = ["run", *SOFTMAX_CI, "--backend", "cpu", "--backend", "tests.test_executors:DEVICE_SPY"]
    local, on_devices = tmp_path / "local.jsonl", tmp_path / "devices.jsonl"
    assert main([*argv, "--jobs", "2", "--json", str(local)]) == 0
    for f in spied.iterdir():
        f.unlink()
    assert main([*argv, "--devices", "all", "--json", str(on_devices)]) == 0
    a, b = _comparable(local), _comparable(on_devices)
    assert len(a) == 2 * N_SOFTMAX_CI and a == b
    seen = {f.name: set(f.read_text().split()) for f in spied.iterdir()}
    assert all(len(devices) == 1 for devices in seen.values()), seen  # a worker keeps its one GPU
    assert set().union(*seen.values()) == {"0", "1"}, seen  # one worker on each
    head = json.loads(on_devices.read_text().splitlines()[0])["header"]["executor"]
    assert head["kind"] == "devices" and head["devices"] == ["0", "1"] and head["workers"] == 2
    assert json.loads(local.read_text().splitlines()[0])["header"]["executor"] == {"kind": "local", "jobs": 2}


def _usage_error(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("parity: error: "), (code, err)
    return err


@pytest.mark.parametrize("flags, says", [
    (["--address", "127.0.0.1:6379"], "add --executor ray"),
    (["--executor", "ray", "--devices", "all"], "drop --devices"),
    (["--devices", "0,0"], "names a GPU twice"),
    (["--executor", "ray", "--no-isolate"], "cannot be combined with --executor ray"),
])
def test_executor_flags_that_cannot_be_honoured_are_one_line_exit_2(flags, says, capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    assert says in _usage_error(["run", *SOFTMAX_CI, *flags, "--json", str(out)], capsys)
    assert not out.exists()  # nothing written, nothing run


@pytest.mark.skipif(executors.gpu_count() > 0, reason="this machine has a GPU")
def test_devices_all_without_a_gpu_is_one_line_exit_2(capsys):
    assert "this machine has no CUDA GPU" in _usage_error(["run", *SOFTMAX_CI, "--devices", "all"], capsys)


def test_executor_ray_without_ray_installed_is_one_line_exit_2(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    err = _usage_error(["run", *SOFTMAX_CI, "--executor", "ray"], capsys)
    assert "--executor ray needs the ray package: pip install 'kernel-parity[ray]'" in err


@needs_ray
def test_an_unreachable_address_is_one_line_exit_2():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = _cli("run", *SOFTMAX_CI, "--executor", "ray", "--address", f"127.0.0.1:{port}", env=env, timeout=60)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, done.stderr
    assert f"--address 127.0.0.1:{port}: no Ray cluster answers there" in err


def test_groups_are_scheduled_largest_first_and_keep_their_order_on_ties():
    from kernel_parity.conformance.case import Case
    from kernel_parity.conformance.runner import group_cases, largest_first

    def c(backend, **p):
        return Case.make("softmax.softmax", backend, "fp32", p, "normal", 0)

    cases = [c("cpu", rows=2, cols=8), c("torch", rows=2, cols=8), c("cpu", rows=64, cols=512, causal=True),
             c("cpu", rows=4, cols=4, wl=-1), c("cpu", rows=16, cols=1)]
    order = [[x.p for x in g] for g in largest_first(group_cases(cases))]
    # 64*512 first; 2*8 = 4*4 = 16*1 tie (negative and boolean parameters ignored) and keep their order
    assert [g[0] for g in order] == [dict(rows=64, cols=512, causal=True), dict(rows=2, cols=8),
                                     dict(rows=4, cols=4, wl=-1), dict(rows=16, cols=1)]
    assert len(order[1]) == 2  # a group stays whole


def test_mutants_over_devices_kill_as_local_workers_do(tmp_path, monkeypatch, capsys):
    """`parity mutants --devices`: each mutant's cases spread over the GPUs (faked here: CPU kernels
    ignore CUDA_VISIBLE_DEVICES), stopping at the first failure, in the suite's order as locally.
    Two C mutants of kernels/cpu/kvcache.c: a mutants run builds its patched C source once (a fresh
    cache each run), and kvcache.c builds in 0.2 s where softmax.c takes 8 s (4 builds: 33 s of this test)."""
    monkeypatch.setattr(executors, "visible_gpus", lambda: ["0", "1"])
    spread_runs = []
    real = executors._run_devices
    monkeypatch.setattr(executors, "_run_devices", lambda devices, *a: spread_runs.append(devices) or real(devices, *a))
    argv = ["mutants", "--mutant", "c-kvcache-write-offset,c-kvcache-paged-slot-relative", "-q"]
    local, spread = tmp_path / "local.json", tmp_path / "devices.json"
    assert main([*argv, "--json", str(local)]) == 0
    assert main([*argv, "--devices", "all", "--jobs", "1", "--json", str(spread)]) == 0
    rows = [{r["id"]: (r["status"], r["by"]) for r in json.loads(p.read_text())["mutants"]} for p in (local, spread)]
    assert rows[0] == rows[1] == {"c-kvcache-write-offset": ("killed", "gate"),
                                  "c-kvcache-paged-slot-relative": ("killed", "gate")}
    assert spread_runs == [("0", "1")] * 2  # each mutant's gate ran over both (fake) GPUs


def test_mutants_devices_without_a_gpu_is_one_line_exit_2(capsys):
    assert main(["mutants", "--mutant", "c-softmax-no-max", "--devices", "all"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


def test_the_golden_cache_gives_the_records_of_a_run_without_it(local_run, tmp_path, monkeypatch):
    """--golden-cache DIR: the first run writes each input group's inputs and goldens, a second run
    reads them (its timings say so) and writes the same records (a run without the cache: local_run's);
    a corrupt entry is a miss, and a changed golden source is another key, never a stale golden."""
    from kernel_parity.conformance import golden_cache

    monkeypatch.delenv(golden_cache.ENV, raising=False)
    cache = tmp_path / "cache"
    argv = ["run", *SOFTMAX_CI, "--backend", "cpu", "--op", "combine.lse_combine_backward", "--jobs", "2"]
    first, second, third = (tmp_path / f"{n}.jsonl" for n in ("first", "second", "third"))
    assert main([*argv, "--golden-cache", str(cache), "--json", str(first)]) == 0
    entries = sorted(cache.glob("*.pkl"))
    assert entries and not list(cache.glob(".tmp-*"))
    assert golden_cache.ENV not in os.environ  # restored after the command
    assert main([*argv, "--golden-cache", str(cache), "--json", str(second)]) == 0
    a = _part(local_run, "softmax.softmax", "combine.lse_combine_backward")
    b, c = _comparable(first), _comparable(second)
    assert a == b == c and len(a) > N_SOFTMAX_CI
    timings = [r["timing"] for r in records.load(second)["results"]]
    assert all("cache_read_s" in t and t["golden_s"] == 0.0 for t in timings)
    entries[0].write_bytes(b"not a pickle")  # unreadable: recomputed and rewritten, never an error
    assert main([*argv, "--golden-cache", str(cache), "--json", str(third), "--no-isolate"]) == 0
    assert _comparable(third) == a and entries[0].read_bytes()[:1] == b"\x80"  # a pickle again
    monkeypatch.setattr(golden_cache, "_op_digest", lambda spec: "another source")  # in-process run only
    assert main([*argv, "--golden-cache", str(cache), "--json", str(third), "--no-isolate"]) == 0
    assert _comparable(third) == a
    assert len(list(cache.glob("*.pkl"))) == 2 * len(entries)  # a new key per group: nothing stale read


def test_the_golden_cache_never_fills_its_disk(tmp_path, monkeypatch):
    from kernel_parity.conformance import golden_cache

    monkeypatch.setattr(golden_cache, "KEEP_FREE", 1 << 62)  # more than any disk has free
    out = tmp_path / "r.jsonl"
    assert main(["run", *SOFTMAX_CI, "--backend", "cpu", "--golden-cache", str(tmp_path / "c"), "--no-isolate",
                 "--json", str(out)]) == 0
    assert not list((tmp_path / "c").glob("*"))  # nothing written, and the run is as without a cache


def _blas_threads_are(n: int) -> None:
    """A worker's setup hook (parallel.py's `setup`): raises unless the worker was spawned with n BLAS
    threads: its environment at start holds OMP_NUM_THREADS=n and, where NumPy bundles OpenBLAS, the
    library itself runs n threads."""
    import ctypes
    import glob

    start = dict(kv.split("=", 1) for kv in Path("/proc/self/environ").read_text().split("\0") if "=" in kv)
    if start.get("OMP_NUM_THREADS") != str(n) or start.get("OPENBLAS_NUM_THREADS") != str(n):
        raise RuntimeError(f"worker spawned with OMP_NUM_THREADS={start.get('OMP_NUM_THREADS')}, want {n}")
    libs = glob.glob(str(Path(np.__file__).parent.parent / "numpy.libs" / "libscipy_openblas*.so"))
    if libs:
        lib = ctypes.CDLL(libs[0])
        got = next((getattr(lib, f)() for f in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads")
                    if hasattr(lib, f)), n)
        if got != n:
            raise RuntimeError(f"worker's OpenBLAS runs {got} threads, want {n}")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a worker's start environment from /proc")
def test_workers_are_spawned_with_their_share_of_the_cores_as_blas_threads(monkeypatch):
    """NumPy's BLAS reads its thread count once, as a spawned worker unpickles its target: the variables
    must be in the environment the worker starts with (with 32 BLAS threads in each of 16 workers on a
    32-core host, the float64 goldens ran 10x slower)."""
    from kernel_parity.conformance import parallel
    from kernel_parity.conformance.suites import Filters

    for var in parallel.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(parallel, "_cores", lambda: 2)  # 1 thread each: OpenBLAS alone would take every core
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cases = suites.cases("ci", Filters(ops=("softmax.softmax",), backends=("cpu",)))[:2]
    recs = parallel.run_isolated(cases, jobs=2, extra_backends=[], setup=(Path(__file__).stem, "_blas_threads_are", 1))
    assert len(recs) == len(cases) and all(r.verdict == "pass" for r in recs)
    assert all(var not in os.environ for var in parallel.THREAD_VARS)  # the parent's own environment is restored


@needs_ray
def test_ray_over_several_nodes_spreads_the_groups_and_a_lost_node_loses_no_case(tmp_path, monkeypatch):
    """A cluster of a head without CPUs and two one-CPU nodes (separate raylets: Ray's own way to test
    several nodes on one machine): the run's case groups go to both nodes; the node running the
    stalled case is removed mid-case (its raylet and workers killed), its unfinished cases go to the
    other node, and the records are a local run's, none lost or doubled."""
    from ray.cluster_utils import Cluster

    shared = tmp_path / "nodes"
    shared.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("KP_TEST_NODES_DIR", str(shared))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = [*SOFTMAX_CI, "--backend", "tests.test_executors:NODE_SPY", "--jobs", "2"]
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["run", *argv, "--json", str(local)]) == 0
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        loud = [a for a in argv if a != "-q"]  # the lost worker is told on stderr
        run = subprocess.Popen([sys.executable, "-m", "kernel_parity.conformance.cli", "run", *loud,
                                "--executor", "ray", "--address", cluster.address, "--timeout", "300",
                                "--json", str(on_ray)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (shared / "stalled").exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (shared / "stalled").exists(), "the stalling case never ran on the cluster"
        pid = int((shared / "stalled").read_text())
        (node,) = [n for n in cluster.list_all_nodes() if n.all_processes["raylet"][0].process.pid == pid]
        cluster.remove_node(node, allow_graceful=False)
        _, err = run.communicate(timeout=240)
    finally:
        cluster.shutdown()
    assert run.returncode == 0, err
    a, b = _comparable(local), _comparable(on_ray)
    assert len(a) == N_SOFTMAX_CI and a == b  # every case once, each the local run's record
    nodes = {f.name[4:]: f.read_text().split() for f in shared.glob("ran-*") if f.name != "ran-local"}
    assert len(nodes) == 2 and all(nodes.values())  # both nodes ran cases
    stalled = next(i for i in a if a[i]["params"]["n"] == STALL_N)
    assert stalled in nodes[str(pid)] and any(stalled in ids for n, ids in nodes.items() if n != str(pid))
    assert f"lost the worker running {stalled}" in err
