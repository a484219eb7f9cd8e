"""GPU benchmark of the GEMM backward Triton kernels (kernels/triton/gemm_bwd.py) on Hopper, beside eager
torch's autograd of the same product.

    python benchmarks/gpu_gemm_bwd.py [--quick] [--out PATH]          # a thin caller of `parity bench`
    python benchmarks/gpu_gemm_bwd.py --tune [--quick] [--out PATH]   # the measurement by hand
    python benchmarks/gpu_gemm_bwd.py --tune --smoke-cpu [--quick]    # --tune's code at one tiny shape, CPU

The shapes are Llama-3-8B's projections at M = 512 tokens (a training step): q / o (4096 x 4096), k / v
(1024 x 4096), gate / up (14336 x 4096), down (4096 x 14336), as N x K of W.

By default they go to `parity bench` (benchmarks/bench_cases.py) as gemm.gemm_nt_backward, backends
triton (ours) and torch (kernels/torch/gemm.py: autograd through the eager forward, in A's dtype; for a
quantized W the dequantize-then-matmul path; timed whole, its forward included, as an eager step runs
it): every case judged by the gate against the float64 golden (its verdict and norm_err are the
accuracy figures), timed with do_bench, set against the ceilings measured in the same run, and
torch's ms over ours. The ceiling is the matmul rate (bf16 on a GPU: an fp32 case's share is of that
rate) only for an op whose spec declares its flops (OpSpec.flops); gemm.gemm_nt_backward does not yet,
so parity bench gives its bytes (inputs read, gradients written once) over the copy ceiling, and
--tune gives TFLOP/s.
- float32 W with a bias (da = dc W, dw = dc^T A, db = sum dc: 2 x 2 M N K flops), bf16 and fp32
  activations, every shape;
- quantized W, Q4_K, Q6_K and Q8_0 (the QLoRA step: da only, 2 M N K flops, the weight dequantized in
  registers): bf16 activations at every shape, fp32 activations at q / o and k / v only. Drawing a
  quantized 14336 x 4096 weight (the golden quantizers) is 10-20 s of host work per input group, and
  each dtype is its own group: fp32 at the two large shapes would add ~85 s for no other kernel path.
26 input groups, 52 records; about 3 minutes of host work on an H200 host (estimated from the
models suite's per-group times in reports/baselines/models-h200.jsonl.gz).
The C backend (cpu: fp32 only) is left out: ~17 GFLOP/s on the host, up to 7 s a call at these shapes
and at least six calls timed per case, minutes for a ratio that says nothing of a GPU kernel; the gate
judges it at M = 64 (conformance/suites/models.toml).
--quick: bf16; float32 W at q / o (the first group parity bench runs: its first line in seconds), Q8_0
at q / o and Q4_K at k / v; three input groups, one per kernel path (the matmul, two GGML decoders).

--tune: the direct measurement. A header with the bf16 and fp32 matmul rates (torch.matmul 8192^3, fp32
without tf32) measured in this run; then per shape (--quick: q / o and down) and dtype (--quick: bf16)
float32 W: ours (gemm_nt_backward) against torch.autograd.grad of `a @ w.to(a.dtype).T + b`; each
quantized W: ours (backward_da) against torch's dequantize-then-matmul (dequantized every call, as an
eager step does) and against a matmul of a pre-dequantized W (the floor of that path). do_bench medians,
TFLOP/s and the share of the dtype's matmul rate. Each row's line gives the gate's verdict and norm_err
for ours on the same case (bench_cases.Gate: gemm.gemm_nt_backward with the params of the default
path, on the triton backend, from the case's own inputs); a case the gate fails, or a timing that
raises, makes the exit status 1. The gate draws its own inputs, so a full --tune costs the host about
twice the default path's work. --smoke-cpu runs --tune (implied) at M = 16, 64 x 256 on the CPU (any
GPU hidden) under the Triton interpreter, one call per timing, to check the script itself.
Results go to --out (default $OUT/gemm-bwd-bench.json, else ./gemm-bwd-bench.json); --tune rewrites it
after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OP = "gemm.gemm_nt_backward"
BACKENDS = ["triton", "torch"]
M = 512
SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}  # (N, K)
QUANT = ("q4_k", "q6_k", "q8_0")
FP32_QUANT_SHAPES = ("q/o", "k/v")  # fp32 activations through a quantized W: the cheap weights (docstring)
QUICK = (("q/o", "f32"), ("q/o", "q8_0"), ("k/v", "q4_k"))  # bf16; float32 W first
TUNE_QUICK = ("q/o", "down")
SMOKE_M, SMOKE_SHAPE = 16, (64, 256)


def _params(n: int, k: int, wfmt: str, m: int = M) -> dict:
    """One case's params (the same in `entries` and --tune's gate check): float32 W with its bias (da, dw
    and db), a quantized W without (da only: the bias has no effect on it)."""
    return dict(m=m, n=n, k=k, wfmt=wfmt, bias=int(wfmt == "f32"))


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run); --quick: QUICK, bf16."""
    common = {"op": OP, "backends": BACKENDS, "dists": ["normal"]}
    if quick:
        return [{**common, "dtypes": ["bf16"], "params": [_params(*SHAPES[s], w) for s, w in QUICK]}]
    return [{**common, "dtypes": ["bf16", "fp32"], "params": [_params(n, k, "f32") for n, k in SHAPES.values()]},
            {**common, "dtypes": ["bf16"], "params": [_params(n, k, w) for w in QUANT for n, k in SHAPES.values()]},
            {**common, "dtypes": ["fp32"],
             "params": [_params(*SHAPES[s], w) for w in QUANT for s in FP32_QUANT_SHAPES]}]


def main() -> int:
    from bench_cases import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three bf16 input groups (--tune: q/o and down, bf16)")
    p.add_argument("--tune", action="store_true", help="the measurement by hand instead of parity bench")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="--tune's code at one tiny shape on the CPU (Triton interpreter); implies --tune")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm-bwd-bench.json"),
                   help="JSON output (default $OUT/gemm-bwd-bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    if args.smoke_cpu:
        return tune(args, p.prog)
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU "
              "(--tune --smoke-cpu checks the script on the CPU)", file=sys.stderr)
        return 2
    if args.tune:
        return tune(args, p.prog)
    from bench_cases import run

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # run() writes with Path.write_text, after the bench
    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_gemm_bwd.py")


def tune(args: argparse.Namespace, prog: str) -> int:
    """The direct measurement (module docstring): ours, torch's autograd, dequantize-then-matmul and its
    floor by hand, each row beside the gate's verdict on the same case."""
    if args.smoke_cpu:  # before torch and triton are imported: the gate's triton backend then runs here too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"
        from kernel_parity.conformance.backends.triton_prep import interpreter_ready

        why = interpreter_ready()  # also fixes the interpreter's bf16 casts and dots
        if why:
            print(f"{prog}: error: the Triton interpreter cannot run here: {why}", file=sys.stderr)
            return 2
    import numpy as np
    import torch
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate

    from kernel_parity.kernels.torch import gemm as tg
    from kernel_parity.kernels.triton import gemm_bwd as k
    from kernel_parity.refimpl import quant
    from kernel_parity.reports.files import write_text

    dev = torch.device("cpu" if args.smoke_cpu else "cuda")
    kw = dict(warmup=5 if args.quick else 25, rep=20 if args.quick else 100, return_mode="median")
    m = SMOKE_M if args.smoke_cpu else M
    shapes = {"tiny": SMOKE_SHAPE} if args.smoke_cpu else (
        {s: SHAPES[s] for s in TUNE_QUICK} if args.quick else SHAPES)
    dtypes = {"bf16": torch.bfloat16} if args.quick else {"bf16": torch.bfloat16, "fp32": torch.float32}

    def ms(fn) -> float:
        if args.smoke_cpu:  # the interpreter: one call, wall time
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return float(do_bench(fn, **kw))

    rates = {}
    if not args.smoke_cpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            x = torch.randn(8192, 8192, device=dev, dtype=dtype)
            rates[name] = 2 * 8192**3 / (ms(lambda: x @ x) * 1e9)
            del x
        print(f"{torch.cuda.get_device_name()}: matmul bf16 {rates['bf16']:.0f} TFLOP/s, fp32 {rates['fp32']:.0f}",
              flush=True)
    doc = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
               torch=torch.__version__, triton=triton.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"),
               m=m, rates=rates, config=dict(matmul=k.MATMUL_CONFIG, da=k.DA_CONFIGS, colsum=k.COLSUM_BLOCK),
               results=[], errors=[])
    gate = Gate("triton")

    def figures(t_ms: float, flops: float, dname: str) -> dict:
        tf = flops / (t_ms * 1e9)
        return dict(ms=t_ms, tflops=tf, pct_matmul=100 * tf / rates[dname] if dname in rates else None)

    def entry(row: dict, fn) -> None:
        row["gate"] = gate(OP, row["dtype"], _params(row["n"], row["k"], row["wfmt"], m))
        try:
            row.update(fn())
        except Exception as e:  # one failing timing is recorded; the run goes on
            row["error"] = f"{type(e).__name__}: {e}"
            doc["errors"].append(f"{row['shape']} {row['dtype']} {row['wfmt']}: "
                                 f"{traceback.format_exc().splitlines()[-1]}")
        doc["results"].append(row)
        write_text(args.out, json.dumps(doc, indent=1))
        print(_line(row), flush=True)

    for sname, (n, kk) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, kk, device=dev, generator=g) * 0.02
        bias = torch.randn(n, device=dev, generator=g)
        w_np = w.cpu().numpy()
        wq_np = {fmt: quant.quantize(fmt, w_np) for fmt in QUANT}  # once per shape: 10-20 s for Q4_K at 14336 x 4096
        wq = {fmt: torch.from_numpy(q).to(dev) for fmt, q in wq_np.items()}
        w_deq = {fmt: torch.from_numpy(quant.dequantize(fmt, q).astype(np.float32)).to(dev) for fmt, q in wq_np.items()}
        flops = 2 * 2 * m * n * kk  # da and dw: two GEMMs of 2 M N K each (db's column sum aside)
        for dname, dtype in dtypes.items():
            a = torch.randn(m, kk, device=dev, generator=g).to(dtype)
            dc = torch.randn(m, n, device=dev, generator=g).to(dtype)

            def f32_row():
                return {"ours": figures(ms(lambda: k.gemm_nt_backward(a, "f32", w, dc, bias=True)), flops, dname),
                        "torch": figures(ms(lambda: tg.gemm_nt_backward(a, "f32", {"w": w}, dc, bias)), flops, dname)}

            entry(dict(shape=sname, n=n, k=kk, m=m, dtype=dname, wfmt="f32"), f32_row)
            for fmt in QUANT:
                def q_row(fmt=fmt):
                    da = torch.empty(m, kk, device=dev, dtype=dtype)
                    wd = w_deq[fmt].to(dtype)
                    half = flops / 2  # da alone
                    return {"ours": figures(ms(lambda: k.backward_da(dc, fmt, wq[fmt], da)), half, dname),
                            "torch_dequant_matmul": figures(
                                ms(lambda: tg.gemm_nt_backward(a, fmt, {"w": wq[fmt]}, dc)), half, dname),
                            "torch_matmul_predequantized": figures(ms(lambda: dc @ wd), half, dname)}

                entry(dict(shape=sname, n=n, k=kk, m=m, dtype=dname, wfmt=fmt), q_row)
            del a, dc
        del w, bias, wq, w_deq
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    doc["gate_failures"] = gate.failures
    write_text(args.out, json.dumps(doc, indent=1))
    for f in gate.failures:
        print("GATE FAIL", f, flush=True)
    for e in doc["errors"]:
        print("ERROR", e, flush=True)
    return 1 if gate.failures or doc["errors"] else 0


def _line(row: dict) -> str:
    """`bf16 q/o 4096x4096 f32: ours 0.1793 ms 95.8 TFLOP/s 12.1% | torch ... | gate pass norm_err 0.21`."""
    from bench_cases import gate_text

    parts = []
    for name, f in row.items():
        if isinstance(f, dict) and "ms" in f:
            pct = "" if f["pct_matmul"] is None else f" {f['pct_matmul']:.1f}%"
            parts.append(f"{name} {f['ms']:.4f} ms {f['tflops']:.3g} TFLOP/s{pct}")
    if "error" in row:
        parts.append(f"error: {row['error']}")
    return (f"{row['dtype']} {row['shape']} {row['n']}x{row['k']} {row['wfmt']}: " + " | ".join(parts)
            + f" | {gate_text(row['gate'])}")


if __name__ == "__main__":
    sys.exit(main())
