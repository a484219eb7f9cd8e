"""Named suites of fixed cases (conformance/suites/<name>.toml, or any TOML path).

    description = "..."
    include = ["smoke"]              # other suites whose cases this one also runs

    [[cases]]
    op = "softmax.softmax"
    backends = ["triton", "cpu", "torch"]
    dtypes = ["fp32", "fp16", "bf16"]
    dists = ["normal", "masked"]
    seeds = [0]
    params = [{rows = 3, n = 113, pad = 0}, ...]     # explicit parameter sets, and/or
    grid = {rows = [1, 3], n = [1, 113], pad = [0]}  # a cartesian product
    cpu = {sq = 64, sk = 64}                         # overrides at `--scale cpu` (real head
                                                     # configs, sizes a CPU can afford)

A case entry expands to params x dtypes x dists x seeds x backends. Every case is validated
against its op spec when the suite loads; a bad entry is an error naming the file and entry.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SUITE_DIR = Path(__file__).parent / "suites"
DEFAULT_SUITE = "ci"


SCALES = ("auto", "real", "cpu")


@dataclass(frozen=True)
class Filters:
    ops: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()  # replaces each entry's backend list when given
    dtypes: tuple[str, ...] = ()
    dists: tuple[str, ...] = ()
    scale: str = "auto"  # "real" sizes, the entries' "cpu" overrides, or auto: real with a CUDA GPU


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """`--shard I/N` (runs and mutants): (i, n), 1-based; None without the flag; a usage error otherwise."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard {text!r} must be i/N (e.g. 2/4)") from None
    if not 1 <= i <= n:
        raise UsageError(f"--shard {text!r}: i must be in 1..N")
    return i, n


def canonical_filter_dtype(name: str) -> str:
    """--dtype value: a dtype (aliases resolved) or the name of some op's dtype set; else UsageError."""
    if any(name in spec.dtype_sets for spec in ops.all_specs().values()):
        return name
    return dt.canonical(name)


def resolve_scale(scale: str) -> str:
    if scale not in SCALES:
        raise UsageError(f"--scale {scale!r} must be one of {', '.join(SCALES)}")
    if scale != "auto":
        return scale
    from kernel_parity.conformance.backends._torch import cuda_available

    return "real" if cuda_available() else "cpu"


def names() -> list[str]:
    return sorted(p.stem for p in SUITE_DIR.glob("*.toml"))


def path_of(name: str) -> Path:
    if not isinstance(name, str) or not name or "\0" in name:
        raise UsageError(f"suite {name!r} is not a suite name or a path to a .toml file")
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return p
    if p.suffix == ".toml" and p.exists():
        raise UsageError(f"suite file {name!r} is not a file")
    q = SUITE_DIR / f"{name}.toml"
    if "/" not in name and q.is_file():
        return q
    if p.suffix == ".toml" or "/" in name or os.sep in name:
        raise UsageError(f"suite file {name!r} not found (a suite is a name: {', '.join(names())}; "
                         f"or the path of an existing .toml file)")
    import difflib

    close = difflib.get_close_matches(name, names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UsageError(f"unknown suite {name!r} ({hint}known: {', '.join(names())}; or a path to a .toml file)")


def load_doc(name: str) -> dict[str, Any]:
    path = path_of(name)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"suite {str(path)!r} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"suite {str(path)!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    _check_doc(doc, f"suite {str(path)!r}")
    return doc


_TOP_KEYS = {"description": "a string", "include": "a list of suite names", "cases": "a list of [[cases]] tables"}
_ENTRY_KEYS = {
    "op": "an op name", "backends": "a list of backend names", "dtypes": "a list of dtype names",
    "dists": "a list of distribution names", "seeds": "a list of non-negative integers",
    "params": "a list of {name = value} tables", "grid": "a table of name = value or [values]",
    "cpu": "a table of name = value overrides",
}


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) and x for x in v)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, float)


def _check_doc(doc: dict[str, Any], where: str) -> None:
    """Every key of a suite document has the type the loader expects (UsageError naming it)."""
    for k, v in doc.items():
        if k not in _TOP_KEYS:
            raise UsageError(f"{where}: unknown key {k!r} (expected: {', '.join(_TOP_KEYS)})")
    if "description" in doc and not isinstance(doc["description"], str):
        raise UsageError(f"{where}: 'description' must be {_TOP_KEYS['description']}")
    if "include" in doc and not _is_str_list(doc["include"]):
        raise UsageError(f"{where}: 'include' must be {_TOP_KEYS['include']}")
    entries = doc.get("cases", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"{where}: 'cases' must be {_TOP_KEYS['cases']}")
    for i, e in enumerate(entries):
        at = f"{where} case entry {i + 1}"
        for k in e:
            if k not in _ENTRY_KEYS:
                raise UsageError(f"{at}: unknown key {k!r} (expected: {', '.join(_ENTRY_KEYS)})")
        if not isinstance(e.get("op"), str) or not e.get("op"):
            raise UsageError(f"{at}: 'op' must be {_ENTRY_KEYS['op']}")
        for k in ("backends", "dtypes", "dists"):
            if k in e and (not _is_str_list(e[k]) or not e[k]):
                raise UsageError(f"{at}: {k!r} must be {_ENTRY_KEYS[k]} (non-empty), got {e[k]!r:.60}")
        if "seeds" in e and (not isinstance(e["seeds"], list) or not e["seeds"] or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e["seeds"])):
            raise UsageError(f"{at}: 'seeds' must be {_ENTRY_KEYS['seeds']} (non-empty), got {e['seeds']!r:.60}")
        if "params" in e and (not isinstance(e["params"], list) or not all(
                isinstance(p, dict) and all(_is_scalar(x) for x in p.values()) for p in e["params"])):
            raise UsageError(f"{at}: 'params' must be {_ENTRY_KEYS['params']} with integer or string values")
        if "grid" in e and (not isinstance(e["grid"], dict) or not all(
                _is_scalar(v) or (isinstance(v, list) and v and all(_is_scalar(x) for x in v))
                for v in e["grid"].values())):
            raise UsageError(f"{at}: 'grid' must be {_ENTRY_KEYS['grid']} (integers or strings)")
        if "cpu" in e and (not isinstance(e["cpu"], dict) or not all(_is_scalar(x) for x in e["cpu"].values())):
            raise UsageError(f"{at}: 'cpu' must be {_ENTRY_KEYS['cpu']} (integers or strings)")


def description(name: str) -> str:
    return str(load_doc(name).get("description", ""))


def cases(name: str, filters: Filters = Filters(), _seen: tuple[str, ...] = ()) -> list[Case]:
    """The suite's cases after filters, deduplicated, in file order."""
    if name in _seen:
        raise UsageError(f"suite {name!r} includes itself (through {' -> '.join(_seen)})")
    if len(_seen) > 16:
        raise UsageError(f"suite {name!r}: includes nest more than 16 deep (through {' -> '.join(_seen)})")
    doc = load_doc(name)
    out: list[Case] = []
    for inc in doc.get("include", []):
        out.extend(cases(inc, filters, _seen + (name,)))
    wanted_ops = {s.name for s in ops.match(list(filters.ops))} if filters.ops else None
    scale = None
    want_dtypes = {canonical_filter_dtype(d) for d in filters.dtypes} if filters.dtypes else None
    for i, entry in enumerate(doc.get("cases", [])):
        where = f"suite {name!r} case entry {i + 1}"
        op = entry.get("op")
        if not isinstance(op, str):
            raise UsageError(f"{where}: missing op")
        try:
            spec = ops.get(op)
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
        if wanted_ops is not None and op not in wanted_ops:
            continue
        backends = list(filters.backends) or entry.get("backends", ["triton", "cpu", "torch"])
        try:
            dtypes = [spec.canonical_dtype(d) for d in entry.get("dtypes", list(spec.dtypes))]
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
        dists = entry.get("dists", ["normal"])
        seeds = entry.get("seeds", [0])
        cpu = entry.get("cpu")
        if cpu and scale is None:
            scale = resolve_scale(filters.scale)
        for p in _param_sets(entry, where):
            if cpu and scale == "cpu":
                p = {**p, **cpu}
            for dtype, dist, seed, backend in itertools.product(dtypes, dists, seeds, backends):
                if want_dtypes is not None and dtype not in want_dtypes:
                    continue
                if filters.dists and dist not in filters.dists:
                    continue
                try:
                    out.append(ops.make_case(op, backend, dtype, p, dist, seed))
                except UsageError as e:
                    raise UsageError(f"{where}: {e}") from None
    return list(dict.fromkeys(out))


def _param_sets(entry: dict[str, Any], where: str) -> list[dict[str, Any]]:
    sets = list(entry.get("params", []))
    grid = entry.get("grid")
    if grid:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] if isinstance(grid[k], list) else [grid[k]] for k in keys)):
            sets.append(dict(zip(keys, combo)))
    if not sets:
        raise UsageError(f"{where}: needs params or grid")
    return sets
