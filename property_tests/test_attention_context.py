"""Property tests of attention.context_kv (TensorRT-LLM's context attention that writes the cache):

- every kernel vs the golden on drawn shapes (empty chunks, histories 0 .. 40, pages of 16 / 64);
- two calls equal one: the first `cut` tokens of every chunk, then the rest after them (input_pos + cut,
  over the caches the first call left) give the one call's O and LSE within its limits, and its caches
  bit for bit: the second call attends to what the first one wrote.

Shapes are small (the Triton kernel runs in the interpreter on CI).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.ops.attention_inputs import cu_seqlens
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

OP = "attention.context_kv"
FEW = settings(max_examples=6)  # the interpreter on CI: a Triton example is ~0.5 s (two calls: ~1 s)
SMALL = dict(b=(1, 3), sq=(1, 12), hist=(0, 40), hq=(1, 3), hkv=[1, 2], d=[16, 32], page=[0, 16, 64])


def _heads(p):
    return {**p, "hq": p["hkv"] * p["hq"]}  # hq drawn as the group size


def ctx_cases(**over):
    return cases(OP, transform=_heads, **{**SMALL, **over})


@pytest.mark.parity_backends("triton", "cpu")
@FEW
@given(case=ctx_cases())
def test_context_kv(parity, backend, case):
    parity.check(case.with_backend(backend))


def _copy(x):
    return {k: np.array(v, copy=True) for k, v in x.items()}


@pytest.mark.parity_backends("triton", "cpu", "torch")
@FEW
@given(case=ctx_cases(lens=["full"], sq=(2, 12)), cut=st.integers(1, 11))
def test_two_calls_equal_one(backend, case, cut):
    case = case.with_backend(backend)
    p, b = case.p, case.p["b"]
    cut = min(cut, p["sq"] - 1)
    x = runs.inputs_of(case)
    whole = runs.run(case, _copy(x))
    tok = {n: x[n].reshape(b, p["sq"], *x[n].shape[1:]) for n in ("q", "k", "v")}  # lens=full: b equal chunks
    caches = {n: x[n] for n in ("k_cache", "v_cache")}
    parts = []
    for lo, hi in ((0, cut), (cut, p["sq"])):
        sub = ops.make_case(OP, backend, case.dtype, {**p, "sq": hi - lo, "hist": p["hist"] + lo}, case.dist,
                            case.seed)
        y = {**x, **caches, "cu_seqlens": cu_seqlens(np.full(b, hi - lo)),
             "input_pos": (x["input_pos"] + lo).astype(np.int32),
             **{n: np.ascontiguousarray(t[:, lo:hi].reshape(-1, *t.shape[2:])) for n, t in tok.items()}}
        r = runs.run(sub, _copy(y))
        caches = {n: r[n] for n in ("k_cache", "v_cache")}
        parts.append((r, hi - lo))
    o = np.concatenate([r["o"].reshape(b, n, *r["o"].shape[1:]) for r, n in parts], axis=1)
    lse = np.concatenate([r["lse"].reshape(r["lse"].shape[0], b, n) for r, n in parts], axis=2)
    joined = {"o": o.reshape(-1, *o.shape[2:]), "lse": lse.reshape(lse.shape[0], -1)}
    what = f"each chunk was written and attended in two calls, the second after the first {cut} tokens"
    runs.assert_close(case, joined, {"o": whole["o"], "lse": whole["lse"]}, what)
    runs.assert_same_bits(case, caches, whole, what, names=("k_cache", "v_cache"))
