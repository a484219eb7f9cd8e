"""Realistic results documents for the report tests, built from the records measured on an H100 that
are committed under reports/baselines/ (every field a real record has: several outputs, limits,
layers, worst elements, noise, messages, skips with reasons, known failures, errors).

`sample(n)` takes real records as they are (failures of liger and quack included); `scaled(n)`
replicates them to n cases on fresh seed numbers, scales each copy's errors by a log-normal factor,
and turns a few copies into the failures a kernel team meets (a diagnosed causal-alignment bug,
crashes, timeouts, shrunk cases), so a 20,000-case file has the shape of a real one.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import random
from pathlib import Path

from kernel_parity.reports import records

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "reports" / "baselines"
SOURCES = ("ci-h100.jsonl.gz", "peers-liger-h100.jsonl.gz", "peers-quack-h100.jsonl.gz", "models-h100.jsonl.gz",
           "ci-quant-mla-h100.jsonl.gz", "ci-mlp-h100.jsonl.gz", "ci-rope-h100.jsonl.gz")


@functools.lru_cache(maxsize=1)
def _lines() -> tuple[dict, tuple[tuple[str, str], ...]]:
    """(header, (verdict, record line) ...) of the committed H100 files (ids unique, first wins)."""
    header, seen = None, {}
    for name in SOURCES:
        lines = gzip.decompress((BASELINES / name).read_bytes()).decode("utf-8").splitlines()
        header = header or json.loads(lines[0])["header"]
        for line in lines[1:]:
            obj = json.loads(line)
            if "id" in obj:
                seen.setdefault(obj["id"], (obj["verdict"], line))
    return header, tuple(seen.values())


def header(**extra) -> dict:
    return {**copy.deepcopy(_lines()[0]), **extra}


def sample(n: int, seed: int = 0) -> list[dict]:
    """n real records: every failing, erroring and known-failing one first, then a spread of the rest."""
    lines = _lines()[1]
    bad = [line for v, line in lines if v != "pass"]
    good = [line for v, line in lines if v == "pass"]
    random.Random(seed).shuffle(good)
    return [json.loads(line) for line in (bad + good)[:n]]


def _renamed(r: dict, seed: int) -> dict:
    old = r["id"]
    new = old.rsplit("/seed=", 1)[0] + f"/seed={seed}"
    r["id"], r["seed"] = new, seed
    r["repro"] = r["repro"].replace(old, new)
    if r.get("message"):
        r["message"] = r["message"].replace(old, new)
    return r


def _scale(r: dict, f: float) -> None:
    if isinstance(r.get("norm_err"), float):
        r["norm_err"] *= f
    for o in r["outputs"].values():
        m = o.get("metrics") or {}
        for k in ("max_abs", "max_rel", "rmse", "nmse", "cos_diff"):
            if isinstance(m.get(k), float):
                m[k] *= f


def _alignment_bug(r: dict) -> None:
    """A passing attention record, now failing the way a top-left causal mask fails."""
    name, out = next(iter(r["outputs"].items()))
    out["layers"]["numeric"] = {"ok": False, "detail": "17 elements outside tol"}
    out["worst"] = [{"index": [0, 5, 1, i], "got": 0.5 + i / 8, "expected": 0.25, "abs": 0.25 + i / 8,
                     "rel": 1.0 + i / 2, "out": True} for i in range(4)]
    r.update(verdict="fail", kind="numeric", norm_err=25.0 * (1 + r["seed"] % 7),
             reason=f"{name}: 17 elements outside tol, cos_diff=3.1e-03",
             message=f"{r['op']}[{r['backend']}] {name}: 17 elements outside tol\n  {name}[0, 5, 1, 0] = 0.5, "
                     f"expected 0.25  |d|=0.25 rel=1\n  repro: {r['repro']}",
             diagnosis=["matches the other causal alignment: alignment bug"])
    r["layers"]["numeric"] = "fail"
    r["shrunk"] = {"id": r["id"].split("/")[0] + "/" + r["backend"] + "/fp32/b=1,sq=2,sk=3/normal/seed=0",
                   "verdict": "fail", "kind": "numeric", "norm_err": 12.0, "reason": "o: 1 element outside tol",
                   "repro": "parity repro " + r["id"].split("/")[0] + "/" + r["backend"] + "/fp32/b=1,sq=2,sk=3/normal/seed=0"}


def scaled(n: int, seed: int = 0) -> dict:
    """A finished results document of n cases with the shape of a real run (see the module doc)."""
    rng = random.Random(seed)
    lines = [line for _, line in _lines()[1]]
    out = []
    k = 0
    while len(out) < n:
        for line in lines:
            if len(out) >= n:
                break
            r = json.loads(line)
            if k:
                r = _renamed(r, r["seed"] + 1000 * k)
            if k:
                _scale(r, rng.lognormvariate(0, 1))
                roll = rng.random()
                if r["op"] == "attention.prefill" and r["verdict"] == "pass" and roll < 0.05:
                    _alignment_bug(r)
                elif r["verdict"] == "pass" and roll < 0.001:
                    r.update(verdict="crash", kind=None, norm_err=None, outputs={},
                             reason="worker died: SIGSEGV (signal 11)", message="the worker running this case died: SIGSEGV")
                elif r["verdict"] == "pass" and roll < 0.0015:
                    r.update(verdict="timeout", kind=None, norm_err=None, outputs={},
                             reason="exceeded 600 s", message="killed after 600 s (--timeout)")
            out.append(r)
        k += 1
    return {"schema": records.SCHEMA, "header": header(planned=n), "results": out, "complete": {"cases": n}}


def write(path: Path, doc: dict) -> Path:
    records.write(path, doc["header"], doc["results"], doc.get("complete"))
    return path
