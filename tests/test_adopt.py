"""An outside kernel repo adopts kernel-parity by following the README's "Adopt it in your kernel
repo" section literally: its files are the section's code blocks (each starts with `# <path>`),
its commands the section's shell blocks. The repo has a `kernels/` package of its own, an
entry-point backend, an op family of its own, a `[tool.kernel-parity]` table and a known failure.

The venv is truly fresh: `python -m venv` with its own pip, no access to this project's
site-packages (no .pth file, no system site-packages; torch, which kernel-parity does not depend
on, is not importable there), and the README's install lines run as written, installing from this
checkout (pip takes wheels from its local cache or find-links where it can). So a README whose
install line lacks what the section then runs (pytest, hypothesis, pytest-xdist) fails here.
`parity gate` there runs its suites on its backend and exits 0 (its listed failure is an xfail),
1 once a bug is seeded in its kernel; `pytest -n 2` writes one merged report with every record.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parent.parent


def readme_section() -> tuple[dict[str, str], list[list[str]]]:
    """({path: text} of the file blocks, [commands of each shell block]) of the adoption section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Adopt it in your kernel repo", 1)[1].split("\n## ", 1)[0]
    files, shells = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        first, _, rest = body.partition("\n")
        if lang in ("sh", "bash"):
            shells.append([ln for ln in body.splitlines() if ln.strip() and not ln.startswith("#")])
        elif first.startswith("# "):
            files[first[2:].strip()] = rest
    return files, shells


def _run(cmd: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def fresh_venv(where: Path) -> tuple[Path, dict]:
    """A new virtual environment with its own pip and nothing else; (its folder, the environment
    variables of a shell that activated it)."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv), PYTHONNOUSERSITE="1")
    return venv, env


@pytest.fixture(scope="module")
def adopter(tmp_path_factory):
    files, shells = readme_section()
    assert {"pyproject.toml", "kernels/softmax.py", "acme_parity/__init__.py", "acme_parity/ops.py",
            "parity/suite.toml", "parity/known_failures.toml", "tests/test_acme.py"} <= set(files)
    base = tmp_path_factory.mktemp("adopt")
    repo = base / "acme-kernels"
    for path, body in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(body)
    venv, env = fresh_venv(base)
    probe = _run("python -c 'import sys, site; print(sys.prefix); print(site.getsitepackages())'", repo, env)
    assert probe.returncode == 0 and str(venv) in probe.stdout.splitlines()[0], probe.stdout + probe.stderr
    isolated = _run("python -c 'import torch'", repo, env)
    assert isolated.returncode != 0, "the adopter's venv sees this project's packages (torch imports there)"
    install, usage = shells[0], shells[-1]
    for cmd in install:  # the README's install lines, as written
        cmd = cmd.replace("<path to kernel-parity>", str(ROOT))
        r = _run(cmd, repo, env)
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr[-3000:]}"
    return repo, env, usage


def test_the_venv_is_fresh_and_the_install_line_brings_what_the_section_runs(adopter):
    repo, env, usage = adopter
    r = _run("python -c 'import torch'", repo, env)
    assert r.returncode != 0  # still nothing of this project's environment
    for module in ("pytest", "hypothesis", "xdist", "kernel_parity"):
        r = _run(f"python -c 'import {module}'", repo, env)
        assert r.returncode == 0, f"the README's install line does not bring {module}: {r.stderr[-500:]}"


def test_parity_gate_runs_the_adopters_suites_with_its_backends(adopter):
    repo, env, usage = adopter
    config, gate = usage[0], usage[1]
    r = _run(config, repo, env)
    assert r.returncode == 0, r.stderr
    assert "backends        ['acme']" in r.stdout and "[tool.kernel-parity].backends" in r.stdout
    assert "tolerance" in r.stdout and "rounds the factor to bf16" in r.stdout
    r = _run(gate, repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = records.load(repo / "build" / "gate.jsonl")
    verdicts = {}
    for rec in doc["results"]:
        verdicts.setdefault((rec["op"], rec["dist"]), set()).add(rec["verdict"])
    assert {rec["backend"] for rec in doc["results"]} == {"acme"}
    assert verdicts[("softmax.softmax", "masked")] == {"xfail"}  # its own known failure
    assert verdicts[("softmax.softmax", "large")] == {"pass"} and verdicts[("acme.scale", "normal")] == {"pass"}
    assert (repo / "build" / "gate.html").read_text().startswith("<!DOCTYPE html>")
    assert doc["header"]["tolerance_overrides"][0]["op"] == "acme.scale"
    # The seeded bug: no max subtraction, so large logits overflow. The gate must exit 1.
    kernel = repo / "kernels" / "softmax.py"
    good = kernel.read_text()
    kernel.write_text(good.replace("x - x.max(axis=-1, keepdims=True)", "x"))
    try:
        r = _run(gate, repo, env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "FAIL softmax.softmax/acme/" in r.stdout and "/large/" in r.stdout
    finally:
        kernel.write_text(good)


def test_pytest_under_xdist_writes_one_merged_report_with_every_record(adopter):
    repo, env, usage = adopter
    pytest_cmd = usage[2]
    assert " -n 2 " in pytest_cmd
    r = _run(pytest_cmd, repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    merged = records.load(repo / "build" / "pytest.jsonl")
    serial_cmd = pytest_cmd.replace(" -n 2 ", " ").replace("build/pytest.", "build/serial.")
    r = _run(serial_cmd, repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    serial = records.load(repo / "build" / "serial.jsonl")
    ids = sorted(rec["id"] for rec in merged["results"])
    assert ids == sorted(rec["id"] for rec in serial["results"]) and len(ids) >= 20
    assert {rec["op"] for rec in merged["results"]} == {"acme.scale", "softmax.softmax"}
