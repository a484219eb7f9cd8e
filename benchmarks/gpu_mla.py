"""GPU benchmark of the Triton MLA decode kernels (kernels/triton/mla.py, mla_sparse.py) on Hopper.

    python benchmarks/gpu_mla.py --out $OUT/mla-bench.json    (an H100: < 4 minutes)
    python benchmarks/gpu_mla.py --smoke-cpu                   (no GPU: tiny shapes in the Triton interpreter)

1. Header: this run's device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate.
2. parity: small bf16 cases (which the interpreter cannot check) against a float64 torch reference
   of refimpl.mla's formula: seqlens 0 / 1 / 65 / 200, (s_q, h_q) = (1, 16), (2, 16), (2, 64) (two
   row blocks, causal), auto / uniform / explicit (mla_schedule) splits, NaN past seqlens and in
   unused pages; sparse with -1 padding and topk_length, h_q 16 and 128.
3. tune: config sweeps (kernels.triton.mla.MlaConfig) per row class at b=128, 8192 tokens, and a
   split sweep at one memory-bound shape (1, 2, 4 splits, FlashMLA's scheduler); the bench then
   uses each class's fastest config. Past --tune-budget seconds only the defaults run.
4. bench: b=128, s_q in {1, 2}, h_q in {16, 32, 64, 128}, 4096 / 8192 / 16384 cached tokens a
   request (bf16, pages of 64 on a shuffled table), timed by triton.testing.do_bench (median; the
   caches are >= 600 MB, far past L2, which do_bench also flushes). Figures with FlashMLA's
   formulas: bytes = (sum seqlens x 576 + b s_q h_q (576 + 512)) x 2, as % of the copy bandwidth
   and of FlashMLA's 3000 GB/s; FLOPs = 2 s_q h_q sum seqlens (576 + 512), as % of the matmul rate
   and of FlashMLA's 660 TFLOP/s. Each timed output is checked once (requests 0 and 1) against a
   float64 reference: max |error| and FlashMLA's cos_diff. Peer: torch SDPA (efficient, math) on
   a materialised cache with the MQA head folded into the query length (q (b, 1, s_q h_q, 576),
   K (b, 1, L, 576), V (b, 1, L, 512), a bottom-right mask for s_q = 2). Plus sparse decode
   (top-2048 of 8192) at h_q = 64 and 128.
5. fused: mla_decode_fused_fp8 (kernels/triton/mla_fused.py, MAX's FP8 decode branch) at DeepSeek-V3's
   shapes (b = 128, one new token a request, h_q in {16, 128}, 4096 / 16384 cached tokens), beside
   the plain mla_decode of the same attention (what the RoPE + RMSNorm + two FP8 bmms add) and the
   eager torch branch (kernels/torch/mla.py, the declared baseline). Bytes = the cache rows read
   (576 x 2 per token) + FP8 weights + q and out; FLOPs = the attention's + the two bmms'. The new
   rows are re-normalised on every timed call (idempotent up to rounding): the timing is unaffected.
Every entry is guarded: a failure is recorded and the run goes on. JSON (--out) is rewritten after
each section; the table prints last. Exit 1 if any parity check or section failed.
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
D, D_V, PAGE = 576, 512, 64
FLASHMLA_GBPS, FLASHMLA_TFLOPS = 3000.0, 660.0  # FlashMLA's published H800 figures
LIMITS = dict(o=3e-2, lse=1e-3, cos=1e-5)  # bf16 O against float64 (P and O rounded to bf16)
# Alternatives per row class (the launcher's MLA_CONFIGS entry always runs first): tiles in
# flight (num_stages - 1) x tile length, orientation, V loaded twice. Some may not fit shared
# memory (a (64, 576) bf16 tile is 72 KB): they are recorded as errors.
SWEEP = {
    16: [(16, 64, 4, 2, True, True), (16, 32, 4, 3, True, True), (16, 32, 4, 4, True, False),
         (16, 32, 4, 4, False, True), (16, 32, 4, 5, True, True)],
    32: [(32, 32, 4, 4, True, True), (32, 64, 4, 2, True, True), (32, 32, 8, 3, True, True),
         (32, 32, 4, 3, False, True)],
    64: [(64, 64, 8, 2, False, True), (64, 32, 8, 2, False, True), (64, 32, 8, 3, True, True),
         (64, 32, 8, 3, False, False), (64, 64, 8, 2, True, True)],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.path.join(os.environ["OUT"], "mla-bench.json") if os.environ.get("OUT") else None
    p.add_argument("--out", default=default_out, help="JSON output path (default $OUT/mla-bench.json)")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny shapes in the Triton interpreter (no GPU)")
    p.add_argument("--sections", default="parity,tune,bench,fused", help="comma list of parity, tune, bench, fused")
    p.add_argument("--tune-budget", type=float, default=100.0, help="seconds after which tune stops")
    p.add_argument("--fused-configs", type=int, default=None, metavar="N",
                   help="tune the fused branch over the first N configs of FUSED_SWEEP (default all; 0: only "
                        "mla_fused.ATTEND_CONFIG, no tuning)")
    args = p.parse_args()
    if args.fused_configs is not None and args.fused_configs < 0:
        p.error(f"--fused-configs {args.fused_configs}: expected a count >= 0")
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    return args


def ref64(torch, q, keys, scale, causal):
    """float64 MLA of one request. q: (s_q, h_q, d); keys: (L, d) -> o (s_q, h_q, d_v), lse (h_q, s_q)."""
    q, keys = q.double(), keys.double()
    s_q, L = q.shape[0], keys.shape[0]
    s = scale * torch.einsum("qhd,ld->qhl", q, keys)  # s_q, h_q, L
    if causal:
        keep = torch.arange(L, device=q.device)[None, :] <= (L - s_q + torch.arange(s_q, device=q.device))[:, None]
        s = s.masked_fill(~keep[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ keys[:, :D_V], lse.T


def gather(torch, cache, table, i, L):
    t = torch.arange(L, device=cache.device)
    return cache[table[i, t // cache.shape[1]].long(), t % cache.shape[1], 0]


def compare(ctx, name, pairs) -> dict:
    """pairs: (got o, got lse, expected o, expected lse); max errors, cos_diff, -inf/NaN patterns."""
    torch = ctx.torch
    eo = el = 0.0
    num = den = 0.0
    bad = []
    for o, lse, o_r, lse_r in pairs:
        o, lse = o.double().to(o_r.device), lse.double().to(o_r.device)
        if bool(torch.isnan(o).any()) or not torch.equal(torch.isneginf(lse), torch.isneginf(lse_r)):
            bad.append("NaN or -inf pattern differs")
        fin = torch.isfinite(lse_r)
        eo = max(eo, float((o - o_r).abs().max()) if o.numel() else 0.0)
        el = max(el, float((lse[fin] - lse_r[fin]).abs().max()) if bool(fin.any()) else 0.0)
        num, den = num + float((o * o_r).sum()), den + float((o * o + o_r * o_r).sum())
    cos = 1 - 2 * num / max(den, 1e-12)  # FlashMLA's cal_diff
    for what, val in (("o", eo), ("lse", el), ("cos", cos)):
        if not abs(val) <= LIMITS[what]:
            bad.append(f"{what}: {val:.3g} > {LIMITS[what]:.3g}")
    row = dict(case=name, max_err_o=eo, max_err_lse=el, cos_diff=cos, ok=not bad)
    ctx.state["parity"].append(row)
    if bad:
        ctx.state["failures"].append(f"{name}: " + "; ".join(bad))
        print("PARITY FAIL", ctx.state["failures"][-1], file=sys.stderr, flush=True)
    return row


def paged(ctx, b, seqlens, spare=2):
    """bf16 cache of shuffled pages (NaN past each seqlens and in spare pages), table, seqlens tensor."""
    torch = ctx.torch
    n = [math.ceil(L / PAGE) for L in seqlens]
    total = sum(n) + spare
    cache = torch.randn((total, PAGE, 1, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    perm = torch.randperm(total, device=ctx.dev, generator=ctx.gen).to(torch.int32)
    table = torch.full((b, max(n + [1]) + 1), 2147480000, dtype=torch.int32, device=ctx.dev)
    at = 0
    for i, (L, k) in enumerate(zip(seqlens, n)):
        table[i, :k] = perm[at:at + k]
        at += k
        if L % PAGE:
            cache[perm[at - 1].long(), L % PAGE:] = math.nan
    cache[perm[at:].long()] = math.nan
    return cache, table, torch.tensor(seqlens, dtype=torch.int32, device=ctx.dev)


def check_dense(ctx, name, q, cache, table, sl, o, lse, scale, causal, reqs):
    torch = ctx.torch
    pairs = []
    for i in reqs:
        L = int(sl[i])
        o_r, lse_r = ref64(torch, q[i], gather(torch, cache, table, i, L), scale, causal)
        pairs.append((o[i], lse[i], o_r, lse_r))
    return compare(ctx, name, pairs)


def sparse_ref(ctx, q, cache, idx, tlen, scale, reqs):
    torch = ctx.torch
    flat = cache.view(-1, D)
    out = []
    for i in reqs:
        os_, ls_ = [], []
        for j in range(q.shape[1]):
            row = idx[i, j, : idx.shape[2] if tlen is None else int(tlen[i])]
            o_r, lse_r = ref64(torch, q[i, j:j + 1], flat[row[row >= 0].long()], scale, False)
            os_.append(o_r)
            ls_.append(lse_r)
        out.append((torch.cat(os_), torch.cat(ls_, dim=1)))
    return out


def parity(ctx) -> None:
    from kernel_parity.kernels.triton.mla import mla_decode, mla_schedule
    from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse
    torch = ctx.torch
    scale = 1 / math.sqrt(D)
    seqlens = [0, 1, 65, 200]
    cache, table, sl = paged(ctx, 4, seqlens)
    for s_q, h_q in ctx.parity_shapes:
        q = torch.randn((4, s_q, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        plan = mla_schedule(seqlens, 5, device=ctx.dev)
        for label, kw in (("auto", {}), ("splits=3", dict(num_splits=3)), ("mla_schedule", dict(splits=plan))):
            name = f"mla_decode s_q={s_q} h_q={h_q} seqlens={seqlens} {label}"
            try:
                o, lse = mla_decode(q, cache, table, sl, scale, out=torch.full((4, s_q, h_q, D_V), math.nan,
                                    dtype=q.dtype, device=ctx.dev), **kw)
                check_dense(ctx, name, q, cache, table, sl, o, lse, scale, True, range(4))
            except Exception as e:
                ctx.fail(name, e)
    rows = table.cpu().tolist()
    flat_live = [rows[i][t // PAGE] * PAGE + t % PAGE for i, L in enumerate(seqlens) for t in range(L)]
    for s_q, h_q, tl_list in ctx.parity_sparse:
        name = f"mla_decode_sparse s_q={s_q} h_q={h_q} topk=96 topk_length={tl_list}"
        try:
            pick = torch.randint(len(flat_live), (4, s_q, 96), device=ctx.dev, generator=ctx.gen)
            idx = torch.tensor(flat_live, dtype=torch.int32, device=ctx.dev)[pick]
            idx[torch.rand(idx.shape, device=ctx.dev, generator=ctx.gen) < 0.25] = -1
            tlen = None if tl_list is None else torch.tensor(tl_list, dtype=torch.int32, device=ctx.dev)
            q = torch.randn((4, s_q, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            for splits in (None, 3):
                o, lse = mla_decode_sparse(q, cache, idx, tlen, scale, num_splits=splits)
                refs = sparse_ref(ctx, q, cache, idx, tlen, scale, range(4))
                compare(ctx, f"{name} splits={splits}", [(o[i], lse[i], *refs[i]) for i in range(4)])
        except Exception as e:
            ctx.fail(name, e)


def big_cache(ctx, b, L):
    """(b L / 64 pages, 64, 1, 576) bf16 on a shuffled table, every request L tokens."""
    torch = ctx.torch
    n = b * L // PAGE
    cache = torch.randn((n, PAGE, 1, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    table = torch.randperm(n, device=ctx.dev, generator=ctx.gen).to(torch.int32).view(b, L // PAGE)
    return cache, table, torch.full((b,), L, dtype=torch.int32, device=ctx.dev)


def figures(ctx, b, s_q, h_q, tokens, ms) -> dict:
    nbytes = (tokens * D + b * s_q * h_q * (D + D_V)) * 2
    flops = 2 * s_q * h_q * tokens * (D + D_V)
    gbps, tflops = nbytes / ms / 1e6, flops / ms / 1e9
    return dict(ms=ms, bytes=nbytes, flops=flops, GBps=gbps, pct_copy=100 * gbps / ctx.copy_gbps,
                pct_3000=100 * gbps / FLASHMLA_GBPS, TFLOPs=tflops, pct_matmul=100 * tflops / ctx.mm_tflops,
                pct_660=100 * tflops / FLASHMLA_TFLOPS)


def row_class(rows: int) -> int:
    return min(64, max(16, 1 << (rows - 1).bit_length()))


def pick_best(ctx) -> None:
    """Per row class, the config with the least total time over the class's tuned shapes (only
    configs that ran correctly on all of them)."""
    for cls in {r["rows_class"] for r in ctx.state["tune"] if "rows_class" in r}:
        rows = [r for r in ctx.state["tune"] if r.get("rows_class") == cls]
        n_shapes = len({r["sweep"] for r in rows})
        total: dict = {}
        for r in rows:
            if "ms" in r and r["ok"]:
                n, t = total.get(tuple(r["config"]), (0, 0.0))
                total[tuple(r["config"])] = (n + 1, t + r["ms"])
        full = {c: t for c, (n, t) in total.items() if n == n_shapes}
        if full:
            ctx.best[cls] = min(full, key=full.get)


def tune(ctx) -> None:
    from kernel_parity.kernels.triton import mla as M
    torch = ctx.torch
    t0 = time.time()
    b, L = ctx.shape_b, ctx.tune_L
    cache, table, sl = big_cache(ctx, b, L)
    for (s_q, h_q) in ctx.tune_shapes:
        cls = row_class(s_q * h_q)
        q = torch.randn((b, s_q, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
        o = torch.empty((b, s_q, h_q, D_V), dtype=q.dtype, device=ctx.dev)
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=ctx.dev)
        default = tuple(M.MLA_CONFIGS[(cls, 2)])
        for k, cfg in enumerate([default] + [c for c in ctx.sweep[cls] if c != default]):
            if k and time.time() - t0 > ctx.tune_budget:  # past the budget only the defaults run
                ctx.state["notes"].append(f"tune budget {ctx.tune_budget:.0f} s: skipped {cfg} at h_q={h_q}")
                continue
            row = dict(sweep=f"b={b} s_q={s_q} h_q={h_q} L={L}", rows_class=cls, config=cfg)
            try:
                M.mla_decode(q, cache, table, sl, 1 / math.sqrt(D), out=o, out_lse=lse, config=cfg)
                err = check_dense(ctx, f"tune {row['sweep']} {cfg}", q, cache, table, sl, o, lse,
                                  1 / math.sqrt(D), True, (0,))
                ms = ctx.bench(lambda: M.mla_decode(q, cache, table, sl, 1 / math.sqrt(D), out=o, out_lse=lse,
                                                    config=cfg))
                row.update(figures(ctx, b, s_q, h_q, b * L, ms), ok=err["ok"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            ctx.state["tune"].append(row)
            print("tune", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        ctx.save()
    pick_best(ctx)
    # Splits at one memory-bound shape: 1, 2, 4 a request, and FlashMLA's own scheduler
    # (refimpl.mla.schedule with its num_sm_parts, as ranges) through mla_splits.
    import numpy as np

    from kernel_parity.refimpl import mla as R
    s_q, h_q = ctx.tune_shapes[0]
    q = torch.randn((b, s_q, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    lens = np.full(b, L)
    parts = max(1, R.sm_parts(ctx.sm_count, s_q, h_q))
    flashmla = M.mla_splits(R.partitions(*R.schedule(lens, s_q, h_q, parts), lens), device=ctx.dev)
    for label, kw in (("1", dict(num_splits=1)), ("2", dict(num_splits=2)), ("4", dict(num_splits=4)),
                      (f"FlashMLA schedule, {parts} parts", dict(splits=flashmla))):
        row = dict(sweep=f"splits b={b} s_q={s_q} h_q={h_q} L={L}", splits=label)
        try:
            cfg = ctx.best.get(row_class(s_q * h_q))
            ms = ctx.bench(lambda: M.mla_decode(q, cache, table, sl, 1 / math.sqrt(D), config=cfg, **kw))
            row.update(figures(ctx, b, s_q, h_q, b * L, ms))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        ctx.state["tune"].append(row)
        print("tune", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def sdpa_ms(ctx, q, dense, v_dense, s_q, h_q, scale) -> dict:
    """torch SDPA per backend on the materialised cache, MQA folded into the query length."""
    torch = ctx.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, L = dense.shape[:2]
    qs = q.reshape(b, 1, s_q * h_q, D)
    k, v = dense.unsqueeze(1), v_dense.unsqueeze(1)
    mask = None
    if s_q > 1:  # row (i, head) sees keys j <= L - s_q + i
        qi = torch.arange(s_q, device=ctx.dev).repeat_interleave(h_q)
        mask = torch.arange(L, device=ctx.dev)[None, :] <= (L - s_q + qi)[:, None]
    res = {}
    for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel(be):
                def fn():
                    return torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
                fn()
                res[name] = ctx.bench(fn)
        except Exception as e:
            res[name] = None
            ctx.state["errors_sdpa"].append(f"{name} s_q={s_q} h_q={h_q} L={L}: {type(e).__name__}: {str(e)[:200]}")
    return res


def record(ctx, row) -> None:
    ctx.state["results"].append(row)
    print("bench", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def bench_dense(ctx, L) -> None:
    """mla_decode at every (s_q, h_q) over one b x L cache, SDPA beside it."""
    from kernel_parity.kernels.triton.mla import mla_decode
    torch = ctx.torch
    b, scale = ctx.shape_b, 1 / math.sqrt(D)
    cache, table, sl = big_cache(ctx, b, L)
    dense = v_dense = None
    if ctx.sdpa:
        try:
            dense = cache[table.long()].reshape(b, L, D)
            v_dense = dense[..., :D_V].contiguous()
        except Exception as e:  # out of memory: no peer at this length
            ctx.state["errors_sdpa"].append(f"materialise L={L}: {type(e).__name__}: {e}"[:300])
    for s_q in (1, 2):
        for h_q in ctx.bench_h:
            shape = f"b={b} s_q={s_q} h_q={h_q} L={L}"
            row = dict(op="mla_decode", shape=shape)
            try:
                q = torch.randn((b, s_q, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                cfg = ctx.best.get(row_class(s_q * h_q))
                o = torch.full((b, s_q, h_q, D_V), math.nan, dtype=q.dtype, device=ctx.dev)
                lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=ctx.dev)
                mla_decode(q, cache, table, sl, scale, out=o, out_lse=lse, config=cfg)
                chk = check_dense(ctx, "bench " + shape, q, cache, table, sl, o, lse, scale, True, (0, 1))
                ms = ctx.bench(lambda: mla_decode(q, cache, table, sl, scale, out=o, out_lse=lse, config=cfg))
                row.update(figures(ctx, b, s_q, h_q, b * L, ms), config=cfg or "default",
                           max_err_o=chk["max_err_o"], cos_diff=chk["cos_diff"], parity_ok=chk["ok"])
                if dense is not None and v_dense is not None:
                    sd = sdpa_ms(ctx, q, dense, v_dense, s_q, h_q, scale)
                    row["sdpa_ms"] = sd
                    live = {k: t for k, t in sd.items() if t is not None}
                    if live:
                        best = min(live, key=live.get)
                        row.update(best_sdpa=best, speedup_vs_sdpa=live[best] / ms)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                ctx.fail("bench " + shape, e)
            record(ctx, row)


def bench_sparse(ctx, L) -> None:
    """mla_decode_sparse, s_q = 1: each request's top-k slots drawn among its own L tokens."""
    from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse
    torch = ctx.torch
    b, scale = ctx.shape_b, 1 / math.sqrt(D)
    cache, table, _ = big_cache(ctx, b, L)
    for h_q in ctx.sparse_h:
        shape = f"b={b} s_q=1 h_q={h_q} topk={ctx.topk} of L={L}"
        row = dict(op="mla_decode_sparse", shape=shape)
        try:
            tok = torch.randint(L, (b, 1, ctx.topk), device=ctx.dev, generator=ctx.gen)
            page = table.long().gather(1, (tok // PAGE).view(b, -1)).view(b, 1, -1)
            idx = (page * PAGE + tok % PAGE).to(torch.int32)
            q = torch.randn((b, 1, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
            o, lse = mla_decode_sparse(q, cache, idx, None, scale)
            refs = sparse_ref(ctx, q, cache, idx, None, scale, (0, 1))
            chk = compare(ctx, "bench " + shape, [(o[i], lse[i], *refs[i]) for i in (0, 1)])
            ms = ctx.bench(lambda: mla_decode_sparse(q, cache, idx, None, scale, out=o, out_lse=lse))
            row.update(figures(ctx, b, 1, h_q, b * ctx.topk, ms), config="default",
                       max_err_o=chk["max_err_o"], cos_diff=chk["cos_diff"], parity_ok=chk["ok"])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            ctx.fail("bench " + shape, e)
        record(ctx, row)


def fused_inputs(ctx, b, h_q, L):
    """DeepSeek-V3 shapes (dn 128, d_r 64, d_c 512, v 128): one new token a request at position L - 1."""
    torch = ctx.torch
    cache, table, sl = big_cache(ctx, b, L)
    dn, d_r, d_c, dv = 128, D - D_V, D_V, 128
    q = torch.randn((b, h_q, dn + d_r), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
    off = torch.arange(b + 1, device=ctx.dev, dtype=torch.int32)
    ang = torch.arange(L, device=ctx.dev, dtype=torch.float64)[:, None] * \
        10000.0 ** (-torch.arange(0, d_r, 2, device=ctx.dev, dtype=torch.float64) / d_r)
    freqs = torch.stack([ang.cos(), ang.sin()], -1).reshape(L, d_r).float()
    gamma = 1 + 0.1 * torch.randn(d_c, device=ctx.dev, generator=ctx.gen)
    w_uk = (0.05 * torch.randn((h_q, d_c, dn), device=ctx.dev, generator=ctx.gen) * 448).to(torch.float8_e4m3fn)
    w_uv = (0.05 * torch.randn((h_q, dv, d_c), device=ctx.dev, generator=ctx.gen) * 448).to(torch.float8_e4m3fn)
    s_uk = torch.full((h_q, d_c // 128, dn // 128), 1 / 448, device=ctx.dev)
    s_uv = torch.full((h_q, dv // 128, d_c // 128), 1 / 448, device=ctx.dev)
    return dict(q=q, input_row_offsets=off, freqs_cis=freqs, gamma=gamma, epsilon=1e-6, w_uk=w_uk, w_uk_scale=s_uk,
                w_uv=w_uv, w_uv_scale=s_uv, kv_cache=cache, block_table=table, cache_lengths=sl - 1,
                scale=192 ** -0.5), sl


FUSED_SWEEP = [(32, 16, 8, 2, "ieee"), (16, 32, 4, 2, "split3"), (16, 64, 4, 2, "split3"), (16, 16, 4, 2, "split3"),
               (32, 32, 4, 2, "split3"), (32, 32, 8, 2, "split3"), (16, 32, 4, 3, "split3"), (32, 64, 8, 2, "split3"),
               (64, 32, 8, 2, "split3"), (64, 16, 8, 2, "split3"), (16, 32, 8, 2, "split3")]


def _fused_args(x):
    return [x[k] for k in ("q", "input_row_offsets", "freqs_cis", "gamma", "epsilon", "w_uk", "w_uk_scale", "w_uv",
                           "w_uv_scale", "kv_cache", "block_table", "cache_lengths", "scale")]


def fused_tune(ctx) -> None:
    """The fused attention's configs (kernels.triton.mla_fused.ATTEND_CONFIG) at two shapes; each
    output against the first (IEEE) config's on the same raw cache: max |d out| and cos_diff."""
    from kernel_parity.kernels.triton import mla_fused as F
    torch = ctx.torch
    default = F.ATTEND_CONFIG
    total: dict = {}
    for h_q, L in ctx.fused_tune_shapes:
        x, _ = fused_inputs(ctx, ctx.shape_b, h_q, L)
        args = _fused_args(x)
        raw = args[9].clone()
        ref = None
        for cfg in ctx.fused_sweep:
            row = dict(sweep=f"h_q={h_q} L={L}", config=cfg)
            try:
                F.ATTEND_CONFIG = cfg
                args[9].copy_(raw)
                out = F.mla_decode_fused_fp8(*args, max_new_tokens=1)
                if ref is None:
                    ref = out.double()
                d = out.double()
                row.update(max_d_out=float((d - ref).abs().max()),
                           cos_vs_first=float(1 - 2 * (d * ref).sum() / ((d * d).sum() + (ref * ref).sum())))
                row["ms"] = ctx.bench(lambda: F.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1))
                n, t = total.get(cfg, (0, 0.0))
                total[cfg] = (n + 1, t + row["ms"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                F.ATTEND_CONFIG = default
            ctx.state["tune"].append(row)
            print("fused tune", row, flush=True)
        del x, args, raw
        if ctx.cuda:
            torch.cuda.empty_cache()
    full = {c: t for c, (n, t) in total.items() if n == len(ctx.fused_tune_shapes) and c[4] != "ieee"}
    if full:
        ctx.best["fused"] = min(full, key=full.get)
    ctx.save()


def fused(ctx) -> None:
    """mla_decode_fused_fp8 vs the plain mla_decode of its attention and the eager branch."""
    from kernel_parity.kernels.torch import mla as eager
    from kernel_parity.kernels.triton import mla_fused as F
    from kernel_parity.kernels.triton.mla import mla_decode
    from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8
    torch = ctx.torch
    b = ctx.shape_b
    if ctx.fused_sweep:
        fused_tune(ctx)
    if "fused" in ctx.best:
        F.ATTEND_CONFIG = tuple(ctx.best["fused"])
    for L in ctx.fused_L:
        for h_q in ctx.fused_h:
            shape = f"b={b} new=1 h_q={h_q} L={L}"
            row = dict(op="mla_decode_fused_fp8", shape=shape)
            try:
                x, sl = fused_inputs(ctx, b, h_q, L)
                kw = dict(x)
                args = [kw.pop(k) for k in ("q", "input_row_offsets", "freqs_cis", "gamma", "epsilon", "w_uk",
                                            "w_uk_scale", "w_uv", "w_uv_scale", "kv_cache", "block_table",
                                            "cache_lengths", "scale")]
                out = torch.empty((b, h_q, 128), dtype=torch.bfloat16, device=ctx.dev)
                fresh = args[9].clone()  # the check runs both on the same raw cache rows
                ref_out, _ = eager.decode_fused_fp8(*args[:9], fresh.clone(), *args[10:])
                mla_decode_fused_fp8(*args[:9], fresh, *args[10:], out=out, max_new_tokens=1)
                del fresh
                cos = 1 - 2 * (out.double() * ref_out.double()).sum() / \
                    ((out.double() ** 2).sum() + (ref_out.double() ** 2).sum())
                err = float((out.double() - ref_out.double()).abs().max())
                ms = ctx.bench(lambda: mla_decode_fused_fp8(*args, out=out, max_new_tokens=1))
                q_abs = torch.randn((b, 1, h_q, D), device=ctx.dev, generator=ctx.gen).to(torch.bfloat16)
                ms_attn = ctx.bench(lambda: mla_decode(q_abs, x["kv_cache"], x["block_table"], sl, x["scale"]))
                w_bytes = 2 * h_q * D_V * 128 + 4 * (x["w_uk_scale"].numel() + x["w_uv_scale"].numel())
                nbytes = b * L * D * 2 + w_bytes + b * h_q * (192 + 128) * 2
                flops = 2 * h_q * b * L * (D + D_V) + 2 * 2 * b * h_q * 128 * D_V
                gbps = nbytes / ms / 1e6
                row.update(config=F.ATTEND_CONFIG, ms=ms, bytes=nbytes, flops=flops, GBps=gbps, pct_copy=100 * gbps / ctx.copy_gbps,
                           pct_3000=100 * gbps / FLASHMLA_GBPS, TFLOPs=flops / ms / 1e9,
                           pct_matmul=100 * flops / ms / 1e9 / ctx.mm_tflops, pct_660=100 * flops / ms / 1e9 / 660,
                           mla_decode_ms=ms_attn, fused_overhead=ms / ms_attn - 1,
                           cos_diff_vs_eager=float(cos), max_err_o=err,
                           cos_diff=float(cos), parity_ok=bool(cos < 1.2e-3))  # the eager bf16 tier
                try:
                    row["eager_ms"] = ctx.bench(lambda: eager.decode_fused_fp8(*args, inplace=True))
                    row["speedup_vs_eager"] = row["eager_ms"] / ms
                except Exception as e:  # out of memory: no peer at this size
                    row["eager_error"] = f"{type(e).__name__}: {e}"[:300]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                ctx.fail("fused " + shape, e)
            record(ctx, row)
            if ctx.cuda:
                torch.cuda.empty_cache()
        ctx.save()


def bench(ctx) -> None:
    for L in ctx.bench_L:
        bench_dense(ctx, L)
        if L == ctx.sparse_L:
            bench_sparse(ctx, L)
        if ctx.cuda:
            ctx.torch.cuda.empty_cache()
        ctx.save()


def ceilings(torch, dev, gen, time_ms, cuda) -> tuple[float, float]:
    """This run's copy bandwidth (GB/s, bytes read + written, 2 GiB) and bf16 matmul rate (8192^3)."""
    n_copy = (2048 if cuda else 8) * MIB
    src = torch.rand(n_copy // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    copy_gbps = 2 * n_copy / time_ms(lambda: dst.copy_(src)) / 1e6
    n = 8192 if cuda else 256
    a = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    return copy_gbps, 2 * n**3 / time_ms(lambda: a @ b) / 1e9


class Context:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.best: dict = {}

    def fail(self, name, e) -> None:
        self.state["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}"[:2000])
        print(f"ERROR {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def main() -> int:
    args = parse_args()
    if args.smoke_cpu:
        from kernel_parity.conformance.backends.triton_prep import interpreter_mode, interpreter_ready, \
            prepare_environment
        if not interpreter_mode():
            print("gpu_mla --smoke-cpu is for a machine without a CUDA GPU (the interpreter's fixes apply only "
                  "there); on a GPU run it without the flag", file=sys.stderr)
            return 2
        prepare_environment()  # TRITON_INTERPRET=1 before triton is imported
        why = interpreter_ready()
        if why:
            print(f"gpu_mla --smoke-cpu: {why}", file=sys.stderr)
            return 2
    import torch
    import triton

    cuda = torch.cuda.is_available() and not args.smoke_cpu
    if not cuda and not args.smoke_cpu:
        print("gpu_mla: no CUDA device; run on a GPU machine, or with --smoke-cpu", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    if cuda:
        from triton.testing import do_bench
        bench_kw = dict(warmup=25, rep=100, return_mode="median")

        def time_ms(fn) -> float:
            return float(do_bench(fn, **bench_kw))
    else:
        bench_kw = dict(perf_counter="min of 2")

        def time_ms(fn) -> float:
            ts = []
            for _ in range(2):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return sorted(ts)[0]

    state: dict = dict(parity=[], tune=[], results=[], failures=[], errors=[], errors_sdpa=[], notes=[])
    copy_gbps, mm_tflops = ceilings(torch, dev, gen, time_ms, cuda)
    from kernel_parity.kernels.triton import mla as M
    props = torch.cuda.get_device_properties(dev) if cuda else None
    header = dict(
        device=torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)",
        capability=".".join(map(str, torch.cuda.get_device_capability(dev))) if cuda else None,
        sm_count=props.multi_processor_count if cuda else 1,
        l2_bytes=getattr(props, "L2_cache_size", None) if cuda else None,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, smoke_cpu=args.smoke_cpu,
        copy_GBps=copy_gbps, matmul_bf16_TFLOPs=mm_tflops, do_bench=bench_kw, limits=LIMITS,
        mla_configs={str(k): tuple(v) for k, v in M.MLA_CONFIGS.items()},
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    print(f"{header['device']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.1f} TFLOP/s", flush=True)

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            doc = dict(header=header, best_configs={str(k): v for k, v in ctx.best.items()}, **state)
            Path(args.out).write_text(json.dumps(doc, indent=1, default=str))

    sizes = (dict(shape_b=128, tune_L=8192, bench_L=(4096, 8192, 16384), bench_h=(16, 32, 64, 128),
                  tune_shapes=((1, 16), (1, 32), (1, 64), (1, 128)), sweep=SWEEP, sparse_L=8192,
                  sparse_h=(64, 128), topk=2048, sdpa=True, fused_L=(4096, 16384), fused_h=(16, 128),
                  fused_tune_shapes=((128, 4096), (16, 16384)), fused_sweep=FUSED_SWEEP, parity_shapes=((1, 16), (2, 16), (2, 64)),
                  parity_sparse=((2, 16, [50, 0, 96, 7]), (1, 128, None)))
             if cuda else
             dict(shape_b=2, tune_L=128, bench_L=(64, 128), bench_h=(2, 16), tune_shapes=((1, 16), (1, 32)),
                  sweep={16: SWEEP[16][:1], 32: SWEEP[32][:1], 64: []}, sparse_L=64, sparse_h=(16,), topk=32, fused_L=(64,), fused_h=(2,), fused_tune_shapes=((2, 64),),
                  fused_sweep=FUSED_SWEEP[:2],
                  sdpa=True, parity_shapes=((1, 16), (2, 2)), parity_sparse=((2, 16, [50, 0, 96, 7]),)))
    ctx = Context(torch=torch, dev=dev, gen=gen, cuda=cuda, bench=time_ms, copy_gbps=copy_gbps, mm_tflops=mm_tflops,
                  sm_count=header["sm_count"], tune_budget=args.tune_budget if cuda else 1e9, state=state,
                  save=save, **sizes)
    if args.fused_configs is not None:
        ctx.fused_sweep = ctx.fused_sweep[:args.fused_configs]
    sections = set(args.sections.split(","))
    for name, fn in (("parity", parity), ("tune", tune), ("bench", bench), ("fused", fused)):
        if name not in sections:
            continue
        t0 = time.time()
        try:
            fn(ctx)
        except Exception as e:  # keep what the other sections measured
            state["errors"].append(f"section {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"[{name}: {time.time() - t0:.0f} s]", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        save()

    print(f"\n{header['device']}  copy {copy_gbps:.0f} GB/s  bf16 matmul {mm_tflops:.1f} TFLOP/s  "
          f"best configs {ctx.best}")
    print(f"{'op':17s} {'shape':36s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'%3000':>6s} {'TFLOP/s':>8s} "
          f"{'%mm':>5s} {'%660':>5s} {'max|dO|':>8s} {'cos_diff':>9s} {'SDPA ms':>14s} {'x':>6s}")
    for r in state["results"]:
        if "ms" not in r:
            print(f"{r['op']:17s} {r['shape']:36s} ERROR {r.get('error', '')[:80]}")
            continue
        sd = f"{r['best_sdpa']} {r['sdpa_ms'][r['best_sdpa']]:.3f}" if r.get("best_sdpa") else "-"
        x = f"{r['speedup_vs_sdpa']:5.1f}x" if r.get("best_sdpa") else "-"
        print(f"{r['op']:17s} {r['shape']:36s} {r['ms']:8.4f} {r['GBps']:7.0f} {r['pct_copy']:5.1f}% "
              f"{r['pct_3000']:5.1f}% {r['TFLOPs']:8.1f} {r['pct_matmul']:4.0f}% {r['pct_660']:4.0f}% "
              f"{r['max_err_o']:8.1e} {r['cos_diff']:9.1e} {sd:>14s} {x:>6s}")
    if state["failures"] or state["errors"]:
        print(f"\nFAILED: {len(state['failures'])} parity failure(s), {len(state['errors'])} error(s)",
              *state["failures"], *[e.splitlines()[0] for e in state["errors"]], sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nparity ok in {len(state['parity'])} checks; {len(state['results'])} timed entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
