"""The kvquant.decode / kvquant.decode_split goldens (refimpl/kvquant_split.py) against a plain torch float64
transcription (dequantize: codes.to(float64) * scale, causal bottom-right mask, softmax; each split's softmax over
its own key range), their declared conventions (queries before the sequence, empty splits, the merge, pages =
the contiguous cache they gather into), their invariants in float64, their refusals, the spec's inputs (neighbour
separation across split boundaries, poison), and the kernels' refusals."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.ops.kvquant_split import DECODE, DECODE_SPLIT
from kernel_parity.refimpl import kvquant
from kernel_parity.refimpl import kvquant_split as ref

torch = pytest.importorskip("torch")

P = dict(b=6, sq=3, hq=8, hkv=2, d=32, kv=40, lens="ragged")


def _inputs(fmt, gran, dist="normal", seed=0, spec=DECODE, **kw):
    p = {**P, "fmt": fmt, "gran": gran, **kw}
    return p, spec.make_inputs(p, "fp32", dist, np.random.default_rng(seed))


def _split_inputs(fmt, gran, splits=3, page=0, **kw):
    return _inputs(fmt, gran, spec=DECODE_SPLIT, splits=splits, page=page, **kw)


def _args(x):
    return x["q"], x["k_cache"], x["v_cache"], x["k_scale"], x["v_scale"], x["seqlens"]


def _torch_reference(x, splits=None, bounds=None):
    """Decode as a PyTorch model writes it, float64, one sequence at a time: (o, lse) or, with `splits`,
    (o_parts, lse_parts) of each equal key range (normalised over its own keys), or of the ranges
    [bounds[i, s], bounds[i, s + 1]) cut to the sequence's length."""
    q = torch.from_numpy(np.asarray(x["q"], dtype=np.float64))
    b, s_q, h_q, d = q.shape
    h_kv = x["k_cache"].shape[2]
    n = splits or 1
    o = torch.zeros(n, b, s_q, h_q, d, dtype=torch.float64)
    lse = torch.full((n, b, h_q, s_q), -math.inf, dtype=torch.float64)
    for i in range(b):
        L = int(x["seqlens"][i])
        kv = []
        for codes, s in ((x["k_cache"], x["k_scale"]), (x["v_cache"], x["v_scale"])):
            c = torch.from_numpy(codes[i, :L].astype(np.float64))
            st = torch.from_numpy(s.astype(np.float64))
            st = st[i, :L, :, None] if st.dim() == 3 else st.reshape(1, -1, 1)
            kv.append((c * st).repeat_interleave(h_q // h_kv, dim=1))  # L, h_q, d
        s = torch.einsum("qhd,lhd->hql", q[i], kv[0]) / math.sqrt(d)  # h_q, s_q, L
        j = torch.arange(L)
        c_len = -(-L // n)
        for sp in range(n):
            lo, hi = (sp * c_len, (sp + 1) * c_len) if bounds is None else (int(bounds[i, sp]), int(bounds[i, sp + 1]))
            keep = (j[None, :] <= (L - s_q + torch.arange(s_q))[:, None]) & (j >= lo) & (j < hi)
            sm = s.masked_fill(~keep[None], -math.inf)
            row = keep.any(dim=-1)  # s_q
            p = torch.where(row[None, :, None], torch.softmax(sm, dim=-1), torch.zeros(()))
            p = torch.nan_to_num(p)
            o[sp, i] = torch.einsum("hql,lhd->qhd", p, kv[1])
            lse[sp, i] = torch.logsumexp(sm, dim=-1)
    return (o, lse) if splits else (o[0], lse[0])


def _close(a, b, tol=1e-12):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=tol * max(np.abs(b[fin]).max(initial=0), 1.0))


@pytest.mark.parametrize("fmt", kvquant.FORMATS)
@pytest.mark.parametrize("gran", kvquant.GRANS)
@pytest.mark.parametrize("dist", ["normal", "grid"])
def test_decode_matches_torch_float64(fmt, gran, dist):
    _, x = _inputs(fmt, gran, dist)
    o, lse = ref.decode(*_args(x))
    to, tl = _torch_reference(x)
    _close(o, to.numpy())
    _close(lse, tl.numpy())


@pytest.mark.parametrize("gran", kvquant.GRANS)
def test_split_partials_match_torch_float64(gran):
    _, x = _split_inputs("e4m3", gran, splits=3)
    o, lse, o_parts, lse_parts = ref.decode_split(*_args(x), 3)
    tpo, tpl = _torch_reference(x, splits=3)
    empty = np.isneginf(lse_parts).transpose(0, 1, 3, 2)  # splits, b, s_q, h_q
    assert empty.any() and np.isnan(o_parts[empty]).all()
    _close(np.where(np.isnan(o_parts), 0.0, o_parts), np.where(empty[..., None], 0.0, tpo.numpy()))
    _close(lse_parts, tpl.numpy())
    do, dl = ref.decode(*_args(x))  # the merge is the decode
    _close(o, do, 1e-12)
    _close(lse, dl, 1e-12)


def test_queries_before_the_sequence_see_no_key():
    """L_b < s_q: query i sees keys j <= L_b - s_q + i, none for i < s_q - L_b: O = 0, LSE = -inf."""
    _, x = _inputs("int8", "head")
    L = x["seqlens"]
    assert (L == 0).any() and (L == 1).any()
    o, lse = ref.decode(*_args(x))
    s_q = x["q"].shape[1]
    for i, n in enumerate(L):
        blind = np.arange(s_q) < s_q - n
        assert (o[i][blind] == 0).all() and np.isneginf(lse[i][:, blind]).all()
        assert np.isfinite(lse[i][:, ~blind]).all()


def test_paged_is_the_contiguous_cache_it_gathers_into():
    _, x = _split_inputs("e5m2", "token", splits=4, page=16)
    bt, L = x["block_table"], x["seqlens"]
    page = x["k_cache"].shape[1]
    s_max = bt.shape[1] * page
    flat = {}
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        g = x[name][bt.astype(np.int64)]
        flat[name] = g.reshape(bt.shape[0], s_max, *g.shape[3:])
    paged = ref.decode_split(*_args(x), 4, block_table=bt)
    contiguous = ref.decode_split(x["q"], flat["k_cache"], flat["v_cache"], flat["k_scale"], flat["v_scale"], L, 4)
    for a, b in zip(paged, contiguous):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("part", ["block", "bounds"])
def test_partitions_match_torch_float64(part):
    """Fixed blocks and explicit boundaries (the spec's draws: empty splits inside a request, one split for every
    third request) against the transcription over the same ranges; the merge is the undivided decode's."""
    kw = dict(part="block", blk=7) if part == "block" else dict(part="bounds")
    p, x = _split_inputs("e4m3", "token", splits=6, **kw)
    L = x["seqlens"]
    bounds = x.get("split_bounds")
    if part == "block":
        bounds = np.arange(7)[None, :].repeat(L.size, 0) * 7
    o, lse, op, lp = ref.decode_split(*_args(x), 6, block=p.get("blk") or None, bounds=x.get("split_bounds"))
    wo, wl = _torch_reference(x, 6, bounds)
    _close(lp, wl.numpy())
    live = np.isfinite(wl.numpy()).transpose(0, 1, 3, 2)[..., None]  # splits, b, s_q, h_q, 1
    _close(np.where(live, op, 0.0), wo.numpy())
    do, dl = ref.decode(*_args(x))
    _close(o, do, 1e-12)
    _close(lse, dl, 1e-12)
    if part == "bounds":
        assert (np.diff(x["split_bounds"], axis=1) == 0).any()  # empty splits inside some request
    # the equal partition given as explicit boundaries is the default's
    c = -(-L.astype(np.int64) // 6)
    eq = np.minimum(np.arange(7)[None, :] * c[:, None], L[:, None])
    _, _, eop, elp = ref.decode_split(*_args(x), 6, bounds=eq)
    _, _, dop, dlp = ref.decode_split(*_args(x), 6)
    np.testing.assert_array_equal(elp, dlp)
    np.testing.assert_array_equal(np.nan_to_num(eop), np.nan_to_num(dop))


@pytest.mark.parametrize("splits", [1, 2, 7, 50])
def test_merge_is_independent_of_the_splits(splits):
    _, x = _split_inputs("int8", "token", splits=splits)
    o, lse, _, lse_parts = ref.decode_split(*_args(x), splits)
    do, dl = ref.decode(*_args(x))
    _close(o, do, 1e-12)
    _close(lse, dl, 1e-12)
    assert lse_parts.shape[0] == splits


@pytest.mark.parametrize("gran", kvquant.GRANS)
def test_v_scales_times_c_scale_o(gran):
    _, x = _split_inputs("e4m3", gran)
    o, lse, op, lp = ref.decode_split(*_args(x), 3)
    y = dict(x, v_scale=x["v_scale"] * np.float32(0.25))
    vo, vl, vop, vlp = ref.decode_split(*_args(y), 3)
    np.testing.assert_array_equal(vo, o * 0.25)
    np.testing.assert_array_equal(vop, op * 0.25)
    np.testing.assert_array_equal(vl, lse)
    np.testing.assert_array_equal(vlp, lp)


def test_refusals():
    _, x = _inputs("e4m3", "head")
    with pytest.raises(ValueError, match="k_scale must have shape"):
        ref.decode(*_args(dict(x, k_scale=np.ones(3, np.float32))))
    with pytest.raises(ValueError, match="seqlens must be"):
        ref.decode(*_args(dict(x, seqlens=x["seqlens"] + 10_000)))
    with pytest.raises(ValueError, match="multiple of h_kv"):
        ref.decode(*_args(dict(x, q=x["q"][:, :, :3])))
    with pytest.raises(ValueError, match="q must be"):
        ref.decode(*_args(dict(x, q=x["q"][0])))
    with pytest.raises(ValueError, match="k_cache must have b="):
        ref.decode(*_args(dict(x, k_cache=x["k_cache"][:2], v_cache=x["v_cache"][:2])))
    with pytest.raises(ValueError, match="splits=0"):
        ref.decode_split(*_args(x), 0)
    _, y = _split_inputs("e4m3", "head", page=16)
    with pytest.raises(ValueError, match="block_table must be"):
        ref.decode_split(*_args(y), 3, block_table=y["block_table"][:2])
    with pytest.raises(ValueError, match="do not cover"):
        ref.decode_split(*_args(x), 3, block=5)
    with pytest.raises(ValueError, match="not both"):
        ref.decode_split(*_args(x), 3, block=50, bounds=np.zeros((6, 4), np.int32))
    with pytest.raises(ValueError, match="bounds"):
        ref.decode_split(*_args(x), 3, bounds=np.zeros((6, 4), np.int32))


# -- the spec's inputs -------------------------------------------------------------------------------------------
def test_split_boundaries_separate_neighbouring_tokens():
    """Per-token scales: the keys on either side of every split boundary are >= 16x apart (a split reading one key
    of its neighbour's range, or its scale, is off by an order of magnitude there)."""
    p, x = _split_inputs("e4m3", "token", splits=3)
    L = x["seqlens"]
    seen = 0
    for i, n in enumerate(L):
        c = -(-int(n) // 3)
        for sp in range(1, 3):
            t = sp * c
            if 0 < t < n:
                for name in ("k_scale", "v_scale"):
                    r = x[name][i, t] / x[name][i, t - 1]
                    assert (np.minimum(r, 1 / r) < 1 / 16).all(), (i, t, name, r)
                seen += 1
    assert seen >= 4


def test_poison_past_each_sequence():
    _, x = _inputs("e4m3", "token")
    L = x["seqlens"]
    dead = np.arange(x["k_cache"].shape[1])[None, :] >= L[:, None]
    assert dead[:, -1].all()  # slack past the longest
    bits = x["k_cache"].view(np.uint8)
    assert (bits[dead] == 0x7F).all() and np.isnan(x["k_scale"][dead]).all()
    assert np.isfinite(x["k_scale"][~dead]).all()
    _, x = _inputs("int8", "token")
    assert (x["k_cache"] == -128).any()


# -- the kernels' refusals (one line, ValueError) ----------------------------------------------------------------
def _torch_args(y, names):
    return [torch.from_numpy(np.ascontiguousarray(y[k]).view(np.uint8)).view(torch.float8_e4m3fn)
            if y[k].dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(y[k])) for k in names]


def test_kernels_refuse_bad_arguments():
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 (kept) before triton's first import: later interpreter runs need it
    from kernel_parity.kernels.cpu import kvquant_split as cpu
    from kernel_parity.kernels.torch import kvquant_split as eager
    from kernel_parity.kernels.triton import kvquant_split as tri

    _, x = _inputs("e4m3", "token")
    args = ("q", "k_cache", "v_cache", "k_scale", "v_scale", "seqlens")
    bad = {"k_scale": np.ones(3, np.float32), "v_cache": x["v_cache"].view(np.int8),
           "seqlens": x["seqlens"].astype(np.int64), "q": x["q"][:, :, :3], "k_cache": x["k_cache"][:2]}
    for name, value in bad.items():
        y = dict(x, **{name: value})
        with pytest.raises(ValueError, match="kvquant.decode|dtype must be|k_cache"):
            cpu.decode(*(y[k] for k in args))
        with pytest.raises(ValueError, match="kvquant.decode_split|dtype must be|k_cache"):
            cpu.decode_split(*(y[k] for k in args), 2)
        t = _torch_args(y, args)
        for fn in (eager.decode, tri.decode):
            with pytest.raises(ValueError, match="kvquant.decode"):
                fn(*t)
        for fn in (eager.decode_split, tri.decode_split):
            with pytest.raises(ValueError, match="kvquant.decode_split"):
                fn(*t, 2)
    t = _torch_args(x, args)
    for fn in (eager.decode_split, tri.decode_split):
        with pytest.raises(ValueError, match="splits"):
            fn(*t, 0)
    with pytest.raises(ValueError, match="splits"):
        cpu.decode_split(*(x[k] for k in args), 0)
    with pytest.raises(ValueError, match="out_lse"):
        tri.decode(*t, out_lse=torch.empty(1))
    # the partitions: block or bounds, not both; bounds (b, splits + 1) int; block >= 1 (and covering, on the CPU)
    b = x["q"].shape[0]
    good = np.repeat(np.asarray([[0, 20, 40]], np.int32), b, 0)
    for kw in (dict(block=20, bounds=good), dict(bounds=good[:, :2]), dict(bounds=good.astype(np.float32)),
               dict(block=0), dict(block=5), dict(bounds=good[:, ::-1].copy())):
        with pytest.raises(ValueError, match="kvquant.decode_split"):
            cpu.decode_split(*(x[k] for k in args), 2, **kw)
    for kw in (dict(block=20, bounds=torch.from_numpy(good)), dict(bounds=torch.from_numpy(good[:, :2].copy())),
               dict(bounds=torch.from_numpy(good.astype(np.float32))), dict(block=0), dict(block=True)):
        with pytest.raises(ValueError, match="kvquant.decode_split"):
            tri.decode_split(*t, 2, **kw)
