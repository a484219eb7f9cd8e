"""torch.nn.functional.scaled_dot_product_attention as third-party backends, one per SDPA backend.

Registered through the `kernel_parity.backends` entry point like any outside plugin:
`sdpa-cpu` (whatever SDPA picks on the CPU), and on a CUDA GPU `sdpa-math`, `sdpa-flash`,
`sdpa-efficient`, `sdpa-cudnn`, each forced with `torch.nn.attention.sdpa_kernel`. These are
real kernels nobody here wrote: `supports()` states what each can express, so the report shows
where they pass, where they are unsupported (with the reason) and where they are wrong.

What SDPA can express: scale, GQA (`enable_gqa`), top-left causal (`is_causal`), other masks as
a boolean `attn_mask`, bottom-right causal through `causal_lower_right`. It has no softcap, no
sinks, no LSE output in its public API (LSE is reported as not provided), no varlen, paged or
split-KV input, and no per-sequence cache lengths: a mask still reads the slots past a
sequence's length, which the decode cases poison with NaN, so ragged decode is unsupported and
full-length decode passes the cache up to its length.

`attention.prefill_backward` is SDPA's own backward (autograd through the same call: math, flash,
efficient or cuDNN backward kernels) for the cotangent dO; SDPA recomputes its forward and takes
no LSE cotangent, so the cases with `dlse=1` are unsupported (a skip saying so), as are softcap and
sinks; varlen_backward has no SDPA form.

Capabilities per backend (torch 2.11 on an H200, research/attention-semantics.md §7, and
sdp_utils.cpp): flash fp16/bf16, head dim <= 256 and a multiple of 8, GQA, no explicit mask
except causal_lower_right, is_causal only when s_q == s_k; efficient fp32/fp16/bf16, masks, no
GQA; cuDNN fp16/bf16, head dim <= 256, GQA, masks; math anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kernel_parity.conformance.backends import Backend, NotProvided
from kernel_parity.conformance.backends._torch import autograd_timed, cuda_available, to_torch, torch_available
from kernel_parity.conformance.ops.attention_inputs import value_dim

OPS = ("attention.prefill", "attention.decode", "attention.prefill_backward")
UNSUPPORTED_OPS = {
    "attention.varlen": "SDPA has no variable-length (cu_seqlens) input",
    "attention.varlen_backward": "SDPA has no variable-length (cu_seqlens) input",
    "attention.decode_paged": "SDPA has no paged KV-cache input",
    "attention.decode_split": "SDPA returns no split-KV partial states",
}


@dataclass
class SdpaBackend(Backend):
    kind: str = "math"  # torch.nn.attention.SDPBackend member name, or "default"
    half_only: bool = False
    max_d: int | None = None
    d_multiple: int = 1
    gqa: bool = True
    masks: bool = True  # explicit boolean masks
    same_dv: bool = False  # v's head dim must equal q's (flash: "No available kernel" otherwise)
    caveats: list[str] = field(default_factory=list)

    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        if self.device == "cuda" and not cuda_available():
            return f"{self.name} needs a CUDA GPU"
        return None

    def supports(self, case: Any) -> str | None:
        if case.op in UNSUPPORTED_OPS:
            return UNSUPPORTED_OPS[case.op]
        if case.op not in OPS:
            return f"{self.name} has no kernel for {case.op}"
        p = case.p
        if self.half_only and case.dtype == "fp32":
            return f"{self.kind} SDPA runs fp16/bf16 only"
        if self.max_d and p["d"] > self.max_d:
            return f"{self.kind} SDPA supports head dim <= {self.max_d}, got d={p['d']}"
        if p["d"] % self.d_multiple:
            return f"{self.kind} SDPA needs a head dim that is a multiple of {self.d_multiple}, got d={p['d']}"
        if self.same_dv and value_dim(p) != p["d"]:
            return f"{self.kind} SDPA needs v's head dim equal to q's, got d={p['d']}, d_v={value_dim(p)}"
        if p["cap"]:
            return "SDPA has no logit softcap"
        if p["sink"]:
            return "SDPA has no attention sinks"
        if p.get("dlse"):
            return "SDPA returns no LSE, so its backward takes no LSE cotangent (dlse)"
        if p["hq"] != p["hkv"] and not self.gqa:
            return f"{self.kind} SDPA has no GQA (enable_gqa) on this torch"
        if p.get("rows", 0):
            return "SDPA has no cache_loc input (TensorRT-LLM's cache-row indirection, rows > 0)"
        if case.op == "attention.decode" and p["lens"] != "full":
            return "SDPA has no per-sequence cache lengths: a mask still reads the NaN-poisoned slots past seqlen"
        mask = _mask_kind(case)
        if mask == "bool" and not self.masks:
            return f"{self.kind} SDPA takes no explicit mask (needed for {_why_mask(case)})"
        if mask == "top_left_nonsquare" and not self.masks:
            return f"{self.kind} SDPA refuses is_causal when s_q != s_k"
        return None

    def run(self, case: Any, inputs: dict, out: Any) -> dict:
        if case.op == "attention.prefill_backward":
            return self._backward(case, inputs, out)
        dev = self.device
        q = to_torch(inputs["q"], dev)
        if case.op == "attention.decode":
            n = int(inputs["seqlens"].max(initial=0))
            k, v = to_torch(inputs["k_cache"], dev)[:, :n], to_torch(inputs["v_cache"], dev)[:, :n]
        else:
            k, v = to_torch(inputs["k"], dev), to_torch(inputs["v"], dev)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (b, h, s, d) views
        o = self._sdpa(case, qt, kt, vt).transpose(1, 2)
        buf = out.torch("o", dev)
        buf.copy_(o)
        return {"o": buf, "lse": NotProvided("the public SDPA API returns no LSE")}

    def _sdpa(self, case: Any, qt: Any, kt: Any, vt: Any) -> Any:
        """SDPA on (b, h, s, d) views with the case's scale, GQA and mask, in this backend's kernel."""
        import torch.nn.functional as F

        p = case.p
        kw: dict[str, Any] = dict(scale=1.0 / math.sqrt(p["d"]), enable_gqa=p["hq"] != p["hkv"])
        kind = _mask_kind(case)
        s_q, s_k = qt.shape[2], kt.shape[2]
        if kind in ("causal_square", "top_left_nonsquare"):
            kw["is_causal"] = True
        elif kind == "bottom_right_nonsquare" and not self.masks:
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(s_q, s_k)
        elif kind in ("bool", "bottom_right_nonsquare"):
            kw["attn_mask"] = _bool_mask(case, s_q, s_k, qt.device)
        with _kernel_ctx(self.kind):
            return F.scaled_dot_product_attention(qt, kt, vt, **kw)

    def _backward(self, case: Any, inputs: dict, out: Any) -> dict:
        """dq, dk, dv by autograd through SDPA (its own backward kernel: math, flash, efficient or
        cuDNN), for the cotangent dO; the given O and LSE are not used (SDPA recomputes its own)."""
        import torch

        dev = self.device
        leaves = [to_torch(inputs[n], dev).detach().requires_grad_(True) for n in ("q", "k", "v")]
        do = to_torch(inputs["do"], dev)
        with torch.enable_grad(), _kernel_ctx(self.kind):
            o = self._sdpa(case, *(t.transpose(1, 2) for t in leaves)).transpose(1, 2)
            grads = torch.autograd.grad(o, leaves, do)
        bufs = {n: out.torch(n, dev) for n in ("dq", "dk", "dv")}
        for buf, g in zip(bufs.values(), grads):
            buf.copy_(g)
        return bufs


def _mask_kind(case: Any) -> str:
    p = case.p
    s_q = p["sq"]
    s_k = p.get("sk", p.get("kv"))
    windowed = p["wl"] >= 0 or (p["causal"] == "none" and p["wr"] >= 0)
    if windowed:
        return "bool"
    if p["causal"] == "none":
        return "none"
    if s_q == s_k:
        return "causal_square"
    return "top_left_nonsquare" if p["causal"] == "top_left" else "bottom_right_nonsquare"


def _why_mask(case: Any) -> str:
    return "a sliding window" if case.p["wl"] >= 0 or case.p["wr"] >= 0 else "the causal alignment"


def _bool_mask(case: Any, s_q: int, s_k: int, dev: Any) -> Any:
    import torch

    from kernel_parity.kernels.torch.attention import keep_mask

    b = case.p["b"]
    keep = keep_mask(s_q, s_k, torch.full((b,), s_q, device=dev), torch.full((b,), s_k, device=dev),
                     case.p["causal"], (case.p["wl"], case.p["wr"]))
    return keep[:, None]  # b, 1, s_q, s_k: broadcast over heads


def _kernel_ctx(kind: str) -> Any:
    import contextlib

    if kind == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, kind))


def _make(name: str, device: str, kind: str, **caps: Any) -> SdpaBackend:
    b = SdpaBackend(name=name, device=device, dtypes=("fp32", "fp16", "bf16"),
                    ops={op: None for op in OPS}, kind=kind, doc=f"torch SDPA ({kind}) on {device}", **caps)
    # parity bench times SDPA's backward alone, as it times ours: the forward runs once, untimed
    b.timed["attention.prefill_backward"] = autograd_timed(
        b._backward, "SDPA's backward alone: its forward ran once, untimed (autograd.grad, retain_graph)")
    return b


CPU = _make("sdpa-cpu", "cpu", "default")
MATH = _make("sdpa-math", "cuda", "MATH")
FLASH = _make("sdpa-flash", "cuda", "FLASH_ATTENTION", half_only=True, max_d=256, d_multiple=8, masks=False,
              same_dv=True)
EFFICIENT = _make("sdpa-efficient", "cuda", "EFFICIENT_ATTENTION", d_multiple=8, gqa=False)
CUDNN = _make("sdpa-cudnn", "cuda", "CUDNN_ATTENTION", half_only=True, max_d=256, d_multiple=8)
