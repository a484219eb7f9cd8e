"""`triton-q8`: our Triton GEMV / small-M GEMM over Q4_K and Q8_0 weights with quantized activations
(Q8_K and Q8_0: kernels/triton/gemm_q8.py), ggml's production arithmetic on a GPU (llama.cpp's
mul_mat_vec_q): activations quantized per block, integer dot products, fp32 scales. It claims gemm.gemm_nt's
`emulated` reference (L2); the `triton` backend's exact kernels claim `dequant` (L1), which this path
cannot meet by construction (the activation quantization is the difference, recorded beside it).

A backend of its own, registered through the entry point like torch-norm, so that `parity run`
selects the path by name and the gate judges both paths of the same weights side by side. Its seeded
bugs are in the triton catalogue (the mutants of kernels/triton/ run every case of triton*). On a
machine without a GPU it runs under the Triton interpreter, where the kernel's inline PTX (dp4a,
div.rn, cvt.rni) is replaced by the same integer and IEEE arithmetic in plain Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, to_torch

OP = "gemm.gemm_nt"
FORMATS = ("q4_k", "q8_0")


@dataclass
class TritonQ8Backend(Backend):
    triton: bool = True

    def supports(self, case: Any) -> str | None:
        why = super().supports(case)
        if why:
            return why
        if case.p["wfmt"] not in FORMATS:
            return f"triton-q8 has a quantized-activation path for {', '.join(FORMATS)} weights, not {case.p['wfmt']}"
        return None

    def describe(self) -> str:
        from kernel_parity.conformance.backends.triton_prep import describe_mode

        return f"triton-q8 ({describe_mode()})"


def _run(case: Any, inputs: dict, out: Any, device: str) -> dict:
    from kernel_parity.kernels.triton import gemm_q8

    c = out.torch("c", device)
    bias = to_torch(inputs["bias"], device) if "bias" in inputs else None
    gemm_q8.gemm_nt_q8(to_torch(inputs["a"], device), case.p["wfmt"], to_torch(inputs["w"], device), bias, out=c)
    return {"c": c}


def _make() -> TritonQ8Backend:
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()
    device = "cuda" if cuda_available() else "cpu"
    return TritonQ8Backend(name="triton-q8", device=device,
                           ops={OP: lambda case, inputs, out: _run(case, inputs, out, device)},
                           claims={OP: "emulated"},
                           doc="kernels/triton/gemm_q8.py: Q4_K x Q8_K, Q8_0 x Q8_0 activations, integer dots (ggml's GPU path)")


BACKEND = _make
