"""Compile a gluon kernel for Hopper (sm_90a) on a machine without a GPU, and read what ptxas says of it.

    python benchmarks/gluon_sm90.py gemm_fp8 [BLOCK_N STAGES GROUP_M REGS_MMA REGS_LOAD SKEW]
    python benchmarks/gluon_sm90.py prefill D MODE [BLOCK_N STAGES PIPE]      (MODE 0 none, 1 bottom-right, 2 top-left)
    python benchmarks/gluon_sm90.py mla [CAUSAL]                               (kernels/gluon/mla.py)
    python benchmarks/gluon_sm90.py mla_fused                                  (kernels/gluon/mla_fused.py)
    python benchmarks/gluon_sm90.py gemv [WARPS KB STAGES CTAS SPLITS]         (kernels/gluon/gemv.py)
    python benchmarks/gluon_sm90.py gemv_q8_0 [WARPS G STAGES CTAS SPLITS]     (kernels/gluon/gemv_q8_0.py)
    python benchmarks/gluon_sm90.py kvq_decode [D FMT GRAN PAGE GROUP STAGES] (kernels/gluon/kvquant_decode.py)
    options: --ptx PATH (keep the PTX), --ttgir PATH

Triton's compiler runs whole (Gluon front end, TTGIR passes, LLVM, PTX) behind a stand-in driver that answers
the target (cuda, sm 90) and a device / stream; then this Triton's bundled ptxas assembles the PTX with -v. It
prints `SHARED <bytes>` and ptxas's report: registers, spills (per kernel, the partitions together), and its
performance warnings, of which "wgmma.mma_async instructions are serialized" (C7510-C7515) is the one that
matters: a register move reading an accumulator in flight, or a loop that carries one across its back edge
with register operands, makes ptxas serialise every wgmma of the kernel. tests/test_gluon.py runs it on each
kernel's configs; in development it answers in seconds what a device call answers in minutes (the GPU
machine's Triton is older: its PTX may differ, not its front end's verdicts).
Exit 0 when it compiled (whatever ptxas warns), 1 when it did not, 2 on bad arguments (one line).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stand_in_driver() -> None:
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Driver:  # the compiler asks the active driver for the target and a device / stream only
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 64)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(_Driver())


def _desc(t, block, dtype):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def compile_gemm_fp8(config: list[int]):
    import torch
    from triton.experimental.gluon import language as gl

    from kernel_parity.kernels.gluon import gemm_fp8 as G
    from kernel_parity.kernels.gluon.compat import ws_list

    bn, st, gm, r1, r2, *rest = list(config) + list(G.GEMM_CONFIG)[len(config):]
    skew = rest[0] if rest else 1
    M, N, K = 256, 256, 1024
    qa = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    sa = torch.empty(K // 128, M).t()
    sw = torch.empty(N // 128, K // 128)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    f8 = gl.float8e4nv
    return G._gemm_fp8_kernel.warmup(
        _desc(qa, [128, 128], f8), _desc(w, [bn, 128], f8), _desc(out, [64, bn], gl.bfloat16), out, sa, sw, sw[0],
        M, N, K, 128, *sa.stride(), *sw.stride(), *out.stride(), HAS_BIAS=True, TMA_STORE=True, BLOCK_N=bn,
        GROUP_M=gm, STAGES=st, REGS_MMA=r1, REGS_LOAD=r2, WS_LIST=ws_list(), SKEW=bool(skew), num_warps=4, grid=(1,))


def compile_prefill(d: int, mode: int, config: list[int]):
    import torch
    from triton.experimental.gluon import language as gl

    from kernel_parity.kernels.gluon import attention as A
    from kernel_parity.kernels.gluon.compat import ws_list

    bn, st, pipe = list(config) + list(A.CONFIGS[d])[len(config):]
    b, s, h = 2, 512, 4
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s)
    q2 = A._rows_view(q)
    bf = gl.bfloat16
    return A._prefill_kernel.warmup(
        _desc(q2, [128, d], bf), _desc(q2, [bn, d], bf), _desc(q2, [bn, d], bf), o, lse, s, s, h, 1, 0.1,
        *o.stride()[:3], *lse.stride(), DIAG_MODE=mode, D=d, BLOCK_N=bn, STAGES=st, REGS_MMA=A.REGS[0],
        REGS_LOAD=A.REGS[1], WS_LIST=ws_list(), PIPE=int(pipe), num_warps=4, enable_fp_fusion=False, grid=(1,))


def compile_mla(causal: int):
    import torch
    from triton.experimental.gluon import language as gl

    from kernel_parity.kernels.gluon import mla as G
    from kernel_parity.kernels.gluon.compat import ws_list

    b, s_q, h_q, page, blocks = 2, 2 if causal else 1, 64, 64, 8
    q2 = torch.empty(b * s_q * h_q, 576, dtype=torch.bfloat16)
    c2 = torch.empty(blocks * page, 576, dtype=torch.bfloat16)
    o = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16)
    lse = torch.empty(b, h_q, s_q)
    table = torch.zeros(b, blocks, dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    bf = gl.bfloat16
    return G._mla_seesaw_kernel.warmup(
        _desc(q2, [64, 256], bf), _desc(q2, [64, 64], bf), _desc(c2, [64, 256], bf), _desc(c2, [64, 64], bf), o, lse,
        table, lens, table.stride(0), s_q * h_q, s_q, h_q, page, 0.1, *o.stride()[:3], *lse.stride(),
        CAUSAL=bool(causal), REGS_MMA=G.REGS[0], REGS_LOAD=G.REGS[1], WS_LIST=ws_list(), num_warps=4,
        enable_fp_fusion=False, grid=(1,))


def compile_mla_fused():
    import torch
    from triton.experimental.gluon import language as gl

    from kernel_parity.kernels.gluon import mla_fused as G
    from kernel_parity.kernels.gluon.compat import ws_list

    b, h_q, page, blocks = 2, 16, 64, 8
    q1 = torch.empty(b * h_q, 576, dtype=torch.bfloat16)
    c2 = torch.empty(blocks * page, 576, dtype=torch.bfloat16)
    acc = torch.empty(b * h_q, 512)
    m = torch.empty(b * h_q)
    off = torch.zeros(b + 1, dtype=torch.int32)
    table = torch.zeros(b, blocks, dtype=torch.int32)
    bf = gl.bfloat16
    return G._mla_fused_cached_kernel.warmup(
        _desc(q1, [64, 256], bf), _desc(q1, [64, 64], bf), _desc(q1, [64, 256], bf), _desc(q1, [64, 64], bf),
        _desc(c2, [32, 256], bf), _desc(c2, [32, 64], bf), acc, m, m, off, off, table, table.stride(0), h_q, page,
        0.1, REGS_MMA=G.REGS[0], REGS_LOAD=G.REGS[1], WS_LIST=ws_list(), num_warps=4, enable_fp_fusion=False,
        grid=(1,))


def compile_gemv(config: list[int]):
    import torch

    from kernel_parity.kernels.gluon import gemv as G

    warps, kb, stages, _, *rest = list(config) + list(G.GEMV_CONFIG)[len(config):]
    splits = rest[0] if rest else 1
    N, nb = 512, 16
    w = torch.empty(N, nb * 144, dtype=torch.uint8)
    codes_desc, hdr_desc = G.descriptors(w, 8 * warps, kb)
    q = torch.empty(nb * 64, dtype=torch.int32)
    d = torch.empty(nb)
    s = torch.empty(nb * 8, dtype=torch.int32)
    out = torch.empty(1, N, dtype=torch.bfloat16)
    ws = torch.empty(splits, N)
    cnt = torch.zeros(N, dtype=torch.int32)
    return G._gemv_q4_k_tma_kernel.warmup(codes_desc, hdr_desc, q, d, s, d, out, ws, cnt, N, nb, 1, HAS_BIAS=True,
                                          WARPS=warps, KB=kb, STAGES=stages, SPLITS=splits, num_warps=warps,
                                          grid=(1,))


def compile_gemv_q8_0(config: list[int]):
    import torch

    from kernel_parity.kernels.gluon import gemv_q8_0 as G

    warps, g, stages, _, *rest = list(config) + list(G.GEMV_Q8_0_CONFIG)[len(config):]
    splits = rest[0] if rest else 1
    N, ng = 512, 16
    w = torch.empty(N, ng * 272, dtype=torch.uint8)
    descs = G.descriptors(w, 32 // g * warps, g)
    q = torch.empty(ng * 64, dtype=torch.int32)
    d = torch.empty(ng * 8)
    out = torch.empty(1, N, dtype=torch.bfloat16)
    ws = torch.empty(splits, N)
    cnt = torch.zeros(N, dtype=torch.int32)
    return G._gemv_q8_0_tma_kernel.warmup(*descs, q, d, d, out, ws, cnt, N, ng, 1, HAS_BIAS=True, WARPS=warps, G=g,
                                          STAGES=stages, SPLITS=splits, num_warps=warps, grid=(1,))


def compile_kvq_decode(config: list[int]):
    import torch

    from kernel_parity.kernels.gluon import kvquant_decode as G

    d, fmt, gran, page, group, stages = list(config) + [128, 0, 0, 16, 4, G.STAGES][len(config):]
    b, h_kv, nb = 2, 2, 8
    q = torch.empty(b, h_kv * group, d, dtype=torch.bfloat16)
    cache = torch.empty(nb, page, h_kv, d // 4, dtype=torch.int32)
    sc = torch.empty(nb, page, h_kv) if gran == 2 else torch.empty(h_kv if gran == 1 else 1)
    bt = torch.empty(b, 4, dtype=torch.int32)
    lens = torch.empty(b, dtype=torch.int32)
    o = torch.empty(2, b, h_kv * group, d)
    lse = torch.empty(2, b, h_kv * group)
    ss = sc.stride() if gran == 2 else (0, 0, 0)
    cap = G.register_cap(group)
    return G._kvq_decode_gluon_kernel.warmup(
        q, cache, cache, sc, sc, bt, lens, o, lse, h_kv, 64, 0.1, 0, *q.stride()[:2], *cache.stride()[:3],
        *cache.stride()[:3], *ss, *bt.stride(), *o.stride()[:3], *lse.stride(), FMT=fmt, GRAN=gran, PAGE=page, D=d,
        GROUP=group, POWC=G.POW[fmt], PMUL=2.0 ** G.POW[fmt], STAGES=stages, num_warps=1,
        **({"maxnreg": cap} if cap else {}), grid=(1,))


def ptxas_report(ptx: str) -> str:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next((bin_dir / n for n in ("ptxas-blackwell", "ptxas") if (bin_dir / n).exists()), None)
    if ptxas is None:
        return "no ptxas bundled with this Triton"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    return r.stdout + r.stderr


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cases import OneLineParser

    ap = OneLineParser(description=__doc__.split("\n")[0])  # a bad argument: one line, exit 2
    ap.add_argument("kernel", choices=("gemm_fp8", "prefill", "mla", "mla_fused", "gemv", "gemv_q8_0", "kvq_decode"))
    ap.add_argument("args", nargs="*", type=int, help="gemm_fp8: config; prefill: D MODE [config]")
    ap.add_argument("--ptx", default=None)
    ap.add_argument("--ttgir", default=None)
    a = ap.parse_args(argv)
    if a.kernel == "prefill" and len(a.args) < 2:
        ap.error("prefill takes D MODE [BLOCK_N STAGES PIPE]")
    if a.kernel == "mla_fused" and a.args:
        ap.error(f"mla_fused takes no arguments, not {' '.join(map(str, a.args))}: the kernel has no config to choose")
    if a.kernel == "mla" and (len(a.args) > 1 or any(x not in (0, 1) for x in a.args)):
        ap.error(f"mla takes [CAUSAL] (0 or 1), not {' '.join(map(str, a.args))}: the kernel has no config to choose")
    os.environ.pop("TRITON_INTERPRET", None)
    _stand_in_driver()
    try:
        if a.kernel == "gemm_fp8":
            k = compile_gemm_fp8(a.args)
        elif a.kernel == "prefill":
            k = compile_prefill(a.args[0], a.args[1], a.args[2:])
        elif a.kernel == "mla_fused":
            k = compile_mla_fused()
        elif a.kernel == "gemv":
            k = compile_gemv(a.args)
        elif a.kernel == "gemv_q8_0":
            k = compile_gemv_q8_0(a.args)
        elif a.kernel == "kvq_decode":
            k = compile_kvq_decode(a.args)
        else:
            k = compile_mla(a.args[0] if a.args else 0)
    except Exception as e:  # noqa: BLE001  (a compile error: its message, exit 1)
        print(f"compile failed: {type(e).__name__}: {e}"[-4000:])
        return 1
    if a.ptx:
        Path(a.ptx).write_text(k.asm["ptx"])
    if a.ttgir:
        Path(a.ttgir).write_text(k.asm["ttgir"])
    print("SHARED", k.metadata.shared)
    print(ptxas_report(k.asm["ptx"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
