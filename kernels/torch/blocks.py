"""Eager fused transformer blocks in the activations' dtype, stage by stage (the `blocks` family's
same-precision baseline).

    norm -> q, k, v (+ bias) -> RoPE -> cache write -> attention -> W_o (+ bias) (+ residual)
    norm -> gate/up (+ b1) -> silu(gate) * up -> down (+ b2) -> + x;   outproj: attn @ W_o (+ bias) + residual,
    then the MLP (w1's halves aI rows each, I of them real: act's lanes [I, aI) zero, W2 read over [0, I))

What a PyTorch model runs without fused kernels: every weight dequantized to the activations' dtype
(kernels/torch/gemm.py), every stage a separate torch op rounding to that dtype, no activation
quantization (this baseline is held to the `dequant`, L1, reference). Conventions as refimpl/blocks.py:
aligned rows (RMSNorm over the n real lanes, padding lanes zero), aligned heads (a cached row's lanes
[d, a_d) cleared, dot products over a_d, scale 1/sqrt(d)), head-major caches (h_kv, cap, a_d) written
in place at start .. start + T - 1, bottom-right causal attention over history + chunk, GQA query head
h reading kv head h // (h_q / h_kv), W_o flat (aE, h_q a_d) or per head (h_q, aE, a_d) ("f32_heads").
A weight is a (format, tensor) pair: "f32" (N, K) floats or GGML blocks (N, K / block * nbytes) uint8.
"""

from __future__ import annotations

import math

import torch

from kernel_parity.kernels.torch import attention as tattn
from kernel_parity.kernels.torch import gemm as tgemm

Weight = tuple[str, torch.Tensor]


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, n: int, gemma: bool) -> torch.Tensor:
    """x (..., aE) -> y (..., aE): the mean of squares over lanes [0, n), padding lanes zero."""
    real = x[..., :n]
    rstd = torch.rsqrt(real.pow(2).mean(dim=-1, keepdim=True) + eps)
    g = gamma[:n].to(x.dtype)
    y = torch.zeros_like(x)
    y[..., :n] = real * rstd * ((1.0 + g) if gemma else g)
    return y


def project(a: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ W^T (+ bias) in a's dtype, the weight dequantized first."""
    fmt, data = w
    if fmt == "f32_heads":  # Wo[h][aE][a_d], summed over heads, the bias once
        h, n, ad = data.shape
        c = torch.einsum("thj,hnj->tn", a.view(a.shape[0], h, ad), data.to(a.dtype))
        return c if bias is None else c + bias.to(a.dtype)
    return tgemm.gemm_nt(a, fmt, {"w": data}, bias)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, d: int,
         style: str) -> torch.Tensor:
    """x (t, h, a_d): the first d lanes rotated at each token's position; the rest unchanged."""
    c = cos[positions][:, None, :].to(x.dtype)  # t, 1, d/2
    s = sin[positions][:, None, :].to(x.dtype)
    out = x.clone()
    if style == "interleaved":
        a, b = x[..., 0:d:2], x[..., 1:d:2]
        out[..., 0:d:2], out[..., 1:d:2] = a * c - b * s, a * s + b * c
    elif style == "half":
        a, b = x[..., : d // 2], x[..., d // 2: d]
        out[..., : d // 2], out[..., d // 2: d] = a * c - b * s, a * s + b * c
    else:
        raise ValueError(f"unknown rope style {style!r} (interleaved, half)")
    return out


def write_cache(cache: torch.Tensor, rows: torch.Tensor, start: int, d: int) -> None:
    """cache (h_kv, cap, a_d)[:, start + t] = rows (T, h_kv, a_d)[t] with lanes [d, a_d) cleared, in place."""
    t = rows.shape[0]
    cache[:, start:start + t, :d] = rows[..., :d].transpose(0, 1).to(cache.dtype)
    cache[:, start:start + t, d:] = 0


def qkv_sections(wq: Weight, bq: torch.Tensor | None, h_q: int, h_kv: int,
                 ad: int) -> tuple:
    """The seed's one W_qkv ((h_q + 2 h_kv) a_d rows: q heads, then k, then v) and b_qkv as three sections (views)."""
    fmt, data = wq
    off, rows = (0, h_q * ad, (h_q + h_kv) * ad), (h_q * ad, h_kv * ad, h_kv * ad)  # each section's first row, rows
    if data.shape[0] != sum(rows):
        raise ValueError(f"W_qkv must have (h_q + 2 h_kv) a_d = {sum(rows)} rows, got {tuple(data.shape)}")
    ws = tuple((fmt, data[o:o + r]) for o, r in zip(off, rows))
    bs = (None,) * 3 if bq is None else tuple(bq[o:o + r] for o, r in zip(off, rows))
    return (*ws, *bs)


class _SavedProbs(torch.autograd.Function):
    """O = P V with the forward's softmax probabilities P given (seed audit S9: the saved scores), and a backward
    that reads that P instead of a softmax's own: dP = dO V^T, D = rowsum(P dP), dS = P (dP - D), dq = scale
    dS K, dk = scale dS^T Q, dv = P^T dO (the group's query heads summed). q (T, h_q, a_d); k, v (live, h_kv,
    a_d); p (h_q, T, live), 0 on the masked slots."""

    @staticmethod
    def forward(ctx, q, k, v, p, scale):
        g = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # live, h_q, a_d
        ctx.save_for_backward(q, ke, ve, p)
        ctx.scale, ctx.g = scale, g
        return torch.einsum("htj,jhd->thd", p, ve)

    @staticmethod
    def backward(ctx, do):
        q, ke, ve, p = ctx.saved_tensors
        dp = torch.einsum("thd,jhd->htj", do, ve)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq = ctx.scale * torch.einsum("htj,jhd->thd", ds, ke)
        dk = ctx.scale * torch.einsum("htj,thd->jhd", ds, q)
        dv = torch.einsum("htj,thd->jhd", p, do)
        live, hq, ad = dk.shape
        return (dq, dk.view(live, hq // ctx.g, ctx.g, ad).sum(dim=2), dv.view(live, hq // ctx.g, ctx.g, ad).sum(dim=2),
                None, None)


def attention_prefill(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight,
                      wo: Weight, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      start: int, *, n: int, h_q: int, h_kv: int, d: int, bq: torch.Tensor | None = None,
                      bk: torch.Tensor | None = None, bv: torch.Tensor | None = None, bo: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None, style: str = "half",
                      gemma: bool = False, rope_off: int = 0, qkv: str = "separate",
                      probs: bool = False, probs_in: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """x (T, aE) in cache slots start .. start + T - 1, rotated at positions rope_off + slot; the caches
    (h_kv, cap, a_d) are written in place. qkv="fused": wq is the seed's W_qkv, bq b_qkv (wk, wv, bk, bv None).

    returns {"norm", "q", "k", "v", "q_rope", "k_rope", "attn", "out"} (refimpl.blocks.attention_prefill's
    shapes; the caches are the arguments themselves); probs: also "p" (h_q, T, start + T), the attention's
    softmax probabilities (0 on the masked slots); probs_in: the forward's P (h_q, T, ctx >= start + T), used in
    place of the softmax, forward and backward (`_SavedProbs`)."""
    t = x.shape[0]
    ad = k_cache.shape[-1]
    if qkv == "fused":
        wq, wk, wv, bq, bk, bv = qkv_sections(wq, bq, h_q, h_kv, ad)
    nrm = rms_norm(x, gamma, eps, n, gemma)
    q = project(nrm, wq, bq).view(t, h_q, ad)
    k = project(nrm, wk, bk).view(t, h_kv, ad)
    v = project(nrm, wv, bv).view(t, h_kv, ad)
    pos = torch.arange(start, start + t, device=x.device)
    rpos = pos + rope_off  # RoPE's positions; the cache slots are pos
    q_rope, k_rope = rope(q, cos, sin, rpos, d, style), rope(k, cos, sin, rpos, d, style)
    write_cache(k_cache, k_rope, start, d)
    write_cache(v_cache, v, start, d)
    live = start + t
    if probs_in is not None:
        p = probs_in[None, :, :, :live].to(x.dtype)
        attn = _SavedProbs.apply(q_rope, k_cache[:, :live].transpose(0, 1), v_cache[:, :live].transpose(0, 1), p[0],
                                 1.0 / math.sqrt(d))
    else:
        o, _, p = tattn.attention(q_rope[None], k_cache[:, :live].transpose(0, 1)[None],
                                  v_cache[:, :live].transpose(0, 1)[None], scale=1.0 / math.sqrt(d),
                                  causal="bottom_right", probs=True)
        attn = o[0]
    out = project(attn.reshape(t, h_q * ad), wo, bo)
    if residual is not None:
        out = out + residual
    res = {"norm": nrm, "q": q, "k": k, "v": v, "q_rope": q_rope, "k_rope": k_rope, "attn": attn, "out": out}
    return {**res, "p": p[0]} if probs else res


def attention_decode(x: torch.Tensor, *args, residual: torch.Tensor | None = None, **kw) -> dict[str, torch.Tensor]:
    """One token x (aE,) at position `start` (the 12th positional argument): `attention_prefill` with T = 1."""
    res = attention_prefill(x[None], *args, residual=None if residual is None else residual[None], **kw)
    return {k: v[0] for k, v in res.items()}


def mlp(x: torch.Tensor, gamma: torch.Tensor, eps: float, w1: Weight, w2: Weight, *, n: int,
        b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, inter: int | None = None,
        gemma: bool = False) -> dict[str, torch.Tensor]:
    """x (T, aE) -> {"norm", "h" (T, 2aI), "act" (T, aI), "down", "out" = x + down}; w1's gate half first (aI rows),
    I = inter real lanes of each half (None: aI): act's lanes [I, aI) zero, the down projection over [0, I)."""
    nrm = rms_norm(x, gamma, eps, n, gemma)
    h = project(nrm, w1, b1)
    ai = h.shape[-1] // 2
    i = ai if inter is None else inter
    if i == ai:
        act = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        down = project(act, w2, b2)
    else:  # the padding never enters act or the down projection (W2 dequantized, its real columns)
        real = torch.nn.functional.silu(h[:, :i]) * h[:, ai:ai + i]
        act = torch.cat([real, real.new_zeros((real.shape[0], ai - i))], dim=-1)
        fmt, data = w2
        w = data if fmt == "f32" else tgemm.dequantize_weight(fmt, {"w": data}, x.dtype, ai)
        down = act[:, :i] @ w[:, :i].to(x.dtype).T
        if b2 is not None:
            down = down + b2.to(x.dtype)
    return {"norm": nrm, "h": h, "act": act, "down": down, "out": x + down}


def outproj_mlp(attn: torch.Tensor, residual: torch.Tensor, wo: Weight, gamma: torch.Tensor, eps: float, w1: Weight,
                w2: Weight, *, n: int, bo: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, inter: int | None = None, gemma: bool = False,
                attn_layout: str = "token_major") -> dict[str, torch.Tensor]:
    """attn (T, h_q a_d), or (h_q, T, a_d) with attn_layout="head_major" (the seed's [h, T, a_d]: token t's row
    is its heads' rows in order) -> {"proj", "h1" = proj + residual, then `mlp` on h1}."""
    if attn_layout == "head_major":
        h, t, ad = attn.shape
        attn = attn.transpose(0, 1).reshape(t, h * ad)
    elif attn_layout != "token_major":
        raise ValueError(f"attn_layout={attn_layout!r}: expected 'token_major' or 'head_major'")
    proj = project(attn, wo, bo)
    h1 = proj + residual
    return {"proj": proj, "h1": h1, **mlp(h1, gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma)}


def layer(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
          k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
          gamma2: torch.Tensor, w1: Weight, w2: Weight, *, n: int, h_q: int, h_kv: int, d: int,
          bq: torch.Tensor | None = None, bk: torch.Tensor | None = None, bv: torch.Tensor | None = None,
          bo: torch.Tensor | None = None, style: str = "half", gemma: bool = False,
          scores_ctx: int = 0, scores_in: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A whole layer (seed audit S9): `attention_prefill` (its output pre before the residual), h1 = pre + x,
    then `mlp` on h1 (gamma2). returns the attention's stages ("out" left out), "h1", "norm2", "h", "act", "down",
    "out"; scores_ctx > 0: also "scores" (h_q, T, scores_ctx), the attention's own P, lanes past start + T zero;
    scores_in: the forward's saved P (h_q, T, ctx), which the attention uses instead of its softmax, forward and
    backward (the whole layer's backward with the saved scores, S9)."""
    a = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q, h_kv=h_kv,
                          d=d, bq=bq, bk=bk, bv=bv, bo=bo, style=style, gemma=gemma, probs=scores_ctx > 0,
                          probs_in=scores_in)
    pre = a.pop("out")  # attn W_o^T (+ bo): the attention block before its residual
    h1 = pre + x
    m = mlp(h1, gamma2, eps, w1, w2, n=n, gemma=gemma)
    res = {**{k: v for k, v in a.items() if k != "p"}, "h1": h1, "norm2": m["norm"],
           **{k: m[k] for k in ("h", "act", "down", "out")}}
    if scores_ctx:
        p = a["p"]
        res["scores"] = torch.nn.functional.pad(p, (0, scores_ctx - p.shape[-1]))
    return res
