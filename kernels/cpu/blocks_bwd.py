"""Native CPU whole-layer backward of the fused blocks (kernels in blocks_bwd.c): the seed's backward stage
kernels, fp32, run in reverse pipeline order.

    mlp_backward:       dact = dout W2 -> dh (SwiGLU) -> dnorm = dh W1 -> dx (RMSNorm) + dout;
                        dgamma, dW1 = dh^T norm, dW2 = dout^T act, db1 = sum dh, db2 = sum dout
    attention_prefill_backward:  dattn = dout W_o -> (dq_rope, dk_rope, dv) of the causal GQA attention over
                        history + chunk -> dq, dk (RoPE^T) -> dnorm = dq Wq + dk Wk + dv Wv -> dx (RMSNorm);
                        dgamma, dW, db of every projection, dr = dout; `scores` the forward's P (S9)
    layer_backward:     the whole layer (S9): mlp_backward on h1 -> dh1, attention_prefill_backward for dh1,
                        dx += dh1 (one C call, blocks_layer_backward)

Arrays (all float32 and C-contiguous unless said; no copy is made): the forward's (kernels/cpu/blocks.py's
names and shapes: x (T, aE), gamma, the weights as (fmt, array) pairs (wq, wk, wv each in its own format: S1),
the biases, the caches holding the history (h_kv, cap, a_d), cos / sin) plus the forward's saved activations
    mlp: norm (T, aE), rstd (T,), h (T, 2aI), act (T, aI) (lanes [I, aI) of each half padding: `inter`)
    attention: norm (T, aE), rstd (T,), q_rope (T, h_q, a_d), k_rope, v (T, h_kv, a_d), attn (T, h_q, a_d)
and the cotangent dout (T, aE).
out: preallocated gradients (any subset; the rest are allocated): the stage gradients (mlp: dact, dh,
dnorm; attention: dattn, dq_rope, dk_rope, dv, dq, dk, dnorm) and dx always; with `weight_grads` (every
weight float32) also dgamma and the weight gradients (mlp: dw1, dw2, db1, db2 for b1, b2; attention: dwq, dwk, dwv, dwo, and
dbq, dbk, dbv, dbo for the biases given, dr with a residual).
returns: {name: array} of those.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kernel_parity.kernels.cpu.blocks import QKV_LAYOUTS, STYLES, _array, _norm_args, _optional, _weight, _wo, mlp_width
from kernel_parity.kernels.cpu.loader import check_status, load

__all__ = ["attention_prefill_backward", "layer_backward", "mlp_backward"]

_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_INTS = ("t", "e", "ae", "hq", "hkv", "d", "ad", "cap", "start", "inter", "max_seq", "style", "gemma", "wqkv_type",
         "wo_type", "w1_type", "w2_type")
_ATTN_INTS = ("rope_off", "qkv_fused", "wo_heads")  # blocks_bwd.c's attention fields after w2_type (S7, S11, S4)
_ARRAYS = ("x", "gamma", "dout", "wq", "wk", "wv", "wo", "w1", "w2", "k_cache", "v_cache", "cos", "sin", "norm", "rstd",
           "q_rope", "k_rope", "v", "attn", "h", "act", "dattn", "dq_rope", "dk_rope", "dv", "dq", "dk", "dnorm", "dact",
           "dh", "dx", "dgamma", "dwq", "dwk", "dwv", "dwo", "dw1", "dw2", "dbq", "dbk", "dbv", "dbo", "dr")
_lib: ctypes.CDLL | None = None


_MLP_FIELDS = (("db1", _PTR), ("db2", _PTR), ("ipad", _I64))  # the MLP's bias gradients and padding (appended)
_QKV_TYPE_FIELDS = (("wk_type", _I64), ("wv_type", _I64))  # W_k's, W_v's own formats (appended, S1)
_SCORES_FIELDS = (("scores", _PTR), ("ctx", _I64))  # the attention's saved P and its row length (S9, appended)


class _Params(ctypes.Structure):
    """blocks_bwd.c's bwd_params, field for field."""
    _fields_ = [*((n, _I64) for n in _INTS + _ATTN_INTS), ("eps", _F64), *((n, _PTR) for n in _ARRAYS),
                *_MLP_FIELDS, *_QKV_TYPE_FIELDS, *_SCORES_FIELDS]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("blocks_bwd")
        for name in ("blocks_mlp_backward", "blocks_attention_prefill_backward"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.POINTER(_Params)]
            fn.restype = ctypes.c_int
        lib.blocks_layer_backward.argtypes = [ctypes.POINTER(_Params), ctypes.POINTER(_Params)]
        lib.blocks_layer_backward.restype = ctypes.c_int
        _lib = lib
    return _lib


def _outputs(out: dict[str, np.ndarray] | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    out = dict(out or {})
    unknown = set(out) - set(shapes)
    if unknown:
        raise ValueError(f"out names unknown gradient(s) {', '.join(sorted(unknown))} (this call's: {', '.join(shapes)})")
    for name, shape in shapes.items():
        out[name] = _array(f"out[{name!r}]", out[name], shape, writeable=True) if name in out else \
            np.empty(shape, dtype=np.float32)
    return out


def _params(fields: dict[str, Any], arrays: dict[str, np.ndarray | None]) -> _Params:
    p = _Params(**{k: int(v) for k, v in fields.items() if k != "eps"}, eps=float(fields.get("eps", 0.0)))
    for name, a in arrays.items():
        if a is not None:
            setattr(p, name, a.ctypes.data)
    return p


def _run(entry: str, fields: dict[str, Any], arrays: dict[str, np.ndarray | None],
         defer: list | None = None) -> None:
    """Call `entry` with the filled bwd_params; with `defer`, append them to it instead (layer_backward)."""
    p = _params(fields, arrays)
    if defer is not None:
        defer.append(p)
        return
    check_status(getattr(_kernels(), entry)(ctypes.byref(p)), entry)


def mlp_backward(x: np.ndarray, gamma: np.ndarray, eps: float, w1, w2, dout: np.ndarray, *, norm: np.ndarray,
                 rstd: np.ndarray, h: np.ndarray, act: np.ndarray, n: int, b1=None, b2=None,
                 inter: int | None = None, gemma: bool = False, weight_grads: bool = True,
                 out: dict[str, np.ndarray] | None = None, _defer: list | None = None) -> dict[str, np.ndarray]:
    """The MLP block's backward for dout (T, aE); returns the gradients (module docstring). b1, b2: the forward's
    biases (or None; h carries them): with `weight_grads`, their gradients db1, db2 are returned."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x must be a float32 array (T, aE), got {getattr(x, 'shape', type(x).__name__)}")
    t, ae = _array("x", x, x.shape).shape
    eps = _norm_args(gamma, eps, n, ae)
    real, i = mlp_width(w1, inter)
    w1_type, _ = _weight("w1", w1, 2 * i, ae)
    w2_type, _ = _weight("w2", w2, ae, i)
    if weight_grads and (w1_type or w2_type):
        raise ValueError(f"weight gradients need float32 weights, got w1={w1[0]}, w2={w2[0]}")
    for name, a, shape in (("dout", dout, (t, ae)), ("norm", norm, (t, ae)), ("rstd", rstd, (t,)),
                           ("h", h, (t, 2 * i)), ("act", act, (t, i))):
        _array(name, a, shape)
    shapes = {"dact": (t, i), "dh": (t, 2 * i), "dnorm": (t, ae), "dx": (t, ae)}
    biases = {"db1": _optional("b1", b1, (2 * i,)), "db2": _optional("b2", b2, (ae,))}
    if weight_grads:
        shapes.update(dgamma=(ae,), dw1=(2 * i, ae), dw2=(ae, i))
        shapes.update({k: b.shape for k, b in biases.items() if b is not None})
    res = _outputs(out, shapes)
    fields = dict(t=t, e=n, ae=ae, inter=real, ipad=i - real, gemma=bool(gemma), w1_type=w1_type, w2_type=w2_type,
                  eps=eps)
    _run("blocks_mlp_backward", fields, dict(x=x, gamma=gamma, dout=dout, w1=w1[1], w2=w2[1], norm=norm, rstd=rstd,
                                             h=h, act=act, **res), _defer)
    return res


def attention_prefill_backward(x: np.ndarray, gamma: np.ndarray, eps: float, wq, wk, wv, wo, k_cache: np.ndarray,
                               v_cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, start: int, dout: np.ndarray, *,
                               norm: np.ndarray, rstd: np.ndarray, q_rope: np.ndarray, k_rope: np.ndarray,
                               v: np.ndarray, attn: np.ndarray, n: int, h_q: int, h_kv: int, d: int, bq=None,
                               bk=None, bv=None, bo=None, residual=None, style: str = "half", gemma: bool = False,
                               weight_grads: bool = True, out: dict[str, np.ndarray] | None = None,
                               rope_off: int = 0, qkv: str = "separate", scores: np.ndarray | None = None,
                               _defer: list | None = None) -> dict[str, np.ndarray]:
    """The prefill attention block's backward for dout (T, aE); the caches hold the history (slots < start,
    read only). RoPE's transpose at the forward's positions rope_off + start + t; qkv="fused": wq is W_qkv, bq
    b_qkv (wk, wv, bk, bv None) and dwqkv, dbqkv replace dwq, dwk, dwv, dbq, dbk, dbv; scores: the forward's
    softmax probabilities (h_q, T, ctx), ctx >= start + T (S9), read in place of recomputing them. Returns the
    gradients (module docstring)."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x must be a float32 array (T, aE), got {getattr(x, 'shape', type(x).__name__)}")
    t, ae = _array("x", x, x.shape).shape
    eps = _norm_args(gamma, eps, n, ae)
    if not (isinstance(h_kv, int) and isinstance(h_q, int) and h_kv >= 1 and h_q >= 1 and h_q % h_kv == 0):
        raise ValueError(f"h_q={h_q!r} must be a positive multiple of h_kv={h_kv!r}")
    if not isinstance(k_cache, np.ndarray) or k_cache.ndim != 3 or k_cache.shape[0] != h_kv:
        raise ValueError(f"k_cache must be (h_kv = {h_kv}, cap, a_d) float32, got {getattr(k_cache, 'shape', None)}")
    cap, ad = k_cache.shape[1:]
    _array("k_cache", k_cache, (h_kv, cap, ad))
    _array("v_cache", v_cache, (h_kv, cap, ad))
    if not isinstance(d, int) or d < 2 or d % 2 or d > ad:
        raise ValueError(f"d={d!r} must be an even int in [2, a_d = {ad}] (the caches' last axis)")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + t > cap:
        raise ValueError(f"start={start!r}: the tokens' slots must lie in [0, cap = {cap})")
    if not isinstance(rope_off, (int, np.integer)) or rope_off < 0:
        raise ValueError(f"rope_off={rope_off!r} must be an int >= 0 (RoPE's position minus the cache slot)")
    last = rope_off + start + t
    if not isinstance(cos, np.ndarray) or cos.ndim != 2 or cos.shape[1] != d // 2 or cos.shape[0] < last:
        raise ValueError(f"cos must be (max_seq >= rope_off + start + T = {last}, d / 2 = {d // 2}) float32, got "
                         f"{getattr(cos, 'shape', None)}")
    _array("cos", cos, cos.shape)
    _array("sin", sin, cos.shape)
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    if qkv not in QKV_LAYOUTS:
        raise ValueError(f"qkv must be one of {', '.join(QKV_LAYOUTS)}, got {qkv!r}")
    fused, rows = qkv == "fused", (h_q + 2 * h_kv) * ad
    if fused and (wk is not None or wv is not None or bk is not None or bv is not None):
        raise ValueError("qkv='fused' takes W_qkv as wq and b_qkv as bq: wk, wv, bk, bv must be None")
    sections = (("wq (W_qkv)", wq, rows),) if fused else (("wq", wq, h_q * ad), ("wk", wk, h_kv * ad),
                                                           ("wv", wv, h_kv * ad))
    types = [_weight(nm, w, n_rows, ae)[0] for nm, w, n_rows in sections] * (3 if fused else 1)  # each its own (S1)
    wo_type, wo_heads = _wo(wo, ae, h_q, ad)
    if weight_grads and (any(types) or wo_type):
        raise ValueError(f"weight gradients need float32 weights, got wq={wq[0]}, "
                         f"{'' if fused else f'wk={wk[0]}, wv={wv[0]}, '}wo={wo[0]}")
    for name, a, shape in (("dout", dout, (t, ae)), ("norm", norm, (t, ae)), ("rstd", rstd, (t,)),
                           ("q_rope", q_rope, (t, h_q, ad)), ("k_rope", k_rope, (t, h_kv, ad)), ("v", v, (t, h_kv, ad)),
                           ("attn", attn, (t, h_q, ad))):
        _array(name, a, shape)
    biases = {"bq": _optional("bq", bq, (rows if fused else h_q * ad,)), "bk": _optional("bk", bk, (h_kv * ad,)),
              "bv": _optional("bv", bv, (h_kv * ad,)), "bo": _optional("bo", bo, (ae,))}
    if residual is not None:
        _array("residual", residual, (t, ae))
    if scores is not None:
        if not isinstance(scores, np.ndarray) or scores.ndim != 3 or scores.shape[:2] != (h_q, t) or \
                scores.shape[2] < start + t:
            raise ValueError(f"scores must be (h_q = {h_q}, T = {t}, ctx >= start + T = {start + t}) float32, got "
                             f"{getattr(scores, 'shape', type(scores).__name__)}")
        _array("scores", scores, scores.shape)
    shapes = {"dattn": (t, h_q, ad), "dq_rope": (t, h_q, ad), "dk_rope": (t, h_kv, ad), "dv": (t, h_kv, ad),
              "dq": (t, h_q, ad), "dk": (t, h_kv, ad), "dnorm": (t, ae), "dx": (t, ae)}
    if weight_grads:
        shapes.update(dgamma=(ae,), dwq=(h_q * ad, ae), dwk=(h_kv * ad, ae), dwv=(h_kv * ad, ae),
                      dwo=(h_q, ae, ad) if wo_heads else (ae, h_q * ad))  # per head: the seed's d_wo (S4)
        shapes.update({f"d{b}": a.shape for b, a in biases.items() if a is not None})
        if residual is not None:
            shapes["dr"] = (t, ae)
        if fused:  # W_qkv's gradient (and b_qkv's), one buffer each: the kernel writes the sections
            shapes = {("dwqkv" if k == "dwq" else "dbqkv" if k == "dbq" else k): ((rows, ae) if k == "dwq" else
                                                                                (rows,) if k == "dbq" else v)
                      for k, v in shapes.items() if k not in ("dwk", "dwv")}
    res = _outputs(out, shapes)
    fields = dict(t=t, e=n, ae=ae, hq=h_q, hkv=h_kv, d=d, ad=ad, cap=cap, start=int(start), max_seq=cos.shape[0],
                  style=STYLES[style], gemma=bool(gemma), wqkv_type=types[0], wk_type=types[1], wv_type=types[2],
                  wo_type=wo_type, eps=eps,
                  rope_off=int(rope_off), qkv_fused=fused, wo_heads=wo_heads,
                  ctx=0 if scores is None else scores.shape[2])
    grads = {("dwq" if k == "dwqkv" else "dbq" if k == "dbqkv" else k): v for k, v in res.items()}
    _run("blocks_attention_prefill_backward", fields,
         dict(x=x, gamma=gamma, dout=dout, wq=wq[1], wk=None if fused else wk[1], wv=None if fused else wv[1],
              wo=wo[1], k_cache=k_cache, v_cache=v_cache, cos=cos, sin=sin, norm=norm, rstd=rstd, q_rope=q_rope,
              k_rope=k_rope, v=v, attn=attn, scores=scores, **grads), _defer)
    return res


# the MLP block's gradients in layer_backward: mlp_backward's names -> the layer's (refimpl.blocks.LAYER_MLP_GRADS)
LAYER_MLP_GRADS = {"dact": "dact", "dh": "dh", "dnorm": "dnorm2", "dx": "dh1", "dgamma": "dgamma2", "dw1": "dw1",
                   "dw2": "dw2"}


def layer_backward(x: np.ndarray, gamma: np.ndarray, eps: float, wq, wk, wv, wo, k_cache: np.ndarray,
                   v_cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, start: int, gamma2: np.ndarray, w1, w2,
                   dout: np.ndarray, *, norm: np.ndarray, rstd: np.ndarray, q_rope: np.ndarray, k_rope: np.ndarray,
                   v: np.ndarray, attn: np.ndarray, h1: np.ndarray, norm2: np.ndarray, rstd2: np.ndarray,
                   h: np.ndarray, act: np.ndarray, n: int, h_q: int, h_kv: int, d: int, bq=None, bk=None, bv=None,
                   bo=None, style: str = "half", gemma: bool = False, scores: np.ndarray | None = None,
                   attention_grads: bool = True, mlp_grads: bool = True,
                   out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The whole layer's backward (S9; blocks_layer_backward): the MLP block's on h1 (saved h1, norm2, rstd2, h,
    act; gamma2, w1, w2) for dout, giving dh1; the attention block's (saved norm, rstd, q_rope, k_rope, v, attn;
    `scores` its P, or None: recomputed) for dh1; dx = its RMSNorm dx + dh1. attention_grads / mlp_grads: each
    block's weight gradients (float32 weights). Returns the gradients under the layer's names: the MLP's
    renamed (LAYER_MLP_GRADS: dnorm2, dh1, dgamma2, ...), the attention's as attention_prefill_backward's."""
    out = dict(out or {})
    layer_names = {v: k for k, v in LAYER_MLP_GRADS.items()}
    mlp_out = {layer_names[k]: out.pop(k) for k in list(out) if k in layer_names}
    if not isinstance(dout, np.ndarray) or dout.ndim != 2:
        raise ValueError(f"dout must be a float32 array (T, aE), got {getattr(dout, 'shape', type(dout).__name__)}")
    if "dx" not in mlp_out:
        mlp_out["dx"] = np.empty(dout.shape, dtype=np.float32)
    deferred: list = []
    m = mlp_backward(h1, gamma2, eps, w1, w2, dout, norm=norm2, rstd=rstd2, h=h, act=act, n=n, gemma=gemma,
                     weight_grads=mlp_grads, out=mlp_out, _defer=deferred)
    a = attention_prefill_backward(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, m["dx"],
                                   norm=norm, rstd=rstd, q_rope=q_rope, k_rope=k_rope, v=v, attn=attn, n=n, h_q=h_q,
                                   h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, style=style, gemma=gemma,
                                   weight_grads=attention_grads, out=out, scores=scores, _defer=deferred)
    mp, ap = deferred
    check_status(_kernels().blocks_layer_backward(ctypes.byref(ap), ctypes.byref(mp)), "blocks_layer_backward")
    return {**{LAYER_MLP_GRADS[k]: v for k, v in m.items()}, **a}
