"""kernel-parity: float64 goldens, parity metrics, a tolerance policy, reports and a CI gate for ML kernels.

One import namespace. The repository's top-level folders install under it (the build backend's
package-dir mapping, pyproject.toml): kernel_parity.refimpl (goldens), kernel_parity.kernels (our
Triton, C and torch kernels), kernel_parity.conformance (the framework), kernel_parity.reports
(writers) and kernel_parity.property_tests (the hypothesis property tests, runnable against any
backend). Nothing generic (`kernels`, `reports`) is installed at the top level of an environment.
"""

__version__ = "0.1.0"
