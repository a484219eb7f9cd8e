"""Property tests of the attention backward ops (attention.prefill_backward, attention.varlen_backward):
every kernel vs the golden, and the invariants of a VJP

- dv = P^T dO, with P from the forward golden (attention of V = the identity gives P itself);
- GQA gradients equal the MHA gradients of K, V repeated per query head, summed over each group;
- the VJP is linear in the cotangents: negating (dO, dLSE) negates every gradient bit for bit, and
  doubling them doubles the gradients;
- a sum over rows' cotangents gives the sum of the gradients (the cotangents split by rows);
- keys no query sees get dk = dv = 0 exactly, rows with no key and no sink dq = 0 exactly, and
  changing the unseen keys changes nothing, bit for bit.

Each invariant runs on the kernels (a plugin backend with --parity-backend too) and, in float64, on
the golden. Draws leave out the degenerate cases where every row sees at most one key and there is no
sink: dS is then exactly 0 (dq = dk = 0 by cancellation), so any rounding fails a tolerance relative
to the golden (the strategy excludes them, as STYLE rule 9 asks). Shapes are small: the Triton
kernels run in the interpreter on CI, where each example costs about a second.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_parity.refimpl.attention as ref
from kernel_parity.conformance import ops
from kernel_parity.conformance.dtypes import get as get_dtype
from kernel_parity.conformance.metrics import compare
from kernel_parity.conformance.tolerance import GOLDEN_SELF_CHECK
from kernel_parity.property_tests import runs
from kernel_parity.property_tests.strategies import cases

FEW = settings(max_examples=6)  # the interpreter: each example runs three kernels, ~1 s
PREFILL, VARLEN = "attention.prefill_backward", "attention.varlen_backward"


def _keep(p):
    """(b, s_q, s_k) mask of a case (varlen: each sequence padded to the longest)."""
    if "lens" in p:
        from kernel_parity.conformance.ops.attention_inputs import varlen_lens as _varlen_lens

        lq, lk = _varlen_lens(p)
    else:
        lq, lk = np.full(p["b"], p["sq"]), np.full(p["b"], p["sk"])
    return ref.mask(p["sq"], p["sk"], lq, lk, p["causal"], (p["wl"], p["wr"]))


def shape(p):
    """hq drawn as a group size; causal forces wr <= 0; a case where no row sees two keys gets a sink."""
    p = {**p, "hq": p["hkv"] * p["hq"]}
    if p["causal"] != "none":
        p["wr"] = min(p["wr"], 0)
    if not p["sink"] and _keep(p).sum(axis=-1).max() <= 1:
        p["sink"] = 1
    return p


def _same_values(case, got, want, what):
    """Equal value for value (float64 holds every 16- and 32-bit value exactly; -0 equals 0)."""
    for n in want:
        a, b = got[n].astype(np.float64), want[n].astype(np.float64)
        bad = int(np.count_nonzero(~((a == b) | (np.isnan(a) & np.isnan(b)))))
        assert bad == 0, f"{case.backend} {case.op} {n}: {bad} element(s) changed when {what}\n  repro: parity repro {case.id}"


MASKS = dict(causal=["none", "bottom_right", "top_left"], wl=[-1, -1, 0, 1, 3, 9], wr=[-1, -1, 0, 2], cap=[0, 0, 30],
             sink=[0, 1], dlse=[0, 1])
HEADS = dict(hq=(1, 4), hkv=[1, 2], d=[16, 32, 64], dv=[0, 0, 16])
SMALL = {
    PREFILL: dict(b=(1, 2), sq=(1, 20), sk=(1, 24), **HEADS, **MASKS),
    VARLEN: dict(b=(1, 4), sq=(1, 12), sk=(1, 16), **HEADS, **MASKS),
}
BACKENDS = {PREFILL: ("triton", "cpu", "torch", "sdpa-cpu"), VARLEN: ("triton", "cpu", "torch")}


def bwd_cases(op=PREFILL, **over):
    return cases(op, transform=shape, dists=("normal", "large", "outlier", "scales"), **{**SMALL[op], **over})


def _with(case, **params):
    return ops.make_case(case.op, case.backend, case.dtype, {**case.p, **params}, case.dist, case.seed)


def _f64(x):
    return {k: (v.astype(np.float64) if v.dtype.kind not in "iu" else v) for k, v in x.items()}


def _golden(case, x):
    return ops.get(case.op).reference(_f64(x), case.p)


@pytest.mark.parity_backends(by_op=BACKENDS)
@FEW
@given(data=st.data())
def test_attention_backward(parity, op, backend, data):
    parity.check(data.draw(bwd_cases(op)).with_backend(backend))


# -- invariants on the kernels ------------------------------------------------------------------
def _probabilities(case, x):
    """(b, h_q, s_q, s_k) P of the forward golden: attention with V = the identity over the keys."""
    p = case.p
    eye = np.broadcast_to(np.eye(p["sk"])[None, :, None, :], (p["b"], p["sk"], p["hkv"], p["sk"]))
    o, _, _ = ref.prefill(x["q"].astype(np.float64), x["k"].astype(np.float64), eye, causal=p["causal"],
                          window=(p["wl"], p["wr"]), softcap=float(p["cap"]), sinks=x.get("sinks"))
    return o.transpose(0, 2, 1, 3)  # b, h_q, s_q, s_k


def _p_t_do(case, x):
    """dv = P^T dO summed over each kv head's query heads, in float64."""
    p = case.p
    pr = _probabilities(case, x)
    dv = np.einsum("bhij,bihc->bjhc", pr, x["do"].astype(np.float64))  # b, s_k, h_q, d_v
    return dv.reshape(*dv.shape[:2], p["hkv"], p["hq"] // p["hkv"], -1).sum(axis=3)


@pytest.mark.parity_backends("triton", "cpu", "torch")
@FEW
@given(case=bwd_cases())
def test_dv_is_p_transpose_do(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    runs.assert_close(case, {"dv": runs.run(case, x)["dv"]}, {"dv": _p_t_do(case, x)}, "dv was compared with P^T dO")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@FEW
@given(case=bwd_cases(hkv=[2], hq=(2, 4)))
def test_gqa_gradients_are_mha_gradients_summed_over_the_group(backend, case):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    g = case.p["hq"] // case.p["hkv"]
    mha = _with(case, hkv=case.p["hq"])
    y = {**x, "k": np.repeat(x["k"], g, axis=2), "v": np.repeat(x["v"], g, axis=2)}
    got, want = runs.run(mha, y), runs.run(case, x)
    summed = {n: got[n].astype(np.float64).reshape(*got[n].shape[:2], -1, g, got[n].shape[-1]).sum(axis=3)
              for n in ("dk", "dv")}
    runs.assert_close(case, {**summed, "dq": got["dq"]}, {n: want[n].astype(np.float64) for n in ("dq", "dk", "dv")},
                      f"K, V were repeated {g}x (MHA) and dk, dv summed over each group")


def _scaled(x, f):
    y = dict(x)
    for n in ("do", "dlse"):
        if n in x:
            y[n] = (x[n].astype(np.float64) * f).astype(x[n].dtype)  # exact: a sign or a power of two
    return y


@pytest.mark.parity_backends(by_op={PREFILL: ("triton", "cpu", "torch"), VARLEN: ("cpu",)})
@FEW
@given(data=st.data())
def test_vjp_is_linear_in_the_cotangent(op, backend, data):
    case = data.draw(bwd_cases(op)).with_backend(backend)
    x = runs.inputs_of(case)
    base = runs.run(case, x)
    neg = runs.run(case, _scaled(x, -1.0))
    _same_values(case, {n: -v.astype(np.float64) for n, v in neg.items()}, base, "the cotangents were negated")
    two = runs.run(case, _scaled(x, 2.0))
    runs.assert_close(case, {n: v.astype(np.float64) / 2 for n, v in two.items()},
                      {n: v.astype(np.float64) for n, v in base.items()}, "the cotangents were doubled")


@pytest.mark.parity_backends("triton", "cpu", "torch")
@FEW
@given(case=bwd_cases(sq=(2, 20)), split_seed=st.integers(0, 2**32 - 1))
def test_rows_cotangents_sum_to_the_gradients_sum(backend, case, split_seed):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    rows = np.random.default_rng(split_seed).random(case.p["sq"]) < 0.5  # each row's cotangent to part A or B
    parts = []
    for keep in (rows, ~rows):
        y = dict(x)
        y["do"] = np.where(keep[None, :, None, None], x["do"], np.zeros((), x["do"].dtype))
        if "dlse" in x:
            y["dlse"] = np.where(keep[None, None, :], x["dlse"], np.float32(0))
        parts.append(runs.run(case, y))
    whole = runs.run(case, x)
    runs.assert_close(case, {n: parts[0][n].astype(np.float64) + parts[1][n].astype(np.float64) for n in whole},
                      {n: v.astype(np.float64) for n, v in whole.items()}, "the rows' cotangents were split in two")


@pytest.mark.parity_backends("triton", "cpu", "torch", "sdpa-cpu")
@FEW
@given(case=bwd_cases(causal=["bottom_right", "top_left"], wl=[-1, 0, 2], sq=(1, 12), sk=(1, 20)),
       seed=st.integers(0, 2**32 - 1))
def test_unseen_keys_get_zero_gradients_and_change_nothing(backend, case, seed):
    case = case.with_backend(backend)
    x = runs.inputs_of(case)
    keep = _keep(case.p)
    unseen = ~keep.any(axis=1)  # b, s_k: keys no query may attend
    empty = ~keep.any(axis=2)  # b, s_q: rows with no key
    got = runs.run(case, x)
    assert not got["dk"][unseen].any() and not got["dv"][unseen].any(), \
        f"{backend}: keys no query sees got non-zero dk / dv\n  repro: parity repro {case.id}"
    if not case.p["sink"]:
        assert not got["dq"][empty].any(), f"{backend}: rows with no key got dq != 0\n  repro: parity repro {case.id}"
    y = dict(x)
    rng = np.random.default_rng(seed)
    for name in ("k", "v"):
        t = x[name].astype(np.float64)
        t[unseen] = rng.standard_normal(t[unseen].shape) * 100.0
        y[name] = t.astype(x[name].dtype)
    runs.assert_same_bits(case, runs.run(case, y), got, "keys no query sees were changed")


# -- the same invariants on the golden, in float64 -------------------------------------------------
def _close(got, want, what):
    cmp = compare(got, want, get_dtype("fp64"), GOLDEN_SELF_CHECK)
    assert cmp.anomaly_mismatch == 0 and cmp.elem_ratio <= 1.0, f"{what}: {cmp.anomaly_detail or cmp.metrics}"


@given(case=bwd_cases())
def test_golden_dv_is_p_transpose_do_and_gqa_is_mha_summed(case):
    x = runs.inputs_of(case)
    g = _golden(case, x)
    _close(g["dv"], _p_t_do(case, x), "golden dv vs P^T dO of the forward golden")
    grp = case.p["hq"] // case.p["hkv"]
    mha = _with(case, hkv=case.p["hq"])
    m = _golden(mha, {**x, "k": np.repeat(x["k"], grp, axis=2), "v": np.repeat(x["v"], grp, axis=2)})
    for n in ("dk", "dv"):
        _close(m[n].reshape(*m[n].shape[:2], -1, grp, m[n].shape[-1]).sum(axis=3), g[n], f"golden {n}: MHA summed")
    _close(m["dq"], g["dq"], "golden dq of MHA")


@given(case=bwd_cases(VARLEN), a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_golden_is_linear_in_the_cotangent(case, a, b):
    x = _f64(runs.inputs_of(case))
    rng = np.random.default_rng(case.seed)
    y = {**x, "do": rng.standard_normal(x["do"].shape)}
    if "dlse" in x:
        y["dlse"] = rng.standard_normal(x["dlse"].shape)
    mix = {**x, "do": a * x["do"] + b * y["do"]}
    if "dlse" in x:
        mix["dlse"] = a * x["dlse"] + b * y["dlse"]
    gx, gy, gm = (_golden(case, z) for z in (x, y, mix))
    for n in gm:
        scale = max(1.0, np.abs(gx[n]).max(initial=0), np.abs(gy[n]).max(initial=0))
        _close(gm[n] / scale, (a * gx[n] + b * gy[n]) / scale, f"golden {n} of a x dO + b y dO")
