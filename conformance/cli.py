"""The `parity` command line.

    parity list [ops|backends|suites|cases]      what exists (cases: after filters)
    parity run      run a suite (filters; --json/--html/--junit/--md; --jobs; progress bar;
                    --resume FILE continues a killed run)
    parity gate     run + baseline diff; exit 1 on any failure or regression (--bench: and slowdowns)
    parity bench    run and time the kernels: time, GB/s or TFLOP/s, the share of the device's ceiling
                    measured in the same run, and the ratio to every peer backend, in the records
    parity sweep    fresh seeds over a suite's cases: failures, flaky verdicts, worst norm_err
    parity repro ID replay one case bit for bit: metrics, worst elements, verdict (--export DIR)
    parity report   render results JSON to --html/--junit/--md
    parity merge    join results files (CI shards) into one
    parity config   the resolved [tool.kernel-parity] configuration and where each value came from
    parity diff     per-case error diff of two results files
    parity mutants  seeded bugs in our own kernels: killed or survived, by which case and layer
    parity calibrate  measure error quantiles over seeds and print the limits they suggest
    parity coverage what each backend covers: per op, the parameter values, dtypes and
                    distributions that run, and those it skips with the reasons
    parity shrink   the smallest shape of a failing case that fails the same way (Hypothesis)
    parity bisect   the first commit where a case starts failing, or its error grows past a factor

Exit codes: 0 pass, 1 parity failure or regression, 2 usage or input error (one line).

Every output path a command takes (`--json`, `--html`, `--junit`, `--md`, `--export DIR`) is
declared with the flag (`_output`), and `main` checks them all, and that none of them is one of
the command's input files, before the command starts: an unwritable path is exit 2 with one line,
never a traceback after the run. Repeatable list flags also take comma lists (`--backend cpu,torch`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import shlex
import sys
from typing import Sequence

from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError  # noqa: F401

DEFAULT_TIMEOUT_S = 600.0  # per case, in a worker process: a hang is a `timeout`, never a stuck gate


class _Once(argparse._StoreAction):
    """A flag that takes one value: given twice it is an error (exit 2), never the last one silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "_given", None)
        if given is None:
            given = {}
            setattr(namespace, "_given", given)
        if self.dest in given:
            raise argparse.ArgumentError(self, f"given twice ({given[self.dest]!r}, then {values!r}): it takes one "
                                               f"value")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage otherwise)
        raise UsageError(message)

    def add_argument(self, *args, **kw):
        """Flags that store one value (no action named) refuse a second value."""
        if args and str(args[0]).startswith("-") and "action" not in kw:
            kw["action"] = _Once
        return super().add_argument(*args, **kw)


class _ListAction(argparse.Action):
    """A repeatable flag whose values may also be comma lists: `--backend cpu,torch --backend x`."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        parts = [v.strip() for v in str(values).split(",")] if "," in str(values) else [values]
        if "," in str(values) and not all(parts):
            raise argparse.ArgumentError(self, f"empty item in the comma list {values!r}")
        setattr(namespace, self.dest, items + parts)


def _list_flag(p: argparse.ArgumentParser, flag: str, help: str = "", **kw) -> None:
    p.add_argument(flag, action=_ListAction, default=[], help=(help + "; " if help else "") +
                   "repeatable, or a comma list", **kw)


# Output and input paths of each subcommand, declared where the flags are: main() checks them
# before the command runs (one helper for every command: reports.files.check_outputs).
OUTPUT_FILE, OUTPUT_DIR = "file", "dir"


def _output(p: argparse.ArgumentParser, flag: str, help: str, kind: str = OUTPUT_FILE, metavar: str = "PATH") -> None:
    p.add_argument(flag, metavar=metavar, help=help)
    outs = dict(p.get_default("_outputs") or {})
    outs[flag] = kind
    p.set_defaults(_outputs=outs)


def _input(p: argparse.ArgumentParser, dest: str, what: str) -> None:
    """`dest` (a positional or a flag's dest) names an input file of the command: no output may be it."""
    ins = dict(p.get_default("_inputs") or {})
    ins[dest] = what
    p.set_defaults(_inputs=ins)


def output_paths(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """{flag: (path, kind)} of the output paths given to the parsed command."""
    out = {}
    for flag, kind in (getattr(args, "_outputs", None) or {}).items():
        v = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if v is not None:
            out[flag] = (v, kind)
    return out


def check_paths(args: argparse.Namespace) -> None:
    """Exit 2 (UsageError) if an output path of the parsed command cannot be written or is one of its
    input files. Runs before the command does anything."""
    from kernel_parity.reports import files

    outs = output_paths(args)
    inputs: dict[str, str] = {}
    for dest, what in (getattr(args, "_inputs", None) or {}).items():
        v = getattr(args, dest, None)
        for path in (v if isinstance(v, list) else [v]):
            if isinstance(path, str) and path:
                inputs[f"{what} {path}" if isinstance(v, list) else what] = path
    dir_files: tuple[str, ...] = ()
    if any(k == OUTPUT_DIR for _, k in outs.values()):
        from kernel_parity.conformance.repro import EXPORT_FILES as dir_files
    try:
        for flag, (path, kind) in outs.items():
            if kind == OUTPUT_DIR:
                files.check_output_dir(flag, path, dir_files)
        files.check_outputs({f: p for f, (p, k) in outs.items() if k == OUTPUT_FILE}, inputs)
        for flag, (path, kind) in outs.items():
            if kind == OUTPUT_DIR:
                for what, src in inputs.items():
                    for n in dir_files:
                        if files.same_file(os.path.join(path, n), src):
                            raise files.OutputPathError(f"{flag} {path!r} would overwrite the {what} ({n})")
    except files.OutputPathError as e:
        raise UsageError(str(e)) from None



def _number(cast: type, lowest: float, strict: bool, what: str):
    """An argparse type: `cast(text)`, finite, above `lowest` (or at least it, if not strict)."""
    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or (v <= lowest if strict else v < lowest):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__name__ = what
    return parse


positive_int = _number(int, 0, True, "a positive integer")
nonneg_int = _number(int, 0, False, "a non-negative integer")
positive_float = _number(float, 0.0, True, "a finite number > 0")


def sample_mode(text: str) -> str:
    """--sample: auto, off, or a number of output elements above which rows are sampled."""
    t = text.strip().lower()
    if t in ("auto", "off") or (t.isdigit() and int(t) >= 0):
        return t
    raise argparse.ArgumentTypeError(f"expected auto, off or a number of output elements >= 0, got {text!r}")


sample_mode.__name__ = "auto, off or a number of elements"


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default=None,
                   help="suite name or .toml path (default: [tool.kernel-parity] suites, else ci)")
    _list_flag(p, "--op", "op name, prefix (softmax) or glob")
    _list_flag(p, "--backend", "backend name or module:object; replaces the suite's backends")
    _list_flag(p, "--dtype", "fp32, fp16, bf16 (aliases ok)")
    _list_flag(p, "--dist", "value distribution")
    _output(p, "--json", "write the results document (JSON lines, streamed as cases finish)")
    _output(p, "--html", "write the self-contained HTML report")
    _output(p, "--junit", "write JUnit XML")
    _output(p, "--md", "write a Markdown summary")
    _output(p, "--golden-cache", "read and write each input group's inputs and goldens in this directory "
            "(KERNEL_PARITY_GOLDEN_CACHE; README: the golden cache)", OUTPUT_DIR, "DIR")
    p.add_argument("--sample", type=sample_mode, default=None, metavar="auto|off|N",
                   help="judge row-independent ops on a seeded sample of rows when their outputs exceed N "
                        "elements (auto: 4194304; off: every row; KERNEL_PARITY_SAMPLE; README: sampled judging)")
    p.add_argument("--schedule", metavar="RESULTS", default=None,
                   help="order the case groups by the times an earlier results file measured, longest first "
                        "(KERNEL_PARITY_SCHEDULE; default: by the size of their params)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes running cases (default 1)")
    p.add_argument("--no-isolate", action="store_true",
                   help="run cases in this process (debugging only: a kernel that exits or crashes ends the run)")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds per case before it is killed as a timeout (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where case groups run: this host's worker processes (default) or a Ray cluster "
                        "(--address)")
    p.add_argument("--address", metavar="ADDR", default=None,
                   help="with --executor ray: host:port or ray://host:port of a cluster, 'local' (a new local "
                        "cluster for this run) or 'auto' (default: RAY_ADDRESS or a cluster started here, else a new "
                        "local one)")
    p.add_argument("--devices", metavar="all|I,J", default=None,
                   help="one worker per GPU of this host (CUDA_VISIBLE_DEVICES per worker; --jobs N: N per GPU), "
                        "without Ray; exit 2 on a machine without a GPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-recheck", action="store_true", help="do not re-run borderline cases on fresh seeds")
    p.add_argument("--determinism", action="store_true",
                   help="run every case's kernel twice more on the same inputs: differing bits fail a backend that "
                        "claims run-to-run determinism (ours), are recorded for the others (KERNEL_PARITY_DETERMINISM; "
                        "borderline cases are always checked)")
    p.add_argument("--no-diagnose", action="store_true", help="do not re-run failed cases' goldens under alternative semantics")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the summary line")
    p.add_argument("--scale", default="auto", choices=["auto", "real", "cpu"],
                   help="suite sizes: real, the entries' cpu overrides, or auto (real when a CUDA GPU is present)")
    p.add_argument("--known-failures", metavar="TOML", default=None,
                   help="this repository's known-failures file (default: [tool.kernel-parity] known_failures); "
                        "kernel-parity's own entries apply to its own backends in any case")
    p.add_argument("--shard", metavar="I/N", default=None,
                   help="run the I-th of N deterministic slices of the cases (CI matrices; parity merge joins them)")
    _input(p, "known_failures", "known-failures file")
    _input(p, "suite", "suite file")
    _input(p, "schedule", "schedule results file")


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    """The case selection of `parity run`, for commands that only look at the cases."""
    p.add_argument("--suite", default=None)
    _list_flag(p, "--op")
    _list_flag(p, "--backend")
    _list_flag(p, "--dtype")
    _list_flag(p, "--dist")
    p.add_argument("--scale", default="auto", choices=["auto", "real", "cpu"])
    p.add_argument("--shard", metavar="I/N", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="parity", description="kernel-parity: check kernels against float64 goldens.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("list", help="list ops, backends, suites or cases")
    p.add_argument("what", nargs="?", default="all", choices=["all", "ops", "backends", "suites", "cases"])
    _add_selection_args(p)
    p.add_argument("--with-skips", action="store_true",
                   help="cases: also list the cases the backend will skip, each with its reason")

    p = sub.add_parser("coverage", help="what each backend covers: parameter values, dtypes and "
                                        "distributions that run, and what it skips with the reasons")
    _add_selection_args(p)
    _output(p, "--json", "write the coverage table (JSON)")

    p = sub.add_parser("run", help="run a suite and write reports")
    _add_run_args(p)
    p.add_argument("--resume", metavar="FILE",
                   help="continue the run whose --json results file this is (its selection, the missing cases)")
    _input(p, "resume", "resumed results file")
    p = sub.add_parser("bench", help="run and time the selected cases' kernels (records gain perf)")
    _add_run_args(p)
    p.set_defaults(bench=True)

    p = sub.add_parser("gate", help="run, diff against a baseline, exit 1 on failure")
    _add_run_args(p)
    p.add_argument("--bench", action="store_true",
                   help="also time each case (as parity bench), so a --baseline with times can flag slowdowns")
    p.add_argument("--slowdown", type=positive_float, default=1.3,
                   help="with --bench and a baseline of the same device: a case this many times slower fails "
                        "(default 1.3)")
    p.add_argument("--baseline", metavar="JSON", help="results of a previous run to diff against")
    p.add_argument("--growth", type=positive_float, default=4.0, help="flag errors that grew by more than this factor")
    p.add_argument("--changed-since", metavar="REF", default=None,
                   help="run the op families the files changed since git REF touch thoroughly (the suite's "
                        "cases at extra fresh seeds) and the others quickly (smoke); prints what and why")
    p.add_argument("--thorough-seeds", type=nonneg_int, default=2,
                   help="fresh seeds per case of a thorough family with --changed-since (default 2)")
    _input(p, "baseline", "--baseline file")

    p = sub.add_parser("sweep", help="fresh seeds over a suite's cases: false alarms and flaky verdicts")
    _add_run_args(p)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--seeds", type=positive_int, default=None, help="fresh seeds per (params, dtype, dist) combination")
    how.add_argument("--per-op", type=positive_int, default=None, metavar="N",
                     help="fresh-seed runs per op and backend, spread over its combinations (default 100)")
    p.add_argument("--start", type=nonneg_int, default=None,
                   help="first fresh seed (default: a random one, printed, so a sweep replays with --start)")

    p = sub.add_parser("config", help="the resolved configuration, and where each value came from")
    _list_flag(p, "--backend")
    p.add_argument("--known-failures", metavar="TOML", default=None)

    p = sub.add_parser("merge", help="join results files (shards of one run) into one results file and reports")
    p.add_argument("results", nargs="+")
    _output(p, "--json", "write the merged results file")
    _output(p, "--html", "write the HTML report")
    _output(p, "--junit", "write JUnit XML")
    _output(p, "--md", "write a Markdown summary")
    p.add_argument("--quiet", "-q", action="store_true")
    _input(p, "results", "input")

    p = sub.add_parser("repro", help="replay one case from its id")
    p.add_argument("case_id")
    _list_flag(p, "--backend", "module:object for a third-party backend")
    _output(p, "--export", "write inputs, golden and kernel outputs (.npz), the case and a standalone repro.py "
                           "into this directory", OUTPUT_DIR, "DIR")
    _output(p, "--json", "write the one-record results document")
    p.add_argument("--sample", type=sample_mode, default=None, metavar="auto|off|N",
                   help="a model-size case is judged on a sample of rows as in a run (auto); off judges every row")

    p = sub.add_parser("bisect", help="the first commit where a case starts failing (or its error grows)")
    p.add_argument("case_id")
    p.add_argument("--good", required=True, metavar="REF", help="a commit where the case passes")
    p.add_argument("--bad", required=True, metavar="REF", help="a later commit where it fails")
    p.add_argument("--growth", type=positive_float, default=None,
                   help="bad means norm_err above this factor x its value at --good (not only failing)")
    _list_flag(p, "--backend", "module:object for a third-party backend (imported from each commit's tree)")

    p = sub.add_parser("shrink", help="the smallest shape of a failing case that fails the same way")
    p.add_argument("case_id", nargs="?", default=None)
    p.add_argument("--results", metavar="FILE", default=None, help="shrink the failing cases of this results file")
    _list_flag(p, "--backend", "module:object for a third-party backend")
    p.add_argument("--max-examples", type=positive_int, default=100,
                   help="shapes Hypothesis draws before it shrinks (default 100)")
    p.add_argument("--limit", type=positive_int, default=20, help="with --results: at most this many failing cases")
    _output(p, "--json", "write the records (each original with its `shrunk` note, then the shrunk case)")
    _input(p, "results", "results file")

    p = sub.add_parser("report", help="render a results file, or several runs side by side (exit 1 if one does not "
                                      "pass the gate)")
    p.add_argument("results", nargs="+", help="a results file; several (runs on different devices): one --html page "
                                              "with a column per device")
    p.add_argument("--mutants", metavar="JSON", help="a `parity mutants --json` file: its kill table joins the HTML")
    _output(p, "--html", "write the HTML report")
    _output(p, "--junit", "write JUnit XML")
    _output(p, "--md", "write a Markdown summary")
    _input(p, "results", "results file")
    _input(p, "mutants", "mutants file")

    p = sub.add_parser("diff", help="compare two results files case by case")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--growth", type=positive_float, default=4.0)
    _output(p, "--json", "write the diff (JSON: its summary and every entry)")
    _input(p, "old", "old results file")
    _input(p, "new", "new results file")

    p = sub.add_parser("mutants", help="seeded bugs in our kernels: does the gate kill each one?")
    p.add_argument("--suite", default=None, help="suite whose cases must kill the mutants (default: ci)")
    p.add_argument("--props", action="store_true", help="also run the property tests on mutants the gate lets through")
    _list_flag(p, "--mutant", "only this mutant id")
    _list_flag(p, "--bug", "only mutants of this bug class")
    _list_flag(p, "--backend", "only mutants of this backend's kernels (triton, cpu, torch, gluon)")
    p.add_argument("--shard", metavar="I/N", default=None,
                   help="only the I-th of N round-robin slices of the selected mutants (parallel runs)")
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="worker processes per mutant (default 2; with --devices: per GPU)")
    p.add_argument("--devices", metavar="all|I,J", default=None,
                   help="each mutant's cases over these GPUs of this host, --jobs workers per GPU; exit 2 on a "
                        "machine without a GPU")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds per case before it is a timeout (a mutant that hangs is killed by it)")
    _output(p, "--json", "write the kill table (JSON)")
    _output(p, "--html", "write the kill table as an HTML report")
    p.add_argument("--list", action="store_true", help="list the catalogue and exit")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the table and the summary")
    _input(p, "suite", "suite file")

    p = sub.add_parser("calibrate", help="error quantiles over many seeds -> suggested limits")
    p.add_argument("op")
    p.add_argument("--suite", default=None,
                   help="parameter sets from this suite (default: [tool.kernel-parity] suites, else ci)")
    _list_flag(p, "--backend")
    _list_flag(p, "--dtype")
    p.add_argument("--seeds", type=positive_int, default=20, help="seeds per parameter set")
    p.add_argument("--scale", default="auto", choices=["auto", "real", "cpu"])
    p.add_argument("--no-progress", action="store_true")
    _output(p, "--json", "write the measured quantiles and the suggestions (JSON)")
    _input(p, "suite", "suite file")
    return parser


# subcommand -> (module, function(args, command line) -> exit code); imported only when run, and no
# module below imports this one: the CLI sits on top of the framework, never inside a cycle.
COMMANDS = {
    "run": ("commands", "cmd_run"), "gate": ("commands", "cmd_gate"), "bench": ("commands", "cmd_bench"), "report": ("commands", "cmd_report"),
    "diff": ("commands", "cmd_diff"), "merge": ("commands", "cmd_merge"), "config": ("commands", "cmd_config"),
    "sweep": ("sweep", "sweep"), "list": ("listing", "list_things"), "repro": ("repro", "repro"),
    "calibrate": ("calibrate", "calibrate"), "mutants": ("mutants.run", "main"),
    "coverage": ("listing", "coverage"), "shrink": ("shrink", "shrink"), "bisect": ("bisect", "bisect"),
}


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """An environment variable for this command (the workers it starts inherit it), the previous
    value restored after (main() is also called in-process). None: left as it is."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        check_paths(args)  # every output path, before anything runs
        module, fn = COMMANDS[args.command]
        impl = getattr(importlib.import_module(f"kernel_parity.conformance.{module}"), fn)
        from kernel_parity.conformance import golden_cache, sampling

        cache = getattr(args, "golden_cache", None)
        schedule = getattr(args, "schedule", None)
        if schedule:  # read once here: a file that is not a results file is exit 2 before anything runs
            from kernel_parity.conformance.runner import SCHEDULE_ENV, measured_seconds
            from kernel_parity.reports.records import RecordsError

            try:
                measured_seconds(schedule)
            except (RecordsError, KeyError, ValueError, IndexError) as e:
                raise UsageError(f"--schedule {schedule!r}: {e}") from None
        with _env(golden_cache.ENV, os.path.abspath(cache) if cache else None), \
                _env(sampling.ENV, getattr(args, "sample", None)), \
                _env("KERNEL_PARITY_DETERMINISM", "1" if getattr(args, "determinism", False) else None), \
                _env(SCHEDULE_ENV if schedule else "", os.path.abspath(schedule) if schedule else None):
            return impl(args, "parity " + " ".join(shlex.quote(a) for a in argv))
    except UsageError as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `parity list cases | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
