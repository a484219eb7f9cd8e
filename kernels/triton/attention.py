"""Prefill attention, dense batched and packed variable-length, FlashAttention-2 style, in Triton.

    s_ij  = scale * q_i . k_j                   scale default 1/sqrt(d)
    s_ij  = cap * tanh(s_ij / cap)              optional logit softcap, before the mask
    s_ij  = -inf where masked                   causal / window / past the sequence's length
    LSE_i = ln sum_j exp(s_ij)                  natural log, -inf for a fully masked row
    O_i   = sum_j exp(s_ij - LSE'_i) v_j        LSE' = ln(exp(LSE) + exp(S_h)) with a sink, else LSE

Conventions (OPS.md, attention; goldens in refimpl/attention.py): causal alignment bottom_right
(keep j <= i + L_k - L_q) or top_left (j <= i), per sequence; window (left, right) inclusive on
the same diagonal, -1 unbounded, causal forces right = 0; query head h reads kv head
h // (h_q // h_kv); the sink (per query head, scaled domain) enters the denominator only and the
returned LSE excludes it; a fully masked row gives O = 0, LSE = -inf; keys at or past a
sequence's length are never loaded.

Algorithm: one program per (BLOCK_M queries, query head, sequence) streams the key tiles with an
online softmax (running max m, running sum l, accumulator rescaled by exp(m_old - m_new)); both
dots accumulate in fp32 on the tensor cores (fp32 inputs use input_precision="ieee": tf32 would
cost ~1e-3 relative error). Logits are kept in the log2 domain (scale * log2(e) folded into one
multiply) so every exponential is the GPU's native ex2. A program's key range [lo, hi) is cut
to the tiles its rows can see, so fully masked tiles (above the causal diagonal, outside the
window) are never loaded: the 2x of causal prefill. Only the tiles that straddle a mask edge or
the sequence end run the masked loop body; the interior runs without any mask arithmetic.

References: Dao, "FlashAttention-2" (2023); the Triton fused-attention tutorial; flash-attn's
`construct_local_mask` for the window convention.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .softmax import LN2, LOG2E

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CAUSAL = ("none", "bottom_right", "top_left")
# (BLOCK_M, BLOCK_N, num_warps, num_stages) by (padded head dim, element size). 16-bit rows were
# measured on an H200 with Triton 3.6 (benchmarks/gpu_attention.py, causal, h_q=32, h_kv=8):
# - d=128, b=16, s=4096: (128, 128, 8, 3) 438 TFLOP/s; (128, 64, 8, 3) 425; (128, 64, 8, 4) 422;
#   (64, 64, 4, 3) 419; (128, 128, 8, 2) 401-403; (64, 128, 4, 3) 351. BLOCK_M = 128 over 8 warps
#   gives each of two warpgroups a 64-row wgmma; three stages of 128-key K/V tiles (192 KB with
#   Q) is the most that fits shared memory. tl.range(warp_specialize=True) measured the same.
# - d=64, b=4, s=1024: (128, 64, 8, 3) 227; (128, 64, 4, 3) 219; (64, 64, 4, 3) 218; BLOCK_N=128 185.
# - d=256, b=4, s=1024: (128, 64, 8, 2) 296; (64, 64, 4, 3) 246; (128, 64, 8, 1) 246; (128, 32, 8, 2) 231.
# d <= 32 rows are unmeasured guesses. fp32 runs its dots on the FMA units (ieee), so smaller
# tiles keep registers in bounds.
PREFILL_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (16, 2): (128, 64, 4, 3), (32, 2): (128, 64, 4, 3), (64, 2): (128, 64, 8, 3),
    (128, 2): (128, 128, 8, 3), (256, 2): (128, 64, 8, 2),
    (16, 4): (64, 32, 4, 2), (32, 4): (64, 32, 4, 2), (64, 4): (64, 32, 4, 2),
    (128, 4): (64, 32, 4, 2), (256, 4): (32, 32, 4, 2),
}
MAX_HEAD_DIM = 256


@triton.jit
def _tanh(x):
    """tanh in fp32 to ~1 ulp: Cephes' odd polynomial near 0 (where 1 - 2 / (e^2x + 1) cancels),
    the exponential form elsewhere (it saturates to +-1 without overflow trouble)."""
    ax = tl.abs(x)
    z = x * x
    poly = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
             + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x
    big = 1.0 - 2.0 / (tl.exp2(ax * (2.0 * LOG2E)) + 1.0)
    return tl.where(ax < 0.625, poly, tl.where(x < 0.0, -big, big))


@triton.jit
def _window_tiles(m0, i_last, diag_off, L_k, left, right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key range of query rows m0..i_last, row i keeping i + diag_off - left <= j <= i + diag_off + right,
    j < L_k: [lo, hi) holds every kept key (lo on a tile edge); [full_lo, full_hi) the whole tiles
    every row keeps entirely (no mask needed), full_lo <= full_hi."""
    lo = 0
    hi = L_k
    full_lo = 0
    full_hi = (L_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag_off - left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(lo, tl.cdiv(tl.maximum(i_last + diag_off - left, 0), BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, i_last + diag_off + right + 1)
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + diag_off + right + 1, 0) // BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, hi, full_lo, full_hi


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, K_base, V_base, start, end, diag, offs_n, offs_d, offs_dv,
    L_k, left, right, d, d_v, stride_kn, stride_vn, qk_scale, softcap_out,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update over key tiles [start, end) (start a multiple of BLOCK_N).

    MASK=False: every key of every tile is valid for every row (interior tiles), so no mask is
    built and no row can be all -inf; MASK=True: edge tiles, masked loads and logits."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        # 64-bit tile base, 32-bit offsets inside the tile.
        k_ptrs = K_base + tl.cast(start_n, tl.int64) * stride_kn + offs_n[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = V_base + tl.cast(start_n, tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :]
        if MASK:
            # Keys past L_k may hold NaN: masked loads never read them (0 * NaN would survive p = 0).
            kmask = (cols < L_k)[None, :]
            vmask = (cols < L_k)[:, None]
            if not EVEN_D:
                kmask = kmask & (offs_d < d)[:, None]
                vmask = vmask & (offs_dv < d_v)[None, :]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(offs_d < d)[:, None], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # fp32 accumulation
        if SOFTCAP:
            qk = _tanh(qk * qk_scale) * softcap_out  # qk_scale = scale / cap, softcap_out = cap * log2 e
        if MASK:
            if not SOFTCAP:
                qk = qk * qk_scale  # scale * log2 e: log2-domain logits
            keep = (cols < L_k)[None, :]
            if HAS_LEFT:
                keep = keep & (cols[None, :] >= diag[:, None] - left)
            if HAS_RIGHT:
                keep = keep & (cols[None, :] <= diag[:, None] + right)
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            # Rows with nothing seen yet keep m = -inf; a finite stand-in makes exp2 give 0
            # instead of evaluating -inf - -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_use[:, None])
        elif SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = m_new
            p = tl.exp2(qk - m_use[:, None])
        else:
            # Interior tiles: no mask. The logits are rounded to the log2 domain before the max is
            # subtracted, as on the edge tiles (the launch turns FMA contraction off): one FMA
            # qk * scale - m rounds the product only after the subtraction, so the row's largest
            # logit gets exp2(the product's rounding residual) instead of 1, a weight off by u |s|
            # from the same logit on an edge tile: at logits near 1e12 (FlashMLA's case) exp2 of
            # +-4096, an infinite or empty row; at -1e3, weights 4e-5 apart (seed-audit S21).
            qk = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = m_new
            p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # fp32 running sum
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_dv < d_v)[None, :], other=0.0)
        # P is rounded to V's dtype for the tensor cores (as FlashAttention does); acc stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_prefill_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, Lse_ptr, Sinks_ptr, CuQ_ptr, CuK_ptr,
    s_q, s_k, n_m_blocks, group, d, d_v, qk_scale, softcap_out, left, right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr, VARLEN: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Query blocks vary fastest, then heads: the programs resident together share one kv head
    # (GQA group) of one sequence, so its K/V tiles are served from L2. The heaviest (last, for
    # causal) query blocks go first so that the tail of the grid is the cheap blocks.
    pid = tl.program_id(0)
    pid_m = n_m_blocks - 1 - pid % n_m_blocks
    head = pid // n_m_blocks
    b = tl.program_id(1)
    kv_head = head // group
    if VARLEN:
        q0 = tl.load(CuQ_ptr + b)
        k0 = tl.load(CuK_ptr + b)
        L_q = tl.load(CuQ_ptr + b + 1) - q0
        L_k = tl.load(CuK_ptr + b + 1) - k0
    else:
        q0 = 0
        k0 = 0
        L_q = s_q
        L_k = s_k
    m0 = pid_m * BLOCK_M
    if m0 >= L_q:
        return
    q_off = b.to(tl.int64) * stride_qb + q0.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
    K_base = K_ptr + b.to(tl.int64) * stride_kb + k0.to(tl.int64) * stride_ks + kv_head.to(tl.int64) * stride_kh
    V_base = V_ptr + b.to(tl.int64) * stride_vb + k0.to(tl.int64) * stride_vs + kv_head.to(tl.int64) * stride_vh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < L_q
    q = tl.load(Q_ptr + q_off + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d < d)[None, :], other=0.0)

    # Row i keeps keys diag_i - left <= j <= diag_i + right, j < L_k.
    diag_off = 0 if TOP_LEFT else L_k - L_q
    diag = offs_m + diag_off
    lo, hi, full_lo, full_hi = _window_tiles(m0, tl.minimum(m0 + BLOCK_M, L_q) - 1, diag_off, L_k, left, right,
                                             HAS_LEFT, HAS_RIGHT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fp32 accumulator of sum_j p_ij v_j
    # Edge tiles below the window's interior, interior tiles (no mask), edge tiles above it.
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, K_base, V_base, lo, tl.minimum(full_lo, hi), diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
        True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, K_base, V_base, full_lo, full_hi, diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
        False, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, K_base, V_base, full_hi, hi, diag, offs_n, offs_d, offs_dv,
        L_k, left, right, d, d_v, stride_ks, stride_vs, qk_scale, softcap_out,
        True, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, BLOCK_N, DOT_PRECISION)

    # A row that saw no key has l = 0 and acc = 0: the clamped denominator writes O = 0.
    den = l_i
    if HAS_SINK:
        sink2 = tl.load(Sinks_ptr + head).to(tl.float32) * LOG2E
        den = l_i + tl.exp2(sink2 - tl.where(m_i == float("-inf"), 0.0, m_i))
    inv = 1.0 / tl.where(den > 0.0, den, 1.0)
    o = acc * inv[:, None]
    o_off = b.to(tl.int64) * stride_ob + q0.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh
    tl.store(O_ptr + o_off + offs_m[:, None] * stride_os + offs_dv[None, :], o.to(O_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_dv < d_v)[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    l_off = b.to(tl.int64) * stride_lb + q0.to(tl.int64) * stride_ls + head.to(tl.int64) * stride_lh
    tl.store(Lse_ptr + l_off + offs_m * stride_ls, lse, mask=mask_m)


def _check_common(q, k, v, causal, window, softcap, sinks, h_axis: int, scale=None,
                  max_head_dim: int = MAX_HEAD_DIM) -> tuple[int, int]:
    """Shared argument checks; returns the normalised (left, right) window."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
        if t.shape[-1] > 1 and t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1, got strides {tuple(t.stride())}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ before the head dim")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}")
    if not 1 <= q.shape[-1] <= max_head_dim or not 1 <= v.shape[-1] <= max_head_dim:
        raise ValueError(f"head dims d={q.shape[-1]}, d_v={v.shape[-1]} must be in [1, {max_head_dim}]")
    h_q, h_kv = q.shape[h_axis], k.shape[h_axis]
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {CAUSAL}, got {causal!r}")
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window {tuple(window)}: each bound must be >= 0 or -1 (unbounded)")
    if scale is not None and not (float(scale) > 0.0 and math.isfinite(float(scale))):
        raise ValueError(f"scale={scale} must be finite and > 0")
    if not softcap >= 0.0 or math.isinf(softcap):
        raise ValueError(f"softcap={softcap} must be finite and >= 0 (0 disables it)")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (h_q,)
                              or sinks.dtype != torch.float32 or sinks.device != q.device):
        raise ValueError(f"sinks must be a ({h_q},) float32 tensor on {q.device}, got "
                         f"{tuple(getattr(sinks, 'shape', ()))} {getattr(sinks, 'dtype', type(sinks).__name__)}")
    return left, (0 if causal != "none" else right)


def _check_out(out, shape, dtype, device, name: str, unit_last: bool = False) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if unit_last and shape[-1] > 1 and out.numel() > 0 and out.stride(-1) != 1:
        raise ValueError(f"{name} must have last-dim stride 1, got strides {tuple(out.stride())}")


def _launch(q, k, v, o, lse, sinks, cu_q, cu_k, b, s_q, s_k, max_q, strides, *, scale, causal, left, right,
            softcap, config):
    h_q, d = q.shape[-2], q.shape[-1]
    group = h_q // k.shape[-2]
    d_v = v.shape[-1]
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    block_m, block_n, num_warps, num_stages = config or PREFILL_CONFIGS[(max(block_d, block_dv), min(q.element_size(), 4))]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    n_m = triton.cdiv(max_q, block_m)
    if n_m * h_q >= 2**31 or b > 65535:
        raise ValueError(f"grid ({n_m} query blocks x {h_q} heads, {b} sequences) exceeds CUDA's limits")
    _attention_prefill_kernel[(n_m * h_q, b)](
        q, k, v, o, lse, sinks if sinks is not None else lse, cu_q, cu_k,
        s_q, s_k, n_m, group, d, d_v,
        scale / softcap if softcap else scale * 1.4426950408889634, softcap * 1.4426950408889634,
        left, right, *strides,
        TOP_LEFT=causal == "top_left", HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0,
        HAS_SINK=sinks is not None, VARLEN=cu_q is not None, EVEN_D=block_d == d and block_dv == d_v,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,  # the interior tiles' logits rounded before the max is subtracted (no FMA)
    )


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, causal: str = "none",
            window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
            out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
            config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense batched attention.

    q: (b, s_q, h_q, d); k: (b, s_k, h_kv, d); v: (b, s_k, h_kv, d_v) — one dtype of fp32/fp16/bf16,
       last-dim stride 1, other strides arbitrary; h_q % h_kv == 0
    causal: "none" | "bottom_right" | "top_left"; window: (left, right), -1 unbounded
    softcap: cap > 0 enables cap * tanh(s / cap); sinks: (h_q,) float32 sink logits or None
    out: (b, s_q, h_q, d_v) q's dtype, last-dim stride 1; out_lse: (b, h_q, s_q) float32; any strides
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages), for tuning only (default PREFILL_CONFIGS)
    returns: (out, out_lse); LSE natural log, excluding the sink
    """
    left, right = _check_common(q, k, v, causal, window, softcap, sinks, h_axis=2, scale=scale)
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q (b, s_q, h_q, d), k/v (b, s_k, h_kv, d), got {tuple(q.shape)}, {tuple(k.shape)}")
    b, s_q, h_q, _ = q.shape
    s_k, d_v = k.shape[1], v.shape[-1]
    if out is None:
        out = torch.empty((b, s_q, h_q, d_v), dtype=q.dtype, device=q.device)
    _check_out(out, (b, s_q, h_q, d_v), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (b, h_q, s_q), torch.float32, q.device, "out_lse")
    if b == 0 or s_q == 0 or h_q == 0:
        return out, out_lse
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *out_lse.stride())
    _launch(q, k, v, out, out_lse, sinks, None, None, b, s_q, s_k, s_q, strides, scale=scale, causal=causal,
            left=left, right=right, softcap=float(softcap), config=config)
    return out, out_lse


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float | None = None,
           causal: str = "none", window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
           out_lse: torch.Tensor | None = None,
           config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention (FlashAttention's varlen layout); masks per sequence.

    q: (total_q, h_q, d); k: (total_k, h_kv, d); v: (total_k, h_kv, d_v) — as `prefill`
    cu_seqlens_q, cu_seqlens_k: (b + 1,) int32 on q's device, from 0; sequence i is rows cu[i]:cu[i+1]
    max_seqlen_q: host int >= every query length (sizes the grid); max_seqlen_k: unused bound, kept
                  for FlashAttention's signature
    out: (total_q, h_q, d_v) q's dtype, last-dim stride 1; out_lse: (h_q, total_q) float32
    returns: (out, out_lse); zero-length sequences write nothing
    """
    left, right = _check_common(q, k, v, causal, window, softcap, sinks, h_axis=1, scale=scale)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"expected q (total_q, h_q, d), k/v (total_k, h_kv, d), got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         f"must both be (b + 1,)")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} must be >= 0")
    total_q, h_q, _ = q.shape
    d_v = v.shape[-1]
    b = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty((total_q, h_q, d_v), dtype=q.dtype, device=q.device)
    _check_out(out, (total_q, h_q, d_v), q.dtype, q.device, "out", True)
    if out_lse is None:
        out_lse = torch.empty((h_q, total_q), dtype=torch.float32, device=q.device)
    _check_out(out_lse, (h_q, total_q), torch.float32, q.device, "out_lse")
    if b == 0 or max_seqlen_q == 0 or total_q == 0:
        return out, out_lse
    # Batch strides are 0: each sequence's rows start at its cu_seqlens offset.
    strides = (0, *q.stride()[:2], 0, *k.stride()[:2], 0, *v.stride()[:2], 0, *out.stride()[:2],
               0, out_lse.stride(0), out_lse.stride(1))
    _launch(q, k, v, out, out_lse, sinks, cu_seqlens_q, cu_seqlens_k, b, 0, 0, int(max_seqlen_q), strides,
            scale=scale, causal=causal, left=left, right=right, softcap=float(softcap), config=config)
    return out, out_lse
