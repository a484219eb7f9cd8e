"""The SwiGLU / GeGLU launchers of every built-in backend: bad input is a ValueError naming the shape,
dtype or value, and views of a padded buffer (row strides past the width) are read and written in
place without a copy (Triton through the interpreter on CPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton
torch = pytest.importorskip("torch")

import kernel_parity.refimpl.mlp as ref  # noqa: E402
from kernel_parity.kernels.cpu import mlp as cpu  # noqa: E402
from kernel_parity.kernels.torch import mlp as eager  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    from kernel_parity.kernels.triton import mlp

    return mlp


def test_cpu_bad_input_names_it():
    h = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match=r"even width 2i, got shape \(3, 7\)"):
        cpu.swiglu_fused(np.zeros((3, 7), np.float32))
    with pytest.raises(ValueError, match="dtype must be one of"):
        cpu.swiglu(np.zeros((2, 4), np.float64), np.zeros((2, 4), np.float64))
    with pytest.raises(ValueError, match=r"up must match gate"):
        cpu.swiglu(h[:, :4], np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match=r"unknown gelu approximation 'sigmoid'"):
        cpu.geglu_fused(h, "sigmoid")
    with pytest.raises(ValueError, match="must be 2-D"):
        cpu.swiglu(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="out overlaps gate or up"):
        cpu.swiglu(h[:, :4], h[:, 4:], out=h[:, :4])
    with pytest.raises(ValueError, match="last-axis stride must be 1"):
        cpu.swiglu(h[:, ::2], h[:, 1::2])


def test_triton_bad_input_names_it(tri):
    h = torch.zeros((3, 8))
    with pytest.raises(ValueError, match=r"even width 2i, got shape \(3, 7\)"):
        tri.swiglu_fused(torch.zeros((3, 7)))
    with pytest.raises(ValueError, match="dtype torch.float64 not supported"):
        tri.swiglu(torch.zeros((2, 4), dtype=torch.float64), torch.zeros((2, 4), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"unknown gelu approximation 'sigmoid'"):
        tri.geglu(h[:, :4], h[:, 4:], "sigmoid")
    with pytest.raises(ValueError, match=r"out must be \(3, 4\)"):
        tri.swiglu(h[:, :4], h[:, 4:], out=torch.zeros((3, 5)))
    with pytest.raises(ValueError, match="last-dim stride 1"):
        tri.swiglu(h[:, ::2], h[:, 1::2])


def test_eager_bad_input_names_it():
    with pytest.raises(ValueError, match=r"even width 2i, got shape \(3, 7\)"):
        eager.halves(torch.zeros((3, 7)))
    with pytest.raises(ValueError, match=r"unknown gelu approximation 'sigmoid'"):
        eager.geglu(torch.zeros((2, 4)), torch.zeros((2, 4)), "sigmoid")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_padded_views_are_read_and_written_in_place(tri, dtype):
    """Rows of a wider buffer: h with 5 padding columns a row, out with 3; the padding stays NaN."""
    rng = np.random.default_rng(1)
    np_dt = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}[dtype]
    t, i = 4, 37
    h_buf = np.full((t, 2 * i + 5), np.nan, np_dt)
    h_buf[:, : 2 * i] = (rng.standard_normal((t, 2 * i)) * 3).astype(np_dt)
    h = h_buf[:, : 2 * i]
    want = ref.geglu(*ref.split(h.astype(np.float64)), approx="erf")
    bound = 1e-5 + (2.0**-8 if dtype == "bf16" else 2e-6) * np.abs(want)
    out_buf = np.full((t, i + 3), np.nan, np_dt)
    cpu.geglu_fused(h, "erf", out=out_buf[:, :i])
    assert np.all(np.abs(out_buf[:, :i].astype(np.float64) - want) <= bound)
    assert np.isnan(out_buf[:, i:].astype(np.float64)).all()
    th = torch.from_numpy(h_buf.view(np.int16) if dtype == "bf16" else h_buf)
    th = th.view(torch.bfloat16) if dtype == "bf16" else th
    t_out = torch.full((t, i + 3), float("nan"), dtype=th.dtype)
    tri.geglu_fused(th[:, : 2 * i], "erf", out=t_out[:, :i])
    got = t_out[:, :i].float().double().numpy()
    assert np.all(np.abs(got - want) <= bound)
    assert torch.isnan(t_out[:, i:]).all()
