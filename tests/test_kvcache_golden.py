"""Self-tests of refimpl/kvcache.py and of kvcache.update's `rows` (TensorRT-LLM's cache_loc) cases:
the golden against a token-by-token loop, TensorRT-LLM's paged-append arithmetic against the golden
(where they agree and where the ci case separates them), the generated inputs, and the validation."""

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.errors import UsageError
from kernel_parity.refimpl import kvcache as ref

SPEC = ops.get("kvcache.update")
SEPARATING = dict(b=3, snew=20, hkv=2, d=16, smax=64, layout="paged16", rows=7)  # the ci case


def _loop(cache, new, pos, block_table=None, cache_loc=None):
    """The contract written out one token at a time."""
    out = cache.copy()
    for i in range(new.shape[0]):
        r = i if cache_loc is None else cache_loc[i]
        for t in range(new.shape[1]):
            p = pos[i] + t
            if block_table is None:
                out[r, p] = new[i, t]
            else:
                out[block_table[r, p // cache.shape[1]], p % cache.shape[1]] = new[i, t]
    return out


def _trt(cache, new, pos, block_table, cache_loc):
    """TensorRT-LLM's update_paged_kv_cache: pages from cache_len // P, then + cache_len % P on the flat offset."""
    out = cache.copy()
    page = cache.shape[1]
    flat = out.reshape(-1, *cache.shape[2:])
    for i in range(new.shape[0]):
        c = int(pos[i])
        for t in range(new.shape[1]):
            flat[block_table[cache_loc[i], c // page + t // page] * page + t % page + c % page] = new[i, t]
    return out


def _inputs(params, seed):
    p = SPEC.params.validate(SPEC.name, params)
    return p, SPEC.make_inputs(p, "fp32", "normal", np.random.default_rng(seed))


@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged64"])
def test_golden_with_cache_loc_is_the_token_loop(layout):
    for seed in range(5):
        p, x = _inputs(dict(b=3, snew=5, hkv=2, d=8, smax=70, layout=layout, rows=5), seed)
        got = ref.update(x["k_cache"], x["k_new"], x["pos"], block_table=x.get("block_table"), cache_loc=x["cache_loc"])
        assert np.array_equal(got, _loop(x["k_cache"], x["k_new"], x["pos"], x.get("block_table"), x["cache_loc"]))
        if layout == "contiguous":  # the rows no sequence maps to keep every bit
            unused = np.setdiff1d(np.arange(5), x["cache_loc"])
            assert unused.size == 2 and np.array_equal(got[unused], x["k_cache"][unused])


def test_rows_inputs_are_a_permutation_with_canary_rows_and_unowned_odd_pages():
    for seed in range(50):
        p, x = _inputs(SEPARATING, seed)
        loc, bt = x["cache_loc"], x["block_table"]
        assert len(set(loc.tolist())) == 3 and loc.max() < 7 and (loc != np.arange(3)).all()
        assert bt.shape == (7, 4) and x["k_cache"].shape[0] == 2 * 7 * 4 + 1
        assert (bt % 2 == 0).all() and len(set(bt.ravel().tolist())) == bt.size  # owned pages: distinct, even
        assert x["pos"][0] % 16 != 0  # sequence 0 starts inside a page


def test_trt_arithmetic_agrees_only_where_its_callers_stay():
    # where TensorRT-LLM's callers stay it agrees: every append starting on a page boundary, or a
    # sequence's pages physically consecutive
    rng = np.random.default_rng(3)
    cache, new = rng.standard_normal((28, 16, 1, 4)), rng.standard_normal((2, 20, 1, 4))
    bt, loc = np.array([[8, 9, 10, 11], [0, 1, 2, 3]]), np.array([1, 0])
    for pos in (np.array([16, 32]), np.array([5, 13])):
        assert np.array_equal(_trt(cache, new, pos, bt, loc), ref.update(cache, new, pos, block_table=bt, cache_loc=loc))
    shuffled = np.array([[9, 8, 11, 10], [3, 2, 1, 0]])
    aligned = np.array([16, 32])
    assert np.array_equal(_trt(cache, new, aligned, shuffled, loc),
                          ref.update(cache, new, aligned, block_table=shuffled, cache_loc=loc))
    # the ci case: shuffled even pages and an unaligned append separate the two on every seed
    for seed in range(30):
        _, x = _inputs(SEPARATING, seed)
        args = (x["k_cache"], x["k_new"], x["pos"])
        assert not np.array_equal(_trt(*args, x["block_table"], x["cache_loc"]),
                                  ref.update(*args, block_table=x["block_table"], cache_loc=x["cache_loc"])), seed


def test_rows_fewer_than_the_batch_is_a_usage_error():
    with pytest.raises(UsageError, match=r"rows=2 .* b=3 .*expected rows=0, no cache_loc, or rows >= b"):
        ops.make_case("kvcache.update", "cpu", "fp32", {**SEPARATING, "rows": 2}, "normal", 0)
    with pytest.raises(UsageError, match="rows=2"):
        ops.make_case("rope.kv_update", "cpu", "fp32", {**SEPARATING, "d": 64, "rows": 2}, "normal", 0)
    default = ops.make_case("kvcache.update", "cpu", "fp32", {**SEPARATING, "rows": 0}, "normal", 0)
    assert "rows" not in default.id  # rows=0 is the default: the older case ids are unchanged


@pytest.mark.parametrize("bad, match", [
    (np.array([1, 1], dtype=np.int32), "same cache row"),
    (np.array([0, 4], dtype=np.int32), r"cache_loc\[1\] = 4 must lie in \[0, 4\)"),
    (np.array([0, 1, 2], dtype=np.int32), r"cache_loc must have shape \(b,\) = \(2,\)"),
    (np.array([0, 1], dtype=np.int64), "cache_loc"),
])
def test_cpu_kernels_reject_a_bad_cache_loc_before_writing(bad, match):
    from kernel_parity.kernels.cpu import kvcache, rope

    rng = np.random.default_rng(2)
    cache = rng.standard_normal((4, 8, 2, 16)).astype(np.float32)
    new = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)
    pos = np.array([0, 2], dtype=np.int32)
    before = cache.copy()
    with pytest.raises(ValueError, match=match):
        kvcache.update(cache, new, pos, cache_loc=bad)
    with pytest.raises(ValueError, match=match):
        rope.kv_update(cache, cache.copy(), new, new.copy(), pos, np.zeros((8, 8, 2), np.float16), cache_loc=bad)
    assert np.array_equal(cache, before)


# -- TensorRT-LLM's ragged writes (tokens="ragged": flattened new tokens, seq_len / seq_start) and dv --------
RAGGED = dict(b=4, snew=6, hkv=2, d=16, smax=30, tokens="ragged")


def _ragged_loop(cache, new, pos, seq_len, seq_start, block_table=None, cache_loc=None):
    """The ragged contract one sequence at a time: its rows of new are a (1, seq_len, h, d) fixed append."""
    out = cache.copy()
    for i in range(seq_len.size):
        one = new[seq_start[i]: seq_start[i] + seq_len[i]][None]
        loc = None if cache_loc is None else cache_loc[i:i + 1]
        bt = None if block_table is None else (block_table if cache_loc is not None else block_table[i:i + 1])
        if cache_loc is None and block_table is None:
            out[i:i + 1] = _loop(out[i:i + 1], one, pos[i:i + 1])
        else:
            out = _loop(out, one, pos[i:i + 1], bt, loc)
    return out


@pytest.mark.parametrize("extra", [dict(layout="contiguous", dv=8), dict(layout="paged16", dv=40),
                                   dict(layout="paged16", rows=6), dict(layout="contiguous", rows=5)])
def test_ragged_golden_is_the_per_sequence_loop(extra):
    zero_seen = 0
    for seed in range(10):
        p, x = _inputs({**RAGGED, **extra}, seed)
        n, start = x["seq_len"], x["seq_start"]
        assert n.min() == 0 and n.max() <= 6 and np.array_equal(start, np.cumsum(n) - n)  # a 0-length sequence
        assert x["k_new"].shape == (n.sum(), 2, 16) and x["v_new"].shape == (n.sum(), 2, extra.get("dv") or 16)
        assert x["v_cache"].shape[-1] == (extra.get("dv") or 16) and ((x["pos"] + n) <= 30).all()
        kw = dict(block_table=x.get("block_table"), cache_loc=x.get("cache_loc"))
        for c, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
            got = ref.update(x[c], x[new], x["pos"], seq_len=n, seq_start=start, **kw)
            want = _ragged_loop(x[c], x[new], x["pos"], n, start, kw["block_table"], kw["cache_loc"])
            assert np.array_equal(got, want)
            assert (got != x[c]).sum() > 0  # something was written
        zero_seen += int((n == 0).sum())
    assert zero_seen == 10


def test_ragged_and_dv_keep_the_older_ids_on_both_writes():
    for op in ("kvcache.update", "rope.kv_update"):  # rope.kv_update takes them too (S13)
        default = ops.make_case(op, "cpu", "fp32", {**SEPARATING, "d": 64, "tokens": "fixed", "dv": 0}, "normal", 0)
        assert "tokens" not in default.id and "dv" not in default.id
        with pytest.raises(UsageError, match="tokens='padded' is not one of fixed, ragged"):
            ops.make_case(op, "cpu", "fp32", {**RAGGED, "layout": "contiguous", "tokens": "padded"}, "normal", 0)


@pytest.mark.parametrize("kw, match", [
    (dict(seq_start=np.array([0, 3], dtype=np.int32)), r"sequence 1's tokens new\[3 : 6\] must lie in new's 5 rows"),
    (dict(seq_len=np.array([2, -1], dtype=np.int32)), "seq_len and seq_start >= 0"),
    (dict(seq_start=None), "go together"),
    (dict(seq_len=np.array([3, 3], dtype=np.int32), seq_start=np.array([0, 2], dtype=np.int32),
          pos=np.array([0, 6], dtype=np.int32)), "do not fit"),
])
def test_cpu_kernel_rejects_a_bad_ragged_layout_before_writing(kw, match):
    from kernel_parity.kernels.cpu import kvcache

    rng = np.random.default_rng(4)
    cache = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    new = rng.standard_normal((5, 2, 16)).astype(np.float32)
    args = dict(seq_len=np.array([2, 3], dtype=np.int32), seq_start=np.array([0, 2], dtype=np.int32),
                pos=np.array([1, 4], dtype=np.int32)) | kw
    before = cache.copy()
    with pytest.raises(ValueError, match=match):
        kvcache.update(cache, new, args.pop("pos"), **args)
    assert np.array_equal(cache, before)
    kvcache.update(cache, new, np.array([1, 4], dtype=np.int32), seq_len=np.array([2, 3], dtype=np.int32),
                   seq_start=np.array([0, 2], dtype=np.int32))  # the good layout writes
    assert np.array_equal(cache[1, 4:7], new[2:5]) and np.array_equal(cache[0, 1:3], new[:2])


def test_metadata_golden_by_hand():
    """TensorRT-LLM's prepare_fused_mha_metadata: exclusive cumsum, a zero-length sequence inside the batch,
    CUDA-graph padding rows inert (seq_len 0, the last real row's position and cache row), stale values dropped."""
    n, pos, loc = [np.array(a, dtype=np.int32) for a in ([3, 0, 2, 0, 0], [5, 6, 7, 99, 98], [2, 0, 1, 77, 76])]
    got = ref.metadata(n, pos, loc, graph=4)
    want = ([3, 0, 2, 0], [5, 6, 7, 7], [2, 0, 1, 1], [0, 3, 3, 5])
    assert all(np.array_equal(g, w) and g.dtype == np.int32 for g, w in zip(got, want))
    got = ref.metadata(n, pos, loc)  # no graph: the b = 3 real rows
    assert [a.tolist() for a in got] == [[3, 0, 2], [5, 6, 7], [2, 0, 1], [0, 3, 3]]
    # TensorRT-LLM's count, sum(seq_len > 0) = 2, would drop the third sequence of this batch
    assert int((n > 0).sum()) == 2 and got[0].size == 3
    with pytest.raises(ValueError, match="graph=2"):
        ref.metadata(n, pos, loc, graph=2)


@pytest.mark.parametrize("graph", [0, 16])
def test_metadata_kernels_are_the_golden(graph):
    from kernel_parity.kernels.cpu import kvcache as ck

    spec = ops.get("kvcache.metadata")
    for seed in range(20):
        p = spec.params.validate(spec.name, dict(b=7, maxb=16, graph=graph, snew=1 + seed % 5, smax=50))
        x = spec.make_inputs(p, "fp32", "normal", np.random.default_rng(seed))
        want = ref.metadata(x["seq_len"], x["input_pos"], x["cache_loc"], graph=graph)
        got = ck.metadata(x["seq_len"], x["input_pos"], x["cache_loc"], graph=graph)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), seed
        assert (want[1] < 10**6).all() and (want[2] < 10**6).all()  # no stale value reaches the outputs


def test_metadata_params_are_checked():
    base = dict(b=5, maxb=8, graph=0, snew=4, smax=30)
    with pytest.raises(UsageError, match=r"graph=3 .* b=5 .*expected graph=0 or graph >= b"):
        ops.make_case("kvcache.metadata", "cpu", "fp32", {**base, "graph": 3}, "normal", 0)
    with pytest.raises(UsageError, match=r"maxb=8 .*graph=9"):
        ops.make_case("kvcache.metadata", "cpu", "fp32", {**base, "graph": 9}, "normal", 0)


def test_metadata_triton_kernel_is_the_golden():
    """kernels/triton/kvcache.py `metadata` in the interpreter: the spec's inputs with and without CUDA-graph padding,
    a batch of zero lengths only, and buffers past one block (the cumsum carried across blocks); a graph smaller
    than the batch and a wrong buffer are refused."""
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()
    torch = pytest.importorskip("torch")
    if interpreter_ready():
        pytest.skip(interpreter_ready())
    from kernel_parity.kernels.triton import kvcache as tk

    spec = ops.get("kvcache.metadata")
    rng = np.random.default_rng(5)
    cases = []
    for seed, graph in ((0, 0), (1, 16), (2, 9)):
        p = spec.params.validate(spec.name, dict(b=7, maxb=16, graph=graph, snew=4, smax=50))
        x = spec.make_inputs(p, "fp32", "normal", np.random.default_rng(seed))
        cases.append((x["seq_len"], x["input_pos"], x["cache_loc"], graph))
    zero = np.zeros(6, dtype=np.int32)
    cases += [(zero, zero + 5, zero + 3, 0), (zero, zero + 5, zero + 3, 4)]
    n = rng.integers(0, 4, 2600).astype(np.int32)
    n[2400:] = 0
    n[2399] = 2
    cases.append((n, rng.integers(0, 10**6, 2600).astype(np.int32), rng.integers(0, 10**6, 2600).astype(np.int32),
                  2500))
    for seq_len, pos, loc, graph in cases:
        want = ref.metadata(seq_len, pos, loc, graph=graph)
        got = tk.metadata(*(torch.from_numpy(a.copy()) for a in (seq_len, pos, loc)), graph=graph)
        assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want)), (seq_len.size, graph)
    t = [torch.from_numpy(a.copy()) for a in cases[0][:3]]
    with pytest.raises(ValueError, match=r"graph of 3 rows \(expected >= 7\)"):
        tk.metadata(*t, graph=3)
    with pytest.raises(ValueError, match="input_pos must be a contiguous"):
        tk.metadata(t[0], t[1].long(), t[2])
