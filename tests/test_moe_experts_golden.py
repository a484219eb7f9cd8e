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


# ---------------------------------------------------------------------------------------------------- block FP8

def _fp8_layer(seed=0, t=9, d=256, f=256, e=3, k=2, s=0, dtype=ml_dtypes.bfloat16):
    """A layer with block-FP8 weights (refimpl.quant_fp.fp8_quantize_blocks per expert) and x in `dtype`."""
    from kernel_parity.refimpl.quant_fp import fp8_quantize_blocks

    x, ids, w, w13, w2, sh = _layer(seed, t, d, f, e, k, s)
    x = x.astype(dtype).astype(np.float64) * 3

    def q(a):
        parts = [fp8_quantize_blocks(m, 128, 128) for m in a]
        return mx.BlockFP8(np.stack([c for c, _ in parts]), np.stack([sc for _, sc in parts]))

    return x, ids, w, q(w13), q(w2), {n: q(v) for n, v in sh.items()}


def test_block_fp8_weights_dequantize_exactly_one_expert_at_a_time():
    """BlockFP8[e] is code x its 128 x 128 block's scale in float64; the golden equals the dense golden on those."""
    from kernel_parity.refimpl.quant_fp import fp8_dequantize_blocks

    x, ids, w, b13, b2, sh = _fp8_layer(1, d=384, f=128, s=1)
    c, sc = b13.codes[1], b13.scales[1]
    want = c.astype(np.float64) * np.repeat(np.repeat(sc.astype(np.float64), 128, 0), 128, 1)
    np.testing.assert_array_equal(b13[1], want)
    np.testing.assert_array_equal(b13[1], fp8_dequantize_blocks(c, sc, 128, 128))
    dense = lambda b: np.stack([b[i] for i in range(b.shape[0])])  # noqa: E731
    for act in (None, "e4m3"):
        np.testing.assert_array_equal(
            mx.experts(x, ids, w, b13, b2, act_quant=act, ws13=sh["ws13"], ws2=sh["ws2"]),
            mx.experts(x, ids, w, dense(b13), dense(b2), act_quant=act, ws13=dense(sh["ws13"]), ws2=dense(sh["ws2"])))
    with pytest.raises(ValueError, match=r"scales must be \(E, ceil\(N/128\), ceil\(K/128\)\)"):
        mx.BlockFP8(b13.codes, b13.scales[:, :1])


def test_group_quantize_is_kvquants_quantizer_per_128_columns():
    """x's w8a8 codes: s = float32(amax of each 128 columns) / 448, codes e4m3fn(RNE(clamp(float32(x) / s))) (the IEEE
    division, refimpl.kvquant.quantize), the last group shorter; an all-zero group is codes 0."""
    rng = np.random.default_rng(3)
    v = (rng.standard_normal((4, 300)) * 10.0 ** rng.integers(-3, 3, (4, 1))).astype(np.float32)
    v[2, 128:256] = 0
    got, s = mx.group_quantize(v)
    assert s.shape == (4, 3)
    for r in range(4):
        for g in range(3):
            part = v[r, 128 * g:128 * (g + 1)]
            sg = np.float32(np.abs(part).max()) / np.float32(448)
            assert s[r, g] == sg
            with np.errstate(invalid="ignore", divide="ignore"):
                y = np.where(sg == 0, np.float32(0), part / np.where(sg == 0, np.float32(1), sg)).astype(np.float32)
            codes = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            np.testing.assert_array_equal(got[r, 128 * g:128 * (g + 1)], codes * np.float64(sg))
    assert (got[2, 128:256] == 0).all()


def test_w8a8_golden_is_the_per_token_loop_on_quantized_x_and_act():
    """act_quant='e4m3': out[t] = sum_j w_j W2 q(rnd(silu(G q(x_t)) * (U q(x_t)))), q the per-128 group quantizer."""
    x, ids, w, b13, b2, _ = _fp8_layer(4, t=5, d=256, f=256, e=3, k=2)
    got = mx.experts(x, ids, w, b13, b2, act_dtype=ml_dtypes.bfloat16, act_quant="e4m3")
    xq = mx.group_quantize(x)[0]
    want = np.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = ids[t, j]
            h = b13[e] @ xq[t]
            g, u = h[:256], h[256:]
            a = (g / (1 + np.exp(-g)) * u).astype(ml_dtypes.bfloat16).astype(np.float64)
            want[t] += w[t, j] * (b2[e] @ mx.group_quantize(a[None])[0][0])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert not np.allclose(got, mx.experts(x, ids, w, b13, b2, act_dtype=ml_dtypes.bfloat16), rtol=1e-3, atol=0)


@pytest.mark.parametrize("act", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_flip_bound_holds_every_act_within_its_radius(monkeypatch, act):
    """The act quantizer's bound (flip_bound) holds the w8a8 output of any act within r of the golden's: r widened
    10^4x so that many codes flip and many groups' scales move, each act drawn in [act - r, act + r] (and at its
    ends), rounded to the test dtype and quantized as a kernel does (one routed expert and one shared)."""
    monkeypatch.setattr(mx, "FLIP_R", 2.0e4)
    x, ids, w, b13, b2, sh = _fp8_layer(5, t=16, d=256, f=384, e=1, k=1, s=1, dtype=act)
    x = x * 0.3
    q = mx.experts(x, ids, w, b13, b2, act_dtype=act, act_quant="e4m3", flip_bound=True, **sh)
    out = mx.experts(x, ids, w, b13, b2, act_dtype=act, act_quant="e4m3", **sh)
    assert q.shape == (2,) + out.shape and (q >= 0).all() and (q[0] > 0).mean() > 0.5 and (q[1] > 0).any()
    xq = mx.group_quantize(x)[0]
    rng = np.random.default_rng(0)
    for pick in (lambda n: rng.uniform(-1, 1, n), lambda n: np.ones(n), lambda n: rng.choice([-1.0, 1.0], n)):
        res = np.zeros_like(out)
        for a13, a2m, wt in ((b13[0], b2[0], w[:, :1]), (sh["ws13"][0], sh["ws2"][0], 1.0)):
            h = xq @ a13.T
            f = a13.shape[0] // 2
            g, u = h[:, :f], h[:, f:]
            sg, dsg = mx._silu_parts(g)
            a = sg * u
            mg2, mu2 = (xq ** 2) @ (a13[:f] ** 2).T, (xq ** 2) @ (a13[f:] ** 2).T
            lsq = a * a + 256 * (dsg * u) ** 2 * mg2 + 256 * sg * sg * mu2
            r = mx.FLIP_R * mx.EPS32 * (np.sqrt(lsq) + np.abs(a))
            ak = mx._round(a + pick(a.shape) * r, act)
            res += wt * (mx.group_quantize(ak)[0] @ a2m.T)
        err = np.abs(res - out)
        assert (err <= (q[0] + q[1]) * (1 + 1e-9) + 1e-12 * np.abs(out).max()).all()
        assert err.max() > 0  # the perturbation moved codes


def test_fp8_spec_inputs_separate_neighbouring_blocks_and_groups():
    """wfmt fp8w / fp8: every weight's codes and block scales; neighbouring blocks' scales (rows and columns) 10-100x
    apart, x's 128-column groups (fp8) too; the golden reads BlockFP8 weights."""
    from kernel_parity.conformance.ops.moe_experts import EXPERTS, dense_weight, fp8_weight

    p = dict(t=6, d=384, f=256, e=3, k=2, shared=1, wfmt="fp8")
    x = EXPERTS.make_inputs(p, "bf16", "normal", np.random.default_rng(2))
    assert "w13" not in x and x["w13_codes"].dtype == ml_dtypes.float8_e4m3fn
    assert x["w13_bscales"].shape == (3, 4, 3) and x["w2_bscales"].shape == (3, 3, 2) and x["ws2_codes"].shape[0] == 1
    for name in ("w13", "w2", "ws13", "ws2"):
        sc = fp8_weight(x, name)["scales"].astype(np.float64)
        assert (np.abs(np.log10(sc[:, 1:] / sc[:, :-1])) > 0.5).all()  # row blocks
        assert (np.abs(np.log10(sc[:, :, 1:] / sc[:, :, :-1])) > 0.5).all()  # column blocks
        assert isinstance(dense_weight(x, name), mx.BlockFP8)
    amax = np.abs(x["x"].astype(np.float64)).reshape(6, 3, 128).max(axis=-1)
    assert (np.abs(np.log10(amax[:, 1:] / amax[:, :-1])) > 0.5).all()
    with pytest.raises(Exception, match="multiples of the block 128"):
        from kernel_parity.conformance import ops
        ops.make_case("moe.experts", "cpu", "bf16", dict(p, f=192), "normal", 0)


def test_torch_dequantizes_fp8_as_the_golden_within_one_fp32_rounding():
    from kernel_parity.conformance.ops.moe_experts import EXPERTS, fp8_weight
    from kernel_parity.kernels.torch.moe_experts import dequant_fp8, group_quant_fp8

    x = EXPERTS.make_inputs(dict(t=4, d=256, f=128, e=2, k=1, shared=0, wfmt="fp8w"), "fp32", "normal",
                            np.random.default_rng(0))
    q = fp8_weight(x, "w13")
    tq = {n: torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn) if n == "codes" else torch.from_numpy(v)
          for n, v in q.items()}
    want = mx.BlockFP8(q["codes"], q["scales"])[1]
    np.testing.assert_allclose(dequant_fp8(tq, 1, torch.float32).numpy(), want, rtol=2.0 ** -24, atol=0)
    v = np.random.default_rng(1).standard_normal((3, 300)).astype(np.float32) * 5
    np.testing.assert_allclose(group_quant_fp8(torch.from_numpy(v)).numpy(), mx.group_quantize(v)[0], rtol=2.0 ** -24,
                               atol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_kernels_refuse_bad_fp8_arguments_in_one_line(backend):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()
    x, ids, w, b13, b2, _ = _fp8_layer(0, t=3, d=128, f=128, e=2, k=1, dtype=np.float32)
    args = [np.ascontiguousarray(x, dtype=np.float32), ids, np.ascontiguousarray(w, dtype=np.float32)]
    w13 = {"codes": b13.codes, "scales": b13.scales}
    w2 = {"codes": b2.codes, "scales": b2.scales}
    if backend == "cpu":
        from kernel_parity.kernels.cpu.moe_experts import experts
    else:
        import importlib
        experts = importlib.import_module(f"kernel_parity.kernels.{backend}.moe_experts").experts
        conv = lambda a: torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn) if a.dtype.itemsize == 1 \
            else torch.from_numpy(a)  # noqa: E731
        args = [torch.from_numpy(a) for a in args]
        w13 = {n: conv(v) for n, v in w13.items()}
        w2 = {n: conv(v) for n, v in w2.items()}
    d13 = np.zeros((2, 256, 128), np.float32) if backend == "cpu" else torch.zeros((2, 256, 128))
    d2 = np.zeros((2, 128, 128), np.float32) if backend == "cpu" else torch.zeros((2, 128, 128))
    for call, match in [(lambda: experts(*args, w13, {**w2, "scales": w2["scales"][:, :, :0]}), r"scales'\] must be"),
                        (lambda: experts(*args, w13, w2, act_fp8=1), "act_fp8 must be a bool"),
                        (lambda: experts(*args, d13, d2, act_fp8=True), r"act_fp8 \(w8a8\) needs block-FP8"),
                        (lambda: experts(*args, w13, d2), "share one format"),
                        (lambda: experts(*args, w13, w2, ws13=w13, ws2={"codes": w2["codes"]}), "must be a dict of")]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_model_size_layers_draw_each_expert_from_its_own_stream_whatever_the_threads(monkeypatch):
    """conformance/ops/moe_experts.on_experts: from SPAWN_MIN weight elements each expert's weights come from its own
    child stream (rng.spawn), drawn on threads, the same values on 1 or 2 threads; below it (every ci case) from the
    case's generator in expert order, as before."""
    from kernel_parity.conformance.ops import moe_experts as spec_mod

    p = dict(t=4, d=32, f=16, e=4, k=2, shared=0, wfmt="dense")
    spec = spec_mod.SPECS[0]

    def draw() -> dict:
        return spec.make_inputs(p, "bf16", "normal", np.random.Generator(np.random.PCG64(7)))

    small = draw()
    monkeypatch.setattr(spec_mod, "SPAWN_MIN", 0)
    runs = []
    for n in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", n)
        runs.append(draw())
    for name in ("w13", "w2"):
        assert np.array_equal(runs[0][name].view(np.uint16), runs[1][name].view(np.uint16))
        assert not np.array_equal(runs[0][name].view(np.uint16), small[name].view(np.uint16))
    scales = [float(np.asarray(runs[0]["w13"][i], np.float64).std()) for i in range(4)]
    assert all(a / b > 3 or b / a > 3 for a, b in zip(scales, scales[1:]))  # experts still differ in magnitude
