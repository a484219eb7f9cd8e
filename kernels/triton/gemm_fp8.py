"""FP8 e4m3 block-scaled GEMM (DeepSeek-V3 recipe), in Triton: C = A @ W^T (+ bias).

Activations are quantized per (gm x gk) group (DeepSeek's `act_quant`, research/quant-formats.md §3.3):

    amax = max(max |x| over the group, 1e-4)      s = amax / 448 (fp32)
    qa   = e4m3(x / s)                            (IEEE division, round to nearest even)

then, with weights W e4m3 (N, K) and fp32 scales sw (ceil(N / gn), ceil(K / gk)):

    C[m, n] = sum_kb dot(qa[m, kb], qw[n, kb]) * sa[m // gm, kb] * sw[n // gn, kb]     (fp32)

Each K block's tensor-core dot starts from zero and is promoted into the fp32 accumulator with
its scale product (DeepSeek's fp8_gemm_kernel, DeepGEMM's per-128-channel promotion), so the
reduced-precision accumulation of Hopper's fp8 wgmma never spans more than one scale group. With
a single K group (gk >= K: per-token x per-channel, per-tensor) the dots accumulate in place and
the scales are applied once at the end. |x / s| <= 448 by construction, so the cast never
saturates (Triton emits cvt.rn.satfinite on the GPU). The division is tl.math.div_rn: Triton's
`/` on fp32 is the approximate div.full.f32 on the GPU.

On the GPU the fp8 tiles are bulk tensor copies (TMA descriptors, zero-filled past the edges; 1.5x
the cp.async version), and a tile inside one 128 x 128 weight-scale block promotes with one scale
product per row (SW_TILE: one FFMA per accumulator element instead of an FMUL and an FFMA). Measured
at 8192^3 on an H100: 764-776 TFLOP/s, 0.59-0.65x torch._scaled_mm blockwise (1178-1298 across runs),
0.66x F.scaled_mm; the unpromoted modes (one K group) 1252, 0.96x torch's per-tensor _scaled_mm.
What is left is the promotion: each K block waits for its wgmma before the FFMAs, with one CTA an SM
(152 registers); cuBLAS overlaps the two with warp specialization.

Golden: refimpl.gemm's emulated reference (the same quantized operands, exact block dots);
refimpl.gemm's dequant reference measures the quantization error itself.

Triton interpreter: tl.dot on e4m3 operands is exact; its fp32 -> e4m3 cast is not (Triton 3.9:
no rounding carry into the exponent, ties away from zero, -0 lost), which the harness fixes in
the interpreter (conformance/backends/triton_interpreter.py), not here.

References: deepseek-ai/DeepSeek-V3 inference/kernel.py (act_quant, fp8_gemm); deepseek-ai/DeepGEMM.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .tiles import grouped_tile_offsets, tma_operands

FP8_MAX = 448.0
AMAX_MIN = 1e-4
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, TMA]); BLOCK_K is lowered to divide gk.
# Measured on an H100 at 8192^3, 1 x 128 x 128 (benchmarks/NOTES-gemm.md): this one with bulk tensor
# copies 772-776 TFLOP/s (0.61x torch._scaled_mm blockwise, 0.66x F.scaled_mm), without them 517;
# (64, 128, 128, 8, 4, 4) 732; BLOCK_N = 256 spills (517); promoting one K block after issuing the
# next block's dot (skewed) 736.
GEMM_CONFIG = (128, 128, 128, 8, 8, 4, 1)
QUANT_ROWS = 8  # rows per program of the per-token (gm = 1) activation quantizer
# K groups a one-pass program quantizes (a rows x groups x 128 tile). H200, one run (benchmarks/gpu_gluon.py bench,
# same bits at every setting): at M = K = 8192 4 x 8 / 2 x 16 took 60 us vs 70 for 8 x 1; at the DeepSeek-V3
# shapes no setting won twice and the spread between neighbours' timings (11 to 50 us at 4096 x 1536) exceeds
# the effect: 1 stays until a quieter measurement says otherwise.
QUANT_GROUPS = 1


@triton.jit
def _scale_of(amax, scale_ub, UE8M0: tl.constexpr):
    """s = max(amax, 1e-4) [min scale_ub] / 448, IEEE-divided; UE8M0: s rounded up to a power of
    two exactly (the exponent bumped when any mantissa bit is set; s >= 1e-4 / 448 is normal)."""
    amax = tl.maximum(amax, 1e-4)
    if scale_ub > 0:
        amax = tl.minimum(amax, scale_ub)
    s = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        bits = s.to(tl.int32, bitcast=True)
        up = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23
        s = up.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _to_e4m3(x, s):
    """x / s saturated to +-448 (an upper bound on amax can leave |x / s| above it)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)


@triton.jit
def _fp8_act_quant_kernel(
    X_ptr, Q_ptr, S_ptr, M, K, gm, gk, scale_ub,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    ONE_PASS: tl.constexpr, UE8M0: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUPS: tl.constexpr = 1,
):
    """ONE_PASS (gm = 1, gk <= BLOCK_K): BLOCK_M rows of one K group, each row its own group.
    Otherwise one program per (gm x gk) group, looping over it twice (amax, then quantize)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_k0 = pid_k * gk + tl.arange(0, BLOCK_K)
    k_end = tl.minimum(pid_k * gk + gk, K)
    if ONE_PASS and GROUPS > 1:  # BLOCK_M rows of GROUPS K groups: a (rows, groups, gk) tile
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_g = pid_k * GROUPS + tl.arange(0, GROUPS)
        offs_c = tl.arange(0, BLOCK_K)
        offs_k = offs_g[:, None] * gk + offs_c[None, :]
        kmask = (offs_c[None, :] < gk) & (offs_k < K)
        mask = (offs_m < M)[:, None, None] & kmask[None, :, :]
        rows = offs_m[:, None, None].to(tl.int64)
        x = tl.load(X_ptr + rows * stride_xm + offs_k[None, :, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(tl.max(tl.abs(x), axis=2), scale_ub, UE8M0)
        y = _to_e4m3(x, s[:, :, None])
        tl.store(Q_ptr + rows * stride_qm + offs_k[None, :, :] * stride_qk, y.to(Q_ptr.dtype.element_ty), mask=mask)
        tl.store(S_ptr + offs_m[:, None] * stride_sm + offs_g[None, :] * stride_sk, s,
                 mask=(offs_m < M)[:, None] & (offs_g * gk < K)[None, :])
    elif ONE_PASS:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (offs_m < M)[:, None] & (offs_k0 < k_end)[None, :]
        x = tl.load(X_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k0[None, :] * stride_xk,
                    mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(tl.max(tl.abs(x), axis=1), scale_ub, UE8M0)
        y = _to_e4m3(x, s[:, None])
        tl.store(Q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k0[None, :] * stride_qk,
                 y.to(Q_ptr.dtype.element_ty), mask=mask)
        tl.store(S_ptr + offs_m * stride_sm + pid_k * stride_sk, s, mask=offs_m < M)
    else:
        m_lo = pid_m * gm
        m_end = tl.minimum(m_lo + gm, M)
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for m0 in range(m_lo, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            for k0 in range(pid_k * gk, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = (offs_m < m_end)[:, None] & (offs_k < k_end)[None, :]
                x = tl.load(X_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                            mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
        s = _scale_of(tl.max(tl.max(amax, axis=1), axis=0), scale_ub, UE8M0)
        for m0 in range(m_lo, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            for k0 in range(pid_k * gk, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = (offs_m < m_end)[:, None] & (offs_k < k_end)[None, :]
                x = tl.load(X_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                            mask=mask, other=0.0).to(tl.float32)
                y = _to_e4m3(x, s)
                tl.store(Q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :] * stride_qk,
                         y.to(Q_ptr.dtype.element_ty), mask=mask)
        tl.store(S_ptr + pid_m * stride_sm + pid_k * stride_sk, s)


@triton.jit
def _fp8_tiles(QA_ptr, W_ptr, a_ptrs, w_ptrs, mask_m, mask_n, offs_k, pid_m, pid_n, k0, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of qa and (BLOCK_N, BLOCK_K) tile of w at column k0."""
    if TMA:  # QA_ptr, W_ptr are tensor descriptors: bulk tensor copies, zero-filled past the edges
        qa = QA_ptr.load([pid_m * BLOCK_M, k0])
        qw = W_ptr.load([pid_n * BLOCK_N, k0])
    else:
        mask_k = (k0 + offs_k) < K
        qa = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        qw = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    return qa, qw


@triton.jit
def _fp8_scale(sa_ptrs, sw_ptrs, sw_tile, mask_m, mask_n, k0, gk, stride_sak, stride_swk, SW_TILE: tl.constexpr):
    """sa * sw of the scale group holding column k0, as (BLOCK_M, 1) (SW_TILE: one weight scale for
    the tile, one FFMA per accumulator element) or (BLOCK_M, BLOCK_N)."""
    kb = k0 // gk
    sa = tl.load(sa_ptrs + kb * stride_sak, mask=mask_m, other=0.0)
    if SW_TILE:
        return (sa * tl.load(sw_tile + kb * stride_swk))[:, None]
    else:
        return sa[:, None] * tl.load(sw_ptrs + kb * stride_swk, mask=mask_n, other=0.0)[None, :]


@triton.jit
def _gemm_fp8_kernel(
    QA_ptr, SA_ptr, W_ptr, SW_ptr, Bias_ptr, C_ptr, M, N, K, gm, gn, gk,
    stride_am, stride_ak, stride_sam, stride_sak, stride_wn, stride_wk, stride_swn, stride_swk,
    stride_cm, stride_cn,
    PROMOTE_EACH: tl.constexpr, SW_TILE: tl.constexpr, TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GROUP_M row tiles share a W column tile in L2
    pid_m, pid_n, offs_m, offs_n, mask_m, mask_n = grouped_tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = 0  # unused under TMA
    w_ptrs = 0
    if not TMA:
        a_ptrs = QA_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = W_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    sa_ptrs = SA_ptr + (offs_m // gm) * stride_sam
    sw_ptrs = SW_ptr + (offs_n // gn) * stride_swn
    sw_tile = SW_ptr + (pid_n * BLOCK_N // gn) * stride_swn  # SW_TILE: the tile lies in one weight-scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        qa, qw = _fp8_tiles(QA_ptr, W_ptr, a_ptrs, w_ptrs, mask_m, mask_n, offs_k, pid_m, pid_n, k0, K,
                            BLOCK_M, BLOCK_N, TMA)
        if PROMOTE_EACH:  # fp8 tensor-core dot of one scale group, promoted to fp32 with its scales
            acc += tl.dot(qa, tl.trans(qw)) * _fp8_scale(sa_ptrs, sw_ptrs, sw_tile, mask_m, mask_n, k0, gk,
                                                         stride_sak, stride_swk, SW_TILE)
        else:  # one K group: accumulate in place (fp32), scale at the end
            acc = tl.dot(qa, tl.trans(qw), acc)
        if not TMA:
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    if not PROMOTE_EACH:
        sa = tl.load(sa_ptrs, mask=mask_m, other=0.0)
        sw = tl.load(sw_ptrs, mask=mask_n, other=0.0)
        acc = acc * (sa[:, None] * sw[None, :])
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def act_quant_fp8(a: torch.Tensor, gm: int = 1, gk: int = 128, *, scale_ub: float | None = None,
                  scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(gm x gk)-group e4m3 quantization of activations (DeepSeek act_quant, with the amax clamp).

    a: (M, K) bf16/fp16/fp32, any strides; gm, gk >= 1 (gm >= M, gk >= K: per-tensor)
    scale_ub: an upper bound on amax (MAX's dynamic scales: 1200), then a saturating cast
    scale_fmt: "fp32", or "ue8m0" (scales rounded up to powers of two, DeepSeek-V3.1)
    returns (q, s): q (M, K) float8_e4m3fn; s (ceil(M / gm), ceil(K / gk)) fp32 stored
    column-major (strides (1, ceil(M / gm))), the "outer-dim-major" layout torch._scaled_mm wants
    for 1 x 128 blockwise scales, and coalesced for the GEMM's per-row scale loads.
    """
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"act_quant_fp8: a must be a 2-D bf16/fp16/fp32 tensor, got "
                         f"{getattr(a, 'dtype', type(a))} {tuple(getattr(a, 'shape', ()))}")
    if int(gm) < 1 or int(gk) < 1:
        raise ValueError(f"act_quant_fp8: group sizes gm={gm}, gk={gk} must be >= 1")
    if scale_fmt not in ("fp32", "ue8m0"):
        raise ValueError(f"act_quant_fp8: scale_fmt must be 'fp32' or 'ue8m0', got {scale_fmt!r}")
    if scale_ub is not None and not scale_ub > 0:
        raise ValueError(f"act_quant_fp8: scale_ub must be positive or None, got {scale_ub}")
    M, K = a.shape
    gm, gk = min(int(gm), max(M, 1)), min(int(gk), max(K, 1))
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=a.device)
    nm, nk = triton.cdiv(M, gm), triton.cdiv(K, gk)
    s = torch.empty((nk, nm), dtype=torch.float32, device=a.device).t()
    if M == 0 or K == 0:
        return q, s
    one_pass = gm == 1 and gk <= 1024
    block_k = triton.next_power_of_2(gk) if one_pass else min(256, triton.next_power_of_2(gk))
    block_m = QUANT_ROWS if one_pass else min(16, triton.next_power_of_2(gm))
    groups = QUANT_GROUPS if one_pass else 1
    grid = (triton.cdiv(M, block_m) if one_pass else nm, triton.cdiv(nk, groups))
    _fp8_act_quant_kernel[grid](
        a, q, s, M, K, gm, gk, float(scale_ub or 0.0), *a.stride(), *q.stride(), *s.stride(),
        ONE_PASS=one_pass, UE8M0=scale_fmt == "ue8m0", BLOCK_M=block_m,
        BLOCK_K=block_k, GROUPS=groups, num_warps=4,
    )
    return q, s


def check_scales_bias_out(what: str, qa: torch.Tensor, sa: torch.Tensor, sa_shape: tuple[int, int],
                          w_scale: torch.Tensor, sw_shape: tuple[int, int], n: int, bias: torch.Tensor | None,
                          out: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The checks a quantized-operand FP8 GEMM wrapper makes of its scales, bias and out (this kernel's and
    kernels/gluon/gemm_fp8.py's): fp32 scales of the given shapes, a (n,) float bias, an (M, n) out_dtype out
    (allocated when None), all on qa's device; returns out."""
    m = qa.shape[0]
    for name, t, shape in (("sa", sa, sa_shape), ("w_scale", w_scale, sw_shape)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32 \
                or t.device != qa.device:
            raise ValueError(f"{what}: {name} must be a {shape} float32 tensor on {qa.device}, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)
                             or not bias.dtype.is_floating_point or bias.device != qa.device):
        raise ValueError(f"{what}: bias must be a ({n},) float tensor on {qa.device}")
    if out is None:
        return torch.empty((m, n), dtype=out_dtype, device=qa.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != out_dtype \
            or out.device != qa.device:
        raise ValueError(f"{what}: out must be a ({m}, {n}) {out_dtype} tensor on {qa.device}")
    return out


def gemm_fp8_scaled(qa: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
                    gm: int = 1, gn: int = 128, gk: int = 128, out_dtype: torch.dtype = torch.bfloat16,
                    config: tuple[int, ...] | None = None) -> torch.Tensor:
    """C = sum_kb dot(qa, w)[kb] * sa * w_scale (+ bias) on already-quantized operands.

    qa: (M, K) float8_e4m3fn; sa: (ceil(M / gm), ceil(K / gk)) fp32, any strides
    w: (N, K) float8_e4m3fn; w_scale: (ceil(N / gn), ceil(K / gk)) fp32, any strides
    gk: a multiple of 16 unless gk >= K (one K group); bias: (N,) float; out: (M, N) out_dtype
    config: tuning only (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    """
    for name, t in (("qa", qa), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"gemm_fp8: {name} must be a 2-D float8_e4m3fn tensor, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    M, K = qa.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"gemm_fp8: a has K={K}, w {tuple(w.shape)}")
    if min(int(gm), int(gn), int(gk)) < 1:
        raise ValueError(f"gemm_fp8: group sizes gm={gm}, gn={gn}, gk={gk} must be >= 1")
    gm, gn, gk = min(int(gm), max(M, 1)), min(int(gn), max(N, 1)), min(int(gk), max(K, 1))
    one_group = gk >= K
    if not one_group and gk % 16:
        raise ValueError(f"gemm_fp8: gk={gk} must be a multiple of 16 (or >= K={K})")
    if w.device != qa.device:
        raise ValueError(f"gemm_fp8: w is on {w.device}, a on {qa.device}")
    out = check_scales_bias_out("gemm_fp8", qa, sa, (triton.cdiv(M, gm), triton.cdiv(K, gk)), w_scale,
                                (triton.cdiv(N, gn), triton.cdiv(K, gk)), N, bias, out, out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:  # an empty sum: the scales (no columns) are never read
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros((), device=out.device))
    block_m, block_n, block_k, group_m, num_warps, num_stages, *opt = config or GEMM_CONFIG
    if not one_group:
        while gk % block_k:  # each K tile inside one scale group
            block_k //= 2
    # Bulk tensor copies (TMA) on the GPU where the operands allow them: 16-byte aligned rows, unit
    # last stride (the Triton interpreter runs the pointer path: it has no fp8 descriptor loads)
    a_arg, w_arg, use_tma = tma_operands(qa, w, block_m, block_n, block_k, bool(opt[0]) if opt else True)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _gemm_fp8_kernel[grid](
        a_arg, sa, w_arg, w_scale, bias if bias is not None else sa, out, M, N, K, gm, gn, gk,
        *qa.stride(), *sa.stride(), *w.stride(), *w_scale.stride(), *out.stride(),
        PROMOTE_EACH=not one_group, SW_TILE=gn % block_n == 0, TMA=use_tma, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def gemm_fp8(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, gm: int = 1, gn: int = 128, gk: int = 128, *,
             config: tuple[int, ...] | None = None) -> torch.Tensor:
    """C = A @ W^T (+ bias) with A quantized to e4m3 per (gm x gk) group, W e4m3 per (gn x gk) block.

    a: (M, K) bf16 (or fp16/fp32), any strides
    w: (N, K) float8_e4m3fn; w_scale: (ceil(N / gn), ceil(K / gk)) fp32 (DeepSeek's weight_scale_inv)
    gm, gn, gk: 1 x 128 x 128 is DeepSeek-V3; gn = 1, gk >= K per-token x per-channel; gm >= M,
                gn >= N, gk >= K per-tensor. gk a multiple of 16 unless gk >= K.
    bias: (N,) float, added in fp32; out: (M, N) a's dtype
    returns out: fp32 accumulation of per-K-group fp8 dots promoted with sa * sw, one rounding to a's dtype
    """
    qa, sa = act_quant_fp8(a, gm, gk)
    return gemm_fp8_scaled(qa, sa, w, w_scale, bias, out, gm=gm, gn=gn, gk=gk, out_dtype=a.dtype, config=config)
