"""--tune of benchmarks/gpu_mla.py: the Triton MLA decode kernels timed by hand against FlashMLA's formulas
and published figures, config and split sweeps, torch SDPA beside them, each timed row judged by the gate.

    python benchmarks/gpu_mla.py --tune [--quick] [--sections configs,sdpa,sparse,fused] [--out PATH]
    python benchmarks/gpu_mla.py --smoke-cpu [--out PATH]          # --tune at tiny shapes, no GPU

The flags are gpu_mla.py's; its main() checks them, then imports this module on the --tune / --smoke-cpu
path alone and calls tune(args, sections).

--tune times the kernels directly (conformance/bench.py's time_call: do_bench's median), with
FlashMLA's formulas: bytes = (sum seqlens x 576 + b s_q h_q (576 + 512)) x 2 as % of the copy ceiling
and of FlashMLA's 3000 GB/s, FLOPs = 2 s_q h_q sum seqlens (576 + 512) as % of the matmul ceiling and
of FlashMLA's 660 TFLOP/s (the ceilings measured as parity bench measures them); every request holds
L tokens (pages of 64 on a shuffled table). Sections (--sections, default all):
- configs: config sweeps (kernels.triton.mla.MlaConfig) per row class at b=128 over 8192 tokens, the
  launcher's table entry first, then the fastest config per class that the gate passed (what
  MLA_CONFIGS should hold); past --tune-budget seconds only the table entries run. Then splits at
  (s_q, h_q) = (1, 16): 1, 2, 4 a request and FlashMLA's scheduler (refimpl/mla_schedule.py).
- sdpa: ours beside torch SDPA (efficient, math) at the default decode shapes, on a materialised
  cache with the MQA head folded into the query length (q (b, 1, s_q h_q, 576), K (b, 1, L, 576),
  V (b, 1, L, 512), a bottom-right mask for s_q = 2): SDPA has no paged form, no backend of mla.*.
- sparse: decode_sparse at the default shapes, its bytes and FLOPs those of the 2048 listed rows.
- fused: mla_decode_fused_fp8's attention configs (mla_fused.ATTEND_CONFIG; --fused-configs N) at two
  shapes, then the fused branch at the default shapes beside the plain mla_decode of its attention
  (what RoPE + RMSNorm + two FP8 bmms add). Eager torch's time is the default path's peer.
Each timed line gives the gate's verdict and norm_err for a case of the same op run the same way
(bench_cases.Gate on the triton backend, the swept config, split count or schedule in place while the
gate runs) at b=16 with the line's other params (the same launch-table entry; a smaller batch, so
the float64 golden takes seconds); a case the gate fails, or a section that raises, makes the exit
status 1. --tune --quick: fewer shapes in every section, the first four fused configs.
--smoke-cpu runs --tune at tiny shapes in the Triton interpreter on a machine without a GPU: a crash
check of this script before a GPU run (the kernels' own check there is `parity run --suite ci --op mla`).
Results: --out (default $OUT/mla-bench.json, else ./mla-bench.json): the document (header, ceilings, rows,
best_configs, gate_failures, errors), rewritten after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback

from bench_cases import replaced
from gpu_mla import (B, FUSED_HEADS, FUSED_TOKENS, HEADS, SPARSE_HEADS, SPARSE_TOKENS, TOKENS, TOPK, _decode,
                     _fused, _sparse)

D, D_V, PAGE = 576, 512, 64
SCALE = D ** -0.5  # the ops' scale "head"
FLASHMLA_GBPS, FLASHMLA_TFLOPS = 3000.0, 660.0  # FlashMLA's published H800 figures
# Alternatives per row class (the launcher's MLA_CONFIGS entry always runs first): tiles in flight
# (num_stages - 1) x tile length, orientation, V loaded twice. Some may not fit shared memory (a
# (64, 576) bf16 tile is 72 KB): they are recorded as errors.
SWEEP = {
    16: [(16, 64, 4, 2, True, True), (16, 32, 4, 3, True, True), (16, 32, 4, 4, True, False),
         (16, 32, 4, 4, False, True), (16, 32, 4, 5, True, True)],
    32: [(32, 32, 4, 4, True, True), (32, 64, 4, 2, True, True), (32, 32, 8, 3, True, True),
         (32, 32, 4, 3, False, True)],
    64: [(64, 64, 8, 2, False, True), (64, 32, 8, 2, False, True), (64, 32, 8, 3, True, True),
         (64, 32, 8, 3, False, False), (64, 64, 8, 2, True, True)],
}
FUSED_SWEEP = [(32, 16, 8, 2, "ieee"), (16, 32, 4, 2, "split3"), (16, 64, 4, 2, "split3"), (16, 16, 4, 2, "split3"),
               (32, 32, 4, 2, "split3"), (32, 32, 8, 2, "split3"), (16, 32, 4, 3, "split3"), (32, 64, 8, 2, "split3"),
               (64, 32, 8, 2, "split3"), (64, 16, 8, 2, "split3"), (16, 32, 8, 2, "split3")]
# --tune's sizes: b, the gate's batch, the sweeps' shapes ((s_q, h_q) or (h_q, L)) and configs
FULL = dict(b=B, gate_b=16, tune_L=8192, tune_shapes=((1, 16), (1, 32), (1, 64), (1, 128)), sweep=SWEEP,
            sdpa_L=TOKENS, sdpa_shapes=tuple((sq, hq) for sq in (1, 2) for hq in HEADS), sparse_L=SPARSE_TOKENS,
            sparse_h=SPARSE_HEADS, topk=TOPK, fused=tuple((hq, L) for L in FUSED_TOKENS for hq in FUSED_HEADS),
            fused_tune=((128, 4096), (16, 16384)), fused_sweep=FUSED_SWEEP)
QUICK = {**FULL, "tune_shapes": ((1, 16), (1, 128)), "sdpa_L": (4096,), "sparse_h": (64,),
         "fused": ((16, 4096), (128, 4096)), "fused_tune": ((128, 4096),), "fused_sweep": FUSED_SWEEP[:4]}
SMOKE = dict(b=2, gate_b=2, tune_L=128, tune_shapes=((1, 16), (1, 32)),
             sweep={16: SWEEP[16][:1], 32: SWEEP[32][:1], 64: []}, sdpa_L=(128,), sdpa_shapes=((1, 2), (2, 16)),
             sparse_L=64, sparse_h=(16,), topk=32, fused=((2, 64),), fused_tune=((2, 64),), fused_sweep=FUSED_SWEEP[:2])


def tune(args: argparse.Namespace, sections: list[str]) -> int:
    """--tune and --smoke-cpu (gpu_mla.main, its flags checked): this run's sizes, then Tune's sections."""
    size = SMOKE if args.smoke_cpu else QUICK if args.quick else FULL
    if args.fused_configs is not None:
        size = {**size, "fused_sweep": size["fused_sweep"][:args.fused_configs]}
    return Tune(args, size).run(sections)


def flashmla_cost(b: int, s_q: int, h_q: int, tokens: int) -> tuple[int, float]:
    """FlashMLA's (bytes, FLOPs) of a decode over `tokens` cached rows: the rows, q and o; both matmuls."""
    return (tokens * D + b * s_q * h_q * (D + D_V)) * 2, 2.0 * s_q * h_q * tokens * (D + D_V)


def row_class(rows: int) -> int:
    return min(64, max(16, 1 << (rows - 1).bit_length()))


class Tune:
    """The direct measurement (module docstring, --tune): each section's rows, each with the gate's verdict."""

    def __init__(self, args: argparse.Namespace, size: dict) -> None:
        import torch
        import triton

        from bench_cases import Gate

        from kernel_parity.conformance.bench import measure_ceilings, time_call
        from kernel_parity.kernels.triton import mla as M
        from kernel_parity.kernels.triton import mla_fused as F

        self.torch, self.M, self.F, self.args, self.size = torch, M, F, args, size
        self.dev = torch.device("cpu" if args.smoke_cpu else "cuda")
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        self.time = lambda fn: time_call(fn, self.dev)
        self.ceil = measure_ceilings(str(self.dev), quick=args.quick or args.smoke_cpu)
        cuda = self.dev.type == "cuda"
        self.sm_count = torch.cuda.get_device_properties(self.dev).multi_processor_count if cuda else 1
        self.gate = Gate("triton")
        header = dict(device=self.ceil.device, torch=torch.__version__, triton=triton.__version__,
                      time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      command=" ".join(["benchmarks/gpu_mla.py", *sys.argv[1:]]),
                      sm_count=self.sm_count, mla_configs={str(k): tuple(v) for k, v in M.MLA_CONFIGS.items()},
                      fused_attend_config=F.ATTEND_CONFIG)
        self.doc = dict(header=header, ceilings=self.ceil.to_json(), rows=[], best_configs={},
                        gate_failures=self.gate.failures, errors=[])
        print(f"{self.ceil.device}  copy {self.ceil.copy_gbps:.0f} GB/s  {self.ceil.matmul_dtype} matmul "
              f"{self.ceil.matmul_tflops:.3g} TFLOP/s", flush=True)

    def run(self, sections: list[str]) -> int:
        for name in sections:
            t0 = time.time()
            try:
                getattr(self, name)()
            except Exception as e:  # keep what the other sections measure
                self.doc["errors"].append(f"section {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}"[:3000])
                print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
            if self.dev.type == "cuda":
                self.torch.cuda.empty_cache()
        self.save()
        for f in self.gate.failures:
            print("GATE FAIL", f, flush=True)
        for e in self.doc["errors"]:
            print("ERROR", e.splitlines()[0], flush=True)
        return 1 if self.gate.failures or self.doc["errors"] else 0

    # -- helpers ------------------------------------------------------------------------
    def save(self) -> None:
        from kernel_parity.reports.files import write_text

        write_text(self.args.out, json.dumps(self.doc, indent=1, default=str))  # atomically: a crash keeps the last

    def rnd(self, *shape):
        return self.torch.randn(shape, device=self.dev, generator=self.gen).to(self.torch.bfloat16)

    def rates(self, ms: float, cost: tuple[int, float]) -> dict:
        """ms, (bytes, FLOPs) -> the figures against this run's ceilings and FlashMLA's published ones."""
        nbytes, flops = cost
        gbps, tflops = nbytes / ms / 1e6, flops / ms / 1e9
        return dict(ms=ms, bytes=nbytes, flops=flops, gbps=gbps, pct_copy=100 * gbps / self.ceil.copy_gbps,
                    pct_3000=100 * gbps / FLASHMLA_GBPS, tflops=tflops,
                    pct_matmul=100 * tflops / self.ceil.matmul_tflops, pct_660=100 * tflops / FLASHMLA_TFLOPS)

    def timed(self, name: str, info: dict, call, figs, judged, sweep: bool = False) -> dict:
        """Time call(); figs(ms) -> figures; judged = (op, params, context in which the gate's case runs).
        An exception is an error row (a failure of the run unless `sweep`: a config that does not fit)."""
        try:
            ms = self.time(call)
        except Exception as e:
            row = dict(name=name, **info, error=f"{type(e).__name__}: {e}"[:300])
            if not sweep:
                self.doc["errors"].append(f"{name} {info}: {row['error']}")
            return self.record(row, f"{name} {info}: {row['error']}")
        from bench_cases import gate_text

        op, params, ctx = judged
        with ctx:
            verdict = self.gate(op, "bf16", params)
        row = dict(name=name, **info, **figs(ms), gate=verdict)
        what = " ".join([name] + [f"{k}={v}" for k, v in info.items()])
        return self.record(row, f"{what}: {self.text(row)}  {gate_text(verdict)}")

    def text(self, r: dict) -> str:
        return (f"{r['ms']:.4f} ms {r['gbps']:.0f} GB/s {r['pct_copy']:.1f}% of copy ({r['pct_3000']:.1f}% of 3000)  "
                f"{r['tflops']:.1f} TFLOP/s {r['pct_matmul']:.1f}% of matmul ({r['pct_660']:.1f}% of 660)")

    def record(self, row: dict, line: str) -> dict:
        self.doc["rows"].append(row)
        print(line, flush=True)
        self.save()
        return row

    def big_cache(self, b: int, L: int):
        """(b L / 64 pages, 64, 1, 576) bf16 on a shuffled table, every request L tokens."""
        torch = self.torch
        n = b * L // PAGE
        cache = self.rnd(n, PAGE, 1, D)
        table = torch.randperm(n, device=self.dev, generator=self.gen).to(torch.int32).view(b, L // PAGE)
        return cache, table, torch.full((b,), L, dtype=torch.int32, device=self.dev)

    def scheduled(self, decode):
        """mla_decode with FlashMLA's split schedule of its own seqlens (read to the host: the gate's run)."""
        def call(q, kv_cache, block_table, seqlens, scale, *a, **kw):
            s_q, h_q = q.shape[1], q.shape[2]
            return decode(q, kv_cache, block_table, seqlens, scale, *a, **kw,
                          splits=self.schedule(seqlens.cpu().numpy(), s_q, h_q)[1])
        return call

    def schedule(self, lens, s_q: int, h_q: int):
        """(SM parts, mla_decode's splits) of FlashMLA's scheduler for these lengths."""
        from kernel_parity.refimpl import mla_schedule as S

        parts = max(1, S.sm_parts(self.sm_count, s_q, h_q))
        return parts, self.M.mla_splits(S.partitions(*S.schedule(lens, s_q, h_q, parts), lens), device=self.dev)

    # -- sections -----------------------------------------------------------------------
    def configs(self) -> None:
        """The config sweep per row class, the best passing config of each, then the split sweep."""
        import numpy as np

        M, torch = self.M, self.torch
        b, L, gb = self.size["b"], self.size["tune_L"], self.size["gate_b"]
        cache, table, sl = self.big_cache(b, L)
        t0 = time.time()
        totals: dict = {}  # (class, config) -> [shapes, ms] over configs the gate passed
        for s_q, h_q in self.size["tune_shapes"]:
            cls = row_class(s_q * h_q)
            q = self.rnd(b, s_q, h_q, D)
            o = torch.empty((b, s_q, h_q, D_V), dtype=q.dtype, device=self.dev)
            lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=self.dev)
            default = tuple(M.MLA_CONFIGS[(cls, 2)])
            for k, cfg in enumerate([default] + [c for c in self.size["sweep"][cls] if c != default]):
                if k and time.time() - t0 > self.args.tune_budget:  # past the budget only the table runs
                    self.record(dict(name="config", skipped=f"{cfg} at s_q={s_q} h_q={h_q}"),
                                f"config {cfg} at s_q={s_q} h_q={h_q}: skipped (past --tune-budget)")
                    continue
                entry = {**M.MLA_CONFIGS, (cls, 2): M.MlaConfig(*cfg)}
                row = self.timed(f"config b={b} s_q={s_q} h_q={h_q} L={L}", dict(config=cfg),
                                 lambda: M.mla_decode(q, cache, table, sl, SCALE, out=o, out_lse=lse, config=cfg),
                                 lambda ms: self.rates(ms, flashmla_cost(b, s_q, h_q, b * L)),
                                 ("mla.decode", _decode(gb, s_q, h_q, L), replaced(M, "MLA_CONFIGS", entry)), True)
                if row.get("gate", {}).get("verdict") == "pass":
                    t = totals.setdefault((cls, tuple(cfg)), [0, 0.0])
                    t[0], t[1] = t[0] + 1, t[1] + row["ms"]
        for cls in sorted({row_class(s * h) for s, h in self.size["tune_shapes"]}):
            n = sum(1 for s, h in self.size["tune_shapes"] if row_class(s * h) == cls)
            full = {c: t for (k, c), (m, t) in totals.items() if k == cls and m == n}
            if full:
                self.doc["best_configs"][str(cls)] = min(full, key=full.get)
        print(f"best configs (fastest the gate passed, per row class): {self.doc['best_configs']}", flush=True)
        # Splits at one memory-bound shape: 1, 2, 4 a request, and FlashMLA's own scheduler
        s_q, h_q = self.size["tune_shapes"][0]
        q = self.rnd(b, s_q, h_q, D)
        parts, flashmla = self.schedule(np.full(b, L), s_q, h_q)
        forms = [(str(n), dict(num_splits=n), replaced(M, "_auto_splits", lambda *a, n=n: n)) for n in (1, 2, 4)]
        forms.append((f"FlashMLA schedule, {parts} parts", dict(splits=flashmla),
                      replaced(M, "mla_decode", self.scheduled(M.mla_decode))))
        for label, kw, ctx in forms:
            self.timed(f"splits b={b} s_q={s_q} h_q={h_q} L={L}", dict(splits=label),
                       lambda: M.mla_decode(q, cache, table, sl, SCALE, **kw),
                       lambda ms: self.rates(ms, flashmla_cost(b, s_q, h_q, b * L)),
                       ("mla.decode", _decode(gb, s_q, h_q, L), ctx))

    def sdpa(self) -> None:
        """Ours (the launcher's table) beside torch SDPA per backend at every default decode shape."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        M, torch = self.M, self.torch
        b, gb = self.size["b"], self.size["gate_b"]
        for L in self.size["sdpa_L"]:
            cache, table, sl = self.big_cache(b, L)
            dense = cache[table.long()].reshape(b, 1, L, D)
            v = dense[..., :D_V].contiguous()
            for s_q, h_q in self.size["sdpa_shapes"]:
                q = self.rnd(b, s_q, h_q, D)
                qs = q.reshape(b, 1, s_q * h_q, D)
                mask = None
                if s_q > 1:  # row (i, head) sees keys j <= L - s_q + i
                    qi = torch.arange(s_q, device=self.dev).repeat_interleave(h_q)
                    mask = torch.arange(L, device=self.dev)[None, :] <= (L - s_q + qi)[:, None]
                peers: dict = {}
                for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
                    def fn(qs=qs, mask=mask):
                        return torch.nn.functional.scaled_dot_product_attention(qs, dense, v, attn_mask=mask,
                                                                                scale=SCALE)
                    try:
                        with sdpa_kernel(be):
                            fn()
                            peers[name] = self.time(fn)
                    except Exception as e:  # this SDPA backend cannot take the shape here
                        peers[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

                def figs(ms, peers=peers):
                    live = {k: t for k, t in peers.items() if isinstance(t, float)}
                    return {**self.rates(ms, flashmla_cost(b, s_q, h_q, b * L)), "sdpa_ms": peers,
                            "sdpa_ms_over_ours": {k: t / ms for k, t in live.items()}}

                row = self.timed(f"sdpa b={b} s_q={s_q} h_q={h_q} L={L}", {},
                                 lambda: M.mla_decode(q, cache, table, sl, SCALE, causal=s_q > 1), figs,
                                 ("mla.decode", _decode(gb, s_q, h_q, L), contextlib.nullcontext()))
                ratios = [f"{k} {r:.2f}x" for k, r in row.get("sdpa_ms_over_ours", {}).items()]
                print("  SDPA ms / ours: " + (", ".join(ratios) or "-")
                      + "".join(f"  ({k}: {t})" for k, t in peers.items() if not isinstance(t, float)), flush=True)
            del cache, table, dense, v

    def sparse(self) -> None:
        """decode_sparse, s_q = 1: each request's top-k slots drawn among its own L tokens."""
        from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse

        torch = self.torch
        b, L, k, gb = self.size["b"], self.size["sparse_L"], self.size["topk"], self.size["gate_b"]
        cache, table, _ = self.big_cache(b, L)
        for h_q in self.size["sparse_h"]:
            tok = torch.randint(L, (b, 1, k), device=self.dev, generator=self.gen)
            page = table.long().gather(1, (tok // PAGE).view(b, -1)).view(b, 1, -1)
            idx = (page * PAGE + tok % PAGE).to(torch.int32)
            q = self.rnd(b, 1, h_q, D)
            self.timed(f"sparse b={b} s_q=1 h_q={h_q} topk={k} of L={L}", {},
                       lambda: mla_decode_sparse(q, cache, idx, None, SCALE),
                       lambda ms: self.rates(ms, flashmla_cost(b, 1, h_q, b * k)),
                       ("mla.decode_sparse", _sparse(gb, h_q, L, k), contextlib.nullcontext()))

    def fused_inputs(self, b: int, h_q: int, L: int) -> tuple[list, object]:
        """mla_decode_fused_fp8's positional arguments at DeepSeek-V3's shapes (dn 128, d_r 64, d_c 512,
        v 128), one new token a request at position L - 1; and the seqlens (L) of its attention."""
        torch, dev, gen = self.torch, self.dev, self.gen
        cache, table, sl = self.big_cache(b, L)
        dn, d_r, d_c, dv = 128, D - D_V, D_V, 128
        ang = torch.arange(L, device=dev, dtype=torch.float64)[:, None] * \
            10000.0 ** (-torch.arange(0, d_r, 2, device=dev, dtype=torch.float64) / d_r)
        fp8 = lambda *s: (0.05 * torch.randn(s, device=dev, generator=gen) * 448).to(torch.float8_e4m3fn)  # noqa: E731
        args = [self.rnd(b, h_q, dn + d_r), torch.arange(b + 1, device=dev, dtype=torch.int32),
                torch.stack([ang.cos(), ang.sin()], -1).reshape(L, d_r).float(),
                1 + 0.1 * torch.randn(d_c, device=dev, generator=gen), 1e-6,
                fp8(h_q, d_c, dn), torch.full((h_q, d_c // 128, dn // 128), 1 / 448, device=dev),
                fp8(h_q, dv, d_c), torch.full((h_q, dv // 128, d_c // 128), 1 / 448, device=dev),
                cache, table, sl - 1, 192 ** -0.5]
        return args, sl

    def fused_cost(self, args: list, b: int, h_q: int, L: int) -> tuple[int, float]:
        """(bytes, FLOPs) of the fused branch: the cache rows, the FP8 weights and their scales, q and out;
        the attention's FLOPs and the two bmms'."""
        w_bytes = 2 * h_q * D_V * 128 + 4 * (args[6].numel() + args[8].numel())
        return (b * L * D * 2 + w_bytes + b * h_q * (192 + 128) * 2,
                2.0 * h_q * b * L * (D + D_V) + 2 * 2 * b * h_q * 128 * D_V)

    def fused(self) -> None:
        """The attention-config sweep of the fused branch, then the branch beside the plain mla_decode."""
        M, F, torch = self.M, self.F, self.torch
        b, gb, sweep = self.size["b"], self.size["gate_b"], self.size["fused_sweep"]
        totals: dict = {}  # config -> [shapes, ms] over the split3 configs the gate passed
        for h_q, L in self.size["fused_tune"] if sweep else ():
            args, _ = self.fused_inputs(b, h_q, L)
            out = torch.empty((b, h_q, 128), dtype=torch.bfloat16, device=self.dev)
            cost = self.fused_cost(args, b, h_q, L)
            for cfg in sweep:
                # the new rows are re-normalised on every timed call: idempotent up to rounding
                with replaced(F, "ATTEND_CONFIG", cfg):
                    row = self.timed(f"fused config b={b} h_q={h_q} L={L}", dict(config=cfg),
                                     lambda: F.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1),
                                     lambda ms: self.rates(ms, cost),
                                     ("mla.decode_fused_fp8", _fused(gb, h_q, L - 1), contextlib.nullcontext()), True)
                if row.get("gate", {}).get("verdict") == "pass" and cfg[4] != "ieee":
                    t = totals.setdefault(cfg, [0, 0.0])
                    t[0], t[1] = t[0] + 1, t[1] + row["ms"]
            del args, out
        full = {c: t for c, (n, t) in totals.items() if n == len(self.size["fused_tune"])}
        if full:
            self.doc["best_configs"]["fused"] = min(full, key=full.get)
            print(f"best fused attention config (fastest the gate passed): {self.doc['best_configs']['fused']}",
                  flush=True)
        for h_q, L in self.size["fused"]:
            args, sl = self.fused_inputs(b, h_q, L)
            out = torch.empty((b, h_q, 128), dtype=torch.bfloat16, device=self.dev)
            q_abs = self.rnd(b, 1, h_q, D)
            attn = self.time(lambda: M.mla_decode(q_abs, args[9], args[10], sl, args[12]))
            cost = self.fused_cost(args, b, h_q, L)
            self.timed(f"fused b={b} new=1 h_q={h_q} L={L}", dict(config=F.ATTEND_CONFIG),
                       lambda: F.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1),
                       lambda ms: {**self.rates(ms, cost), "mla_decode_ms": attn, "fused_overhead": ms / attn - 1},
                       ("mla.decode_fused_fp8", _fused(gb, h_q, L - 1), contextlib.nullcontext()))
            print(f"  the plain mla_decode of its attention: {attn:.4f} ms", flush=True)
            del args, out
