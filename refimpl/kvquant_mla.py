"""Golden FlashMLA sparse MLA decode over its FP8 KV cache rows of 656 bytes (issue 34, `kvquant.mla_sparse`).

The row format (FlashMLA README "FP8 KV cache", its tests/quant.py `quantize_k_cache` / `dequantize_k_cache`,
layout V32_FP8Sparse), one row per (token, kv head), little-endian:

    bytes [0, 512)    512 float8_e4m3fn codes of the NoPE (latent) part c, channels 0..511
    bytes [512, 528)  4 float32 scales, scale g for channels [128 g, 128 g + 128)
    bytes [528, 656)  64 bfloat16 RoPE values k_pe (not quantized)

The cache is (num_blocks, page, h_kv, 656) uint8 (page 64 and h_kv = 1 in FlashMLA and DeepSeek-V3.2; any page
and h_kv here, the block and slot strides as stored: FlashMLA's own test allocates page + 1 rows a block).

Pack (`pack`, FlashMLA's quantize_k_cache, choices declared):
- scale_g = 2^ceil(log2(max(float32(amax_g) / 448, 1e-4))): amax over the group's 128 values (as float32), an
  IEEE float32 division by 448, clamped below at float32(1e-4) (FlashMLA's FP8_AMAX_MARGIN), then rounded UP to a
  power of two (UE8M0-style). FlashMLA takes torch.log2 in float32 then ceil; here the power of two is the exact
  ceiling (frexp): the two differ only where float32 log2 of a value within ~1e-7 relative above a power of two
  rounds to the integer, i.e. never on the inputs drawn here. A group of zeros gets 2^-13 (the clamp) and codes 0.
- codes = e4m3(float32(x) / float32(scale_g)): the float32 quotient (exact: the scale is a power of two, but for
  float32 underflow) rounded to nearest even onto the e4m3fn grid (subnormals m 2^-9 included), clamped to
  +-448 first (refimpl/kvquant.py quantize's convention, __NV_SATFINITE). With the power-of-two ceiling
  |x / scale| <= 448 always, so the clamp never acts on pack's own scales: torch's `.to(float8_e4m3fn)` (what
  FlashMLA's test uses; round to nearest even, its handling past 448 version-dependent) gives the same codes. A
  group whose amax is exactly 448 2^k gets scale 2^k: its amax element is the saturated code +-448.
- k_pe: the 64 RoPE values rounded to bfloat16 (round to nearest even; the cache's values are bf16 already).
Unpack (`unpack`): float64(code) x float64(scale_g) for the NoPE part, float64(bf16) for the RoPE part: exact
(FlashMLA's dequantize_k_cache multiplies in float32 and stores bf16: exact too with power-of-two scales).

The op (`mla_sparse`, FlashMLA `flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`):
    q (b, s_q, h_q, 576), indices (b, s_q, h_kv, topk) int (or (b, s_q, topk) with h_kv = 1), flat slots
    block * page + offset, -1 padding, entries at or past topk_length[b] unused; query head h reads kv head
    h // (h_q / h_kv)'s list and rows. The golden unpacks exactly the rows the used entries name (no other row is
    read: unused rows may hold NaN bytes) and runs refimpl.mla.decode_sparse's float64 math on them:
    s_ij = scale q_i . row_j (576 dims), O_i = softmax_j(s_ij) row_j[:d_v] (d_v = 512: the dequantized NoPE
    part), LSE natural log; no causal mask; a slot listed twice counts twice; a row with no used entry
    O = 0, LSE = -inf.
The kernels are judged against this golden on the same codes: the cache's quantization error is not in the
comparison (kvquant.update-style writers answer for that), only the kernels' arithmetic.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from kernel_parity.refimpl.mla import COMPUTE, decode_sparse  # noqa: F401  (COMPUTE: the error model's switch)

F64 = NDArray[np.float64]

D_NOPE, D_ROPE, TILE = 512, 64, 128
N_TILES = D_NOPE // TILE  # 4
D = D_NOPE + D_ROPE  # 576
SCALE_OFF = D_NOPE  # 512: the scales' first byte
ROPE_OFF = D_NOPE + 4 * N_TILES  # 528: the RoPE part's first byte
ROW_BYTES = ROPE_OFF + 2 * D_ROPE  # 656
FP8_MAX = 448.0
AMAX_FLOOR = np.float32(1e-4)  # FlashMLA's clamp of amax / 448 (HFAI FP8's FP8_AMAX_MARGIN)
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16

__all__ = ["row_scales", "pack", "unpack", "unpack_parts", "mla_sparse", "ROW_BYTES", "ROPE_OFF", "SCALE_OFF"]


def _pow2_ceil(v: NDArray[np.float32]) -> NDArray[np.float32]:
    """The least power of two >= v (v > 0 float32), exactly."""
    m, e = np.frexp(v.astype(np.float64))  # v = m 2^e, m in [0.5, 1)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)


def row_scales(x: NDArray) -> NDArray[np.float32]:
    """FlashMLA's scales of rows x (..., >= 512): (..., 4) float32 powers of two (module docstring)."""
    x32 = np.asarray(x, dtype=np.float32)[..., :D_NOPE]
    amax = np.max(np.abs(x32.reshape(*x32.shape[:-1], N_TILES, TILE)), axis=-1)
    v = np.maximum((amax / np.float32(FP8_MAX)).astype(np.float32), AMAX_FLOOR)
    return _pow2_ceil(v)


def pack(x: NDArray, scales: NDArray | None = None) -> NDArray[np.uint8]:
    """656-byte rows (..., 656) uint8 of rows x (..., 576) (float; the RoPE part rounded to bf16).

    scales: (..., 4) float32 to quantize with instead of `row_scales(x)` (any positive finite values: codes are
    then clamped to +-448, the RoPE part as before)."""
    x = np.asarray(x)
    if x.shape[-1] != D:
        raise ValueError(f"pack: rows must have {D} values (512 NoPE + 64 RoPE), got shape {x.shape}")
    s = row_scales(x) if scales is None else np.asarray(scales, dtype=np.float32)
    if s.shape != x.shape[:-1] + (N_TILES,):
        raise ValueError(f"pack: scales must have shape {x.shape[:-1] + (N_TILES,)}, got {s.shape}")
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError("pack: scales must be finite and > 0")
    nope = np.asarray(x[..., :D_NOPE], dtype=np.float32).reshape(*x.shape[:-1], N_TILES, TILE)
    with np.errstate(over="ignore", under="ignore"):  # refimpl/kvquant.py's quantize (imported there from here)
        v = (nope / s[..., None]).astype(np.float32)
    codes = np.clip(v, -FP8_MAX, FP8_MAX).astype(E4M3).reshape(*x.shape[:-1], D_NOPE)
    rope = np.asarray(x[..., D_NOPE:], dtype=np.float64).astype(BF16)
    out = np.empty(x.shape[:-1] + (ROW_BYTES,), dtype=np.uint8)
    out[..., :SCALE_OFF] = codes.view(np.uint8)
    out[..., SCALE_OFF:ROPE_OFF] = np.ascontiguousarray(s.astype("<f4")).view(np.uint8)
    out[..., ROPE_OFF:] = np.ascontiguousarray(rope).view(np.uint8)
    return out


def _check_rows(rows: NDArray) -> NDArray[np.uint8]:
    rows = np.asarray(rows)
    if rows.dtype != np.uint8 or rows.ndim < 1 or rows.shape[-1] != ROW_BYTES:
        raise ValueError(f"FP8 MLA cache rows must be uint8 (..., {ROW_BYTES}), got {rows.dtype} {rows.shape}")
    return rows


def unpack_parts(rows: NDArray) -> tuple[NDArray, NDArray[np.float32], NDArray]:
    """(codes (..., 512) float8_e4m3fn, scales (..., 4) float32, k_pe (..., 64) bfloat16) of rows (..., 656)."""
    rows = np.ascontiguousarray(_check_rows(rows))
    codes = rows[..., :SCALE_OFF].view(E4M3)
    scales = np.ascontiguousarray(rows[..., SCALE_OFF:ROPE_OFF]).view("<f4").astype(np.float32)
    rope = np.ascontiguousarray(rows[..., ROPE_OFF:]).view("<u2").astype(np.uint16).view(BF16)
    return codes, scales, rope


def unpack(rows: NDArray) -> F64:
    """Rows (..., 656) uint8 -> (..., 576) float64, exact: code x scale of its 128-group, then the bf16 RoPE."""
    codes, scales, rope = unpack_parts(rows)
    out = np.empty(codes.shape[:-1] + (D,))
    c = codes.astype(np.float64).reshape(*codes.shape[:-1], N_TILES, TILE)
    out[..., :D_NOPE] = (c * scales.astype(np.float64)[..., None]).reshape(*codes.shape[:-1], D_NOPE)
    out[..., D_NOPE:] = rope.astype(np.float64)
    return out


def mla_sparse(q: NDArray, kv_cache: NDArray, indices: NDArray, topk_length: NDArray | None, scale: float,
               d_v: int = 512, *, absolute: bool | str = False) -> tuple[F64, F64]:
    """FlashMLA's sparse decode over the 656-byte FP8 rows (module docstring).

    q: (b, s_q, h_q, 576); kv_cache: (num_blocks, page, h_kv, 656) uint8 (or (num_blocks, page, 656): h_kv = 1)
    indices: (b, s_q, h_kv, topk) int (or (b, s_q, topk) with h_kv = 1): flat slots block * page + offset, -1 padding
    topk_length: (b,) int or None; scale: softmax scale; d_v: value dims (512, the NoPE part)
    returns: o (b, s_q, h_q, d_v), lse (b, h_q, s_q) natural log; a row with no used entry (0, -inf)
    absolute: refimpl.mla.decode_sparse's magnitudes (True) or compute-precision terms (COMPUTE) instead
    Only the rows the used entries name are unpacked; a used entry outside [0, num_blocks * page) raises.
    """
    cache = _check_rows(kv_cache)
    if cache.ndim == 3:
        cache = cache[:, :, None]
    if cache.ndim != 4:
        raise ValueError(f"kv_cache must be (num_blocks, page, h_kv, {ROW_BYTES}) uint8, got shape {cache.shape}")
    n_blocks, page, h_kv, _ = cache.shape
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 4 or q.shape[-1] != D:
        raise ValueError(f"q must be (b, s_q, h_q, {D}), got shape {q.shape}")
    b, s_q = q.shape[:2]
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"indices must be integers, got {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.ndim == 3 and h_kv == 1:
        idx = idx[:, :, None]
    if idx.ndim != 4 or idx.shape[:3] != (b, s_q, h_kv):
        raise ValueError(f"indices {np.shape(indices)} must be (b, s_q, h_kv, topk) = ({b}, {s_q}, {h_kv}, topk)")
    used = idx != -1
    if topk_length is not None:
        tl_ = np.asarray(topk_length)
        if tl_.dtype.kind not in "iu" or tl_.size != b:
            raise ValueError(f"topk_length must be ({b},) integers, got {tl_.dtype} {tl_.shape}")
        used &= np.arange(idx.shape[-1]) < tl_.astype(np.int64).reshape(b, 1, 1, 1)
    n_slots = n_blocks * page
    if ((idx[used] < 0) | (idx[used] >= n_slots)).any():
        raise ValueError(f"indices outside the cache's {n_slots} slots (and not -1)")
    # a compact cache of the named rows only: (n, 1, h_kv, 576), one row a page, slots renumbered 0..n-1
    names, inverse = np.unique(np.where(used, idx, 0), return_inverse=True)
    rows = unpack(cache[names // page, names % page])  # n, h_kv, 576
    compact = np.where(used, inverse.reshape(idx.shape), -1)
    return decode_sparse(q, rows[:, None], compact, None, scale, d_v=d_v, absolute=absolute)
