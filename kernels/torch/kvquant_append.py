"""One decode step over a quantized paged KV cache, eager torch (kvquant.append_decode's baseline): write, then read.

    slot_b  = block_table[b, L_b // page] * page + L_b % page                L_b = seq_lens[b] (before the append)
    k_cache.view(-1, h_kv, d)[slot_b] = Q(k_new[b] / s_k)     (likewise V; gran token stores s = amax / FMAX too)
    o, lse  = kvquant.decode_paged's eager path over seq_lens + 1 keys     (kernels/torch/kvquant_decode.py)

The write is kernels/torch/kvquant.py's `quantize` (fp32 IEEE division by a tensor, clamp, torch's nearest-even
casts; int8 torch.round, half to even) at the slots the block table gives, through uint8 views of the caches; the
read dequantizes the whole cache (the new rows included, as written) to fp32 and runs the fp32 attention, O rounded
to q's dtype once. Conventions: refimpl/kvquant_append.py (the golden): the new token is read back as quantized.
"""

from __future__ import annotations

import torch

from kernel_parity.kernels.torch.kvquant import FMAX, STORAGE, quantize
from kernel_parity.kernels.torch.kvquant_decode import decode_paged

GRANS = ("tensor", "head", "token")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _bad(msg: str) -> None:
    raise ValueError(f"kvquant.append_decode: {msg}")


def check_args(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, fmt, gran, k_scale, v_scale,
               k_scale_cache, v_scale_cache) -> None:
    """ValueError (one line: the argument and what was expected) unless the call is well formed."""
    if fmt not in STORAGE:
        _bad(f"fmt={fmt!r} must be one of {', '.join(STORAGE)}")
    if gran not in GRANS:
        _bad(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            _bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            _bad(f"{name} is on {t.device}, q on {q.device}")
    if q.dim() != 3 or q.dtype not in FLOATS:
        _bad(f"q must be (b, h_q, d) fp32 / fp16 / bf16, got {tuple(q.shape)} {q.dtype}")
    b, h_q, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape) \
            or k_cache.dtype != STORAGE[fmt] or v_cache.dtype != STORAGE[fmt]:
        _bad(f"k_cache, v_cache must both be (num_blocks, page, h_kv, d={d}) {STORAGE[fmt]} for fmt {fmt}, got "
             f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv:
        _bad(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (b, h_kv, d) or t.dtype not in FLOATS:
            _bad(f"{name} must be ({b}, {h_kv}, {d}) fp32 / fp16 / bf16, got {tuple(t.shape)} {t.dtype}")
    if gran == "token":
        if k_scale is not None or v_scale is not None:
            _bad("gran token computes its scales: k_scale, v_scale must be None")
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (nb, page, h_kv) or t.dtype != torch.float32 \
                    or t.device != q.device:
                _bad(f"gran token needs {name}, a ({nb}, {page}, {h_kv}) float32 tensor on {q.device}")
    else:
        if k_scale_cache is not None or v_scale_cache is not None:
            _bad(f"gran {gran} has static scales: k_scale_cache, v_scale_cache must be None")
        shape = (1,) if gran == "tensor" else (h_kv,)
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32 \
                    or t.device != q.device:
                _bad(f"gran {gran} needs {name}, a {shape} float32 tensor on {q.device}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        _bad(f"block_table must be ({b}, max_pages) int32, got {tuple(block_table.shape)} {block_table.dtype}")
    if tuple(seq_lens.shape) != (b,) or seq_lens.dtype != torch.int32:
        _bad(f"seq_lens must be ({b},) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    try:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    except RuntimeError:
        _bad(f"{what}'s block and page dims must be mergeable into one slot dim (strides {tuple(t.stride())})")


def append_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, fmt: str, gran: str, *,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append (k_new, v_new) at seq_lens[b] (caches and, gran token, scale caches written in place), then decode
    over seq_lens[b] + 1 keys: returns (o (b, h_q, d) q's dtype, lse (b, h_q) fp32)."""
    check_args(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, fmt, gran, k_scale, v_scale,
               k_scale_cache, v_scale_cache)
    b = q.shape[0]
    nb, page, h, d = k_cache.shape
    lens = seq_lens.long()
    rows = torch.arange(b, device=q.device)
    pages = block_table[rows, lens // page].long()
    slots = pages * page + lens % page
    token = gran == "token"
    for cache, new, static, sc in ((k_cache, k_new, k_scale, k_scale_cache), (v_cache, v_new, v_scale, v_scale_cache)):
        x = new.float()
        if token:
            amax = x.abs().amax(dim=-1)  # (b, h)
            s = amax / torch.full_like(amax, FMAX[fmt])  # a tensor divisor (IEEE on CUDA too)
        elif gran == "head":
            s = static[None, :].expand(b, h)
        else:
            s = static.expand(b, h)
        codes = quantize(x, s[:, :, None], fmt)
        _flat(cache, "cache").view(torch.uint8)[slots] = codes.view(torch.uint8)
        if token:
            _flat(sc, "scale_cache")[slots] = s
    ks = k_scale_cache if token else k_scale
    vs = v_scale_cache if token else v_scale
    return decode_paged(q, k_cache, v_cache, ks, vs, block_table, (seq_lens + 1).to(torch.int32), scale=scale)
