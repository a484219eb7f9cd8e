"""Seed audit S5 for blocks.outproj_mlp: the attention output head-major, the seed's [h_q, T, a_d]
(`attn_layout=head_major`), as the outproj + MLP block's input.

The contract (refimpl/blocks.py `outproj_mlp`): token t's row of the product is its heads' rows in order,
(attn[0, t], .., attn[h_q - 1, t]); everything after the gather is the token-major block. The inputs are
the token-major case's draws, scaled per head (0.1, 1, 10) and transposed, so a buffer read in the other
layout is off by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton

from kernel_parity.conformance import ops, suites  # noqa: E402
from kernel_parity.conformance.cli import main  # noqa: E402
from kernel_parity.conformance.ops.blocks_inputs import head_major_scales  # noqa: E402
from kernel_parity.conformance.runner import Prepared  # noqa: E402
from kernel_parity.refimpl import blocks as ref  # noqa: E402

OP = "blocks.outproj_mlp"
OLD = dict(t=3, e=64, epad=0, hq=4, d=24, dpad=8, wo="f32", wo_layout="head_major", obias=1, i=32, w1="q8_0",
           w2="f32", eps="1e-6", gemma=0)
# the ci cases' two shapes: W_o per head with the MLP's biases and padding, and a quantized flat W_o
HEADS = dict(t=5, e=64, epad=0, hq=3, d=24, dpad=8, wo="f32", wo_layout="head_major", obias=1, i=20, w1="q8_0",
             w2="f32", eps="1e-6", gemma=0, bias=1, ipad=12)
FLAT = dict(t=3, e=60, epad=4, hq=2, d=32, dpad=0, wo="q8_0", wo_layout="flat", obias=0, i=64, w1="q8_0", w2="f32",
            eps="1e-5", gemma=1)


def _case(p: dict, layout: str | None, dist: str = "normal", seed: int = 2):
    q = dict(p) if layout is None else dict(p, attn_layout=layout)
    return ops.make_case(OP, "cpu", "fp32", q, dist, seed)


def _inputs(p: dict, layout: str | None, dist: str = "normal") -> dict:
    case = _case(p, layout, dist)
    return case, {k: np.ascontiguousarray(v) for k, v in Prepared(ops.get(OP), case).inputs.items()}


def _args(case, x: dict) -> tuple[tuple, dict]:
    """The backends' (positional, keyword) arguments of the case (attn_layout among the keywords)."""
    from kernel_parity.conformance.backends.blocks import _outproj_mlp_args
    return _outproj_mlp_args(case, x)


def test_the_default_keeps_older_case_ids_and_inputs():
    base, x = _inputs(OLD, None)
    same, y = _inputs(OLD, "token_major")
    assert same.id == base.id and "attn_layout" not in base.id
    assert set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
    assert "attn_layout=head_major" in _case(OLD, "head_major").id


@pytest.mark.parametrize("p", [HEADS, FLAT], ids=["heads", "flat"])
def test_the_inputs_are_the_token_major_draws_scaled_per_head_and_transposed(p):
    _, tok = _inputs(p, "token_major", "rows")
    _, hm = _inputs(p, "head_major", "rows")
    t, hq, ad = p["t"], p["hq"], p["d"] + p["dpad"]
    assert hm["attn"].shape == (hq, t, ad) and hm["attn"].flags.c_contiguous
    assert all(np.array_equal(tok[k], hm[k]) for k in tok if k != "attn")
    want = tok["attn"].astype(np.float64).reshape(t, hq, ad).transpose(1, 0, 2) * head_major_scales(hq)[:, None, None]
    np.testing.assert_allclose(hm["attn"], want, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("p", [HEADS, FLAT], ids=["heads", "flat"])
@pytest.mark.parametrize("reference", ["dequant", "emulated"])
def test_the_golden_reads_each_head_and_the_other_layout_is_far_off(p, reference):
    spec = ops.get(OP)
    fn = spec.reference if reference == "dequant" else spec.references["emulated"]
    case = _case(p, "head_major")
    x64 = dict(Prepared(spec, case).inputs64)
    t, tok_p = p["t"], {k: v for k, v in case.p.items() if k != "attn_layout"}
    rows = dict(x64, attn=x64["attn"].transpose(1, 0, 2).reshape(t, -1))  # the token rows, gathered
    got, want = fn(x64, case.p), fn(rows, tok_p)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    misread = fn(dict(x64, attn=x64["attn"].reshape(t, -1)), tok_p)  # the buffer read token-major
    rel = np.abs(misread["proj"] - got["proj"]).max() / np.abs(got["proj"]).max()
    assert rel > 1e-2, rel  # orders of magnitude beyond any fp32 limit
    mag, mag_rows = spec.magnitude(x64, case.p), spec.magnitude(rows, tok_p)  # the error model, the same
    for name in mag:
        np.testing.assert_array_equal(mag[name], mag_rows[name], err_msg=name)


def test_a_bad_layout_exits_2_with_one_line(capsys):
    bad = ",".join(f"{k}={v}" for k, v in dict(FLAT, attn_layout="heads").items())
    assert main(["repro", f"{OP}/cpu/fp32/{bad}/normal/seed=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attn_layout" in err[0] and "head_major" in err[0], err
    with pytest.raises(ValueError, match="attn_layout='heads'"):
        ref.attn_rows(np.zeros((2, 3, 4)), "heads")


@pytest.mark.parametrize("p", [HEADS, FLAT], ids=["heads", "flat"])
def test_the_c_kernel_head_major_is_the_token_major_kernel_on_the_gathered_rows(p):
    blocks = pytest.importorskip("kernel_parity.kernels.cpu.blocks")
    case, x = _inputs(p, "head_major")
    args, kw = _args(case, x)
    rows = np.ascontiguousarray(x["attn"].transpose(1, 0, 2).reshape(p["t"], -1))
    for qa in (True, False):
        got = blocks.outproj_mlp(*args, **kw, quantize_activations=qa)
        want = blocks.outproj_mlp(rows, *args[1:], **dict(kw, attn_layout="token_major"), quantize_activations=qa)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with pytest.raises(ValueError, match=rf"attn \(head_major\) must be a float32 array \(h_q, T = {p['t']}, a_d\)"):
        blocks.outproj_mlp(rows, *args[1:], **kw)


@pytest.mark.parametrize("p", [HEADS, FLAT], ids=["heads", "flat"])
def test_the_torch_and_triton_paths_match_their_token_major_runs(p):
    torch = pytest.importorskip("torch")
    from kernel_parity.kernels.torch import blocks as tb
    case, x = _inputs(p, "head_major")
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    args, kw = _args(case, t)
    rows = t["attn"].transpose(0, 1).reshape(p["t"], -1).contiguous()
    tok = dict(kw, attn_layout="token_major")
    paths = [tb]
    if not interpreter_ready():
        from kernel_parity.kernels.triton import blocks as trb
        paths.append(trb)
    for mod in paths:
        got, want = mod.outproj_mlp(*args, **kw), mod.outproj_mlp(rows, *args[1:], **tok)
        for name in want:
            assert torch.equal(got[name], want[name]), (mod.__name__, name)


def test_ci_runs_the_head_major_input_on_every_kernel_backend_with_t_above_h_q():
    cases = [(set(c["backends"]), q) for c in suites.load_doc("ci")["cases"] if c["op"] == OP for q in c["params"]]
    hm = [(b, q) for b, q in cases if q.get("attn_layout") == "head_major"]
    assert set().union(*(b for b, _ in hm)) >= {"cpu", "torch", "triton"}
    assert all(q["t"] > q["hq"] > 1 for _, q in hm)  # layouts differ; a head at h_q a_d stays in the buffer
    assert {q["wo_layout"] for _, q in hm} == {"flat", "head_major"}
