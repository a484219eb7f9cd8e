"""Issue 32, MAX S23: the sparse mode (sparse_mla) of mla.decode_fused_fp8: each new token attends only the
top-k cache slots its d_indices row lists (indices_stride, per-token topk_lengths, -1 padding).

The golden's sparse mode is checked against its dense mode (a list of exactly a token's causal keys gives the
dense causal result), the poisoned inputs against what they promise (every entry a kernel must not use names a
NaN row, a token of length 0 gets out 0), the param's default keeps older ids and draws, and mask=null with
sparse is a one-line usage error. The Triton kernel's sparse mode: tests/test_mla_fused_sparse.py.
"""

from __future__ import annotations

import numpy as np

from kernel_parity.conformance import ops
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.ops.mla import PAGE, fused_stride
from kernel_parity.refimpl import mla as golden

CASE = "mla.decode_fused_fp8/torch/bf16/b=3,new=2,hq=2,kv=70,lens=ragged,sink={sink}{extra}/normal/seed=0"


def _case(sink: int = 0, extra: str = ""):
    case = ops.parse_case(CASE.format(sink=sink, extra=extra))
    spec = ops.get(case.op)
    return spec, case.p, spec.make_inputs(case.p, "bf16", "normal", np.random.default_rng(5))


def _args(x):
    return (x["q"], x["input_row_offsets"], x["freqs_cis"], x["gamma"], 1e-6, x["w_uk"], x["w_uk_scale"],
            x["w_uv"], x["w_uv_scale"], x["kv_cache"], x["block_table"], x["cache_lengths"], 0.13)


def test_sparse_defaults_to_dense_keeps_the_dense_draws_and_rejects_a_null_mask(capsys):
    plain = CASE.format(sink=1, extra="")
    assert ops.parse_case(CASE.format(sink=1, extra=",sparse=0")).id == plain
    assert "sparse" not in ops.parse_case(plain).p
    _, _, dense = _case(1)
    _, _, sparse = _case(1, ",sparse=8")
    for k, v in dense.items():  # the sparse draws come last: only the cache's unselected rows change
        if k != "kv_cache":
            assert np.array_equal(v, sparse[k]), k
    assert main(["repro", CASE.format(sink=0, extra=",sparse=8,mask=null")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mask=null needs sparse=0" in err[0]


def test_a_list_of_every_causal_key_gives_the_dense_result():
    """Token t listing exactly its request's keys 0..p (shuffled, -1 and NaN-slot garbage interleaved past its
    length and in the stride's extra columns) attends as the dense causal branch, sinks per request too."""
    _, _, x = _case(1, ",sink_shape=batch")
    off, cl, table = x["input_row_offsets"], x["cache_lengths"], x["block_table"]
    n = np.diff(off)
    T = int(n.sum())
    req = np.repeat(np.arange(3), n)
    pos = cl[req] + np.arange(T) - off[req]
    k = int(pos.max()) + 3
    stride = k + 2
    rng = np.random.default_rng(0)
    idx = np.full((T, stride), 10 ** 8, dtype=np.int64)  # past the cache: never to be read
    lens = np.zeros(T, dtype=np.int64)
    for t in range(T):
        tok = np.arange(int(pos[t]) + 1)
        slots = list(table[req[t], tok // PAGE].astype(np.int64) * PAGE + tok % PAGE)
        slots.insert(int(rng.integers(0, len(slots) + 1)), -1)
        idx[t, :len(slots)] = rng.permutation(slots)
        lens[t] = len(slots)
    dense, cache = golden.decode_fused_fp8(*_args(x), attn_sink=x["attn_sink"], sink_per="batch")
    sparse, cache_s = golden.decode_fused_fp8(*_args(x), attn_sink=x["attn_sink"], sink_per="batch",
                                              d_indices=idx.reshape(-1), indices_stride=stride, topk=k,
                                              topk_lengths=lens)
    np.testing.assert_allclose(sparse, dense, rtol=1e-9, atol=1e-12)
    assert np.array_equal(cache, cache_s, equal_nan=True)


def test_the_inputs_poison_every_entry_a_kernel_must_not_use():
    spec, p, x = _case(0, ",sparse=16")
    stride, T = fused_stride(p), len(x["topk_lengths"])
    idx = x["d_indices"].reshape(T, stride).astype(np.int64)
    lens = x["topk_lengths"]
    assert lens[0] == 16 and lens[2] == 0 and (idx[:, :16] == -1).any()
    rows = x["kv_cache"].reshape(-1, x["kv_cache"].shape[-1]).astype(np.float64)
    past = np.arange(stride)[None, :] >= lens[:, None]
    assert np.isnan(rows[idx[past], 0]).all()  # past each length and the stride's extra columns: NaN rows
    used = ~past & (idx != -1)
    assert not np.isnan(rows[idx[used]]).any()
    live = ~np.isnan(rows[:, 0])
    assert live.sum() <= len(np.unique(idx[used])) + T  # every other cached row: NaN
    out = spec.reference(x, p)["out"]
    assert np.isfinite(out).all() and not out[2].any() and np.abs(out[lens > 0]).min(axis=(1, 2)).max() > 0


# ---- the second cache (extra=1) ----------------------------------------------------------------------

def test_extra_needs_sparse_and_defaults_off(capsys):
    plain = CASE.format(sink=1, extra=",sparse=16")
    assert ops.parse_case(CASE.format(sink=1, extra=",sparse=16,extra=0")).id == plain
    assert main(["repro", CASE.format(sink=0, extra=",extra=1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "extra=1 needs sparse=k > 0" in err[0]


def test_the_extra_list_is_the_main_list_extended_by_its_rows():
    """One softmax over both lists: the golden with the second cache equals the golden without it whose main
    list also names copies of the extra rows (written into the main cache's spare NaN pages; scales set to 1,
    so the e4m3 rows are exact in bf16), per-request sinks in the denominator once."""
    import ml_dtypes

    spec, p, x = _case(1, ",sparse=16,extra=1")
    k, stride, T = p["sparse"], fused_stride(p), len(x["topk_lengths"])
    x["extra_scales"] = np.ones_like(x["extra_scales"])
    x["extra_k"] = np.nan_to_num(x["extra_k"].astype(np.float32), nan=0.0).astype(ml_dtypes.float8_e4m3fn)
    with_extra = spec.reference(x, p)["out"]
    rows = x["kv_cache"].reshape(-1, x["kv_cache"].shape[-1])
    spare = np.flatnonzero(np.isnan(rows[:, 0].astype(np.float64)))
    main_idx, e_idx = (x[n].reshape(T, stride).astype(np.int64) for n in ("d_indices", "extra_d_indices"))
    merged = np.full((T, 2 * k), -1, dtype=np.int64)
    lens = np.zeros(T, dtype=np.int32)
    e_rows = x["extra_k"].reshape(-1, rows.shape[1])
    for t in range(T):
        m = [int(i) for i in main_idx[t, :x["topk_lengths"][t]]]
        e = [int(i) for i in e_idx[t, :x["extra_topk_lengths"][t]]]
        copies = []
        for i in e:
            if i != -1:
                rows[spare[len(copies) + 16 * t]] = e_rows[i].astype(np.float32)
            copies.append(-1 if i == -1 else int(spare[len(copies) + 16 * t]))
        merged[t, :len(m) + len(copies)] = m + copies
        lens[t] = len(m) + len(copies)
    q = dict(x, d_indices=merged.reshape(-1).astype(np.int32), topk_lengths=lens)
    for n in ("extra_k", "extra_scales", "extra_d_indices", "extra_topk_lengths"):
        del q[n]
    p2 = dict(p, sparse=2 * k)
    del p2["extra"]
    q["d_indices"] = np.concatenate([merged, np.full((T, 3), -1)], axis=1).reshape(-1).astype(np.int32)
    np.testing.assert_allclose(spec.reference(q, p2)["out"], with_extra, rtol=1e-12, atol=1e-14)
