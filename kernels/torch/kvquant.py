"""Quantized KV cache write (quantize on append), eager torch: the `kvquant` family's baseline for kvquant.update.

    update(cache, new, slot_mapping, fmt, gran, *, scale=None, scale_cache=None)      in place, K and V apart

    s(t, h) = scale[0] (tensor) | scale[h] (head) | amax_d |new[t, h, :]| / FMAX (token; fp32 IEEE division)
    codes   = e4m3 / e5m2: clamp(x / s, +-FMAX).to(float8)          (torch's cast rounds to nearest even)
              int8:        round-half-even(x / s).clamp(-128, 127)   (torch.round is half to even)
    cache.view(-1, h, d)[slot] = codes, scale_cache.view(-1, h)[slot] = s (token)   for slot != -1

Conventions: refimpl/kvquant_update.py (the golden) and refimpl/kvquant.py (the formats). x / s is
torch's float32 division of two tensors (IEEE, correctly rounded on CPU and CUDA); a row with s = 0 (all zeros)
gets codes 0. Every divisor is a tensor: torch on CUDA divides by a Python scalar as a multiply by the scalar's
float32 reciprocal (seen on an H200 with torch 2.11: amax / 448 gave 5-23% of the ci cases' dynamic scales other
bits than the IEEE quotient; torch's CPU division by a scalar is exact).
The clamp is explicit: torch's fp32 -> e5m2 cast overflows to inf (and e4m3fn's to NaN before torch 2.12).
Padding tokens (slot -1) are dropped with a boolean mask (a device sync: this is the eager baseline). The
writes go through uint8 views of the caches (index_put on float8 tensors is not implemented everywhere).

`check_update` holds the argument rules the Triton kernel shares (kernels/triton/kvquant.py).
"""

from __future__ import annotations

import torch

FORMATS = ("e4m3", "e5m2", "int8")
GRANS = ("tensor", "head", "token")
FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
STORAGE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}
NEW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _bad(msg: str) -> None:
    raise ValueError(f"kvquant.update: {msg}")


def check_update(cache, new, slot_mapping, fmt, gran, scale, scale_cache) -> None:
    """ValueError (one line: the argument and what was expected) unless the call is well formed.
    Slot values (range, distinctness) and new's finiteness are the caller's guarantee: checking them would sync
    the device."""
    if fmt not in FORMATS:
        _bad(f"fmt={fmt!r} must be one of {', '.join(FORMATS)}")
    if gran not in GRANS:
        _bad(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.dtype != STORAGE[fmt]:
        _bad(f"cache must be a (num_blocks, page, h_kv, d) {STORAGE[fmt]} tensor for fmt {fmt}, got "
             f"{getattr(cache, 'dtype', type(cache).__name__)} {tuple(getattr(cache, 'shape', ()))}")
    nb, page, h, d = cache.shape
    if not isinstance(new, torch.Tensor) or new.dim() != 3 or tuple(new.shape[1:]) != (h, d) \
            or new.dtype not in NEW_DTYPES:
        _bad(f"new must be an (n, {h}, {d}) float32 / float16 / bfloat16 tensor, got "
             f"{getattr(new, 'dtype', type(new).__name__)} {tuple(getattr(new, 'shape', ()))}")
    n = new.shape[0]
    if not isinstance(slot_mapping, torch.Tensor) or tuple(slot_mapping.shape) != (n,) \
            or slot_mapping.dtype not in (torch.int64, torch.int32):
        _bad(f"slot_mapping must be an ({n},) int64 (or int32) tensor")
    for name, t in (("new", new), ("slot_mapping", slot_mapping), ("scale", scale), ("scale_cache", scale_cache)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != cache.device:
            _bad(f"{name} is on {t.device}, the cache on {cache.device}")
    if d > 1 and (cache.stride(-1) != 1 or new.stride(-1) != 1):
        _bad("cache and new must have last-dim stride 1")
    if gran == "token":
        if scale is not None:
            _bad("gran token computes its scales: scale must be None")
        if not isinstance(scale_cache, torch.Tensor) or tuple(scale_cache.shape) != (nb, page, h) \
                or scale_cache.dtype != torch.float32:
            _bad(f"gran token needs scale_cache, a ({nb}, {page}, {h}) float32 tensor")
    else:
        if scale_cache is not None:
            _bad(f"gran {gran} has static scales: scale_cache must be None")
        want = (1,) if gran == "tensor" else (h,)
        if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want or scale.dtype != torch.float32:
            _bad(f"gran {gran} needs scale, a {want} float32 tensor")


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    """(num_blocks, page, ...) -> (num_blocks * page, ...) as a view (the slots), or ValueError."""
    try:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    except RuntimeError:
        _bad(f"{what}'s block and page dims must be mergeable into one slot dim (strides {tuple(t.stride())})")


def quantize(x: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of fp32 x at fp32 scales s (broadcast): x / s (s = 0: 0), saturated, nearest even."""
    zero = s == 0
    v = torch.where(zero, 0.0, x / torch.where(zero, 1.0, s))
    if fmt == "int8":
        return torch.round(v).clamp(-128.0, 127.0).to(torch.int8)
    return v.clamp(-FMAX[fmt], FMAX[fmt]).to(STORAGE[fmt])


def update(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, fmt: str, gran: str, *,
           scale: torch.Tensor | None = None, scale_cache: torch.Tensor | None = None) -> None:
    """Quantize `new` (n, h_kv, d) into `cache` (num_blocks, page, h_kv, d) in place at slot_mapping's slots
    (-1 skipped); gran token also writes its scales into scale_cache (num_blocks, page, h_kv)."""
    check_update(cache, new, slot_mapping, fmt, gran, scale, scale_cache)
    nb, page, h, d = cache.shape
    flat = _flat(cache, "cache")
    flat_sc = _flat(scale_cache, "scale_cache") if gran == "token" else None
    if new.shape[0] == 0:
        return
    x = new.float()
    if gran == "token":
        amax = x.abs().amax(dim=-1)  # (n, h)
        s = amax / torch.full_like(amax, FMAX[fmt])  # a tensor divisor: CUDA divides a tensor by a Python scalar
        # as a multiply by its float32 reciprocal (1 / 448 rounded), which misses some scales by an ulp
    elif gran == "head":
        s = scale[None, :].expand(x.shape[0], h)
    else:
        s = scale.expand(x.shape[0], h)
    codes = quantize(x, s[:, :, None], fmt)
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    flat.view(torch.uint8)[idx] = codes[keep].view(torch.uint8)
    if gran == "token":
        flat_sc[idx] = s[keep]
