"""`parity repro ID`: rebuild a case's inputs bit for bit, re-run golden and kernel, explain.

`--export DIR` writes what an upstream bug report needs: inputs.npz (storage dtypes; bf16 as
its uint16 bits), expected.npz (float64 golden), actual.npz (kernel outputs), case.json
(the record) and repro.py, a NumPy-only script that recomputes the metrics from those files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kernel_parity.conformance import ops
from kernel_parity.conformance.errors import EXIT_FAIL, EXIT_OK
from kernel_parity.conformance.session import open_session
from kernel_parity.reports import records

_METRICS = ("max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp", "mismatch", "max_ref")


def repro(args: Any, command: str = "") -> int:
    session = open_session(args.backend)
    case = ops.parse_case(args.case_id)
    backend = session.registry.get(case.backend)
    runner = session.runner()
    runner.capture = {} if args.export else None
    rec = runner.evaluate(case).to_json()
    print(f"case     {case.id}")
    print(f"backend  {backend.describe()}")
    for name, o in rec["outputs"].items():
        m = o.get("metrics", {})
        lim = o.get("limits") or {}
        print(f"output {name} ({o['dtype']}, shape {tuple(o['shape'])}{', exact' if o.get('exact') else ''})")
        for k in _METRICS:
            if k in m:
                print(f"  {k:<9} {m[k]!r}")
        if lim:
            print("  limits   " + ", ".join(f"{k}={v!r}" for k, v in lim.items() if v is not None))
        if o.get("noise"):
            n = o["noise"]
            print(f"  noise    err {n['err']!r} <= {n['k']} x baseline {n['baseline_err']!r} + floor {n['floor']!r}")
        for layer, res in o.get("layers", {}).items():
            state = "n/a" if res["ok"] is None else ("ok" if res["ok"] else "FAIL")
            print(f"  {layer:<9} {state}{': ' + res['detail'] if res['detail'] else ''}")
        for w in o.get("worst", []):
            print(f"  worst    {name}{w['index']} got {w['got']!r} expected {w['expected']!r} |d|={w['abs']:.3g}")
    if rec.get("recheck"):
        print(f"recheck  seeds {rec['recheck']['seeds']} -> {rec['recheck']['verdicts']}")
    if rec.get("message"):
        print(rec["message"])
    print(f"verdict  {rec['verdict']}{' (' + rec['kind'] + ')' if rec.get('kind') else ''}"
          f"{': ' + rec['reason'] if rec.get('reason') else ''}")
    if args.json:
        from kernel_parity.conformance import env

        records.write(args.json, env.header(f"parity repro {case.id}"), [rec])
    if args.export:
        export(Path(args.export), rec, (runner.capture or {}).get(case.id))
        print(f"exported to {args.export}")
    return EXIT_FAIL if rec["verdict"] in records.FAILING else EXIT_OK


def _bits(a: np.ndarray) -> tuple[np.ndarray, str]:
    a = np.ascontiguousarray(a)
    name = a.dtype.name
    if a.dtype.kind == "V" or name == "bfloat16":
        return a.view(np.uint16), "bfloat16"
    return a, name


def export(folder: Path, rec: dict, arrays: dict | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.json").write_text(records.dump({}, [rec]), encoding="utf-8")
    if arrays is None:
        return
    dtypes = {}
    for group in ("inputs", "outputs"):
        packed = {}
        for k, v in arrays[group].items():
            packed[k], dtypes[f"{group}/{k}"] = _bits(np.asarray(v))
        np.savez(folder / f"{'actual' if group == 'outputs' else 'inputs'}.npz", **packed)
    np.savez(folder / "expected.npz", **{k: np.asarray(v, dtype=np.float64) for k, v in arrays["golden"].items()})
    (folder / "dtypes.json").write_text(json.dumps(dtypes, indent=1), encoding="utf-8")
    (folder / "repro.py").write_text(_SCRIPT.format(case_id=rec["id"]), encoding="utf-8")


_SCRIPT = '''"""Standalone repro of kernel-parity case {case_id}.

inputs.npz holds the kernel inputs in their storage dtypes (bfloat16 as uint16 bits, see
dtypes.json), expected.npz the float64 golden outputs, actual.npz the kernel's outputs.
Run: python repro.py   (needs numpy; ml_dtypes only to decode bfloat16)
"""
import json
from pathlib import Path

import numpy as np

here = Path(__file__).parent
dtypes = json.loads((here / "dtypes.json").read_text())


def decode(group, name, a):
    if dtypes.get(f"{{group}}/{{name}}") == "bfloat16":
        import ml_dtypes
        return a.view(ml_dtypes.bfloat16)
    return a


expected = np.load(here / "expected.npz")
actual = np.load(here / "actual.npz")
for name in expected.files:
    b = expected[name]
    a = decode("outputs", name, actual[name]).astype(np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    d = np.abs(a[both] - b[both])
    nmse = float((d ** 2).sum() / max((b[both] ** 2).sum(), 1e-300))
    cos = 1 - 2 * float((a[both] * b[both]).sum()) / max(float((a[both] ** 2 + b[both] ** 2).sum()), 1e-300)
    print(f"{{name}}: max_abs={{d.max() if d.size else 0.0:.6g}} nmse={{nmse:.6g}} cos_diff={{cos:.6g}} "
          f"nonfinite mismatch={{int((np.isfinite(a) != np.isfinite(b)).sum())}}")
'''
