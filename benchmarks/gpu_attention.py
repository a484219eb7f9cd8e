"""GPU benchmark of the Triton attention kernels (prefill, decode, paged decode) beside torch SDPA, on Hopper.

    python benchmarks/gpu_attention.py [--quick] [--out PATH]          # bench: a thin caller of `parity bench`
    python benchmarks/gpu_attention.py --sections tune [--out PATH]    # the block-config sweeps
    python benchmarks/gpu_attention.py --sections bench,tune [--quick] [--out PATH]

bench (the default): the cases below go to `parity bench` (benchmarks/bench_cases.py), bf16, h_q=32,
h_kv=8, with backends triton (ours) and torch's SDPA with one backend enabled (conformance/backends/
sdpa.py: sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math; efficient has no GQA in torch 2.11 and
skips with that reason, as does every backend where it cannot express a case): every case judged by
the gate against the float64 golden (its verdict and norm_err are the accuracy figures), timed with
do_bench (L2 cleared before every call) with the launchers' tables, its bytes or flops over the
copy / matmul ceiling measured in the same run, and each peer's ms over ours.
- decode, d=128, b=64 over 8192 cached tokens (the target shape); causal "none", since one query
  sees every key: SDPA takes no mask, its fastest form. GB/s count K + V read once plus q and o.
- decode_paged at the same shape, pages 16 and 64 (shuffled), ours alone: SDPA has no paged input,
  so the decode row holds the peers' times.
- causal prefill (bottom-right; s_q = s_k, so the same mask as top-left): b=16 s=4096 d=128, and b=4
  s=1024 at d=64 and 256; TFLOP/s count 4 b h_q s^2 d / 2. sdpa-math is left out (an s^2 score matrix).
--quick: decode and paged decode (page 16) at b=16 over 4096 tokens, prefill b=4 s=1024 d=128.
A shorter decode is no row here: under do_bench a call of ours costs ~0.27 ms of host-side work
(the adapter and the launcher's checks and launches; measured on an H200 at b=16 over 4096 and b=8
over 2048 alike), more than its device time, so the figure would be the host's. --quick's decode
figure sits at that floor (a smoke run); the small decode's device time is tune's graph replay.

tune (script-only, skipped under --quick): the sweeps that picked the launch tables, timed with parity
bench's own timer (conformance/bench.py's time_call): causal prefill block configs (BLOCK_M, BLOCK_N,
warps, stages) at b=16 s=4096 d=128, paged decode configs (BLOCK_N, warps, stages) at b=64 over 8192
tokens for pages 16 and 64, and paged decode's split-KV count (auto, 1, 2, 4, 8) at b=8 over 2048 tokens,
timed as CUDA-graph replays over 6 rotated input sets (384 MiB: launch gaps and L2 stay out of a
~20 us figure). Each swept config's line gives the gate's verdict and norm_err for a case run with
that config (bench_cases.Gate on the triton backend, the launcher's table entry for d=128 bf16, or its
split count, replaced while the gate runs): attention.prefill b=2 s=1024 and attention.decode_paged
b=32 over 2048 tokens (the same table entries, unsplit like the swept shape; smaller, so the float64
golden takes seconds), and the split sweep's own shape. A config the gate fails makes the exit status 1.
Results: --out (default $OUT/attention_bench.json, else ./attention_bench.json): bench's summary, with
tune's document (header, ceilings, rows, gate_failures) under "tune" when both run; tune alone writes
its document there, after every row.
The small-shape checks of every entry point are the gate's: `parity run --suite ci --op attention
--backend triton` on the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cases import replaced  # noqa: E402

SECTIONS = ("bench", "tune")
HEADS = dict(hq=32, hkv=8)
DECODE_BACKENDS = ["triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"]
PREFILL_BACKENDS = ["triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
DECODE_SHAPES = ((64, 8192),)  # (b, cached tokens)
PREFILL_SHAPES = ((16, 4096, 128), (4, 1024, 64), (4, 1024, 256))  # (b, s, d)
QUICK_DECODE, QUICK_PREFILL = ((16, 4096),), ((4, 1024, 128),)


def _decode(b: int, kv: int, causal: str = "none", **extra) -> dict:
    return dict(b=b, sq=1, kv=kv, **HEADS, d=128, lens="full", **extra, causal=causal, wl=-1, wr=-1, cap=0, sink=0)


def _prefill(b: int, s: int, d: int) -> dict:
    return dict(b=b, sq=s, sk=s, **HEADS, d=d, causal="bottom_right", wl=-1, wr=-1, cap=0, sink=0)


def entries(quick: bool = False) -> list[dict]:
    """The bench section's cases as suite entries (bench_cases.run); --quick: one shape per op."""
    decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if quick else (DECODE_SHAPES, PREFILL_SHAPES)
    pages = (16,) if quick else (16, 64)
    common = {"dtypes": ["bf16"], "dists": ["normal"]}
    return [{"op": "attention.decode", "backends": DECODE_BACKENDS, **common,
             "params": [_decode(b, kv) for b, kv in decode]},
            {"op": "attention.decode_paged", "backends": ["triton"], **common,
             "params": [_decode(b, kv, page=page) for b, kv in decode for page in pages]},
            {"op": "attention.prefill", "backends": PREFILL_BACKENDS, **common,
             "params": [_prefill(b, s, d) for b, s, d in prefill]}]


def main() -> int:
    from bench_cases import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape per op, no sweep (smoke run)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_bench.json"),
                   help="JSON output path (default $OUT/attention_bench.json)")
    p.add_argument("--sections", default="bench", help=f"comma list of {', '.join(SECTIONS)} (default bench)")
    args = p.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        why = ("; the small-shape checks are the gate's: parity run --suite ci --op attention --backend triton"
               if "parity" in bad else "")
        p.error(f"--sections {args.sections!r}: expected a comma list of {', '.join(SECTIONS)}{why}")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    code, tuned = 0, None
    if "tune" in sections:
        if args.quick:
            print("tune: skipped under --quick", flush=True)
        else:
            code, tuned = tune(args.out)
    if "bench" in sections:
        from bench_cases import run

        code = max(code, run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
                             description="benchmarks/gpu_attention.py"))
        if tuned is not None:  # the sweeps' rows beside bench's cases, in one file
            doc = json.loads(Path(args.out).read_text())
            Path(args.out).write_text(json.dumps({**doc, "tune": tuned}, indent=1, default=str))
    return code


def tune(out: str) -> tuple[int, dict]:
    """The sweeps (module docstring): (exit status, {header, ceilings, rows, gate_failures}) also
    written to `out` after every row, so a crash keeps what was measured."""
    import torch
    import triton

    from bench_cases import Gate, gate_text
    from gpu_attention_parity import paged_copy

    from kernel_parity.conformance.bench import measure_ceilings, time_call
    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_decode as D

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ceil = measure_ceilings(str(dev))
    print(f"{ceil.device}  copy {ceil.copy_gbps:.0f} GB/s  bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True)
    gate = Gate("triton")
    doc = dict(header=dict(device=ceil.device, torch=torch.__version__, triton=triton.__version__,
                           time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           command="benchmarks/gpu_attention.py --sections tune",
                           prefill_configs={str(k): v for k, v in A.PREFILL_CONFIGS.items()},
                           decode_configs={str(k): v for k, v in D.DECODE_CONFIGS.items()}),
               ceilings=ceil.to_json(), rows=[], gate_failures=gate.failures)
    rnd = lambda *shape: torch.randn(shape, device=dev, generator=gen).to(torch.bfloat16)  # noqa: E731

    def sweep(name, configs, timed, rate, judged) -> None:
        """Time timed(cfg) for each config; judged(cfg) is a context in which the gate's case runs with it."""
        for cfg in configs:
            try:
                ms = timed(cfg)
            except Exception as e:  # e.g. out of shared memory
                row = dict(sweep=name, config=cfg, error=f"{type(e).__name__}: {e}"[:300])
                print(f"tune {name} {cfg}: {row['error']}", flush=True)
            else:
                op, params, ctx = judged(cfg)
                with ctx:
                    verdict = gate(op, "bf16", params)
                row = dict(sweep=name, config=cfg, ms=ms, **rate(ms), gate=verdict)
                figs = "  ".join(f"{k} {v:.1f}" for k, v in rate(ms).items())
                print(f"tune {name} {cfg}: {ms:.4f} ms  {figs}  {gate_text(verdict)}", flush=True)
            doc["rows"].append(row)
            Path(out).write_text(json.dumps(doc, indent=1, default=str))

    key = (128, 2)  # the launch-table entry of d = 128, 2-byte elements
    # Causal prefill at the target shape.
    b, s = 16, 4096
    q, k, v = rnd(b, s, 32, 128), rnd(b, s, 8, 128), rnd(b, s, 8, 128)
    flops = 4 * b * 32 * s * s * 128 / 2
    sweep("prefill", [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
          lambda cfg: time_call(lambda: A.prefill(q, k, v, causal="bottom_right", config=cfg), dev),
          lambda ms: {"tflops": flops / ms / 1e9, "pct_of_matmul": 100 * flops / ms / 1e9 / ceil.matmul_tflops},
          lambda cfg: ("attention.prefill", _prefill(2, 1024, 128),
                       replaced(A, "PREFILL_CONFIGS", {**A.PREFILL_CONFIGS, key: cfg})))
    del q, k, v
    # Paged decode at the target shape, pages 16 and 64.
    b, L = 64, 8192
    q, kc, vc = rnd(b, 1, 32, 128), rnd(b, L, 8, 128), rnd(b, L, 8, 128)
    sl = torch.full((b,), L, dtype=torch.int32, device=dev)
    nbytes = 2 * kc.numel() * 2 + 2 * q.numel() * 2  # K + V read once, q read and o written
    for page in (16, 64):
        kp, vp, table = paged_copy(torch, kc, vc, page, gen)
        sweep(f"decode_paged{page}", [(64, 4, 2), (64, 2, 2), (64, 4, 3), (128, 4, 3), (32, 4, 3)],
              lambda cfg: time_call(lambda: D.decode_paged(q, kp, vp, table, sl, config=cfg), dev),
              lambda ms: {"gbps": nbytes / ms / 1e6, "pct_of_copy": 100 * nbytes / ms / 1e6 / ceil.copy_gbps},
              lambda cfg, page=page: ("attention.decode_paged", _decode(32, 2048, "bottom_right", page=page),
                                      replaced(D, "DECODE_CONFIGS", {**D.DECODE_CONFIGS, key: cfg})))
        del kp, vp, table
    del q, kc, vc
    torch.cuda.empty_cache()
    # Split-KV count of a small paged decode, as CUDA-graph replays over 6 input sets.
    b, L = 8, 2048
    sl = torch.full((b,), L, dtype=torch.int32, device=dev)
    sets = []
    for _ in range(6):
        q, kc, vc = rnd(b, 1, 32, 128), rnd(b, L, 8, 128), rnd(b, L, 8, 128)
        sets.append((q, *paged_copy(torch, kc, vc, 16, gen), sl))
    nbytes = 2 * kc.numel() * 2 + 2 * q.numel() * 2

    def replay_ms(splits) -> float:
        calls = [lambda p=p: D.decode_paged(*p, num_splits=splits) for p in sets]
        for call in calls:  # compile and allocate outside the capture
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for call in calls:
                call()
        return time_call(g.replay, dev) / len(calls)

    sweep("decode_paged16_splits", [None, 1, 2, 4, 8], replay_ms,
          lambda ms: {"gbps": nbytes / ms / 1e6, "pct_of_copy": 100 * nbytes / ms / 1e6 / ceil.copy_gbps},
          lambda n: ("attention.decode_paged", _decode(b, L, "bottom_right", page=16),
                     contextlib.nullcontext() if n is None else replaced(D, "_auto_splits", lambda *a, n=n: n)))
    del sets
    torch.cuda.empty_cache()
    for f in gate.failures:
        print("GATE FAIL", f, flush=True)
    return (1 if gate.failures else 0), doc


if __name__ == "__main__":
    sys.exit(main())
