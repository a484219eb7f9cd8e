"""Cases and case ids.

A case is everything needed to rebuild a run bit for bit:

    <op>/<backend>/<dtype>/<k=v,...>/<dist>/seed=<n>
    softmax.softmax/triton/fp16/rows=3,n=113,pad=0/normal/seed=0

Ids are canonical (parameters in the spec's order, dtype by its short name), shell-safe,
parseable, and stable across runs and machines. Inputs come from
numpy Generator(PCG64(seed)), so an id is a complete reproduction recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kernel_parity.conformance.errors import UsageError

_SAFE = re.compile(r"^[A-Za-z0-9_.+\-]+$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.+\-]*$")


@dataclass(frozen=True)
class Case:
    op: str
    backend: str
    dtype: str
    params: tuple[tuple[str, Any], ...]
    dist: str
    seed: int

    @staticmethod
    def make(op: str, backend: str, dtype: str, params: dict[str, Any], dist: str, seed: int) -> "Case":
        for what, v in (("op", op), ("backend", backend), ("dtype", dtype), ("dist", dist)):
            if not _SAFE.match(v):
                raise UsageError(f"{what} {v!r} has characters not allowed in a case id (use letters, digits, _ . + -)")
        for k, v in params.items():
            if not _SAFE.match(k) or not _SAFE_VALUE.match(str(v)):
                raise UsageError(f"parameter {k}={v!r} has characters not allowed in a case id")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
        return Case(op, backend, dtype, tuple(params.items()), dist, seed)

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def params_text(self) -> str:
        return ",".join(f"{k}={_fmt(v)}" for k, v in self.params) or "-"

    @property
    def id(self) -> str:
        return f"{self.op}/{self.backend}/{self.dtype}/{self.params_text}/{self.dist}/seed={self.seed}"

    @property
    def input_key(self) -> tuple:
        """Everything that determines the inputs and golden (not the backend)."""
        return (self.op, self.dtype, self.params, self.dist, self.seed)

    def with_backend(self, backend: str) -> "Case":
        return Case(self.op, backend, self.dtype, self.params, self.dist, self.seed)

    def with_seed(self, seed: int) -> "Case":
        return Case(self.op, self.backend, self.dtype, self.params, self.dist, seed)

    def __str__(self) -> str:
        return self.id


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def split_id(text: str) -> tuple[str, str, str, str, str, int]:
    """Split an id into its six fields without consulting any spec; UsageError if malformed."""
    parts = text.strip().split("/")
    if len(parts) != 6:
        raise UsageError(
            f"malformed case id {text!r}: expected op/backend/dtype/params/dist/seed=N "
            f"(6 fields separated by '/'), got {len(parts)}"
        )
    op, backend, dtype, params, dist, seed = parts
    for what, v in (("op", op), ("backend", backend), ("dtype", dtype), ("dist", dist)):
        if not v or not _SAFE.match(v):
            raise UsageError(f"malformed case id {text!r}: bad {what} field {v!r}")
    m = re.fullmatch(r"seed=(0|[1-9][0-9]{0,18})", seed)
    if not m or int(m.group(1)) >= 2**63:
        raise UsageError(f"malformed case id {text!r}: last field must be seed=N (N a non-negative decimal "
                         f"integer below 2**63), got {seed!r}")
    return op, backend, dtype, params, dist, int(m.group(1))
