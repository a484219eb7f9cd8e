"""Result records: the results file every report is rendered from.

Writers in reports/ read this document only; they never import the runner or the kernels.

A results file (schema `kernel-parity/results/2`) is JSON lines, streamed as cases finish, so a
run that is killed keeps every case it finished:

    {"schema": "kernel-parity/results/2", "header": {...}}      first line
    {record}                                                     one line per finished case
    ...
    {"complete": {"cases": N, "elapsed_s": ..., ...}}           last line, only when the run ended

The header holds package_version, git_commit (HEAD, "-dirty" when tracked files differ), git_tree (the git
tree id of the tracked files as they ran: `git rev-parse COMMIT^{tree}` finds their commit even where a
device copy's .git lags its files), device, driver, python, platform, numpy, torch,
triton, time (UTC ISO-8601), command, suite, and `planned` (the number of cases the run set out
to do) with `selection` (what `parity run --resume` needs to re-derive them). A file without the
completion line is *incomplete*: reports show "incomplete: N of M cases" and never PASS.
Files of the previous schema `kernel-parity/results/1` (one JSON document with "results": [...],
the committed baselines) are read as complete.

One record per case:

    id          canonical case id, e.g. "softmax.softmax/triton/fp16/rows=3,n=113,pad=0/normal/seed=0"
    op, backend, dtype, dist, seed, params (dict)
    verdict     pass | fail | error | crash | timeout | skip | vacuous | flaky | xfail | xpass
                (xfail: a listed known failure that still fails; xpass: one that now passes)
    kind        for fail: "structural" | "exact" | "numeric" | "noise"; else null
    tier        the limits that judged it: "production" (our kernels and every plugin) or
                "baseline" (the op's eager same-precision baseline); null when not judged
    reason      one line: why it failed / was skipped / raised (null for pass)
    message     the multi-line failure message (first line what, then where, then repro), or null
    repro       the shell command that replays the case
    norm_err    worst ratio of a measured error to its limit over all outputs and layers (<= 1 passes)
    outputs     {name: {
                   "dtype", "shape", "exact" (bool),
                   "metrics": {numel, max_abs, max_rel, rmse, nmse, cos_diff, max_ulp,
                               mismatch, mismatch_frac, max_ref, nonfinite_ref},
                   "limits": {atol, rtol, cos_diff, nmse, cos_diff_eff, nmse_eff} (numeric outputs),
                   "layers": {layer: {"ok": bool | null, "detail": str}},
                   "worst": [{"index": [...], "got", "expected", "abs", "rel", "out"}],   (at most 5;
                             out: outside the tolerance; elements within it are listed only when
                             none is out)
                   "noise": {"err", "baseline_err", "k", "floor", "limit"} or null
                 }}
    layers      {structure|exact|numeric|noise|trust: "pass" | "fail" | "n/a"}  (worst over outputs)
    recheck     null, or {"seeds": [...], "verdicts": [...]} for a borderline case
    timing      {"inputs_s", "golden_s", "kernel_s", "total_s"}
    shrunk      (optional) `parity shrink`'s smallest case failing the same way: {"id", "verdict", "kind",
                "norm_err", "reason", "repro"}
    perf        (optional) `parity bench`'s timing: {"ms", "bytes", "flops", "gbps", "tflops", "bound",
                "ceiling", "pct_of_ceiling", "peers": {backend: {"ms", "ratio"}}, "device"}

Floats are written with `repr` precision (json's default), so metrics round-trip to the bit;
NaN and infinities are written as the strings "nan", "inf", "-inf". Every line is validated on
read: a file that is not a results file, or a record of the wrong shape, is a RecordsError naming
the file, the line and the key.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kernel_parity.conformance.results import (FAILING, KINDS, SCHEMA, TIERS, VERDICTS, CaseResult,  # noqa: F401
                                               ResultsError)

from kernel_parity.reports import files

SCHEMA_V1 = "kernel-parity/results/1"  # read-only: one JSON document (committed baselines)


class RecordsError(ValueError):
    """A results file that is not a kernel-parity results document (one line, names the file)."""


def _encode(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path`: atomically for a file, through a symlink, into a device or FIFO."""
    files.write_text(path, text)


def _line(obj: Any) -> str:
    return json.dumps(_encode(obj), separators=(",", ":"), allow_nan=False)


def dump(header: dict, results: list[dict], complete: dict | None = None, finished: bool = True) -> str:
    """A whole results file as text: header line, one line per record, the completion line
    (none when not `finished`: the file then reads as incomplete)."""
    if complete is None:
        complete = {"cases": len(results)}
    lines = [_line({"schema": SCHEMA, "header": header}), *(_line(r) for r in results)]
    if finished:
        lines.append(_line({"complete": complete}))
    return "\n".join(lines) + "\n"


def write(path: str | os.PathLike, header: dict, results: list[dict], complete: dict | None = None) -> None:
    """Write a finished run's results file in one go (atomically for a regular file)."""
    atomic_write_text(path, dump(header, results, complete))


class Stream:
    """A results file written as the run goes: `add` each record, `finish` with the completion line.

    Every line is flushed as it is written, so a process killed at any point leaves a file that
    `load` reads as incomplete (a torn last line is ignored) and `parity run --resume` continues.
    """

    def __init__(self, f: IO[str]) -> None:
        self._f = f

    @classmethod
    def create(cls, path: str | os.PathLike, header: dict) -> "Stream":
        s = cls(files.open_stream(path))
        s._write({"schema": SCHEMA, "header": header})
        return s

    @classmethod
    def reopen(cls, path: str | os.PathLike) -> "Stream":
        """Append to a file `load` read as incomplete, after cutting a torn last line."""
        with open(path, "rb+") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1
            f.truncate(keep)
        return cls(files.open_stream(path, append=True))

    def _write(self, obj: Any) -> None:
        self._f.write(_line(obj) + "\n")
        self._f.flush()

    def add(self, rec: dict) -> None:
        self._write(rec)

    def finish(self, complete: dict) -> None:
        self._write({"complete": complete})
        self.close()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


# -- reading, with validation -------------------------------------------------------------------
def check_record(rec: Any, where: str) -> dict:
    """`rec` (a decoded JSON line) if it is a valid CaseResult, as its normalised JSON form;
    RecordsError naming `where` and the key otherwise."""
    if isinstance(rec, dict):
        rec = _decode_metrics_safe(rec)
    try:
        return CaseResult.from_json(rec, where).to_json()
    except ResultsError as e:
        raise RecordsError(str(e)) from None


def _decode_metrics_safe(rec: dict) -> dict:
    """NaN / inf written as strings, back to floats, wherever the record has the expected shape."""
    if isinstance(rec.get("norm_err"), str) and rec["norm_err"] in _SPECIAL:
        rec["norm_err"] = _SPECIAL[rec["norm_err"]]
    outs = rec.get("outputs")
    if isinstance(outs, dict):
        for out in outs.values():
            if not isinstance(out, dict):
                continue
            for group in ("metrics", "limits", "noise"):
                d = out.get(group)
                if isinstance(d, dict):
                    for k, v in d.items():
                        if isinstance(v, str) and v in _SPECIAL:
                            d[k] = _SPECIAL[v]
            refs = out.get("references")
            if isinstance(refs, dict):
                for d in refs.values():
                    if isinstance(d, dict):
                        for k, v in d.items():
                            if isinstance(v, str) and v in _SPECIAL:
                                d[k] = _SPECIAL[v]
            worst = out.get("worst")
            if isinstance(worst, list):
                for w in worst:
                    if isinstance(w, dict):
                        for k in ("got", "expected", "abs", "rel"):
                            if isinstance(w.get(k), str) and w[k] in _SPECIAL:
                                w[k] = _SPECIAL[w[k]]
    return rec


def _check_header(header: Any, where: str) -> dict:
    if not isinstance(header, dict):
        raise RecordsError(f"{where}: 'header' must be a JSON object")
    planned = header.get("planned")
    if planned is not None and (not isinstance(planned, int) or isinstance(planned, bool) or planned < 0):
        raise RecordsError(f"{where}: header 'planned' must be a non-negative integer or null, got {planned!r:.40}")
    return header


def load(path: str | os.PathLike) -> dict:
    """Read a results file: {"schema", "header", "results", "complete" (dict, or None if incomplete)}.
    A gzip-compressed file (e.g. reports/baselines/*.jsonl.gz) is read the same way.

    Raises RecordsError naming the file (and line) on anything that is not a results file.
    """
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise RecordsError(f"results file {name!r} does not exist") from None
    except IsADirectoryError:
        raise RecordsError(f"results file {name!r} is a directory") from None
    except OSError as e:
        raise RecordsError(f"results file {name!r} is not readable: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":  # gzip (committed baselines are kept as .jsonl.gz)
        import gzip
        import zlib

        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise RecordsError(f"results file {name!r} is a damaged gzip file: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordsError(f"results file {name!r} is not UTF-8 text") from None
    if not text.strip():
        raise RecordsError(f"results file {name!r} is empty")
    first = text.lstrip()[:1]
    if first != "{":
        raise RecordsError(f"results file {name!r} is not a kernel-parity results file (it does not start with a JSON object)")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "results" in doc:
        return _load_v1(doc, name)
    if isinstance(doc, dict) and doc.get("schema") not in (SCHEMA, None):
        raise RecordsError(f"results file {name!r} has schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return _load_lines(text, name)


def _load_v1(doc: dict, name: str) -> dict:
    if doc.get("schema") != SCHEMA_V1:
        raise RecordsError(f"results file {name!r} has schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    header = _check_header(doc.get("header", {}), f"results file {name!r}")
    results = doc["results"]
    if not isinstance(results, list):
        raise RecordsError(f"results file {name!r}: 'results' must be a list")
    if not results:
        raise RecordsError(f"results file {name!r} holds no results")
    recs = [check_record(r, f"results file {name!r} record {i + 1}") for i, r in enumerate(results)]
    return {"schema": SCHEMA, "header": header, "results": recs, "complete": {"cases": len(recs)}}


def _load_lines(text: str, name: str) -> dict:
    lines = text.split("\n")
    torn = lines[-1] != ""  # the last line of a killed run may be cut short
    if not torn:
        lines = lines[:-1]
    header = None
    results: dict[str, dict] = {}
    complete = None
    for n, line in enumerate(lines, 1):
        where = f"results file {name!r} line {n}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if torn and n == len(lines) and header is not None:
                break  # a torn last line: the run was killed while writing it
            raise RecordsError(f"{where} is not valid JSON: {e.msg}") from None
        if header is None:
            if not isinstance(obj, dict) or "schema" not in obj:
                raise RecordsError(f"results file {name!r} has schema None, expected {SCHEMA!r}")
            if obj["schema"] != SCHEMA:
                raise RecordsError(f"results file {name!r} has schema {obj['schema']!r}, expected {SCHEMA!r}")
            header = _check_header(obj.get("header", {}), where)
            continue
        if complete is not None:
            raise RecordsError(f"{where}: a line after the completion record")
        if isinstance(obj, dict) and set(obj) == {"complete"}:
            if not isinstance(obj["complete"], dict):
                raise RecordsError(f"{where}: 'complete' must be a JSON object")
            complete = obj["complete"]
            continue
        rec = check_record(obj, where)
        results[rec["id"]] = rec  # a case recorded twice (a resumed run) keeps its last record
    if header is None:
        raise RecordsError(f"results file {name!r} has no header line")
    if complete is not None and not results:
        raise RecordsError(f"results file {name!r} holds no results")
    return {"schema": SCHEMA, "header": header, "results": list(results.values()), "complete": complete}


def incomplete(doc: dict) -> tuple[int, int | None] | None:
    """(cases done, cases planned or None) for a file without its completion record; else None.

    A document is incomplete when it says so ("complete": None, as `load` returns for a file
    without its completion line); in-memory documents without the key are finished runs."""
    if "complete" not in doc or doc["complete"] is not None:
        return None
    planned = (doc.get("header") or {}).get("planned")
    return len(doc.get("results") or []), planned


def status_line(doc: dict) -> str | None:
    """'incomplete: N of M cases' for an incomplete document, else None."""
    inc = incomplete(doc)
    if inc is None:
        return None
    done, planned = inc
    return f"incomplete: {done} of {planned if planned is not None else '?'} cases (the run did not finish)"


def stale_entries(doc: dict) -> list[str]:
    """Known-failure entries that matched nothing (from the completion record or a v1 header)."""
    for src in (doc.get("complete") or {}, doc.get("header") or {}):
        kf = src.get("known_failures")
        if isinstance(kf, dict) and isinstance(kf.get("stale"), list):
            return [str(s) for s in kf["stale"]]
    return []


def doc_passed(doc: dict) -> bool:
    """The gate's verdict on a whole document: complete, not empty, nothing failing, nothing stale."""
    results = doc.get("results") or []
    return (incomplete(doc) is None and bool(results) and passed(results)
            and not stale_entries(doc))


def worst_verdict(verdicts: list[str]) -> str:
    """The most severe verdict in VERDICTS order (an empty list is 'skip')."""
    ranked = [v for v in VERDICTS if v in set(verdicts)]
    return ranked[0] if ranked else "skip"


def summary(results: list[dict]) -> dict[str, int]:
    from kernel_parity.conformance.results import counts

    return counts(results)


def passed(results: list[dict]) -> bool:
    """True when no record's verdict is in FAILING (the gate's overall PASS)."""
    return not any(r.get("verdict") in FAILING for r in results)


def encode(x: Any) -> Any:
    """`x` with non-finite floats written as the strings "nan", "inf", "-inf" (JSON-safe)."""
    return _encode(x)


# Matrix helpers shared by the HTML and Markdown writers.

_DTYPE_ORDER = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8e4m3", "fp8e5m2", "fp8", "fp4",
                "int64", "int32", "int16", "int8", "uint8", "int4", "bool")


def dtype_key(dtype: str) -> tuple[int, str]:
    """Sort key: wide floats first, then narrow floats, then integers; unknown names last."""
    return (_DTYPE_ORDER.index(dtype) if dtype in _DTYPE_ORDER else len(_DTYPE_ORDER), dtype)


def cell_key(r: dict) -> tuple[str, str, str]:
    return (str(r.get("op") or "?"), str(r.get("backend") or "?"), str(r.get("dtype") or "?"))


@dataclass(frozen=True)
class Cell:
    """The records of one op x backend x dtype, summarised for a matrix cell."""

    counts: dict[str, int]  # verdict -> count, non-zero only
    skip_reasons: tuple[str, ...]  # distinct, first-seen order
    not_run: int = 0  # planned cases without a record (an incomplete run)

    @property
    def worst(self) -> str:
        """Colour of the cell: the worst verdict among the records that ran (skip if none ran;
        "notrun" when nothing of it ran because the run stopped first)."""
        if not self.counts and self.not_run:
            return "notrun"
        return worst_verdict([v for v in self.counts if v != "skip"] or ["skip"])

    @property
    def ran(self) -> int:
        """Records that ran (everything but skips)."""
        return sum(self.counts.values()) - self.counts.get("skip", 0)

    @property
    def text(self) -> str:
        """"12/12", "3 fail / 12", "skip", "9/12 · 2 xfail · 1 vacuous · 3 skip", "not run (12)"."""
        tail = [f"{self.not_run} not run"] if self.not_run else []
        if not self.counts:
            return f"not run ({self.not_run})"
        if self.ran == 0:
            return " · ".join(["skip"] + tail)
        failing = [f"{self.counts[v]} {v}" for v in VERDICTS if v in FAILING and v in self.counts]
        parts = [" ".join(failing) + f" / {self.ran}" if failing
                 else f"{self.counts.get('pass', 0)}/{self.ran}"]
        parts += [f"{self.counts[v]} {v}" for v in ("xfail", "vacuous", "skip") if v in self.counts]
        return " · ".join(parts + tail)


def plan_of(doc: dict) -> dict[tuple[str, str, str], int]:
    """{(op, backend, dtype): planned cases} of an incomplete document whose header has its plan
    (`parity run` writes it), else {}: a finished run's records are its plan."""
    if incomplete(doc) is None:
        return {}
    plan = (doc.get("header") or {}).get("plan")
    out: dict[tuple[str, str, str], int] = {}
    if isinstance(plan, dict):
        for k, n in plan.items():
            parts = str(k).split("/")
            if len(parts) == 3 and isinstance(n, int) and not isinstance(n, bool) and n > 0:
                out[(parts[0], parts[1], parts[2])] = n
    return out


def matrix(results: list[dict], plan: dict[tuple[str, str, str], int] | None = None
           ) -> tuple[list[str], list[tuple[str, list[str]]], dict[tuple[str, str, str], Cell]]:
    """(ops, [(backend, [dtype, ...]), ...], {(op, backend, dtype): Cell}), each sorted. With the
    `plan` of an incomplete run, cells of planned cases that did not run say so."""
    groups: dict[tuple[str, str, str], list[dict]] = {key: [] for key in (plan or {})}
    for r in results:
        groups.setdefault(cell_key(r), []).append(r)
    cells: dict[tuple[str, str, str], Cell] = {}
    for key, recs in groups.items():
        counts: dict[str, int] = {}
        for r in recs:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        reasons = dict.fromkeys(str(r.get("reason") or "no reason given")
                                for r in recs if r["verdict"] == "skip")
        cells[key] = Cell(counts, tuple(reasons), max(0, (plan or {}).get(key, 0) - len(recs)))
    ops = sorted({k[0] for k in cells})
    backends = sorted({k[1] for k in cells})
    columns = [(b, sorted({k[2] for k in cells if k[1] == b}, key=dtype_key)) for b in backends]
    return ops, columns, cells
