"""TensorRT-LLM's RoPE-fused KV-cache write, in Triton (the helpers are rope.py's).

    p = pos[b] + t:   cache_k[slot(b, p)] = RoPE(k_new[b, t], p)      cache_v[slot(b, p)] = v_new[b, t]
    slot(b, p) = (r, p) contiguous, (block_table[r, p // page], p % page) paged
    r = cache_loc[b] (TensorRT-LLM's row indirection), or b without cache_loc
    with q:           q_out[b, t] = RoPE(q[b, t], p)  (update_kv_cache_rope_fusion's q, every query head)
    ragged (seq_len, seq_start): k_new, v_new (total, h_kv, d | d_v), q (n_q, h_q, d) (TensorRT-LLM's
                      flattened [B*S, N, D] buffers); [b, t] above is row seq_start[b] + t, t < seq_len[b],
                      q_out's other rows untouched; v's head dim d_v may differ from d

Conventions (OPS.md, layers; golden refimpl/rope.py kv_update, refimpl/kvcache.py update): k is
rotated over its whole head dim with half-split pairs ("interleaved as [2, D//2]" in TensorRT-LLM's
words) from an fp16 table of (cos, sin) pairs [max_seq, d/2, 2] indexed by absolute position; v is
copied as it is (no conversion); every other slot keeps its bits. fp32 rotation, one rounding.

One program writes BLOCK_T tokens x BLOCK_H heads of one sequence, K then V: the table rows are
read once as contiguous (cos, sin) pairs and shared by the heads; a multi-token write at an
unaligned start follows the block table into the sequence's next page token by token. With q,
the same program then rotates its heads' query rows of every group (q head g * h_kv + j for the
program's kv heads j) with the same angles. Ragged launches max_len // BLOCK_T programs per sequence
(max_len: the longest seq_len, or new's row count: no device sync); tokens past the sequence's
seq_len are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kvcache import check_cache_loc
from .rope import STYLES, SUPPORTED_DTYPES, _blocks, _copy_rows, _pair_angles, _rope_rows, _tables, _warps


@triton.jit
def _kv_rows(New_ptr, new_rows, Cache_ptr, cache_rows, m_rows, head_dim, offs_p, mask_p, cos, sin,
             HALF: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """New rows into their cache slots: rotated over the whole head (K) or copied as they are (V, BLOCK_Q
    wide: its own head dim)."""
    if ROTATE:
        _rope_rows(New_ptr, new_rows, Cache_ptr, cache_rows, m_rows, 0, head_dim, offs_p, mask_p, cos, sin,
                   HALF, BLOCK_T, BLOCK_H, BLOCK_P)
    else:
        _copy_rows(New_ptr, new_rows, Cache_ptr, cache_rows, m_rows, 0, head_dim, BLOCK_Q)


@triton.jit
def _rope_kv_update_kernel(
    KC_ptr, VC_ptr, KN_ptr, VN_ptr, Pos_ptr, Cos_ptr, Sin_ptr, BT_ptr, Loc_ptr, Q_ptr, QO_ptr, SeqLen_ptr,
    SeqStart_ptr, q_groups, s_new, n_heads, head_dim, v_dim, t_blocks,
    stride_kc_blk, stride_kc_slot, stride_kc_h, stride_vc_blk, stride_vc_slot, stride_vc_h,
    stride_kn_b, stride_kn_t, stride_kn_h, stride_vn_b, stride_vn_t, stride_vn_h,
    stride_tab_row, stride_tab_col, stride_bt_b, stride_bt_p, stride_q_b, stride_q_t, stride_q_h,
    stride_qo_b, stride_qo_t, stride_qo_h,
    HALF: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, LOC: tl.constexpr, ROPE_Q: tl.constexpr,
    TABLE_PAIRS: tl.constexpr, RAGGED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = (pid // t_blocks).to(tl.int64)
    offs_t = (pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    if RAGGED:  # this sequence's tokens only, rows seq_start[b] + t of the flattened inputs
        mask_t = offs_t < tl.load(SeqLen_ptr + b)
        src_t = tl.load(SeqStart_ptr + b).to(tl.int64) + offs_t.to(tl.int64)
    else:
        mask_t = offs_t < s_new
        src_t = offs_t.to(tl.int64)
    m_rows = mask_t[:, None] & (offs_h < n_heads)[None, :]
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < head_dim // 2
    p = tl.load(Pos_ptr + b).to(tl.int64) + offs_t  # absolute positions of the new tokens
    if LOC:
        row = tl.load(Loc_ptr + b).to(tl.int64)  # the sequence's cache / block-table row
    else:
        row = b
    if PAGED:
        blk = tl.load(BT_ptr + row * stride_bt_b + (p // PAGE) * stride_bt_p, mask=mask_t, other=0).to(tl.int64)
        slot = p % PAGE
    else:
        blk = row
        slot = p
    cos, sin = _pair_angles(p, mask_t, offs_p, mask_p, Cos_ptr, Sin_ptr, stride_tab_row, stride_tab_col, 0.0, 0.0,
                            False, False, TABLE_PAIRS)
    t64 = src_t[:, None]
    _kv_rows(KN_ptr, b * stride_kn_b + t64 * stride_kn_t + (offs_h * stride_kn_h)[None, :],
             KC_ptr, (blk * stride_kc_blk + slot * stride_kc_slot)[:, None] + (offs_h * stride_kc_h)[None, :],
             m_rows, head_dim, offs_p, mask_p, cos, sin, HALF, ROTATE=True,
             BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_P=BLOCK_P, BLOCK_Q=2 * BLOCK_P)
    _kv_rows(VN_ptr, b * stride_vn_b + t64 * stride_vn_t + (offs_h * stride_vn_h)[None, :],
             VC_ptr, (blk * stride_vc_blk + slot * stride_vc_slot)[:, None] + (offs_h * stride_vc_h)[None, :],
             m_rows, v_dim, offs_p, mask_p, cos, sin, HALF, ROTATE=False,
             BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_P=BLOCK_P, BLOCK_Q=BLOCK_DV)
    if ROPE_Q:  # the queries of every group, at the tokens' positions p
        q_t = t64  # ragged: the flattened q's rows of this sequence, as new's
        for g in range(0, q_groups):
            qh = g * n_heads + offs_h
            _kv_rows(Q_ptr, b * stride_q_b + q_t * stride_q_t + (qh * stride_q_h)[None, :],
                     QO_ptr, b * stride_qo_b + t64 * stride_qo_t + (qh * stride_qo_h)[None, :],
                     m_rows, head_dim, offs_p, mask_p, cos, sin, HALF, ROTATE=True,
                     BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_P=BLOCK_P, BLOCK_Q=2 * BLOCK_P)


def kv_update(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              pos: torch.Tensor, table: torch.Tensor, *, block_table: torch.Tensor | None = None,
              cache_loc: torch.Tensor | None = None, q: torch.Tensor | None = None,
              q_out: torch.Tensor | None = None, style: str = "half", seq_len: torch.Tensor | None = None,
              seq_start: torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor | None:
    """TensorRT-LLM's RoPE-fused KV write, in place: k_new rotated at position pos[b] + t by
    table's row, v_new copied, both appended after the first pos[b] tokens of sequence b.

    k_cache, v_cache: (rows, s_max, h_kv, d), or (num_blocks, page, h_kv, d) with block_table; last-dim
                      stride 1, other strides any
    k_new, v_new: (b, s_new, h_kv, d), the caches' dtype, last-dim stride 1
    pos: (b,) int32, tokens already cached; table: (max_seq, d/2, 2) (cos, sin) pairs (fp16 in
    TensorRT-LLM; fp32 and complex64 freqs_cis read too), rows indexed by absolute position
    block_table: (rows, max_blocks) int32 for the paged layout
    cache_loc: (b,) int32 contiguous, each sequence's cache / block-table row (TensorRT-LLM's cache_loc;
               None: row b, rows = b)
    q: (b, s_new, h_q, d), h_q a multiple of h_kv, the caches' dtype, last-dim stride 1: rotated at
       pos[b] + t too (TensorRT-LLM's update_kv_cache_rope_fusion) into q_out (like q; allocated when
       None), which is returned (None without q)
    seq_len, seq_start: (b,) int32 contiguous, both or neither: TensorRT-LLM's ragged layout, k_new, v_new
       (total, h_kv, d | d_v) and q (n_q, h_q, d), its flattened [B*S, N, D] buffer of any n_q rows: sequence
       b's tokens rows seq_start[b] : seq_start[b] + seq_len[b] of each (in range: not checked), q_out's
       other rows not written; max_len >= every seq_len (default: k_new's rows, no device sync)
    v_new, v_cache may have their own head dim d_v (TensorRT-LLM's V_D_HEAD): v is only copied.
    The caller guarantees that the writes fit, that pos[b] + s_new <= max_seq, and that no two
    sequences share a written page (not checked: that would sync the device).
    """
    ragged = seq_len is not None
    if ragged != (seq_start is not None):
        raise ValueError("seq_len and seq_start go together (the ragged layout), or neither")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(c, torch.Tensor) or c.dim() != (3 if ragged and "new" in name else 4):
            raise ValueError(f"{name} must be a 4-D tensor, got "
                             f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}")
        if c.dtype not in SUPPORTED_DTYPES or c.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {c.dtype} must be k_cache's ({k_cache.dtype}), one of {SUPPORTED_DTYPES}")
        if c.shape[-1] > 1 and c.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {tuple(c.stride())}")
        if c.device != k_cache.device:
            raise ValueError(f"{name} is on {c.device}, k_cache on {k_cache.device}")
    h, d = k_new.shape[-2:]
    dv = v_new.shape[-1]
    if ragged:
        b = seq_len.shape[0] if isinstance(seq_len, torch.Tensor) and seq_len.dim() == 1 else -1
        for name, a in (("seq_len", seq_len), ("seq_start", seq_start)):
            if not isinstance(a, torch.Tensor) or tuple(a.shape) != (b,) or a.dtype != torch.int32 \
                    or a.device != k_cache.device or (b > 1 and a.stride(0) != 1):
                raise ValueError(f"{name} must be a contiguous (b,) int32 tensor on {k_cache.device}, like seq_len")
        s_new = k_new.shape[0] if max_len is None else int(max_len)
    else:
        b, s_new = k_new.shape[:2]
    if tuple(v_new.shape[:-1]) != tuple(k_new.shape[:-1]):
        raise ValueError(f"v_new {tuple(v_new.shape)} must match k_new {tuple(k_new.shape)} except the last axis")
    if tuple(k_cache.shape[:-1]) != tuple(v_cache.shape[:-1]) or tuple(k_cache.shape[2:]) != (h, d) \
            or v_cache.shape[3] != dv:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be alike, "
                         f"with (h_kv, d) = {(h, d)} and v's head dim {dv}")
    if d % 2:
        raise ValueError(f"head dim d={d} must be even (rotary pairs)")
    if style not in STYLES:
        raise ValueError(f"style={style!r} must be one of {STYLES}")
    if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (b,) or pos.dtype != torch.int32 \
            or pos.device != k_cache.device:
        raise ValueError(f"pos must be a ({b},) int32 tensor on {k_cache.device}")
    cos_v, sin_v, s_row, s_col, pairs = _tables(None, None, table, d // 2, k_cache.device)
    paged, loc = block_table is not None, cache_loc is not None
    check_cache_loc(cache_loc, b, k_cache.device)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 \
                or (not loc and block_table.shape[0] != b) \
                or block_table.dtype != torch.int32 or block_table.device != k_cache.device:
            raise ValueError(f"block_table must be a ({'rows' if loc else b}, max_blocks) int32 tensor on "
                             f"{k_cache.device}")
    elif not loc and k_cache.shape[0] != b:
        raise ValueError(f"k_cache batch {k_cache.shape[0]} != k_new batch {b} (contiguous layout)")
    rope_q = q is not None
    if rope_q:
        if not isinstance(q, torch.Tensor) or q.dim() != k_new.dim() \
                or (not ragged and tuple(q.shape[:-2]) != tuple(k_new.shape[:-2])) or q.shape[-1] != d or (h and q.shape[-2] % h) or q.dtype != k_cache.dtype \
                or q.device != k_cache.device or (d > 1 and q.stride(-1) != 1):
            raise ValueError(f"q must be {'(n_q,)' if ragged else tuple(k_new.shape[:-2])} x (k * {h}, {d}) "
                             f"{k_cache.dtype} tensor on {k_cache.device} with last-dim stride 1")
        if q_out is None:
            q_out = torch.empty_like(q)
        if tuple(q_out.shape) != tuple(q.shape) or q_out.dtype != q.dtype or q_out.device != q.device \
                or (d > 1 and q_out.stride(-1) != 1):
            raise ValueError(f"q_out must be like q {tuple(q.shape)} {q.dtype}, last-dim stride 1")
    elif q_out is not None:
        raise ValueError("q_out given without q")
    if b * s_new == 0 or h * d == 0:
        return q_out
    block_p, block_dv = triton.next_power_of_2(d // 2), triton.next_power_of_2(max(dv, 1))
    block_t, block_h = _blocks(s_new, h, 2 * block_p + block_dv)  # K and V rows
    t_blocks = triton.cdiv(s_new, block_t)

    def rows(t: torch.Tensor) -> tuple[int, int, int]:  # (batch, token, head) strides; ragged: no batch stride
        return (0, *t.stride()[:2]) if ragged else tuple(t.stride()[:3])

    _rope_kv_update_kernel[(b * t_blocks, triton.cdiv(h, block_h))](
        k_cache, v_cache, k_new, v_new, pos, cos_v, sin_v, block_table if paged else pos, cache_loc if loc else pos,
        q if rope_q else k_new, q_out if rope_q else k_new, seq_len if ragged else pos, seq_start if ragged else pos,
        q.shape[-2] // h if rope_q else 0, s_new, h, d, dv, t_blocks,
        *k_cache.stride()[:3], *v_cache.stride()[:3], *rows(k_new), *rows(v_new), s_row, s_col,
        *(block_table.stride() if paged else (0, 0)),
        *(rows(q) if rope_q else (0, 0, 0)), *(rows(q_out) if rope_q else (0, 0, 0)),
        HALF=style == "half", PAGED=paged, PAGE=k_cache.shape[1] if paged else 1, LOC=loc, ROPE_Q=rope_q,
        TABLE_PAIRS=pairs, RAGGED=ragged,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_P=block_p, BLOCK_DV=block_dv,
        num_warps=_warps(block_t * block_h * (2 * block_p + block_dv)),
    )
    return q_out
