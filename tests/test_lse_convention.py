"""The LSE of an empty row (seed audit S22): the project's -inf, FlashMLA's / FlashAttention's +inf, and
the one declared conversion adapters apply (conformance/lse.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from kernel_parity.conformance.lse import (FLASH_EMPTY_ROW_LSE, PROJECT_EMPTY_ROW_LSE,
                                           empty_row_lse_to_neg_inf)
from kernel_parity.refimpl import attention as attention_ref

VALUES = [math.inf, -math.inf, math.nan, 1.5, 0.0, -3.25, 88.0]
WANT = [-math.inf, -math.inf, math.nan, 1.5, 0.0, -3.25, 88.0]


def test_the_conventions_are_ln0_and_its_negation():
    assert PROJECT_EMPTY_ROW_LSE == -math.inf and FLASH_EMPTY_ROW_LSE == math.inf


def test_the_golden_writes_minus_inf_for_an_empty_row():
    # s_q 3 > s_k 1 with bottom-right causal: query rows 0 and 1 see no key (the project's convention)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 3, 1, 8)), rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8))
    o, lse, _ = attention_ref.attention(q, k, v, causal="bottom_right")
    assert np.all(lse[0, 0, :2] == PROJECT_EMPTY_ROW_LSE) and np.isfinite(lse[0, 0, 2])
    assert np.all(o[0, :2] == 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_plus_inf_becomes_minus_inf_and_nothing_else_changes(dtype):
    a = np.array(VALUES, dtype=dtype).reshape(7, 1)
    before = a.copy()
    got = empty_row_lse_to_neg_inf(a)
    assert got.dtype == dtype and got.shape == a.shape
    np.testing.assert_array_equal(got, np.array(WANT, dtype=dtype).reshape(7, 1))  # NaN compares equal here
    np.testing.assert_array_equal(a, before)  # a new array: the kernel's output is not written


def test_torch_plus_inf_becomes_minus_inf_on_the_tensor_s_device_and_dtype():
    torch = pytest.importorskip("torch")
    t = torch.tensor(VALUES, dtype=torch.float32)
    got = empty_row_lse_to_neg_inf(t)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device == t.device
    assert torch.equal(torch.isnan(got), torch.isnan(torch.tensor(WANT)))
    np.testing.assert_array_equal(got.numpy(), np.array(WANT, dtype=np.float32))
    assert t[0].item() == math.inf  # the input is not modified


def test_fa4_adapter_hands_the_judge_the_project_convention(monkeypatch):
    """flash-attn-4 returns +inf for an empty row; its adapter must pass -inf on (and keep finite rows)."""
    torch = pytest.importorskip("torch")
    from kernel_parity.conformance.backends import flash_attn4

    lib_lse = torch.tensor([[[math.inf, 0.75, math.inf]]])  # (b, h_q, s_q): rows 0 and 2 empty
    monkeypatch.setattr(flash_attn4, "_call", lambda p, q, k, v, sinks: (torch.zeros(1, 3, 1, 8), lib_lse))
    x = {n: np.zeros((1, 3, 1, 8), dtype=np.float32) for n in ("q", "k", "v")}
    got = flash_attn4._prefill(SimpleNamespace(p={"sink": 0}), x, SimpleNamespace(device="cpu"))
    np.testing.assert_array_equal(got["lse"].numpy(), np.array([[[-math.inf, 0.75, -math.inf]]], dtype=np.float32))
