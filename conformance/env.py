"""The environment header of a results document: what ran, where, when."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from kernel_parity.conformance import __version__


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_state(root: Path | None = None) -> tuple[str | None, str | None]:
    """(commit, tree): HEAD's commit (with "-dirty" when tracked files differ from it) and the git tree id of the
    files as they are in the working tree, tracked and untracked (not ignored): HEAD's tree when clean and nothing
    is untracked, else one built in a temporary index and object directory (the repository is not written). A copy
    whose .git lags its files (a device machine's copy of a working tree, where files added since are untracked)
    still names the tree that ran: compare it with `git rev-parse COMMIT^{tree}`."""
    root = root or Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or not shutil.which("git"):
        return None, None

    def git(*args: str, env: dict | None = None) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, env=env)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return None, None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if not dirty and not git("ls-files", "--others", "--exclude-standard"):
        return head, git("rev-parse", "HEAD^{tree}")
    objects = git("rev-parse", "--git-path", "objects")  # relative to root unless absolute
    tree = None
    if objects:
        objects = str(root / objects)
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"),
                       GIT_OBJECT_DIRECTORY=str(Path(tmp) / "objects"), GIT_ALTERNATE_OBJECT_DIRECTORIES=objects)
            (Path(tmp) / "objects").mkdir()
            if git("read-tree", "HEAD", env=env) is not None and git("add", "-A", env=env) is not None:
                tree = git("write-tree", env=env)
    return head + ("-dirty" if dirty else ""), tree


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
    commit, tree = git_state()
    return {
        "package_version": __version__,
        "git_commit": commit,
        "git_tree": tree,
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
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
