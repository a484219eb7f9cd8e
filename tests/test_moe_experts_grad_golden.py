"""The MoE experts backward golden (refimpl/moe_experts_grad.py) against float64 torch autograd through a plain
transcription of Hugging Face's Mixtral sparse block (shared experts added), through a per-token loop with act
rounded (the declared straight-through rule), repeated ids; the error model's magnitudes; refusals; the spec's
inputs and outputs (dout, dtypes, the experts `skew` leaves empty) and the kernels' argument checks (one-line
ValueErrors)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import moe_experts_grad as mg

torch = pytest.importorskip("torch")


def _layer(seed=0, t=11, d=40, f=24, e=6, k=3, s=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (t, d))
    ids = np.argsort(rng.random((t, e)), axis=-1)[:, :k].astype(np.int32)
    w = rng.uniform(0.05, 1, (t, k))
    w13 = rng.normal(0, d ** -0.5, (e, 2 * f, d))
    w2 = rng.normal(0, f ** -0.5, (e, d, f))
    sh = dict(ws13=rng.normal(0, d ** -0.5, (s, 2 * f, d)), ws2=rng.normal(0, f ** -0.5, (s, d, f))) if s else {}
    return x, ids, w, w13, w2, sh, rng.normal(0, 1, (t, d))


def _autograd(x, ids, w, w13, w2, dout, ws13=None, ws2=None):
    """float64 autograd of transformers' MixtralSparseMoeBlock loop (w1 = gate, w3 = up), shared experts added."""
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in
              dict(x=x, w=w, w13=w13, w2=w2, **({"ws13": ws13, "ws2": ws2} if ws13 is not None else {})).items()}
    X, W = leaves["x"], leaves["w"]
    E, F2, _ = w13.shape
    out = torch.zeros_like(X)
    mask = torch.nn.functional.one_hot(torch.from_numpy(ids).long(), num_classes=E).permute(2, 1, 0)

    def mlp(a, g13, g2):
        h = a @ g13.T
        return (torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]) @ g2.T

    for e in range(E):
        idx, top_x = torch.where(mask[e])
        out = out.index_add(0, top_x, mlp(X[top_x], leaves["w13"][e], leaves["w2"][e]) * W[top_x, idx, None])
    for s in range(0 if ws13 is None else ws13.shape[0]):
        out = out + mlp(X, leaves["ws13"][s], leaves["ws2"][s])
    out.backward(torch.from_numpy(dout))
    names = {"x": "dx", "w": "dweights", "w13": "dw13", "w2": "dw2", "ws13": "dws13", "ws2": "dws2"}
    return {names[n]: v.grad.numpy() for n, v in leaves.items()}


@pytest.mark.parametrize("t,d,f,e,k,s", [(11, 40, 24, 6, 3, 0), (1, 16, 8, 1, 1, 0), (17, 32, 48, 8, 2, 1),
                                         (5, 24, 16, 4, 4, 2)])
def test_matches_float64_autograd_of_the_hf_mixtral_loop(t, d, f, e, k, s):
    x, ids, w, w13, w2, sh, dout = _layer(t, t, d, f, e, k, s)
    got = mg.experts_backward(x, ids, w, w13, w2, dout, **sh)
    want = _autograd(x, ids, w, w13, w2, dout, **sh)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-11, atol=1e-12 * np.abs(want[name]).max(),
                                   err_msg=name)


@pytest.mark.parametrize("act", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_per_token_definition_with_act_rounded_and_repeated_ids(act):
    """Per token and slot, act rounded to act_dtype where y, dweights and dW2 read it, the chain rule through it as
    the identity; an expert repeated in a token (each slot counts)."""
    x, ids, w, w13, w2, _, dout = _layer(3, s=0)
    ids[0, 1] = ids[0, 0]
    got = mg.experts_backward(x, ids, w, w13, w2, dout, act_dtype=act)
    f = w13.shape[1] // 2
    dx, dwt = np.zeros_like(x), np.zeros_like(w)
    dw13, dw2 = np.zeros_like(w13), np.zeros_like(w2)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = w13[e] @ x[t]
            g, u = h[:f], h[f:]
            s = 1 / (1 + np.exp(-g))
            act_r = (g * s * u).astype(act).astype(np.float64)
            d0 = w2[e].T @ dout[t]
            dwt[t, j] = dout[t] @ (w2[e] @ act_r)
            dh = np.concatenate([w[t, j] * d0 * u * s * (1 + g * (1 - s)), w[t, j] * d0 * g * s])
            dx[t] += w13[e].T @ dh
            dw13[e] += np.outer(dh, x[t])
            dw2[e] += np.outer(w[t, j] * dout[t], act_r)
    for name, want in (("dx", dx), ("dweights", dwt), ("dw13", dw13), ("dw2", dw2)):
        np.testing.assert_allclose(got[name], want, rtol=1e-10, atol=1e-12 * np.abs(want).max(), err_msg=name)


def test_magnitude_bounds_the_terms():
    """M >= the RSS of each output's terms where the sums are plain products of exact factors: dW2's (w dout_d
    act_r,f over the slots) and dweights' (act_r dact0 over F)."""
    x, ids, w, w13, w2, sh, dout = _layer(5, s=1)
    m = mg.experts_backward(x, ids, w, w13, w2, dout, act_dtype=np.float16, absolute=True, **sh)
    f = w13.shape[1] // 2
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        h = x[t] @ w13[e].T
        g, u = h[:, :f], h[:, f:]
        act_r = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float64)
        rss = np.sqrt(((w[t, j, None] * dout[t]) ** 2).T @ act_r ** 2)
        assert np.all(m["dw2"][e] >= rss * (1 - 1e-12))
        terms = np.sqrt(np.sum((act_r * (dout[t] @ w2[e])) ** 2, axis=1))
        assert np.all(m["dweights"][t, j] >= terms * (1 - 1e-12))
    assert set(m) == {"dx", "dweights", "dw13", "dw2", "dws13", "dws2"}
    assert all(np.all(np.isfinite(v)) and np.all(v >= 0) for v in m.values())


@pytest.mark.parametrize("change,match", [
    (dict(dout=np.zeros((11, 39))), "dout must have x's shape"),
    (dict(ids=np.full((11, 3), 6, np.int32)), r"ids must be in \[0, E=6\)"),
    (dict(w2=np.zeros((6, 40, 23))), "w2 must be"),
])
def test_refusals(change, match):
    x, ids, w, w13, w2, _, dout = _layer()
    a = {**dict(x=x, ids=ids, weights=w, w13=w13, w2=w2, dout=dout), **change}
    with pytest.raises(ValueError, match=match):
        mg.experts_backward(a["x"], a["ids"], a["weights"], a["w13"], a["w2"], a["dout"])


def test_spec_inputs_outputs_and_empty_experts():
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.ops.moe_experts_grad import EXPERTS_BACKWARD as spec

    assert ops.get("moe.experts_backward") is spec
    p = dict(t=30, d=64, f=32, e=9, k=2, shared=1)
    x = spec.make_inputs(p, "bf16", "skew", np.random.default_rng(1))
    assert x["dout"].dtype == ml_dtypes.bfloat16 and x["dout"].shape == (30, 64) and "w13_qweight" not in x
    assert x["ids"].max() < 3  # experts 3 .. 8 get no token
    g = spec.reference({k: (v if v.dtype.kind in "iu" or k in spec.storage_inputs else v.astype(np.float64))
                        for k, v in x.items()}, p)
    assert set(g) == set(spec.output_shapes(p)) == {"dx", "dweights", "dw13", "dw2", "dws13", "dws2"}
    assert np.all(g["dw13"][3:] == 0) and np.all(g["dw2"][3:] == 0) and np.all(np.abs(g["dw2"][:3]) > 0)
    assert spec.out_dtype("dw13", "bf16").name == "fp32" and spec.tol_dtype("dw13", "bf16").name == "bf16"
    assert spec.out_dtype("dx", "bf16").name == "bf16"


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_kernels_refuse_bad_arguments_in_one_line(backend):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 kept (not monkeypatched) before triton's first import
    x, ids, w, w13, w2, _, dout = _layer()
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    args = [f32(x), ids, f32(w), f32(w13), f32(w2), f32(dout)]
    if backend == "cpu":
        from kernel_parity.kernels.cpu.moe_experts_grad import experts_backward as kernel
    else:
        import importlib
        kernel = importlib.import_module(f"kernel_parity.kernels.{backend}.moe_experts_grad").experts_backward
        args = [torch.from_numpy(a) for a in args]
    bad_ids = args[1] * 0 + 6
    for call, match in [(lambda: kernel(args[0], bad_ids, *args[2:]), r"ids must be in \[0, E=6\)"),
                        (lambda: kernel(*args[:5], args[5][:, :3]), "dout must have x's shape"),
                        (lambda: kernel(*args[:3], args[3][:, :47], *args[4:]), "w13 must be"),
                        (lambda: kernel(*args, ws13=args[3][:1]), "ws13 and ws2"),
                        (lambda: kernel(*args[:3], {"qweight": args[3]}, *args[4:]), "must be dense"),
                        (lambda: kernel(*args, out={"dw9": args[0]}), "no output named")]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_goldens_on_threads_give_the_bits_of_one_thread(monkeypatch):
    """refimpl.moe_experts.experts and experts_backward take their experts on threads (refimpl/threads.py) and sum
    them in expert order: the same bits with one thread as with four (outputs, magnitudes, block-FP8 weights)."""
    from kernel_parity.refimpl.moe_experts import BlockFP8, experts
    from kernel_parity.refimpl.moe_experts_grad import experts_backward
    from kernel_parity.refimpl.quant_fp import fp8_quantize_blocks

    rng = np.random.default_rng(3)
    t, d, f, e, k = 40, 128, 128, 8, 3
    x, dout = rng.standard_normal((t, d)), rng.standard_normal((t, d))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    w = rng.random((t, k))
    w13, w2 = rng.standard_normal((e, 2 * f, d)), rng.standard_normal((e, d, f))
    ws13, ws2 = rng.standard_normal((1, 2 * f, d)), rng.standard_normal((1, d, f))
    parts = [fp8_quantize_blocks(w13[i], 128, 128) for i in range(e)]
    f8 = BlockFP8(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))

    def run() -> list[np.ndarray]:
        outs = [experts(x, ids, w, w13, w2, ws13=ws13, ws2=ws2, absolute=a) for a in (False, True)]
        outs.append(experts(x, ids, w, f8, w2, act_quant="e4m3"))
        outs.append(experts(x, ids, w, f8, w2, act_quant="e4m3", flip_bound=True))
        for a in (False, True):
            g = experts_backward(x, ids, w, w13, w2, dout, ws13=ws13, ws2=ws2, absolute=a)
            outs += [g[n] for n in sorted(g)]
        return outs

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = run()
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    four = run()
    assert len(one) == len(four) == 16
    for a, b in zip(one, four):
        assert np.array_equal(a, b)
