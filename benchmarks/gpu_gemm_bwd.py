"""GPU benchmark of the GEMM backward Triton kernels (kernels/triton/gemm_bwd.py) on Hopper, beside eager
torch's autograd of the same product.

    python benchmarks/gpu_gemm_bwd.py [--quick] [--out PATH] [--smoke-cpu]

1. Header: the bf16 matmul rate (torch.matmul 8192^3) and the fp32 one ("highest" precision, no tf32),
   measured in this run; every TFLOP/s figure is also given as a share of the dtype's rate.
2. float32 W (a training step's projection), Llama-3-8B at M = 512 tokens: q / o (4096 x 4096), k / v
   (1024 x 4096), gate / up (14336 x 4096), down (4096 x 14336), bf16 and fp32 activations: our
   gemm_nt_backward (da = dc W, dw = dc^T A, db = sum dc: two GEMMs of 2 M N K flops each and a column sum)
   against torch.autograd.grad of `a @ w.to(a.dtype).T + b` (what an eager model's backward runs).
3. Quantized W (Q4_K, Q6_K, Q8_0: a QLoRA step, da only) at the same shapes: our fused dequantize-GEMM
   against torch's dequantize-then-matmul (kernels/torch/gemm.py's dequantization, timed with it: an
   eager step does it every time) and against a matmul of a pre-dequantized W (the floor of that path).
Every timed kernel's outputs are checked once against float64 (torch on the GPU, from the same rounded
inputs; dw on the first 512 rows): err = max |x - ref| / (|dc| |W|) elementwise scale, against the path's
limit (fp32 arithmetic 1e-5; bf16: W and the output rounded to bf16, 8e-3). Timings are do_bench medians.
Results go to --out (default $OUT/gemm-bwd-bench.json). --smoke-cpu runs tiny shapes under the Triton
interpreter to check the script itself.
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

LIMITS = {"fp32": 1e-5, "bf16": 8e-3}
M = 512
SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
QUANT = ("q4_k", "q6_k", "q8_0")
CHECK_ROWS = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes, bf16 only, fewer repetitions")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    default_out = os.path.join(os.environ["OUT"], "gemm-bwd-bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output (default $OUT/gemm-bwd-bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    if args.out:
        check_output_or_exit(p.prog, "--out", args.out)
    return args


def main() -> int:
    args = parse_args()
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        from kernel_parity.conformance.backends.triton_prep import interpreter_ready

        why = interpreter_ready()  # also fixes the interpreter's bf16 casts and dots
        if why:
            print(f"gpu_gemm_bwd: the Triton interpreter cannot run here: {why}", file=sys.stderr)
            return 2
    import numpy as np
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print("gpu_gemm_bwd: no CUDA device; run on a GPU machine (or --smoke-cpu)", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from kernel_parity.kernels.torch import gemm as tg
    from kernel_parity.kernels.triton import gemm_bwd as k
    from kernel_parity.refimpl import quant

    dev = torch.device("cpu" if args.smoke_cpu else "cuda")
    kw = dict(warmup=5 if args.quick else 25, rep=20 if args.quick else 100, return_mode="median")
    m = 16 if args.smoke_cpu else M
    shapes = {"tiny": (64, 256)} if args.smoke_cpu else (
        {n: SHAPES[n] for n in ("q/o", "down")} if args.quick else SHAPES)
    dtypes = {"bf16": torch.bfloat16} if args.quick else {"bf16": torch.bfloat16, "fp32": torch.float32}

    def ms(fn) -> float:
        if args.smoke_cpu:  # the interpreter: one call, wall time
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return float(do_bench(fn, **kw))

    rates = {}
    if not args.smoke_cpu:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            x = torch.randn(8192, 8192, device=dev, dtype=dtype)
            torch.backends.cuda.matmul.allow_tf32 = False
            rates[name] = 2 * 8192**3 / (ms(lambda: x @ x) * 1e9)
            del x
        print(f"{torch.cuda.get_device_name()}: matmul bf16 {rates['bf16']:.0f} TFLOP/s, fp32 {rates['fp32']:.0f}")

    def figures(t_ms: float, flops: float, dname: str) -> dict:
        tf = flops / (t_ms * 1e9)
        return dict(ms=t_ms, tflops=tf, pct_matmul=100 * tf / rates[dname] if dname in rates else None)

    def err(got, ref, scale) -> float:
        return float(((got.double() - ref).abs() / scale.clamp_min(1e-30)).max())

    results, failures = [], []

    def entry(row: dict, fn) -> None:
        try:
            row.update(fn())
        except Exception as e:  # one failing entry is recorded; the run goes on
            row["error"] = f"{type(e).__name__}: {e}"
            failures.append(f"{row}: {traceback.format_exc().splitlines()[-1]}")
        results.append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(rates=rates, results=results, failures=failures), indent=1))
        print(json.dumps(row))

    for sname, (n, kk) in shapes.items():
        for dname, dtype in dtypes.items():
            a = torch.randn(m, kk, device=dev, dtype=torch.float32).to(dtype)
            dc = torch.randn(m, n, device=dev, dtype=torch.float32).to(dtype)
            w = (torch.randn(n, kk, device=dev) * 0.02).float()
            bias = torch.randn(n, device=dev)
            flops = 2 * 2 * m * n * kk

            def f32_entry():
                out = k.gemm_nt_backward(a, "f32", w, dc, bias=True)
                a64, w64, dc64 = a.double(), w.double(), dc.double()
                lim = LIMITS["fp32" if dtype == torch.float32 else "bf16"]
                e_da = err(out["da"], dc64 @ w64, dc64.abs() @ w64.abs())
                r = slice(0, CHECK_ROWS)
                e_dw = err(out["dw"][r], dc64[:, r].T @ a64, dc64[:, r].abs().T @ a64.abs())
                row = dict(err_da=e_da, err_dw=e_dw, ok=max(e_da, e_dw) <= lim)
                if not row["ok"]:
                    failures.append(f"{sname} {dname} f32 W: err {max(e_da, e_dw):.3g} > {lim}")
                row["ours"] = figures(ms(lambda: k.gemm_nt_backward(a, "f32", w, dc, bias=True)), flops, dname)

                def eager():
                    return tg.gemm_nt_backward(a, "f32", {"w": w}, dc, bias)

                row["torch"] = figures(ms(eager), flops, dname)
                return row

            entry(dict(shape=sname, n=n, k=kk, m=m, dtype=dname, wfmt="f32"), f32_entry)
            for fmt in QUANT:
                wq_np = quant.quantize(fmt, w.cpu().numpy())
                wq = torch.from_numpy(wq_np).to(dev)
                w_deq = torch.from_numpy(quant.dequantize(fmt, wq_np).astype(np.float32)).to(dev)

                def q_entry(fmt=fmt, wq=wq, w_deq=w_deq):
                    da = torch.empty(m, kk, device=dev, dtype=dtype)
                    k.backward_da(dc, fmt, wq, da)
                    dc64, w64 = dc.double(), w_deq.double()
                    lim = LIMITS["fp32" if dtype == torch.float32 else "bf16"]
                    e = err(da, dc64 @ w64, dc64.abs() @ w64.abs())
                    row = dict(err_da=e, ok=e <= lim)
                    if e > lim:
                        failures.append(f"{sname} {dname} {fmt}: err {e:.3g} > {lim}")
                    half = flops / 2
                    row["ours"] = figures(ms(lambda: k.backward_da(dc, fmt, wq, da)), half, dname)
                    row["torch_dequant_matmul"] = figures(
                        ms(lambda: tg.gemm_nt_backward(a, fmt, {"w": wq}, dc)), half, dname)
                    wd = w_deq.to(dtype)
                    row["torch_matmul_predequantized"] = figures(ms(lambda: dc @ wd), half, dname)
                    return row

                entry(dict(shape=sname, n=n, k=kk, m=m, dtype=dname, wfmt=fmt), q_entry)
            del a, dc, w, bias
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
               torch=torch.__version__, triton=triton.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"),
               m=m, rates=rates, config=dict(matmul=k.MATMUL_CONFIG, da=k.DA_CONFIGS, colsum=k.COLSUM_BLOCK),
               results=results, failures=failures)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
