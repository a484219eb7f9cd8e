"""The attention golden's own execution: large goldens run as (batch, kv head) pieces on threads."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("hkv, causal, window, sinks", [(2, "bottom_right", (-1, -1), False), (4, "none", (3, 1), True),
                                                         (1, "top_left", (-1, -1), True)])
def test_attention_by_pieces_on_threads_is_the_whole_call(hkv, causal, window, sinks, monkeypatch):
    """(batch, kv head) pieces on threads give the whole call's arrays bit for bit, empty rows included."""
    from kernel_parity.refimpl import attention as A

    rng = np.random.default_rng(11)
    b, s_q, s_k, h_q, d = 3, 7, 5, 4, 16
    q, k, v = (rng.standard_normal(s) for s in ((b, s_q, h_q, d), (b, s_k, hkv, d), (b, s_k, hkv, d + 8)))
    kw = dict(causal=causal, window=window, softcap=20.0, sinks=rng.standard_normal(h_q) if sinks else None,
              k_lens=np.array([5, 0, 3]))
    monkeypatch.setattr(A, "PIECE_LOGITS", 1 << 40)
    whole = A.attention(q, k, v, **kw)
    monkeypatch.setattr(A, "PIECE_LOGITS", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    pieces = A.attention(q, k, v, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(whole, pieces))


@pytest.mark.parametrize("extra", ["splits=3,page=16", "splits=3,part=block,blk=256,page=64",
                                   "splits=4,part=bounds,page=16,sink=1"])
def test_paged_split_golden_is_the_paged_decode(extra):
    """decode_split over pages (TensorRT-LLM's paged generate) is decode_paged's attention, merged from splits
    that start and end inside pages; it never reads a poisoned slot, and reads each sequence through its own
    block-table row (a table with two rows swapped gives other outputs)."""
    from kernel_parity.conformance import ops
    from kernel_parity.refimpl import attention as A

    p = dict(b=4, sq=2, kv=300, hq=4, hkv=2, d=16, lens="ragged", causal="bottom_right", wl=-1, wr=-1, cap=0, sink=0)
    p.update({k: (v if not v.isdigit() else int(v)) for k, v in (kv.split("=") for kv in extra.split(","))})
    spec = ops.get("attention.decode_split")
    p = spec.params.validate(spec.name, p)
    x = spec.make_inputs(p, "fp32", "normal", np.random.default_rng(5))
    assert x["k_cache"].shape[1] == p["page"] and np.isnan(x["k_cache"]).any()  # pages, poisoned
    part = dict(block=p.get("blk"), bounds=x.get("split_bounds"))
    o, lse, lse_sink, o_parts, lse_parts = A.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"],
                                                          p["splits"], block_table=x["block_table"],
                                                          sinks=x.get("sinks"), **part)
    o_ref, lse_ref, _ = A.decode_paged(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seqlens"],
                                       sinks=x.get("sinks"))
    assert not np.isnan(o).any() and not np.isnan(lse_parts).any()
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    gathered = [A.gather_pages(x[n], x["block_table"]) for n in ("k_cache", "v_cache")]
    flat = A.decode_split(x["q"], *gathered, x["seqlens"], p["splits"], sinks=x.get("sinks"), **part)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip((o, lse, lse_sink, o_parts, lse_parts), flat))
    swapped = x["block_table"][[3, 1, 2, 0]]  # sequences 0 (L=300) and 3 (L=299) read each other's pages
    o_sw = A.decode_split(x["q"], x["k_cache"], x["v_cache"], x["seqlens"], p["splits"], block_table=swapped,
                          sinks=x.get("sinks"), **part)[0]
    assert not np.allclose(o_sw[0], o[0])
