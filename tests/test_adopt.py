"""An outside kernel repo adopts kernel-parity by following the README's "Adopt it in your kernel
repo" section literally: its files are the section's code blocks (each starts with `# <path>`),
its commands the section's shell blocks. The repo has a `kernels/` package of its own, an
entry-point backend, an op family of its own, a `[tool.kernel-parity]` table and a known failure.

It is installed beside kernel-parity in a fresh virtual environment (which sees this project's
installed dependencies through a .pth file; pip runs offline: --no-deps --no-build-isolation), and:
`parity gate` there runs its suites on its backend and exits 0 (its listed failure is an xfail),
1 once a bug is seeded in its kernel; `pytest -n 2` writes one merged report with every record.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ["--no-deps", "--no-build-isolation", "-q"]


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
    return subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


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
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = next(venv.glob("lib/python*/site-packages"))
    (purelib / "kernel_parity_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv))
    install, usage = shells[0], shells[-1]
    for cmd in install:  # the README's install lines, with the offline flags
        cmd = cmd.replace("<path to kernel-parity>", str(ROOT)) + " " + " ".join(OFFLINE)
        r = _run(cmd, repo, env)
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return repo, env, usage


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
