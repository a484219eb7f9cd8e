"""Eager PyTorch in the test dtype (kernels/torch/*): the same-precision noise baseline."""

from __future__ import annotations

from dataclasses import dataclass

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import autograd_timed, cuda_available, torch_available
from kernel_parity.conformance.backends.builtin import collect


@dataclass
class TorchBackend(Backend):
    def available(self) -> str | None:
        return torch_available()


# backward adapters that differentiate a forward they build with torch.autograd.grad: `parity bench`
# times the backward alone (the forward once, untimed), as benchmarks/gpu_layers_bwd.py does
AUTOGRAD_TIMED = ("norm.rms_norm_backward", "norm.layer_norm_backward", "rope.rope_backward",
                  "mlp.swiglu_backward", "mlp.geglu_backward")


def make() -> TorchBackend:
    device = "cuda" if cuda_available() else "cpu"
    ops = collect("torch_ops", device)
    return TorchBackend(
        name="torch",
        device=device,
        dtypes=("fp32", "fp16", "bf16", "int32"),  # int32: mla.schedule (integer in, integer out)
        ops=ops,
        timed={op: autograd_timed(ops[op], "eager torch's backward alone: its forward ran once, untimed "
                                           "(autograd.grad, retain_graph)") for op in AUTOGRAD_TIMED if op in ops},
        claims=collect("torch_claims"),
        support=collect("torch_supports"),
        doc="kernels/torch/*: eager torch in the test dtype (baseline for the noise layer)",
    )
