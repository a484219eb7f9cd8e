"""The Triton preparation shared by every backend that declares `triton = True` (ours and any
plugin of Triton kernels): `prepare_environment()` sets TRITON_INTERPRET=1 on a machine without a
CUDA GPU before the plugin's module (and with it triton) is imported, and `interpreter_ready()`
applies the bf16 fixes of triton_interpreter.py the first time such a backend is asked whether it
is available. Triton imported before the flag could be set is a clear reason, not a wrong result.

It imports nothing of the backend registry, so the registry and the Triton backend both use it.
"""

from __future__ import annotations

import os
import sys

from kernel_parity.conformance.backends._torch import cuda_available, torch_available

_too_late: bool | None = None  # decided by the first preparation of the process
_fixes: str | None = None  # the interpreter fixes in place (a note for descriptions)
TOO_LATE = ("triton was imported before TRITON_INTERPRET=1 was set, so its own @jit helpers "
            "(tl.cdiv, tl.sum, ...) cannot run in the interpreter: set TRITON_INTERPRET=1 before "
            "starting, or let kernel-parity import triton first")


def interpreter_mode() -> bool:
    return not cuda_available()


def prepare_environment() -> None:
    """On a machine without a CUDA GPU, set TRITON_INTERPRET=1 before any Triton kernel module is
    imported (triton.jit reads it when a function is decorated: triton's own library at `import
    triton`, a kernel module when it is imported). Idempotent."""
    global _too_late
    if _too_late is None and interpreter_mode():
        _too_late = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_ready() -> str | None:
    """None when Triton kernels can run here (fixing the interpreter's bf16 if needed), else why."""
    global _fixes
    why = torch_available()
    if why:
        return why
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"triton is not importable ({type(e).__name__}: {e})"
    if not interpreter_mode():
        return None
    prepare_environment()
    if _too_late:
        return TOO_LATE
    if _fixes is None:
        from kernel_parity.conformance.backends.triton_interpreter import ensure_bf16

        _fixes = ensure_bf16() or ""
    return None


def describe_mode() -> str:
    if not interpreter_mode():
        return "cuda"
    return f"interpreter on CPU{'; ' + _fixes if _fixes else ''}"
