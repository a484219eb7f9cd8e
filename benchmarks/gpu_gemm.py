"""GPU benchmark of the quantized-GEMM Triton kernels (kernels/triton/gemm*.py) on Hopper.

    python benchmarks/gpu_gemm.py [--out PATH] [--quick] [--budget-s S] [--sections gemv,q8,fp8,prefill,int4]
                                  [--formats q4_k,...] [--dump PATH] [--smoke-cpu]

1. Header: copy bandwidth (a 2 GiB device-to-device copy, bytes read + written) and the bf16
   matmul rate (torch.matmul 8192^3), measured in this run; GEMV figures are shares of the first.
2. gemv: GGML Q4_K, Q8_0, Q4_0, Q6_K at M = 1, N x K = 14336 x 4096 and 4096 x 14336, a sweep of
   the GEMV configs (BLOCK_N, NB, num_warps, num_stages; automatic split-K); then M = 4 and 16 at
   the first shape (the launcher's choice, the exact kernel, tensor-core configs). GB/s counts the
   weight bytes only. Timed as CUDA-graph replays over rotated weight copies whose total exceeds
   3x L2 (a ~10 us kernel: no launch gaps, no L2 reuse); do_bench (L2 flushed per call) beside it.
   torch bf16 GEMV of the same shape for scale.
2b. q8: Q4_K x Q8_K and Q8_0 x Q8_0 activations (kernels/triton/gemm_q8.py, backend triton-q8) at M = 1 on both shapes and
   M = 4, 16 on the first: quantizer + integer-dot GEMV as one call, and the GEMV alone, as shares of
   the read and copy rates; checked against the `emulated` golden (and its distance to the dequantized
   product, the activation quantization, recorded beside it). Beside them, the limits at the weights' own
   size: a pure Triton read stream of the same rotated bytes and torch's bf16 GEMV over a matrix of the
   same bytes (a 33 MB matrix is read in ~11 us: launch, ramp and tail count). --q8-grid first sweeps
   ~40 M = 1 configs per format (the GEMV alone, each checked) and times the three fastest in full.
3. prefill: Q4_K at M = 4096, 4096 x 4096 and 14336 x 4096 (bf16 A), a config sweep, against a
   torch bf16 matmul of the same shape.
4. fp8: DeepSeek 1 x 128 x 128 at 8192^3: the GEMM on pre-quantized operands (config sweep) and
   with the activation quantizer, against torch._scaled_mm blockwise (scale_a (M, K/128)
   outer-dim-major, scale_b = w_scale.T), torch.nn.functional.scaled_mm (BlockWise1x128 x
   BlockWise128x128) and per-tensor _scaled_mm; our per-token x per-channel and per-tensor modes.
5. int4: GPTQ and AWQ (group 128) at M = 4096 (vs torch bf16 matmul) and M = 1 (GB/s).
Every timed kernel's output is checked once against float64 (dequantized weights from refimpl/ on
the CPU, products in torch float64 on the GPU, on the first 512 output columns): err_acc =
max |C - ref| / (|A| @ |W|^T), err_max = max |C - ref| / max |ref|; `ok` against the path's limit.
An entry that fails records its error and the run goes on. --dump writes the registers, spills and
the opcode histogram of the longest loop of every compiled kernel variant (cuobjdump). Results go
to --out (default $OUT/gemm-bench.json), rewritten after each entry. --budget-s stops the sweeps (not the main
entries) when the run gets long; --smoke-cpu runs tiny shapes on the CPU (Triton interpreter) to
check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

MIB = 1 << 20
CHECK_COLS = 512
# err_acc limits: fp32 arithmetic; weights and output rounded to bf16; fp8 GEMM (exact operands) with a
# bf16 output, whose rounding alone reaches 2^-9 = 1.95e-3 of sum |a||w|.
LIMITS = {"fp32": 1e-5, "bf16": 8e-3, "fp8": 4e-3}

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
# kernels/triton/gemm_q8.py (Q4_K x Q8_K, Q8_0 x Q8_0 activations, backend triton-q8): (BLOCK_M, BLOCK_N, NB,
# num_warps, num_stages) per format and M (Q8_0: NB block pairs); None: the launcher's choice
# (gemm_q8.default_config, by M and N). Offline sm_90 SASS, instructions a weight: Q4_K 1.5 (the exact
# kernel: 6.4 on the device), Q8_0 1.4 / 1.16.
Q8_SWEEP = {"q4_k": {1: [None, (1, 4, 2, 1, 1), (1, 2, 4, 1, 1), (1, 8, 8, 4, 1), (1, 4, 8, 4, 1)]},
            "q8_0": {1: [None, (1, 4, 64, 2, 1), (1, 8, 16, 4, 1), (1, 8, 32, 4, 1)]}}
# M = 4 / 16: the launcher's choice (None), the dp4a GEMV at its default tile ("gemv"), and the int8 tensor-core
# kernel (kernels/triton/gemm_mmq.py, "mmq") at (BLOCK_N, BLOCK_M, NB, num_warps, num_stages): W rows on the
# tensor cores' M side (16 .. 128), A rows on the N side (16), NB 32-wide sub-blocks (Q8_0) / 256-blocks (Q4_K)
# an iteration, SPLIT_K ranges of K a row (default gemm_mmq.auto_splits: ~6 programs an SM).
MMQ_GRID = [(64, 16, 1, 4, 3), (32, 16, 1, 2, 3),  # then PREFETCH (the next block's weight words loaded first)
            (64, 16, 1, 4, 3, None, 1), (32, 16, 1, 2, 3, None, 1), (64, 16, 1, 4, 2, None, 1),
            (32, 16, 1, 2, 2, None, 1), (128, 16, 1, 4, 3, None, 1), (128, 16, 1, 8, 3, None, 1),
            (16, 16, 1, 1, 3, None, 1), (64, 16, 1, 4, 3, 2, 1), (64, 16, 1, 4, 3, 8, 1), (32, 16, 1, 2, 3, 4, 1)]
# 6th: SPLIT_K (None: auto), 7th: PREFETCH (gemm_mmq.launch_mmq)
for _fmt in Q8_SWEEP:
    for _m in (4, 16):
        Q8_SWEEP[_fmt][_m] = [None, ("gemv", None)] + [("mmq", c) for c in MMQ_GRID]
# Swept on the first shape; the others run the default and the best. 6th element: GROUP_M.
PREFILL_SWEEP = [(256, 128, 1, 8, 3, 4), (256, 128, 1, 8, 4, 4), (256, 64, 1, 8, 3, 4), (256, 128, 1, 8, 3, 8)]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, TMA)
FP8_SWEEP = [(128, 128, 128, 8, 8, 4, 1), (128, 128, 128, 16, 8, 4, 1), (128, 128, 128, 8, 8, 3, 1),
             (128, 128, 128, 8, 8, 4, 0)]
INT4_SWEEP = [(256, 128, 64, 4, 8, 3), (256, 64, 64, 8, 8, 3), (256, 64, 64, 4, 8, 3)]  # first shape, M = 4096


class Ctx:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.budget_s

    def save(self) -> None:
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(dict(header=self.header, results=self.results,
                                                      errors=self.errors), indent=1, default=str))

    def entry(self, section: str, name: str, fn) -> dict | None:
        """Run one benchmark entry; its dict goes to results, an exception to errors."""
        try:
            row = dict(section=section, name=name, **fn())
            self.results.append(row)
            print("bench", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            return row
        except Exception as e:
            self.errors.append(dict(section=section, name=name, error=f"{type(e).__name__}: {e}"[:500],
                                    trace=traceback.format_exc()[-2000:]))
            print(f"ERROR {section}/{name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
            return None
        finally:
            self.save()


def errors_vs(ctx, c, ref, mag, limit: str) -> dict:
    """err_acc = max |c - ref| / mag (mag = |A| @ |W|^T), err_max = max |c - ref| / max |ref|."""
    d = (c.double() - ref).abs()
    bad = bool(ctx.torch.isnan(c).any())
    err_acc = float((d / mag.clamp_min(1e-300)).max())
    err_max = float(d.max() / ref.abs().max().clamp_min(1e-300))
    return dict(err_acc=err_acc, err_max=err_max, ok=not bad and err_acc <= LIMITS[limit], limit=limit)


# ------------------------------------------------------------------ weights and float64 references

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


def ggml_w64(ctx, fmt: str, w):
    """float64 dequantization of the first CHECK_COLS rows (refimpl, on the CPU), on the device."""
    from kernel_parity.refimpl import quant
    return ctx.torch.from_numpy(quant.dequantize(fmt, w[:CHECK_COLS].cpu().numpy())).to(ctx.dev)


def check_slice(ctx, c, a, w64, limit, bias=None) -> dict:
    """c[:, :CHECK_COLS] against a @ w64^T in float64 (w64: the first CHECK_COLS rows of W)."""
    a64 = a.double()
    ref = a64 @ w64.T
    if bias is not None:
        ref += bias[:w64.shape[0]].double()
    return errors_vs(ctx, c[:, :w64.shape[0]], ref, a64.abs() @ w64.abs().T, limit)


def rotated(ctx, fmt: str, n: int, k: int):
    """(w, copies of w's shape whose total exceeds 3x L2 with w first, w's float64 check rows)."""
    w = ggml_random(ctx, fmt, n, k)
    rot = [w] + [ggml_random(ctx, fmt, n, k) for _ in range(max(1, min(7, -(-3 * ctx.l2 // w.numel()) - 1)))]
    return w, rot, ggml_w64(ctx, fmt, w)


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


# ------------------------------------------------------------------ sections

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
            w, rot, w64 = rotated(ctx, fmt, n, k)
            nbytes = w.numel()
            outs = [torch.empty((1, n), dtype=a.dtype, device=ctx.dev) for _ in rot]
            for i, (cfg, split) in enumerate(sweep if not ctx.quick else sweep[:1]):
                if i and ctx.over_budget():
                    break

                def run(cfg=cfg, split=split):
                    c = G.gemm_nt(a, fmt, w, config=cfg, split_k=split)
                    row = dict(fmt=fmt, shape=[1, n, k], config=cfg, split_k=split or "auto", weight_bytes=nbytes,
                               rotations=len(rot), **check_slice(ctx, c, a, w64, "bf16"))
                    if i == 0:  # fp32 A and output: the decode path's exact fp32 arithmetic, fp32 limit
                        f32 = check_slice(ctx, G.gemm_nt(a.float(), fmt, w, config=cfg, split_k=split), a.float(),
                                          w64, "fp32")
                        row.update(err_acc_fp32=f32["err_acc"], ok=row["ok"] and f32["ok"])
                    ms = graph_ms(ctx, [lambda ww=ww, o=o: G.gemm_nt(a, fmt, ww, out=o, config=cfg, split_k=split)
                                        for ww, o in zip(rot, outs)])
                    row.update(ms=ms, GBps=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / ctx.copy_gbps,
                               ms_do_bench=ctx.bench(lambda: G.gemm_nt(a, fmt, w, out=outs[0], config=cfg,
                                                                       split_k=split)))
                    return row
                ctx.entry("gemv", f"{fmt} {n}x{k} {cfg} split={split or 'auto'}", run)
            del rot, outs, w, w64
            torch.cuda.empty_cache() if ctx.cuda else None
    n, k = ctx.gemv_shapes[0]
    for fmt, sweep in DECODE_SWEEP.items():  # M = 2..16: the GEMV kernel with BLOCK_M rows of A
        if ctx.formats and fmt not in ctx.formats:
            continue
        w = ggml_random(ctx, fmt, n, k)
        w64 = ggml_w64(ctx, fmt, w)
        for m in (4, 16):
            a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            for i, (cfg, split) in enumerate(sweep if not ctx.quick else sweep[:1]):
                if i and ctx.over_budget():
                    break

                def run(cfg=cfg, split=split, m=m, a=a):
                    row = dict(fmt=fmt, shape=[m, n, k], config=cfg, split_k=split or "auto",
                               **check_slice(ctx, G.gemm_nt(a, fmt, w, config=cfg, split_k=split), a, w64, "bf16"))
                    if i == 0:  # fp32 A: fp32 arithmetic
                        f32 = check_slice(ctx, G.gemm_nt(a.float(), fmt, w, config=cfg, split_k=split), a.float(),
                                          w64, "fp32")
                        row.update(err_acc_fp32=f32["err_acc"], ok=row["ok"] and f32["ok"])
                    ms = ctx.bench(lambda: G.gemm_nt(a, fmt, w, config=cfg, split_k=split))
                    row.update(ms=ms, GBps=w.numel() / ms / 1e6, pct_copy=100 * w.numel() / ms / 1e6 / ctx.copy_gbps)
                    return row
                ctx.entry("decode", f"{fmt} M={m} {n}x{k} {cfg} split={split or 'auto'}", run)


def q8(ctx) -> None:
    """triton-q8 (Q4_K x Q8_K, Q8_0 x Q8_0): the activation quantizer and the integer-dot GEMV together (what
    a user calls), and the GEMV alone, on weight bytes against the read and copy rates of this run; checked
    against the `emulated` golden (float64 of the same integer dots) on the first CHECK_COLS rows."""
    from kernel_parity.kernels.triton import gemm_mmq as MMQ, gemm_q8 as Q
    from kernel_parity.refimpl import gemm as refgemm
    torch = ctx.torch
    for n, k in ctx.gemv_shapes:
        for fmt, sweeps in Q8_SWEEP.items():
            if ctx.formats and fmt not in ctx.formats:
                continue
            w, rot, w64 = rotated(ctx, fmt, n, k)
            nbytes = w.numel()
            w_np = w[:CHECK_COLS].cpu().numpy()
            limits_at_size(ctx, rot, n, k, f"{fmt} {n}x{k}")
            if ctx.q8_grid:
                q8_grid_sweep(ctx, fmt, n, k, w, rot, w_np, w64)
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

                    def run(item=cfg, m=m, a=a, outs=outs, fmt=fmt, w=w, w64=w64, w_np=w_np, rot=rot, nbytes=nbytes):
                        kernel, cfg = item if isinstance(item, tuple) and isinstance(item[0], str) else ("auto", item)
                        kernel_used = Q.kernel_for(m) if kernel == "auto" else kernel
                        launch = Q.launch_gemv if kernel_used == "gemv" else MMQ.launch_mmq
                        cfg_used = cfg or (Q.default_config if kernel_used == "gemv" else MMQ.default_config)(fmt, m, n)
                        c = Q.gemm_nt_q8(a, fmt, w, config=cfg, kernel=kernel)
                        ref = torch.from_numpy(refgemm.emulated_reference(a.float().cpu().numpy(), fmt, {"w": w_np}))
                        mag = a.double().abs() @ w64.abs().T
                        row = dict(fmt=fmt, path="q8", kernel=kernel_used, shape=[m, n, k],
                                   config=cfg or f"default {cfg_used}", weight_bytes=nbytes,
                                   rotations=len(rot), **errors_vs(ctx, c[:, :CHECK_COLS], ref.to(ctx.dev), mag, "bf16"))
                        dq = a.double() @ w64.T  # the dequantized product: the activation quantization's size
                        row["err_acc_vs_dequant"] = float(((c[:, :CHECK_COLS].double() - dq).abs() / mag).max())
                        ms = graph_ms(ctx, [lambda ww=ww, o=o: Q.gemm_nt_q8(a, fmt, ww, out=o, config=cfg,
                                                                            kernel=kernel)
                                            for ww, o in zip(rot, outs)])
                        quantize = Q.quantize_q8_k if fmt == "q4_k" else Q.quantize_q8_0
                        quantized = quantize(a)
                        ms_quant = ctx.bench(lambda: quantize(a))
                        ms_gemv = graph_ms(ctx, [lambda ww=ww, o=o: launch(fmt, quantized, ww, None, o, cfg_used)
                                                 for ww, o in zip(rot, outs)])
                        gbps = nbytes / ms / 1e6
                        row.update(ms=ms, GBps=gbps, pct_copy=100 * gbps / ctx.copy_gbps,
                                   pct_read=100 * gbps / ctx.read_gbps, ms_quantize=ms_quant, ms_gemv_alone=ms_gemv,
                                   pct_read_gemv_alone=100 * nbytes / ms_gemv / 1e6 / ctx.read_gbps)
                        return row
                    ctx.entry("q8", f"{fmt} x q8 M={m} {n}x{k} {cfg}", run)  # cfg: the sweep's item
            del rot, w, w64
            torch.cuda.empty_cache() if ctx.cuda else None


def q8_grid_sweep(ctx, fmt: str, n: int, k: int, w, rot, w_np, w64) -> None:
    """--q8-grid, at M = 1 on the first shape: the GEMV alone (activations quantized once) at every q8_grid
    config, each output checked against the emulated golden; the three fastest go to ctx.q8_best."""
    from kernel_parity.kernels.triton import gemm_q8 as Q
    from kernel_parity.refimpl import gemm as refgemm
    torch = ctx.torch
    if (n, k) != ctx.gemv_shapes[0]:
        return
    a = torch.randn((1, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    ref = torch.from_numpy(refgemm.emulated_reference(a.float().cpu().numpy(), fmt, {"w": w_np})).to(ctx.dev)
    mag = a.double().abs() @ w64.abs().T
    quantized = (Q.quantize_q8_k if fmt == "q4_k" else Q.quantize_q8_0)(a)
    outs = [torch.empty((1, n), dtype=a.dtype, device=ctx.dev) for _ in rot]
    timed = []
    for cfg in q8_grid(fmt) if ctx.cuda else q8_grid(fmt)[:2]:  # the interpreter (--smoke-cpu): two
        if ctx.over_budget():
            break

        def run(cfg=cfg):
            Q.launch_gemv(fmt, quantized, w, None, outs[0], cfg)
            row = dict(fmt=fmt, path="q8 gemv alone", shape=[1, n, k], config=cfg,
                       **errors_vs(ctx, outs[0][:, :CHECK_COLS], ref, mag, "bf16"))
            ms = graph_ms(ctx, [lambda ww=ww, o=o: Q.launch_gemv(fmt, quantized, ww, None, o, cfg)
                                for ww, o in zip(rot, outs)])
            gbps = w.numel() / ms / 1e6
            row.update(ms=ms, GBps=gbps, pct_copy=100 * gbps / ctx.copy_gbps, ms_gemv_alone=ms,
                       pct_read_gemv_alone=100 * gbps / ctx.read_gbps)
            return row
        row = ctx.entry("q8grid", f"{fmt} gemv alone M=1 {n}x{k} {cfg}", run)
        if row and row["ok"]:
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
        w64 = ggml_w64(ctx, "q4_k", w)
        sweep = PREFILL_SWEEP if si == 0 and not ctx.quick else [PREFILL_SWEEP[0]]
        if si and timed and min(timed, key=timed.get) not in sweep:
            sweep = sweep + [min(timed, key=timed.get)]
        for i, cfg in enumerate(sweep):
            if i and ctx.over_budget():
                break

            def run(cfg=cfg):
                c = G.gemm_nt(a, "q4_k", w, config=cfg, path="fused")
                row = dict(fmt="q4_k", path="fused", shape=[m, n, k], config=cfg, **check_slice(ctx, c, a, w64, "bf16"))
                ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, config=cfg, path="fused"))
                row.update(ms=ms, TFLOPs=flops / ms / 1e9, pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops,
                           torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms)
                if si == 0:
                    timed[cfg] = ms
                return row
            ctx.entry("prefill", f"q4_k {m}x{n}x{k} {cfg}", run)
        prefill_dequant(ctx, a, w, w64, t_ref, flops, dense_timed)
        del w, w64
    prefill_crossover(ctx)


# gemm_nt's dequant path (kernels/triton/gemm_dense.py after the dequantizer): (BLOCK_M, BLOCK_N, BLOCK_K,
# GROUP_M, num_warps, num_stages[, TMA]), swept on the first shape; the others run the default and the best
DENSE_SWEEP = [None, (256, 128, 64, 8, 8, 4), (256, 128, 64, 16, 8, 3), (256, 128, 64, 4, 8, 3),
               (256, 128, 128, 8, 8, 2), (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 8, 3, 0)]
CROSSOVER_M = (128, 256, 512, 1024, 2048)  # rows of A where the fused and dequant paths are both timed


def prefill_dequant(ctx, a, w, w64, t_ref: float, flops: int, timed: dict) -> None:
    """gemm_nt's dequant path at DENSE_SWEEP tiles, and as a reference the same dequantization followed by
    torch's matmul (cuBLAS) instead of ours; each output checked, the dequantizer timed alone too."""
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

    def ref_run():
        with_torch()
        row = dict(fmt="q4_k", shape=[m, n, k], **check_slice(ctx, c, a, w64, "bf16"))
        ms = ctx.bench(with_torch)
        row.update(ms=ms, ms_dequantize=ms_dq, TFLOPs=flops / ms / 1e9, torch_bf16_ms=t_ref,
                   speed_vs_torch_bf16=t_ref / ms)
        return row
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
            G.gemm_nt(a, "q4_k", w, out=c, config=cfg, path="dequant")
            row = dict(fmt="q4_k", path="dequant", shape=[m, n, k], config=cfg or f"default {G.gemm_dense.CONFIG}",
                       **check_slice(ctx, c, a, w64, "bf16"))
            ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, config=cfg, path="dequant"))
            row.update(ms=ms, ms_dequantize=ms_dq, TFLOPs=flops / ms / 1e9, pct_matmul=100 * flops / ms / 1e9 /
                       ctx.mm_tflops, torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms)
            if first:
                timed[cfg] = ms
            return row
        ctx.entry("prefill", f"q4_k dequant path {m}x{n}x{k} {cfg}", run)
    del wd, c


def prefill_crossover(ctx) -> None:
    """The fused kernel and the dequant path (defaults) at CROSSOVER_M rows of A, 14336 x 4096: where
    gemm.DEQUANT_MIN_M should sit."""
    from kernel_parity.kernels.triton import gemm as G
    torch = ctx.torch
    n, k = ctx.prefill_shapes[-1]
    w = ggml_random(ctx, "q4_k", n, k)
    w64 = ggml_w64(ctx, "q4_k", w)
    for m in CROSSOVER_M if ctx.cuda else (17, 40):
        a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        t_ref = ctx.bench(lambda: a @ wd.T)
        del wd
        for path in ("fused", "dequant"):
            def run(path=path, m=m, a=a, t_ref=t_ref):
                c = G.gemm_nt(a, "q4_k", w, path=path)
                row = dict(fmt="q4_k", path=path, shape=[m, n, k], **check_slice(ctx, c, a, w64, "bf16"))
                ms = ctx.bench(lambda: G.gemm_nt(a, "q4_k", w, out=c, path=path))
                row.update(ms=ms, TFLOPs=2 * m * n * k / ms / 1e9, torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms)
                return row
            ctx.entry("prefill", f"q4_k {path} M={m} {n}x{k}", run)
    del w, w64


def fp8_ref(ctx, qa, sa, qw, sw, rows: int, gk: int = 128):
    """Emulated float64 reference of the first `rows` rows: sum_kb dot(qa, qw)_kb * sa * sw."""
    torch = ctx.torch
    xa, xw = qa[:rows].double(), qw[:CHECK_COLS].double()
    m, k = xa.shape
    ref = torch.zeros((m, xw.shape[0]), dtype=torch.float64, device=ctx.dev)
    mag = torch.zeros_like(ref)
    swn = sw.double()[torch.arange(xw.shape[0], device=ctx.dev) // 128]  # n, kb
    for kb in range(-(-k // gk)):
        s = slice(kb * gk, (kb + 1) * gk)
        scale = sa[:rows, kb].double()[:, None] * swn[:, kb][None, :]
        ref += (xa[:, s] @ xw[:, s].T) * scale
        mag += (xa[:, s].abs() @ xw[:, s].abs().T) * scale
    return ref, mag


def fp8(ctx) -> None:
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
    rows = min(m, 256)
    ref, mag = fp8_ref(ctx, qa, sa, qw, sw, rows)
    chk = lambda c: errors_vs(ctx, c[:rows, :CHECK_COLS], ref, mag, "fp8")  # noqa: E731
    t_scaled = {}
    ctx.entry("fp8", f"act_quant_fp8 {m}x{k}", lambda: dict(
        ms=(ms := ctx.bench(lambda: F.act_quant_fp8(a, 1, 128))), GBps=(3 * m * k + 4 * m * k // 128) / ms / 1e6))
    for i, cfg in enumerate(FP8_SWEEP if not ctx.quick else FP8_SWEEP[:1]):
        if i and ctx.over_budget():
            break

        def run(cfg=cfg):
            c = F.gemm_fp8_scaled(qa, sa, qw, sw, config=cfg)
            row = dict(shape=[m, n, k], config=cfg, **chk(c))
            ms = ctx.bench(lambda: F.gemm_fp8_scaled(qa, sa, qw, sw, out=c, config=cfg))
            t_scaled[cfg] = ms
            row.update(ms=ms, TFLOPs=flops / ms / 1e9)
            return row
        ctx.entry("fp8", f"gemm_fp8_scaled 1x128x128 {cfg}", run)
    best = min(t_scaled, key=t_scaled.get) if t_scaled else None
    ctx.entry("fp8", "gemm_fp8 (act quant + GEMM, best config)", lambda: dict(
        shape=[m, n, k], config=best, **chk(F.gemm_fp8(a, qw, sw, config=best)),
        ms=(ms := ctx.bench(lambda: F.gemm_fp8(a, qw, sw, config=best))), TFLOPs=flops / ms / 1e9))

    def scaled_mm_block():
        sa_t = sa  # (M, K/128) with strides (1, M): outer-dim-major, as act_quant_fp8 stores it
        c = torch._scaled_mm(qa, qw.t(), scale_a=sa_t, scale_b=sw.t(), out_dtype=torch.bfloat16)
        ms = ctx.bench(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa_t, scale_b=sw.t(), out_dtype=torch.bfloat16))
        row = dict(shape=[m, n, k], **chk(c), ms=ms, TFLOPs=flops / ms / 1e9)
        if best is not None:
            row.update(ours_ms=t_scaled[best], ours_speed_vs_scaled_mm=ms / t_scaled[best])
        return row
    ctx.entry("fp8", "torch._scaled_mm blockwise 1x128x128", scaled_mm_block)

    def f_scaled_mm_block():  # the recipe-based API of newer torch, same operands
        F_ = torch.nn.functional
        call = lambda: F_.scaled_mm(qa, qw.t(), sa, F_.ScalingType.BlockWise1x128, sw.t(),  # noqa: E731
                                    F_.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        c, ms = call(), ctx.bench(call)
        row = dict(shape=[m, n, k], **chk(c), ms=ms, TFLOPs=flops / ms / 1e9)
        if best is not None:
            row.update(ours_ms=t_scaled[best], ours_speed_vs_scaled_mm=ms / t_scaled[best])
        return row
    ctx.entry("fp8", "torch.nn.functional.scaled_mm BlockWise1x128 x BlockWise128x128", f_scaled_mm_block)

    one = torch.ones((), dtype=torch.float32, device=ctx.dev)
    ctx.entry("fp8", "torch._scaled_mm per-tensor (unit scales, timing only)", lambda: dict(
        shape=[m, n, k], ms=(ms := ctx.bench(lambda: torch._scaled_mm(qa, qw.t(), scale_a=one, scale_b=one,
                                                                      out_dtype=torch.bfloat16))),
        TFLOPs=flops / ms / 1e9))
    for gm, gn, gk, label in ((1, 1, k, "per-token x per-channel"), (m, n, k, "per-tensor")):
        def run(gm=gm, gn=gn, gk=gk):
            qa2, sa2 = F.act_quant_fp8(a, gm, gk)
            sw2 = torch.ones((-(-n // gn), -(-k // gk)), dtype=torch.float32, device=ctx.dev)
            c = F.gemm_fp8_scaled(qa2, sa2, qw, sw2, gm=gm, gn=gn, gk=gk, config=best)
            s_rows = sa2[torch.arange(rows, device=ctx.dev) // gm, 0].double()[:, None]  # one K group, unit sw
            ref2 = (qa2[:rows].double() @ qw[:CHECK_COLS].double().T) * s_rows
            mag2 = (qa2[:rows].double().abs() @ qw[:CHECK_COLS].double().abs().T) * s_rows
            ms = ctx.bench(lambda: F.gemm_fp8_scaled(qa2, sa2, qw, sw2, gm=gm, gn=gn, gk=gk, out=c, config=best))
            return dict(shape=[m, n, k], config=best, **errors_vs(ctx, c[:rows, :CHECK_COLS], ref2, mag2, "fp8"),
                        ms=ms, TFLOPs=flops / ms / 1e9)
        ctx.entry("fp8", f"gemm_fp8_scaled {label}", run)


def int4(ctx) -> None:
    from kernel_parity.kernels.triton import gemm_int4 as I
    from kernel_parity.refimpl import quant_fp
    torch = ctx.torch
    g = 128
    for si, (n, k) in enumerate(ctx.prefill_shapes):
        packs = {}
        for order in ("gptq", "awq"):
            qshape = (k // 8, n) if order == "gptq" else (k, n // 8)
            qw = torch.randint(-2**31, 2**31 - 1, qshape, dtype=torch.int32, device=ctx.dev, generator=ctx.gen)
            qz = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), dtype=torch.int32, device=ctx.dev,
                               generator=ctx.gen)
            s = (torch.rand((k // g, n), device=ctx.dev, generator=ctx.gen) * 2e-3 + 1e-4).half()
            cols = CHECK_COLS if order == "gptq" else CHECK_COLS // 8
            part = {"qweight": qw[:, :cols].cpu().numpy(), "qzeros": qz[:, :CHECK_COLS // 8].cpu().numpy(),
                    "scales": s[:, :CHECK_COLS].cpu().numpy()}
            packs[order] = (qw, qz, s, torch.from_numpy(quant_fp.int4_dequantize(part, order)).to(ctx.dev))
        nbytes = n * k // 2 + 2 * n * (k // g) + n * (k // g) // 2
        for m in (ctx.prefill_m, 1):
            a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            flops = 2 * m * n * k
            if m > 1:
                wd = torch.randn((n, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                t_ref = ctx.bench(lambda: a @ wd.T)
                del wd
            for order, (qw, qz, s, w64) in packs.items():
                # (path, config): the launcher's path (the dequant path at this M), the fused kernel's default,
                # then its sweep on the first shape
                sweep = [("auto", None)] + ([("fused", None)] + (
                    [("fused", c) for c in INT4_SWEEP] if si == 0 and not ctx.quick else []) if m > 1 else [])
                for i, (path, cfg) in enumerate(sweep):
                    if i and ctx.over_budget():
                        break

                    def run(cfg=cfg, path=path, order=order, qw=qw, qz=qz, s=s, w64=w64):
                        c = I.gemm_int4(a, qw, qz, s, group=g, order=order, config=cfg, path=path)
                        row = dict(order=order, path=path, shape=[m, n, k], config=cfg,
                                   **check_slice(ctx, c, a, w64, "bf16"))
                        ms = ctx.bench(lambda: I.gemm_int4(a, qw, qz, s, group=g, order=order, out=c, config=cfg,
                                                           path=path))
                        row.update(ms=ms, TFLOPs=flops / ms / 1e9, GBps_weights=nbytes / ms / 1e6)
                        if m > 1:
                            row.update(torch_bf16_ms=t_ref, speed_vs_torch_bf16=t_ref / ms)
                        else:
                            row.update(pct_copy=100 * nbytes / ms / 1e6 / ctx.copy_gbps)
                        return row
                    ctx.entry("int4", f"{order} {path} {m}x{n}x{k} {cfg}", run)
        if si == len(ctx.prefill_shapes) - 1:  # the fused kernel against the dequant path by rows (GPTQ)
            qw, qz, s, w64 = packs["gptq"]
            for m in CROSSOVER_M if ctx.cuda else (17, 40):
                a = torch.randn((m, k), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                for path in ("fused", "dequant"):
                    def run(path=path, m=m, a=a):
                        c = I.gemm_int4(a, qw, qz, s, group=g, order="gptq", path=path)
                        row = dict(order="gptq", path=path, shape=[m, n, k], **check_slice(ctx, c, a, w64, "bf16"))
                        ms = ctx.bench(lambda: I.gemm_int4(a, qw, qz, s, group=g, order="gptq", out=c, path=path))
                        row.update(ms=ms, TFLOPs=2 * m * n * k / ms / 1e9)
                        return row
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
    lines = []
    from kernel_parity.kernels.triton import gemm_q8 as Q
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
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"kernel dump: {len(lines)} compiled variants -> {path}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.path.join(os.environ["OUT"], "gemm-bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output (default $OUT/gemm-bench.json)")
    p.add_argument("--quick", action="store_true", help="first config of each sweep only")
    p.add_argument("--budget-s", type=float, default=170.0, help="stop the sweeps after this many seconds")
    p.add_argument("--sections", default="gemv,q8,prefill,fp8,int4")
    p.add_argument("--formats", default="", help="GGML formats of the gemv / decode sweeps (default all)")
    p.add_argument("--q8-grid", action="store_true",
                   help="q8: sweep a grid of M = 1 configs first (the GEMV alone), then time the three fastest in full")
    p.add_argument("--dump", default="", help="write registers, spills and loop opcodes of the compiled kernels here")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    p.add_argument("--q8-m", default="", help="rows of A the q8 section runs, a comma list of 1, 4, 16 (default all)")
    args = p.parse_args()
    raw = args.q8_m
    try:
        args.q8_m = sorted({int(x) for x in raw.split(",") if x}) or [1, 4, 16]
    except ValueError:
        args.q8_m = [0]
    if not set(args.q8_m) <= {1, 4, 16}:
        p.error(f"--q8-m {raw!r}: expected a comma list of 1, 4, 16")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    return args


def main() -> int:
    args = parse_args()
    if args.smoke_cpu:
        from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment
        prepare_environment()
        why = interpreter_ready()
        if why:
            print(f"gpu_gemm --smoke-cpu: {why}", file=sys.stderr)
            return 2
    import torch

    cuda = torch.cuda.is_available() and not args.smoke_cpu
    if not cuda and not args.smoke_cpu:
        print("gpu_gemm: no CUDA device; this benchmark runs on a GPU (--smoke-cpu checks the script)", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

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
        matmul_bf16_TFLOPs=mm_tflops,
        matmul_size=n, do_bench=bench_kw, limits=LIMITS, check_cols=CHECK_COLS,
        configs=dict(gemv=V.GEMV_CONFIGS, decode=V.DECODE_CONFIGS, prefill=G.PREFILL_CONFIGS,
                     fp8=F.GEMM_CONFIG, int4=(I.DECODE_CONFIG, I.PREFILL_CONFIG)),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    print(f"{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    ctx = Ctx(torch=torch, dev=dev, gen=gen, cuda=cuda, bench=bench, copy_gbps=copy_gbps, read_gbps=read_gbps,
              mm_tflops=mm_tflops,
              quick=args.quick or not cuda, t0=t0, budget_s=args.budget_s, out=args.out, header=header,
              results=[], errors=[], l2=(header["l2_bytes"] or 50 * MIB),
              gemv_shapes=[(14336, 4096), (4096, 14336)] if cuda else [(40, 512)],
              prefill_shapes=[(4096, 4096), (14336, 4096)] if cuda else [(40, 512)],
              prefill_m=4096 if cuda else 33, fp8_size=8192 if cuda else 256,
              formats=[f for f in args.formats.split(",") if f], q8_grid=args.q8_grid, q8_best={}, q8_m=args.q8_m)
    sections = {"gemv": gemv, "q8": q8, "prefill": prefill, "fp8": fp8, "int4": int4}
    for name in args.sections.split(","):  # in the order given
        fn = sections[name]
        t = time.time()
        try:
            fn(ctx)
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
        print(f"{r['section']:8s} {r['name'][:58]:58s} {r.get('ms', float('nan')):9.4f} ms {rate:>20s} "
              f"err {r.get('err_acc', float('nan')):8.1e} {'' if r.get('ok', True) else 'WRONG'}")
    wrong = [r["name"] for r in ctx.results if r.get("ok") is False]
    if wrong or ctx.errors:
        print(f"\n{len(wrong)} wrong result(s), {len(ctx.errors)} error(s):", *wrong,
              *[f"{e['section']}/{e.get('name', '')}: {e['error']}" for e in ctx.errors], sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
