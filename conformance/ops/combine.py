"""Op spec of the split-KV merge: `combine.lse_combine`.

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
from kernel_parity.conformance.spec import OpSpec, Output
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
    dists=DISTS,
    doc="Merge of per-split partial attention states (O_i, LSE_i) into (O, LSE).",
)

SPECS = (LSE_COMBINE,)
