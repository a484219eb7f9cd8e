"""The norm launchers (Triton, C, eager torch): bad input is a ValueError naming the shape, dtype or
value; the C and Triton kernels agree with each other bit for bit-ish on plain rows and accept
strided rows (a row stride past the aligned width) without copying."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton


def _rows(rows=3, aw=20, n=17, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((rows, aw), dtype=dtype)
    x[:, :n] = rng.standard_normal((rows, n)).astype(dtype)
    return x


CPU_BAD = [
    (dict(x=np.zeros((3,), np.float32)), "x must be 2-D"),
    (dict(x=np.zeros((3, 4), np.float64)), "x dtype"),
    (dict(n=5), r"real width n=5 must be an integer in \[1, 4\]"),
    (dict(n=0), r"real width n=0"),
    (dict(eps=-1.0), "eps=-1.0"),
    (dict(eps=float("nan")), "eps=nan"),
    (dict(w=np.ones(2, np.float32)), "w must be a 1-D numpy.ndarray with at least n=4 lanes"),
    (dict(w=np.ones(4, np.float16)), "w dtype must be x's"),
    (dict(out=np.zeros((3, 5), np.float32)), "out must have shape"),
]


@pytest.mark.parametrize("change, message", CPU_BAD)
def test_cpu_bad_input_is_a_value_error(change, message):
    from kernel_parity.kernels.cpu import norm as k

    args = dict(x=np.zeros((3, 4), np.float32), w=np.ones(4, np.float32), eps=1e-6, n=None, out=None)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        k.rms_norm(args["x"], args["w"], args["eps"], n=args["n"], out=args["out"])
    with pytest.raises(ValueError, match=message):
        k.layer_norm(args["x"], args["w"], None, args["eps"], n=args["n"], out=args["out"])


def test_cpu_refuses_overlap_and_orphan_outputs():
    from kernel_parity.kernels.cpu import norm as k

    x = _rows()
    with pytest.raises(ValueError, match="out overlaps"):
        k.rms_norm(x, None, 1e-6, out=x)
    with pytest.raises(ValueError, match="out_h given without a residual"):
        k.rms_norm(x, None, 1e-6, out_h=np.zeros_like(x))
    with pytest.raises(ValueError, match="gemma=True needs a weight"):
        k.rms_norm(x, None, 1e-6, gemma=True)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        k.rms_norm(x, None, 1e-6, residual=np.zeros((3, 19), np.float32))
    with pytest.raises(ValueError, match="last-axis stride must be 1"):
        k.rms_norm(np.zeros((3, 8), np.float32)[:, ::2], None, 1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_cpu_strided_rows_and_padding(dtype):
    """A row stride past the aligned width is used as is; padding lanes come out +0."""
    from kernel_parity.kernels.cpu import norm as k

    big = _rows(rows=4, aw=40, n=17, dtype=dtype)
    x = big[:, :20]  # row stride 40, aligned width 20, real width 17
    w = np.ones(20, dtype)
    y, _, rstd = k.rms_norm(x, w, 1e-6, n=17, out_rstd=np.zeros(4, np.float32))
    ref = x.astype(np.float64)[:, :17]
    want = ref / np.sqrt((ref * ref).mean(axis=1, keepdims=True) + 1e-6)
    eps = np.finfo(np.float32).eps if dtype == np.float32 else float(ml_dtypes.finfo(dtype).eps)
    assert np.max(np.abs(y[:, :17].astype(np.float64) - want)) <= 2 * eps * np.abs(want).max()
    assert np.all(y[:, 17:].astype(np.float64) == 0) and np.all(np.signbit(y[:, 17:].astype(np.float32)) == 0)
    assert rstd.dtype == np.float32


@pytest.fixture(scope="module")
def tk():
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    from kernel_parity.kernels.triton import norm as k

    return k


def test_triton_bad_input_is_a_value_error(tk):
    import torch

    x = torch.zeros(3, 4)
    cases = [
        (lambda: tk.rms_norm(torch.zeros(4), None, 1e-6), "x must be a 2-D tensor"),
        (lambda: tk.rms_norm(x.double(), None, 1e-6), "x dtype torch.float64 not supported"),
        (lambda: tk.rms_norm(x, None, 1e-6, n=5), r"real width n=5 must be an integer in \[1, 4\]"),
        (lambda: tk.rms_norm(x, torch.ones(3), 1e-6), "w must be 1-D with at least n=4 lanes"),
        (lambda: tk.rms_norm(x, None, -1.0), "eps=-1.0"),
        (lambda: tk.rms_norm(x, None, 1e-6, gemma=True), "gemma=True needs a weight"),
        (lambda: tk.rms_norm(x, None, 1e-6, residual=torch.zeros(3, 5)), r"residual must be \(3, 4\)"),
        (lambda: tk.rms_norm(x, None, 1e-6, out=torch.zeros(3, 4, dtype=torch.float16)), r"out must be \(3, 4\)"),
        (lambda: tk.rms_norm(x, None, 1e-6, out_rstd=torch.zeros(3, dtype=torch.float16)), "out_rstd must be"),
        (lambda: tk.rms_norm(torch.zeros(3, 8)[:, ::2], None, 1e-6), "last-dim stride 1"),
        (lambda: tk.layer_norm(x, None, torch.ones(2), 1e-5), "b must be 1-D"),
        (lambda: tk.layer_norm(x, None, None, 1e-5, out_mean=torch.zeros(3)), "both or neither"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("n, pad", [(17, 16), (128, 1)])
def test_triton_matches_c_and_zeroes_padding(tk, n, pad):
    """Strided rows (row stride past the aligned width), padding past next_pow2(n): the Triton
    and C kernels agree to an fp32 rounding and both write +0 in the padding lanes."""
    import torch

    from kernel_parity.kernels.cpu import norm as kc

    big = _rows(rows=5, aw=n + pad + 7, n=n, seed=n)
    x = big[:, : n + pad]
    r = _rows(rows=5, aw=n + pad, n=n, seed=n + 1)
    w = np.random.default_rng(2).standard_normal(n + pad).astype(np.float32)
    yc, hc, rc = kc.rms_norm(x, w, 1e-6, n=n, gemma=True, residual=r, out_rstd=np.zeros(5, np.float32))
    yt, ht, rt = tk.rms_norm(torch.from_numpy(big)[:, : n + pad], torch.from_numpy(w), 1e-6, n=n, gemma=True,
                             residual=torch.from_numpy(r), out_rstd=torch.zeros(5))
    np.testing.assert_allclose(yt.numpy(), yc, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ht.numpy(), hc)
    np.testing.assert_allclose(rt.numpy(), rc, rtol=1e-6)
    assert not yt[:, n:].any() and not torch.signbit(yt[:, n:]).any() and not ht[:, n:].any()
    lc, mc, sc = kc.layer_norm(x, w, w, 1e-5, n=n, out_mean=np.zeros(5, np.float32), out_rstd=np.zeros(5, np.float32))
    lt, mt, st = tk.layer_norm(torch.from_numpy(big)[:, : n + pad], torch.from_numpy(w), torch.from_numpy(w), 1e-5,
                               n=n, out_mean=torch.zeros(5), out_rstd=torch.zeros(5))
    np.testing.assert_allclose(lt.numpy(), lc, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(mt.numpy(), mc)  # both the correctly rounded fp32 of an fp64 mean
    np.testing.assert_allclose(st.numpy(), sc, rtol=1e-6)
    assert not lt[:, n:].any()


def test_torch_baseline_bad_input():
    torch = pytest.importorskip("torch")
    from kernel_parity.kernels.torch import norm as k

    with pytest.raises(ValueError, match="x must be 2-D"):
        k.rms_norm(torch.zeros(4), None, 1e-6)
    with pytest.raises(ValueError, match=r"real width n=9 must be in \[1, 8\]"):
        k.layer_norm(torch.zeros(2, 8), None, None, 1e-5, n=9)
    with pytest.raises(ValueError, match="gemma=True needs a weight"):
        k.rms_norm(torch.zeros(2, 8), None, 1e-6, gemma=True)
