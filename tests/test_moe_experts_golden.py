"""The fused MoE experts golden (refimpl/moe_experts.py) against a plain torch float64 transcription of Hugging
Face's Mixtral sparse block (a loop over experts: index the tokens, gate / up, silu * up, down, times the routing
weight, index_add) and of a per-token loop; its declared production cast (act rounded to the activation dtype),
the shared experts, repeated ids, the error model's magnitude, refusals; the spec's inputs (neighbour separation,
the dists) and the kernels' argument checks (one-line ValueErrors)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import moe_experts as mx

torch = pytest.importorskip("torch")


def _layer(seed=0, t=11, d=40, f=24, e=6, k=3, s=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (t, d))
    ids = np.argsort(rng.random((t, e)), axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.05, 1, (t, k))
    w13 = rng.normal(0, d ** -0.5, (e, 2 * f, d))
    w2 = rng.normal(0, f ** -0.5, (e, d, f))
    sh = dict(ws13=rng.normal(0, d ** -0.5, (s, 2 * f, d)), ws2=rng.normal(0, f ** -0.5, (s, d, f))) if s else {}
    return x, ids, w, w13, w2, sh


def _hf_mixtral(x, ids, w, w13, w2, ws13=None, ws2=None):
    """transformers' MixtralSparseMoeBlock loop in float64 (w1 = gate, w3 = up: vLLM's w13 halves)."""
    X, I, W = torch.from_numpy(x), torch.from_numpy(ids).long(), torch.from_numpy(w)
    E, F2, _ = w13.shape
    out = torch.zeros_like(X)
    mask = torch.nn.functional.one_hot(I, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        idx, top_x = torch.where(mask[e])
        h = X[top_x] @ torch.from_numpy(w13[e]).T
        act = torch.nn.functional.silu(h[:, :F2 // 2]) * h[:, F2 // 2:]
        y = (act @ torch.from_numpy(w2[e]).T) * W[top_x, idx, None]
        out.index_add_(0, top_x, y)
    for s in range(0 if ws13 is None else ws13.shape[0]):
        h = X @ torch.from_numpy(ws13[s]).T
        out += (torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]) @ torch.from_numpy(ws2[s]).T
    return out.numpy()


@pytest.mark.parametrize("t,d,f,e,k,s", [(11, 40, 24, 6, 3, 0), (1, 16, 8, 1, 1, 0), (17, 32, 48, 8, 2, 1),
                                         (5, 24, 16, 4, 4, 2)])
def test_matches_hf_mixtral_loop(t, d, f, e, k, s):
    x, ids, w, w13, w2, sh = _layer(t, t, d, f, e, k, s)
    np.testing.assert_allclose(mx.experts(x, ids, w, w13, w2, **sh), _hf_mixtral(x, ids, w, w13, w2, **sh),
                               rtol=1e-12, atol=1e-13)


def test_per_token_definition_and_repeated_ids():
    """out[t] = sum_j w_j E_{ids[t, j]}(x_t): a per-token loop, an expert repeated in a token (each slot counts)."""
    x, ids, w, w13, w2, _ = _layer(3)
    ids[0, 1] = ids[0, 0]
    want = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = w13[ids[t, j]] @ x[t]
            g, u = h[:w13.shape[1] // 2], h[w13.shape[1] // 2:]
            want[t] += w[t, j] * (w2[ids[t, j]] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(mx.experts(x, ids, w, w13, w2), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("act", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_act_rounded_to_the_activation_dtype(act):
    """act_dtype rounds silu(g) * u once (RNE) before the down projection, nothing else."""
    x, ids, w, w13, w2, _ = _layer(4, t=3, k=1, e=2)
    got = mx.experts(x, ids, w, w13, w2, act_dtype=act)
    want = np.zeros_like(x)
    for t in range(3):
        e = ids[t, 0]
        h = w13[e] @ x[t]
        g, u = h[:24], h[24:]
        a = (g / (1 + np.exp(-g)) * u).astype(act).astype(np.float64)
        want[t] = w[t, 0] * (w2[e] @ a)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert not np.allclose(got, mx.experts(x, ids, w, w13, w2), rtol=1e-9, atol=0)  # the cast is there


def test_storage_dtype_weights_widen_exactly():
    x, ids, w, w13, w2, _ = _layer(5)
    b13, b2 = w13.astype(ml_dtypes.bfloat16), w2.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(mx.experts(x, ids, w, b13, b2),
                                  mx.experts(x, ids, w, b13.astype(np.float64), b2.astype(np.float64)))


def test_magnitude_bounds_the_down_projections_terms():
    """M^2 >= sum_j w_j^2 sum_f (W2[d, f] act_f)^2 (the act-rounding code flips' scale), and M > 0 wherever out is."""
    x, ids, w, w13, w2, sh = _layer(6, s=1)
    m = mx.experts(x, ids, w, w13, w2, absolute=True, **sh)
    rss2 = np.zeros_like(x)
    f = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = w13[ids[t, j]] @ x[t]
            a = h[:f] / (1 + np.exp(-h[:f])) * h[f:]
            rss2[t] += w[t, j] ** 2 * ((w2[ids[t, j]] * a) ** 2).sum(axis=1)
    assert (m * m >= rss2 * (1 - 1e-9)).all()
    assert (m > 0).all()


@pytest.mark.parametrize("change,match", [
    (dict(x=np.zeros((3,))), "x must be"),
    (dict(ids=np.zeros((11, 3), np.float32)), "ids must be"),
    (dict(ids=np.full((11, 3), 6, np.int32)), r"ids must be in \[0, E=6\)"),
    (dict(w=np.zeros((11, 2))), "weights must"),
    (dict(w13=np.zeros((6, 47, 40))), "w13 must"),
    (dict(w2=np.zeros((6, 40, 23))), "w2 must"),
])
def test_refusals(change, match):
    x, ids, w, w13, w2, _ = _layer()
    args = {**dict(x=x, ids=ids, w=w, w13=w13, w2=w2), **change}
    with pytest.raises(ValueError, match=match):
        mx.experts(args["x"], args["ids"], args["w"], args["w13"], args["w2"])
    with pytest.raises(ValueError, match="ws13 and ws2"):
        mx.experts(x, ids, w, w13, w2, ws13=np.zeros((1, 48, 40)))


def test_spec_inputs_separate_neighbours_and_dists():
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.ops.moe_experts import EXPERTS, expert_scale

    p = dict(t=30, d=64, f=32, e=9, k=3, shared=1, wfmt="dense")
    rng = np.random.default_rng(0)
    for dist in EXPERTS.dists:
        x = EXPERTS.make_inputs(p, "bf16", dist, np.random.default_rng(1))
        ids = x["ids"]
        assert ids.dtype == np.int32 and all(len(set(r)) == 3 for r in ids.tolist())
        assert x["w13"].dtype == ml_dtypes.bfloat16 and x["ws13"].shape == (1, 64, 64)
        if dist == "last":
            assert (ids == 8).any(axis=1).all()
        if dist == "skew":
            assert ids.max() < 3
    x = EXPERTS.make_inputs(p, "fp32", "normal", rng)
    rms = np.sqrt((x["w2"].astype(np.float64) ** 2).mean(axis=(1, 2)))
    np.testing.assert_allclose(rms / rms[0], expert_scale(np.arange(9)) / expert_scale(0), rtol=0.1)
    assert ops.get("moe.experts") is EXPERTS


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_kernels_refuse_bad_arguments_in_one_line(backend):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 kept (not monkeypatched) before triton's first import: later runs need it
    x, ids, w, w13, w2, _ = _layer()
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    args = [f32(x), ids, f32(w), f32(w13), f32(w2)]
    if backend == "cpu":
        from kernel_parity.kernels.cpu.moe_experts import experts
    else:
        import importlib
        experts = importlib.import_module(f"kernel_parity.kernels.{backend}.moe_experts").experts
        args = [torch.from_numpy(a) for a in args]
    bad_ids = args[1] * 0 + 6
    for call, match in [(lambda: experts(args[0], bad_ids, *args[2:]), r"ids must be in \[0, E=6\)"),
                        (lambda: experts(args[0], args[1], args[2], args[3][:, :47], args[4]), "w13 must be"),
                        (lambda: experts(args[0], args[1], args[2][:, :2], args[3], args[4]), "weights must be"),
                        (lambda: experts(*args, ws13=args[3][:1]), "ws13 and ws2")]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_int4_inputs_dequantize_exactly_in_golden_and_torch():
    """wfmt=int4: every weight GPTQ v1 (group 128); the golden's dense weights are refimpl.quant_fp's exact
    dequantization, and the eager kernel's fp32 dequantization (before its cast) is the same values."""
    from kernel_parity.conformance.ops.moe_experts import EXPERTS, dense_weight, int4_weight
    from kernel_parity.kernels.torch.moe_experts import dequant_int4
    from kernel_parity.refimpl.quant_fp import int4_dequantize

    p = dict(t=4, d=256, f=128, e=3, k=2, shared=1, wfmt="int4")
    x = EXPERTS.make_inputs(p, "bf16", "normal", np.random.default_rng(2))
    assert "w13" not in x and x["w13_qweight"].shape == (3, 32, 256) and x["w2_scales"].shape == (3, 1, 256)
    for name in ("w13", "w2", "ws13", "ws2"):
        q = int4_weight(x, name)
        dense = dense_weight(x, name)
        for e in range(q["qweight"].shape[0]):
            want = int4_dequantize({n: v[e] for n, v in q.items()})
            np.testing.assert_array_equal(dense[e], want)
            tq = {n: torch.from_numpy(v) for n, v in q.items()}
            np.testing.assert_array_equal(dequant_int4(tq, e, torch.float32).numpy(), want)
    with pytest.raises(Exception, match="multiples of the group 128"):
        from kernel_parity.conformance import ops
        ops.make_case("moe.experts", "cpu", "bf16", dict(p, d=96), "normal", 0)
