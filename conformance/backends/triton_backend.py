"""Our Triton kernels: on a CUDA GPU when one is present, else under TRITON_INTERPRET=1 on CPU
(the preparation, shared with plugins of Triton kernels, is in triton_prep.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends.builtin import collect
from kernel_parity.conformance.backends.triton_prep import (  # noqa: F401  (re-exported)
    TOO_LATE, describe_mode, interpreter_mode, interpreter_ready, prepare_environment)


@dataclass
class TritonBackend(Backend):
    interpreter: bool = False
    triton: bool = True

    def available(self) -> str | None:
        return interpreter_ready()

    def describe(self) -> str:
        return f"triton ({describe_mode()})"


def make() -> TritonBackend:
    prepare_environment()
    interpreter = interpreter_mode()
    device = "cpu" if interpreter else "cuda"
    return TritonBackend(
        name="triton",
        device=device,
        dtypes=("fp32", "fp16", "bf16", "int32"),  # int32: mla.schedule (integer in, integer out)
        ops=collect("triton_ops", device),
        claims=collect("triton_claims"),
        support=collect("triton_supports"),
        interpreter=interpreter,
        deterministic=True,
        doc="kernels/triton/*: Triton GPU kernels (interpreter mode on a machine without a GPU)",
    )
