"""GPU benchmark of the Triton RoPE and RoPE-fused KV-write kernels (Hopper target).

    python benchmarks/gpu_rope.py [--quick] [--out PATH]      # a thin caller of `parity bench`
    python benchmarks/gpu_rope.py --direct|--tune [--quick] [--out PATH]

By default the cases of `entries` (the shapes below as rope.rope / rope.kv_update cases; backends
triton (ours), torch and liger where it installs and expresses the case) go to `parity bench`
(benchmarks/bench_cases.py): judged by the gate, timed with do_bench, bytes over the copy ceiling
measured in the same run, each peer's ms over ours. --direct (or --tune) runs the measurement below
by hand:

1. Measures device copy bandwidth: a large device-to-device copy, bytes read + written, median of
   triton.testing.do_bench. Every other figure is a share of it.
2. rope at real model shapes (Llama-3-8B q and k over 16K tokens, GPT-NeoX-20B's 25% rotary,
   DeepSeek MLA's 64 rotary dims at the end of 576-wide rows), every table layout and theta-built
   angles: median ms, GB/s with bytes = x read + y written + the table rows read (the memory-bound
   floor), % of copy bandwidth, and torch's eager baseline (kernels/torch/rope.py: HF for half pairs,
   Meta's complex multiply for interleaved) with the speedup.
3. kv_update (TensorRT-LLM's fused write): decode (one token per sequence) and a 2048-token chunk
   into pages of 16, the same figures (bytes = k, v read + written + table rows).
Each line gives the gate's verdict and norm_err for ours on the same case (bench_cases.Gate: rope.rope /
rope.kv_update with those params and dtype on the triton backend, under the tile settings being timed);
a case the gate fails prints GATE FAIL and the script exits 1 after writing its JSON.
--tune times a few (TILE, ELEMS_PER_THREAD) settings at the Llama-3-8B q shape first.
Results go to --out (default $OUT/rope_bench.json when OUT is set) with a header naming the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    p.add_argument("--tune", action="store_true", help="time a few tile settings first (implies --direct)")
    p.add_argument("--direct", action="store_true", help="the measurement by hand instead of parity bench")
    default_out = os.path.join(os.environ["OUT"], "rope_bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/rope_bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    if args.out:
        check_output_or_exit(p.prog, "--out", args.out)
    return args


def _rope(t, h, d, rot, style, at, table, theta, scaling, maxseq, pos="offset") -> dict:
    return dict(t=t, h=h, d=d, rot=rot, style=style, at=at, table=table, theta=theta, scaling=scaling,
                maxseq=maxseq, pos=pos, start=0)


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run): the shapes of the direct run; --quick:
    Llama-3-8B's k (8 heads) in bf16 with each table layout (four input groups, a first line in seconds)."""
    be = ["triton", "torch", "liger"]
    if quick:
        return [{"op": "rope.rope", "backends": be, "dtypes": ["bf16"],
                 "params": [_rope(16384, 8, 128, 128, "half", "first", table, 500000,
                                  "llama3" if table == "theta" else "none", 16384)
                            for table in ("cos_sin", "cs_f16", "cis", "theta")]}]
    bf16 = [_rope(16384, h, 128, 128, "half", "first", table, 500000, "llama3" if table == "theta" else "none", 16384)
            for h in (32, 8) for table in ("cos_sin", "cs_f16", "cis", "theta")]
    if not quick:
        bf16 += [_rope(16384, h, 128, 128, "interleaved", "first", table, 500000,
                       "llama3" if table == "theta" else "none", 16384) for h in (32, 8) for table in ("cis", "theta")]
        bf16 += [_rope(16384, 28, 128, 128, "half", "first", "cos_sin", 1000000, "none", 32768, "random"),
                 _rope(65536, 1, 576, 64, "interleaved", "last", "cis", 10000, "none", 65536),
                 _rope(2048, 128, 576, 64, "interleaved", "last", "cis", 10000, "none", 4096, "random")]
    out = [{"op": "rope.rope", "backends": be, "dtypes": ["bf16"], "params": bf16},
           {"op": "rope.rope", "backends": be, "dtypes": ["fp32"],
            "params": [_rope(16384, 32, 128, 128, "half", "first", "theta", 500000, "llama3", 16384)]},
           {"op": "rope.rope", "backends": be, "dtypes": ["fp16"],
            "params": [_rope(16384, 32, 128, 128, "half", "first", "cos_sin", 500000, "none", 16384, "random")]
            + ([] if quick else [_rope(16384, 64, 96, 24, "half", "first", t, 10000, "none", 16384)
                                 for t in ("cs_f16", "theta")])}]
    if not quick:
        out.append({"op": "rope.kv_update", "backends": ["triton", "torch"], "dtypes": ["bf16"],
                    "params": [dict(b=128, snew=1, hkv=8, d=128, smax=4096, layout="contiguous"),
                               dict(b=8, snew=2048, hkv=8, d=128, smax=8192, layout="paged16")]})
    return out


def main() -> int:  # noqa: C901  (one linear script)
    args = parse_args()
    if not (args.direct or args.tune):
        from bench_cases import run

        return run(entries(args.quick), out=args.out or "rope_bench.json", ours="triton", argv=("--no-recheck",),
                   description="benchmarks/gpu_rope.py")
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("gpu_rope: no CUDA device; this benchmark must run on a GPU machine", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate, gate_text

    import kernel_parity.refimpl.rope as ref
    from kernel_parity.kernels.torch import rope as eager
    from kernel_parity.kernels.triton import rope as k
    from kernel_parity.kernels.triton import rope_kv as kv

    dev = torch.device("cuda")
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    bench_kw = dict(warmup=10 if args.quick else 25, rep=40 if args.quick else 200, return_mode="median")
    gen = torch.Generator(device=dev).manual_seed(0)
    results: list[dict] = []
    gate = Gate("triton")

    def bench(fn) -> float:
        return float(do_bench(fn, **bench_kw))

    copy_bytes = 2048 * MIB
    src = torch.rand(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbps = 2 * copy_bytes / copy_ms / 1e6
    del src, dst
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)

    def tables(table: str, maxseq: int, rot: int, theta: float, scaling: str) -> dict:
        if table == "theta":
            return {"theta": theta, "scaling": scaling}
        cos, sin = ref.tables(maxseq, rot, theta, scaling)
        if table == "cos_sin":
            return {"cos": torch.tensor(cos, dtype=torch.float32, device=dev),
                    "sin": torch.tensor(sin, dtype=torch.float32, device=dev)}
        pairs = np.stack([cos, sin], axis=-1)
        if table == "cs_f16":
            return {"table": torch.tensor(pairs, dtype=torch.float16, device=dev)}
        return {"table": torch.view_as_complex(torch.tensor(pairs, dtype=torch.float32, device=dev))}

    def run_rope(model, t, h, d, rot, style, at, table, theta, scaling, dt, maxseq, positions="offset",
                 with_torch=True, tag=""):
        x = torch.randn(t, h, d, device=dev, generator=gen).to(tdt[dt])
        if positions == "offset":
            pos = torch.arange(t, device=dev, dtype=torch.int32)
        else:
            pos = torch.randint(0, maxseq, (t,), device=dev, dtype=torch.int32, generator=gen)
        kw = tables(table, maxseq, rot, theta, scaling)
        sty = dict(style=style, rot=rot, at=at)
        y = torch.full_like(x, float("nan"))
        k.rope(x, pos, **kw, **sty, out=y)
        p = dict(t=t, h=h, d=d, rot=rot, style=style, at=at, table=table, theta=int(theta), scaling=scaling,
                 maxseq=maxseq, pos=positions, start=0)
        name = f"rope {model} {dt} {table} {style}{tag}"
        verdict = gate("rope.rope", dt, p)
        ours = bench(lambda: k.rope(x, pos, **kw, **sty, out=y))
        elt = x.element_size()
        tab_bytes = 0 if table == "theta" else t * (rot // 2) * 2 * (2 if table == "cs_f16" else 4)
        nbytes = 2 * x.numel() * elt + tab_bytes + 4 * t
        theirs = bench(lambda: eager.rope(x, pos, **kw, **sty)) if with_torch else None
        gbps = nbytes / ours / 1e6
        row = dict(op="rope.rope", model=model, dtype=dt, shape=[t, h, d], rot=rot, style=style, at=at, table=table,
                   theta=theta, scaling=scaling, ms=ours, GBps=gbps, pct_copy=100 * gbps / copy_gbps, bytes=nbytes,
                   torch_ms=theirs, speedup_vs_torch=None if theirs is None else theirs / ours,
                   gate=verdict, tag=tag)
        results.append(row)
        tm = "" if theirs is None else f" torch {theirs:.3f} ms ({theirs / ours:.1f}x)"
        print(f"{name:48s} {(t, h, d)!s:18s} {ours:.3f} ms {gbps:6.0f} GB/s {row['pct_copy']:5.1f}%{tm}"
              f"  {gate_text(verdict)}", flush=True)
        del x, y, kw
        torch.cuda.empty_cache()
        return row

    if args.tune:
        default = (k.TILE, k.ELEMS_PER_THREAD)
        for tile, ept in ((2048, 8), (2048, 16), (4096, 16), (4096, 32), (8192, 16), (8192, 32)):
            k.TILE, k.ELEMS_PER_THREAD = tile, ept
            tag = f" tile={tile},ept={ept}"
            for table, style in (("cos_sin", "half"), ("theta", "half"), ("cis", "interleaved")):
                run_rope("llama3-8b-q", 16384, 32, 128, 128, style, "first", table, 500000.0,
                         "llama3" if table == "theta" else "none", "bf16", 16384, with_torch=False, tag=tag)
            run_rope("llama3-8b-k", 16384, 8, 128, 128, "half", "first", "cs_f16", 500000.0, "none", "bf16", 16384,
                     with_torch=False, tag=tag)
            run_rope("deepseek-mla-kv", 65536, 1, 576, 64, "interleaved", "last", "cis", 10000.0, "none", "bf16",
                     65536, with_torch=False, tag=tag)
        k.TILE, k.ELEMS_PER_THREAD = default

    llama = dict(theta=500000.0, scaling="llama3", maxseq=16384)
    shapes = [("llama3-8b-q", 16384, 32, 128, 128, "half", "first"),
              ("llama3-8b-k", 16384, 8, 128, 128, "half", "first")]
    for model, t, h, d, rot, style, at in shapes:
        for table in ("cos_sin", "cs_f16", "cis", "theta"):
            run_rope(model, t, h, d, rot, style, at, table, llama["theta"], "llama3" if table == "theta" else "none",
                     "bf16", llama["maxseq"])
        if not args.quick:
            run_rope(model, t, h, d, rot, "interleaved", at, "cis", 500000.0, "none", "bf16", 16384)
            run_rope(model, t, h, d, rot, "interleaved", at, "theta", 500000.0, "llama3", "bf16", 16384)
    run_rope("llama3-8b-q", 16384, 32, 128, 128, "half", "first", "theta", 500000.0, "llama3", "fp32", 16384)
    run_rope("llama3-8b-q", 16384, 32, 128, 128, "half", "first", "cos_sin", 500000.0, "none", "fp16", 16384,
             positions="random")
    run_rope("qwen2-7b-q", 16384, 28, 128, 128, "half", "first", "cos_sin", 1000000.0, "none", "bf16", 32768,
             positions="random")
    run_rope("neox-20b", 16384, 64, 96, 24, "half", "first", "cs_f16", 10000.0, "none", "fp16", 16384)
    run_rope("neox-20b", 16384, 64, 96, 24, "half", "first", "theta", 10000.0, "none", "fp16", 16384)
    run_rope("deepseek-mla-kv", 65536, 1, 576, 64, "interleaved", "last", "cis", 10000.0, "none", "bf16", 65536)
    run_rope("deepseek-mla-q", 2048, 128, 576, 64, "interleaved", "last", "cis", 10000.0, "none", "bf16", 4096,
             positions="random")

    # kv_update: decode into a contiguous cache, and a 2048-token chunk into pages of 16.
    for label, b, s_new, h, d, smax, page in (("decode", 128, 1, 8, 128, 4096, None),
                                              ("chunk", 8, 2048, 8, 128, 8192, 16)):
        dt = torch.bfloat16
        k_new, v_new = (torch.randn(b, s_new, h, d, device=dev, generator=gen).to(dt) for _ in range(2))
        pos = torch.randint(0, smax - s_new + 1, (b,), device=dev, dtype=torch.int32, generator=gen)
        cos, sin = ref.tables(smax, d, 10000.0)
        table = torch.tensor(np.stack([cos, sin], axis=-1), dtype=torch.float16, device=dev)
        if page is None:
            shape, bt = (b, smax, h, d), None
        else:
            per = smax // page
            shape = (b * per, page, h, d)
            bt = torch.randperm(b * per, device=dev, generator=gen).to(torch.int32).reshape(b, per)
        kc, vc = torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        verdict = gate("rope.kv_update", "bf16", dict(b=b, snew=s_new, hkv=h, d=d, smax=smax,
                                                      layout="contiguous" if page is None else f"paged{page}"))
        ours = bench(lambda: kv.kv_update(kc, vc, k_new, v_new, pos, table, block_table=bt))
        theirs = bench(lambda: eager.kv_update(kc2, vc2, k_new, v_new, pos, table, block_table=bt))
        # decode moves ~0.5 MB, far less than the host-side launch costs: the device time of one
        # call is measured as CUDA-graph replays of 64 calls (what a captured decode step sees)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(64):
                kv.kv_update(kc, vc, k_new, v_new, pos, table, block_table=bt)
        graph_ms = bench(g.replay) / 64
        del g
        nbytes = 4 * k_new.numel() * 2 + b * s_new * d * 2 + 4 * b
        gbps = nbytes / ours / 1e6
        results.append(dict(op="rope.kv_update", model="llama3-8b", label=label, dtype="bf16", shape=[b, s_new, h, d],
                            layout="contiguous" if page is None else f"paged{page}", ms=ours, GBps=gbps,
                            pct_copy=100 * gbps / copy_gbps, bytes=nbytes, torch_ms=theirs,
                            speedup_vs_torch=theirs / ours, gate=verdict,
                            graph_ms=graph_ms, graph_pct_copy=100 * nbytes / graph_ms / 1e6 / copy_gbps))
        print(f"kv_update {label:8s} {(b, s_new, h, d)!s:18s} {ours * 1e3:.1f} us (graph {graph_ms * 1e3:.1f} us, "
              f"{100 * nbytes / graph_ms / 1e6 / copy_gbps:.0f}%) {gbps:6.0f} GB/s "
              f"{100 * gbps / copy_gbps:5.1f}% torch {theirs * 1e3:.1f} us ({theirs / ours:.1f}x) {gate_text(verdict)}",
              flush=True)
        del kc, vc, kc2, vc2
        torch.cuda.empty_cache()

    header = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                  copy_GBps=copy_gbps, time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  tile=k.TILE, elems_per_thread=k.ELEMS_PER_THREAD)
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "results": results, "gate_failures": gate.failures},
                                             indent=1))
    for f in gate.failures:
        print("GATE FAIL", f, file=sys.stderr, flush=True)
    return 1 if gate.failures else 0


if __name__ == "__main__":
    sys.exit(main())
