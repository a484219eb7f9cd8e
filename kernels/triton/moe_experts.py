"""The fused MoE experts layer over routed tokens, in Triton (vLLM's fused_moe layout).

    experts(x, ids, weights, w13, w2, *, ws13=None, ws2=None, block_m=None) -> out (T, D), x's dtype

    out[t] = sum_j weights[t, j] W2[e] rnd(silu(G_e x_t) * (U_e x_t))  +  sum_s Ws2[s] rnd(silu(Gs x_t) * (Us x_t))

1. Alignment: kernels/triton/moe_align.py (the moe.align op's kernel): the T k token slots (slot = t k + j)
   sorted by expert (stable), each expert's run padded to a multiple of BLOCK_M with the sentinel T k; one
   expert id per block of BLOCK_M. Experts that no token chose get no block. The GEMMs' grids cover the worst
   case's ceil((T k + E (BLOCK_M - 1)) / BLOCK_M) blocks; a program whose block starts at or past
   num_tokens_post_pad (read on the device, as vLLM's kernel does: no host sync) returns at once.
2. `_gemm1_swiglu`: a program per (block, BLOCK_N columns of F): the block's rows of x (token slot // k)
   against its expert's gate and up rows of w13, two tl.dot accumulators in fp32 over D, SwiGLU in the
   epilogue (silu(g) = g / (1 + exp(-g)) in fp32), act rounded to x's dtype (the golden's production cast)
   and stored in the slot's row of act (T k, F).
3. `_gemm2`: a program per (block, BLOCK_N columns of D): act rows against w2[e] in fp32 over F, times the
   slot's routing weight (fp32), stored in the slot's row of ys (T k, D), fp32.
   The shared experts run 2 and 3 as S more experts with their own layout (slot t S + s, weight 1).
4. `_sum_slots`: out[t] = the fp32 sum of its k slot rows then its S shared rows, rounded once to x's dtype.
bf16 / fp16: 16-bit tl.dot operands, fp32 accumulation; fp32: "ieee" dots. int4 (GPTQ v1 w4a16, every weight;
kernels/cpu/moe_experts.py `weight_shape`): each K tile inside one group, its codes q - z (|.| <= 15, exact in
any dtype) the dot's operand and the group's fp16 scales applied to the tile's fp32 partial product, so the
weights are used exactly (never rounded to bf16), as the golden's dequantized ones. Block FP8 (DeepSeek-V3: e4m3fn
codes, one fp32 scale per 128 x 128 block, every weight): BLOCK_K divides 128, so each K tile lies in one column
block; its e4m3 codes (exact in bf16, fp16 and fp32) are the dot's operand and the tile's fp32 partial product is
multiplied by each column's block scale (its row block's), as the int4 path applies its group scale. w8a8
(act_fp8): `_group_quant` quantizes x, and act after GEMM1, per row per 128 columns (s = amax / 448 and v / s with
tl.math.div_rn, the IEEE division: Triton's `/` is the approximate div.full.f32 on the GPU; clamp to +-448,
e4m3fn RNE), as vLLM's per_token_group_quant_fp8 runs before each GEMM; the GEMMs then take both operands as
codes (bf16, exact products) and scale the tile's partial product by the row's group scale and the column's block
scale (vLLM's fused_moe_kernel with block_shape). GGML weights (llama.cpp's expert-stacked q8_0 / q4_0 / q4_k / q6_k
tensors, {"fmt", "blocks"}: each expert's rows K / QK little-endian blocks, never converted; w-only): the K loop
walks the rows' blocks GGML_G groups at a time, decoding each (BLOCK_N, G, E) tile to fp32 with
kernels/triton/gemm.py's dequantizers (`_dq_q8_0` ...: ggml's dequantize_row_*, one rounding of the exact value) and
multiplying it part by part against x's (or act's) columns gathered at the group's element order (gemm.py's
`_k_of`), in fp32 "ieee" dots for every dtype: the weights are never rounded to a 16-bit dtype, as the golden's
exact dequantization (refimpl/moe_experts.py). Padding rows (the sentinel) load
zeros and store nothing. Under the interpreter the backend makes bf16 dots and casts behave as on the GPU
(conformance/backends/triton_interpreter.py).
Reference: vllm-project/vllm vllm/model_executor/layers/fused_moe/fused_moe.py (fused_moe_kernel, the
sorted_token_ids / expert_ids layout, MUL_ROUTED_WEIGHT in the second GEMM); written anew.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.cpu.moe_experts import check_act_fp8, check_experts_args
from kernel_parity.kernels.triton.gemm import FORMATS as GGML_TILES
from kernel_parity.kernels.triton.gemm import _dq_q4_0, _dq_q4_k, _dq_q6_k, _dq_q8_0, _k_of
from kernel_parity.kernels.triton.moe_align import align

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BLOCK_N, BLOCK_K, num_warps) of both GEMMs; BLOCK_M by the tokens an expert gets on average (unmeasured)
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 4


def block_m_for(t: int, k: int, e: int) -> int:
    """Rows a block: 16 for decode-like loads (few slots an expert), up to 64 for prefill."""
    per_expert = t * k / max(1, e)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


@triton.jit
def _int4_tile(QW, QZ, SC, e, k0, group, offs_n, mask_n, N, n_experts, stride_qe, stride_ze, stride_se,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert e's GPTQ v1 codes (q - z) as a (BLOCK_K, BLOCK_N) int32 tile of W^T at rows k0 .. k0 + BLOCK_K (inside
    one group) and columns offs_n, and the group's scales (BLOCK_N,) fp32: W^T = (q - z) * scale, exactly."""
    shift = 4 * tl.arange(0, 8)
    grp = k0 // group
    scale = tl.load(SC + e * stride_se + grp * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    zw = tl.load(QZ + e * stride_ze + grp * (N // 8) + offs_n // 8, mask=mask_n, other=0)
    zero = ((zw >> (4 * (offs_n % 8))) & 15) + 1  # v1 checkpoints store zero - 1
    offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    qw = tl.load(QW + e * stride_qe + offs_r[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask_n[None, :], other=0)
    q = tl.reshape((qw[:, None, :] >> shift[None, :, None]) & 15, [BLOCK_K, BLOCK_N])
    return q - zero[None, :], scale


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w: "ieee" fp32 products for fp32 operands, 16-bit tensor-core products otherwise (fp32 sums)."""
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _dot_int4(a, codes, scale, acc, IEEE: tl.constexpr):
    """acc + (a @ codes) * scale: the codes (|q - z| <= 15) exact in a's dtype, the group's scale applied to the
    fp32 partial product (the weights never rounded to a 16-bit dtype)."""
    if IEEE:
        part = tl.dot(a, codes.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, codes.to(tl.float32).to(a.dtype))  # via fp32: the interpreter's int32 -> bf16 is wrong
    return acc + part * scale[None, :]


FP8_BLOCK = 128


@triton.jit
def _fp8_tile(W, BS, e, k0, offs_n, mask_n, K, nbk, stride_we, stride_wn, stride_se, BLOCK_K: tl.constexpr):
    """Expert e's e4m3 codes as a (BLOCK_K, BLOCK_N) fp32 tile of W^T at rows k0 .. k0 + BLOCK_K (inside one 128
    column block) and columns offs_n, and each column's block scale (BLOCK_N,): W^T = codes * scale, exactly."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & mask_n[None, :]
    c = tl.load(W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=mask, other=0)
    scale = tl.load(BS + e * stride_se + (offs_n // 128) * nbk + k0 // 128, mask=mask_n, other=0.0)
    return c.to(tl.float8e4nv, bitcast=True).to(tl.float32), scale


@triton.jit
def _dot_fp8(a, codes, scale, acc, IEEE: tl.constexpr):
    """acc + (a @ codes) * scale: the e4m3 codes exact in a's dtype, the block's scale applied to the fp32 partial
    product (the weights never rounded)."""
    if IEEE:
        part = tl.dot(a, codes, input_precision="ieee")
    else:
        part = tl.dot(a, codes.to(a.dtype))
    return acc + part * scale[None, :]


GGML_G = 4  # GGML: groups decoded a K step (gemm.py's tiles: a whole 256-block of q4_k / q6_k, 4 q8_0 / q4_0 blocks)


@triton.jit
def _ggml_part(acc, X, rows, valid, stride_x, w, g0, n_groups, FMT: tl.constexpr, P: tl.constexpr,
               BLOCK_N: tl.constexpr, G: tl.constexpr, E: tl.constexpr):
    """acc + X[rows, k] @ w^T for part P of the groups g0 .. g0 + G - 1 (w: (BLOCK_N, G, E) fp32, gemm.py's
    decoded tile; k: its columns, gemm.py's `_k_of`): fp32 operands, "ieee" products and fp32 sums."""
    c = tl.arange(0, G * E)
    grp = g0 + c // E
    k = _k_of(FMT, grp, c % E, P)
    a = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=valid[:, None] & (grp < n_groups)[None, :],
                other=0.0).to(tl.float32)
    return tl.dot(a, tl.trans(tl.reshape(w, [BLOCK_N, G * E])), acc, input_precision="ieee")


@triton.jit
def _ggml_mac(acc, X, rows, valid, stride_x, Wrow, g0, n_groups, mask_n, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
              G: tl.constexpr, E: tl.constexpr):
    """acc + X[rows] @ W^T over the groups g0 .. g0 + G - 1 of the weight rows at Wrow ((BLOCK_N, 1, 1) byte
    pointers): each group decoded to fp32 by kernels/triton/gemm.py's dequantizers (ggml's dequantize_row_*, one
    rounding of the exact value; q8_0 / q4_0 / q6_k exact), then multiplied part by part (`_ggml_part`)."""
    g = g0 + tl.arange(0, G)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    mask = mask_n[:, None, None] & (g < n_groups)
    if FMT == 0:
        w0 = _dq_q8_0(Wrow, g, e, mask)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w0, g0, n_groups, FMT, 0, BLOCK_N, G, E)
    elif FMT == 1:
        w0, w1 = _dq_q4_0(Wrow, g, e, mask)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w0, g0, n_groups, FMT, 0, BLOCK_N, G, E)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w1, g0, n_groups, FMT, 1, BLOCK_N, G, E)
    elif FMT == 2:
        w0, w1 = _dq_q4_k(Wrow, g, e, mask)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w0, g0, n_groups, FMT, 0, BLOCK_N, G, E)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w1, g0, n_groups, FMT, 1, BLOCK_N, G, E)
    else:
        w0, w1, w2, w3 = _dq_q6_k(Wrow, g, e, mask)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w0, g0, n_groups, FMT, 0, BLOCK_N, G, E)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w1, g0, n_groups, FMT, 1, BLOCK_N, G, E)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w2, g0, n_groups, FMT, 2, BLOCK_N, G, E)
        acc = _ggml_part(acc, X, rows, valid, stride_x, w3, g0, n_groups, FMT, 3, BLOCK_N, G, E)
    return acc


@triton.jit
def _group_quant(X, Q, S, n_rows, L, stride_x, stride_q, stride_s, BLOCK_R: tl.constexpr):
    """Rows of X (n_rows, L) quantized per 128 columns: s = amax / 448, codes e4m3fn(RNE(clamp(v / s, +-448))) (the
    IEEE divisions; s = 0: codes 0), stored as their bits in Q (uint8) and s in S (n_rows, ceil(L / 128))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < L)[None, :]
    r64 = rows.to(tl.int64)
    v = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(tl.max(tl.abs(v), axis=1), 448.0)
    safe = tl.where(s == 0.0, 1.0, s)
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, safe[:, None]), -448.0), 448.0)
    y = tl.where(s[:, None] == 0.0, 0.0, y)
    tl.store(Q + r64[:, None] * stride_q + cols[None, :], y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(S + r64 * stride_s + g, s, mask=rmask)


@triton.jit
def _a8_tile(A, AS, rows, valid, k0, stride_a, stride_as, BLOCK_K: tl.constexpr, K):
    """w8a8: the rows' e4m3 codes at columns k0 .. k0 + BLOCK_K as bf16 (exact), and their group's scales."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    c = tl.load(A + rows[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & (offs_k < K)[None, :], other=0)
    sa = tl.load(AS + rows * stride_as + k0 // 128, mask=valid, other=0.0)
    return c.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16), sa


@triton.jit
def _dot_a8(a, sa, codes, scale, acc):
    """w8a8: acc + (codes_a @ codes_w) * sa * scale, both operands bf16 codes (exact products, fp32 sums)."""
    return acc + tl.dot(a, codes.to(tl.bfloat16)) * sa[:, None] * scale[None, :]


@triton.jit
def _gemm1_swiglu(X, XS, W13, QZ13, SC13, SID, EID, NTP, ACT, n_slots, TOPK, D, F, n_experts, group, nbk,
                  stride_x, stride_xs, stride_we, stride_wn, stride_a, stride_ze, stride_se,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                  INT4: tl.constexpr, FP8: tl.constexpr = False, A8: tl.constexpr = False, GGML_FMT: tl.constexpr = -1,
                  GROUP_EL: tl.constexpr = 32, GE: tl.constexpr = 32, GG: tl.constexpr = 2):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NTP):  # a block past the padded slots: nothing to do
        return
    e = tl.load(EID + pid_m).to(tl.int64)
    slot = tl.load(SID + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slot < n_slots
    tok = slot // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    w_base = W13 + e * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GGML_FMT >= 0:  # GGML rows (stride_wn bytes): the gate's and the up's blocks decoded GG groups a step
        n_groups = D // GROUP_EL
        row_g = w_base + offs_n[:, None, None].to(tl.int64) * stride_wn
        row_u = w_base + (offs_n[:, None, None] + F).to(tl.int64) * stride_wn
        for g0 in range(0, n_groups, GG):
            acc_g = _ggml_mac(acc_g, X, tok, valid, stride_x, row_g, g0, n_groups, mask_n, GGML_FMT, BLOCK_N, GG, GE)
            acc_u = _ggml_mac(acc_u, X, tok, valid, stride_x, row_u, g0, n_groups, mask_n, GGML_FMT, BLOCK_N, GG, GE)
    else:
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            if A8:  # x's codes and group scales (`_group_quant`), the weights' codes and block scales
                a, sa = _a8_tile(X, XS, tok, valid, k0, stride_x, stride_xs, BLOCK_K, D)
                cg, sg = _fp8_tile(W13, SC13, e, k0, offs_n, mask_n, D, nbk, stride_we, stride_wn, stride_se, BLOCK_K)
                cu, su = _fp8_tile(W13, SC13, e, k0, offs_n + F, mask_n, D, nbk, stride_we, stride_wn, stride_se,
                                   BLOCK_K)
                acc_g = _dot_a8(a, sa, cg, sg, acc_g)
                acc_u = _dot_a8(a, sa, cu, su, acc_u)
            elif FP8:
                a = tl.load(X + tok[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                cg, sg = _fp8_tile(W13, SC13, e, k0, offs_n, mask_n, D, nbk, stride_we, stride_wn, stride_se, BLOCK_K)
                cu, su = _fp8_tile(W13, SC13, e, k0, offs_n + F, mask_n, D, nbk, stride_we, stride_wn, stride_se,
                                   BLOCK_K)
                acc_g = _dot_fp8(a, cg, sg, acc_g, IEEE)
                acc_u = _dot_fp8(a, cu, su, acc_u, IEEE)
            elif INT4:  # BLOCK_K divides the group and D (the wrapper checks): whole K tiles inside one group
                a = tl.load(X + tok[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                cg, sg = _int4_tile(W13, QZ13, SC13, e, k0, group, offs_n, mask_n, 2 * F, n_experts, stride_we,
                                    stride_ze, stride_se, BLOCK_K, BLOCK_N)
                cu, su = _int4_tile(W13, QZ13, SC13, e, k0, group, offs_n + F, mask_n, 2 * F, n_experts, stride_we,
                                    stride_ze, stride_se, BLOCK_K, BLOCK_N)
                acc_g = _dot_int4(a, cg, sg, acc_g, IEEE)
                acc_u = _dot_int4(a, cu, su, acc_u, IEEE)
            else:
                a = tl.load(X + tok[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                wmask = mask_k[:, None] & mask_n[None, :]
                wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
                wu = tl.load(w_base + (offs_n[None, :] + F) * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
                acc_g = _dot(a, wg, acc_g, IEEE)
                acc_u = _dot(a, wu, acc_u, IEEE)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(ACT + slot[:, None] * stride_a + offs_n[None, :], act.to(ACT.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _gemm2(ACT, AS, W2, QZ2, SC2, SID, EID, NTP, RW, YS, n_slots, D, F, n_experts, group, nbk,
           stride_a, stride_as, stride_we, stride_wd, stride_y, stride_ze, stride_se,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
           INT4: tl.constexpr, FP8: tl.constexpr = False, A8: tl.constexpr = False, GGML_FMT: tl.constexpr = -1,
           GROUP_EL: tl.constexpr = 32, GE: tl.constexpr = 32, GG: tl.constexpr = 2):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NTP):  # a block past the padded slots: nothing to do
        return
    e = tl.load(EID + pid_m).to(tl.int64)
    slot = tl.load(SID + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slot < n_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    w_base = W2 + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GGML_FMT >= 0:  # GGML rows of w2 (along F): act's rows against their decoded blocks
        n_groups = F // GROUP_EL
        row_w = w_base + offs_n[:, None, None].to(tl.int64) * stride_wd
        for g0 in range(0, n_groups, GG):
            acc = _ggml_mac(acc, ACT, slot, valid, stride_a, row_w, g0, n_groups, mask_n, GGML_FMT, BLOCK_N, GG, GE)
    else:
        for k0 in range(0, F, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < F
            if A8:  # act's codes and group scales (`_group_quant`)
                a, sa = _a8_tile(ACT, AS, slot, valid, k0, stride_a, stride_as, BLOCK_K, F)
                c, sc = _fp8_tile(W2, SC2, e, k0, offs_n, mask_n, F, nbk, stride_we, stride_wd, stride_se, BLOCK_K)
                acc = _dot_a8(a, sa, c, sc, acc)
            elif FP8:
                a = tl.load(ACT + slot[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                c, sc = _fp8_tile(W2, SC2, e, k0, offs_n, mask_n, F, nbk, stride_we, stride_wd, stride_se, BLOCK_K)
                acc = _dot_fp8(a, c, sc, acc, IEEE)
            elif INT4:
                a = tl.load(ACT + slot[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                c, sc = _int4_tile(W2, QZ2, SC2, e, k0, group, offs_n, mask_n, D, n_experts, stride_we, stride_ze,
                                   stride_se, BLOCK_K, BLOCK_N)
                acc = _dot_int4(a, c, sc, acc, IEEE)
            else:
                a = tl.load(ACT + slot[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)
                w = tl.load(w_base + offs_n[None, :] * stride_wd + offs_k[:, None],
                            mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc = _dot(a, w, acc, IEEE)
    rw = tl.load(RW + slot, mask=valid, other=0.0)
    acc = acc * rw[:, None]
    tl.store(YS + slot[:, None] * stride_y + offs_n[None, :], acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _sum_slots(YS, YSS, OUT, D, TOPK, S, stride_y, stride_ys, stride_o, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, TOPK):
        acc += tl.load(YS + (t * TOPK + j) * stride_y + offs, mask=mask, other=0.0)
    for s in range(0, S):
        acc += tl.load(YSS + (t * S + s) * stride_ys + offs, mask=mask, other=0.0)
    tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def _parts(w):
    """(W or qweight or codes, qzeros, scales, group, strides (expert, row) of W / qweight / codes, qzeros' and
    scales' expert strides, int4?) of a dense, GPTQ v1 int4 or block-FP8 weight (codes as uint8; the group: the
    scales' column blocks); the dense case passes W for the unused pointers."""
    if isinstance(w, dict) and "fmt" in w:  # GGML blocks: byte strides
        b = w["blocks"]
        return b, b, b, 1, b.stride(0), b.stride(1), 0, 0, False
    if isinstance(w, dict) and "codes" in w:
        c, sc = w["codes"].view(torch.uint8), w["scales"]
        return c, c, sc, sc.shape[2], c.stride(0), c.stride(1), 0, sc.stride(0), True
    if isinstance(w, dict):
        qw, qz, sc = w["qweight"], w["qzeros"], w["scales"]
        group = qw.shape[1] * 8 // sc.shape[1]
        return qw, qz, sc, group, qw.stride(0), qw.stride(1), qz.stride(0), sc.stride(0), True
    return w, w, w, 1, w.stride(0), w.stride(1), 0, 0, False


def _quant_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (n, L) uint8 e4m3fn bits, scales (n, ceil(L / 128)) fp32) of v's per-row, per-128-column quantization."""
    n, length = v.shape
    groups = triton.cdiv(length, FP8_BLOCK)
    q = torch.empty((n, length), dtype=torch.uint8, device=v.device)
    sc = torch.empty((n, groups), dtype=torch.float32, device=v.device)
    if n:
        _group_quant[(triton.cdiv(n, 16), groups)](v, q, sc, n, length, v.stride(0), q.stride(0), sc.stride(0),
                                                   BLOCK_R=16)
    return q, sc


def _routed(x, ids, weights, w13, w2, block_m: int, xq=None) -> torch.Tensor:
    """ys (T k, D) fp32: each slot's expert output times its routing weight (steps 1-3); xq: w8a8, x's codes and
    group scales (`_quant_rows`)."""
    t, d = x.shape
    k = ids.shape[1]
    fp8 = isinstance(w13, dict) and "codes" in w13
    ggml = w13["fmt"] if isinstance(w13, dict) and "fmt" in w13 else None
    a8 = xq is not None
    q13, z13, s13, g13, se13, sn13, ze13, sce13, int4 = _parts(w13)
    q2, z2, s2, g2, se2, sn2, ze2, sce2, _ = _parts(w2)
    int4 = int4 and not fp8
    e = q13.shape[0]
    f = (s13.shape[2] if int4 else q13.shape[1]) // 2
    tiles = {}
    if ggml is not None:  # gemm.py's tile of the format: (id, elements a block, bytes, groups a block, E)
        fid, qk, _, gpb, ge = GGML_TILES[ggml]
        tiles = dict(GGML_FMT=fid, GROUP_EL=qk // gpb, GE=ge, GG=GGML_G)
    n = t * k
    sorted_ids, expert_ids, post_pad = align(ids.to(torch.int32), e, block_m)
    act = torch.empty((n, f), dtype=x.dtype, device=x.device)
    ys = torch.zeros((n, d), dtype=torch.float32, device=x.device)  # a slot no block wrote reads 0, never stale memory
    nb = expert_ids.numel()
    if nb == 0:
        return ys
    ieee = x.dtype == torch.float32
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    xa, xs = xq if a8 else (x, x)
    _gemm1_swiglu[(nb, triton.cdiv(f, BLOCK_N))](
        xa, xs, q13, z13, s13, sorted_ids, expert_ids, post_pad, act, n, k, d, f, e, g13, g13, xa.stride(0),
        xs.stride(0), se13, sn13, act.stride(0), ze13, sce13, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=ieee, INT4=int4, FP8=fp8, A8=a8, num_warps=NUM_WARPS, **tiles)
    aa, as_ = _quant_rows(act) if a8 else (act, act)  # w8a8: act (rounded to x's dtype) quantized per 128 columns
    _gemm2[(nb, triton.cdiv(d, BLOCK_N))](
        aa, as_, q2, z2, s2, sorted_ids, expert_ids, post_pad, rw, ys, n, d, f, e, g2, g2, aa.stride(0), as_.stride(0),
        se2, sn2, ys.stride(0), ze2, sce2, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee, INT4=int4,
        FP8=fp8, A8=a8, num_warps=NUM_WARPS, **tiles)
    return ys


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
            ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None, block_m: int | None = None,
            act_fp8: bool = False) -> torch.Tensor:
    """(T, D) in x's dtype: the routed experts' weighted sum plus the shared experts (module docstring); act_fp8:
    w8a8 (block-FP8 weights only)."""
    t, d, e, f, k, s, fs = check_experts_args(x, ids, weights, w13, w2, ws13, ws2)
    a8 = check_act_fp8(act_fp8, w13)
    tensors = {"x": x, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if ws13 is not None else {})}
    fp8 = isinstance(w13, dict) and "codes" in w13
    ggml = isinstance(w13, dict) and "fmt" in w13
    int4 = isinstance(w13, dict) and not fp8 and not ggml
    for name, a in tensors.items():
        if isinstance(a, dict) and ggml:
            b = a["blocks"]
            if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or not b.is_contiguous():
                raise ValueError(f"moe.experts: GGML {name}['blocks'] must be a contiguous uint8 tensor")
            if a["fmt"] not in GGML_TILES:
                raise ValueError(f"moe.experts: the Triton kernel decodes {', '.join(GGML_TILES)} weights, not "
                                 f"{a['fmt']!r}")
            continue
        if isinstance(a, dict) and fp8:
            for part, want in (("codes", torch.float8_e4m3fn), ("scales", torch.float32)):
                v = a[part]
                if not isinstance(v, torch.Tensor) or v.dtype != want or not v.is_contiguous():
                    raise ValueError(f"moe.experts: fp8 {name}[{part!r}] must be a contiguous {want} tensor")
            continue
        if isinstance(a, dict) and name != "x":
            for part, want in (("qweight", torch.int32), ("qzeros", torch.int32), ("scales", torch.float16)):
                v = a[part]
                if not isinstance(v, torch.Tensor) or v.dtype != want or not v.is_contiguous():
                    raise ValueError(f"moe.experts: int4 {name}[{part!r}] must be a contiguous {want} tensor")
            continue
        if not isinstance(a, torch.Tensor) or a.dtype != x.dtype:
            raise ValueError(f"moe.experts: {name} must be a tensor of x's dtype {getattr(x, 'dtype', None)}")
        if a.stride(-1) != 1 or (name != "x" and a.stride(1) != a.shape[2]):
            raise ValueError(f"moe.experts: {name}'s rows must be contiguous within an expert, got strides "
                             f"{a.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"moe.experts: x dtype must be one of float32, bfloat16, float16, got {x.dtype}")
    if int4:
        group = w13["qweight"].shape[1] * 8 // w13["scales"].shape[1]
        if group % BLOCK_K or d % BLOCK_K or f % BLOCK_K or (s and fs % BLOCK_K):
            raise ValueError(f"moe.experts: int4 needs the group ({group}), D ({d}), F ({f}) and Fs ({fs}) multiples "
                             f"of {BLOCK_K} (whole K tiles inside one group)")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("moe.experts: ids must be an int32 / int64 tensor")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"moe.experts: ids must be in [0, E={e})")
    if block_m is not None and block_m not in (16, 32, 64, 128):
        raise ValueError(f"moe.experts: block_m={block_m!r} must be one of 16, 32, 64, 128")
    bm = block_m or block_m_for(t, k, e)
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    xq = _quant_rows(x) if a8 else None  # w8a8: x quantized once, for the routed and the shared experts
    ys = _routed(x, ids, weights, w13, w2, bm, xq)
    yss = ys
    if s:
        sid = torch.arange(s, dtype=torch.int32, device=x.device).expand(t, s)
        yss = _routed(x, sid, torch.ones((t, s), dtype=torch.float32, device=x.device), ws13, ws2,
                      block_m or block_m_for(t, s, s), xq)
    block_d = min(1024, triton.next_power_of_2(d))
    _sum_slots[(t, triton.cdiv(d, block_d))](ys, yss, out, d, k, s, ys.stride(0), yss.stride(0), out.stride(0),
                                             BLOCK_D=block_d)
    return out
