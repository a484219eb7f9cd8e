"""moe.experts with GGML expert weights (wfmt q8_0 / q4_0 / q4_k / q6_k, w-only): the golden's GGMLWeight against
refimpl.quant's exact dequantization and a per-token float64 loop; the spec's inputs (every weight GGML-quantized by
the byte-exact reference quantizer, neighbouring blocks, rows and K-quant sub-blocks far apart in scale); the
kernels' decoders (C, eager torch, Triton's gemm.py helpers through the fused kernel) against the golden's values;
refusals (one-line ValueErrors)."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.refimpl import moe_experts as mx
from kernel_parity.refimpl import quant

torch = pytest.importorskip("torch")

FMTS = ("q8_0", "q4_0", "q4_k", "q6_k")


def _case(fmt, t=5, d=256, f=256, e=3, k=2, s=1, dtype="fp32", seed=0):
    from kernel_parity.conformance.ops.moe_experts import EXPERTS

    p = dict(t=t, d=d, f=f, e=e, k=k, shared=s, wfmt=fmt)
    return p, EXPERTS.make_inputs(p, dtype, "normal", np.random.default_rng(seed))


@pytest.mark.parametrize("fmt", FMTS)
def test_ggml_weight_is_the_exact_dequantization_and_the_golden_a_per_token_loop(fmt):
    from kernel_parity.conformance.ops.moe_experts import EXPERTS, dense_weight

    p, x = _case(fmt)
    w = {n: dense_weight(x, n, fmt) for n in ("w13", "w2", "ws13", "ws2")}
    assert isinstance(w["w13"], mx.GGMLWeight) and w["w13"].shape == (3, 512, 256) and w["w2"].shape == (3, 256, 256)
    for e in range(3):
        np.testing.assert_array_equal(w["w2"][e], quant.dequantize(fmt, x["w2_ggml"][e]))
    dense = {n: np.stack([v[i] for i in range(v.shape[0])]) for n, v in w.items()}
    xs = x["x"].astype(np.float64)
    rnd = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731  (act rounded to x's fp32: the golden's cast)
    want = np.zeros_like(xs)
    for t in range(xs.shape[0]):
        for j in range(2):
            e, wt = x["ids"][t, j], float(x["weights"][t, j])
            h = dense["w13"][e] @ xs[t]
            g, u = h[:256], h[256:]
            want[t] += wt * dense["w2"][e] @ rnd(g / (1 + np.exp(-g)) * u)
        h = dense["ws13"][0] @ xs[t]
        want[t] += dense["ws2"][0] @ rnd(h[:256] / (1 + np.exp(-h[:256])) * h[256:])
    got = EXPERTS.reference(x, p)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def _row_scales(fmt, blocks):
    """(rows, blocks a row) |d| of each block (fp16 at byte 0, q6_k's at 208)."""
    f = quant.FORMATS[fmt]
    b = blocks.reshape(blocks.shape[0], -1, f.nbytes)
    off = 208 if fmt == "q6_k" else 0
    return np.abs(b[..., off:off + 2].copy().view("<f2")[..., 0].astype(np.float64))


@pytest.mark.parametrize("fmt", FMTS)
def test_spec_inputs_separate_neighbouring_blocks_rows_and_subblocks(fmt):
    """Every weight GGML-quantized by refimpl.quant.quantize after `ggml_factor`: a block's scale d differs from its
    row neighbour's and from the same block of the next row by >= 3x; q4_k's neighbouring 32-element sub-blocks'
    6-bit scales and q6_k's neighbouring 16-element int8 scales differ too; the bytes are the reference
    quantizer's own (re-quantizing the dequantized values gives them back for q8_0)."""
    from kernel_parity.conformance.ops.moe_experts import ggml_factor

    p, x = _case(fmt, d=512, f=256, e=2, s=0)
    assert set(x) == {"x", "ids", "weights", "w13_ggml", "w2_ggml"}
    blocks = x["w13_ggml"][1]  # (2F, D / QK * nbytes)
    d = _row_scales(fmt, blocks)
    assert d.shape[1] >= 2
    ratio = lambda a, b: np.maximum(a, b) / np.maximum(np.minimum(a, b), 1e-30)  # noqa: E731
    assert (ratio(d[:, 1:], d[:, :-1]) >= 3).all()  # along the row
    assert (ratio(d[1:], d[:-1]) >= 3).all()  # the next row's same block
    fields = quant.block_fields(fmt, blocks)
    if fmt in ("q4_k", "q6_k"):  # sub-block scales: q4_k's 8 of 32 elements, q6_k's 16 of 16
        sc = np.abs(fields.scales.astype(np.float64))
        assert sc.shape[-1] == (8 if fmt == "q4_k" else 16)
        assert (np.abs(sc[..., 1:] - sc[..., :-1]) >= 1).mean() > 0.9
    fac = ggml_factor(512, 256, fmt)
    assert fac.dtype == np.float32 and np.isclose(np.sqrt((fac.astype(np.float64) ** 2).mean()), 1, rtol=1e-6)
    if fmt == "q8_0":
        np.testing.assert_array_equal(quant.quantize(fmt, quant.dequantize(fmt, blocks).astype(np.float32)), blocks)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_decoders_give_the_goldens_values(fmt):
    """The eager kernel's fp32 dequantization is the golden's exact values rounded once to fp32 (ggml's
    dequantize_row_*), and so is the C kernel's (identity weights through its rows: one expert, x a unit vector)."""
    from kernel_parity.kernels.torch.moe_experts import dequant_ggml

    _, x = _case(fmt, e=2, s=0)
    w = {"fmt": fmt, "blocks": torch.from_numpy(x["w13_ggml"])}
    for e in range(2):
        got = dequant_ggml(w, e, torch.float32).numpy()
        np.testing.assert_array_equal(got, quant.dequantize(fmt, x["w13_ggml"][e]).astype(np.float32))


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_kernels_refuse_bad_ggml_arguments_in_one_line(backend):
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()
    _, x = _case("q8_0", t=3, d=64, f=32, e=2, s=0)
    xs = np.ascontiguousarray(x["x"])
    w13, w2 = x["w13_ggml"], x["w2_ggml"]
    if backend == "cpu":
        from kernel_parity.kernels.cpu.moe_experts import experts
        conv = lambda a: a  # noqa: E731
    else:
        import importlib
        experts = importlib.import_module(f"kernel_parity.kernels.{backend}.moe_experts").experts
        conv = torch.from_numpy  # noqa: E731
    args = [conv(xs), conv(x["ids"]), conv(x["weights"])]
    g = lambda fmt, b: {"fmt": fmt, "blocks": conv(np.ascontiguousarray(b))}  # noqa: E731
    for call, match in [
        (lambda: experts(*args, g("q5_9", w13), g("q8_0", w2)), r"must be one of q8_0, q4_0, q4_k, q6_k"),
        (lambda: experts(*args, g("q8_0", w13[:, :, :33]), g("q8_0", w2)), r"K / 32 \* 34"),
        (lambda: experts(*args, g("q8_0", w13), g("q4_0", w2[:, :, :18])), "share one format"),
        (lambda: experts(*args, g("q8_0", w13), g("q8_0", w2[:, :32])), "w2 must be"),
        (lambda: experts(*args, g("q8_0", w13), g("q8_0", w2), act_fp8=True), "needs block-FP8"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_spec_refuses_dims_off_the_block_and_golden_refuses_bad_blocks():
    from kernel_parity.conformance.ops.moe_experts import EXPERTS

    msg = EXPERTS.check(dict(t=2, d=128, f=256, e=2, k=1, shared=0, wfmt="q4_k"))
    assert msg is not None and "multiples of its block of 256" in msg
    assert EXPERTS.check(dict(t=2, d=96, f=32, e=2, k=1, shared=0, wfmt="q4_0")) is None
    with pytest.raises(ValueError, match="must be one of"):
        mx.GGMLWeight("q5_k", np.zeros((1, 2, 176), np.uint8))
    with pytest.raises(ValueError, match=r"blocks must be \(E, N, K / 32 \* 34\) uint8"):
        mx.GGMLWeight("q8_0", np.zeros((1, 2, 35), np.uint8))
