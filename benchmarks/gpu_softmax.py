"""GPU benchmark of the Triton softmax, online_softmax and lse_combine kernels (Hopper target).

    python benchmarks/gpu_softmax.py [--quick] [--out PATH]

1. Measures device copy bandwidth: a large device-to-device copy, bytes read + written, median of
   triton.testing.do_bench. Every other figure is reported as a share of it.
2. At every benchmarked shape, checks the kernel against a float64 reference computed on the GPU
   from the same (rounded) input: max abs error and max error relative to a per-dtype bound
   (fp32: a few ulp of fp32; fp16/bf16: one ulp of the storage dtype). A miss prints the case
   and the script exits 1 after writing its JSON.
3. Times ours and torch's (torch.softmax, an eager torch combine): median ms, GB/s with bytes =
   inputs read once + outputs written once (the memory-bound floor), % of copy bandwidth, and
   speedup = torch ms / ours ms.

Inputs are >= 256 MiB (64 MiB with --quick) so L2 (50-60 MB) cannot hold them; do_bench also
clears L2 before every timed call. Calls moving < 256 MiB (the combine, ~10-40 us; the 16-row
split case; everything under --quick) can be shorter than their host-side launch, so they are
also timed as CUDA-graph replays over rotated input sets (graph_* fields): the device time that
e.g. split-KV decoding inside a captured graph will see. Results go to --out
(default $OUT/softmax_bench.json when OUT is set) with a header naming device and versions.
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

MIB = 1 << 20
# Per storage dtype: (rtol, atol) for |y - ref| <= atol + rtol * |ref|. fp32 allows ~16 ulp: the
# kernel lands within a few (ex2.approx, fp32 sums); a bug lands orders of magnitude out.
# fp16/bf16 allow one ulp of the storage dtype (the fp32 result is rounded once, half an ulp,
# plus the fp32 error); fp16's atol is its subnormal spacing, reached by softmax of long rows.
TOL = {"fp32": (2e-6, 1e-30), "fp16": (2.0**-10, 2.0**-24), "bf16": (2.0**-7, 1e-30)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (smoke run)")
    default_out = os.path.join(os.environ["OUT"], "softmax_bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/softmax_bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    return args


def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_softmax: no CUDA device (torch.cuda.is_available() is False); "
              "this benchmark must run on a GPU machine", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from kernel_parity.kernels.triton import softmax as sm
    from kernel_parity.kernels.triton.combine import lse_combine

    dev = torch.device("cuda")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    in_bytes = (64 if args.quick else 256) * MIB
    bench_kw = dict(warmup=10 if args.quick else 25, rep=40 if args.quick else 200, return_mode="median")
    gen = torch.Generator(device=dev).manual_seed(0)
    results: list[dict] = []
    failures: list[str] = []

    def bench(fn) -> float:
        return float(do_bench(fn, **bench_kw))

    def graph_ms(make_call, sets: int) -> float:
        """Device time of one call: a CUDA graph of `sets` calls on distinct inputs, replayed.

        A kernel of ~10 us is shorter than its host-side launch, so do_bench's figure for it can
        include launch gaps; graph replay has none. Distinct inputs (>= 256 MiB in all) keep L2
        from serving one call's data to the next.
        """
        calls = [make_call() for _ in range(sets)]
        for call in calls:  # compile and allocate outside the capture
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for call in calls:
                call()
        t = float(do_bench(g.replay, **bench_kw)) / sets
        del g, calls
        return t

    def graph_fields(make, nbytes: int) -> dict:
        """graph_* figures for calls moving < 256 MiB (make(True): ours, make(False): torch's)."""
        if nbytes >= 256 * MIB:
            return {}
        sets = max(4, math.ceil(256 * MIB / nbytes))
        ours, theirs = graph_ms(lambda: make(True), sets), graph_ms(lambda: make(False), sets)
        torch.cuda.empty_cache()
        return dict(graph_ms=ours, torch_graph_ms=theirs, graph_speedup_vs_torch=theirs / ours,
                    graph_pct_copy=100 * nbytes / ours / 1e6 / copy_gbps)

    # 1. copy bandwidth: bytes read + bytes written.
    copy_bytes = (512 if args.quick else 2048) * MIB
    src = torch.rand(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbps = 2 * copy_bytes / copy_ms / 1e6
    del src, dst
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({2 * copy_bytes / MIB:.0f} MiB moved in {copy_ms:.3f} ms)")

    def check(name: str, dt: str, y: torch.Tensor, ref: torch.Tensor, scale=None) -> tuple[float, bool]:
        """Max abs error of y against the float64 ref, and whether every element is in TOL.

        scale: the magnitude rtol applies to, |ref| by default; a sum of mixed-sign terms passes
        the sum of their magnitudes, since its cancellation is not the kernel's error.
        """
        rtol, atol = TOL[dt]
        y64 = y.double()
        err = (y64 - ref).abs()
        bad = ~(err <= atol + rtol * (ref.abs() if scale is None else scale))  # NaN counts as bad
        max_abs = float(err.nan_to_num(nan=math.inf).max())
        if bool(bad.any()):
            idx = int(bad.flatten().nonzero()[0])
            failures.append(f"{name}: {int(bad.sum())}/{bad.numel()} elements outside tol "
                            f"(rtol={rtol:.3g} atol={atol:.3g}); first at flat {idx}: "
                            f"{float(y64.flatten()[idx]):.9g} vs {float(ref.flatten()[idx]):.9g}")
            print("PARITY FAIL", failures[-1], file=sys.stderr)
        return max_abs, not bool(bad.any())

    def record(op, dt, shape, path, ours_ms, torch_ms, nbytes, max_abs, ok, **extra):
        gbps = nbytes / ours_ms / 1e6
        row = dict(op=op, dtype=dt, shape=list(shape), path=path, ms=ours_ms, GBps=gbps,
                   pct_copy=100 * gbps / copy_gbps, bytes=nbytes, max_abs_err=max_abs, parity_ok=ok,
                   torch_ms=torch_ms, torch_GBps=None if torch_ms is None else nbytes / torch_ms / 1e6,
                   speedup_vs_torch=None if torch_ms is None else torch_ms / ours_ms, **extra)
        results.append(row)
        tm = "" if torch_ms is None else f" torch {torch_ms:.3f} ms ({row['speedup_vs_torch']:.2f}x)"
        print(f"{op:14s} {dt:4s} {str(tuple(shape)):22s} {path:12s} {ours_ms:.3f} ms "
              f"{gbps:6.0f} GB/s {row['pct_copy']:5.1f}%{tm}  err {max_abs:.2e}", flush=True)

    # 2+3. softmax: fused path at n = 4096..32768, split path on long rows.
    ns = [4096, 32768] if args.quick else [4096, 8192, 16384, 32768]
    cases = [(n, None) for n in ns] + [(262144, None), (1 << 20, 16)]  # (n, rows or None = fill in_bytes)
    for dt, dtype in dtypes.items():
        elt = torch.finfo(dtype).bits // 8
        for n, rows in cases:
            rows = rows or max(1, in_bytes // (n * elt))
            x = torch.randn(rows, n, device=dev, dtype=torch.float32, generator=gen).mul_(3).to(dtype)
            path = "fused" if n <= sm.MAX_FUSED_N else "split"
            y = sm.softmax(x, out=torch.full_like(x, math.nan))  # poisoned: unwritten elements fail
            ref = torch.softmax(x.double(), dim=-1)
            max_abs, ok = check(f"softmax {dt} {(rows, n)}", dt, y, ref)
            del y, ref
            out = torch.empty_like(x)
            ours = bench(lambda: sm.softmax(x, out=out))
            theirs = bench(lambda: torch.softmax(x, dim=-1))
            nbytes = 2 * x.numel() * elt

            def make(ours: bool, shape=(rows, n), dtype=dtype):
                xi = torch.randn(shape, device=dev, generator=gen).to(dtype)
                oi = torch.empty_like(xi)
                return (lambda: sm.softmax(xi, out=oi)) if ours else (lambda: torch.softmax(xi, dim=-1))

            record("softmax", dt, (rows, n), path, ours, theirs, nbytes, max_abs, ok,
                   **graph_fields(make, nbytes))
            if dt == "fp32" and n in (32768, 262144):
                lse_buf = torch.empty(rows, device=dev)
                for tile in (1024, 4096):
                    y, lse = sm.online_softmax(x, tile, out=torch.full_like(x, math.nan),
                                               out_lse=torch.full((rows,), math.nan, device=dev))
                    ref = torch.softmax(x.double(), dim=-1)
                    max_abs, ok = check(f"online_softmax tile={tile} {dt} {(rows, n)}", dt, y, ref)
                    lse_err, lse_ok = check(f"online_softmax lse tile={tile} {(rows, n)}", "fp32", lse,
                                            torch.logsumexp(x.double(), dim=-1))
                    del y, ref
                    ours = bench(lambda: sm.online_softmax(x, tile, out=out, out_lse=lse_buf))
                    record("online_softmax", dt, (rows, n), f"tile={tile}", ours, theirs,
                           2 * x.numel() * elt + 4 * rows, max(max_abs, lse_err), ok and lse_ok)
            del x, out
            torch.cuda.empty_cache()

    # lse_combine: stage 2 of split-KV decoding (rows = batch 32 x heads 64).
    splits, rows = 16, 32 * 64
    for d_v in (128, 512):
        for o_dt, out_dt in (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")):
            o = torch.randn(splits, rows, d_v, device=dev, generator=gen).to(dtypes[o_dt])
            lse = torch.randn(splits, rows, device=dev, generator=gen).mul_(4)
            out = torch.full((rows, d_v), math.nan, device=dev, dtype=dtypes[out_dt])  # poisoned
            out_lse = torch.full((rows,), math.nan, device=dev)
            lse_combine(o, lse, out=out, out_lse=out_lse)
            lse64 = torch.logsumexp(lse.double(), dim=0)
            w64 = torch.exp(lse.double() - lse64)[..., None]
            ref = (w64 * o.double()).sum(0)
            max_abs, ok = check(f"lse_combine {o_dt}->{out_dt} d_v={d_v}", out_dt, out, ref,
                                scale=(w64 * o.double().abs()).sum(0))
            lse_err, lse_ok = check(f"lse_combine lse d_v={d_v}", "fp32", out_lse, lse64)

            def eager(o=o, lse=lse, out_dtype=dtypes[out_dt]):
                m = lse.amax(dim=0)
                w = torch.exp(lse - m)
                s = w.sum(dim=0)
                return ((w[..., None] * o.float()).sum(dim=0) / s[..., None]).to(out_dtype), m + torch.log(s)

            def make_ours(o_dt=o_dt, out_dt=out_dt, d_v=d_v):
                o = torch.randn(splits, rows, d_v, device=dev, generator=gen).to(dtypes[o_dt])
                lse = torch.randn(splits, rows, device=dev, generator=gen).mul_(4)
                out = torch.empty(rows, d_v, device=dev, dtype=dtypes[out_dt])
                out_lse = torch.empty(rows, device=dev)
                return lambda: lse_combine(o, lse, out=out, out_lse=out_lse)

            def make_eager(o_dt=o_dt, d_v=d_v):
                o = torch.randn(splits, rows, d_v, device=dev, generator=gen).to(dtypes[o_dt])
                lse = torch.randn(splits, rows, device=dev, generator=gen).mul_(4)
                return lambda: eager(o, lse)

            ours = bench(lambda: lse_combine(o, lse, out=out, out_lse=out_lse))
            theirs = bench(eager)
            nbytes = o.numel() * o.element_size() + lse.numel() * 4 + out.numel() * out.element_size() + rows * 4
            record("lse_combine", f"{o_dt}>{out_dt}", (splits, rows, d_v), "", ours, theirs, nbytes,
                   max(max_abs, lse_err), ok and lse_ok,
                   **graph_fields(lambda ours: make_ours() if ours else make_eager(), nbytes))
            del o, lse, out, out_lse, ref

    header = dict(
        device=torch.cuda.get_device_name(dev),
        capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
        sm_count=torch.cuda.get_device_properties(dev).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, quick=args.quick,
        copy_GBps=copy_gbps, copy_bytes_moved=2 * copy_bytes, input_bytes=in_bytes,
        do_bench=bench_kw, max_fused_n=sm.MAX_FUSED_N, tolerances=TOL,
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, results=results, failures=failures), indent=1))
        print(f"wrote {args.out}")

    print(f"\n{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s")
    print(f"{'op':14s} {'dtype':9s} {'shape':20s} {'path':10s} {'ms':>8s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'torch ms':>8s} {'speedup':>7s}   (graph replay: ms, %copy, speedup)")
    for r in results:
        t = "" if r["torch_ms"] is None else f"{r['torch_ms']:8.3f} {r['speedup_vs_torch']:6.2f}x"
        g = "" if "graph_ms" not in r else (f"   {r['graph_ms']:.4f} {r['graph_pct_copy']:5.1f}% "
                                            f"{r['graph_speedup_vs_torch']:5.2f}x")
        print(f"{r['op']:14s} {r['dtype']:9s} {str(tuple(r['shape'])):20s} {r['path']:10s} {r['ms']:8.3f} "
              f"{r['GBps']:6.0f} {r['pct_copy']:5.1f}% {t}{g}")
    if failures:
        print(f"\nPARITY FAILED in {len(failures)} case(s):", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nparity ok in all {len(results)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
