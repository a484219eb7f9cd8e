"""Self-tests of refimpl/blocks.py: the composed golden against a literal, step-by-step float64
computation written here from the formulas (loops over tokens, heads and keys; no refimpl function but
the GGML weight decoder), for both references.

L2 (`emulated`) is written in its closed form: the activation row rounded to float32, quantized by the
textbook Q8_0 (d = amax / 127 stored as fp16, codes round(x / d) half away from zero with the unrounded
d) or Q8_K (iscale = -127 / (the signed value of largest |x|), codes nearest-even of iscale x capped at
127, d = 1 / iscale in fp32) rule, dequantized, times the dequantized weights: the integer block sums of
the golden and this product are the same real number, so they differ by float64 reassociation only.
"""

import math

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import quant

# float64 reassociation over a few hundred terms, relative to each output's scale
REL = 1e-11
K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def _q8_0(row: np.ndarray) -> np.ndarray:
    """The dequantized Q8_0 row of float32(row), literally."""
    x = row.astype(np.float32).astype(np.float64).reshape(-1, 32)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        d = float(np.float32(np.max(np.abs(x[b])) / np.float32(127.0)))
        inv = float(np.float32(1.0) / np.float32(d)) if d else 0.0
        for i in range(32):
            v = float(np.float32(x[b, i] * inv))
            c = math.floor(abs(v) + 0.5) * (1 if v >= 0 else -1)  # roundf: half away from zero
            out[b, i] = c * float(np.float16(d))
    return out.reshape(-1)


def _q8_k(row: np.ndarray) -> np.ndarray:
    """The dequantized Q8_K row of float32(row), literally."""
    x = row.astype(np.float32).reshape(-1, 256)
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        j = int(np.argmax(np.abs(x[b])))  # the first of the largest |x|
        if x[b, j] == 0:
            continue
        iscale = np.float32(-127.0) / x[b, j]
        for i in range(256):
            c = min(127, int(np.rint(np.float32(iscale * x[b, i]))))  # nearest_int: half to even
            out[b, i] = c * float(np.float32(1.0) / iscale)
    return out.reshape(-1)


def _act(row: np.ndarray, fmt: str, emulated: bool) -> np.ndarray:
    if not emulated or fmt in ("f32", "f32_heads"):
        return row
    return _q8_k(row) if fmt in K_QUANTS else _q8_0(row)


def _w(fmt: str, data: np.ndarray) -> np.ndarray:
    return np.asarray(data, dtype=np.float64) if fmt == "f32" else quant.dequantize(fmt, data)


def _linear(a: np.ndarray, fmt: str, data: np.ndarray, bias, emulated: bool) -> np.ndarray:
    w = _w(fmt, data)
    out = np.array([_act(r, fmt, emulated) @ w.T for r in np.atleast_2d(a)])
    return out + bias if bias is not None else out


def _rms(x: np.ndarray, gamma: np.ndarray, eps: float, n: int, gemma: bool) -> np.ndarray:
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        r = 1.0 / math.sqrt(sum(v * v for v in x[t, :n]) / n + eps)
        for i in range(n):
            y[t, i] = x[t, i] * r * ((1.0 + gamma[i]) if gemma else gamma[i])
    return y


def _rope(v: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: int, d: int, style: str) -> np.ndarray:
    out = v.copy()
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + d // 2)
        out[a] = v[a] * cos[pos, i] - v[b] * sin[pos, i]
        out[b] = v[a] * sin[pos, i] + v[b] * cos[pos, i]
    return out


def literal_attention(x: dict, p: dict, emulated: bool) -> dict:
    t, s, hq, hkv, d = p["t"], p["start"], p["hq"], p["hkv"], p["d"]
    ad = d + p["dpad"]
    nrm = _rms(x["x"], x["gamma"], float(p["eps"]), p["e"], bool(p["gemma"]))
    q = _linear(nrm, p["wqkv"], x["wq"], x.get("bq"), emulated).reshape(t, hq, ad)
    k = _linear(nrm, p["wqkv"], x["wk"], x.get("bk"), emulated).reshape(t, hkv, ad)
    v = _linear(nrm, p["wqkv"], x["wv"], x.get("bv"), emulated).reshape(t, hkv, ad)
    q_rope = np.array([[_rope(q[i, h], x["cos"], x["sin"], s + i, d, p["style"]) for h in range(hq)] for i in range(t)])
    k_rope = np.array([[_rope(k[i, g], x["cos"], x["sin"], s + i, d, p["style"]) for g in range(hkv)] for i in range(t)])
    kc, vc = x["k_cache"].copy(), x["v_cache"].copy()
    for i in range(t):
        for g in range(hkv):
            kc[g, s + i] = np.concatenate([k_rope[i, g, :d], np.zeros(ad - d)])
            vc[g, s + i] = np.concatenate([v[i, g, :d], np.zeros(ad - d)])
    attn = np.zeros((t, hq, ad))
    for i in range(t):
        for h in range(hq):
            g = h // (hq // hkv)
            scores = [sum(q_rope[i, h, c] * kc[g, j, c] for c in range(ad)) / math.sqrt(d) for j in range(s + i + 1)]
            m = max(scores)
            w = [math.exp(sc - m) for sc in scores]
            attn[i, h] = sum(wj * vc[g, j] for j, wj in enumerate(w)) / sum(w)
    out = _linear(attn.reshape(t, hq * ad), p["wo"], x["wo"], x.get("bo"), emulated)
    if "r" in x:
        out = out + x["r"]
    return {"norm": nrm, "q": q, "k": k, "v": v, "q_rope": q_rope, "k_rope": k_rope, "attn": attn, "k_cache": kc,
            "v_cache": vc, "out": out}


def literal_mlp(xin: np.ndarray, x: dict, p: dict, emulated: bool) -> dict:
    i = p["i"]
    nrm = _rms(xin, x["gamma"], float(p["eps"]), p["e"], bool(p["gemma"]))
    h = _linear(nrm, p["w1"], x["w1"], None, emulated)
    act = np.array([[h[t, j] / (1.0 + math.exp(-h[t, j])) * h[t, i + j] for j in range(i)] for t in range(h.shape[0])])
    down = _linear(act, p["w2"], x["w2"], None, emulated)
    return {"norm": nrm, "h": h, "act": act, "down": down, "out": xin + down}


def _compare(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        g = np.asarray(got[name], dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what} {name}: NaN positions differ"
        fin = ~np.isnan(w)
        scale = max(np.max(np.abs(w[fin]), initial=0.0), 1e-300)
        err = np.max(np.abs(g[fin] - w[fin]), initial=0.0)
        assert err <= REL * scale, f"{what} {name}: max |golden - literal| = {err:.3g} > {REL:g} x max {scale:.3g}"


PREFILL = [
    dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=3, start=5, cap=9, wqkv="q8_0", wo="q8_0", bias=1, obias=1,
         residual=1, style="half", theta=10000, eps="1e-6", gemma=0),
    dict(e=32, epad=0, hq=3, hkv=1, d=10, dpad=22, t=2, start=0, cap=2, wqkv="q5_0", wo="q5_0", bias=0, obias=0,
         residual=0, style="interleaved", theta=500000, eps="1", gemma=1),
    dict(e=20, epad=0, hq=2, hkv=2, d=8, dpad=0, t=4, start=2, cap=7, wqkv="f32", wo="f32", bias=1, obias=1,
         residual=1, style="interleaved", theta=10000, eps="1e-5", gemma=0),
]


@pytest.mark.parametrize("reference", ["dequant", "emulated"])
@pytest.mark.parametrize("dist", ["normal", "heads", "pads"])
@pytest.mark.parametrize("params", PREFILL, ids=lambda p: f"{p['wqkv']}-{p['style']}")
def test_attention_prefill_golden_is_the_literal_computation(params, dist, reference):
    case = ops.make_case("blocks.attention_prefill", "cpu", "fp32", params, dist, 3)
    prep = Prepared(ops.get(case.op), case)
    want = literal_attention(prep.inputs64, case.p, reference == "emulated")
    _compare(prep.references[reference], want, f"{case.id} [{reference}]")


def test_attention_decode_golden_is_prefill_of_one_token():
    p = dict(PREFILL[0], pos=7, cap=9)
    del p["t"], p["start"]
    case = ops.make_case("blocks.attention_decode", "cpu", "fp32", p, "normal", 1)
    prep = Prepared(ops.get(case.op), case)
    x = dict(prep.inputs64)
    x["x"], x["r"] = x["x"][None], x["r"][None]
    want = literal_attention(x, dict(case.p, t=1, start=7), True)
    got = {k: (v if k in ("k_cache", "v_cache") else v[None]) for k, v in prep.references["emulated"].items()}
    _compare(got, want, case.id)


MLP = [
    dict(t=2, e=250, epad=6, i=256, w1="q4_k", w2="q6_k", eps="1e-6", gemma=0),
    dict(t=3, e=60, epad=4, i=64, w1="q5_0", w2="q8_0", eps="1", gemma=1),
    dict(t=1, e=16, epad=0, i=8, w1="f32", w2="f32", eps="1e-5", gemma=0),
]


@pytest.mark.parametrize("reference", ["dequant", "emulated"])
@pytest.mark.parametrize("params", MLP, ids=lambda p: f"{p['w1']}-{p['w2']}")
def test_mlp_golden_is_the_literal_computation(params, reference):
    case = ops.make_case("blocks.mlp", "cpu", "fp32", params, "blocks", 5)
    prep = Prepared(ops.get(case.op), case)
    x = prep.inputs64
    _compare(prep.references[reference], literal_mlp(x["x"], x, case.p, reference == "emulated"),
             f"{case.id} [{reference}]")


@pytest.mark.parametrize("reference", ["dequant", "emulated"])
@pytest.mark.parametrize("layout,wo", [("head_major", "f32"), ("flat", "q8_0"), ("flat", "f32")])
def test_outproj_mlp_golden_is_the_literal_computation(layout, wo, reference):
    p = dict(t=2, e=60, epad=4, hq=3, d=24, dpad=8, wo=wo, wo_layout=layout, obias=1, i=32, w1="q8_0", w2="q5_0",
             eps="1e-6", gemma=0)
    case = ops.make_case("blocks.outproj_mlp", "cpu", "fp32", p, "rows", 2)
    prep = Prepared(ops.get(case.op), case)
    x, emulated = prep.inputs64, reference == "emulated"
    if layout == "head_major":  # sum over heads h of attn_h . Wo[h][n], the bias once
        hq, ae, ad = x["wo"].shape
        proj = np.array([[sum(x["attn"][t, h * ad:(h + 1) * ad] @ x["wo"][h, n] for h in range(hq)) + x["bo"][n]
                          for n in range(ae)] for t in range(p["t"])])
    else:
        proj = _linear(x["attn"], wo, x["wo"], x["bo"], emulated)
    h1 = proj + x["residual"]
    want = {"proj": proj, "h1": h1, **literal_mlp(h1, x, case.p, emulated)}
    _compare(prep.references[reference], want, f"{case.id} [{reference}]")


def test_emulated_differs_from_dequant_by_the_activation_quantization():
    """L1 != L2 on a quantized block (the distance is the activation quantization error, ~1e-3 of the
    scale), L1 == L2 on fp32 weights (nothing is quantized)."""
    for wqkv, same in (("q8_0", False), ("f32", True)):
        p = dict(PREFILL[0], wqkv=wqkv, wo=wqkv)
        prep = Prepared(ops.get("blocks.attention_prefill"),
                        ops.make_case("blocks.attention_prefill", "cpu", "fp32", p, "normal", 0))
        l1, l2 = prep.references["dequant"]["out"], prep.references["emulated"]["out"]
        rel = np.max(np.abs(l1 - l2)) / np.max(np.abs(l1))
        assert (rel == 0.0) if same else (1e-5 < rel < 5e-2), f"{wqkv}: L1 vs L2 relative distance {rel:.3g}"
