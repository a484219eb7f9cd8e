"""The MoE alignment golden (refimpl/moe_align.py, vLLM's moe_align_block_size) against a plain-Python transcription
of the CUDA kernel's serial algorithm (histogram, cumsum of the padded counts, a scatter in slot order), a worked
example, its edges (T k < B, counts on multiples of B and one past, E = 1, B = 1, T = 0) and its refusals, which
the kernels share (kernels/moe_args.py): the same line from the golden and every kernel."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kernel_parity.refimpl import moe

torch = pytest.importorskip("torch")


def _serial(ids: np.ndarray, E: int, B: int):
    """vLLM's moe_align_block_size_kernel, one thread: counts, padded cumsum, expert_ids per block, then each
    slot placed at its expert's cursor (slot order: the declared stable order); the buffers pre-filled as vLLM's
    wrapper does (sorted_ids with numel), expert_ids' tail -1 (declared)."""
    flat = [int(v) for v in ids.reshape(-1)]
    n = len(flat)
    P = n + E * (B - 1)
    counts = [0] * E
    for v in flat:
        counts[v] += 1
    cumsum = [0] * (E + 1)
    for e in range(E):
        cumsum[e + 1] = cumsum[e] + (counts[e] + B - 1) // B * B
    sorted_ids = [n] * P
    expert_ids = [-1] * (-(-P // B))
    for e in range(E):
        for i in range(cumsum[e], cumsum[e + 1], B):
            expert_ids[i // B] = e
    cursor = cumsum[:E]
    for s, v in enumerate(flat):
        sorted_ids[cursor[v]] = s
        cursor[v] += 1
    return np.array(sorted_ids), np.array(expert_ids), np.array([cumsum[E]])


def _eq(got, want):
    for g, w in zip(got, want):
        assert g.dtype == np.int32
        np.testing.assert_array_equal(g, w)


def test_worked_example():
    ids = np.array([[0, 2], [1, 2], [2, 0]], np.int32)  # slots: e0 {0, 5}, e1 {2}, e2 {1, 3, 4}, e3 none
    s, x, p = moe.align(ids, 4, 4)
    assert s.tolist() == [0, 5, 6, 6, 2, 6, 6, 6, 1, 3, 4, 6] + [6] * 6  # P = 6 + 4 x 3 = 18
    assert x.tolist() == [0, 1, 2, -1, -1]  # ceil(18 / 4) blocks
    assert p.tolist() == [12]


@pytest.mark.parametrize("T,k,E,B", [(37, 2, 8, 16), (23, 8, 256, 16), (19, 8, 128, 64), (1, 1, 8, 128),
                                     (200, 4, 3, 7), (50, 6, 60, 1), (4, 2, 1, 32)])
def test_matches_the_serial_algorithm(T, k, E, B):
    rng = np.random.default_rng(T * 1000 + E)
    for ids in (rng.integers(0, E, (T, k)), np.argsort(rng.random((T, E)), axis=1)[:, :k] if k <= E else None):
        if ids is not None:
            ids = ids.astype(np.int32)
            _eq(moe.align(ids, E, B), _serial(ids, E, B))


def test_counts_on_and_one_past_a_block():
    E, B = 8, 16
    on = np.tile(np.arange(E, dtype=np.int32), (B, 1))  # every expert exactly B slots: no padding at all
    s, x, p = moe.align(on, E, B)
    assert p[0] == E * B and (s[: E * B] < on.size).all() and (s[E * B:] == on.size).all()
    assert x[:E].tolist() == list(range(E)) and (x[E:] == -1).all()
    past = np.tile(np.arange(E, dtype=np.int32), (B + 1, 1))  # B + 1 each: two blocks, B - 1 padding
    s, x, p = moe.align(past, E, B)
    assert p[0] == E * 2 * B and x[: 2 * E].tolist() == [e for e in range(E) for _ in (0, 1)]
    seg = s[: 2 * B]
    assert (seg[: B + 1] < past.size).all() and (seg[B + 1:] == past.size).all()


def test_fewer_slots_than_a_block_and_the_edges():
    s, x, p = moe.align(np.array([[5, 1]], np.int32), 8, 16)  # T k = 2 < B
    assert p[0] == 32 and s[0] == 1 and s[16] == 0 and (np.delete(s, [0, 16]) == 2).all()
    assert x.tolist()[:2] == [1, 5] and (x[2:] == -1).all() and s.size == 2 + 8 * 15
    s, x, p = moe.align(np.array([[0], [0], [0]], np.int32), 1, 1)  # E = 1, B = 1: no padding, P = T k
    assert s.tolist() == [0, 1, 2] and x.tolist() == [0, 0, 0] and p.tolist() == [3]
    s, x, p = moe.align(np.zeros((0, 2), np.int32), 3, 4)  # T = 0
    assert s.tolist() == [0] * 9 and x.tolist() == [-1] * 3 and p.tolist() == [0]


def test_repeated_experts_in_a_token_are_slots_like_any_other():
    ids = np.array([[2, 2], [0, 2]], np.int32)
    _eq(moe.align(ids, 3, 2), _serial(ids, 3, 2))


def test_vectorised_at_a_prefill_chunk():
    """4096 tokens x top-8 of 256 experts (DeepSeek-V3) at B 16: the serial transcription's answer, well under a
    second (the gate calls the golden per case)."""
    ids = np.argsort(np.random.default_rng(3).random((4096, 256)), axis=1)[:, :8].astype(np.int32)
    t0 = time.perf_counter()
    got = moe.align(ids, 256, 16)
    assert time.perf_counter() - t0 < 1.0
    _eq(got, _serial(ids, 256, 16))


BAD = [
    (np.zeros((2, 2), np.float32), 8, 16, "int32"), (np.zeros(4, np.int32), 8, 16, r"\(T, k\)"),
    (np.zeros((2, 2), np.int64), 8, 16, "int32"), (np.array([[0, 8]], np.int32), 8, 16, "expert id 8"),
    (np.array([[-1, 0]], np.int32), 8, 16, "expert id -1"), (np.zeros((2, 2), np.int32), 0, 16, "num_experts=0"),
    (np.zeros((2, 2), np.int32), 8, 0, "block_size=0"), (np.zeros((2, 2), np.int32), 8, True, "block_size=True"),
    (np.zeros((2, 2), np.int32), "8", 16, "num_experts='8'"),
    (np.zeros((2, 2), np.int32), 16, 2**28, "do not fit int32"),
]


@pytest.mark.parametrize("ids,E,B,match", BAD)
def test_refuses_bad_arguments(ids, E, B, match):
    with pytest.raises(ValueError, match=match):
        moe.align(ids, E, B)


@pytest.mark.parametrize("ids,E,B,match", BAD)
def test_the_kernels_refuse_as_the_golden_does(ids, E, B, match):
    """The kernels' shared rules (kernels/moe_args.py) and the golden's own: the same refusal, the same line."""
    from kernel_parity.conformance.backends.triton_prep import prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 kept (not monkeypatched) before triton's first import: later runs need it
    from kernel_parity.kernels.cpu import moe_align as cpu
    from kernel_parity.kernels.torch import moe_align as eager
    from kernel_parity.kernels.triton import moe_align as tri

    msgs = set()
    for f, x in ((moe.align, ids), (cpu.align, ids), (eager.align, torch.from_numpy(ids)),
                 (tri.align, torch.from_numpy(ids))):
        with pytest.raises(ValueError) as e:
            f(x, E, B)
        msgs.add(str(e.value))
    assert len(msgs) == 1, msgs
    assert "\n" not in msgs.pop()
