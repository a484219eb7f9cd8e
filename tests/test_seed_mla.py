"""Issue 32, FlashMLA S20: mla.decode with h_kv > 1 latent KV heads (FlashMLA's k_cache
[num_blocks, page, h_kv, 576], query head h on kv head h // (h_q / h_kv)); MAX S25: per-batch
attention sinks in mla.decode_fused_fp8 (sink_shape=batch).

The golden is checked against itself on each kv head's slice of the cache (h_kv = 1 there, the form of
before); the C kernel bit for bit the same way (a row's arithmetic depends only on its own data, see
mla.c); the eager torch kernel against the golden; the param's default keeps older ids, and a bad
h_q / h_kv pair is a one-line usage error.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.cli import main
from kernel_parity.refimpl import mla as golden

torch = pytest.importorskip("torch")

BASE = "mla.decode/{be}/{dt}/b=3,sq=2,hq=8,kv=65,lens=ragged,causal=1,scale=head{extra}/normal/seed=0"


def _inputs(hkv: int, dtype: str = "fp32", hq: int = 8):
    spec = ops.get("mla.decode")
    p = spec.params.validate(spec.name, dict(b=3, sq=2, hq=hq, hkv=hkv, kv=65, lens="ragged", causal=1,
                                             scale="head"))
    return p, spec.make_inputs(p, dtype, "normal", np.random.default_rng(3))


def test_hkv_defaults_to_one_and_bad_pairs_are_one_line_usage_errors(capsys):
    plain = BASE.format(be="cpu", dt="bf16", extra="")
    assert ops.parse_case(BASE.format(be="cpu", dt="bf16", extra=",hkv=1")).id == plain
    assert "hkv" not in ops.parse_case(plain).p and ops.parse_case(BASE.format(be="cpu", dt="bf16",
                                                                               extra=",hkv=2")).p["hkv"] == 2
    assert main(["repro", BASE.format(be="cpu", dt="bf16", extra=",hkv=3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hq=8 must be a multiple of hkv=3" in err[0]


@pytest.mark.parametrize("hkv", [2, 4, 8])
def test_golden_is_the_one_head_decode_on_each_kv_heads_slice(hkv):
    p, x = _inputs(hkv)
    assert x["kv_cache"].shape[2] == hkv
    o, lse = golden.decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], 0.05)
    g = 8 // hkv
    for k in range(hkv):
        hs = slice(k * g, (k + 1) * g)
        o1, l1 = golden.decode(x["q"][:, :, hs], x["kv_cache"][:, :, k:k + 1], x["block_table"], x["seqlens"], 0.05)
        assert np.array_equal(o1, o[:, :, hs]) and np.array_equal(l1, lse[:, hs])
    # the kv heads' rows are drawn apart: the head-0 cache gives other outputs for every other group
    o0, _ = golden.decode(x["q"], np.repeat(x["kv_cache"][:, :, :1], hkv, axis=2), x["block_table"],
                          x["seqlens"], 0.05)
    live = x["seqlens"] > 0
    assert np.abs(o0 - o)[live][:, :, g:].min(axis=-1).max() > 0 and np.abs(o0 - o)[live][:, :, g:].max() > 0.1
    with pytest.raises(ValueError, match="multiple of the cache's h_kv"):
        golden.decode(x["q"][:, :, :3], x["kv_cache"], x["block_table"], x["seqlens"], 0.05)


def test_c_kernel_with_kv_heads_is_bitwise_the_one_head_kernel_on_each_slice():
    from kernel_parity.kernels.cpu import loader

    try:
        from kernel_parity.kernels.cpu import mla as cmla
        cmla._kernels()
    except loader.CompilerUnavailable as e:
        pytest.skip(f"kernels/cpu unavailable: {e}")
    _, x = _inputs(2, "bf16")
    args = (x["block_table"], x["seqlens"], 0.05, 512, True)
    o, lse = cmla.mla_decode(x["q"], x["kv_cache"], *args)
    o3, lse3 = cmla.mla_decode(x["q"], x["kv_cache"], *args, threads=3)
    assert np.array_equal(o, o3) and np.array_equal(lse, lse3)
    for k in range(2):
        hs = slice(4 * k, 4 * k + 4)
        o1, l1 = cmla.mla_decode(np.ascontiguousarray(x["q"][:, :, hs]), x["kv_cache"][:, :, k:k + 1], *args)
        assert np.array_equal(o1, o[:, :, hs]) and np.array_equal(l1, lse[:, hs])
    with pytest.raises(ValueError, match="h_kv = 2 latent kv heads must divide h_q = 3"):
        cmla.mla_decode(np.ascontiguousarray(x["q"][:, :, :3]), x["kv_cache"], *args)


def test_torch_kernel_with_kv_heads_is_the_golden():
    from kernel_parity.kernels.torch import mla as tmla

    _, x = _inputs(4)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    o, lse = tmla.decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], 0.05)
    want_o, want_lse = golden.decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], 0.05)
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


# ---- S25: MAX's per-batch sink -------------------------------------------------------------------

FUSED = "mla.decode_fused_fp8/torch/bf16/b=3,new=2,hq=2,kv=64,lens=ragged,sink={sink}{extra}/normal/seed=0"


def test_sink_shape_defaults_to_head_and_needs_a_sink(capsys):
    plain = FUSED.format(sink=1, extra="")
    assert ops.parse_case(FUSED.format(sink=1, extra=",sink_shape=head")).id == plain
    assert "sink_shape" not in ops.parse_case(plain).p
    assert main(["repro", FUSED.format(sink=0, extra=",sink_shape=batch")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sink_shape=batch needs sink=1" in err[0]


def _fused(extra: str):
    case = ops.parse_case(FUSED.format(sink=1, extra=extra))
    spec = ops.get(case.op)
    return case.p, spec.make_inputs(case.p, "bf16", "normal", np.random.default_rng(4))


def test_per_batch_sink_is_the_per_head_sink_of_each_request_repeated():
    """Golden and eager kernel: request r's rows under sink_per="batch" are those of a per-head call whose every
    head has request r's sink; the per-request sinks are drawn apart, so request 0's sink gives other rows."""
    from kernel_parity.kernels.torch import mla as tmla

    p, x = _fused(",sink_shape=batch")
    sinks = x.pop("attn_sink")
    assert sinks.shape == (3,) and np.ptp(sinks) > 1.0
    off = x["input_row_offsets"]
    args = lambda a: (a["q"], a["input_row_offsets"], a["freqs_cis"], a["gamma"], 1e-6, a["w_uk"], a["w_uk_scale"],
                      a["w_uv"], a["w_uv_scale"], a["kv_cache"], a["block_table"], a["cache_lengths"], 0.1)
    out, _ = golden.decode_fused_fp8(*args(x), attn_sink=sinks, sink_per="batch")
    from kernel_parity.conformance.backends._torch import to_torch

    t = {k: to_torch(v, "cpu") for k, v in x.items()}
    tout, _ = tmla.decode_fused_fp8(*args(t), attn_sink=torch.from_numpy(sinks), sink_per="batch")
    for r in range(3):
        rows = slice(int(off[r]), int(off[r + 1]))
        per_head = np.full(2, sinks[r], dtype=np.float32)
        want, _ = golden.decode_fused_fp8(*args(x), attn_sink=per_head)
        np.testing.assert_allclose(out[rows], want[rows], rtol=1e-12, atol=1e-15)
        twant, _ = tmla.decode_fused_fp8(*args(t), attn_sink=torch.from_numpy(per_head))
        assert torch.equal(tout[rows], twant[rows])
        if r:
            other, _ = golden.decode_fused_fp8(*args(x), attn_sink=np.full(2, sinks[0], dtype=np.float32))
            assert np.abs(other[rows] - out[rows]).max() > 0.05 * np.abs(out[rows]).max()
    with pytest.raises(ValueError, match="per request"):
        golden.decode_fused_fp8(*args(x), attn_sink=sinks[:2], sink_per="batch")


# ---- S24: MAX's scale granularities and epsilon ------------------------------------------------------

def test_gran_and_eps_default_to_deepseeks_and_triton_declares_other_granularities_unsupported():
    from kernel_parity.conformance.backends import Registry

    plain = FUSED.format(sink=0, extra="")
    assert ops.parse_case(FUSED.format(sink=0, extra=",gran=1x128x128,eps=1e-6")).id == plain
    fine = ops.parse_case(FUSED.format(sink=0, extra=",gran=2x128x64"))
    p, x = fine.p, ops.get(fine.op).make_inputs(fine.p, "bf16", "normal", np.random.default_rng(0))
    assert x["w_uk_scale"].shape == (2, 512 // 128, 128 // 64) and x["w_uv_scale"].shape == (2, 1, 512 // 64)
    triton = Registry().get("triton")
    assert "(1, 128, 128) scale granularity only" in triton.supports(ops.parse_case(fine.id.replace("/torch/",
                                                                                                      "/triton/")))
    assert triton.supports(ops.parse_case(FUSED.format(sink=0, extra=",eps=1e-2").replace("/torch/", "/triton/"))) \
        is None
    null = ops.parse_case(FUSED.format(sink=0, extra=",mask=null").replace("/torch/", "/triton/"))
    assert "masks causally only" in triton.supports(null)
    assert ops.parse_case(FUSED.format(sink=0, extra=",mask=causal")).id == plain


def test_null_mask_lets_a_first_new_token_see_the_second():
    """mask=null (MAX's mask_str): the golden differs from the causal one only on rows that had later new tokens
    hidden: a request's first of two new tokens."""
    spec = ops.get("mla.decode_fused_fp8")
    case = ops.parse_case(FUSED.format(sink=0, extra=",mask=null"))
    x = spec.make_inputs(case.p, "bf16", "normal", np.random.default_rng(1))
    null, causal = spec.reference(x, case.p)["out"], spec.reference(x, ops.parse_case(FUSED.format(sink=0,
                                                                                                  extra="")).p)["out"]
    off = x["input_row_offsets"]
    first = np.zeros(len(null), bool)
    first[off[:-1][np.diff(off) == 2]] = True
    assert np.array_equal(null[~first], causal[~first]) and np.abs(null[first] - causal[first]).max() > 0.01


def test_eps_reaches_the_golden_cache_rows():
    case = ops.parse_case(FUSED.format(sink=0, extra=",eps=1e-2"))
    spec = ops.get(case.op)
    x = spec.make_inputs(case.p, "bf16", "normal", np.random.default_rng(0))
    big = spec.reference(x, case.p)["kv_cache"]
    small = spec.reference(x, ops.parse_case(FUSED.format(sink=0, extra="")).p)["kv_cache"]
    new = ~np.isclose(big, small, equal_nan=True)
    assert new.any() and np.nanmax(np.abs(big - small)) > 0.1  # eps ~ a row's mean square: rows ~30% smaller
