"""Triton MLA decode (kernels/triton/mla.py, mla_sparse.py) against float64 references (interpreter on CPU).

The golden is refimpl.mla (decode, decode_sparse) where it exists, else `_decode64` /
`_sparse64` below (the same formula, written for trust: per-request gathers, float64 softmax).
One case per dispatch path (both tile orientations, shared or separate V loads, one row block or
several, one split, uniform splits, explicit splits with empty and mid-page pieces, the combine)
plus the edges: seqlens 0, 1, 63, 64, 65, 200, s_q > seqlens (a row with no key), NaN in every
cache slot past seqlens and in unused pages, shuffled block tables whose unused entries point
nowhere, sparse -1 padding and topk_length (entries past it point at NaN slots).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

prepare_environment()  # before anything imports triton
torch = pytest.importorskip("torch")
_why = interpreter_ready()
if _why:
    pytest.skip(_why, allow_module_level=True)

from kernel_parity.kernels.triton.mla import MlaConfig, mla_decode, mla_schedule, mla_splits  # noqa: E402
from kernel_parity.kernels.triton.mla_sparse import mla_decode_sparse  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GOLDEN = "kernel_parity.refimpl.mla" if importlib.util.find_spec("kernel_parity.refimpl.mla") else None
BAD_PAGE = 2147480000  # FlashMLA's filler for unused block-table entries: reading one faults or fails
# Bound per O element: |o - ref| <= out * |ref| + acc * sum_j p_j |v_j| (the golden's own weights).
TOL = {
    # fp32 exp2 of log2-domain logits and fp32 sums: ~1e-6 relative.
    "fp32": dict(out=1e-5, acc=1e-5, lse=3e-5),
    # P is rounded to the 16-bit dtype before the PV dot (half an ulp a weight: 2^-9 bf16, 2^-12
    # fp16), then O once; the logits are exact 16-bit products summed in fp32, so LSE keeps fp32's
    # accuracy (FlashMLA's test asks 8/65536 relative of its LSE).
    "bf16": dict(out=2.0**-8, acc=2.0**-8, lse=3e-5),
    "fp16": dict(out=2.0**-10, acc=2.0**-10, lse=3e-5),
}


# ------------------------------------------------------------------ references (float64)

def _attend64(q, keys, keep, scale, d_v):
    """q: (n, d); keys: (L, d); keep: (n, L) -> o (n, d_v), lse (n,), mag (n, d_v) = sum_j p_j |v_j|."""
    s = np.where(keep, scale * (q @ keys.T), -np.inf)  # n, L
    m = np.max(s, axis=1, initial=-np.inf)
    m0 = np.where(np.isfinite(m), m, 0.0)
    p = np.where(keep, np.exp(s - m0[:, None]), 0.0)
    den = p.sum(1)
    lse = np.where(den > 0, m0 + np.log(np.where(den > 0, den, 1.0)), -np.inf)
    p = p / np.where(den > 0, den, 1.0)[:, None]
    v = keys[:, :d_v]
    return p @ v, lse, p @ np.abs(v)


def _decode64(q, kv_cache, block_table, seqlens, scale, d_v, causal):
    """q: (b, s_q, h_q, d); kv_cache: (blocks, page, 1, d) -> o (b, s_q, h_q, d_v), lse (b, h_q, s_q), mag."""
    b, s_q, h_q, d = q.shape
    page = kv_cache.shape[1]
    o, lse, mag = np.zeros((b, s_q, h_q, d_v)), np.zeros((b, h_q, s_q)), np.zeros((b, s_q, h_q, d_v))
    for i in range(b):
        L = int(seqlens[i])
        t = np.arange(L)
        keys = kv_cache[block_table[i, t // page], t % page, 0]  # L, d
        qi = np.repeat(np.arange(s_q), h_q)  # rows (query, head)
        keep = np.ones((s_q * h_q, L), bool)
        if causal:
            keep = t[None, :] <= (L - s_q + qi)[:, None]
        oi, li, mi = _attend64(q[i].reshape(s_q * h_q, d), keys, keep, scale, d_v)
        o[i], mag[i] = oi.reshape(s_q, h_q, d_v), mi.reshape(s_q, h_q, d_v)
        lse[i] = li.reshape(s_q, h_q).T
    return o, lse, mag


def _sparse64(q, kv_cache, indices, topk_length, scale, d_v):
    b, s_q, h_q, d = q.shape
    flat = kv_cache.reshape(-1, d)
    o, lse, mag = np.zeros((b, s_q, h_q, d_v)), np.zeros((b, h_q, s_q)), np.zeros((b, s_q, h_q, d_v))
    for i in range(b):
        for j in range(s_q):
            idx = indices[i, j, : indices.shape[2] if topk_length is None else int(topk_length[i])]
            keys = flat[idx[idx >= 0]]
            o[i, j], lse[i, :, j], mag[i, j] = _attend64(q[i, j], keys, np.ones((h_q, len(keys)), bool), scale, d_v)
    return o, lse, mag


def _golden(name, *args):
    """The refimpl golden's (o, lse) where it exists; mag always from the local reference."""
    local = {"decode": _decode64, "decode_sparse": _sparse64}[name](*args)
    if GOLDEN is None:
        return local
    ref = getattr(importlib.import_module(GOLDEN), name)
    o, lse = (ref(*args[:-1], d_v=args[-1]) if name == "decode_sparse"
              else ref(*args[:4], args[4], d_v=args[5], causal=args[6]))
    return np.asarray(o), np.asarray(lse), local[2]


def assert_close(what, o, lse, ref, tol, request):
    """o, lse within TOL of the golden; -inf LSE exactly where the golden has it, no NaN."""
    o_ref, lse_ref, mag = ref
    t = TOL[tol]
    g, gl = o.detach().double().cpu().numpy(), lse.detach().double().cpu().numpy()
    bound = t["out"] * np.abs(o_ref) + t["acc"] * mag
    bad = ~(np.abs(g - o_ref) <= bound)  # NaN counts as bad
    fin = np.isfinite(lse_ref)
    bad_l = ~np.where(fin, np.abs(gl - np.where(fin, lse_ref, 0.0)) <= t["lse"], gl == lse_ref)
    if bad.any() or bad_l.any():
        lines = []
        for name, arr, exp, mask, lim in (("O", g, o_ref, bad, bound), ("LSE", gl, lse_ref, bad_l, None)):
            worst = np.argsort(-np.where(np.isnan(arr), np.inf, np.abs(arr - exp)), axis=None)[:5]
            lines += [f"  {name}{list(np.unravel_index(k, arr.shape))} = {arr.flat[k]:.7g}, "
                      f"expected {exp.flat[k]:.7g}  |d|={abs(arr.flat[k] - exp.flat[k]):.2e}"
                      + (f" bound={lim.flat[k]:.2e}" if lim is not None else "") for k in worst if mask.flat[k]]
        pytest.fail(f"{what}: O {int(bad.sum())}/{bad.size}, LSE {int(bad_l.sum())}/{bad_l.size} elements outside "
                    f"tol ({tol}: {t})\n" + "\n".join(lines) + f"\n  repro: pytest '{request.node.nodeid}'",
                    pytrace=False)


# ------------------------------------------------------------------ inputs

def _paged(rng, seqlens, d, dtype, page=64, spare_pages=3):
    """A NaN-filled cache holding each request's tokens on shuffled pages; unused table entries BAD_PAGE."""
    n_pages = [max(1, math.ceil(L / page)) for L in seqlens]
    total = sum(n_pages) + spare_pages
    cache = torch.full((total, page, 1, d), float("nan"), dtype=TORCH[dtype])
    table = torch.full((len(seqlens), max(n_pages) + 1), BAD_PAGE, dtype=torch.int32)
    perm = rng.permutation(total)
    at = 0
    for i, L in enumerate(seqlens):
        for p in range(math.ceil(L / page)):
            blk = int(perm[at])
            at += 1
            table[i, p] = blk
            n = min(page, L - p * page)
            cache[blk, :n, 0] = torch.from_numpy(rng.standard_normal((n, d))).to(TORCH[dtype])
    return cache.to(DEV), table.to(DEV)


def _q(rng, b, s_q, h_q, d, dtype):
    return torch.from_numpy(rng.standard_normal((b, s_q, h_q, d))).to(TORCH[dtype]).to(DEV)


def _np(t):
    return t.double().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()


SWAP = (16, 64, 4, 2, True, True)
ROWS = (16, 64, 4, 2, False, True)  # rows x keys; 16-row blocks: a 32-row problem runs as two
SEPARATE_V = (16, 32, 4, 2, True, False)
CHUNKED = (16, 32, 4, 2, True, True, 128)  # table entries / indices fetched 128 keys at a time: chunk edges
DENSE_CASES = [
    # (dtype, s_q, h_q, seqlens, causal, num_splits or explicit boundaries, config, d_v, page)
    ("bf16", 1, 16, [0, 1, 65], True, None, None, 512, 64),          # default config, one split
    ("bf16", 2, 16, [63, 64, 200], True, 3, None, 512, 64),          # 32 rows, uniform splits + combine
    ("bf16", 2, 16, [200, 1, 64], True, None, ROWS, 512, 64),         # two row blocks, causal cap per block
    ("bf16", 2, 2, [200], True, [[0, 64, 64, 192, 200]], SWAP, 512, 64),  # explicit, one empty split
    ("bf16", 2, 2, [1, 200], True, [[0, 1, 5], [0, 50, 200]], SEPARATE_V, 512, 64),  # mid-page, past L
    ("bf16", 2, 2, [1, 65], False, 2, SWAP, 512, 64),                 # s_q > seqlens without the mask
    ("fp16", 1, 2, [1, 64, 200], True, 4, None, 512, 64),
    ("fp32", 2, 2, [65], True, 2, ROWS, 512, 64),
    ("bf16", 2, 3, [0, 37, 100], True, 3, None, 64, 16),              # small dims, pages of 16
    ("bf16", 1, 2, [200, 129], True, [[0, 70, 200], [0, 0, 129]], CHUNKED, 512, 64),  # chunk edges, mid-page
    ("bf16", 2, 2, [100, 37], True, 2, (16, 64, 4, 2, False, True, 32), 64, 16),  # 64-key tiles, 32-key chunks
]


@pytest.mark.parametrize("dtype,s_q,h_q,seqlens,causal,splits,config,d_v,page", DENSE_CASES)
def test_mla_decode(dtype, s_q, h_q, seqlens, causal, splits, config, d_v, page, request):
    rng = np.random.default_rng(len(seqlens) * 100 + s_q * 10 + h_q)
    b, d, scale = len(seqlens), d_v + 64, 1.0 / math.sqrt(d_v + 64)
    cache, table = _paged(rng, seqlens, d, dtype, page)
    q = _q(rng, b, s_q, h_q, d, dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    explicit = torch.tensor(splits, dtype=torch.int32, device=DEV) if isinstance(splits, list) else None
    out = torch.full((b, s_q, h_q, d_v), float("nan"), dtype=q.dtype, device=DEV)
    o, lse = mla_decode(q, cache, table, sl, scale, d_v=d_v, causal=causal, out=out, config=config,
                        num_splits=None if explicit is not None else splits, splits=explicit)
    assert o is out and lse.shape == (b, h_q, s_q)
    ref = _golden("decode", _np(q), _np(cache), _np(table), np.array(seqlens), scale, d_v, causal)
    assert_close(f"mla_decode[triton] {dtype} s_q={s_q} h_q={h_q} seqlens={seqlens} splits={splits}",
                 o, lse, ref, dtype, request)


def test_mla_schedule_drives_decode(request):
    """The scheduler's partition (uneven lengths, more pieces for the long request) gives the same
    result as one split."""
    rng = np.random.default_rng(3)
    seqlens = [300, 20, 0]
    cache, table = _paged(rng, seqlens, 576, "bf16")
    q = _q(rng, 3, 1, 2, 576, "bf16")
    sl = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    plan = mla_schedule(seqlens, num_parts=4, device=DEV)
    assert plan.tolist() == [[0, 128, 256, 300], [0, 20, 20, 20], [0, 0, 0, 0]]
    o, lse = mla_decode(q, cache, table, sl, 1 / 24, splits=plan, config=SWAP)
    ref = _golden("decode", _np(q), _np(cache), _np(table), np.array(seqlens), 1 / 24, 512, True)
    assert_close("mla_decode[triton] mla_schedule splits", o, lse, ref, "bf16", request)


@pytest.mark.skipif(GOLDEN is None, reason="refimpl.mla (FlashMLA's scheduler golden) not present")
def test_mla_decode_flashmla_schedule(request):
    """FlashMLA's own split scheduler (refimpl.mla.schedule, as ranges by refimpl.mla.partitions)
    drives the kernel through mla_splits: pieces start mid-request, requests get 1 or 3 splits."""
    R = importlib.import_module(GOLDEN)
    rng = np.random.default_rng(5)
    seqlens = [700, 20, 0, 130, 257]
    meta, num_splits = R.schedule(np.array(seqlens), 1, 16, num_sm_parts=10)
    ranges = R.partitions(meta, num_splits, np.array(seqlens))
    plan = mla_splits(ranges, device=DEV)
    assert plan.shape[1] > 2  # some request is split
    cache, table = _paged(rng, seqlens, 576, "bf16")
    q = _q(rng, len(seqlens), 1, 16, 576, "bf16")
    sl = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    o, lse = mla_decode(q, cache, table, sl, 1 / 24, splits=plan)
    ref = _golden("decode", _np(q), _np(cache), _np(table), np.array(seqlens), 1 / 24, 512, True)
    assert_close(f"mla_decode[triton] FlashMLA schedule {plan.tolist()}", o, lse, ref, "bf16", request)


SPARSE_CASES = [
    # (dtype, s_q, h_q, topk, topk_length, num_splits, config)
    ("bf16", 2, 16, 96, [70, 0], None, None),
    ("bf16", 2, 16, 96, [96, 33], 3, None),
    ("bf16", 1, 2, 40, None, 2, ROWS),
    ("fp16", 2, 2, 64, None, 1, SEPARATE_V),
    ("bf16", 1, 16, 200, [150, 199], 2, CHUNKED),
]


@pytest.mark.parametrize("dtype,s_q,h_q,topk,topk_length,num_splits,config", SPARSE_CASES)
def test_mla_decode_sparse(dtype, s_q, h_q, topk, topk_length, num_splits, config, request):
    rng = np.random.default_rng(topk + h_q)
    b = 2
    cache, _ = _paged(rng, [150, 150], 576, dtype)
    filled = np.flatnonzero(~torch.isnan(cache[:, :, 0, 0].float()).cpu().numpy().reshape(-1))
    poisoned = np.flatnonzero(torch.isnan(cache[:, :, 0, 0].float()).cpu().numpy().reshape(-1))
    idx = rng.choice(filled, size=(b, s_q, topk))
    idx[rng.random(idx.shape) < 0.25] = -1  # padding anywhere in the list
    if topk_length is not None:  # entries past topk_length point at NaN slots: they must not be read
        for i, n in enumerate(topk_length):
            idx[i, :, n:] = rng.choice(poisoned, size=idx[i, :, n:].shape)
    indices = torch.from_numpy(idx.astype(np.int32)).to(DEV)
    tl_t = torch.tensor(topk_length, dtype=torch.int32, device=DEV) if topk_length is not None else None
    q = _q(rng, b, s_q, h_q, 576, dtype)
    o, lse = mla_decode_sparse(q, cache, indices, tl_t, 1 / 24, num_splits=num_splits, config=config)
    ref = _golden("decode_sparse", _np(q), _np(cache), idx, None if tl_t is None else np.array(topk_length),
                  1 / 24, 512)
    assert_close(f"mla_decode_sparse[triton] {dtype} s_q={s_q} h_q={h_q} topk={topk} topk_length={topk_length}",
                 o, lse, ref, dtype, request)


def test_mla_rejects_bad_input():
    q = torch.zeros((1, 1, 2, 576), dtype=torch.bfloat16)
    cache = torch.zeros((2, 64, 1, 576), dtype=torch.bfloat16)
    table = torch.zeros((1, 2), dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        mla_decode(q, cache, table, sl, 0.1, d_v=500)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q, cache.float(), table, sl, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode(q, cache, table.long(), sl, 0.1)
    with pytest.raises(ValueError, match="scale"):
        mla_decode(q, cache, table, sl, float("nan"))
    with pytest.raises(ValueError, match="num_splits=3 but splits"):
        mla_decode(q, cache, table, sl, 0.1, num_splits=3, splits=torch.zeros((1, 3), dtype=torch.int32))
    with pytest.raises(ValueError, match="indices"):
        mla_decode_sparse(q, cache, torch.zeros((1, 2, 4), dtype=torch.int32), None, 0.1)
    with pytest.raises(ValueError, match="not consecutive"):
        mla_splits([[(0, 64), (65, 100)]])
    with pytest.raises(ValueError, match="out must be"):
        mla_decode(q, cache, table, sl, 0.1, out=torch.zeros((1, 1, 2, 576), dtype=torch.bfloat16))
    assert MlaConfig(*SWAP).swap_ab


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke-cpu is the benchmark's run without a GPU")
def test_gpu_mla_benchmark_smoke_cpu(tmp_path):
    """benchmarks/gpu_mla.py --smoke-cpu: its --tune path end to end at tiny shapes in the interpreter, every
    section, each timed row with the gate's verdict, and the JSON."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_mla.py"
    out = tmp_path / "mla-bench.json"
    run = subprocess.run([sys.executable, str(script), "--smoke-cpu", "--out", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, \
        f"gpu_mla.py --smoke-cpu exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert not res["errors"] and not res["gate_failures"]
    assert {r["name"].split(" b=")[0] for r in res["rows"]} == {"config", "splits", "sdpa", "sparse", "fused config",
                                                                   "fused"}
    assert all(r["ms"] > 0 and r["gate"]["verdict"] == "pass" for r in res["rows"]), res["rows"]
    assert set(res["best_configs"]) == {"16", "32", "fused"} and "gate pass norm_err" in run.stdout
