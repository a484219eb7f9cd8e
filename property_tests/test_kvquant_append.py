"""Property tests of kvquant.append_decode (one decode step over a quantized paged KV cache, write and read fused):
every kernel vs the golden, and the op's invariants.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.append_decode vs its golden over every format x granularity x dist, GQA groups 1-4, head dims 16-128,
  pages of 16 / 64, ragged and full histories of 0-300 keys (the interpreter's split at 512 is the ci suite's);
- the new slot's old bits do not matter: a second step on the caches the first one left (the new slots now holding
  the codes, not the poison) writes the same bits and returns the same O and LSE (a kernel that reads the new
  slot back from memory before its write lands, or attends its stale contents, fails one of the two);
- sequences are independent: reversing the batch (q, new rows, table rows, lengths) reverses O and the LSE within
  the op's limits and leaves the caches bit for bit as they were.
"""

import numpy as np
import pytest
from hypothesis import given, settings

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(b=(1, 5), hq=(1, 8), hkv=[1, 1, 2, 4], d=[16, 32, 64, 128], kv=(0, 300))
FEW = settings(max_examples=8)  # the interpreter: a Triton example is ~1 s
CACHES = ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")


def _valid(p):
    """hq a multiple of hkv: hq = hkv x a group of 1, 2 or 4 (hq drawn in [1, 8] picks it)."""
    group = [1, 2, 4][p["hq"] % 3]
    return {**p, "hq": p["hkv"] * group}


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.append_decode", transform=_valid, **SMALL))
def test_append_decode(parity, backend, case):
    parity.check(case.with_backend(backend))


def _copy(x):
    return {k: np.array(v, copy=True) for k, v in x.items()}


def _as_inputs(x, got):
    """The inputs with the caches replaced by a run's outputs (bytes back to the format's storage)."""
    y = _copy(x)
    for name in CACHES:
        if name in got:
            y[name] = np.ascontiguousarray(got[name]).view(x[name].dtype).reshape(x[name].shape).copy()
    return y


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.append_decode", transform=_valid, **SMALL))
def test_the_new_slots_old_bits_do_not_matter(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    first = runs.run(case, _copy(x))
    second = runs.run(case, _as_inputs(x, first))
    runs.assert_same_bits(case, first, second, "the step ran again over the caches it had written",
                          tuple(k for k in first if k in CACHES or k in ("o", "lse")))


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.append_decode", transform=_valid, **SMALL))
def test_sequences_are_independent(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    a = runs.run(case, _copy(x))
    rev = _copy(x)
    for name in ("q", "k_new", "v_new", "block_table", "seq_lens"):
        rev[name] = np.array(x[name][::-1], order="C", copy=True)
    b = runs.run(case, rev)
    runs.assert_same_bits(case, a, b, "the batch was reversed", tuple(k for k in a if k in CACHES))
    back = {"o": np.asarray(b["o"])[::-1].astype(np.float64), "lse": np.asarray(b["lse"])[::-1].astype(np.float64)}
    runs.assert_close(case, {"o": np.asarray(a["o"]), "lse": np.asarray(a["lse"])}, back, "the batch was reversed")
