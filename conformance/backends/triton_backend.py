"""Our Triton kernels: on a CUDA GPU when one is present, else under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

from conformance.backends import Backend
from conformance.backends._torch import cuda_available, torch_available
from conformance.backends.builtin import collect


@dataclass
class TritonBackend(Backend):
    interpreter: bool = False
    note: str | None = None
    _prepared: bool = False

    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        try:
            import triton  # noqa: F401
        except Exception as e:
            return f"triton is not importable ({type(e).__name__}: {e})"
        if self.interpreter and not self._prepared:
            from conformance.backends.triton_interpreter import ensure_bf16

            self.note = ensure_bf16()
            self._prepared = True
        return None

    def describe(self) -> str:
        if not self.interpreter:
            return "triton (cuda)"
        return f"triton (interpreter on CPU{'; ' + self.note if self.note else ''})"


def make() -> TritonBackend:
    interpreter = not cuda_available()
    if interpreter:
        # Read by triton.jit when kernels/triton/* is first imported (after this point).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cpu" if interpreter else "cuda"
    return TritonBackend(
        name="triton",
        device=device,
        ops=collect("triton_ops", device),
        interpreter=interpreter,
        doc="kernels/triton/*: Triton GPU kernels (interpreter mode on a machine without a GPU)",
    )
