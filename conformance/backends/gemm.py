"""Adapters binding the quantized GEMM kernels of each built-in backend to `gemm.gemm_nt` (and its VJP
`gemm.gemm_nt_backward`), the reference each kernel claims, and the weight formats each has a path for.

- cpu:    kernels/cpu/gemm.c, ggml's integer path (activations quantized to Q8_0 / Q8_1 / Q8_K,
          integer block dots, float32 accumulation): claims `emulated`; float32 A and C
- triton: kernels/triton/gemm*.py: GGML Q8_0 / Q4_0 / Q4_K / Q6_K dequantized in registers
          (claims `dequant`), FP8 block-scaled with activations quantized per 1 x 128 group in
          the kernel (claims `emulated`), int4 groups dequantized to A's dtype (`dequant`)
- torch:  kernels/torch/gemm.py: W dequantized to A's dtype, then `a @ w.T` (claims `dequant`)
The backward (one reference, L1: da through the dequantized weight): cpu kernels/cpu/gemm_bwd.c (fp32,
float32 and GGML weights), triton kernels/triton/gemm_bwd.py (float32 and the Triton GGML formats),
torch autograd through the eager forward (every format).
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch
from kernel_parity.conformance.ops.gemm import FP8_W, GGML_W, INT4_GROUP, INT4_W, granularity

OP = "gemm.gemm_nt"
BWD = "gemm.gemm_nt_backward"
CPU_W = ("f32",) + GGML_W
TRITON_GGML = ("q8_0", "q4_0", "q4_k", "q6_k")


def _bias(inputs: dict, device: str) -> Any:
    return to_torch(inputs["bias"], device) if "bias" in inputs else None


def cpu_ops() -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import gemm as k

        c = out.numpy("c")
        k.gemm_nt(inputs["a"], case.p["wfmt"], inputs["w"], inputs.get("bias"), out=c)
        return {"c": c}

    def backward(case, inputs, out):
        from kernel_parity.kernels.cpu import gemm as k

        names = _gradients(case)
        return k.gemm_nt_backward(inputs["a"], case.p["wfmt"], inputs["w"], inputs["dc"], bias=bool(case.p["bias"]),
                                  out={n: out.numpy(n) for n in names})

    return {OP: run, BWD: backward}


def _gradients(case) -> tuple[str, ...]:
    """The gradient outputs of a gemm.gemm_nt_backward case (its spec's shapes)."""
    if case.p["wfmt"] != "f32":
        return ("da",)
    return ("da", "dw", "db") if case.p["bias"] else ("da", "dw")


def cpu_claims() -> dict[str, Any]:
    return {OP: "emulated"}


def cpu_supports() -> dict[str, Callable]:
    def check(case) -> str | None:
        w = case.p["wfmt"]
        if case.dtype != "fp32":
            return f"the C GEMM takes float32 activations (ggml's), not {case.dtype}"
        return None if w in CPU_W else f"the C GEMM runs float32 and GGML weights, not {w}"

    return {OP: check, BWD: check}


def triton_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.triton import gemm, gemm_fp8, gemm_int4

        p, c = case.p, out.torch("c", device)
        a, bias = to_torch(inputs["a"], device), _bias(inputs, device)
        w = p["wfmt"]
        if w in FP8_W:
            g = granularity(p)
            gemm_fp8.gemm_fp8(a, to_torch(inputs["w"], device), to_torch(inputs["w_scale"], device), bias, out=c,
                              gm=g["gm"], gn=g["gn"], gk=g["gk"])
        elif w in INT4_W:
            gemm_int4.gemm_int4(a, *(to_torch(inputs[n], device) for n in ("qweight", "qzeros", "scales")),
                                group=INT4_GROUP, order=INT4_W[w], bias=bias, out=c)
        else:
            gemm.gemm_nt(a, w, to_torch(inputs["w"], device), bias, out=c)
        return {"c": c}

    def backward(case, inputs, out):
        from kernel_parity.kernels.triton import gemm_bwd

        return gemm_bwd.gemm_nt_backward(to_torch(inputs["a"], device), case.p["wfmt"], to_torch(inputs["w"], device),
                                         to_torch(inputs["dc"], device), bias=bool(case.p["bias"]),
                                         out={n: out.torch(n, device) for n in _gradients(case)})

    return {OP: run, BWD: backward}


def triton_claims() -> dict[str, Any]:
    return {OP: lambda case: "emulated" if case.p["wfmt"] in FP8_W else "dequant"}


def triton_supports() -> dict[str, Callable]:
    def check(case) -> str | None:
        w = case.p["wfmt"]
        if w in FP8_W and case.dtype == "fp32":
            # Hopper's fp8 tensor cores accumulate a dot in ~14-bit precision (DeepSeek-V3 report; seen:
            # cos_diff 1e-8 against fp32's 1e-12 on an H100), so the kernel's output is 16-bit
            return "the FP8 GEMM accumulates on fp8 tensor cores: it claims a bf16/fp16 output, not fp32"
        if w in TRITON_GGML or w in FP8_W or w in INT4_W:
            return None
        return f"the Triton GEMMs decode {', '.join(TRITON_GGML)}, fp8 and int4 weights, not {w}"

    def check_backward(case) -> str | None:
        w = case.p["wfmt"]
        if w == "f32" or w in TRITON_GGML:
            return None
        return f"the Triton GEMM backward takes float32 and {', '.join(TRITON_GGML)} weights, not {w}"

    return {OP: check, BWD: check_backward}


def torch_ops(device: str) -> dict[str, Callable]:
    def run(case, inputs, out):
        from kernel_parity.kernels.torch import gemm as k

        p, c = case.p, out.torch("c", device)
        w = p["wfmt"]
        weights = {n: to_torch(v, device) for n, v in inputs.items() if n not in ("a", "bias")}
        extra: dict[str, Any] = {}
        wfmt = w
        if w in FP8_W:
            wfmt, g = "fp8", granularity(p)
            extra = {"gn": g["gn"], "gk": g["gk"]}
        elif w in INT4_W:
            wfmt, extra = "int4", {"order": INT4_W[w], "group": INT4_GROUP}
        c.copy_(k.gemm_nt(to_torch(inputs["a"], device), wfmt, weights, _bias(inputs, device), **extra))
        return {"c": c}

    def backward(case, inputs, out):
        from kernel_parity.kernels.torch import gemm as k

        p = case.p
        weights = {n: to_torch(v, device) for n, v in inputs.items() if n not in ("a", "bias", "dc")}
        wfmt, extra = _torch_format(p)
        grads = k.gemm_nt_backward(to_torch(inputs["a"], device), wfmt, weights, to_torch(inputs["dc"], device),
                                   _bias(inputs, device), **extra)
        res = {}
        for name in _gradients(case):
            res[name] = out.torch(name, device)
            res[name].copy_(grads[name])
        return res

    return {OP: run, BWD: backward}


def _torch_format(p: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the torch path's weight format, its keyword arguments) of a case's wfmt."""
    w = p["wfmt"]
    if w in FP8_W:
        g = granularity(p)
        return "fp8", {"gn": g["gn"], "gk": g["gk"]}
    if w in INT4_W:
        return "int4", {"order": INT4_W[w], "group": INT4_GROUP}
    return w, {}


def torch_claims() -> dict[str, Any]:
    return {OP: "dequant"}
