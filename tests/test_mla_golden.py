"""Self-tests of refimpl/mla.py (FlashMLA dense and sparse decode, the naive form, MAX's fused FP8
branch) and refimpl/mla_schedule.py (FlashMLA's split scheduler), against independent float64
computations and the other goldens (refimpl.attention, refimpl.combine, refimpl.quant_fp)."""

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import attention, mla, mla_fp8
from kernel_parity.refimpl import quant_fp as qf
from kernel_parity.refimpl.combine import attention_state, lse_combine

D_C, D_R, DN, DV = 512, 64, 128, 128
D = D_C + D_R
PAGE = 64
SCALE = D**-0.5
# Two float64 evaluations of the same sums in different orders: a few ulps of the largest term.
F64_REL = 1e-12
POISON_BLOCK = 2147480000  # what FlashMLA's tests put in unused block-table entries


def _close(got, want, what, rel=F64_REL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    same_inf = np.isinf(want)
    assert (np.isinf(got) == same_inf).all() and (got[same_inf] == want[same_inf]).all(), \
        f"{what}: infinities differ at {np.argwhere(np.isinf(got) != same_inf)[:5].tolist()}"
    err = np.abs(np.where(same_inf, 0, got) - np.where(same_inf, 0, want))
    tol = rel * max(np.abs(np.where(same_inf, 0, want)).max(initial=0), 1e-300)
    where = np.unravel_index(err.argmax(), err.shape) if err.size else ()
    assert err.max(initial=0) <= tol, f"{what}: max |d| = {err.max(initial=0):.3e} > {tol:.3e} at {where}"


def _paged(rng, seqlens, page=PAGE, d=D, poison=True):
    """Cache with each request's tokens in shuffled blocks; NaN past each length; poisoned unused entries."""
    seqlens = np.asarray(seqlens)
    nblk = -(-seqlens // page)
    max_blocks = int(nblk.max(initial=0)) + 1
    ids = rng.permutation(int(nblk.sum()) + 2)
    cache = rng.standard_normal((ids.size, page, 1, d)) * 0.5
    table = np.full((seqlens.size, max_blocks), POISON_BLOCK if poison else 0, dtype=np.int32)
    start = np.concatenate([[0], np.cumsum(nblk)])
    for i, (a, z) in enumerate(zip(start[:-1], start[1:])):  # test setup: a loop over a few requests
        table[i, : z - a] = ids[a:z]
        flat = cache[table[i, : z - a]].reshape(-1, d)
        flat[seqlens[i]:] = np.nan
        cache[table[i, : z - a]] = flat.reshape(-1, page, 1, d)
    cache[ids[-2:]] = np.nan  # blocks no request owns
    return cache, table


def _direct(q, cache, table, seqlens, scale, d_v, causal):
    """Per request and row: gather the visible keys, textbook softmax in float64."""
    b, s_q, h, _ = q.shape
    o, lse = np.zeros((b, s_q, h, d_v)), np.full((b, h, s_q), -np.inf)
    for i in range(b):
        rows = cache[:, :, 0].reshape(-1, cache.shape[-1])
        slots = [table[i, t // cache.shape[1]] * cache.shape[1] + t % cache.shape[1] for t in range(seqlens[i])]
        k = rows[slots] if slots else np.zeros((0, cache.shape[-1]))
        for r in range(s_q):
            vis = seqlens[i] - s_q + r + 1 if causal else seqlens[i]
            if vis <= 0:
                continue
            s = scale * q[i, r] @ k[:vis].T  # h, vis
            lse[i, :, r] = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
            o[i, r] = np.exp(s - lse[i, :, r, None]) @ k[:vis, :d_v]
    return o, lse


@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (3, False)])
def test_decode_matches_direct_per_request(s_q, causal):
    rng = np.random.default_rng(1)
    seqlens = np.array([1, 64, 130, 0, 2])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((5, s_q, 3, D))
    o, lse = mla.decode(q, cache, table, seqlens, SCALE, causal=causal)
    o_ref, lse_ref = _direct(q, cache, table, seqlens, SCALE, D_C, causal)
    _close(o, o_ref, "decode O")
    _close(lse, lse_ref, "decode LSE")


@pytest.mark.parametrize("chunk", [1, 2 * 130 * D])
def test_decode_in_request_chunks_matches_direct(monkeypatch, chunk):
    """Chunking the requests (to bound the gathered rows' memory) changes nothing: one request per
    chunk, and two per chunk with a last chunk of one."""
    monkeypatch.setattr(mla, "CHUNK", chunk)
    rng = np.random.default_rng(7)
    seqlens = np.array([130, 0, 64, 1, 129])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((5, 2, 3, D))
    o, lse = mla.decode(q, cache, table, seqlens, SCALE, causal=True)
    o_ref, lse_ref = _direct(q, cache, table, seqlens, SCALE, D_C, True)
    _close(o, o_ref, "chunked decode O")
    _close(lse, lse_ref, "chunked decode LSE")


def test_decode_matches_attention_decode_paged():
    rng = np.random.default_rng(2)
    seqlens = np.array([239, 65, 2])
    cache, table = _paged(rng, seqlens, poison=False)  # attention.gather_pages reads whole tables
    q = rng.standard_normal((3, 2, 8, D))
    o, lse = mla.decode(q, cache, table, seqlens, 0.1)
    o_ref, lse_ref, _ = attention.decode_paged(q, cache, cache[..., :D_C], table, seqlens, scale=0.1)
    _close(o, o_ref, "decode O vs attention.decode_paged")
    _close(lse, lse_ref, "decode LSE vs attention.decode_paged")


def test_absorbed_equals_naive():
    rng = np.random.default_rng(3)
    b, s_q, h = 3, 2, 4
    seqlens = np.array([100, 3, 64])
    cache, table = _paged(rng, seqlens)
    w_uk, w_uv = rng.standard_normal((2, h, DN, D_C)) * 0.05
    q_nope, q_pe = rng.standard_normal((b, s_q, h, DN)), rng.standard_normal((b, s_q, h, D_R))
    scale = 192**-0.5
    o_lat, lse = mla.decode(np.concatenate([mla.absorb(q_nope, w_uk), q_pe], -1), cache, table, seqlens, scale)
    o_naive, lse_naive = mla.decode_naive(q_nope, q_pe, cache, table, seqlens, w_uk, w_uv, scale)
    _close(mla.unabsorb(o_lat, w_uv), o_naive, "absorbed O W_UV^T vs naive O")
    _close(lse, lse_naive, "absorbed LSE vs naive LSE")


def test_empty_rows_give_zero_and_minus_inf():
    rng = np.random.default_rng(4)
    seqlens = np.array([0, 1, 2])
    cache, table = _paged(rng, seqlens)
    o, lse = mla.decode(rng.standard_normal((3, 3, 2, D)), cache, table, seqlens, SCALE)
    empty = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], bool)  # causal: row i sees j <= L - 3 + i
    assert (o[empty] == 0).all() and np.isneginf(lse.transpose(0, 2, 1)[empty]).all()
    assert np.isfinite(lse.transpose(0, 2, 1)[~empty]).all()


def test_nan_past_seqlens_is_never_read():
    rng = np.random.default_rng(5)
    seqlens = np.array([65, 7])
    cache, table = _paged(rng, seqlens)  # NaN past lengths, NaN spare blocks, poisoned table entries
    q = rng.standard_normal((2, 2, 4, D))
    o, lse = mla.decode(q, cache, table, seqlens, SCALE)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    clean = np.nan_to_num(cache, nan=123.0)
    o2, lse2 = mla.decode(q, clean, np.where(table == POISON_BLOCK, 0, table), seqlens, SCALE)
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2)


def test_causal_s_q_2_rows_see_their_prefix():
    rng = np.random.default_rng(6)
    seqlens = np.array([70, 129])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((2, 2, 4, D))
    o, lse = mla.decode(q, cache, table, seqlens, SCALE)
    o0, lse0 = mla.decode(q[:, :1], cache, table, seqlens - 1, SCALE)  # row 0 sees L - 1 keys
    o1, lse1 = mla.decode(q[:, 1:], cache, table, seqlens, SCALE)
    _close(o, np.concatenate([o0, o1], 1), "causal s_q=2 O")
    _close(lse, np.concatenate([lse0, lse1], 2), "causal s_q=2 LSE")


def _visible_indices(table, seqlens, s_q, causal, topk):
    """(b, s_q, topk) slot ids of every visible key, -1 padded."""
    b = seqlens.size
    idx = np.full((b, s_q, topk), -1, dtype=np.int32)
    for i in range(b):
        for r in range(s_q):
            vis = seqlens[i] - s_q + r + 1 if causal else seqlens[i]
            t = np.arange(max(vis, 0))
            idx[i, r, : t.size] = table[i, t // PAGE] * PAGE + t % PAGE
    return idx


@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_sparse_equals_dense_when_indices_list_every_visible_key(s_q, causal):
    rng = np.random.default_rng(7)
    seqlens = np.array([130, 1, 0])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((3, s_q, 4, D))
    idx = _visible_indices(table, seqlens, s_q, causal, 160)
    perm = rng.permutation(160)  # order and -1 interleaving do not matter
    o, lse = mla.decode_sparse(q, cache, idx[..., perm], None, SCALE)
    o_ref, lse_ref = mla.decode(q, cache, table, seqlens, SCALE, causal=causal)
    _close(o, o_ref, "sparse O vs dense")
    _close(lse, lse_ref, "sparse LSE vs dense")


def test_sparse_topk_length_and_duplicates():
    rng = np.random.default_rng(8)
    seqlens = np.array([100, 100])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((2, 1, 4, D))
    idx = _visible_indices(table, seqlens, 1, False, 128)
    garbage = idx.copy()
    garbage[:, :, 100:] = 10**9  # past topk_length: never read
    o, lse = mla.decode_sparse(q, cache, garbage, np.array([100, 40]), SCALE)
    o_ref, lse_ref = mla.decode(q, cache, table, np.array([100, 40]), SCALE)
    _close(o, o_ref, "sparse topk_length O")
    _close(lse, lse_ref, "sparse topk_length LSE")
    twice = np.concatenate([idx[..., :100], idx[..., :100]], -1)  # every key listed twice
    o2, lse2 = mla.decode_sparse(q, cache, twice, None, SCALE)
    _close(o2, mla.decode(q, cache, table, seqlens, SCALE)[0], "duplicated indices O")
    _close(lse2, mla.decode(q, cache, table, seqlens, SCALE)[1] + np.log(2), "duplicated indices LSE")


def test_sparse_sink_scales_output_and_not_lse():
    rng = np.random.default_rng(9)
    seqlens = np.array([50, 0])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((2, 1, 3, D))
    idx = _visible_indices(table, seqlens, 1, False, 64)
    sink = np.array([0.5, -np.inf, np.inf])
    o, lse = mla.decode_sparse(q, cache, idx, None, SCALE, attn_sink=sink)
    o_ref, lse_ref, _ = attention.decode_paged(q, cache, cache[..., :D_C], np.where(table == POISON_BLOCK, 0, table),
                                               seqlens, scale=SCALE, sinks=sink[:2].tolist() + [0.0])
    _close(o[:, :, :2], o_ref[:, :, :2], "sparse sink O")
    _close(lse, lse_ref, "sparse sink LSE (excludes the sink)")
    assert (o[:, :, 2] == 0).all() and (o[1] == 0).all()


# --------------------------------------------------------------------------- schedule

SEQLEN_SETS = [[0], [1], [64], [65], [0, 0, 0], [1, 0, 64, 4096, 1], [10**6, 3, 0, 10**6 + 1],
               [2**24, 1], list(range(0, 2000, 37)), [64 * 7] * 130]


@pytest.mark.parametrize("floor", [True, False])
@pytest.mark.parametrize("parts", [1, 2, 3, 33, 66, 132])
def test_schedule_is_valid(parts, floor):
    rng = np.random.default_rng(parts)
    sets = SEQLEN_SETS + [rng.integers(0, 5000, rng.integers(1, 300)).tolist() for _ in range(5)]
    for seqlens in sets:
        meta, ns = mla.schedule(seqlens, 1, 128, parts, payload_floor=floor)
        assert meta.shape == (parts, 8) and meta.dtype == np.int32 and ns.dtype == np.int32
        bad = mla.check_schedule(meta, ns, seqlens)
        assert not bad, f"schedule(seqlens={seqlens[:8]}..., parts={parts}) violates: {bad}"
        ranges = mla.partitions(meta, ns, seqlens)
        for L, rr in zip(seqlens, ranges):  # contiguous cover of [0, L) in split order
            assert rr[0][0] == 0 and rr[-1][1] == L and all(a[1] == c[0] for a, c in zip(rr, rr[1:]))


def _greedy(seqlens, parts, f=5, block=64, floor=True):
    """The scheduler written as FlashMLA states it: one request at a time, per part."""
    n = [-(-L // block) for L in seqlens]
    payload = -(-sum(x + f for x in n) // parts) + f
    payload = max(payload, 2 * f) if floor else payload
    meta, splits, r, k, ns = [], [], 0, 0, 0
    for _ in range(parts):
        row, left = [r, k * block, None, None, ns], payload
        while r < len(n):
            if left >= n[r] - k + f:
                left -= n[r] - k + f
                splits.append(ns + 1)
                r, k, ns = r + 1, 0, 0
                continue
            if left - f > 0:
                k, ns = k + left - f, ns + 1
            break
        row[2:4] = (r, k * block) if k > 0 else (r - 1, seqlens[r - 1])
        meta.append(row + [0, 0, 0])
    return meta, np.concatenate([[0], np.cumsum(splits)]).tolist()


@pytest.mark.parametrize("floor", [True, False])
def test_schedule_matches_request_by_request_greedy(floor):
    rng = np.random.default_rng(14)
    for _ in range(60):
        seqlens = rng.integers(0, rng.choice([2, 70, 700, 20000]), rng.integers(1, 60)).tolist()
        parts = int(rng.integers(1, 140))
        meta, ns = mla.schedule(seqlens, 1, 64, parts, payload_floor=floor)
        want_meta, want_ns = _greedy(seqlens, parts, floor=floor)
        assert meta.tolist() == want_meta and ns.tolist() == want_ns, f"seqlens={seqlens}, parts={parts}"


def test_schedule_by_hand():
    meta, ns = mla.schedule([640], 1, 16, 2)  # 10 blocks + 5 = 15; payload ceil(15/2) + 5 = 13
    assert meta.tolist() == [[0, 0, 0, 512, 0, 0, 0, 0], [0, 512, 0, 640, 1, 0, 0, 0]] and ns.tolist() == [0, 2]
    meta, ns = mla.schedule([0, 64, 1], 1, 16, 4)  # total 3 * 5 + 2 = 17; payload max(10, 10)
    assert meta[:, :5].tolist() == [[0, 0, 0, 0, 0], [1, 0, 1, 64, 0], [2, 0, 2, 1, 0], [3, 0, 2, 1, 0]]
    assert ns.tolist() == [0, 1, 2, 3]
    meta, ns = mla.schedule([64, 192], 1, 16, 2)  # payload 12: request 0 leaves 6 = F + 1, one block of request 1
    assert meta[:, :5].tolist() == [[0, 0, 1, 64, 0], [1, 64, 1, 192, 1]] and ns.tolist() == [0, 1, 3]
    assert mla.sm_parts(132, 1, 128) == 66 and mla.sm_parts(132, 2, 64) == 66 and mla.sm_parts(78, 1, 16) == 78


def test_check_schedule_catches_broken_schedules():
    seqlens = [64 * 40, 64 * 40 + 5, 300]
    meta, ns = mla.schedule(seqlens, 1, 128, 8)
    assert not mla.check_schedule(meta, ns, seqlens)
    split = int(np.flatnonzero((meta[:, 3] % 64 == 0) & (meta[:, 3] > 0) & (meta[:, 0] == meta[:, 2]))[0])
    dropped = meta.copy(); dropped[split, 3] -= 64  # a part stops one block early
    overlap = meta.copy(); overlap[split + 1, 1] -= 64  # the next part starts one block early
    off_edge = meta.copy(); off_edge[split, 3] += 1; off_edge[split + 1, 1] += 1
    wrong_ns = ns.copy(); wrong_ns[1:] += 1
    cases = {"assigned 0 times": (dropped, ns), "more than once": (overlap, ns), "off a block edge": (off_edge, ns),
             "pieces per request": (meta, wrong_ns)}
    for want, (m, n) in cases.items():
        bad = mla.check_schedule(m, n, seqlens)
        assert any(want in v for v in bad), f"expected a '{want}' violation, got {bad}"
    assert any("max_splits" in v for v in mla.check_schedule(meta, ns, seqlens, max_splits=1))


def test_partitions_merged_equal_decode():
    rng = np.random.default_rng(10)
    seqlens = np.array([64 * 9 + 3, 0, 200, 1])
    cache, table = _paged(rng, seqlens)
    q = rng.standard_normal((4, 1, 2, D))
    meta, ns = mla.schedule(seqlens, 1, 2, 6)
    o_ref, lse_ref = mla.decode(q, cache, table, seqlens, SCALE)
    rows = cache[:, :, 0].reshape(-1, D)
    for i, ranges in enumerate(mla.partitions(meta, ns, seqlens)):  # a few requests, a few splits
        t = np.arange(seqlens[i])
        k = rows[table[i, t // PAGE] * PAGE + t % PAGE]
        parts = [attention_state(SCALE * q[i, 0] @ k[a:z].T, np.broadcast_to(k[a:z, :D_C], (2, z - a, D_C)))
                 for a, z in ranges]
        o, lse = lse_combine(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
        _close(o, o_ref[i, 0], f"request {i}: merged splits O")
        _close(lse, lse_ref[i, :, 0], f"request {i}: merged splits LSE")


# --------------------------------------------------------------------------- fused FP8 branch

H = 4


def _fp8_weights(rng, n, k):
    """(H, n, k) e4m3 weights with (H, n/128, k/128) float32 block scales."""
    q, s = zip(*(qf.fp8_quantize_blocks(rng.standard_normal((n, k)) * 0.05, 128, 128) for _ in range(H)))
    return np.stack(q), np.stack(s)


def _fused_case(rng):
    cache_lengths, n = np.array([5, 70, 0, 64]), np.array([1, 2, 1, 3])
    L = cache_lengths + n
    cache, table = _paged(rng, L, d=D)
    cache = cache[:, :, 0]
    off = np.concatenate([[0], np.cumsum(n)])
    w = 10000.0 ** (-np.arange(0, D_R, 2) / D_R)
    ang = np.arange(300)[:, None] * w
    freqs = np.stack([np.cos(ang), np.sin(ang)], -1).reshape(300, D_R)
    w_uk, s_uk = _fp8_weights(rng, D_C, DN)
    w_uv, s_uv = _fp8_weights(rng, DV, D_C)
    return dict(q=rng.standard_normal((off[-1], H, DN + D_R)), input_row_offsets=off, freqs_cis=freqs,
                gamma=1 + 0.1 * rng.standard_normal(D_C), epsilon=1e-6, w_uk=w_uk, w_uk_scale=s_uk, w_uv=w_uv,
                w_uv_scale=s_uv.reshape(H, -1), kv_cache=cache, block_table=table, cache_lengths=cache_lengths,
                scale=192**-0.5)


def _rope_complex(x, f):
    return ((x[..., 0::2] + 1j * x[..., 1::2]) * (f[..., 0::2] + 1j * f[..., 1::2])).view(np.float64)


def _act_bmm(a, w, s):
    """Independent composition, head by head: quant_fp's 1 x 128 activation blocks (MAX's scale_ub
    and reciprocal), then the product of the dequantized operands."""
    out = []
    for h in range(H):
        qa, sa = qf.fp8_quantize_blocks(a[h], 1, 128, amax_floor=0.0, scale_ub=1200.0, reciprocal=True)
        w_h = qf.fp8_dequantize_blocks(w[h], s[h].reshape(-1, a.shape[-1] // 128), 128, 128)
        out.append(qf.fp8_dequantize_blocks(qa, sa, 1, 128) @ w_h.T)
    return np.stack(out)


def test_fused_writes_only_the_new_rows():
    rng = np.random.default_rng(11)
    kw = _fused_case(rng)
    _, after = mla.decode_fused_fp8(**kw)
    before, table, off, cl = kw["kv_cache"], kw["block_table"], kw["input_row_offsets"], kw["cache_lengths"]
    expect = before.copy()
    for r in range(cl.size):  # the few new tokens, one by one
        for t in range(off[r + 1] - off[r]):
            p = cl[r] + t
            row = expect[table[r, p // PAGE], p % PAGE]
            c = row[:D_C]
            row[:D_C] = c / np.sqrt(np.mean(c**2) + kw["epsilon"]) * kw["gamma"]
            row[D_C:] = _rope_complex(row[D_C:], kw["freqs_cis"][p])
    assert np.array_equal(np.isnan(after), np.isnan(before)), "fused: NaN rows changed"
    _close(np.nan_to_num(after), np.nan_to_num(expect), "fused cache_after")
    changed = ~np.all((after == before) | np.isnan(before), axis=-1)
    assert changed.sum() == off[-1], f"fused: {changed.sum()} rows changed, want {off[-1]}"


def test_fused_q_inplace_rotates_q_rope_at_each_tokens_position_and_keeps_q_nope():
    """q_inplace (MAX's fused_qk_rope leaves q rotated): q_after's rope part is q's rotated at position
    cache_lengths[r] + t, token by token (complex multiply); the nope part is q's, value for value; the other
    outputs are those without it; the magnitudes (absolute, the two products in squared form) are within
    sqrt(2) of |q_after| (|u + v| <= sqrt(2) hypot(u, v)), |q_nope| exact."""
    rng = np.random.default_rng(13)
    kw = _fused_case(rng)
    out, after, q_after = mla.decode_fused_fp8(**kw, q_inplace=True)
    out0, after0 = mla.decode_fused_fp8(**kw)
    assert np.array_equal(out, out0) and np.array_equal(after, after0, equal_nan=True), "q_inplace moved out / cache"
    q, off, cl = kw["q"], kw["input_row_offsets"], kw["cache_lengths"]
    want = q.copy()
    for r in range(cl.size):
        for t in range(off[r + 1] - off[r]):
            want[off[r] + t, :, DN:] = _rope_complex(q[off[r] + t, :, DN:], kw["freqs_cis"][cl[r] + t][None])
    assert np.array_equal(q_after[..., :DN], q[..., :DN]), "q_inplace: the nope part changed"
    _close(q_after, want, "q_after vs token-by-token rotation")
    assert not np.allclose(q_after[..., DN:], q[..., DN:]), "q_inplace: the rope part was not rotated"
    mag = mla.decode_fused_fp8(**kw, q_inplace=True, absolute=True)[2]
    assert np.array_equal(mag[..., :DN], np.abs(q[..., :DN])) and np.all(np.sqrt(2) * mag >= np.abs(q_after) * (1 - 1e-12))


@pytest.mark.parametrize("sink", [None, [0.3, -1.0, 2.0, -np.inf]])
def test_fused_equals_composition_of_pieces(sink):
    rng = np.random.default_rng(12)
    kw = _fused_case(rng)
    out, after = mla.decode_fused_fp8(**kw, attn_sink=None if sink is None else np.array(sink))
    q, off, cl = kw["q"], kw["input_row_offsets"], kw["cache_lengths"]
    pos = np.concatenate([cl[r] + np.arange(off[r + 1] - off[r]) for r in range(cl.size)])
    q_lat = _act_bmm(q[..., :DN].transpose(1, 0, 2), kw["w_uk"], kw["w_uk_scale"]).transpose(1, 0, 2)
    q_full = np.concatenate([q_lat, _rope_complex(q[..., DN:], kw["freqs_cis"][pos][:, None])], -1)
    o_lat = []
    for r in range(cl.size):  # one attention.decode_paged call per request (its own s_q)
        o, _, _ = attention.decode_paged(q_full[None, off[r]:off[r + 1]], after[:, :, None], after[:, :, None, :D_C],
                                         np.where(kw["block_table"] == POISON_BLOCK, 0, kw["block_table"])[r:r + 1],
                                         [cl[r] + off[r + 1] - off[r]], scale=kw["scale"], sinks=sink)
        o_lat.append(o[0])
    o_lat = np.concatenate(o_lat)
    want = _act_bmm(o_lat.transpose(1, 0, 2), kw["w_uv"], kw["w_uv_scale"]).transpose(1, 0, 2)
    _close(out, want, "fused out vs composition")


def test_fused_zero_activation_group_quantizes_to_zero():
    rng = np.random.default_rng(13)
    kw = _fused_case(rng)
    kw["q"][0, :, :DN] = 0.0  # a token whose q_nope is all zero: scale 0, codes 0, q_lat 0
    out, _ = mla.decode_fused_fp8(**kw)
    assert np.isfinite(out).all()
    q8, s = mla_fp8.quantize_act(np.zeros((1, 2, 256)))
    assert (s == 0).all() and (q8.astype(np.float32) == 0).all()


def test_activation_quant_saturates_above_scale_ub_and_groups_per_batch():
    x = np.zeros((2, 3, 256))
    x[0, 0, :2] = [2400.0, 600.0]  # amax 2400 > ub: scale 1200 / 448, 2400 saturates to 448
    x[1] = np.random.default_rng(15).standard_normal((3, 256))
    q8, s = mla_fp8.quantize_act(x)
    assert s[0, 0, 0] == np.float32(1200.0) / np.float32(448.0) and s[0, 0, 1] == 0
    assert q8[0, 0, :3].astype(np.float32).tolist() == [448.0, 224.0, 0.0]
    q2, s2 = mla_fp8.quantize_act(x, m_gran=2)  # groups of 2 tokens never straddle batch entries
    want_q, want_s = qf.fp8_quantize_blocks(x[1], 2, 128, amax_floor=0.0, scale_ub=1200.0, reciprocal=True)
    assert s2.shape == (2, 2, 2) and np.array_equal(s2[1], want_s)
    assert np.array_equal(q2[1].view(np.uint8), want_q.view(np.uint8))


def test_decode_golden_on_threads_is_the_one_thread_result(monkeypatch):
    """Request chunks computed on threads (refimpl/threads.py) give the one-thread arrays bit for bit."""
    from kernel_parity.conformance import ops
    from kernel_parity.refimpl import mla as m

    spec = ops.get("mla.decode")
    p = spec.validate(dict(b=6, sq=2, hq=8, kv=300, lens="ragged", causal=1, scale="head"), "bf16", "normal")
    x = spec.make_inputs(p, "bf16", "normal", np.random.default_rng(3))
    x64 = {k: (v.astype(np.float64) if v.dtype.kind in "fV" else v) for k, v in x.items()}
    monkeypatch.setattr(m, "CHUNK", 300 * 576)  # one request a chunk
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = spec.reference(x64, p)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    many = spec.reference(x64, p)
    assert all(np.array_equal(one[k], many[k], equal_nan=True) for k in one)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_decode_golden_widens_the_stored_cache_itself(dtype):
    """mla.decode declares kv_cache a storage input: the runner hands it over as stored and the golden
    widens the rows it gathers; the result is the float64 cache's bit for bit, and the cache untouched."""
    from kernel_parity.conformance import ops
    from kernel_parity.conformance.case import Case
    from kernel_parity.conformance.runner import Prepared

    spec = ops.get("mla.decode")
    assert spec.storage_inputs == {"kv_cache"}
    p = spec.validate(dict(b=5, sq=2, hq=4, kv=200, lens="ragged", causal=1, scale="head"), dtype, "normal")
    case = Case.make("mla.decode", "cpu", dtype, p, "normal", 7)
    prep = Prepared(spec, case)
    stored = prep.inputs64["kv_cache"]
    assert stored.dtype == prep.inputs["kv_cache"].dtype != np.float64
    before = stored.copy()
    wide = dict(prep.inputs64, kv_cache=stored.astype(np.float64))
    want = spec.reference(wide, p)
    assert all(np.array_equal(prep.golden[k], want[k], equal_nan=True) for k in want)
    assert np.array_equal(stored.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_paged_cache_pages_are_one_calls_draws(dtype):
    """The 16-bit caches' values go straight into each page: the values of one table draw per request
    (conformance/inputs.table_draw) laid out through the block table, NaN past each request's tokens
    and in the two spare pages."""
    from kernel_parity.conformance.inputs import table_draw
    from kernel_parity.conformance.ops import mla as M

    seqlens = np.array([0, 1, 64, 65, 130, 7])
    cache, table = M.paged_latent_cache(np.random.default_rng(4), seqlens, "normal", dtype)
    rng = np.random.default_rng(4)
    rng.permutation(cache.shape[0])  # the layout's draw comes first
    quick = M._value_table("normal", dtype)
    used = set()
    for i, n in enumerate(seqlens):
        want = table_draw(rng, int(n) * M.D, quick).reshape(-1, M.D)
        k = -(-int(n) // M.PAGE)
        pages = cache[table[i, :k], :, 0].reshape(-1, M.D)
        assert np.array_equal(pages[:n].view(np.uint16), want.view(np.uint16))
        assert np.isnan(pages[n:].astype(np.float32)).all()
        assert (table[i, k:] == M.TABLE_POISON).all()
        used.update(table[i, :k].tolist())
    spare = sorted(set(range(cache.shape[0])) - used)
    assert len(spare) == 2 and np.isnan(cache[spare].astype(np.float32)).all()


def test_activation_quant_formats_reduce_to_the_default_and_round_the_scale_first():
    """fp8 / scale_dtype (MAX's fp8_dtype / fp8_scale_dtype): the general path at (e4m3, fp32) is the default
    path bit for bit; bf16 scales are bf16 values of bf16(amax) / 448 and the codes are x * (1 / s) of that
    stored scale; e5m2 codes at 57344, saturating above scale_ub."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 3, 256)) * 10.0 ** rng.uniform(-2, 2, (2, 3, 1))
    x[0, 1, :128] = 0.0  # a zero group: scale 0, codes 0 in every format
    x[1, 2, 0] = 5000.0  # above scale_ub: saturates
    q0, s0 = mla_fp8.quantize_act(x)
    xp = np.asarray(x, dtype=np.float32)
    q1, s1 = mla_fp8._quantize_act_fmt(xp, 3, 1, 128, 1200.0, "e4m3", "fp32")
    assert np.array_equal(q0.view(np.uint8), q1.view(np.uint8)) and np.array_equal(s0, s1)
    for fmt, fmax in (("e4m3", 448.0), ("e5m2", 57344.0)):
        q, s = mla_fp8.quantize_act(x, fp8=fmt, scale_dtype="bf16")
        assert q.dtype.name == {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt]
        amax = np.minimum(np.abs(xp).reshape(2, 3, 2, 128).max(-1).astype(ml_dtypes.bfloat16).astype(np.float32),
                          np.float32(1200.0))
        want_s = (amax / np.float32(fmax)).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(s, want_s) and s[0, 1, 0] == 0
        with np.errstate(divide="ignore"):
            r = np.where(want_s > 0, np.float32(1.0) / want_s, np.float32(0.0))
        want_q = qf.fp8_encode(xp * np.repeat(r, 128, axis=-1), fmt, saturate=True)
        assert np.array_equal(q.view(np.uint8), want_q.view(np.uint8))
        assert q[1, 2, 0].astype(np.float32) == fmax
    q5, s5 = mla_fp8.quantize_act(x, fp8="e5m2")  # fp32 scales: the default's, over 57344
    assert np.array_equal(s5, np.minimum(np.abs(xp).reshape(2, 3, 2, 128).max(-1), np.float32(1200.0))
                          / np.float32(57344.0))
    with pytest.raises(ValueError, match="fp8 must be one of"):
        mla_fp8.quantize_act(x, fp8="e4m3fnuz")
    with pytest.raises(ValueError, match="scale_dtype must be one of"):
        mla_fp8.quantize_act(x, scale_dtype="fp16")


def test_fused_formats_read_the_stored_weights_and_keep_the_older_ids():
    """The golden with fp8=e5m2 / scale_dtype=bf16 is the composition over the stored e5m2 codes and bf16 scales;
    the default params keep every older case id; a weight of the wrong format is refused."""
    from kernel_parity.conformance import ops

    spec = ops.get("mla.decode_fused_fp8")
    base = dict(b=3, new=2, hq=2, kv=64, lens="ragged", sink=0)
    for extra in ({}, {"fp8": "e4m3", "scale_dtype": "fp32"}):
        case = ops.make_case(spec.name, "torch", "bf16", {**base, **extra}, "normal", 0)
        assert case.id == "mla.decode_fused_fp8/torch/bf16/b=3,new=2,hq=2,kv=64,lens=ragged,sink=0/normal/seed=0"
    p = spec.params.validate(spec.name, {**base, "fp8": "e5m2", "scale_dtype": "bf16"})
    x = spec.make_inputs(p, "bf16", "normal", np.random.default_rng(3))
    assert x["w_uk"].dtype.name == "float8_e5m2" and x["w_uk_scale"].dtype == ml_dtypes.bfloat16
    g = x
    args = (g["q"], g["input_row_offsets"], g["freqs_cis"], g["gamma"], 1e-6, g["w_uk"], g["w_uk_scale"], g["w_uv"],
            g["w_uv_scale"], g["kv_cache"], g["block_table"], g["cache_lengths"], 0.1)
    out, _ = mla.decode_fused_fp8(*args, fp8="e5m2", scale_dtype="bf16")
    q = np.asarray(g["q"], dtype=np.float64)
    H = q.shape[1]
    q_lat = mla_fp8.bmm_fp8(q[..., :128].transpose(1, 0, 2), g["w_uk"], g["w_uk_scale"].astype(np.float32),
                            fp8="e5m2", scale_dtype="bf16")
    w = mla_fp8.dequantize(g["w_uk"], g["w_uk_scale"].astype(np.float32), 128, 128)
    qa, sa = mla_fp8.quantize_act(q[..., :128].transpose(1, 0, 2), fp8="e5m2", scale_dtype="bf16")
    _close(q_lat, mla_fp8.dequantize(qa, sa, 1, 128) @ w.transpose(0, 2, 1), "e5m2 / bf16 q_lat")
    assert out.shape == (q.shape[0], H, 128) and np.isfinite(out).all()
    with pytest.raises(ValueError, match="fp8='e4m3' wants float8_e4m3fn"):
        mla.decode_fused_fp8(*args)
