"""Op specs of the split-KV merge: `combine.lse_combine` and its backward `combine.lse_combine_backward`.

Partial outputs O_i (splits, rows, d_v) are stored in the test dtype, their LSEs
(splits, rows) in float32 (every peer keeps LSE in fp32). An empty split has LSE -inf and
its O is NaN here, so a kernel that multiplies it by a zero weight instead of skipping it
fails structurally.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.combine  # noqa: F401  (refimpl.combine below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw
from kernel_parity.conformance.params import Int, Schema
from kernel_parity.conformance.spec import OpSpec, Output, Rows
from kernel_parity.conformance.tolerance import Tol

DISTS = {
    "normal": "O_i ~ N(0, 1), LSE_i ~ N(0, 3)",
    "spread": "LSE_i ~ N(0, 1e4): one split dominates, the others underflow to weight 0",
    "empty": "30% of splits empty (LSE -inf, O NaN); row 0 all empty, row 1 one live split",
    "neg_large": "LSE_i = -60000 + N(0, 1): very negative finite LSEs (finite-sentinel bugs)",
}


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n, rows, dv = p["splits"], p["rows"], p["dv"]
    o = draw(rng, (n, rows, dv), "normal")
    if dist == "normal":
        lse = draw(rng, (n, rows), "normal", 3.0)
    elif dist == "spread":
        lse = draw(rng, (n, rows), "normal", 1e4)
    elif dist == "neg_large":
        lse = -60000.0 + draw(rng, (n, rows), "normal")
    elif dist == "empty":
        lse = draw(rng, (n, rows), "normal", 3.0)
        empty = rng.random((n, rows)) < 0.3
        empty[:, 0] = True
        if rows > 1:
            empty[:, 1] = True
            empty[rng.integers(n), 1] = False
        lse[empty] = -np.inf
        o[empty] = np.nan  # "any O": the kernel must never read it into the result
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return {
        "o_parts": dt.round_to(o, dtype),
        "lse_parts": dt.round_to(lse, "fp32"),
    }


def _ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    o, lse = refimpl.combine.lse_combine(inputs["o_parts"], inputs["lse_parts"])
    return {"o": o, "lse": lse}


# The error model (conformance/tolerance.py): o = sum_i w_i O_i -> sqrt(sum_i w_i^2 O_i^2) (splits of opposite
# signs cancel), lse = M + ln s -> sqrt(M^2 + (ln s)^2 + (1 - 1/s)^2) (refimpl.combine.lse_combine, `absolute`).
# cond on the ci cases (cpu): o 1.0-1.46, lse 1.0-1.03. The LSE, fp32 with atol 1e-5 and ln s <= ln(splits),
# never fails on a cancellation; o in fp32 does (values ~1000 whose weighted sum is ~1: tests/test_error_model_rows).
def _mag(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    o, lse = refimpl.combine.lse_combine(inputs["o_parts"], inputs["lse_parts"], absolute=True)
    return {"o": o, "lse": lse}


LSE_COMBINE = OpSpec(
    name="combine.lse_combine",
    golden=refimpl.combine.lse_combine,
    reference=_ref,
    params=Schema(dict(
        splits=Int(1, 1024, edges=(16, 32, 64), doc="number of partial states"),
        rows=Int(1, 1 << 20, doc="rows (batch x heads x queries, flattened)"),
        dv=Int(1, 1024, edges=(64, 128, 256, 512), doc="value head dim"),
    )),
    make_inputs=_inputs,
    output_shapes=lambda p: {"o": (p["rows"], p["dv"]), "lse": (p["rows"],)},
    outputs={
        "o": Output("test", doc="merged output"),
        "lse": Output("fp32", doc="merged natural-log LSE, -inf when every split is empty"),
    },
    tolerance=Tol(acc_len=lambda p, output: p["splits"]),
    rows=Rows("rows", inputs={"o_parts": 1, "lse_parts": 1}, outputs={"o": 0, "lse": 0}),  # a row merges its own splits
    dists=DISTS,
    magnitude=_mag,
    doc="Merge of per-split partial attention states (O_i, LSE_i) into (O, LSE).",
)


# ---- backward ------------------------------------------------------------------------------------
def _backward_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The forward's inputs (same draws), its float64 golden (o, lse) rounded to their dtypes, then
    the cotangents do (test dtype) and dlse (fp32), N(0, 1) from the same generator."""
    fwd = _inputs(p, dtype, dist, rng)
    o, lse = refimpl.combine.lse_combine(fwd["o_parts"].astype(np.float64), fwd["lse_parts"].astype(np.float64))
    do = rng.standard_normal((p["rows"], p["dv"]))
    dlse = rng.standard_normal(p["rows"])
    return {**fwd, "o": dt.round_to(o, dtype), "lse": dt.round_to(lse, "fp32"),
            "do": dt.round_to(do, dtype), "dlse": dt.round_to(dlse, "fp32")}


def _backward_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    do_parts, dlse_parts = refimpl.combine.lse_combine_backward(inputs["o_parts"], inputs["lse_parts"],
                                                                 inputs["do"], inputs["dlse"])
    return {"do_parts": do_parts, "dlse_parts": dlse_parts}


def _backward_mag(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    """The error model (refimpl.combine, `absolute`): dLSE_i -> w_i sqrt(sum_d dO_d^2 ((1 - w_i)^2 O_id^2 +
    sum_{j != i} w_j^2 O_jd^2) + sum_j (w_j a_j)^2 + dLSE^2), a_j = dO . O_j: the terms of dO . (O_i - O) + dLSE
    written without O, and abar's terms w_j a_j with the rounding of each weight's exp. Without the last
    terms (cond median 1.0-1.39 per distribution) our Triton kernel on an H200 failed a thorough seed
    (`.../triton/fp32/splits=65,rows=3,dv=130/spread/seed=7000003`: dLSE of the dominant split off by 1.9e-6,
    the GPU's approximate exp2 in w_i a_i, which a_i does not cancel); with them the dominant split is a
    cancellation on any input: cond on the ci cases (cpu) median 4.8 (normal), 79 (spread), 6.4 (empty),
    1.6 (neg_large). dO_i = w_i dO is a product (no cancellation): no model, judged against |golden|."""
    _, dlse_parts = refimpl.combine.lse_combine_backward(inputs["o_parts"], inputs["lse_parts"], inputs["do"],
                                                         inputs["dlse"], absolute=True)
    return {"dlse_parts": dlse_parts}


def _backward_acc_len(p: dict[str, Any], output: str) -> int:
    # dO_i = w_i dO: the weights' sum runs over the splits; dLSE_i = w_i (dO . O_i - sum_j w_j dO . O_j
    # + dLSE): a dot of d_v products, then the weighted sum over the splits
    return p["splits"] if output == "do_parts" else p["dv"] + p["splits"]


LSE_COMBINE_BACKWARD = OpSpec(
    name="combine.lse_combine_backward",
    golden=refimpl.combine.lse_combine_backward,
    reference=_backward_ref,
    params=LSE_COMBINE.params,
    make_inputs=_backward_inputs,
    output_shapes=lambda p: {"do_parts": (p["splits"], p["rows"], p["dv"]), "dlse_parts": (p["splits"], p["rows"])},
    outputs={
        "do_parts": Output("test", doc="gradient of each split's O: w_i dO; exactly 0 for an empty split"),
        "dlse_parts": Output("fp32", doc="gradient of each split's LSE: w_i (dO . (O_i - O) + dLSE); 0 when empty"),
    },
    # No override: 25 fresh seeds of every ci combination stay within the dtype defaults (worst
    # norm_err 0.78, fp16 do_parts against the noise floor).
    tolerance=Tol(acc_len=_backward_acc_len, noise_k=3.0),
    dists=DISTS,
    magnitude=_backward_mag,
    doc="VJP of combine.lse_combine: inputs o_parts, lse_parts, o, lse, do, dlse; outputs do_parts, dlse_parts.",
)

SPECS = (LSE_COMBINE, LSE_COMBINE_BACKWARD)
