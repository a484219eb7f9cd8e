"""GPU benchmark of causal prefill (attention.prefill, bf16, GQA 32 / 8) against cuDNN and flash-attn-4.

    python benchmarks/gpu_prefill.py [--quick] [--out PATH]

A thin caller of `parity bench` (benchmarks/bench_cases.py): the shapes of issue 19's prefill row, b 16
s 4096 at d 128 and d 64, b 4 s 1024 at d 64 and d 256, bottom-right causal (s_q = s_k, so the same
mask as top-left), backends triton (ours), fa4 (flash-attn-4's `flash_attn_func`, CuTe DSL, where it
installs: research/peers-measured.md), sdpa-cudnn and sdpa-flash (torch's SDPA with one backend
enabled). Every case is judged by the gate against the float64 golden, then timed with do_bench;
TFLOP/s count 4 b h_q s^2 d / 2 (FlashAttention's causal count, `OpSpec.flops`), beside the bf16 matmul
rate measured in the same run; each peer's ms over ours. A peer that is not installed is a skip with
its reason. Results: --out (default $OUT/prefill-bench.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(16, 4096, 128), (16, 4096, 64), (4, 1024, 64), (4, 1024, 256)]  # (b, s, d)
BACKENDS = ["triton", "fa4", "sdpa-cudnn", "sdpa-flash"]


def entries(quick: bool = False) -> list[dict]:
    shapes = SHAPES[2:] if quick else SHAPES
    return [{"op": "attention.prefill", "backends": BACKENDS, "dtypes": ["bf16"], "dists": ["normal"],
             "params": [dict(b=b, sq=s, sk=s, hq=32, hkv=8, d=d, causal="bottom_right", wl=-1, wr=-1, cap=0,
                             sink=0) for b, s, d in shapes]}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the two s 1024 shapes only")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill-bench.json"))
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit
    check_output_or_exit(p.prog, "--out", args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cases import run
    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_prefill.py")


if __name__ == "__main__":
    sys.exit(main())
