"""GPU benchmark of the RMSNorm / LayerNorm kernels (kernels/triton/norm.py) beside the peers, on Hopper.

    python benchmarks/gpu_norm.py [--quick] [--out PATH]     # a thin caller of `parity bench`
    python benchmarks/gpu_norm.py --tune [--quick] [--out PATH]

By default the cases below (Llama-3 / Qwen2 widths and narrow rows, bf16 and fp32; RMSNorm plain,
with rstd, with the fused residual; LayerNorm with a bias, with mean / rstd) go to `parity bench`
(benchmarks/bench_cases.py) with backends triton (ours), torch (our eager composition), torch-norm
(F.rms_norm / F.layer_norm), liger and quack (the `peers` extra; a skip with the reason where they
do not install or cannot express a case): every case judged by the gate, timed with do_bench, its
bytes over the copy ceiling measured in the same run, and each peer's ms over ours.
--tune instead times the fused kernel directly over num_warps (and rows per program) beside torch and
the peers' own entry points, the sweep that picked the launch table; each timed form's line gives the
gate's verdict and norm_err for the same case (bench_cases.Gate: norm.rms_norm / norm.layer_norm with
those params and dtype on the triton backend), and a case the gate fails makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [(16384, 4096), (32768, 4096), (16384, 8192), (32768, 8192), (4096, 3584), (65536, 128), (4096, 1024)]
BACKENDS = ["triton", "torch", "torch-norm", "liger", "quack"]


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run); --quick: bf16 at the first shape, RMSNorm
    plain and with the residual, LayerNorm with the bias (three input groups, a first line in seconds)."""
    if quick:
        r, n = SHAPES[0]
        return [{"op": "norm.rms_norm", "backends": BACKENDS, "dtypes": ["bf16"],
                 "params": [dict(rows=r, n=n, pad=0, eps="1e-6", gemma=0, residual=res, rstd=0) for res in (0, 1)]},
                {"op": "norm.layer_norm", "backends": BACKENDS, "dtypes": ["bf16"],
                 "params": [dict(rows=r, n=n, pad=0, eps="1e-5", bias=1, stats=0)]}]
    rms = [dict(rows=r, n=n, pad=0, eps="1e-6", gemma=0, residual=res, rstd=rs)
           for r, n in SHAPES for res, rs in ((0, 0), (0, 1), (1, 0))]
    ln = [dict(rows=r, n=n, pad=0, eps="1e-5", bias=1, stats=st) for r, n in SHAPES for st in (0, 1)]
    return [{"op": "norm.rms_norm", "backends": BACKENDS, "dtypes": ["bf16", "fp32"], "params": rms},
            {"op": "norm.layer_norm", "backends": BACKENDS, "dtypes": ["bf16", "fp32"], "params": ln}]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm_bench.json"))
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    if args.tune:
        return tune(args)
    from bench_cases import run

    return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
               description="benchmarks/gpu_norm.py")


def tune(args: argparse.Namespace) -> int:
    """The direct measurement with the launch-table sweep (ours, torch, the peers' entry points)."""
    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate, gate_text

    from kernel_parity.kernels.triton import norm as K

    dev = torch.device("cuda")
    kw = dict(warmup=10, rep=50 if args.quick else 200, return_mode="median")
    bench = lambda fn: float(do_bench(fn, **kw))  # noqa: E731
    big = torch.empty(1 << 29, dtype=torch.uint8, device=dev)  # 512 MiB
    dst = torch.empty_like(big)
    copy_ms = bench(lambda: dst.copy_(big))
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    del big, dst
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_gbs": copy_gbs, "rows": []}
    print(f"device {out['device']}  copy {copy_gbs:.0f} GB/s", flush=True)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    shapes = SHAPES[:2] if args.quick else SHAPES
    gate = Gate("triton")
    for dname in ("bf16", "fp32"):
        dt = dtypes[dname]
        for rows, n in shapes:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(rows, n, device=dev, dtype=torch.float32, generator=g).to(dt)
            r = torch.randn(rows, n, device=dev, dtype=torch.float32, generator=g).to(dt)
            w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dt)
            b = torch.randn(n, device=dev, generator=g).to(dt)
            y, h = torch.empty_like(x), torch.empty_like(x)
            rstd = torch.empty(rows, device=dev, dtype=torch.float32)
            mean = torch.empty_like(rstd)
            el = x.element_size() * rows * n
            rms = dict(rows=rows, n=n, pad=0, eps="1e-6", gemma=0, residual=0, rstd=0)
            ln = dict(rows=rows, n=n, pad=0, eps="1e-5", bias=1, stats=0)
            # name: (ours, torch's, bytes, the case the gate judges: op and params as in `entries`)
            cases = {
                "rms": (lambda: K.rms_norm(x, w, 1e-6, out=y), lambda: F.rms_norm(x, (n,), w, 1e-6), 2 * el,
                        ("norm.rms_norm", rms)),
                "rms+rstd": (lambda: K.rms_norm(x, w, 1e-6, out=y, out_rstd=rstd), None, 2 * el,
                             ("norm.rms_norm", {**rms, "rstd": 1})),
                "rms_residual": (lambda: K.rms_norm(x, w, 1e-6, residual=r, out=y, out_h=h),
                                 lambda: F.rms_norm(torch.add(x, r, out=h), (n,), w, 1e-6), 4 * el,
                                 ("norm.rms_norm", {**rms, "residual": 1})),
                "layer_norm": (lambda: K.layer_norm(x, w, b, 1e-5, out=y), lambda: F.layer_norm(x, (n,), w, b, 1e-5),
                               2 * el, ("norm.layer_norm", ln)),
                "layer_norm+stats": (lambda: K.layer_norm(x, w, b, 1e-5, out=y, out_mean=mean, out_rstd=rstd), None,
                                     2 * el, ("norm.layer_norm", {**ln, "stats": 1})),
            }
            peers = _peer_calls(x, w, r, n)
            for name, (ours, theirs, nbytes, (op, params)) in cases.items():
                ms = bench(ours)
                tms = bench(theirs) if theirs is not None else None
                verdict = gate(op, dname, params)
                row = dict(dtype=dname, rows=rows, n=n, op=name, ms=ms, gbs=nbytes / ms / 1e6,
                           pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, torch_ms=tms,
                           torch_pct=None if tms is None else 100 * nbytes / tms / 1e6 / copy_gbs, gate=verdict)
                row["peers"] = {}
                for peer, calls in peers.items():
                    call = calls.get(name) if isinstance(calls, dict) else None
                    if call is None:
                        row["peers"][peer] = calls if isinstance(calls, str) else "no such form"
                        continue
                    try:
                        pms = bench(call)
                        row["peers"][peer] = {"ms": pms, "pct_copy": 100 * nbytes / pms / 1e6 / copy_gbs}
                    except Exception as e:  # a peer that cannot take this shape
                        row["peers"][peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                out["rows"].append(row)
                print(f"{dname} {rows}x{n} {name:<17} ours {ms:.4f} ms {row['pct_copy']:5.1f}%"
                      + ("" if tms is None else f"   torch {tms:.4f} ms {row['torch_pct']:5.1f}%")
                      + f"   {gate_text(verdict)}", flush=True)
            if args.tune and dname == "bf16":
                base_nw = K._num_warps
                base_tile = K.FUSED_TILE
                for tile in ((4096, 8192, 16384) if n < 4096 else (K.FUSED_TILE,)):
                    for nw in (2, 4, 8, 16, 32):
                        K._num_warps = lambda t, nw=nw: nw  # noqa: E731
                        K.FUSED_TILE = tile
                        try:
                            ms_r = bench(lambda: K.rms_norm(x, w, 1e-6, out=y))
                            ms_l = bench(lambda: K.layer_norm(x, w, b, 1e-5, out=y))
                        except Exception as e:  # a config that does not compile
                            print(f"  tune tile={tile} nw={nw}: {type(e).__name__}", flush=True)
                            continue
                        finally:
                            K._num_warps, K.FUSED_TILE = base_nw, base_tile
                        out["rows"].append(dict(dtype=dname, rows=rows, n=n, op="tune", tile=tile, num_warps=nw,
                                                rms_pct=100 * 2 * el / ms_r / 1e6 / copy_gbs,
                                                ln_pct=100 * 2 * el / ms_l / 1e6 / copy_gbs))
                        print(f"  tune tile={tile} nw={nw}: rms {100 * 2 * el / ms_r / 1e6 / copy_gbs:5.1f}%  "
                              f"ln {100 * 2 * el / ms_l / 1e6 / copy_gbs:5.1f}%", flush=True)
            del x, r, y, h
            torch.cuda.empty_cache()
    out["gate_failures"] = gate.failures
    Path(args.out).write_text(json.dumps(out, indent=1))
    for f in gate.failures:
        print("GATE FAIL", f, flush=True)
    return 1 if gate.failures else 0


def _peer_calls(x, w, r, n) -> dict:
    """{peer: {case name: zero-argument call} or the reason it does not run} for liger and quack's
    RMSNorm (the forms they expose; see conformance/backends/liger.py and quack.py)."""
    out: dict = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out["liger"] = {"rms": lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama")}
    except Exception as e:  # not installed, or it does not import with this torch
        out["liger"] = f"not available: {type(e).__name__}: {e}"
    try:
        from quack.rmsnorm import rmsnorm_fwd

        out["quack"] = {"rms": lambda: rmsnorm_fwd(x, w, eps=1e-6),
                        "rms_residual": lambda: rmsnorm_fwd(x, w, residual=r, eps=1e-6)}
    except Exception as e:
        out["quack"] = f"not available: {type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    sys.exit(main())
