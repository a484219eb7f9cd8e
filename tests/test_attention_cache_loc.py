"""Self-tests of the attention reading ops' `rows` (TensorRT-LLM's cache_loc: decode, decode_paged,
decode_split, chunked_prefill): the golden reads row cache_loc[b], the generated inputs poison the rows no sequence
maps to, older ids and inputs are unchanged, validation, and the C kernel's cache_loc checks."""

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.errors import UsageError
from kernel_parity.refimpl import attention as A

MASK = dict(causal="bottom_right", wl=-1, wr=-1, cap=0, sink=0)
CASES = {
    "attention.decode": dict(b=4, sq=2, kv=37, hq=4, hkv=2, d=32, lens="ragged", **MASK),
    "attention.decode_paged": dict(b=4, sq=1, kv=40, hq=4, hkv=2, d=32, lens="ragged", page=16, **MASK),
    "attention.chunked_prefill": dict(b=4, sq=5, hist=20, hq=4, hkv=2, d=32, lens="ragged", page=16, **MASK),
    "attention.decode_split": dict(b=4, sq=1, kv=300, hq=4, hkv=2, d=32, lens="ragged", splits=2, part="block",
                                   blk=256, page=64, **MASK),
}


def _inputs(op, params, seed=0):
    spec = ops.get(op)
    p = spec.params.validate(spec.name, params)
    return spec, p, spec.make_inputs(p, "fp32", "normal", np.random.default_rng(seed))


@pytest.mark.parametrize("op", CASES)
def test_rows_zero_keeps_the_older_ids_and_inputs(op):
    spec, p, x = _inputs(op, CASES[op])
    _, _, y = _inputs(op, {**CASES[op], "rows": 0})
    assert "rows" not in ops.make_case(op, "cpu", "fp32", {**CASES[op], "rows": 0}, "normal", 0).id
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=True) for k in x)
    _, _, z = _inputs(op, {**CASES[op], "rows": 7})  # the same draws first, then cache_loc
    assert np.array_equal(z["q"], x["q"]) and "cache_loc" in z and "cache_loc" not in x


@pytest.mark.parametrize("op", CASES)
def test_golden_reads_row_cache_loc_and_its_unused_rows_are_poison(op):
    spec, p, x = _inputs(op, {**CASES[op], "rows": 7})
    _, _, plain = _inputs(op, CASES[op])
    loc = x["cache_loc"]
    assert len(set(loc.tolist())) == 4 and (loc != np.arange(4)).all() and loc.max() < 7
    got, want = spec.reference(x, p), spec.reference(plain, CASES[op])
    assert all(np.array_equal(got[k], want[k], equal_nan=True) for k in want)  # the same sequences, other rows
    unused = np.setdiff1d(np.arange(7), loc)
    if "block_table" in x:
        assert x["block_table"].shape[0] == 7 and np.isnan(x["k_cache"][x["block_table"][unused]]).all()
    else:
        assert x["k_cache"].shape[0] == 7 and np.isnan(x["k_cache"][unused]).all()
    ignored = {k: v for k, v in x.items() if k != "cache_loc"}  # a kernel that reads row b
    if "block_table" in x:
        ignored["block_table"] = x["block_table"][:4]
    else:
        ignored["k_cache"], ignored["v_cache"] = x["k_cache"][:4], x["v_cache"][:4]
    wrong = spec.reference(ignored, CASES[op])
    assert not np.allclose(wrong["o"], got["o"], equal_nan=True)


def test_decode_cache_loc_is_the_gathered_cache():
    _, p, x = _inputs("attention.decode", {**CASES["attention.decode"], "rows": 5})
    kw = dict(seqlens=x["seqlens"])
    o, lse, _ = A.decode(x["q"], x["k_cache"], x["v_cache"], cache_loc=x["cache_loc"], **kw)
    o2, lse2, _ = A.decode(x["q"], x["k_cache"][x["cache_loc"]], x["v_cache"][x["cache_loc"]], **kw)
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2) and not np.isnan(o).any()


@pytest.mark.parametrize("op", CASES)
def test_rows_fewer_than_the_batch_is_a_usage_error(op):
    with pytest.raises(UsageError, match=r"rows=3 .* b=4 .*expected rows=0, no cache_loc, or rows >= b"):
        ops.make_case(op, "cpu", "fp32", {**CASES[op], "rows": 3}, "normal", 0)


@pytest.mark.parametrize("bad, match", [
    (np.array([0, 4], dtype=np.int32), r"cache_loc must lie in \[0, 4\)"),
    (np.array([0, 1, 2], dtype=np.int32), r"cache_loc must have shape \(2,\)"),
    (np.array([0, 1], dtype=np.int64), "cache_loc"),
])
def test_cpu_kernels_reject_a_bad_cache_loc(bad, match):
    from kernel_parity.kernels.cpu import attention as k

    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    cache = rng.standard_normal((4, 8, 1, 16)).astype(np.float32)
    lens = np.array([3, 5], dtype=np.int32)
    with pytest.raises(ValueError, match=match):
        k.decode(q, cache, cache, lens, cache_loc=bad)
    table = np.arange(8, dtype=np.int32).reshape(4, 2)
    with pytest.raises(ValueError, match=match):
        k.decode_paged(q, cache, cache, table, lens, cache_loc=bad)
