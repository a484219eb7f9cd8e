"""Native CPU fused transformer blocks (kernels in blocks.c): C-Kernel-Engine's mega-fused decode
attention block in one pass, and the prefill attention, MLP and outproj + MLP blocks stage by stage.

    attention_decode / attention_prefill:  norm -> q, k, v (+ bias) -> RoPE -> cache write -> attention
                                           -> W_o (+ bias) (+ residual)
    mlp:          norm -> h = norm W1^T (+ b1) (gate | up) -> act = silu(gate) up -> down (+ b2) -> out = x + down
    outproj_mlp:  proj = attn W_o^T (+ bias) -> h1 = proj + residual -> the mlp on h1

Arrays (all float32 and C-contiguous unless said; no copy is made):
x: (aE,) decode, (T, aE) prefill / mlp;  attn (outproj_mlp): (T, h_q a_d), or (h_q, T, a_d) with
    attn_layout="head_major" (the seed's [h, T, a_d]);  residual: like x
gamma: (aE,);  eps: RMSNorm epsilon;  n: the real embed dim E (lanes [n, aE) are padding, zero)
a weight: (fmt, array): "f32" (N, K) float32, or a GGML format (`WEIGHT_FORMATS`) (N, K / block * nbytes)
    uint8 rows of blocks; wq (h_q a_d, aE), wk, wv (h_kv a_d, aE) (each in its own format: S1), wo (aE, h_q a_d)
    (any of them: a K-quant W_o needs h_q a_d a multiple of 256, a 32-block one a_d a multiple of 32)
    or ("f32_heads", (h_q, aE, a_d)) (outproj_mlp and the attention blocks), w1 (2aI, aE) gate rows first (up at
    row aI), w2 (aE, aI)
bq (h_q a_d,), bk, bv (h_kv a_d,), bo (aE,), b1 (2aI,) (b_gate | b_up), b2 (aE,) (b_down): or None
inter: the MLP's real intermediate width I <= aI (None: aI); lanes [I, aI) of each half are padding: h
    carries them as projected, act's are cleared
k_cache, v_cache: (h_kv, cap, a_d), written in place at slots start .. start + T - 1 (decode: pos)
cos, sin: (max_seq, d / 2);  style: "half" or "interleaved";  gemma: RMSNorm weight (1 + gamma)
rope_off (attention): RoPE's position minus the cache slot (the seed's rope_pos_offset), 0 by default
qkv (attention): "separate", or "fused": wq is the seed's one W_qkv ((h_q + 2 h_kv) a_d, aE), rows of the q
    heads, then k, then v, and bq b_qkv likewise (wk, wv, bk, bv None)
out: a dict of preallocated stage outputs (any subset; the rest are allocated)
quantize_activations: True (production, the `emulated` L2 arithmetic: activations quantized to Q8_0 /
    Q8_1 / Q8_K for integer block dots) or False (the same kernels with the weights dequantized: L1)
returns: {stage name: array} (refimpl/blocks.py's names and shapes, the caches excepted)

Conventions and precision: blocks.c's header (fp32 storage, double arithmetic). Launchers raise
ValueError naming the argument, shape, dtype or value that is wrong.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kernel_parity.kernels.cpu.loader import check_status, load
from kernel_parity.kernels.cpu.quant import FORMATS

__all__ = ["WEIGHT_FORMATS", "attention_decode", "attention_prefill", "isa", "layer", "mlp", "outproj_mlp"]

WEIGHT_FORMATS = ("f32", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
STYLES = {"half": 0, "interleaved": 1}
QKV_LAYOUTS = ("separate", "fused")
_F32 = np.dtype(np.float32)
_I64, _PTR, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_INTS = ("t", "e", "ae", "hq", "hkv", "d", "ad", "cap", "start", "inter", "max_seq", "style", "gemma", "wo_heads",
         "quant_acts", "wqkv_type", "wo_type", "w1_type", "w2_type")
_ATTN_INTS = ("rope_off", "qkv_fused")  # blocks.c's attention fields after w2_type (seed audit S7, S11)
_ARRAYS = ("x", "gamma", "wq", "wk", "wv", "wo", "w1", "w2", "bq", "bk", "bv", "bo", "res", "k_cache", "v_cache",
           "cos", "sin", "norm", "q", "k", "v", "q_rope", "k_rope", "attn", "out", "proj", "h1", "h", "act", "down")
_lib: ctypes.CDLL | None = None


_MLP_FIELDS = (("b1", _PTR), ("b2", _PTR), ("ipad", _I64))  # the MLP's biases and padding (appended)
_ATTN_LAYOUT_FIELDS = (("attn_heads", _I64),)  # outproj_mlp's head-major attention output (appended, S5)
_QKV_TYPE_FIELDS = (("wk_type", _I64), ("wv_type", _I64))  # W_k's, W_v's own formats (appended, S1)
_LAYER_FIELDS = (("gamma2", _PTR), ("norm2", _PTR), ("scores", _PTR), ("ctx", _I64))  # the layer (appended, S9)


class _Params(ctypes.Structure):
    """blocks.c's blk_params, field for field."""
    _fields_ = [*((n, _I64) for n in _INTS + _ATTN_INTS), ("eps", _F64), *((n, _PTR) for n in _ARRAYS),
                *_MLP_FIELDS, *_ATTN_LAYOUT_FIELDS, *_QKV_TYPE_FIELDS, *_LAYER_FIELDS]


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("blocks")
        for name in ("blocks_attention_decode", "blocks_attention_prefill", "blocks_mlp", "blocks_outproj_mlp",
                     "blocks_layer"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.POINTER(_Params)]
            fn.restype = ctypes.c_int
        lib.blocks_q8_path.argtypes = []
        lib.kp_set_isa_cap.argtypes = [ctypes.c_int]
        for fn in (lib.blocks_q8_path, lib.kp_set_isa_cap):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def isa(cap: int | None = None) -> int:
    """The SIMD path of the Q8_0 dots: 2 AVX-512 VNNI, 1 AVX2, 0 scalar (the other stages are compiled for
    the same paths by KP_MULTIVERSION). `cap` first lowers the highest allowed path (process-wide; for tests
    that compare the paths: every path gives the same bits)."""
    lib = _kernels()
    if cap is not None:
        lib.kp_set_isa_cap(int(cap))
    return lib.blocks_q8_path()


def _array(name: str, a: Any, shape: tuple[int, ...], dtype: np.dtype = _F32, writeable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray of shape {shape}, got {type(a).__name__}")
    if a.shape != tuple(shape) or a.dtype != dtype:
        raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got shape {a.shape} and dtype {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (strides {a.strides}); no copy is made")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return a


def _weight(name: str, w: Any, n: int, k: int) -> tuple[int, np.ndarray]:
    """(ggml type id, array) of a (fmt, array) weight of N = n rows and K = k columns."""
    if not isinstance(w, tuple) or len(w) != 2:
        raise ValueError(f"{name} must be a (format, array) pair, got {type(w).__name__}")
    fmt, a = w
    if fmt == "f32":
        return 0, _array(name, a, (n, k))
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{name}: unsupported weight format {fmt!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    type_id, qk, nbytes = FORMATS[fmt]
    if k % qk:
        raise ValueError(f"{name}: {fmt} needs K = {k} to be a multiple of its block of {qk} elements")
    return type_id, _array(name, a, (n, k // qk * nbytes), np.dtype(np.uint8))


def _optional(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    return None if a is None else _array(name, a, shape)


def _outputs(out: dict[str, np.ndarray] | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    out = dict(out or {})
    unknown = set(out) - set(shapes)
    if unknown:
        raise ValueError(f"out names unknown output(s) {', '.join(sorted(unknown))} (outputs: {', '.join(shapes)})")
    for name, shape in shapes.items():
        out[name] = _array(f"out[{name!r}]", out[name], shape, writeable=True) if name in out else \
            np.empty(shape, dtype=np.float32)
    return out


def _norm_args(gamma: Any, eps: Any, n: Any, ae: int) -> float:
    _array("gamma", gamma, (ae,))
    if not isinstance(n, (int, np.integer)) or not 1 <= n <= ae:
        raise ValueError(f"n (the real embed dim) must be an int in [1, aE = {ae}], got {n!r}")
    eps = float(eps)
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return eps


def _run(entry: str, fields: dict[str, Any], arrays: dict[str, np.ndarray | None]) -> None:
    p = _Params(**{k: int(v) for k, v in fields.items() if k != "eps"}, eps=float(fields.get("eps", 0.0)))
    for name, a in arrays.items():
        if a is not None:
            setattr(p, name, a.ctypes.data)
    status = getattr(_kernels(), entry)(ctypes.byref(p))
    if status == 3:
        raise ValueError(f"{entry}: a reduction length is not a whole number of its weight format's blocks")
    check_status(status, entry)


def _wo(wo: Any, ae: int, h_q: int, ad: int) -> tuple[int, int]:
    """(ggml type id, wo_heads) of the attention blocks' W_o: (fmt, (aE, h_q a_d)) flat, or ("f32_heads",
    (h_q, aE, a_d)) the seed's fp32 per-head layout (seed audit S4)."""
    if isinstance(wo, tuple) and len(wo) == 2 and wo[0] == "f32_heads":
        _array("wo ('f32_heads')", wo[1], (h_q, ae, ad))
        return 0, 1
    return _weight("wo", wo, ae, h_q * ad)[0], 0


def _attention(entry: str, x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, *, n, h_q, h_kv, d,
               bq, bk, bv, bo, residual, style, gemma, quantize_activations, out, decode: bool, rope_off: int = 0,
               qkv: str = "separate", layer: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    if not isinstance(x, np.ndarray) or x.ndim != (1 if decode else 2):
        raise ValueError(f"x must be a float32 array ({'aE' if decode else 'T, aE'}), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    t, ae = (1, x.shape[0]) if decode else x.shape
    _array("x", x, x.shape)
    eps = _norm_args(gamma, eps, n, ae)
    if not (isinstance(h_kv, int) and isinstance(h_q, int) and h_kv >= 1 and h_q >= 1 and h_q % h_kv == 0):
        raise ValueError(f"h_q={h_q!r} must be a positive multiple of h_kv={h_kv!r}")
    if not isinstance(k_cache, np.ndarray) or k_cache.ndim != 3 or k_cache.shape[0] != h_kv:
        raise ValueError(f"k_cache must be (h_kv = {h_kv}, cap, a_d) float32, got {getattr(k_cache, 'shape', None)}")
    cap, ad = k_cache.shape[1:]
    _array("k_cache", k_cache, (h_kv, cap, ad), writeable=True)
    _array("v_cache", v_cache, (h_kv, cap, ad), writeable=True)
    if not isinstance(d, int) or d < 2 or d % 2 or d > ad:
        raise ValueError(f"d={d!r} must be an even int in [2, a_d = {ad}] (the caches' last axis)")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + t > cap:
        raise ValueError(f"{'pos' if decode else 'start'}={start!r}: the new tokens' slots must lie in [0, cap = {cap})")
    if not isinstance(cos, np.ndarray) or cos.ndim != 2 or cos.shape[1] != d // 2:
        raise ValueError(f"cos must be (max_seq, d / 2 = {d // 2}) float32, got {getattr(cos, 'shape', None)}")
    max_seq = cos.shape[0]
    _array("cos", cos, (max_seq, d // 2))
    _array("sin", sin, (max_seq, d // 2))
    if not isinstance(rope_off, (int, np.integer)) or rope_off < 0:
        raise ValueError(f"rope_off={rope_off!r} must be an int >= 0 (RoPE's position minus the cache slot)")
    if rope_off + start + t > max_seq:
        raise ValueError(f"RoPE positions up to {rope_off + start + t - 1} need cos/sin rows, the tables have "
                         f"{max_seq}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    if qkv not in QKV_LAYOUTS:
        raise ValueError(f"qkv must be one of {', '.join(QKV_LAYOUTS)}, got {qkv!r}")
    fused = qkv == "fused"
    if fused:  # the seed's one W_qkv / b_qkv as wq / bq: rows of the q heads, then k, then v
        if wk is not None or wv is not None or bk is not None or bv is not None:
            raise ValueError("qkv='fused' takes W_qkv as wq and b_qkv as bq: wk, wv, bk, bv must be None")
        types = [_weight("wq (W_qkv)", wq, (h_q + 2 * h_kv) * ad, ae)[0]] * 3
    else:  # each its own format (S1: the seed's wq_dt, wk_dt, wv_dt)
        types = [_weight(nm, w, rows, ae)[0] for nm, w, rows in (("wq", wq, h_q * ad), ("wk", wk, h_kv * ad),
                                                                   ("wv", wv, h_kv * ad))]
    wo_type, wo_heads = _wo(wo, ae, h_q, ad)  # a K-quant's 256-blocks over h_q a_d (S1): _weight checks it
    if wo_type and FORMATS[wo[0]][1] == 32 and ad % 32:
        raise ValueError(f"wo={wo[0]} quantizes the attention output per head: a_d = {ad} must be a multiple of 32")
    lead = () if decode else (t,)
    shapes = {"norm": (*lead, ae), "q": (*lead, h_q, ad), "k": (*lead, h_kv, ad), "v": (*lead, h_kv, ad),
              "q_rope": (*lead, h_q, ad), "k_rope": (*lead, h_kv, ad), "attn": (*lead, h_q, ad), "out": (*lead, ae)}
    if layer is not None:  # the whole layer (S9): the MLP block's stages and fields beside the attention's
        shapes.update(layer["shapes"])
    res = _outputs(out, shapes)
    fields = dict(t=t, e=n, ae=ae, hq=h_q, hkv=h_kv, d=d, ad=ad, cap=cap, start=int(start), max_seq=max_seq,
                  style=STYLES[style], gemma=bool(gemma), quant_acts=bool(quantize_activations),
                  wqkv_type=types[0], wk_type=types[1], wv_type=types[2], wo_type=wo_type, wo_heads=wo_heads, eps=eps,
                  rope_off=int(rope_off), qkv_fused=fused)
    arrays = dict(x=x, gamma=gamma, wq=wq[1], wk=None if fused else wk[1], wv=None if fused else wv[1], wo=wo[1],
                  k_cache=k_cache, v_cache=v_cache, cos=cos, sin=sin,
                  bq=_optional("bq", bq, (((h_q + 2 * h_kv) if fused else h_q) * ad,)),
                  bk=_optional("bk", bk, (h_kv * ad,)),
                  bv=_optional("bv", bv, (h_kv * ad,)), bo=_optional("bo", bo, (ae,)),
                  res=_optional("residual", residual, x.shape), **res)
    if layer is not None:
        fields.update(layer["fields"])
        arrays.update(layer["arrays"])
    _run(entry, fields, arrays)
    return res


def attention_decode(x: np.ndarray, gamma: np.ndarray, eps: float, wq, wk, wv, wo, k_cache: np.ndarray,
                     v_cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: int, *, n: int, h_q: int, h_kv: int,
                     d: int, bq=None, bk=None, bv=None, bo=None, residual=None, style: str = "half",
                     gemma: bool = False, quantize_activations: bool = True,
                     out: dict[str, np.ndarray] | None = None, rope_off: int = 0,
                     qkv: str = "separate") -> dict[str, np.ndarray]:
    """The fused decode block for one token x (aE,) in slot pos (slots 0 .. pos attended), rotated at
    rope_off + pos; qkv="fused": wq is W_qkv, bq b_qkv (wk, wv, bk, bv None)."""
    return _attention("blocks_attention_decode", x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, pos,
                      n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style,
                      gemma=gemma, quantize_activations=quantize_activations, out=out, decode=True,
                      rope_off=rope_off, qkv=qkv)


def attention_prefill(x: np.ndarray, gamma: np.ndarray, eps: float, wq, wk, wv, wo, k_cache: np.ndarray,
                      v_cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, start: int, *, n: int, h_q: int,
                      h_kv: int, d: int, bq=None, bk=None, bv=None, bo=None, residual=None, style: str = "half",
                      gemma: bool = False, quantize_activations: bool = True,
                      out: dict[str, np.ndarray] | None = None, rope_off: int = 0,
                      qkv: str = "separate") -> dict[str, np.ndarray]:
    """The attention block over x (T, aE) in slots start .. start + T - 1 (rotated at rope_off + slot), stage
    by stage; qkv as `attention_decode`."""
    return _attention("blocks_attention_prefill", x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start,
                      n=n, h_q=h_q, h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=residual, style=style,
                      gemma=gemma, quantize_activations=quantize_activations, out=out, decode=False,
                      rope_off=rope_off, qkv=qkv)


def mlp_width(w1: Any, inter: Any) -> tuple[int, int]:
    """(I, aI) of a (format, array) w1 of 2aI rows (gate, then up) and the real width `inter` (None: aI)."""
    if not isinstance(w1, tuple) or len(w1) != 2 or not isinstance(w1[1], np.ndarray) or w1[1].ndim != 2 \
            or w1[1].shape[0] % 2:
        raise ValueError(f"w1 must be a (format, array) pair of 2aI rows (gate, then up), got "
                         f"{getattr(w1[1], 'shape', None) if isinstance(w1, tuple) and len(w1) == 2 else type(w1).__name__}")
    ai = w1[1].shape[0] // 2
    i = ai if inter is None else inter
    if not isinstance(i, (int, np.integer)) or not 1 <= i <= ai:
        raise ValueError(f"inter (the real intermediate width I) must be an int in [1, aI = {ai}], got {inter!r}")
    return int(i), ai


def _mlp_fields(x: np.ndarray, gamma, eps, w1, w2, n, gemma, quantize_activations, b1=None, b2=None,
                inter=None) -> tuple[dict, dict]:
    t, ae = x.shape
    eps = _norm_args(gamma, eps, n, ae)
    i, ai = mlp_width(w1, inter)
    w1_type, _ = _weight("w1", w1, 2 * ai, ae)
    w2_type, _ = _weight("w2", w2, ae, ai)
    fields = dict(t=t, e=n, ae=ae, inter=i, ipad=ai - i, gemma=bool(gemma), quant_acts=bool(quantize_activations),
                  w1_type=w1_type, w2_type=w2_type, eps=eps)
    return fields, dict(gamma=gamma, w1=w1[1], w2=w2[1], b1=_optional("b1", b1, (2 * ai,)),
                        b2=_optional("b2", b2, (ae,)))


def mlp(x: np.ndarray, gamma: np.ndarray, eps: float, w1, w2, *, n: int, b1=None, b2=None, inter: int | None = None,
        gemma: bool = False, quantize_activations: bool = True,
        out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """x (T, aE) -> {"norm", "h" (T, 2aI), "act" (T, aI), "down", "out" = x + down}."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x must be a float32 array (T, aE), got {getattr(x, 'shape', type(x).__name__)}")
    _array("x", x, x.shape)
    fields, arrays = _mlp_fields(x, gamma, eps, w1, w2, n, gemma, quantize_activations, b1, b2, inter)
    t, ae, i = x.shape[0], x.shape[1], fields["inter"] + fields["ipad"]
    res = _outputs(out, {"norm": (t, ae), "h": (t, 2 * i), "act": (t, i), "down": (t, ae), "out": (t, ae)})
    _run("blocks_mlp", fields, dict(x=x, **arrays, **res))
    return res


def outproj_mlp(attn: np.ndarray, residual: np.ndarray, wo, gamma: np.ndarray, eps: float, w1, w2, *, n: int,
                bo: np.ndarray | None = None, b1=None, b2=None, inter: int | None = None, gemma: bool = False,
                quantize_activations: bool = True, out: dict[str, np.ndarray] | None = None,
                attn_layout: str = "token_major") -> dict[str, np.ndarray]:
    """attn (T, h_q a_d), or (h_q, T, a_d) with attn_layout="head_major" (the seed's [h, T, a_d]), residual
    (T, aE) -> {"proj", "h1" = proj + residual, "norm", "h", "act", "down", "out"}."""
    if not isinstance(residual, np.ndarray) or residual.ndim != 2:
        raise ValueError(f"residual must be a float32 array (T, aE), got {getattr(residual, 'shape', None)}")
    _array("residual", residual, residual.shape)
    t, ae = residual.shape
    if attn_layout == "head_major":
        if not isinstance(attn, np.ndarray) or attn.ndim != 3 or attn.shape[1] != t:
            raise ValueError(f"attn (head_major) must be a float32 array (h_q, T = {t}, a_d), got "
                             f"{getattr(attn, 'shape', None)}")
        attn_hq, attn_ad = attn.shape[0], attn.shape[2]
    elif attn_layout == "token_major":
        if not isinstance(attn, np.ndarray) or attn.ndim != 2 or attn.shape[0] != t:
            raise ValueError(f"attn must be a float32 array (T = {t}, h_q a_d), got {getattr(attn, 'shape', None)}")
        attn_hq, attn_ad = 1, attn.shape[1]
    else:
        raise ValueError(f"attn_layout={attn_layout!r}: expected 'token_major' or 'head_major'")
    _array("attn", attn, attn.shape)
    k = attn_hq * attn_ad
    fields, arrays = _mlp_fields(residual, gamma, eps, w1, w2, n, gemma, quantize_activations, b1, b2, inter)
    if isinstance(wo, tuple) and len(wo) == 2 and wo[0] == "f32_heads":
        a = wo[1]
        if not isinstance(a, np.ndarray) or a.ndim != 3 or a.shape[1] != ae or a.shape[0] * a.shape[2] != k:
            raise ValueError(f"wo ('f32_heads') must be (h_q, aE = {ae}, a_d) with h_q a_d = {k}, got "
                             f"{getattr(a, 'shape', None)}")
        _array("wo", a, a.shape)
        hq, ad, wo_type, heads = a.shape[0], a.shape[2], 0, 1
        if attn_layout == "head_major" and (hq, ad) != (attn_hq, attn_ad):
            raise ValueError(f"wo ('f32_heads') has {hq} heads of {ad} lanes, attn {attn_hq} of {attn_ad}")
    else:
        wo_type, _ = _weight("wo", wo, ae, k)
        hq, ad, heads = attn_hq, attn_ad, 0
    i = fields["inter"] + fields["ipad"]
    res = _outputs(out, {"proj": (t, ae), "h1": (t, ae), "norm": (t, ae), "h": (t, 2 * i), "act": (t, i),
                         "down": (t, ae), "out": (t, ae)})
    fields.update(hq=hq, ad=ad, wo_type=wo_type, wo_heads=heads, attn_heads=int(attn_layout == "head_major"))
    _run("blocks_outproj_mlp", fields, dict(x=attn, res=residual, wo=wo[1], bo=_optional("bo", bo, (ae,)),
                                            **arrays, **res))
    return res


def context_window(live: int) -> int:
    """The saved scores' row length: the live slots start + T rounded up to 16 floats (refimpl.blocks')."""
    return -(-live // 16) * 16


def layer(x: np.ndarray, gamma: np.ndarray, eps: float, wq, wk, wv, wo, k_cache: np.ndarray, v_cache: np.ndarray,
          cos: np.ndarray, sin: np.ndarray, start: int, gamma2: np.ndarray, w1, w2, *, n: int, h_q: int, h_kv: int,
          d: int, bq=None, bk=None, bv=None, bo=None, style: str = "half", gemma: bool = False,
          quantize_activations: bool = True, scores: bool = False,
          out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A whole layer over x (T, aE) in slots start .. start + T - 1 (seed audit S9), blocks.c's blocks_layer: the
    prefill attention block (stage by stage, its W_o output before the residual kept in double), h1 = that + x,
    then the MLP block on h1 (gamma2, w1 gate rows first, w2; one eps and gemma).
    returns the attention stages ("out" left out), "h1", "norm2", "h", "act", "down", "out", and with scores
    "scores" (h_q, T, ctx = context_window(start + T)): the attention's own P (its logits, final max and sum),
    0 on the masked slots and the padding lanes."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x must be a float32 array (T, aE), got {getattr(x, 'shape', type(x).__name__)}")
    t, ae = x.shape
    _array("gamma2", gamma2, (ae,))
    i, ai = mlp_width(w1, None)
    w1_type, _ = _weight("w1", w1, 2 * ai, ae)
    w2_type, _ = _weight("w2", w2, ae, ai)
    shapes = {"h1": (t, ae), "norm2": (t, ae), "h": (t, 2 * ai), "act": (t, ai), "down": (t, ae)}
    ctx = context_window(int(start) + t)
    if scores:
        shapes["scores"] = (h_q, t, ctx)
    names = ("h1", "norm2", "h", "act", "down", "scores")
    extra = {k: v for k, v in (out or {}).items() if k in names}
    main = {k: v for k, v in (out or {}).items() if k not in names}
    res_extra = _outputs(extra, shapes)
    spec = dict(shapes=shapes, fields=dict(inter=i, ipad=0, w1_type=w1_type, w2_type=w2_type, ctx=ctx),
                arrays=dict(gamma2=gamma2, w1=w1[1], w2=w2[1], **res_extra))
    res = _attention("blocks_layer", x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q,
                     h_kv=h_kv, d=d, bq=bq, bk=bk, bv=bv, bo=bo, residual=None, style=style, gemma=gemma,
                     quantize_activations=quantize_activations, out={**main, **res_extra}, decode=False,
                     layer=spec)
    return res
