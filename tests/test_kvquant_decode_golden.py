"""The kvquant.decode_paged golden (refimpl/kvquant_decode.py) against a plain torch float64 transcription of paged
decode over a dequantized cache (vLLM's reference: codes.to(float64) * scale, gather the pages, softmax), its
declared conventions (empty sequences, per-head with one head = per-tensor, refimpl.attention.decode_paged on the
dequantized float cache), its invariants in float64, its refusals, and the spec's inputs (neighbour separation,
poison, codes over the whole grid)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.ops.kvquant_decode import DECODE_PAGED, NAN_CODE
from kernel_parity.refimpl import attention, kvquant

torch = pytest.importorskip("torch")

P = dict(b=7, hq=8, hkv=2, d=32, kv=70, lens="ragged", page=16)


def _inputs(fmt, gran, dist="normal", seed=0, **kw):
    p = {**P, "fmt": fmt, "gran": gran, **kw}
    return p, DECODE_PAGED.make_inputs(p, "fp32", dist, np.random.default_rng(seed))


def _golden(x, **kw):
    return kvquant.decode_paged(x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["block_table"],
                                x["seq_lens"], **kw)


def _torch_reference(x):
    """Paged decode as a PyTorch model writes it, float64: dequantize, gather, softmax, weighted sum."""
    q = torch.from_numpy(np.asarray(x["q"], dtype=np.float64))
    b, h_q, d = q.shape
    nb, page, h_kv, _ = x["k_cache"].shape
    o = torch.zeros(b, h_q, d, dtype=torch.float64)
    lse = torch.full((b, h_q), -math.inf, dtype=torch.float64)
    for i in range(b):
        L = int(x["seq_lens"][i])
        if L == 0:
            continue
        pages = torch.from_numpy(x["block_table"][i, : -(-L // page)].astype(np.int64))
        kv = []
        for codes, s in ((x["k_cache"], x["k_scale"]), (x["v_cache"], x["v_scale"])):
            c = torch.from_numpy(codes.astype(np.float64))[pages].reshape(-1, h_kv, d)[:L]
            st = torch.from_numpy(s.astype(np.float64))
            st = st[pages].reshape(-1, h_kv)[:L, :, None] if st.dim() == 3 else st.reshape(1, -1, 1)
            kv.append((c * st).repeat_interleave(h_q // h_kv, dim=1))  # L, h_q, d
        s = torch.einsum("hd,lhd->hl", q[i], kv[0]) / math.sqrt(d)
        o[i] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), kv[1])
        lse[i] = torch.logsumexp(s, dim=-1)
    return o.numpy(), lse.numpy()


@pytest.mark.parametrize("fmt", kvquant.FORMATS)
@pytest.mark.parametrize("gran", kvquant.GRANS)
@pytest.mark.parametrize("dist", ["normal", "grid"])
def test_matches_torch_float64(fmt, gran, dist):
    _, x = _inputs(fmt, gran, dist)
    o, lse = _golden(x)
    to, tl = _torch_reference(x)
    np.testing.assert_allclose(o, to, rtol=1e-12, atol=1e-12 * np.abs(to).max())
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(tl))
    np.testing.assert_allclose(lse[np.isfinite(lse)], tl[np.isfinite(tl)], rtol=1e-12, atol=1e-12)


def test_empty_sequence_gives_zero_and_minus_inf():
    _, x = _inputs("e4m3", "token")
    assert (x["seq_lens"] == 0).any()
    o, lse = _golden(x)
    empty = x["seq_lens"] == 0
    assert (o[empty] == 0).all() and np.isneginf(lse[empty]).all() and np.isfinite(lse[~empty]).all()


def test_is_attention_decode_paged_on_the_dequantized_cache():
    """Token scales (through the pages) and the float cache of code x scale give attention.decode_paged's answer."""
    _, x = _inputs("int8", "token")
    o, lse = _golden(x)
    k = kvquant.dequantize(x["k_cache"], x["k_scale"][..., None])
    v = kvquant.dequantize(x["v_cache"], x["v_scale"][..., None])
    ro, rl, _ = attention.decode_paged(x["q"][:, None], k, v, x["block_table"], x["seq_lens"])
    np.testing.assert_allclose(o, ro[:, 0], rtol=1e-13, atol=1e-13 * np.abs(ro).max())
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl[..., 0]))
    np.testing.assert_allclose(lse[np.isfinite(lse)], rl[..., 0][np.isfinite(lse)], rtol=1e-14)


def test_one_head_scale_is_the_tensor_scale():
    _, x = _inputs("e5m2", "head", hkv=1, hq=4)
    assert x["k_scale"].shape == (1,)
    o1, l1 = _golden(x)
    o2, l2 = _golden(dict(x, k_scale=x["k_scale"].reshape(1), v_scale=x["v_scale"].reshape(1)))
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


@pytest.mark.parametrize("gran", kvquant.GRANS)
def test_k_scales_times_c_is_softmax_scale_times_c_and_v_scales_scale_o(gran):
    _, x = _inputs("e4m3", gran)
    d = x["q"].shape[-1]
    o, lse = _golden(x)
    ko, kl = _golden(dict(x, k_scale=x["k_scale"] * np.float32(4.0)))
    so, sl = _golden(x, scale=4.0 / math.sqrt(d))
    np.testing.assert_allclose(ko, so, rtol=1e-12, atol=1e-12 * np.abs(so).max())
    np.testing.assert_allclose(kl[np.isfinite(kl)], sl[np.isfinite(sl)], rtol=1e-12)
    vo, vl = _golden(dict(x, v_scale=x["v_scale"] * np.float32(0.25)))
    np.testing.assert_array_equal(vo, o * 0.25)
    np.testing.assert_array_equal(vl, lse)


def test_refusals():
    _, x = _inputs("e4m3", "head")
    with pytest.raises(ValueError, match="k_scale must have shape"):
        _golden(dict(x, k_scale=np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="seq_lens must be"):
        _golden(dict(x, seq_lens=x["seq_lens"] + 10_000))
    with pytest.raises(ValueError, match="multiple of h_kv"):
        _golden(dict(x, q=x["q"][:, :3]))
    with pytest.raises(ValueError, match="q must be"):
        _golden(dict(x, q=x["q"][0]))


# -- the spec's inputs -------------------------------------------------------------------------------------------
def test_neighbouring_scales_are_far_apart():
    for gran, axis in (("token", 1), ("head", 0)):
        _, x = _inputs("e4m3", gran)
        for name in ("k_scale", "v_scale"):
            s = x[name].astype(np.float64)
            if gran == "token":  # live slots only: neighbouring slots of a page, neighbouring heads of a slot
                r1 = s[:, 1:] / s[:, :-1]
                r2 = s[..., 1:] / s[..., :-1]
                ratios = np.concatenate([r1[np.isfinite(r1) & (r1 > 0)], r2[np.isfinite(r2) & (r2 > 0)]])
            else:
                ratios = s[1:] / s[:-1]
            assert ratios.size and (np.minimum(ratios, 1 / ratios) < 1 / 16).all(), (gran, name, ratios.max())
        assert np.nanmedian(x["v_scale"]) > 8 * np.nanmedian(x["k_scale"])


def test_codes_and_poison():
    _, x = _inputs("int8", "token")
    assert (x["k_cache"] == -128).any() and (x["v_cache"] == -128).any()
    _, x = _inputs("int8", "tensor")
    assert (x["k_cache"] == -128).any() and (x["k_cache"] == 127).any()
    _, x = _inputs("e4m3", "tensor")
    vals = np.abs(x["k_cache"].astype(np.float32))
    assert (vals == 448).any()  # saturated at the calibrated static scale
    _, x = _inputs("e4m3", "token", dist="grid")
    bits = x["k_cache"].view(np.uint8)
    live = np.isfinite(x["k_scale"])
    sub = ((bits & 0x78) == 0) & ((bits & 7) != 0)
    assert sub[live].any(), "grid codes take e4m3 subnormals"
    assert (bits[~live] == NAN_CODE).all() and np.isnan(x["k_scale"][~live]).all()
    _, x = _inputs("e5m2", "tensor", dist="grid")
    assert x["k_cache"].dtype == ml_dtypes.float8_e5m2


# -- the kernels' refusals (one line, ValueError) ----------------------------------------------------------------
def test_kernels_refuse_bad_arguments():
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 (kept) before triton's first import: later interpreter runs need it
    from kernel_parity.kernels.cpu.kvquant_decode import decode_paged as cpu
    from kernel_parity.kernels.torch.kvquant_decode import check_args as torch_check
    from kernel_parity.kernels.triton.kvquant_decode import check_args as triton_check

    _, x = _inputs("e4m3", "token")
    args = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "block_table", "seq_lens")
    bad = {"k_scale": np.ones(3, np.float32), "v_cache": x["v_cache"].view(np.int8),
           "seq_lens": x["seq_lens"].astype(np.int64), "q": x["q"][:, :3]}
    for name, value in bad.items():
        y = dict(x, **{name: value})
        with pytest.raises(ValueError, match="kvquant.decode_paged|dtype must be"):
            cpu(*(y[k] for k in args))
        t = [torch.from_numpy(np.ascontiguousarray(y[k]).view(np.uint8)).view(torch.float8_e4m3fn)
             if y[k].dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(y[k])) for k in args]
        for check in (torch_check, triton_check):
            with pytest.raises(ValueError, match="kvquant.decode_paged"):
                check(*t)


def test_triton_refuses_a_fast_conversion_it_cannot_run():
    """fast_cvt 1 / 2 (inline PTX) only on a GPU for a bf16 q over an FP8 cache: the interpreter refuses it."""
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()
    from kernel_parity.kernels.triton.kvquant_decode import decode_paged

    _, x = _inputs("e4m3", "tensor")
    args = [torch.from_numpy(np.ascontiguousarray(x[k]).view(np.uint8)).view(torch.float8_e4m3fn)
            if x[k].dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(x[k]))
            for k in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "block_table", "seq_lens")]
    for fast in (1, 2, 5):
        with pytest.raises(ValueError, match="fast_cvt"):
            decode_paged(*args, fast_cvt=fast)
    out, lse = decode_paged(*args, fast_cvt=0)
    assert out.shape == args[0].shape
