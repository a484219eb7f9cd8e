"""Writing report files safely: through symlinks, never over a device or FIFO, never over an input.

- `write_text(path, text)`: a regular file (or a path that does not exist yet) is replaced
  atomically (readers see the old file or the whole new one); a symlink is followed and its
  target is written, the link stays; a character device, FIFO or socket (`/dev/stdout`,
  `/dev/null`, a named pipe) is written into, never replaced.
- `open_stream(path)`: the same rules for a file written line by line (the JSON-lines results
  stream): the target of a symlink, a device or FIFO as it is.
- `check_outputs({flag: path}, inputs={what: path})`: before a run starts, every output path must
  be writable where it points, be no directory, be given once, and be none of the run's input
  files; the first problem is an OutputPathError naming the flag, the path and what is wrong.
"""

from __future__ import annotations

import os
import stat
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
    target = _target(path)
    if _special(target):
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        # mkstemp makes 0600; a report is for others to read (CI artifacts, a web server)
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
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


def _writable_dir(d: Path) -> str | None:
    """None if files can be created in `d` (or in the directories it would be made in)."""
    probe = d
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing directory above {str(d)!r}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"directory {str(probe)!r} is not writable"
    return None


def check_output(flag: str, path: str | os.PathLike) -> None:
    """OutputPathError unless `path` can be written as the output of `flag`."""
    raw = os.fspath(path)
    if not raw.strip():
        raise OutputPathError(f"{flag} needs a file path, got an empty string")
    target = _target(raw)
    if target.is_dir():
        raise OutputPathError(f"{flag} {raw!r} is a directory, expected a file path")
    if target.exists():
        if _special(target):
            if not os.access(target, os.W_OK):
                raise OutputPathError(f"{flag} {raw!r} is not writable")
            return
        if not os.access(target, os.W_OK) and not os.access(target.parent, os.W_OK | os.X_OK):
            raise OutputPathError(f"{flag} {raw!r} is not writable")
    why = _writable_dir(target.parent)
    if why:
        raise OutputPathError(f"{flag} {raw!r} cannot be written: {why}")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    ta, tb = _target(a), _target(b)
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
