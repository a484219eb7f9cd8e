"""mla.decode's FlashMLA lengths (`lens` varlen and bench, S19) and FlashMLA's own grid in the models suite."""

import numpy as np

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.ops import mla as M
from kernel_parity.conformance.ops.attention_inputs import lengths
from kernel_parity.conformance.runner import Prepared

ID = "mla.decode/torch/fp32/b={b},sq={sq},hq=2,kv={kv},lens={lens},causal=0,scale=head/large/seed=0"


def test_full_and_ragged_lengths_and_tolerances_are_unchanged():
    for lens in ("full", "ragged"):
        for b, kv in ((1, 1), (5, 65), (128, 4096)):
            p = ops.parse_case(ID.format(b=b, sq=1, kv=kv, lens=lens)).p
            assert np.array_equal(M._decode_lens(p), lengths(b, kv, lens))
            assert M._decode_lens(p).max() == kv  # the tolerance's accumulation length stays kv + 576


def test_varlen_and_bench_are_flashmla_s_lengths():
    bench = ops.parse_case(ID.format(b=128, sq=1, kv=1024, lens="bench"))
    assert M._decode_lens(bench.p).tolist() == [1024 + 2 * i for i in range(128)]
    p = ops.parse_case(ID.format(b=128, sq=2, kv=4096, lens="varlen")).p
    L = M._decode_lens(p)
    assert L.dtype == np.int32 and L.min() >= 2 and np.array_equal(L, M._decode_lens(dict(p)))  # params only
    assert 3500 < L.mean() < 4700 and 1500 < L.std() < 2500 and L.max() > 4096  # max(N(4096, 2048), s_q)
    small = ops.parse_case(ID.format(b=3, sq=1, kv=63, lens="bench"))
    x = Prepared(ops.get(small.op), small).inputs
    assert x["seqlens"].tolist() == [63, 65, 67] and x["block_table"].shape == (3, 2)


def test_a_bad_lens_exits_2_with_one_line(capsys):
    assert main(["repro", ID.format(b=2, sq=1, kv=8, lens="normal")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lens" in err[0] and "varlen" in err[0]


def test_models_runs_flashmla_s_test_grid_and_benchmark_lengths():
    real = suites.Filters(ops=("mla.decode",), dists=("large",), scale="real")
    cases = suites.cases("models", real)
    grid = {(c.p["sq"], c.p["hq"], c.p["kv"], c.p["lens"]) for c in cases if c.p["lens"] != "bench"}
    assert grid == {(sq, hq, kv, lens) for sq in (1, 2) for hq in (16, 32, 64, 128) for kv in (4096, 8192, 16384)
                    for lens in ("full", "varlen")}
    assert all(c.p["b"] == 128 and c.p["causal"] == (c.p["sq"] == 2) for c in cases)
    bench = sorted({c.p["kv"] for c in cases if c.p["lens"] == "bench"})
    assert bench == [1024, 2048, 4096, 8192, 16384, 32768]
