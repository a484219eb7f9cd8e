"""The one ctypes loader for the native CPU kernels, and the calling convention they share.

`load(stem)` compiles `kernels/cpu/<stem>.c` (with the headers it includes) into a shared library
on first use and caches it on disk and in-process:

- cache dir: `$KERNEL_PARITY_CACHE`, else `$XDG_CACHE_HOME/kernel-parity`, else
  `~/.cache/kernel-parity`; libraries go in its `cpu/` folder;
- file name: `<stem>-<sha256 of source, headers, compiler identity, flags, machine>.so`, so a changed
  source, header, flag or compiler builds a new library instead of loading a stale one;
- built into a temporary file and moved into place with `os.replace`, so two processes building at
  once each install a complete library and a crash never leaves a truncated one;
- compiler: `$CC` if set (may hold arguments, e.g. "ccache gcc"), else the first of cc, gcc, clang.
  Without one, or when compilation fails, `CompilerUnavailable` says why in one line.

Flags: -O3 with IEEE semantics kept. No -ffast-math (it assumes no inf/NaN, and masking is -inf).
-ffp-contract=off keeps FMA contraction off, so every ISA path rounds identically;
-fno-trapping-math only drops FP-exception-flag fidelity, which lets GCC if-convert the branch-free
selects and vectorise them. No -march=native: the sources compile AVX2 and AVX-512 variants with
target attributes and choose at run time (common.h), so a cached library is valid on any x86-64.

Calling convention (used by the wrappers in this folder): strides are passed in elements, dtypes
as codes (`DTYPE_CODES`), and kernels return 0 or an error code (`check_status`).
Nothing happens at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["CompilerUnavailable", "load", "DTYPE_CODES", "dtype_code", "check_status", "element_strides",
           "unit_last_strides", "row_stride", "check_array", "check_output"]

SRC_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-trapping-math",
         "-fvisibility=hidden")
LIBS = ("-lm",)
_BUILD_VERSION = "1"  # bump when the build recipe changes in a way the key does not see
_COMPILERS = ("cc", "gcc", "clang")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class CompilerUnavailable(RuntimeError):
    """No usable C compiler, or the kernel source failed to compile; the message is one line."""


def load(stem: str) -> ctypes.CDLL:
    """The compiled `kernels/cpu/<stem>.c`, built and cached on first use."""
    with _lock:
        lib = _loaded.get(stem)
        if lib is None:
            lib = _loaded[stem] = ctypes.CDLL(str(_build(stem)))
        return lib


def warm(jobs: int = 2) -> tuple[list[str], float, Path | None]:
    """Compile every kernels/cpu/*.c whose library is not cached yet, `jobs` compilers at a time,
    before worker processes would each build what they need (the first run on a machine):
    (stems built, seconds, the cache folder). A source that fails to build is left to the case
    that loads it, which records the compiler's one-line error."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    try:
        stems = [p.stem for p in sorted(SRC_DIR.glob("*.c")) if not _target(p.stem)[1].is_file()]
    except CompilerUnavailable:
        return [], 0.0, None
    if not stems:
        return [], 0.0, _cache_dir()
    t0 = time.perf_counter()

    def build(stem: str) -> str | None:
        try:
            _build(stem)
            return stem
        except CompilerUnavailable:
            return None

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        built = [s for s in pool.map(build, stems) if s]
    return built, time.perf_counter() - t0, _cache_dir()


def _target(stem: str) -> tuple[Path, Path]:
    """(source, the cached library's path): the name carries a hash of everything that builds it."""
    source = SRC_DIR / f"{stem}.c"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stem) or not source.is_file():
        raise ValueError(f"stem must name a C source in {SRC_DIR}, got {stem!r}")
    cc = _find_compiler()
    key = hashlib.sha256()
    for part in (_BUILD_VERSION, _compiler_identity(cc), " ".join(cc), " ".join(FLAGS + LIBS),
                 platform.machine()):
        key.update(part.encode() + b"\0")
    for path in [source, *_headers(source)]:
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return source, _cache_dir() / f"{stem}-{key.hexdigest()[:24]}.so"


def _build(stem: str) -> Path:
    source, target = _target(stem)
    cc = _find_compiler()
    out_dir = target.parent
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [*cc, *FLAGS, "-o", tmp, str(source), *LIBS]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CompilerUnavailable(f"{cc[0]} failed on {source.name}: {_one_line(str(e))}") from None
        if proc.returncode != 0:
            raise CompilerUnavailable(
                f"{cc[0]} failed on {source.name}: {_first_error(proc.stderr or proc.stdout)}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600; a shared cache needs it readable
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _find_compiler() -> list[str]:
    env_cc = os.environ.get("CC", "").strip()
    if env_cc:
        cmd = shlex.split(env_cc)
        if shutil.which(cmd[0]):
            return cmd
        raise CompilerUnavailable(f"$CC={env_cc!r} is not an executable on PATH")
    for name in _COMPILERS:
        path = shutil.which(name)
        if path:
            return [path]
    raise CompilerUnavailable("no C compiler found (tried $CC, cc, gcc, clang)")


_identity: dict[tuple[str, ...], str] = {}


def _compiler_identity(cc: list[str]) -> str:
    """First line of `cc --version` (resolves what `cc` points at, e.g. 'cc (Debian 12.2.0-14) 12.2.0')."""
    key = tuple(cc)
    if key not in _identity:
        try:
            proc = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CompilerUnavailable(f"{cc[0]} --version failed: {_one_line(str(e))}") from None
        lines = (proc.stdout or proc.stderr).strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise CompilerUnavailable(f"{cc[0]} --version failed (exit {proc.returncode})")
        _identity[key] = lines[0].strip()
    return _identity[key]


def _headers(source: Path) -> list[Path]:
    """Local headers `source` includes, transitively, in first-seen order."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_bytes()):
            path = SRC_DIR / name.decode()
            if path.is_file() and path not in seen:
                seen.append(path)
                todo.append(path)
    return seen


def _cache_dir() -> Path:
    root = os.environ.get("KERNEL_PARITY_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "kernel-parity"
    path = base / "cpu"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompilerUnavailable(f"cannot create kernel cache dir {path}: {e.strerror}") from None
    return path


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return _one_line(ln)
    return _one_line(lines[0]) if lines else "no diagnostics"


# ---- calling convention shared by the wrappers -------------------------------------------------

DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 0,
    np.dtype(np.float16): 1,
    np.dtype(ml_dtypes.bfloat16): 2,
}
_STATUS = {1: "unsupported dtype code", 2: "out of memory"}


def dtype_code(dtype: np.dtype) -> int:
    return DTYPE_CODES[np.dtype(dtype)]


def check_status(status: int, kernel: str) -> None:
    if status == 2:
        raise MemoryError(f"{kernel}: out of memory for the fp32 row buffer")
    if status != 0:
        raise RuntimeError(f"{kernel} returned {status} ({_STATUS.get(status, 'unknown error')})")


def element_strides(name: str, a: np.ndarray) -> tuple[int, ...]:
    """`a`'s strides in elements; 0 for axes of extent <= 1 and for empty arrays, whose strides numpy
    leaves arbitrary and which are never dereferenced.

    ValueError when `a` is not aligned to its element size or a stride is not a whole element count.
    """
    size = a.itemsize
    if a.size == 0:
        return (0,) * a.ndim
    strides = tuple(0 if n <= 1 else s for n, s in zip(a.shape, a.strides))
    if not a.flags.aligned or any(s % size for s in strides):
        raise ValueError(f"{name} must be aligned to its {size}-byte elements, got strides "
                         f"{a.strides} bytes at address {a.ctypes.data:#x}")
    return tuple(s // size for s in strides)


def unit_last_strides(name: str, a: np.ndarray) -> tuple[int, ...]:
    """`a`'s element strides; ValueError unless its last axis is unit-stride (the kernels read rows
    as contiguous runs and take no copy)."""
    strides = element_strides(name, a)
    if a.shape[-1] > 1 and a.size > 0 and strides[-1] != 1:
        raise ValueError(f"{name} last-axis stride must be 1 element, got {strides[-1]} "
                         f"(strides {a.strides} bytes); no copy is made")
    return strides


def row_stride(name: str, a: np.ndarray, width: str = "n") -> int:
    """Row stride in elements of a (rows, n) array; ValueError unless its last axis is unit-stride and
    its rows are disjoint (stride >= n, named `width` in the message)."""
    stride_row = unit_last_strides(name, a)[0]
    rows, n = a.shape
    if a.size and rows > 1 and stride_row < n:
        raise ValueError(f"{name} row stride must be >= {width} = {n} elements, got {stride_row} "
                         f"(strides {a.strides} bytes): rows would overlap")
    return stride_row


def check_array(name: str, a: object, ndim: int, layout: str, dtypes: tuple[np.dtype, ...]) -> np.ndarray:
    """ValueError unless `a` is an ndarray with `ndim` axes and one of `dtypes` (`layout` names the axes)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray {layout}, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {a.shape}")
    if a.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype must be one of {names}, got {a.dtype}")
    return a


def check_output(name: str, a: object, shape: tuple[int, ...], dtype: np.dtype, layout: str) -> np.ndarray:
    """ValueError unless `a` is a writeable ndarray of exactly `shape` and `dtype`."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray {layout}, got {type(a).__name__}")
    if a.shape != shape or a.dtype != dtype:
        raise ValueError(f"{name} must have shape {shape} and dtype {dtype}, got shape {a.shape} "
                         f"and dtype {a.dtype}")
    if not a.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return a
