"""`parity bisect ID --good REF --bad REF`: the first commit where a case starts failing, or where its
error grows past a factor (`--growth F`: norm_err above F x its value at the good commit).

git's own bisection (`git bisect run`) drives it, in a temporary worktree of the repository the
current directory is in, so the working tree is never touched. At every commit it tries, a step
process replays the case (the same rebuild as `parity repro`) and records the commit, the verdict and
the norm_err; a commit where the case cannot be built or run (an import error, a usage error) is
skipped (exit 125), never called good or bad. The kernels under test come from that commit:

- a plugin backend given as `module:object` is imported from the commit's tree (the worktree is the
  first entry of sys.path);
- in kernel-parity's own repository, `kernel_parity.*` itself is imported from the commit's tree
  (refimpl/, kernels/, conformance/ ... mapped to the package as the installed one is), and the op
  families registered in that commit's pyproject.toml are the ones loaded.
Prints the first bad commit and the error at every commit tried; exit 0 when one was found, 1 when
the bisection ended without one (every commit skipped), 2 for bad input (a ref that is no commit, a
good commit where the case already fails, a bad commit where it passes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kernel_parity.conformance import ops
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK, UsageError

SKIP = 125  # git bisect run: this commit cannot be tested


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})  # never wait on a prompt
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"git is not usable here ({e})") from None
    if check and p.returncode != 0:
        raise UsageError(f"git {args[0]}: {(p.stderr.strip().splitlines() or ['failed'])[0]}")
    return p


def _commit(root: Path, ref: str, flag: str) -> str:
    if not ref or ref.startswith("-"):
        raise UsageError(f"{flag} {ref!r} is not a git revision")
    p = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if p.returncode != 0:
        raise UsageError(f"{flag} {ref!r} is not a commit of {root}")
    return p.stdout.strip()


def is_kernel_parity(tree: Path) -> bool:
    return (tree / "conformance" / "runner.py").is_file() and (tree / "refimpl").is_dir()


def bisect(args: Any, command: str = "") -> int:
    ops.parse_case(args.case_id)  # a malformed id is exit 2 before any git work
    top = _git(Path.cwd(), "rev-parse", "--show-toplevel").stdout.strip()
    root = Path(top)
    good, bad = _commit(root, args.good, "--good"), _commit(root, args.bad, "--bad")
    if good == bad:
        raise UsageError("--good and --bad name the same commit")
    if _git(root, "merge-base", "--is-ancestor", good, bad, check=False).returncode != 0:
        raise UsageError(f"--good {args.good!r} is not an ancestor of --bad {args.bad!r}")
    tmp = Path(tempfile.mkdtemp(prefix="kp-bisect-"))
    tree, log = tmp / "tree", tmp / "steps.jsonl"
    step = tmp / "step.py"
    step.write_text(_STEP, encoding="utf-8")
    try:
        _git(root, "worktree", "add", "--detach", "--quiet", str(tree), bad)
        mode = ["--self"] if is_kernel_parity(tree) else []
        base = [sys.executable, str(step), args.case_id, "--log", str(log), *mode]
        for b in args.backend:
            base += ["--backend", b]
        ref_err = None
        for rev, want_fail, flag in ((good, False, "--good"), (bad, True, "--bad")):
            _git(tree, "checkout", "--quiet", "--detach", rev)
            rec = _run_step(base, tree)
            if rec is None:
                raise UsageError(f"{flag} {rev[:12]}: the case cannot be run there (see the step's error above)")
            failing = _is_bad(rec, ref_err, args.growth)
            if rev == good:
                ref_err = rec.get("norm_err")
            if failing != want_fail:
                state = "fails" if failing else "passes"
                raise UsageError(f"{flag} {rev[:12]}: the case {state} there ({rec['verdict']}, norm_err "
                                 f"{_fmt(rec.get('norm_err'))}); nothing to bisect")
        judge = base + (["--growth", str(args.growth), "--reference-err", repr(ref_err)] if args.growth else [])
        _git(tree, "bisect", "start", bad, good)
        run = subprocess.run(["git", "-C", str(tree), "bisect", "run", *judge], capture_output=True, text=True,
                             timeout=None)
        first = _first_bad(run.stdout)
        _git(tree, "bisect", "reset", "--quiet", check=False)
        tried = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()] \
            if log.exists() else []
        print(f"parity bisect {args.case_id}")
        print(f"{'commit':<12}  {'verdict':<8}  {'norm_err':>10}  subject")
        for rec in tried:
            subject = _git(root, "log", "-1", "--format=%s", rec["commit"], check=False).stdout.strip()[:60]
            print(f"{rec['commit'][:12]:<12}  {rec['verdict']:<8}  {_fmt(rec.get('norm_err')):>10}  {subject}")
        if first is None:
            print(f"parity bisect: no first bad commit found ({(run.stdout.strip().splitlines() or [''])[-1]})")
            return EXIT_FAIL
        subject = _git(root, "log", "-1", "--format=%h %s", first, check=False).stdout.strip()
        what = f"error grows past {args.growth:g}x" if args.growth else "fails"
        print(f"parity bisect: first commit where the case {what}: {first}  ({subject})")
        return EXIT_OK
    finally:
        _git(root, "worktree", "remove", "--force", str(tree), check=False)
        _git(root, "worktree", "prune", check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _run_step(base: list[str], tree: Path) -> dict | None:
    out = subprocess.run(base + ["--report"], cwd=tree, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == SKIP or not lines:
        sys.stderr.write(out.stderr[-2000:])
        return None
    return json.loads(lines[-1])


def _is_bad(rec: dict, ref_err: float | None, growth: float | None) -> bool:
    if growth and ref_err is not None:
        err = rec.get("norm_err")
        return rec["verdict"] in _FAILING or (err is not None and err > growth * max(ref_err, 1e-300))
    return rec["verdict"] in _FAILING


_FAILING = ("fail", "error", "crash", "timeout", "flaky", "xpass")


def _first_bad(text: str) -> str | None:
    for line in text.splitlines():
        if line.endswith(" is the first bad commit"):
            return line.split()[0]
    return None


def _fmt(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else "-"


# The step process, run at each commit from the commit's tree (cwd). It is a file of its own (written
# to a temporary folder) so that in --self mode nothing of kernel_parity is imported before the
# package is mapped onto the commit's tree.
_STEP = r'''
import argparse, importlib.util, json, os, subprocess, sys, types
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("case_id"); p.add_argument("--log"); p.add_argument("--self", action="store_true")
p.add_argument("--backend", action="append", default=[]); p.add_argument("--report", action="store_true")
p.add_argument("--growth", type=float); p.add_argument("--reference-err", type=float)
a = p.parse_args()
tree = Path.cwd()
SKIP = 125
try:
    if a.self:  # kernel_parity.* from this commit's tree, mapped as the installed package is
        spec = importlib.util.spec_from_file_location("kernel_parity", tree / "kernel_parity" / "__init__.py",
                                                      submodule_search_locations=[str(tree / "kernel_parity")])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["kernel_parity"] = pkg
        spec.loader.exec_module(pkg)
        for sub in ("refimpl", "kernels", "conformance", "reports", "property_tests"):
            init = tree / sub / "__init__.py"
            if not init.exists():
                continue
            spec = importlib.util.spec_from_file_location(f"kernel_parity.{sub}", init,
                                                          submodule_search_locations=[str(tree / sub)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            setattr(pkg, sub, mod)
            spec.loader.exec_module(mod)
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        table = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["entry-points"]["kernel_parity.ops"]
        from kernel_parity.conformance import ops
        ops.families = lambda: dict(table)  # this commit's families, not the installed ones
    sys.path.insert(0, str(tree))
    from kernel_parity.conformance import known, ops
    from kernel_parity.conformance.backends import Registry
    from kernel_parity.conformance.runner import Runner
    case = ops.parse_case(a.case_id)
    registry = Registry(extra=[b for b in a.backend if ":" in b])
    rec = Runner(registry, recheck=False).evaluate(case)
except Exception as e:  # this commit cannot run the case: git bisect skips it
    print(f"step: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(SKIP)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
line = {"commit": commit, "verdict": rec.verdict, "norm_err": rec.norm_err, "reason": rec.reason}
if a.report:
    print(json.dumps(line))
    sys.exit(0)
with open(a.log, "a") as f:
    f.write(json.dumps(line) + "\n")
failing = rec.verdict in ("fail", "error", "crash", "timeout", "flaky", "xpass")
if a.growth is not None and a.reference_err is not None and rec.norm_err is not None:
    failing = failing or rec.norm_err > a.growth * max(a.reference_err, 1e-300)
sys.exit(1 if failing else 0)
'''

