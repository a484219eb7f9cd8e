"""The contracts the coming op families need, each proven on a small example op
(tests/example_ops.py): per-tensor dtypes with 8-bit poison, several references, ordered
intermediates, in-place outputs, gradients; plus the dtype table and the one result type."""

from __future__ import annotations

import copy
import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance import ops
from kernel_parity.conformance.backends import Backend, Registry
from kernel_parity.conformance.results import CaseResult, ResultsError
from kernel_parity.conformance.runner import Runner
from tests import example_ops as ex


@pytest.fixture(autouse=True, scope="module")
def example_ops():
    ops.register(ex.SPECS)
    yield
    ops.unregister([s.name for s in ex.SPECS])


def run(case_id: str, *backends: str) -> CaseResult:
    return Runner(ex.registry(*backends)).evaluate(ops.parse_case(case_id))


# -- per-tensor dtypes from ml_dtypes -------------------------------------------------------------------
@pytest.mark.parametrize("name, lib", [("fp8e4m3", ml_dtypes.float8_e4m3fn), ("fp8e5m2", ml_dtypes.float8_e5m2),
                                       ("e8m0", ml_dtypes.float8_e8m0fnu), ("fp4e2m1", ml_dtypes.float4_e2m1fn),
                                       ("bf16", ml_dtypes.bfloat16)])
def test_float_dtypes_come_from_ml_dtypes(name, lib):
    d = dt.get(name)
    info = ml_dtypes.finfo(lib)
    assert (d.eps, d.tiny, d.max) == (float(info.eps), float(info.tiny), float(info.max))


@pytest.mark.parametrize("name", ["int4", "uint4", "int8"])
def test_integer_dtypes_come_from_the_library(name):
    d = dt.get(name)
    assert d.max == float(ml_dtypes.iinfo(d.np_type).max) and not d.is_float and d.eps == 0.0


def test_per_tensor_dtypes_and_an_unwritten_fp8_byte():
    for dset in ("f32-e4m3", "bf16-e4m3"):
        ok = run(f"example.fp8_cast/ex_cast/{dset}/n=37/normal/seed=0", "CAST_GOOD")
        assert ok.verdict == "pass", ok.reason
        assert ok.outputs["y"].dtype == "fp8e4m3" and ok.dtype == dset
        spec = ops.get("example.fp8_cast")
        assert spec.tensor_dtype(dset, "x").name == {"f32-e4m3": "fp32", "bf16-e4m3": "bf16"}[dset]
    # x[0] = -0.3125 casts to 0xAA, the poison byte itself: the good kernel still passes (above); a
    # kernel that never stores the last byte is caught although 0xAA is a valid fp8 value.
    bad = run("example.fp8_cast/ex_cast_unwritten/f32-e4m3/n=37/normal/seed=0", "CAST_UNWRITTEN")
    assert bad.verdict == "fail" and bad.kind == "structural"
    assert "1 element(s) never written" in bad.reason


# -- several references -----------------------------------------------------------------------------------
def test_a_backend_is_judged_by_the_reference_it_claims_and_every_error_is_recorded():
    claims = run("example.qmatvec/ex_qmv/fp32/n=16,k=256/normal/seed=0", "QMV_CLAIMS_EMULATED")
    assert claims.verdict == "pass", claims.reason
    out = claims.outputs["y"]
    assert out.reference == "emulated" and set(out.references) == {"dequant", "emulated"}
    # The quantization error of x (L2 - L1) is recorded, far above the kernel's own rounding:
    assert out.references["dequant"]["max_abs"] > 100 * out.references["emulated"]["max_abs"]
    plain = run("example.qmatvec/ex_qmv_plain/fp32/n=16,k=256/normal/seed=0", "QMV_NO_CLAIM")
    assert plain.verdict == "fail" and plain.outputs["y"].reference == "dequant"


# -- ordered intermediates ------------------------------------------------------------------------------
def test_the_first_diverging_stage_is_named():
    good = run("example.norm_scale/ex_ns/fp32/n=64/normal/seed=0", "NS_GOOD")
    assert good.verdict == "pass" and good.first_divergence is None
    assert [good.outputs[k].stage for k in ("norm", "scaled")] == [0, 1]
    eps = run("example.norm_scale/ex_ns_eps/fp32/n=64/normal/seed=0", "NS_BAD_EPS")
    assert eps.verdict == "fail" and eps.first_divergence == "norm"
    assert "first divergence: stage 'norm'" in eps.reason
    add = run("example.norm_scale/ex_ns_add/fp32/n=64/normal/seed=0", "NS_BAD_ADD")
    assert add.verdict == "fail" and add.first_divergence == "y"  # every stage agreed: the last step did it


# -- in-place outputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_in_place_outputs_are_checked_and_other_inputs_must_stay_untouched(dtype):
    good = run(f"example.append/ex_ap/{dtype}/n=40,k=7/normal/seed=0", "AP_GOOD")
    assert good.verdict == "pass", good.reason
    shifted = run(f"example.append/ex_ap_shift/{dtype}/n=40,k=7/normal/seed=0", "AP_SHIFTED")
    assert shifted.verdict == "fail" and shifted.kind == "exact"
    scribbles = run(f"example.append/ex_ap_scribble/{dtype}/n=40,k=7/normal/seed=0", "AP_SCRIBBLES")
    assert scribbles.verdict == "fail" and "wrote into input(s) new" in scribbles.reason


def _rope_bwd_kernel(over_dy: bool):
    """Our C rope backward with dx stored over dy (returned only when the case has no inplace, so the runner
    must find it in dy's buffer itself), or into a scratch array it drops."""
    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import rope as k

        dx = inputs["dy"] if over_dy else np.empty_like(inputs["dy"])
        k.rope_backward(inputs["dy"], inputs["positions"], cos=inputs["cos"], sin=inputs["sin"],
                        style=case.p["style"], rot=case.p["rot"], at=case.p["at"], out=dx)
        return {} if case.p.get("inplace", 0) else {"dx": dx}
    return run


RB_OVER = Backend(name="ex_rb_over", ops={"rope.rope_backward": _rope_bwd_kernel(True)})
RB_SCRATCH = Backend(name="ex_rb_scratch", ops={"rope.rope_backward": _rope_bwd_kernel(False)})
_RB = ("rope.rope_backward/{}/fp32/t=7,h=3,d=64,rot=32,style=half,at=first,table=cos_sin,theta=10000,"
       "scaling=none,maxseq=64,pos=random,start=0{}/normal/seed=0")


def test_an_in_place_output_chosen_by_a_param_is_the_input_as_left_and_only_then_may_it_be_written():
    def one(backend: str, inplace: str) -> CaseResult:
        registry = Registry(extra=[f"tests.test_contracts:{n}" for n in ("RB_OVER", "RB_SCRATCH")])
        return Runner(registry).evaluate(ops.parse_case(_RB.format(backend, inplace)))

    over = one("ex_rb_over", ",inplace=1")
    assert over.verdict == "pass", over.reason
    not_declared = one("ex_rb_over", "")  # inplace=0: the right dx, but dy must stay untouched
    assert not_declared.verdict == "fail" and "wrote into input(s) dy" in not_declared.reason, not_declared.reason
    dropped = one("ex_rb_scratch", ",inplace=1")  # dy left as it was: judged as dx, it is dy, not dx
    assert dropped.verdict == "fail", dropped.reason


# -- gradients -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradients_are_outputs_judged_by_the_same_layers(dtype):
    case = f"example.square/{{}}/{dtype}/n=300/normal/seed=3"
    good = run(case.format("ex_sq"), "SQ_GOOD", "SQ_EAGER")
    assert good.verdict == "pass", good.reason
    dx = good.outputs["dx"]
    assert dx.noise is not None and dx.noise["k"] == 3.0  # FlashAttention: 3x the baseline's gradient error
    bad = run(case.format("ex_sq_badgrad"), "SQ_BAD_GRAD", "SQ_EAGER")
    assert bad.verdict == "fail" and bad.reason.startswith("dx:")
    fwd = run(case.format("ex_sq_fwd"), "SQ_NO_BACKWARD", "SQ_EAGER")
    assert fwd.verdict == "pass" and "no backward adapter" in fwd.outputs["dx"].not_provided
    base = run(case.format("ex_sq_eager"), "SQ_EAGER")
    assert base.verdict == "pass" and base.tier == "baseline"


def test_cotangents_come_from_the_case_seed():
    from kernel_parity.conformance.runner import Prepared

    spec = ops.get("example.square")
    a = Prepared(spec, ops.parse_case("example.square/ex_sq/fp32/n=50/normal/seed=3"))
    b = Prepared(spec, ops.parse_case("example.square/ex_sq/fp32/n=50/normal/seed=3"))
    c = Prepared(spec, ops.parse_case("example.square/ex_sq/fp32/n=50/normal/seed=4"))
    assert np.array_equal(a.cotangents["y"], b.cotangents["y"])
    assert not np.array_equal(a.cotangents["y"], c.cotangents["y"])


# -- the one result type ----------------------------------------------------------------------------------
def test_case_result_round_trips_and_validates():
    rec = run("example.norm_scale/ex_ns_eps/fp32/n=64/normal/seed=0", "NS_BAD_EPS")
    back = CaseResult.from_json(rec.to_json())
    assert back == rec
    bad = rec.to_json()
    bad["verdict"] = "nearly"
    with pytest.raises(ResultsError, match="'verdict' 'nearly' is not one of"):
        CaseResult.from_json(bad, "line 3")
    bad = copy.deepcopy(rec.to_json())  # to_json shares the record's metrics dicts (no deep copy: speed)
    bad["outputs"]["norm"]["metrics"]["max_abs"] = "big"
    with pytest.raises(ResultsError, match="metrics.max_abs must be a number"):
        CaseResult.from_json(bad)
    assert math.isnan(CaseResult.from_json({**rec.to_json(), "norm_err": float("nan")}).norm_err)
