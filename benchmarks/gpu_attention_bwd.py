"""GPU benchmark of the Triton attention backward (kernels/triton/attention_bwd.py) beside SDPA and fa4, on Hopper.

    python benchmarks/gpu_attention_bwd.py [--quick] [--out PATH]     # a thin caller of `parity bench`
    python benchmarks/gpu_attention_bwd.py --tune [--quick] [--sections parity,tune,bench] [--out PATH]

Default: attention.prefill_backward, causal (bottom-right; s_q = s_k, so the same mask as top-left) bf16,
goes to `parity bench` (benchmarks/bench_cases.py) with backends triton (ours: the preprocessing, dk / dv
and dq passes from the given O and LSE), fa4 (flash-attn-4, where it installs), sdpa-flash and
sdpa-cudnn (torch's SDPA with one backend enabled; sdpa-efficient is left out: it has no GQA, so every
case here would skip): every case judged by the gate against the float64 golden (its verdict and
norm_err are the accuracy figures), timed with do_bench, its figures beside the ceilings measured in the
same run (the op declares no OpSpec.flops, so its share is of the copy rate: TFLOP/s are --tune's), and
each peer's ms over ours. A peer that is not installed or cannot express a case is a skip with its
reason. The peers are timed as `parity bench` times their adapters, autograd through their own forward:
their ms holds a forward besides the backward (ours is the backward alone; --tune times SDPA's alone).
Gate-judged shapes: attention backward is judged whole (the op declares no row sample, OpSpec.rows: dk
and dv sum over every query row), and its inputs and references cost ~26 b h_q s^2 d float64 flops on
the host (3 x 10^13 at the target b 16, s 4096, h_q 32, d 128: ~17 minutes on one core). So each shape
--tune times at full size is judged at its s and d with fewer sequences or heads (GATED; host seconds
of inputs and references, measured on one core):
    s 1024, d 128, b 1, h_q / h_kv 32 / 8     ~3 s    (--tune --quick's b 4)
    s 1024, d 64,  b 4, h_q / h_kv 32 / 8     ~11 s   (--tune's shape itself)
    s 1024, d 256, b 1, h_q / h_kv 32 / 8     ~8 s    (--tune's b 4)
    s 4096, d 128, b 1, h_q / h_kv 8 / 2      ~16 s   (the target's s, d and GQA 4; --tune's b 16, 32 / 8)
--quick: the d 128 group alone (QUICK_GATED; the cheapest golden, see its comment). Ours takes ~0.1-0.6 ms a case (scaled from --tune's
H100 figures, reports/baselines/attention-bwd-bench-h100.json), the low end near the host work of a call
through an adapter (~0.27 ms measured for decode, README): the full-size figures (the issue's goal:
>= 1.0x SDPA's flash backward at b 16, s 4096) are --tune's.

--tune: the measurement by hand (do_bench medians, L2 cleared before every call), its sections chosen
by --sections (default all; --quick: the first three parity cases, no sweep, bench at b 4 s 1024 d 128):
- parity: the ops' small cases (GQA 1 / 4 / 8, both causal alignments, windows, softcap, sinks, an LSE
  cotangent, rows with no key, d 64 / 128 / 192 / 256, d_v != d, ragged varlen with empty sequences) in
  bf16, fp16 and fp32 on the triton backend, each judged by the gate (bench_cases.Gate);
- tune: block configs of the dk / dv and dq kernels at the target shape; the fastest the gate passes
  (b 1, s 1024, h_q / h_kv 8 / 2, d 128 run with that config as the table's d 128 entry) is bench's;
- bench: causal bf16, h_q 32, h_kv 8, at b 16 s 4096 d 128 and b 4 s 1024 d 64 / 256. Ours from the
  forward's O and LSE (kernels/triton/attention.py); SDPA flash and cuDNN the backward alone
  (autograd.grad through one kept forward, retain_graph) on the same q, k, v, dO. FLOPs counted as
  FlashAttention does: 2.5 x the forward's 4 b h s^2 d / 2, i.e. five s^2 d matmuls.
Each timed line gives the gate's verdict and norm_err on its GATED case (the same table entry); a case
the gate fails, or a section that raises, makes the exit status 1.
Results: --out (default $OUT/attention_bwd_bench.json, else ./attention_bwd_bench.json): the default
path's summary, or --tune's document rewritten after every row.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OP = "attention.prefill_backward"
BACKENDS = ["triton", "fa4", "sdpa-flash", "sdpa-cudnn"]
SECTIONS = ("parity", "tune", "bench")
HQ, HKV = 32, 8
SHAPES = [(16, 4096, 128), (4, 1024, 64), (4, 1024, 256)]  # (b, s, d), causal bf16; the first is the target
QUICK_SHAPES = [(4, 1024, 128)]
# (b, h_q, h_kv) the gate judges at each timed shape's s and d (module docstring); entries' order, cheapest first
GATED = {(4, 1024, 128): (1, 32, 8), (4, 1024, 64): (4, 32, 8), (4, 1024, 256): (1, 32, 8),
         (16, 4096, 128): (1, 8, 2)}
# entries(quick=True): the single-sequence d 128 group alone. Measured on an H200 (16-core host), quick's
# first record came at 35 s with the b 4, d 64 group first (its golden ~28 s), at 30 s with the d 256 one
# first (~24 s); the d 128 group's four records landed 7 s after the one before it.
QUICK_GATED = [(4, 1024, 128)]
SWEEP_GATE = (1, 1024, 8, 2, 128)  # (b, s, h_q, h_kv, d): the gate's case of each swept config
# dk/dv config, dq config: (BLOCK_M, BLOCK_N, num_warps, num_stages) each
TUNE = [
    ((64, 128, 8, 2), (128, 64, 8, 2)), ((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 3), (128, 32, 4, 3)),
    ((64, 64, 4, 3), (64, 64, 4, 3)), ((128, 128, 8, 2), (128, 128, 8, 2)), ((32, 128, 8, 2), (128, 32, 8, 2)),
    ((64, 128, 4, 2), (128, 64, 4, 2)), ((64, 64, 8, 3), (128, 64, 8, 3)),
]
PARITY_CASES = [  # (op, params); bf16, fp16 and fp32 each
    ("attention.prefill_backward", dict(b=2, sq=130, sk=200, hq=8, hkv=2, d=128, causal="bottom_right", wl=-1, wr=-1,
                                        cap=0, sink=0)),
    ("attention.prefill_backward", dict(b=1, sq=200, sk=130, hq=8, hkv=1, d=64, causal="bottom_right", wl=-1, wr=-1,
                                        cap=0, sink=1, dlse=1)),
    ("attention.prefill_backward", dict(b=1, sq=96, sk=300, hq=4, hkv=4, d=128, causal="top_left", wl=-1, wr=-1, cap=50,
                                        sink=0, dlse=1)),
    ("attention.prefill_backward", dict(b=2, sq=257, sk=257, hq=4, hkv=2, d=64, causal="bottom_right", wl=127, wr=0,
                                        cap=0, sink=1)),
    ("attention.prefill_backward", dict(b=1, sq=128, sk=160, hq=4, hkv=1, d=256, causal="none", wl=17, wr=9, cap=30,
                                        sink=0)),
    ("attention.prefill_backward", dict(b=1, sq=100, sk=140, hq=4, hkv=2, d=192, dv=128, causal="bottom_right", wl=-1,
                                        wr=-1, cap=0, sink=0)),
    ("attention.varlen_backward", dict(b=6, sq=150, sk=180, hq=8, hkv=2, d=128, lens="ragged", causal="bottom_right",
                                       wl=-1, wr=-1, cap=0, sink=1, dlse=1)),
    ("attention.varlen_backward", dict(b=4, sq=64, sk=64, hq=4, hkv=4, d=64, lens="full", causal="none", wl=8, wr=3,
                                       cap=30, sink=0)),
]


def _params(b: int, s: int, hq: int, hkv: int, d: int) -> dict:
    return dict(b=b, sq=s, sk=s, hq=hq, hkv=hkv, d=d, causal="bottom_right", wl=-1, wr=-1, cap=0, sink=0)


def _gated(b: int, s: int, d: int) -> dict:
    """The params the gate judges for the timed shape (b, s, d)."""
    gb, hq, hkv = GATED[(b, s, d)]
    return _params(gb, s, hq, hkv, d)


def entries(quick: bool = False) -> list[dict]:
    """The default path's cases as suite entries (bench_cases.run): every GATED case; --quick QUICK_GATED's."""
    shapes = QUICK_GATED if quick else list(GATED)
    return [{"op": OP, "backends": BACKENDS, "dtypes": ["bf16"], "dists": ["normal"],
             "params": [_gated(*shape) for shape in shapes]}]


def main() -> int:
    from bench_cases import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the cheapest group (--tune: no sweep, one shape)")
    p.add_argument("--tune", action="store_true", help="the measurement by hand instead of parity bench")
    p.add_argument("--sections", default=None, help=f"with --tune: a comma list of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_bwd_bench.json"),
                   help="JSON output path (default $OUT/attention_bwd_bench.json)")
    args = p.parse_args()
    if args.sections is not None and not args.tune:
        p.error("--sections names --tune's sections: add --tune")
    args.sections = [s.strip() for s in (args.sections or ",".join(SECTIONS)).split(",") if s.strip()]
    if not args.sections or any(s not in SECTIONS for s in args.sections):
        p.error(f"--sections: expected a comma list of {', '.join(SECTIONS)}")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    if args.tune:
        return tune(args)
    from bench_cases import run

    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_attention_bwd.py")


class Context:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.best: tuple | None = None


def _flops(b: int, s: int, d: int) -> float:
    return 2.5 * 4 * b * HQ * s * s * d / 2


def _gate(ctx, params: dict, d: int, cfg) -> dict:
    """The gate's verdict on `params` with `cfg` (None: the table's) as the launch table's d entry, bf16."""
    from unittest import mock

    from kernel_parity.kernels.triton import attention_bwd as B

    table = B.BWD_CONFIGS if cfg is None else {**B.BWD_CONFIGS, (d, 2): cfg}
    with mock.patch.object(B, "BWD_CONFIGS", table):
        return ctx.gate(OP, "bf16", params)


def parity(ctx) -> None:
    """The ops' own small cases on this GPU, each judged by the gate (verdict, norm_err)."""
    from bench_cases import gate_text

    for op, params in PARITY_CASES[: 3 if ctx.quick else None]:
        for dtype in ("bf16", "fp16", "fp32"):
            row = dict(op=op, dtype=dtype, **ctx.gate(op, dtype, params))
            ctx.doc["parity"].append(row)
            print(f"parity {row['case'] or op}: {gate_text(row)}", flush=True)
            ctx.save()


def _data(ctx, b, s, d):
    torch, dt = ctx.torch, ctx.torch.bfloat16
    q, k, v = (torch.randn((b, s, h, d), device=ctx.dev, generator=ctx.gen).to(dt) for h in (HQ, HKV, HKV))
    do = torch.randn((b, s, HQ, d), device=ctx.dev, generator=ctx.gen).to(dt)
    return q, k, v, do


def sweep(ctx) -> None:
    """Block configs at the target shape; the fastest the gate passes becomes ctx.best."""
    from bench_cases import gate_text

    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_bwd as B

    b, s, d = SHAPES[0]
    q, k, v, do = _data(ctx, b, s, d)
    o, lse = A.prefill(q, k, v, causal="bottom_right")
    flops = _flops(b, s, d)
    passed = []
    for cfg in TUNE:
        try:
            ms = ctx.bench(lambda: B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg))
        except Exception as e:  # out of shared memory or registers
            row = dict(config=cfg, error=f"{type(e).__name__}: {e}"[:300])
            print(f"tune {cfg}: {row['error']}", flush=True)
        else:
            verdict = _gate(ctx, _params(*SWEEP_GATE), d, cfg)
            row = dict(config=cfg, ms=ms, TFLOPs=flops / ms / 1e9, gate=verdict)
            if verdict["verdict"] == "pass":
                passed.append(row)
            print(f"tune {cfg}: {ms:.3f} ms {row['TFLOPs']:.0f} TFLOP/s  {gate_text(verdict)}", flush=True)
        ctx.doc["tune"].append(row)
        ctx.save()
    if passed:
        ctx.best = tuple(min(passed, key=lambda r: r["ms"])["config"])
    print("best config:", ctx.best, flush=True)


def _sdpa_backward_ms(ctx, q, k, v, do) -> dict:
    """Backward-only ms of SDPA flash and cuDNN (None: refused), causal, GQA, on (b, h, s, d) views."""
    torch = ctx.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                dot = do.transpose(1, 2)
                torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
                torch.cuda.synchronize()
                res[name] = ctx.bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
            del o
        except Exception as e:
            res[name] = None
            ctx.doc["errors_sdpa"].append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    return res


def bench(ctx) -> None:
    """Full-size shapes: ours and SDPA's backward alone, each row with the gate's verdict on its GATED case."""
    from bench_cases import gate_text

    torch = ctx.torch
    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_bwd as B

    for b, s, d in (QUICK_SHAPES if ctx.quick else SHAPES):
        q, k, v, do = _data(ctx, b, s, d)
        o, lse = A.prefill(q, k, v, causal="bottom_right")
        cfg = ctx.best if (b, s, d) == SHAPES[0] else None
        g = B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg)
        ms = ctx.bench(lambda: B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg,
                                                  out_dq=g["dq"], out_dk=g["dk"], out_dv=g["dv"]))
        flops = _flops(b, s, d)
        sd = _sdpa_backward_ms(ctx, q, k, v, do)
        verdict = _gate(ctx, _gated(b, s, d), d, cfg)
        row = dict(op="prefill_backward", shape=f"b={b} s={s} h={HQ}/{HKV} d={d} bf16 causal", config=cfg, ms=ms,
                   TFLOPs=flops / ms / 1e9, pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops, flops=flops,
                   sdpa_backward_ms=sd, sdpa_TFLOPs={n: (flops / t / 1e9 if t else None) for n, t in sd.items()},
                   gate=verdict)
        for n, t in sd.items():
            if t:
                row[f"speedup_vs_{n}"] = t / ms
        ctx.doc["results"].append(row)
        ctx.save()
        sdpa = " ".join(f"{n} {t:.3f} ms ({t / ms:.2f}x)" for n, t in sd.items() if t)
        print(f"bench {row['shape']:36s} {str(cfg):42s} {ms:8.3f} ms {row['TFLOPs']:6.0f} TFLOP/s "
              f"({row['pct_matmul']:4.1f}% of matmul)  SDPA: {sdpa or '-'}  {gate_text(verdict)}", flush=True)
        del q, k, v, do, o, lse, g
        torch.cuda.empty_cache()


def tune(args) -> int:
    """--tune (module docstring): exit 1 when the gate fails a case or a section raises."""
    import torch
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate

    from kernel_parity.conformance.bench import measure_ceilings
    from kernel_parity.kernels.triton import attention_bwd as B
    from kernel_parity.reports.files import write_text

    dev = torch.device("cuda")
    bench_kw = dict(warmup=10 if args.quick else 25, rep=40 if args.quick else 150, return_mode="median")
    ceil = measure_ceilings(str(dev), quick=args.quick)
    print(f"{ceil.device}  torch {torch.__version__}  triton {triton.__version__}  copy {ceil.copy_gbps:.0f} GB/s  "
          f"bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True)
    gate = Gate("triton")
    doc: dict = dict(
        header=dict(device=ceil.device, torch=torch.__version__, triton=triton.__version__, quick=args.quick,
                    command="benchmarks/gpu_attention_bwd.py --tune", do_bench=bench_kw,
                    bwd_configs={str(k): v for k, v in B.BWD_CONFIGS.items()},
                    flops="2.5 x 4 b h s^2 d / 2 (causal)", time=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
        ceilings=ceil.to_json(), parity=[], tune=[], results=[], gate_failures=gate.failures, errors=[],
        errors_sdpa=[])

    def save() -> None:  # a missing folder is made, the file replaced atomically
        write_text(args.out, json.dumps(doc, indent=1, default=str))

    ctx = Context(torch=torch, dev=dev, gen=torch.Generator(device=dev).manual_seed(0), gate=gate, doc=doc,
                  bench=lambda fn: float(do_bench(fn, **bench_kw)), mm_tflops=ceil.matmul_tflops, quick=args.quick,
                  save=save)
    for name, fn in (("parity", parity), ("tune", sweep), ("bench", bench)):
        if name not in args.sections or (name == "tune" and args.quick):
            continue
        t0 = time.time()
        try:
            fn(ctx)
        except Exception as e:  # keep what the other sections measured
            doc["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
        torch.cuda.empty_cache()
        save()
    if gate.failures or doc["errors"]:
        print(f"\nFAILED: {len(gate.failures)} gate failure(s), {len(doc['errors'])} section error(s)",
              *gate.failures, *[e.splitlines()[0] for e in doc["errors"]], sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nno gate failure: {len(doc['parity'])} parity case(s), {len(doc['tune'])} swept config(s), "
          f"{len(doc['results'])} benchmarked shape(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
