"""Issue 32, "Magnitude": RoPE at positions up to 2^20. A given table is read (judged at acc_len 2 at any
position); angles built from theta are the peers' fp32 p w_i, judged with that term (rope._angle_len: the
largest rounded angle p_max w_1; w_0 = 1 keeps the first angle exact). The golden's angles stay float64, and
with table=theta it builds only the tokens' rows, not a 2^20-row table.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.ops.rope import _angle_len
from kernel_parity.conformance.runner import Prepared
from kernel_parity.refimpl import rope as ref

LONG = 1 << 20
P = dict(t=7, h=2, d=64, rot=64, style="interleaved", at="last", table="theta", theta=500000, scaling="llama3",
         maxseq=LONG, pos="offset", start=LONG - 7)


def test_tables_rows_are_the_full_tables_rows():
    pos = np.array([0, 1, 17, 4095, 4096, 9999])
    for scaling in ("none", "llama3"):
        cos, sin = ref.tables(10000, 32, 500000.0, scaling)
        c, s = ref.tables(10000, 32, 500000.0, scaling, rows=pos)
        assert np.array_equal(c, cos[pos]) and np.array_equal(s, sin[pos])
    with pytest.raises(ValueError, match="rows must be positions"):
        ref.tables(100, 32, 10000.0, rows=np.array([100]))


def test_theta_golden_at_2_20_rotates_by_the_float64_angles():
    prep = Prepared(ops.get("rope.rope"), ops.make_case("rope.rope", "cpu", "fp32", P, "normal", 2))
    x, pos = prep.inputs64["x"], prep.inputs64["positions"]
    assert pos.min() >= LONG - 7 and pos.max() == LONG - 1
    ang = pos[:, None] * ref.inv_freq(64, 500000.0, "llama3")[None, :]  # t, 32
    a, b = x[..., P["d"] - 64::2], x[..., P["d"] - 63::2]  # the interleaved pairs of the last 64 dims
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    y = prep.golden["y"]
    np.testing.assert_allclose(y[..., 0::2], a * c - b * s, rtol=0, atol=1e-12)
    np.testing.assert_allclose(y[..., 1::2], a * s + b * c, rtol=0, atol=1e-12)


def test_angle_term_is_the_largest_rounded_angle():
    w1 = ref.inv_freq(64, 500000.0, "llama3")[1]
    assert _angle_len(P, "y") == np.ceil(((LONG - 1) * w1) ** 2)
    assert _angle_len({**P, "pos": "random", "start": 0, "maxseq": 5000}, "y") == np.ceil((4999 * w1) ** 2)
    assert _angle_len({**P, "rot": 2}, "y") == 2  # w_0 = 1 alone: p is exact in fp32
    for table in ("cos_sin", "cs_f16", "cis"):  # a given table is read, at any position
        assert _angle_len({**P, "table": table}, "y") == 2
    # never wider than the angle bound it replaces, (maxseq - 1)^2
    for pos, start in (("offset", 31), ("random", 0), ("ragged", 0)):
        p = {**P, "t": 6, "maxseq": 40, "pos": pos, "start": start}
        assert 2 <= _angle_len(p, "y") <= 39 ** 2


def test_ci_runs_positions_near_2_20_with_tables_and_theta():
    docs = [c for c in suites.load_doc("ci")["cases"] if c["op"] == "rope.rope" and "params" in c]
    long = [p for c in docs for p in c["params"] if p["maxseq"] >= LONG]
    assert {p["table"] for p in long} == {"cos_sin", "cs_f16", "cis", "theta"}
    assert any(p["pos"] == "offset" and p["start"] + p["t"] == LONG for p in long if p["table"] == "theta")
    assert any(p["pos"] == "offset" and p["start"] + p["t"] == LONG for p in long if p["table"] != "theta")
    assert {d for c in docs if any(p["maxseq"] >= LONG for p in c["params"]) for d in c["dtypes"]} == \
        {"fp32", "fp16", "bf16"}
