"""--tune of benchmarks/gpu_gemm.py: the quantized GEMMs of gemm.gemm_nt timed by hand, the sweeps that
picked the launch tables, each timed call judged by the gate beside its figures.

    python benchmarks/gpu_gemm.py --tune [--quick] [--out PATH] [--budget-s S] [--sections gemv,q8,prefill,fp8,int4]
                                  [--formats q4_k,...] [--q8-grid] [--q8-m 1,4,16] [--dump PATH] [--smoke-cpu]

The flags are gpu_gemm.py's (gpu_gemm.parse_args: any flag after --out above implies --tune); its main()
imports this module on the --tune path alone and calls tune(args). After this run's copy, read and bf16
matmul rates (a 2 GiB copy, 8192^3), the sections:
  gemv     the four GGML formats at M = 1 on both shapes, a sweep of the GEMV configs (BLOCK_N, NB, num_warps,
           num_stages; split-K automatic or 1) as CUDA-graph replays over rotated weight copies (over 3x L2:
           no launch gaps, no L2 reuse), do_bench beside it, torch's bf16 GEMV of the shape for scale; then
           M = 4 and 16 at 14336 x 4096 (the launcher's choice, the exact kernel, tensor-core configs).
  q8       triton-q8 at M = 1 on both shapes, M = 4 and 16 on the first (--q8-m): quantizer + integer-dot
           GEMV as one call, and the GEMV alone, beside the limits at the weights' own size (a Triton read
           stream of the same rotated bytes, torch's bf16 GEMV over a matrix of those bytes); --q8-grid first
           sweeps ~40 M = 1 configs (the GEMV alone) and times the three fastest in full.
  prefill  Q4_K at M = 4096: the fused kernel's and the dequant path's (dequantizer + our dense GEMM) sweeps,
           beside torch's bf16 matmul and dequantize + torch matmul; both paths at M = 128 .. 2048.
  fp8      8192^3: the GEMM on pre-quantized operands (config sweep), with the activation quantizer,
           torch._scaled_mm blockwise, F.scaled_mm (BlockWise1x128 x BlockWise128x128), per-tensor
           _scaled_mm on unit scales, and our per-token x per-channel and per-tensor modes.
  int4     GPTQ and AWQ at M = 4096 (beside torch's bf16 matmul) and M = 1, the fused kernel's sweep, then the
           fused kernel against the dequant path at M = 128 .. 2048.
Each timed GEMM's line gives the gate's verdict and norm_err on the gemm.gemm_nt case of its shape and format
(bench_cases.Gate: dist normal, seed 0, the case's own inputs) with the call the line timed swapped into the
backend's adapter while the gate runs: its config, split-K, path or kernel on triton / triton-q8, the
composition itself for the two references (dequantize + torch matmul, F.scaled_mm), scaled-mm's own adapter
for _scaled_mm blockwise; the first config of each gemv and decode sweep is judged with fp32 A too. A timed
case the gate fails, or an entry that raises, makes the exit status 1. Lines that time no gemm.gemm_nt (the
limits, torch's dense GEMMs, the dequantizer and FP8 quantizer alone, _scaled_mm on unit scales) carry no
verdict. The gate's input groups are prepared once (KERNEL_PARITY_GOLDEN_CACHE, a temporary folder unless set).
--budget-s (default 170 s, the gate's time included) ends each sweep after its first config once the run is
that long; --quick times each sweep's first config alone; --sections picks and orders the sections;
--formats narrows gemv, decode and q8; --dump writes the registers, spills and the opcode histogram of the
longest loop of every compiled kernel variant (cuobjdump); --smoke-cpu runs tiny shapes on the CPU
(TRITON_INTERPRET=1, the Triton interpreter) to check the script. benchmarks/gpu_gate.sh's gemm step
(--quick --budget-s S) and q8 step (--sections q8 --budget-s S) run this path.
Results: --out (default $OUT/gemm-bench.json, else ./gemm-bench.json): {header, results, errors,
gate_failures}, rewritten after each entry.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback

from bench_cases import replaced
from gpu_gemm import FP8_SIZE, GEMV_SHAPES, OP, PREFILL_M, PREFILL_SHAPES, _case

MIB = 1 << 20


# ------------------------------------------------------------------ --tune: the sweeps

# ((BLOCK_N, NB, num_warps, num_stages), split_k or None = automatic); the launcher's table first.
# NB: blocks (Q4_K) or block pairs (Q8_0, Q4_0) per iteration; Q6_K: (BLOCK_N, G, ...) of its word-tile kernel.
# Split-K costs a second (reduction) launch; split_k = 1 shows what it buys.
GEMV_SWEEP = {  # kernels/triton/gemm_gemv.py
    "q4_k": [((8, 8, 4, 1), None), ((4, 8, 4, 1), None), ((16, 8, 4, 1), 1)],
    "q8_0": [((8, 16, 4, 1), None), ((8, 32, 4, 1), None)],
    "q4_0": [((8, 16, 4, 1), None), ((8, 32, 4, 1), None)],
    "q6_k": [((16, 4, 4, 2), None), ((8, 4, 2, 2), None)],
}
# Decode 2 <= M <= 16: (config, split_k); None: the launcher's choice (bf16 A from M = 4: the
# tensor-core kernel). 5 elements: the exact-fp32 GEMV kernel (BLOCK_M, BLOCK_N, NB, num_warps,
# num_stages); 6: the tensor-core kernel (BLOCK_M, BLOCK_N, G, num_warps, num_stages, GROUP_M).
DECODE_SWEEP = {
    "q4_k": [(None, None), ((2, 8, 8, 4, 1), None), ((16, 64, 2, 4, 4, 1), None), ((16, 32, 2, 4, 3, 1), None),
             ((16, 64, 1, 4, 3, 1), None), ((16, 128, 1, 4, 3, 1), None)],
    "q8_0": [(None, None), ((4, 8, 8, 4, 1), None), ((16, 64, 2, 4, 3, 1), None)],
    "q4_0": [(None, None), ((2, 8, 16, 4, 1), None), ((16, 64, 2, 4, 3, 1), None)],
    "q6_k": [(None, None), ((1, 16, 4, 4, 2), None), ((16, 64, 1, 4, 3, 1), None)],
}
# M = 4 / 16 of triton-q8: the launcher's choice (None), the dp4a GEMV at its default tile ("gemv"), and the int8
# tensor-core kernel (kernels/triton/gemm_mmq.py, "mmq") at (BLOCK_N, BLOCK_M, NB, num_warps, num_stages): W rows on
# the tensor cores' M side (16 .. 128), A rows on the N side (16), NB 32-wide sub-blocks (Q8_0) / 256-blocks (Q4_K)
# an iteration, SPLIT_K ranges of K a row (default gemm_mmq.auto_splits: ~6 programs an SM).
MMQ_GRID = [(64, 16, 1, 4, 3), (32, 16, 1, 2, 3),  # then PREFETCH (the next block's weight words loaded first)
            (64, 16, 1, 4, 3, None, 1), (32, 16, 1, 2, 3, None, 1), (64, 16, 1, 4, 2, None, 1),
            (32, 16, 1, 2, 2, None, 1), (128, 16, 1, 4, 3, None, 1), (128, 16, 1, 8, 3, None, 1),
            (16, 16, 1, 1, 3, None, 1), (64, 16, 1, 4, 3, 2, 1), (64, 16, 1, 4, 3, 8, 1), (32, 16, 1, 2, 3, 4, 1)]
# 6th: SPLIT_K (None: auto), 7th: PREFETCH (gemm_mmq.launch_mmq)
_Q8_SMALL_M = [None, ("gemv", None)] + [("mmq", c) for c in MMQ_GRID]
# kernels/triton/gemm_q8.py (Q4_K x Q8_K, Q8_0 x Q8_0 activations, backend triton-q8): (BLOCK_M, BLOCK_N, NB,
# num_warps, num_stages) per format and M (Q8_0: NB block pairs); None: the launcher's choice
# (gemm_q8.default_config, by M and N). Offline sm_90 SASS, instructions a weight: Q4_K 1.5 (the exact
# kernel: 6.4 on the device), Q8_0 1.4 / 1.16.
Q8_SWEEP = {"q4_k": {1: [None, (1, 4, 2, 1, 1), (1, 2, 4, 1, 1), (1, 8, 8, 4, 1), (1, 4, 8, 4, 1)],
                     4: _Q8_SMALL_M, 16: _Q8_SMALL_M},
            "q8_0": {1: [None, (1, 4, 64, 2, 1), (1, 8, 16, 4, 1), (1, 8, 32, 4, 1)], 4: _Q8_SMALL_M, 16: _Q8_SMALL_M}}
# Swept on the first shape; the others run the default and the best. 6th element: GROUP_M.
PREFILL_SWEEP = [(256, 128, 1, 8, 3, 4), (256, 128, 1, 8, 4, 4), (256, 64, 1, 8, 3, 4), (256, 128, 1, 8, 3, 8)]
# gemm_nt's dequant path (kernels/triton/gemm_dense.py after the dequantizer): (BLOCK_M, BLOCK_N, BLOCK_K,
# GROUP_M, num_warps, num_stages[, TMA]), swept on the first shape; the others run the default and the best
DENSE_SWEEP = [None, (256, 128, 64, 8, 8, 4), (256, 128, 64, 16, 8, 3), (256, 128, 64, 4, 8, 3),
               (256, 128, 128, 8, 8, 2), (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 8, 3, 0)]
CROSSOVER_M = (128, 256, 512, 1024, 2048)  # rows of A where the fused and dequant paths are both timed
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, TMA)
FP8_SWEEP = [(128, 128, 128, 8, 8, 4, 1), (128, 128, 128, 16, 8, 4, 1), (128, 128, 128, 8, 8, 3, 1),
             (128, 128, 128, 8, 8, 4, 0)]
INT4_SWEEP = [(256, 128, 64, 4, 8, 3), (256, 64, 64, 8, 8, 3), (256, 64, 64, 4, 8, 3)]  # first shape, M = 4096


def _adding(module, name: str, **kw) -> tuple:
    """(module, name, module.name with kw added): the config, path or kernel a line timed, for Ctx.judge."""
    return module, name, functools.partial(getattr(module, name), **kw)


class Ctx:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.gates: dict = {}  # backend -> bench_cases.Gate

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.budget_s

    def judge(self, params: dict, swap: tuple = (), dtype: str = "bf16", backend: str = "triton") -> dict:
        """The gate's verdict on gemm.gemm_nt at params (bench_cases.Gate on `backend`), with swap = (module,
        name, replacement) in place while it runs: the call the line timed, on the case's own inputs."""
        from bench_cases import Gate

        if backend not in self.gates:
            self.gates[backend] = Gate(backend)
        with replaced(*swap) if swap else contextlib.nullcontext():
            return self.gates[backend](OP, dtype, params)

    def failures(self) -> list[str]:
        return [f for gate in self.gates.values() for f in gate.failures]

    def save(self) -> None:
        from kernel_parity.reports.files import write_text

        write_text(self.out, json.dumps(dict(header=self.header, results=self.results, errors=self.errors,
                                                  gate_failures=self.failures()), indent=1, default=str))

    def entry(self, section: str, name: str, fn) -> dict | None:
        """Run one benchmark entry; its dict goes to results, an exception to errors."""
        from bench_cases import gate_text

        try:
            row = dict(section=section, name=name, **fn())
            self.results.append(row)
            print("bench", {k: (f"{v:.4g}" if isinstance(v, float) else gate_text(v) if k.startswith("gate") else v)
                            for k, v in row.items()}, flush=True)
            return row
        except Exception as e:
            self.errors.append(dict(section=section, name=name, error=f"{type(e).__name__}: {e}"[:500],
                                    trace=traceback.format_exc()[-2000:]))
            print(f"ERROR {section}/{name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
            return None
        finally:
            self.save()


def ggml_random(ctx, fmt: str, n: int, k: int):
    """(n, k / QK * bytes) uint8 on the device: random codes, random finite fp16 scale fields."""
    torch = ctx.torch
    from kernel_parity.kernels.triton.gemm import FORMATS
    _, qk, nbytes, _, _ = FORMATS[fmt]
    w = torch.randint(0, 256, (n, k // qk, nbytes), dtype=torch.uint8, device=ctx.dev, generator=ctx.gen)
    for off in {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[fmt]:
        d = (torch.rand((n, k // qk), device=ctx.dev, generator=ctx.gen) * 2 - 1) * 2e-3
        w[..., off:off + 2] = d.half().view(torch.uint8).view(n, k // qk, 2)
    return w.view(n, -1)


def rotated(ctx, fmt: str, n: int, k: int):
    """(w, copies of w's shape whose total exceeds 3x L2 with w first)."""
    w = ggml_random(ctx, fmt, n, k)
    return w, [w] + [ggml_random(ctx, fmt, n, k) for _ in range(max(1, min(7, -(-3 * ctx.l2 // w.numel()) - 1)))]


def graph_ms(ctx, calls) -> float:
    """Median ms per call of a CUDA graph replaying `calls` (each on its own weights)."""
    torch = ctx.torch
    for call in calls:  # compile and allocate outside the capture
        call()
    if not ctx.cuda:
        return ctx.bench(lambda: [call() for call in calls]) / len(calls)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    return ctx.bench(g.replay) / len(calls)


def gemv(ctx) -> None:
    from kernel_parity.kernels.triton import gemm as G
    torch = ctx.torch
    for n, k in ctx.gemv_shapes:
        a = torch.randn((1, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        ctx.entry("gemv", f"torch bf16 {n}x{k}", lambda: dict(
            shape=[1, n, k], ms=(ms := ctx.bench(lambda: a @ wd.T)), GBps=2 * n * k / ms / 1e6,
            pct_copy=100 * 2 * n * k / ms / 1e6 / ctx.copy_gbps))
        del wd
        for fmt, sweep in GEMV_SWEEP.items():
            if ctx.formats and fmt not in ctx.formats:
                continue
            w, rot = rotated(ctx, fmt, n, k)
            nbytes = w.numel()
            outs = [torch.empty((1, n), dtype=a.dtype, device=ctx.dev) for _ in rot]
            for i, (cfg, split) in enumerate(sweep if not ctx.quick else sweep[:1]):
                if i and ctx.over_budget():
                    break

                def run(cfg=cfg, split=split, i=i):
                    ms = graph_ms(ctx, [lambda ww=ww, o=o: G.gemm_nt(a, fmt, ww, out=o, config=cfg, split_k=split)
                                        for ww, o in zip(rot, outs)])
                    row = dict(fmt=fmt, shape=[1, n, k], config=cfg, split_k=split or "auto", weight_bytes=nbytes,
                               rotations=len(rot), ms=ms, GBps=nbytes / ms / 1e6,
                               pct_copy=100 * nbytes / ms / 1e6 / ctx.copy_gbps,
                               ms_do_bench=ctx.bench(lambda: G.gemm_nt(a, fmt, w, out=outs[0], config=cfg,
                                                                       split_k=split)))
                    swap = _adding(G, "gemm_nt", config=cfg, split_k=split)
                    row["gate"] = ctx.judge(_case(1, n, k, fmt), swap)
                    if i == 0:  # fp32 A: the decode path's exact fp32 arithmetic, judged at fp32
                        row["gate_fp32"] = ctx.judge(_case(1, n, k, fmt), swap, dtype="fp32")
                    return row
                ctx.entry("gemv", f"{fmt} {n}x{k} {cfg} split={split or 'auto'}", run)
            del rot, outs, w
            torch.cuda.empty_cache() if ctx.cuda else None
    n, k = ctx.gemv_shapes[0]
    for fmt, sweep in DECODE_SWEEP.items():  # M = 2..16: the GEMV kernel with BLOCK_M rows of A
        if ctx.formats and fmt not in ctx.formats:
            continue
        w = ggml_random(ctx, fmt, n, k)
        for m in (4, 16):
            a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            for i, (cfg, split) in enumerate(sweep if not ctx.quick else sweep[:1]):
                if i and ctx.over_budget():
                    break

                def run(cfg=cfg, split=split, m=m, a=a, i=i):
                    ms = ctx.bench(lambda: G.gemm_nt(a, fmt, w, config=cfg, split_k=split))
                    row = dict(fmt=fmt, shape=[m, n, k], config=cfg, split_k=split or "auto", ms=ms,
                               GBps=w.numel() / ms / 1e6, pct_copy=100 * w.numel() / ms / 1e6 / ctx.copy_gbps)
                    swap = _adding(G, "gemm_nt", config=cfg, split_k=split)
                    row["gate"] = ctx.judge(_case(m, n, k, fmt), swap)
                    if i == 0:  # fp32 A: fp32 arithmetic
                        row["gate_fp32"] = ctx.judge(_case(m, n, k, fmt), swap, dtype="fp32")
                    return row
                ctx.entry("decode", f"{fmt} M={m} {n}x{k} {cfg} split={split or 'auto'}", run)


def q8(ctx) -> None:
    """triton-q8 (Q4_K x Q8_K, Q8_0 x Q8_0): the activation quantizer and the integer-dot GEMV together (what
    a user calls), and the GEMV alone, on weight bytes against the read and copy rates of this run; each
    call judged by the gate on the triton-q8 backend (its `emulated` reference) with the line's kernel and tile."""
    from kernel_parity.kernels.triton import gemm_mmq as MMQ, gemm_q8 as Q
    torch = ctx.torch
    for n, k in ctx.gemv_shapes:
        for fmt, sweeps in Q8_SWEEP.items():
            if ctx.formats and fmt not in ctx.formats:
                continue
            w, rot = rotated(ctx, fmt, n, k)
            nbytes = w.numel()
            limits_at_size(ctx, rot, n, k, f"{fmt} {n}x{k}")
            if ctx.q8_grid:
                q8_grid_sweep(ctx, fmt, n, k, w, rot)
            for m, sweep in sweeps.items():
                if (m > 1 and (n, k) != ctx.gemv_shapes[0]) or m not in ctx.q8_m:
                    continue
                if m == 1 and ctx.q8_best.get(fmt):  # the grid's three fastest, after the table's
                    sweep = list(dict.fromkeys(list(sweep) + ctx.q8_best[fmt]))
                a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                outs = [torch.empty((m, n), dtype=a.dtype, device=ctx.dev) for _ in rot]
                for i, cfg in enumerate(sweep if not ctx.quick else sweep[:1]):
                    if i and ctx.over_budget():
                        break

                    def run(item=cfg, m=m, a=a, outs=outs, fmt=fmt, rot=rot, nbytes=nbytes):
                        kernel, cfg = item if isinstance(item, tuple) and isinstance(item[0], str) else ("auto", item)
                        kernel_used = Q.kernel_for(m) if kernel == "auto" else kernel
                        launch = Q.launch_gemv if kernel_used == "gemv" else MMQ.launch_mmq
                        cfg_used = cfg or (Q.default_config if kernel_used == "gemv" else MMQ.default_config)(fmt, m, n)
                        ms = graph_ms(ctx, [lambda ww=ww, o=o: Q.gemm_nt_q8(a, fmt, ww, out=o, config=cfg,
                                                                            kernel=kernel)
                                            for ww, o in zip(rot, outs)])
                        quantize = Q.quantize_q8_k if fmt == "q4_k" else Q.quantize_q8_0
                        quantized = quantize(a)
                        ms_quant = ctx.bench(lambda: quantize(a))
                        ms_gemv = graph_ms(ctx, [lambda ww=ww, o=o: launch(fmt, quantized, ww, None, o, cfg_used)
                                                 for ww, o in zip(rot, outs)])
                        gbps = nbytes / ms / 1e6
                        return dict(fmt=fmt, path="q8", kernel=kernel_used, shape=[m, n, k],
                                    config=cfg or f"default {cfg_used}", weight_bytes=nbytes, rotations=len(rot),
                                    ms=ms, GBps=gbps, pct_copy=100 * gbps / ctx.copy_gbps,
                                    pct_read=100 * gbps / ctx.read_gbps, ms_quantize=ms_quant, ms_gemv_alone=ms_gemv,
                                    pct_read_gemv_alone=100 * nbytes / ms_gemv / 1e6 / ctx.read_gbps,
                                    gate=ctx.judge(_case(m, n, k, fmt), _adding(Q, "gemm_nt_q8", config=cfg,
                                                                                kernel=kernel), backend="triton-q8"))
                    ctx.entry("q8", f"{fmt} x q8 M={m} {n}x{k} {cfg}", run)  # cfg: the sweep's item
            del rot, w
            torch.cuda.empty_cache() if ctx.cuda else None


def q8_grid_sweep(ctx, fmt: str, n: int, k: int, w, rot) -> None:
    """--q8-grid, at M = 1 on the first shape: the GEMV alone (activations quantized once) at every q8_grid
    config, each judged by the gate (gemm_nt_q8 with that tile); the three fastest that the gate passes go to
    ctx.q8_best."""
    from kernel_parity.conformance.results import FAILING
    from kernel_parity.kernels.triton import gemm_q8 as Q
    torch = ctx.torch
    if (n, k) != ctx.gemv_shapes[0]:
        return
    a = torch.randn((1, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    quantized = (Q.quantize_q8_k if fmt == "q4_k" else Q.quantize_q8_0)(a)
    outs = [torch.empty((1, n), dtype=a.dtype, device=ctx.dev) for _ in rot]
    timed = []
    for cfg in q8_grid(fmt) if ctx.cuda else q8_grid(fmt)[:2]:  # the interpreter (--smoke-cpu): two
        if ctx.over_budget():
            break

        def run(cfg=cfg):
            ms = graph_ms(ctx, [lambda ww=ww, o=o: Q.launch_gemv(fmt, quantized, ww, None, o, cfg)
                                for ww, o in zip(rot, outs)])
            gbps = w.numel() / ms / 1e6
            return dict(fmt=fmt, path="q8 gemv alone", shape=[1, n, k], config=cfg, ms=ms, GBps=gbps,
                        pct_copy=100 * gbps / ctx.copy_gbps, ms_gemv_alone=ms,
                        pct_read_gemv_alone=100 * gbps / ctx.read_gbps,
                        gate=ctx.judge(_case(1, n, k, fmt), _adding(Q, "gemm_nt_q8", config=cfg, kernel="gemv"),
                                       backend="triton-q8"))
        row = ctx.entry("q8grid", f"{fmt} gemv alone M=1 {n}x{k} {cfg}", run)
        if row and row["gate"]["verdict"] not in FAILING:
            timed.append((row["ms_gemv_alone"], cfg))
    ctx.q8_best[fmt] = [cfg for _, cfg in sorted(timed)[:3]]


def q8_grid(fmt: str) -> list[tuple[int, ...]]:
    """The M = 1 configs of --q8-grid: (1, BLOCK_N, NB, num_warps, 1) with every thread on 1, 2 or 4 chunks
    (Q4_K: 64 weights) or block pairs (Q8_0: 64 weights) an iteration, BLOCK_N <= 16, NB <= 16 (Q4_K) / 64."""
    per = 4 if fmt == "q4_k" else 1  # chunks (Q4_K) or pairs (Q8_0) of one NB step of one row
    nb_max = 16 if fmt == "q4_k" else 64
    out = []
    for warps in (1, 2, 4, 8):
        for block_n in (1, 2, 4, 8, 16):
            for nb in (1, 2, 4, 8, 16, 32, 64):
                if nb <= nb_max and block_n * nb * per in (32 * warps, 64 * warps, 128 * warps):
                    out.append((1, block_n, nb, warps, 1))
    return out


def _read_kernel_jit():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(X, Out, n_words, BLOCK: tl.constexpr):
        """A pure stream: every 32-bit word of X read once, a program's xor written (1 / BLOCK of the bytes)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n_words, other=0)
        tl.store(Out + tl.program_id(0), tl.xor_sum(x, axis=0))
    return read_kernel


def limits_at_size(ctx, rot, n: int, k: int, label: str) -> None:
    """What a kernel can get on exactly these bytes (the rotated weights, CUDA-graph replays as the GEMVs
    are timed): a pure Triton read stream of the same words (best of a few block sizes), and torch's bf16
    GEMV over a matrix of the same bytes (n x nbytes / 2n). The size's own ceiling, for the GEMV's share."""
    import triton
    torch = ctx.torch
    nbytes = rot[0].numel()
    words = [w.view(-1)[: nbytes // 4 * 4].view(torch.int32) for w in rot]
    kern = ctx.__dict__.setdefault("read_kernel", _read_kernel_jit())
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16)):
        def run(block=block, warps=warps):
            outs = [torch.empty(triton.cdiv(x.numel(), block), dtype=torch.int32, device=ctx.dev) for x in words]
            ms = graph_ms(ctx, [lambda x=x, o=o: kern[(o.numel(),)](x, o, x.numel(), BLOCK=block, num_warps=warps)
                                for x, o in zip(words, outs)])
            gbps = nbytes / ms / 1e6
            return dict(path="read", shape=[n, k], bytes=nbytes, config=(block, warps), rotations=len(rot), ms=ms,
                        GBps=gbps, pct_read=100 * gbps / ctx.read_gbps, pct_copy=100 * gbps / ctx.copy_gbps)
        ctx.entry("q8", f"read stream of {label} bytes {(block, warps)}", run)
    cols = max(1, nbytes // (2 * n))
    a = torch.randn((1, cols), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    mats = [torch.randn((n, cols), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16) for _ in rot]

    def gemv_run():
        outs = [torch.empty((1, n), dtype=a.dtype, device=ctx.dev) for _ in mats]
        ms = graph_ms(ctx, [lambda wd=wd, o=o: torch.matmul(a, wd.T, out=o) for wd, o in zip(mats, outs)])
        gbps = 2 * n * cols / ms / 1e6
        return dict(path="torch bf16", shape=[1, n, cols], bytes=2 * n * cols, rotations=len(mats), ms=ms, GBps=gbps,
                    pct_read=100 * gbps / ctx.read_gbps, pct_copy=100 * gbps / ctx.copy_gbps)
    ctx.entry("q8", f"torch bf16 GEMV {n}x{cols} (the bytes of {label})", gemv_run)
    del mats


def prefill(ctx) -> None:
    from kernel_parity.kernels.triton import gemm as G
    torch = ctx.torch
    m = ctx.prefill_m
    timed: dict = {}
    dense_timed: dict = {}
    for si, (n, k) in enumerate(ctx.prefill_shapes):
        a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        flops = 2 * m * n * k
        t_ref = ctx.bench(lambda: a @ wd.T)
        ctx.entry("prefill", f"torch bf16 {m}x{n}x{k}", lambda: dict(shape=[m, n, k], ms=t_ref,
                                                                      TFLOPs=flops / t_ref / 1e9))
        del wd
        w = ggml_random(ctx, "q4_k", n, k)
        sweep = PREFILL_SWEEP if si == 0 and not ctx.quick else [PREFILL_SWEEP[0]]
        if si and timed and min(timed, key=timed.get) not in sweep:
            sweep = sweep + [min(timed, key=timed.get)]
        for i, cfg in enumerate(sweep):
            if i and ctx.over_budget():
                break

            def run(cfg=cfg):
                c = G.gemm_nt(a, "q4_k", w, config=cfg, path="fused")
                ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, config=cfg, path="fused"))
                if si == 0:
                    timed[cfg] = ms
                return dict(fmt="q4_k", path="fused", shape=[m, n, k], config=cfg, ms=ms, TFLOPs=flops / ms / 1e9,
                            pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops, torch_bf16_ms=t_ref,
                            speed_vs_torch_bf16=t_ref / ms,
                            gate=ctx.judge(_case(m, n, k, "q4_k"), _adding(G, "gemm_nt", config=cfg, path="fused")))
            ctx.entry("prefill", f"q4_k {m}x{n}x{k} {cfg}", run)
        prefill_dequant(ctx, a, w, t_ref, flops, dense_timed)
        del w
    prefill_crossover(ctx)


def prefill_dequant(ctx, a, w, t_ref: float, flops: int, timed: dict) -> None:
    """gemm_nt's dequant path at DENSE_SWEEP tiles, and as a reference the same dequantization followed by
    torch's matmul (cuBLAS) instead of ours; each judged by the gate, the dequantizer timed alone too."""
    from kernel_parity.kernels.triton import gemm as G, quant as TQ
    torch = ctx.torch
    m, k = a.shape
    n = w.shape[0]
    wd = torch.empty((n, k), dtype=a.dtype, device=a.device)
    ms_dq = ctx.bench(lambda: TQ.dequantize("q4_k", w, out=wd))
    nbytes = w.numel() + 2 * n * k
    ctx.entry("prefill", f"q4_k dequantize to bf16 {n}x{k}", lambda: dict(
        shape=[n, k], ms=ms_dq, GBps=nbytes / ms_dq / 1e6, pct_copy=100 * nbytes / ms_dq / 1e6 / ctx.copy_gbps))
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)

    def with_torch():
        TQ.dequantize("q4_k", w, out=wd)
        torch.matmul(a, wd.T, out=c)

    def dequant_then_torch(a_, wfmt, w_, bias=None, out=None, **_):
        """with_torch as gemm.gemm_nt, for the gate (its cases have no bias)."""
        if bias is not None:
            raise ValueError("dequantize + torch matmul: no bias form")
        w16 = TQ.dequantize(wfmt, w_, out=torch.empty((w_.shape[0], a_.shape[1]), dtype=a_.dtype, device=a_.device))
        return torch.matmul(a_, w16.T, out=out)

    def ref_run():
        ms = ctx.bench(with_torch)
        return dict(fmt="q4_k", shape=[m, n, k], ms=ms, ms_dequantize=ms_dq, TFLOPs=flops / ms / 1e9,
                    torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms,
                    gate=ctx.judge(_case(m, n, k, "q4_k"), (G, "gemm_nt", dequant_then_torch)))
    ctx.entry("prefill", f"q4_k dequantize + torch matmul {m}x{n}x{k}", ref_run)
    first = not timed
    sweep = DENSE_SWEEP if first and not ctx.quick else [None]
    if not first:
        best = min(timed, key=timed.get)
        sweep = sweep + ([best] if best not in sweep else [])
    for i, cfg in enumerate(sweep):
        if i and ctx.over_budget():
            break

        def run(cfg=cfg):
            ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, config=cfg, path="dequant"))
            if first:
                timed[cfg] = ms
            return dict(fmt="q4_k", path="dequant", shape=[m, n, k], config=cfg or f"default {G.gemm_dense.CONFIG}",
                        ms=ms, ms_dequantize=ms_dq, TFLOPs=flops / ms / 1e9,
                        pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops, torch_bf16_ms=t_ref,
                        speed_vs_torch_bf16=t_ref / ms,
                        gate=ctx.judge(_case(m, n, k, "q4_k"), _adding(G, "gemm_nt", config=cfg, path="dequant")))
        ctx.entry("prefill", f"q4_k dequant path {m}x{n}x{k} {cfg}", run)
    del wd, c


def prefill_crossover(ctx) -> None:
    """The fused kernel and the dequant path (defaults) at CROSSOVER_M rows of A, 14336 x 4096: where
    gemm.DEQUANT_MIN_M should sit."""
    from kernel_parity.kernels.triton import gemm as G
    torch = ctx.torch
    n, k = ctx.prefill_shapes[-1]
    w = ggml_random(ctx, "q4_k", n, k)
    for m in CROSSOVER_M if ctx.cuda else (17, 40):
        a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        t_ref = ctx.bench(lambda: a @ wd.T)
        del wd
        for path in ("fused", "dequant"):
            def run(path=path, m=m, a=a, t_ref=t_ref):
                c = G.gemm_nt(a, "q4_k", w, path=path)
                ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, path=path))
                return dict(fmt="q4_k", path=path, shape=[m, n, k], ms=ms, TFLOPs=2 * m * n * k / ms / 1e9,
                            torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms,
                            gate=ctx.judge(_case(m, n, k, "q4_k"), _adding(G, "gemm_nt", path=path)))
            ctx.entry("prefill", f"q4_k {path} M={m} {n}x{k}", run)
    del w


def fp8(ctx) -> None:
    """The gate judges gemm_fp8 (the activation quantizer, then gemm_fp8_scaled) at the config a line timed:
    the GEMM-alone lines' kernel, behind the quantizer every gemm.gemm_nt case of the triton backend runs."""
    from kernel_parity.kernels.triton import gemm_fp8 as F
    torch = ctx.torch
    m = n = k = ctx.fp8_size
    flops = 2 * m * n * k
    a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    wf = torch.randn((n, k), device=ctx.dev, generator=ctx.gen) * 0.02
    # 128 x 128 weight blocks (DeepSeek's weight_quant: s = amax / 448, q = e4m3(w / s))
    blocks = wf.view(n // 128, 128, k // 128, 128)
    sw = (blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4) / 448.0).float().contiguous()
    qw = (blocks / sw[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    del wf, blocks
    qa, sa = F.act_quant_fp8(a, 1, 128)
    t_scaled = {}
    ctx.entry("fp8", f"act_quant_fp8 {m}x{k}", lambda: dict(
        ms=(ms := ctx.bench(lambda: F.act_quant_fp8(a, 1, 128))), GBps=(3 * m * k + 4 * m * k // 128) / ms / 1e6))
    for i, cfg in enumerate(FP8_SWEEP if not ctx.quick else FP8_SWEEP[:1]):
        if i and ctx.over_budget():
            break

        def run(cfg=cfg):
            c = F.gemm_fp8_scaled(qa, sa, qw, sw, config=cfg)
            t_scaled[cfg] = ms = ctx.bench(lambda: F.gemm_fp8_scaled(qa, sa, qw, sw, out=c, config=cfg))
            return dict(shape=[m, n, k], config=cfg, ms=ms, TFLOPs=flops / ms / 1e9,
                        gate=ctx.judge(_case(m, n, k, "fp8"), _adding(F, "gemm_fp8", config=cfg)))
        ctx.entry("fp8", f"gemm_fp8_scaled 1x128x128 {cfg}", run)
    best = min(t_scaled, key=t_scaled.get) if t_scaled else None
    ctx.entry("fp8", "gemm_fp8 (act quant + GEMM, best config)", lambda: dict(
        shape=[m, n, k], config=best, ms=(ms := ctx.bench(lambda: F.gemm_fp8(a, qw, sw, config=best))),
        TFLOPs=flops / ms / 1e9, gate=ctx.judge(_case(m, n, k, "fp8"), _adding(F, "gemm_fp8", config=best))))

    def versus_ours(ms: float) -> dict:
        return {} if best is None else dict(ours_ms=t_scaled[best], ours_speed_vs_scaled_mm=ms / t_scaled[best])

    def scaled_mm_block():  # sa: (M, K/128) with strides (1, M), outer-dim-major, as act_quant_fp8 stores it
        ms = ctx.bench(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16))
        return dict(shape=[m, n, k], ms=ms, TFLOPs=flops / ms / 1e9, **versus_ours(ms),
                    gate=ctx.judge(_case(m, n, k, "fp8"), backend="scaled-mm"))
    ctx.entry("fp8", "torch._scaled_mm blockwise 1x128x128", scaled_mm_block)

    F_ = torch.nn.functional

    def f_scaled_mm(qa_, sa_, w_, sw_, out_dtype):  # the recipe-based API of newer torch
        return F_.scaled_mm(qa_, w_.t(), sa_, F_.ScalingType.BlockWise1x128, sw_.t(), F_.ScalingType.BlockWise128x128,
                            output_dtype=out_dtype)

    def f_scaled_mm_gemm(a_, w_, sw_, bias=None, out=None, gm=1, gn=128, gk=128, **_):
        """act_quant_fp8 then F.scaled_mm as gemm_fp8, for the gate (its fp8 case: 1 x 128 x 128, no bias)."""
        if bias is not None or (gm, gn, gk) != (1, 128, 128):
            raise ValueError(f"F.scaled_mm blockwise: no bias, groups 1 x 128 x 128 (got {gm} x {gn} x {gk})")
        qa_, sa_ = F.act_quant_fp8(a_, 1, 128)
        return out.copy_(f_scaled_mm(qa_, sa_, w_, sw_, a_.dtype))

    def f_scaled_mm_block():
        ms = ctx.bench(lambda: f_scaled_mm(qa, sa, qw, sw, torch.bfloat16))
        return dict(shape=[m, n, k], ms=ms, TFLOPs=flops / ms / 1e9, **versus_ours(ms),
                    gate=ctx.judge(_case(m, n, k, "fp8"), (F, "gemm_fp8", f_scaled_mm_gemm)))
    ctx.entry("fp8", "torch.nn.functional.scaled_mm BlockWise1x128 x BlockWise128x128", f_scaled_mm_block)

    one = torch.ones((), dtype=torch.float32, device=ctx.dev)
    ctx.entry("fp8", "torch._scaled_mm per-tensor (unit scales, timing only)", lambda: dict(
        shape=[m, n, k], ms=(ms := ctx.bench(lambda: torch._scaled_mm(qa, qw.t(), scale_a=one, scale_b=one,
                                                                      out_dtype=torch.bfloat16))),
        TFLOPs=flops / ms / 1e9))
    for gm, gn, gk, wfmt in ((1, 1, k, "fp8_row"), (m, n, k, "fp8_tensor")):
        def run(gm=gm, gn=gn, gk=gk, wfmt=wfmt):
            qa2, sa2 = F.act_quant_fp8(a, gm, gk)
            sw2 = torch.ones((-(-n // gn), -(-k // gk)), dtype=torch.float32, device=ctx.dev)
            c = F.gemm_fp8_scaled(qa2, sa2, qw, sw2, gm=gm, gn=gn, gk=gk, config=best)
            ms = ctx.bench(lambda: F.gemm_fp8_scaled(qa2, sa2, qw, sw2, gm=gm, gn=gn, gk=gk, out=c, config=best))
            return dict(shape=[m, n, k], config=best, ms=ms, TFLOPs=flops / ms / 1e9,
                        gate=ctx.judge(_case(m, n, k, wfmt), _adding(F, "gemm_fp8", config=best)))
        label = "per-token x per-channel" if wfmt == "fp8_row" else "per-tensor"
        ctx.entry("fp8", f"gemm_fp8_scaled {label}", run)


def int4(ctx) -> None:
    from kernel_parity.kernels.triton import gemm_int4 as I
    torch = ctx.torch
    g = 128  # gemm.gemm_nt's INT4_GROUP
    for si, (n, k) in enumerate(ctx.prefill_shapes):
        packs = {}
        for order in ("gptq", "awq"):
            qshape = (k // 8, n) if order == "gptq" else (k, n // 8)
            qw = torch.randint(-2**31, 2**31 - 1, qshape, dtype=torch.int32, device=ctx.dev, generator=ctx.gen)
            qz = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), dtype=torch.int32, device=ctx.dev,
                               generator=ctx.gen)
            s = (torch.rand((k // g, n), device=ctx.dev, generator=ctx.gen) * 2e-3 + 1e-4).half()
            packs[order] = (qw, qz, s)
        nbytes = n * k // 2 + 2 * n * (k // g) + n * (k // g) // 2
        for m in (ctx.prefill_m, 1):
            a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            flops = 2 * m * n * k
            if m > 1:
                wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                t_ref = ctx.bench(lambda: a @ wd.T)
                del wd
            for order, (qw, qz, s) in packs.items():
                # (path, config): the launcher's path (the dequant path at this M), the fused kernel's default,
                # then its sweep on the first shape
                sweep = [("auto", None)] + ([("fused", None)] + (
                    [("fused", c) for c in INT4_SWEEP] if si == 0 and not ctx.quick else []) if m > 1 else [])
                for i, (path, cfg) in enumerate(sweep):
                    if i and ctx.over_budget():
                        break

                    def run(cfg=cfg, path=path, order=order, qw=qw, qz=qz, s=s):
                        c = I.gemm_int4(a, qw, qz, s, group=g, order=order, config=cfg, path=path)
                        ms = ctx.bench(lambda: I.gemm_int4(a, qw, qz, s, group=g, order=order, out=c, config=cfg,
                                                           path=path))
                        row = dict(order=order, path=path, shape=[m, n, k], config=cfg, ms=ms,
                                   TFLOPs=flops / ms / 1e9, GBps_weights=nbytes / ms / 1e6)
                        if m > 1:
                            row.update(torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms)
                        else:
                            row.update(pct_copy=100 * nbytes / ms / 1e6 / ctx.copy_gbps)
                        row["gate"] = ctx.judge(_case(m, n, k, f"int4_{order}"),
                                                _adding(I, "gemm_int4", config=cfg, path=path))
                        return row
                    ctx.entry("int4", f"{order} {path} {m}x{n}x{k} {cfg}", run)
        if si == len(ctx.prefill_shapes) - 1:  # the fused kernel against the dequant path by rows (GPTQ)
            qw, qz, s = packs["gptq"]
            for m in CROSSOVER_M if ctx.cuda else (17, 40):
                a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                for path in ("fused", "dequant"):
                    def run(path=path, m=m, a=a):
                        c = I.gemm_int4(a, qw, qz, s, group=g, order="gptq", path=path)
                        ms = ctx.bench(lambda: I.gemm_int4(a, qw, qz, s, group=g, order="gptq", out=c, path=path))
                        return dict(order="gptq", path=path, shape=[m, n, k], ms=ms, TFLOPs=2 * m * n * k / ms / 1e9,
                                    gate=ctx.judge(_case(m, n, k, "int4_gptq"), _adding(I, "gemm_int4", path=path)))
                    ctx.entry("int4", f"gptq {path} M={m} {n}x{k}", run)
        del packs


def _compiled(fn) -> list:
    """The CompiledKernels a JITFunction holds (Triton 3.x keeps them per device in device_caches)."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        for part in (entry if isinstance(entry, tuple) else (entry,)):
            if isinstance(part, dict):
                out += [k for k in part.values() if hasattr(k, "asm")]
    return out


def dump_kernels(ctx, path: str) -> None:
    """Registers, spills and the opcode histogram of the longest loop of every compiled variant of
    the GEMM kernels (cuobjdump on the cubin): the device's own compiler output, for the notes."""
    import collections
    import re
    import subprocess
    import tempfile
    from kernel_parity.kernels.triton import gemm as G, gemm_fp8 as F, gemm_gemv as V, gemm_int4 as I
    from kernel_parity.kernels.triton import gemm_q8 as Q
    lines = []
    for fn in (V._gemv_kernel, V._q6_k_kernel, G._gemm_ggml_kernel, F._gemm_fp8_kernel, I._gemm_int4_kernel,
               Q._gemv_q4_k_q8_kernel, Q._gemv_q8_0_q8_kernel):
        for k in _compiled(fn):
            meta = {x: getattr(k.metadata, x, None) for x in ("num_warps", "num_stages")}
            consts = {n: v for n, v in getattr(k.src, "constants", {}).items()} if hasattr(k, "src") else {}
            hist, n = "", 0
            try:
                with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                    f.write(k.asm["cubin"])
                sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True,
                                      text=True).stdout.splitlines()
                addr = {i: int(m.group(1), 16) for i, l in enumerate(sass)
                        if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", l))}
                best = None
                for i, l in enumerate(sass):  # backward branches: cuobjdump prints the target address
                    m = re.search(r"BRA\s+0x([0-9a-f]+)", l)
                    if m and i in addr and int(m.group(1), 16) < addr[i]:
                        lo = min(j for j, a in addr.items() if a >= int(m.group(1), 16))
                        best = (lo, i) if best is None or i - lo > best[1] - best[0] else best
                if best:
                    op = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
                    ops = collections.Counter(m.group(1).split(".")[0] for l in sass[best[0]:best[1] + 1]
                                              if (m := op.search(l)))
                    n = sum(ops.values())
                    hist = " ".join(f"{o}:{c}" for o, c in ops.most_common(16))
            except Exception as e:  # the histogram is a nicety
                hist = f"(no sass: {type(e).__name__})"
            lines.append(f"{fn.__name__} {meta} regs={getattr(k, 'n_regs', None)} "
                         f"spills={getattr(k, 'n_spills', None)} loop={n} {hist}\n    {consts}")
    from kernel_parity.reports.files import write_text

    write_text(path, "\n".join(lines) + "\n")
    print(f"kernel dump: {len(lines)} compiled variants -> {path}", flush=True)


@contextlib.contextmanager
def _golden_cache():
    """KERNEL_PARITY_GOLDEN_CACHE set to a temporary folder (unless set) while the sweeps run: the gate's
    input groups and goldens are made once however many configs of a shape it judges."""
    from kernel_parity.conformance import golden_cache

    if golden_cache.directory() is not None:
        yield
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kp-gemm-gate-") as tmp:
        os.environ[golden_cache.ENV] = tmp
        try:
            yield
        finally:
            del os.environ[golden_cache.ENV]


def tune(args: argparse.Namespace) -> int:
    """The direct measurement (module docstring); 1 when a timed case fails the gate or an entry raises."""
    if args.smoke_cpu:
        from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment
        prepare_environment()
        why = interpreter_ready()
        if why:
            print(f"gpu_gemm.py: error: --smoke-cpu: {why}", file=sys.stderr)
            return 2
    import torch

    cuda = torch.cuda.is_available() and not args.smoke_cpu
    if not cuda and not args.smoke_cpu:
        print("gpu_gemm.py: error: no CUDA device; --tune times the kernels on a GPU (--smoke-cpu checks the "
              "script on the CPU)", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from bench_cases import gate_text

    dev = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    bench_kw = dict(warmup=10, rep=40 if args.quick else 60, return_mode="median")

    def bench(fn) -> float:
        if cuda:
            return float(do_bench(fn, **bench_kw))
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    t0 = time.time()
    copy_bytes = (2048 if cuda else 16) * MIB
    src = torch.rand(copy_bytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_gbps = 2 * copy_bytes / bench(lambda: dst.copy_(src)) / 1e6
    read_gbps = copy_bytes / bench(lambda: src.sum()) / 1e6  # a read-only stream, for scale
    del src, dst
    n = 8192 if cuda else 256
    x = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    mm_tflops = 2 * n**3 / bench(lambda: x @ y) / 1e9
    del x, y
    props = torch.cuda.get_device_properties(dev) if cuda else None
    from kernel_parity.kernels.triton import gemm as G, gemm_fp8 as F, gemm_gemv as V, gemm_int4 as I
    header = dict(
        device=torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter smoke run)",
        capability=".".join(map(str, torch.cuda.get_device_capability(dev))) if cuda else None,
        sm_count=props.multi_processor_count if cuda else None,
        l2_bytes=getattr(props, "L2_cache_size", None) if cuda else None,
        torch=torch.__version__, triton=triton.__version__, copy_GBps=copy_gbps, read_GBps=read_gbps,
        matmul_bf16_TFLOPs=mm_tflops, matmul_size=n, do_bench=bench_kw,
        gate="bench_cases.Gate: gemm.gemm_nt at each line's shape, dist normal, seed 0, the timed call swapped in",
        configs=dict(gemv=V.GEMV_CONFIGS, decode=V.DECODE_CONFIGS, prefill=G.PREFILL_CONFIGS,
                     fp8=F.GEMM_CONFIG, int4=(I.DECODE_CONFIG, I.PREFILL_CONFIG)),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command="benchmarks/gpu_gemm.py --tune",
    )
    print(f"{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    ctx = Ctx(torch=torch, dev=dev, gen=gen, cuda=cuda, bench=bench, copy_gbps=copy_gbps, read_gbps=read_gbps,
              mm_tflops=mm_tflops, quick=args.quick or not cuda, t0=t0, budget_s=args.budget_s, out=args.out,
              header=header, results=[], errors=[], l2=(header["l2_bytes"] or 50 * MIB),
              gemv_shapes=list(GEMV_SHAPES) if cuda else [(40, 512)],
              prefill_shapes=list(PREFILL_SHAPES) if cuda else [(40, 512)],
              prefill_m=PREFILL_M if cuda else 33, fp8_size=FP8_SIZE if cuda else 256,
              formats=args.formats, q8_grid=args.q8_grid, q8_best={}, q8_m=args.q8_m)
    sections = {"gemv": gemv, "q8": q8, "prefill": prefill, "fp8": fp8, "int4": int4}
    with _golden_cache():
        for name in args.sections:  # in the order given
            t = time.time()
            try:
                sections[name](ctx)
            except Exception as e:  # set-up of a section; its entries record their own errors
                ctx.errors.append(dict(section=name, error=f"{type(e).__name__}: {e}"[:500],
                                       trace=traceback.format_exc()[-2000:]))
                print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            print(f"[{name}: {time.time() - t:.0f} s]", flush=True)
            if cuda:
                torch.cuda.empty_cache()
            ctx.save()

    if args.dump and cuda:
        try:
            dump_kernels(ctx, args.dump)
        except Exception as e:
            print(f"kernel dump failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"\n{header['device']}  copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s  "
          f"total {time.time() - t0:.0f} s")
    for r in ctx.results:
        rate = (f"{r['GBps']:7.0f} GB/s {r.get('pct_copy', 0):5.1f}%" if "GBps" in r
                else f"{r.get('TFLOPs', 0):7.1f} TFLOP/s")
        print(f"{r['section']:8s} {r['name'][:58]:58s} {r.get('ms', float('nan')):9.4f} ms {rate:>20s}  "
              + ("" if "gate" not in r else gate_text(r["gate"])))
    failures = ctx.failures()
    for f in failures:
        print("GATE FAIL", f, flush=True)
    if ctx.errors:
        print(f"\n{len(ctx.errors)} error(s):", *[f"{e['section']}/{e.get('name', '')}: {e['error']}"
                                                 for e in ctx.errors], sep="\n  ", file=sys.stderr)
    return 1 if failures or ctx.errors else 0
