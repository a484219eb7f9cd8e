"""torch._grouped_mm as a third-party backend `grouped-mm`: the MoE experts layer (`moe.experts`) through torch's
grouped GEMM (CUTLASS on Hopper; an eager fallback in CPU builds), bf16.

The token slots are sorted by expert (a stable sort: torch ops), each expert's rows one group of the GEMM
(`offs`: the groups' cumulative row ends, int32; an expert with no token is an empty group), then

    h13 = _grouped_mm(x[slots], w13^T, offs)   (T k, 2F) bf16   (fp32 accumulation, one rounding: as vLLM's
                                                                 intermediate cache1)
    act = bf16(silu(gate) * up)                                  (in fp32 from the bf16 gate / up)
    y   = _grouped_mm(act, w2^T, offs)         (T k, D) bf16
    out = bf16(sum_j weights[t, j] y[t, j] + shared experts)     (the sum and the shared experts in fp32)

This is the composition a serving engine without a fused MoE kernel runs (vLLM's unfused path writes the same bf16
intermediates), judged at the production tier like ours. Registered through the `kernel_parity.backends` entry
point like any plugin; it runs where torch has `_grouped_mm` (torch >= 2.8; CUDA needs compute capability 9.0).
"""

from __future__ import annotations

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, to_torch

OP = "moe.experts"


def _grouped(a, w, offs):
    """a (rows, K) @ w[g] (K, N) for each group g of rows ending at offs[g]."""
    import torch

    return torch._grouped_mm(a, w, offs=offs)


def _swiglu(h):
    import torch

    f = h.shape[-1] // 2
    g, u = h[..., :f].float(), h[..., f:].float()
    return (torch.nn.functional.silu(g) * u).to(h.dtype)


def experts(x, ids, weights, w13, w2, ws13=None, ws2=None):
    """torch tensors on one device (module docstring): out (T, D) in x's dtype."""
    import torch

    t, k = ids.shape
    e = w13.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    rows = order // k
    act = _swiglu(_grouped(x[rows], w13.transpose(1, 2), offs))
    y = _grouped(act, w2.transpose(1, 2), offs)
    acc = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    acc.index_add_(0, rows, y.float() * weights.reshape(-1)[order].float()[:, None])
    if ws13 is not None:
        for s in range(ws13.shape[0]):
            hs = _swiglu(x @ ws13[s].t())
            acc += (hs @ ws2[s].t()).float()
    return acc.to(x.dtype)


def _run(case, inputs, out, device):
    ts = {n: to_torch(a, device) for n, a in inputs.items()}
    o = out.torch("out", device)
    o.copy_(experts(ts["x"], ts["ids"], ts["weights"], ts["w13"], ts["w2"], ts.get("ws13"), ts.get("ws2")))
    return {"out": o}


class GroupedMmBackend(Backend):
    def available(self) -> str | None:
        import torch

        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no _grouped_mm (torch >= 2.8)"
        if self.device == "cuda":
            if not cuda_available():
                return "no CUDA GPU"
            major, _ = torch.cuda.get_device_capability()
            if major < 9:
                return "torch._grouped_mm's CUDA kernel needs compute capability >= 9.0"
        return None

    def supports(self, case) -> str | None:
        why = super().supports(case)
        if why:
            return why
        p = case.p
        if p.get("wfmt", "dense") != "dense":
            return f"torch._grouped_mm multiplies bf16 operands; {p['wfmt']} weights are not dense"
        if p["d"] % 8 or p["f"] % 8:
            return f"torch._grouped_mm needs 16-byte aligned rows: d and f multiples of 8 (d={p['d']}, f={p['f']})"
        return None


def make() -> GroupedMmBackend:
    device = "cuda" if cuda_available() else "cpu"
    return GroupedMmBackend(name="grouped-mm", device=device, dtypes=("bf16",),
                            ops={OP: lambda case, inputs, out: _run(case, inputs, out, device)},
                            doc="torch._grouped_mm: the MoE experts layer as two grouped GEMMs (bf16) around an eager "
                                "SwiGLU, the weighted sum in fp32")


GROUPED_MM = make
