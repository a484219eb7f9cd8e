"""Judging large outputs on a seeded sample of rows (conformance/sampling.py): which rows, that the
sampled path gives the full golden's verdicts, that a NaN anywhere is still judged, and that a bug
confined to rows outside a sample still fails a ci case."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import golden_cache, ops, sampling, suites
from kernel_parity.conformance.backends import Backend, Registry
from kernel_parity.conformance.runner import Runner

ROW_OPS = ("norm.rms_norm", "norm.layer_norm", "rope.rope", "rope.rope_backward", "mlp.swiglu", "mlp.geglu",
           "mlp.swiglu_backward", "mlp.geglu_backward", "gemm.gemm_nt", "mla.decode", "softmax.softmax",
           "softmax.online_softmax", "combine.lse_combine", "moe.route_backward", "kvquant.mla_sparse",
           "kvquant.mla_decode")
BIG = "norm.rms_norm/{b}/bf16/rows=4096,n=64,pad=0,eps=1e-5,gemma=0,residual=0,rstd=0/normal/seed=3"


def test_edge_rows_hold_every_tile_edge_power_of_two_and_the_ends():
    got = set(sampling.edge_rows(300, 128).tolist())
    assert {0, 1, 298, 299, 127, 128, 255, 256} <= got  # ends and 128-row tile edges
    assert {2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129, 257} <= got  # 2^j - 1, 2^j, 2^j + 1
    assert not {6, 10, 100, 200} & got
    assert set(sampling.edge_rows(1, 128).tolist()) == {0}


def test_small_outputs_ops_without_rows_and_off_are_judged_whole(monkeypatch):
    spec = ops.get("norm.rms_norm")
    small = ops.parse_case(BIG.format(b="cpu").replace("rows=4096", "rows=37"))
    big = ops.parse_case(BIG.format(b="cpu").replace("n=64", "n=4096"))
    inputs = {}
    assert sampling.choose(spec, small, inputs) is None
    s = sampling.choose(spec, big, inputs)
    assert s is not None and s.n == 4096 and 256 < s.idx.size < 1024
    assert np.array_equal(s.idx, sampling.choose(spec, big, inputs).idx)  # from the seed: the same rows
    other = sampling.choose(spec, big.with_seed(4), inputs)
    assert not np.array_equal(s.idx, other.idx)
    monkeypatch.setenv(sampling.ENV, "off")
    assert sampling.choose(spec, big, inputs) is None
    monkeypatch.setenv(sampling.ENV, "0")
    assert sampling.choose(spec, small, inputs) is not None  # forced: every case of a row op
    spec = ops.get("norm.rms_norm_backward")  # dw sums over every row: no `rows`, judged whole
    case = ops.parse_case(BIG.format(b="cpu").replace("norm.rms_norm/", "norm.rms_norm_backward/")
                          .replace("rstd=0", "rstd=1"))
    assert spec.rows is None and sampling.choose(spec, case, {}) is None


def test_mla_requests_of_length_zero_one_and_page_edges_are_always_judged(monkeypatch):
    monkeypatch.setenv(sampling.ENV, "0")
    spec = ops.get("mla.decode")
    case = ops.parse_case("mla.decode/cpu/bf16/b=200,sq=1,hq=4,kv=640,lens=ragged,causal=0,scale=head/normal/seed=0")
    lens = np.asarray([640 * (i + 1) // (i + 2) for i in range(200)])
    lens[:5] = [640, 0, 1, 639, 320]
    s = sampling.choose(spec, case, {"seqlens": lens})
    edge = np.flatnonzero((lens <= 1) | (lens % 64 <= 1) | (lens % 64 == 63))
    assert set(edge.tolist()) <= set(s.idx.tolist())


@functools.lru_cache(maxsize=1)
def _all_ci_cases() -> tuple:
    """The ci suite's cases, planned once for the module (0.5 s a time; one test asks once per row op)."""
    return tuple(suites.cases("ci"))


def _ci_cases(op_names: tuple[str, ...], backends: tuple[str, ...]) -> list:
    return [c for c in _all_ci_cases() if c.op in op_names and c.backend in backends]


def test_sampled_and_full_verdicts_agree_on_the_ci_suite(monkeypatch):
    """Every ci case of a row-independent op, judged through the sampled path (forced, with 16 random
    rows so that samples are strict subsets where the rows allow) and judged whole: same verdicts."""
    cases = _ci_cases(ROW_OPS, ("cpu", "torch"))
    assert len(cases) > 500
    monkeypatch.setattr(sampling, "SAMPLE_RANDOM", 16)
    verdicts = {}
    for mode in ("off", "0"):
        monkeypatch.setenv(sampling.ENV, mode)
        recs = Runner(recheck=False).run(cases)
        verdicts[mode] = {r.id: r.verdict for r in recs}
        if mode == "0":
            sampled = [r for r in recs if r.sample]
            assert sampled and any(r.sample["rows"] < r.sample["of"] for r in sampled)
    assert verdicts["0"] == verdicts["off"]


def _rms_backend(name: str, bad_rows=lambda n: np.zeros(0, dtype=int), nan_row: int | None = None) -> Backend:
    """RMSNorm in float64, rounded once; rows `bad_rows(rows)` scaled by 1.5 (a wrong finite value),
    `nan_row` NaN."""
    def rms_norm(case, inputs, out):
        p = case.p
        x = inputs["x"].astype(np.float64)
        w = inputs["w"].astype(np.float64)
        y64 = x / np.sqrt((x[:, :p["n"]] ** 2).mean(-1, keepdims=True) + float(p["eps"])) * w
        y64[bad_rows(x.shape[0])] *= 1.5
        if nan_row is not None:
            y64[nan_row] = np.nan
        y = out.numpy("y")
        y[...] = dt.round_to(y64, dt.of_array(y))
        if not p["rstd"]:
            return {"y": y}
        rstd = out.numpy("rstd")
        rstd[...] = dt.round_to(1.0 / np.sqrt((x[:, :p["n"]] ** 2).mean(-1) + float(p["eps"])), "fp32")
        return {"y": y, "rstd": rstd}

    return Backend(name=name, device="cpu", ops={"norm.rms_norm": rms_norm}, doc="test backend")


def _runner(*backends: Backend) -> Runner:
    reg = Registry()
    for b in backends:
        reg.add(b)
    return Runner(reg, recheck=False, noise=False)


def test_a_nan_outside_the_sample_joins_it_and_fails_as_in_a_full_run(monkeypatch):
    monkeypatch.setenv(sampling.ENV, "0")
    case = ops.parse_case(BIG.format(b="nan-row"))
    idx = sampling.choose(ops.get("norm.rms_norm"), case, {}).idx
    row = int(np.setdiff1d(np.arange(4096), idx)[7])
    rec = _runner(_rms_backend("nan-row", nan_row=row)).evaluate(case)
    assert rec.verdict == "fail" and rec.kind == "structural"
    assert rec.sample["rows"] == idx.size + 1
    assert f"[{row}, 0]" in rec.reason or f"[{row}," in rec.message
    assert "judged on a sample" in rec.message
    monkeypatch.setenv(sampling.ENV, "off")
    full = _runner(_rms_backend("nan-row", nan_row=row)).evaluate(case)
    assert (full.verdict, full.kind) == (rec.verdict, rec.kind) and full.sample is None


def test_a_bug_confined_to_rows_outside_the_sample_still_fails_a_ci_case(monkeypatch):
    """The sample cannot see a wrong finite value in rows it does not hold: such a kernel passes the
    sampled model-size case. The same kernel is wrong in rows of every tile's interior, which the ci
    suite's cases (small, judged whole) hold: it fails there."""
    monkeypatch.setenv(sampling.ENV, "0")
    case = ops.parse_case(BIG.format(b="interior-rows"))
    idx = sampling.choose(ops.get("norm.rms_norm"), case, {}).idx
    outside = np.setdiff1d(np.arange(4096), idx)

    def bad(n):
        return outside[outside < n]

    backend = _rms_backend("interior-rows", bad_rows=bad)
    assert _runner(backend).evaluate(case).verdict == "pass"  # what sampling gives up
    monkeypatch.setenv(sampling.ENV, "off")
    assert _runner(backend).evaluate(case).verdict == "fail"
    monkeypatch.setenv(sampling.ENV, "auto")
    ci = [c.with_backend("interior-rows") for c in _ci_cases(("norm.rms_norm",), ("cpu",))
          if c.p["residual"] == 0 and c.p["gemma"] == 0 and c.dist == "normal"]
    recs = _runner(backend).run(ci)
    assert all(r.sample is None for r in recs)
    assert any(r.verdict == "fail" for r in recs)


def test_the_golden_cache_keeps_sampled_and_full_references_apart(monkeypatch, tmp_path):
    monkeypatch.setenv(golden_cache.ENV, str(tmp_path))
    case = ops.parse_case(BIG.format(b="cpu"))
    runs = {}
    for mode in ("0", "off", "0"):
        monkeypatch.setenv(sampling.ENV, mode)
        rec = Runner(recheck=False, noise=False).evaluate(case)
        runs.setdefault(mode, []).append(rec)
    assert len(list(tmp_path.glob("*.pkl"))) == 2
    first, again = runs["0"]
    assert again.timing.get("cache_read_s") is not None
    assert (again.verdict, again.norm_err, again.sample) == (first.verdict, first.norm_err, first.sample)
    assert runs["off"][0].sample is None


@pytest.mark.parametrize("value", ["auto", "off", "0", "4194304"])
def test_the_flag_takes_auto_off_or_a_count(value):
    from kernel_parity.conformance.cli import sample_mode

    assert sample_mode(value) == value


def test_every_declared_row_axis_counts_the_rows():
    """For every op that declares `rows`: every output is named, and on its ci cases each named input
    and output has `param` entries along its row axis (a wrong axis would sample the wrong thing)."""
    specs = [s for s in ops.match(None) if s.rows is not None]
    assert {s.name for s in specs} == set(ROW_OPS)
    for spec in specs:
        assert set(spec.outputs) <= set(spec.rows.outputs), spec.name
        seen = set()
        for case in _ci_cases((spec.name,), ("cpu", "torch", "triton")):
            if case.input_key in seen or len(seen) >= 6:
                continue
            seen.add(case.input_key)
            p = case.p
            n = p[spec.rows.param]
            inputs = spec.make_inputs(p, case.dtype, case.dist, np.random.Generator(np.random.PCG64(case.seed)))
            for name, axis in spec.rows.inputs.items():
                if name in inputs:
                    assert inputs[name].shape[axis] == n, (case.id, name)
            for name, shape in spec.output_shapes(p).items():
                assert shape[spec.rows.outputs[name]] == n, (case.id, name)
        assert seen, spec.name


def test_the_flag_reaches_the_records_and_the_html_report_says_so(tmp_path):
    from kernel_parity.conformance import cli

    suite = tmp_path / "s.toml"
    suite.write_text('[[cases]]\nop = "norm.rms_norm"\nbackends = ["cpu"]\ndtypes = ["bf16"]\ndists = ["normal"]\n'
                     'params = [{rows = 300, n = 64, pad = 0, eps = "1e-5", gemma = 0, residual = 0, rstd = 0}]\n')
    out, page = tmp_path / "r.jsonl", tmp_path / "r.html"
    assert cli.main(["run", "--suite", str(suite), "--sample", "0", "--no-progress", "-q",
                     "--json", str(out), "--html", str(page)]) == 0
    rec = [json.loads(line) for line in out.read_text().splitlines()][1]
    assert rec["sample"]["param"] == "rows" and rec["sample"]["of"] == 300 and rec["verdict"] == "pass"
    assert "Judged on a seeded sample of rows: 1 cases" in page.read_text()
    assert cli.main(["run", "--suite", str(suite), "--sample", "off", "--no-progress", "-q", "--json", str(out)]) == 0
    assert "sample" not in [json.loads(line) for line in out.read_text().splitlines()][1]


def test_repro_says_the_sample_and_takes_the_flag(capsys):
    from kernel_parity.conformance import cli

    case = BIG.format(b="cpu")
    assert cli.main(["repro", case, "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "sample   judged on " in out and "of 4096 rows (rows;" in out
    assert cli.main(["repro", case, "--sample", "off"]) == 0
    assert "sample   judged" not in capsys.readouterr().out
