"""Triton fused FP8 MLA decode (kernels/triton/mla_fused.py) against the float64 golden
refimpl.mla.decode_fused_fp8 (MAX's mla_decode_branch_fp8), in the interpreter on CPU.

Inputs are the op spec's (conformance/ops/mla.py `mla.decode_fused_fp8`): shuffled 64-token pages,
the new tokens' rows holding the raw latent, NaN in every other unused row and unused table
entries poisoned, e4m3 W_UK / W_UV from N(0, 0.02) per 128 x 128 block. Cases: one token, a ragged
batch with a request of 0 new tokens and one with an empty cache, two tokens (causal among the new
ones) with a sink, two attention row blocks per request, an all-zero q_nope (scale 0, codes 0),
fp32 (where the output rounding vanishes and only the kernel's fp32 arithmetic remains), MAX's
3-D cache layout and a strided `out`. The cache after the call: the new rows are the golden's,
every other row is bit-identical to what it was (NaN rows included).
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
from kernel_parity.conformance.backends._torch import to_torch  # noqa: E402
from kernel_parity.conformance.ops.mla import DECODE_FUSED_FP8, FUSED_EPS, FUSED_SCALE  # noqa: E402
from kernel_parity.conformance.spec import float64_view  # noqa: E402
from kernel_parity.kernels.triton.mla_fused import mla_decode_fused_fp8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Bound per element: |got - ref| <= rel * |ref| + abs * max|ref|.
TOL = {
    # out: fp32 all the way, rounded once to the dtype (half an ulp, relative: 2^-9 bf16, 2^-12
    # fp16, doubled); abs: fp32 sums and scale products (~1e-6). No room for a moved e4m3 code
    # (~3e-5 x max|out|): an fp32 o_lat a few ulps off the golden's crosses a midpoint about once
    # in 700,000 codes (measured on the golden), and these cases have no such near-tie.
    "out": {"fp32": (0.0, 1e-5), "bf16": (2.0**-8, 1e-5), "fp16": (2.0**-11, 1e-5)},
    # the new cache rows: fp32 RMSNorm and RoPE (a 512-term fp32 sum of squares), rounded once
    "cache": {"fp32": (0.0, 1e-6), "bf16": (2.0**-8, 1e-6), "fp16": (2.0**-11, 1e-6)},
}
CASES = {  # op-spec params
    "one": dict(b=1, new=1, hq=1, kv=1, lens="full", sink=0),
    "ragged": dict(b=5, new="ragged", hq=4, kv=65, lens="ragged", sink=0),
    "mtp_sink": dict(b=3, new=2, hq=2, kv=64, lens="ragged", sink=1),
    "two_row_blocks": dict(b=2, new=2, hq=17, kv=130, lens="full", sink=1),
}


def _case(name: str, dtype: str, seed: int = 0, dist: str = "normal", **fmt) -> dict[str, np.ndarray]:
    """fmt: fp8= / scale_dtype= (MAX's fp8_dtype / fp8_scale_dtype), the spec's defaults otherwise."""
    p = DECODE_FUSED_FP8.params.validate(DECODE_FUSED_FP8.name, {**CASES[name], **fmt})
    return DECODE_FUSED_FP8.make_inputs(p, dtype, dist, np.random.default_rng(seed))


def _run(x: dict[str, np.ndarray], **kw) -> tuple[np.ndarray, np.ndarray]:
    """(out, cache after the call) of the Triton kernel on copies of x."""
    t = {k: to_torch(v.copy(), DEV) for k, v in x.items()}
    out = mla_decode_fused_fp8(t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], FUSED_EPS, t["w_uk"],
                               t["w_uk_scale"], t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"],
                               t["cache_lengths"], FUSED_SCALE, attn_sink=t.get("attn_sink"), **kw)
    return out.double().cpu().numpy(), t["kv_cache"].double().cpu().numpy()


def _golden(x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    g = float64_view(x)
    fmt = {"fp8": "e5m2" if x["w_uk"].dtype.name == "float8_e5m2" else "e4m3",
           "scale_dtype": "bf16" if x["w_uk_scale"].dtype.name == "bfloat16" else "fp32"}
    return refimpl.mla.decode_fused_fp8(g["q"], g["input_row_offsets"], g["freqs_cis"], g["gamma"], FUSED_EPS,
                                        x["w_uk"], g["w_uk_scale"], x["w_uv"], g["w_uv_scale"], g["kv_cache"],
                                        g["block_table"], g["cache_lengths"], FUSED_SCALE,
                                        attn_sink=g.get("attn_sink"), **fmt)


def assert_fused(x: dict[str, np.ndarray], dtype: str, request, out: np.ndarray, cache: np.ndarray) -> None:
    """out and the cache after the call against the golden: the new rows within TOL, every other
    row bit-identical to the input (NaN rows still NaN), exactly T rows changed."""
    repro = f"  repro: pytest '{request.node.nodeid}'"
    want_out, want_cache = _golden(x)
    before = x["kv_cache"].astype(np.float64)
    assert np.array_equal(np.isnan(cache), np.isnan(before)), "mla_decode_fused_fp8 cache: NaN rows changed\n" + repro
    rows = ~np.all((cache == before) | (np.isnan(cache) & np.isnan(before)), axis=-1)  # rows the kernel wrote
    moved = ~np.all((want_cache == before) | np.isnan(before), axis=-1)  # rows the golden changes
    assert np.array_equal(rows, moved) and rows.sum() == out.shape[0], (
        f"mla_decode_fused_fp8 cache: rows {np.argwhere(rows).tolist()} changed, expected "
        f"{np.argwhere(moved).tolist()}\n" + repro)
    for what, got, want in (("out", out, want_out), ("cache", cache[rows], want_cache[rows])):
        rel, ab = TOL[what][dtype]
        bound = rel * np.abs(want) + ab * np.abs(want).max(initial=0.0)
        bad = ~(np.abs(got - want) <= bound)  # NaN counts as bad
        if bad.any():
            worst = np.argsort(-np.where(np.isnan(got), np.inf, np.abs(got - want) - bound), axis=None)[:5]
            lines = [f"  {what}{list(np.unravel_index(i, got.shape))} = {got.flat[i]:.7g}, expected "
                     f"{want.flat[i]:.7g}  |d|={abs(got.flat[i] - want.flat[i]):.2e} bound={bound.flat[i]:.2e}"
                     for i in worst if bad.flat[i]]
            pytest.fail(f"mla_decode_fused_fp8 {what}: {int(bad.sum())}/{bad.size} elements outside tol ({dtype}: "
                        f"rel={rel:.2e} abs={ab:.2e} x max|ref|)\n" + "\n".join(lines) + "\n" + repro, pytrace=False)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_matches_golden(request, dtype, name):
    x = _case(name, dtype)
    assert_fused(x, dtype, request, *_run(x))


@pytest.mark.parametrize("name", ["ragged", "mtp_sink"])
def test_fused_fp32_is_the_golden_to_fp32_accuracy(request, name):
    x = _case(name, "fp32", seed=1, dist="large")
    assert_fused(x, "fp32", request, *_run(x))


def test_fused_fp8_and_scale_dtypes_match_golden(request):
    """MAX's fp8_dtype / fp8_scale_dtype, read from w_uk / w_uk_scale: e5m2 codes, bf16 scales (the activation
    scales rounded to bf16 before the codes are formed); each alone is a ci case."""
    x = _case("ragged", "bf16", seed=4, fp8="e5m2", scale_dtype="bf16")
    assert_fused(x, "bf16", request, *_run(x))


def test_fused_zero_q_nope_group_quantizes_to_zero(request):
    x = _case("ragged", "bf16", seed=2)
    x["q"][0, :, :128] = 0  # scale 0, codes 0, q_lat 0 for that token (MAX's zero reciprocal)
    assert_fused(x, "bf16", request, *_run(x))


def test_fused_three_dim_cache_strided_out_and_explicit_max_new_tokens(request):
    x = _case("mtp_sink", "bf16", seed=3)
    t_new = x["q"].shape[0]
    buf = torch.full((t_new, 2, 2, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    x3 = {**x, "kv_cache": x["kv_cache"][:, :, 0]}  # MAX's (num_blocks, page, d) layout
    _, cache = _run(x3, out=buf[:, 1], max_new_tokens=2)
    out = buf[:, 1].double().cpu().numpy()
    assert torch.isnan(buf[:, 0]).all(), "mla_decode_fused_fp8 wrote outside out"
    assert_fused(x, "bf16", request, out, cache[:, :, None])


def _cached_state_float64(q_full, kv_cache, block_table, cache_lengths, input_row_offsets, n_m64, qk_scale):
    """What a `cached_attend` returns (kernels/gluon/mla_fused.py's contract), computed in float64 with torch:
    per row (token t of request r, head h; row t H + h) the online-softmax state over keys [0, cache_lengths[r])
    in the log2 domain: (sum_j 2^(s_j - m) v_j, m = max_j s_j, sum_j 2^(s_j - m)), s_j = qk_scale q . k_j."""
    T, H, d = q_full.shape
    page = kv_cache.shape[1]
    rows = kv_cache.reshape(-1, d).double()
    acc = torch.zeros(T * H, 512, dtype=torch.float64)
    m = torch.full((T * H,), float("-inf"), dtype=torch.float64)
    lsum = torch.zeros(T * H, dtype=torch.float64)
    off = input_row_offsets.tolist()
    for r in range(len(off) - 1):
        n = int(cache_lengths[r])
        if off[r + 1] == off[r] or n == 0:
            continue
        j = torch.arange(n)
        keys = rows[block_table[r, j // page].long() * page + j % page]
        q = q_full[off[r]:off[r + 1]].double().reshape(-1, d)
        s = qk_scale * (q @ keys.T)
        mr = s.max(dim=1).values
        p = torch.exp2(s - mr[:, None])
        sl = slice(off[r] * H, off[r + 1] * H)
        acc[sl], m[sl], lsum[sl] = p @ keys[:, :512], mr, p.sum(dim=1)
    return acc.float(), m.float(), lsum.float()


@pytest.mark.parametrize("name", ["ragged", "mtp_sink", "two_row_blocks"])
def test_fused_cached_state_hook_matches_golden(request, name):
    """The Triton kernel continuing from a cached part's state (`cached_attend`, the contract of the gluon
    kernel): from a float64 state it meets the golden within the same bounds."""
    x = _case(name, "bf16", seed=5)
    assert_fused(x, "bf16", request, *_run(x, cached_attend=_cached_state_float64))


def test_fused_cached_state_hook_refuses_the_sparse_mode():
    x = _case("one", "bf16")
    t = {k: to_torch(v.copy(), DEV) for k, v in x.items()}
    with pytest.raises(ValueError, match="cached_attend is for the dense mode"):
        mla_decode_fused_fp8(t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], FUSED_EPS, t["w_uk"],
                             t["w_uk_scale"], t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"],
                             t["cache_lengths"], FUSED_SCALE, d_indices=torch.zeros(4, dtype=torch.int32),
                             indices_stride=4, topk=4, topk_lengths=torch.ones(1, dtype=torch.int32),
                             cached_attend=_cached_state_float64)


@pytest.mark.parametrize("bad", ["w_uk_dtype", "w_uv_scale_shape", "cache_dtype", "granularity", "w_uv_format",
                                 "w_uv_scale_dtype"])
def test_fused_refuses_bad_inputs(bad):
    x = _case("one", "bf16")
    t = {k: to_torch(v.copy(), DEV) for k, v in x.items()}
    if bad == "w_uk_dtype":
        t["w_uk"] = t["w_uk"].to(torch.bfloat16)
    elif bad == "w_uv_scale_shape":
        t["w_uv_scale"] = t["w_uv_scale"][:, :, :2]
    elif bad == "cache_dtype":
        t["kv_cache"] = t["kv_cache"].float()
    elif bad == "w_uv_format":  # MAX's one fp8_dtype: W_UV's codes in W_UK's format
        t["w_uv"] = t["w_uv"].float().to(torch.float8_e5m2)
    elif bad == "w_uv_scale_dtype":  # and one fp8_scale_dtype
        t["w_uv_scale"] = t["w_uv_scale"].to(torch.bfloat16)
    else:  # q_nope of 96 channels: not a whole 128-channel scale group
        t["q"] = t["q"][..., 32:]
    with pytest.raises(ValueError, match="mla_decode_fused_fp8"):
        mla_decode_fused_fp8(t["q"], t["input_row_offsets"], t["freqs_cis"], t["gamma"], FUSED_EPS, t["w_uk"],
                             t["w_uk_scale"], t["w_uv"], t["w_uv_scale"], t["kv_cache"], t["block_table"],
                             t["cache_lengths"], FUSED_SCALE)
