"""The rope launchers (kernels/cpu/rope.py, kernels/triton/rope.py) refuse bad input with a
ValueError naming the shape, dtype or value, before anything runs or is written."""

import numpy as np
import pytest

T, H, D, ROT, MAXSEQ = 4, 2, 16, 8, 10


def _numpy_args():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.arange(T, dtype=np.int32)
    cos = np.ones((MAXSEQ, ROT // 2), dtype=np.float32)
    return x, pos, cos, np.zeros_like(cos)


CPU_BAD = [
    (lambda x, p, c, s: dict(x=x.astype(np.float64)), "dtype"),
    (lambda x, p, c, s: dict(x=x[0]), r"\(t, h, d\)"),
    (lambda x, p, c, s: dict(rot=7), "rot=7"),
    (lambda x, p, c, s: dict(rot=18), "rot=18"),
    (lambda x, p, c, s: dict(style="neox"), "style='neox'"),
    (lambda x, p, c, s: dict(at="middle"), "at='middle'"),
    (lambda x, p, c, s: dict(positions=p + MAXSEQ), "max_seq = 10"),
    (lambda x, p, c, s: dict(positions=p.astype(np.int64)), "positions"),
    (lambda x, p, c, s: dict(cos=c[:, :3], sin=s[:, :3]), "rot/2 = 4"),
    (lambda x, p, c, s: dict(cos=None, sin=None, table=np.stack([c, s], -1)[..., :1]), "pairs"),
    (lambda x, p, c, s: dict(cos=None, sin=None, theta=0.5), "theta=0.5"),
    (lambda x, p, c, s: dict(cos=None, sin=None, theta=1e4, scaling="yarn"), "scaling='yarn'"),
    (lambda x, p, c, s: dict(scaling="llama3"), "theta= only"),
    (lambda x, p, c, s: dict(out=np.empty((T, H, D), np.float16)), "out"),
]


@pytest.mark.parametrize("bad, match", CPU_BAD)
def test_cpu_rope_rejects_bad_input(bad, match):
    from kernel_parity.kernels.cpu import rope as k

    x, pos, cos, sin = _numpy_args()
    kw = dict(x=x, positions=pos, cos=cos, sin=sin, rot=ROT) | bad(x, pos, cos, sin)
    with pytest.raises(ValueError, match=match):
        k.rope(kw.pop("x"), kw.pop("positions"), **kw)


def test_cpu_kv_update_rejects_writes_that_do_not_fit():
    from kernel_parity.kernels.cpu import rope as k

    rng = np.random.default_rng(1)
    cache = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    new = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)
    table = np.zeros((8, 8, 2), dtype=np.float16)
    before = cache.copy()
    with pytest.raises(ValueError, match="do not fit"):
        k.kv_update(cache, cache.copy(), new, new.copy(), np.array([0, 6], dtype=np.int32), table)
    with pytest.raises(ValueError, match="rot/2 = 8"):
        k.kv_update(cache, cache.copy(), new, new.copy(), np.array([0, 1], dtype=np.int32), table[:, :4])
    assert np.array_equal(cache, before)  # nothing written


def test_triton_rope_rejects_bad_input():
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 before the kernel module is imported, as the backend does
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    import torch

    from kernel_parity.kernels.triton import rope as k

    x, pos, cos, sin = (torch.from_numpy(a) for a in _numpy_args())
    cases = [
        (dict(rot=7), "rot=7"), (dict(style="neox"), "style='neox'"), (dict(at="middle"), "at='middle'"),
        (dict(positions=pos.long()), "int32"), (dict(cos=cos[:, :3], sin=sin[:, :3]), "rot/2 = 4"),
        (dict(theta=1e4), "not both"), (dict(x=x.double()), "dtype"), (dict(out=torch.empty(T, H, D + 1)), "out"),
    ]
    for bad, match in cases:
        kw = dict(x=x, positions=pos, cos=cos, sin=sin, rot=ROT) | bad
        with pytest.raises(ValueError, match=match):
            k.rope(kw.pop("x"), kw.pop("positions"), **kw)


def test_theta_limits_grow_with_the_largest_position():
    """table=theta: rtol, the scale-aware atol and cos_diff / nmse grow with eps32 x p_max w_1, the largest
    rounded fp32 angle (w_0 = 1 keeps the first exact); a given table keeps the dtype's aggregate limits."""
    from kernel_parity.conformance import dtypes as dt
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.tolerance import DTYPE_DEFAULTS
    from kernel_parity.refimpl.rope import inv_freq

    spec = ops.get("rope.rope")
    eps32 = dt.get("fp32").eps
    p = dict(table="theta", maxseq=4097, pos="random", start=0, t=7, rot=64, theta=10000, scaling="none")
    for dtype in ("fp32", "fp16", "bf16"):
        base, d = DTYPE_DEFAULTS[dtype], dt.get(dtype)
        lim = spec.tolerance.limits("y", d, p)
        acc = eps32 * 4096 * inv_freq(64, 10000.0)[1]
        assert lim.rtol == pytest.approx(base.rtol + acc)
        assert lim.cos_diff == pytest.approx(base.cos_diff + acc**2) and lim.nmse == pytest.approx(base.nmse + 2 * acc**2)
        assert lim.atol_max_eps * d.eps == pytest.approx(2 * acc)
        table = spec.tolerance.limits("y", d, dict(p, table="cis"))
        assert table.cos_diff == pytest.approx(base.cos_diff + 2 * eps32**2)


def test_rope_backward_in_place_equals_a_separate_dx_and_a_partial_overlap_is_refused():
    """out=dy (C-Kernel-Engine's rope_backward_qk: dx over dy) gives a separate dx's bits, both pairings;
    an out that overlaps dy one element over is refused before anything is written."""
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()
    import torch

    from kernel_parity.kernels.cpu import rope as kc

    _, pos, _, _ = _numpy_args()
    ang = np.random.default_rng(2).uniform(0, 6.3, (MAXSEQ, ROT // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    buf = np.random.default_rng(3).standard_normal(T * H * D + 1).astype(np.float32)
    dy = buf[:-1].reshape(T, H, D)
    for style in ("half", "interleaved"):
        want = kc.rope_backward(dy, pos, cos=cos, sin=sin, rot=ROT, style=style)
        got = dy.copy()
        assert kc.rope_backward(got, pos, cos=cos, sin=sin, rot=ROT, style=style, out=got) is got
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), style
    with pytest.raises(ValueError, match="overlaps"):
        kc.rope_backward(dy, pos, cos=cos, sin=sin, rot=ROT, out=buf[1:].reshape(T, H, D))
    if interpreter_ready():
        return
    from kernel_parity.kernels.triton import rope as kt

    tdy, tpos, tcos, tsin = (torch.from_numpy(a) for a in (dy.copy(), pos, cos, sin))
    for style in ("half", "interleaved"):
        want = kt.rope_backward(tdy, tpos, cos=tcos, sin=tsin, rot=ROT, style=style)
        got = tdy.clone()
        assert kt.rope_backward(got, tpos, cos=tcos, sin=tsin, rot=ROT, style=style, out=got) is got
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), style
    tbuf = torch.from_numpy(buf.copy())
    with pytest.raises(ValueError, match="overlaps"):
        kt.rope_backward(tbuf[:-1].view(T, H, D), tpos, cos=tcos, sin=tsin, rot=ROT, out=tbuf[1:].view(T, H, D))
