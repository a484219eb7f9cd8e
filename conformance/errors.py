"""Exceptions the framework raises on purpose, and the exit codes of the `parity` command."""

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2  # pass; a parity failure or regression; a usage or input error


class UsageError(ValueError):
    """Bad user input (flag, op, backend, dtype, case id, parameter, file): one line, exit code 2."""


class SpecError(RuntimeError):
    """An op spec or suite that contradicts itself (a framework bug, found by self-tests)."""
