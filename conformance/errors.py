"""Exceptions the framework raises on purpose."""


class UsageError(ValueError):
    """Bad user input (flag, op, backend, dtype, case id, parameter): one line, exit code 2."""


class SpecError(RuntimeError):
    """An op spec or suite that contradicts itself (a framework bug, found by self-tests)."""
