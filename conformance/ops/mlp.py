"""Op specs of the gated-MLP activations: `mlp.swiglu` and `mlp.geglu`.

The gate g and the up projection u arrive as the two halves of one fused projection h (t, 2i),
gate first (layout=fused: vLLM's SiluAndMul, FlashInfer, ggml, C-Kernel-Engine's w1), or as two
tensors (layout=split: Liger's silu_mul(a, b), HF's gate_proj / up_proj). Distributions:
`large` puts gates far into silu's and gelu's tails (a sigmoid as 1 / (1 + exp(-g)) in fp16
overflows at g < -11); `halves` gives gate and up scales 100x apart, so gate and up swapped is
far off whatever the activation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.mlp as ref
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import Diagnosis, OpSpec, Output
from kernel_parity.conformance.tolerance import Override, Tier, Tol

DISTS = {
    "normal": "gate, up ~ N(0, 1)",
    "large": "gate ~ N(0, 30): deep in the activation's tails (sigmoid overflow), up ~ N(0, 1)",
    "halves": "gate ~ N(0, 1), up ~ N(0, 100): gate and up swapped is off by orders of magnitude",
}


def _gate_up(p: dict[str, Any], dist: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    g = rng.standard_normal((p["t"], p["i"]))
    u = rng.standard_normal((p["t"], p["i"]))
    if dist == "large":
        g *= 30.0
    elif dist == "halves":
        u *= 100.0
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}")
    return g, u


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    g, u = _gate_up(p, dist, rng)
    if p["layout"] == "fused":
        return {"h": dt.round_to(np.concatenate([g, u], axis=-1), dtype)}
    return {"gate": dt.round_to(g, dtype), "up": dt.round_to(u, dtype)}


def gate_up_of(x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) of either layout, as the golden sees them."""
    if "h" in x:
        return ref.split(x["h"])
    return x["gate"], x["up"]


def _swiglu_ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"y": ref.swiglu(*gate_up_of(x))}


def _geglu_ref(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"y": ref.geglu(*gate_up_of(x), approx=p["approx"])}


# The eager baseline's tier for GeGLU (the torch backend only; production keeps the dtype defaults).
# Measured on torch 2.13 CPU, 4M draws a distribution and dtype (max over elements of
# |error| - rtol |golden|, the atol each would need): torch's F.gelu forms 0.5 x (1 + erf(x / sqrt 2))
# (and 1 + tanh) in fp32, where 1 + erf cancels below x = -2 and its vectorised erf is off by up to
# ~2.6e-6 (gelu relative error 6e-3 over x in [-4, -2]; tanh 8e-4); `halves` multiplies that by
# |up| ~ 100-500: 2.0e-4 (fp32, erf), 9.4e-5 (fp16), 2.0e-5 (bf16), 1.9e-5 (fp32, tanh); normal
# and large need < 3e-6. Our kernels form Phi from erfc and the tanh form as a sigmoid, and pass
# the defaults.
GELU_BASELINE = Tier(
    reason="eager torch (CPU) evaluates 1 + erf(x / sqrt 2) and 1 + tanh in fp32: both cancel for x < -2 "
           "(gelu error up to ~2.6e-6 absolute, 6e-3 relative), which `halves` scales by |up| ~ 100-500",
    overrides=(Override("torch's fp32 1 + erf cancellation times |up| <= 500: measured need 2.0e-4 "
                        "(fp32 erf), 9.4e-5 (fp16), 2.0e-5 (bf16), 2.5x margin", atol=5e-4),),
)

_COMMON = dict(
    t=Int(1, 1 << 20, doc="tokens"),
    i=Int(1, 1 << 18, edges=(64, 1024, 11008, 14336), doc="intermediate width (of gate and of up)"),
    layout=OneOf("fused", "split", doc="one (t, 2i) projection, gate first, or separate gate and up"),
)

SWIGLU = OpSpec(
    name="mlp.swiglu",
    golden=ref.swiglu,
    reference=_swiglu_ref,
    params=Schema(dict(_COMMON)),
    make_inputs=_inputs,
    output_shapes=lambda p: {"y": (p["t"], p["i"])},
    outputs={"y": Output("test", doc="silu(gate) * up")},
    tolerance=Tol(),
    dists=DISTS,
    doc="SwiGLU activation: silu(gate) * up, from a fused gate-first projection or separate tensors.",
)

GEGLU = OpSpec(
    name="mlp.geglu",
    golden=ref.geglu,
    reference=_geglu_ref,
    params=Schema(dict(_COMMON, approx=OneOf(*ref.GELU_APPROX, doc="gelu: tanh approximation or exact erf"))),
    make_inputs=_inputs,
    output_shapes=lambda p: {"y": (p["t"], p["i"])},
    outputs={"y": Output("test", doc="gelu(gate) * up")},
    tolerance=Tol(baseline=GELU_BASELINE),
    dists=DISTS,
    diagnoses=(Diagnosis("matches the other GELU (tanh approximation vs erf)",
                         lambda p: {**p, "approx": "erf" if p["approx"] == "tanh" else "tanh"}),),
    doc="GeGLU activation: gelu(gate) * up (tanh or erf GELU), fused gate-first or separate tensors.",
)

SPECS = (SWIGLU, GEGLU)
