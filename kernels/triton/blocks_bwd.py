"""The fused blocks' whole-layer backward composed of our Triton backward kernels, stage by stage.

    mlp:        dact = dout W2 (gemm_bwd) -> dh = SwiGLU's (dgate | dup) (mlp.glu_backward_fused) -> dnorm = dh W1
                (gemm_bwd) -> dx, dgamma (norm_backward.rms_norm_backward) -> dx += dout (blocks.add);
                dW2 = dout^T act, dW1 = dh^T norm (gemm_bwd.matmul), db2 = sum dout, db1 = sum dh (gemm_bwd.colsum);
                aI-lane halves with I real lanes: dact's and dh's padding zeroed, SwiGLU's backward
                (mlp.glu_backward) over the real lanes
    attention:  dattn = dout W_o, dW_o, d_bo (gemm_bwd) -> dq_rope, dk, dv over history + chunk
                (attention_bwd.prefill_backward, bottom-right causal, from the saved O and LSE) -> the new
                keys' rows, lanes [d, a_d) zero -> dq, dk (rope.rope_backward) -> dnorm = dq Wq + dk Wk + dv Wv,
                dW, db (gemm_bwd) -> dx, dgamma (norm_backward.rms_norm_backward);  dr = dout
    layer (S9): mlp on h1 -> dh1, attention for dh1, dx += dh1 (blocks.add); no saved scores (P from the LSE)

Conventions as kernels/triton/blocks.py (refimpl/blocks.py; OPS.md, layers and backward): aligned rows and
heads, head-major caches (h_kv, cap, a_d) holding the history (read, never written: the keys and values of
history + chunk are assembled in a buffer of their own, the new rows' lanes [d, a_d) cleared by the forward's
cache-write kernel), GQA query head h reading kv head h // (h_q / h_kv). Weights: "f32" (N, K) or one of
gemm.FORMATS (dequantized in registers, the L1 meaning; no gradient). fp32 throughout; every reduction
accumulates in fp32 (the kernels' own docstrings say where).
Arguments: kernels/cpu/blocks_bwd.py's (the forward's, the saved activations, dout; `lse` (h_q, T) the
attention's natural-log LSE for the attention kernel), as torch tensors; `out` preallocated gradients.
"""

from __future__ import annotations

import math

import torch

from . import attention_bwd, gemm_bwd, norm_backward, rope
from . import mlp as tmlp
from .blocks import add, qkv_sections, write_cache

Weight = tuple[str, torch.Tensor]


def _outputs(out: dict | None, shapes: dict[str, tuple[int, ...]], like: torch.Tensor) -> dict[str, torch.Tensor]:
    out = dict(out or {})
    unknown = set(out) - set(shapes)
    if unknown:
        raise ValueError(f"out names unknown gradient(s) {', '.join(sorted(unknown))} (this call's: {', '.join(shapes)})")
    for name, shape in shapes.items():
        if name not in out:
            out[name] = torch.empty(shape, dtype=torch.float32, device=like.device)
        elif tuple(out[name].shape) != shape or not out[name].is_contiguous():
            raise ValueError(f"out[{name!r}] must be a contiguous {shape} tensor, got {tuple(out[name].shape)}")
    return out


def _linear_backward(w: Weight, x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor | None,
                     db: torch.Tensor | None) -> None:
    """dx = dy W;  dw = dy^T x;  db = the sum of dy's rows (those given)."""
    gemm_bwd.backward_da(dy, w[0], w[1], dx)
    if dw is not None:
        gemm_bwd.matmul(dy.t(), x, dw)
    if db is not None:
        gemm_bwd.colsum(dy, db)


def _norm_backward(x, gamma, rstd, dnorm, n, gemma, o) -> None:
    dgamma = o["dgamma"] if "dgamma" in o else torch.empty_like(gamma)
    norm_backward.rms_norm_backward(x, gamma, rstd, dnorm, n=n, gemma=gemma, out_dx=o["dx"], out_dw=dgamma)


def mlp_backward(x: torch.Tensor, gamma: torch.Tensor, eps: float, w1: Weight, w2: Weight, dout: torch.Tensor, *,
                 norm: torch.Tensor, rstd: torch.Tensor, h: torch.Tensor, act: torch.Tensor, n: int, b1=None,
                 b2=None, inter: int | None = None, gemma: bool = False, weight_grads: bool = True,
                 out: dict | None = None) -> dict[str, torch.Tensor]:
    """The MLP block's backward (module docstring); eps is the forward's (the saved rstd carries it). b1, b2: the
    forward's biases or None (h carries them): their gradients db1, db2 with `weight_grads`."""
    t, ae = x.shape
    ai = h.shape[1] // 2
    i = ai if inter is None else inter
    shapes = {"dact": (t, ai), "dh": (t, 2 * ai), "dnorm": (t, ae), "dx": (t, ae)}
    if weight_grads:
        shapes.update(dgamma=(ae,), dw1=(2 * ai, ae), dw2=(ae, ai))
        shapes.update({f"d{k}": tuple(b.shape) for k, b in (("b1", b1), ("b2", b2)) if b is not None})
    o = _outputs(out, shapes, x)
    _linear_backward(w2, act, dout, o["dact"], o.get("dw2"), o.get("db2"))
    if i == ai:
        tmlp.glu_backward_fused("swiglu", h, o["dact"], out=o["dh"])
    else:  # act's padding lanes were cleared: no gradient reaches them or h's
        o["dact"][:, i:].zero_()
        o["dh"].zero_()
        tmlp.glu_backward("swiglu", h[:, :i], h[:, ai:ai + i], o["dact"][:, :i], out_dgate=o["dh"][:, :i],
                          out_dup=o["dh"][:, ai:ai + i])
    _linear_backward(w1, norm, o["dh"], o["dnorm"], o.get("dw1"), o.get("db1"))
    _norm_backward(x, gamma, rstd, o["dnorm"], n, gemma, o)
    add(o["dx"], dout, o["dx"])  # the residual: out = x + down
    return o


def attention_prefill_backward(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight,
                               wo: Weight, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, start: int, dout: torch.Tensor, *, norm: torch.Tensor,
                               rstd: torch.Tensor, q_rope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                               attn: torch.Tensor, lse: torch.Tensor, n: int, h_q: int, h_kv: int, d: int, bq=None,
                               bk=None, bv=None, bo=None, residual=None, style: str = "half", gemma: bool = False,
                               weight_grads: bool = True, out: dict | None = None, rope_off: int = 0,
                               qkv: str = "separate") -> dict[str, torch.Tensor]:
    """The prefill attention block's backward (module docstring); the caches hold the history. RoPE's transpose at
    the forward's positions rope_off + start + t; qkv="fused": wq is W_qkv, bq b_qkv, and the gradients dwqkv,
    dbqkv (W_qkv's rows) replace dwq, dwk, dwv, dbq, dbk, dbv (written through row-section views)."""
    t, ae = x.shape
    ad = k_cache.shape[-1]
    live = start + t
    fused = qkv == "fused"
    if fused:
        wq, wk, wv, bq, bk, bv = qkv_sections(wq, bq, h_q, h_kv, ad)
    shapes = {"dattn": (t, h_q, ad), "dq_rope": (t, h_q, ad), "dk_rope": (t, h_kv, ad), "dv": (t, h_kv, ad),
              "dq": (t, h_q, ad), "dk": (t, h_kv, ad), "dnorm": (t, ae), "dx": (t, ae)}
    if weight_grads:
        shapes.update(dgamma=(ae,), dwq=(h_q * ad, ae), dwk=(h_kv * ad, ae), dwv=(h_kv * ad, ae),
                      dwo=tuple(wo[1].shape) if wo[0] == "f32_heads" else (ae, h_q * ad))  # per head (S4)
        shapes.update({f"d{b}": tuple(a.shape) for b, a in (("bq", bq), ("bk", bk), ("bv", bv), ("bo", bo))
                       if a is not None})
        if residual is not None:
            shapes["dr"] = (t, ae)
    if weight_grads and fused:
        rows = (h_q + 2 * h_kv) * ad
        for w in ("w", "b"):
            if f"d{w}q" in shapes:
                for k in ("q", "k", "v"):
                    del shapes[f"d{w}{k}"]
                shapes[f"d{w}qkv"] = (rows, ae) if w == "w" else (rows,)
    o = _outputs(out, shapes, x)
    if weight_grads and fused:
        for w in ("w", "b"):
            if f"d{w}qkv" in o:
                _, _, _, *secs = qkv_sections(("f32", o[f"d{w}qkv"]), o[f"d{w}qkv"], h_q, h_kv, ad)
                o.update({f"d{w}{k}": v for k, v in zip("qkv", secs)})
    if "dr" in o:
        o["dr"].copy_(dout)
    if wo[0] == "f32_heads":  # the seed's Wo[h][aE][a_d]: dattn_h = dout Wo[h], dWo[h] = dout^T attn_h, d_bo once
        for h in range(h_q):
            dwo = o.get("dwo")
            _linear_backward(("f32", wo[1][h]), attn[:, h], dout, o["dattn"][:, h], None if dwo is None else dwo[h],
                             o.get("dbo") if h == 0 else None)
    else:
        _linear_backward(wo, attn.view(t, h_q * ad), dout, o["dattn"].view(t, h_q * ad), o.get("dwo"), o.get("dbo"))
    # keys and values of history + chunk in buffers of their own: the caches are inputs (read only)
    kc, vc = k_cache[:, :live].clone(), v_cache[:, :live].clone()
    write_cache(kc, k_rope, start, d)
    write_cache(vc, v, start, d)
    dk_all = torch.empty((1, live, h_kv, ad), dtype=torch.float32, device=x.device)
    dv_all = torch.empty_like(dk_all)
    attention_bwd.prefill_backward(q_rope[None], kc.permute(1, 0, 2)[None], vc.permute(1, 0, 2)[None], attn[None],
                                   lse[None], o["dattn"][None], scale=1.0 / math.sqrt(d), causal="bottom_right",
                                   out_dq=o["dq_rope"][None], out_dk=dk_all, out_dv=dv_all)
    for name, g in (("dk_rope", dk_all), ("dv", dv_all)):  # the new keys' rows; the write cleared [d, a_d)
        o[name].copy_(g[0, start:])
        o[name][..., d:] = 0.0
    pos = torch.arange(rope_off + start, rope_off + live, dtype=torch.int32, device=x.device)
    for src, dst in (("dq_rope", "dq"), ("dk_rope", "dk")):
        rope.rope_backward(o[src], pos, cos=cos, sin=sin, style=style, rot=d, at="first", out=o[dst])
    parts = [torch.empty((t, ae), dtype=torch.float32, device=x.device) for _ in range(2)]
    for (w, dy, dw, db), dst in zip(((wq, o["dq"], "dwq", "dbq"), (wk, o["dk"], "dwk", "dbk"),
                                      (wv, o["dv"], "dwv", "dbv")), (o["dnorm"], *parts)):
        _linear_backward(w, norm, dy.view(t, -1), dst, o.get(dw), o.get(db))
    add(o["dnorm"], parts[0], o["dnorm"])  # dnorm = (dq Wq + dk Wk) + dv Wv
    add(o["dnorm"], parts[1], o["dnorm"])
    _norm_backward(x, gamma, rstd, o["dnorm"], n, gemma, o)
    if fused:
        o = {k: v for k, v in o.items() if k not in ("dwq", "dwk", "dwv", "dbq", "dbk", "dbv")}
    return o


# the MLP block's gradients in layer_backward: mlp_backward's names -> the layer's (refimpl.blocks.LAYER_MLP_GRADS)
LAYER_MLP_GRADS = {"dact": "dact", "dh": "dh", "dnorm": "dnorm2", "dx": "dh1", "dgamma": "dgamma2", "dw1": "dw1",
                   "dw2": "dw2"}


def layer_backward(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                   gamma2: torch.Tensor, w1: Weight, w2: Weight, dout: torch.Tensor, *, norm: torch.Tensor,
                   rstd: torch.Tensor, q_rope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                   attn: torch.Tensor, lse: torch.Tensor, h1: torch.Tensor, norm2: torch.Tensor, rstd2: torch.Tensor,
                   h: torch.Tensor, act: torch.Tensor, n: int, h_q: int, h_kv: int, d: int, bq=None, bk=None, bv=None,
                   bo=None, style: str = "half", gemma: bool = False, attention_grads: bool = True,
                   mlp_grads: bool = True, out: dict | None = None) -> dict[str, torch.Tensor]:
    """The whole layer's backward (seed audit S9): `mlp_backward` on h1 (saved h1, norm2, rstd2, h, act) for dout,
    giving dh1; `attention_prefill_backward` for dh1 (from the saved O and LSE: attention_bwd.prefill_backward
    takes no P, so the saved scores are not an argument); dx = its RMSNorm dx + dh1 (blocks.add). Gradients under
    the layer's names (LAYER_MLP_GRADS for the MLP's)."""
    out = dict(out or {})
    layer_names = {v: k for k, v in LAYER_MLP_GRADS.items()}
    m = mlp_backward(h1, gamma2, eps, w1, w2, dout, norm=norm2, rstd=rstd2, h=h, act=act, n=n, gemma=gemma,
                     weight_grads=mlp_grads, out={layer_names[k]: out.pop(k) for k in list(out) if k in layer_names})
    a = attention_prefill_backward(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, m["dx"],
                                   norm=norm, rstd=rstd, q_rope=q_rope, k_rope=k_rope, v=v, attn=attn, lse=lse, n=n,
                                   h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, style=style, gemma=gemma,
                                   weight_grads=attention_grads, out=out)
    add(a["dx"], m["dx"], a["dx"])  # the attention block's residual: h1 = x + attn W_o^T
    return {**{LAYER_MLP_GRADS[k]: v for k, v in m.items()}, **a}
