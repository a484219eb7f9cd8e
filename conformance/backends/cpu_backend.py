"""Our native C kernels (kernels/cpu/*.c), compiled on first use and loaded through ctypes."""

from __future__ import annotations

from dataclasses import dataclass

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends.builtin import collect


@dataclass
class CpuBackend(Backend):
    def supports(self, case) -> str | None:
        why = super().supports(case)
        if why:
            return why
        from kernel_parity.kernels.cpu.loader import CompilerUnavailable, load

        try:
            load(case.op.split(".", 1)[0])
        except CompilerUnavailable as e:
            return f"C kernels unavailable: {e}"
        return None


def make() -> CpuBackend:
    return CpuBackend(
        name="cpu",
        device="cpu",
        dtypes=("fp32", "fp16", "bf16", "int32"),  # int32: mla.schedule (integer in, integer out)
        ops=collect("cpu_ops"),
        claims=collect("cpu_claims"),
        support=collect("cpu_supports"),
        deterministic=True,
        doc="kernels/cpu/*.c: native C kernels, fp32 accumulation",
    )
