"""GPU benchmark of decode attention over a quantized KV cache (issue 34) on Hopper: a thin caller of `parity bench`.

    python benchmarks/gpu_kvquant.py [--quick] [--out PATH]

Llama-3-8B's attention (32 query heads, 8 kv heads, d 128), one new token a sequence over 32,768 cached tokens in
pages of 16, b 1 / 8 / 32, bf16 queries:
- kvquant.decode_paged (ours: triton; the eager torch baseline beside it) over an e4m3 cache with per-tensor
  scales (vLLM's k_scale / v_scale), an e4m3 cache with per-token scales and an int8 cache with per-token scales;
- attention.decode_paged (ours: triton) over the bf16 cache of the same shape, in the same run.
Every case is judged by the gate against the float64 golden and timed with do_bench; the read ceiling is measured
in the same run (conformance/bench.py). The summary adds, per b and format, the quantized decode's speed-up over
the bf16-cache decode (bf16 ms / quantized ms) and its share of the read ceiling: issue 34's goal is >= 1.8x and
>= 90% for the e4m3 cache at 32K tokens.
--quick: b 8 only. Results: --out (default $OUT/kvquant-bench.json, else ./kvquant-bench.json).

--tune instead times kernels/triton/kvquant_decode.py directly over an e4m3 per-tensor cache at the same shape,
for each (BLOCK_N, num_warps, num_stages) of TUNE_CONFIGS and keys a split of TUNE_SPLITS, beside the bf16-cache
kernels/triton/attention_decode.py decode_paged and a pure read of the same bytes (torch's sum of a uint8 view's
int64 words: the read ceiling of this call), each output checked against the default config's (max abs diff).
"""

from __future__ import annotations

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
        {"op": "kvquant.decode_paged", "backends": ["triton", "torch"], **common,
         "params": [dict(b=b, **HEADS, kv=KV, lens="full", page=PAGE, fmt=fmt, gran=gran)
                    for b in batches for fmt, gran in CACHES]},
        {"op": "attention.decode_paged", "backends": ["triton"], **common,
         "params": [dict(b=b, sq=1, kv=KV, **HEADS, lens="full", page=PAGE, causal="none", wl=-1, wr=-1, cap=0,
                         sink=0) for b in batches]},
    ]


TUNE_CONFIGS = ((128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3), (128, 8, 4), (256, 4, 2), (256, 4, 3),
                (256, 8, 2), (256, 8, 3), (64, 4, 4), (64, 4, 6), (64, 2, 4))
TUNE_SPLITS = (None, 1024, 4096)
TUNE_BATCHES = (1, 8)


def tune(out: str) -> int:
    """The --tune section (module docstring): one JSON document of rows."""
    import torch
    from triton.testing import do_bench

    from kernel_parity.kernels.triton import attention_decode as D
    from kernel_parity.kernels.triton import kvquant_decode as Q
    from kernel_parity.reports.files import write_text

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    doc = {"device": torch.cuda.get_device_name(), "kv": KV, "page": PAGE, **HEADS, "rows": rows}

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
        words = k8.view(torch.uint8).view(-1).view(torch.int64)
        read_ms = ms(lambda: words.sum()) * 2  # K and V: two such reads
        kb, vb = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
        bf16_ms = ms(lambda: D.decode_paged(q.unsqueeze(1), kb, vb, table, sl, causal="none"))
        del kb, vb
        ref, _ = Q.decode_paged(q, k8, v8, ks, vs, table, sl)
        row = {"b": b, "bytes": nbytes, "read_ms": read_ms, "read_gbps": nbytes / read_ms / 1e6, "bf16_ms": bf16_ms,
               "configs": []}
        for cfg in TUNE_CONFIGS:
            for keys in TUNE_SPLITS:
                try:
                    fn = lambda: Q.decode_paged(q, k8, v8, ks, vs, table, sl, config=cfg, split_keys=keys)  # noqa: E731
                    o, _ = fn()
                    t = ms(fn)
                    row["configs"].append({"config": cfg, "split_keys": keys, "ms": t, "speedup_over_bf16": bf16_ms / t,
                                           "pct_of_read": 100 * read_ms / t,
                                           "max_diff": float((o.float() - ref.float()).abs().max())})
                except Exception as e:  # a config that does not compile (shared memory): its row says why
                    row["configs"].append({"config": cfg, "split_keys": keys, "error": f"{type(e).__name__}: {e}"[:300]})
                c = row["configs"][-1]
                print(f"b={b} {cfg} keys={keys}: " + (f"{c['ms'] * 1e3:.1f} us {c['speedup_over_bf16']:.2f}x bf16 "
                      f"{c['pct_of_read']:.1f}% read diff {c['max_diff']:.3g}" if "ms" in c else c["error"]), flush=True)
        best = min((c for c in row["configs"] if "ms" in c), key=lambda c: c["ms"], default=None)
        row["best"] = best
        print(f"b={b}: bf16 {bf16_ms * 1e3:.1f} us, read {read_ms * 1e3:.1f} us; best {best}", flush=True)
        rows.append(row)
        write_text(out, json.dumps(doc, indent=1, default=str))
        del q, k8, v8, words, table
        torch.cuda.empty_cache()
    return 0


def speedups(summary: dict) -> list[dict]:
    """Per (b, fmt, gran): the quantized decode's ms, its share of the read ceiling, and bf16 ms / its ms."""
    bf16 = {c["params"]["b"]: c["backends"].get("triton", {}).get("ms") for c in summary["cases"]
            if c["op"] == "attention.decode_paged"}
    rows = []
    for c in summary["cases"]:
        if c["op"] != "kvquant.decode_paged":
            continue
        fig = c["backends"].get("triton", {})
        base = bf16.get(c["params"]["b"])
        rows.append({"b": c["params"]["b"], "fmt": c["params"]["fmt"], "gran": c["params"]["gran"],
                     "verdict": fig.get("verdict"), "ms": fig.get("ms"), "bf16_ms": base,
                     "speedup_over_bf16": base / fig["ms"] if base and fig.get("ms") else None,
                     "pct_of_ceiling": fig.get("pct_of_ceiling"), "bound": fig.get("bound")})
    return rows


def main() -> int:
    from bench_cases import OneLineParser, run

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="b 8 only")
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
        return tune(args.out)
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
        print(f"kvquant b={r['b']} {r['fmt']}/{r['gran']}: {r['ms']} ms, {sp} the bf16 cache, {pct} of {r['bound']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
