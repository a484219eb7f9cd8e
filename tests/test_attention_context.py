"""attention.context_kv (TensorRT-LLM's context_attention_kv): the golden against per-sequence dense attention
over history + chunk, the cache write's canaries, validation, and what the ci suite covers."""

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.cli import main
from kernel_parity.refimpl import attention as A

OP = "attention.context_kv"


def _case(page: int, lens: str = "ragged"):
    spec = ops.get(OP)
    p = spec.params.validate(OP, dict(b=5, sq=9, hist=20, hq=4, hkv=2, d=16, lens=lens, page=page))
    return spec, p, spec.make_inputs(p, "fp32", "normal", np.random.default_rng(3))


@pytest.mark.parametrize("page", [0, 16])
def test_golden_is_dense_causal_attention_over_history_then_chunk(page):
    """Query i of sequence b sees the b's cached history and chunk keys 0..i (bottom_right over
    input_pos_b + L_b keys); the chunk lands at input_pos_b + t; every other slot keeps its bits (NaN)."""
    spec, p, x = _case(page)
    o, lse, _, k_out, v_out = A.context_kv(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["cu_seqlens"],
                                           x["input_pos"], x.get("block_table"))
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    cu, pos = x["cu_seqlens"], x["input_pos"]
    assert (np.diff(cu) == 0).any() and (pos == 0).any() and (pos > 0).any()  # an empty chunk, both histories
    read = (lambda c: A.gather_pages(c, x["block_table"])) if page else (lambda c: c)
    k_in, k_seq, v_seq = read(x["k_cache"]), read(k_out), read(v_out)
    for b in range(p["b"]):  # the test's loop over sequences: each one a dense prefill of its own
        lo, hi, h = cu[b], cu[b + 1], pos[b]
        assert np.array_equal(k_seq[b, h:h + hi - lo], x["k"][lo:hi]) and np.array_equal(v_seq[b, h:h + hi - lo],
                                                                                        x["v"][lo:hi])
        assert np.isnan(k_seq[b, h + hi - lo:]).all() and np.array_equal(k_seq[b, :h], k_in[b, :h])
        if hi == lo:
            continue
        keys = np.concatenate([k_in[b, :h], x["k"][lo:hi]])[None]
        vals = np.concatenate([read(x["v_cache"])[b, :h], x["v"][lo:hi]])[None]
        o_b, lse_b, _ = A.prefill(x["q"][None, lo:hi], keys, vals, causal="bottom_right")
        np.testing.assert_allclose(o[lo:hi], o_b[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, lo:hi], lse_b[0], rtol=1e-12, atol=1e-12)
    untouched = np.ones(k_out.shape[0], bool)  # pages no sequence owns keep their bits too
    if page:
        untouched[np.unique(x["block_table"])] = False
        assert untouched.sum() == 2 and np.isnan(k_out[untouched]).all()


def test_inputs_poison_the_slots_the_write_fills():
    """The cache holds NaN from input_pos_b on (the chunk's own slots included): a kernel that attends before
    its write lands reads NaN."""
    _, p, x = _case(0, lens="full")
    s = np.arange(x["k_cache"].shape[1])
    assert np.isnan(x["k_cache"][:, s >= p["hist"]]).all() and not np.isnan(x["k_cache"][:, s < p["hist"]]).any()


def test_validation_is_one_line_exit_2(capsys):
    bad = f"{OP}/torch/fp32/b=2,sq=3,hist=4,hq=3,hkv=2,d=16,lens=full,page=0/normal/seed=0"
    assert main(["repro", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hq=3" in err[0] and "hkv=2" in err[0]
    assert main(["repro", bad.replace("hq=3", "hq=4").replace("page=0", "page=32")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "page" in err[0]


def test_ci_covers_empty_chunks_gqa_both_histories_and_a_chunk_crossing_a_page():
    from kernel_parity.conformance import suites
    from kernel_parity.conformance.runner import Prepared

    seen = set()
    for case in suites.cases("ci"):
        if case.op != OP:
            continue
        seen.add(("backend", case.backend))
        if case.backend != "triton" or case.dtype != "fp32":
            continue
        x = Prepared(ops.get(OP), case).inputs
        n, pos, page = np.diff(x["cu_seqlens"]), x["input_pos"], case.p["page"]
        seen.update([("empty", bool((n == 0).any())), ("gqa", case.p["hq"] > case.p["hkv"] > 1),
                     ("hist0+hist", bool((pos == 0).any() and (pos > 0).any()))])
        if page and ((pos % page + n > page) & (n > 0)).any():
            seen.add(("crossing", True))
    want = {("backend", b) for b in ("triton", "cpu", "torch")} | {(k, True) for k in ("empty", "gqa", "hist0+hist",
                                                                                       "crossing")}
    assert want <= seen, f"ci misses {sorted(want - seen)}"
