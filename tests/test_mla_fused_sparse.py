"""Triton fused FP8 MLA decode, MAX's sparse mode (issue 32, S23: `sparse=k`, `extra=1`) against the float64
golden, in the interpreter on CPU, at test_mla_fused.py's tight bounds (the dense kernel's).

Inputs are the op spec's sparse draws (conformance/ops/mla.py): every entry a kernel must not use (past a
token's topk_length, the stride's three extra columns, and with extra=1 the second cache's) names a NaN row,
every cached row no token selects is NaN, the third token's list is empty (out 0). Cases: topk below the
kernel's 32-key tile, topk 40 (two tiles, the second partial) with the second cache and two head blocks
(h_q 17), per-request sinks, and an fp32 cache (the IEEE path, not the three-part split). The cache after
the call is the golden's; the kernel's usage errors are one ValueError each.
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
import kernel_parity.refimpl.mla  # noqa: E402,F401
from kernel_parity.conformance.backends import Registry  # noqa: E402
from kernel_parity.conformance import ops  # noqa: E402
from kernel_parity.conformance.backends._torch import to_torch  # noqa: E402
from kernel_parity.conformance.ops.mla import DECODE_FUSED_FP8, FUSED_EPS, FUSED_SCALE, fused_sparse_args  # noqa: E402
from kernel_parity.conformance.spec import float64_view  # noqa: E402
from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# test_mla_fused.py's bounds: |got - ref| <= rel |ref| + abs max|ref| (out rounded once to the dtype)
TOL = {"fp32": (0.0, 1e-5), "bf16": (2.0**-8, 1e-5)}
CASES = {
    "topk16": dict(b=3, new=2, hq=2, kv=70, lens="ragged", sink=0, sparse=16),
    "topk5_batch_sink": dict(b=4, new="ragged", hq=3, kv=64, lens="full", sink=1, sink_shape="batch", sparse=5),
    "topk40_extra_17_heads": dict(b=2, new=2, hq=17, kv=64, lens="full", sink=1, sparse=40, extra=1),
}


def _case(name: str, dtype: str, seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    p = CASES[name]
    return p, DECODE_FUSED_FP8.make_inputs(p, dtype, "normal", np.random.default_rng(seed))


def _run(p: dict, x: dict[str, np.ndarray], **kw) -> tuple[np.ndarray, np.ndarray]:
    t = {k: to_torch(v.copy(), DEV) for k, v in x.items()}
    out = mla_decode_fused_fp8(t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], FUSED_EPS, t["w_uk"],
                               t["w_uk_scale"], t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"],
                               t["cache_lengths"], FUSED_SCALE, attn_sink=t.get("attn_sink"),
                               sink_per=p.get("sink_shape", "head"), **{**fused_sparse_args(t, p), **kw})
    return out.double().cpu().numpy(), t["kv_cache"].double().cpu().numpy()


def _golden(p: dict, x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    g = float64_view(x)
    return refimpl.mla.decode_fused_fp8(g["q"], g["input_row_offsets"], g["freqs_cis"], g["gamma"], FUSED_EPS,
                                        g["w_uk"], g["w_uk_scale"], g["w_uv"], g["w_uv_scale"], g["kv_cache"],
                                        g["block_table"], g["cache_lengths"], FUSED_SCALE,
                                        attn_sink=g.get("attn_sink"), sink_per=p.get("sink_shape", "head"),
                                        **fused_sparse_args(x, p))


@pytest.mark.parametrize("name,dtype", [(n, "bf16") for n in CASES] + [("topk40_extra_17_heads", "fp32")])
def test_sparse_matches_golden(name, dtype):
    # topk5's seed 0 puts one o_lat element of token 1 on an e4m3 midpoint (5.9e-9 relative, below an fp32
    # ulp: the golden's own tie, which moves that code and its row of out in any fp32 kernel): seed 1
    p, x = _case(name, dtype, seed=1 if name == "topk5_batch_sink" else 0)
    out, cache = _run(p, x)
    want, want_cache = _golden(p, x)
    new = ~np.all((want_cache == x["kv_cache"].astype(np.float64)) | np.isnan(want_cache), axis=-1)
    assert np.array_equal(np.isnan(cache), np.isnan(want_cache)) and new.sum() == out.shape[0]
    rel, ab = TOL[dtype]
    assert np.all(np.abs(cache[new] - want_cache[new]) <= rel * np.abs(want_cache[new]) + 1e-6 * np.abs(
        want_cache[new]).max())
    bound = rel * np.abs(want) + ab * np.abs(want).max()
    bad = ~(np.abs(out - want) <= bound)
    assert not bad.any(), f"{int(bad.sum())}/{bad.size} outside, worst |d| {np.nanmax(np.abs(out - want)):.3g}"
    assert "extra" in p or not out[2].any()  # the third token's list is empty: out 0


def test_triton_takes_sparse_and_extra():
    for q in ("sparse=16", "sparse=16,extra=1"):
        case = ops.parse_case(f"mla.decode_fused_fp8/triton/bf16/b=3,new=2,hq=2,kv=70,lens=ragged,sink=1,{q}"
                              f"/normal/seed=0")
        assert Registry().get("triton").supports(case) is None


@pytest.mark.parametrize("bad", ["stride", "index_dtype", "extra_dense", "extra_dtype", "extra_scales"])
def test_sparse_refuses_bad_inputs(bad):
    p, x = _case("topk16", "bf16")
    t = {k: to_torch(v.copy(), DEV) for k, v in x.items()}
    kw = fused_sparse_args(t, p)
    e = {"extra_k": torch.zeros((1, 64, 1, 576), dtype=torch.float8_e4m3fn),
         "extra_scales": torch.ones((64, 5)), "extra_d_indices": kw["d_indices"],
         "extra_topk_lengths": kw["topk_lengths"]}
    if bad == "stride":
        kw["topk"] = kw["indices_stride"] + 1
    elif bad == "index_dtype":
        kw["d_indices"] = kw["d_indices"].long()
    elif bad == "extra_dense":
        kw = {"extra_k": e["extra_k"]}
    elif bad == "extra_dtype":
        kw.update(e, extra_k=e["extra_k"].to(torch.bfloat16))
    else:
        kw.update(e, extra_scales=e["extra_scales"][:, :4])
    with pytest.raises(ValueError, match="mla_decode_fused_fp8") as err:
        mla_decode_fused_fp8(t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], FUSED_EPS, t["w_uk"],
                             t["w_uk_scale"], t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"],
                             t["cache_lengths"], FUSED_SCALE, **kw)
    assert "\n" not in str(err.value)
