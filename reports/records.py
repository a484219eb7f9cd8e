"""Result records: the JSON document every report is rendered from.

Writers in reports/ read this document only; they never import the runner or the kernels.

Schema `kernel-parity/results/1`:

    {
      "schema": "kernel-parity/results/1",
      "header": {
        "package_version", "git_commit", "device", "driver", "python", "platform",
        "numpy", "torch", "triton", "time" (UTC ISO-8601), "command", "suite"
      },
      "results": [ record, ... ]
    }

One record per case:

    id          canonical case id, e.g. "softmax.softmax/triton/fp16/rows=3,n=113,pad=0/normal/seed=0"
    op, backend, dtype, dist, seed, params (dict)
    verdict     pass | fail | error | crash | timeout | skip | vacuous | flaky | xfail | xpass
                (xfail: a listed known failure that still fails; xpass: one that now passes)
    kind        for fail: "structural" | "exact" | "numeric" | "noise"; else null
    reason      one line: why it failed / was skipped / raised (null for pass)
    message     the multi-line failure message (first line what, then where, then repro), or null
    repro       the shell command that replays the case
    norm_err    worst ratio of a measured error to its limit over all outputs and layers (<= 1 passes)
    outputs     {name: {
                   "dtype", "shape", "exact" (bool),
                   "metrics": {numel, max_abs, max_rel, rmse, nmse, cos_diff, max_ulp,
                               mismatch, mismatch_frac, max_ref, nonfinite_ref},
                   "limits": {atol, rtol, cos_diff, nmse} (numeric outputs),
                   "layers": {layer: {"ok": bool | null, "detail": str}},
                   "worst": [{"index": [...], "got", "expected", "abs", "rel"}],   (at most 5)
                   "noise": {"err", "baseline_err", "k", "floor", "limit"} or null
                 }}
    layers      {structure|exact|numeric|noise|trust: "pass" | "fail" | "n/a"}  (worst over outputs)
    recheck     null, or {"seeds": [...], "verdicts": [...]} for a borderline case
    timing      {"inputs_s", "golden_s", "kernel_s", "total_s"}

Floats are written with `repr` precision (json's default), so metrics round-trip to the bit;
NaN and infinities are written as the strings "nan", "inf", "-inf".
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "kernel-parity/results/1"
VERDICTS = ("fail", "error", "crash", "timeout", "flaky", "xpass", "xfail", "vacuous", "skip", "pass")
FAILING = frozenset({"fail", "error", "crash", "timeout", "flaky", "xpass"})


class RecordsError(ValueError):
    """A results file that is not a kernel-parity results document."""


def _encode(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _decode_metrics(rec: dict) -> dict:
    for out in rec.get("outputs", {}).values():
        for group in ("metrics", "limits", "noise"):
            d = out.get(group)
            if isinstance(d, dict):
                for k, v in d.items():
                    if isinstance(v, str) and v in _SPECIAL:
                        d[k] = _SPECIAL[v]
        for w in out.get("worst", []):
            for k in ("got", "expected", "abs", "rel"):
                if isinstance(w.get(k), str) and w[k] in _SPECIAL:
                    w[k] = _SPECIAL[w[k]]
    if isinstance(rec.get("norm_err"), str) and rec["norm_err"] in _SPECIAL:
        rec["norm_err"] = _SPECIAL[rec["norm_err"]]
    return rec


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        # mkstemp makes 0600; a report is for others to read (CI artifacts, a web server)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump(header: dict, results: list[dict]) -> str:
    """The document as JSON: header indented, one compact line per record (diffs stay readable)."""
    head = json.dumps(_encode(header), indent=1, allow_nan=False).replace("\n", "\n ")
    lines = [json.dumps(_encode(r), separators=(",", ":"), allow_nan=False) for r in results]
    body = ",\n  ".join(lines)
    return (f'{{\n "schema": {json.dumps(SCHEMA)},\n "header": {head},\n "results": [\n  {body}\n ]\n}}\n'
            if lines else f'{{\n "schema": {json.dumps(SCHEMA)},\n "header": {head},\n "results": []\n}}\n')


def write(path: str | os.PathLike, header: dict, results: list[dict]) -> None:
    atomic_write_text(path, dump(header, results))


def load(path: str | os.PathLike) -> dict:
    """Read a results document; raises RecordsError naming the file on anything else."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordsError(f"results file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordsError(f"results file {str(path)!r} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise RecordsError(f"results file {str(path)!r} has schema {found!r}, expected {SCHEMA!r}")
    doc["results"] = [_decode_metrics(r) for r in doc.get("results", [])]
    return doc


def worst_verdict(verdicts: list[str]) -> str:
    """The most severe verdict in VERDICTS order (an empty list is 'skip')."""
    ranked = [v for v in VERDICTS if v in set(verdicts)]
    return ranked[0] if ranked else "skip"


def summary(results: list[dict]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for r in results:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return counts


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

    @property
    def worst(self) -> str:
        """Colour of the cell: the worst verdict among the records that ran (skip if none ran)."""
        return worst_verdict([v for v in self.counts if v != "skip"] or ["skip"])

    @property
    def ran(self) -> int:
        """Records that ran (everything but skips)."""
        return sum(self.counts.values()) - self.counts.get("skip", 0)

    @property
    def text(self) -> str:
        """"12/12", "3 fail / 12", "skip", "9/12 · 2 xfail · 1 vacuous · 3 skip"."""
        if self.ran == 0:
            return "skip"
        failing = [f"{self.counts[v]} {v}" for v in VERDICTS if v in FAILING and v in self.counts]
        parts = [" ".join(failing) + f" / {self.ran}" if failing
                 else f"{self.counts.get('pass', 0)}/{self.ran}"]
        parts += [f"{self.counts[v]} {v}" for v in ("xfail", "vacuous", "skip") if v in self.counts]
        return " · ".join(parts)


def matrix(results: list[dict]) -> tuple[list[str], list[tuple[str, list[str]]],
                                         dict[tuple[str, str, str], Cell]]:
    """(ops, [(backend, [dtype, ...]), ...], {(op, backend, dtype): Cell}), each sorted."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in results:
        groups.setdefault(cell_key(r), []).append(r)
    cells: dict[tuple[str, str, str], Cell] = {}
    for key, recs in groups.items():
        counts: dict[str, int] = {}
        for r in recs:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        reasons = dict.fromkeys(str(r.get("reason") or "no reason given")
                                for r in recs if r["verdict"] == "skip")
        cells[key] = Cell(counts, tuple(reasons))
    ops = sorted({k[0] for k in cells})
    backends = sorted({k[1] for k in cells})
    columns = [(b, sorted({k[2] for k in cells if k[1] == b}, key=dtype_key)) for b in backends]
    return ops, columns, cells
