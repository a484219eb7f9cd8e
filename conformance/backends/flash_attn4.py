"""flash-attn-4 (FlashAttention 4: Tri Dao's CuTe-DSL kernels, `flash_attn.cute`) as a third-party
backend, `fa4`.

Registered through the `kernel_parity.backends` entry point like any outside plugin; installed by
`pip install flash-attn-4` beside the `peers` extra (it runs on nvidia-cutlass-dsl, as quack does;
research/peers-measured.md says how the wheels travel to a machine without internet); runs on a CUDA
GPU (Hopper's sm90 path, Blackwell's sm100). Read against flash-attn-4 4.0.0b36. One call per case:

- attention.prefill: `flash_attn_func(q, k, v, softmax_scale, causal, window_size, learnable_sink,
  softcap, return_lse=True)` on the case's (b, s, h, d) tensors as they are (FlashAttention's own
  layout; GQA by h_q % h_kv, no repeat), scale 1/sqrt(d). Its causal mask and windows are
  bottom-right aligned (key j for query i when i + s_k - s_q - left <= j <= i + s_k - s_q + right),
  OPS.md's convention: causal=bottom_right maps to causal=True (a window's right edge then 0), a
  window (wl, wr) with -1 for unbounded to window_size=(wl or None, wr or None); top_left equals
  bottom_right only when s_q == s_k, so other top_left cases are a skip. softcap = cap.
- attention.prefill_backward: autograd through the same call (FA4's own backward kernels, which
  recompute from their forward's O and LSE; the case's O and LSE are not used) for the cotangents dO
  and, where the case has one, dLSE (FA4's LSE takes a gradient); dsinks is learnable_sink's
  gradient. Judged against the op's `exact` reference (below). A case with both sinks and dLSE is a
  skip: FA4's LSE includes the sink, so its LSE cotangent is not the op's.
- The LSE is FlashAttention's natural-log LSE (b, h_q, s_q); an empty row's +inf (FA2's convention)
  is read as -inf (OPS.md) by conformance/lse.py's `empty_row_lse_to_neg_inf`, the one declared
  conversion. With sinks its LSE includes the sink's mass (an empty row's LSE is the sink), which the
  op's `lse` (without the sink) is not: those cases report lse as not provided and judge o.

The adapter returns flash-attn-4's own tensors (no copy), so `parity bench` times its call alone.
What it cannot express is a skip with the reason (`supports`): fp32, head dims outside 8..256 or not
a multiple of 8, top-left causal with s_q != s_k, sinks beside an LSE cotangent, GQA backward with
d != d_v on Hopper (its SM90 backward asserts d == d_v); every op but attention.prefill and its
backward (the varlen and paged forms are not bound yet). An install that does not import (4.0.0b36
imports quack-kernels) is unavailable with the import error as the reason.

First GPU run (H100, 2026-11-28, ci suite, reports/baselines/ci-fa4-h100.jsonl.gz): 97 pass, 107 skip,
5 fail, 4 error (the GQA d != d_v backward, now a skip). Its softcap is `tanh(x, fastmath=True)`
(flash_attn/cute/utils.py): the LSE of capped logits misses the golden by ~6e-5 (rel 7e-6, atol 1e-5)
on `large` / `outlier` logits (conformance/known_failures.toml); one bf16 `scales` backward case has
dsinks[0] -0.3949 against the golden's -0.3857 (cos_diff 1.1e-4). That case is ill-conditioned in O:
the golden takes D = dO . O from the case's bf16 O (FlashAttention's contract), and the exact-O
reference gives -0.3918, 1.6% away from it; FA4 recomputes O in its own forward, so the case's O is
not what it differentiates. So the adapter claims the backward's `exact` reference (the VJP at q, k, v,
O recomputed in float64), which FA4's interface is: it takes q, k, v, dO and never the case's O (tested
with a fake library on the CPU; not yet rerun on a GPU: the 2026-11-28 device session could not install
the wheels, see the closing note of issue 19).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from kernel_parity.conformance.backends import Backend, NotProvided
from kernel_parity.conformance.backends._torch import cuda_available, to_torch, torch_available
from kernel_parity.conformance.lse import empty_row_lse_to_neg_inf
from kernel_parity.conformance.ops.attention_inputs import value_dim

OPS = ("attention.prefill", "attention.prefill_backward")
INSTALL = "pip install flash-attn-4 (with the `peers` extra's nvidia-cutlass-dsl)"


def _installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # a `flash_attn` without a `cute` package (FlashAttention 2)
        return False


@dataclass
class FlashAttn4Backend(Backend):
    def available(self) -> str | None:
        why = torch_available()
        if why:
            return why
        if not _installed():
            return f"flash-attn-4 is not installed ({INSTALL})"
        if self.device == "cuda" and not cuda_available():
            return "flash-attn-4 needs a CUDA GPU (its CuTe-DSL kernels compile for sm80 / sm90 / sm100 only)"
        why = _import_error()  # an install missing one of its needs is a skip saying which, not an error per case
        if why:
            return (f"flash-attn-4 is installed but does not import ({why}); it needs quack-kernels, "
                    "nvidia-cutlass-dsl, apache-tvm-ffi, torch-c-dlpack-ext and einops")
        return None

    def supports(self, case: Any) -> str | None:
        why = super().supports(case)
        if why:
            return why
        p = case.p
        for name, d in (("d", p["d"]), ("d_v", value_dim(p))):
            if not 8 <= d <= 256 or d % 8:
                return f"flash-attn-4 takes head dims of 8..256 in multiples of 8, got {name}={d}"
        if p["causal"] == "top_left" and p["sq"] != p["sk"]:
            return ("flash-attn-4's causal mask is bottom-right aligned; top-left differs from it when "
                    f"s_q != s_k ({p['sq']} != {p['sk']})")
        if p["sink"] and p.get("dlse"):
            return "flash-attn-4's LSE includes the sink: its LSE cotangent is not the op's dLSE"
        if case.op == "attention.prefill_backward" and p["hq"] != p["hkv"] and p["d"] != value_dim(p) \
                and _capability_major() == 9:
            return ("flash-attn-4's SM90 backward requires head_dim == head_dim_v under GQA "
                    f"(FlashAttentionBackwardSm90 asserts it; d={p['d']}, d_v={value_dim(p)})")
        return None


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    """Why `flash_attn.cute` does not import (once per process: asked for every case), or None."""
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as e:  # noqa: BLE001 (any failure of a third-party import)
        return f"{type(e).__name__}: {e}"
    return None


def _capability_major() -> int | None:
    import torch

    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


def _window(v: int) -> int | None:
    return None if v < 0 else int(v)


def _call(p: dict, q: Any, k: Any, v: Any, sinks: Any) -> tuple[Any, Any]:
    from flash_attn.cute import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=1.0 / math.sqrt(p["d"]), causal=p["causal"] != "none",
                           window_size=(_window(p["wl"]), _window(p["wr"])), learnable_sink=sinks,
                           softcap=float(p["cap"]), return_lse=True)


def _prefill(case, inputs, out):
    p, dev = case.p, out.device
    q, k, v = (to_torch(inputs[n], dev) for n in ("q", "k", "v"))
    sinks = to_torch(inputs["sinks"], dev) if p["sink"] else None
    o, lse = _call(p, q, k, v, sinks)
    if sinks is not None:
        return {"o": o, "lse": NotProvided("flash-attn-4's LSE includes the sink's mass; the op's lse has none")}
    return {"o": o, "lse": empty_row_lse_to_neg_inf(lse)}


def _prefill_backward(case, inputs, out):
    import torch

    p, dev = case.p, out.device
    q, k, v = (to_torch(inputs[n], dev).detach().clone().requires_grad_() for n in ("q", "k", "v"))
    sinks = to_torch(inputs["sinks"], dev).detach().clone().requires_grad_() if p["sink"] else None
    with torch.enable_grad():
        o, lse = _call(p, q, k, v, sinks)
        outs, cots = [o], [to_torch(inputs["do"], dev)]
        if p.get("dlse"):
            outs.append(lse)
            cots.append(to_torch(inputs["dlse"], dev))
        torch.autograd.backward(outs, cots)
    res = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        res["dsinks"] = sinks.grad
    return res


def make(device: str = "cuda") -> FlashAttn4Backend:
    return FlashAttn4Backend(name="fa4", device=device, dtypes=("fp16", "bf16"),
                             ops={"attention.prefill": _prefill, "attention.prefill_backward": _prefill_backward},
                             # FA4 differentiates its own forward's O (the case's O is not an input it takes):
                             # the VJP at q, k, v is its reference, not the one through the case's rounded O
                             claims={"attention.prefill_backward": "exact"},
                             doc="flash-attn-4's CuTe-DSL FlashAttention (attention.prefill and its backward) on a CUDA GPU")


BACKEND = make()
