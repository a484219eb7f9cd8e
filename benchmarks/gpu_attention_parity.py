"""Parity half of benchmarks/gpu_attention.py: float64 references and the small-shape checks.

- `parity`: every Triton attention entry point and kvcache.update at small shapes against the
  goldens of refimpl/ (numpy float64 on the CPU).
- `ref64`, `mask64`: the goldens' formula in torch float64 on the GPU, for slices of the large
  benchmarked shapes (checked against refimpl itself before use).
- `check`: max |error| per output against per-dtype limits; NaN or a differing -inf pattern fails.
"""

from __future__ import annotations

import math
import sys

# Per dtype: (atol on O, atol on LSE) against float64. O is a convex combination of N(0, 1)
# values (|O| < ~3): fp32 leaves ~1e-6 (fp32 dots, ex2 on log2-scaled logits); 16-bit inputs
# round P to the storage dtype before the PV dot (FlashAttention's practice) and O once at the end.
TOL = {"fp32": (3e-5, 3e-5), "fp16": (4e-3, 2e-3), "bf16": (3e-2, 1.5e-2)}


def mask64(torch, s_q, s_k, q_lens, k_lens, causal, window, dev):
    """(b, s_q, s_k) keep-mask: refimpl.attention.mask, in torch (the eager baseline's own)."""
    from kernel_parity.kernels.torch.attention import keep_mask

    return keep_mask(s_q, s_k, q_lens.to(dev), k_lens.to(dev), causal, window)


def ref64(torch, q, k, v, keep, scale=None, softcap=0.0, sinks=None):
    """float64 attention on the GPU: refimpl.attention.masked_attention in torch.
    q: (b, s_q, h_q, d); k, v: (b, s_k, h_kv, d); keep: (b, s_q, s_k) -> o (b, s_q, h_q, d), lse (b, h_q, s_q)"""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    idx = torch.arange(q.shape[2], device=q.device) // (q.shape[2] // k.shape[2])
    read = keep.any(1)[:, :, None, None]  # keys no query reads may be NaN
    k, v = torch.where(read, k, 0.0)[:, :, idx], torch.where(read, v, 0.0)[:, :, idx]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    lse_s = lse if sinks is None else torch.logaddexp(lse, sinks.double()[None, :, None])
    p = torch.where(keep[:, None], torch.exp(s - torch.where(torch.isfinite(lse_s), lse_s, 0.0)[..., None]), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def check(ctx, name, dt, pairs) -> tuple[float, bool]:
    """pairs: (label, got, expected float64); O-like labels use TOL[dt][0], LSE-like [1]."""
    torch = ctx.torch
    worst, bad = 0.0, []
    for label, got, exp in pairs:
        atol = ctx.tol[dt][1 if "lse" in label else 0]
        got, exp = got.double().to(exp.device), exp.double()
        if not torch.equal(torch.isneginf(got), torch.isneginf(exp)) or bool(torch.isnan(got).any()):
            bad.append(f"{label}: NaN or -inf pattern differs")
        fin = torch.isfinite(exp)
        err = float((got[fin] - exp[fin]).abs().max()) if bool(fin.any()) else 0.0
        worst = max(worst, err)
        if not err <= atol:
            bad.append(f"{label}: max|d|={err:.3g} > {atol:.3g}")
    ctx.state["parity"].append(dict(case=name, dtype=dt, max_err=worst, ok=not bad))
    if bad:
        ctx.state["failures"].append(f"{name} [{dt}]: " + "; ".join(bad))
        print("PARITY FAIL", ctx.state["failures"][-1], file=sys.stderr, flush=True)
    return worst, not bad


def paged_copy(torch, kc, vc, page, gen):
    """(b, L, h, d) caches, L % page == 0 -> shuffled (b L / page + 1, page, h, d) pages with a NaN
    page 0 that no table entry names, and the (b, L / page) int32 table."""
    b, L = kc.shape[:2]
    n = b * L // page
    perm = torch.randperm(n, device=kc.device, generator=gen) + 1
    pages = []
    for c in (kc, vc):
        p = torch.full((n + 1, page, *c.shape[2:]), math.nan, dtype=c.dtype, device=c.device)
        p[perm] = c.reshape(n, page, *c.shape[2:])
        pages.append(p)
    return pages[0], pages[1], perm.view(b, L // page).to(torch.int32)


def parity(ctx) -> None:
    """Small shapes against refimpl's float64 goldens (numpy on the CPU). bf16 everywhere (the
    interpreter cannot check it), fp16/fp32 on one case per entry point (the interpreter checks
    them across the whole case matrix)."""
    import numpy as np

    from kernel_parity.kernels.triton import attention as A
    from kernel_parity.kernels.triton import attention_decode as D
    from kernel_parity.kernels.triton import kvcache as KV
    from kernel_parity.refimpl import attention as R
    from kernel_parity.refimpl import kvcache as RK
    torch, dev, gen = ctx.torch, ctx.dev, ctx.gen
    dts = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    npy = lambda t: t.double().cpu().numpy()  # noqa: E731
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    rnd = lambda shape, dt: torch.randn(shape, device=dev, generator=gen).to(dt)  # noqa: E731
    everywhere, bf16 = ("bf16", "fp16", "fp32"), ("bf16",)
    # (dtypes, b, s_q, s_k, h_q, h_kv, d, causal, window, softcap, sinks)
    for dns, b, s_q, s_k, hq, hkv, d, causal, window, cap, sk in [
            (everywhere, 2, 113, 239, 8, 2, 128, "bottom_right", (-1, -1), 0.0, False),
            (bf16, 2, 239, 113, 8, 8, 64, "bottom_right", (16, -1), 0.0, True),
            (bf16, 1, 130, 130, 8, 1, 96, "none", (5, 7), 30.0, True),
            (bf16, 2, 64, 300, 4, 4, 256, "top_left", (32, -1), 0.0, False)]:
        for dn in dns:
            dt = dts[dn]
            q, k, v = rnd((b, s_q, hq, d), dt), rnd((b, s_k, hkv, d), dt), rnd((b, s_k, hkv, d), dt)
            sinks = torch.randn(hq, device=dev, generator=gen) if sk else None
            kw = dict(causal=causal, window=window, softcap=cap)
            o, lse = A.prefill(q, k, v, sinks=sinks, out=torch.full_like(q, math.nan), **kw)
            o_r, lse_r, _ = R.prefill(npy(q), npy(k), npy(v), sinks=None if sinks is None else npy(sinks), **kw)
            check(ctx, f"prefill b={b} s_q={s_q} s_k={s_k} h={hq}/{hkv} d={d} {kw} sinks={sk}", dn,
                  [("o", o, T(o_r)), ("lse", lse, T(lse_r))])
    lq, lk = [0, 7, 129, 1], [5, 0, 200, 64]
    cq, ck = (torch.tensor(np.cumsum([0] + x), dtype=torch.int32, device=dev) for x in (lq, lk))
    q, k, v = (rnd((sum(n), h, 128), torch.bfloat16) for n, h in ((lq, 8), (lk, 2), (lk, 2)))
    o, lse = A.varlen(q, k, v, cq, ck, max(lq), max(lk), causal="bottom_right", window=(64, -1))
    o_r, lse_r, _ = R.varlen(npy(q), npy(k), npy(v), cq.cpu().numpy(), ck.cpu().numpy(), causal="bottom_right",
                             window=(64, -1))
    check(ctx, f"varlen q={lq} k={lk} h=8/2 d=128 bottom_right (64,-1)", "bf16",
          [("o", o, T(o_r)), ("lse", lse, T(lse_r))])
    # decode: (dtypes, s_q, h_q, h_kv, d, seqlens, causal, window, softcap, sinks)
    for dns, s_q, hq, hkv, d, L, causal, window, cap, sk in [
            (everywhere, 1, 32, 8, 128, [0, 1, 1000, 777], "bottom_right", (-1, -1), 0.0, False),
            (bf16, 4, 32, 8, 128, [3, 64, 1000, 129], "bottom_right", (100, -1), 0.0, True),
            (bf16, 2, 8, 1, 64, [17, 5, 300, 2], "top_left", (31, 0), 30.0, True)]:
        for dn in dns:
            dt = dts[dn]
            b, s_max = len(L), max(L) + 64
            q, kc, vc = rnd((b, s_q, hq, d), dt), rnd((b, s_max, hkv, d), dt), rnd((b, s_max, hkv, d), dt)
            for i, n in enumerate(L):
                kc[i, n:], vc[i, n:] = math.nan, math.nan
            sl = torch.tensor(L, dtype=torch.int32, device=dev)
            sinks = torch.randn(hq, device=dev, generator=gen) if sk else None
            kw = dict(causal=causal, window=window, softcap=cap)
            rkw = dict(kw, sinks=None if sinks is None else npy(sinks))
            o_r, lse_r, _ = R.decode(npy(q), npy(kc), npy(vc), np.array(L), **rkw)
            tag = f"s_q={s_q} h={hq}/{hkv} d={d} L={L} {kw} sinks={sk}"
            o, lse = D.decode(q, kc, vc, sl, sinks=sinks, out=torch.full_like(q, math.nan), **kw)
            check(ctx, "decode " + tag, dn, [("o", o, T(o_r)), ("lse", lse, T(lse_r))])
            for page in ((16, 64) if dn == "bf16" else ()):
                pad = (-s_max) % page
                kp, vp, table = paged_copy(torch, *(torch.cat([c, c[:, :pad] * math.nan], 1) for c in (kc, vc)), page, gen)
                o, lse = D.decode_paged(q, kp, vp, table, sl, sinks=sinks, **kw)
                check(ctx, f"decode_paged page={page} " + tag, dn, [("o", o, T(o_r)), ("lse", lse, T(lse_r))])
            for splits in (1, 3, 2000):
                o_r2, lse_r2, _, op_r, lp_r = R.decode_split(npy(q), npy(kc), npy(vc), np.array(L), splits, **rkw)
                o, lse, op, lp = D.decode_split(q, kc, vc, sl, splits, sinks=sinks, **kw)
                op_r = np.where(np.isnan(op_r), npy(op), op_r)  # empty splits: any value
                check(ctx, f"decode_split splits={splits} " + tag, dn, [("o", o, T(o_r2)), ("lse", lse, T(lse_r2)),
                                                                       ("o_parts", op, T(op_r)), ("lse_parts", lp, T(lp_r))])
    for dn in ("bf16", "fp32"):  # kvcache.update, bit-exact, contiguous and paged
        dt = dts[dn]
        iv = torch.int16 if dn == "bf16" else torch.int32
        cache, new, pages = rnd((3, 100, 8, 128), dt), rnd((3, 5, 8, 128), dt), rnd((20, 16, 8, 128), dt)
        pos = torch.tensor([0, 37, 90], dtype=torch.int32, device=dev)
        table = torch.randperm(20, device=dev, generator=gen)[:18].view(3, 6).to(torch.int32)
        bits = lambda t: t.view(iv).cpu().numpy()  # noqa: E731
        exp_c = RK.update(bits(cache), bits(new), pos.cpu().numpy())
        exp_p = RK.update(bits(pages), bits(new), pos.cpu().numpy(), block_table=table.cpu().numpy())
        KV.update(cache, new, pos)
        KV.update(pages, new, pos, block_table=table)
        ok = np.array_equal(bits(cache), exp_c) and np.array_equal(bits(pages), exp_p)
        ctx.state["parity"].append(dict(case="kvcache.update contiguous+paged", dtype=dn, max_err=0.0, ok=ok))
        if not ok:
            ctx.state["failures"].append(f"kvcache.update [{dn}]: not bit-exact")
    print(f"parity: {len(ctx.state['parity'])} cases, {len(ctx.state['failures'])} failures", flush=True)
