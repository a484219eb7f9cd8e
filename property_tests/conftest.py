"""Hypothesis profiles for the property tests, chosen by --hypothesis-profile or PARITY_PROFILE.

dev       a quick local run
ci        derandomized (the same examples every run, so CI is reproducible), print_blob on
thorough  many examples, for nightly runs and `parity gate --changed-since`
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=15, **_COMMON)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("PARITY_PROFILE", "dev"))
