"""Eager torch dequantizers and quantizers for the quant family (the same-precision baseline).

    ggml:   y = d * (q - o)  |  d * q + m  |  d * sc_j * q - dmin * m_j     in float32, then `dtype`
    fp8:    q = x.to(float8)  (saturate: clamp to +-max first);  blocks: s = amax / 448, q = x / s
    int4:   W[n, k] = s[k // g, n] * (q[k, n] - z[k // g, n])               in the output dtype

These are what a PyTorch user writes without a fused kernel, on CPU or CUDA. The GGML formats
are unpacked from a uint8 tensor with the bit maps of research/quant-formats.md section 1.3 (an
independent reading of the layout, not a port of refimpl): every product d * sc * q is exact in
float32 and the one subtraction or addition rounds once, as ggml's `dequantize_row_*` does, so the
float32 result is bit-identical to ggml's and to the golden rounded to float32; bf16/fp16 output is
that float32 value rounded once more. fp8 casts are torch's own: `saturate=False` is the native
cast, whose e4m3fn overflow is NaN up to torch 2.11 and +-448 since pytorch/pytorch#178817
(torch 2.13 here); `saturate=True` clamps first, which is the same on every version.
"""

from __future__ import annotations

import torch

# format: (block, bytes per block)
GGML = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
        "q8_1": (32, 36), "iq4_nl": (32, 18), "q2_k": (256, 84), "q3_k": (256, 110),
        "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q8_k": (256, 292)}
IQ4_NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """(..., nb, nbytes) -> (..., nb) float32 of the little-endian fp16 at byte `off`."""
    return b[..., off:off + 2].contiguous().view(torch.float16)[..., 0].float()


def _legacy_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) codes: low nibble of qs[j] is element j, high nibble j + 16."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).long()


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) bytes of a little-endian u32 -> (..., 32) bit e of it, shifted to bit 4."""
    word = sum(qh[..., i].long() << (8 * i) for i in range(4))
    return ((word[..., None] >> torch.arange(32, device=qh.device)) & 1) << 4


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) packed bytes -> (..., 8) six-bit scales and mins (ggml's get_scale_min_k4)."""
    s = sc.long()
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=-1), torch.cat([lo_m, hi_m], dim=-1)


def _k_quant_index(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per element e of a 256-block: h = e // 128, t = (e % 128) // 32, l = e % 32."""
    e = torch.arange(256, device=device)
    return e // 128, (e % 128) // 32, e % 32, e


def _dequant_f32(fmt: str, b: torch.Tensor) -> torch.Tensor:
    """(..., nb, nbytes) uint8 blocks -> (..., nb, block) float32."""
    if fmt in ("q4_0", "iq4_nl"):
        q = _legacy_nibbles(b[..., 2:18])
        if fmt == "q4_0":
            return _f16(b, 0)[..., None] * (q - 8).float()
        table = torch.tensor(IQ4_NL, dtype=torch.float32, device=b.device)
        return _f16(b, 0)[..., None] * table[q]
    if fmt == "q4_1":
        return _f16(b, 0)[..., None] * _legacy_nibbles(b[..., 4:20]).float() + _f16(b, 2)[..., None]
    if fmt == "q5_0":
        q = _legacy_nibbles(b[..., 6:22]) | _fifth_bit(b[..., 2:6])
        return _f16(b, 0)[..., None] * (q - 16).float()
    if fmt == "q5_1":
        q = _legacy_nibbles(b[..., 8:24]) | _fifth_bit(b[..., 4:8])
        return _f16(b, 0)[..., None] * q.float() + _f16(b, 2)[..., None]
    if fmt in ("q8_0", "q8_1"):
        off = 2 if fmt == "q8_0" else 4
        return _f16(b, 0)[..., None] * b[..., off:off + 32].contiguous().view(torch.int8).float()
    if fmt == "q8_k":
        d = b[..., 0:4].contiguous().view(torch.float32)
        return d * b[..., 4:260].contiguous().view(torch.int8).float()
    h, t, l, e = _k_quant_index(b.device)
    if fmt in ("q4_k", "q5_k"):
        sc, m = _scale_min_k4(b[..., 4:16])
        j = e // 32
        qs = b[..., 16:144] if fmt == "q4_k" else b[..., 48:176]
        c, r = e // 64, e % 64
        q = (qs[..., 32 * c + r % 32].long() >> torch.where(r < 32, 0, 4)) & 0xF
        if fmt == "q5_k":
            q = q | (((b[..., 16:48][..., e % 32].long() >> j) & 1) << 4)
        d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
        return (d * sc[..., j].float()) * q.float() - dmin * m[..., j].float()
    if fmt == "q6_k":
        ql, qh = b[..., 0:128].long(), b[..., 128:192].long()
        low = (ql[..., 64 * h + l + 32 * (t & 1)] >> torch.where(t < 2, 0, 4)) & 0xF
        q = (low | (((qh[..., 32 * h + l] >> (2 * t)) & 3) << 4)) - 32
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        return (_f16(b, 208)[..., None] * sc[..., e // 16]) * q.float()
    if fmt == "q3_k":
        hmask, qs, s = b[..., 0:32].long(), b[..., 32:96].long(), b[..., 96:108].long()
        low = (qs[..., 32 * h + l] >> (2 * t)) & 3
        q = low - torch.where(((hmask[..., l] >> (e // 32)) & 1) == 1, 0, 4)
        j = torch.arange(16, device=b.device)
        lo4 = torch.where(j < 8, s[..., j % 8] & 0xF, s[..., j % 8] >> 4)
        sc = (lo4 | (((s[..., 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32  # ..., 16
        return (_f16(b, 108)[..., None] * sc[..., e // 16].float()) * q.float()
    if fmt == "q2_k":
        s, qs = b[..., 0:16].long(), b[..., 16:80].long()
        q = (qs[..., 32 * h + l] >> (2 * t)) & 3
        sc = s[..., e // 16]
        dl = _f16(b, 80)[..., None] * (sc & 0xF).float()
        return dl * q.float() - _f16(b, 82)[..., None] * (sc >> 4).float()
    raise ValueError(f"unknown GGML format {fmt!r}; known: {sorted(GGML)}")


def dequantize(fmt: str, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGML blocks -> values: data (..., nb * nbytes) uint8 -> (..., nb * block) in `dtype`."""
    if fmt not in GGML:
        raise ValueError(f"unknown GGML format {fmt!r}; known: {sorted(GGML)}")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{fmt}: output dtype must be one of {OUT_DTYPES}, got {dtype}")
    block, nbytes = GGML[fmt]
    if data.dtype != torch.uint8 or data.ndim < 1 or data.shape[-1] % nbytes:
        raise ValueError(f"{fmt}: data must be uint8 (..., nb * {nbytes}), got {data.dtype} "
                         f"{tuple(data.shape)}")
    b = data.reshape(*data.shape[:-1], -1, nbytes)
    return _dequant_f32(fmt, b).reshape(*data.shape[:-1], -1).to(dtype)


def fp8_encode(x: torch.Tensor, fmt: str = "e4m3", saturate: bool = False) -> torch.Tensor:
    """x.float() -> float8 with torch's cast; saturate clamps to +-max finite first (NaN stays)."""
    if fmt not in FP8:
        raise ValueError(f"fp8 format must be one of {sorted(FP8)}, got {fmt!r}")
    x = x.float()  # float64 converts through float32 anyway; say so explicitly
    if saturate:
        x = x.clamp(-FP8_MAX[fmt], FP8_MAX[fmt])
    return x.to(FP8[fmt])


def fp8_quantize_blocks(x: torch.Tensor, block_m: int, block_k: int, amax_floor: float = 1e-4,
                        scale_ub: float | None = None, scale_fmt: str = "fp32",
                        reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek act_quant / weight blocks: x (M, K) -> q (M, K) e4m3fn, s (ceil(M/bm), ceil(K/bk)) fp32.

    s = max(amax, floor) [min scale_ub] / 448 in float32 (ue8m0: 2^ceil(log2 s), exactly, from the
    exponent bits), q = x / s (reciprocal: x * (1 / s)) in float32, clamped to +-448, cast."""
    if x.ndim != 2 or block_m < 1 or block_k < 1:
        raise ValueError(f"x must be (M, K) and blocks positive, got {tuple(x.shape)}, ({block_m}, {block_k})")
    if scale_fmt not in ("fp32", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'fp32' or 'ue8m0', got {scale_fmt!r}")
    m, k = x.shape
    mb, kb = -(-m // block_m), -(-k // block_k)
    xp = torch.zeros(mb * block_m, kb * block_k, dtype=torch.float32, device=x.device)
    xp[:m, :k] = x.float()  # zero padding leaves each edge block's amax unchanged
    xb = xp.view(mb, block_m, kb, block_k)
    amax = xb.abs().amax(dim=(1, 3)).clamp(min=amax_floor)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    s = amax / torch.full_like(amax, 448.0)  # CUDA turns `/ 448.0` into `* (1 / 448)`: 1 ulp off
    if scale_fmt == "ue8m0":
        mant, exp = torch.frexp(s)  # s = mant 2^exp, mant in [0.5, 1): a power of two has mant 0.5
        s = torch.ldexp(torch.ones_like(s), torch.where(mant == 0.5, exp - 1, exp))
    sb = s[:, None, :, None]
    y = xb * (torch.ones_like(sb) / sb) if reciprocal else xb / sb  # tensor / tensor: IEEE division
    q = fp8_encode(y, "e4m3", saturate=True)
    return q.view(mb * block_m, kb * block_k)[:m, :k], s


def fp8_dequantize_blocks(q: torch.Tensor, s: torch.Tensor, block_m: int, block_k: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (M, K) float8 * s[i // bm, j // bk] in float32, then `dtype`."""
    m, k = q.shape
    if tuple(s.shape) != (-(-m // block_m), -(-k // block_k)):
        raise ValueError(f"scales {tuple(s.shape)} do not tile q {(m, k)} in ({block_m}, {block_k}) blocks")
    full = s.float().repeat_interleave(block_m, 0).repeat_interleave(block_k, 1)[:m, :k]
    return (q.float() * full).to(dtype)


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> 8 codes each along `dim`, nibble p (bits 4p..) first."""
    shifts = torch.arange(0, 32, 4, device=words.device)
    c = (words.long().unsqueeze(-1) >> shifts) & 0xF  # int32 sign-extends; the mask drops it
    c = c.movedim(dim if dim >= 0 else dim - 1, -2)  # ..., words, 8
    return c.reshape(*c.shape[:-2], -1).movedim(-1, dim)


def int4_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    order: str = "gptq", dtype: torch.dtype | None = None) -> torch.Tensor:
    """GPTQ v1 / AWQ group-wise int4 -> W (N, K) in `dtype` (default scales.dtype).

    gptq: qweight (K/8, N) along K, qzeros (K/g, N/8) along N holding z - 1;
    awq: qweight (K, N/8) along N in nibble order 0,2,4,6,1,3,5,7, qzeros the same holding z."""
    dtype = scales.dtype if dtype is None else dtype
    if order == "gptq":
        q = _nibbles(qweight, 0)  # K, N
        z = _nibbles(qzeros, 1) + 1  # v1 stored zero - 1
    elif order == "awq":
        undo = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=qweight.device)  # column 8j+i in nibble undo[i]
        q = _nibbles(qweight, 1).unflatten(1, (-1, 8))[..., undo].flatten(1)
        z = _nibbles(qzeros, 1).unflatten(1, (-1, 8))[..., undo].flatten(1)
    else:
        raise ValueError(f"int4 order must be 'gptq' or 'awq', got {order!r}")
    if z.shape != scales.shape or q.shape[1] != scales.shape[1] or q.shape[0] % scales.shape[0]:
        raise ValueError(f"int4 {order}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} do not describe one (K, N) weight")
    g = q.shape[0] // scales.shape[0]
    zk = z.repeat_interleave(g, 0)
    sk = scales.to(dtype).repeat_interleave(g, 0)
    return ((q - zk).to(dtype) * sk).T  # (q - z) is exact in fp16/bf16; the product rounds once
