"""The backward of the fused MoE experts layer, eager torch autograd in the model dtype (the `moe.experts_backward`
op's eager baseline).

    experts_backward(x, ids, weights, w13, w2, dout, *, ws13=None, ws2=None, out=None) -> {name: tensor}

torch.autograd through Hugging Face's Mixtral sparse block (kernels/torch/moe_experts.py's loop, written out here:
the routing weights cast to the model dtype, each chosen expert's tokens gathered, gate and up from one matmul,
silu(gate) * up, the down matmul, times the routing weight, index_add into a zero output; the shared experts'
MLP added last), x, the routing weights and each chosen expert's w13[e], w2[e] (and the shared experts') leaves;
out.backward(dout). Every op and its backward run in x's dtype (dense weights only): the weighted cotangent, dact,
silu's backward, dgate, dup, each slot's dx and the weight gradients round to it; dweights and the weight
gradients are then widened to fp32 (the outputs' dtype), an expert no token chose gets zeros. act is rounded
to the model dtype as the golden's (refimpl/moe_experts_grad.py); the other roundings are this baseline's own,
judged in its tier (conformance/ops/moe_experts_grad.py).
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.cpu.moe_experts_grad import check_backward_args, grad_shapes


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    f = w13.shape[0] // 2
    h = x @ w13.t()
    g = h[:, :f]
    return (g * torch.sigmoid(g) * h[:, f:]) @ w2.t()


def _leaf(a: torch.Tensor) -> torch.Tensor:
    return a.detach().clone().requires_grad_(True)


def experts_backward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     dout: torch.Tensor, *, ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None,
                     out: dict | None = None) -> dict[str, torch.Tensor]:
    """{"dx", "dweights", "dw13", "dw2"} (and "dws13", "dws2"): autograd of the eager loop (module docstring)."""
    t, d, e, f, k, s, fs = check_backward_args(x, ids, weights, w13, w2, dout, ws13, ws2)
    named = {"x": x, "dout": dout, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if s else {})}
    for name, a in named.items():
        if not isinstance(a, torch.Tensor) or a.dtype != x.dtype or not a.dtype.is_floating_point:
            raise ValueError(f"moe.experts_backward: {name} must be a float tensor of x's dtype "
                             f"{getattr(x, 'dtype', None)}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("moe.experts_backward: ids must be an int32 / int64 tensor")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32:
        raise ValueError("moe.experts_backward: weights must be a float32 tensor")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"moe.experts_backward: ids must be in [0, E={e})")
    given = dict(out or {})
    res = {}
    for name, shape in grad_shapes(t, d, e, f, k, s, fs).items():
        want = x.dtype if name == "dx" else torch.float32
        a = given.pop(name, None)
        if a is not None and (not isinstance(a, torch.Tensor) or tuple(a.shape) != shape or a.dtype != want):
            raise ValueError(f"moe.experts_backward: out[{name!r}] must be a {want} tensor of shape {shape}")
        res[name] = torch.empty(shape, dtype=want, device=x.device) if a is None else a
    if given:
        raise ValueError(f"moe.experts_backward: no output named {sorted(given)} (outputs: {', '.join(res)})")
    xl, wl = _leaf(x), _leaf(weights)
    y = torch.zeros_like(x)
    rw = wl.to(x.dtype)
    mask = torch.nn.functional.one_hot(ids.long(), num_classes=e).permute(2, 1, 0)  # E, k, T (HF's expert_mask)
    hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten().tolist()
    leaves = {}
    for expert in hit:
        slot, tok = torch.where(mask[expert])
        l13, l2 = leaves[expert] = (_leaf(w13[expert]), _leaf(w2[expert]))
        ye = _mlp(xl[tok], l13, l2) * rw[tok, slot, None]
        y = y.index_add(0, tok, ye)
    shared = [(_leaf(ws13[j]), _leaf(ws2[j])) for j in range(s)]
    for l13, l2 in shared:
        y = y + _mlp(xl, l13, l2)
    if t:
        y.backward(dout)
    res["dx"].copy_(xl.grad if xl.grad is not None else torch.zeros_like(x))
    res["dweights"].copy_(wl.grad if wl.grad is not None else torch.zeros_like(weights))
    for name in ("dw13", "dw2"):
        res[name].zero_()  # the experts no token chose
    for expert, (l13, l2) in leaves.items():
        res["dw13"][expert].copy_(l13.grad)
        res["dw2"][expert].copy_(l2.grad)
    for j, (l13, l2) in enumerate(shared):
        res["dws13"][j].copy_(l13.grad if l13.grad is not None else torch.zeros_like(l13))
        res["dws2"][j].copy_(l2.grad if l2.grad is not None else torch.zeros_like(l2))
    return res
