"""FlashMLA's sparse MLA decode over its FP8 KV cache rows of 656 bytes, in Triton (`kvquant.mla_sparse`).

    s_ij  = scale (sum_g sc_jg (q_i,g . codes_jg) + q_i,pe . k_pe,j)       g = the 4 groups of 128 latent channels
    LSE_i = ln sum_j exp(s_ij);  O_i,g = sum_j exp(s_ij - LSE_i) sc_jg codes_jg     (V = the dequantized latent)

Row format (refimpl/kvquant_mla.py, FlashMLA's README "FP8 KV cache"): bytes [0, 512) e4m3fn codes, [512, 528) 4
float32 scales (one per 128 codes), [528, 656) 64 bf16 RoPE values. The cache is (num_blocks, page, h_kv, 656)
uint8 with any block / slot / head strides (FlashMLA's test pads a block to page + 1 rows); indices (b, s_q, h_kv,
topk) (or (b, s_q, topk) with h_kv = 1) int32 flat slots block * page + offset, -1 padding, entries at or past
topk_length[b] never read; query head h reads kv head h // (h_q / h_kv)'s list and rows; a row with no used entry
gives O = 0, LSE = -inf.

Structure: kernels/triton/mla_sparse.py's (one program per (request, query, split of the list, kv head, block of
<= 64 of its query heads); the heads of a kv head share each gathered row), with the row read as bytes:
- codes: uint8 loads, decoded to fp32 in integer arithmetic (`_e4m3`: sign, 4-bit exponent, 3-bit mantissa; a
  normal code's float32 bits built directly, a subnormal one m 2^-9 by one exact multiply, 0x7F / 0xFF NaN; no
  denormal operand anywhere, so flush-to-zero cannot touch it), then cast to bf16: exact (every e4m3 value is a
  bf16 value);
- scales and RoPE: the row pointer cast to float32 / bf16 pointers at byte offsets 512 / 528 (4- and 2-byte
  aligned: the row stride 656 is a multiple of 4) and loaded as such;
- the scales folded in per 128-group, never multiplied into the codes: logits = sum_g sc_g (q_g . codes_g) from 4
  bf16 tl.dot's of 128 (fp32 accumulation) plus the RoPE dot; O_g += (p sc_g).to(bf16) . codes_g (the probability
  times its key's group scale rounded to bf16 once, as p alone is in a bf16-cache kernel; with FlashMLA's
  power-of-two scales the same bits as p.to(bf16) x scale). So any positive float32 scale is taken at full
  precision, not only powers of two.
- online softmax in the log2 domain, fp32 state; splits of the list merged by lse_combine (attention_decode's
  `_combine`) when the GPU needs more programs; one split on the interpreter.
q must be bf16 (FlashMLA's FP8 sparse decode computes in bf16); O is bf16, LSE fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_decode import _combine, _sm_count
from .mla import _check_index, _outputs
from .softmax import LN2

ROW_BYTES, SCALE_OFF, ROPE_OFF, D, D_V, D_PE, TILE = 656, 512, 528, 576, 512, 64, 128
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256


@triton.jit
def _e4m3(c):
    """fp32 values of e4m3fn codes c (uint8), exactly."""
    E_SHIFT = 3
    E_MASK = 15
    M_MASK = 7
    M_SHIFT = 20
    BIAS = 120  # 127 - 7
    SUB = 0.001953125  # 2^-9: a subnormal code's unit
    x = c.to(tl.int32)
    e = (x >> E_SHIFT) & E_MASK
    m = x & M_MASK
    normal = ((e + BIAS) << 23) | (m << M_SHIFT)
    f = tl.where(e == 0, m.to(tl.float32) * SUB, normal.to(tl.float32, bitcast=True))
    f = tl.where((x & 127) == 127, float("nan"), f)
    return tl.where(x >= 128, -f, f)


@triton.jit
def _group(KV_ptr, rows, live, offs_t, g: tl.constexpr):
    """(codes (BLOCK_N, 128) bf16, scales (BLOCK_N,) fp32) of 128-group g of the gathered rows."""
    c = tl.load(KV_ptr + rows[:, None] + g * 128 + offs_t[None, :], mask=live[:, None], other=0)
    sc = tl.load((KV_ptr + rows + 512 + 4 * g).to(tl.pointer_type(tl.float32)), mask=live, other=0.0)
    return _e4m3(c).to(tl.bfloat16), sc


@triton.jit
def _kvq_mla_sparse_kernel(
    Q_ptr, KV_ptr, O_ptr, Lse_ptr, Idx_ptr, TopkLen_ptr,
    h_q, h_kv, s_q, topk, n_m, n_splits, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_ib, stride_is, stride_ih, stride_it,
    stride_o_split, stride_ob, stride_os, stride_oh, stride_l_split, stride_lb, stride_lh, stride_ls,
    HAS_TOPK_LEN: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % n_m
    kvh = (pid // n_m) % h_kv
    split = (pid // n_m // h_kv) % n_splits
    qi = (pid // n_m // h_kv // n_splits) % s_q
    b = pid // n_m // h_kv // n_splits // s_q

    grp = h_q // h_kv  # kv head kvh's query heads kvh grp + [0, grp)
    offs_g = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_g < grp
    head = kvh * grp + offs_g
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, 128)
    offs_pe = tl.arange(0, 64)
    q_rows = b.to(tl.int64) * stride_qb + qi * stride_qs + head * stride_qh
    q0 = tl.load(Q_ptr + q_rows[:, None] + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q1 = tl.load(Q_ptr + q_rows[:, None] + 128 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q2 = tl.load(Q_ptr + q_rows[:, None] + 256 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q3 = tl.load(Q_ptr + q_rows[:, None] + 384 + offs_t[None, :], mask=mask_m[:, None], other=0.0)
    q_pe = tl.load(Q_ptr + q_rows[:, None] + 512 + offs_pe[None, :], mask=mask_m[:, None], other=0.0)

    T = topk
    if HAS_TOPK_LEN:
        T = tl.minimum(tl.maximum(tl.load(TopkLen_ptr + b), 0), topk)
    per_split = tl.cdiv(tl.cdiv(T, n_splits), BLOCK_N) * BLOCK_N  # whole tiles
    lo = tl.minimum(split * per_split, T)
    hi = tl.minimum(lo + per_split, T)

    idx_row = Idx_ptr + b.to(tl.int64) * stride_ib + qi.to(tl.int64) * stride_is + kvh * stride_ih
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + offs_n
        slot = tl.load(idx_row + offs * stride_it, mask=offs < hi, other=-1)
        live = slot >= 0  # padding and entries past T_b are never gathered
        slot = tl.where(live, slot, 0)
        rows = (slot // PAGE).to(tl.int64) * stride_kb + (slot % PAGE).to(tl.int64) * stride_ks + kvh * stride_kh
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
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
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


def _check(q, kv_cache, scale, d_v, what) -> tuple[int, int, int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype != torch.bfloat16 or q.shape[-1] != D:
        raise ValueError(f"{what}: q must be a (b, s_q, h_q, {D}) bfloat16 tensor, got "
                         f"{getattr(q, 'shape', type(q).__name__)} {getattr(q, 'dtype', '')}")
    if q.numel() and q.stride(-1) != 1:
        raise ValueError(f"{what}: q must have last-dim stride 1, got strides {tuple(q.stride())}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 \
            or kv_cache.shape[-1] != ROW_BYTES or kv_cache.shape[1] < 1 or kv_cache.shape[2] < 1:
        raise ValueError(f"{what}: kv_cache must be a (num_blocks, page, h_kv, {ROW_BYTES}) uint8 tensor, got "
                         f"{getattr(kv_cache, 'shape', type(kv_cache).__name__)} {getattr(kv_cache, 'dtype', '')}")
    if kv_cache.device != q.device:
        raise ValueError(f"{what}: kv_cache is on {kv_cache.device}, q on {q.device}")
    if kv_cache.stride(-1) != 1 or any(s % 4 for s in kv_cache.stride()[:3]) or kv_cache.data_ptr() % 4:
        raise ValueError(f"{what}: kv_cache rows must be unit-stride bytes at 4-byte aligned addresses (the scales "
                         f"are float32), got strides {tuple(kv_cache.stride())}")
    b, s_q, h_q, _ = q.shape
    h_kv = kv_cache.shape[2]
    if h_q % h_kv:
        raise ValueError(f"{what}: h_q={h_q} must be a multiple of the cache's h_kv={h_kv}")
    if d_v != D_V:
        raise ValueError(f"{what}: d_v={d_v!r} must be {D_V} (the rows' NoPE part)")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scale={scale!r} must be a finite number > 0")
    return b, s_q, h_q, h_kv


def kvquant_mla_sparse(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                       topk_length: torch.Tensor | None, scale: float, d_v: int = 512,
                       num_splits: int | None = None, out: torch.Tensor | None = None,
                       out_lse: torch.Tensor | None = None, *, block_n: int = 32, num_warps: int | None = None,
                       num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode of q (b, s_q, h_q, 576) bf16 over the FP8 rows kv_cache (num_blocks, page, h_kv, 656)
    uint8; indices (b, s_q, h_kv, topk) (or (b, s_q, topk), h_kv = 1) int32; topk_length (b,) int32 or None.
    returns (out (b, s_q, h_q, 512) bf16, out_lse (b, h_q, s_q) fp32); num_splits: splits of the lists (None: 1 on
    the interpreter / CPU, about one wave of programs on a GPU)."""
    what = "kvquant_mla_sparse"
    b, s_q, h_q, h_kv = _check(q, kv_cache, scale, d_v, what)
    if isinstance(indices, torch.Tensor) and indices.dim() == 3 and h_kv == 1:
        indices = indices[:, :, None]
    _check_index(indices, "indices", (b, s_q, h_kv, None), q.device, what)
    if topk_length is not None:
        _check_index(topk_length, "topk_length", (b,), q.device, what)
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 65535):
        raise ValueError(f"{what}: num_splits={num_splits!r} must be an int in [1, 65535]")
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"{what}: block_n={block_n!r} must be 16, 32, 64 or 128")
    topk = indices.shape[3]
    grp = h_q // h_kv
    block_m = min(64, max(16, triton.next_power_of_2(max(grp, 1))))
    n_m = triton.cdiv(grp, block_m)
    programs = b * s_q * h_kv * n_m
    if num_splits is None:
        num_splits = 1
        if q.is_cuda and programs > 0:
            num_splits = max(1, min(2 * _sm_count(q.device) // programs, max(topk, 1) // MIN_SPLIT_KEYS, MAX_SPLITS))
    if programs * num_splits >= 2**31:
        raise ValueError(f"{what}: {programs} x {num_splits} programs exceed CUDA's grid")
    out, out_lse, dst_o, dst_l = _outputs(q, D_V, out, out_lse, num_splits)
    if b == 0 or h_q == 0 or s_q == 0:
        return out, out_lse
    _kvq_mla_sparse_kernel[(programs * num_splits,)](
        q, kv_cache, dst_o, dst_l, indices, topk_length if topk_length is not None else indices,
        h_q, h_kv, s_q, topk, n_m, num_splits, float(scale) * 1.4426950408889634,
        *q.stride()[:3], *kv_cache.stride()[:3], *indices.stride(), *dst_o.stride()[:4], *dst_l.stride(),
        HAS_TOPK_LEN=topk_length is not None, PAGE=kv_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps or (8 if block_m == 64 else 4), num_stages=num_stages,
    )
    if num_splits > 1:
        _combine(dst_o, dst_l, out, out_lse, None)
    return out, out_lse
