"""Which op families a change touches: `parity gate --changed-since REF`.

The files changed since REF (committed, staged, unstaged and untracked: `git diff --name-only REF`
plus `git ls-files --others --exclude-standard`) are mapped to the op families whose verdicts they can
change, each with the reason:

- a family's own files, by stem: refimpl/<stem>*.py, conformance/ops/<stem>*.py,
  conformance/backends/<stem>.py, kernels/{triton,cpu,torch}/<stem>*.{py,c,h},
  property_tests/test_<stem>*.py (`gemm_gemv.py` and `attention_bwd.py` are gemm's and attention's:
  the longest family stem that the file name starts with, followed by `_` or nothing);
- everything that imports a changed Python module, transitively (a change to the combine kernel
  reaches attention's split-KV decode, a change to refimpl/norm.py reaches the fused blocks' golden),
  and every C source that includes a changed header;
- a plugin backend's declared source files (`Backend.sources`, globs relative to the repository
  root): the families of the ops it implements;
- the framework (conformance/ outside ops/ and backends/, reports/, the build files, suites, known
  failures): every family, since any verdict may move.
Documentation (*.md) and benchmarks/ change no verdict.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kernel_parity.conformance.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("refimpl", "kernels", "conformance", "reports", "property_tests")
FRAMEWORK = ("conformance/", "reports/", "kernel_parity/", "pyproject.toml", "Makefile", "setup.py", "setup.cfg")
NO_VERDICT = ("benchmarks/", "tests/", ".ci/")


@dataclass
class Selection:
    """Families a change touches, each with why; `everything` when the framework changed."""

    files: list[str]
    families: dict[str, list[str]] = field(default_factory=dict)  # stem -> reasons
    everything: str | None = None  # why every family is selected

    def add(self, stem: str, why: str) -> None:
        reasons = self.families.setdefault(stem, [])
        if why not in reasons:
            reasons.append(why)


def git_changed(ref: str, root: Path = ROOT) -> list[str]:
    """Repository-relative paths changed since `ref` (working tree included); UsageError for a bad ref."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError(f"--changed-since {ref!r}: git is not usable here ({e})") from None
        if out.returncode != 0:
            first = (out.stderr.strip().splitlines() or ["git failed"])[0]
            raise UsageError(f"--changed-since {ref!r}: {first}")
        return out.stdout

    if not ref or ref.startswith("-"):
        raise UsageError(f"--changed-since {ref!r} is not a git revision")
    git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    names = git("diff", "--name-only", ref, "--").splitlines() + git("ls-files", "--others", "--exclude-standard").splitlines()
    return sorted(dict.fromkeys(n for n in names if n.strip()))


def _stem_of(name: str, stems: list[str]) -> str | None:
    """The longest family stem that `name` starts with, followed by `_` or nothing."""
    for stem in sorted(stems, key=len, reverse=True):
        if name == stem or name.startswith(stem + "_"):
            return stem
    return None


def _own_family(path: str, stems: list[str]) -> str | None:
    parts = path.split("/")
    name = Path(path).stem
    if parts[0] == "refimpl" and len(parts) == 2:
        return _stem_of(name, stems)
    if parts[:2] in (["conformance", "ops"], ["conformance", "backends"]) and len(parts) == 3:
        return _stem_of(name, stems)
    if parts[0] == "kernels" and len(parts) == 3:
        return _stem_of(name, stems)
    if parts[0] == "property_tests" and name.startswith("test_"):
        return _stem_of(name[len("test_"):], stems)
    return None


def _module_of(path: str) -> str | None:
    parts = Path(path).with_suffix("").parts
    if not parts or parts[0] not in PACKAGE_DIRS or not path.endswith(".py"):
        return None
    mod = "kernel_parity." + ".".join(parts)
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _imports(path: Path, module: str) -> set[str]:
    """Modules of kernel_parity that `path` imports (any statement, any depth; relative ones resolved)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return set()
    out = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.startswith("kernel_parity.")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules that import it (kernel_parity's own Python files)."""
    users: dict[str, set[str]] = {}
    for top in PACKAGE_DIRS:
        for path in (root / top).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            mod = _module_of(rel)
            if mod is None:
                continue
            for dep in _imports(path, mod):
                users.setdefault(dep, set()).add(mod)
    return users


def _path_of_module(mod: str, root: Path) -> str | None:
    rel = mod[len("kernel_parity."):].replace(".", "/")
    for cand in (f"{rel}.py", f"{rel}/__init__.py"):
        if (root / cand).is_file():
            return cand
    return None


def select(files: list[str], stems: list[str], plugin_sources: dict[str, tuple[list[str], list[str]]] | None = None,
           root: Path = ROOT) -> Selection:
    """The families `files` touch (module docstring). plugin_sources: backend -> (its source globs,
    the stems of the ops it implements)."""
    sel = Selection(files=list(files))
    users = None
    for f in files:
        if f.endswith(".md") or f.startswith(NO_VERDICT):
            continue
        own = _own_family(f, stems)
        if own is not None:
            sel.add(own, f"{f} is its own file")
        elif f.startswith(FRAMEWORK) and not f.startswith(("conformance/ops/", "conformance/backends/")):
            sel.everything = sel.everything or f"{f} is part of the framework: any verdict may move"
            continue
        for name, (globs, plugin_stems) in (plugin_sources or {}).items():
            if any(fnmatch.fnmatchcase(f, g) for g in globs):
                for s in plugin_stems:
                    sel.add(s, f"{f} is a source of the plugin backend {name}")
        mod = _module_of(f)
        if mod is not None:
            users = users if users is not None else import_graph(root)
            via: dict[str, str] = {mod: mod}  # user -> the module it imports on the way to `mod`
            todo = [mod]
            while todo:  # everything that imports it, transitively
                dep = todo.pop()
                for user in users.get(dep, ()):
                    if user not in via:
                        via[user] = dep
                        todo.append(user)
            for user in sorted(set(via) - {mod}):
                upath = _path_of_module(user, root)
                stem = _own_family(upath, stems) if upath else None
                if stem is not None:
                    step = via[user]
                    how = "" if step == mod else f" through {_path_of_module(step, root) or step}"
                    sel.add(stem, f"{upath} imports {f}{how}")
        if f.startswith("kernels/cpu/") and f.endswith(".h"):
            from kernel_parity.kernels.cpu.loader import _headers

            for src in sorted((root / "kernels" / "cpu").glob("*.c")):
                if any(h.name == Path(f).name for h in _headers(src)):
                    stem = _stem_of(src.stem, stems)
                    if stem is not None:
                        sel.add(stem, f"kernels/cpu/{src.name} includes {f}")
    return sel


def plugin_sources(registry: object) -> dict[str, tuple[list[str], list[str]]]:
    """backend -> (its declared source globs, the stems of its ops), for loaded backends with `sources`."""
    out = {}
    for b in registry.loaded():  # type: ignore[attr-defined]
        globs = list(getattr(b, "sources", ()) or ())
        if globs:
            stems = sorted({op.split(".", 1)[0] for op in (getattr(b, "ops", None) or {})})
            out[b.name] = (globs, stems)
    return out


def relative_to_root(path: str, root: Path = ROOT) -> str:
    return os.path.relpath(os.path.abspath(path), root)
