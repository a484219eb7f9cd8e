"""FlashMLA's dense paged MLA decode over its FP8 KV cache rows of 656 bytes, and the rows' write path, in Triton
(`kvquant.mla_decode`, `kvquant.mla_pack`).

    s_ij  = scale (sum_g sc_jg (q_i,g . codes_jg) + q_i,pe . k_pe,j)       g = the 4 groups of 128 latent channels
    LSE_i = ln sum_j exp(s_ij);  O_i,g = sum_j exp(s_ij - LSE_i) sc_jg codes_jg     (V = the dequantized latent)

Row format and the byte reads: kernels/triton/kvquant_mla.py (its `_e4m3` / `_group` helpers are used here: codes
decoded in integer arithmetic to bf16 exactly, scales and RoPE read through float32 / bf16 pointers at byte offsets
512 / 528, the scales folded into 4 bf16 tl.dot's of 128 per tile and into the probabilities of the P V dots).
Paging and masking: kernels/triton/mla.py's dense decode (conventions refimpl/kvquant_mla_dense.py): token t of
request b is kv_cache[block_table[b, t // page], t % page, kv head]; row r (of s_q) sees t <= L_b - s_q + r with
`causal` (bottom-right); slots at or past L_b and table entries past a request's last page are never read; a row
with no visible token gives O = 0, LSE = -inf.

Structure (mla_decode): one program per (request, split of its tokens, kv head, block of <= 64 of its h_q / h_kv x
s_q query rows; row m is query m // g of head kvh g + m % g), so a key tile serves every query row of its kv head;
tiles of BLOCK_N tokens, each token's block id read from the table (any page size); online
softmax in the log2 domain with fp32 state; splits merged by lse_combine (attention_decode's `_combine`) on a GPU,
one split on the interpreter.

mla_pack: one program per token (slot -1: return at once, nothing written): its 512 latent values widened to fp32,
per 128-group amax / 448 (tl.math.div_rn: IEEE), clamped below at float32(1e-4), rounded up to a power of two on
its bits (a float32 with a nonzero mantissa goes to the next exponent: exact); codes = div_rn(x, scale) (exact: a
power of two), clamped to +-448, .to(float8e4nv) (round to nearest even, as kernels/triton/kvquant.py's write);
the 4 scales stored through a float32 pointer at byte 512, the 64 RoPE values through a bf16 pointer at 528.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import _combine, _sm_count
from .kvquant_mla import _check, _group
from .mla import _check_index, _outputs
from .softmax import LN2

ROW_BYTES, D, D_V, D_PE = 656, 576, 512, 64
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256
AMAX_FLOOR = 9.999999747378752e-05  # float32(1e-4): FlashMLA's clamp of amax / 448


@triton.jit
def _kvq_mla_decode_kernel(
    Q_ptr, KV_ptr, O_ptr, Lse_ptr, Seqlens_ptr, BT_ptr,
    s_q, h_q, h_kv, n_m, n_splits, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt_b, stride_bt_p,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_l_split, stride_lb, stride_lh, stride_ls,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % n_m
    kvh = (pid // n_m) % h_kv
    split = (pid // n_m // h_kv) % n_splits
    b = pid // n_m // h_kv // n_splits
    L = tl.load(Seqlens_ptr + b)

    grp = h_q // h_kv
    n_rows = grp * s_q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    qi = offs_m // grp
    head = kvh * grp + offs_m % grp
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, 128)
    offs_pe = tl.arange(0, 64)
    q_rows = b.to(tl.int64) * stride_qb + qi * stride_qs + head * stride_qh
    q0 = tl.load(Q_ptr + q_rows[:, None] + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q1 = tl.load(Q_ptr + q_rows[:, None] + 128 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q2 = tl.load(Q_ptr + q_rows[:, None] + 256 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q3 = tl.load(Q_ptr + q_rows[:, None] + 384 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(Q_ptr + q_rows[:, None] + 512 + offs_pe[None, :], mask=mask_m[:, None], other=0.0)

    per_split = tl.cdiv(tl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N  # whole tiles
    lo = tl.minimum(split * per_split, L)
    hi = tl.minimum(lo + per_split, L)
    diag = L - s_q + qi  # the last token row m sees (causal)
    if CAUSAL:  # no tile past the last token the block's last row sees
        hi = tl.minimum(hi, L - s_q + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // grp + 1)

    bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        live = cols < hi  # never at or past L_b: poisoned slots and table entries are not read
        page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0)
        rows = page.to(tl.int64) * stride_kb + (cols % PAGE).to(tl.int64) * stride_ks + kvh * stride_kh
        k0, sc0 = _group(KV_ptr, rows, live, offs_t, 0)
        k1, sc1 = _group(KV_ptr, rows, live, offs_t, 1)
        k2, sc2 = _group(KV_ptr, rows, live, offs_t, 2)
        k3, sc3 = _group(KV_ptr, rows, live, offs_t, 3)
        kp = tl.load((KV_ptr + rows + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_pe[None, :],
                     mask=live[:, None], other=0.0)
        s = tl.dot(q0, tl.trans(k0)) * sc0[None, :]
        s += tl.dot(q1, tl.trans(k1)) * sc1[None, :]
        s += tl.dot(q2, tl.trans(k2)) * sc2[None, :]
        s += tl.dot(q3, tl.trans(k3)) * sc3[None, :]
        s = tl.dot(q_pe, tl.trans(kp), s)
        keep = live[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= diag[:, None])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = tl.dot((p * sc0[None, :]).to(tl.bfloat16), k0, acc0 * alpha[:, None])
        acc1 = tl.dot((p * sc1[None, :]).to(tl.bfloat16), k1, acc1 * alpha[:, None])
        acc2 = tl.dot((p * sc2[None, :]).to(tl.bfloat16), k2, acc2 * alpha[:, None])
        acc3 = tl.dot((p * sc3[None, :]).to(tl.bfloat16), k3, acc3 * alpha[:, None])
        m_i = m_new

    o_rows = split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob + qi * stride_os + head * stride_oh
    inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    o_ptrs = O_ptr + o_rows[:, None] + offs_t[None, :]
    ty = O_ptr.dtype.element_ty
    tl.store(o_ptrs, (acc0 * inv[:, None]).to(ty), mask=mask_m[:, None])
    tl.store(o_ptrs + 128, (acc1 * inv[:, None]).to(ty), mask=mask_m[:, None])
    tl.store(o_ptrs + 256, (acc2 * inv[:, None]).to(ty), mask=mask_m[:, None])
    tl.store(o_ptrs + 384, (acc3 * inv[:, None]).to(ty), mask=mask_m[:, None])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    lse_rows = split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh + qi * stride_ls
    tl.store(Lse_ptr + lse_rows, lse, mask=mask_m)


def kvquant_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
                       scale: float, d_v: int = 512, causal: bool = True, num_splits: int | None = None,
                       out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None, *, block_n: int = 32,
                       num_warps: int | None = None, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense MLA decode of q (b, s_q, h_q, 576) bf16 over the FP8 rows kv_cache (num_blocks, page, h_kv, 656) uint8
    (or (num_blocks, page, 656): h_kv = 1); block_table (b, max_blocks) int32; seqlens (b,) int32 on q's device.
    returns (out (b, s_q, h_q, 512) bf16, out_lse (b, h_q, s_q) fp32); num_splits: splits of each request's
    tokens (None: 1 on the interpreter / CPU, about one wave of programs on a GPU)."""
    what = "kvquant_mla_decode"
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3:
        kv_cache = kv_cache[:, :, None]
    b, s_q, h_q, h_kv = _check(q, kv_cache, scale, d_v, what)
    if s_q < 1:
        raise ValueError(f"{what}: s_q={s_q} must be >= 1")
    _check_index(block_table, "block_table", (b, None), q.device, what)
    _check_index(seqlens, "seqlens", (b,), q.device, what)
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 65535):
        raise ValueError(f"{what}: num_splits={num_splits!r} must be an int in [1, 65535]")
    if block_n not in (16, 32, 64):
        raise ValueError(f"{what}: block_n={block_n!r} must be 16, 32 or 64")
    page = kv_cache.shape[1]
    rows = s_q * (h_q // h_kv)
    block_m = min(64, max(16, triton.next_power_of_2(max(rows, 1))))
    n_m = triton.cdiv(rows, block_m)
    programs = b * h_kv * n_m
    if num_splits is None:
        num_splits = 1
        if q.is_cuda and programs > 0:
            max_keys = block_table.shape[1] * page
            num_splits = max(1, min(2 * _sm_count(q.device) // programs, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))
    if programs * num_splits >= 2**31:
        raise ValueError(f"{what}: {programs} x {num_splits} programs exceed CUDA's grid")
    out, out_lse, dst_o, dst_l = _outputs(q, D_V, out, out_lse, num_splits)
    if b == 0 or h_q == 0:
        return out, out_lse
    _kvq_mla_decode_kernel[(programs * num_splits,)](
        q, kv_cache, dst_o, dst_l, seqlens, block_table,
        s_q, h_q, h_kv, n_m, num_splits, float(scale) * 1.4426950408889634,
        *q.stride()[:3], *kv_cache.stride()[:3], *block_table.stride(), *dst_o.stride()[:4], *dst_l.stride(),
        CAUSAL=bool(causal) and s_q > 1, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps or (8 if block_m == 64 else 4), num_stages=num_stages,
    )
    if num_splits > 1:
        _combine(dst_o, dst_l, out, out_lse, None)
    return out, out_lse


# --------------------------------------------------------------------------- the write path

@triton.jit
def _kvq_mla_pack_kernel(KV_ptr, C_ptr, Pe_ptr, Slot_ptr, page, stride_kb, stride_ks, stride_ct, stride_pt):
    t = tl.program_id(0)
    slot = tl.load(Slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding: nothing written
        return
    row = KV_ptr + (slot // page) * stride_kb + (slot % page) * stride_ks
    offs_g = tl.arange(0, 4)
    offs_t = tl.arange(0, 128)
    x = tl.load(C_ptr + t.to(tl.int64) * stride_ct + offs_g[:, None] * 128 + offs_t[None, :]).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    v = tl.maximum(tl.math.div_rn(amax, 448.0), 9.999999747378752e-05)  # float32(1e-4): AMAX_FLOOR
    bits = v.to(tl.int32, bitcast=True)
    e = (bits & 0x7F800000) + tl.where((bits & 0x007FFFFF) != 0, 0x00800000, 0)  # the least power of two >= v
    sc = e.to(tl.float32, bitcast=True)
    c = tl.math.div_rn(x, sc[:, None])
    c = tl.minimum(tl.maximum(c, -448.0), 448.0)  # never acts on these scales (__NV_SATFINITE)
    codes = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(row + offs_g[:, None] * 128 + offs_t[None, :], codes)
    tl.store((row + 512).to(tl.pointer_type(tl.float32)) + offs_g, sc)
    offs_pe = tl.arange(0, 64)
    pe = tl.load(Pe_ptr + t.to(tl.int64) * stride_pt + offs_pe)
    tl.store((row + 528).to(tl.pointer_type(tl.bfloat16)) + offs_pe, pe)


def kvquant_mla_pack(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write rows [kv_c (n, 512) ; k_pe (n, 64)] (bf16) quantized into kv_cache (num_blocks, page, 1, 656) uint8 (or
    (num_blocks, page, 656)) in place at slot_mapping (n,) int64 / int32 (-1 skipped); returns kv_cache.
    Slots (range, distinctness) are the caller's: not checked (a device sync)."""
    what = "kvquant_mla_pack"
    cache = kv_cache[:, :, None] if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3 else kv_cache
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 4 \
            or cache.shape[2] != 1 or cache.shape[3] != ROW_BYTES or cache.shape[1] < 1:
        raise ValueError(f"{what}: kv_cache must be a (num_blocks, page, 1, {ROW_BYTES}) uint8 tensor, got "
                         f"{getattr(kv_cache, 'shape', type(kv_cache).__name__)} {getattr(kv_cache, 'dtype', '')}")
    if cache.stride(-1) != 1 or any(s % 4 for s in cache.stride()[:2]) or cache.data_ptr() % 4:
        raise ValueError(f"{what}: kv_cache rows must be unit-stride bytes at 4-byte aligned addresses (the scales "
                         f"are float32), got strides {tuple(cache.stride())}")
    for name, t, d in (("kv_c", kv_c, D_V), ("k_pe", k_pe, D_PE)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != d \
                or t.device != cache.device or (t.numel() and t.stride(1) != 1):
            raise ValueError(f"{what}: {name} must be an (n, {d}) bfloat16 tensor with unit last stride on "
                             f"{cache.device}, got {getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}")
    n = kv_c.shape[0]
    if k_pe.shape[0] != n:
        raise ValueError(f"{what}: k_pe has {k_pe.shape[0]} rows, kv_c {n}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64) \
            or tuple(slot_mapping.shape) != (n,) or slot_mapping.device != cache.device:
        raise ValueError(f"{what}: slot_mapping must be a ({n},) int32 / int64 tensor on {cache.device}, got "
                         f"{getattr(slot_mapping, 'shape', type(slot_mapping).__name__)} "
                         f"{getattr(slot_mapping, 'dtype', '')}")
    if n == 0 or cache.numel() == 0:
        return kv_cache
    _kvq_mla_pack_kernel[(n,)](cache, kv_c, k_pe, slot_mapping.contiguous(), cache.shape[1], cache.stride(0),
                               cache.stride(1), kv_c.stride(0), k_pe.stride(0), num_warps=4)
    return kv_cache
