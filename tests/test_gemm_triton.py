"""Triton kernels of `gemm.gemm_nt` against the float64 goldens of refimpl/ (Triton interpreter on CPU).

kernels/triton/gemm.py and gemm_gemv.py (GGML Q8_0, Q4_0, Q4_K, Q6_K: the exact-fp32 GEMV kernel for
M = 1 and small M (fp32 A up to 16 rows), the tensor-core kernel for bf16 / fp16 decode and prefill),
gemm_fp8.py
(DeepSeek-V3 block-scaled FP8: activation quantizer bit-exact, GEMM vs the emulated golden) and
gemm_int4.py (GPTQ v1, AWQ), one case per dispatch path plus edges (N not a tile multiple,
split-K, bias, strided A and out), at shapes small enough for the interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton
torch = pytest.importorskip("torch")
_why = interpreter_ready()
if _why:
    pytest.skip(_why, allow_module_level=True)

from kernel_parity import refimpl  # noqa: E402
import kernel_parity.refimpl.gemm  # noqa: E402,F401
import kernel_parity.refimpl.quant  # noqa: E402,F401
import kernel_parity.refimpl.quant_fp  # noqa: E402,F401
from kernel_parity.kernels.triton import gemm, gemm_fp8, gemm_int4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Bound per element: |c - ref| <= out * |ref| + acc * sum_k |a_k w_k| (the golden's own operands).
TOL = {
    # fp32 arithmetic on exactly dequantized weights: K-term fp32 sums, ~eps32 sqrt(K) << 1e-5.
    "fp32": dict(out=0.0, acc=1e-5),
    # the decode path computes in fp32 and rounds once to the 16-bit output (half an ulp: 2^-9 / 2^-12).
    "decode_bf16": dict(out=2.0**-8, acc=1e-5),
    "decode_fp16": dict(out=2.0**-10, acc=1e-5),
    # prefill / int4: each weight rounded once to A's dtype (relative 2^-9 / 2^-12), then the output.
    "dot_bf16": dict(out=2.0**-8, acc=2.0**-8),
    "dot_fp16": dict(out=2.0**-10, acc=2.0**-11),
}


def assert_close(what: str, got: torch.Tensor, ref: np.ndarray, mag: np.ndarray, tol: str, request) -> None:
    """got within TOL[tol] of ref, elementwise; mag = |a| @ |W|^T of the golden's operands."""
    g = got.detach().double().cpu().numpy()
    t = TOL[tol]
    bound = t["out"] * np.abs(ref) + t["acc"] * mag
    bad = ~(np.abs(g - ref) <= bound)  # NaN counts as bad
    if bad.any():
        worst = np.argsort(-np.where(np.isnan(g), np.inf, np.abs(g - ref) - bound), axis=None)[:5]
        lines = [f"  C{list(np.unravel_index(i, g.shape))} = {g.flat[i]:.7g}, expected {ref.flat[i]:.7g}  "
                 f"|d|={abs(g.flat[i] - ref.flat[i]):.2e} bound={bound.flat[i]:.2e}" for i in worst if bad.flat[i]]
        pytest.fail(f"{what}: {int(bad.sum())}/{bad.size} elements outside tol ({tol}: out={t['out']:.2e} "
                    f"acc={t['acc']:.2e} x sum|a||w|)\n" + "\n".join(lines)
                    + f"\n  repro: pytest '{request.node.nodeid}'", pytrace=False)


def _a(rng, m: int, k: int, dtype: str) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(TORCH[dtype]).to(DEV)


FP16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}  # byte offsets of d (, dmin)


def _ggml_weight(rng, fmt: str, n: int, k: int, dist: str) -> np.ndarray:
    if dist == "random":  # every code pattern, finite random fp16 scales of both signs
        _, qk, nbytes, _, _ = gemm.FORMATS[fmt]
        data = rng.integers(0, 256, (n, k // qk, nbytes), dtype=np.uint8)
        for off in FP16_FIELDS[fmt]:
            d = rng.uniform(-1.0, 1.0, (n, k // qk)) * 2.0 ** rng.integers(-12, 0, (n, k // qk))
            data[..., off:off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        return data.reshape(n, -1)
    return refimpl.quant.quantize(fmt, (rng.standard_normal((n, k)) * 0.02).astype(np.float32))


# ------------------------------------------------------------------ GGML: decode (M <= 16) and prefill

GGML_CASES = [
    # (fmt, m, n, k, dtype, dist): M = 1 GEMV, 3 GEMV kernel with 3 rows of A, 17 prefill; N = 37 leaves a ragged tile
    *[(f, m, 37, 512, dt, "normal") for f in gemm.FORMATS for m in (1, 3, 17) for dt in ("fp32", "bf16")],
    *[(f, m, 16, 256 if f in ("q8_0", "q4_0") else 512, "fp32", "random") for f in gemm.FORMATS for m in (1, 17)],
    ("q4_k", 17, 16, 256, "fp16", "random"),
    ("q6_k", 2, 16, 256, "fp16", "normal"),
    ("q4_0", 1, 37, 256, "fp16", "normal"),
    # the GEMV's unmasked main loop then its masked tail: Q4_K 9 blocks (8 an iteration), Q8_0 / Q4_0
    # 20 blocks (8 pairs an iteration)
    ("q4_k", 1, 20, 2304, "bf16", "random"),
    ("q8_0", 1, 20, 640, "bf16", "random"),
    ("q4_0", 1, 20, 640, "fp32", "random"),
    # an odd block count: the pair formats read 16-bit halves and end on half a pair
    ("q8_0", 1, 20, 96, "fp32", "random"),
    ("q4_0", 5, 20, 96, "bf16", "normal"),
    # decode: the GEMV kernel with M = 16 of fp32 A in row tiles, M = 5 ends on a partial one; bf16 / fp16
    # A from M = 4: the tensor-core kernel (BLOCK_M = 16)
    ("q4_k", 16, 20, 512, "fp32", "random"),
    ("q8_0", 5, 20, 640, "fp32", "normal"),
    ("q4_0", 16, 20, 256, "fp16", "random"),
    ("q6_k", 4, 20, 512, "bf16", "normal"),
    ("q4_k", 2, 20, 512, "bf16", "normal"),
]


@pytest.mark.parametrize("fmt,m,n,k,dtype,dist", GGML_CASES)
def test_ggml_gemm_nt(fmt, m, n, k, dtype, dist, request):
    rng = np.random.default_rng(7)
    w = _ggml_weight(rng, fmt, n, k, dist)
    a = _a(rng, m, k, dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEV)
    c = gemm.gemm_nt(a, fmt, torch.from_numpy(w).to(DEV), bias=bias)
    a64, w64 = a.double().cpu().numpy(), refimpl.quant.dequantize(fmt, w)
    ref = refimpl.gemm.dequant_reference(a64, fmt, {"w": w}, bias.double().cpu().numpy())
    # exact fp32 GEMV kernel: fp32 A up to DECODE_MAX_M, bf16 / fp16 A below DECODE_DOT_MIN_M
    exact = m <= gemm.DECODE_MAX_M and (dtype == "fp32" or m < gemm.DECODE_DOT_MIN_M)
    path = "decode" if exact else "dot"
    tol = "fp32" if dtype == "fp32" else f"{path}_{dtype}"
    assert c.dtype == a.dtype
    assert_close(f"gemm_nt[{fmt}] {path}", c, ref, np.abs(a64) @ np.abs(w64).T, tol, request)


@pytest.mark.parametrize("fmt,m,splits", [("q4_k", 1, 2), ("q8_0", 1, 3), ("q6_k", 3, 2), ("q4_0", 5, 8)])
def test_ggml_split_k_strided(fmt, m, splits, request):
    """Split-K partials + the reduction kernel; A with a column stride of 2, out a column slice."""
    rng = np.random.default_rng(11)
    n, k = 37, 512 if fmt in ("q4_k", "q6_k") else 256
    w = _ggml_weight(rng, fmt, n, k, "normal")
    a = _a(rng, m, 2 * k, "fp32")[:, ::2]  # (m, k) with strides (2k, 2)
    out = torch.full((m, 2 * n), float("nan"), device=DEV)[:, ::2]
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEV).to(torch.bfloat16)
    c = gemm.gemm_nt(a, fmt, torch.from_numpy(w).to(DEV), bias=bias, out=out, split_k=splits)
    assert c is out
    a64, w64 = a.double().cpu().numpy(), refimpl.quant.dequantize(fmt, w)
    ref = refimpl.gemm.dequant_reference(a64, fmt, {"w": w}, bias.double().cpu().numpy())
    assert_close(f"gemm_nt[{fmt}] split_k={splits}", c, ref, np.abs(a64) @ np.abs(w64).T, "fp32", request)


# ------------------------------------------------------------------ GGML prefill: dequantize, then a dense GEMM

@pytest.mark.parametrize("fmt,m,n,k,dtype,dist", [
    ("q4_k", 300, 200, 512, "bf16", "normal"),  # the default path from DEQUANT_MIN_M rows: 2 x 2 tiles of (256, 128)
    ("q8_0", 260, 40, 288, "fp16", "random"),  # K = 288: a masked last K tile of 32 columns
    ("q8_0", 3, 37, 96, "bf16", "random"),  # forced at 3 rows; an odd block count
    ("q4_0", 20, 37, 256, "fp16", "normal"),
])
def test_ggml_dequant_path(fmt, m, n, k, dtype, dist, request):
    """path 'dequant' (the default for bf16 / fp16 A from gemm.DEQUANT_MIN_M rows): W dequantized once to A's
    dtype, then gemm_dense; against the float64 golden at the tensor-core kernel's tolerance (each weight
    rounded once to A's dtype), with a bias, into a column slice of a NaN-filled buffer."""
    rng = np.random.default_rng(17)
    w = _ggml_weight(rng, fmt, n, k, dist)
    a = _a(rng, m, k, dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEV)
    buf = torch.full((m, 2 * n), float("nan"), dtype=a.dtype, device=DEV)
    out = buf[:, ::2]
    forced = m < gemm.DEQUANT_MIN_M
    c = gemm.gemm_nt(a, fmt, torch.from_numpy(w).to(DEV), bias=bias, out=out, path="dequant" if forced else "auto")
    assert c is out and not torch.isnan(buf[:, 1::2].float()).logical_not().any()
    a64, w64 = a.double().cpu().numpy(), refimpl.quant.dequantize(fmt, w)
    ref = refimpl.gemm.dequant_reference(a64, fmt, {"w": w}, bias.double().cpu().numpy())
    assert_close(f"gemm_nt[{fmt}] dequant path", c, ref, np.abs(a64) @ np.abs(w64).T, f"dot_{dtype}", request)


def test_ggml_paths_by_rows(monkeypatch):
    """'auto' takes the dequant path for bf16 / fp16 A from DEQUANT_MIN_M rows and without a config, the fused
    kernels otherwise (fp32 A, fewer rows, a config); the two paths agree up to fp32 summation order."""
    calls = []
    dense = gemm.gemm_dense.gemm_nt_dense
    monkeypatch.setattr(gemm.gemm_dense, "gemm_nt_dense", lambda *args: calls.append(args[0].shape[0]) or dense(*args))
    rng = np.random.default_rng(19)
    w = torch.from_numpy(_ggml_weight(rng, "q4_k", 20, 256, "normal")).to(DEV)
    lo = gemm.DEQUANT_MIN_M
    a = _a(rng, lo, 256, "bf16")
    c_auto = gemm.gemm_nt(a, "q4_k", w)
    gemm.gemm_nt(a[:lo - 1], "q4_k", w)
    gemm.gemm_nt(a.float(), "q4_k", w)
    c_fused = gemm.gemm_nt(a, "q4_k", w, path="fused")
    gemm.gemm_nt(a, "q4_k", w, config=gemm.PREFILL_CONFIGS["q4_k"])
    assert calls == [lo]
    mag = (a.double().abs() @ torch.from_numpy(refimpl.quant.dequantize("q4_k", w.cpu().numpy())).abs().T.to(DEV))
    # fp32 sums of the same bf16 products in two orders, each rounded once to bf16: at most one bf16 ulp apart
    # (2^-7 relative at the bottom of a binade) plus the fp32 order term
    assert ((c_auto.double() - c_fused.double()).abs() <= 2.0**-7 * c_fused.double().abs() + 1e-5 * mag).all()


def test_ggml_dequant_path_rejects_bad_input():
    w = torch.zeros((4, 144), dtype=torch.uint8, device=DEV)
    a = torch.zeros((2, 256), device=DEV)
    with pytest.raises(ValueError, match="path 'dense' is not one of auto, fused, dequant"):
        gemm.gemm_nt(a, "q4_k", w, path="dense")
    with pytest.raises(ValueError, match="needs bf16 / fp16 a"):
        gemm.gemm_nt(a, "q4_k", w, path="dequant")
    with pytest.raises(ValueError, match="of one dtype"):
        gemm.gemm_dense.gemm_nt_dense(a.bfloat16(), torch.zeros((4, 256), dtype=torch.float16, device=DEV), None,
                                      torch.empty((2, 4), device=DEV))
    with pytest.raises(ValueError, match=r"out must be \(2, 4\)"):
        gemm.gemm_dense.gemm_nt_dense(a.bfloat16(), torch.zeros((4, 256), dtype=torch.bfloat16, device=DEV), None,
                                      torch.empty((4, 2), device=DEV))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_ggml_unaligned_rows(fmt, request):
    """w a view whose rows start 2 bytes past a 4-byte boundary (row stride = 2 mod 4): the pair
    formats read 16-bit halves."""
    rng = np.random.default_rng(13)
    n, k, m = 20, 256, 3
    w = _ggml_weight(rng, fmt, n, k, "random")
    buf = torch.zeros((n, w.shape[1] + 2), dtype=torch.uint8)
    buf[:, 2:] = torch.from_numpy(w)
    wv = buf.to(DEV)[:, 2:]
    a = _a(rng, m, k, "fp32")
    for mm in (1, m):
        c = gemm.gemm_nt(a[:mm], fmt, wv)
        a64, w64 = a[:mm].double().cpu().numpy(), refimpl.quant.dequantize(fmt, w)
        ref = refimpl.gemm.dequant_reference(a64, fmt, {"w": w})
        assert_close(f"gemm_nt[{fmt}] unaligned rows M={mm}", c, ref, np.abs(a64) @ np.abs(w64).T, "fp32", request)


def test_ggml_rejects_bad_input():
    a = torch.zeros((2, 256))
    w = torch.zeros((4, 144), dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        gemm.gemm_nt(torch.zeros((2, 128)), "q4_k", w)
    with pytest.raises(ValueError, match="not one of"):
        gemm.gemm_nt(a, "q5_k", w)
    with pytest.raises(ValueError, match=r"\(4, 144\)"):
        gemm.gemm_nt(a, "q4_k", torch.zeros((4, 140), dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        gemm.gemm_nt(a, "q4_k", w.float())
    with pytest.raises(ValueError, match="out must be"):
        gemm.gemm_nt(a, "q4_k", w, out=torch.zeros((2, 4), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="4-byte aligned"):  # Q4_K reads its blocks as 32-bit words
        gemm.gemm_nt(a, "q4_k", torch.zeros((4, 146), dtype=torch.uint8)[:, 2:])


# ------------------------------------------------------------------ FP8 block-scaled (DeepSeek-V3)

FP8_CASES = [
    # (m, n, k, gm, gn, gk, dtype)
    (3, 40, 256, 1, 128, 128, "bf16"),    # DeepSeek 1 x 128 x 128, decode-sized M
    (17, 37, 384, 1, 128, 128, "fp32"),   # three K groups promoted one by one; ragged N tile
    (17, 16, 320, 1, 128, 128, "fp32"),   # K not a multiple of gk: the last group is 64 wide
    (5, 40, 256, 1, 1, 256, "bf16"),      # per-token x per-channel: one K group, scales at the end
    (5, 40, 256, 5, 40, 256, "fp32"),     # per-tensor
    (17, 40, 256, 4, 16, 64, "fp32"),     # 4 x 64 activation groups (the two-pass quantizer)
]


@pytest.mark.parametrize("m,n,k,gm,gn,gk,dtype", FP8_CASES)
def test_gemm_fp8(m, n, k, gm, gn, gk, dtype, request):
    rng = np.random.default_rng(5)
    a = _a(rng, m, k, dtype)
    a[0, :gk] = 0  # an all-zero group: amax takes the 1e-4 floor
    qw, sw = refimpl.quant_fp.fp8_quantize_blocks(rng.standard_normal((n, k)) * 0.02, gn, gk)
    w = torch.from_numpy(np.ascontiguousarray(qw).view(np.uint8)).view(torch.float8_e4m3fn).to(DEV)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEV)

    qa, sa = gemm_fp8.act_quant_fp8(a, gm, gk)
    qa_ref, sa_ref = refimpl.quant_fp.fp8_quantize_blocks(a.float().cpu().numpy(), gm, gk)
    assert np.array_equal(qa.view(torch.uint8).cpu().numpy(), np.asarray(qa_ref).view(np.uint8)), \
        f"act_quant_fp8 codes differ from refimpl.quant_fp.fp8_quantize_blocks; repro: pytest '{request.node.nodeid}'"
    assert np.array_equal(sa.cpu().numpy(), sa_ref), \
        f"act_quant_fp8 scales differ from refimpl.quant_fp.fp8_quantize_blocks; repro: pytest '{request.node.nodeid}'"

    c = gemm_fp8.gemm_fp8(a, w, torch.from_numpy(sw).to(DEV), bias=bias, gm=gm, gn=gn, gk=gk)
    assert c.dtype == a.dtype
    weights = {"w": qw, "w_scale": sw}
    a64 = a.double().cpu().numpy()
    ref = refimpl.gemm.emulated_reference(a64, "fp8", weights, bias.double().cpu().numpy(), gm=gm, gn=gn, gk=gk)
    deq_a = refimpl.quant_fp.fp8_dequantize_blocks(qa_ref, sa_ref, gm, gk)
    deq_w = refimpl.quant_fp.fp8_dequantize_blocks(qw, sw, gn, gk)
    tol = "fp32" if dtype == "fp32" else "decode_bf16"  # fp32 accumulation, one rounding to A's dtype
    assert_close(f"gemm_fp8 {gm}x{gn}x{gk} vs emulated", c, ref, np.abs(deq_a) @ np.abs(deq_w).T, tol, request)


def test_gemm_fp8_rejects_bad_input():
    a = torch.zeros((2, 256), dtype=torch.bfloat16)
    w = torch.zeros((4, 256), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="w_scale"):
        gemm_fp8.gemm_fp8(a, w, torch.ones((1, 1)))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm_fp8.gemm_fp8(a, w.float(), torch.ones((1, 2)))
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm_fp8.gemm_fp8(a, w, torch.ones((1, 32)), gk=8)


# ------------------------------------------------------------------ int4 (GPTQ v1, AWQ)

INT4_CASES = [
    # (order, m, n, k, group, dtype, dist)
    *[(o, m, 40, 256, 128, dt, "normal") for o in ("gptq", "awq") for m in (1, 17) for dt in ("fp32", "bf16")],
    *[(o, 3, 16, 512, 64, "fp32", "random") for o in ("gptq", "awq")],  # every code, GPTQ zero 16
    ("awq", 17, 16, 256, 128, "fp16", "normal"),
    # the dequant path (bf16 / fp16 A from gemm_int4.DEQUANT_MIN_M rows): partial (256, 128) tiles both ways;
    # group 32 (the dequantizer's BLOCK_K lowered to it), every code
    ("gptq", 520, 136, 256, 128, "bf16", "normal"), ("awq", 530, 40, 256, 32, "fp16", "random"),
]


@pytest.mark.parametrize("order,m,n,k,group,dtype,dist", INT4_CASES)
def test_gemm_int4(order, m, n, k, group, dtype, dist, request):
    rng = np.random.default_rng(3)
    packed = refimpl.quant_fp.int4_quantize(rng.standard_normal((n, k)) * 0.02, group, order)
    if dist == "random":
        packed = {name: (rng.integers(0, 2**32, v.shape, dtype=np.uint64).astype(np.uint32).view(np.int32)
                         if v.dtype == np.int32 else v) for name, v in packed.items()}
    a = _a(rng, m, k, dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEV)
    t = {name: torch.from_numpy(np.ascontiguousarray(v)).to(DEV) for name, v in packed.items()}
    c = gemm_int4.gemm_int4(a, t["qweight"], t["qzeros"], t["scales"], group=group, order=order, bias=bias)
    assert c.dtype == a.dtype
    a64 = a.double().cpu().numpy()
    ref = refimpl.gemm.dequant_reference(a64, "int4", packed, bias.double().cpu().numpy(), order=order, group=group)
    w64 = refimpl.quant_fp.int4_dequantize(packed, order)
    tol = "fp32" if dtype == "fp32" else f"dot_{dtype}"
    assert_close(f"gemm_int4[{order}] g={group}", c, ref, np.abs(a64) @ np.abs(w64).T, tol, request)


def test_gemm_int4_rejects_bad_input():
    a = torch.zeros((2, 256))
    qw, qz, s = (torch.zeros(shape, dtype=dt) for shape, dt in
                 (((32, 16), torch.int32), ((2, 2), torch.int32), ((2, 16), torch.float16)))
    with pytest.raises(ValueError, match="order"):
        gemm_int4.gemm_int4(a, qw, qz, s, order="exl2")
    with pytest.raises(ValueError, match="group"):
        gemm_int4.gemm_int4(a, qw, qz, s, group=100)
    with pytest.raises(ValueError, match="qzeros"):
        gemm_int4.gemm_int4(a, qw, qz[:1], s)
    with pytest.raises(ValueError, match="path 'dense' is not one of auto, fused, dequant"):
        gemm_int4.gemm_int4(a, qw, qz, s, path="dense")
    with pytest.raises(ValueError, match="needs bf16 / fp16 a"):
        gemm_int4.gemm_int4(a, qw, qz, s, path="dequant")


@pytest.mark.parametrize("order", ["gptq", "awq"])
def test_gemm_int4_paths_agree(order):
    """The fused kernel and the dequant path on one input (M = 20, forced both ways): the same bf16 weights
    and fp32 sums in two orders, each rounded once to bf16 (at most one ulp apart, plus the order term)."""
    rng = np.random.default_rng(23)
    packed = refimpl.quant_fp.int4_quantize(rng.standard_normal((48, 256)) * 0.02, 64, order)
    t = {name: torch.from_numpy(np.ascontiguousarray(v)).to(DEV) for name, v in packed.items()}
    a = _a(rng, 20, 256, "bf16")
    got = [gemm_int4.gemm_int4(a, t["qweight"], t["qzeros"], t["scales"], group=64, order=order, path=p).double()
           for p in ("fused", "dequant")]
    mag = a.double().abs() @ torch.from_numpy(refimpl.quant_fp.int4_dequantize(packed, order)).abs().T.to(DEV)
    assert ((got[0] - got[1]).abs() <= 2.0**-7 * got[0].abs() + 1e-5 * mag).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_dequantize_to_16_bit_rounds_the_fp32_values_once(fmt):
    """quant.dequantize into a bf16 / fp16 out: each value the fp32 dequantization rounded once to that
    dtype (round to nearest even, torch's .to), bit for bit; a float64 or int out is refused."""
    from kernel_parity.kernels.triton import quant as tq
    w_np = _ggml_weight(np.random.default_rng(3), fmt, 5, 512, "random")
    w = torch.from_numpy(w_np).to(DEV)
    want32 = tq.dequantize(fmt, w)
    golden = refimpl.quant.dequantize(fmt, w_np.reshape(5 * 512 // gemm.FORMATS[fmt][1], -1)).reshape(5, 512)
    assert torch.equal(want32.cpu(), torch.from_numpy(golden.astype(np.float32)))
    for dt in (torch.bfloat16, torch.float16):
        got = tq.dequantize(fmt, w, out=torch.empty((5, 512), dtype=dt, device=DEV))
        assert got.dtype == dt and torch.equal(got, want32.to(dt))
    with pytest.raises(ValueError, match="out must be"):
        tq.dequantize(fmt, w, out=torch.empty((5, 512), dtype=torch.float64, device=DEV))


@pytest.mark.parametrize("rows,groups", [(8, 4), (4, 8), (2, 16)])
def test_act_quant_more_groups_a_program_gives_the_same_bits(rows, groups, monkeypatch):
    """QUANT_ROWS x QUANT_GROUPS (work in progress: more bytes a quantizer program): the same codes and scales
    as the refimpl quantizer, K not a multiple of the groups a program takes, an all-zero group."""
    rng = np.random.default_rng(11)
    monkeypatch.setattr(gemm_fp8, "QUANT_ROWS", rows)
    monkeypatch.setattr(gemm_fp8, "QUANT_GROUPS", groups)
    for m, k, gk in ((5, 1000, 128), (9, 640, 128), (3, 256, 64)):
        a = _a(rng, m, k, "bf16")
        a[1, :gk] = 0
        qa, sa = gemm_fp8.act_quant_fp8(a, 1, gk)
        qa_ref, sa_ref = refimpl.quant_fp.fp8_quantize_blocks(a.float().cpu().numpy(), 1, gk)
        assert np.array_equal(qa.view(torch.uint8).cpu().numpy(), np.asarray(qa_ref).view(np.uint8)), (m, k, gk)
        assert np.array_equal(sa.cpu().numpy(), sa_ref), (m, k, gk)
