"""GPU benchmark of the Triton SwiGLU / GeGLU kernels (Hopper target), beside liger-kernel and eager torch.

    python benchmarks/gpu_mlp.py [--quick] [--out PATH]      # a thin caller of `parity bench`
    python benchmarks/gpu_mlp.py --tune [--quick] [--out PATH]

By default the cases below (Llama-3-8B and Qwen2-7B widths at 4K and 16K tokens; SwiGLU and GeGLU
(tanh, erf) over the fused gate-first projection and split gate / up; bf16 and fp16, fp32 at the
first shape) go to `parity bench` (benchmarks/bench_cases.py) with backends triton (ours), torch
(F.silu(g) * u, F.gelu(g) * u) and liger (the `peers` extra; a skip with the reason where it does not
install or has no such form): every case judged by the gate, timed with do_bench, its bytes over
the copy ceiling measured in the same run, and each peer's ms over ours.
--tune instead runs the direct measurement (1 GiB copy, ours / liger / torch by hand) and sweeps the
launch table (tile elements, widest column block, warps) at the headline shapes; each row's line gives
the gate's verdict and norm_err for ours' two forms, the same cases (bench_cases.Gate: mlp.swiglu /
mlp.geglu, layout fused and split, on the triton backend), and a case the gate fails makes the exit
status 1. Inputs are >= 470 MB, far beyond L2 (50-60 MB).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ((16384, 14336), (4096, 14336), (16384, 18944), (4096, 18944))  # Llama-3-8B, Qwen2-7B widths
QUICK_SHAPES = ((4096, 14336),)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape, fewer repetitions")
    p.add_argument("--tune", action="store_true", help="sweep the launch table at the headline shapes")
    default_out = os.path.join(os.environ["OUT"], "mlp_bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/mlp_bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    if args.out:
        check_output_or_exit(p.prog, "--out", args.out)
    return args


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run); --quick: bf16 at QUICK_SHAPES, SwiGLU fused
    and split, GeGLU (tanh) fused (three input groups, a first line in seconds)."""
    if quick:
        be, params = ["triton", "torch", "liger"], [dict(t=t, i=i) for t, i in QUICK_SHAPES]
        return [{"op": "mlp.swiglu", "backends": be, "dtypes": ["bf16"],
                 "params": [dict(p, layout=layout) for p in params for layout in ("fused", "split")]},
                {"op": "mlp.geglu", "backends": be, "dtypes": ["bf16"],
                 "params": [dict(p, layout="fused", approx="tanh") for p in params]}]
    shapes = SHAPES
    out = []
    for op, forms in (("mlp.swiglu", [{}]), ("mlp.geglu", [{"approx": "tanh"}, {"approx": "erf"}])):
        for dtypes, sh in ((["bf16", "fp16"], shapes), (["fp32"], shapes[:1])):
            out.append({"op": op, "backends": ["triton", "torch", "liger"], "dtypes": dtypes,
                        "params": [dict(t=t, i=i, layout=layout, **form) for t, i in sh
                                   for layout in ("fused", "split") for form in forms]})
    return out


def main() -> int:
    args = parse_args()
    if not args.tune:
        from bench_cases import run

        return run(entries(args.quick), out=args.out or "mlp_bench.json", ours="triton", argv=("--no-recheck",),
                   description="benchmarks/gpu_mlp.py")
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("gpu_mlp: no CUDA device; this benchmark must run on a GPU machine", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate, gate_text

    from kernel_parity.kernels.triton import mlp as k

    try:
        import liger_kernel.ops as lk
    except Exception as e:  # not installed: ours and torch only
        lk = None
        print(f"gpu_mlp: liger-kernel not importable ({type(e).__name__}: {e})")
    dev = torch.device("cuda")
    kw = dict(warmup=10 if args.quick else 25, rep=50 if args.quick else 200, return_mode="median")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def ms(fn) -> float:
        return float(do_bench(fn, **kw))

    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 2 * n * 2 / (ms(lambda: dst.copy_(src)) * 1e6)
    del src, dst
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")

    gate = Gate("triton")
    results, tuned = [], []
    acts = ("silu", "tanh", "erf")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for (t, i), dname in itertools.product(shapes, ("bf16", "fp16", "fp32")):
        if dname == "fp32" and (t, i) != shapes[0]:
            continue
        dtype = dtypes[dname]
        h = torch.randn((t, 2 * i), device=dev, dtype=torch.float32).mul_(2.0).to(dtype)
        g, u = h[:, :i], h[:, i:]
        gs, us = g.contiguous(), u.contiguous()
        y = torch.empty((t, i), device=dev, dtype=dtype)
        nbytes = 3 * t * i * h.element_size()
        for act in acts:
            ours_fused = (lambda: k.swiglu_fused(h, out=y)) if act == "silu" else (lambda: k.geglu_fused(h, act, out=y))
            ours_split = (lambda: k.swiglu(gs, us, out=y)) if act == "silu" else (lambda: k.geglu(gs, us, act, out=y))
            op, form = ("mlp.swiglu", {}) if act == "silu" else ("mlp.geglu", {"approx": act})
            row = dict(t=t, i=i, dtype=dname, act=act,
                       gate={layout: gate(op, dname, dict(t=t, i=i, layout=layout, **form))
                             for layout in ("fused", "split")})
            for name, fn in (("ours_fused", ours_fused), ("ours_split", ours_split)):
                m = ms(fn)
                row[name] = dict(ms=m, gbs=nbytes / (m * 1e6), pct_copy=100 * nbytes / (m * 1e6) / copy_gbs)
            torch_fn = (lambda: F.silu(g) * u) if act == "silu" else (
                lambda: F.gelu(g, approximate="tanh" if act == "tanh" else "none") * u)
            m = ms(torch_fn)
            row["torch"] = dict(ms=m, gbs=nbytes / (m * 1e6), pct_copy=100 * nbytes / (m * 1e6) / copy_gbs)
            if lk is not None and act != "erf":
                liger = {"silu": [("liger_fused", lambda: lk.LigerFusedGateUpSiLUMulFunction.apply(h)),
                                  ("liger_split", lambda: lk.LigerSiLUMulFunction.apply(gs, us))],
                         "tanh": [("liger_split", lambda: lk.LigerGELUMulFunction.apply(gs, us))]}[act]
                for name, fn in liger:
                    m = ms(fn)
                    row[name] = dict(ms=m, gbs=nbytes / (m * 1e6), pct_copy=100 * nbytes / (m * 1e6) / copy_gbs)
            results.append(row)
            print(f"{dname} t={t:>5} i={i:>5} {act:>4}: " + "  ".join(
                f"{name} {v['ms']:.3f} ms {v['pct_copy']:.0f}%" for name, v in row.items()
                if isinstance(v, dict) and name != "gate")
                + "   " + ", ".join(f"{layout} {gate_text(v)}" for layout, v in row["gate"].items()), flush=True)
        if args.tune and (t, i) in ((16384, 14336), (4096, 14336)) and dname in ("bf16", "fp32"):
            saved = (k.TILE, k.BLOCK_N_MAX, k.NUM_WARPS)
            for tile, bn, warps in itertools.product((2048, 4096, 8192, 16384), (512, 1024, 2048, 4096), (4, 8)):
                if bn > tile:
                    continue
                k.TILE, k.BLOCK_N_MAX, k.NUM_WARPS = tile, bn, warps
                for act in ("silu", "erf"):
                    fn = (lambda: k.swiglu_fused(h, out=y)) if act == "silu" else (lambda: k.geglu_fused(h, act, out=y))
                    m = ms(fn)
                    tuned.append(dict(t=t, i=i, dtype=dname, act=act, tile=tile, block_n=bn, warps=warps, ms=m,
                                      pct_copy=100 * nbytes / (m * 1e6) / copy_gbs))
            k.TILE, k.BLOCK_N_MAX, k.NUM_WARPS = saved
            best = sorted((r for r in tuned if r["t"] == t and r["dtype"] == dname), key=lambda r: r["ms"])[:4]
            for r in best:
                print(f"  tune {dname} t={t} {r['act']}: tile {r['tile']} block_n {r['block_n']} warps {r['warps']}: "
                      f"{r['ms']:.3f} ms {r['pct_copy']:.1f}%")
        del h, g, u, gs, us, y
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               time=time.strftime("%Y-%m-%d %H:%M:%S"), copy_gbs=copy_gbs,
               config=dict(tile=k.TILE, block_n_max=k.BLOCK_N_MAX, num_warps=k.NUM_WARPS),
               results=results, tuned=tuned, gate_failures=gate.failures)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    for f in gate.failures:
        print("GATE FAIL", f)
    return 1 if gate.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
