"""OpSpec: an op described as data.

An op is named `<stem>.<function>`: `refimpl.<stem>.<function>` is its golden and every other
folder uses the same stem (conformance/ops/<stem>.py, kernels/*/<stem>.*,
property_tests/test_<stem>.py). A self-test checks the rule for every registered spec.

Contracts an op may declare, beyond one golden and one dtype:
- per-tensor dtypes: `dtype_sets = {"w4a8": {"a": "fp8e4m3", "w": "int4", "y": "bf16"}}`; a case
  whose dtype is a set's name gives each tensor (input or output) its own dtype;
- several references: `references = {"emulated": fn}` besides the main one (`reference_name`);
  every reference's error is recorded per output, `Output.reference` says which judges it, and a
  backend may claim one for its kernel (`Backend.claims = {op: reference}`);
- ordered intermediates: `stages = ("norm", "proj", ...)`, outputs of a fused op in pipeline
  order; the record names the first stage that diverges from the composed golden;
- in-place outputs: `Output(inplace="cache")` is that input as the kernel left it (every other
  input must stay untouched); `inplace` may be a function of the case's params naming the input or
  None, for an op whose param chooses between a separate output and one written over an input;
- gradients: `vjp(inputs64, params, cotangents) -> {grad: array}` is a float64 VJP golden; the
  cotangents (of the outputs in `cotangent_of`) are drawn from the case seed; `gradients` declares
  the gradient outputs, judged by the same layers (the noise layer with `Tol.grad_noise_k`);
- inputs in their storage dtype: `storage_inputs = frozenset({"kv_cache"})` hands those to the
  references as stored (bf16, fp16, fp8), for goldens that widen exactly what they read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.errors import SpecError, UsageError
from kernel_parity.conformance.params import Schema
from kernel_parity.conformance.tolerance import Tol

Inputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class Output:
    """One output tensor. dtype "test" means the case's dtype (its own entry in a dtype set);
    exact means bit-exact."""

    dtype: str = "test"
    exact: bool = False
    nan_is_any: bool = False  # the golden's NaN marks "any value is right here" (an empty split's O)
    tol_dtype: str | None = None  # judge with this dtype's limits ("test": the case's) instead of the output's
    reference: str | None = None  # the reference that judges it (None: the op's main one)
    # this output is the input of that name, as the kernel left it; or a function of the case's params
    # giving that name or None (a param that chooses between a separate output and one over an input)
    inplace: str | Callable[[dict[str, Any]], str | None] | None = None
    # exact float outputs: False when a NaN is computed by arithmetic (its payload and sign are the
    # hardware's: x86 makes 0xFFC00000, a GPU 0x7FFFFFFF), so any NaN matches a NaN of the golden
    nan_bits: bool = True
    doc: str = ""

    def inplace_of(self, p: dict[str, Any]) -> str | None:
        """The input this output is written over in a case of params p, or None (a separate buffer)."""
        return self.inplace(p) if callable(self.inplace) else self.inplace

    def resolve(self, case_dtype: str) -> dt.DType:
        """The output's dtype for a plain (single-dtype) case; OpSpec.out_dtype handles sets."""
        return dt.get(case_dtype if self.dtype == "test" else self.dtype)

    def accept_any(self, got: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """`got` with the golden's "any value" positions (its NaNs) made equal to it, when nan_is_any."""
        if not self.nan_is_any:
            return got
        anywhere = np.isnan(ref)
        return np.where(anywhere, np.array(np.nan, dtype=got.dtype), got) if anywhere.any() else got


@dataclass(frozen=True)
class Diagnosis:
    """An alternative semantics a wrong kernel may have implemented.

    `alter(params)` returns the params of the alternative golden (None: not applicable to this
    case); if the kernel's outputs pass against that golden, the failure is named by `label`,
    e.g. "matches top_left causal: alignment bug".
    """

    label: str
    alter: Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class Rows:
    """The op's outputs are independent across rows: output row i depends only on row i of the
    row-indexed inputs and on the inputs every row shares. At model sizes the golden and the
    comparison then run on a seeded sample of the rows (conformance/sampling.py)."""

    param: str  # the param that counts the rows ("rows", "t", "m", "b")
    inputs: dict[str, int]  # row-indexed input -> its row axis (the others are shared, read whole)
    outputs: dict[str, int]  # output -> its row axis (every output of the op)
    tile: int = 128  # row tiles whose first and last rows are always judged
    # rows always judged beyond the edges: (params, inputs) -> row indices (e.g. empty requests)
    always: Callable[[dict[str, Any], dict[str, np.ndarray]], np.ndarray] | None = None
    # (params, inputs, rows) -> (params, inputs) of those rows alone, where taking rows of the named
    # inputs is not the whole story; default: take them and set `param` to the count
    subset: Callable[[dict[str, Any], dict[str, np.ndarray], np.ndarray],
                     tuple[dict[str, Any], dict[str, np.ndarray]]] | None = None
    # the elements a case's golden and judging go through, compared with the sampling threshold;
    # default: the outputs' (MLA decode reads b x kv x 576 cache values for a small output)
    size: Callable[[dict[str, Any]], int] | None = None


@dataclass(frozen=True)
class OpSpec:
    name: str  # "<stem>.<function>"
    golden: Callable[..., Any]  # the refimpl function (for the one-stem self-test and docs)
    reference: Callable[[Inputs, dict[str, Any]], dict[str, np.ndarray]]  # float64 inputs -> outputs
    params: Schema
    make_inputs: Callable[[dict[str, Any], str, str, np.random.Generator], Inputs]  # params, dtype, dist, rng
    output_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    outputs: dict[str, Output]
    tolerance: Tol
    dtypes: tuple[str, ...] = dt.FLOAT_TEST_DTYPES
    dists: dict[str, str] = field(default_factory=dict)  # name -> description
    check: Callable[[dict[str, Any]], str | None] | None = None  # cross-parameter constraint
    output_pads: Callable[[dict[str, Any]], dict[str, int]] | None = None  # poisoned row padding per output
    diagnoses: tuple["Diagnosis", ...] = ()  # alternative semantics to name when a case fails
    baseline: str | None = "torch"  # same-precision backend: the noise layer, and the only "baseline" tier
    diagnosis_budget_s: float = 30.0  # skip diagnoses when the alternative goldens would cost more
    backends: tuple[str, ...] = ("triton", "cpu", "torch")  # built-ins that must implement it
    doc: str = ""
    dtype_sets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> {tensor: dtype}
    references: dict[str, Callable[[Inputs, dict[str, Any]], dict[str, np.ndarray]]] = field(default_factory=dict)
    reference_name: str = "golden"  # the name of `reference` among the references
    stages: tuple[str, ...] = ()  # intermediate outputs, in pipeline order
    vjp: Callable[[Inputs, dict[str, Any], dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    cotangent_of: tuple[str, ...] = ()  # forward outputs that receive a cotangent
    gradients: dict[str, Output] = field(default_factory=dict)  # gradient outputs (judged like outputs)
    gradient_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]] | None = None
    # `parity bench`'s cost model: the matmul work of one call, and (bytes read, bytes written) when
    # "every input read once, every output written once" is not what the kernel moves
    flops: Callable[[dict[str, Any]], float] | None = None
    bytes_moved: Callable[[dict[str, Any]], tuple[int, int]] | None = None
    # inputs the references take in their storage dtype and widen exactly themselves, piece by piece
    # (MLA's paged cache: 1.2G values at the models suite's sizes, whose float64 copy was most of a
    # group's time and 9.6 GB of a worker's memory); every other input reaches them as float64
    storage_inputs: frozenset[str] = frozenset()
    rows: Rows | None = None  # row-independent outputs: large cases are judged on a sample of rows
    # the error model: float64 inputs, params -> {output: the magnitude its rounding errors scale with,
    # the golden's shape}, i.e. the golden's computation on absolute values (for a product |A| |B|, for
    # dS = P (dP - D) P (|dP| + |D|)). The numeric layer then judges each element against
    # max(|golden|, magnitude) and scales the aggregate limits by the output's conditioning
    # (conformance/tolerance.py, layer 3); outputs it leaves out are judged against |golden| alone
    magnitude: Callable[[Inputs, dict[str, Any]], dict[str, np.ndarray]] | None = None

    def canonical_dtype(self, name: str) -> str:
        """A case dtype: the name of one of the op's dtype sets, or a dtype (aliases resolved)."""
        return name if name in self.dtype_sets else dt.canonical(name)

    def all_outputs(self) -> dict[str, Output]:
        """Forward outputs (stages included) and gradient outputs."""
        return {**self.outputs, **self.gradients}

    def all_references(self) -> dict[str, Callable]:
        return {self.reference_name: self.reference, **self.references}

    def tensor_dtype(self, case_dtype: str, tensor: str) -> dt.DType:
        """The dtype of one tensor (input or output) in a case of dtype `case_dtype`."""
        dset = self.dtype_sets.get(case_dtype)
        if dset is None:
            return dt.get(case_dtype)
        if tensor not in dset:
            raise SpecError(f"{self.name}: dtype set {case_dtype!r} gives no dtype for tensor {tensor!r}")
        return dt.get(dset[tensor])

    def out_dtype(self, name: str, case_dtype: str) -> dt.DType:
        o = self.all_outputs()[name]
        return self.tensor_dtype(case_dtype, name) if o.dtype == "test" else dt.get(o.dtype)

    def tol_dtype(self, name: str, case_dtype: str) -> dt.DType:
        """Whose limits apply: fp32 partials of a bf16 computation carry bf16 error."""
        o = self.all_outputs()[name]
        if o.tol_dtype is None:
            return self.out_dtype(name, case_dtype)
        if o.tol_dtype == "test":
            return self.tensor_dtype(case_dtype, name) if case_dtype in self.dtype_sets else dt.get(case_dtype)
        return dt.get(o.tol_dtype)

    @property
    def stem(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def function(self) -> str:
        return self.name.split(".", 1)[1]

    def validate(self, params: dict[str, Any], dtype: str, dist: str) -> dict[str, Any]:
        """Validated, canonically ordered params; UsageError naming the bad value."""
        params = self.params.validate(self.name, params)
        if dtype not in self.dtypes:
            raise UsageError(f"{self.name} does not support dtype {dtype!r} (supported: {', '.join(self.dtypes)})")
        if dist not in self.dists:
            raise UsageError(f"{self.name} has no value distribution {dist!r} (known: {', '.join(self.dists)})")
        if self.check is not None:
            why = self.check(params)
            if why:
                raise UsageError(f"{self.name}: {why}")
        return params


def float64_view(inputs: Inputs, keep: frozenset[str] | set[str] = frozenset()) -> Inputs:
    """What the golden sees: the rounded inputs, exactly, as float64 (integers stay integers); those
    named in `keep` (a spec's `storage_inputs`) as stored, for a golden that widens them itself."""
    out = {}
    for k, v in inputs.items():
        if k in keep or np.asarray(v).dtype.kind in "iub":
            out[k] = np.asarray(v)
        else:
            out[k] = np.asarray(v).astype(np.float64)
    return out
