"""`parity repro ID`: rebuild a case's inputs bit for bit, re-run golden and kernel, explain.

`--export DIR` writes what an upstream bug report needs:

    case.json     the record (a one-case results file: limits, metrics, verdict, repro line)
    inputs.npz    the kernel's inputs, each in its own storage dtype: NumPy types as they are,
                  bfloat16 / fp8 / e8m0 / int4 / fp4 (ml_dtypes) as unsigned integers of their
                  width; a view into a padded buffer is saved as the whole buffer
    actual.npz    the kernel's outputs, the same way
    expected.npz  the float64 golden outputs
    layout.json   per array: its dtype's real name, shape, byte strides and offset into the buffer
                  saved, so `load_arrays` rebuilds every input bit for bit, padding included
    repro.py      a script: `python repro.py` re-runs the golden (and the kernel, where its backend
                  imports) through kernel-parity when it is installed, else judges the saved
                  outputs against the saved golden with the recorded limits; it prints the limits,
                  the verdict and the worst out-of-tolerance elements, and exits 1 when the case fails.

Every file is written atomically; the directory is checked before the case runs (conformance/cli.py).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kernel_parity.conformance import known, ops
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK, UsageError
from kernel_parity.conformance.inputs import storage
from kernel_parity.conformance.session import open_session
from kernel_parity.reports import files, records

_METRICS = ("max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp", "mismatch", "max_ref",
            "cond")  # cond: the error model's conditioning (OpSpec.magnitude), where the op has one
EXPORT_FILES = ("case.json", "inputs.npz", "expected.npz", "actual.npz", "layout.json", "repro.py")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def repro(args: Any, command: str = "") -> int:
    session = open_session(args.backend)
    case = ops.parse_case(args.case_id)
    backend = session.registry.get(case.backend)
    runner = session.runner()
    runner.capture = {} if args.export else None
    result = runner.evaluate(case)
    known.apply_one(result, session.entries)  # the same known failures as the gate (xfail / xpass)
    rec = result.to_json()
    print(f"case     {case.id}")
    print(f"backend  {backend.describe()}")
    print_record(rec)
    if args.json:
        from kernel_parity.conformance import env

        try:
            records.write(args.json, env.header(f"parity repro {case.id}"), [rec])
        except OSError as e:
            raise UsageError(f"--json {args.json!r} could not be written ({e.strerror or e})") from None
    if args.export:
        try:
            export(Path(args.export), rec, (runner.capture or {}).get(case.id))
        except OSError as e:
            raise UsageError(f"--export {args.export!r} could not be written ({e.strerror or e})") from None
        print(f"exported to {args.export}")
    return EXIT_FAIL if rec["verdict"] in records.FAILING else EXIT_OK


def _g(x: Any) -> str:
    """A figure rounded for reading (the record keeps every bit)."""
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def print_record(rec: dict, out: Any = None) -> None:
    """The repro printout of one record: per output its metrics, limits, noise comparison, layers
    and worst elements (out-of-tolerance ones first, marked), then the verdict."""
    w = out or sys.stdout
    for name, o in rec["outputs"].items():
        m = o.get("metrics", {})
        lim = o.get("limits") or {}
        print(f"output {name} ({o['dtype']}, shape {tuple(o['shape'])}{', exact' if o.get('exact') else ''})", file=w)
        if o.get("not_provided"):
            print(f"  not provided: {o['not_provided']}", file=w)
        for k in _METRICS:
            if k in m:
                print(f"  {k:<9} {m[k]!r}", file=w)
        if lim:
            print("  limits   " + ", ".join(f"{k}={_g(v)}" for k, v in lim.items() if v is not None), file=w)
        n = o.get("noise")
        if n:
            ok = n["err"] <= n["limit"]
            print(f"  noise    err {_g(n['err'])} {'<=' if ok else '>'} {_g(n['k'])} x baseline "
                  f"{_g(n['baseline_err'])} + floor {_g(n['floor'])} = {_g(n['limit'])}: {'ok' if ok else 'FAIL'}", file=w)
        for layer, res in o.get("layers", {}).items():
            state = "n/a" if res["ok"] is None else ("ok" if res["ok"] else "FAIL")
            print(f"  {layer:<9} {state}{': ' + res['detail'] if res['detail'] else ''}", file=w)
        for e in o.get("worst", []):
            mark = "OUT " if e.get("out") else ("in  " if e.get("out") is False else "")
            model = f" bound={_g(e['bound'])} (magnitude {_g(e['magnitude'])})" if "bound" in e else ""
            print(f"  worst    {mark}{name}{e['index']} got {e['got']!r} expected {e['expected']!r} "
                  f"|d|={_g(e['abs'])}{model}", file=w)
    if rec.get("recheck"):
        print(f"recheck  seeds {rec['recheck']['seeds']} -> {rec['recheck']['verdicts']}", file=w)
    sample = rec.get("sample")
    if sample:  # conformance/sampling.py
        print(f"sample   judged on {sample['rows']} of {sample['of']} rows ({sample['param']}; the whole outputs "
              f"scanned for NaN / inf / unwritten; --sample off judges every row)", file=w)
    if rec.get("message"):
        print(rec["message"], file=w)
    print(f"verdict  {rec['verdict']}{' (' + rec['kind'] + ')' if rec.get('kind') else ''}"
          f"{': ' + rec['reason'] if rec.get('reason') else ''}", file=w)


# -- export ------------------------------------------------------------------------------------
def _pack(a: Any) -> tuple[np.ndarray, dict]:
    """(the buffer to save, its layout entry) of one array: its own storage dtype, exactly."""
    a = np.asarray(a)
    buf = storage(a)
    if buf is not a and buf.flags.c_contiguous and buf.dtype == a.dtype:  # not a reinterpreting view
        offset = a.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
        strides = list(a.strides)
    else:
        buf = np.array(a, order="C")  # (not ascontiguousarray: it makes a 0-d array 1-d)
        offset, strides = 0, list(buf.strides)
    native = type(a.dtype).__module__.startswith("numpy") and a.dtype.kind in "biufc"
    saved = buf if native else buf.view(_UINT[a.dtype.itemsize])
    return np.array(saved, order="C"), {"dtype": a.dtype.name, "shape": list(a.shape), "strides": strides,
                                         "offset": int(offset), "buffer": list(buf.shape)}


def dtype_named(name: str) -> np.dtype:
    """The NumPy dtype of a layout entry's name (ml_dtypes' types by their own names)."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def unpack(saved: np.ndarray, entry: dict) -> np.ndarray:
    """The array a layout entry describes, rebuilt from its saved buffer (a writable copy)."""
    dtype = dtype_named(entry["dtype"])
    buf = np.ascontiguousarray(saved).copy().view(dtype).reshape(entry["buffer"])
    return np.ndarray(tuple(entry["shape"]), dtype, buffer=buf, offset=entry["offset"],
                      strides=tuple(entry["strides"]))


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    return bio.getvalue()


def export(folder: Path, rec: dict, arrays: dict | None) -> None:
    """Write the export files into `folder` (created if missing), each atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    if arrays is None:  # the case did not reach the kernel (a skip, an error building inputs)
        files.write_text(folder / "case.json", records.dump({}, [rec]))
        return
    layout: dict[str, dict] = {}
    blobs = {}
    for group, fname in (("inputs", "inputs.npz"), ("outputs", "actual.npz")):
        packed = {}
        for k, v in arrays[group].items():
            if not isinstance(v, np.ndarray) and not np.isscalar(v):
                continue  # an output the backend does not provide
            packed[k], layout[f"{group}/{k}"] = _pack(v)
        blobs[fname] = _npz_bytes(packed)
    blobs["expected.npz"] = _npz_bytes({k: np.asarray(v, dtype=np.float64) for k, v in arrays["golden"].items()})
    for fname, data in blobs.items():
        files.write_bytes(folder / fname, data)
    files.write_text(folder / "layout.json", json.dumps(layout, indent=1) + "\n")
    files.write_text(folder / "case.json", records.dump({}, [rec]))
    files.write_text(folder / "repro.py", _SCRIPT.replace("{case_id}", rec["id"]))


def load_arrays(folder: str | os.PathLike, group: str) -> dict[str, np.ndarray]:
    """The arrays of one group ("inputs" or "outputs") of an export, rebuilt bit for bit."""
    folder = Path(folder)
    layout = json.loads((folder / "layout.json").read_text(encoding="utf-8"))
    fname = "inputs.npz" if group == "inputs" else "actual.npz"
    with np.load(folder / fname) as z:
        return {k: unpack(z[k], layout[f"{group}/{k}"]) for k in z.files}


def replay_export(folder: str | os.PathLike, out: Any = None) -> int:
    """`python repro.py` with kernel-parity installed: rebuild the inputs from the export, re-run
    the golden and the kernel (or, where the kernel's backend cannot run here, judge the saved
    outputs), print limits, verdict and worst elements; 1 when the case fails, else 0."""
    from kernel_parity.conformance.backends import Backend, Registry
    from kernel_parity.conformance.runner import Prepared, Runner

    w = out or sys.stdout
    folder = Path(folder)
    doc = records.load(folder / "case.json")
    (saved,) = doc["results"]
    case = ops.parse_case(saved["id"])
    inputs = load_arrays(folder, "inputs")
    regenerated = Prepared(ops.get(case.op), case).inputs
    same = set(regenerated) == set(inputs) and all(
        _same_view(inputs[k], regenerated[k]) for k in inputs)
    print(f"case     {case.id}", file=w)
    print(f"inputs   {'inputs.npz (the same bits as the case seed draws)' if same else 'inputs.npz (they differ from the case seed draws: edited?)'}",
          file=w)
    origin = (saved.get("repro") or "").partition(" --backend ")[2].strip() or None
    why = None
    try:
        registry = Registry(extra=[origin] if origin else None)
        backend = registry.get(case.backend)
        why = backend.available()
    except (UsageError, Exception) as e:  # noqa: BLE001 - any import failure means: judge the saved outputs
        registry, why = Registry(), f"{type(e).__name__}: {e}"
    if why:
        actual = load_arrays(folder, "outputs")
        print(f"kernel   not re-run ({why}): judging the saved outputs (actual.npz)", file=w)
        fixed = Backend(name=case.backend, ops={case.op: lambda c, i, o: dict(actual)})
        registry = Registry()
        registry.add(fixed)  # the saved outputs stand in for the kernel
    else:
        print(f"kernel   re-run: {backend.describe()}", file=w)
    rec = Runner(registry, recheck=False).evaluate(case, inputs=inputs).to_json()
    print_record(rec, w)
    return 1 if rec["verdict"] in records.FAILING else 0


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    from kernel_parity.conformance.inputs import same_bits

    return a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides and same_bits(a, b)


_SCRIPT = '''"""Standalone repro of kernel-parity case {case_id}.

    python repro.py            exit 1 when the case fails, 0 when it passes

With kernel-parity installed, the inputs are rebuilt from inputs.npz (bit for bit, padding
included: layout.json), the float64 golden is re-run, and the kernel too where its backend runs
here; otherwise the saved outputs (actual.npz) are judged. Without kernel-parity, this script
judges actual.npz against expected.npz with the limits recorded in case.json (elementwise
atol + rtol |expected|, the cos_diff and nmse limits, NaN/inf positions, bit-exact outputs).
Needs numpy, and ml_dtypes for bfloat16 / fp8 / int4 / fp4 arrays.
"""
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def dtype_named(name):
    try:
        import ml_dtypes
        if hasattr(ml_dtypes, name):
            return np.dtype(getattr(ml_dtypes, name))
    except ImportError:
        pass
    return np.dtype(name)


def load(fname, group):
    layout = json.loads((HERE / "layout.json").read_text())
    out = {}
    with np.load(HERE / fname) as z:
        for k in z.files:
            e = layout[group + "/" + k]
            buf = z[k].copy().view(dtype_named(e["dtype"])).reshape(e["buffer"])
            out[k] = np.ndarray(tuple(e["shape"]), buf.dtype, buffer=buf, offset=e["offset"],
                                strides=tuple(e["strides"]))
    return out


def judge_saved():
    lines = (HERE / "case.json").read_text().splitlines()
    rec = next(json.loads(ln) for ln in lines[1:] if ln.strip() and "id" in json.loads(ln))
    actual, failed = load("actual.npz", "outputs"), []
    with np.load(HERE / "expected.npz") as z:
        expected = {k: z[k] for k in z.files}
    for name, o in rec["outputs"].items():
        if name not in actual or name not in expected:
            continue
        got, ref = actual[name], expected[name]
        if o.get("exact"):
            g = np.ascontiguousarray(got)
            r = np.ascontiguousarray(ref).astype(g.dtype)
            if g.dtype.kind not in "iub":
                g, r = g.view("u%d" % g.dtype.itemsize), r.view("u%d" % g.dtype.itemsize)
            bad = np.argwhere(g != r)
            print("%s: exact, %d differing element(s)" % (name, len(bad)))
            for i in bad[:5]:
                print("  OUT %s%s got %r expected %r" % (name, list(i), g[tuple(i)], r[tuple(i)]))
            if len(bad):
                failed.append(name)
            continue
        lim = o.get("limits") or {}
        a, b = got.astype(np.float64), ref.astype(np.float64)
        cls = lambda x: np.where(np.isnan(x), 1, np.where(np.isposinf(x), 2, np.where(np.isneginf(x), 3, 0)))
        anomalies = int((cls(a) != cls(b)).sum())
        both = np.isfinite(a) & np.isfinite(b)
        d = np.abs(a - b)
        allowed = lim.get("atol", 0.0) + lim.get("rtol", 0.0) * np.abs(b)
        out = both & (d > allowed)
        af, bf = a[both], b[both]
        sq, bb, den = float(((af - bf) ** 2).sum()), float((bf ** 2).sum()), float((af ** 2 + bf ** 2).sum())
        nmse = 0.0 if sq == 0 else (sq / bb if bb > 0 else float("inf"))
        cos = 0.0 if den == 0 else 1 - 2 * float((af * bf).sum()) / den
        cos_lim = lim.get("cos_diff_eff", lim.get("cos_diff"))
        nmse_lim = lim.get("nmse_eff", lim.get("nmse"))
        print("%s: limits %s" % (name, ", ".join("%s=%.3g" % kv for kv in lim.items() if kv[1] is not None)))
        print("  %d element(s) out of tolerance, %d NaN/inf position(s) differ, cos_diff=%.3g nmse=%.3g"
              % (int(out.sum()), anomalies, cos, nmse))
        ratio = np.where(out, d / np.maximum(allowed, 1e-300), 0.0)
        for i in np.argsort(-ratio, axis=None)[:5]:
            i = np.unravel_index(i, a.shape)
            if not out[i]:
                break
            print("  OUT %s%s got %r expected %r |d|=%.3g" % (name, list(map(int, i)), a[i], b[i], d[i]))
        if out.any() or anomalies or (cos_lim is not None and cos > cos_lim) or (nmse_lim is not None and nmse > nmse_lim):
            failed.append(name)
    verdict = "fail" if failed or rec["verdict"] in ("fail", "error", "crash", "timeout", "flaky", "xpass") else "pass"
    print("recorded verdict %s; saved outputs: %s" % (rec["verdict"], "FAIL (" + ", ".join(failed) + ")" if failed else "within the limits"))
    print("verdict  " + verdict)
    return 1 if verdict == "fail" else 0


if __name__ == "__main__":
    try:
        from kernel_parity.conformance.repro import replay_export
    except ImportError:
        sys.exit(judge_saved())
    sys.exit(replay_export(HERE))
'''
