pytest_plugins = ["pytester"]

from kernel_parity.conformance import profiles  # noqa: E402  (the same Hypothesis profile as the property tests)

profiles.load()
