"""The kvquant.chunked_prefill golden (refimpl/kvquant_prefill.py) against a plain torch float64 transcription of
chunked prefill over a dequantized paged cache (vLLM's reference: codes.to(float64) * scale, gather the pages,
bottom-right causal softmax), its declared conventions (empty chunks write no row, refimpl.attention's
chunked_prefill on the dequantized float cache, row blocks give the same numbers), its refusals, the spec's
inputs (the ragged (chunk, history) pairs, neighbour separation, poison) and the kernels' refusals."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.ops.kvquant_decode import NAN_CODE
from kernel_parity.conformance.ops.kvquant_prefill import CHUNKED_PREFILL, lengths
from kernel_parity.refimpl import attention, kvquant
from kernel_parity.refimpl import kvquant_prefill as golden_module

torch = pytest.importorskip("torch")

P = dict(b=8, sq=12, hist=40, hq=8, hkv=2, d=32, lens="ragged", page=16)
ARGS = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "cu_seqlens_q", "hist", "block_table")


def _inputs(fmt, gran, dist="normal", seed=0, **kw):
    p = {**P, "fmt": fmt, "gran": gran, **kw}
    return p, CHUNKED_PREFILL.make_inputs(p, "fp32", dist, np.random.default_rng(seed))


def _golden(x, **kw):
    return kvquant.chunked_prefill(*(x[k] for k in ARGS), **kw)


def _torch_reference(x):
    """Chunked prefill as a PyTorch model writes it, float64: dequantize, gather, causal mask, softmax, sum."""
    q = torch.from_numpy(np.asarray(x["q"], dtype=np.float64))
    total_q, h_q, d = q.shape
    nb, page, h_kv, _ = x["k_cache"].shape
    o = torch.zeros(total_q, h_q, d, dtype=torch.float64)
    lse = torch.zeros(h_q, total_q, dtype=torch.float64)
    cu = x["cu_seqlens_q"]
    for i in range(cu.size - 1):
        c0, c1, H = int(cu[i]), int(cu[i + 1]), int(x["hist"][i])
        if c1 == c0:
            continue
        L = H + c1 - c0
        pages = torch.from_numpy(x["block_table"][i, : -(-L // page)].astype(np.int64))
        kv = []
        for codes, s in ((x["k_cache"], x["k_scale"]), (x["v_cache"], x["v_scale"])):
            c = torch.from_numpy(codes.astype(np.float64))[pages].reshape(-1, h_kv, d)[:L]
            st = torch.from_numpy(s.astype(np.float64))
            st = st[pages].reshape(-1, h_kv)[:L, :, None] if st.dim() == 3 else st.reshape(1, -1, 1)
            kv.append((c * st).repeat_interleave(h_q // h_kv, dim=1))  # L, h_q, d
        s = torch.einsum("qhd,lhd->hql", q[c0:c1], kv[0]) / math.sqrt(d)
        pos = H + torch.arange(c1 - c0)[:, None]  # query i at position hist + i
        s = s.masked_fill(torch.arange(L)[None, :] > pos, -math.inf)
        o[c0:c1] = torch.einsum("hql,lhd->qhd", torch.softmax(s, dim=-1), kv[1])
        lse[:, c0:c1] = torch.logsumexp(s, dim=-1)
    return o.numpy(), lse.numpy()


@pytest.mark.parametrize("fmt", kvquant.FORMATS)
@pytest.mark.parametrize("gran", kvquant.GRANS)
@pytest.mark.parametrize("dist", ["normal", "grid"])
def test_matches_torch_float64(fmt, gran, dist):
    _, x = _inputs(fmt, gran, dist)
    o, lse = _golden(x)
    to, tl = _torch_reference(x)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(o, to, rtol=1e-12, atol=1e-12 * np.abs(to).max())
    np.testing.assert_allclose(lse, tl, rtol=1e-12, atol=1e-12)


def test_is_attention_chunked_prefill_on_the_dequantized_cache():
    """Token scales through the pages, and the float cache of code x scale, give attention.chunked_prefill's answer."""
    _, x = _inputs("int8", "token")
    o, lse = _golden(x)
    k = kvquant.dequantize(x["k_cache"], x["k_scale"][..., None])
    v = kvquant.dequantize(x["v_cache"], x["v_scale"][..., None])
    ro, rl, _ = attention.chunked_prefill(x["q"], k, v, x["cu_seqlens_q"], x["hist"], x["block_table"])
    np.testing.assert_allclose(o, ro, rtol=1e-13, atol=1e-13 * np.abs(ro).max())
    np.testing.assert_allclose(lse, rl, rtol=1e-14)


def test_row_blocks_give_the_same_numbers(monkeypatch):
    _, x = _inputs("e4m3", "head")
    o, lse = _golden(x)
    monkeypatch.setattr(golden_module, "LOGIT_BUDGET", 1)  # one query row at a time
    o1, l1 = _golden(x)
    np.testing.assert_allclose(o1, o, rtol=1e-14, atol=1e-14 * np.abs(o).max())
    np.testing.assert_allclose(l1, lse, rtol=1e-14)


def test_empty_chunks_write_no_row_and_ignore_their_cache():
    p, x = _inputs("e4m3", "token")
    lq, hs = lengths(p)
    assert (lq == 0).any() and ((lq == 0) & (hs > 0)).any()
    o, lse = _golden(x)
    assert o.shape[0] == lq.sum()
    poisoned = dict(x, block_table=x["block_table"].copy())
    poisoned["block_table"][lq == 0] = -1  # an empty chunk's pages are never read
    o2, l2 = _golden(poisoned)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, l2)


def test_the_chunk_reads_its_own_keys_from_the_cache():
    """Query i sees key hist + i (its own, written before the call) and not key hist + i + 1."""
    p, x = _inputs("e4m3", "tensor", lens="full", b=1, sq=4, hist=5)
    o, _ = _golden(x)
    page = p["page"]
    k = x["k_cache"].copy()
    pg, slot = x["block_table"][0, (5 + 3) // page], (5 + 3) % page  # the last query's own key
    k[pg, slot] = np.asarray(0.0, dtype=k.dtype)
    o2, _ = _golden(dict(x, k_cache=k))
    assert not np.array_equal(o[3], o2[3]) and np.array_equal(o[:3], o2[:3])


@pytest.mark.parametrize("gran", kvquant.GRANS)
def test_k_scales_times_c_is_softmax_scale_times_c_and_v_scales_scale_o(gran):
    _, x = _inputs("e4m3", gran)
    d = x["q"].shape[-1]
    o, lse = _golden(x)
    ko, kl = _golden(dict(x, k_scale=x["k_scale"] * np.float32(4.0)))
    so, sl = _golden(x, scale=4.0 / math.sqrt(d))
    np.testing.assert_allclose(ko, so, rtol=1e-12, atol=1e-12 * np.abs(so).max())
    np.testing.assert_allclose(kl, sl, rtol=1e-12)
    vo, vl = _golden(dict(x, v_scale=x["v_scale"] * np.float32(0.25)))
    np.testing.assert_array_equal(vo, o * 0.25)
    np.testing.assert_array_equal(vl, lse)


def test_refusals():
    _, x = _inputs("e4m3", "head")
    with pytest.raises(ValueError, match="k_scale must have shape"):
        _golden(dict(x, k_scale=np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        _golden(dict(x, cu_seqlens_q=x["cu_seqlens_q"][::-1].copy()))
    with pytest.raises(ValueError, match="hist must be"):
        _golden(dict(x, hist=x["hist"] - 100))
    with pytest.raises(ValueError, match="max_pages \\* page"):
        _golden(dict(x, hist=x["hist"] + 10_000))
    with pytest.raises(ValueError, match="multiple of h_kv"):
        _golden(dict(x, q=x["q"][:, :3]))
    with pytest.raises(ValueError, match="q must be"):
        _golden(dict(x, q=x["q"][0]))


# -- the spec's inputs -------------------------------------------------------------------------------------------
def test_ragged_pairs():
    p = dict(P, sq=40, hist=300)
    lq, hs = lengths(p)
    pairs = set(zip(lq.tolist(), hs.tolist()))
    assert {(40, 300), (0, 150), (1, 299), (40, 0), (3, 30), (20, 15), (0, 0)} <= pairs
    assert 33 in (lq + hs).tolist()  # one past two pages of 16
    full = lengths(dict(p, lens="full"))
    assert (full[0] == 40).all() and (full[1] == 300).all()


def test_neighbouring_scales_are_far_apart_and_dead_slots_poisoned():
    for gran in ("token", "head"):
        _, x = _inputs("e4m3", gran)
        s = x["k_scale"].astype(np.float64)
        if gran == "token":
            r = s[:, 1:] / s[:, :-1]
            r = r[np.isfinite(r) & (r > 0)]
        else:
            r = s[1:] / s[:-1]
        assert r.size and (np.minimum(r, 1 / r) < 1 / 16).all()
    p, x = _inputs("e4m3", "token", dist="grid")
    lq, hs = lengths(p)
    live = np.isfinite(x["k_scale"][..., 0])  # (num_blocks, page): the live slots
    assert live.sum() == (lq + hs).sum()
    assert (x["k_cache"].view(np.uint8)[~live] == NAN_CODE).all()
    _, x = _inputs("e5m2", "tensor", dist="grid")
    assert x["k_cache"].dtype == ml_dtypes.float8_e5m2


# -- the kernels' refusals (one line, ValueError) ----------------------------------------------------------------
def test_kernels_refuse_bad_arguments():
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 before triton's first import: later interpreter runs need it
    from kernel_parity.kernels.cpu.kvquant_prefill import chunked_prefill as cpu
    from kernel_parity.kernels.torch.kvquant_prefill import check_args as torch_check
    from kernel_parity.kernels.triton.kvquant_prefill import check_args as triton_check

    _, x = _inputs("e4m3", "token")
    bad = {"k_scale": np.ones(3, np.float32), "v_cache": x["v_cache"].view(np.int8),
           "hist": x["hist"].astype(np.int64), "q": x["q"][:, :3], "cu_seqlens_q": x["cu_seqlens_q"][:-1]}
    for name, value in bad.items():
        y = dict(x, **{name: value})
        with pytest.raises(ValueError, match="kvquant.chunked_prefill|dtype must be"):
            cpu(*(y[k] for k in ARGS))
        t = [torch.from_numpy(np.ascontiguousarray(y[k]).view(np.uint8)).view(torch.float8_e4m3fn)
             if y[k].dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(y[k])) for k in ARGS]
        for check in (torch_check, triton_check):
            with pytest.raises(ValueError, match="kvquant.chunked_prefill"):
                check(*t)
