"""The gluon backend (kernels/gluon, conformance/backends/gluon_backend.py).

On any machine: the backend is registered and, without a Hopper GPU, says why it cannot run (every case a
skip with that reason, never a pass); its support rules; the Gluon API the kernels use exists in the
installed Triton; and the FP8 GEMM compiles for sm_90a with this machine's Triton (no GPU: a stand-in
driver, the compiler's own passes and ptxas): no register spills, and no wgmma serialised by ptxas (its
"wgmma.mma_async instructions are serialized" warning: a register move reading an accumulator in flight).
On a Hopper GPU (GPU machine): the API pin and the kernel against the Triton kernel and the fp64 emulation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernel_parity.conformance.backends import gluon_backend

ROOT = Path(__file__).resolve().parents[1]


def _gpu_hopper() -> bool:
    return gluon_backend.unavailable() is None


def test_registered_and_unavailable_reason():
    from kernel_parity.conformance.backends import entry_points

    assert entry_points()["gluon"] == "kernel_parity.conformance.backends.gluon_backend:BACKEND"
    b = gluon_backend.make()
    assert b.name == "gluon" and b.device == "cuda"
    why = b.available()
    if not _gpu_hopper():
        assert why and ("CUDA GPU" in why or "Hopper" in why or "lacks" in why)


@pytest.mark.parametrize("wfmt,dtype,m,n,k,expect", [
    ("fp8", "bf16", 3, 48, 256, None),
    ("fp8", "fp16", 33, 130, 512, None),
    ("fp8", "fp32", 3, 48, 256, "bf16/fp16 output"),
    ("fp8_row", "bf16", 3, 48, 256, "no path"),
    ("q4_k", "bf16", 3, 48, 256, "no path"),
])
def test_gemm_supports(wfmt, dtype, m, n, k, expect):
    case = SimpleNamespace(op="gemm.gemm_nt", dtype=dtype, p={"m": m, "n": n, "k": k, "wfmt": wfmt, "bias": 0})
    why = gluon_backend._gemm_supports(case)
    assert (why is None) if expect is None else (expect in why)


def test_api_present_in_installed_triton():
    """What compat.REQUIRED names exists here too (this machine's Triton is newer than the GPU's)."""
    from kernel_parity.kernels.gluon import compat

    assert compat.missing() == ()
    assert isinstance(compat.ws_list(), bool) and isinstance(compat.tma_new(), bool)


_COMPILE = r'''
import os, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class _Driver:  # the compiler asks the active driver for the target and a device / stream only
    def get_current_device(self): return 0
    def get_current_stream(self, d=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 64)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True
driver.set_active(_Driver())

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from kernel_parity.kernels.gluon.compat import ws_list

desc = lambda t, blk, dt: TensorDescriptor(t, list(t.shape), list(t.stride()), blk,
                                           gl.NVMMASharedLayout.get_default_for(blk, dt))
which = sys.argv[1]
if which == "gemm_fp8":
    from kernel_parity.kernels.gluon import gemm_fp8 as G
    M, N, K = 256, 256, 1024
    qa = torch.empty(M, K, dtype=torch.float8_e4m3fn); w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    sa = torch.empty(K // 128, M).t(); sw = torch.empty(N // 128, K // 128)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    bn, st, gm, r1, r2 = G.GEMM_CONFIG
    f8 = gl.float8e4nv
    k = G._gemm_fp8_kernel.warmup(desc(qa, [128, 128], f8), desc(w, [bn, 128], f8), desc(out, [64, bn], gl.bfloat16),
        out, sa, sw, sw[0], M, N, K, 128, *sa.stride(), *sw.stride(), *out.stride(), HAS_BIAS=True,
        TMA_STORE=True, BLOCK_N=bn, GROUP_M=gm, STAGES=st, REGS_MMA=r1, REGS_LOAD=r2, WS_LIST=ws_list(), SKEW=True,
        num_warps=4, grid=(1,))
else:  # attention d mode [BLOCK_N STAGES PIPE]
    from kernel_parity.kernels.gluon import attention as A
    d, mode = int(sys.argv[2]), int(sys.argv[3])
    b, s, h = 2, 512, 4
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16); o = torch.empty_like(q); lse = torch.empty(b, h, s)
    bn, st, pipe = tuple(int(x) for x in sys.argv[4:7]) if len(sys.argv) > 4 else A.CONFIGS[d]
    q2 = A._rows_view(q)
    k = A._prefill_kernel.warmup(desc(q2, [128, d], gl.bfloat16), desc(q2, [bn, d], gl.bfloat16),
        desc(q2, [bn, d], gl.bfloat16), o, lse, s, s, h, 1, 0.1, *o.stride()[:3], *lse.stride(), DIAG_MODE=mode, D=d,
        BLOCK_N=bn, STAGES=st, REGS_MMA=A.REGS[0], REGS_LOAD=A.REGS[1], WS_LIST=ws_list(), PIPE=bool(pipe), num_warps=4,
        enable_fp_fusion=False, grid=(1,))
d = tempfile.mkdtemp()
open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = next(os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bin_dir, n)))
r = subprocess.run([ptxas, "-v", "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                   capture_output=True, text=True)
print("SHARED", k.metadata.shared)
print(r.stdout + r.stderr)
'''


@pytest.mark.parametrize("which", [("gemm_fp8",), ("attention", "128", "1"), ("attention", "64", "2"),
                                   ("attention", "256", "0"), ("attention", "32", "1"),
                                   ("attention", "128", "1", "128", "2", "1"), ("attention", "64", "2", "128", "3", "1"),
                                   ("attention", "128", "0", "64", "3", "1")],
                         ids=["gemm_fp8", "prefill-d128-br", "prefill-d64-tl", "prefill-d256-full", "prefill-d32-br",
                              "prefill-d128-pipe", "prefill-d64-tl-pipe", "prefill-d128-n64-pipe"])
def test_kernel_compiles_for_hopper(tmp_path, which):
    """Each kernel through the whole compiler for sm_90a, on this machine: setmaxnreg per partition, no spills,
    no serialised wgmma, under the shared-memory limit of an H100 / H200 (227 KB)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _COMPILE, *which], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    out = r.stdout + r.stderr
    if "Unsupported .version" in out:
        pytest.skip("this Triton's ptxas is older than its PTX")
    assert r.returncode == 0, out[-3000:]
    assert "serialized" not in out, out[-2000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in out, out[-2000:]
    shared = int(out.split("SHARED", 1)[1].split()[0])
    assert shared <= 227 * 1024, shared


@pytest.mark.skipif(not _gpu_hopper(), reason=str(gluon_backend.unavailable()))
@pytest.mark.parametrize("causal", ["bottom_right", "top_left", "none"])
@pytest.mark.parametrize("pipe", [0, 1])
def test_prefill_on_gpu_matches_triton_kernel(causal, pipe):
    """Multi-tile shapes (s_q > s_k included): O and LSE against the Triton kernel within bf16's rounding of O."""
    import torch

    from kernel_parity.kernels.gluon import attention as G
    from kernel_parity.kernels.triton import attention as T

    for b, sq, sk, hq, hkv, d in ((2, 300, 300, 4, 2, 128), (1, 150, 70, 2, 1, 64), (1, 129, 400, 2, 2, 256)):
        g = torch.Generator(device="cuda").manual_seed(sq + sk + d)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        o, lse = G.prefill(q, k, v, causal=causal, config=G.CONFIGS[d][:2] + (pipe,))
        ot, lset = T.prefill(q, k, v, causal=causal)
        assert torch.equal(torch.isinf(lse), torch.isinf(lset))
        fin = torch.isfinite(lset)
        assert (lse[fin] - lset[fin]).abs().max().item() < 1e-3
        assert (o.float() - ot.float()).abs().max().item() < 2e-2


@pytest.mark.skipif(not _gpu_hopper(), reason=str(gluon_backend.unavailable()))
def test_gemm_fp8_on_gpu_matches_triton_kernel():
    """Same quantized operands: the gluon kernel and kernels/triton/gemm_fp8.py promote the same per-block
    dots with the same scale products; both within an fp32 accumulation's error of the fp64 emulation."""
    import torch

    from kernel_parity.kernels.gluon import gemm_fp8 as G
    from kernel_parity.kernels.triton import gemm_fp8 as T

    for m, n, k in ((1, 256, 256), (33, 130, 512), (300, 384, 2048)):
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sw = torch.rand((n + 127) // 128, k // 128, device="cuda", generator=g) * 1e-2
        bias = torch.randn(n, device="cuda", generator=g)
        qa, sa = T.act_quant_fp8(a, 1, 128)
        ours = G.gemm_fp8_scaled(qa, sa, w, sw, bias, gn=128)
        ref = T.gemm_fp8_scaled(qa, sa, w, sw, bias, gm=1, gn=128, gk=128)
        emu = torch.zeros(m, n, dtype=torch.float64, device="cuda")
        for kb in range(k // 128):
            sl = slice(kb * 128, (kb + 1) * 128)
            emu += (qa[:, sl].double() @ w[:, sl].double().T) * sa[:, kb].double()[:, None] \
                * sw[:, kb].double().repeat_interleave(128)[:n][None, :]
        emu += bias.double()
        rel = ((ours.double() - emu).norm() / emu.norm()).item()
        assert rel < 8e-3, (m, n, k, rel)  # bf16 output rounding (2^-9) dominates
        assert (ours.float() - ref.float()).abs().max().item() <= 2 * (ref.float().abs().max().item() * 2 ** -8)
