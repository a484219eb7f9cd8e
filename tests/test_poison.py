"""Poisoned outputs and canaries catch unwritten elements and out-of-bounds writes."""

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.poison import CANARY, OutputRequest, is_poison, poison_array


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp64"])
def test_poison_is_a_recognisable_nan(name):
    d = dt.get(name)
    p = poison_array(4, d)
    with np.errstate(invalid="ignore"):  # casting a signalling NaN warns
        assert np.all(np.isnan(p.astype(np.float64)))
    assert np.all(is_poison(p, d))
    assert not np.any(is_poison(np.full(4, np.nan, dtype=d.np), d))  # a computed NaN is not poison


def _request(pads=None):
    return OutputRequest({"y": (3, 5), "lse": (3,)}, {"y": dt.get("bf16"), "lse": dt.get("fp32")}, pads or {})


def test_clean_write_leaves_canaries_intact():
    req = _request({"y": 2})
    y, lse = req.numpy("y"), req.numpy("lse")
    y[...] = np.ones((3, 5), dtype=ml_dtypes.bfloat16)
    lse[...] = 0
    assert req.damage() == {}
    assert y.strides == (7 * 2, 2)  # padded rows


def test_write_past_the_end_is_caught():
    req = _request()
    y = req.numpy("y")
    y[...] = 1
    y.base[CANARY + 15] = 1  # the first element after the output
    assert "after the output" in req.damage()["y"]


def test_write_before_the_start_is_caught():
    req = _request()
    lse = req.numpy("lse")
    lse.base[CANARY - 1] = 0
    assert "before the output" in req.damage()["lse"]


def test_write_into_row_padding_is_caught():
    req = _request({"y": 2})
    y = req.numpy("y")
    y.base[CANARY + 5] = 0  # row 0, first padding element
    assert "row padding" in req.damage()["y"]


def test_torch_buffers_are_poisoned_the_same_way():
    torch = pytest.importorskip("torch")
    req = _request({"y": 1})
    y = req.torch("y", "cpu")
    assert y.dtype == torch.bfloat16 and y.stride() == (6, 1)
    from kernel_parity.conformance.poison import tensor_to_numpy

    assert np.all(is_poison(tensor_to_numpy(y, dt.get("bf16")), dt.get("bf16")))
    y.fill_(1.0)
    assert req.damage() == {}
    y.as_strided((1,), (1,), y.storage_offset() + 15 + 2).fill_(0.0)  # past the end
    assert "y" in req.damage()
