"""`parity list`: ops (with parameters, dtypes, distributions), backends, suites, cases."""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.backends import Registry
from kernel_parity.conformance.errors import EXIT_OK


def list_things(args: Any, command: str = "") -> int:
    what = args.what
    if what in ("all", "ops"):
        print("ops:")
        for spec in ops.match(args.op or None):
            params = ", ".join(f"{k} ({p.describe()})" for k, p in spec.params.params.items())
            print(f"  {spec.name:<26} {spec.doc}")
            print(f"  {'':<26} params: {params}")
            print(f"  {'':<26} dtypes: {', '.join(spec.dtypes)}; dists: {', '.join(spec.dists)}; "
                  f"outputs: {', '.join(spec.outputs)}")
    if what in ("all", "backends"):
        registry = Registry(extra=[b for b in args.backend if ":" in b])
        print("backends:")
        for name in registry.names():
            try:
                b = registry.get(name)
                why = b.available()
                state = "available" if not why else f"unavailable: {why}"
                print(f"  {name:<15} {b.describe():<32} {state}")
            except Exception as e:  # a broken third-party backend must not hide the others
                print(f"  {name:<15} {'?':<32} broken: {type(e).__name__}: {e}")
    if what in ("all", "suites"):
        print("suites:")
        for name in suites.names():
            print(f"  {name:<10} {len(suites.cases(name)):>6} cases  {suites.description(name)}")
    if what == "cases":  # the cases `parity run` with the same flags would run (configuration included)
        from kernel_parity.conformance.commands import Selection, select_cases
        from kernel_parity.conformance.session import open_session

        session = open_session(args.backend)
        args.shard = getattr(args, "shard", None)
        for c in select_cases(Selection.from_args(args, session), session):
            print(c.id)
    return EXIT_OK
