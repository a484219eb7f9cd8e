"""Property tests of kvquant.decode and kvquant.decode_split (decode and flash decoding over a quantized KV cache):
every kernel vs the golden, and the ops' invariants.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.decode and kvquant.decode_split vs their goldens over every format x granularity, s_q 1-4, GQA groups
  1-4, head dims 16-128, ragged and full lengths up to 150 keys, 1-6 splits in each partition (equal counts,
  fixed blocks, explicit boundaries), contiguous caches and pages of 16 / 64, both dists;
- flash decoding is decoding: decode_split's merged O and LSE over a contiguous cache are kvquant.decode's on the
  same inputs (within kvquant.decode's limits), whatever the number of splits and their partition;
- the merge is the partials' logsumexp: LSE = ln sum_s exp(LSE_s) over the kernel's own partials;
- scaling every V scale by c scales O and every split's O_s by c and leaves the LSEs (c a power of two).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(b=(1, 4), sq=(1, 4), hq=(1, 8), hkv=[1, 1, 2, 4], d=[16, 32, 64, 128], kv=(1, 150))
SPLIT = dict(SMALL, splits=(1, 6), blk=(0, 2))
FEW = settings(max_examples=4)  # the interpreter: a Triton example is ~1 s (a program per kv head and split)


def _valid(p):
    """hq a multiple of hkv: hq = hkv x a group of 1, 2 or 4 (hq drawn in [1, 8] picks it); part=block's blk
    ceil(kv / splits) + 0..2 (the drawn blk: blocks that cover the longest sequence exactly or with room), 0 for
    the other partitions."""
    group = [1, 2, 4][p["hq"] % 3]
    out = {**p, "hq": p["hkv"] * group}
    if "part" in p:
        out["blk"] = -(-p["kv"] // p["splits"]) + p["blk"] if p["part"] == "block" else 0
    return out


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode", transform=_valid, **SMALL))
def test_decode(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_split", transform=_valid, **SPLIT))
def test_decode_split(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_split", transform=_valid, **dict(SPLIT, page=[0])))
def test_merged_split_is_decode(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    p = {k: v for k, v in case.p.items() if k not in ("splits", "page", "part", "blk")}
    dec = ops.make_case("kvquant.decode", backend, case.dtype, p, case.dist, case.seed)
    got = runs.run(case, x)
    want = runs.run(dec, x)
    runs.assert_close(dec, {"o": got["o"], "lse": got["lse"]},
                      {"o": np.asarray(want["o"], np.float64), "lse": np.asarray(want["lse"], np.float64)},
                      f"the keys were split {case.p['splits']} ways (against kvquant.decode)")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_split", transform=_valid, **SPLIT))
def test_lse_is_the_partials_logsumexp(backend, case):
    case = case.with_backend(backend)
    got = runs.run(case, runs.inputs_of(case))
    parts = np.asarray(got["lse_parts"], np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        top = parts.max(axis=0)
        fin = np.isfinite(top)
        lse = np.where(fin, np.where(fin, top, 0.0) + np.log(np.exp(parts - np.where(fin, top, 0.0)).sum(axis=0)),
                       -np.inf)
    runs.assert_close(case, {"lse": got["lse"]}, {"lse": lse}, "the LSE was compared with its partials' logsumexp")


@pytest.mark.parity_backends(*BACKENDS)
@FEW
@given(case=cases("kvquant.decode_split", transform=_valid, **SPLIT), e=st.sampled_from([-2, -1, 1, 2]))
def test_v_scales_times_c_scale_o_by_c(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    c = 2.0 ** e
    a = runs.run(case, x)
    b = runs.run(case, dict(x, v_scale=np.ascontiguousarray(x["v_scale"] * np.float32(c))))
    want = {"o": np.asarray(a["o"], np.float64) * c, "lse": np.asarray(a["lse"], np.float64),
            "o_parts": np.asarray(a["o_parts"], np.float64) * c, "lse_parts": np.asarray(a["lse_parts"], np.float64)}
    runs.assert_close(case, b, want, f"the V scales were scaled by {c} (O should scale by {c}, the LSEs stay)")
