"""GPU benchmark of the quantized GEMMs of gemm.gemm_nt (kernels/triton/gemm*.py) beside the peers, on Hopper.

    python benchmarks/gpu_gemm.py [--quick] [--out PATH]        # a thin caller of `parity bench`
    python benchmarks/gpu_gemm.py --tune [--quick] [--out PATH] [--budget-s S] [--sections gemv,q8,prefill,fp8,int4]
                                  [--formats q4_k,...] [--q8-grid] [--q8-m 1,4,16] [--dump PATH] [--smoke-cpu]

By default the gemm.gemm_nt cases below go to `parity bench` (benchmarks/bench_cases.py), bf16 A: every
case judged by the gate against the float64 golden (its verdict and norm_err are the accuracy figures),
timed with do_bench (L2 cleared before every call), its bytes over the read ceiling (a GEMV reads its
weights and writes one row) or its flops over the bf16 matmul rate (prefill), both measured in the same
run, and each peer's ms over ours (triton). A backend that cannot express a case is a skip with its reason.
- GGML Q4_K, Q8_0, Q4_0, Q6_K (weights of random codes, dist `random`): M = 1 at N x K = 14336 x 4096 and
  4096 x 14336 (Llama-3-8B's gate / up and down), M = 4 and 16 at 14336 x 4096. Backends triton (ours: W
  dequantized in registers), triton-q8 (ours: Q8_K / Q8_0 activations, integer dots; Q4_K and Q8_0 only)
  and torch (W dequantized to bf16, then a @ w.T).
- Q4_K prefill, M = 4096 at 4096 x 4096 and 14336 x 4096: the same three backends.
- FP8 e4m3, M = N = K = 8192 (dist normal): DeepSeek's 1 x 128 x 128 blockwise (fp8), per-token x
  per-channel (fp8_row) and per-tensor (fp8_tensor) scales; triton, torch and scaled-mm (torch._scaled_mm).
- int4 GPTQ and AWQ, group 128 (dist normal): M = 4096 and 1 at 4096 x 4096 and 14336 x 4096; triton, torch.
71 cases in 29 input groups. The goldens of the M >= 4096 groups are judged on a sample of rows
(conformance/sampling.py): about 5 s of host float64 work a group, a few minutes for the whole list.
--quick: three M = 1 GEMVs, Q4_K and Q8_0 at 14336 x 4096 (triton, triton-q8, torch) and Q6_K at
4096 x 14336 (triton, torch): a first line in seconds.

--tune (implied by any flag after --out above) instead times the kernels by hand, the sweeps that picked
the launch tables, each timed GEMM with the gate's verdict: benchmarks/gpu_gemm_tune.py, imported on that
path alone, whose docstring has its sections and flags. benchmarks/gpu_gate.sh's gemm step (--quick
--budget-s S) and q8 step (--sections q8 --budget-s S) run it.
Results: --out (default $OUT/gemm-bench.json, else ./gemm-bench.json): bench's summary, or tune's
{header, results, errors, gate_failures}, rewritten after each entry.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OP = "gemm.gemm_nt"
GGML = ("q4_k", "q8_0", "q4_0", "q6_k")  # the GGML formats of the triton backend
Q8 = ("q4_k", "q8_0")  # the formats triton-q8 has a quantized-activation path for
GEMV_SHAPES = ((14336, 4096), (4096, 14336))  # N x K: Llama-3-8B's gate / up, down
PREFILL_SHAPES = ((4096, 4096), (14336, 4096))
PREFILL_M = 4096
FP8_SIZE = 8192
SECTIONS = ("gemv", "q8", "prefill", "fp8", "int4")
BUDGET_S = 170.0


def _case(m: int, n: int, k: int, wfmt: str) -> dict:
    """gemm.gemm_nt's params (no bias): the same in `entries` and in --tune's gate checks."""
    return dict(m=m, n=n, k=k, wfmt=wfmt, bias=0)


def _ggml(fmt: str, params: list[dict]) -> dict:
    return {"op": OP, "backends": ["triton", "triton-q8", "torch"] if fmt in Q8 else ["triton", "torch"],
            "dtypes": ["bf16"], "dists": ["random"], "params": params}


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run); --quick: three M = 1 GEMVs (docstring)."""
    (n, k), (n2, k2) = GEMV_SHAPES
    if quick:
        return [_ggml(f, [_case(1, n, k, f)]) for f in Q8] + [_ggml("q6_k", [_case(1, n2, k2, "q6_k")])]
    out = [_ggml(f, [_case(1, n, k, f), _case(1, n2, k2, f), _case(4, n, k, f), _case(16, n, k, f)]) for f in GGML]
    out.append(_ggml("q4_k", [_case(PREFILL_M, pn, pk, "q4_k") for pn, pk in PREFILL_SHAPES]))
    out.append({"op": OP, "backends": ["triton", "torch", "scaled-mm"], "dtypes": ["bf16"], "dists": ["normal"],
                "params": [_case(FP8_SIZE, FP8_SIZE, FP8_SIZE, w) for w in ("fp8", "fp8_row", "fp8_tensor")]})
    out.append({"op": OP, "backends": ["triton", "torch"], "dtypes": ["bf16"], "dists": ["normal"],
                "params": [_case(m, pn, pk, w) for w in ("int4_gptq", "int4_awq") for pn, pk in PREFILL_SHAPES
                           for m in (PREFILL_M, 1)]})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_cases import OneLineParser

    p = OneLineParser(prog="gpu_gemm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="bench: three M = 1 GEMVs; --tune: the first config of each sweep")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm-bench.json"),
                   help="JSON output (default $OUT/gemm-bench.json, else ./gemm-bench.json)")
    p.add_argument("--tune", action="store_true",
                   help="time the kernels by hand: the sweeps, each with the gate's verdict")
    tune_only = " (implies --tune)"
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"stop the sweeps after this many seconds (default {BUDGET_S:.0f}){tune_only}")
    p.add_argument("--sections", default=None, help=f"comma list of {', '.join(SECTIONS)} (default all){tune_only}")
    p.add_argument("--formats", default=None, help=f"GGML formats of the gemv / decode / q8 sweeps{tune_only}")
    p.add_argument("--q8-grid", action="store_true",
                   help=f"q8: sweep a grid of M = 1 configs (the GEMV alone), then time the three fastest{tune_only}")
    p.add_argument("--q8-m", default=None, help=f"rows of A the q8 section runs, a comma list of 1, 4, 16{tune_only}")
    p.add_argument("--dump", default=None,
                   help=f"write registers, spills and loop opcodes of the compiled kernels here{tune_only}")
    p.add_argument("--smoke-cpu", action="store_true",
                   help=f"tiny shapes on the CPU (Triton interpreter: TRITON_INTERPRET=1){tune_only}")
    args = p.parse_args(argv)
    args.tune = args.tune or args.q8_grid or args.smoke_cpu or any(
        v is not None for v in (args.budget_s, args.sections, args.formats, args.q8_m, args.dump))
    args.budget_s = BUDGET_S if args.budget_s is None else args.budget_s
    args.sections = [s for s in (args.sections or ",".join(SECTIONS)).split(",") if s]
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        p.error(f"--sections {','.join(args.sections)!r}: expected a comma list of {', '.join(SECTIONS)}")
    args.formats = [f for f in (args.formats or "").split(",") if f]
    if not set(args.formats) <= set(GGML):
        p.error(f"--formats {','.join(args.formats)!r}: expected a comma list of {', '.join(GGML)}")
    raw = args.q8_m or ""
    try:
        args.q8_m = sorted({int(x) for x in raw.split(",") if x}) or [1, 4, 16]
    except ValueError:
        args.q8_m = [0]
    if not set(args.q8_m) <= {1, 4, 16}:
        p.error(f"--q8-m {raw!r}: expected a comma list of 1, 4, 16")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    if args.dump:
        check_output_or_exit(p.prog, "--dump", args.dump)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tune:
        from gpu_gemm_tune import tune

        return tune(args)
    import torch

    if not torch.cuda.is_available():
        print("gpu_gemm.py: error: no CUDA device (torch.cuda.is_available() is False); parity bench's cases run "
              "on a GPU (--smoke-cpu checks the --tune script on the CPU)", file=sys.stderr)
        return 2
    from bench_cases import run

    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_gemm.py")


if __name__ == "__main__":
    sys.exit(main())
