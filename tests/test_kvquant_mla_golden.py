"""The FP8 sparse MLA golden (refimpl/kvquant_mla.py, kvquant.mla_sparse) against plain torch transcriptions of
FlashMLA's own test helpers (tests/quant.py quantize_k_cache / dequantize_k_cache for its V32_FP8Sparse layout, and
its float reference of the sparse decode), in the golden's declared conventions: the 656-byte layout, power-of-two
scales (amax / 448 clamped at 1e-4, rounded up), e4m3 codes (saturated at 448, subnormal), -1 padding, topk_length,
a slot listed twice, rows no used entry names never read; every kernel's decoding of every finite e4m3 code (one key:
O is the row, code x scale, bit for bit); and the refusals of the golden and of each kernel."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernel_parity.refimpl import kvquant_mla as km

torch = pytest.importorskip("torch")


def _torch_quantize(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's quantize_k_cache (V32_FP8Sparse) for rows x (n, 576) bf16, written out in torch: per 128-group
    scale = 2^ceil(log2(max(amax / 448, 1e-4))), codes = (x / scale).to(float8_e4m3fn), the RoPE bf16 bytes."""
    n = x.shape[0]
    out = torch.empty(n, km.ROW_BYTES, dtype=torch.uint8)
    for g in range(4):
        blk = x[:, g * 128:(g + 1) * 128]
        s = blk.abs().amax(dim=-1).float() / 448.0
        s = torch.pow(2, s.clamp_min(1e-4).log2().ceil()).float()
        out[:, g * 128:(g + 1) * 128] = (blk.float() / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        out[:, 512 + 4 * g:516 + 4 * g] = s.view(torch.uint8).reshape(n, 4)
    out[:, 528:] = x[:, 512:].contiguous().view(torch.uint8).reshape(n, 128)
    return out


def _torch_dequantize(rows: torch.Tensor) -> torch.Tensor:
    """FlashMLA's dequantize_k_cache: codes in float32 times their group's scale, stored bf16; the RoPE bytes."""
    n = rows.shape[0]
    out = torch.empty(n, 576, dtype=torch.bfloat16)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    for g in range(4):
        c = rows[:, g * 128:(g + 1) * 128].contiguous().view(torch.float8_e4m3fn).float()
        out[:, g * 128:(g + 1) * 128] = (c * scales[:, g:g + 1]).to(torch.bfloat16)
    out[:, 512:] = rows[:, 528:].contiguous().view(torch.bfloat16)
    return out


def _torch_sparse_ref(q, rows, idx, topk_length, scale):
    """The sparse decode in float64 torch: gather each list's rows, -1 and entries past topk_length masked, softmax,
    O = P rows[:, :512]; an empty row O = 0, LSE = -inf (FlashMLA returns +inf there)."""
    q = torch.from_numpy(q).double()
    kv = torch.from_numpy(rows).double()  # slots, 576
    idx = torch.from_numpy(idx).long()  # b, s_q, topk (h_kv = 1)
    valid = (idx != -1) & (torch.arange(idx.shape[-1]) < torch.from_numpy(topk_length).long()[:, None, None])
    k = kv[torch.where(valid, idx, 0)]  # b, s_q, topk, 576
    s = torch.einsum("bqhd,bqkd->bqhk", q, k) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # b, s_q, h
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    o = torch.einsum("bqhk,bqkd->bqhd", p, torch.where(valid[..., None], k, 0.0)[..., :512])
    return o.numpy(), lse.permute(0, 2, 1).numpy()


def _rows(rng, n, spread=True):
    x = rng.standard_normal((n, 576)) / 10.0
    if spread:  # groups a few decades apart, a zero group, a saturating amax
        x[:, :512] *= np.repeat(10.0 ** rng.uniform(-4, 2, (n, 4)), 128, axis=1)
        x[0, 128:256] = 0.0
        x[1, 5] = 448.0 * 2.0 ** -3
        x[1, :128] = np.clip(x[1, :128], -56.0, 56.0)
    return x.astype(ml_dtypes.bfloat16)


def test_pack_matches_flashmla_quantize_byte_for_byte():
    rng = np.random.default_rng(0)
    x = _rows(rng, 300)
    want = _torch_quantize(torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)).numpy()
    np.testing.assert_array_equal(km.pack(x.astype(np.float64)), want)


def test_unpack_matches_flashmla_dequantize_exactly():
    rng = np.random.default_rng(1)
    rows = km.pack(_rows(rng, 200).astype(np.float64))
    want = _torch_dequantize(torch.from_numpy(rows)).float().numpy().astype(np.float64)
    np.testing.assert_array_equal(km.unpack(rows), want)


def test_layout_and_scale_choices():
    x = np.zeros((1, 576))
    x[0, 0] = 448.0 * 2.0 ** -5  # amax exactly 448 2^-5: scale 2^-5, the saturated code
    x[0, 1] = 3 * 2.0 ** -9 * 2.0 ** -5  # a subnormal code (m = 3)
    x[0, 128:256] = 0.0  # a zero group: the 1e-4 clamp gives 2^-13, codes 0
    x[0, 256] = 1e-3  # amax / 448 below 1e-4: 2^-13 as well
    x[0, 384] = -300.0  # amax / 448 = 0.67: scale 1, code -300 rounded to -288 (e4m3 step 32 at 256..448)
    x[0, 512:] = np.arange(64) - 31.5
    row = km.pack(x)[0]
    codes, scales, rope = km.unpack_parts(row)
    np.testing.assert_array_equal(scales, np.array([2.0 ** -5, 2.0 ** -13, 2.0 ** -13, 1.0], np.float32))
    assert row[0] == 0x7E and float(codes[0]) == 448.0
    assert row[1] == 3 and float(codes[1]) == 3 * 2.0 ** -9
    assert not row[128:256].any()
    assert float(codes[384]) == -288.0
    np.testing.assert_array_equal(row[512:528].view("<f4"), scales)
    np.testing.assert_array_equal(row[528:].view("<u2").view(ml_dtypes.bfloat16).astype(np.float64), x[0, 512:])
    assert km.ROW_BYTES == 656 and km.SCALE_OFF == 512 and km.ROPE_OFF == 528


def test_golden_matches_a_torch_sparse_reference():
    rng = np.random.default_rng(2)
    n_blocks, page, b, s_q, h, k = 5, 64, 3, 2, 8, 40
    cache = km.pack(_rows(rng, n_blocks * page).astype(np.float64)).reshape(n_blocks, page, 1, km.ROW_BYTES)
    idx = rng.integers(0, n_blocks * page, (b, s_q, k)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[:, :, 1] = idx[:, :, 0]  # a slot listed twice
    idx[2] = -1  # a request with no used entry
    tlen = np.array([k, 17, k], dtype=np.int32)
    q = rng.standard_normal((b, s_q, h, 576)).astype(ml_dtypes.bfloat16).astype(np.float64) / 4
    o, lse = km.mla_sparse(q, cache, idx, tlen, 576 ** -0.5)
    ro, rl = _torch_sparse_ref(q, km.unpack(cache.reshape(-1, km.ROW_BYTES)), idx, tlen, 576 ** -0.5)
    np.testing.assert_allclose(o, ro, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, rl, rtol=1e-12)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()


def test_rows_no_used_entry_names_are_never_read():
    rng = np.random.default_rng(3)
    cache = km.pack(_rows(rng, 2 * 64, spread=False).astype(np.float64)).reshape(2, 64, 1, km.ROW_BYTES)
    idx = np.array([[[3, 70, -1, 9, 100]]], dtype=np.int32)
    tlen = np.array([4], dtype=np.int32)
    poisoned = cache.copy().reshape(-1, km.ROW_BYTES)
    keep = np.zeros(128, dtype=bool)
    keep[[3, 70, 9]] = True
    poisoned[~keep] = 0x7F  # NaN codes, scales 3.4e38, RoPE 3.4e38: slot 100 is past topk_length
    q = rng.standard_normal((1, 1, 4, 576)) / 4
    a = km.mla_sparse(q, cache, idx, tlen, 0.1)
    b = km.mla_sparse(q, poisoned.reshape(cache.shape), idx, tlen, 0.1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("what", ["float cache", "row width", "slot out of range", "negative slot", "indices shape"])
def test_golden_refuses(what):
    cache = np.zeros((2, 64, 1, km.ROW_BYTES), dtype=np.uint8)
    q = np.zeros((1, 1, 4, 576))
    idx = np.zeros((1, 1, 1, 8), dtype=np.int32)
    if what == "float cache":
        cache = cache.astype(np.float32)
    elif what == "row width":
        cache = cache[..., :655]
    elif what == "slot out of range":
        idx[..., 3] = 128
    elif what == "negative slot":
        idx[..., 3] = -2
    else:
        idx = idx[:, :, :, :, None]
    with pytest.raises(ValueError):
        km.mla_sparse(q, cache, idx, None, 0.1)
    # an out-of-range entry past topk_length is never used: not refused
    if what == "slot out of range":
        km.mla_sparse(q, cache, idx, np.array([3], dtype=np.int32), 0.1)


def _bad_inputs():
    cache = np.zeros((2, 64, 1, km.ROW_BYTES), dtype=np.uint8)
    q = np.zeros((1, 1, 4, 576), dtype=ml_dtypes.bfloat16)
    idx = np.zeros((1, 1, 1, 8), dtype=np.int32)
    idx[..., 2] = 128  # outside the 128 slots
    return q, cache, idx


def test_cpu_kernel_refuses_like_the_golden():
    from kernel_parity.kernels.cpu.kvquant_mla import kvquant_mla_sparse
    q, cache, idx = _bad_inputs()
    with pytest.raises(ValueError, match="indices"):
        kvquant_mla_sparse(q, cache, idx, None, 0.1)
    kvquant_mla_sparse(q, cache, idx, np.array([2], dtype=np.int32), 0.1)  # past topk_length: fine
    with pytest.raises(ValueError, match="kv_cache"):
        kvquant_mla_sparse(q, cache.astype(np.int8), idx, None, 0.1)
    with pytest.raises(ValueError, match="q"):
        kvquant_mla_sparse(q.astype(np.float32), cache, idx, None, 0.1)


def _triton():
    """The Triton kernel, or a skip where Triton cannot run here (kernel-parity's interpreter set-up)."""
    from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

    prepare_environment()  # TRITON_INTERPRET=1 before triton's first import on a machine without a GPU
    why = interpreter_ready()
    if why:
        pytest.skip(why)
    from kernel_parity.kernels.triton.kvquant_mla import kvquant_mla_sparse

    return kvquant_mla_sparse


def _one_key_row():
    """One 656-byte row holding every finite e4m3 code (254 of them, twice, then 4 zeros), scales 2^-3, 1, 2^5,
    2^-20 and RoPE values; with one key p = 1, so O is the row's NoPE part, code x scale, exact in bf16."""
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    row = np.zeros(km.ROW_BYTES, dtype=np.uint8)
    row[:508] = np.concatenate([finite, finite[::-1]])
    row[512:528] = np.array([2.0 ** -3, 1.0, 2.0 ** 5, 2.0 ** -20], "<f4").view(np.uint8)
    row[528:] = (np.arange(64) / 8 - 4).astype(ml_dtypes.bfloat16).view(np.uint8)
    cache = np.full((2, 64, 1, km.ROW_BYTES), 0x7F, dtype=np.uint8)  # NaN codes and 3.4e38 scales elsewhere
    cache[1, 5, 0] = row
    return cache, np.array([[[[-1, 69, -1]]]], dtype=np.int32)  # slot 1 * 64 + 5 between two -1


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_one_key_gives_every_code_times_its_scale_exactly(backend):
    cache, idx = _one_key_row()
    rng = np.random.default_rng(4)
    q = (rng.standard_normal((1, 1, 16, 576)) / 8).astype(ml_dtypes.bfloat16)
    want_o, want_lse = km.mla_sparse(q.astype(np.float64), cache, idx, None, 0.1)
    if backend == "cpu":
        from kernel_parity.kernels.cpu.kvquant_mla import kvquant_mla_sparse
        o, lse = kvquant_mla_sparse(q, cache, idx, None, 0.1)
    else:
        f = _triton() if backend == "triton" else __import__(
            "kernel_parity.kernels.torch.kvquant_mla", fromlist=["mla_sparse"]).mla_sparse
        tq = torch.from_numpy(q.view(np.uint16)).view(torch.bfloat16)
        o, lse = f(tq, torch.from_numpy(cache), torch.from_numpy(idx), None, 0.1)
        o, lse = o.float().numpy(), lse.numpy()
    np.testing.assert_array_equal(np.asarray(o, dtype=np.float64), want_o)  # exact: one key, p = 1
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)  # one fp32 logit of 576 terms, |LSE| up to ~1e3


def test_torch_and_triton_kernels_refuse():
    from kernel_parity.kernels.torch.kvquant_mla import mla_sparse as eager
    q, cache, idx = _bad_inputs()
    tq = torch.from_numpy(q.view(np.uint16)).view(torch.bfloat16)
    with pytest.raises(ValueError, match="indices"):
        eager(tq, torch.from_numpy(cache), torch.from_numpy(idx), None, 0.1)
    kvquant_mla_sparse = _triton()
    with pytest.raises(ValueError, match="kv_cache"):
        kvquant_mla_sparse(tq, torch.from_numpy(cache).float(), torch.from_numpy(idx), None, 0.1)
    with pytest.raises(ValueError, match="q"):
        kvquant_mla_sparse(tq.float(), torch.from_numpy(cache), torch.from_numpy(idx), None, 0.1)
    with pytest.raises(ValueError, match="scale"):
        kvquant_mla_sparse(tq, torch.from_numpy(cache), torch.from_numpy(idx), None, math.nan)
