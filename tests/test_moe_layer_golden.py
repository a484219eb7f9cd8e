"""The MoE layer golden (refimpl/moe_layer.py): moe.route's and moe.experts' goldens composed after a float64
router GEMM, checked against that composition, a torch float64 transcription of Hugging Face's DeepSeek-V3 /
Mixtral MoE blocks, and the locality of the experts (an unchosen expert's weights change no token's output);
its error model (the weights' and selection values' sensitivities against finite differences, the decidability
of the spec's tokens under the logits' full error bound); the spec's inputs; the kernels' argument checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import moe_experts as mx
from kernel_parity.refimpl import moe_layer as ml

torch = pytest.importorskip("torch")

MIXTRAL = dict(scoring="softmax", renormalize=True, n_group=1, topk_group=1, routed_scaling=1.0, mask="-inf")
DEEPSEEK = dict(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, routed_scaling=2.5, mask="-inf")


def _layer(seed=0, t=13, d=40, f=24, e=8, s=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (t, d))
    wg = rng.normal(0, 1.5 / np.sqrt(d), (e, d))
    w13 = rng.normal(0, d ** -0.5, (e, 2 * f, d)) * (10.0 ** (np.arange(e) % 3 - 1))[:, None, None]
    w2 = rng.normal(0, f ** -0.5, (e, d, f))
    sh = dict(ws13=rng.normal(0, d ** -0.5, (s, 2 * f, d)), ws2=rng.normal(0, f ** -0.5, (s, d, f))) if s else {}
    return x, wg, w13, w2, sh, rng.normal(0, 0.3, e)


def _route(logits, k, **kw):
    from kernel_parity.refimpl.moe import route

    return route(logits, k, **kw)


@pytest.mark.parametrize("kw,k,s", [(MIXTRAL, 2, 0), (DEEPSEEK, 3, 1), (dict(MIXTRAL, renormalize=False), 1, 2)])
def test_layer_is_route_then_experts(kw, k, s):
    x, wg, w13, w2, sh, bias = _layer(1, s=s)
    b = bias if kw["scoring"] == "sigmoid" else None
    out, w, ids, margin = ml.layer(x, wg, w13, w2, k, bias=b, **kw, **sh)
    w0, ids0, m0 = _route(x @ wg.T, k, bias=b, **kw)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(margin, m0)
    np.testing.assert_array_equal(out, mx.experts(x, ids0, w0, w13, w2, **sh))


def _hf_deepseek_v3(x, wg, bias, w13, w2, ws13, ws2, k, n_group, topk_group, scaling):
    """transformers' DeepseekV3MoE in float64: the fp32 router (here float64) F.linear, sigmoid, the bias for the
    choice, group scores by the two best, masked_fill 0 of the dropped groups, topk, renormalise, scale; the
    experts' loop, the shared expert added."""
    X = torch.from_numpy(x)
    logits = torch.nn.functional.linear(X, torch.from_numpy(wg))
    scores = logits.sigmoid()
    sel = scores + torch.from_numpy(bias)[None]
    t, e = sel.shape
    gs = sel.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    gidx = gs.topk(topk_group, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, -1)
    ids = sel.masked_fill(~smask.bool(), 0.0).topk(k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling
    out = torch.zeros_like(X)
    f = w13.shape[1] // 2
    for j in range(e):
        tok, slot = torch.where(ids == j)
        h = X[tok] @ torch.from_numpy(w13[j]).T
        y = (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ torch.from_numpy(w2[j]).T
        out.index_add_(0, tok, y * w[tok, slot, None])
    h = X @ torch.from_numpy(ws13[0]).T
    out += (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ torch.from_numpy(ws2[0]).T
    return out.numpy(), np.sort(ids.numpy(), axis=-1)


def test_matches_hf_deepseek_v3_block():
    x, wg, w13, w2, sh, bias = _layer(2, t=17, e=16, s=1)
    out, w, ids, _ = ml.layer(x, wg, w13, w2, 4, bias=bias, **dict(DEEPSEEK, mask="zero"), **sh)
    want, want_ids = _hf_deepseek_v3(x, wg, bias, w13, w2, sh["ws13"], sh["ws2"], 4, 4, 2, 2.5)
    np.testing.assert_array_equal(np.sort(ids, axis=-1), want_ids)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_matches_hf_mixtral_block():
    """MixtralSparseMoeBlock (router in float64 here): softmax, topk 2, renormalise, the experts' loop."""
    x, wg, w13, w2, _, _ = _layer(3)
    out, _, ids, _ = ml.layer(x, wg, w13, w2, 2, **MIXTRAL)
    X = torch.from_numpy(x)
    p = torch.softmax(torch.nn.functional.linear(X, torch.from_numpy(wg)), dim=-1)
    rw, sel = torch.topk(p, 2, dim=-1)
    rw = rw / rw.sum(dim=-1, keepdim=True)
    want = torch.zeros_like(X)
    for j in range(wg.shape[0]):
        tok, slot = torch.where(sel == j)
        h = X[tok] @ torch.from_numpy(w13[j]).T
        want.index_add_(0, tok, ((torch.nn.functional.silu(h[:, :24]) * h[:, 24:]) @ torch.from_numpy(w2[j]).T)
                        * rw[tok, slot, None])
    np.testing.assert_array_equal(ids, sel.numpy())
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", [None, ml_dtypes.bfloat16])
def test_an_unchosen_experts_weights_change_no_token_that_did_not_choose_it(act):
    x, wg, w13, w2, sh, _ = _layer(4, t=9, e=8, s=1)
    out, _, ids, _ = ml.layer(x, wg, w13, w2, 2, act_dtype=act, **MIXTRAL, **sh)
    for e in range(8):
        v13, v2 = w13.copy(), w2.copy()
        v13[e] *= -3.0
        v2[e] = np.random.default_rng(e).normal(0, 5, v2[e].shape)
        got, _, ids2, _ = ml.layer(x, wg, v13, v2, 2, act_dtype=act, **MIXTRAL, **sh)
        np.testing.assert_array_equal(ids2, ids)
        free = ~(ids == e).any(axis=1)
        np.testing.assert_array_equal(got[free], out[free])  # bit for bit
        if (~free).any():
            assert not np.allclose(got[~free], out[~free])


def _jacobian(fn, logits, h=1e-6):
    """d fn(logits)[t, j] / d logits[t, e] by central differences: (T, k, E)."""
    t, e = logits.shape
    base = fn(logits)
    jac = np.zeros(base.shape + (e,))
    for i in range(e):
        dl = np.zeros_like(logits)
        dl[:, i] = h
        jac[..., i] = (fn(logits + dl) - fn(logits - dl)) / (2 * h)
    return jac


@pytest.mark.parametrize("scoring,renorm,scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                                  ("sigmoid", True, 2.5), ("sigmoid", False, 2.5)])
def test_weight_sensitivity_is_the_jacobian_on_the_logit_scales(scoring, renorm, scale):
    x, wg, *_ = _layer(5, t=7, e=10)
    logits = x @ wg.T
    m = ml.logit_scale(x, wg)
    _, ids, _ = _route(logits, 3, scoring=scoring, renormalize=renorm, routed_scaling=scale)

    def weights(lg):  # the chosen experts held fixed
        s = ml.scores(lg, scoring)
        w = np.take_along_axis(s, ids.astype(np.int64), axis=-1)
        return scale * (w / w.sum(axis=-1, keepdims=True) if renorm else w)

    jac = _jacobian(weights, logits)
    want = (np.abs(jac) * m[:, None, :]).sum(axis=-1)
    got = ml.weight_sensitivity(logits, ids, m, scoring, renorm, scale)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_select_sensitivity_is_the_jacobian_on_the_logit_scales(scoring):
    x, wg, *_ = _layer(6, t=5, e=12)
    logits = x @ wg.T
    m = ml.logit_scale(x, wg)
    jac = _jacobian(lambda lg: ml.scores(lg, scoring), logits)
    np.testing.assert_allclose(ml.select_sensitivity(logits, m, scoring), (np.abs(jac) * m[:, None, :]).sum(axis=-1),
                               rtol=1e-6)


def test_logit_scale_bounds_an_fp32_router_gemm():
    """|fp32 logits - float64| <= r_g max(|l|, M), with r_g = rtol32 + eps32 sqrt(D) (the bound the op assumes)."""
    from kernel_parity.conformance.ops.moe_layer import r_g

    for d in (64, 2048, 7168):
        x, wg, *_ = _layer(7, t=64, d=d, e=64, f=1)
        x32, wg32 = x.astype(np.float32), wg.astype(np.float32)
        exact = x32.astype(np.float64) @ wg32.astype(np.float64).T
        err = np.abs((x32 @ wg32.T).astype(np.float64) - exact)
        assert (err <= r_g(d) * ml.logit_scale(x32, wg32)).all()


PARAMS = [
    dict(t=37, d=64, f=16, e=8, k=2, scoring="softmax", renorm=1, bias=0, groups=1, kept=1, rscale="1", mask="-inf",
         shared=0),
    dict(t=23, d=64, f=16, e=64, k=8, scoring="sigmoid", renorm=1, bias=1, groups=8, kept=4, rscale="2.5",
         mask="-inf", shared=1),
    dict(t=23, d=96, f=16, e=32, k=8, scoring="softmax", renorm=0, bias=0, groups=1, kept=1, rscale="1", mask="-inf",
         shared=0),
    dict(t=17, d=64, f=16, e=64, k=8, scoring="sigmoid", renorm=1, bias=1, groups=8, kept=4, rscale="2.5",
         mask="zero", shared=1),
]


@pytest.mark.parametrize("p", PARAMS)
@pytest.mark.parametrize("dist", ["normal", "last", "skew"])
def test_spec_tokens_are_decided_under_the_full_logit_error(p, dist):
    """Every drawn token keeps its ids when each logit moves by its whole bound r_g m_e (random signs, and the signs
    that push the k-th and the (k+1)-th experts together), and its weights move by at most r_g G."""
    from kernel_parity.conformance.ops.moe_layer import LAYER, r_g
    from kernel_parity.conformance.ops.moe_route import route_args

    x = LAYER.make_inputs(p, "bf16", dist, np.random.default_rng(11))
    xs, wg = x["x"].astype(np.float64), x["wg"].astype(np.float64)
    bias = x["bias"].astype(np.float64) if "bias" in x else None
    logits = xs @ wg.T
    w, ids, _ = _route(logits, p["k"], bias=bias, **route_args(p))
    bound = r_g(p["d"]) * ml.logit_scale(xs, wg)
    rng = np.random.default_rng(0)
    g = ml.weight_sensitivity(logits, ids, ml.logit_scale(xs, wg), p["scoring"], bool(p["renorm"]), float(p["rscale"]))
    for trial in range(8):
        if trial == 0:  # chosen experts down, the others up
            sign = np.ones_like(logits)
            np.put_along_axis(sign, ids.astype(np.int64), -1.0, axis=-1)
        else:
            sign = rng.choice([-1.0, 1.0], logits.shape)
        w2, ids2, _ = _route(logits + sign * bound, p["k"], bias=bias, **route_args(p))
        np.testing.assert_array_equal(np.sort(ids2, axis=-1), np.sort(ids, axis=-1))
        assert (np.abs(w2 - w) <= r_g(p["d"]) * g * 1.01 + 1e-300).all()


def test_spec_inputs_dists_and_neighbours():
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.ops.moe_experts import expert_scale
    from kernel_parity.conformance.ops.moe_layer import LAYER

    assert ops.get("moe.layer") is LAYER
    p = dict(PARAMS[0], t=64)
    for dist in LAYER.dists:
        x = LAYER.make_inputs(p, "bf16", dist, np.random.default_rng(1))
        assert x["x"].dtype == ml_dtypes.bfloat16 and x["wg"].shape == (8, 64) and "bias" not in x
        out = LAYER.reference({k: v for k, v in x.items()}, p)
        ids = out["ids"]
        if dist == "last":
            assert (ids == 7).any(axis=1).mean() > 0.5
        if dist == "skew":  # max(k, E // 3) = 2 live experts: most of the six others get no token
            assert len(np.unique(ids)) <= 4 and (ids < 2).mean() > 0.9
        if dist == "normal":
            assert len(np.unique(ids)) == 8
    x = LAYER.make_inputs(dict(PARAMS[1], d=128, f=128), "fp32", "normal", np.random.default_rng(2))
    rms = np.sqrt((x["w2"].astype(np.float64) ** 2).mean(axis=(1, 2)))
    np.testing.assert_allclose(rms / rms[0], expert_scale(np.arange(64)) / expert_scale(0), rtol=0.1)
    logits = x["x"].astype(np.float64) @ x["wg"].astype(np.float64).T
    assert np.abs(np.diff(logits, axis=1)).min() > 1e-4  # neighbouring experts' logits differ
    assert x["bias"].dtype == np.float32 and x["ws13"].shape == (1, 256, 128)


def test_golden_refusals():
    x, wg, w13, w2, _, _ = _layer()
    with pytest.raises(ValueError, match="wg must be"):
        ml.layer(x, wg[:, :5], w13, w2, 2)
    with pytest.raises(ValueError, match="w13 must hold"):
        ml.layer(x, wg, w13[:5], w2[:5], 2)
    with pytest.raises(ValueError, match="k=9"):
        ml.layer(x, wg, w13, w2, 9)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_kernels_refuse_bad_arguments_in_one_line(backend):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 kept (not monkeypatched) before triton's first import
    import importlib

    layer = importlib.import_module(f"kernel_parity.kernels.{backend}.moe_layer").layer
    x, wg, w13, w2, _, _ = _layer()
    args = [np.ascontiguousarray(a, dtype=np.float32) for a in (x, wg, w13, w2)]
    if backend != "cpu":
        args = [torch.from_numpy(a) for a in args]
    for call, match in [(lambda: layer(args[0], args[1][:, :5], args[2], args[3], 2), "wg must be"),
                        (lambda: layer(args[0], args[1], args[2][:5], args[3][:5], 2), "w13 must be"),
                        (lambda: layer(args[0], args[1], args[2], args[3], 9), "k=9"),
                        (lambda: layer(args[0], args[1], args[2], args[3][:, :5], 2), "w2 must be")]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
