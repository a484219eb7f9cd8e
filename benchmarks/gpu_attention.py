"""GPU benchmark of the Triton attention kernels (prefill, varlen, decode, paged, split) on Hopper.

    python benchmarks/gpu_attention.py [--quick] [--out PATH] [--sections parity,tune,bench]

1. Header: device copy bandwidth (a 2 GiB device-to-device copy, bytes read + written) and bf16
   matmul rate (8192^3 on random data) of this run; every figure is a share of one of them.
2. parity (gpu_attention_parity.py): every entry point (prefill, varlen, decode, decode_paged,
   decode_split, kvcache.update) at small shapes against the float64 goldens of refimpl/ (numpy
   on the CPU), in bf16 (which the Triton interpreter cannot check) and, on one case each, fp16
   and fp32: both causal alignments, windows, softcap, sinks, GQA 1/4/8, s_q != s_k both ways,
   zero lengths, NaN-poisoned cache slots and pages, shuffled page tables, more splits than
   keys. Outputs are NaN-poisoned first.
3. tune: sweeps block configs of causal prefill and of paged decode at the target shapes.
4. bench (do_bench medians; the best tuned config where a sweep ran, else the launchers' tables):
   - paged decode bf16, h_q=32, h_kv=8, d=128, b=64, 8192 cached tokens, pages 16 and 64, and
     decode b=8 L=2048 (pages 16): GB/s with bytes = K + V read once + q + o, % of copy
     bandwidth; torch SDPA (flash, efficient, cuDNN, math, where they run) on the same data as
     contiguous (b, h_kv, L, d) K/V, no mask (s_q = 1 sees every key); efficient has no GQA in
     torch 2.11 and runs on K/V repeated to h_q heads (4x the bytes; timed without the repeat).
   - causal prefill bf16 b=16 s=4096 h_q=32 h_kv=8 d=128, and b=4 s=1024 d=64 / d=256: TFLOP/s
     with flops = 4 b h_q s^2 d / 2; SDPA flash and cuDNN with is_causal (s_q == s_k, so top-left
     = bottom-right), enable_gqa.
   Each benchmarked kernel's output is checked on a slice against a float64 torch reference on the
   GPU (the goldens' formula; validated against refimpl on a small case first). do_bench clears L2
   before every timed call; the small decode (64 MiB, ~20 us) is timed as CUDA-graph replays over
   6 rotated input sets instead, so that launch gaps and L2 both stay out of its figure.
Results go to --out (default $OUT/attention_bench.json), rewritten after each section.
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

from benchmarks.gpu_attention_parity import TOL, check, mask64, paged_copy, parity, ref64  # noqa: E402

MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions, no sweep (smoke run)")
    default_out = os.path.join(os.environ["OUT"], "attention_bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/attention_bench.json)")
    p.add_argument("--sections", default="parity,tune,bench", help="comma list of parity, tune, bench")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    return args


def _prefill_data(ctx, b, s, hq, hkv, d):
    torch, dt = ctx.torch, ctx.torch.bfloat16
    return [torch.randn((b, s, h, d), device=ctx.dev, generator=ctx.gen).to(dt) for h in (hq, hkv, hkv)]


def _decode_data(ctx, b, L, hq, hkv, d):
    torch, dt = ctx.torch, ctx.torch.bfloat16
    q = torch.randn((b, 1, hq, d), device=ctx.dev, generator=ctx.gen).to(dt)
    kc, vc = (torch.randn((b, L, hkv, d), device=ctx.dev, generator=ctx.gen).to(dt) for _ in range(2))
    return q, kc, vc, torch.full((b,), L, dtype=torch.int32, device=ctx.dev)


def _sweep(ctx, name, configs, call, ref, rate) -> None:
    """Time call(cfg) for each config; ctx.best[name] = the fastest. rate(ms) -> dict of figures."""
    for cfg in configs:
        try:
            o = call(cfg)[0]
            row = dict(sweep=name, config=cfg, ms=ctx.bench(lambda: call(cfg)),
                       max_diff_vs_default=float((o.float() - ref).abs().max()))
            row.update(rate(row["ms"]))
        except Exception as e:  # e.g. out of shared memory
            row = dict(sweep=name, config=cfg, error=f"{type(e).__name__}: {e}"[:300])
        ctx.state["tune"].append(row)
        ctx.save()
        print("tune", row, flush=True)
    timed = [r for r in ctx.state["tune"] if r["sweep"] == name and "ms" in r]
    if timed:
        ctx.best[name] = tuple(min(timed, key=lambda r: r["ms"])["config"])


def tune(ctx) -> None:
    """Block-config sweeps at the target shapes; the bench section then uses the fastest."""
    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_decode as D
    torch, hq, hkv, d = ctx.torch, 32, 8, 128
    b, s = 16, 4096
    q, k, v = _prefill_data(ctx, b, s, hq, hkv, d)
    ref = A.prefill(q, k, v, causal="bottom_right")[0].float()
    _sweep(ctx, "prefill", [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
           lambda cfg: A.prefill(q, k, v, causal="bottom_right", config=cfg), ref,
           lambda ms: dict(TFLOPs=4 * b * hq * s * s * d / 2 / ms / 1e9))
    q, kc, vc, sl = _decode_data(ctx, 64, 8192, hq, hkv, d)
    nbytes = 2 * kc.numel() * 2 + 2 * q.numel() * 2
    ref = D.decode(q, kc, vc, sl)[0].float()
    for page in (16, 64):
        kp, vp, table = paged_copy(torch, kc, vc, page, ctx.gen)
        _sweep(ctx, f"decode_paged{page}", [(64, 4, 2), (64, 2, 2), (64, 4, 3), (128, 4, 3), (32, 4, 3)],
               lambda cfg: D.decode_paged(q, kp, vp, table, sl, config=cfg), ref,
               lambda ms: dict(GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / ctx.copy_gbps))
    print("best configs:", ctx.best, flush=True)


def sdpa_ms(ctx, q, k, v, causal, backends) -> dict:
    """Median ms of torch SDPA per backend on (b, h, s, d) tensors (None: the backend refused).
    efficient has no GQA in torch 2.11: it runs on K/V repeated to h_q heads."""
    torch = ctx.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    enum = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION,
                efficient=SDPBackend.EFFICIENT_ATTENTION, math=SDPBackend.MATH)
    res = {}
    for name in backends:
        try:
            g = q.shape[1] // k.shape[1]
            kk, vv, gqa = ((k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False) if name == "efficient"
                           else (k, v, True))
            with sdpa_kernel(enum[name]):
                sdpa(q, kk, vv, is_causal=causal, enable_gqa=gqa)
                torch.cuda.synchronize()
                res[name] = ctx.bench(lambda: sdpa(q, kk, vv, is_causal=causal, enable_gqa=gqa))
        except Exception as e:
            res[name] = None
            ctx.state.setdefault("errors_sdpa", []).append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    return res


def record(ctx, op, shape, config, ms, err, ok, sdpa, nbytes=None, flops=None) -> None:
    row = dict(op=op, shape=shape, config=config, ms=ms, max_err=err, parity_ok=ok, sdpa_ms=sdpa)
    if nbytes is not None:
        row.update(GBps=nbytes / ms / 1e6, pct_ceiling=100 * nbytes / ms / 1e6 / ctx.copy_gbps, bytes=nbytes)
    else:
        row.update(TFLOPs=flops / ms / 1e9, pct_ceiling=100 * flops / ms / 1e9 / ctx.mm_tflops, flops=flops)
    live = {k: t for k, t in sdpa.items() if t is not None}
    if live:
        best = min(live, key=live.get)
        row.update(best_sdpa=best, speedup_vs_best_sdpa=live[best] / ms)
    ctx.state["results"].append(row)
    ctx.save()
    print("bench", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def bench(ctx) -> None:
    import numpy as np

    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_decode as D
    from kernel_parity.refimpl import attention as R
    torch = ctx.torch
    # The float64 torch reference used on the slices below, against the golden itself first.
    q, k, v = (torch.randn((2, n, h, 64), device=ctx.dev, generator=ctx.gen) for n, h in ((33, 8), (70, 2), (70, 2)))
    sk = torch.randn(8, device=ctx.dev, generator=ctx.gen)
    keep = mask64(torch, 33, 70, torch.full((2,), 33, device=ctx.dev), torch.tensor([70, 41], device=ctx.dev),
                  "bottom_right", (9, -1), ctx.dev)
    o_r, lse_r, _ = R.prefill(*(t.double().cpu().numpy() for t in (q, k, v)), causal="bottom_right", window=(9, -1),
                              softcap=20.0, sinks=sk.double().cpu().numpy(), k_lens=np.array([70, 41]))
    check(ctx, "ref64 vs refimpl.attention.prefill", "fp32",
          [(n, t, torch.from_numpy(r)) for n, t, r in zip(("o", "lse"), ref64(torch, q, k, v, keep, None, 20.0, sk),
                                                          (o_r, lse_r))])
    hq, hkv, d = 32, 8, 128
    # Paged decode at the target shape (pages 16, 64), contiguous decode beside it.
    b, L = (16, 4096) if ctx.quick else (64, 8192)
    q, kc, vc, sl = _decode_data(ctx, b, L, hq, hkv, d)
    nbytes = 2 * kc.numel() * 2 + 2 * q.numel() * 2
    shape = f"b={b} L={L} h={hq}/{hkv} d={d} bf16"
    o_r, lse_r = ref64(torch, q[:2], kc[:2], vc[:2], torch.ones((2, 1, L), dtype=torch.bool, device=ctx.dev))
    q_s = q.transpose(1, 2).contiguous()
    sd = sdpa_ms(ctx, q_s, kc.permute(0, 2, 1, 3).contiguous(), vc.permute(0, 2, 1, 3).contiguous(), False,
                 ("flash", "cudnn", "efficient", "math"))
    for page in (16, 64):
        kp, vp, table = paged_copy(torch, kc, vc, page, ctx.gen)
        cfg = ctx.best.get(f"decode_paged{page}")
        o, lse = D.decode_paged(q, kp, vp, table, sl, config=cfg, out=torch.full_like(q, math.nan))
        err, ok = check(ctx, f"bench decode_paged page={page} {shape} (slice b<2 vs float64)", "bf16",
                        [("o", o[:2], o_r), ("lse", lse[:2], lse_r)])
        ms = ctx.bench(lambda: D.decode_paged(q, kp, vp, table, sl, out=o, out_lse=lse, config=cfg))
        record(ctx, "decode_paged", f"{shape} page={page}", cfg, ms, err, ok, sd, nbytes=nbytes)
    cfg = ctx.best.get("decode_paged16")
    o, lse = D.decode(q, kc, vc, sl, config=cfg)
    err, ok = check(ctx, f"bench decode {shape}", "bf16", [("o", o[:2], o_r), ("lse", lse[:2], lse_r)])
    ms = ctx.bench(lambda: D.decode(q, kc, vc, sl, out=o, out_lse=lse, config=cfg))
    record(ctx, "decode", shape, cfg, ms, err, ok, sd, nbytes=nbytes)

    # Small decode (b=8, L=2048: 64 MiB of cache, ~20 us): CUDA-graph replay over 6 input sets
    # (384 MiB, so L2 serves nothing from one call to the next) measures device time without
    # launch gaps; auto split-KV against fixed splits.
    b, L = 8, 2048
    sets = [_decode_data(ctx, b, L, hq, hkv, d) for _ in range(6)]
    nbytes = 2 * sets[0][1].numel() * 2 + 2 * sets[0][0].numel() * 2
    shape = f"b={b} L={L} h={hq}/{hkv} d={d} bf16"
    o_r, lse_r = ref64(torch, *(t[:2] for t in sets[0][:3]), torch.ones((2, 1, L), dtype=torch.bool, device=ctx.dev))

    def graph_ms(calls) -> float:
        for call in calls:  # compile and allocate outside the capture
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for call in calls:
                call()
        return ctx.bench(g.replay) / len(calls)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    sd = {}
    sd_sets = [(q.transpose(1, 2).contiguous(), kc.permute(0, 2, 1, 3).contiguous(), vc.permute(0, 2, 1, 3).contiguous())
               for q, kc, vc, _ in sets]
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                sd[name] = graph_ms([lambda t=t: torch.nn.functional.scaled_dot_product_attention(*t, enable_gqa=True)
                                     for t in sd_sets])
        except Exception as e:
            sd[name] = None
            ctx.state.setdefault("errors_sdpa", []).append(f"{name} graph: {type(e).__name__}: {str(e)[:200]}")
    del sd_sets
    pages = [(q, *paged_copy(torch, kc, vc, 16, ctx.gen), sl) for q, kc, vc, sl in sets]
    for splits in (None, 1, 2, 4, 8):
        o, lse = D.decode_paged(*pages[0], num_splits=splits)
        err, ok = check(ctx, f"bench decode_paged {shape} splits={splits}", "bf16", [("o", o[:2], o_r), ("lse", lse[:2], lse_r)])
        ms = graph_ms([lambda p=p: D.decode_paged(*p, num_splits=splits) for p in pages])
        record(ctx, "decode_paged", f"{shape} page=16 splits={splits or 'auto'} graph", None, ms, err, ok, sd,
               nbytes=nbytes)
    del sets, pages
    torch.cuda.empty_cache()

    # Causal prefill: target shape, then d = 64 and 256 at b=4 s=1024.
    for b, s, dd in ([(4, 1024, 128)] if ctx.quick else [(16, 4096, 128), (4, 1024, 64), (4, 1024, 256)]):
        q, k, v = _prefill_data(ctx, b, s, hq, hkv, dd)
        flops = 4 * b * hq * s * s * dd / 2
        shape = f"b={b} s={s} h={hq}/{hkv} d={dd} bf16 causal"
        cfg = ctx.best.get("prefill") if dd == 128 else None
        o, lse = A.prefill(q, k, v, causal="bottom_right", config=cfg, out=torch.full_like(q, math.nan))
        keep = mask64(torch, s, s, torch.full((1,), s, device=ctx.dev), torch.full((1,), s, device=ctx.dev),
                      "bottom_right", (-1, -1), ctx.dev)
        o_r, lse_r = ref64(torch, q[:1, :, :8], k[:1, :, :2], v[:1, :, :2], keep)
        err, ok = check(ctx, f"bench prefill {shape} (slice b=0 heads 0-7 vs float64)", "bf16",
                        [("o", o[:1, :, :8], o_r), ("lse", lse[:1, :8], lse_r)])
        del o_r, lse_r, keep
        ms = ctx.bench(lambda: A.prefill(q, k, v, causal="bottom_right", out=o, out_lse=lse, config=cfg))
        sd = sdpa_ms(ctx, q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                     v.transpose(1, 2).contiguous(), True, ("flash", "cudnn"))
        record(ctx, "prefill", shape, cfg, ms, err, ok, sd, flops=flops)


class Context:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.best: dict = {}



def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA device (torch.cuda.is_available() is False); "
              "this benchmark must run on a GPU machine", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_decode as D

    sections = set(args.sections.split(","))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bench_kw = dict(warmup=10 if args.quick else 25, rep=40 if args.quick else 150, return_mode="median")
    state: dict = dict(parity=[], tune=[], results=[], failures=[], errors=[])

    def time_ms(fn) -> float:
        return float(do_bench(fn, **bench_kw))

    # 1. ceilings.
    copy_bytes = (512 if args.quick else 2048) * MIB
    src = torch.rand(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_gbps = 2 * copy_bytes / time_ms(lambda: dst.copy_(src)) / 1e6
    n = 4096 if args.quick else 8192
    a = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    bm = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    mm_tflops = 2 * n**3 / time_ms(lambda: a @ bm) / 1e9
    header = dict(
        device=torch.cuda.get_device_name(dev),
        capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
        sm_count=torch.cuda.get_device_properties(dev).multi_processor_count,
        l2_bytes=getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", None),
        torch=torch.__version__, triton=triton.__version__, quick=args.quick,
        copy_GBps=copy_gbps, matmul_bf16_TFLOPs=mm_tflops, do_bench=bench_kw, tolerances=TOL,
        prefill_configs={str(k): v for k, v in A.PREFILL_CONFIGS.items()},
        decode_configs={str(k): v for k, v in D.DECODE_CONFIGS.items()},
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    print(f"{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(header=header, **state), indent=1, default=str))

    ctx = Context(torch=torch, dev=dev, gen=gen, bench=time_ms, tol=TOL, copy_gbps=copy_gbps,
                  mm_tflops=mm_tflops, quick=args.quick, state=state, save=save)
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
    print(f"{'op':13s} {'shape':34s} {'config':18s} {'ms':>8s} {'rate':>13s} {'%ceil':>6s} "
          f"{'best SDPA':>16s} {'ratio':>6s} {'err':>8s}")
    for r in state["results"]:
        rate = f"{r['GBps']:7.0f} GB/s" if "GBps" in r else f"{r['TFLOPs']:6.0f} TFLOP/s"
        best = r.get("best_sdpa")
        sd = f"{best} {r['sdpa_ms'][best]:.3f}" if best else "-"
        ratio = f"{r['speedup_vs_best_sdpa']:5.2f}x" if best else "-"
        print(f"{r['op']:13s} {r['shape']:34s} {str(r['config']):18s} {r['ms']:8.3f} {rate:>13s} "
              f"{r['pct_ceiling']:5.1f}% {sd:>16s} {ratio:>6s} {r['max_err']:8.1e}")
    n_par = len(state["parity"])
    if state["failures"] or state["errors"]:
        print(f"\nFAILED: {len(state['failures'])} parity failure(s), {len(state['errors'])} section error(s)",
              *state["failures"], *[e.splitlines()[0] for e in state["errors"]], sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nparity ok in {n_par} small cases and {len(state['results'])} benchmarked ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
