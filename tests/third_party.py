"""Third-party backends for the self-tests, loaded as `--backend tests.third_party:NAME`.

Each implements softmax.softmax with NumPy and one deliberate defect the gate must catch.
"""

from __future__ import annotations

import os
import time

import numpy as np

from conformance import dtypes as dt
from conformance.backends import Backend
from conformance.poison import poison_array


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


def _writes_input(case, x, y):
    y[...] = _softmax(x).astype(y.dtype)
    x[0, 0] = 0


GOOD = _make("np_good", _good)
NO_MAX = _make("np_no_max", _no_max)
UNWRITTEN = _make("np_unwritten", _unwritten)
OOB = _make("np_oob", _oob)
NOISY = _make("np_noisy", _noisy)
RAISES = _make("np_raises", _raises)
CRASHES = _make("np_crashes", _crashes)
HANGS = _make("np_hangs", _hangs)
WRITES_INPUT = _make("np_writes_input", _writes_input)


class FactoryBackend(Backend):
    """A Backend subclass: `--backend module:Class` instantiates it."""

    def __init__(self) -> None:
        super().__init__(name="np_class", device="cpu", ops={"softmax.softmax": GOOD.ops["softmax.softmax"]})


# -- attention backends with one classic semantic bug each (for the diagnosis) -----------------
def _attention(name: str, causal: str | None = None, tiled: bool = False, no_scale: bool = False) -> Backend:
    def prefill(case, inputs, out):
        import torch

        from kernels.torch import attention as k

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
