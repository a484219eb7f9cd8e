"""Judging a large output on a seeded sample of its rows (the models suite's sizes).

For an op whose outputs are independent across rows (an op spec's `rows`: output row i depends
only on input row i and on inputs every row shares: norms, RoPE, the GLUs, GEMM rows, MLA decode
requests), the float64 golden and the comparison run on a subset of the rows when the outputs are
large; the kernel still runs on the whole input. The subset always holds

- the first two and the last two rows,
- every edge of the row tiles (rows r with r % tile in {0, tile - 1}, tile the spec's), so a kernel's
  first and last row of each tile is judged whatever its tile size divides,
- rows 2^j - 1, 2^j, 2^j + 1 (index arithmetic that overflows a power of two),
- the rows the spec names as always judged (`Rows.always`: e.g. MLA requests of length 0, 1 or at a
  page edge),
- min(SAMPLE_RANDOM, rows / 8) rows drawn from the case seed (their own stream: the inputs do not
  change),

and, after the kernel ran, every row where any sampled output holds NaN, inf or the poison pattern:
the whole output is still scanned for non-finite values (and for unwritten elements, canaries and row
padding, which the runner checks on the whole buffers), and the golden of those rows is added before
judging, so a NaN anywhere is judged exactly as in a full run. The record's `sample` says so:
{"param": "rows", "rows": k, "of": n}.

What the sample cannot see: a wrong finite value confined to rows outside it. Every such bug still
fails a ci case, where outputs are small and judged whole (SAMPLE_MIN elements and below), and
tests/test_sampling.py checks that (and that sampled and full verdicts agree on the ci suite).
`KERNEL_PARITY_SAMPLE` (`--sample`): "auto" (default: sample outputs over SAMPLE_MIN elements, unless
the sample would hold most rows), "off" (judge every row, however large), or a number of elements to
sample above (always sampled then, for tests: 0 samples every case of a row-independent op).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

ENV = "KERNEL_PARITY_SAMPLE"
SAMPLE_MIN = 1 << 22  # output elements (over the sampled outputs) above which a case is sampled
SAMPLE_RANDOM = 256  # seeded rows beyond the edges
SAMPLE_STREAM = 0x73616D  # the sample of a case comes from PCG64([seed, SAMPLE_STREAM])


def threshold() -> int | None:
    """Output elements above which a case is sampled; None: never (KERNEL_PARITY_SAMPLE=off)."""
    v = os.environ.get(ENV, "auto").strip().lower()
    if v in ("", "auto"):
        return SAMPLE_MIN
    if v == "off":
        return None
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        from kernel_parity.conformance.errors import UsageError

        raise UsageError(f"{ENV}={v!r}: expected auto, off or a number of output elements >= 0")
    return n


@dataclass
class RowSample:
    """The judged rows of one input group (sorted, unique) out of `n` rows of `param`."""

    param: str
    n: int
    idx: np.ndarray

    @property
    def tag(self) -> str:
        """A digest of the rows (part of the golden cache's key)."""
        return hashlib.sha256(self.idx.astype(np.int64).tobytes()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {"param": self.param, "rows": int(self.idx.size), "of": int(self.n)}


def edge_rows(n: int, tile: int) -> np.ndarray:
    """First and last two rows, every tile's first and last row, and 2^j - 1, 2^j, 2^j + 1."""
    r = np.arange(0, n, max(1, tile))
    powers = 1 << np.arange(max(1, n.bit_length() + 1))
    cand = np.concatenate([[0, 1, n - 2, n - 1], r, r + tile - 1, powers - 1, powers, powers + 1])
    return np.unique(cand[(cand >= 0) & (cand < n)])


def choose(spec: Any, case: Any, inputs: dict[str, np.ndarray]) -> RowSample | None:
    """The rows to judge for this group, or None to judge every row (small outputs, an op whose
    outputs are not row-independent, sampling switched off, or a sample that would be most rows)."""
    rows = getattr(spec, "rows", None)
    limit = threshold()
    if rows is None or spec.vjp is not None or limit is None:
        return None
    p = case.p
    if size(spec, p) <= limit:
        return None
    n = int(p[rows.param])
    pick = [edge_rows(n, rows.tile)]
    if rows.always is not None:
        pick.append(np.asarray(rows.always(p, inputs), dtype=np.int64).reshape(-1))
    rng = np.random.Generator(np.random.PCG64([case.seed, SAMPLE_STREAM]))
    pick.append(rng.choice(n, min(SAMPLE_RANDOM, max(1, n // 8)), replace=False))
    idx = np.unique(np.concatenate(pick).astype(np.int64))
    idx = idx[(idx >= 0) & (idx < n)]
    if idx.size * 2 > n and limit == SAMPLE_MIN:  # most rows anyway: judge them all (unless asked)
        return None
    return RowSample(rows.param, n, idx)


def size(spec: Any, p: dict[str, Any]) -> int:
    """The elements a case's golden and judging go through (`Rows.size`, default its outputs')."""
    if spec.rows.size is not None:
        return int(spec.rows.size(p))
    shapes = spec.output_shapes(p)
    return int(sum(int(np.prod(s)) for name, s in shapes.items() if name in spec.rows.outputs))


def take_rows(a: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    return np.take(np.asarray(a), idx, axis=axis)


def sub_inputs(spec: Any, p: dict[str, Any], inputs: dict[str, np.ndarray], idx: np.ndarray
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(params, inputs) of the sampled rows alone: row-indexed inputs taken, shared ones as they are."""
    rows = spec.rows
    if rows.subset is not None:
        return rows.subset(p, inputs, idx)
    sub = {k: (take_rows(v, idx, rows.inputs[k]) if k in rows.inputs else v) for k, v in inputs.items()}
    return {**p, rows.param: int(idx.size)}, sub


def sub_shape(shape: tuple[int, ...], axis: int, k: int) -> tuple[int, ...]:
    s = list(shape)
    s[axis] = k
    return tuple(s)


def flagged_rows(spec: Any, sample: RowSample, outputs: dict[str, Any]) -> np.ndarray:
    """Rows outside the sample where a sampled output holds NaN or inf (the poison included)."""
    found = []
    for name, axis in spec.rows.outputs.items():
        got = outputs.get(name)
        if not isinstance(got, np.ndarray) or got.ndim <= axis or got.shape[axis] != sample.n:
            continue
        bad = ~_finite(got)
        if bad.any():
            other = tuple(i for i in range(got.ndim) if i != axis)
            found.append(np.flatnonzero(bad.any(axis=other) if other else bad))
    if not found:
        return np.zeros(0, dtype=np.int64)
    rows = np.unique(np.concatenate(found))
    return rows[~np.isin(rows, sample.idx)]


def _finite(a: np.ndarray) -> np.ndarray:
    """isfinite for any float storage (ml_dtypes included), integers all finite; from the bit pattern
    where the dtype is a 16-bit float (a cast of 10^8 bf16 values to float64 is the slow way)."""
    if a.dtype.kind in "iub":
        return np.ones(a.shape, dtype=bool)
    if a.dtype.itemsize == 2:
        bits = np.ascontiguousarray(a).view(np.uint16)
        if a.dtype == np.float16:
            return (bits & 0x7C00) != 0x7C00
        if a.dtype.name == "bfloat16":
            return (bits & 0x7F80) != 0x7F80
    with np.errstate(invalid="ignore"):
        return np.isfinite(a.astype(np.float64) if a.dtype.kind == "V" or a.dtype.itemsize == 1 else a)


def cache_variant(spec: Any) -> str:
    """The golden cache's key beside the group's identity: entries of a sampled and a full run differ."""
    if getattr(spec, "rows", None) is None or spec.vjp is not None:
        return ""
    limit = threshold()
    return "" if limit is None else f"sample>{limit}"


def same(sample: RowSample | None, idx: Any) -> bool:
    if sample is None or idx is None:
        return sample is None and idx is None
    return bool(np.array_equal(sample.idx, np.asarray(idx)))


def judged(prep: Any, outputs: dict[str, Any]) -> dict[str, Any]:
    """The kernel outputs as the references hold them: sampled outputs' rows taken."""
    if prep.sample is None:
        return outputs
    out = {}
    for name, got in outputs.items():
        axis = prep.row_axis(name) if name in prep.shapes else None
        ok = axis is not None and isinstance(got, np.ndarray) and got.ndim > axis and got.shape[axis] == prep.sample.n
        out[name] = take_rows(got, prep.sample.idx, axis) if ok else got
    return out


def golden_nan(prep: Any, name: str) -> np.ndarray:
    """Where the golden of output `name` is NaN, over the whole output (rows outside a sample: False;
    the sample holds every row where the kernel wrote a NaN, see Prepared.widen)."""
    g = np.asarray(prep.golden[name], dtype=np.float64)
    axis = prep.row_axis(name)
    if axis is None:
        return np.isnan(g)
    full = np.zeros(prep.shapes[name], dtype=bool)
    index = [slice(None)] * full.ndim
    index[axis] = prep.sample.idx
    full[tuple(index)] = np.isnan(g)
    return full


def full_index(prep: Any, name: str, index: list[int]) -> list[int]:
    """An element's index in the sampled output -> its index in the whole output."""
    axis = prep.row_axis(name)
    if axis is None or not index:
        return index
    out = list(index)
    out[axis] = int(prep.sample.idx[index[axis]])
    return out
