"""Eager PyTorch in the test dtype (kernels/torch/*): the same-precision noise baseline."""

from __future__ import annotations

from dataclasses import dataclass

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, torch_available
from kernel_parity.conformance.backends.builtin import collect


@dataclass
class TorchBackend(Backend):
    def available(self) -> str | None:
        return torch_available()


def make() -> TorchBackend:
    device = "cuda" if cuda_available() else "cpu"
    return TorchBackend(
        name="torch",
        device=device,
        ops=collect("torch_ops", device),
        claims=collect("torch_claims"),
        support=collect("torch_supports"),
        doc="kernels/torch/*: eager torch in the test dtype (baseline for the noise layer)",
    )
