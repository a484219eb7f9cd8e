"""Self-tests of the C blocks (kernels/cpu/blocks.c) beyond the gate: the bits do not depend on the SIMD
path, and the launchers refuse bad input with a ValueError naming it."""

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.conformance.runner import Prepared

blocks = pytest.importorskip("kernel_parity.kernels.cpu.blocks")

DECODE = dict(e=120, epad=8, hq=8, hkv=2, d=30, dpad=2, pos=70, cap=72, wqkv="q8_0", wo="q8_0", bias=1, obias=1,
              residual=1, style="half", theta=10000, eps="1e-6", gemma=0)


def _decode_args(p, x):
    return ((x["x"], x["gamma"], float(p["eps"]), (p["wqkv"], x["wq"]), (p["wqkv"], x["wk"]), (p["wqkv"], x["wv"]),
             (p["wo"], x["wo"]), x["k_cache"], x["v_cache"], x["cos"], x["sin"], p["pos"]),
            dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x.get("bq"), bk=x.get("bk"), bv=x.get("bv"),
                 bo=x.get("bo"), residual=x.get("r"), style=p["style"], gemma=bool(p["gemma"])))


def _inputs(op, p, dist="blocks", seed=3):
    case = ops.make_case(op, "cpu", "fp32", p, dist, seed)
    return {k: np.array(v, copy=True) for k, v in Prepared(ops.get(op), case).inputs.items()}


@pytest.mark.parametrize("wfmt", ["q8_0", "q5_0", "f32"])
def test_decode_bits_do_not_depend_on_the_simd_path(wfmt):
    p = dict(DECODE, wqkv=wfmt, wo=wfmt)
    best = blocks.isa()
    runs = {}
    try:
        for cap in sorted({0, min(1, best), best}):
            blocks.isa(cap)
            x = _inputs("blocks.attention_decode", p)
            args, kw = _decode_args(p, x)
            out = blocks.attention_decode(*args, **kw)
            runs[cap] = {**out, "k_cache": x["k_cache"], "v_cache": x["v_cache"]}
    finally:
        blocks.isa(2)
    first = runs[min(runs)]
    for cap, got in runs.items():
        for name, a in got.items():
            assert np.array_equal(a.view(np.uint32), first[name].view(np.uint32)), \
                f"{name}: the bits on SIMD path {cap} differ from path {min(runs)} ({wfmt})"


def test_launchers_refuse_bad_input():
    x = _inputs("blocks.attention_decode", DECODE)
    args, kw = _decode_args(DECODE, x)
    bad = [
        (dict(h_q=7), "h_q=7 must be a positive multiple of h_kv"),
        (dict(d=31), "d=31 must be an even int"),
        (dict(style="neox"), "style must be one of"),
        (dict(bq=np.zeros(3, np.float32)), "bq must have shape"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            blocks.attention_decode(*args, **{**kw, **change})
    a = list(args)
    a[11] = 72  # pos past the cache
    with pytest.raises(ValueError, match="pos=72"):
        blocks.attention_decode(*a, **kw)
    a = list(args)
    a[3] = ("q4_k", x["wq"])
    with pytest.raises(ValueError, match="q4_k needs K = 128 to be a multiple of its block of 256"):
        blocks.attention_decode(*a, **kw)
    a = list(args)
    a[7] = np.asfortranarray(x["k_cache"])
    with pytest.raises(ValueError, match="k_cache must be C-contiguous"):
        blocks.attention_decode(*a, **kw)
    with pytest.raises(ValueError, match="w1 must be a \\(format, array\\) pair"):
        blocks.mlp(np.zeros((2, 64), np.float32), np.ones(64, np.float32), 1e-6, "q8_0", ("q8_0", x["wq"]), n=64)
