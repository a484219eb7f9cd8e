"""Eager RoPE with torch's own ops: the same-precision noise baseline of the rotary family.

    pair i at position p:  (a, b) -> (a cos(p w_i) - b sin(p w_i),  a sin(p w_i) + b cos(p w_i))

What the two reference implementations everyone copies do, each in its own precision:
- style "half": HF transformers' `apply_rotary_pos_emb`: cos and sin of the positions, repeated
  over both halves (`cat(freqs, freqs)`), cast to x's dtype, then `x * cos + rotate_half(x) * sin`
  in x's dtype (rotate_half(x) = cat(-x2, x1)): in fp16 / bf16 every product and the sum round
  to the dtype, and so does the table.
- style "interleaved": Meta's llama `apply_rotary_emb`: x upcast to fp32, viewed as complex pairs,
  multiplied by complex64 freqs_cis, `view_as_real`, cast back: fp32 arithmetic, one rounding.
Angles from theta are HF's / Meta's fp32 angles: inv_freq = 1 / theta^(2i / rot) in fp32 (Llama-3.1
scaling applied to it in fp32), angle = float(p) * inv_freq, cos / sin in fp32.
Partial rotary: the rotary part is sliced out (first or last rot dims), rotated and concatenated
back with the pass-through dims, which are never converted.

Backward (`rope_backward`): torch autograd through `rope` in x's dtype (HF's rotation's backward rounds
as its forward does; Meta's complex path stays fp32).
"""

from __future__ import annotations

import math

import torch

from kernel_parity.kernels.torch.kvcache import update as _cache_update

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}


def inv_freq(rot: int, theta: float, scaling: str, device) -> torch.Tensor:
    """(rot/2,) float32: 1 / theta^(2i/rot), with Llama-3.1's scaling ("llama3") in fp32."""
    f = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64, device=device).float() / rot))
    if scaling == "none":
        return f
    if scaling != "llama3":
        raise ValueError(f"unknown rope scaling {scaling!r} (none, llama3)")
    c = LLAMA3
    wavelen = 2 * math.pi / f
    low_wavelen = c["original_max_position"] / c["low_freq_factor"]
    high_wavelen = c["original_max_position"] / c["high_freq_factor"]
    smooth = (c["original_max_position"] / wavelen - c["low_freq_factor"]) / (c["high_freq_factor"] - c["low_freq_factor"])
    mid = (1 - smooth) * f / c["factor"] + smooth * f
    return torch.where(wavelen < high_wavelen, f, torch.where(wavelen > low_wavelen, f / c["factor"], mid))


def _cos_sin(positions: torch.Tensor, rot: int, cos=None, sin=None, table=None, theta=None,
             scaling: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (t, rot/2) of the tokens' positions, in the table's dtype (fp32 from theta)."""
    pos = positions.long()
    if theta is not None:
        ang = pos.float()[:, None] * inv_freq(rot, theta, scaling, positions.device)[None, :]
        return ang.cos(), ang.sin()
    if table is not None:
        if table.dtype == torch.complex64:
            table = torch.view_as_real(table)
        return table[pos, :, 0], table[pos, :, 1]
    return cos[pos], sin[pos]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x_rot: torch.Tensor, c: torch.Tensor, s: torch.Tensor, style: str) -> torch.Tensor:
    """x_rot (t, h, rot) rotated by (t, rot/2) cos and sin, in the style's own precision."""
    if style == "half":  # HF: the table in x's dtype, products and sum in x's dtype
        cos = torch.cat((c, c), dim=-1).to(x_rot.dtype)[:, None, :]
        sin = torch.cat((s, s), dim=-1).to(x_rot.dtype)[:, None, :]
        return x_rot * cos + _rotate_half(x_rot) * sin
    if style == "interleaved":  # Meta: complex multiply in fp32
        freqs_cis = torch.complex(c.float(), s.float())[:, None, :]
        xc = torch.view_as_complex(x_rot.float().reshape(*x_rot.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x_rot)
    raise ValueError(f"unknown rope style {style!r} (interleaved, half)")


def rope(x: torch.Tensor, positions: torch.Tensor, *, cos=None, sin=None, table=None, theta=None,
         scaling: str = "none", style: str = "half", rot: int | None = None, at: str = "first") -> torch.Tensor:
    """x (t, h, d) -> (t, h, d) in x.dtype; the rotary part is the first or last `rot` dims.

    positions: (t,) int; cos, sin: (max_seq, rot/2) | table: (max_seq, rot/2, 2) pairs or complex64
    (max_seq, rot/2) | theta (+ scaling)
    """
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D (t, h, d), got shape {tuple(x.shape)}")
    d = x.shape[-1]
    rot = d if rot is None else rot
    lo = 0 if at == "first" else d - rot
    c, s = _cos_sin(positions, rot, cos, sin, table, theta, scaling)
    rotated = _rotate(x[..., lo:lo + rot], c, s, style)
    return torch.cat((x[..., :lo], rotated, x[..., lo + rot:]), dim=-1)


def rope_backward(x: torch.Tensor, positions: torch.Tensor, dy: torch.Tensor, **angles) -> torch.Tensor:
    """dx (t, h, d) in x.dtype: autograd of `rope` (same arguments) for the cotangent dy (t, h, d)."""
    xl = x.detach().requires_grad_()
    with torch.enable_grad():
        (dx,) = torch.autograd.grad([rope(xl, positions, **angles)], [xl], [dy])
    return dx


def kv_update(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              pos: torch.Tensor, table: torch.Tensor, *, block_table: torch.Tensor | None = None,
              cache_loc: torch.Tensor | None = None, q: torch.Tensor | None = None,
              q_out: torch.Tensor | None = None, style: str = "half", seq_len: torch.Tensor | None = None,
              seq_start: torch.Tensor | None = None) -> torch.Tensor | None:
    """In place: k_new rotated at position pos[b] + t by table's rows (HF's half-split style in the
    dtype by default), v_new as it is, both appended to the caches (kernels/torch/kvcache.update).
    With q (b, s_new, h_q, d) the queries are rotated by the same rows (TensorRT-LLM's
    update_kv_cache_rope_fusion) into q_out (allocated when None), which is returned.

    k_cache, v_cache: (rows, s_max, h, d) or (num_blocks, page, h, d) with block_table (rows, max_blocks);
    k_new, v_new: (b, s_new, h, d); pos: (b,); table: (max_seq, d/2, 2) (cos, sin) pairs;
    cache_loc: (b,) each sequence's cache / block-table row (TensorRT-LLM; None: row b).
    Ragged (TensorRT-LLM's flattened tokens): k_new, v_new (total, h, d | dv) with seq_len, seq_start (b,), q
    (n_q, h_q, d) its flattened buffer (sequence b's rows seq_start[b] + t as new's; q_out's other rows are not
    written); v's head dim dv may differ from k's (v is only copied)."""
    h, d = k_new.shape[-2:]
    if seq_len is not None:  # each flattened row's position: pos of its sequence plus its index in it
        n = seq_len.to(pos.device).long()
        bi = torch.repeat_interleave(torch.arange(n.numel(), device=pos.device), n)
        t = torch.arange(bi.numel(), device=pos.device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        p = torch.zeros(k_new.shape[0], dtype=torch.long, device=pos.device)
        p[seq_start.to(pos.device).long()[bi] + t] = pos.long()[bi] + t
    else:
        b, s_new = k_new.shape[:2]
        p = (pos.long()[:, None] + torch.arange(s_new, device=pos.device)[None, :]).reshape(-1)  # b * s_new
    c, s = _cos_sin(p, d, table=table)
    k_rot = _rotate(k_new.reshape(-1, h, d), c, s, style).reshape(k_new.shape)
    rag = dict(seq_len=seq_len, seq_start=seq_start) if seq_len is not None else {}
    _cache_update(k_cache, k_rot, pos, block_table=block_table, cache_loc=cache_loc, **rag)
    _cache_update(v_cache, v_new, pos, block_table=block_table, cache_loc=cache_loc, **rag)
    if q is None:
        return None
    if seq_len is not None:  # the flattened q buffer: the sequences' rows only, each at its token's position
        rows = seq_start.to(pos.device).long()[bi] + t
        cq, sq = _cos_sin(pos.long()[bi] + t, d, table=table)
        if q_out is None:
            q_out = torch.empty_like(q)
        q_out[rows] = _rotate(q[rows], cq, sq, style)
        return q_out
    q_rot = _rotate(q.reshape(-1, q.shape[-2], d), c, s, style).reshape(q.shape)
    if q_out is None:
        return q_rot
    q_out.copy_(q_rot)
    return q_out
