"""benchmarks/gluon_sm90.py's `main` on several kernels in one process, for tests/test_gluon.py.

    python tests/gluon_sm90_batch.py OUT.jsonl '[["gemm_fp8"], ["prefill", "128", "1"], ["mla", "0"]]'

Each job is the argument list of one `python benchmarks/gluon_sm90.py ...`, run through the same `main` (argument
checks, the stand-in driver, the whole compiler, ptxas -v). One process pays torch's and Triton's start-up once
instead of once a kernel: 17 compiles, one process each, spent about a third of their time importing (~50 s of
a 2-core machine). A job's exit code and its whole output, file descriptors 1 and 2 alike (Triton's compiler
prints its diagnostics from C++, the script prints ptxas's report), are one JSON line of OUT, written as the job
ends: a process that dies part-way leaves the answers of the jobs before it, and a `started` line names the job
it died in.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_captured(fn, argv: list[str]) -> tuple[int, str]:
    """(exit code, everything written to fd 1 and 2) of fn(argv), as a process of its own would give them."""
    with tempfile.TemporaryFile("w+b") as cap:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(cap.fileno(), 1)
        os.dup2(cap.fileno(), 2)
        try:
            try:
                code = fn(argv)
            except SystemExit as e:  # the script's argument errors: exit 2 with one line
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001  (what an uncaught exception does to a process: exit 1)
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        cap.seek(0)
        return int(code or 0), cap.read().decode(errors="replace")


def main(out: str, jobs: list[list[str]]) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gluon_sm90

    with open(out, "a") as f:
        for argv in jobs:
            f.write(json.dumps({"argv": argv, "started": True}) + "\n")
            f.flush()
            code, text = _run_captured(gluon_sm90.main, list(argv))
            f.write(json.dumps({"argv": argv, "rc": code, "out": text}) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
