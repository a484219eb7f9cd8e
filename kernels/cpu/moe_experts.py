"""Native CPU fused MoE experts layer over routed tokens (kernel in moe_experts.c).

    experts(x, ids, weights, w13, w2, *, ws13=None, ws2=None, out=None, act_fp8=False) -> out

    out[t] = sum_j weights[t, j] W2[e] rnd(silu(G_e x_t) * (U_e x_t))  (+ the shared experts, weight 1)
    e = ids[t, j]; G_e = w13[e, :F], U_e = w13[e, F:] (vLLM's w13 layout, gate first)

x (T, D), w13 (E, 2F, D), w2 (E, D, F), ws13 (S, 2Fs, D), ws2 (S, D, Fs): one dtype of float32 / float16 /
bfloat16, C-contiguous (no copy is made), or every weight GPTQ v1 int4 (`weight_shape`: a dict of qweight,
qzeros, fp16 scales per expert, one group; activations stay in x's dtype, the weights dequantized exactly), or
every weight block FP8 (a dict of codes (E, N, K) float8_e4m3fn and scales (E, ceil(N/128), ceil(K/128)) fp32,
DeepSeek-V3's 128 x 128 blocks, dequantized in float32), or every weight GGML blocks (a dict {"fmt": "q8_0" /
"q4_0" / "q4_k" / "q6_k", "blocks": (E, N, K / QK * nbytes) uint8}: llama.cpp's expert-stacked tensors, each row
dequantized to float32 as ggml's dequantize_row_* when read; w-only, x and act in x's dtype); act_fp8 (block FP8
only): w8a8, x and act quantized per token per 128 columns to e4m3 before each GEMM (refimpl/moe_experts.py);
ids (T, k) int32 in [0, E); weights (T, k) float32. Returns out (T, D) in x's dtype (`out` used when given).
rnd: act rounded to x's dtype (the golden's production cast, refimpl/moe_experts.py); arithmetic float32
(moe_experts.c). Bad arguments: ValueError naming them (`check_experts_args`, shared with the torch and Triton
kernels).
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from kernel_parity.kernels.cpu.loader import check_output, check_status, dtype_code, load

__all__ = ["experts", "check_experts_args", "weight_shape", "INT4_KEYS", "FP8_KEYS", "FP8_BLOCK"]

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load("moe_experts")
        lib.moe_experts_kernel.argtypes = ([_PTR] * 19 + [_I64] + [_PTR] * 8 + [_INT] + [_PTR] * 4 + [_INT]
                                           + [_I64] * 7 + [_INT, _PTR])
        lib.moe_experts_kernel.restype = ctypes.c_int
        _lib = lib
    return _lib


def _shape(a) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(a, "shape", ()))


INT4_KEYS = ("qweight", "qzeros", "scales")
FP8_KEYS = ("codes", "scales")
FP8_BLOCK = 128
GGML_KEYS = ("fmt", "blocks")
# GGML weight formats: (ggml type id, elements a block, bytes a block)
GGML = {"q8_0": (8, 32, 34), "q4_0": (2, 32, 18), "q4_k": (12, 256, 144), "q6_k": (14, 256, 210)}


def weight_shape(name: str, w) -> tuple[tuple[int, ...], int | str | None]:
    """(the logical (E, N, K) shape, the int4 group, "fp8" or None) of a dense weight (E, N, K), a GPTQ v1 int4
    one: a dict {"qweight": (E, K/8, N) int32, "qzeros": (E, K/g, N/8) int32, "scales": (E, K/g, N) fp16}, or a
    block-FP8 one: a dict {"codes": (E, N, K) float8_e4m3fn, "scales": (E, ceil(N/128), ceil(K/128)) fp32}."""
    if not isinstance(w, dict):
        return _shape(w), None
    if set(w) == set(GGML_KEYS):
        fmt, b = w["fmt"], _shape(w["blocks"])
        if fmt not in GGML:
            raise ValueError(f"moe.experts: GGML {name}['fmt'] must be one of {', '.join(GGML)}, got {fmt!r}")
        _, qk, nbytes = GGML[fmt]
        if len(b) != 3 or b[2] % nbytes:
            raise ValueError(f"moe.experts: GGML {name}['blocks'] must be (E, N, K / {qk} * {nbytes}) bytes of {fmt} "
                             f"blocks, got shape {b}")
        return (b[0], b[1], b[2] // nbytes * qk), fmt
    if set(w) == set(FP8_KEYS):
        cs, sc = _shape(w["codes"]), _shape(w["scales"])
        if len(cs) != 3:
            raise ValueError(f"moe.experts: fp8 {name}['codes'] must be (E, N, K), got shape {cs}")
        want = (cs[0], -(-cs[1] // FP8_BLOCK), -(-cs[2] // FP8_BLOCK))
        if sc != want:
            raise ValueError(f"moe.experts: fp8 {name}['scales'] must be (E, ceil(N/128), ceil(K/128)) = {want}, got "
                             f"{sc}")
        return cs, "fp8"
    if set(w) != set(INT4_KEYS):
        raise ValueError(f"moe.experts: int4 {name} must be a dict of {', '.join(INT4_KEYS)} (fp8: "
                         f"{', '.join(FP8_KEYS)}; GGML: {', '.join(GGML_KEYS)}), got keys {sorted(w)}")
    qw, qz, sc = (_shape(w[n]) for n in INT4_KEYS)
    if len(qw) != 3 or len(sc) != 3 or sc[0] != qw[0] or sc[2] != qw[2] or sc[1] < 1 or (qw[1] * 8) % sc[1]:
        raise ValueError(f"moe.experts: int4 {name} needs qweight (E, K/8, N) and scales (E, K/g, N), got {qw} and "
                         f"{sc}")
    e, k8, n = qw
    g = k8 * 8 // sc[1]
    if qz != (e, sc[1], n // 8) or n % 8 or g % 8:
        raise ValueError(f"moe.experts: int4 {name} qzeros must be (E={e}, K/g={sc[1]}, N/8={n // 8}) with N % 8 = 0 "
                         f"and the group a multiple of 8, got {qz}")
    return (e, n, k8 * 8), g


def check_experts_args(x, ids, weights, w13, w2, ws13=None, ws2=None) -> tuple[int, int, int, int, int, int, int]:
    """(T, D, E, F, k, S, Fs) of valid moe.experts arguments (shapes only: any array type; each weight dense
    or int4, `weight_shape`); ValueError (one line naming the argument and what was expected) otherwise. The
    ids' range is checked by each kernel."""
    if len(_shape(x)) != 2:
        raise ValueError(f"moe.experts: x must be (T, D), got shape {_shape(x)}")
    t, d = _shape(x)
    if len(_shape(ids)) != 2 or _shape(ids)[0] != t:
        raise ValueError(f"moe.experts: ids must be (T={t}, k), got shape {_shape(ids)}")
    k = _shape(ids)[1]
    if _shape(weights) != (t, k):
        raise ValueError(f"moe.experts: weights must be (T={t}, k={k}), got shape {_shape(weights)}")
    s13, g13 = weight_shape("w13", w13)
    if len(s13) != 3 or s13[2] != d or s13[1] % 2 or s13[1] == 0 or s13[0] == 0:
        raise ValueError(f"moe.experts: w13 must be (E, 2F, D={d}) with E, F >= 1, got shape {s13}")
    e, f = s13[0], s13[1] // 2
    s2, g2 = weight_shape("w2", w2)
    if s2 != (e, d, f):
        raise ValueError(f"moe.experts: w2 must be (E={e}, D={d}, F={f}), got shape {s2}")
    groups = {g13, g2}
    if (ws13 is None) != (ws2 is None):
        raise ValueError("moe.experts: ws13 and ws2 come together (or neither)")
    s, fs = 0, 0
    if ws13 is not None:
        ss, gs = weight_shape("ws13", ws13)
        if len(ss) != 3 or ss[2] != d or ss[1] % 2 or ss[1] == 0:
            raise ValueError(f"moe.experts: ws13 must be (S, 2Fs, D={d}) with Fs >= 1, got shape {ss}")
        s, fs = ss[0], ss[1] // 2
        s2s, gs2 = weight_shape("ws2", ws2)
        if s2s != (s, d, fs):
            raise ValueError(f"moe.experts: ws2 must be (S={s}, D={d}, Fs={fs}), got shape {s2s}")
        groups |= {gs, gs2}
    if len(groups) != 1:
        raise ValueError(f"moe.experts: the weights must share one format (dense, int4 of one group, fp8, or one GGML "
                         f"format), got "
                         f"{sorted(groups, key=str)}")
    return t, d, e, f, k, s, fs


def group_of(w) -> int | str | None:
    return weight_shape("w", w)[1]


def check_act_fp8(act_fp8, w13) -> bool:
    """act_fp8 (w8a8) is a bool and needs block-FP8 weights."""
    if not isinstance(act_fp8, bool):
        raise ValueError(f"moe.experts: act_fp8 must be a bool, got {act_fp8!r}")
    if act_fp8 and group_of(w13) != "fp8":
        raise ValueError("moe.experts: act_fp8 (w8a8) needs block-FP8 weights (dicts of codes, scales)")
    return act_fp8


def experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w13, w2, *, ws13=None, ws2=None,
            out: np.ndarray | None = None, act_fp8: bool = False) -> np.ndarray:
    """The routed experts' weighted sum (plus the shared experts) of each token of x (T, D); returns out (T, D).
    Each weight dense (x's dtype, C-contiguous), a GPTQ v1 int4 dict or a block-FP8 dict (`weight_shape`,
    C-contiguous parts); act_fp8: w8a8 (block FP8 weights only)."""
    t, d, e, f, k, s, fs = check_experts_args(x, ids, weights, w13, w2, ws13, ws2)
    a8 = check_act_fp8(act_fp8, w13)
    sets = {"w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if ws13 is not None else {})}
    want = {"qweight": np.int32, "qzeros": np.int32, "scales": np.float16}
    if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
        raise ValueError("moe.experts: x must be a C-contiguous numpy array")
    ptrs, f8ptrs, gptrs = [], [], []
    for name in ("w13", "w2", "ws13", "ws2"):
        w = sets.get(name)
        gptrs.append(None)
        if w is None:
            ptrs += [None] * 4
            f8ptrs += [None] * 2
        elif isinstance(w, dict) and set(w) == set(GGML_KEYS):
            b = w["blocks"]
            if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or not b.flags.c_contiguous:
                raise ValueError(f"moe.experts: {name}['blocks'] must be a C-contiguous uint8 numpy array, got "
                                 f"{getattr(b, 'dtype', type(b).__name__)}")
            ptrs += [None] * 4
            f8ptrs += [None] * 2
            gptrs[-1] = b.ctypes.data
        elif isinstance(w, dict) and set(w) == set(FP8_KEYS):
            c, sc = w["codes"], w["scales"]
            if not isinstance(c, np.ndarray) or c.dtype != ml_dtypes.float8_e4m3fn or not c.flags.c_contiguous:
                raise ValueError(f"moe.experts: {name}['codes'] must be a C-contiguous float8_e4m3fn numpy array, got "
                                 f"{getattr(c, 'dtype', type(c).__name__)}")
            if not isinstance(sc, np.ndarray) or sc.dtype != np.float32 or not sc.flags.c_contiguous:
                raise ValueError(f"moe.experts: {name}['scales'] must be a C-contiguous float32 numpy array, got "
                                 f"{getattr(sc, 'dtype', type(sc).__name__)}")
            ptrs += [None] * 4
            f8ptrs += [c.ctypes.data, sc.ctypes.data]
        elif isinstance(w, dict):
            f8ptrs += [None] * 2
            for part, dtype in want.items():
                a = w[part]
                if not isinstance(a, np.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
                    raise ValueError(f"moe.experts: {name}[{part!r}] must be a C-contiguous {np.dtype(dtype)} numpy "
                                     f"array, got {getattr(a, 'dtype', type(a).__name__)}")
            ptrs += [None] + [w[part].ctypes.data for part in INT4_KEYS]
        else:
            if not isinstance(w, np.ndarray) or w.dtype != x.dtype or not w.flags.c_contiguous:
                raise ValueError(f"moe.experts: {name} must be a C-contiguous numpy array of x's dtype {x.dtype}, got "
                                 f"{getattr(w, 'dtype', type(w).__name__)}")
            ptrs += [w.ctypes.data, None, None, None]
            f8ptrs += [None] * 2
    try:
        dt = dtype_code(x.dtype)
    except KeyError:
        raise ValueError(f"moe.experts: x dtype must be float32, float16 or bfloat16, got {x.dtype}") from None
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.flags.c_contiguous):
        raise ValueError("moe.experts: ids must be a C-contiguous int32 numpy array")
    if not (isinstance(weights, np.ndarray) and weights.dtype == np.float32 and weights.flags.c_contiguous):
        raise ValueError("moe.experts: weights must be a C-contiguous float32 numpy array")
    if ids.size and (ids.min() < 0 or ids.max() >= e):
        raise ValueError(f"moe.experts: ids must be in [0, E={e}), got [{ids.min()}, {ids.max()}]")
    res = np.empty((t, d), x.dtype) if out is None else out
    check_output("out", res, (t, d), x.dtype, "(T, D)")
    if not res.flags.c_contiguous:
        raise ValueError("moe.experts: out must be C-contiguous")
    arrays = [x, ids, weights] + [a for w in sets.values() for a in (w.values() if isinstance(w, dict) else (w,))]
    if any(np.may_share_memory(res, a) for a in arrays):
        raise ValueError("moe.experts: out must not overlap the inputs")
    if t == 0:
        return res
    g = group_of(w13)
    if g in GGML and (d % GGML[g][1] or f % GGML[g][1] or fs % GGML[g][1]):
        raise ValueError(f"moe.experts: {g} weights need D, F and Fs multiples of its block of {GGML[g][1]}, got "
                         f"D={d} F={f} Fs={fs}")
    gt = GGML[g][0] if g in GGML else 0
    status = _kernels().moe_experts_kernel(x.ctypes.data, ids.ctypes.data, weights.ctypes.data, *ptrs,
                                           g if isinstance(g, int) else 0, *f8ptrs, int(a8), *gptrs, gt, t, d, e, f,
                                           k, s, fs, dt, res.ctypes.data)
    check_status(status, "moe_experts_kernel")
    return res
