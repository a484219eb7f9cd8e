"""Our Triton kernels: on a CUDA GPU when one is present, else under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, torch_available
from kernel_parity.conformance.backends.builtin import collect


@dataclass
class TritonBackend(Backend):
    interpreter: bool = False
    note: str | None = None
    too_late: bool = False  # triton was imported before TRITON_INTERPRET=1 could be set
    _prepared: bool = False

    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        try:
            import triton  # noqa: F401
        except Exception as e:
            return f"triton is not importable ({type(e).__name__}: {e})"
        if self.too_late:
            return ("triton was imported before TRITON_INTERPRET=1 was set, so its own @jit helpers "
                    "(tl.cdiv, tl.sum, ...) cannot run in the interpreter: set TRITON_INTERPRET=1 before "
                    "starting, or let kernel-parity import triton first")
        if self.interpreter and not self._prepared:
            from kernel_parity.conformance.backends.triton_interpreter import ensure_bf16

            self.note = ensure_bf16()
            self._prepared = True
        return None

    def describe(self) -> str:
        if not self.interpreter:
            return "triton (cuda)"
        return f"triton (interpreter on CPU{'; ' + self.note if self.note else ''})"


_too_late: bool | None = None  # decided by the first make() of the process


def make() -> TritonBackend:
    global _too_late
    interpreter = not cuda_available()
    if interpreter and _too_late is None:
        # triton.jit reads it when a function is decorated: triton's own library at `import
        # triton`, our kernels when kernels/triton/* is imported. Both must come after this.
        _too_late = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    too_late = bool(interpreter and _too_late)
    device = "cpu" if interpreter else "cuda"
    return TritonBackend(
        name="triton",
        device=device,
        ops=collect("triton_ops", device),
        interpreter=interpreter,
        too_late=too_late,
        doc="kernels/triton/*: Triton GPU kernels (interpreter mode on a machine without a GPU)",
    )
