"""kernel-parity: cases, op specs, backends, metrics, tolerance, runner, gate, CLI, pytest plugin."""

__version__ = "0.1.0"
