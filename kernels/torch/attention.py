"""Eager attention in the input's dtype (FlashAttention's `attention_ref(upcast=False)` method).

    s = scale q k^T (softcap, mask)  ->  P = softmax(s)  ->  O = P V      every step in q.dtype
    LSE = logsumexp of the same logits computed from float32 upcasts      (an fp32 statistic)

The O path rounds the logits and the probabilities to the input dtype, as a PyTorch model does
without a fused kernel: its error is the yardstick of the noise layer (a fused kernel should be no
worse than k times it). The LSE path is upcast because LSE is an fp32 output everywhere.
Masks follow OPS.md: bottom_right / top_left causal alignment per sequence, inclusive windows
(left, right) with causal forcing right = 0, softcap before the mask, GQA query head h reads kv
head h // (h_q // h_kv), sinks add exp(S_h) to the denominator only (the returned LSE excludes
them), fully masked rows give O = 0 and LSE = -inf, keys at or past a sequence's length are
zeroed before any product (caches hold NaN there). V may have its own head dim d_v, or be a view
of K's first d_v dims (one cache buffer). chunked_prefill places each sequence's queries after its
history in the cache (bottom_right over history + chunk). With cache_loc (decode, decode_paged,
chunked_prefill; TensorRT-LLM) sequence b's cache row, or block-table row, is cache_loc[b].
"""

from __future__ import annotations

import math

import torch

CAUSAL = ("none", "bottom_right", "top_left")


def keep_mask(s_q: int, s_k: int, q_lens: torch.Tensor, k_lens: torch.Tensor, causal: str,
              window: tuple[int, int]) -> torch.Tensor:
    """(b, s_q, s_k) bool: True where query i may attend key j."""
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {CAUSAL}, got {causal!r}")
    left, right = window
    if causal != "none":
        right = 0
    dev = q_lens.device
    i = torch.arange(s_q, device=dev)[None, :, None]
    j = torch.arange(s_k, device=dev)[None, None, :]
    lq, lk = q_lens.long()[:, None, None], k_lens.long()[:, None, None]
    diag = i if causal == "top_left" else i + lk - lq
    keep = (i < lq) & (j < lk)
    if right >= 0:
        keep = keep & (j <= diag + right)
    if left >= 0:
        keep = keep & (j >= diag - left)
    return keep


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              causal: str = "none", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              sinks: torch.Tensor | None = None, q_lens: torch.Tensor | None = None,
              k_lens: torch.Tensor | None = None, keep: torch.Tensor | None = None,
              probs: bool = False) -> tuple[torch.Tensor, ...]:
    """q (b, s_q, h_q, d), k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v) -> o (b, s_q, h_q, d_v), lse (b, h_q, s_q);
    probs: also the probabilities P (b, h_q, s_q, s_k) the output was formed from (0 where masked)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = q.device
    if keep is None:
        q_lens = torch.full((b,), s_q, device=dev) if q_lens is None else q_lens.to(dev)
        k_lens = torch.full((b,), s_k, device=dev) if k_lens is None else k_lens.to(dev)
        keep = keep_mask(s_q, s_k, q_lens, k_lens, causal, window)
    read = keep.any(dim=1)[:, :, None, None]  # b, s_k: keys some query reads; the rest may be NaN
    k = torch.where(read, k, torch.zeros((), dtype=k.dtype, device=dev)).repeat_interleave(h_q // h_kv, dim=2)
    v = torch.where(read, v, torch.zeros((), dtype=v.dtype, device=dev)).repeat_interleave(h_q // h_kv, dim=2)
    p = _probabilities(q, k, keep, scale, softcap, sinks)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    lse = _lse_fp32(q, k, keep, scale, softcap)
    return (o, lse, p) if probs else (o, lse)


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # b, h_q, s_q, s_k in q.dtype
    return softcap * torch.tanh(s / softcap) if softcap else s


def _probabilities(q, k, keep, scale, softcap, sinks) -> torch.Tensor:
    s = _logits(q, k, scale, softcap).masked_fill(~keep[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : keep.shape[-1]]  # NaN on a row with no key and no sink
    if sinks is None:
        live = keep.any(dim=-1)[:, None, :, None]  # b, 1, s_q, 1
        p = torch.where(live, p, torch.zeros((), dtype=p.dtype, device=p.device))
    return p


def _lse_fp32(q, k, keep, scale, softcap) -> torch.Tensor:
    s = _logits(q.float(), k.float(), scale, softcap).masked_fill(~keep[:, None], float("-inf"))
    return torch.logsumexp(s, dim=-1)  # -inf for a fully masked row


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q (total_q, h_q, d), k/v (total_k, h_kv, d) -> o (total_q, h_q, d), lse (h_q, total_q)."""
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    s_q, s_k = max(int(lq.max()), 1), max(int(lk.max()), 1)
    qi, ki = torch.arange(s_q, device=q.device)[None, :], torch.arange(s_k, device=q.device)[None, :]
    q_ok, k_ok = qi < lq[:, None], ki < lk[:, None]
    qd = q[(cq[:-1, None] + qi).clamp(max=max(q.shape[0] - 1, 0))] * q_ok[..., None, None]
    kd = k[(ck[:-1, None] + ki).clamp(max=max(k.shape[0] - 1, 0))] * k_ok[..., None, None]
    vd = v[(ck[:-1, None] + ki).clamp(max=max(k.shape[0] - 1, 0))] * k_ok[..., None, None]
    o, lse = attention(qd, kd, vd, q_lens=lq, k_lens=lk, **kw)
    return o[q_ok], lse.transpose(1, 2)[q_ok].T


def decode(q, k_cache, v_cache, seqlens, *, causal: str = "bottom_right", cache_loc: torch.Tensor | None = None,
           **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h_q, d), caches (b, s_max, h_kv, d) (or (rows, ...) read at row cache_loc[b]),
    seqlens (b,) -> o, lse (b, h_q, s_q)."""
    if cache_loc is not None:
        k_cache, v_cache = k_cache[cache_loc.long()], v_cache[cache_loc.long()]
    return attention(q, k_cache, v_cache, k_lens=seqlens, causal=causal, **kw)


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(num_blocks, page, h, d) + (b, max_blocks) -> (b, max_blocks * page, h, d)."""
    g = cache[block_table.long()]
    return g.reshape(block_table.shape[0], -1, *cache.shape[2:])


def decode_paged(q, k_cache, v_cache, block_table, seqlens, *, cache_loc: torch.Tensor | None = None,
                 **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """As `decode` over pages through block_table (b, max_blocks), or its rows cache_loc[b]."""
    if cache_loc is not None:
        block_table = block_table[cache_loc.long()]
    return decode(q, gather_pages(k_cache, block_table), gather_pages(v_cache, block_table), seqlens, **kw)


def decode_split(q, k_cache, v_cache, seqlens, num_splits: int, *, causal: str = "bottom_right",
                 window: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None, block: int | None = None,
                 bounds: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 cache_loc: torch.Tensor | None = None, **kw):
    """Per-split partials (fp32) and their merge; returns (o, lse, o_parts, lse_parts).

    Split s of sequence b covers keys [s C_b, min((s + 1) C_b, L_b)), C_b = ceil(L_b / num_splits);
    with `block`, [s block, (s + 1) block) cut to [0, L_b); with `bounds` (b, num_splits + 1),
    [bounds[b, s], bounds[b, s + 1]) cut to [0, L_b) (refimpl.attention.split_bounds).
    With `block_table` (b, max_blocks) the caches are pages (num_blocks, page, h_kv, d), gathered
    into each sequence's logical cache first (token t: page block_table[b, t // page], slot t % page).
    With cache_loc (b,) sequence b reads cache row / block-table row cache_loc[b] (TensorRT-LLM).
    o_parts (splits, b, s_q, h_q, d_v) fp32, lse_parts (splits, b, h_q, s_q) fp32.
    """
    from kernel_parity.kernels.torch.combine import lse_combine

    if cache_loc is not None and block_table is not None:
        block_table = block_table[cache_loc.long()]
    elif cache_loc is not None:
        k_cache, v_cache = k_cache[cache_loc.long()], v_cache[cache_loc.long()]
    if block_table is not None:
        k_cache, v_cache = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    b, s_q = q.shape[:2]
    s_max = k_cache.shape[1]
    L = seqlens.to(q.device).long()
    keep = keep_mask(s_q, s_max, torch.full((b,), s_q, device=q.device), L, causal, window)
    c = (L + num_splits - 1) // num_splits
    j = torch.arange(s_max, device=q.device)[None, :]
    o_parts, lse_parts = [], []
    for sp in range(num_splits):  # the splits are the algorithm under test
        if bounds is not None:
            start, end = (torch.minimum(bounds[:, sp + e].to(L.device).long(), L)[:, None] for e in (0, 1))
        elif block is not None:
            start = torch.minimum(torch.full_like(L, sp * block), L)[:, None]
            end = torch.minimum(start + block, L[:, None])
        else:
            start = torch.minimum(sp * c, L)[:, None]
            end = torch.minimum(start + c[:, None], L[:, None])
        in_split = (j >= start) & (j < end)
        o, lse = attention(q, k_cache, v_cache, keep=keep & in_split[:, None, :], **kw)
        o_parts.append(o.float())
        lse_parts.append(lse)
    o_parts_t, lse_parts_t = torch.stack(o_parts), torch.stack(lse_parts)
    h_q, d_v = q.shape[2], v_cache.shape[-1]
    rows = lse_parts_t.transpose(2, 3).reshape(num_splits, -1)  # splits, b*s_q*h_q (o_parts' row order)
    o, lse_rows = lse_combine(o_parts_t.reshape(num_splits, -1, d_v), rows)
    o = o.reshape(b, s_q, h_q, d_v)
    lse = lse_rows.reshape(b, s_q, h_q).transpose(1, 2)
    if sinks is not None:
        lse_sink = torch.logaddexp(lse, sinks.float()[None, :, None])
        w = torch.where(torch.isfinite(lse_sink), torch.exp(lse - lse_sink), torch.zeros_like(lse))
        o = o.float() * w.transpose(1, 2)[..., None]
    return o.to(q.dtype), lse, o_parts_t, lse_parts_t


def chunked_prefill(q, k_cache, v_cache, cu_seqlens_q, hist, block_table=None, *, causal: str = "bottom_right",
                    cache_loc: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed chunks q (total_q, h_q, d) over caches holding hist_b + L_q,b keys per sequence
    (contiguous (b, s_max, h_kv, d), or pages through block_table) -> o (total_q, h_q, d_v), lse (h_q, total_q).
    Query i of sequence b is at position hist_b + i (bottom_right: keys j <= hist_b + i)."""
    cq = cu_seqlens_q.long()
    lq = cq[1:] - cq[:-1]
    lk = hist.to(q.device).long() + lq
    if cache_loc is not None and block_table is not None:
        block_table = block_table[cache_loc.long()]
    elif cache_loc is not None:
        k_cache, v_cache = k_cache[cache_loc.long()], v_cache[cache_loc.long()]
    if block_table is not None:
        k_cache, v_cache = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    qi = torch.arange(max(int(lq.max()), 1), device=q.device)[None, :]
    q_ok = qi < lq[:, None]  # b, s_q
    qd = q[(cq[:-1, None] + qi).clamp(max=max(q.shape[0] - 1, 0))] * q_ok[..., None, None]
    o, lse = attention(qd, k_cache, v_cache, q_lens=lq, k_lens=lk, causal=causal, **kw)
    return o[q_ok], lse.transpose(1, 2)[q_ok].T


# -- backward: autograd through the eager forward, in the input's dtype ------------------------------
def prefill_backward(q, k, v, do, dlse=None, *, sinks=None, **kw) -> dict[str, torch.Tensor]:
    """Gradients of `attention` by autograd in q's dtype (FlashAttention's same-precision reference:
    its tests differentiate attention_ref(upcast=False)); the eager forward's own O and LSE are used.

    do: (b, s_q, h_q, d_v) cotangent of O; dlse: (b, h_q, s_q) cotangent of the LSE with the sink
    folded in, or None; returns {"dq", "dk", "dv"} in the inputs' dtypes (and "dsinks", fp32)."""
    return _autograd(lambda q_, k_, v_, s_: attention(q_, k_, v_, sinks=s_, **kw), q, k, v, do, dlse, sinks,
                     lambda s_: s_[None, :, None])


def varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, do, dlse=None, *, sinks=None, **kw) -> dict[str, torch.Tensor]:
    """Gradients of `varlen` by autograd (as `prefill_backward`); dlse: (h_q, total_q) or None."""
    return _autograd(lambda q_, k_, v_, s_: varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, sinks=s_, **kw),
                     q, k, v, do, dlse, sinks, lambda s_: s_[:, None])


def _autograd(forward, q, k, v, do, dlse, sinks, sink_as_lse) -> dict[str, torch.Tensor]:
    """d(sum(O dO) + sum(LSE' dLSE)) by autograd; LSE' = logaddexp(LSE, sink), the LSE with the sink,
    whose cotangent is 0 on rows where it is -inf (no key, no sink: no gradient)."""
    leaves = {n: t.detach().requires_grad_(True) for n, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks))
              if t is not None}
    with torch.enable_grad():
        o, lse = forward(leaves["q"], leaves["k"], leaves["v"], leaves.get("sinks"))
        outs, cots = [o], [do.to(o.dtype)]
        if dlse is not None:
            if "sinks" in leaves:
                lse = torch.logaddexp(lse, sink_as_lse(leaves["sinks"].float()))
            outs.append(lse)
            cots.append(torch.where(torch.isfinite(lse), dlse.float(), torch.zeros((), device=lse.device)))
        grads = torch.autograd.grad(outs, list(leaves.values()), cots, allow_unused=True)
    return {f"d{n}": (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(leaves, grads)}


def context_kv(q, k, v, k_cache, v_cache, cu_seqlens, input_pos, block_table=None,
               **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Context attention that writes the cache: k / v (total, h_kv, d) appended in place at input_pos_b + t
    (kernels.torch.kvcache.update, ragged), then `chunked_prefill` over the written caches (bottom_right)."""
    from .kvcache import update

    cu = cu_seqlens.long()
    rag = dict(block_table=block_table, seq_len=cu[1:] - cu[:-1], seq_start=cu[:-1])
    update(k_cache, k, input_pos, **rag)
    update(v_cache, v, input_pos, **rag)
    return chunked_prefill(q, k_cache, v_cache, cu_seqlens, input_pos, block_table, causal="bottom_right", **kw)
