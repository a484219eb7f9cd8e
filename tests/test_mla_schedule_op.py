"""mla.schedule (FlashMLA's get_mla_metadata as a gated op): the kernels against the golden, the input
distributions (tight lands on the payload's boundaries), validation, and ci coverage."""

import numpy as np
import pytest

from kernel_parity import refimpl
import kernel_parity.refimpl.mla  # noqa: F401
from kernel_parity.conformance import ops, suites
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.ops import mla_schedule as S
from kernel_parity.conformance.runner import Prepared

F = 5
ID = "mla.schedule/cpu/int32/b={b},kv=300,sq={sq},hq={hq},hkv={hkv},sms={sms},floor=1/{dist}/seed=0"


def _batches():
    rng = np.random.default_rng(32)
    out = [([0], 1, 16, 1, 132), ([64, 0, 0, 1], 2, 64, 1, 132), ([10**6, 3, 0, 10**6 + 1], 1, 128, 1, 78)]
    for _ in range(25):
        b = int(rng.integers(1, 200))
        L = rng.integers(0, rng.choice([2, 65, 700, 20000]), b).tolist()
        sq, hq, hkv = int(rng.choice([1, 2])), int(rng.choice([16, 32, 64, 128])), int(rng.choice([1, 2]))
        out.append((L, sq, hq, hkv, int(rng.integers(hkv * 4, 300))))
    return out


def _golden(L, sq, hq, hkv, sms, floor):
    return refimpl.mla.schedule(np.asarray(L), sq, hq, refimpl.mla.sm_parts(sms, sq, hq, hkv), 64, hkv,
                                payload_floor=floor)


@pytest.mark.parametrize("floor", [True, False])
def test_cpu_and_torch_kernels_equal_the_golden(floor):
    from kernel_parity.kernels.cpu.mla_schedule import get_mla_metadata as c_sched
    torch = pytest.importorskip("torch")
    from kernel_parity.kernels.torch.mla_schedule import get_mla_metadata as t_sched

    for L, sq, hq, hkv, sms in _batches():
        if refimpl.mla.sm_parts(sms, sq, hq, hkv) < 1:
            continue
        meta, ns = _golden(L, sq, hq, hkv, sms, floor)
        for name, got in (("cpu", c_sched(np.asarray(L, np.int32), sq, hq, hkv, sms, floor)),
                          ("torch", [t.numpy() for t in t_sched(torch.tensor(L, dtype=torch.int32), sq, hq, hkv,
                                                                   sms, floor)])):
            assert np.array_equal(got[0], meta) and np.array_equal(got[1], ns), f"{name}: L={L[:6]}, sms={sms}"


def _events(L, parts, floor=True):
    """FlashMLA's greedy, counting the payload boundaries it meets."""
    n = [-(-int(x) // 64) for x in L]
    W = -(-sum(x + F for x in n) // parts) + F
    W = max(W, 2 * F) if floor else W
    ev = {"exact": 0, "left_f": 0, "split_1": 0, "short_1": 0}
    r = k = 0
    for _ in range(parts):
        R = W
        while r < len(n):
            rest = n[r] - k + F
            if R >= rest:
                R, r, k = R - rest, r + 1, 0
                ev["exact"] += R == 0
                continue
            ev["short_1"] += rest == R + 1
            ev["left_f"] += R == F
            ev["split_1"] += R == F + 1
            k += max(R - F, 0)
            break
    return ev


def test_tight_lengths_land_on_the_payload_boundaries():
    total = {"exact": 0, "left_f": 0, "split_1": 0, "short_1": 0}
    for seed in range(4):
        case = ops.parse_case(ID.format(b=64, sq=1, hq=64, hkv=1, sms=78, dist="tight").replace("seed=0", f"seed={seed}"))
        L = Prepared(ops.get(case.op), case).inputs["seqlens"]
        assert L.dtype == np.int32 and (L >= 0).all() and (L == 0).any()
        parts = S.num_sm_parts(case.p)
        W = -(-sum(-(-int(x) // 64) + F for x in L) // parts) + F
        assert W == F + max(F + 1, -(-64 * (2 * 5 + F) // parts)), "tight fixes the payload"
        for k, v in _events(L, parts).items():
            total[k] += v
    assert all(v > 0 for v in total.values()), total


def test_distributions():
    def lens(dist, **kw):
        case = ops.parse_case(ID.format(**{**dict(b=128, sq=2, hq=16, hkv=1, sms=132), **kw}, dist=dist))
        return Prepared(ops.get(case.op), case).inputs["seqlens"]

    assert (lens("equal") == 300).all()
    assert lens("bench").tolist() == [300 + 2 * i for i in range(128)]
    v = lens("varlen")
    assert v.min() >= 2 and 200 < v.mean() < 400 and v.std() > 100  # max(N(300, 150), s_q)
    e = lens("edges")
    assert set((e % 64).tolist()) <= {0, 1, 63} and (e == 0).any()
    s = lens("skewed")
    assert (s == 300).sum() >= 1 and (s == 0).any() and (s[s != 300] <= 64).all()


def test_bad_params_exit_2_with_one_line(capsys):
    for bad, want in (("b=2,kv=300,sq=1,hq=16,hkv=3,sms=132,floor=1", "multiple of hkv=3"),
                      ("b=2,kv=300,sq=2,hq=128,hkv=1,sms=3,floor=1", "expected sms >= 4"),
                      ("b=2,kv=300,sq=1,hq=16,hkv=1,sms=132,floor=2", "floor")):
        assert main(["repro", f"mla.schedule/cpu/int32/{bad}/equal/seed=0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err


def test_ci_gates_every_backend_at_several_part_counts_with_and_without_the_floor():
    cases = [c for c in suites.cases("ci") if c.op == "mla.schedule"]
    assert {c.backend for c in cases} == {"cpu", "torch", "triton"}
    assert set(S.DISTS) == {c.dist for c in cases}
    assert {0, 1} == {c.p["floor"] for c in cases} and {1, 2} == {c.p["sq"] for c in cases}
    parts = {S.num_sm_parts(c.p) for c in cases}
    assert min(parts) < 8 and max(parts) >= 132
    assert any(c.p["b"] > S.num_sm_parts(c.p) for c in cases) and any(c.p["hkv"] > 1 for c in cases)
