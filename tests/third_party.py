"""Third-party backends for the self-tests, loaded as `--backend tests.third_party:NAME`.

Each implements softmax.softmax with NumPy and one deliberate defect the gate must catch.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.poison import poison_array


def _softmax(x: np.ndarray, subtract_max: bool = True) -> np.ndarray:
    x64 = x.astype(np.float64)
    m = np.max(x64, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m) if subtract_max else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x64 - m)
        s = e.sum(axis=-1, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def _make(name: str, fn) -> Backend:
    def softmax(case, inputs, out):
        y = out.numpy("y")
        fn(case, inputs["x"], y)
        return {"y": y}

    return Backend(name=name, device="cpu", ops={"softmax.softmax": softmax}, doc=f"test backend: {name}")


def _good(case, x, y):
    y[...] = _softmax(x).astype(y.dtype)


def _no_max(case, x, y):  # overflows on large logits: inf / inf = NaN
    y[...] = _softmax(x, subtract_max=False).astype(y.dtype)


def _unwritten(case, x, y):
    y[...] = _softmax(x).astype(y.dtype)
    y[-1, -1] = poison_array(1, dt.of_array(y))[0]  # as if the last element were never stored


def _oob(case, x, y):
    y[...] = _softmax(x).astype(y.dtype)
    base = y.base
    base[-1] = 0  # one element past the end of the output, in the canary


def _noisy(case, x, y):
    s = _softmax(x)
    y[...] = (s * (1 + 0.05 * np.sign(np.sin(np.arange(s.size))).reshape(s.shape))).astype(y.dtype)


def _raises(case, x, y):
    raise RuntimeError("kernel launch failed: too many resources requested")


def _crashes(case, x, y):
    os._exit(3)


def _hangs(case, x, y):
    time.sleep(600)


def _exits_zero(case, x, y):  # exit(0) from inside a kernel: must never read as a pass
    os._exit(0)


def _sys_exit(case, x, y):
    raise SystemExit(0)


def _segfaults(case, x, y):
    import ctypes

    ctypes.string_at(0)


def _by_case(case, x, y):
    """Different misbehaviour per case, for one gate run that must survive all of them."""
    p = case.p
    if p["rows"] == 1:
        _exits_zero(case, x, y)
    elif p["rows"] == 4:
        _segfaults(case, x, y)
    elif p["rows"] == 5:
        time.sleep(600)
    _good(case, x, y)


def _slow(case, x, y):  # a correct kernel that takes its time (for the killed-run self-test)
    time.sleep(float(os.environ.get("KP_TEST_SLOW_S", "0.3")))
    _good(case, x, y)


def _writes_input(case, x, y):
    y[...] = _softmax(x).astype(y.dtype)
    x[0, 0] = 0


GOOD = _make("np_good", _good)
# a correct kernel for bf16 only (a plugin that runs some dtypes of an op: gluon's GEMM is FP8 only)
BF16_ONLY = Backend(name="np_bf16_only", device="cpu", dtypes=("bf16",), ops=dict(GOOD.ops),
                    doc="test backend: np_bf16_only")
NO_MAX = _make("np_no_max", _no_max)
UNWRITTEN = _make("np_unwritten", _unwritten)
OOB = _make("np_oob", _oob)
NOISY = _make("np_noisy", _noisy)
RAISES = _make("np_raises", _raises)
CRASHES = _make("np_crashes", _crashes)
HANGS = _make("np_hangs", _hangs)
WRITES_INPUT = _make("np_writes_input", _writes_input)
EXITS_ZERO = _make("np_exits_zero", _exits_zero)
SYS_EXIT = _make("np_sys_exit", _sys_exit)
SEGFAULTS = _make("np_segfaults", _segfaults)
BY_CASE = _make("np_by_case", _by_case)
SLOW = _make("np_slow", _slow)
NAMED_TRITON = _make("triton", _good)  # a plugin may not take a built-in backend's name


def _factory_raises():
    raise RuntimeError("cannot open the device")


FACTORY_RAISES = _factory_raises


class _HookRaises(Backend):
    def __init__(self, name: str, hook: str) -> None:
        super().__init__(name=name, device="cpu", ops={"softmax.softmax": GOOD.ops["softmax.softmax"]})
        self.hook = hook

    def available(self):
        if self.hook == "available":
            raise RuntimeError("driver query failed")
        return None

    def supports(self, case):
        if self.hook == "supports":
            raise KeyError("rows")
        return super().supports(case)


SUPPORTS_RAISES = _HookRaises("np_supports_raises", "supports")
AVAILABLE_RAISES = _HookRaises("np_available_raises", "available")


class _Contract(Backend):
    """Rows whose every logit is -inf are outside this kernel's contract (it writes NaN there),
    and it refuses, as a data-dependent precondition, inputs with a NaN in the padding."""

    def __init__(self, name: str, declare: bool = True, precondition: bool = False) -> None:
        super().__init__(name=name, device="cpu", ops={"softmax.softmax": self._softmax})
        self.declare, self.needs = declare, precondition

    def _softmax(self, case, inputs, out):
        assert out.backend is self and out.device == "cpu"  # adapters receive the backend
        y = out.numpy("y")
        x = inputs["x"]
        y[...] = _softmax(x).astype(y.dtype)
        dead = np.all(np.isneginf(x.astype(np.float64)), axis=-1)
        y[dead] = np.nan
        return {"y": y}

    def outside_contract(self, case, inputs):
        if not self.declare:
            return {}
        dead = np.all(np.isneginf(inputs["x"].astype(np.float64)), axis=-1)
        return {"y": (dead[:, None], "rows with no finite logit: this kernel returns NaN there")}

    def precondition(self, case, inputs):
        if self.needs and case.p["pad"]:
            return "the kernel needs unpadded rows"
        return None


CONTRACT = _Contract("np_contract")
NO_CONTRACT = _Contract("np_no_contract", declare=False)
PRECONDITION = _Contract("np_precondition", precondition=True)


class FactoryBackend(Backend):
    """A Backend subclass: `--backend module:Class` instantiates it."""

    def __init__(self) -> None:
        super().__init__(name="np_class", device="cpu", ops={"softmax.softmax": GOOD.ops["softmax.softmax"]})


# -- attention backends with one classic semantic bug each (for the diagnosis) -----------------
def _attention(name: str, causal: str | None = None, tiled: bool = False, no_scale: bool = False) -> Backend:
    def prefill(case, inputs, out):
        import torch

        from kernel_parity.kernels.torch import attention as k

        p = case.p
        q, kk, vv = (torch.from_numpy(inputs[n].astype(np.float32)) for n in ("q", "k", "v"))
        if tiled:  # k.repeat instead of repeat_interleave: query head h reads kv head h % h_kv
            g = p["hq"] // p["hkv"]
            kk, vv = kk.repeat(1, 1, g, 1), vv.repeat(1, 1, g, 1)
        o, lse = k.attention(q, kk, vv, causal=causal or p["causal"], window=(p["wl"], p["wr"]),
                             softcap=float(p["cap"]), scale=1.0 if no_scale else None)
        ob, lb = out.numpy("o"), out.numpy("lse")
        ob[...] = o.numpy().astype(ob.dtype)
        lb[...] = lse.numpy()
        return {"o": ob, "lse": lb}

    return Backend(name=name, device="cpu", dtypes=("fp32",), ops={"attention.prefill": prefill})


ATTN_TOP_LEFT = _attention("attn_top_left", causal="top_left")
ATTN_TILED = _attention("attn_tiled", tiled=True)
ATTN_NO_SCALE = _attention("attn_no_scale", no_scale=True)



# -- a plugin of Triton kernels (our own, unmodified): it declares triton = True and so gets the
# interpreter preparation our own Triton backend gets (bf16 rounding and dot fixes) on a CPU.
def _triton_prefill(case, inputs, out):
    from kernel_parity.conformance.backends._torch import to_torch
    from kernel_parity.kernels.triton import attention as fa

    p = case.p
    dev = out.device
    o, lse = out.torch("o", dev), out.torch("lse", dev)
    fa.prefill(*(to_torch(inputs[n], dev) for n in ("q", "k", "v")), causal=p["causal"], window=(p["wl"], p["wr"]),
               softcap=float(p["cap"]), sinks=to_torch(inputs["sinks"], dev) if "sinks" in inputs else None,
               out=o, out_lse=lse)
    return {"o": o, "lse": lse}


def _triton_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TritonPlugin(Backend):
    def __init__(self) -> None:
        super().__init__(name="np_triton", device=_triton_device(), ops={"attention.prefill": _triton_prefill},
                         triton=True)


TRITON_PLUGIN = TritonPlugin

class UndeclaredTritonPlugin(Backend):
    """The same Triton kernels without `triton = True`: no interpreter preparation on a CPU."""

    def __init__(self) -> None:
        super().__init__(name="np_triton_plain", device=_triton_device(), ops={"attention.prefill": _triton_prefill})


UNDECLARED_TRITON_PLUGIN = UndeclaredTritonPlugin
