"""The FP8 dense MLA goldens (refimpl/kvquant_mla_dense.py, kvquant.mla_decode and kvquant.mla_pack) against plain
torch transcriptions of FlashMLA's own test helpers (its dense decode reference, tests/test_flash_mla_dense_decoding.py
style: per request, the first L tokens of its pages, bottom-right causal tril(diagonal=s_k - s_q), on the
dequantized rows; tests/quant.py quantize_k_cache for the write, transcribed in tests/test_kvquant_mla_golden.py),
in the goldens' declared conventions: only live tokens' rows and table entries are read, empty rows (0, -inf), the
write leaves every other byte and skips -1; every kernel's pack of the format's edge values (zero groups, amax
exactly 448 2^k, subnormal codes and underflow, bf16's extremes) bit for bit; and the refusals of the goldens and
of each kernel."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import kvquant_mla as km
from kernel_parity.refimpl import kvquant_mla_dense as kd

torch = pytest.importorskip("torch")

BF16 = ml_dtypes.bfloat16
POISON_BLOCK = 2147480000


def _torch_quantize(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's quantize_k_cache (V32_FP8Sparse) for rows x (n, 576) bf16 (tests/test_kvquant_mla_golden.py's)."""
    n = x.shape[0]
    out = torch.empty(n, kd.ROW_BYTES, dtype=torch.uint8)
    for g in range(4):
        blk = x[:, g * 128:(g + 1) * 128]
        s = blk.abs().amax(dim=-1).float() / 448.0
        s = torch.pow(2, s.clamp_min(1e-4).log2().ceil()).float()
        out[:, g * 128:(g + 1) * 128] = (blk.float() / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        out[:, 512 + 4 * g:516 + 4 * g] = s.view(torch.uint8).reshape(n, 4)
    out[:, 528:] = x[:, 512:].contiguous().view(torch.uint8).reshape(n, 128)
    return out


def _torch_dense_ref(q, rows_of, seqlens, scale, causal):
    """FlashMLA's dense decode reference in float64 torch, one request at a time: its L rows (L, 576), logits,
    tril(diagonal=L - s_q) when causal, softmax, O = P rows[:, :512]; an empty row O = 0, LSE = -inf."""
    b, s_q, h, _ = q.shape
    o = np.zeros((b, s_q, h, 512))
    lse = np.full((b, h, s_q), -np.inf)
    for i in range(b):
        L = int(seqlens[i])
        kv = torch.from_numpy(rows_of(i, L))  # L, 576
        qi = torch.from_numpy(q[i]).double()  # s_q, h, 576
        s = torch.einsum("qhd,kd->hqk", qi, kv) * scale
        if causal and s_q > 1:
            mask = torch.ones(s_q, L, dtype=torch.bool).tril(diagonal=L - s_q)
            s = s.masked_fill(~mask, float("-inf"))
        ls = torch.logsumexp(s, dim=-1)  # h, s_q
        p = torch.where(torch.isinf(ls)[..., None], torch.zeros_like(s), torch.exp(s - ls[..., None]))
        o[i] = torch.einsum("hqk,kd->qhd", p, kv[:, :512]).numpy()
        lse[i] = ls.numpy()
    return o, lse


def _rows(rng, n):
    x = rng.standard_normal((n, 576)) / 10.0
    x[:, :512] *= np.repeat(10.0 ** rng.uniform(-4, 2, (n, 4)), 128, axis=1)
    return x.astype(BF16)


def _paged(rng, seqlens, page=64, pad_row=True):
    """(cache (num_blocks, page, 1, 656) uint8 with NaN poison everywhere but the live tokens, table (b, m) int32 with
    poison ids past each request's pages, rows_of(i, L) -> the request's dequantized rows)."""
    used = [-(-int(n) // page) for n in seqlens]
    n_blocks = sum(used) + 2
    perm = 1 + rng.permutation(n_blocks - 1)
    cache = np.full((n_blocks, page, 1, kd.ROW_BYTES), 0x7F, dtype=np.uint8)  # NaN codes, 3.4e38 scales
    table = np.full((len(seqlens), max(used + [1]) + 1), POISON_BLOCK, dtype=np.int32)
    nxt, dense = 0, []
    for i, L in enumerate(seqlens):
        blocks = perm[nxt:nxt + used[i]]
        nxt += used[i]
        table[i, :used[i]] = blocks
        t = np.arange(L)
        rows = km.pack(_rows(rng, int(L)).astype(np.float64))
        cache[blocks[t // page], t % page, 0] = rows
        dense.append(km.unpack(rows))
    return cache, table, lambda i, L: dense[i][:L]


@pytest.mark.parametrize("causal", [0, 1])
def test_decode_golden_matches_a_torch_dense_reference(causal):
    rng = np.random.default_rng(5 + causal)
    seqlens = np.array([130, 0, 1, 64, 65, 2], dtype=np.int32)
    cache, table, rows_of = _paged(rng, seqlens)
    q = rng.standard_normal((6, 2, 8, 576)).astype(BF16).astype(np.float64) / 4
    o, lse = kd.mla_decode(q, cache, table, seqlens, 576 ** -0.5, causal=bool(causal))
    ro, rl = _torch_dense_ref(q, rows_of, seqlens, 576 ** -0.5, bool(causal))
    np.testing.assert_allclose(o, ro, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, rl, rtol=1e-12)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()  # an empty request
    if causal:  # L = 1, s_q = 2: row 0 sees nothing, row 1 the one token
        assert (o[2, 0] == 0).all() and np.isneginf(lse[2, :, 0]).all() and np.isfinite(lse[2, :, 1]).all()


def test_decode_golden_reads_only_live_tokens():
    rng = np.random.default_rng(7)
    seqlens = np.array([70, 3], dtype=np.int32)
    cache, table, _ = _paged(rng, seqlens)
    q = rng.standard_normal((2, 1, 4, 576)) / 4
    a = kd.mla_decode(q, cache, table, seqlens, 0.1, causal=False)
    other = cache.copy()
    live = np.zeros(cache.shape[:2], dtype=bool)
    for i, L in enumerate(seqlens):
        t = np.arange(L)
        live[table[i, t // 64], t % 64] = True
    other[~live] = km.pack(_rows(rng, int((~live).sum())).astype(np.float64))[:, None]
    b = kd.mla_decode(q, other, table, seqlens, 0.1, causal=False)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_pack_golden_matches_flashmla_quantize_and_keeps_other_bytes():
    rng = np.random.default_rng(8)
    n, blocks, page = 50, 2, 64
    x = _rows(rng, n)
    x[0, 128:256] = 0  # a zero group
    x[1, :128] = np.clip(x[1, :128].astype(np.float64), -2.0 ** -3 * 448, 2.0 ** -3 * 448).astype(BF16)
    x[1, 7] = 448 * 2.0 ** -3  # amax exactly 448 2^-3
    cache = rng.integers(0, 256, (blocks, page, 1, kd.ROW_BYTES), dtype=np.uint8)
    slots = rng.choice(blocks * page, n, replace=False).astype(np.int64)
    slots[[3, 9]] = -1
    out = kd.mla_pack(cache, x[:, :512], x[:, 512:], slots)
    want = cache.copy().reshape(-1, kd.ROW_BYTES)
    real = slots != -1
    want[slots[real]] = _torch_quantize(torch.from_numpy(x[real].view(np.uint16)).view(torch.bfloat16)).numpy()
    np.testing.assert_array_equal(out.reshape(-1, kd.ROW_BYTES), want)
    np.testing.assert_array_equal(cache.reshape(-1, kd.ROW_BYTES)[~np.isin(np.arange(blocks * page), slots)],
                                  out.reshape(-1, kd.ROW_BYTES)[~np.isin(np.arange(blocks * page), slots)])


@pytest.mark.parametrize("what", ["float cache", "row width", "block out of range", "short table", "d_v", "hq"])
def test_decode_golden_refuses(what):
    cache = np.zeros((2, 64, 1, kd.ROW_BYTES), dtype=np.uint8)
    q = np.zeros((1, 1, 4, 576))
    table = np.array([[1, POISON_BLOCK]], dtype=np.int32)
    seqlens = np.array([64], dtype=np.int32)
    d_v = 512
    if what == "float cache":
        cache = cache.astype(np.float32)
    elif what == "row width":
        cache = cache[..., :655]
    elif what == "block out of range":
        seqlens[0] = 65  # the poison entry is now live
    elif what == "short table":
        table = table[:, :1]
        seqlens[0] = 65
    elif what == "d_v":
        d_v = 256
    else:
        cache = np.zeros((2, 64, 3, kd.ROW_BYTES), dtype=np.uint8)
    with pytest.raises(ValueError):
        kd.mla_decode(q, cache, table, seqlens, 0.1, d_v=d_v)


@pytest.mark.parametrize("what", ["slot out of range", "negative slot", "duplicate slot", "two heads", "shapes"])
def test_pack_golden_refuses(what):
    cache = np.zeros((2, 64, 1, kd.ROW_BYTES), dtype=np.uint8)
    x = np.zeros((3, 576))
    slots = np.array([0, 5, -1])
    if what == "slot out of range":
        slots[1] = 128
    elif what == "negative slot":
        slots[1] = -2
    elif what == "duplicate slot":
        slots[1] = 0
    elif what == "two heads":
        cache = np.zeros((2, 64, 2, kd.ROW_BYTES), dtype=np.uint8)
    else:
        x = np.zeros((3, 575))
    with pytest.raises(ValueError):
        kd.mla_pack(cache, x[:, :512], x[:, 512:], slots)


def _triton():
    """The Triton module, or a skip where Triton cannot run here (kernel-parity's interpreter set-up)."""
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    from kernel_parity.conformance.backends.triton_interpreter import ensure_bf16

    ensure_bf16()  # the GPU's fp32 -> fp8 rounding on the interpreter
    from kernel_parity.kernels.triton import kvquant_mla_dense

    return kvquant_mla_dense


def _edge_rows():
    """Rows of the format's edge values: zero groups, amax exactly 448 2^k (k from -133 to 119, bf16's range),
    subnormal codes and values that underflow to 0, bf16's largest and smallest (subnormal) values."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 576)) / 10
    x[0, :] = 0.0
    for r, k in enumerate([-20, -5, 0, 3, 30, 119], start=1):  # amax exactly 448 2^k
        x[r, :512] = np.clip(x[r, :512] * 2.0 ** k * 1000, -448 * 2.0 ** k, 448 * 2.0 ** k)
        x[r, 100] = -448 * 2.0 ** k
    x[7, :512] = rng.standard_normal(512) * 2.0 ** -20  # the scale floors at 2^-13: subnormal codes, underflow
    x[8, :512] = float(ml_dtypes.finfo(BF16).max) * rng.choice([-1.0, 1.0], 512)  # bf16 max: scale 2^120
    x[9, :512] = float(ml_dtypes.finfo(BF16).smallest_subnormal) * rng.integers(-3, 4, 512)
    x[10, :512] = np.where(np.arange(512) % 128 == 0, 2.0 ** -2, 2.0 ** -17)  # the floor with a normal amax
    x[11, :512] = rng.standard_normal(512) * np.repeat(2.0 ** np.array([-10, 0, 10, 20]), 128)
    return x.astype(BF16)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_every_kernel_packs_the_edge_values_bit_for_bit(backend):
    x = _edge_rows()
    n = x.shape[0]
    rng = np.random.default_rng(10)
    cache = rng.integers(0, 256, (2, 16, 1, kd.ROW_BYTES), dtype=np.uint8)
    slots = np.concatenate([rng.choice(32, n, replace=False), [-1]]).astype(np.int64)
    xs = np.concatenate([x, x[:1]])
    want = kd.mla_pack(cache, xs[:, :512], xs[:, 512:], slots)
    kv_c, k_pe = np.ascontiguousarray(xs[:, :512]), np.ascontiguousarray(xs[:, 512:])
    if backend == "cpu":
        from kernel_parity.kernels.cpu.kvquant_mla_dense import kvquant_mla_pack
        got = cache.copy()
        kvquant_mla_pack(got, kv_c, k_pe, slots)
    else:
        def t(a):
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        if backend == "torch":
            from kernel_parity.kernels.torch.kvquant_mla_dense import mla_pack as fn
        else:
            fn = _triton().kvquant_mla_pack
        tc = torch.from_numpy(cache.copy())
        fn(tc, t(kv_c), t(k_pe), torch.from_numpy(slots))
        got = tc.numpy()
    np.testing.assert_array_equal(got, want)


def _bad_decode():
    cache = np.zeros((2, 64, 1, kd.ROW_BYTES), dtype=np.uint8)
    q = np.zeros((1, 1, 4, 576), dtype=BF16)
    table = np.array([[1, POISON_BLOCK]], dtype=np.int32)
    return q, cache, table, np.array([65], dtype=np.int32)  # token 64 lives in the poison entry


def test_cpu_kernels_refuse_like_the_goldens():
    from kernel_parity.kernels.cpu.kvquant_mla_dense import kvquant_mla_decode, kvquant_mla_pack
    q, cache, table, seqlens = _bad_decode()
    with pytest.raises(ValueError, match="block"):
        kvquant_mla_decode(q, cache, table, seqlens, 0.1)
    kvquant_mla_decode(q, cache, table, np.array([64], dtype=np.int32), 0.1)  # the poison entry not live: fine
    with pytest.raises(ValueError, match="kv_cache"):
        kvquant_mla_decode(q, cache.astype(np.int8), table, seqlens, 0.1)
    with pytest.raises(ValueError, match="q"):
        kvquant_mla_decode(q.astype(np.float32), cache, table, seqlens, 0.1)
    x = np.zeros((2, 576), dtype=BF16)
    for slots in ([0, 128], [3, 3], [-2, 0]):
        with pytest.raises(ValueError, match="slot_mapping"):
            kvquant_mla_pack(cache, x[:, :512].copy(), x[:, 512:].copy(), np.array(slots, dtype=np.int64))
    with pytest.raises(ValueError, match="kv_c"):
        kvquant_mla_pack(cache, x[:, :512].astype(np.float32), x[:, 512:].copy(), np.array([0, 1]))


def test_torch_and_triton_kernels_refuse():
    from kernel_parity.kernels.torch.kvquant_mla_dense import mla_decode as eager
    q, cache, table, seqlens = _bad_decode()
    tq = torch.from_numpy(q.view(np.uint16)).view(torch.bfloat16)
    with pytest.raises(ValueError):
        eager(tq, torch.from_numpy(cache), torch.from_numpy(table), torch.from_numpy(seqlens), 0.1)
    tri = _triton()
    args = (torch.from_numpy(table), torch.from_numpy(seqlens), 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        tri.kvquant_mla_decode(tq, torch.from_numpy(cache).float(), *args)
    with pytest.raises(ValueError, match="q"):
        tri.kvquant_mla_decode(tq.float(), torch.from_numpy(cache), *args)
    with pytest.raises(ValueError, match="block_table"):
        tri.kvquant_mla_decode(tq, torch.from_numpy(cache), torch.from_numpy(table).long(), *args[1:])
    kv_c = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_pe"):
        tri.kvquant_mla_pack(torch.from_numpy(cache), kv_c, torch.zeros(2, 63, dtype=torch.bfloat16),
                             torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        tri.kvquant_mla_pack(torch.from_numpy(cache), kv_c, torch.zeros(2, 64, dtype=torch.bfloat16),
                             torch.zeros(3, dtype=torch.int64))
