"""Writing report files safely: through symlinks, never over a device or FIFO, never over an input.

- `write_text(path, text)`: a regular file (or a path that does not exist yet) is replaced
  atomically (readers see the old file or the whole new one); a symlink is followed and its
  target is written, the link stays; a character device, FIFO or socket (`/dev/stdout`,
  `/dev/null`, a named pipe) is written into, never replaced.
- `open_stream(path)`: the same rules for a file written line by line (the JSON-lines results
  stream): the target of a symlink, a device or FIFO as it is.
- `check_outputs({flag: path}, inputs={what: path})`: before a run starts, every output path must
  be writable where it points (probed: a temporary file is created and removed in the directory
  it lands in, because permission bits say nothing for root, /proc or a read-only mount; a device
  must open for writing, and /dev/full never can), be no directory, be given once, and be none of
  the run's input files; the first problem is an OutputPathError naming the flag, the path and
  what is wrong. `check_output_dir` does the same for a directory output (`repro --export DIR`).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO


class OutputPathError(ValueError):
    """An output path that cannot be written as asked (one line; a usage error)."""


def _target(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: symlinks followed (a dangling link's target included)."""
    return Path(os.path.realpath(path))


def _special(p: Path) -> bool:
    """A character/block device, FIFO or socket: written into, never replaced."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` (see the module docstring for what happens at each kind of path)."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path`: atomically for a regular file, into a device or FIFO as it is."""
    target = _target(path)
    if _special(target):
        with open(target, "wb") as f:
            f.write(data)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        # mkstemp makes 0600; a report is for others to read (CI artifacts, a web server)
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_stream(path: str | os.PathLike, append: bool = False) -> IO[str]:
    """A text file to write line by line at `path` (followed through symlinks)."""
    target = _target(path)
    if not _special(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    return open(target, "a" if append else "w", encoding="utf-8", buffering=1)


_DEV_FULL = (1, 7)  # Linux's /dev/full: every write fails with ENOSPC, by design


def _probe_dir(d: Path) -> str | None:
    """None if a file can really be created in the existing directory `d` (a temporary file is
    made and removed: permission bits say nothing for root, nor for /proc or a read-only mount)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".parity-probe-", dir=d)
    except OSError as e:
        return f"no file can be created in {str(d)!r} ({e.strerror or type(e).__name__})"
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return None


def _writable_dir(d: Path) -> str | None:
    """None if files can be created in `d` (or in the directories it would be made in)."""
    probe = d
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing directory above {str(d)!r}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is not a directory"
    return _probe_dir(probe)


def _check_special(flag: str, raw: str, target: Path) -> None:
    """A device, FIFO or socket written into: it must open for writing and not be /dev/full."""
    st = os.stat(target)
    if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == _DEV_FULL:
        raise OutputPathError(f"{flag} {raw!r} cannot be written: every write to it fails (no space left)")
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        if not os.access(target, os.W_OK):
            raise OutputPathError(f"{flag} {raw!r} is not writable")
        return  # opening a FIFO for writing waits for its reader: the write itself will tell
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)))
    except OSError as e:
        raise OutputPathError(f"{flag} {raw!r} cannot be opened for writing ({e.strerror or e})") from None


def _resolved(flag: str, path: str | os.PathLike, what: str) -> tuple[str, Path]:
    """(the path as given, where a write lands); OutputPathError for an empty or NUL-holding path."""
    raw = os.fspath(path)
    if not raw.strip():
        raise OutputPathError(f"{flag} needs a {what} path, got an empty string")
    if "\0" in raw:
        raise OutputPathError(f"{flag} {raw!r} is not a valid path (it holds a NUL byte)")
    return raw, _target(raw)


def _creatable(flag: str, raw: str, d: Path) -> None:
    why = _writable_dir(d)
    if why:
        raise OutputPathError(f"{flag} {raw!r} cannot be written: {why}")


def check_output(flag: str, path: str | os.PathLike) -> None:
    """OutputPathError unless `path` can be written as the output (a file) of `flag`."""
    raw, target = _resolved(flag, path, "file")
    if target.is_dir():
        raise OutputPathError(f"{flag} {raw!r} is a directory, expected a file path")
    if target.exists() and _special(target):
        _check_special(flag, raw, target)
        return
    _creatable(flag, raw, target.parent)  # a regular file is replaced through a temporary file beside it


def check_output_dir(flag: str, path: str | os.PathLike, names: tuple[str, ...] = ()) -> None:
    """OutputPathError unless `path` is (or can be made) a directory in which the files `names`
    can be written."""
    raw, target = _resolved(flag, path, "directory")
    if target.exists() and not target.is_dir():
        raise OutputPathError(f"{flag} {raw!r} is a file, expected a directory (it is created if missing)")
    _creatable(flag, raw, target)
    for n in names:
        if (target / n).is_dir():
            raise OutputPathError(f"{flag} {raw!r}: {n!r} in it is a directory, and a file of that name is written there")


def check_output_or_exit(prog: str, flag: str, path: str | os.PathLike) -> None:
    """For scripts (benchmarks/): exit 2 with one line before any work when `path` cannot be written."""
    try:
        check_output(flag, path)
    except OutputPathError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        ta, tb = _target(a), _target(b)
    except (ValueError, OSError):  # a path with a NUL byte is no file (its own check names it)
        return False
    if ta == tb:
        return True
    try:
        return ta.exists() and tb.exists() and os.path.samefile(ta, tb)
    except OSError:
        return False


def check_outputs(outputs: dict[str, str | os.PathLike | None],
                  inputs: dict[str, str | os.PathLike | None] | None = None) -> None:
    """Check every given output path before anything runs (OutputPathError on the first problem)."""
    given = [(flag, p) for flag, p in outputs.items() if p is not None]
    for flag, p in given:
        check_output(flag, p)
    for i, (flag, p) in enumerate(given):
        for flag2, p2 in given[i + 1:]:
            if same_file(p, p2) and not _special(_target(p)):
                raise OutputPathError(f"{flag} and {flag2} name the same file {os.fspath(p)!r}")
        for what, src in (inputs or {}).items():
            if src is not None and same_file(p, src) and not _special(_target(p)):
                raise OutputPathError(f"{flag} {os.fspath(p)!r} is the {what}: an output never overwrites an input")
