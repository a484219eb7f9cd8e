"""kernels/triton/gemm_q8.py (the `triton-q8` backend) against refimpl/ (Triton interpreter on CPU).

The Q8_K and Q8_0 quantizers byte for byte against ggml's reference quantizers (codes, d, and for Q8_K
the sums of each 32 codes from its stored bsums), including ties and a block whose largest magnitude
occurs twice with both signs; the Q4_K x Q8_K and Q8_0 x Q8_0 products against the `emulated` golden
(float64 of the same integer dots); the tail of blocks (an odd Q8_0 block count: 16-bit halves, a pair
without its second block), rows past the tile, bias, and the argument errors. The GPU's inline PTX (dp4a,
div.rn, cvt.rni) is not run here: the interpreter takes the plain-Triton branch of the same arithmetic.
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
from kernel_parity.kernels.triton import gemm_q8  # noqa: E402

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _q8_k_fields(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's Q8_K of each row of a: codes (M, K) int8, d (M, nb) float32, sums of 32 codes (M, K/32)."""
    m = a.shape[0]
    b = refimpl.quant.quantize("q8_k", a.reshape(-1, 256)).reshape(m, -1, 292)
    codes = b[:, :, 4:260].copy().view(np.int8).reshape(m, -1)
    d = b[:, :, 0:4].copy().view(np.float32).reshape(m, -1)
    bsums = b[:, :, 260:292].copy().view(np.int16).reshape(m, -1, 2).astype(np.int32).sum(-1)
    return codes, d, bsums


def _activations(rng, m: int, k: int) -> np.ndarray:
    a = rng.standard_normal((m, k)).astype(np.float32)
    blk = 256 if k % 256 == 0 else 32  # each block of A on its own scale, decades apart
    a *= np.exp(rng.uniform(-4, 4, (m, k // blk, 1))).astype(np.float32).repeat(blk, axis=2).reshape(m, k)
    return a


def test_quantizer_is_ggml_byte_for_byte():
    rng = np.random.default_rng(1)
    a = _activations(rng, 3, 1024)
    a[0, :256] = 0.0  # an all-zero block: d = 0, codes 0
    a[1, 256:512] = np.round(rng.standard_normal(256) * 8) / 2  # halves: ties of -127/max * x
    a[1, 256 + 7], a[1, 256 + 3] = 9.0, -9.0  # largest magnitude twice: the first (-9) sets d's sign
    a[2, 512:768] = rng.integers(-127, 128, 256).astype(np.float32)  # exact codes when max = +-127
    q, d, s = gemm_q8.quantize_q8_k(torch.from_numpy(a))
    rq, rd, rs = _q8_k_fields(a)
    assert np.array_equal(q.numpy(), rq)
    assert np.array_equal(d.numpy().view(np.uint32), rd.view(np.uint32))  # bits: d's sign, and 0 for zeros
    assert np.array_equal(s.numpy(), rs)


def test_q8_0_quantizer_is_ggml_byte_for_byte():
    rng = np.random.default_rng(2)
    a = _activations(rng, 2, 512)
    a[0, :32] = 0.0  # d = 0
    a[0, 32:64] = np.arange(-16, 16) * np.float32(127 / 15.5) / 4  # many codes at exact halves: roundf's ties
    a[1, 64:96] = np.float32(-3.0)  # every element the largest magnitude, negative
    q, d = gemm_q8.quantize_q8_0(torch.from_numpy(a))
    ref = refimpl.quant.quantize("q8_0", a.reshape(-1, 32)).reshape(2, -1, 34)
    assert np.array_equal(q.numpy().view(np.uint8).reshape(2, -1, 32), ref[:, :, 2:])
    assert np.array_equal(d.numpy().astype(np.float16).view(np.uint8).reshape(2, -1, 2), ref[:, :, :2])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("wfmt, m, n, k, bias", [
    ("q4_k", 1, 19, 2304, False), ("q4_k", 3, 9, 512, True), ("q4_k", 1, 1, 256, True),
    ("q8_0", 1, 19, 288, False), ("q8_0", 3, 9, 512, True), ("q8_0", 2, 1, 32, True)])
def test_gemv_matches_emulated_golden(dtype, wfmt, m, n, k, bias):
    rng = np.random.default_rng(m * 1000 + n)
    a32 = _activations(rng, m, k)
    a = torch.from_numpy(a32).to(TORCH[dtype])
    a_in = a.float().numpy()  # the activations as the kernel sees them
    wf = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-3, 3, (n, 1)))).astype(np.float32)
    qk = 256 if wfmt == "q4_k" else 32
    w = refimpl.quant.quantize(wfmt, wf.reshape(-1, qk)).reshape(n, -1)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    got = gemm_q8.gemm_nt_q8(a, wfmt, torch.from_numpy(w), None if b is None else torch.from_numpy(b))
    assert got.dtype == a.dtype and tuple(got.shape) == (m, n)
    ref = refimpl.gemm.emulated_reference(a_in, wfmt, {"w": w}, b)
    deq = refimpl.gemm.dequant_reference(a_in, wfmt, {"w": w}, b)
    g = got.double().numpy()
    # fp32 scale products and sums over nb * 4 chunk partials, then one rounding to the output dtype
    out_rel = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-10}[dtype]
    mag = np.abs(a_in).astype(np.float64) @ np.abs(refimpl.quant.dequantize(wfmt, w.reshape(n * k // qk, -1)).reshape(n, k)).T
    assert np.all(np.abs(g - ref) <= out_rel * np.abs(ref) + 1e-5 * mag + (np.abs(b) * 1e-7 if bias else 0))
    # and it is not the dequantized product: the activation quantization shows (the kernel claims L2)
    assert np.abs(ref - deq).max() > 10 * np.abs(g - ref).max() or dtype != "fp32"


def test_rows_past_the_tile_and_out():
    rng = np.random.default_rng(7)
    a = torch.from_numpy(_activations(rng, 5, 512))
    w = torch.from_numpy(refimpl.quant.quantize("q4_k", rng.standard_normal((11 * 2, 256)).astype(np.float32))
                         .reshape(11, -1))
    out = torch.full((5, 11), float("nan"))
    # M and N not tile multiples, NB = 1 (the dp4a GEMV by name: the launcher takes the tensor cores at M = 5)
    got = gemm_q8.gemm_nt_q8(a, "q4_k", w, out=out, config=(2, 8, 1, 4, 1), kernel="gemv")
    assert got is out
    ref = refimpl.gemm.emulated_reference(a.numpy(), "q4_k", {"w": w.numpy()})
    assert np.allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fmt, m, n, k", [("q4_k", 1, 5, 2304), ("q8_0", 1, 5, 4096), ("q4_k", 3, 5, 512),
                                         ("q8_0", 9, 3, 512)])
def test_the_launchers_defaults_run_their_main_loop(fmt, m, n, k):
    """Every config gemm_q8.default_config picks (by M and N; the N >= 8192 Q4_K tile asked for by name, at
    a small N) through its unmasked main loop and its tail, against the emulated golden."""
    rng = np.random.default_rng(k + m)
    a = torch.from_numpy(_activations(rng, m, k))
    qk = 256 if fmt == "q4_k" else 32
    w = refimpl.quant.quantize(fmt, rng.standard_normal((n * k // qk, qk)).astype(np.float32)).reshape(n, -1)
    ref = refimpl.gemm.emulated_reference(a.numpy(), fmt, {"w": w})
    configs = {gemm_q8.default_config(fmt, m, n)} | ({gemm_q8.default_config(fmt, m, 1 << 14)} if m == 1 else set())
    for cfg in configs:  # the dp4a GEMV's tiles (the launcher's kernel at M = 1, forced by name above it)
        nb = k // qk if fmt == "q4_k" else k // 64
        assert m > 1 or nb >= 2 * cfg[2], (cfg, "the case must reach the unmasked loop")
        got = gemm_q8.gemm_nt_q8(a, fmt, torch.from_numpy(w), config=cfg, kernel="gemv")
        assert np.allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()), cfg
    if m > 1:  # the launcher's own choice there: the tensor-core kernel at its default tile
        assert gemm_q8.kernel_for(m) == "mmq"
        got = gemm_q8.gemm_nt_q8(a, fmt, torch.from_numpy(w))
        assert np.allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert gemm_q8.default_config("q4_k", 1, 14336) == (1, 4, 2, 1, 1)
    assert gemm_q8.default_config("q4_k", 1, 4096) == (1, 2, 4, 1, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(wfmt="q6_k"), "weight format 'q6_k' is not supported"),
    (dict(k=320), "K=320 must be a multiple of 256"),
    (dict(w_cols=100), r"w must be \(4, 144\)"),
    (dict(w_dtype=torch.int8), "2-D uint8 tensor"),
    (dict(kernel="dp4a"), "kernel 'dp4a' is not one of auto, gemv, mmq"),
])
def test_argument_errors(kwargs, match):
    k = kwargs.get("k", 256)
    a = torch.zeros((1, k))
    w = torch.zeros((4, kwargs.get("w_cols", 144)), dtype=kwargs.get("w_dtype", torch.uint8))
    with pytest.raises(ValueError, match=match):
        gemm_q8.gemm_nt_q8(a, kwargs.get("wfmt", "q4_k"), w, kernel=kwargs.get("kernel", "auto"))
