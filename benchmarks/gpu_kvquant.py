"""GPU benchmark of decode attention over a quantized KV cache (issue 34) on Hopper: a thin caller of `parity bench`.

    python benchmarks/gpu_kvquant.py [--quick] [--out PATH]

Llama-3-8B's attention (32 query heads, 8 kv heads, d 128), one new token a sequence over 32,768 cached tokens in
pages of 16, b 1 / 8 / 32, bf16 queries:
- kvquant.decode_paged (ours: triton, and gluon for the FP8 caches; the eager torch baseline beside it) over an e4m3 cache with per-tensor
  scales (vLLM's k_scale / v_scale), an e4m3 cache with per-token scales and an int8 cache with per-token scales;
- attention.decode_paged (ours: triton) over the bf16 cache of the same shape, in the same run.
Every case is judged by the gate against the float64 golden and timed with do_bench; the read ceiling is measured
in the same run (conformance/bench.py). The summary adds, per b and format, the quantized decode's speed-up over
the bf16-cache decode (bf16 ms / quantized ms) and its share of the read ceiling: issue 34's goal is >= 1.8x and
>= 90% for the e4m3 cache at 32K tokens.
--quick: b 8 only. Results: --out (default $OUT/kvquant-bench.json, else ./kvquant-bench.json).

--tune instead times kernels/triton/kvquant_decode.py directly over an e4m3 per-tensor cache at the same shape,
b 1 / 8 / 32, for each FP8 conversion (fast_cvt of TUNE_FAST), (BLOCK_N, num_warps, num_stages[, maxnreg]) of
TUNE_CONFIGS and keys a split of TUNE_SPLITS, and kernels/gluon/kvquant_decode.py (CUDA-graph timing, splits of
TUNE_GLUON_SPLITS), beside the bf16-cache kernels/triton/attention_decode.py decode_paged
and the read floor (the cache's bytes at the read ceiling conformance/bench.py measures: a 1 GiB fp32 sum), each
output checked against the Triton-cast kernel's (max abs diff); first, every FP8 code through the fast conversion
against torch's cast, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KV, PAGE = 32768, 16
HEADS = dict(hq=32, hkv=8, d=128)
BATCHES = (1, 8, 32)
CACHES = (("e4m3", "tensor"), ("e4m3", "token"), ("int8", "token"))


def entries(quick: bool = False) -> list[dict]:
    batches = (8,) if quick else BATCHES
    common = {"dtypes": ["bf16"], "dists": ["normal"]}
    return [
        {"op": "kvquant.decode_paged", "backends": ["triton", "gluon", "torch"], **common,
         "params": [dict(b=b, **HEADS, kv=KV, lens="full", page=PAGE, fmt=fmt, gran=gran)
                    for b in batches for fmt, gran in CACHES]},
        {"op": "attention.decode_paged", "backends": ["triton"], **common,
         "params": [dict(b=b, sq=1, kv=KV, **HEADS, lens="full", page=PAGE, causal="none", wl=-1, wr=-1, cap=0,
                         sink=0) for b in batches]},
    ]


# (BLOCK_N, num_warps, num_stages[, maxnreg]): a 4th entry caps the registers (168: three 4-warp CTAs an SM beside
# their 74 KB of shared memory; 128: four of (64, 4, 3)'s 39 KB)
TUNE_CONFIGS = ((128, 4, 2), (128, 4, 3), (128, 4, 3, 168), (128, 4, 2, 168), (128, 8, 2), (128, 8, 3), (64, 4, 3),
                (64, 4, 3, 128), (64, 4, 4))
TUNE_SPLITS = (None, 2048)
TUNE_GLUON_SPLITS = (None, 1024, 2048)
TUNE_BATCHES = (1, 8, 32)
# kernels/triton/kvquant_decode.py fast_cvt: 0 Triton's casts, 2 the integer-pipe bf16 conversion
TUNE_FAST = (2,)


def check_conversion() -> dict:
    """Every e4m3 / e5m2 code through the kernel's FP8 -> bf16 conversion (fast_cvt) against torch's cast,
    bit for bit (NaN codes excluded: a saturating write never stores one)."""
    import torch
    import triton
    import triton.language as tl

    from kernel_parity.kernels.triton import kvquant_decode as Q

    @triton.jit
    def conv(X, Y, FMT: tl.constexpr, FAST: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(Y + offs, Q._codes(tl.load(X + offs), FMT, Y.dtype.element_ty, FAST))

    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    res = {}
    for (fmt, dtype), (fast, out) in itertools.product(((0, torch.float8_e4m3fn), (1, torch.float8_e5m2)),
                                                       ((1, torch.bfloat16),)):
        y = torch.empty(256, dtype=out, device="cuda")
        conv[(1,)](codes, y, FMT=fmt, FAST=fast)
        want = codes.view(dtype).to(out)
        finite = torch.isfinite(want)
        bad = (y.view(torch.int16) != want.view(torch.int16)) & finite
        res[f"{dtype} -> {out}"] = {"finite_codes": int(finite.sum()), "mismatches": int(bad.sum()),
                           "first_bad": [int(i) for i in torch.nonzero(bad).flatten()[:8]]}
    return res


def tune(out: str, quick: bool = False) -> int:
    """The --tune section (module docstring): one JSON document of rows. quick: the Triton kernel at its default
    config and split only (the gluon kernel and the bf16 cache as always)."""
    import torch
    from triton.testing import do_bench

    from kernel_parity.conformance.bench import measure_ceilings
    from kernel_parity.kernels.triton import attention_decode as D
    from kernel_parity.kernels.triton import kvquant_decode as Q
    from kernel_parity.reports.files import write_text

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    ceil = measure_ceilings(dev)
    doc = {"device": torch.cuda.get_device_name(), "kv": KV, "page": PAGE, **HEADS, "ceilings": ceil.to_json(),
           "conversion": check_conversion(), "rows": rows}
    print(f"ceilings {doc['ceilings']}; conversion {doc['conversion']}", flush=True)

    def ms(fn) -> float:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    for b in TUNE_BATCHES:
        pages = KV // PAGE
        nb = b * pages
        table = torch.randperm(nb, device=dev, generator=gen).to(torch.int32).view(b, pages)
        sl = torch.full((b,), KV, dtype=torch.int32, device=dev)
        q = torch.randn(b, HEADS["hq"], HEADS["d"], device=dev, dtype=torch.bfloat16, generator=gen)
        shape = (nb, PAGE, HEADS["hkv"], HEADS["d"])
        k8 = (torch.randn(shape, device=dev, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        v8 = (torch.randn(shape, device=dev, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        ks = torch.full((1,), 0.01, device=dev)
        vs = torch.full((1,), 0.01, device=dev)
        nbytes = 2 * k8.numel() + 2 * q.numel() * 2
        kb, vb = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
        bf16_ms = ms(lambda: D.decode_paged(q.unsqueeze(1), kb, vb, table, sl, causal="none"))
        del kb, vb
        ref, _ = Q.decode_paged(q, k8, v8, ks, vs, table, sl, fast_cvt=0)
        read_ms = nbytes / (ceil.read_gbps * 1e6)
        row = {"b": b, "bytes": nbytes, "read_floor_ms": read_ms, "bf16_ms": bf16_ms, "configs": []}
        for fast in TUNE_FAST:
            for cfg in ((None,) if quick else TUNE_CONFIGS):
                for keys in ((None,) if quick else TUNE_SPLITS):
                    try:
                        fn = lambda: Q.decode_paged(q, k8, v8, ks, vs, table, sl, config=cfg,  # noqa: E731
                                                    split_keys=keys, fast_cvt=fast)
                        o, _ = fn()
                        t = ms(fn)
                        row["configs"].append({"fast_cvt": fast, "config": cfg, "split_keys": keys, "ms": t,
                                               "speedup_over_bf16": bf16_ms / t, "pct_of_read": 100 * read_ms / t,
                                               "max_diff": float((o.float() - ref.float()).abs().max())})
                    except Exception as e:  # a config that does not compile (shared memory): its row says why
                        row["configs"].append({"fast_cvt": fast, "config": cfg, "split_keys": keys,
                                               "error": f"{type(e).__name__}: {e}"[:300]})
                    c = row["configs"][-1]
                    print(f"b={b} fast={fast} {cfg} keys={keys}: " + (
                        f"{c['ms'] * 1e3:.1f} us {c['speedup_over_bf16']:.2f}x bf16 {c['pct_of_read']:.1f}% read "
                        f"diff {c['max_diff']:.3g}" if "ms" in c else c["error"]), flush=True)
        best = min((c for c in row["configs"] if "ms" in c), key=lambda c: c["ms"], default=None)
        row["best"] = best
        if best is not None:  # CUDA-graph timing (launch overhead out: b 1 is host-bound under do_bench)
            from triton.testing import do_bench_cudagraph

            kb, vb = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
            row["graph_bf16_ms"] = float(do_bench_cudagraph(
                lambda: D.decode_paged(q.unsqueeze(1), kb, vb, table, sl, causal="none"), rep=100))
            del kb, vb
            for fast in TUNE_FAST:
                mine = min((c for c in row["configs"] if "ms" in c and c["fast_cvt"] == fast),
                           key=lambda c: c["ms"], default=None)
                if mine is not None:
                    mine["graph_ms"] = float(do_bench_cudagraph(lambda: Q.decode_paged(
                        q, k8, v8, ks, vs, table, sl, config=mine["config"], split_keys=mine["split_keys"],
                        fast_cvt=fast), rep=100))
                    print(f"b={b} graph: fast={fast} {mine['config']} {mine['split_keys']}: "
                          f"{mine['graph_ms'] * 1e3:.1f} us vs bf16 {row['graph_bf16_ms'] * 1e3:.1f} us "
                          f"({row['graph_bf16_ms'] / mine['graph_ms']:.2f}x), read floor {read_ms * 1e3:.1f} us "
                          f"({100 * read_ms / mine['graph_ms']:.1f}%)", flush=True)
        row["gluon"] = gluon_rows(q, k8, v8, ks, vs, table, sl, ref, row["graph_bf16_ms"] if best else bf16_ms,
                                  read_ms)
        print(f"b={b}: bf16 {bf16_ms * 1e3:.1f} us, read floor {read_ms * 1e3:.1f} us; best {best}", flush=True)
        rows.append(row)
        write_text(out, json.dumps(doc, indent=1, default=str))
        del q, k8, v8, table
        torch.cuda.empty_cache()
    return 0


def gluon_rows(q, k8, v8, ks, vs, table, sl, ref, bf16_graph_ms: float, read_ms: float) -> list[dict]:
    """kernels/gluon/kvquant_decode.py on the --tune inputs, CUDA-graph timed, at its default split and each of
    TUNE_GLUON_SPLITS: ms, bf16 graph ms / ms, % of the read floor, max |O - ref| (ref: the Triton-cast kernel)."""
    from triton.testing import do_bench_cudagraph

    from kernel_parity.conformance.backends.gluon_backend import unavailable
    from kernel_parity.kernels.gluon import kvquant_decode as G

    why = unavailable()
    if why:
        return [{"error": why}]
    rows = []
    for keys in TUNE_GLUON_SPLITS:
        try:
            fn = lambda: G.decode_paged(q, k8, v8, ks, vs, table, sl, split_keys=keys)  # noqa: E731
            o, _ = fn()
            t = float(do_bench_cudagraph(fn, rep=100))
            rows.append({"split_keys": keys, "graph_ms": t, "speedup_over_bf16": bf16_graph_ms / t,
                         "pct_of_read": 100 * read_ms / t, "max_diff": float((o.float() - ref.float()).abs().max())})
            print(f"b={q.shape[0]} gluon keys={keys}: {t * 1e3:.1f} us, {bf16_graph_ms / t:.2f}x the bf16 cache, "
                  f"{100 * read_ms / t:.1f}% of the read floor", flush=True)
        except Exception as e:  # noqa: BLE001  (its row says why)
            rows.append({"split_keys": keys, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def speedups(summary: dict) -> list[dict]:
    """Per (b, fmt, gran) and our kernel (triton; gluon where it takes the case): the quantized decode's ms, its share
    of the read ceiling, and bf16 ms / its ms."""
    bf16 = {c["params"]["b"]: c["backends"].get("triton", {}).get("ms") for c in summary["cases"]
            if c["op"] == "attention.decode_paged"}
    rows = []
    for c in summary["cases"]:
        if c["op"] != "kvquant.decode_paged":
            continue
        base = bf16.get(c["params"]["b"])
        for name in ("triton", "gluon"):
            fig = c["backends"].get(name)
            if not fig or fig.get("verdict") == "skip":
                continue
            rows.append({"b": c["params"]["b"], "fmt": c["params"]["fmt"], "gran": c["params"]["gran"],
                         "backend": name, "verdict": fig.get("verdict"), "ms": fig.get("ms"), "bf16_ms": base,
                         "speedup_over_bf16": base / fig["ms"] if base and fig.get("ms") else None,
                         "pct_of_ceiling": fig.get("pct_of_ceiling"), "bound": fig.get("bound")})
    return rows


def main() -> int:
    from bench_cases import OneLineParser, run

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="b 8 only; with --tune, the Triton kernel's default config only")
    p.add_argument("--tune", action="store_true", help="time the Triton kernel's configs directly (module docstring)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kvquant-bench.json"),
                   help="JSON output path (default $OUT/kvquant-bench.json)")
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit, write_text

    check_output_or_exit(p.prog, "--out", args.out)
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: error: no CUDA device (torch.cuda.is_available() is False); this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    if args.tune:
        return tune(args.out, args.quick)
    code = run(entries(args.quick), out=args.out, ours="triton",
               description="quantized KV-cache decode benchmark (benchmarks/gpu_kvquant.py)")
    if code == 2 or not Path(args.out).exists():
        return code
    summary = json.loads(Path(args.out).read_text())
    summary["speedups"] = speedups(summary)
    write_text(args.out, json.dumps(summary, indent=1, default=str))
    for r in summary["speedups"]:
        sp = f"{r['speedup_over_bf16']:.2f}x" if r["speedup_over_bf16"] else "-"
        pct = f"{r['pct_of_ceiling']:.1f}%" if r["pct_of_ceiling"] is not None else "-"
        print(f"kvquant {r['backend']} b={r['b']} {r['fmt']}/{r['gran']}: {r['ms']} ms, {sp} the bf16 cache, {pct} of {r['bound']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
