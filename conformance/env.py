"""The environment header of a results document: what ran, where, when."""

from __future__ import annotations

import datetime as _dt
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kernel_parity.conformance import __version__


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or not shutil.which("git"):
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> tuple[str | None, str | None]:
    """(device name, driver version) when torch sees a CUDA device."""
    if "torch" not in sys.modules and not _version("torch"):
        return None, None
    try:
        import torch

        if not torch.cuda.is_available():
            return None, None
        name = torch.cuda.get_device_name(0)
    except Exception:
        return None, None
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
            driver = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return name, driver


def cpu_name() -> str:
    """The CPU as results files name it: model and core count."""
    return f"{_cpu_name()} ({_cpu_count()} cores)"


def header(command: str | None = None, suite: str | None = None) -> dict:
    gpu, driver = _gpu()
    cpu = cpu_name()
    return {
        "package_version": __version__,
        "git_commit": _git_commit(),
        "device": gpu or cpu,
        "gpu": gpu,
        "cpu": cpu,
        "driver": driver,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "numpy": _version("numpy"),
        "ml_dtypes": _version("ml_dtypes"),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "suite": suite,
    }


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
