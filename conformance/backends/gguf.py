"""gguf-py (llama.cpp's `gguf` package: NumPy quantizers and dequantizers) as a third-party backend.

gguf writes the same bytes as ggml's reference quantizers for the formats it can quantize (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0) and dequantizes every format it knows to float32; it has no Q8_1 and no
Q8_K (activation-side formats). It is registered through the `kernel_parity.backends` entry point,
like any plugin: our goldens must agree with it byte for byte, and a report shows where it is
unsupported and why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance.backends import Backend

QUANTIZE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
DEQUANTIZE = QUANTIZE + ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl")


def _qtype(fmt: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[fmt.upper()]


def _quantize(case, inputs, out):
    from gguf import quants

    q = out.numpy("q")
    with np.errstate(over="ignore"):  # a block of 1e15 stores d = fp16 inf, as ggml does
        q[...] = quants.quantize(inputs["x"], _qtype(case.p["fmt"]))
    return {"q": q}


def _dequantize(case, inputs, out):
    from gguf import quants

    y = out.numpy("y")
    with np.errstate(invalid="ignore", over="ignore"):
        y[...] = quants.dequantize(inputs["data"], _qtype(case.p["fmt"]))
    return {"y": y}


class GgufBackend(Backend):
    def available(self) -> str | None:
        try:
            import gguf.quants  # noqa: F401
        except Exception as e:
            return f"the gguf package is not importable ({type(e).__name__}: {e}); pip install gguf"
        return None

    def supports(self, case) -> str | None:
        why = super().supports(case)
        if why:
            return why
        fmt = case.p["fmt"]
        have = QUANTIZE if case.op == "quant.quantize" else DEQUANTIZE
        if fmt not in have:
            verb = "quantize" if case.op == "quant.quantize" else "dequantize"
            return f"gguf cannot {verb} {fmt} (it {verb}s {', '.join(have)})"
        return None


def make() -> GgufBackend:
    return GgufBackend(name="gguf", device="cpu", dtypes=("fp32",),
                       ops={"quant.quantize": _quantize, "quant.dequantize": _dequantize},
                       doc="gguf-py: llama.cpp's NumPy quantizers (Q4_0..Q8_0) and dequantizers")


GGUF = make
