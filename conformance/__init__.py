"""The framework: cases, op specs, backends, metrics, tolerance, runner, gate, CLI, pytest plugin."""

from kernel_parity import __version__  # noqa: F401  (kept for `from kernel_parity.conformance import __version__`)
