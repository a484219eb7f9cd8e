"""Self-tests of the attention backward goldens (refimpl/attention_grad.py): the hand-written float64
VJP against torch autograd in float64 through an independent forward, and against central finite
differences of the forward golden (refimpl/attention.py), over GQA, both causal alignments,
windows, softcap, sinks, an LSE cotangent, fully masked rows and varlen with empty sequences; the
chunked (bounded-memory) evaluation against one block; the exact zeros the contract promises."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kernel_parity.refimpl.attention as ref
import kernel_parity.refimpl.attention_grad as grad

CASES = [  # b, s_q, s_k, h_q, h_kv, d, d_v, causal, window, softcap, sink, dlse
    (2, 5, 7, 4, 2, 6, 6, "bottom_right", (-1, -1), 0.0, False, True),
    (1, 7, 4, 4, 1, 5, 3, "bottom_right", (-1, -1), 0.0, True, True),  # s_q > s_k: fully masked rows
    (1, 6, 4, 2, 2, 4, 4, "bottom_right", (-1, -1), 0.0, False, True),  # ... without a sink
    (2, 5, 9, 4, 2, 4, 5, "top_left", (-1, -1), 2.0, False, False),  # keys no query sees
    (1, 8, 8, 8, 8, 3, 3, "none", (2, 1), 1.5, True, True),
    (1, 9, 6, 6, 2, 4, 2, "none", (0, 0), 0.0, True, False),  # diagonal only: rows with no key
    (2, 6, 10, 2, 1, 5, 4, "bottom_right", (3, 0), 3.0, True, True),
    (1, 5, 5, 8, 1, 4, 4, "top_left", (1, -1), 0.0, False, True),
]


def _case(c, seed=0):
    b, s_q, s_k, h_q, h_kv, d, d_v, causal, window, cap, sink, dl = c
    rng = np.random.default_rng(seed)
    x = dict(q=rng.standard_normal((b, s_q, h_q, d)), k=rng.standard_normal((b, s_k, h_kv, d)),
             v=rng.standard_normal((b, s_k, h_kv, d_v)), do=rng.standard_normal((b, s_q, h_q, d_v)),
             dlse=rng.standard_normal((b, h_q, s_q)) if dl else None,
             sinks=rng.standard_normal(h_q) if sink else None)
    return x, dict(causal=causal, window=window, softcap=cap)


def _torch_grads(x, kw):
    """Autograd in float64 through an independent forward: expand K/V per query head, mask with a
    boolean tensor, and append the sink as one more logit of the softmax."""
    torch = pytest.importorskip("torch")
    t = {n: torch.tensor(v, dtype=torch.float64, requires_grad=n in ("q", "k", "v", "sinks"))
         for n, v in x.items() if v is not None}
    b, s_q, h_q, d = x["q"].shape
    s_k, h_kv = x["k"].shape[1:3]
    keep = torch.tensor(ref.mask(s_q, s_k, np.full(b, s_q), np.full(b, s_k), kw["causal"], kw["window"]))
    kk = t["k"].repeat_interleave(h_q // h_kv, dim=2)
    vv = t["v"].repeat_interleave(h_q // h_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", t["q"], kk) / math.sqrt(d)
    if kw["softcap"]:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    s = s.masked_fill(~keep[:, None], -math.inf)
    if "sinks" in t:
        s = torch.cat([s, t["sinks"][None, :, None, None].expand(b, h_q, s_q, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # b, h_q, s_q (with the sink)
    live = torch.isfinite(lse)
    p = torch.exp(s - torch.where(live, lse, torch.zeros_like(lse))[..., None])[..., :s_k]
    o = torch.einsum("bhij,bjhc->bihc", p, vv)
    loss = (o * t["do"]).sum()
    if "dlse" in t:
        loss = loss + torch.where(live, lse * t["dlse"], torch.zeros_like(lse)).sum()
    names = [n for n in ("q", "k", "v", "sinks") if n in t]
    gs = torch.autograd.grad(loss, [t[n] for n in names])
    return {f"d{n}": gv.numpy() for n, gv in zip(names, gs)}


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c[7]}-w{c[8][0]}.{c[8][1]}-cap{c[9]:g}-sink{int(c[10])}-dl{int(c[11])}")
def test_golden_equals_torch_autograd_float64(c):
    x, kw = _case(c)
    got = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], sinks=x["sinks"], **kw)
    want = _torch_grads(x, kw)
    assert set(got) == set(want)
    for n in want:
        err = np.abs(got[n] - want[n]).max()
        assert err <= 1e-13 * max(1.0, np.abs(want[n]).max()), f"{n}: {err:.3g} from torch autograd (float64)"


def _loss(x, kw):
    o, _, lse = ref.prefill(x["q"], x["k"], x["v"], sinks=x["sinks"], **kw)
    total = np.sum(o * x["do"])
    if x["dlse"] is not None:
        total += np.sum(np.where(np.isfinite(lse), lse * x["dlse"], 0.0))
    return total


@pytest.mark.parametrize("c", CASES[:6], ids=lambda c: f"{c[7]}-cap{c[9]:g}-sink{int(c[10])}-dl{int(c[11])}")
def test_golden_equals_finite_differences_of_the_forward_golden(c):
    """<grad, u> against (f(x + h u) - f(x - h u)) / 2h for a random direction u of every input."""
    x, kw = _case(c, seed=1)
    got = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], sinks=x["sinks"], **kw)
    rng = np.random.default_rng(2)
    for name in ("q", "k", "v", "sinks"):
        if x[name] is None:
            continue
        u = rng.standard_normal(x[name].shape)
        h = 1e-5
        fp = _loss({**x, name: x[name] + h * u}, kw)
        fm = _loss({**x, name: x[name] - h * u}, kw)
        fd = (fp - fm) / (2 * h)
        an = float(np.sum(got["d" + name] * u))
        assert abs(fd - an) <= 1e-7 * max(1.0, abs(an)), f"d{name}: analytic {an:.12g}, finite differences {fd:.12g}"


def test_varlen_golden_equals_per_sequence_prefill_with_empty_sequences():
    """varlen = each sequence's own prefill (its own alignment), empty sequences (q or k) included;
    torch autograd through the per-sequence forwards checks the same numbers independently."""
    rng = np.random.default_rng(3)
    lq, lk = np.array([3, 0, 5, 1, 4]), np.array([4, 2, 0, 1, 6])
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    h_q, h_kv, d, d_v = 4, 2, 5, 3
    q, do = rng.standard_normal((lq.sum(), h_q, d)), rng.standard_normal((lq.sum(), h_q, d_v))
    k, v = rng.standard_normal((lk.sum(), h_kv, d)), rng.standard_normal((lk.sum(), h_kv, d_v))
    dlse, sinks = rng.standard_normal((h_q, lq.sum())), rng.standard_normal(h_q)
    kw = dict(causal="bottom_right", window=(2, 0), softcap=2.0)
    got = grad.varlen_backward(q, k, v, cq, ck, do, dlse, sinks=sinks, **kw)
    dsinks = np.zeros(h_q)
    for i in range(lq.size):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        one = dict(q=q[None, qs], k=k[None, ks], v=v[None, ks], do=do[None, qs], dlse=dlse[None, :, qs], sinks=sinks)
        if lq[i] == 0:
            continue  # no rows: nothing to compare, nothing added to dsinks
        want = _torch_grads(one, kw) if lk[i] else None
        g = grad.prefill_backward(one["q"], one["k"], one["v"], one["do"], one["dlse"], sinks=sinks, **kw)
        np.testing.assert_allclose(got["dq"][qs], g["dq"][0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(got["dk"][ks], g["dk"][0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(got["dv"][ks], g["dv"][0], rtol=0, atol=1e-13)
        if want is not None:
            for n in ("dq", "dk", "dv"):
                np.testing.assert_allclose(g[n], want[n], rtol=0, atol=1e-12)
        dsinks += g["dsinks"]
    np.testing.assert_allclose(got["dsinks"], dsinks, rtol=0, atol=1e-12)
    # keys of a sequence without queries get exactly zero; so do the rows of a sequence without keys
    assert not got["dk"][ck[1]:ck[2]].any() and not got["dv"][ck[1]:ck[2]].any()
    assert not got["dq"][cq[2]:cq[3]].any()
    o, lse = grad.varlen_forward(q, k, v, cq, ck, sinks=sinks, **kw)
    o2, _, lse2 = ref.varlen(q, k, v, cq, ck, sinks=sinks, **kw)
    np.testing.assert_allclose(o, o2, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, lse2, rtol=0, atol=1e-13)


def test_exact_zeros_and_no_nan():
    """Keys no query sees get dk = dv = 0 exactly; rows with no key (and no sink) dq = 0, never NaN,
    even with an LSE cotangent on them; a sink of -inf changes nothing and gets no NaN."""
    x, kw = _case((1, 6, 9, 4, 2, 4, 4, "top_left", (1, -1), 0.0, False, True))
    g = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], **kw)
    keep = ref.mask(6, 9, np.array([6]), np.array([9]), "top_left", (1, -1))
    unseen = ~keep.any(axis=1)[0]
    assert unseen.any() and not g["dk"][0, unseen].any() and not g["dv"][0, unseen].any()
    x, kw = _case((1, 7, 3, 2, 1, 4, 4, "bottom_right", (-1, -1), 1.0, False, True))
    g = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], **kw)
    assert all(np.isfinite(a).all() for a in g.values())
    assert not g["dq"][0, :4].any()  # rows 0..3 see no key (s_q - s_k = 4)
    h = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], sinks=np.full(2, -np.inf), **kw)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_allclose(h[n], g[n], rtol=0, atol=1e-14)
    assert np.array_equal(h["dsinks"], np.zeros(2))


@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_chunks_cover_the_case_once(head_map):
    """Any chunk budget (one query head per chunk, a kv head, batches) gives the one-block result."""
    x, kw = _case((3, 5, 6, 8, 2, 4, 3, "bottom_right", (2, 0), 1.0, True, True), seed=4)
    one = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], sinks=x["sinks"], head_map=head_map, **kw)
    for budget in (1, 30, 4 * 30, 8 * 30, 2 * 8 * 30):
        got = grad.prefill_backward(x["q"], x["k"], x["v"], x["do"], x["dlse"], sinks=x["sinks"], head_map=head_map,
                                    budget=budget, **kw)
        for n in one:
            np.testing.assert_allclose(got[n], one[n], rtol=0, atol=1e-13, err_msg=f"{n} budget={budget}")
    seen = []
    for bs, kv, rows in grad._chunks(3, 2, 4, 5, 6, budget=2 * 30):
        seen += [(bi, h) for bi in range(bs.start, bs.stop) for h in grad._heads(kv, rows, 4)]
    assert sorted(seen) == [(bi, h) for bi in range(3) for h in range(8)]



@pytest.mark.parametrize("c", CASES[:4], ids=lambda c: f"{c[7]}-sink{int(c[10])}-dl{int(c[11])}")
def test_given_o_enters_only_through_d(c):
    """With the forward's O given the golden is the exact VJP; with a perturbed O it is the exact VJP with
    dLSE - dO . (O_given - O) (D = rowsum(dO * O_given), FlashAttention-2's contract); varlen agrees."""
    x, kw = _case(c, seed=5)
    keep = grad._prefill_keep(x["q"], x["k"], kw["causal"], kw["window"], None, None)
    o, lse = grad.forward(x["q"], x["k"], x["v"], keep, softcap=kw["softcap"], sinks=x["sinks"])
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    dl = np.zeros_like(lse) if x["dlse"] is None else x["dlse"]
    bent = o + 1e-3 * np.random.default_rng(1).standard_normal(o.shape) * (o != 0)
    shift = np.einsum("bshc,bshc->bhs", do, bent - o)
    exact = grad.prefill_backward(q, k, v, do, dl, sinks=x["sinks"], **kw)
    same = grad.prefill_backward(q, k, v, do, dl, o=o, sinks=x["sinks"], **kw)
    moved = grad.prefill_backward(q, k, v, do, dl, o=bent, sinks=x["sinks"], **kw)
    via_dl = grad.prefill_backward(q, k, v, do, dl - shift, sinks=x["sinks"], **kw)
    for n in exact:
        np.testing.assert_allclose(same[n], exact[n], rtol=1e-12, atol=1e-12, err_msg=f"{n}: o = the exact O")
        np.testing.assert_allclose(moved[n], via_dl[n], rtol=1e-12, atol=1e-12, err_msg=f"{n}: o enters via D only")
    assert not np.allclose(moved["dq"], exact["dq"]), "a perturbed O changed nothing"
    b, s_q, h_q = q.shape[:3]
    cu_q = np.arange(b + 1, dtype=np.int32) * s_q
    cu_k = np.arange(b + 1, dtype=np.int32) * k.shape[1]
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731  (b, s, ...) -> packed rows
    dl_packed = dl.transpose(1, 0, 2).reshape(h_q, -1)  # h_q, total_q
    packed = grad.varlen_backward(flat(q), flat(k), flat(v), cu_q, cu_k, flat(do), dl_packed, o=flat(bent),
                                  sinks=x["sinks"], **kw)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_allclose(packed[n], flat(moved[n]), rtol=1e-12, atol=1e-12, err_msg=f"varlen {n} with o")
