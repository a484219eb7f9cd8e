"""Small example ops that prove the contracts the coming op families need, each with a good
kernel and a broken one (tests/test_contracts.py). Registered per test with `ops.register`.

- example.fp8_cast      per-tensor dtypes (x bf16/fp32 in, y fp8 e4m3 out), an 8-bit output whose
                        poison (0xAA) is itself a valid value, bit-exact
- example.qmatvec       two references: `dequant` (what the int8 weights mean) and `emulated` (the
                        production arithmetic: x quantized to int8 too, integer dots)
- example.norm_scale    ordered intermediates: norm -> scaled -> y
- example.append        an in-place output: the cache the kernel writes into
- example.square        a gradient: dx = 2 x g, judged by the same layers (noise layer 3x the eager
                        baseline's error)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.params import Int, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Override, Tol

DISTS = {"normal": "N(0, 1)"}
E4M3 = ml_dtypes.float8_e4m3fn


# -- fp8 cast: per-tensor dtypes, 8-bit poison -------------------------------------------------------
def _cast_inputs(p, dtype, dist, rng):
    x = rng.standard_normal(p["n"]) * 4.0
    x[0] = -0.3125  # casts to the byte 0xAA: the poison pattern itself must count as written
    return {"x": dt.round_to(x, dt.get({"f32-e4m3": "fp32", "bf16-e4m3": "bf16"}[dtype]))}


def _cast_ref(x, p):
    return {"y": np.clip(x["x"], -448.0, 448.0).astype(E4M3).astype(np.float64)}


FP8_CAST = OpSpec(
    name="example.fp8_cast", golden=_cast_ref, reference=_cast_ref, params=Schema({"n": Int(1, 4096)}),
    make_inputs=_cast_inputs, output_shapes=lambda p: {"y": (p["n"],)},
    outputs={"y": Output("test", exact=True, doc="x saturated to +-448 and rounded to fp8 e4m3")},
    tolerance=Tol(noise_k=None), dtypes=("f32-e4m3", "bf16-e4m3"), dists=DISTS, baseline=None, backends=(),
    dtype_sets={"f32-e4m3": {"x": "fp32", "y": "fp8e4m3"}, "bf16-e4m3": {"x": "bf16", "y": "fp8e4m3"}},
)


def _cast_kernel(skip_last: bool):
    def run(case, inputs, out):
        y = out.numpy("y")
        full = np.clip(inputs["x"].astype(np.float32), -448, 448).astype(E4M3)
        if skip_last:
            y[:-1] = full[:-1]  # the last element is never stored
        else:
            y[...] = full
        return {"y": y}
    return run


CAST_GOOD = Backend(name="ex_cast", ops={"example.fp8_cast": _cast_kernel(False)},
                    dtypes=("f32-e4m3", "bf16-e4m3"))
CAST_UNWRITTEN = Backend(name="ex_cast_unwritten", ops={"example.fp8_cast": _cast_kernel(True)},
                         dtypes=("f32-e4m3", "bf16-e4m3"))


# -- int8 matvec: two references ----------------------------------------------------------------------
def _qmv_inputs(p, dtype, dist, rng):
    n, k = p["n"], p["k"]
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    return {"w": w, "w_scale": dt.round_to(rng.uniform(0.01, 0.02, n), "fp32"),
            "x": dt.round_to(rng.standard_normal(k), "fp32")}


def _quant_x(x: np.ndarray) -> tuple[np.ndarray, float]:
    s = float(np.float32(np.abs(x).max() / 127.0)) or 1.0
    return np.clip(np.rint(x / s), -127, 127).astype(np.int64), s


def _qmv_dequant(x, p):
    return {"y": (x["w"].astype(np.float64) * x["w_scale"][:, None]) @ x["x"]}


def _qmv_emulated(x, p):
    q, s = _quant_x(x["x"])
    return {"y": (x["w"].astype(np.int64) @ q).astype(np.float64) * x["w_scale"] * s}


QMATVEC = OpSpec(
    name="example.qmatvec", golden=_qmv_dequant, reference=_qmv_dequant, references={"emulated": _qmv_emulated},
    reference_name="dequant", params=Schema({"n": Int(1, 512), "k": Int(1, 512)}), make_inputs=_qmv_inputs,
    output_shapes=lambda p: {"y": (p["n"],)}, outputs={"y": Output("fp32")},
    tolerance=Tol(acc_len=lambda p, o: p["k"], noise_k=None), dtypes=("fp32",), dists=DISTS, baseline=None,
    backends=(),
)


def _qmv_kernel(case, inputs, out):
    y = out.numpy("y")
    q, s = _quant_x(inputs["x"].astype(np.float64))  # the production path: int8 activations
    y[...] = ((inputs["w"].astype(np.int64) @ q).astype(np.float32) * inputs["w_scale"] * np.float32(s))
    return {"y": y}


QMV_CLAIMS_EMULATED = Backend(name="ex_qmv", ops={"example.qmatvec": _qmv_kernel}, dtypes=("fp32",),
                              claims={"example.qmatvec": "emulated"})
QMV_NO_CLAIM = Backend(name="ex_qmv_plain", ops={"example.qmatvec": _qmv_kernel}, dtypes=("fp32",))


# -- norm -> scale -> residual: ordered stages ---------------------------------------------------------------
def _ns_inputs(p, dtype, dist, rng):
    return {k: dt.round_to(rng.standard_normal(p["n"]), dtype) for k in ("x", "w", "r")}


def _ns_ref(x, p, eps: float = 1e-6):
    norm = x["x"] / np.sqrt(np.mean(x["x"] ** 2) + eps)
    scaled = norm * x["w"]
    return {"norm": norm, "scaled": scaled, "y": scaled + x["r"]}


NORM_SCALE = OpSpec(
    name="example.norm_scale", golden=_ns_ref, reference=_ns_ref, params=Schema({"n": Int(1, 4096)}),
    make_inputs=_ns_inputs, output_shapes=lambda p: {k: (p["n"],) for k in ("norm", "scaled", "y")},
    outputs={"norm": Output("fp32", doc="stage 1"), "scaled": Output("fp32", doc="stage 2"), "y": Output("test")},
    stages=("norm", "scaled"), tolerance=Tol(acc_len=lambda p, o: p["n"], noise_k=None), dtypes=("fp32",),
    dists=DISTS, baseline=None, backends=(),
)


def _ns_kernel(eps: float, sign: float):
    def run(case, inputs, out):
        x, w, r = (inputs[k].astype(np.float64) for k in ("x", "w", "r"))
        norm = x / np.sqrt(np.mean(x * x) + eps)
        res = {"norm": norm, "scaled": norm * w, "y": norm * w + sign * r}
        bufs = {k: out.numpy(k) for k in res}
        for k, v in res.items():
            bufs[k][...] = v.astype(np.float32)
        return bufs
    return run


NS_GOOD = Backend(name="ex_ns", ops={"example.norm_scale": _ns_kernel(1e-6, 1.0)}, dtypes=("fp32",))
NS_BAD_EPS = Backend(name="ex_ns_eps", ops={"example.norm_scale": _ns_kernel(1.0, 1.0)}, dtypes=("fp32",))
NS_BAD_ADD = Backend(name="ex_ns_add", ops={"example.norm_scale": _ns_kernel(1e-6, -1.0)}, dtypes=("fp32",))


# -- append into a cache: an in-place output -----------------------------------------------------------------
def _ap_inputs(p, dtype, dist, rng):
    return {"cache": dt.round_to(rng.standard_normal(p["n"]), dtype),
            "new": dt.round_to(rng.standard_normal(p["k"]), dtype),
            "pos": np.array([p["n"] - p["k"]], dtype=np.int32)}


def _ap_ref(x, p):
    cache = x["cache"].copy()
    pos = int(x["pos"][0])
    cache[pos:pos + len(x["new"])] = x["new"]
    return {"cache": cache}


APPEND = OpSpec(
    name="example.append", golden=_ap_ref, reference=_ap_ref,
    params=Schema({"n": Int(2, 4096), "k": Int(1, 64)}), make_inputs=_ap_inputs,
    output_shapes=lambda p: {"cache": (p["n"],)},
    outputs={"cache": Output("test", exact=True, inplace="cache", doc="the cache after the append")},
    tolerance=Tol(noise_k=None), dtypes=("fp32", "bf16"), dists=DISTS, baseline=None, backends=(),
    check=lambda p: None if p["k"] <= p["n"] else "k must be <= n",
)


def _ap_kernel(offset: int, scribble: bool):
    def run(case, inputs, out):
        pos = int(inputs["pos"][0]) - offset
        inputs["cache"][pos:pos + len(inputs["new"])] = inputs["new"]  # in place: no output buffer
        if scribble:
            inputs["new"][0] = 0  # writes an input that must stay untouched
        return {}
    return run


AP_GOOD = Backend(name="ex_ap", ops={"example.append": _ap_kernel(0, False)})
AP_SHIFTED = Backend(name="ex_ap_shift", ops={"example.append": _ap_kernel(1, False)})
AP_SCRIBBLES = Backend(name="ex_ap_scribble", ops={"example.append": _ap_kernel(0, True)})


# -- square, with a gradient -----------------------------------------------------------------------------------
def _sq_inputs(p, dtype, dist, rng):
    return {"x": dt.round_to(rng.standard_normal(p["n"]), dtype)}


def _sq_ref(x, p):
    return {"y": x["x"] ** 2}


def _sq_vjp(x, p, cot):
    return {"dx": 2.0 * x["x"] * cot["y"]}


SQUARE = OpSpec(
    name="example.square", golden=_sq_ref, reference=_sq_ref, params=Schema({"n": Int(1, 4096)}),
    make_inputs=_sq_inputs, output_shapes=lambda p: {"y": (p["n"],)}, outputs={"y": Output("test")},
    vjp=_sq_vjp, cotangent_of=("y",), gradients={"dx": Output("test", doc="d(sum y g)/dx")},
    gradient_shapes=lambda p: {"dx": (p["n"],)},
    tolerance=Tol(overrides=(Override("the square of a bf16 value is rounded twice by the eager baseline",
                                      dtype="bf16", atol_max_eps=2.0),)),
    dtypes=("fp32", "bf16"), dists=DISTS, baseline="ex_sq_eager", backends=(),
)


def _sq_forward(case, inputs, out):
    y = out.numpy("y")
    x = inputs["x"].astype(np.float32)
    y[...] = (x * x).astype(y.dtype)
    return {"y": y}


def _sq_backward(factor: float):
    def run(case, inputs, cot, out):
        dx = out.numpy("dx")
        dx[...] = (factor * inputs["x"].astype(np.float32) * cot["y"].astype(np.float32)).astype(dx.dtype)
        return {"dx": dx}
    return run


def _sq_eager_forward(case, inputs, out):
    import torch

    from kernel_parity.conformance.backends._torch import to_torch

    x = to_torch(inputs["x"], "cpu")
    y = out.torch("y", "cpu")
    y.copy_(x * x)
    return {"y": y}


def _sq_eager_backward(case, inputs, cot, out):
    import torch

    from kernel_parity.conformance.backends._torch import to_torch

    x = to_torch(inputs["x"], "cpu").clone().requires_grad_(True)
    (x * x).backward(to_torch(cot["y"], "cpu"))  # autograd in the test dtype: the same-precision baseline
    dx = out.torch("dx", "cpu")
    dx.copy_(x.grad)
    return {"dx": dx}


SQ_EAGER = Backend(name="ex_sq_eager", ops={"example.square": _sq_eager_forward},
                   backward={"example.square": _sq_eager_backward})
SQ_GOOD = Backend(name="ex_sq", ops={"example.square": _sq_forward}, backward={"example.square": _sq_backward(2.0)})
SQ_BAD_GRAD = Backend(name="ex_sq_badgrad", ops={"example.square": _sq_forward},
                      backward={"example.square": _sq_backward(1.0)})
SQ_NO_BACKWARD = Backend(name="ex_sq_fwd", ops={"example.square": _sq_forward})

SPECS = (FP8_CAST, QMATVEC, NORM_SCALE, APPEND, SQUARE)


def registry(*names: str) -> Any:
    from kernel_parity.conformance.backends import Registry

    return Registry(extra=[f"tests.example_ops:{n}" for n in names])
