"""Property tests: Hypothesis profile (conformance.profiles) and the backends each test runs on.

`PARITY_PROFILE=ci` (or --hypothesis-profile ci) draws the same examples on every run whatever
the test selection. A test that takes a `backend` argument and carries
`@pytest.mark.parity_backends(...)` runs once per listed built-in backend (`by_op={op: names}`
parametrizes "op, backend" pairs); with
`--parity-backend module:object` (repeatable) it runs on those plugin backends instead, so every
property test, the metamorphic ones included, checks a third-party kernel.
"""

import os

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


# The ci profile's 30 examples an interpreted parametrization: a test run on the Triton backends (the
# interpreter on CI: up to a second an example) without an @settings of its own draws TRITON_EXAMPLES examples;
# its cpu / torch / plugin parametrizations keep the profile's. 67 parametrizations (attention, combine, gemm,
# kvcache, mla, mlp, norm, quant, rope, softmax); `-k triton` over those files (87 items): 223 -> 72 s at -n 2
# on an idle 2-core machine (attention's split-KV tests 25-30 s -> 6-7 s each). Every triton/ mutant that is not
# equivalent is killed by the ci gate (`parity mutants`); these examples only meet a mutant the gate lets through
# (--props). Derandomized profiles
# only (ci): dev and thorough draw as many as their profile says. The moe and kvquant families set their own
# budgets (their modules are left as they were). PARITY_TRITON_EXAMPLES=30 restores the profile's count.
TRITON_EXAMPLES = int(os.environ.get("PARITY_TRITON_EXAMPLES", "8"))
INTERPRETED = ("triton", "triton-q8")
OWN_BUDGETS = ("test_moe", "test_kvquant")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    from hypothesis import settings

    fn = getattr(item, "obj", None)
    own = getattr(fn, "_hypothesis_internal_use_settings", None)
    spec = getattr(item, "callspec", None)
    if (own is None or spec is None or spec.params.get("backend") not in INTERPRETED
            or not settings.default.derandomize or own.max_examples != settings.default.max_examples
            or own.max_examples <= TRITON_EXAMPLES or item.module.__name__.rsplit(".", 1)[-1].startswith(OWN_BUDGETS)):
        yield
        return
    fn._hypothesis_internal_use_settings = settings(own, max_examples=TRITON_EXAMPLES)
    try:
        yield
    finally:
        fn._hypothesis_internal_use_settings = own
