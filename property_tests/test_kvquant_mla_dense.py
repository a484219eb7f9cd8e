"""Property tests of kvquant.mla_decode and kvquant.mla_pack (FlashMLA's dense paged MLA decode over its 656-byte FP8
rows, and the rows' write path): every kernel vs the golden, and the ops' invariants.

Kernel (every backend, or the --parity-backend plugins):
- kvquant.mla_decode vs its golden over 1-3 requests, 1-2 query rows (causal or not), 1-40 query heads on 1-2 kv
  heads, 0-160 cached tokens (ragged, page edges), every dist;
- scaling every group scale of every row by 2^e and q's latent part by 2^-e leaves every logit, so O's bits are
  those of before times 2^e and the LSE's bits unchanged (power-of-two scalings are exact);
- only the rows of a request's tokens are read: every other row's bytes (other pages, the slots past a request's
  length, the poison pages) replaced by random finite rows changes nothing, bit for bit;
- the Triton kernel's split tokens (2-5 splits merged by lse_combine: the GPU's path) agree with one split within
  the op's limits;
- kvquant.mla_pack vs its golden (bit-exact) over 1-60 tokens, pages of 1-64, padding;
- a token's row depends only on that token: the tokens permuted together with their slots give the same cache,
  bit for bit.
Golden (float64): a packed row unpacked is within half an e4m3 step of its source (at its code, times its group's
scale), the RoPE part exact (kvquant.mla_sparse's pack round trip, property_tests/test_kvquant_mla.py), and the
cache the golden writes holds the bytes of refimpl.kvquant_mla.pack at the written slots and the old bytes
elsewhere.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases
from kernel_parity.refimpl import kvquant_mla_dense as kd

BACKENDS = ("triton", "cpu", "torch")
SMALL = dict(b=(1, 3), hq=(1, 40), hkv=[1, 1, 2], kv=(0, 160))
PACK = dict(n=(1, 60), page=[1, 16, 64], blocks=(1, 4), pad=(0, 4))
SCALE_OFF, ROPE_OFF, D_NOPE = 512, 528, 512


def _valid(p):
    """hq a multiple of hkv (hq rounded up to one); causal only with sq = 2."""
    return {**p, "hq": -(-p["hq"] // p["hkv"]) * p["hkv"], "causal": p["causal"] if p["sq"] == 2 else 0}


def _fits(p):
    """pad <= n and the real tokens fit the cache (blocks grown to hold them)."""
    pad = min(p["pad"], p["n"])
    blocks = max(p["blocks"], -(-(p["n"] - pad) // p["page"]))
    return {**p, "pad": pad, "blocks": blocks}


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=10)  # the interpreter: a Triton example is ~1 s
@given(case=cases("kvquant.mla_decode", transform=_valid, **SMALL))
def test_mla_decode(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=10)
@given(case=cases("kvquant.mla_pack", transform=_fits, **PACK))
def test_mla_pack(parity, backend, case):
    parity.check(case.with_backend(backend))


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: two kernel calls an example
@given(case=cases("kvquant.mla_decode", transform=_valid, **SMALL), e=st.sampled_from([-3, -1, 1, 4]))
def test_scales_times_2e_and_q_latent_times_2_minus_e_scale_o_exactly(backend, case, e):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    cache = np.ascontiguousarray(x["kv_cache"])
    with np.errstate(invalid="ignore"):
        cache[..., SCALE_OFF:ROPE_OFF].view("<f4")[...] *= np.float32(2.0 ** e)  # poison NaN stays NaN
    q = np.array(x["q"], copy=True)
    q[..., :D_NOPE] = q[..., :D_NOPE] * q.dtype.type(2.0 ** -e)
    a = runs.run(case, x)
    b = runs.run(case, dict(x, kv_cache=cache, q=q))
    oa, ob = np.asarray(a["o"], dtype=np.float64), np.asarray(b["o"], dtype=np.float64)
    np.testing.assert_array_equal(ob, oa * 2.0 ** e, err_msg=f"{backend}: O did not scale by 2^{e} exactly  "
                                                             f"repro: parity repro {case.id}")
    np.testing.assert_array_equal(np.asarray(b["lse"]), np.asarray(a["lse"]),
                                  err_msg=f"{backend}: the LSE moved  repro: parity repro {case.id}")


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)  # the interpreter: two kernel calls an example
@given(case=cases("kvquant.mla_decode", transform=_valid, **SMALL), seed=st.integers(0, 2**32 - 1))
def test_rows_of_no_live_token_are_never_read(backend, case, seed):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    cache = x["kv_cache"]
    n_blocks, page, h_kv, _ = cache.shape
    table, L = x["block_table"].astype(np.int64), x["seqlens"].astype(np.int64)
    live = np.zeros(n_blocks * page, dtype=bool)
    for i in range(L.size):
        t = np.arange(L[i])
        live[table[i, t // page] * page + t % page] = True
    rng = np.random.default_rng(seed)
    junk = kd.pack(rng.standard_normal((n_blocks * page, h_kv, kd.D)) * 3.0)
    other = np.ascontiguousarray(cache).reshape(n_blocks * page, h_kv, kd.ROW_BYTES).copy()
    other[~live] = junk[~live]
    a = runs.run(case, x)
    b = runs.run(case, dict(x, kv_cache=other.reshape(cache.shape)))
    for name in ("o", "lse"):
        np.testing.assert_array_equal(np.asarray(b[name], dtype=np.float64), np.asarray(a[name], dtype=np.float64),
                                      err_msg=f"{backend}: {name} changed when rows of no live token did  "
                                              f"repro: parity repro {case.id}")


@pytest.mark.parity_backends("triton")
@settings(max_examples=4)  # the interpreter: 2-6 kernel calls an example, seconds each
@given(case=cases("kvquant.mla_decode", transform=_valid, **SMALL), splits=st.integers(2, 5))
def test_triton_splits_agree_with_one_split(parity, backend, case, splits):
    from kernel_parity.conformance.backends._torch import to_torch
    from kernel_parity.conformance.ops.mla import SCALES
    from kernel_parity.kernels.triton.kvquant_mla_dense import kvquant_mla_decode

    case = case.with_backend(backend)
    rec, a = parity.arrays(case)
    assume(rec.verdict != "skip")
    t = {k: to_torch(v, "cpu") for k, v in a["inputs"].items()}
    o, lse = kvquant_mla_decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[case.p["scale"]],
                                causal=bool(case.p["causal"]), num_splits=splits, block_n=16)
    got = {"o": runs.to_numpy(o), "lse": runs.to_numpy(lse)}
    runs.assert_close(case, got, a["outputs"], f"the tokens split into {splits} parts (16-key tiles)")


@pytest.mark.parity_backends(*BACKENDS)
@settings(max_examples=8)
@given(case=cases("kvquant.mla_pack", transform=_fits, **PACK), seed=st.integers(0, 2**32 - 1))
def test_pack_tokens_permuted_with_their_slots_write_the_same_cache(backend, case, seed):
    case = case.with_backend(backend)
    x = dict(runs.inputs_of(case))
    perm = np.random.default_rng(seed).permutation(x["slot_mapping"].size)
    y = dict(x, kv_c=np.ascontiguousarray(x["kv_c"][perm]), k_pe=np.ascontiguousarray(x["k_pe"][perm]),
             slot_mapping=np.ascontiguousarray(x["slot_mapping"][perm]))
    a = runs.run(case, {k: np.array(v, copy=True) for k, v in x.items()})
    b = runs.run(case, {k: np.array(v, copy=True) for k, v in y.items()})
    runs.assert_same_bits(case, a, b, "the tokens were permuted with their slots")


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30), pad=st.integers(0, 5), lo=st.integers(-30, 0),
       hi=st.integers(0, 12))
def test_golden_pack_writes_pack_rows_and_keeps_every_other_byte(seed, n, pad, lo, hi):
    rng = np.random.default_rng(seed)
    blocks, page = 3, 16
    cache = rng.integers(0, 256, (blocks, page, 1, kd.ROW_BYTES), dtype=np.uint8)
    x = (rng.standard_normal((n, kd.D)) * 2.0 ** rng.integers(lo, hi + 1, (n, 1))).astype(ml_dtypes.bfloat16)
    slots = rng.choice(blocks * page, n, replace=False).astype(np.int64)
    slots[rng.permutation(n)[:min(pad, n)]] = -1
    out = kd.mla_pack(cache, x[:, :D_NOPE], x[:, D_NOPE:], slots)
    flat_in, flat_out = cache.reshape(-1, kd.ROW_BYTES), out.reshape(-1, kd.ROW_BYTES)
    real = slots != -1
    np.testing.assert_array_equal(flat_out[slots[real]], kd.pack(np.asarray(x, dtype=np.float64)[real]))
    kept = np.ones(blocks * page, dtype=bool)
    kept[slots[real]] = False
    np.testing.assert_array_equal(flat_out[kept], flat_in[kept])
    got = kd.unpack(flat_out[slots[real]])
    s = kd.row_scales(np.asarray(x, dtype=np.float64)[real]).astype(np.float64)
    v = np.abs(np.asarray(x, dtype=np.float64)[real, :D_NOPE]).reshape(-1, 4, 128) / s[..., None]
    step = np.where(v < 2.0 ** -6, 2.0 ** -9, 2.0 ** (np.floor(np.log2(np.maximum(v, 2.0 ** -6))) - 3))
    err = np.abs(got[:, :D_NOPE] - np.asarray(x, dtype=np.float64)[real, :D_NOPE]).reshape(-1, 4, 128)
    assert (err <= 0.5 * step * s[..., None]).all(), f"max error {err.max()} beyond half a code step"
