"""Third-party peer backend `quack`: being built (issue 16)."""

from kernel_parity.conformance.backends import Backend


class _Pending(Backend):
    def available(self) -> str | None:
        return "not built yet"


BACKEND = _Pending(name="quack", ops={})
