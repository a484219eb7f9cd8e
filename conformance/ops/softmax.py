"""Op specs of the softmax family: `softmax.softmax` and `softmax.online_softmax`.

Inputs are (rows, n) with an optional row-stride padding of `pad` elements that holds NaN.
Distributions cover the numerics a softmax kernel gets wrong: large logits (no max
subtraction overflows), -inf masks with fully masked rows (must give 0, not NaN), and very
negative finite logits (a kernel that masks with a finite sentinel like -5e4 zeroes them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.softmax  # noqa: F401  (refimpl.softmax below)
from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.inputs import draw, padded
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Tol

DISTS = {
    "normal": "N(0, 1) logits",
    "uniform": "U(-1, 1) logits",
    "large": "N(0, 1000) logits: exp overflows without the max subtraction",
    "masked": "N(0, 1) with half the entries -inf; row 0 fully -inf, row 1 has one finite entry",
    "neg_large": "-60000 + N(0, 30): very negative finite logits (finite-sentinel masking bugs)",
    "grid": "multiples of 1/4 in [-8, 8]: exact in every dtype, and still exact after + 16",
    "grid_shift16": "the values of `grid` + 16: softmax must not change, bit for bit",
}

ROW_EDGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def logits(rng: np.random.Generator, rows: int, n: int, dist: str) -> np.ndarray:
    """(rows, n) float64 logits of the named distribution."""
    if dist == "normal":
        return draw(rng, (rows, n), "normal")
    if dist == "uniform":
        return draw(rng, (rows, n), "uniform")
    if dist == "large":
        return draw(rng, (rows, n), "normal", 1000.0)
    if dist == "neg_large":
        return -60000.0 + draw(rng, (rows, n), "normal", 30.0)
    if dist in ("grid", "grid_shift16"):
        x = rng.integers(-32, 33, (rows, n)) / 4.0
        return x + 16.0 if dist == "grid_shift16" else x
    if dist == "masked":
        x = draw(rng, (rows, n), "normal")
        x[rng.random((rows, n)) < 0.5] = -np.inf
        x[0] = -np.inf
        if rows > 1:
            x[1] = -np.inf
            x[1, rng.integers(n)] = rng.standard_normal()
        return x
    raise ValueError(f"unknown distribution {dist!r}")


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    x = logits(rng, p["rows"], p["n"], dist)
    return {"x": padded(x, p["pad"], dt.get(dtype))}


def _softmax_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"y": refimpl.softmax.softmax(inputs["x"], axis=-1)}


def _online_ref(inputs: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    y, lse = refimpl.softmax.online_softmax(inputs["x"], p["tile"], axis=-1)
    return {"y": y, "lse": lse}


def _row_len(p: dict[str, Any], output: str) -> int:
    return p["n"]  # each output element depends on a sum over its row


_COMMON = dict(
    rows=Int(1, 65536, doc="number of rows"),
    n=Int(1, 1 << 22, edges=ROW_EDGES, doc="row length (the softmax axis)"),
    pad=OneOf(0, 1, 16, doc="row-stride padding in elements, filled with NaN"),
)

SOFTMAX = OpSpec(
    name="softmax.softmax",
    golden=refimpl.softmax.softmax,
    reference=_softmax_ref,
    params=Schema(dict(_COMMON)),
    make_inputs=_inputs,
    output_shapes=lambda p: {"y": (p["rows"], p["n"])},
    output_pads=lambda p: {"y": p["pad"]},
    outputs={"y": Output("test", doc="softmax over the last axis")},
    tolerance=Tol(acc_len=_row_len),
    dists=DISTS,
    doc="Row-wise softmax over the last axis of (rows, n).",
)

ONLINE_SOFTMAX = OpSpec(
    name="softmax.online_softmax",
    golden=refimpl.softmax.online_softmax,
    reference=_online_ref,
    params=Schema(dict(_COMMON, tile=OneOf(16, 64, 256, 1024, doc="streaming tile length"))),
    make_inputs=_inputs,
    output_shapes=lambda p: {"y": (p["rows"], p["n"]), "lse": (p["rows"],)},
    output_pads=lambda p: {"y": p["pad"]},
    outputs={
        "y": Output("test", doc="softmax over the last axis"),
        "lse": Output("fp32", doc="natural-log logsumexp of each row, -inf for an all -inf row"),
    },
    tolerance=Tol(acc_len=_row_len),
    dists=DISTS,
    doc="Streaming softmax over tiles (running max and sum), returning the row LSE too.",
)

SPECS = (SOFTMAX, ONLINE_SOFTMAX)
