"""GPU benchmark of the MoE family (issue 34) on Hopper: a thin caller of `parity bench`.

    python benchmarks/gpu_moe.py [--quick] [--sections route,align,experts] [--out PATH]

Every case is judged by the gate against the float64 golden (its verdict and norm_err are the accuracy figures)
and timed with do_bench; the copy / read ceilings and the bf16 matmul rate are measured in the same run
(conformance/bench.py), and each peer's ms over ours is in the summary.
- moe.route (triton vs the eager torch router) at t 4096 / 16384: Mixtral (8 experts, softmax top-2),
  Qwen3-30B-A3B (128, top-8, unnormalised), DeepSeek-V3 (256, sigmoid + bias, 8 groups keep 4, top-8, x2.5).
- moe.align (triton vs eager torch) at the same token counts and routings, block 64.
- moe.experts (bf16): ours (triton, the fused kernel over sorted token blocks) against torch._grouped_mm
  (`grouped-mm`: two grouped GEMMs around an eager SwiGLU) and the eager layer (`torch`: Hugging Face
  Mixtral's loop over experts), at decode (t 64) and prefill (t 512) batches of Mixtral-8x7B (E 8, k 2,
  D 4096, F 14336), Qwen3-30B-A3B (E 128, k 8, D 2048, F 768) and DeepSeek-V3 (E 256, k 8, D 7168,
  F 2048, one shared expert). moe.experts declares its flops (6 t (k + S) D F): a case is compute-bound
  when they take longer at the measured matmul rate than its bytes (the weights, read once) at the copy rate.
--quick: one shape a section; --models: a comma list of mixtral, qwen3, deepseek (default all; DeepSeek-V3's
experts layer alone is 22.5 GB of bf16 weights, minutes of input generation on the host).
Results: --out (default $OUT/moe-bench.json, else ./moe-bench.json), bench_cases.run's summary.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = ("route", "align", "experts")
TOKENS = (4096, 16384)
ROUTERS = {  # moe.route params of each model's router
    "mixtral": dict(e=8, k=2, scoring="softmax", renorm=1, bias=0, groups=1, kept=1, rscale="1", mask="-inf"),
    "qwen3": dict(e=128, k=8, scoring="softmax", renorm=0, bias=0, groups=1, kept=1, rscale="1", mask="-inf"),
    "deepseek": dict(e=256, k=8, scoring="sigmoid", renorm=1, bias=1, groups=8, kept=4, rscale="2.5", mask="-inf"),
}
LAYERS = {  # moe.experts params of each model's experts layer (t set per case)
    "mixtral": dict(d=4096, f=14336, e=8, k=2, shared=0),
    "qwen3": dict(d=2048, f=768, e=128, k=8, shared=0),
    "deepseek": dict(d=7168, f=2048, e=256, k=8, shared=1),
}
EXPERT_TOKENS = (64, 512)


def entries(sections: list[str], quick: bool = False, models: tuple[str, ...] = tuple(ROUTERS)) -> list[dict]:
    tokens = TOKENS[:1] if quick else TOKENS
    models = models[-1:] if quick else models
    out = []
    if "route" in sections:
        out.append({"op": "moe.route", "backends": ["triton", "torch"], "dtypes": ["bf16"], "dists": ["normal"],
                    "params": [dict(t=t, **ROUTERS[m]) for m in models for t in tokens]})
    if "align" in sections:
        out.append({"op": "moe.align", "backends": ["triton", "torch"], "dtypes": ["int32"], "dists": ["uniform"],
                    "params": [dict(t=t, e=ROUTERS[m]["e"], k=ROUTERS[m]["k"], b=64) for m in models
                               for t in tokens]})
    if "experts" in sections:
        layers = models
        out.append({"op": "moe.experts", "backends": ["triton", "grouped-mm", "torch"], "dtypes": ["bf16"],
                    "dists": ["normal"],
                    "params": [dict(t=t, **LAYERS[m], wfmt="dense") for m in layers
                               for t in (EXPERT_TOKENS[:1] if quick else EXPERT_TOKENS)]})
    return out


def main() -> int:
    from bench_cases import OneLineParser, run

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape a section")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--models", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)}")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe-bench.json"),
                   help="JSON output path (default $OUT/moe-bench.json)")
    args = p.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections {args.sections!r}: expected a comma list of {', '.join(SECTIONS)}")
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models or any(m not in ROUTERS for m in models):
        p.error(f"--models {args.models!r}: expected a comma list of {', '.join(ROUTERS)}")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    return run(entries(sections, args.quick, models), out=args.out, ours="triton",
               description="MoE family benchmark (benchmarks/gpu_moe.py)")


if __name__ == "__main__":
    sys.exit(main())
