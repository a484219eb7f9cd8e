"""Self-tests of refimpl/gemm.py (L1 dequant and L2 emulated references) and of the torch
baselines kernels/torch/quant.py (GGML dequantizers) and kernels/torch/gemm.py against them."""

import numpy as np
import pytest

from kernel_parity.refimpl import gemm, quant
from kernel_parity.refimpl import quant_fp as qf

GGML_W = gemm.GGML_W
# L2 and its closed form (dequantized activations times dequantized weights) differ only by the
# order of float64 roundings: a few ulps of sum |a| |w|.
F64_REL = 1e-13
# Per-element activation error bound, in units of the block's |d_a| (research/quant-formats.md
# §1.4): Q8_0/Q8_1 round x / d with the unrounded float32 d, then store fp16(d): 1/2 plus 127 codes
# times half an fp16 ulp (2^-11 relative); Q8_K stores its float32 d = 1/iscale: 1/2 plus 127 x 2^-24.
ACT_STEP = {"q8_0": 0.5 + 127 * 2.0**-11, "q8_1": 0.5 + 127 * 2.0**-11, "q8_k": 0.5 + 127 * 2.0**-23}
# torch baselines vs L1, relative to sum |a| |w|: float32 accumulation over K <= 512 (~K eps32);
# bf16: one rounding of each weight and of each activation (2^-8 each) plus the output rounding.
TORCH_REL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


def _weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> dict:
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    if fmt == "f32":
        return {"w": w}
    if fmt in GGML_W:
        return {"w": quant.quantize(fmt, w)}
    if fmt == "fp8":
        q, s = qf.fp8_quantize_blocks(w, 128, 128)
        return {"w": q, "w_scale": s}
    return qf.int4_quantize(w, 128, fmt.split("_")[1])


def _kw(fmt: str) -> dict:
    return {"order": fmt.split("_")[1], "group": 128} if fmt.startswith("int4") else {}


def _wfmt(fmt: str) -> str:
    return "int4" if fmt.startswith("int4") else fmt


def _scale(a, fmt, weights, k, **kw) -> np.ndarray:
    """sum_k |a| |w|: the scale of each C element's error."""
    return np.abs(a) @ np.abs(gemm.dequantize_weight(_wfmt(fmt), weights, k, **kw)).T


def _representable(act: str, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Activations the production quantizer keeps exactly: per block c * 2^e, c integer in
    [-127, 127] with one element at +-127 (so d = 2^e), and |sum c| < 2^11 (so Q8_1's fp16 s is
    exact too)."""
    block = quant.FORMATS[act].block
    c = rng.integers(-7, 8, (m, k // block, block)).astype(np.float64)
    c[..., 0] = rng.choice([-127.0, 127.0], c.shape[:2])
    e = rng.integers(-8, 3, (m, k // block, 1))
    return (c * 2.0**e).reshape(m, k)


@pytest.mark.parametrize("fmt", GGML_W)
def test_l2_equals_l1_on_representable_activations(fmt):
    rng = np.random.default_rng(11)
    k = 512
    a = _representable(quant.FORMATS[fmt].vec_dot, 3, k, rng)
    weights = _weights(fmt, 8, k, rng)
    l1, l2 = gemm.dequant_reference(a, fmt, weights), gemm.emulated_reference(a, fmt, weights)
    assert np.abs(l1 - l2).max() <= F64_REL * _scale(a, fmt, weights, k).max()


def test_l2_equals_l1_on_representable_fp8_activations():
    rng = np.random.default_rng(12)
    m, k = 4, 384
    # e4m3 values times 2^e per 1 x 128 group, one of them 448 * 2^e: s = 2^e, x / s exact
    a = rng.standard_normal((m, k)).astype(qf.FP8["e4m3"]).astype(np.float64).reshape(m, 3, 128)
    a[..., 0] = 448.0
    a = (a * 2.0 ** rng.integers(-6, 6, (m, 3, 1))).reshape(m, k)
    weights = _weights("fp8", 130, k, rng)
    l1, l2 = gemm.dequant_reference(a, "fp8", weights), gemm.emulated_reference(a, "fp8", weights)
    assert np.abs(l1 - l2).max() <= F64_REL * _scale(a, "fp8", weights, k).max()


@pytest.mark.parametrize("fmt", GGML_W)
def test_l1_minus_l2_is_the_activation_quantization(fmt):
    """|L1 - L2| <= sum_i |w_i| |d_a| ACT_STEP (+ Q8_1's fp16 rounding of s times |m_w|), and > 0."""
    rng = np.random.default_rng(13)
    m, n, k = 4, 8, 512
    a = rng.standard_normal((m, k))
    weights = _weights(fmt, n, k, rng)
    act = quant.FORMATS[fmt].vec_dot
    fa = quant.block_fields(act, quant.quantize(act, a.astype(np.float32)))
    step = np.repeat(np.abs(fa.d) * ACT_STEP[act], quant.FORMATS[act].block, axis=1)  # M, K
    bound = step @ np.abs(quant.dequantize(fmt, weights["w"])).T
    if act == "q8_1":
        fw = quant.block_fields(fmt, weights["w"])
        bound += np.abs(fa.s - fa.d * fa.codes.sum(-1)) @ np.abs(fw.m).T
    err = np.abs(gemm.dequant_reference(a, fmt, weights) - gemm.emulated_reference(a, fmt, weights))
    assert (err <= bound * (1 + F64_REL)).all()
    assert err.max() > 0  # the activations were quantized


@pytest.mark.parametrize("fmt", GGML_W)
def test_l2_is_dequantized_activations_times_weights(fmt):
    """The block formula equals a_q @ w^T in exact arithmetic (q4_1/q5_1: plus m_w (s_a - d_a sum c_a))."""
    rng = np.random.default_rng(14)
    a = rng.standard_normal((3, 512)) * 3
    weights = _weights(fmt, 8, 512, rng)
    act = quant.FORMATS[fmt].vec_dot
    qa = quant.quantize(act, a.astype(np.float32))
    want = quant.dequantize(act, qa) @ quant.dequantize(fmt, weights["w"]).T
    if act == "q8_1":
        fa, fw = quant.block_fields(act, qa), quant.block_fields(fmt, weights["w"])
        want += (fa.s - fa.d * fa.codes.sum(-1)) @ fw.m.T
    got = gemm.emulated_reference(a, fmt, weights)
    assert np.abs(got - want).max() <= F64_REL * _scale(a, fmt, weights, 512).max()


@pytest.mark.parametrize("act_quantizer", ["ref", "x86"])
@pytest.mark.parametrize("fmt", GGML_W)
def test_l2_is_the_blockwise_integer_formula(fmt, act_quantizer):
    """L2 (one float64 matmul over K of the stored fields' products) is the module docstring's blockwise
    formula written out: int64 block dots J_b = sum_j sc_j sum_i c_w c_a, (d_w d_a) J_b summed over the
    blocks, the mins' dmin d_a sum_j m_j bsum_j and Q8_1's m_w s_a, within float64 rounding; and the
    blockwise sums of neighbouring blocks are not interchangeable (a block's scale moves C)."""
    rng = np.random.default_rng(15)
    m, n, k = 5, 6, 768
    a = rng.standard_normal((m, k)) * np.repeat(10.0 ** rng.uniform(-2, 2, (m, k // 32)), 32, axis=1)
    weights = _weights(fmt, n, k, rng)
    act = quant.FORMATS[fmt].vec_dot
    quantizer = {"ref": quant.quantize, "x86": quant.quantize_x86}[act_quantizer]
    fa = quant.block_fields(act, quantizer(act, a.astype(np.float32)))
    fw = quant.block_fields(fmt, weights["w"])
    cw = fw.codes.astype(np.int64)
    if fw.scales is not None:
        cw = cw * np.repeat(fw.scales.astype(np.int64), cw.shape[-1] // fw.scales.shape[-1], axis=-1)
    want = np.zeros((m, n))
    for b in range(fa.codes.shape[1]):
        j = fa.codes[:, b].astype(np.int64) @ cw[:, b].T  # exact
        term = (fw.d[None, :, b] * fa.d[:, None, b]) * j
        if fw.m is not None:
            term = term + fw.m[None, :, b] * fa.s[:, None, b]
        if fw.mins is not None:
            nsub = fw.mins.shape[-1]
            bs = fa.bsums[:, b].reshape(m, nsub, 16 // nsub).sum(-1).astype(np.int64)
            term = term - (fw.dmin[None, :, b] * fa.d[:, None, b]) * (bs @ fw.mins[:, b].astype(np.int64).T)
        want += term
    got = gemm.emulated_reference(a, fmt, weights, act_quantizer=act_quantizer)
    scale = _scale(a, fmt, weights, k).max()
    assert np.abs(got - want).max() <= F64_REL * scale
    swapped = dict(weights, w=weights["w"].copy())
    nbytes = quant.FORMATS[fmt].nbytes
    first, second = slice(0, nbytes), slice(nbytes, 2 * nbytes)  # blocks 0 and 1 of every row, swapped
    swapped["w"][:, first], swapped["w"][:, second] = weights["w"][:, second], weights["w"][:, first]
    assert np.abs(gemm.emulated_reference(a, fmt, swapped, act_quantizer=act_quantizer) - got).max() > 1e-6 * scale


@pytest.mark.parametrize("g", [(1, 128, 128), (1, 1, 300), (5, 130, 300), (2, 64, 100)])
def test_fp8_l2_block_formula(g):
    """L2 = dequant(act_quant(a)) @ dequant(W)^T, and |L1 - L2| within half an e4m3 step of a."""
    gm, gn, gk = g
    rng = np.random.default_rng(15)
    a = rng.standard_normal((5, 300))
    q, s = qf.fp8_quantize_blocks((rng.standard_normal((130, 300)) * 0.02), gn, gk)
    weights, kw = {"w": q, "w_scale": s}, dict(gm=gm, gn=gn, gk=gk)
    l1, l2 = gemm.dequant_reference(a, "fp8", weights, **kw), gemm.emulated_reference(a, "fp8", weights, **kw)
    qa, sa = qf.fp8_quantize_blocks(a, gm, gk)
    ad = qf.fp8_dequantize_blocks(qa, sa, gm, gk)
    scale = _scale(a, "fp8", weights, 300, gn=gn, gk=gk)
    assert np.abs(l2 - ad @ qf.fp8_dequantize_blocks(q, s, gn, gk).T).max() <= F64_REL * scale.max()
    sa_full = np.repeat(np.repeat(sa, gm, 0), gk, 1)[:5, :300]
    step = np.maximum(np.abs(a) * 2.0**-4, sa_full * 2.0**-10) * (1 + 1e-6)  # e4m3 half-step, float32 x / s
    assert (np.abs(l1 - l2) <= step @ np.abs(qf.fp8_dequantize_blocks(q, s, gn, gk)).T).all()
    assert np.abs(l1 - l2).max() > 0


@pytest.mark.parametrize("fmt", ["f32", "int4_gptq", "int4_awq"])
def test_l2_is_l1_without_activation_quantization(fmt):
    rng = np.random.default_rng(16)
    a, bias = rng.standard_normal((3, 256)), rng.standard_normal(16)
    weights = _weights(fmt, 16, 256, rng)
    l1 = gemm.dequant_reference(a, _wfmt(fmt), weights, bias, **_kw(fmt))
    assert np.array_equal(l1, gemm.emulated_reference(a, _wfmt(fmt), weights, bias, **_kw(fmt)))
    w = gemm.dequantize_weight(_wfmt(fmt), weights, 256, **_kw(fmt))
    assert np.array_equal(l1, gemm.gemm_nt(a, w, bias))


def test_gemm_nt_by_hand():
    a = np.array([[1.0, 2.0], [3.0, -1.0]])
    w = np.array([[1.0, 0.0], [0.5, 2.0], [-1.0, 1.0]])
    assert gemm.gemm_nt(a, w, np.array([0.0, 1.0, 10.0])).tolist() == [[1.0, 5.5, 11.0], [3.0, 0.5, 6.0]]


@pytest.mark.parametrize("fmt,k,match", [("q4_k", 384, "multiple of 256"), ("q4_0", 48, "multiple of 32"),
                                         ("q9_9", 64, "unknown weight format 'q9_9'"),
                                         ("q8_k", 256, "activation format")])
def test_bad_shapes_name_the_format_and_rule(fmt, k, match):
    w = {"w": np.zeros((4, 1000), np.uint8)}
    for ref in (gemm.dequant_reference, gemm.emulated_reference):
        with pytest.raises(ValueError, match=match):
            ref(np.zeros((2, k)), fmt, w)


# -- torch baselines ----------------------------------------------------------------------------

torch = pytest.importorskip("torch")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(quant.FORMATS))
def test_torch_dequantize_bit_exact(fmt, device):
    """Uniform random bytes (NaN/inf/subnormal scales included) and quantized rows: torch's float32
    equals the golden rounded once to float32, NaN where the golden is NaN; bf16/fp16 round that."""
    from kernel_parity.kernels.torch import quant as tq

    rng = np.random.default_rng(17)
    f = quant.FORMATS[fmt]
    data = np.concatenate([rng.integers(0, 256, (64, 2 * f.nbytes), dtype=np.uint8),
                           quant.quantize(fmt, rng.standard_normal((2, 2 * f.block)).astype(np.float32))])
    with np.errstate(all="ignore"):
        golden = quant.dequantize(fmt, data).astype(np.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = tq.dequantize(fmt, torch.from_numpy(data).to(device), dtype).cpu()
        want = torch.from_numpy(golden).to(dtype)
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        assert got.dtype == dtype and bool(same.all()), f"{fmt} {dtype}: {int((~same).sum())} elements differ"


@pytest.mark.parametrize("fmt", ["f32", "q4_0", "q4_1", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
                                 "q6_k", "iq4_nl", "fp8", "int4_gptq", "int4_awq"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_gemm_vs_l1(fmt, dtype, device):
    from kernel_parity.conformance.backends._torch import to_torch
    from kernel_parity.kernels.torch import gemm as tg

    rng = np.random.default_rng(18)
    a = rng.standard_normal((3, 512)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    weights = _weights(fmt, 16, 512, rng)
    l1 = gemm.dequant_reference(a, _wfmt(fmt), weights, bias, **_kw(fmt))
    ta = torch.from_numpy(a).to(device, getattr(torch, dtype))
    tw = {name: to_torch(v, device) for name, v in weights.items()}
    c = tg.gemm_nt(ta, _wfmt(fmt), tw, torch.from_numpy(bias).to(device), **_kw(fmt))
    assert c.dtype == ta.dtype and c.shape == (3, 16) and c.device == ta.device
    c = c.cpu()
    scale = _scale(a, fmt, weights, 512, **_kw(fmt)) + np.abs(bias)
    assert (np.abs(c.double().numpy() - l1) <= TORCH_REL[dtype] * scale).all()


def test_torch_gemm_bad_shapes():
    from kernel_parity.kernels.torch import gemm as tg

    with pytest.raises(ValueError, match="multiple of the block of 256"):
        tg.gemm_nt(torch.zeros(2, 384), "q4_k", {"w": torch.zeros(4, 216, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="unknown weight format"):
        tg.gemm_nt(torch.zeros(2, 64), "q9_9", {"w": torch.zeros(4, 8, dtype=torch.uint8)})
