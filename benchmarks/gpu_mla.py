"""GPU benchmark of the Triton MLA decode kernels (kernels/triton/mla.py, mla_sparse.py, mla_fused.py) on Hopper.

    python benchmarks/gpu_mla.py [--quick] [--out PATH]            # a thin caller of `parity bench`
    python benchmarks/gpu_mla.py --tune [--quick] [--sections configs,sdpa,sparse,fused] [--out PATH]
    python benchmarks/gpu_mla.py --smoke-cpu [--out PATH]          # --tune at tiny shapes, no GPU

By default the cases below go to `parity bench` (benchmarks/bench_cases.py), bf16, with backends triton
(ours) and torch (kernels/torch/mla.py: the eager composition, the ops' declared baseline): every case
judged by the gate against the float64 golden (its verdict and norm_err are the accuracy figures),
timed with do_bench (L2 cleared before every call; the caches are >= 300 MB), its bytes over the copy /
read ceiling measured in the same run, and torch's ms over ours. The cpu backend (kernels/cpu/mla.c) is
left out: at these sizes it is seconds a call on the host, no peer of a GPU kernel.
- mla.decode, FlashMLA's benchmark grid: b=128, s_q in {1, 2} (2: causal bottom-right), h_q in {16,
  32, 64, 128}, 4096 / 8192 / 16384 cached tokens, FlashMLA's scale 576^-0.5. Lengths are ragged as
  in the models suite (FlashMLA's test pattern: longest, 0, 1, longest - 1, longest / 2, then (i + 1)
  / (i + 2) of the longest; 95.7% of b x kv tokens), so the gate judges a seeded sample of ~40
  requests (conformance/sampling.py) rather than a float64 golden of minutes.
- mla.decode_sparse: s_q = 1, top-2048 slots among 8192 cached tokens, h_q in {64, 128}.
- mla.decode_fused_fp8 (MAX's FP8 decode branch) at DeepSeek-V3's shapes: b=128, one new token a
  request, h_q in {16, 128}, 4096 / 16384 cached tokens. Its golden is not sampled: a 16384-token
  group takes minutes and some 40 GB of host memory (10 GB at 4096 tokens, h_q = 16, measured).
The figures are parity bench's cost model, every input read once and every output written once: for
decode, FlashMLA's bytes (the cache, q and o). The mla ops declare no `flops` yet, so no case counts
as compute-bound (h_q = 128's share is of the read ceiling); decode_sparse's bytes count its whole
cache, not the ~2048 rows a query reads, and decode_fused_fp8's count the cache twice (an in-place
output, of which the kernel writes the new rows alone): for those two read the ms and torch's ratio;
--tune has FlashMLA's formulas.
--quick: mla.decode at 4096 tokens, (s_q, h_q) = (1, 16) and (2, 128), and decode_sparse at h_q = 64
(three input groups, a first line in seconds).

--tune instead times the kernels directly, with FlashMLA's formulas, config and split sweeps and torch
SDPA beside them, each timed row with the gate's verdict; --smoke-cpu runs it at tiny shapes in the
Triton interpreter. It lives in benchmarks/gpu_mla_tune.py, imported on that path alone, whose docstring
has its sections and flags (--sections, --tune-budget, --fused-configs).
Results: --out (default $OUT/mla-bench.json, else ./mla-bench.json): parity bench's summary, or --tune's
document (header, ceilings, rows, best_configs, gate_failures, errors), rewritten after every row.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

B, HEADS, TOKENS = 128, (16, 32, 64, 128), (4096, 8192, 16384)
SPARSE_HEADS, SPARSE_TOKENS, TOPK = (64, 128), 8192, 2048
FUSED_HEADS, FUSED_TOKENS = (16, 128), (4096, 16384)
QUICK_DECODE = ((1, 16, 4096), (2, 128, 4096))  # (s_q, h_q, kv): memory-bound, then compute-bound
QUICK_SPARSE = (64,)  # h_q
BACKENDS = ["triton", "torch"]
COMMON = {"dtypes": ["bf16"], "dists": ["normal"]}
SECTIONS = ("configs", "sdpa", "sparse", "fused")


def _decode(b: int, sq: int, hq: int, kv: int) -> dict:
    return dict(b=b, sq=sq, hq=hq, kv=kv, lens="ragged", causal=int(sq == 2), scale="head")


def _sparse(b: int, hq: int, kv: int, topk: int) -> dict:
    return dict(b=b, sq=1, hq=hq, kv=kv, lens="ragged", topk=topk, topk_len="full", scale="head")


def _fused(b: int, hq: int, kv: int) -> dict:
    return dict(b=b, new=1, hq=hq, kv=kv, lens="ragged", sink=0)


def entries(quick: bool = False) -> list[dict]:
    """The default path's cases as suite entries (bench_cases.run); --quick: QUICK_DECODE and QUICK_SPARSE."""
    decode = QUICK_DECODE if quick else [(sq, hq, kv) for kv in TOKENS for sq in (1, 2) for hq in HEADS]
    out = [{"op": "mla.decode", "backends": BACKENDS, **COMMON, "params": [_decode(B, *s) for s in decode]},
           {"op": "mla.decode_sparse", "backends": BACKENDS, **COMMON,
            "params": [_sparse(B, hq, SPARSE_TOKENS, TOPK) for hq in (QUICK_SPARSE if quick else SPARSE_HEADS)]}]
    if not quick:
        out.append({"op": "mla.decode_fused_fp8", "backends": BACKENDS, **COMMON,
                    "params": [_fused(B, hq, kv) for kv in FUSED_TOKENS for hq in FUSED_HEADS]})
    return out


def main() -> int:
    from bench_cases import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three input groups (default path), or trimmed sweeps (--tune)")
    p.add_argument("--tune", action="store_true", help="the direct measurement: sweeps, FlashMLA's formulas, SDPA")
    p.add_argument("--smoke-cpu", action="store_true", help="--tune at tiny shapes in the Triton interpreter (no GPU)")
    p.add_argument("--sections", default=None, help=f"--tune's sections, a comma list of {', '.join(SECTIONS)}")
    p.add_argument("--tune-budget", type=float, default=100.0, help="seconds after which configs runs only the table")
    p.add_argument("--fused-configs", type=int, default=None, metavar="N",
                   help="sweep the first N of FUSED_SWEEP (default all; 0: only mla_fused.ATTEND_CONFIG)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mla-bench.json"),
                   help="JSON output path (default $OUT/mla-bench.json)")
    args = p.parse_args()
    hand = args.tune or args.smoke_cpu
    sections = [s.strip() for s in (args.sections or ",".join(SECTIONS)).split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        why = {"parity": "; the small-shape checks are the gate's: parity run --suite ci --op mla --backend triton",
               "bench": "; bench is the default path (no --tune)", "tune": "; the sweeps are configs"}
        p.error(f"--sections {args.sections!r}: expected a comma list of {', '.join(SECTIONS)}"
                + "".join(why.get(s, "") for s in bad))
    if args.sections is not None and not hand:
        p.error("--sections selects parts of --tune; add --tune")
    if args.fused_configs is not None and args.fused_configs < 0:
        p.error(f"--fused-configs {args.fused_configs}: expected a count >= 0")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    if args.smoke_cpu:
        from kernel_parity.conformance.backends.triton_prep import interpreter_mode, interpreter_ready, \
            prepare_environment

        if not interpreter_mode():
            p.error("--smoke-cpu is for a machine without a CUDA GPU; on a GPU use --tune")
        prepare_environment()  # TRITON_INTERPRET=1 before triton is imported
        why = interpreter_ready()
        if why:
            p.error(f"--smoke-cpu: {why}")
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        p.error("no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU "
                "(without one: --smoke-cpu)")
    if hand:
        from gpu_mla_tune import tune

        return tune(args, sections)
    from bench_cases import run

    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_mla.py")


if __name__ == "__main__":
    sys.exit(main())
