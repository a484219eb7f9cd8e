"""The fused blocks' backward goldens (refimpl/blocks.py `mlp_backward`, `attention_prefill_backward`)
against central differences of the forward goldens and against torch autograd, both in float64.

- Central differences: the loss L = sum(dout out) of the forward golden differentiated along random
  directions of every differentiable input (x, gamma, the weights, the biases, the residual) by the
  fourth-order stencil, against <gradient, direction>. Directions are scaled to each input's own size
  (each row's, for x; sqrt(eps) for an all-zero row, the scale at which RMSNorm bends).
- torch autograd in float64 through an independent torch forward of each block (RMSNorm over the real
  lanes, the projections, SwiGLU, RoPE by index arithmetic, the causal GQA attention over history and
  chunk with the new rows' padding cleared): every final gradient and every intermediate gradient (the
  stages), held to tolerance.GOLDEN_SELF_CHECK.
- A quantized block's gradients are those of the float32 block holding its dequantized weights (L1).
The cases come from the op specs' own input builders (the cotangent's padding lanes are zero).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kernel_parity.refimpl.blocks as ref
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.ops.blocks_params import weights_of
from kernel_parity.conformance.runner import Prepared
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.refimpl import quant

torch = pytest.importorskip("torch")
F = torch.nn.functional

# The stencil's truncation ~ (step / scale)^4 = 1e-12 of sum |gradient x direction| at a step of 1e-3 of
# the input's scale, held at 1e-7 (a VJP that drops a term passes only if that term is below 1e-7 of the
# others), plus the loss's own rounding, ~eps64 sum |dout out| per evaluation over the 18 / 12 step.
FD_STEP = 1e-3
FD_RTOL = 1e-7
FD_ROUND = 64 * np.finfo(np.float64).eps

MLP_CASES = [  # params, dist
    (dict(t=3, e=60, epad=4, i=40, w1="f32", w2="f32", eps="1e-6", gemma=0), "normal"),
    (dict(t=1, e=32, epad=0, i=16, w1="f32", w2="f32", eps="1", gemma=1), "normal"),
    (dict(t=4, e=48, epad=2, i=24, w1="f32", w2="f32", eps="1e-5", gemma=0), "rows"),
    (dict(t=5, e=40, epad=0, i=32, w1="f32", w2="f32", eps="1e-6", gemma=1), "tiny"),
]
ATTN = dict(cap=40, theta=10000, eps="1e-6")
ATTENTION_CASES = [
    (dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=5, start=20, wqkv="f32", wo="f32", bias=1, obias=1, residual=1,
          style="half", gemma=0, **ATTN), "normal"),
    (dict(e=32, epad=0, hq=2, hkv=2, d=16, dpad=0, t=7, start=0, wqkv="f32", wo="f32", bias=0, obias=0, residual=0,
          style="interleaved", gemma=1, **ATTN), "normal"),
    (dict(e=40, epad=0, hq=6, hkv=1, d=8, dpad=2, t=3, start=9, wqkv="f32", wo="f32", bias=1, obias=0, residual=1,
          style="interleaved", gemma=0, **ATTN), "heads"),
    (dict(e=64, epad=0, hq=4, hkv=4, d=30, dpad=2, t=2, start=33, wqkv="f32", wo="f32", bias=0, obias=1, residual=0,
          style="half", gemma=1, **ATTN), "tiny"),
]


def _close(got, want, what):
    cmp = compare(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), get_dtype("fp64"),
                  GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


def _prepared(op: str, p: dict, dist: str, seed: int = 3):
    case = ops.make_case(op, "cpu", "fp32", p, dist, seed)
    return case, Prepared(ops.get(op), case)


def _grads(op: str, x: dict, p: dict) -> dict:
    """Every gradient of the golden (the weight gradients included, whatever the spec's outputs)."""
    if op == "blocks.mlp_backward":
        return ref.mlp_backward(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"), x["dout"],
                                n=p["e"], gemma=bool(p["gemma"]))
    kw = dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x.get("bq"), bk=x.get("bk"), bv=x.get("bv"),
              bo=x.get("bo"), residual=x.get("r"), style=p["style"], gemma=bool(p["gemma"]))
    return ref.attention_prefill_backward(x["x"], x["gamma"], float(p["eps"]),
                                          *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"], x["v_cache"],
                                          x["cos"], x["sin"], p["start"], x["dout"], **kw)


def _forward_out(op: str, x: dict, p: dict) -> np.ndarray:
    if op == "blocks.mlp_backward":
        return ref.mlp(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"), n=p["e"],
                       gemma=bool(p["gemma"]))["out"]
    return ref.attention_prefill(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"),
                                 x["k_cache"], x["v_cache"], x["cos"], x["sin"], p["start"], n=p["e"], h_q=p["hq"],
                                 h_kv=p["hkv"], d=p["d"], bq=x.get("bq"), bk=x.get("bk"), bv=x.get("bv"),
                                 bo=x.get("bo"), residual=x.get("r"), style=p["style"], gemma=bool(p["gemma"]))["out"]


GRAD_OF = {"dx": "x", "dgamma": "gamma", "dw1": "w1", "dw2": "w2", "dwq": "wq", "dwk": "wk", "dwv": "wv", "dwo": "wo",
           "dbq": "bq", "dbk": "bk", "dbv": "bv", "dbo": "bo", "dr": "r"}


@pytest.mark.parametrize("op, p, dist", [("blocks.mlp_backward", p, d) for p, d in MLP_CASES]
                         + [("blocks.attention_prefill_backward", p, d) for p, d in ATTENTION_CASES])
def test_golden_against_central_differences(op, p, dist):
    case, prep = _prepared(op, p, dist)
    x = prep.inputs64
    grads = _grads(op, x, p)
    rng = np.random.default_rng(11)

    def loss(inputs):
        return x["dout"] * _forward_out(op, inputs, p)

    for gname, name in GRAD_OF.items():
        if gname not in grads:
            continue
        g = grads[gname]
        base = x[name]
        scale = np.sqrt(np.mean(base ** 2, axis=-1, keepdims=True)) if name == "x" else np.sqrt(np.mean(base ** 2))
        scale = np.where(scale > 0, scale, math.sqrt(float(p["eps"])))  # a zero row: the size eps gives it
        for k in range(2):
            v = rng.standard_normal(base.shape) * scale

            def at(eps):
                return float(np.sum(loss({**x, name: base + eps * v})))

            fd = (-at(2 * FD_STEP) + 8 * at(FD_STEP) - 8 * at(-FD_STEP) + at(-2 * FD_STEP)) / (12 * FD_STEP)
            an = float(np.sum(g * v))
            bound = FD_RTOL * float(np.sum(np.abs(g * v))) + FD_ROUND * float(np.sum(np.abs(loss(x)))) / FD_STEP
            assert abs(fd - an) <= bound, f"{case.id}: {gname} along direction {k}: differences {fd!r}, VJP {an!r}"


# -- torch autograd, float64 -------------------------------------------------------------------------------
def _t(a, grad: bool = True):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _rms_norm(x, gamma, eps, n, gemma):
    real = x[:, :n]
    rstd = torch.rsqrt(real.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = real * rstd * ((1.0 + gamma[:n]) if gemma else gamma[:n])
    return torch.cat([y, torch.zeros(x.shape[0], x.shape[1] - n, dtype=x.dtype)], dim=-1)


def _rope(x, cos, sin, pos, d, style):
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # t, 1, d/2
    if style == "half":
        a, b = x[..., : d // 2], x[..., d // 2: d]
        rot = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = x[..., 0:d:2], x[..., 1:d:2]
        rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(*x.shape[:-1], d)
    return torch.cat([rot, x[..., d:]], dim=-1)


def _torch_mlp(x, p, t):
    i = p["i"]
    norm = _rms_norm(t["x"], t["gamma"], float(p["eps"]), p["e"], p["gemma"])
    h = norm @ t["w1"].T
    act = F.silu(h[:, :i]) * h[:, i:]
    out = t["x"] + act @ t["w2"].T
    return out, {"dnorm": norm, "dh": h, "dact": act}


def _torch_attention(x, p, t):
    tt, ad, hq, hkv, d, start = p["t"], p["d"] + p["dpad"], p["hq"], p["hkv"], p["d"], p["start"]
    norm = _rms_norm(t["x"], t["gamma"], float(p["eps"]), p["e"], p["gemma"])
    q, k, v = (norm @ t[w].T + (t[b] if b in t else 0.0) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    q, k, v = q.reshape(tt, hq, ad), k.reshape(tt, hkv, ad), v.reshape(tt, hkv, ad)
    cos, sin = torch.tensor(x["cos"]), torch.tensor(x["sin"])
    pos = torch.arange(start, start + tt)
    q_rope, k_rope = _rope(q, cos, sin, pos, d, p["style"]), _rope(k, cos, sin, pos, d, p["style"])
    real = (torch.arange(ad) < d).to(torch.float64)
    keys = torch.cat([torch.tensor(x["k_cache"][:, :start]).transpose(0, 1), k_rope * real])  # live, hkv, ad
    vals = torch.cat([torch.tensor(x["v_cache"][:, :start]).transpose(0, 1), v * real])
    group = hq // hkv
    kq, vq = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)  # head h reads h // group
    s = torch.einsum("thc,jhc->htj", q_rope, kq) / math.sqrt(d)
    visible = torch.arange(start + tt)[None, :] <= (start + torch.arange(tt))[:, None]  # bottom-right causal
    s = s.masked_fill(~visible[None], float("-inf"))
    attn = torch.einsum("htj,jhc->thc", torch.softmax(s, dim=-1), vq)
    out = attn.reshape(tt, hq * ad) @ t["wo"].T
    if "bo" in t:
        out = out + t["bo"]
    if "r" in t:
        out = out + t["r"]
    return out, {"dattn": attn, "dq_rope": q_rope, "dk_rope": k_rope, "dv": v, "dq": q, "dk": k, "dnorm": norm}


@pytest.mark.parametrize("op, p, dist", [("blocks.mlp_backward", p, d) for p, d in MLP_CASES]
                         + [("blocks.attention_prefill_backward", p, d) for p, d in ATTENTION_CASES])
def test_golden_against_torch_autograd(op, p, dist):
    case, prep = _prepared(op, p, dist)
    x = prep.inputs64
    grads = _grads(op, x, p)
    t = {name: _t(x[name]) for gname, name in GRAD_OF.items() if gname in grads}
    out, stages = (_torch_mlp if op == "blocks.mlp_backward" else _torch_attention)(x, p, t)
    for s in stages.values():
        s.retain_grad()
    out.backward(torch.tensor(x["dout"]))
    for gname, name in GRAD_OF.items():
        if gname in grads:
            _close(grads[gname], t[name].grad.numpy(), f"{case.id}: {gname}")
    for sname, tensor in stages.items():
        _close(grads[sname], tensor.grad.numpy(), f"{case.id}: stage {sname}")


@pytest.mark.parametrize("op, p, quantized", [
    ("blocks.mlp_backward", dict(t=3, e=60, epad=4, i=64, w1="q8_0", w2="q5_0", eps="1e-6", gemma=0), ("w1", "w2")),
    ("blocks.mlp_backward", dict(t=2, e=256, epad=0, i=256, w1="q4_k", w2="q6_k", eps="1e-5", gemma=1), ("w1", "w2")),
    ("blocks.attention_prefill_backward",
     dict(e=60, epad=4, hq=4, hkv=2, d=24, dpad=8, t=5, start=20, wqkv="q8_0", wo="q5_0", bias=1, obias=1, residual=1,
          style="half", gemma=0, **ATTN), ("wq", "wk", "wv", "wo")),
])
def test_quantized_block_gradients_are_those_of_its_dequantized_weights(op, p, quantized):
    case, prep = _prepared(op, p, "normal")
    x = dict(prep.inputs64)
    got = _grads(op, x, p)
    plain = {**p, **{("wqkv" if w in ("wq", "wk", "wv") else w): "f32" for w in quantized}}
    for w in quantized:
        x[w] = quant.dequantize(p["wqkv" if w in ("wq", "wk", "wv") else w], x[w])
    want = _grads(op, x, plain)
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{case.id}: {name}")
