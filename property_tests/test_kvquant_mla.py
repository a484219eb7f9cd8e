"""Property tests of kvquant.mla_sparse (FlashMLA's sparse MLA decode over its 656-byte FP8 rows): every kernel vs
the golden, the op's invariants, and the row format's pack / unpack.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.mla_sparse vs its golden over 1-3 requests, 1-2 query rows, 1-40 query heads on 1-2 kv heads, lists of
  1-100 entries (-1 padding, repeats, ragged topk_length over poison rows, or none), every dist;
- scaling every group scale of every row by 2^e and q's NoPE part by 2^-e leaves every logit, so O's bits are
  those of before times 2^e and the LSE's bits unchanged (power-of-two scalings are exact);
- only the rows the used entries name are read: every other row's bytes (scales, codes, RoPE) replaced by random
  finite junk changes nothing, bit for bit;
- the Triton kernel's split lists (1-5 splits of each list, merged by lse_combine: the GPU's path, one split on the
  interpreter by default) agree with one split within the op's limits.
Golden (float64):
- pack / unpack round trip: each NoPE value within half an e4m3 step (at its code, times its group's scale) of x,
  the RoPE part exact; each scale the least power of two >= max(amax / 448, 1e-4); unpacked rows packed at their
  scales give the same bytes.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import kvquant_mla as km

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(b=(1, 3), hq=(1, 40), hkv=[1, 1, 2], kv=(0, 160), topk=(1, 100))


def _valid(p):
    """hq a multiple of hkv (hq rounded up to one)."""
    return {**p, "hq": -(-p["hq"] // p["hkv"]) * p["hkv"]}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=10)  # the interpreter: a Triton example is ~1 s
@given(case=cases("kvquant.mla_sparse", transform=_valid, **SMALL))
def test_mla_sparse(parity, backend, case):
    parity.check(case.with_backend(backend))


def _scales(cache: np.ndarray) -> np.ndarray:
    """A writable float32 view (num_blocks, page, h_kv, 4) of the cache's scale bytes."""
    return cache[..., km.SCALE_OFF:km.ROPE_OFF].view("<f4")


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: two kernel calls an example
@given(case=cases("kvquant.mla_sparse", transform=_valid, **SMALL), e=st.sampled_from([-3, -1, 1, 4]))
def test_scales_times_2e_and_q_nope_times_2_minus_e_scale_o_exactly(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    cache = np.ascontiguousarray(x["kv_cache"])
    with np.errstate(invalid="ignore"):
        _scales(cache)[...] *= np.float32(2.0 ** e)  # poison NaN stays NaN
    q = np.array(x["q"], copy=True)
    q[..., :km.D_NOPE] = q[..., :km.D_NOPE] * q.dtype.type(2.0 ** -e)
    a = runs.run(case, x)
    b = runs.run(case, dict(x, kv_cache=cache, q=q))
    oa, ob = np.asarray(a["o"], dtype=np.float64), np.asarray(b["o"], dtype=np.float64)
    np.testing.assert_array_equal(ob, oa * 2.0 ** e, err_msg=f"{backend}: O did not scale by 2^{e} exactly  "
                                                             f"repro: parity repro {case.id}")
    np.testing.assert_array_equal(np.asarray(b["lse"]), np.asarray(a["lse"]),
                                  err_msg=f"{backend}: the LSE moved  repro: parity repro {case.id}")


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: two kernel calls an example
@given(case=cases("kvquant.mla_sparse", transform=_valid, **SMALL), seed=st.integers(0, 2**32 - 1))
def test_rows_no_used_entry_names_are_never_read(backend, case, seed):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    cache = x["kv_cache"]
    n_blocks, page, h_kv, _ = cache.shape
    idx = x["indices"].reshape(*x["indices"].shape[:2], h_kv, -1).astype(np.int64)
    used = idx != -1
    if "topk_length" in x:
        used &= np.arange(idx.shape[-1]) < x["topk_length"].astype(np.int64)[:, None, None, None]
    named = np.zeros((n_blocks * page, h_kv), dtype=bool)
    named[idx[used], np.nonzero(used)[2]] = True
    rng = np.random.default_rng(seed)
    junk = km.pack(rng.standard_normal((n_blocks * page, h_kv, km.D)) * 3.0)
    other = np.ascontiguousarray(cache).reshape(n_blocks * page, h_kv, km.ROW_BYTES).copy()
    other[~named] = junk[~named]
    a = runs.run(case, x)
    b = runs.run(case, dict(x, kv_cache=other.reshape(cache.shape)))
    for name in ("o", "lse"):
        np.testing.assert_array_equal(np.asarray(b[name], dtype=np.float64), np.asarray(a[name], dtype=np.float64),
                                      err_msg=f"{backend}: {name} changed when unlisted rows did  "
                                              f"repro: parity repro {case.id}")


@pytest.mark.parity_backends("triton")
@settings(max_examples=4)  # the interpreter: 2-6 kernel calls an example, seconds each
@given(case=cases("kvquant.mla_sparse", transform=_valid, **SMALL), splits=st.integers(2, 5))
def test_triton_splits_agree_with_one_split(parity, backend, case, splits):
    from kernel_parity.conformance.backends._torch import to_torch
    from kernel_parity.conformance.ops.mla import SCALES
    from kernel_parity.kernels.triton.kvquant_mla import kvquant_mla_sparse

    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    t = {k: to_torch(v, "cpu") for k, v in a["inputs"].items()}
    o, lse = kvquant_mla_sparse(t["q"], t["kv_cache"], t["indices"], t.get("topk_length"), SCALES[case.p["scale"]],
                                num_splits=splits, block_n=16)
    got = {"o": runs.to_numpy(o), "lse": runs.to_numpy(lse)}
    runs.assert_close(case, got, a["outputs"], f"each list split into {splits} parts (16-key tiles)")


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), lo=st.integers(-30, 0), hi=st.integers(0, 12),
       bf16=st.booleans())
def test_pack_unpack_round_trip_within_half_a_code(seed, n, lo, hi, bf16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, km.D)) * 2.0 ** rng.integers(lo, hi + 1, (n, 1))
    x[rng.random(x.shape) < 0.02] = 0.0
    if bf16:  # the cache's usual source: bf16 latents
        x = x.astype(km.BF16).astype(np.float64)
    rows = km.pack(x)
    got = km.unpack(rows)
    _, s, _ = km.unpack_parts(rows)
    s = s.astype(np.float64)
    amax = np.abs(x[:, :km.D_NOPE].astype(np.float32)).reshape(n, 4, 128).max(-1).astype(np.float64)
    floor = np.maximum((amax.astype(np.float32) / np.float32(448.0)).astype(np.float64), float(np.float32(1e-4)))
    assert (np.log2(s) == np.round(np.log2(s))).all(), "a scale is not a power of two"
    assert (s >= floor).all() and (s < 2 * floor).all(), "a scale is not the least power of two >= amax / 448"
    v = np.abs(x[:, :km.D_NOPE].astype(np.float32).astype(np.float64)).reshape(n, 4, 128) / s[..., None]
    step = np.where(v < 2.0 ** -6, 2.0 ** -9, 2.0 ** (np.floor(np.log2(np.maximum(v, 2.0 ** -6))) - 3))
    err = np.abs(got[:, :km.D_NOPE] - x[:, :km.D_NOPE].astype(np.float32)).reshape(n, 4, 128)
    assert (err <= 0.5 * step * s[..., None]).all(), f"max error {err.max()} beyond half a code step"
    want_rope = x[:, km.D_NOPE:].astype(km.BF16).astype(np.float64)
    np.testing.assert_array_equal(got[:, km.D_NOPE:], want_rope)
    np.testing.assert_array_equal(km.pack(got, scales=s), rows)  # at their scales, unpacked rows pack to the bytes
