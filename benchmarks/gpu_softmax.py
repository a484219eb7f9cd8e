"""GPU benchmark of the Triton softmax, online_softmax and lse_combine kernels beside eager torch (Hopper target).

    python benchmarks/gpu_softmax.py [--quick] [--out PATH]            # a thin caller of `parity bench`
    python benchmarks/gpu_softmax.py --graphs [--quick] [--out PATH]   # CUDA-graph replay of the short calls

By default the cases below go to `parity bench` (benchmarks/bench_cases.py) with backends triton (ours)
and torch (the eager composition of kernels/torch/: torch.softmax with all -inf rows zeroed,
torch.logsumexp, the weighted merge): every case judged by the gate against the float64 golden (its
verdict and norm_err are the accuracy figures), timed with do_bench (L2 cleared before every call),
its bytes (inputs read once, outputs written once) over the copy ceiling measured in the same run,
and torch's ms over ours.
- softmax.softmax, fp32 / bf16 / fp16: the fused path at n = 4096 .. 32768 and the split path at
  n = 262144, rows filling 256 MiB of input (L2 holds 50-60 MB), and the 16-row split case n = 2^20.
- softmax.online_softmax, fp32, n = 32768 and 262144 (256 MiB), tiles 256 and 1024.
- combine.lse_combine, stage 2 of split-KV decoding: 16 splits, rows = batch 32 x heads 64,
  d_v = 128 and 512, fp32 and bf16.
--quick: bf16 softmax at n = 4096 and 32768, fp32 online_softmax at n = 32768 (64 MiB each) and the
bf16 combine at d_v = 128.

--graphs instead times the same cases' calls (those moving < 256 MiB; every case under --quick) as
CUDA-graph replays over rotated input sets, ours and torch's composition, the replay timed with
parity bench's own timer (conformance/bench.py's time_call) and divided by the calls in the graph:
a combine of 10-40 us is shorter than its host-side launch, so do_bench's figure of it can hold
launch gaps, which a replay has not (the device time split-KV decoding sees inside a captured
graph). Each line gives the gate's verdict and norm_err for the same case (bench_cases.Gate: a
Runner evaluation on the triton backend); a case the gate fails makes the exit status 1.
Results: --out (default $OUT/softmax_bench.json, else ./softmax_bench.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20
BACKENDS = ["triton", "torch"]
ELT = {"fp32": 4, "bf16": 2, "fp16": 2}
FUSED_NS = (4096, 8192, 16384, 32768)  # <= kernels.triton.softmax.MAX_FUSED_N: whole rows in registers
SPLIT_N = 262144  # the split path (row cut into chunks over a (rows, chunks) grid)
GRAPH_BELOW = 256 * MIB  # --graphs times calls moving less; larger ones keep launch gaps out of do_bench


def _rows(n: int, dtype: str, mib: int) -> int:
    """Rows of length n filling `mib` MiB of input in `dtype`."""
    return max(1, mib * MIB // (n * ELT[dtype]))


def _softmax(dtype: str, ns: tuple[int, ...], mib: int, extra: tuple[dict, ...] = ()) -> dict:
    return {"op": "softmax.softmax", "backends": BACKENDS, "dtypes": [dtype],
            "params": [dict(rows=_rows(n, dtype, mib), n=n, pad=0) for n in ns] + list(extra)}


def _online(ns: tuple[int, ...], tiles: tuple[int, ...], mib: int) -> dict:
    # tile: the op's schema takes 16, 64, 256, 1024 (the kernel takes powers of two up to 8192)
    return {"op": "softmax.online_softmax", "backends": BACKENDS, "dtypes": ["fp32"],
            "params": [dict(rows=_rows(n, "fp32", mib), n=n, pad=0, tile=t) for n in ns for t in tiles]}


def _combine(dtypes: list[str], dvs: list[int]) -> dict:
    # One dtype for the partial O and the merged O (the op has no fp32 -> bf16 form).
    return {"op": "combine.lse_combine", "backends": BACKENDS, "dtypes": dtypes,
            "params": [dict(splits=16, rows=32 * 64, dv=dv) for dv in dvs]}


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run); --quick: 64 MiB inputs, one entry per op."""
    if quick:
        return [_softmax("bf16", (4096, 32768), 64), _online((32768,), (1024,), 64), _combine(["bf16"], [128])]
    long_rows = (dict(rows=16, n=1 << 20, pad=0),)
    return ([_softmax(d, FUSED_NS + (SPLIT_N,), 256, long_rows) for d in ("fp32", "bf16", "fp16")]
            + [_online((32768, SPLIT_N), (256, 1024), 256), _combine(["fp32", "bf16"], [128, 512])])


def main() -> int:
    from bench_cases import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB inputs, one case group per op (smoke run)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA-graph replay of the short calls, each with the gate's verdict")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "softmax_bench.json"),
                   help="JSON output path (default $OUT/softmax_bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    if args.graphs:
        return graphs(args)
    from bench_cases import run

    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_softmax.py")


def _calls(op: str, dtype: str, p: dict, dev, gen):
    """(ours, torch's, bytes moved) zero-argument calls of one case on fresh random inputs."""
    import torch

    from kernel_parity.kernels.torch import combine as TC
    from kernel_parity.kernels.torch import softmax as TS
    from kernel_parity.kernels.triton import combine as KC
    from kernel_parity.kernels.triton import softmax as KS

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if op == "combine.lse_combine":
        o = torch.randn(p["splits"], p["rows"], p["dv"], device=dev, generator=gen).to(dt)
        lse = torch.randn(p["splits"], p["rows"], device=dev, generator=gen).mul_(3)  # the case's LSE ~ N(0, 3)
        out, out_lse = torch.empty(p["rows"], p["dv"], device=dev, dtype=dt), torch.empty(p["rows"], device=dev)
        nbytes = sum(t.numel() * t.element_size() for t in (o, lse, out, out_lse))
        return (lambda: KC.lse_combine(o, lse, out=out, out_lse=out_lse)), (lambda: TC.lse_combine(o, lse)), nbytes
    x = torch.randn(p["rows"], p["n"], device=dev, generator=gen).to(dt)
    y = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    if op == "softmax.softmax":
        return (lambda: KS.softmax(x, out=y)), (lambda: TS.softmax(x)), nbytes
    lse = torch.empty(p["rows"], device=dev)
    return ((lambda: KS.online_softmax(x, p["tile"], out=y, out_lse=lse)), (lambda: TS.online_softmax(x, p["tile"])),
            nbytes + 4 * p["rows"])


def graphs(args: argparse.Namespace) -> int:
    """CUDA-graph replay of the cases' short calls (module docstring), each with the gate's verdict."""
    import torch
    import triton

    from bench_cases import Gate, gate_text

    from kernel_parity.conformance.bench import measure_ceilings, time_call

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ceil = measure_ceilings(str(dev), quick=args.quick)
    print(f"{ceil.device}  copy {ceil.copy_gbps:.0f} GB/s", flush=True)

    def replay_ms(calls: list) -> float:
        """Device ms of one call: a CUDA graph of every call (each on its own inputs), replayed."""
        for call in calls:  # compile and allocate outside the capture
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for call in calls:
                call()
        return time_call(g.replay, dev) / len(calls)

    gate = Gate("triton")
    rows = []
    for entry in entries(args.quick):
        for dtype in entry["dtypes"]:
            for p in entry["params"]:
                op = entry["op"]
                first = _calls(op, dtype, p, dev, gen)
                nbytes = first[2]
                if nbytes >= GRAPH_BELOW and not args.quick:
                    continue
                # Enough input sets that one replay moves >= 256 MiB: L2 serves nothing from call to call.
                n_sets = max(4, math.ceil(GRAPH_BELOW / nbytes))
                sets = [first] + [_calls(op, dtype, p, dev, gen) for _ in range(n_sets - 1)]
                ms, tms = replay_ms([s[0] for s in sets]), replay_ms([s[1] for s in sets])
                del sets, first
                torch.cuda.empty_cache()
                verdict = gate(op, dtype, p)
                row = dict(op=op, dtype=dtype, params=p, bytes=nbytes, graph_ms=ms, gbps=nbytes / ms / 1e6,
                           pct_of_copy=100 * nbytes / ms / 1e6 / ceil.copy_gbps, torch_graph_ms=tms,
                           torch_ms_over_ours=tms / ms, gate=verdict)
                rows.append(row)
                print(f"{op} {dtype} {','.join(f'{k}={v}' for k, v in p.items())}: graph {ms:.4f} ms "
                      f"{row['pct_of_copy']:5.1f}% of copy | torch {tms:.4f} ms ({tms / ms:.2f}x) | "
                      f"{gate_text(verdict)}", flush=True)
    header = dict(device=ceil.device, torch=torch.__version__, triton=triton.__version__, quick=args.quick,
                  time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command="benchmarks/gpu_softmax.py --graphs")
    Path(args.out).write_text(json.dumps(dict(header=header, ceilings=ceil.to_json(), cases=rows,
                                              gate_failures=gate.failures), indent=1, default=str))
    for f in gate.failures:
        print("GATE FAIL", f, flush=True)
    return 1 if gate.failures else 0


if __name__ == "__main__":
    sys.exit(main())
