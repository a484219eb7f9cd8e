"""Property tests of the quantized KV cache family's write path (kvquant.update; the read path's are in
test_kvquant_decode.py): every kernel vs the golden, and quantization's invariants on the kernels' codes.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.update vs its golden over formats (e4m3, e5m2, int8), granularities (tensor, head, token), pages of
  1-16, 1-24 tokens with padding (slot -1) and every dist (shapes small: the Triton kernel runs through the
  interpreter on CI);
- round trip: each written code dequantizes (code * s) to within half the code spacing of x (the spacing of
  the grid interval holding x / s, plus x / s's own fp32 rounding) wherever x / s lies within the grid, and
  to its end (+-FMAX; int8 127 or -128) beyond it;
- monotone: among the elements sharing a scale (a tensor, a head, a (token, head) row), a larger x never gets a
  smaller code.
"""

import numpy as np
import pytest
from hypothesis import given

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import kvquant as kq

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(n=(1, 24), hkv=(1, 8), d=[1, 3, 16, 64, 80, 128], page=[1, 4, 16], blocks=(1, 4), pad=(0, 3))


def _valid(p):
    """pad <= n and enough blocks for the real tokens."""
    pad = min(p["pad"], p["n"] - 1)
    blocks = max(p["blocks"], -(-(p["n"] - pad) // p["page"]))
    return {**p, "pad": pad, "blocks": blocks}


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("kvquant.update", transform=_valid, **SMALL))
def test_update(parity, backend, case):
    parity.check(case.with_backend(backend))


def _written(case, inputs, got, kv):
    """(x (m,) fp32, s (m,) fp32, code values (m,) float64, group id (m,)) of every written element."""
    p = case.p
    fmt, h, d = p["fmt"], p["hkv"], p["d"]
    slots = inputs["slot_mapping"]
    real = slots >= 0
    x = inputs[f"{kv}_new"].astype(np.float32)[real]  # (r, h, d)
    codes = np.asarray(got[f"{kv}_cache"]).view(kq.STORAGE[fmt]).reshape(-1, h, d)[slots[real]]
    if p["gran"] == "token":
        s = np.asarray(got[f"{kv}_scale_cache"]).reshape(-1, h)[slots[real]]  # (r, h)
        group = np.arange(s.size).reshape(s.shape)
    else:
        sc = inputs[f"{kv}_scale"].astype(np.float32)
        s = np.broadcast_to(sc[None, :] if p["gran"] == "head" else sc[None, :1], (x.shape[0], h))
        group = np.broadcast_to(np.arange(h)[None, :] if p["gran"] == "head" else np.zeros((1, 1), int), s.shape)
    s3 = np.broadcast_to(s[:, :, None], x.shape)
    g3 = np.broadcast_to(group[:, :, None], x.shape)
    return x.ravel(), s3.ravel(), codes.astype(np.float64).ravel(), g3.ravel()


def _grid(fmt):
    if fmt == "int8":
        return np.arange(-128, 128, dtype=np.float64)
    v = np.arange(256, dtype=np.uint8).view(kq.STORAGE[fmt]).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("kvquant.update", transform=_valid, **SMALL))
def test_round_trip_within_half_a_code_spacing(backend, case):
    case = case.with_backend(backend)
    inputs = runs.inputs_of(case)
    got = runs.run(case, {k: v.copy() for k, v in inputs.items()})
    fmt = case.p["fmt"]
    grid = _grid(fmt)
    for kv in ("k", "v"):
        x, s, code, _ = _written(case, inputs, got, kv)
        assert np.isfinite(code).all(), f"{backend}: a non-finite code  repro: parity repro {case.id}"
        live = s > 0
        q = x[live].astype(np.float64) / s[live].astype(np.float64)  # the exact quotient
        c = code[live]
        sat = (q > grid[-1]) | (q < grid[0])  # beyond the grid's ends (int8: 127, -128)
        want_sat = np.where(q > 0, grid[-1], grid[0])
        assert (c[sat] == want_sat[sat]).all(), f"{backend}: a saturated {kv} code is not +-FMAX  " \
                                                f"repro: parity repro {case.id}"
        qi, ci = q[~sat], c[~sat]
        j = np.clip(np.searchsorted(grid, qi) - 1, 0, grid.size - 2)  # grid[j] <= q < grid[j + 1] (clipped)
        half = (grid[j + 1] - grid[j]) / 2
        err = np.abs(ci - qi)
        bound = half + np.abs(qi) * 2.0**-23  # x / s rounded to fp32 first
        assert (err <= bound).all(), (f"{backend}: {kv} code {ci[err > bound][:3]} for x / s = "
                                      f"{qi[err > bound][:3]}: beyond half a code spacing  repro: parity repro {case.id}")
        assert (code[~live] == 0).all(), f"{backend}: a zero-scale row with non-zero codes  repro: {case.id}"


@pytest.mark.parity_backends(*BACKENDS)
@given(case=cases("kvquant.update", transform=_valid, **SMALL))
def test_codes_monotone_in_x(backend, case):
    case = case.with_backend(backend)
    inputs = runs.inputs_of(case)
    got = runs.run(case, {k: v.copy() for k, v in inputs.items()})
    for kv in ("k", "v"):
        x, _, code, group = _written(case, inputs, got, kv)
        order = np.lexsort((x, group))  # by group, then x
        g, xs, cs = group[order], x[order], code[order]
        same = g[1:] == g[:-1]
        up = xs[1:] > xs[:-1]
        bad = same & up & (cs[1:] < cs[:-1])
        assert not bad.any(), (f"{backend}: {kv}: x {xs[1:][bad][:3]} above {xs[:-1][bad][:3]} got smaller codes "
                               f"{cs[1:][bad][:3]} < {cs[:-1][bad][:3]}  repro: parity repro {case.id}")
