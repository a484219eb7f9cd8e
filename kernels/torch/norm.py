"""Eager RMSNorm and LayerNorm with torch's own ops, storage dtype in and out (the noise baseline).

    rms_norm:    y = h / sqrt(mean(h^2) + eps) * g,    h = x (+ r),   g = w or (1 + w)
    layer_norm:  y = (x - mean(x)) / sqrt(var(x) + eps) * w (+ b),    var biased (divides by n)

What a careful PyTorch user writes (conventions: OPS.md, layers; goldens in refimpl/norm.py):
- RMSNorm as Hugging Face's LlamaRMSNorm: upcast to float32, `rsqrt(mean(h^2) + eps)`, round the
  normalised rows to the dtype, then multiply by the weight in the dtype (two roundings of the
  output on purpose: that is the model code). Gemma as GemmaRMSNorm: the whole product
  `h * rstd * (1 + w)` in float32, one rounding.
- The fused residual add as vLLM's RMSNorm.forward_native: h = x + r in float32, returned rounded
  to the dtype (the new residual stream), and the float32 h is what gets normalised.
- LayerNorm written out (no F.layer_norm), in float32 with one rounding of y: the two-pass
  variance, with the float32 mean's own rounding error taken back out (c = x - mean, lo = mean(c),
  var = mean(c^2) - lo^2, y = (c - lo) * rsqrt(var + eps) * w + b). Without `lo`, x - mean carries
  half an ulp of the mean: 3e-5 at |mean| = 1000 (the `shifted` rows), 3x fp32's atol at unit
  variance, and rstd off by 10% on two-lane rows whose lanes nearly agree (measured), which
  no tier of this baseline should have to absorb. The mean returned is torch's own float32 mean
  (mean + lo would add the rounding of the n differences x - mean, measured 10-1000x worse).
Rows are stored in an aligned width aw >= n (C-Kernel-Engine's aligned_embed_dim): the statistics
run over the real lanes [0, n); the caller's output buffer gets zeros in the padding lanes
[n, aw). The input padding lanes are zero by contract, so h = x + r over the aligned width keeps
them zero. rstd and mean are float32 per row.

Backward (`rms_norm_backward`, `layer_norm_backward`): torch autograd on the real lanes (the padding
lanes are constants of the forward: their gradients are written as zeros, and the cotangents'
padding lanes are never read). The statistics are recomputed by the forward, as autograd does; the
saved rstd / mean a fused kernel takes are not used. With the fused residual x and r share one
gradient, which carries the cotangent of h. LayerNorm's graph is the forward above (float32, one
rounding). RMSNorm's is the same math with the weight applied in float32 (torch's own F.rms_norm
form: every product and sum in float32, each gradient rounded once to the dtype at its leaf), not
LlamaRMSNorm's `w * hs.to(dtype)`: autograd of that product rounds every term dy hs of dw to the
dtype before the sum over rows, an error of eps(dtype) / 2 of the terms, and on an outlier channel
the terms are ~10x the column's sum (measured: fp16 dw off by 5 ulp of max|dw|). A fused backward
never rounds those terms; the baseline that judges its noise should not either.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, n: int | None, what: str) -> int:
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be 2-D (rows, aligned width), got shape {tuple(x.shape)}")
    aw = x.shape[-1]
    n = aw if n is None else int(n)
    if not 1 <= n <= aw:
        raise ValueError(f"{what}: real width n={n} must be in [1, {aw}] (x's aligned width)")
    return n


def _into(y: torch.Tensor, out: torch.Tensor | None, like: torch.Tensor, n: int) -> torch.Tensor:
    """y (rows, n) written into the aligned buffer `out` (allocated like `like` when None)."""
    if out is None:
        out = torch.empty_like(like)
    out[:, :n] = y
    out[:, n:] = 0  # the padding lanes of an aligned row are zeros
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, *, n: int | None = None, gemma: bool = False,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x, residual: (rows, aw); w: (>= n,) or None -> (y (rows, aw) in x.dtype, h = x + residual
    (rows, aw) or None, rstd (rows,) float32)."""
    n = _check(x, n, "rms_norm")
    if gemma and w is None:
        raise ValueError("rms_norm: gemma=True needs a weight w (it applies 1 + w)")
    hf = x.float() if residual is None else x.float() + residual.float()  # vLLM forward_native
    hs = hf[:, :n]
    rstd = torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
    hs = hs * rstd
    if w is None:
        y = hs.to(x.dtype)
    elif gemma:
        y = (hs * (1.0 + w[:n].float())).to(x.dtype)  # GemmaRMSNorm: (1 + w) in float32
    else:
        y = w[:n] * hs.to(x.dtype)  # LlamaRMSNorm: rounded, then scaled in the dtype
    return _into(y, out, x, n), (None if residual is None else hf.to(x.dtype)), rstd[:, 0]


def layer_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, *,
               n: int | None = None, out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (rows, aw); w, b: (>= n,) or None -> (y (rows, aw) in x.dtype, mean (rows,), rstd (rows,))."""
    n = _check(x, n, "layer_norm")
    xs = x[:, :n].float()
    mean = xs.mean(-1, keepdim=True)
    xc = xs - mean
    lo = xc.mean(-1, keepdim=True)  # the rounding error of the float32 mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) - lo * lo + eps)
    y = (xc - lo) * rstd
    if w is not None:
        y = y * w[:n].float()
    if b is not None:
        y = y + b[:n].float()
    return _into(y.to(x.dtype), out, x, n), mean[:, 0], rstd[:, 0]


def _leaf(a: torch.Tensor | None, n: int, rows: bool = True) -> torch.Tensor | None:
    """The real lanes of `a` as a fresh autograd leaf (a view's storage untouched)."""
    if a is None:
        return None
    return (a[:, :n] if rows else a[:n]).detach().requires_grad_()


def _weight_grad(g: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[:n] = g
    return out


def rms_norm_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float, *, n: int | None = None,
                      gemma: bool = False, residual: torch.Tensor | None = None, dh: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd of `rms_norm`'s math in float32 (the weight too): x, residual, dy, dh (rows, aw); w (aw,) ->
    (dx (rows, aw), the gradient of x and of r, padding lanes zero; dw (aw,), zeros past n), in x's dtype."""
    n = _check(x, n, "rms_norm_backward")
    if (dh is None) != (residual is None):
        raise ValueError("rms_norm_backward: dh is the cotangent of h = x + residual: give both or neither")
    xl, wl, rl = _leaf(x, n), _leaf(w, n, rows=False), _leaf(residual, n)
    with torch.enable_grad():
        h = xl.float() if rl is None else xl.float() + rl.float()  # float32 graph: F.rms_norm's form
        g = 1.0 + wl.float() if gemma else wl.float()
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g
        outs, cots = [y], [dy[:, :n].float()]
        if rl is not None:
            outs.append(h)
            cots.append(dh[:, :n].float())
        dx, dw = torch.autograd.grad(outs, [xl, wl], cots)  # rounded to x's / w's dtype at the leaves
    return _into(dx, out, x, n), _weight_grad(dw, w, n)


def layer_norm_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor, eps: float, *,
                        n: int | None = None, out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Autograd through `layer_norm`: x, dy (rows, aw); w, b (aw,) -> (dx, dw, db or None), x's dtype."""
    n = _check(x, n, "layer_norm_backward")
    xl, wl, bl = _leaf(x, n), _leaf(w, n, rows=False), _leaf(b, n, rows=False)
    with torch.enable_grad():
        y, _, _ = layer_norm(xl, wl, bl, eps)
        leaves = [xl, wl] + ([bl] if bl is not None else [])
        grads = torch.autograd.grad([y], leaves, [dy[:, :n]])
    db = _weight_grad(grads[2], b, n) if bl is not None else None
    return _into(grads[0], out, x, n), _weight_grad(grads[1], w, n), db
