"""Hypothesis profiles for property tests, chosen by --hypothesis-profile or PARITY_PROFILE.

dev       a quick local run (random examples, the local example database)
ci        derandomized: the same examples on every run and whatever the test selection; no
          example database (a database replays examples from earlier runs), print_blob on
thorough  many examples, for nightly runs

Selection-independence: Hypothesis (>= 6.131) also draws, now and then, constants it collects
from the source of every *local* module imported so far. Which modules are imported depends on
which tests were collected, so a derandomized test could draw other examples when run alone than
in the full suite, and `make test` could turn red on a commit that changed no kernel. For
derandomized profiles `pin_examples()` replaces that pool with an empty one (the global pool of
nasty values, which is fixed, stays).
"""

from __future__ import annotations

import os

PROFILES = ("dev", "ci", "thorough")
DEFAULT = "dev"


def register() -> None:
    from hypothesis import HealthCheck, settings

    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    settings.register_profile("dev", max_examples=15, **common)
    settings.register_profile("ci", max_examples=30, derandomize=True, database=None, print_blob=True, **common)
    settings.register_profile("thorough", max_examples=300, **common)


def pin_examples() -> bool:
    """Make Hypothesis's draws independent of which local modules are imported; True if patched."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover
        return False
    if not hasattr(providers, "_get_local_constants"):
        return False  # a Hypothesis without the local-constants pool: nothing to pin
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    return True


def load(name: str | None = None) -> str:
    """Register the profiles and load `name` (default: $PARITY_PROFILE, else dev)."""
    from hypothesis import settings

    register()
    name = name or os.environ.get("PARITY_PROFILE") or DEFAULT
    settings.load_profile(name)
    if settings.default.derandomize:
        pin_examples()
    return name
