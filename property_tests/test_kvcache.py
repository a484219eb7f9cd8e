"""Property tests of the KV-cache write: every kernel vs the golden, bit for bit."""

import pytest
from hypothesis import given

from kernel_parity.property_tests.strategies import cases

SMALL = dict(b=(1, 4), snew=(1, 8), hkv=(1, 4), d=[1, 16, 64, 96], smax=(1, 80))


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("kvcache.update", transform=lambda p: {**p, "smax": max(p["smax"], p["snew"])}, **SMALL))
def test_kvcache_update(parity, backend, case):
    parity.check(case.with_backend(backend))
