"""Eager MLA decode in the input's dtype (the same-precision baseline of refimpl/mla.py).

    s = scale q rows^T (mask)  ->  P = softmax(s)  ->  O = P rows[:, :d_v]    every step in q.dtype
    LSE = logsumexp of the same logits computed from float32 upcasts         (an fp32 statistic)

As kernels/torch/attention.py (FlashAttention's `attention_ref(upcast=False)`): the logits are a
matmul rounded to the dtype, then scaled (a second rounding), the probabilities are a softmax
rounded to the dtype, O a matmul in the dtype (torch accumulates bf16/fp16 products in float32
and rounds once); LSE is upcast because it is an fp32 output everywhere. MLA's structure is kept:
the cache rows are gathered once per request (one latent kv head, never repeated per query head)
and the values are the first d_v columns of the same gathered rows.

Conventions (refimpl/mla.py): paged cache (num_blocks, page, 1, d) or (num_blocks, page, d),
token t of request i at block_table[i, t // page], t % page; causal (s_q > 1) bottom-right,
row i sees keys j <= seqlens[i] - s_q + i; a row with no visible key gives O = 0, LSE = -inf.
Rows no query sees are zeroed right after the gather (they hold NaN in the tests); table entries
past a request's last block are replaced before the gather (FlashMLA's tests poison them with
2147480000). Sparse decode: indices are flat slots into the cache viewed as (num_blocks * page, d),
-1 and positions >= topk_length skipped, a slot listed twice counts twice. Sinks (h_q,) join the
denominator only, rounded to the dtype like the logits; the returned LSE excludes them.

`decode_fused_fp8` is MAX's `mla_decode_branch_fp8` in the same style: each stage in the dtype,
as DeepSeek-V3's eager model writes it, in the golden's order (see its docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_parity.kernels.torch.quant import fp8_quantize_blocks

__all__ = ["decode", "decode_sparse", "decode_fused_fp8"]


# --------------------------------------------------------------------------- shared pieces

def _rows(kv_cache: torch.Tensor, heads: bool = False) -> tuple[torch.Tensor, int]:
    """Cache (num_blocks, page, [1,] d) as (num_blocks * page, d) rows, and the page size; `heads`: a
    cache (num_blocks, page, h_kv, d) as (num_blocks * page, h_kv, d) rows."""
    kv = kv_cache
    if heads:
        if kv.ndim == 3:
            kv = kv[:, :, None]
        if kv.ndim != 4:
            raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, d), got shape {tuple(kv_cache.shape)}")
        return kv.reshape(-1, *kv.shape[2:]), kv.shape[1]
    if kv.ndim == 4:
        if kv.shape[2] != 1:
            raise ValueError(f"MLA caches have one KV head, got kv_cache shape {tuple(kv.shape)}")
        kv = kv[:, :, 0]
    if kv.ndim != 3:
        raise ValueError(f"kv_cache must be (num_blocks, page, [1,] d), got shape {tuple(kv_cache.shape)}")
    return kv.reshape(-1, kv.shape[-1]), kv.shape[1]


def _slots(block_table: torch.Tensor, lengths: torch.Tensor, page: int, s_k: int,
           num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, s_k) flat cache slot of token j of each request (0 where j >= length) and the valid mask."""
    bt = block_table.to(lengths.device).long()
    j = torch.arange(s_k, device=lengths.device)
    valid = j[None, :] < lengths[:, None]
    need = -(-int(lengths.max()) // page) if lengths.numel() else 0
    if need > bt.shape[1]:
        raise ValueError(f"block_table has {bt.shape[1]} blocks per request, seqlens need {need}")
    blk = bt[:, torch.clamp(j // page, max=max(bt.shape[1] - 1, 0))]  # b, s_k
    slot = torch.where(valid, blk * page + j % page, 0)
    if ((slot < 0) | (slot >= num_slots)).any():
        raise ValueError(f"block_table names a block outside the cache ({num_slots // page} blocks)")
    return slot, valid


def _decode_keep(lengths: torch.Tensor, s_q: int, s_k: int, causal: bool, valid: torch.Tensor) -> torch.Tensor:
    """(b, s_q, s_k) visibility: valid keys, and j <= L - s_q + i when causal."""
    keep = valid[:, None, :].expand(lengths.numel(), s_q, s_k)
    if causal and s_q > 1:
        diag = lengths[:, None, None] - s_q + torch.arange(s_q, device=lengths.device)[None, :, None]
        keep = keep & (torch.arange(s_k, device=lengths.device)[None, None, :] <= diag)
    return keep


def _softmax_dtype(s: torch.Tensor, keep: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Weights in s.dtype of logits s (..., h, k) under keep (..., 1, k); sinks (h,), (b, 1, 1, 1) or None."""
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)  # NaN on a row with no key
        return torch.where(keep.any(dim=-1, keepdim=True), p, torch.zeros((), dtype=p.dtype, device=p.device))
    sink = sinks.to(device=s.device, dtype=s.dtype)
    sink = (sink[:, None] if sink.ndim == 1 else sink).expand(*s.shape[:-1], 1)  # (h,) or (b, 1, 1, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.where(torch.isposinf(sink), torch.zeros((), dtype=p.dtype, device=p.device), p)  # +inf: O = 0


def _attend(q: torch.Tensor, kv: torch.Tensor, keep: torch.Tensor, scale: float, d_v: int,
            sinks: torch.Tensor | None = None, lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (b, s_q, h, d) over per-request rows kv (b, s_k, d) -> o (b, s_q, h, d_v), lse (b, h, s_q).

    keep: (b, s_q, s_k); kv must already be zero where no query keeps a key."""
    b, s_q, h, d = q.shape
    qr = q.reshape(b, s_q * h, d)  # rows (i, h): one bmm over every query row of a request
    s = (qr @ kv.transpose(1, 2)).view(b, s_q, h, -1) * scale  # b, s_q, h, s_k in q.dtype
    p = _softmax_dtype(s, keep[:, :, None, :], sinks)
    o = (p.view(b, s_q * h, -1) @ kv[..., :d_v]).view(b, s_q, h, d_v)
    if not lse:
        return o, None
    s32 = (qr.float() @ kv.float().transpose(1, 2)).view(b, s_q, h, -1) * scale
    lse32 = torch.logsumexp(s32.masked_fill(~keep[:, :, None, :], float("-inf")), dim=-1)  # -inf when empty
    return o, lse32.permute(0, 2, 1)


def _gather(rows: torch.Tensor, slot: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """rows[slot] with every row not `read` zeroed (it may hold NaN)."""
    return torch.where(read[..., None], rows[slot], torch.zeros((), dtype=rows.dtype, device=rows.device))


# --------------------------------------------------------------------------- FlashMLA decode

def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
           scale: float, d_v: int = 512, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, d), kv_cache (num_blocks, page, h_kv, d), block_table (b, max_blocks),
    seqlens (b,) -> o (b, s_q, h_q, d_v) in q.dtype, lse (b, h_q, s_q) float32. Query head h reads
    kv head h // (h_q / h_kv): each kv head's rows are gathered once for its group of query heads."""
    rows, page = _rows(kv_cache, heads=True)
    b, s_q, h_q, d = q.shape
    h_kv = rows.shape[1]
    if rows.shape[2] != d or not 0 < d_v <= d:
        raise ValueError(f"q dim {d}, cache dim {rows.shape[2]} and d_v {d_v} disagree")
    if h_q % h_kv:
        raise ValueError(f"h_q = {h_q} query heads must be a multiple of the cache's h_kv = {h_kv} kv heads")
    g = h_q // h_kv
    L = seqlens.to(q.device).long().reshape(b)
    if (L < 0).any():
        raise ValueError(f"seqlens must be >= 0, got {int(L.min())}")
    s_k = max(int(L.max()) if b else 0, 1)
    slot, valid = _slots(block_table, L, page, s_k, rows.shape[0])
    keep = _decode_keep(L, s_q, s_k, causal, valid)
    kv = _gather(rows, slot, keep.any(dim=1)[..., None])  # b, s_k, h_kv, d
    # (request, kv head) pairs as the batch: kv head k's g query heads (`order`'s k-th g) over its rows
    order = torch.arange(h_q, device=q.device).view(h_kv, g).flatten()
    qg = q[:, :, order].reshape(b, s_q, h_kv, g, d).transpose(1, 2).reshape(b * h_kv, s_q, g, d)
    kvg = kv.transpose(1, 2).reshape(b * h_kv, s_k, d)
    og, lg = _attend(qg, kvg, keep.repeat_interleave(h_kv, 0), scale, d_v)
    o, lse = q.new_empty(b, s_q, h_q, d_v), lg.new_empty(b, h_q, s_q)
    o[:, :, order] = og.reshape(b, h_kv, s_q, g, d_v).transpose(1, 2).reshape(b, s_q, h_q, d_v)
    lse[:, order] = lg.reshape(b, h_q, s_q)
    return o, lse


def decode_sparse(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                  topk_length: torch.Tensor | None, scale: float, d_v: int = 512, *,
                  attn_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, d), kv_cache (num_blocks, page, h_kv, d), indices (b, s_q, h_kv, topk) (or
    (b, s_q, topk) when h_kv = 1) flat slots, -1 padding, topk_length (b,) or None -> o (b, s_q, h_q, d_v)
    in q.dtype, lse (b, h_q, s_q) float32. Query head h reads kv head h // (h_q / h_kv): its list, its rows."""
    rows, _ = _rows(kv_cache, heads=True)  # slots, h_kv, d
    b, s_q, h, d = q.shape
    h_kv = rows.shape[1]
    if rows.shape[2] != d or not 0 < d_v <= d:
        raise ValueError(f"q dim {d}, cache dim {rows.shape[2]} and d_v {d_v} disagree")
    if h % h_kv:
        raise ValueError(f"h_q = {h} query heads must be a multiple of the cache's h_kv = {h_kv} kv heads")
    g = h // h_kv
    idx = indices.to(q.device).long()
    if idx.ndim == 3:
        idx = idx[:, :, None]
    if idx.ndim != 4 or tuple(idx.shape[:3]) != (b, s_q, h_kv):
        raise ValueError(f"indices {tuple(indices.shape)} must be (b, s_q, h_kv, topk) = ({b}, {s_q}, {h_kv}, topk)")
    used = idx != -1  # b, s_q, h_kv, topk
    if topk_length is not None:
        k = torch.arange(idx.shape[-1], device=q.device)
        used = used & (k < topk_length.to(q.device).long().reshape(b, 1, 1, 1))
    if ((idx < 0) | (idx >= rows.shape[0]))[used].any():
        raise ValueError(f"indices outside the cache's {rows.shape[0]} slots (and not -1)")
    heads = torch.arange(h_kv, device=q.device)[:, None]
    kv = torch.where(used[..., None], rows[torch.where(used, idx, 0), heads],
                     torch.zeros((), dtype=rows.dtype, device=rows.device))  # b, s_q, h_kv, topk, d
    qg = q.reshape(b, s_q, h_kv, g, d)  # kv head k's g query heads over its own list
    keep = used[:, :, :, None, :]
    s = (qg @ kv.transpose(-1, -2)) * scale  # b, s_q, h_kv, g, topk in q.dtype
    sinks = None if attn_sink is None else attn_sink.reshape(h_kv, g, 1)
    p = _softmax_dtype(s, keep, sinks)
    o = (p @ kv[..., :d_v]).reshape(b, s_q, h, d_v)
    s32 = (qg.float() @ kv.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s32.masked_fill(~keep, float("-inf")), dim=-1).reshape(b, s_q, h)
    return o, lse.permute(0, 2, 1)


# --------------------------------------------------------------------------- MAX fused FP8 branch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _quantize_act_fmt(xp: torch.Tensor, M: int, m_gran: int, k_gran: int, scale_ub: float, fp8: torch.dtype,
                      scale_dtype: torch.dtype) -> torch.Tensor:
    """_quantize_act in another format / scale dtype (MAX's compute_dynamic_fp8_scale in the scale dtype:
    amax cast to it, min with ub and / max finite in it; 1 / s in float32 from the stored scale)."""
    B, mp, K = xp.shape
    xb = xp.view(B, mp // m_gran, m_gran, K // k_gran, k_gran)
    amax = xb.abs().amax(dim=(2, 4)).to(scale_dtype)
    s = (torch.minimum(amax, torch.tensor(scale_ub, dtype=scale_dtype, device=xp.device)) / _FP8_MAX[fp8]).to(
        scale_dtype).float()
    recip = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)[:, :, None, :, None]
    fmax = _FP8_MAX[fp8]
    q = (xb * recip).clamp(-fmax, fmax).to(fp8)
    return (q.float() * s[:, :, None, :, None]).view(B, mp, K)[:, :M]


def _quantize_act(x: torch.Tensor, m_gran: int, k_gran: int, scale_ub: float,
                  fp8: torch.dtype = torch.float8_e4m3fn, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MAX's dynamic activation quantization, dequantized: x (B, M, K) -> q s (B, M, K) float32.

    s = min(amax, ub) / 448 per (m_gran rows x k_gran columns) group of one batch entry (float32,
    no floor), q = e4m3(clamp(x * (1 / s))); a zero group stays zero (MAX's zero reciprocal).
    fp8 / scale_dtype (MAX's fp8_dtype / fp8_scale_dtype, w_uk's and w_uk_scale's dtypes): e5m2 codes at
    57344, bf16 scales rounded before the codes are formed (_quantize_act_fmt)."""
    B, M, K = x.shape
    mp = -(-M // m_gran) * m_gran
    xp = torch.zeros(B, mp, K, dtype=torch.float32, device=x.device)
    xp[:, :M] = x.float()  # groups never straddle two batch entries
    if (fp8, scale_dtype) != (torch.float8_e4m3fn, torch.float32):
        return _quantize_act_fmt(xp, M, m_gran, k_gran, scale_ub, fp8, scale_dtype)
    q, s = fp8_quantize_blocks(xp.reshape(B * mp, K), m_gran, k_gran, amax_floor=0.0, scale_ub=scale_ub,
                               reciprocal=True)
    full = s.repeat_interleave(m_gran, 0).repeat_interleave(k_gran, 1)[:, :K]  # B * mp, K
    deq = torch.where(full == 0, 0.0, q.float() * full)  # s = 0: x * inf = NaN codes, MAX gives 0
    return deq.view(B, mp, K)[:, :M]


def _dequantize_weight(w: torch.Tensor, scale: torch.Tensor, n_gran: int, k_gran: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """w (B, N, K) fp8 * scale[b, n // n_gran, k // k_gran] (float32 or bf16) in float32, then `dtype`."""
    B, N, K = w.shape
    s = scale.float().reshape(B, -(-N // n_gran), -(-K // k_gran))
    full = s.repeat_interleave(n_gran, 1).repeat_interleave(k_gran, 2)[:, :N, :K]
    return (w.float() * full).to(dtype)


def _bmm_fp8(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, granularity: tuple[int, int, int],
             scale_ub: float) -> torch.Tensor:
    """a (B, M, K) quantized as MAX does, times w (B, N, K)^T, both dequantized to a.dtype -> (B, M, N).

    The eager form: operands dequantized to the dtype, one batched matmul in it (as gemm.py). The activation
    is quantized in w's format with scales of w_scale's dtype (MAX's fp8_dtype / fp8_scale_dtype)."""
    mg, ng, kg = granularity
    if w.dtype not in _FP8_MAX or w_scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8 weights must be float8_e4m3fn or float8_e5m2 with float32 or bfloat16 scales, got "
                         f"{w.dtype} and {w_scale.dtype}")
    qa = _quantize_act(a, mg, kg, scale_ub, w.dtype, w_scale.dtype).to(a.dtype)
    return qa @ _dequantize_weight(w, w_scale, ng, kg, a.dtype).transpose(1, 2)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's apply_rotary_emb: interleaved pairs times the cos/sin table row, complex, in
    float32, rounded to x.dtype. x (..., r); freqs (..., r) as [cos_0, sin_0, cos_1, ...]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    fc = torch.view_as_complex(freqs.float().reshape(*freqs.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * fc).flatten(-2).to(x.dtype)


def decode_fused_fp8(q: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
                     gamma: torch.Tensor, epsilon: float, w_uk: torch.Tensor, w_uk_scale: torch.Tensor,
                     w_uv: torch.Tensor, w_uv_scale: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, cache_lengths: torch.Tensor, scale: float, *,
                     attn_sink: torch.Tensor | None = None, causal: bool = True,
                     granularity: tuple[int, int, int] = (1, 128, 128), scale_ub: float = 1200.0,
                     inplace: bool = False, q_inplace: bool = False, sink_per: str = "head",
                     d_indices: torch.Tensor | None = None, indices_stride: int = 0, topk: int = 0,
                     topk_lengths: torch.Tensor | None = None, extra_k: torch.Tensor | None = None,
                     extra_scales: torch.Tensor | None = None, extra_d_indices: torch.Tensor | None = None,
                     extra_topk_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MAX's `mla_decode_branch_fp8`, eager, in q.dtype; arguments and order as refimpl/mla.py.

    q (T, H, dn + d_r), input_row_offsets (b + 1,), freqs_cis (max_seq_len, d_r), gamma (d_c,),
    w_uk (H, d_c, dn) / w_uv (H, dv, d_c) e4m3 or e5m2 with float32 or bf16 block scales (MAX's fp8_dtype and
    fp8_scale_dtype, read from w_uk / w_uk_scale: the activations are quantized in them),
    kv_cache (num_blocks, page, [1,] d)
    in q.dtype, block_table (b, max_blocks), cache_lengths (b,)
    returns: out (T, H, dv) in q.dtype, cache_after (kv_cache's shape; kv_cache itself when inplace)

    1. q_lat = q_nope W_UK: q_nope (per head) quantized per (1 token x 128 channels) from its dtype
       values, both operands dequantized to the dtype, one bmm.
    2. The new tokens' cache rows: latent F.rms_norm(row[:d_c], gamma, eps) in the dtype (DeepSeek's
       RMSNorm), rope part and q_rope rotated in float32 and rounded (DeepSeek's apply_rotary_emb).
    3. Attention of [q_lat ; q_rope] over the updated rows, as `decode` (causal: key j <= position).
    4. out = o_lat W_UV, o_lat quantized like q_nope.
    sink_per: "head" (attn_sink (H,)) or "batch" (attn_sink (b,), request r's sink shared by its heads, MAX's).
    q_inplace: q[..., dn:] is left holding its rotation (step 2's, in q.dtype), as MAX's fused_qk_rope leaves
    q; the rotation is formed before it is written (q_nope was read in step 1).
    d_indices (flat, int), indices_stride, topk, topk_lengths (T,): MAX's sparse mode (refimpl/mla.py): step 3
    attends token t over its first topk_lengths[t] slots d_indices[t * indices_stride:][:topk] (-1 skipped),
    as `decode_sparse` with one query row per token. extra_k (e4m3 rows) with extra_scales (a float32 scale per
    row and 128 latent channels, one for the rope part), extra_d_indices, extra_topk_lengths: MAX's second cache,
    its rows dequantized to the dtype and appended to each token's keys (one softmax over both lists).
    """
    dt = q.dtype
    off = input_row_offsets.to(q.device).long()
    T, H, dq = q.shape
    d_r = freqs_cis.shape[1]
    dn = dq - d_r
    rows, page = _rows(kv_cache)
    d_c = rows.shape[1] - d_r
    n = off[1:] - off[:-1]
    b = n.numel()
    if int(off[0]) != 0 or int(off[-1]) != T or (n < 0).any():
        raise ValueError(f"input_row_offsets {off.tolist()} must rise from 0 to T = {T}")
    cl = cache_lengths.to(q.device).long().reshape(b)
    L = cl + n
    req = torch.repeat_interleave(torch.arange(b, device=q.device), n)  # T: request of each new token
    pos = cl[req] + torch.arange(T, device=q.device) - off[req]  # T: its position
    if T and int(pos.max()) >= freqs_cis.shape[0]:
        raise ValueError(f"freqs_cis has {freqs_cis.shape[0]} positions, tokens reach {int(pos.max())}")
    s_k = max(int(L.max()) if b else 0, 1)
    slot, valid = _slots(block_table, L, page, s_k, rows.shape[0])
    new = slot[req, pos]  # T: cache slot of each new token
    if torch.unique(new).numel() != T:
        raise ValueError("two new tokens map to the same cache slot")
    if attn_sink is not None and (sink_per, tuple(attn_sink.shape)) not in (("head", (H,)), ("batch", (b,))):
        raise ValueError(f"attn_sink of shape {tuple(attn_sink.shape)} is not sink_per={sink_per!r}'s ({H},) "
                         f"per head or ({b},) per request")
    if inplace and not (kv_cache.is_contiguous() and rows.data_ptr() == kv_cache.data_ptr()):
        raise ValueError(f"inplace needs a contiguous kv_cache, got shape {tuple(kv_cache.shape)} "
                         f"strides {kv_cache.stride()}")
    after = rows if inplace else rows.clone()
    if T == 0:
        return q.new_zeros(0, H, w_uv.shape[1]), after.view(kv_cache.shape)
    q_lat = _bmm_fp8(q[..., :dn].transpose(0, 1), w_uk, w_uk_scale, granularity, scale_ub)  # H, T, d_c
    f = freqs_cis[pos]  # T, d_r
    q_full = torch.cat([q_lat.transpose(0, 1), _rope(q[..., dn:], f[:, None])], dim=-1)  # T, H, d
    if q_inplace:
        q[..., dn:] = q_full[..., d_c:]
    fresh = rows[new]  # read before any write: the raw kv_a_proj output
    after[new, :d_c] = F.rms_norm(fresh[:, :d_c], (d_c,), gamma.to(dt), epsilon)
    after[new, d_c:] = _rope(fresh[:, d_c:], f)
    n_max = max(int(n.max()), 1)
    t = torch.arange(n_max, device=q.device)
    ok = t[None, :] < n[:, None]  # b, n_max: padded query slots in use
    q_pad = torch.where(ok[..., None, None], q_full[torch.where(ok, off[:-1, None] + t, 0)],
                        torch.zeros((), dtype=dt, device=q.device))  # b, n_max, H, d
    keep = ok[:, :, None] & valid[:, None, :]
    if causal:
        keep = keep & (torch.arange(s_k, device=q.device)[None, None, :] <= (cl[:, None] + t)[:, :, None])
    if d_indices is not None:  # sparse_mla: each token one query row over its own top-k slots
        if topk_lengths is None or not 0 < topk <= indices_stride:
            raise ValueError(f"sparse mode needs topk_lengths and 0 < topk ({topk}) <= indices_stride "
                             f"({indices_stride})")
        idx = d_indices.to(q.device).long().reshape(-1)[:T * indices_stride].view(T, indices_stride)[:, :topk]
        used = (idx != -1) & (torch.arange(topk, device=q.device)[None, :] < topk_lengths.to(q.device).long()[:, None])
        kv = _gather(after, torch.where(used, idx, 0), used)  # T, topk, d
        if extra_k is not None:  # the second cache's rows, dequantized to the dtype, join the keys
            e_rows = extra_k.reshape(-1, extra_k.shape[-1])
            sc = extra_scales.to(q.device).float().reshape(e_rows.shape[0], -1)
            widths = torch.tensor([128] * (d_c // 128) + [d_r], device=q.device)
            e_deq = (e_rows.float() * sc.repeat_interleave(widths, dim=1)).to(dt)
            e_idx = extra_d_indices.to(q.device).long().reshape(-1)[:T * indices_stride].view(T, indices_stride)
            e_idx = e_idx[:, :topk]
            e_len = extra_topk_lengths.to(q.device).long()
            e_used = (e_idx != -1) & (torch.arange(topk, device=q.device)[None, :] < e_len[:, None])
            kv = torch.cat([kv, _gather(e_deq, torch.where(e_used, e_idx, 0), e_used)], dim=1)
            used = torch.cat([used, e_used], dim=1)
        sinks = attn_sink if attn_sink is None or sink_per == "head" else attn_sink[req].view(T, 1, 1, 1)
        o_lat, _ = _attend(q_full[:, None], kv, used[:, None], scale, d_c, sinks, lse=False)  # T, 1, H, d_c
        o_lat = o_lat[:, 0]
    else:
        kv = _gather(after, slot, keep.any(dim=1))
        sinks = attn_sink if attn_sink is None or sink_per == "head" else attn_sink.view(b, 1, 1, 1)  # r's, each head
        o_lat, _ = _attend(q_pad, kv, keep, scale, d_c, sinks, lse=False)  # b, n_max, H, d_c
        o_lat = o_lat[ok]
    out = _bmm_fp8(o_lat.transpose(0, 1), w_uv, w_uv_scale, granularity, scale_ub)  # H, T, dv
    return out.transpose(0, 1), after.view(kv_cache.shape)
