"""The gate against a baseline: a kernel made slightly less accurate (still inside its tolerance)
shows as error growth and fails the gate, an unchanged kernel passes; with --bench a kernel that got
slower than the declared factor on the same device fails, and `parity bench` records time, the
throughput, the share of the ceiling measured in the same run and the peers' ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernel_parity.conformance.cli import main
from kernel_parity.reports import records

KERNEL = '''import time

import numpy as np

from kernel_parity.conformance.backends import Backend

NOISE, SLEEP = {noise!r}, {sleep!r}


def _softmax(case, inputs, out):
    x = inputs["x"].astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    y64 = e / e.sum(axis=-1, keepdims=True)
    y64 = y64 * (1.0 + NOISE * np.cos(np.arange(y64.size)).reshape(y64.shape))  # a bounded, deterministic error
    if SLEEP:
        time.sleep(SLEEP)
    y = out.numpy("y")
    y[...] = y64.astype(y.dtype)
    return {{"y": y}}


BACKEND = Backend(name="scratch", ops={{"softmax.softmax": _softmax}}, dtypes=("fp32",))
'''
ARGS = ["--backend", "scratch_kernel:BACKEND", "--op", "softmax.softmax", "--dtype", "fp32", "--dist", "normal", "--suite", "smoke",
        "--no-progress", "-q"]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "scratch_kernel.py"

    def write(noise: float = 0.0, sleep: float = 0.0) -> None:
        path.write_text(KERNEL.format(noise=noise, sleep=sleep))
        sys.modules.pop("scratch_kernel", None)

    return write


def test_error_growth_inside_the_tolerance_fails_the_gate(plugin, tmp_path, capsys):
    plugin(noise=0.0)
    assert main(["gate", *ARGS, "--json", str(tmp_path / "base.jsonl")]) == 0
    plugin(noise=5e-7)  # inside the fp32 rtol (1.3e-6 + accumulation): every case still passes
    code = main(["gate", *ARGS, "--baseline", str(tmp_path / "base.jsonl"), "--json", str(tmp_path / "new.jsonl")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert all(r["verdict"] == "pass" for r in records.load(tmp_path / "new.jsonl")["results"])
    assert "GREW" in out and "norm_err" in out
    plugin(noise=0.0)  # the tree as the baseline was taken: passes
    assert main(["gate", *ARGS, "--baseline", str(tmp_path / "base.jsonl")]) == 0


def test_a_slower_kernel_fails_a_bench_gate_on_the_same_device(plugin, tmp_path, capsys):
    plugin()
    assert main(["bench", *ARGS, "--json", str(tmp_path / "base.jsonl")]) == 0
    doc = records.load(tmp_path / "base.jsonl")
    perf = doc["results"][0]["perf"]
    assert perf["ms"] > 0 and perf["bound"] in ("read", "copy", "matmul") and perf["pct_of_ceiling"] > 0
    assert doc["header"]["ceilings"]["cpu"]["copy_gbps"] > 0
    plugin(sleep=0.05)
    code = main(["gate", *ARGS, "--bench", "--slowdown", "2", "--baseline", str(tmp_path / "base.jsonl")])
    out = capsys.readouterr().out
    assert code == 1 and "SLOWER" in out, out


def test_bench_records_the_peers_ratio(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    assert main(["bench", "--suite", "smoke", "--op", "softmax.softmax", "--dtype", "fp32", "--backend", "cpu,torch",
                 "--no-progress", "-q", "--json", str(out)]) == 0
    by_backend = {}
    for r in records.load(out)["results"]:
        by_backend.setdefault(r["backend"], []).append(r)
    cpu = by_backend["cpu"][0]["perf"]
    assert set(cpu["peers"]) == {"torch"}
    assert cpu["peers"]["torch"]["ratio"] == pytest.approx(cpu["peers"]["torch"]["ms"] / cpu["ms"])


def test_bench_beside_a_gpu_peer_on_a_machine_without_one(tmp_path, capsys, monkeypatch):
    """A GPU-only peer in a bench on a CPU machine skips its cases with the reason; the ceilings are
    measured only on devices some case runs on (no CUDA ceiling measured, no traceback)."""
    from kernel_parity.conformance.backends import liger

    monkeypatch.setattr(liger, "cuda_available", lambda: False)
    out = tmp_path / "b.jsonl"
    assert main(["bench", "--suite", "smoke", "--op", "mlp.swiglu", "--dtype", "fp32", "--backend", "cpu,liger",
                 "--no-progress", "-q", "--json", str(out)]) == 0
    doc = records.load(out)
    assert set(doc["header"]["ceilings"]) == {"cpu"}
    verdicts = {(r["backend"], r["verdict"]) for r in doc["results"]}
    assert ("liger", "skip") in verdicts and ("cpu", "pass") in verdicts


def test_a_benchmark_script_is_a_thin_caller_of_parity_bench(tmp_path, capsys):
    """benchmarks/bench_cases.run: suite entries in, parity bench's judged and timed records out, one
    row per case with every backend's figures (a skip with its reason) and each peer's time over ours."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_cases

    entries = [{"op": "norm.rms_norm", "backends": ["cpu", "torch", "liger"], "dtypes": ["bf16"],
                "grid": {"rows": 16, "n": [64, 96], "pad": 0, "eps": "1e-6", "gemma": 0, "residual": [0, 1], "rstd": 0}}]
    out = tmp_path / "bench.json"
    assert bench_cases.run(entries, out=str(out), ours="cpu") == 0
    doc = json.loads(out.read_text())
    assert len(doc["cases"]) == 4 and doc["ceilings"]["cpu"]["copy_gbps"] > 0
    for row in doc["cases"]:
        cpu, torch_, liger_ = (row["backends"][b] for b in ("cpu", "torch", "liger"))
        assert cpu["verdict"] == torch_["verdict"] == "pass" and cpu["ms"] > 0 and cpu["bound"] == "copy"
        assert liger_["verdict"] == "skip" and liger_["reason"]
        assert row["peer_ms_over_cpu"]["torch"] == pytest.approx(torch_["ms"] / cpu["ms"])
    assert "norm.rms_norm bf16 rows=16,n=64" in capsys.readouterr().out
    for name in ("gpu_norm", "gpu_mlp", "gpu_rope", "gpu_layers_bwd", "gpu_prefill"):  # each thin script's cases: a valid suite
        mod = __import__(name)
        suite = tmp_path / f"{name}.toml"
        suite.write_text(bench_cases.suite_text(mod.entries(quick=True)))
        assert main(["list", "cases", "--suite", str(suite)]) == 0


@pytest.mark.parametrize("name,op", [("torch", op) for op in ("norm.rms_norm_backward", "norm.layer_norm_backward",
                                                                "rope.rope_backward", "mlp.swiglu_backward",
                                                                "mlp.geglu_backward")]
                         + [("torch-norm", "norm.rms_norm_backward"), ("torch-norm", "norm.layer_norm_backward")])
def test_eager_torch_backward_is_timed_without_its_forward(name, op, tmp_path):
    """The eager baseline's autograd backward ops, and torch-norm's (F.rms_norm / F.layer_norm), are timed
    as benchmarks/gpu_layers_bwd.py times them: the adapter once (its forward and autograd.grad kept with
    retain_graph), then the timed call replays autograd.grad alone: no forward op runs in it (a
    TorchFunctionMode sees every Python-level torch call: the adapter makes several, the replay only
    autograd.grad), and the gradients are the adapter's."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    from kernel_parity.conformance import ops
    from kernel_parity.conformance.backends import torch_backend, torch_norm
    from kernel_parity.conformance.poison import BenchRequest
    from kernel_parity.conformance.runner import Prepared, case_outputs

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    backend = torch_backend.make() if name == "torch" else torch_norm.BACKEND()
    case = next(c for c in suites_cases(op, name) if backend.supports(c) is None)
    prep = Prepared(ops.get(op), case)
    inputs = {k: v.copy() for k, v in prep.inputs.items()}
    req = BenchRequest({k: v for k, v in prep.shapes.items() if k in case_outputs(prep)}, prep.out_dtypes,
                       dict(prep.pads), backend=backend, device=backend.device)
    with Seen() as whole:
        backend.run(case, inputs, req)
    call, what = backend.timed[op](case, inputs, req)
    with Seen() as timed:
        call()
    assert what and "forward ran once, untimed" in what
    assert len(whole.calls) > 3 and not [c for c in timed.calls if "grad" not in c], timed.calls
    doc = tmp_path / "b.jsonl"
    assert main(["bench", "--suite", "ci", "--op", op, "--backend", name, "--dtype", "fp32", "--dist", "normal",
                 "--no-progress", "-q", "--no-isolate", "--json", str(doc)]) in (0, 1)
    perfs = [r["perf"] for r in records.load(doc)["results"] if r.get("perf") and "ms" in r["perf"]]
    assert perfs and all(p["timed"] == what for p in perfs)


def suites_cases(op, backend="torch"):
    from kernel_parity.conformance import suites

    return suites.cases("ci", suites.Filters(ops=(op,), backends=(backend,), dtypes=("fp32",), dists=("normal",)))
