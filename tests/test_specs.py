"""Self-tests of the op registry: the one-stem rule, goldens, backends, suites."""

import importlib
from pathlib import Path

import numpy as np
import pytest

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import BUILTIN, Registry
from kernel_parity.conformance.runner import Prepared

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(ops.all_specs())


@pytest.mark.parametrize("name", SPECS)
def test_op_has_golden_and_stem_files(name):
    spec = ops.get(name)
    golden = getattr(importlib.import_module(f"kernel_parity.refimpl.{spec.stem}"), spec.function, None)
    assert golden is not None and golden is spec.golden, f"refimpl.{spec.stem}.{spec.function} is not the golden"
    assert (ROOT / "conformance" / "ops" / f"{spec.stem}.py").exists()
    assert (ROOT / "property_tests" / f"test_{spec.stem}.py").exists()
    for folder, ext in (("triton", "py"), ("cpu", "c"), ("torch", "py")):
        if folder in spec.backends:
            assert (ROOT / "kernels" / folder / f"{spec.stem}.{ext}").exists(), f"missing kernels/{folder}/{spec.stem}.{ext}"


@pytest.mark.parametrize("name", SPECS)
def test_spec_backends_exist_and_implement_the_op(name):
    spec = ops.get(name)
    registry = Registry()
    for b in spec.backends:
        assert b in BUILTIN
        assert name in registry.get(b).ops, f"backend {b} has no adapter for {name}"
    assert spec.baseline is None or spec.baseline in registry.names()


@pytest.mark.parametrize("name", SPECS)
def test_spec_tolerance_covers_every_output_dtype(name):
    spec = ops.get(name)
    params = {k: p.edge_values()[0] for k, p in spec.params.params.items()}
    for dtype in spec.dtypes:
        for out_name, out in spec.all_outputs().items():
            if out.exact:
                continue
            for tier in ("production", "baseline"):  # a dtype without default limits raises here
                lim = spec.tolerance.limits(out_name, spec.tol_dtype(out_name, dtype), params, tier)
                assert lim.rtol > 0 and lim.atol > 0, f"{name} {out_name} {dtype}: limits of zero"


@pytest.mark.parametrize("name", SPECS)
def test_inputs_are_deterministic_and_rounded(name):
    spec = ops.get(name)
    case = next(c for c in suites.cases("smoke") if c.op == name)
    a, b = Prepared(spec, case), Prepared(spec, case)
    for k in a.inputs:
        assert a.inputs[k].dtype == b.inputs[k].dtype
        assert np.array_equal(a.inputs[k].view(np.uint8), b.inputs[k].view(np.uint8))
    for k in a.golden:
        assert np.array_equal(a.golden[k], b.golden[k], equal_nan=True)


@pytest.mark.parametrize("suite", suites.names())
def test_suites_load_and_name_only_known_ops_and_backends(suite):
    cases = suites.cases(suite)
    assert cases
    assert {c.backend for c in cases} <= set(Registry().names())
    assert len({c.id for c in cases}) == len(cases)


def test_ci_suite_covers_the_edges():
    cases = suites.cases("ci")
    sm = [c for c in cases if c.op == "softmax.softmax"]
    lengths = {c.p["n"] for c in sm}
    assert {1, 17, 113, 127, 129, 239}.issubset(lengths)  # 1, primes, 2^k +- 1
    assert {"masked"}.issubset({c.dist for c in sm})  # fully -inf rows
    assert any(c.p["pad"] for c in sm)
    comb = [c for c in cases if c.op == "combine.lse_combine"]
    assert "empty" in {c.dist for c in comb} and 1 in {c.p["splits"] for c in comb}
    assert {c.dtype for c in cases} == {"fp32", "fp16", "bf16", "int32"}  # int32: mla.schedule
    assert {c.backend for c in cases} == {"triton", "triton-q8", "cpu", "torch", "sdpa-cpu", "gguf", "ggml", "torch-norm",
                                          "gluon"}
    ops_in_suite = {c.op for c in cases}
    assert ops_in_suite == set(ops.all_specs())  # every op is gated


def test_nothing_happens_at_import():
    """Importing the packages compiles nothing and reads no environment (STYLE rule 2)."""
    import subprocess
    import sys

    code = ("import os, sys; os.environ.pop('TRITON_INTERPRET', None);"
            "import kernel_parity.refimpl.softmax, kernel_parity.refimpl.combine, kernel_parity.conformance.cli;"
            "import kernel_parity.conformance.runner, kernel_parity.conformance.ops as ops;"
            "ops.all_specs();"
            "assert 'TRITON_INTERPRET' not in os.environ;"
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in ('torch','triton'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


PACKAGE_FOLDERS = {"refimpl": "kernel_parity.refimpl", "kernels": "kernel_parity.kernels",
                   "conformance": "kernel_parity.conformance", "reports": "kernel_parity.reports",
                   "property_tests": "kernel_parity.property_tests"}


def test_one_import_namespace():
    """Every package folder installs under kernel_parity (pyproject's list is complete), and no
    source imports a bare top-level name (`import conformance`) that a user's repo may own."""
    import ast
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"kernel_parity"}
    for folder, pkg in PACKAGE_FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((pkg, *rel)))
    assert declared == found
    bare = set(PACKAGE_FOLDERS)
    for folder in (*PACKAGE_FOLDERS, "tests", "benchmarks", "kernel_parity"):
        for src in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(src.read_text(), str(src))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for n in names:
                    assert n.split(".")[0] not in bare, f"{src.relative_to(ROOT)} imports {n}: use kernel_parity.{n}"

def test_no_import_cycles_in_the_framework():
    """Imports inside conformance/ (module level and inside functions) form no cycle: the CLI sits
    on top (nothing imports it), exit codes live with the errors, one session serves the CLI and
    the pytest plugin."""
    import ast

    pkg = ROOT / "conformance"
    modules = {}
    for src in pkg.rglob("*.py"):
        rel = src.relative_to(pkg).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        modules[name or "__init__"] = src
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, src in modules.items():
        for node in ast.walk(ast.parse(src.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernel_parity.conformance"):
                base = node.module[len("kernel_parity.conformance"):].lstrip(".")
                targets = [f"{base}.{a.name}" if base else a.name for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name[len("kernel_parity.conformance."):] for a in node.names
                           if a.name.startswith("kernel_parity.conformance.")]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod and t != "__init__":
                    graph[mod].add(t)
    assert not any("cli" in deps for deps in graph.values()), "nothing may import the CLI"

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    for m in graph:
        assert cycle_from(m) is None, f"import cycle: {' -> '.join(cycle_from(m))}"
