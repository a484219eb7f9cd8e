"""GPU benchmark of the Triton attention backward (kernels/triton/attention_bwd.py) on Hopper.

    python benchmarks/gpu_attention_bwd.py [--quick] [--out PATH] [--sections parity,tune,bench]

1. Header: device copy bandwidth (a 2 GiB device-to-device copy) and bf16 matmul rate (8192^3) of
   this run.
2. parity: attention.prefill_backward and attention.varlen_backward cases through the framework's
   own runner on the GPU (the Triton backend compiles for real here; the interpreter cannot run bf16
   dots natively), judged by the ops' tolerances against the float64 goldens: GQA 1/4/8, both causal
   alignments, windows, softcap, sinks, an LSE cotangent, rows with no key, d 64/128/256, d_v != d,
   ragged varlen with empty sequences, in bf16, fp16 and fp32.
3. tune: block configs of the dk/dv and dq kernels at the target shape (each config checked against
   the default's gradients).
4. bench (do_bench medians, L2 cleared before every call): causal backward bf16, b 16, s 4096,
   h_q 32, h_kv 8, d 128 (the issue's goal: >= 1.0x SDPA's flash backward), and b 4, s 1024, d 64 / 256.
   Ours: preprocessing + dk/dv + dq from the forward's O and LSE (kernels/triton/attention.py).
   SDPA flash and cuDNN: the backward alone (torch.autograd.grad through one forward kept alive,
   retain_graph), on the same q, k, v, dO. FLOPs counted as FlashAttention does: 2.5 x the forward's
   4 b h s^2 d / 2 (causal), i.e. five s^2 d matmuls. Our gradients of a slice (sequence 0, query
   heads 0-7) are checked against float64 autograd on the GPU.
Results go to --out (default $OUT/attention_bwd_bench.json), rewritten after each section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
HQ, HKV = 32, 8
SHAPES = [(16, 4096, 128), (4, 1024, 64), (4, 1024, 256)]  # (b, s, d), causal bf16; the first is the target
QUICK_SHAPES = [(4, 1024, 128)]
# dk/dv config, dq config: (BLOCK_M, BLOCK_N, num_warps, num_stages) each
TUNE = [
    ((64, 128, 8, 2), (128, 64, 8, 2)), ((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 3), (128, 32, 4, 3)),
    ((64, 64, 4, 3), (64, 64, 4, 3)), ((128, 128, 8, 2), (128, 128, 8, 2)), ((32, 128, 8, 2), (128, 32, 8, 2)),
    ((64, 128, 4, 2), (128, 64, 4, 2)), ((64, 64, 8, 3), (128, 64, 8, 3)),
]
PARITY_CASES = [  # (op, params); every dtype of the op
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions, no sweep (smoke run)")
    default_out = os.path.join(os.environ["OUT"], "attention_bwd_bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/attention_bwd_bench.json)")
    p.add_argument("--sections", default="parity,tune,bench", help="comma list of parity, tune, bench")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    if args.out:  # before any GPU work: an unwritable path is exit 2
        check_output_or_exit(p.prog, "--out", args.out)
    return args


class Context:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.best: tuple | None = None


def parity(ctx) -> None:
    """The ops' own cases, judged by the framework on this GPU (verdicts, norm_err, the reason)."""
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.backends import Registry
    from kernel_parity.conformance.runner import Runner

    runner = Runner(Registry(), recheck=False)
    for op, params in PARITY_CASES[: 3 if ctx.quick else None]:
        for dtype in ("bf16", "fp16", "fp32"):
            for backend in ("triton", "torch"):
                case = ops.make_case(op, backend, dtype, params, "normal", 0)
                rec = runner.evaluate(case)
                row = dict(case=case.id, verdict=rec.verdict, norm_err=rec.norm_err, reason=rec.reason)
                ctx.state["parity"].append(row)
                if backend == "triton" and rec.verdict != "pass":
                    ctx.state["failures"].append(f"{case.id}: {rec.verdict}: {rec.reason}")
                print("parity", row, flush=True)
                ctx.save()


def _data(ctx, b, s, d):
    torch, dt = ctx.torch, ctx.torch.bfloat16
    q, k, v = (torch.randn((b, s, h, d), device=ctx.dev, generator=ctx.gen).to(dt) for h in (HQ, HKV, HKV))
    do = torch.randn((b, s, HQ, d), device=ctx.dev, generator=ctx.gen).to(dt)
    return q, k, v, do


def _reference(ctx, q, k, v, do):
    """float64 autograd on the GPU for sequence 0, query heads 0-7 (kv heads 0-1), causal."""
    torch = ctx.torch
    g = HQ // HKV
    q0, k0, v0 = (t[:1, :, :n].double().requires_grad_() for t, n in ((q, 8), (k, 8 // g), (v, 8 // g)))
    s = q.shape[1]
    kk, vv = k0.repeat_interleave(g, 2), v0.repeat_interleave(g, 2)
    logits = torch.einsum("bihd,bjhd->bhij", q0, kk) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    return torch.autograd.grad(o, (q0, k0, v0), do[:1, :, :8].double())


def tune(ctx) -> None:
    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_bwd as B

    b, s, d = SHAPES[0]
    q, k, v, do = _data(ctx, b, s, d)
    o, lse = A.prefill(q, k, v, causal="bottom_right")
    ref = B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right")
    flops = 2.5 * 4 * b * HQ * s * s * d / 2
    timed = []
    for cfg in TUNE:
        try:
            got = B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg)
            diff = max(float((got[n].float() - ref[n].float()).abs().max()) for n in ("dq", "dk", "dv"))
            ms = ctx.bench(lambda: B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg))
            row = dict(config=cfg, ms=ms, TFLOPs=flops / ms / 1e9, max_diff_vs_default=diff)
            timed.append(row)
        except Exception as e:  # out of shared memory or registers
            row = dict(config=cfg, error=f"{type(e).__name__}: {e}"[:300])
        ctx.state["tune"].append(row)
        ctx.save()
        print("tune", row, flush=True)
    if timed:
        ctx.best = tuple(min(timed, key=lambda r: r["ms"])["config"])
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
            ctx.state["errors_sdpa"].append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    return res


def bench(ctx) -> None:
    torch = ctx.torch
    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_bwd as B

    for b, s, d in (QUICK_SHAPES if ctx.quick else SHAPES):
        q, k, v, do = _data(ctx, b, s, d)
        o, lse = A.prefill(q, k, v, causal="bottom_right")
        cfg = ctx.best if (b, s, d) == SHAPES[0] else None
        g = B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg)
        ref = _reference(ctx, q, k, v, do)
        errs = {n: float((g[n][:1, :, : (8 if n == "dq" else 2)].double() - r).abs().max() / r.abs().max())
                for n, r in zip(("dq", "dk", "dv"), ref)}
        del ref
        ok = all(e < 2e-2 for e in errs.values()) and not any(bool(torch.isnan(t).any()) for t in g.values())
        ms = ctx.bench(lambda: B.prefill_backward(q, k, v, o, lse, do, causal="bottom_right", config=cfg,
                                                  out_dq=g["dq"], out_dk=g["dk"], out_dv=g["dv"]))
        flops = 2.5 * 4 * b * HQ * s * s * d / 2
        sd = _sdpa_backward_ms(ctx, q, k, v, do)
        row = dict(op="prefill_backward", shape=f"b={b} s={s} h={HQ}/{HKV} d={d} bf16 causal", config=cfg, ms=ms,
                   TFLOPs=flops / ms / 1e9, pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops, flops=flops,
                   rel_err_vs_float64=errs, parity_ok=ok, sdpa_backward_ms=sd,
                   sdpa_TFLOPs={n: (flops / t / 1e9 if t else None) for n, t in sd.items()})
        for n, t in sd.items():
            if t:
                row[f"speedup_vs_{n}"] = t / ms
        if not ok:
            ctx.state["failures"].append(f"bench {row['shape']}: gradients off float64 by {errs}")
        ctx.state["results"].append(row)
        ctx.save()
        print("bench", row, flush=True)
        del q, k, v, do, o, lse, g
        torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_attention_bwd: no CUDA device (torch.cuda.is_available() is False); "
              "this benchmark must run on a GPU machine", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from kernel_parity.kernels.triton import attention_bwd as B

    sections = set(args.sections.split(","))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bench_kw = dict(warmup=10 if args.quick else 25, rep=40 if args.quick else 150, return_mode="median")
    state: dict = dict(parity=[], tune=[], results=[], failures=[], errors=[], errors_sdpa=[])

    def time_ms(fn) -> float:
        return float(do_bench(fn, **bench_kw))

    copy_bytes = (512 if args.quick else 2048) * MIB
    src = torch.rand(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_gbps = 2 * copy_bytes / time_ms(lambda: dst.copy_(src)) / 1e6
    n = 4096 if args.quick else 8192
    a = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    bm = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    mm_tflops = 2 * n**3 / time_ms(lambda: a @ bm) / 1e9
    del src, dst, a, bm
    header = dict(
        device=torch.cuda.get_device_name(dev), capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
        sm_count=torch.cuda.get_device_properties(dev).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, quick=args.quick, copy_GBps=copy_gbps, matmul_bf16_TFLOPs=mm_tflops,
        do_bench=bench_kw, bwd_configs={str(k): v for k, v in B.BWD_CONFIGS.items()},
        flops="2.5 x 4 b h s^2 d / 2 (causal)", time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    print(f"{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(header=header, **state), indent=1, default=str))

    ctx = Context(torch=torch, dev=dev, gen=gen, bench=time_ms, copy_gbps=copy_gbps, mm_tflops=mm_tflops,
                  quick=args.quick, state=state, save=save)
    for name, fn in (("parity", parity), ("tune", tune), ("bench", bench)):
        if name not in sections or (name == "tune" and args.quick):
            continue
        t0 = time.time()
        try:
            fn(ctx)
        except Exception as e:  # keep what the other sections measured
            state["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
        torch.cuda.empty_cache()
        save()

    print(f"\n{header['device']}  copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s")
    for r in state["results"]:
        sd = " ".join(f"{n} {t:.3f} ms ({r['speedup_vs_' + n]:.2f}x)" for n, t in r["sdpa_backward_ms"].items() if t)
        print(f"{r['shape']:40s} {str(r['config']):42s} {r['ms']:8.3f} ms {r['TFLOPs']:6.0f} TFLOP/s "
              f"({r['pct_matmul']:4.1f}% of matmul)  SDPA: {sd or '-'}")
    if state["failures"] or state["errors"]:
        print(f"\nFAILED: {len(state['failures'])} parity failure(s), {len(state['errors'])} section error(s)",
              *state["failures"], *[e.splitlines()[0] for e in state["errors"]], sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nparity ok in {len(state['parity'])} framework cases and {len(state['results'])} benchmarked shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
