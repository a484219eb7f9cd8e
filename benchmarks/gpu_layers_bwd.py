"""GPU benchmark of the Triton layer backward kernels on Hopper: RMSNorm, LayerNorm and SwiGLU backward
(kernels/triton/norm_backward.py, kernels/triton/mlp.py) beside eager torch's autograd and liger-kernel.

    python benchmarks/gpu_layers_bwd.py [--quick] [--out PATH]            # a thin caller of `parity bench`
    python benchmarks/gpu_layers_bwd.py --direct [--quick] [--out PATH]   # the measurement by hand

By default the shapes below go to `parity bench` (benchmarks/bench_cases.py) as norm.rms_norm_backward
(with the forward's rstd), norm.layer_norm_backward (with a bias, mean and rstd) and
mlp.swiglu_backward (split gate / up), backends triton (ours), torch's and liger: every case judged by
the gate, timed with do_bench, its bytes over the copy ceiling of the same run, each peer's ms over
ours. torch is the peer --direct times: `torch-norm` (F.rms_norm / F.layer_norm, ATen's fused backward)
for the norms, not the eager float32 composite that `torch` (the gate's baseline) differentiates;
`torch` (silu(gate) * up) for SwiGLU. The peers' backward is timed without their forward, as below
(`Backend.timed`: the forward once, untimed, then autograd.grad with retain_graph).

--direct: copy bandwidth first (a 512 MiB device-to-device copy, bytes read + written, do_bench median), then per
shape and dtype, each backward timed alone (do_bench medians):
  rms_bwd   ours: dx, dw from x, w, the forward's fp32 rstd and dy;  bytes = x + dy read, dx written
  ln_bwd    ours: dx, dw, db from x, w, mean, rstd, dy;               bytes as rms_bwd
  swiglu_bwd ours: dgate, dup from gate, up, dy (split layout);       bytes = gate + up + dy read, 2 written
  torch: torch.autograd.grad through one kept forward (F.rms_norm, F.layer_norm, silu(gate) * up),
  liger (where liger-kernel imports): LigerRMSNormFunction / LigerLayerNormFunction / LigerSiLUMulFunction's
  backward the same way (liger recomputes what it did not save, as in training).
The ceiling is the copy rate of this run; each row gives ms, GB/s, % of copy and the ratio to each peer.
Each row's line gives the gate's verdict and norm_err for ours on the same case (bench_cases.Gate:
the op, params and dtype of `entries` on the triton backend); a case the gate fails makes the exit
status 1.
Results go to --out (default $OUT/layers-bwd-bench.json), rewritten after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


SHAPES = [(16384, 4096), (32768, 4096), (16384, 8192), (4096, 14336)]  # (rows, n), the --direct shapes
QUICK_SHAPE = (8192, 4096)  # bench --quick: 64 MiB per bf16 operand, past L2, its first line in seconds


def _params(op: str, rows: int, n: int) -> dict:
    """The case parameters of one op at one shape (the same in `entries` and --direct's gate check)."""
    return {"norm.rms_norm_backward": dict(rows=rows, n=n, pad=0, eps="1e-6", gemma=0, residual=0, rstd=1),
            "norm.layer_norm_backward": dict(rows=rows, n=n, pad=0, eps="1e-5", bias=1, stats=1),
            "mlp.swiglu_backward": dict(t=rows, i=n, layout="split")}[op]


def entries(quick: bool = False) -> list[dict]:
    """The benchmark's cases as suite entries (bench_cases.run): bf16 at every shape, fp32 at the first two;
    --quick: bf16 at QUICK_SHAPE."""
    todo = [("bf16", QUICK_SHAPE)] if quick else [("bf16", s) for s in SHAPES] + [("fp32", s) for s in SHAPES[:2]]
    out = []
    for dtype in dict.fromkeys(d for d, _ in todo):
        shapes = [s for d, s in todo if d == dtype]
        out += [{"op": op, "backends": backends, "dtypes": [dtype], "params": [_params(op, r, n) for r, n in shapes]}
                for op, backends in (("norm.rms_norm_backward", ["triton", "torch-norm", "liger"]),
                                     ("norm.layer_norm_backward", ["triton", "torch-norm", "liger"]),
                                     ("mlp.swiglu_backward", ["triton", "torch", "liger"]))]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="bf16 only: one 8192 x 4096 shape (--direct: the first two shapes)")
    p.add_argument("--direct", action="store_true", help="the measurement by hand instead of parity bench")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "layers-bwd-bench.json"))
    args = p.parse_args()
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(p.prog, "--out", args.out)
    if not args.direct:
        from bench_cases import run

        return run(entries(args.quick), out=args.out, ours="triton", argv=("--no-recheck",),
                   description="benchmarks/gpu_layers_bwd.py")
    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    from bench_cases import Gate

    from kernel_parity.kernels.triton import mlp as M
    from kernel_parity.kernels.triton import norm_backward as NB

    dev = torch.device("cuda")
    kw = dict(warmup=10, rep=50 if args.quick else 150, return_mode="median")
    bench = lambda fn: float(do_bench(fn, **kw))  # noqa: E731
    big = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    copy_gbs = 2 * big.numel() / bench(lambda: dst.copy_(big)) / 1e6
    del big, dst
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_gbs": copy_gbs, "rows": []}
    print(f"device {out['device']}  copy {copy_gbs:.0f} GB/s", flush=True)
    peers = _peers()
    gate = Gate("triton")
    out["peers"] = {k: (v if isinstance(v, str) else "available") for k, v in peers.items()}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    shapes = SHAPES
    todo = [("bf16", s) for s in shapes] + [("fp32", s) for s in shapes[:2]]
    if args.quick:
        todo = todo[:2]
    for dname, (rows, n) in todo:
        dt = dtypes[dname]
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, n, device=dev, generator=g).to(dt)
        dy = torch.randn(rows, n, device=dev, generator=g).to(dt)
        dy_saved = dy.clone()
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dt)
        b = (0.1 * torch.randn(n, device=dev, generator=g)).to(dt)
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1) + 1e-6)
        mean = x32.mean(-1)
        lrstd = torch.rsqrt((x32 - mean[:, None]).pow(2).mean(-1) + 1e-5)
        del x32
        el = x.element_size() * rows * n
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        db = torch.empty_like(w)

        def torch_grad(fwd, leaves):
            leaves = [t.detach().requires_grad_(True) for t in leaves]
            y = fwd(*leaves)
            return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

        rms_rows = {
            "ours": lambda: NB.rms_norm_backward(x, w, rstd, dy, out_dx=dx, out_dw=dw),
            "torch": torch_grad(lambda a, c: F.rms_norm(a, (n,), c, 1e-6), (x, w)),
        }
        if not isinstance(peers.get("liger"), str):
            rms_rows["liger"] = torch_grad(lambda a, c: peers["liger"]["rms"](a, c, 1e-6), (x, w))
        verdict = gate("norm.rms_norm_backward", dname, _params("norm.rms_norm_backward", rows, n))
        _row(out, bench, copy_gbs, dict(op="rms_bwd", dtype=dname, rows=rows, n=n, gate=verdict), rms_rows, 3 * el)

        ln_rows = {
            "ours": lambda: NB.layer_norm_backward(x, w, mean, lrstd, dy, out_dx=dx, out_dw=dw, out_db=db),
            "torch": torch_grad(lambda a, c, d: F.layer_norm(a, (n,), c, d, 1e-5), (x, w, b)),
        }
        if not isinstance(peers.get("liger"), str) and "ln" in peers["liger"]:
            ln_rows["liger"] = torch_grad(lambda a, c, d: peers["liger"]["ln"](a, c, d, 1e-5), (x, w, b))
        verdict = gate("norm.layer_norm_backward", dname, _params("norm.layer_norm_backward", rows, n))
        _row(out, bench, copy_gbs, dict(op="ln_bwd", dtype=dname, rows=rows, n=n, gate=verdict), ln_rows, 3 * el)

        if not torch.equal(dy, dy_saved):  # a peer wrote into an input: said, and the timings below use a fresh copy
            out.setdefault("input_clobbered", []).append(f"{dname} {rows}x{n}: dy changed during the norm timings")
            dy.copy_(dy_saved)
        up = torch.randn(rows, n, device=dev, generator=g).to(dt)
        dgate, dup = torch.empty_like(x), torch.empty_like(x)
        glu_rows = {
            "ours": lambda: M.glu_backward("swiglu", x, up, dy, out_dgate=dgate, out_dup=dup),
            "torch": torch_grad(lambda a, c: F.silu(a) * c, (x, up)),
        }
        if not isinstance(peers.get("liger"), str) and "swiglu" in peers["liger"]:
            glu_rows["liger"] = torch_grad(peers["liger"]["swiglu"], (x, up))
        verdict = gate("mlp.swiglu_backward", dname, _params("mlp.swiglu_backward", rows, n))
        _row(out, bench, copy_gbs, dict(op="swiglu_bwd", dtype=dname, rows=rows, n=n, gate=verdict), glu_rows, 5 * el)
        del x, dy, up, dx, dgate, dup
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["gate_failures"] = gate.failures
    Path(args.out).write_text(json.dumps(out, indent=1))
    for f in gate.failures:
        print("GATE FAIL", f, flush=True)
    return 1 if gate.failures else 0


def _row(out: dict, bench, copy_gbs: float, row: dict, calls: dict, nbytes: int) -> None:
    from bench_cases import gate_text

    for name, call in calls.items():
        try:
            ms = bench(call)
            row[name] = {"ms": ms, "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / copy_gbs}
        except Exception as e:  # a peer that cannot take this shape: said, not fatal
            row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    ours = row.get("ours")
    if isinstance(ours, dict):
        row["ratio"] = {k: v["ms"] / ours["ms"] for k, v in row.items()
                        if isinstance(v, dict) and "ms" in v and k != "ours"}  # > 1: ours faster
    out["rows"].append(row)
    parts = [f"{k} {v['ms']:.4f} ms {v['pct_copy']:5.1f}%" if isinstance(v, dict) and "ms" in v else f"{k}: {v}"
             for k, v in row.items() if k in calls]
    print(f"{row['dtype']} {row['rows']}x{row['n']} {row['op']:<10} " + "   ".join(parts)
          + (f"   {gate_text(row['gate'])}" if "gate" in row else ""), flush=True)


def _peers() -> dict:
    out: dict = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: liger's default writes dX into dY's storage, which would corrupt the shared dy
        # of every later timing and check in this script
        calls = {"rms": lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)}
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            calls["ln"] = lambda x, w, b, eps: LigerLayerNormFunction.apply(x, w, b, eps)
        except Exception:  # noqa: BLE001 - an older liger without it
            pass
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            calls["swiglu"] = lambda a, c: LigerSiLUMulFunction.apply(a, c)
        except Exception:  # noqa: BLE001
            pass
        out["liger"] = calls
    except Exception as e:  # noqa: BLE001 - not installed, or it does not import with this torch
        out["liger"] = f"not available: {type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    sys.exit(main())
