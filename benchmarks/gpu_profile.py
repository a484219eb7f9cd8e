"""Nsight Compute profiles of issue 19's kernels and their peers, at the table's shapes (a Hopper GPU).

    python benchmarks/gpu_profile.py [--out PATH] [--targets a,b,...] [--ncu PATH] [--list]
    python benchmarks/gpu_profile.py --target NAME        (what ncu runs: one target, once, in an NVTX range)

What bounds a kernel is read from the hardware counters, not guessed: for every target (ours and the peer
it is measured against, one process each) ncu profiles the kernels launched inside the NVTX range
`profile` (after warm-up calls outside it, so compilation and autotuning are not profiled) with the
sections SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats, Occupancy and LaunchStats,
`--clock-control none` (the clocks as the benchmarks see them). The raw page of each report is parsed
into, per kernel: duration, SM / memory / DRAM throughput (% of peak), issue-slot use, IPC, achieved
occupancy, registers, the utilisation of every pipe the sections report (tensor pipes included), and the
warp-stall reasons ranked by cycles per issued instruction. Results: --out (default
$OUT/profile-<device>.json), rewritten after each target; a target that fails records its error and the
run goes on. Needs ncu (Firecracker machines; gVisor has no counters: device/H200.md).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats")
SUMMARY = {  # raw metric -> summary key
    "gpu__time_duration.sum": "duration",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_throughput_pct",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
    "sm__issue_active.avg.pct_of_peak_sustained_elapsed": "issue_slots_busy_pct",
    "sm__inst_executed.avg.per_cycle_active": "ipc_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic",
    "smsp__average_warps_active_per_inst_executed.ratio": "warps_active_per_issue",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1_throughput_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_throughput_pct",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE = re.compile(r"^sm__((?:inst_executed_)?pipe_\w+)\.avg\.pct_of_peak_sustained_active$")


# ------------------------------------------------------------------ targets (the child process)

def _ctx():
    import torch
    return SimpleNamespace(torch=torch, dev=torch.device("cuda"), gen=torch.Generator(device="cuda").manual_seed(0))


def _q8(fmt: str, m: int, n: int = 14336, k: int = 4096, kernel: str = "default"):
    from gpu_gemm_tune import ggml_random
    from kernel_parity.kernels.triton import gemm_q8 as Q
    c = _ctx()
    a = c.torch.randn((m, k), device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    w = ggml_random(c, fmt, n, k)
    quantized = (Q.quantize_q8_k if fmt == "q4_k" else Q.quantize_q8_0)(a)
    out = c.torch.empty((m, n), dtype=a.dtype, device=c.dev)
    if kernel == "gluon":  # kernels/gluon/gemv.py / gemv_q8_0.py at the default config, quantizer included
        from kernel_parity.kernels.gluon import gemv as GV
        from kernel_parity.kernels.gluon import gemv_q8_0 as GV8
        return lambda: (GV.gemv_q4_k if fmt == "q4_k" else GV8.gemv_q8_0)(a, w, out=out)
    if kernel == "gemv":  # the dp4a GEMV whatever M is
        return lambda: Q.launch_gemv(fmt, quantized, w, None, out, Q.default_config(fmt, min(m, 8), n))
    if kernel == "prefetch":  # MMQ at its default tile with PREFETCH
        from kernel_parity.kernels.triton import gemm_mmq as MMQ
        cfg = MMQ.default_config(fmt, m, n)[:5] + (None, 1)
        return lambda: MMQ.launch_mmq(fmt, quantized, w, None, out, cfg)
    return lambda: Q.gemm_nt_q8(a, fmt, w, out=out)


def _torch_mm(m: int, n: int, k: int):
    c = _ctx()
    a = c.torch.randn((m, k), device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    w = c.torch.randn((n, k), device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    return lambda: a @ w.T


def _prefill_q4k():
    from gpu_gemm_tune import ggml_random
    from kernel_parity.kernels.triton import gemm as G
    c = _ctx()
    a = c.torch.randn((4096, 4096), device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    w = ggml_random(c, "q4_k", 14336, 4096)
    return lambda: G.gemm_nt(a, "q4_k", w)


def _fp8(peer: bool, gluon: bool = False):
    from kernel_parity.kernels.triton import gemm_fp8 as F
    c = _ctx()
    torch, n = c.torch, 8192
    a = torch.randn((n, n), device=c.dev, generator=c.gen).to(torch.bfloat16)
    blocks = (torch.randn((n, n), device=c.dev, generator=c.gen) * 0.02).view(n // 128, 128, n // 128, 128)
    sw = (blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4) / 448.0).float().contiguous()
    qw = (blocks / sw[:, None, :, None]).view(n, n).to(torch.float8_e4m3fn)
    qa, sa = F.act_quant_fp8(a, 1, 128)
    if peer:
        return lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16)
    if gluon:  # kernels/gluon/gemm_fp8.py, the activation quantizer included (the acceptance row)
        from kernel_parity.kernels.gluon import gemm_fp8 as GF
        return lambda: GF.gemm_fp8(a, qw, sw)
    return lambda: F.gemm_fp8_scaled(qa, sa, qw, sw)


def _mla_ctx():
    """_ctx() with what gpu_mla_tune.Tune's input builders read of their instance (rnd, big_cache)."""
    from gpu_mla_tune import Tune
    c = _ctx()
    c.rnd = lambda *s: c.torch.randn(s, device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    c.big_cache = lambda b, L: Tune.big_cache(c, b, L)
    return c


def _mla(s_q: int, h_q: int, L: int = 4096, b: int = 128, gluon: bool = False):
    from gpu_mla_tune import D
    from kernel_parity.kernels.triton.mla import mla_decode
    c = _mla_ctx()
    cache, table, sl = c.big_cache(b, L)
    q = c.torch.randn((b, s_q, h_q, D), device=c.dev, generator=c.gen).to(c.torch.bfloat16)
    if gluon:  # kernels/gluon/mla.py
        from kernel_parity.kernels.gluon import mla as GM
        return lambda: GM.mla_decode(q, cache, table, sl, 1 / math.sqrt(D))
    return lambda: mla_decode(q, cache, table, sl, 1 / math.sqrt(D))


def _mla_fused(h_q: int = 128, L: int = 4096, b: int = 128):
    from gpu_mla_tune import Tune
    from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8
    c = _mla_ctx()
    args, _ = Tune.fused_inputs(c, b, h_q, L)
    return lambda: mla_decode_fused_fp8(*args, max_new_tokens=1)


def _attention(who: str, b: int, s: int, d: int):
    c = _ctx()
    torch = c.torch
    q = torch.randn((b, s, 32, d), device=c.dev, generator=c.gen).to(torch.bfloat16)
    k = torch.randn((b, s, 8, d), device=c.dev, generator=c.gen).to(torch.bfloat16)
    v = torch.randn((b, s, 8, d), device=c.dev, generator=c.gen).to(torch.bfloat16)
    if who == "triton":
        from kernel_parity.kernels.triton import attention
        return lambda: attention.prefill(q, k, v, causal="bottom_right")
    if who == "gluon":
        from kernel_parity.kernels.gluon import attention as GA
        return lambda: GA.prefill(q, k, v, causal="bottom_right")
    if who == "fa4":
        from flash_attn.cute import flash_attn_func
        return lambda: flash_attn_func(q, k, v, causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return run


TARGETS = {  # name: (issue 19's row, what, builder)
    "gemv-q4k-m1": ("GEMV M=1", "triton-q8 Q4_K 14336x4096 (quantizer + dp4a GEMV)", lambda: _q8("q4_k", 1)),
    "gemv-q8_0-m1": ("GEMV M=1", "triton-q8 Q8_0 14336x4096", lambda: _q8("q8_0", 1)),
    "torch-gemv-bf16": ("GEMV M=1", "torch bf16 GEMV 1x14336x4096 (the peer)", lambda: _torch_mm(1, 14336, 4096)),
    "decode-q4k-m16": ("decode M=4/16", "triton-q8 Q4_K M=16 14336x4096 (the launcher's path)", lambda: _q8("q4_k", 16)),
    "decode-q4k-m16-dp4a": ("decode M=4/16", "triton-q8 dp4a GEMV at M=16", lambda: _q8("q4_k", 16, kernel="gemv")),
    "decode-q4k-m4": ("decode M=4/16", "triton-q8 Q4_K M=4 (the launcher's path)", lambda: _q8("q4_k", 4)),
    "decode-q8_0-m16": ("decode M=4/16", "triton-q8 Q8_0 M=16 (the launcher's path)", lambda: _q8("q8_0", 16)),
    "mmq-q4k-m16-prefetch": ("decode M=4/16", "MMQ Q4_K M=16, default tile with PREFETCH",
                             lambda: _q8("q4_k", 16, kernel="prefetch")),
    "mmq-q8_0-m16-prefetch": ("decode M=4/16", "MMQ Q8_0 M=16, default tile with PREFETCH",
                              lambda: _q8("q8_0", 16, kernel="prefetch")),
    "prefill-q4k": ("prefill Q4_K", "gemm_nt q4_k 4096x14336x4096 bf16", _prefill_q4k),
    "torch-mm-bf16": ("prefill Q4_K", "torch bf16 4096x14336x4096 (the peer)", lambda: _torch_mm(4096, 14336, 4096)),
    "fp8-block": ("FP8 block", "gemm_fp8_scaled 8192^3 1x128 / 128x128", lambda: _fp8(False)),
    "scaled-mm-block": ("FP8 block", "torch._scaled_mm blockwise 8192^3 (the peer)", lambda: _fp8(True)),
    "mla-h128": ("MLA h_q=128", "mla_decode b128 s_q1 h_q128 L4096", lambda: _mla(1, 128)),
    "mla-h64-sq2": ("MLA h_q 32/64 s_q=2", "mla_decode b128 s_q2 h_q64 L4096", lambda: _mla(2, 64)),
    "mla-h32-sq2": ("MLA h_q 32/64 s_q=2", "mla_decode b128 s_q2 h_q32 L4096", lambda: _mla(2, 32)),
    "mla-fused-h128": ("fused FP8 MLA", "mla_decode_fused_fp8 b128 h_q128 L4096", _mla_fused),
    "attn-d128": ("causal prefill", "attention.prefill b16 s4096 32/8 d128 causal", lambda: _attention("triton", 16, 4096, 128)),
    "cudnn-d128": ("causal prefill", "SDPA cuDNN, same shape (the peer)", lambda: _attention("cudnn", 16, 4096, 128)),
    "fa4-d128": ("causal prefill", "flash-attn-4, same shape (the peer)", lambda: _attention("fa4", 16, 4096, 128)),
    "attn-d256": ("causal prefill", "attention.prefill b4 s1024 32/8 d256 causal", lambda: _attention("triton", 4, 1024, 256)),
    "cudnn-d256": ("causal prefill", "SDPA cuDNN, same shape", lambda: _attention("cudnn", 4, 1024, 256)),
    # issue 33: the Gluon kernels beside the same peers
    "gluon-fp8-block": ("FP8 block", "gluon gemm_fp8 8192^3 (quantizer + GEMM)", lambda: _fp8(False, gluon=True)),
    "gluon-attn-d128": ("causal prefill", "gluon prefill b16 s4096 32/8 d128 causal",
                        lambda: _attention("gluon", 16, 4096, 128)),
    "gluon-mla-h128": ("MLA h_q=128", "gluon mla_decode b128 s_q1 h_q128 L4096", lambda: _mla(1, 128, gluon=True)),
    "gluon-gemv-q4k": ("GEMV M=1", "gluon gemv_q4_k 14336x4096 (quantizer + TMA-fed GEMV, default config)",
                       lambda: _q8("q4_k", 1, kernel="gluon")),
    "gluon-gemv-q4k-short": ("GEMV M=1", "gluon gemv_q4_k 4096x14336 (quantizer + the GEMV in 7 K splits)",
                             lambda: _q8("q4_k", 1, 4096, 14336, kernel="gluon")),
    "gluon-gemv-q8_0": ("GEMV M=1", "gluon gemv_q8_0 14336x4096 (quantizer + TMA-fed GEMV, default config)",
                        lambda: _q8("q8_0", 1, kernel="gluon")),
}


def run_target(name: str) -> int:
    import torch
    fn = TARGETS[name][2]()
    for _ in range(3):  # compile, autotune, allocate: outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return 0


# ------------------------------------------------------------------ the driver

def _num(v: str):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return v


def parse_raw(text: str) -> list[dict]:
    """ncu's `--page raw --csv`: a header row of metric names, a row of units, a row per kernel."""
    rows = list(csv.reader(io.StringIO("\n".join(l for l in text.splitlines() if l.startswith('"')))))
    if len(rows) < 3:
        return []
    names, units = rows[0], rows[1]
    kernels = []
    for r in rows[2:]:
        raw = {n: _num(v) for n, v in zip(names, r)}
        unit = dict(zip(names, units))
        k = dict(kernel=str(raw.get("Kernel Name", "?"))[:160])
        for metric, key in SUMMARY.items():
            if metric in raw:
                k[key] = raw[metric]
                if key == "duration":
                    k["duration_unit"] = unit.get(metric)
        stalls = {m.group(1): v for n, v in raw.items() if (m := STALL.match(n)) and isinstance(v, float)}
        k["stalls_top"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:8])
        pipes = {m.group(1): v for n, v in raw.items() if (m := PIPE.match(n)) and isinstance(v, float)}
        k["pipes_top"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:8])
        k["raw"] = {n: v for n, v in raw.items() if isinstance(v, float)}
        kernels.append(k)
    return kernels


def profile(name: str, ncu: str, tmp: Path) -> dict:
    rep = tmp / f"{name}"
    cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "profile/", "--target-processes", "all",
           "--launch-count", "12", "--force-overwrite", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--target", name]
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    row = dict(target=name, row=TARGETS[name][0], what=TARGETS[name][1], seconds=round(time.time() - t, 1))
    if not (tmp / f"{name}.ncu-rep").exists():
        row["error"] = f"ncu rc {p.returncode}: " + (p.stderr + p.stdout)[-1200:]
        return row
    q = subprocess.run([ncu, "-i", str(rep) + ".ncu-rep", "--csv", "--page", "raw"], capture_output=True, text=True,
                       timeout=300)
    row["kernels"] = parse_raw(q.stdout)
    if p.returncode or not row["kernels"]:
        row["error"] = f"ncu rc {p.returncode}: " + (p.stderr + p.stdout + q.stderr)[-1200:]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="JSON output (default $OUT/profile-<device>.json)")
    p.add_argument("--targets", default="", help="comma list (default all); --list names them")
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    if args.list:
        for n, (row, what, _) in TARGETS.items():
            print(f"{n:22s} {row:22s} {what}")
        return 0
    if args.target:
        if args.target not in TARGETS:
            print(f"gpu_profile: unknown target {args.target!r}; expected one of {', '.join(TARGETS)}", file=sys.stderr)
            return 2
        return run_target(args.target)
    names = [t for t in args.targets.split(",") if t] or list(TARGETS)
    bad = [t for t in names if t not in TARGETS]
    if bad:
        print(f"gpu_profile: unknown target(s) {', '.join(bad)}; expected names from: {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    if args.out:
        from kernel_parity.reports.files import check_output_or_exit
        check_output_or_exit(p.prog, "--out", args.out)  # before any GPU work: an unwritable path is exit 2
    import torch
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device; ncu profiles run on a GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in dev else "h100" if "H100" in dev else re.sub(r"\W+", "-", dev.lower())
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), f"profile-{tag}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    ver = subprocess.run([args.ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    doc = dict(device=dev, ncu=ver[-1] if ver else None, torch=torch.__version__, sections=SECTIONS,
               clock_control="none", time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), targets=[])
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "kp-profile"
    tmp.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            row = profile(name, args.ncu, tmp)
        except Exception as e:  # one target never stops the others
            row = dict(target=name, error=f"{type(e).__name__}: {e}"[:500])
        doc["targets"].append(row)
        for k in row.get("kernels", []):
            print(f"{name:20s} {k['kernel'][:48]:48s} {k.get('duration')} {k.get('duration_unit')} "
                  f"sm {k.get('sm_throughput_pct')} dram {k.get('dram_throughput_pct')} "
                  f"issue {k.get('issue_slots_busy_pct')} pipes {list(k['pipes_top'].items())[:3]} "
                  f"stalls {list(k['stalls_top'].items())[:3]}", flush=True)
        if "error" in row:
            print(f"{name}: ERROR {row['error'][-400:]}", file=sys.stderr, flush=True)
        out.write_text(json.dumps(doc, indent=1))
    return 0 if all("error" not in r for r in doc["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
