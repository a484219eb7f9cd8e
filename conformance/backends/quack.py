"""quack-kernels (Tri Dao's group's CuTe-DSL kernels) as a third-party backend, `quack`.

Registered through the `kernel_parity.backends` entry point like any outside plugin; installed by
the `peers` extra (`pip install 'kernel-parity[peers]'`, which brings nvidia-cutlass-dsl); runs on
a CUDA GPU of compute capability 8.0 or newer (its cluster launches need Hopper, sm_90; on sm_8x
it runs one CTA a row). Read against quack-kernels 0.6.5:

- norm.rms_norm: `quack.rmsnorm.rmsnorm_fwd(x, w, residual=r, eps=, store_rstd=, weight_offset=)`,
  the function quack's `rmsnorm()` runs. fp32 / fp16 / bf16 rows and weight, all arithmetic in fp32;
  the fused residual add sums x + r in fp32, normalises that sum and returns it rounded to the
  residual's dtype (h); Gemma's (1 + w) is `weight_offset=1.0`, added to the weight in fp32; rstd
  fp32 when asked for.
- norm.layer_norm: `quack.rmsnorm.layernorm_fwd(x, w, b, eps, return_rstd=, return_mean=)`, which
  takes its weight and bias in fp32 only: the case's w and b are widened exactly.

What it cannot express is a skip with the reason: rows in an aligned width (pad > 0: quack
normalises every lane of the row it is given) and 16-bit rows of odd width (its cp.async copies move
2-byte vectors there, which the CuTe-DSL compiler rejects: seen on an H100, n = 113 in fp16 and
bf16, RMSNorm and LayerNorm). It has no RoPE or gated-MLP entry point of this shape (its rotary and
GEMM epilogues are other contracts).

Seen on an H100 (quack-kernels 0.6.5, nvidia-cutlass-dsl 4.8.1 cu13, torch 2.11): RMSNorm passes
every case of fp32 / fp16 / bf16, w and (1 + w), residual, rstd, n = 113 (fp32), 4096, 70000;
LayerNorm fails the `shifted` rows (x = 1000 + N(0, 1)) in fp32: its mean is one fp32 sum, off by
~1e-4 of the row's spread, beyond fp32's limits (fp16 / bf16 pass).

The adapters return quack's own output tensors (no copy into the harness's buffers), so
`parity bench` times quack's call alone.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, to_torch, torch_available

INSTALL = "pip install 'kernel-parity[peers]'"
MIN_CAPABILITY = (8, 0)


@dataclass
class QuackBackend(Backend):
    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        for module, dist in (("quack", "quack-kernels"), ("cutlass", "nvidia-cutlass-dsl")):
            if importlib.util.find_spec(module) is None:
                return f"{dist} is not installed ({INSTALL})"
        if self.device == "cuda":
            if not cuda_available():
                return "quack needs a CUDA GPU (CuTe-DSL kernels; there is no CPU or interpreter path)"
            import torch

            cap = torch.cuda.get_device_capability()
            if tuple(cap) < MIN_CAPABILITY:
                return f"quack needs compute capability >= 8.0, this GPU is {cap[0]}.{cap[1]}"
        return None

    def supports(self, case: Any) -> str | None:
        why = super().supports(case)
        if why:
            return why
        if case.p["pad"]:
            return (f"quack normalises every lane of the rows it is given: no real width inside an aligned "
                    f"row (pad={case.p['pad']})")
        if case.dtype in ("fp16", "bf16") and case.p["n"] % 2:
            return (f"quack's async row copies move at least 4 bytes: a 16-bit row needs an even width, "
                    f"n={case.p['n']} (CuTe-DSL: 'cp_size only supports (32, 64, 128), but got 16')")
        return None


def _rms_norm(case, inputs, out):
    from quack.rmsnorm import rmsnorm_fwd

    p, dev = case.p, out.device
    x, w = to_torch(inputs["x"], dev), to_torch(inputs["w"], dev)
    r = to_torch(inputs["r"], dev) if p["residual"] else None
    y, h, rstd = rmsnorm_fwd(x, w, residual=r, eps=float(p["eps"]), store_rstd=bool(p["rstd"]),
                             weight_offset=1.0 if p["gemma"] else 0.0)
    res = {"y": y}
    if p["residual"]:
        res["h"] = h
    if p["rstd"]:
        res["rstd"] = rstd
    return res


def _layer_norm(case, inputs, out):
    from quack.rmsnorm import layernorm_fwd

    p, dev = case.p, out.device
    x = to_torch(inputs["x"], dev)
    w = to_torch(inputs["w"], dev).float()  # quack's LayerNorm takes fp32 weight and bias: exact widening
    b = to_torch(inputs["b"], dev).float() if p["bias"] else None
    stats = bool(p["stats"])
    got = layernorm_fwd(x, w, b, eps=float(p["eps"]), return_rstd=stats, return_mean=stats)
    if not stats:
        return {"y": got}
    y, rstd, mean = got
    return {"y": y, "mean": mean,
            "rstd": rstd}


def make(device: str = "cuda") -> QuackBackend:
    return QuackBackend(
        name="quack", device=device, dtypes=("fp32", "fp16", "bf16"),
        ops={"norm.rms_norm": _rms_norm, "norm.layer_norm": _layer_norm},
        doc="quack-kernels' CuTe-DSL RMSNorm and LayerNorm on a CUDA GPU",
    )


BACKEND = make()
