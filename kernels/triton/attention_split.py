"""Split-KV partitions of flash decoding beyond equal counts, their combine, and how many splits
decode takes on its own, in Triton.

    equal  (attention_decode): split s of request b covers [s C_b, min((s + 1) C_b, L_b)), C_b = ceil(L_b / n)
    block  (TensorRT-LLM's multi-block mode): [s B, (s + 1) B) cut to [0, L_b), B fixed (64, 256, the page)
    bounds (FlashMLA's scheduler): [t_b,s, t_b,s+1) cut to [0, L_b), t (b, n + 1) from the caller,
           non-decreasing from 0 to >= L_b (a request with fewer splits repeats its last boundary)

Golden: refimpl.attention.split_bounds and decode_split. n_b, the splits of request b that hold a
key, is ceil(L_b / B) or the count of non-empty intervals. A request with n_b <= 1 skips the
combine (FlashMLA's no-split path): the program of its one split (split 0 when L_b = 0) writes O,
sink included, and LSE directly, and the combine returns at once for its rows. Every stage-1
program still writes its fp32 partial (O normalised by its own sum, LSE; -inf when empty), so the
partials are complete whichever path a request takes.

Combine (stage 2, requests with n_b >= 2), per (request, query) and block of heads, in fp32:
M = max_s LSE_s, w_s = exp(LSE_s - M), LSE = M + ln sum_s w_s, O = sum_s w_s O_s / sum_s w_s, then
O *= 1 / (1 + exp(S_h - LSE)) with a sink. An empty split (LSE -inf) has w_s = 0 and its O is never
loaded (any value may be there); a row with no key gets O = 0, LSE = -inf. O is rounded once.

`_auto_splits`: how many equal splits `decode` / `decode_paged` take when a split count is not given.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .softmax import LN2, LOG2E

PARTS = {"equal": 0, "block": 1, "bounds": 2}
# Automatic splitting, only when b * h_kv programs leave SMs idle: about SPLIT_PROGRAMS_PER_SM
# programs per SM, each split keeping >= MIN_SPLIT_KEYS keys. Measured on an H200 (b=8, 2048
# tokens, h_kv=8: 64 programs), as CUDA-graph replays: 1 split 64 us, 2: 44, 4: 31, 5: 30, 8: 27
# (cuDNN SDPA 23.5 us). At b=64 (512 programs) a second split cost 15% (0.575 vs 0.494 ms).
SPLIT_PROGRAMS_PER_SM = 4
MIN_SPLIT_KEYS = 256
MAX_AUTO_SPLITS = 32


@triton.jit
def _split_range(split, L, b, block, Bounds_ptr, stride_bd_b, stride_bd_s, PART: tl.constexpr):
    """[start, end) of one split of request b (PART 1: blocks of `block` keys; 2: explicit bounds)."""
    if PART == 1:
        start = tl.minimum(split * block, L)
        end = tl.minimum(start + block, L)
    else:
        row = Bounds_ptr + b.to(tl.int64) * stride_bd_b
        start = tl.minimum(tl.load(row + split * stride_bd_s), L)
        end = tl.minimum(tl.load(row + (split + 1) * stride_bd_s), L)
    return start, end


@triton.jit
def _split_count(L, b, n_splits, block, Bounds_ptr, stride_bd_b, stride_bd_s, PART: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """n_b: the splits of request b that hold at least one key (0 when L_b = 0)."""
    if PART == 1:
        n = tl.cdiv(L, block)
    else:
        offs = tl.arange(0, BLOCK_S)
        row = Bounds_ptr + b.to(tl.int64) * stride_bd_b
        lo = tl.minimum(tl.load(row + offs * stride_bd_s, mask=offs < n_splits, other=0), L)
        hi = tl.minimum(tl.load(row + (offs + 1) * stride_bd_s, mask=offs < n_splits, other=0), L)
        n = tl.sum((hi > lo).to(tl.int32), axis=0)
    return n


@triton.jit
def _split_combine_kernel(
    OParts_ptr, LseParts_ptr, O_ptr, Lse_ptr, Sinks_ptr, Seqlens_ptr, Bounds_ptr,
    h_q, s_q, d_v, n_splits, block,
    stride_ps, stride_pb, stride_pq, stride_ph, stride_ls, stride_lb, stride_lh, stride_lq,
    stride_ob, stride_oq, stride_oh, stride_fb, stride_fh, stride_fq, stride_bd_b, stride_bd_s,
    PART: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // s_q
    i = pid % s_q
    L = tl.load(Seqlens_ptr + b)
    if _split_count(L, b, n_splits, block, Bounds_ptr, stride_bd_b, stride_bd_s, PART, BLOCK_S) <= 1:
        return  # one split (or none): stage 1 wrote O and LSE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < h_q
    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < d_v
    lse_row = LseParts_ptr + b.to(tl.int64) * stride_lb + offs_h * stride_lh + i * stride_lq
    o_row = OParts_ptr + b.to(tl.int64) * stride_pb + i * stride_pq + offs_h[:, None] * stride_ph + offs_d[None, :]
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(lse_row + s * stride_ls, mask=mask_h, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)  # never -inf - -inf
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(n_splits):
        w = tl.exp2((tl.load(lse_row + s * stride_ls, mask=mask_h, other=float("-inf")) - m_use) * LOG2E)
        live = mask_h & (w > 0.0)  # an empty split's O is never read
        o_s = tl.load(o_row + s * stride_ps, mask=live[:, None] & mask_d[None, :], other=0.0)
        acc += w[:, None] * o_s
        den += w
    lse = tl.where(den > 0.0, m_use + tl.log2(tl.where(den > 0.0, den, 1.0)) * LN2, float("-inf"))
    scale = 1.0 / tl.where(den > 0.0, den, 1.0)
    if HAS_SINK:  # exp(LSE - logaddexp(LSE, S)); a row with no key keeps O = 0
        sink = tl.load(Sinks_ptr + offs_h, mask=mask_h, other=0.0)
        scale = tl.where(den > 0.0, scale / (1.0 + tl.exp2((sink - lse) * LOG2E)), 0.0)
    o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + i * stride_oq + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc * scale[:, None]).to(O_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    tl.store(Lse_ptr + b.to(tl.int64) * stride_fb + offs_h * stride_fh + i * stride_fq, lse, mask=mask_h)


def combine_partitioned(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor,
                        sinks: torch.Tensor | None, seqlens: torch.Tensor, part: int, block: int,
                        bounds: torch.Tensor | None) -> None:
    """Stage 2 of a block or bounds partition: merges the rows of requests with >= 2 non-empty splits.

    o_parts (splits, b, s_q, h_q, d_v) fp32, lse_parts (splits, b, h_q, s_q) fp32, any strides;
    out (b, s_q, h_q, d_v), out_lse (b, h_q, s_q): the rows of one-split requests are left as stage 1
    wrote them. part: PARTS["block"] or PARTS["bounds"]; block: keys a split (part block);
    bounds: (b, splits + 1) int32 (part bounds).
    """
    splits, b, s_q, h_q, d_v = o_parts.shape
    if b == 0 or s_q == 0 or h_q == 0:
        return
    block_h = min(32, max(2, triton.next_power_of_2(h_q)))
    _split_combine_kernel[(b * s_q, triton.cdiv(h_q, block_h))](
        o_parts, lse_parts, out, out_lse, sinks if sinks is not None else lse_parts, seqlens,
        bounds if bounds is not None else seqlens, h_q, s_q, d_v, splits, block,
        *o_parts.stride()[:4], *lse_parts.stride(), *out.stride()[:3], *out_lse.stride(),
        *(bounds.stride() if bounds is not None else (0, 0)),
        PART=part, HAS_SINK=sinks is not None, BLOCK_H=block_h, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4,
    )


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_splits(q: torch.Tensor, b: int, h_kv: int, n_m: int, max_keys: int) -> int:
    """1 on CPU and whenever the unsplit grid covers every SM; else enough splits to fill them.
    max_keys is the cache capacity: seqlens stays on the device (reading it would synchronise)."""
    programs = b * h_kv * n_m
    if not q.is_cuda or programs >= _sm_count(q.device):
        return 1
    want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * _sm_count(q.device), max(programs, 1))
    return max(1, min(want, max_keys // MIN_SPLIT_KEYS, MAX_AUTO_SPLITS))


def check_partition(block, bounds, splits: int, b: int, device) -> int:
    """The partition code (attention_split.PARTS) of decode_split's block / bounds arguments."""
    if block is not None and bounds is not None:
        raise ValueError("give block (fixed-size splits) or bounds (explicit boundaries), not both")
    if block is not None:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block < 2**31:
            raise ValueError(f"block={block!r} must be an int in [1, 2**31)")
        return PARTS["block"]
    if bounds is not None:
        if not isinstance(bounds, torch.Tensor) or tuple(bounds.shape) != (b, splits + 1) \
                or bounds.dtype != torch.int32 or bounds.device != device:
            raise ValueError(f"bounds must be a ({b}, num_splits + 1 = {splits + 1}) int32 tensor on {device}, got "
                             f"{tuple(getattr(bounds, 'shape', ()))} {getattr(bounds, 'dtype', type(bounds).__name__)}")
        return PARTS["bounds"]
    return PARTS["equal"]
