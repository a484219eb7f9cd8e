"""Property tests: Hypothesis profile (conformance.profiles) and the backends each test runs on.

`PARITY_PROFILE=ci` (or --hypothesis-profile ci) draws the same examples on every run whatever
the test selection. A test that takes a `backend` argument and carries
`@pytest.mark.parity_backends(...)` runs once per listed built-in backend (`by_op={op: names}`
parametrizes "op, backend" pairs); with
`--parity-backend module:object` (repeatable) it runs on those plugin backends instead, so every
property test, the metamorphic ones included, checks a third-party kernel.
"""

import pytest

from kernel_parity.conformance import profiles
from kernel_parity.property_tests import runs

profiles.load()


def pytest_configure(config):
    config.addinivalue_line("markers", "parity_backends(*names): the built-in backends a property test runs on")
    runs.use_backends(config.getoption("parity_backend"))


def pytest_generate_tests(metafunc):
    mark = metafunc.definition.get_closest_marker("parity_backends")
    if mark is None or "backend" not in metafunc.fixturenames:
        return
    by_op = mark.kwargs.get("by_op")
    if by_op:  # parity_backends(by_op={op: (backends, ...)}): parametrizes "op, backend"
        metafunc.parametrize("op, backend", [(op, b) for op, names in by_op.items() for b in runs.backends_for(names)])
    else:
        metafunc.parametrize("backend", runs.backends_for(mark.args))
