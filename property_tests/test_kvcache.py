"""Property tests of the KV-cache write: every kernel vs the golden, bit for bit, with and without
TensorRT-LLM's cache_loc (rows > 0: each sequence writes row cache_loc[b] of a larger cache / table), in
the fixed and the ragged (flattened, seq_len / seq_start) layouts, with V's head dim d or its own (dv)."""

import pytest
from hypothesis import given

from kernel_parity.property_tests.strategies import cases

SMALL = dict(b=(1, 4), snew=(1, 8), hkv=(1, 4), d=[1, 16, 64, 96], smax=(1, 80), rows=(0, 6),
             dv=[0, 0, 1, 8, 48])


def _valid(p):
    """snew fits the cache; rows (cache_loc) 0 or at least b."""
    return {**p, "smax": max(p["smax"], p["snew"]), "rows": p["rows"] and max(p["rows"], p["b"])}


@pytest.mark.parity_backends("triton", "cpu", "torch")
@given(case=cases("kvcache.update", transform=_valid, **SMALL))
def test_kvcache_update(parity, backend, case):
    parity.check(case.with_backend(backend))
