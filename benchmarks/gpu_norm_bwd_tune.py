"""GPU sweep of the RMSNorm / LayerNorm backward's dispatch (kernels/triton/norm_backward.py) on Hopper.

    python benchmarks/gpu_norm_bwd_tune.py [--out PATH] [--shapes R1xN1,R2xN2]

Each variant sets the launcher's knobs (MAX_WIDE_N: the wide kernels up to this width; WIDE_WARPS / LN_WIDE_WARPS
of the wide kernels; PROGRAMS_PER_SM of step 1; REDUCE_BLOCK_N / REDUCE_BLOCK_P of step 2), then per shape (bf16) times
rms_norm_backward (no residual) and layer_norm_backward (with db) with do_bench (median), checks dx / dw (/ db)
against torch autograd in fp32 of the same inputs (max |diff| over max |ref|), and times the peers the same
way: torch's F.rms_norm / F.layer_norm backward (autograd.grad through one kept forward) and liger-kernel's
where it imports. Each shape also gets the gate's verdict and norm_err for the committed launcher
(bench_cases.Gate: the case's own inputs against the float64 golden); a case it fails makes the exit status 1. Bytes = x + dy read, dx written; % of the copy rate measured first in the same run.
Results: --out (default $OUT/norm-bwd-tune.json), rewritten after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {
    "committed": {},
    "before": dict(MAX_WIDE_N=8192, PROGRAMS_PER_SM=4, REDUCE_BLOCK_N=256),  # the launcher before the wide path
    "looped": dict(MAX_WIDE_N=8192),  # rows past 8192 lanes by the looped kernels
    "rms8": dict(WIDE_WARPS=8),
    "rms32": dict(WIDE_WARPS=32),
    "ln16": dict(LN_WIDE_WARPS=16),
    "ln4": dict(LN_WIDE_WARPS=4),
    "pps4": dict(PROGRAMS_PER_SM=4),
    "pps8": dict(PROGRAMS_PER_SM=8),
    "reduce256": dict(REDUCE_BLOCK_N=256),
    "reduce32-p64": dict(REDUCE_BLOCK_N=32, REDUCE_BLOCK_P=64),
}
SHAPES = ((16384, 14336), (4096, 14336), (16384, 4096), (8192, 4096))


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """--shapes: ROWSxN pairs of positive integers, comma-separated (argparse: a bad one is exit 2 naming it)."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not ROWSxN with positive integers (e.g. 16384x14336)")
        out.append((int(parts[0]), int(parts[1])))
    return tuple(out)


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown variant {', '.join(bad) or '(none given)'}; expected a comma list "
                                         f"of {', '.join(VARIANTS)}")
    return names


def main(argv=None) -> int:
    from bench_cases import OneLineParser

    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm-bwd-tune.json"))
    ap.add_argument("--shapes", default=None, type=_shapes, help="ROWSxN[,ROWSxN...] (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS), type=_variants,
                    help=f"a comma list of {', '.join(VARIANTS)}")
    a = ap.parse_args(argv)
    from kernel_parity.reports.files import check_output_or_exit

    check_output_or_exit(ap.prog, "--out", a.out)
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        ap.exit(2, f"{ap.prog}: error: needs a CUDA GPU (this machine has none)\n")

    from bench_cases import Gate
    from gpu_layers_bwd import _params

    from kernel_parity.kernels.triton import norm_backward as NB

    gate = Gate("triton")

    shapes = a.shapes or SHAPES
    defaults = {k: getattr(NB, k) for v in VARIANTS.values() for k in v}
    ms = lambda fn: float(do_bench(fn, warmup=10, rep=60, return_mode="median"))  # noqa: E731
    big = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    copy = 2 * big.numel() / ms(lambda: dst.copy_(big)) / 1e6
    del big, dst
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        liger = True
    except Exception as e:  # noqa: BLE001
        liger = repr(e)
    doc = {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "defaults": defaults, "liger": liger is True or liger,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    for rows, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        dy = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        x32, w32, b32 = (t.float().requires_grad_() for t in (x, w, b))
        rstd = torch.rsqrt(x32.detach().pow(2).mean(-1) + 1e-6)
        mean = x32.detach().mean(-1)
        lrstd = torch.rsqrt((x32.detach() - mean[:, None]).pow(2).mean(-1) + 1e-5)
        ref_rms = torch.autograd.grad(F.rms_norm(x32, (n,), w32, 1e-6), (x32, w32), dy.float())
        ref_ln = torch.autograd.grad(F.layer_norm(x32, (n,), w32, b32, 1e-5), (x32, w32, b32), dy.float())
        del x32, w32, b32
        gbs = lambda t: 3 * x.numel() * 2 / t / 1e6  # noqa: E731
        row = {"rows": rows, "n": n}

        def err(got, ref):
            return [float((u.float() - r).abs().max() / r.abs().max()) for u, r in zip(got, ref)]

        for vname in a.variants:
            for k, v in defaults.items():
                setattr(NB, k, v)
            for k, v in VARIANTS[vname].items():
                setattr(NB, k, v)
            for op in ("rms", "ln"):
                key = f"{op}-{vname}"
                try:
                    if op == "rms":
                        fn = lambda: NB.rms_norm_backward(x, w, rstd, dy)  # noqa: E731
                        e = err(fn(), ref_rms)
                    else:
                        fn = lambda: NB.layer_norm_backward(x, w, mean, lrstd, dy, bias=True)  # noqa: E731
                        e = err(fn(), ref_ln)
                    kind = NB._step1_shape(rows, n, x.device, (n,))[0]
                    t = ms(fn)
                    row[key] = {"ms": t, "gbs": gbs(t), "pct_copy": 100 * gbs(t) / copy, "rel_err": e, "kind": kind}
                except Exception as ex:  # noqa: BLE001
                    row[key] = repr(ex)[:300]
        for k, v in defaults.items():
            setattr(NB, k, v)
        # the gate's verdict for the committed launcher at this shape (bench_cases.Gate: the case's own inputs)
        row["gate"] = {op: gate(op, "bf16", _params(op, rows, n))
                       for op in ("norm.rms_norm_backward", "norm.layer_norm_backward")}
        peers = {}
        for op in ("rms", "ln"):
            leaves = [t.detach().requires_grad_() for t in ((x, w) if op == "rms" else (x, w, b))]
            fwd = {"torch": (lambda: F.rms_norm(leaves[0], (n,), leaves[1], 1e-6)) if op == "rms" else
                   (lambda: F.layer_norm(leaves[0], (n,), leaves[1], leaves[2], 1e-5))}
            if liger is True:
                fwd["liger"] = (lambda: LigerRMSNormFunction.apply(leaves[0], leaves[1], 1e-6)) if op == "rms" else \
                    (lambda: LigerLayerNormFunction.apply(leaves[0], leaves[1], leaves[2], 1e-5))
            for name, f in fwd.items():
                try:
                    y = f()
                    t = ms(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True))
                    peers[f"{op}-{name}"] = {"ms": t, "gbs": gbs(t), "pct_copy": 100 * gbs(t) / copy}
                except Exception as ex:  # noqa: BLE001
                    peers[f"{op}-{name}"] = repr(ex)[:300]
        row["peers"] = peers
        doc["rows"].append(row)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(rows, n, {k: round(v["pct_copy"], 1) if isinstance(v, dict) and "pct_copy" in v else v
                        for k, v in {**row, **peers}.items() if k not in ("rows", "n", "peers", "gate")},
              {op.split(".")[1]: g["verdict"] for op, g in row["gate"].items()}, flush=True)
    doc["gate_failures"] = gate.failures
    Path(a.out).write_text(json.dumps(doc, indent=1))
    return 1 if gate.failures else 0


if __name__ == "__main__":
    sys.exit(main())
