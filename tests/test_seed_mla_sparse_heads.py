"""Issue 32, FlashMLA S20 for mla.decode_sparse: h_kv > 1 latent KV heads, FlashMLA's
(b, s_q, h_kv, topk) indices: query head h reads kv head k = h // (h_q / h_kv)'s own index list over
k's rows of the cache.

The golden is checked against itself on each kv head's slice (h_kv = 1 there, the form of before);
the inputs draw each kv head's rows and lists apart; the eager torch and Triton (interpreter) kernels
against the golden; the param's default keeps older ids and inputs, and a bad h_q / h_kv pair is a
one-line usage error.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.cli import main
from kernel_parity.refimpl import mla as golden

torch = pytest.importorskip("torch")

BASE = ("mla.decode_sparse/torch/fp32/b=2,sq=2,hq=8,kv=70,lens=ragged,topk=48,topk_len=ragged,"
        "scale=head{extra}/normal/seed=0")


def _inputs(hkv: int, hq: int = 8, dtype: str = "fp32"):
    spec = ops.get("mla.decode_sparse")
    p = spec.params.validate(spec.name, dict(b=2, sq=2, hq=hq, hkv=hkv, kv=70, lens="ragged", topk=48,
                                             topk_len="ragged", scale="head"))
    return p, spec.make_inputs(p, dtype, "normal", np.random.default_rng(5))


def test_hkv_defaults_to_one_and_bad_pairs_are_one_line_usage_errors(capsys):
    plain = BASE.format(extra="")
    assert ops.parse_case(BASE.format(extra=",hkv=1")).id == plain
    assert "hkv" not in ops.parse_case(plain).p and ops.parse_case(BASE.format(extra=",hkv=2")).p["hkv"] == 2
    assert main(["repro", BASE.format(extra=",hkv=3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hq=8 must be a multiple of hkv=3" in err[0]


def test_inputs_draw_each_kv_heads_rows_and_lists_apart():
    _, one = _inputs(1)
    assert one["indices"].shape == (2, 2, 48) and one["kv_cache"].shape[2] == 1
    _, x = _inputs(4)
    idx, cache = x["indices"], x["kv_cache"]
    assert idx.shape == (2, 2, 4, 48) and cache.shape[2] == 4
    for k in range(1, 4):
        assert (idx[:, :, k] != idx[:, :, 0]).any()
        live = ~np.isnan(cache[:, :, 0, 0])
        assert (cache[:, :, k][live] != cache[:, :, 0][live]).all(axis=-1).mean() > 0.99


@pytest.mark.parametrize("hkv", [2, 4, 8])
def test_golden_is_the_one_head_sparse_decode_on_each_kv_heads_slice(hkv):
    _, x = _inputs(hkv)
    sink = np.random.default_rng(1).normal(0, 2, 8)
    o, lse = golden.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], 0.05, attn_sink=sink)
    g = 8 // hkv
    for k in range(hkv):
        h = slice(k * g, (k + 1) * g)
        ok, lk = golden.decode_sparse(x["q"][:, :, h], x["kv_cache"][:, :, k:k + 1], x["indices"][:, :, k],
                                      x["topk_length"], 0.05, attn_sink=sink[h])
        np.testing.assert_allclose(o[:, :, h], ok, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(lse[:, h], lk, rtol=1e-13, atol=1e-13)
    # kv head 0's rows, or kv head 1's lists, give other outputs
    o0, _ = golden.decode_sparse(x["q"], np.repeat(x["kv_cache"][:, :, :1], hkv, axis=2), x["indices"],
                                 x["topk_length"], 0.05)
    o1, _ = golden.decode_sparse(x["q"], x["kv_cache"], np.roll(x["indices"], -1, axis=2), x["topk_length"], 0.05)
    o_plain, _ = golden.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], 0.05)
    assert not np.allclose(o0[:, :, g:], o_plain[:, :, g:]) and not np.allclose(o1, o_plain)
    with pytest.raises(ValueError, match="must be a multiple"):
        golden.decode_sparse(x["q"][:, :, :3], x["kv_cache"], x["indices"], None, 0.05)
    with pytest.raises(ValueError, match="indices"):
        golden.decode_sparse(x["q"], x["kv_cache"], x["indices"][:, :, 0], None, 0.05)


def test_torch_kernel_with_kv_heads_is_the_golden():
    from kernel_parity.kernels.torch import mla as tmla

    _, x = _inputs(4)
    sink = np.random.default_rng(2).normal(0, 2, 8)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    o, lse = tmla.decode_sparse(t["q"], t["kv_cache"], t["indices"], t["topk_length"], 0.05,
                                attn_sink=torch.from_numpy(sink).float())
    want_o, want_lse = golden.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], 0.05,
                                            attn_sink=sink.astype(np.float32))
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


def test_triton_kernel_with_kv_heads_is_the_golden():
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse

    _, x = _inputs(2, hq=4)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    o, lse = mla_decode_sparse(t["q"], t["kv_cache"], t["indices"], t["topk_length"], 0.05, num_splits=2)
    want_o, want_lse = golden.decode_sparse(x["q"], x["kv_cache"], x["indices"], x["topk_length"], 0.05)
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="indices"):  # one list per request and query with h_kv = 2
        mla_decode_sparse(t["q"], t["kv_cache"], t["indices"][:, :, 0].contiguous(), None, 0.05)
