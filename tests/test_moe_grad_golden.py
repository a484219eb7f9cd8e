"""The MoE routing backward golden (refimpl/moe_grad.py) against float64 torch autograd through the routers it
names, written as their training code writes them (Hugging Face's Mixtral: softmax, top-k, renormalised; Qwen3-MoE
without renormalisation; DeepSeek-V3's MoEGate: sigmoid, the bias for the choice only, grouped top-k, renormalised,
x 2.5), the choice held (torch.topk's indices carry no gradient); and its declared conventions: the exact zeros of
softmax with renormalisation, sigmoid's complement without cancellation, zero sums, -inf logits, refusals (the
golden's and the kernels')."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.refimpl import moe
from kernel_parity.refimpl.moe_grad import route_backward_error_model

torch = pytest.importorskip("torch")


def _autograd(logits, gw, fn):
    """d sum(gw * w) / d logits, w, ids = fn(x) with x float64 requiring grad."""
    x = torch.from_numpy(logits).requires_grad_(True)
    w, ids = fn(x)
    (g,) = torch.autograd.grad(w, x, grad_outputs=torch.from_numpy(gw))
    return g.numpy(), ids.numpy()


def _mixtral(k, renorm):
    def fn(x):
        s = torch.softmax(x, dim=-1)
        w, ids = torch.topk(s, k, dim=-1)
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids
    return fn


def _deepseek(bias, k, n_group, topk_group, scale, fill):
    def fn(x):
        scores = x.sigmoid()
        T = x.shape[0]
        s = scores.detach() + torch.from_numpy(bias)  # the choice only (as DeepSeek's gate: no gradient here)
        g = s.view(T, n_group, -1)
        idx = g.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_group, dim=-1)[1]
        drop = torch.ones(T, n_group, dtype=torch.bool).scatter_(1, idx, False)
        s = g.masked_fill(drop.unsqueeze(-1), fill).flatten(1)
        ids = torch.topk(s, k, dim=-1)[1]
        w = scores.gather(1, ids)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * scale, ids
    return fn


@pytest.mark.parametrize("E,k,renorm", [(8, 2, True), (128, 8, False), (128, 8, True), (60, 4, True)])
def test_softmax_routing_backward_matches_torch_autograd(E, k, renorm):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(0, 2, (64, E))
    gw = rng.normal(0, 1, (64, k))
    want, ids = _autograd(logits, gw, _mixtral(k, renorm))
    got = moe.route_backward(logits, ids, gw, scoring="softmax", renormalize=renorm)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15 * np.abs(want).max())
    _, rids, _ = moe.route(logits, k, renormalize=renorm)
    assert [set(r) for r in rids.tolist()] == [set(r) for r in ids.tolist()]


@pytest.mark.parametrize("mask,fill", [("-inf", float("-inf")), ("zero", 0.0)])
def test_deepseek_v3_routing_backward_matches_torch_autograd(mask, fill):
    rng = np.random.default_rng(3)
    logits, bias = rng.normal(0, 1.5, (32, 256)), rng.normal(0, 0.3, 256)
    gw = rng.normal(0, 1, (32, 8))
    want, ids = _autograd(logits, gw, _deepseek(bias, 8, 8, 4, 2.5, fill))
    kw = dict(scoring="sigmoid", renormalize=True, bias=bias, n_group=8, topk_group=4, routed_scaling=2.5, mask=mask)
    got = moe.route_backward(logits, ids, gw, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15 * np.abs(want).max())
    # the golden forward's choice is DeepSeek's (the order within a token aside)
    _, rids, _ = moe.route(logits, 8, **kw)
    assert [set(r) for r in rids.tolist()] == [set(r) for r in ids.tolist()]


def test_the_order_of_the_slots_does_not_matter():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (6, 16))
    _, ids, _ = moe.route(logits, 4, scoring="sigmoid")
    gw = rng.normal(0, 1, (6, 4))
    perm = rng.permutation(4)
    a = moe.route_backward(logits, ids, gw, scoring="sigmoid")
    b = moe.route_backward(logits, ids[:, perm], gw[:, perm], scoring="sigmoid")
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-17)


def test_softmax_renormalised_unchosen_are_exactly_zero():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 4, (16, 256))
    _, ids, _ = moe.route(logits, 8)
    g = moe.route_backward(logits, ids, rng.normal(0, 1, (16, 8)), routed_scaling=2.5)
    chosen = np.zeros_like(g, dtype=bool)
    np.put_along_axis(chosen, ids.astype(np.int64), True, axis=-1)
    assert (g[~chosen] == 0).all() and (g[chosen] != 0).all()


def test_one_expert_and_k_equal_e():
    # a renormalised single weight is the constant c: gradient 0; k = E with softmax: weights = c softmax
    assert (moe.route_backward(np.array([[0.3]]), np.array([[0]]), np.array([[5.0]]), scoring="sigmoid") == 0).all()
    x = np.array([[0.1, -1.0, 2.0]])
    s = np.exp(x) / np.exp(x).sum()
    gw = np.array([[1.0, -2.0, 0.5]])
    got = moe.route_backward(x, np.array([[2, 0, 1]]), gw[:, [2, 0, 1]])
    np.testing.assert_allclose(got, s * (gw - (gw * s).sum()), rtol=1e-14)


def test_sigmoid_complement_keeps_its_precision_when_saturated():
    x = np.array([[40.0, -40.0]])
    got = moe.route_backward(x, np.array([[0, 1]]), np.array([[1.0, 1.0]]), scoring="sigmoid", renormalize=False)
    e = np.exp(-40.0)
    np.testing.assert_allclose(got, [[e / (1 + e) ** 2, e / (1 + e) ** 2]], rtol=1e-14)


def test_neg_inf_logits_and_zero_sums():
    # -inf: score 0, gradient 0; renormalize over chosen scores that are all 0: weights 0, gradient 0
    x = np.array([[0.0, -np.inf, 1.0, -np.inf]])
    g = moe.route_backward(x, np.array([[1, 3]]), np.array([[1.0, 2.0]]))
    assert np.array_equal(g, np.zeros_like(x))
    g = moe.route_backward(x, np.array([[2, 1]]), np.array([[1.0, 2.0]]), renormalize=False)
    assert np.isfinite(g).all() and g[0, 1] == 0 and g[0, 3] == 0


def test_error_model_follows_the_golden_and_has_compute_terms():
    rng = np.random.default_rng(11)
    for scoring in ("softmax", "sigmoid"):
        for renorm in (True, False):
            logits = rng.normal(0, 3, (8, 64))
            _, ids, _ = moe.route(logits, 4, scoring=scoring, renormalize=renorm)
            gw = rng.normal(0, 1, (8, 4))
            kw = dict(scoring=scoring, renormalize=renorm)
            g = moe.route_backward(logits, ids, gw, **kw)
            mag, comp = route_backward_error_model(logits, ids, gw, **kw)
            assert (mag >= np.abs(g) / 4).all()  # a root-sum-square of k = 4 terms: at least their sum / 2
            assert (comp >= 0).all() and (comp > 0).any()


BAD = [
    (dict(scoring="relu"), "scoring"),
    (dict(mask="nan"), "mask"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1), "k="),  # k 4 > 1 kept group of 2
    (dict(bias=np.zeros(7)), "bias"),
]


@pytest.mark.parametrize("kw,match", BAD)
def test_refuses_bad_arguments(kw, match):
    x, ids, gw = np.zeros((2, 8)), np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), np.ones((2, 4))
    with pytest.raises(ValueError, match=match):
        moe.route_backward(x, ids, gw, **kw)


def test_refuses_bad_ids_grad_w_and_logits():
    x, gw = np.zeros((2, 8)), np.ones((2, 2))
    for ids, match in ((np.array([[0, 8], [1, 2]]), r"\[0, 8\)"), (np.array([[1, 1], [1, 2]]), "distinct"),
                       (np.array([[0.0, 1.0], [1.0, 2.0]]), "integers"), (np.array([[0, 1]]), r"\(2, k\)")):
        with pytest.raises(ValueError, match=match):
            moe.route_backward(x, ids, gw)
    ids = np.array([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="grad_w"):
        moe.route_backward(x, ids, np.ones((2, 3)))
    with pytest.raises(ValueError, match="grad_w must be finite"):
        moe.route_backward(x, ids, np.array([[np.nan, 1.0], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="finite"):
        moe.route_backward(np.full((2, 8), np.nan), ids, gw)
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        moe.route_backward(np.zeros(8), ids, gw)


@pytest.mark.parametrize("kw", [dict(scoring="relu"), dict(n_group=3), dict(n_group=4, topk_group=1, k=4),
                                dict(ids=[[0, 8]]), dict(ids=[[1, 1]]), dict(grad_w_cols=3), dict(bias=7)])
def test_the_cpu_and_torch_kernels_refuse_as_the_golden_does(kw):
    from kernel_parity.kernels.cpu.moe_grad import route_backward as cpu
    from kernel_parity.kernels.torch.moe_grad import route_backward as eager

    kw = dict(kw)
    k = kw.pop("k", 2)
    ids = np.array(kw.pop("ids", [list(range(k))]), dtype=np.int32)
    gw = np.ones((1, kw.pop("grad_w_cols", ids.shape[1])), np.float32)
    if "bias" in kw:
        kw["bias"] = np.zeros(kw["bias"], np.float32)
    x = np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError):
        moe.route_backward(x, ids, gw, **kw)
    with pytest.raises(ValueError):
        cpu(x, ids, gw, **kw)
    tkw = {k2: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k2, v in kw.items()}
    with pytest.raises(ValueError):
        eager(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(gw), **tkw)


@pytest.mark.parametrize("kw", [dict(scoring="relu"), dict(n_group=3), dict(n_group=4, topk_group=1, k=4),
                                dict(grad_w_cols=3), dict(bias=7), dict(ids_dtype="float32"), dict(out=(1, 7))])
def test_the_triton_wrapper_refuses_bad_arguments(kw):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 (kept) before triton's first import: later interpreter runs need it
    pytest.importorskip("triton")
    from kernel_parity.kernels.triton.moe_grad import route_backward as tri

    kw = dict(kw)
    k = kw.pop("k", 2)
    ids = torch.arange(k, dtype=getattr(torch, kw.pop("ids_dtype", "int32"))).reshape(1, k)
    gw = torch.ones(1, kw.pop("grad_w_cols", k))
    if "bias" in kw:
        kw["bias"] = torch.zeros(kw["bias"])
    if "out" in kw:
        kw["out"] = torch.empty(kw["out"])
    with pytest.raises(ValueError, match="moe.route"):
        tri(torch.zeros(1, 8), ids, gw, **kw)


def test_the_cpu_kernel_takes_strided_ids_and_grad_w():
    from kernel_parity.kernels.cpu.moe_grad import route_backward as cpu

    rng = np.random.default_rng(13)
    x = rng.normal(0, 2, (6, 32)).astype(np.float32)
    _, ids, _ = moe.route(x, 4)
    gw = rng.normal(0, 1, (6, 4)).astype(np.float32)
    a = cpu(x, ids, gw)
    wide_ids, wide_gw = np.zeros((6, 8), np.int32), np.zeros((6, 8), np.float32)
    wide_ids[:, ::2], wide_gw[:, ::2] = ids[:, ::-1], gw[:, ::-1]
    b = cpu(np.asfortranarray(x), wide_ids[:, ::2][:, ::-1], wide_gw[:, ::2][:, ::-1])
    assert np.array_equal(a, b)
