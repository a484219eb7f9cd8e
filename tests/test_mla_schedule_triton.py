"""The Triton FlashMLA scheduler (kernels/triton/mla_schedule.py) against refimpl.mla.schedule, in the
interpreter on CPU: one program over the batch, a batch longer than one 1024-request chunk, idle parts."""

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
from kernel_parity.kernels.triton.mla_schedule import get_mla_metadata  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("L, sq, hq, hkv, sms, floor", [
    ([0], 1, 16, 1, 132, True),                                          # one empty request, 131 idle parts
    ([64, 0, 0, 1, 65, 4096], 2, 64, 1, 132, True),                       # the floor binds
    ([64, 0, 0, 1, 65, 4096], 2, 64, 1, 132, False),
    (np.random.default_rng(1).integers(0, 3000, 1100).tolist(), 1, 16, 1, 4, True),  # two 1024-chunks
    (np.random.default_rng(2).integers(0, 9000, 40).tolist(), 1, 128, 2, 114, True),  # h_kv 2
])
def test_triton_scheduler_equals_the_golden(L, sq, hq, hkv, sms, floor):
    parts = refimpl.mla.sm_parts(sms, sq, hq, hkv)
    meta, ns = refimpl.mla.schedule(np.asarray(L), sq, hq, parts, 64, hkv, payload_floor=floor)
    got_meta, got_ns = get_mla_metadata(torch.tensor(L, dtype=torch.int32, device=DEV), sq, hq, hkv, sms, floor)
    assert np.array_equal(got_meta.cpu().numpy(), meta) and np.array_equal(got_ns.cpu().numpy(), ns)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_sm_parts = 0"):
        get_mla_metadata(torch.zeros(2, dtype=torch.int32, device=DEV), 2, 128, 1, 3)
    with pytest.raises(ValueError, match="int32"):
        get_mla_metadata(torch.zeros(2, dtype=torch.int64, device=DEV), 1, 16, 1, 132)
