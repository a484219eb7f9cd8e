"""Performance beside accuracy: `parity bench` (and `parity gate --bench`).

Each selected case is judged as in `parity run`, then its kernel is timed on the same inputs:

- on a CUDA device, `triton.testing.do_bench` (25 warm-up, 100 ms of repetitions, median; it clears
  L2 between calls); on the CPU a steady-state timer: one warm call, then calls until 0.25 s (at least
  5, at most 200), median. The inputs are moved to the device once and the output buffers allocated
  once (no poison fill between calls: a bench times the kernel, the judge already checked it);
  a kernel that writes into its inputs (a cache) keeps writing into the same copies. A backend may
  split a call (`Backend.timed`): untimed set-up, then the timed part alone (liger's backward ops:
  the forward once, then autograd.grad with retain_graph); the record's perf["timed"] says so.
- bytes moved = every input read once + every output written once (the memory-bound floor; an op may
  declare its own `OpSpec.bytes_moved`, e.g. a decode that reads a cache only up to each length), and
  the matmul work `OpSpec.flops(params)` where the op declares it.
- the ceilings are measured once per run on the device the cases run on: copy (bytes read + written
  of a large device-to-device copy), read (a large reduction) and the matmul rate (fp32 on a CPU, bf16
  on a GPU). A case is compute-bound when its flops take longer at the matmul rate than its bytes at
  the copy rate; else read-bound when it writes under a tenth of what it reads, else copy-bound. Its
  record's `perf` holds ms, bytes, flops, GB/s, TFLOP/s, the bound, that ceiling and the share of it,
  and per peer backend of the same inputs (the other backends of the run) its ms and the ratio
  peer ms / this ms.
- as each record lands, `parity bench` prints its line (`Lines`): the case, verdict, norm_err, ms,
  throughput and share of the ceiling, and once its input group is complete each peer's ms over ours.
A gate against a baseline taken on the same device fails a case whose time grew past `--slowdown`
(reports/diff.py). Timings are measurements, never asserted by a test.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

CPU_MIN_S, CPU_MIN_CALLS, CPU_MAX_CALLS = 0.25, 5, 200
MIB = 1 << 20


def is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def time_call(fn: Callable[[], Any], device: Any) -> float:
    """Median milliseconds of fn() (module docstring)."""
    if is_cuda(device):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < CPU_MAX_CALLS and (len(times) < CPU_MIN_CALLS or time.perf_counter() - start < CPU_MIN_S):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_gbps: float
    read_gbps: float
    matmul_tflops: float
    matmul_dtype: str

    def to_json(self) -> dict:
        return {"device": self.device, "copy_gbps": self.copy_gbps, "read_gbps": self.read_gbps,
                "matmul_tflops": self.matmul_tflops, "matmul_dtype": self.matmul_dtype}


def measure_ceilings(device: str = "cpu", quick: bool = False) -> Ceilings:
    """Copy, read and matmul rates of `device` ("cpu" or a CUDA device), measured now."""
    if is_cuda(device):
        import torch

        n = (256 if quick else 1024) * MIB // 4
        src = torch.rand(n, device=device)
        dst = torch.empty_like(src)
        copy_ms = time_call(lambda: dst.copy_(src), device)
        read_ms = time_call(lambda: src.sum(), device)
        m = 4096 if quick else 8192
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        mm_ms = time_call(lambda: a @ a, device)
        return Ceilings(torch.cuda.get_device_name(device), 2 * n * 4 / copy_ms / 1e6, n * 4 / read_ms / 1e6,
                        2 * m ** 3 / mm_ms / 1e9, "bf16")
    from kernel_parity.conformance.env import cpu_name

    n = (16 if quick else 64) * MIB // 4
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    copy_ms = time_call(lambda: np.copyto(dst, src), "cpu")
    read_ms = time_call(lambda: np.add.reduce(src), "cpu")
    m = 512 if quick else 1024
    a = np.random.default_rng(1).random((m, m), dtype=np.float32)
    mm_ms = time_call(lambda: a @ a, "cpu")
    return Ceilings(cpu_name(), 2 * n * 4 / copy_ms / 1e6, n * 4 / read_ms / 1e6, 2 * m ** 3 / mm_ms / 1e9, "fp32")


def cost(spec: Any, params: dict, inputs: dict, out_shapes: dict, out_dtypes: dict) -> tuple[int, int, float]:
    """(bytes read, bytes written, flops) of one call (module docstring)."""
    declared = getattr(spec, "bytes_moved", None)
    if declared is not None:
        read, written = declared(params)
    else:
        read = sum(int(np.asarray(v).size) * np.asarray(v).dtype.itemsize for v in inputs.values())
        written = sum(int(np.prod(s)) * out_dtypes[k].np.itemsize for k, s in out_shapes.items())
    fl = getattr(spec, "flops", None)
    return int(read), int(written), float(fl(params)) if fl is not None else 0.0


def classify(perf: dict, ceil: Ceilings) -> dict:
    """perf (ms, bytes_read, bytes_written, flops) + throughput, bound, ceiling and the share of it."""
    ms = perf["ms"]
    total = perf["bytes_read"] + perf["bytes_written"]
    gbps = total / ms / 1e6 if ms > 0 else 0.0
    tflops = perf["flops"] / ms / 1e9 if ms > 0 and perf["flops"] else 0.0
    t_mem = total / (ceil.copy_gbps * 1e6) if ceil.copy_gbps else 0.0
    t_mm = perf["flops"] / (ceil.matmul_tflops * 1e9) if perf["flops"] and ceil.matmul_tflops else 0.0
    if t_mm > t_mem:
        bound, ceiling, pct = "matmul", ceil.matmul_tflops, 100 * tflops / ceil.matmul_tflops
    elif perf["bytes_written"] < 0.1 * perf["bytes_read"]:
        bound, ceiling, pct = "read", ceil.read_gbps, 100 * gbps / ceil.read_gbps
    else:
        bound, ceiling, pct = "copy", ceil.copy_gbps, 100 * gbps / ceil.copy_gbps
    return {**perf, "gbps": gbps, "tflops": tflops, "bound": bound, "ceiling": ceiling, "pct_of_ceiling": pct,
            "device": ceil.device}


def group_key(r: dict) -> tuple:
    """The input group of a record: the records of one op, dtype, params, dist and seed share inputs."""
    return (r["op"], r["dtype"], tuple(sorted(r["params"].items())), r["dist"], r["seed"])


def timed(r: dict) -> bool:
    return isinstance(r.get("perf"), dict) and "ms" in r["perf"]


def peers_of(r: dict, group: list[dict]) -> dict:
    """The other timed backends of r's input group: {backend: {ms, ratio = their ms / r's ms}}."""
    if not r["perf"]["ms"] > 0:
        return {}
    return {o["backend"]: {"ms": o["perf"]["ms"], "ratio": o["perf"]["ms"] / r["perf"]["ms"]}
            for o in group if o is not r and timed(o)}


def add_peers(records: list[dict]) -> None:
    """Per timed record: the other backends' times on the same inputs and the ratio peer / this."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if timed(r):
            groups.setdefault(group_key(r), []).append(r)
    for recs in groups.values():
        for r in recs:
            r["perf"]["peers"] = peers_of(r, recs)


def ours_of(backends: list[str]) -> str:
    """The backend an input group's peers are measured against in the lines: ours, a Triton kernel
    (triton, triton-q8) before the C kernels (cpu) before the eager composition (torch), else the
    group's first backend."""
    rank = {"cpu": 1, "torch": 2}
    return min(backends, key=lambda b: 0 if b.split("-")[0] == "triton" else rank.get(b, 3))


class Lines:
    """One line per record of a bench, made as it lands (`parity bench` prints them, flushed):

        [3/4] softmax.softmax/cpu/fp32 rows=3,n=113 masked: pass norm_err 0.0017  0.0234 ms 0.116 GB/s 0.96% of copy

    the case (its params at 0 left out, the seed when not 0), the verdict and norm_err, the time, the
    throughput and the share of the ceiling; the record that completes its input group ends with each
    peer's ms over ours (`ours_of`), e.g. `  | peers' ms / cpu's: torch 1.27x`. A skip or an error gives
    its reason instead of figures. The records are only read, never changed."""

    def __init__(self, cases: list[Any]) -> None:
        self.total = len(cases)
        self.seen = 0
        self.backends: dict[tuple, list[str]] = {}  # input group -> its backends, in the run's order
        for c in cases:
            k = group_key({"op": c.op, "dtype": c.dtype, "params": c.p, "dist": c.dist, "seed": c.seed})
            self.backends.setdefault(k, []).append(c.backend)
        self.landed: dict[tuple, list[dict]] = {}

    def add(self, r: dict) -> str:
        """The line of record `r` (as `CaseResult.to_json` writes it)."""
        self.seen += 1
        key = group_key(r)
        group = self.landed.setdefault(key, [])
        group.append(r)
        line = f"[{self.seen:>{len(str(self.total))}}/{self.total}] {case_text(r)}: {figures(r)}"
        backends = self.backends.get(key, [])
        if len(group) == len(backends):
            line += ratios(group, ours_of(backends))
        return line


def case_text(r: dict) -> str:
    params = ",".join(f"{k}={v}" for k, v in r["params"].items() if str(v) != "0") or "-"
    seed = f" seed={r['seed']}" if r["seed"] else ""
    return f"{r['op']}/{r['backend']}/{r['dtype']} {params} {r['dist']}{seed}"


def figures(r: dict) -> str:
    """verdict, norm_err and the perf figures of one record (or why there are none)."""
    out = r["verdict"]
    if r.get("norm_err") is not None:
        out += f" norm_err {r['norm_err']:.3g}"
    perf = r.get("perf") if isinstance(r.get("perf"), dict) else None
    if not timed(r):
        why = (perf or {}).get("error")
        if why:
            return f"{out}  not timed: {why}"
        return f"{out}: {r['reason']}" if r.get("reason") and r["verdict"] != "pass" else out
    out += f"  {perf['ms']:.4g} ms"
    if "bound" in perf:
        rate = f"{perf['tflops']:.3g} TFLOP/s" if perf["bound"] == "matmul" else f"{perf['gbps']:.3g} GB/s"
        out += f" {rate} {perf['pct_of_ceiling']:.3g}% of {perf['bound']}"
    return out


def ratios(group: list[dict], ours: str) -> str:
    """`  | peers' ms / ours's: peer ratio, ...` of a whole input group; empty when ours or every peer
    was not timed."""
    mine = next((r for r in group if r["backend"] == ours), None)
    peers = peers_of(mine, group) if mine is not None and timed(mine) else {}
    if not peers:
        return ""
    return f"  | peers' ms / {ours}'s: " + ", ".join(f"{b} {p['ratio']:.3g}x" for b, p in peers.items())
