"""The kvquant.append_decode golden (refimpl/kvquant_append.py) against kvquant.update then kvquant.decode_paged
composed by hand, and against a plain float64 loop (dequantize every key, the new one as quantized, softmax); its
declared conventions (the new token at position seq_lens[b], read back as quantized; caches untouched outside the
new slots; a history of 0 gives the new value itself), its refusals, the spec's inputs (page edges, poison,
neighbour separation, midpoints) and the kernels' refusals."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.ops.kvquant_append import APPEND_DECODE, lengths
from kernel_parity.conformance.ops.kvquant_decode import NAN_CODE
from kernel_parity.refimpl import kvquant as kq
from kernel_parity.refimpl.kvquant_append import append_decode
from kernel_parity.refimpl.kvquant_decode import decode_paged
from kernel_parity.refimpl.kvquant_update import update

P = dict(b=9, hq=8, hkv=2, d=32, kv=40, lens="ragged", page=16)
ARGS = ("q", "k_new", "v_new", "k_cache", "v_cache", "block_table", "seq_lens")


def _inputs(fmt, gran, dist="normal", seed=0, dtype="fp32", **kw):
    p = {**P, "fmt": fmt, "gran": gran, **kw}
    return p, APPEND_DECODE.make_inputs(p, dtype, dist, np.random.default_rng(seed))


def _scales(x, gran):
    if gran == "token":
        return dict(k_scale_cache=x["k_scale_cache"], v_scale_cache=x["v_scale_cache"])
    return dict(k_scale=x["k_scale"], v_scale=x["v_scale"])


def _golden(x, p, **kw):
    return append_decode(*(x[k] for k in ARGS), fmt=p["fmt"], gran=p["gran"], **_scales(x, p["gran"]), **kw)


def _slots(x, page):
    L = x["seq_lens"].astype(np.int64)
    return np.array([x["block_table"][i, L[i] // page] * page + L[i] % page for i in range(L.size)], dtype=np.int64)


@pytest.mark.parametrize("fmt", kq.FORMATS)
@pytest.mark.parametrize("gran", kq.GRANS)
def test_is_update_then_decode_paged(fmt, gran):
    p, x = _inputs(fmt, gran)
    res = _golden(x, p)
    slots = _slots(x, p["page"])
    token = gran == "token"
    kc, ksc = update(x["k_cache"], x["k_new"], slots, fmt=fmt, gran=gran, scale=None if token else x["k_scale"],
                     scale_cache=x.get("k_scale_cache"))
    vc, vsc = update(x["v_cache"], x["v_new"], slots, fmt=fmt, gran=gran, scale=None if token else x["v_scale"],
                     scale_cache=x.get("v_scale_cache"))
    o, lse = decode_paged(x["q"], kc, vc, ksc if token else x["k_scale"], vsc if token else x["v_scale"],
                          x["block_table"], x["seq_lens"] + 1)
    np.testing.assert_array_equal(res["o"], o)
    np.testing.assert_array_equal(res["lse"], lse)
    assert res["k_cache"].view(np.uint8).tobytes() == kc.view(np.uint8).tobytes()
    assert res["v_cache"].view(np.uint8).tobytes() == vc.view(np.uint8).tobytes()
    if token:
        assert res["k_scale_cache"].tobytes() == ksc.tobytes() and res["v_scale_cache"].tobytes() == vsc.tobytes()
    assert np.isfinite(res["o"]).all() and np.isfinite(res["lse"]).all()  # the new slots were poison: overwritten


@pytest.mark.parametrize("fmt", kq.FORMATS)
@pytest.mark.parametrize("gran", kq.GRANS)
@pytest.mark.parametrize("dist", ["normal", "grid", "midpoints"])
def test_matches_a_float64_loop(fmt, gran, dist):
    """Each sequence: every cached key and the new one (quantized by hand, s = static or amax / FMAX) dequantized,
    then a float64 softmax."""
    p, x = _inputs(fmt, gran, dist)
    res = _golden(x, p)
    nb, page, h_kv, d = x["k_cache"].shape
    group = p["hq"] // h_kv
    for i, L in enumerate(x["seq_lens"].tolist()):
        keys, vals = [], []
        for kv, out in (("k", keys), ("v", vals)):
            for t in range(L):
                pg, sl = x["block_table"][i, t // page], t % page
                s = x[f"{kv}_scale_cache"][pg, sl] if gran == "token" else \
                    np.broadcast_to(x[f"{kv}_scale"], (h_kv,))
                out.append(x[f"{kv}_cache"][pg, sl].astype(np.float64) * s.astype(np.float64)[:, None])
            new = x[f"{kv}_new"][i].astype(np.float32)
            s = (np.abs(new).max(axis=1) / np.float32(kq.FMAX[fmt])).astype(np.float32) if gran == "token" else \
                np.broadcast_to(x[f"{kv}_scale"], (h_kv,)).astype(np.float32)
            out.append(kq.quantize(new, s[:, None], fmt).astype(np.float64) * s.astype(np.float64)[:, None])
        K, V = np.stack(keys), np.stack(vals)  # (L + 1, h_kv, d)
        for h in range(p["hq"]):
            logits = K[:, h // group] @ x["q"][i, h].astype(np.float64) / math.sqrt(d)
            m = logits.max()
            w = np.exp(logits - m)
            o = (w[:, None] * V[:, h // group]).sum(0) / w.sum()
            np.testing.assert_allclose(res["o"][i, h], o, rtol=1e-12, atol=1e-12 * np.abs(o).max())
            np.testing.assert_allclose(res["lse"][i, h], m + math.log(w.sum()), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("gran", kq.GRANS)
def test_caches_outside_the_new_slots_untouched(gran):
    p, x = _inputs("e5m2", gran, dist="grid")
    res = _golden(x, p)
    slots = _slots(x, p["page"])
    nb, page, h, d = x["k_cache"].shape
    for kv in ("k", "v"):
        before = x[f"{kv}_cache"].view(np.uint8).reshape(nb * page, h * d)
        after = res[f"{kv}_cache"].view(np.uint8).reshape(nb * page, h * d)
        keep = np.ones(nb * page, bool)
        keep[slots] = False
        assert (before[keep] == after[keep]).all()
        assert (before[slots] == NAN_CODE).all() and not (after[slots] == NAN_CODE).all(axis=1).any()
        if gran == "token":
            sb = x[f"{kv}_scale_cache"].reshape(nb * page, h)
            sa = res[f"{kv}_scale_cache"].reshape(nb * page, h)
            assert sb[keep].tobytes() == sa[keep].tobytes()
            assert np.isnan(sb[slots]).all() and np.isfinite(sa[slots]).all()


def test_the_only_key_gives_the_new_value_as_quantized():
    """History 0: O is the new value's dequantized code (not the unquantized value), LSE its logit."""
    p, x = _inputs("e4m3", "token", lens="full", kv=0, b=3)
    res = _golden(x, p)
    nb, page, h_kv, d = x["k_cache"].shape
    group = p["hq"] // h_kv
    slots = _slots(x, page)
    vs = res["v_scale_cache"].reshape(-1, h_kv)[slots].astype(np.float64)
    ks = res["k_scale_cache"].reshape(-1, h_kv)[slots].astype(np.float64)
    vdq = res["v_cache"].reshape(-1, h_kv, d)[slots].astype(np.float64) * vs[..., None]
    kdq = res["k_cache"].reshape(-1, h_kv, d)[slots].astype(np.float64) * ks[..., None]
    heads = np.arange(p["hq"]) // group
    np.testing.assert_allclose(res["o"], vdq[:, heads], rtol=1e-14, atol=0)
    want_lse = np.einsum("bhd,bhd->bh", x["q"].astype(np.float64), kdq[:, heads]) / math.sqrt(d)
    np.testing.assert_allclose(res["lse"], want_lse, rtol=1e-13, atol=1e-13)
    assert not np.allclose(res["o"], x["v_new"].astype(np.float64)[:, heads], rtol=1e-3)  # e4m3: far from x


def test_the_new_key_is_at_seq_lens_and_no_further_key_is_read():
    """Poison every slot past the new token (and the new slot's old bits): nothing changes."""
    p, x = _inputs("int8", "token", dist="grid")
    res = _golden(x, p)
    y = {k: np.array(v, copy=True) for k, v in x.items()}
    page = p["page"]
    for i, L in enumerate(x["seq_lens"].tolist()):
        for t in range(L, y["block_table"].shape[1] * page):
            pg, sl = y["block_table"][i, t // page], t % page
            y["k_cache"][pg, sl] = -128 if t > L else 5
            y["k_scale_cache"][pg, sl] = np.float32(1e30) if t > L else np.float32(-1.0)
    res2 = _golden(y, p)
    np.testing.assert_array_equal(res["o"], res2["o"])
    np.testing.assert_array_equal(res["lse"], res2["lse"])


def test_absolute_gives_the_error_model_only():
    p, x = _inputs("e4m3", "head")
    m = _golden(x, p, absolute=True)
    assert set(m) == {"o", "lse"} and (m["o"] >= 0).all()


def test_refusals():
    p, x = _inputs("e4m3", "head")
    cap = x["block_table"].shape[1] * p["page"]
    with pytest.raises(ValueError, match="kvquant.append_decode: seq_lens must lie in"):
        _golden(dict(x, seq_lens=np.full_like(x["seq_lens"], cap)), p)
    with pytest.raises(ValueError, match="new token's page"):
        bt = x["block_table"].copy()
        bt[1, 0] = 10_000  # sequence 1 has history 0: its new token's page
        _golden(dict(x, block_table=bt), p)
    with pytest.raises(ValueError, match="distinct"):
        bt = x["block_table"].copy()
        bt[4] = bt[1]  # histories 1 and 0 on one page: slots distinct; make them collide instead
        _golden(dict(x, block_table=bt, seq_lens=np.where(np.arange(9) == 4, 0, x["seq_lens"]).astype(np.int32)), p)
    with pytest.raises(ValueError, match="k_new must be"):
        _golden(dict(x, k_new=x["k_new"][:, :1]), p)
    with pytest.raises(ValueError, match="finite"):
        k = np.array(x["k_new"], copy=True)
        k[0, 0, 0] = np.inf
        _golden(dict(x, k_new=k), p)
    with pytest.raises(ValueError, match="gran"):
        append_decode(*(x[k] for k in ARGS), fmt="e4m3", gran="block", k_scale=x["k_scale"], v_scale=x["v_scale"])
    with pytest.raises(ValueError, match="scale of shape"):
        append_decode(*(x[k] for k in ARGS), fmt="e4m3", gran="head", k_scale=x["k_scale"][:1], v_scale=x["v_scale"])


# -- the spec's inputs -------------------------------------------------------------------------------------------
def test_lengths_reach_every_page_edge():
    L = lengths(dict(P, page=16))
    assert L.tolist() == [40, 0, 15, 16, 1, 31, 32, 39, 20]
    assert {0, 15, 31} & set((L % 16).tolist()) and (L % 16 == 15).sum() == 2 and (L % 16 == 0).sum() == 3
    assert (lengths(dict(P, lens="full")) == 40).all()


def test_new_slots_poisoned_and_neighbours_far_apart():
    p, x = _inputs("e4m3", "head")
    slots = _slots(x, p["page"])
    nb, page, h, d = x["k_cache"].shape
    assert (x["k_cache"].view(np.uint8).reshape(nb * page, h, d)[slots] == NAN_CODE).all()
    r = x["k_scale"][1:] / x["k_scale"][:-1]
    assert (np.minimum(r, 1 / r) < 1 / 16).all()
    amax = np.abs(x["k_new"].astype(np.float64)).max(axis=(0, 2))  # the new rows' heads follow the scales
    ra = amax[1:] / amax[:-1]
    assert (np.minimum(ra, 1 / ra) < 1 / 16).all()
    p, x = _inputs("int8", "token", dist="grid")
    slots = _slots(x, p["page"])
    assert np.isnan(x["k_scale_cache"].reshape(-1, h)[slots]).all()
    assert (x["k_cache"].view(np.int8).reshape(-1, h, d)[slots] == 127).all()
    dyn = np.abs(x["k_new"].astype(np.float64)).max(axis=2)  # the new rows' dynamic scales: heads far apart
    rr = dyn[:, 1:] / dyn[:, :-1]
    assert (np.minimum(rr, 1 / rr) < 1 / 16).all()
    _, x = _inputs("e5m2", "tensor", dist="grid")
    assert x["k_cache"].dtype == ml_dtypes.float8_e5m2


@pytest.mark.parametrize("fmt", kq.FORMATS)
@pytest.mark.parametrize("gran", ["tensor", "head", "token"])
def test_midpoints_put_the_quotients_on_midpoints(fmt, gran):
    """Most new values' x / s is a rounding midpoint of the grid (ties: half to even decides the code)."""
    p, x = _inputs(fmt, gran, dist="midpoints", dtype="bf16")
    k = x["k_new"].astype(np.float32)
    if gran == "token":
        s = kq.dynamic_scale(k, fmt)[..., None]
    else:
        s = np.broadcast_to(x["k_scale"], (k.shape[1],))[None, :, None]
    qv = (k / s.astype(np.float32)).astype(np.float64)
    if fmt == "int8":
        mid = np.abs(qv - np.floor(qv)) == 0.5
    else:
        codes = np.arange(256, dtype=np.uint8).view(kq.STORAGE[fmt]).astype(np.float64)
        vals = np.unique(np.abs(codes[np.isfinite(codes)]))
        mids = (vals[:-1] + vals[1:]) / 2
        mid = np.isin(np.abs(qv), mids)
    share = mid.mean()
    assert share > (0.3 if (fmt == "int8" and gran == "token") else 0.9), share


# -- the kernels' refusals (one line, ValueError) ----------------------------------------------------------------
def test_kernels_refuse_bad_arguments():
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()
    torch = pytest.importorskip("torch")
    from kernel_parity.kernels.cpu.kvquant_append import append_decode as cpu
    from kernel_parity.kernels.torch.kvquant_append import check_args as torch_check
    from kernel_parity.kernels.triton.kvquant_append import check_args as triton_check

    p, x = _inputs("e4m3", "token")
    x = {k: np.asarray(v) for k, v in x.items()}
    bad = {"k_scale_cache": np.ones((2, 2, 2), np.float32), "v_cache": x["v_cache"].view(np.int8),
           "seq_lens": x["seq_lens"].astype(np.int64), "q": x["q"][:, :3], "k_new": x["k_new"][:1]}
    for name, value in bad.items():
        y = dict(x, **{name: value})
        with pytest.raises(ValueError, match="kvquant.append_decode|dtype must be|must be"):
            cpu(*(y[k] for k in ARGS), "e4m3", "token", k_scale_cache=y["k_scale_cache"],
                v_scale_cache=y["v_scale_cache"])

        def t(a):
            a = np.ascontiguousarray(a)
            if a.dtype == ml_dtypes.float8_e4m3fn:
                return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
            return torch.from_numpy(a)

        for check in (torch_check, triton_check):
            with pytest.raises(ValueError, match="kvquant.append_decode"):
                check(*(t(y[k]) for k in ARGS), "e4m3", "token", None, None, t(y["k_scale_cache"]),
                      t(y["v_scale_cache"]))
    for check in (torch_check, triton_check):  # static scales with a token call, an unknown format
        args = [t(x[k]) for k in ARGS]
        with pytest.raises(ValueError, match="gran token computes its scales"):
            check(*args, "e4m3", "token", torch.ones(1), torch.ones(1), t(x["k_scale_cache"]), t(x["v_scale_cache"]))
        with pytest.raises(ValueError, match="fmt="):
            check(*args, "e3m4", "token", None, None, t(x["k_scale_cache"]), t(x["v_scale_cache"]))
    with pytest.raises(ValueError, match="seq_lens must lie"):
        cpu(*(dict(x, seq_lens=x["seq_lens"] + 10_000)[k] for k in ARGS), "e4m3", "token",
            k_scale_cache=x["k_scale_cache"], v_scale_cache=x["v_scale_cache"])


def test_triton_split_count_does_not_change_the_answer():
    """kernels/triton/kvquant_append.py with one split and with splits of 128 keys (histories 300, 0, 15: the new key
    in the third split, or in the first with the later ones past the sequence's end): the caches bit for bit, O and
    the LSE to fp32 rounding, and both at the golden."""
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()
    torch = pytest.importorskip("torch")
    if interpreter_ready():
        pytest.skip(interpreter_ready())
    from kernel_parity.kernels.triton.kvquant_append import append_decode as tri

    p, x = _inputs("e4m3", "token", kv=300, b=3)
    assert x["seq_lens"].tolist() == [300, 0, 15]
    want = _golden(x, p)
    runs = []
    for split in (None, 128):
        y = {k: np.array(v, copy=True) for k, v in x.items()}
        t = {k: torch.from_numpy(y[k].view(np.uint8)).view(torch.float8_e4m3fn) if k.endswith("_cache") and
             y[k].dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(y[k]) for k in y}
        o, lse = tri(*(t[k] for k in ARGS), "e4m3", "token", k_scale_cache=t["k_scale_cache"],
                     v_scale_cache=t["v_scale_cache"], split_keys=split)
        runs.append((o.numpy().astype(np.float64), lse.numpy().astype(np.float64),
                     {k: t[k].view(torch.uint8).numpy().tobytes() if k.endswith("_cache") and t[k].dtype != torch.float32
                      else t[k].numpy().tobytes() for k in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")}))
    for o, lse, caches in runs:
        assert caches == runs[0][2]
        assert caches["k_cache"] == want["k_cache"].view(np.uint8).tobytes()
        assert caches["v_scale_cache"] == want["v_scale_cache"].tobytes()
        np.testing.assert_allclose(o, want["o"], rtol=2e-5, atol=2e-6 * np.abs(want["o"]).max())
        np.testing.assert_allclose(lse, want["lse"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=2e-5, atol=2e-6 * np.abs(runs[0][0]).max())
