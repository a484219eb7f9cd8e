"""Paged decode attention over a quantized KV cache (kvquant.decode_paged), in Triton: flash decoding.

    logit_hj = scale * s_k(j) * (q_h . kc_j)        kc_j: key j's codes, converted exactly to q's dtype
    LSE_h = ln sum_j exp(logit_hj);  O_h = sum_j exp(logit_hj - LSE_h) s_v(j) vc_j

Golden: refimpl/kvquant_decode.py (float64 code x scale, then attention.decode_paged's math). Codes:
float8_e4m3fn, float8_e5m2 or int8; every value of the three grids is exact in bf16, fp16 and fp32, so the
codes enter the tensor-core dots as they are and the scales stay out of them (FlashInfer's FP8 decode): per
tensor / per kv head s_k folds into the fp32 logit scale and s_v into the final 1 / l; per token the fp32
logits of a tile are multiplied by the tile's s_k(j) vector and the probabilities by s_v(j) before the P V dot.

Layout: q (b, h_q, d); k_cache, v_cache (num_blocks, page, h_kv, d) codes; token t of sequence b lives at
cache[block_table[b, t // page], t % page]; scales (1,) | (h_kv,) | (num_blocks, page, h_kv) fp32.

Schedule (Flash-Decoding; FlashInfer's GQA head packing): a program takes one kv head of one sequence and ALL
its query heads (the M dimension of the dots, padded to 16), so each code byte is read once whatever the GQA
group, and one split of the sequence: split s covers keys [s C, min((s + 1) C, L_b)), C = split_keys (a
multiple of BLOCK_N). Codes are loaded as 8-bit (a quarter of fp32's, half of bf16's traffic), converted in
registers. With one split the program writes O and LSE; with several it writes fp32 partials (O_s, LSE_s)
that kernels.triton.combine.lse_combine merges (an empty split: LSE -inf, no weight). C is SPLIT_KEYS_CPU on
the interpreter (so that long ci sequences take the split path) and, on a GPU, enough splits to give each SM
SPLIT_PROGRAMS_PER_SM programs (at least MIN_SPLIT_KEYS keys a split), from the table's capacity: seq_lens
stays on the device.

On the interpreter (a CPU tensor) the dots take fp32 operands (ieee): Triton 3.9's interpreter miscomputes a
tl.dot whose operand was cast to bf16 in the kernel (a loaded bf16 tensor is fine). bf16 / fp16 q times an
exact code is an exact product either way, so only the P V dot differs: the GPU rounds p s_v to q's dtype
(as attention_decode does), the interpreter keeps it in fp32.

The FP8 -> bf16 conversion (fast_cvt, `_codes`): Triton's cast goes e4m3 -> fp16 -> bf16, two conversion-pipe
instructions a pair of codes plus one a code, and bounded this kernel at the bf16 kernel's time a key (the
conversion pipe is 16 lanes an SM). The GPU path instead moves bits on the integer pipes (Marlin's trick, checked
bit for bit against torch's cast for all 256 codes of both formats on the H200), and converts V before its tile
goes through shared memory (else Triton reads the 8-bit V tile a byte a load, ld.shared.b8, to transpose it for
the P V dot). int8 codes and fp16 / fp32 queries keep the casts.

Status (H200, Llama-3-8B heads, 32,768 tokens, e4m3 per tensor, the read floor at the measured 4.1 TB/s read
ceiling; benchmarks/gpu_kvquant.py --tune, reports/baselines/kvquant-tune-h200.json): CUDA-graph timing b 1 / 8 /
32: 55.9 / 207 / 801 us, 0.95x / 1.24x / 1.67x the bf16-cache attention.decode_paged (53.1 / 258 / 1339 us) and
29% / 63% / 65% of the read floor; Triton's casts 82.8 / 245 / 902 us. Short of issue 34's goal (1.8x, 90%).
The loop is not byte-bound: 1,276 SASS instructions a thread a 128-key tile, half of them the
conversion (PRMT, SHF, LOP3, HMUL2: 2.5 an element), and the two M = 16 mma.sync dots waste 3/4 of their rows on
a GQA group of 4; b 1 has 128 programs for 132 SMs. Nsight Compute (b 32, (128, 4, 3)): three CTAs an SM (12
warps, registers and shared memory both at the limit), 2.78 active and 0.76 eligible warps a scheduler, 1.95
instructions a cycle of 4, the ALU pipe 49.7% busy, DRAM 56% of peak: latency-bound, not issue- or byte-bound.
Measured and dropped (the H200 files of reports/baselines/issue34d-h200/):
- fp16 dots over the hardware's e4m3 -> fp16 conversion (773 instructions a tile, but 7% slower: that conversion
  is on the slow pipe too);
- the bit moves without their multiply, 2^120 folded into q (a power of two a row) and into P (1,089 instructions
  a tile against 1,221; outputs identical to Triton's casts on subnormal-only caches): 790 against 803 us at b 32
  with 168 registers, equal at b 1 / 8;
- capping registers (maxnreg 168 / 128) and 8 warps: no gain (the CONFIGS comment);
- K's e4m3 codes straight into Hopper's FP8 warp-group MMA with the keys as M (S^T = K q^T, q split into two
  e4m3 pieces, P V as now): 827 instructions a tile, b 8 / 32 at 196 / 750 us (CUDA graph; 1.32x / 1.79x the bf16
  cache, 66% / 69% of the read floor), but the FP8 MMA's short accumulator puts ~2.5e-4 relative error on the
  logits, and the LSE then fails the production tier's fp32 limit (9 of 16 d-128 e4m3 cases, 2 of 6 models
  cases; O passes). Exact K is what the tier and the peers (FlashInfer, vLLM: codes converted to 16 bits) keep.
kernels/gluon/kvquant_decode.py (the `gluon` backend) takes bf16 q over e4m3 / e5m2 caches past this kernel's bound:
one warp a program, the codes through a cp.async ring straight into mma.sync operands, the conversion's power of
two folded into q and P (b 32: 566 us, 2.35x the bf16 cache, 90% of the read floor; its docstring).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .combine import lse_combine

FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2}
GRANS = ("tensor", "head", "token")
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256
MAX_GROUP = 64
SPLIT_KEYS_CPU = 512  # the ci suite's 1,100 / 1,500-key sequences take the split + combine path; its 300-key ones
# one split (the interpreter runs lse_combine a program a row: 256 doubled the ci time of this op)
MIN_SPLIT_KEYS = 2048
SPLIT_PROGRAMS_PER_SM = 8
# (BLOCK_N, num_warps, num_stages) by padded head dim. d = 128 measured on an H200 (Triton 3.6, Llama-3-8B's 32 / 8
# heads, pages of 16, 32,768 tokens, e4m3 per tensor, fast conversion, do_bench us): b = 8: (128, 4, 4) 214,
# (128, 4, 3) 215, (128, 4, 2) 244, (128, 8, 2) 263, (64, 4, 3) 280, (256, 8, 2) 321; b = 32: (128, 4, 3) 778 at
# 2,048 keys a split, 799 at the default split, (128, 4, 2) 895; b = 1: within noise (host-bound under do_bench).
# CUDA-core FMAs in place of the two tl.dots (FlashInfer's small-group decode, group 4 unpadded) measured 3.5-5x
# slower earlier. Register caps (config's 4th entry, maxnreg), b 8 / 32 at 2,048 keys a split: (128, 4, 3, 168) 226 /
# 816, (128, 4, 2, 168) 233 / 841, (64, 4, 3, 128) 289 / 827 (on Triton 3.6, (128, 4, 3) already fits three CTAs an
# SM). Other rows are unmeasured guesses.
CONFIGS = {16: (128, 4, 2), 32: (128, 4, 2), 64: (128, 4, 2), 128: (128, 4, 3), 256: (64, 4, 2)}


# FP8 codes -> bf16 on the integer and FMA pipes, four codes a 32-bit word (the GPU path; Marlin's trick): each
# byte moved to the top of a 16-bit lane (prmt), its exponent and mantissa shifted under bf16's (sign kept), which
# reads as the code's value times 2^(bf16 bias - fp8 bias) in bf16, then one exact multiply by 2^(127 - 7) (e4m3)
# or 2^(127 - 15) (e5m2): exact for every finite code, subnormals included (they become bf16 normals or
# subnormals, and bf16 fma keeps subnormals). Triton's cast goes e4m3 -> f16 -> bf16, one conversion-pipe
# instruction an element (a 16-lane pipe): H200, it bounded the decode at the bf16 kernel's time a key.
_FP8_BF16_ASM = """{
.reg .b32 lo, hi, slo, shi, mul, nz;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
and.b32 slo, lo, 0x80008000;
and.b32 shi, hi, 0x80008000;
shr.b32 lo, lo, SHIFT;
shr.b32 hi, hi, SHIFT;
and.b32 lo, lo, MASK;
and.b32 hi, hi, MASK;
or.b32 lo, lo, slo;
or.b32 hi, hi, shi;
mov.b32 mul, POW2;
mov.b32 nz, 0x80008000;
fma.rn.bf16x2 $0, lo, mul, nz;
fma.rn.bf16x2 $1, hi, mul, nz;
}"""
E4M3_BF16_ASM: tl.constexpr = tl.constexpr(
    _FP8_BF16_ASM.replace("SHIFT", "4").replace("MASK", "0x07F007F0").replace("POW2", "0x7B807B80"))
E5M2_BF16_ASM: tl.constexpr = tl.constexpr(
    _FP8_BF16_ASM.replace("SHIFT", "3").replace("MASK", "0x0FE00FE0").replace("POW2", "0x77807780"))


@triton.jit
def _codes(x, FMT: tl.constexpr, OUT: tl.constexpr, FAST: tl.constexpr = 0, PURE: tl.constexpr = True):
    """8-bit codes (loaded as uint8 for the float formats, int8 for int8) -> OUT, exactly. FAST=1 (a GPU, an FP8
    format, OUT bf16): the integer-pipe conversion above. PURE=False keeps Triton from moving the conversion past
    the tile's trip through shared memory (V: see the kernel)."""
    if FAST == 1 and FMT == 0:
        y = tl.inline_asm_elementwise(E4M3_BF16_ASM, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=PURE, pack=4)
    elif FAST == 1 and FMT == 1:
        y = tl.inline_asm_elementwise(E5M2_BF16_ASM, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=PURE, pack=4)
    elif FMT == 0:
        y = x.to(tl.float8e4nv, bitcast=True).to(OUT)
    elif FMT == 1:
        y = x.to(tl.float8e5, bitcast=True).to(OUT)
    else:  # through fp32 (exact both ways): the interpreter's int8 -> bf16 cast reinterprets the bits
        y = x.to(tl.float32).to(OUT)
    return y


@triton.jit
def _attend(q, K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head, start, end, qk_scale, m_i, l_i, acc,
            offs_d, mask_d, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh, stride_bt_p,
            FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
            DOT_PRECISION: tl.constexpr, FAST_CVT: tl.constexpr = 0):
    """Cached keys [start, end) of one kv head (K_base / V_base: its cache planes, bt_row: the sequence's block
    table) into the online-softmax state (m_i, l_i, acc), log2-domain logits (qk_scale holds log2 e; per-token
    scales applied here). Shared with kvquant_append.py's kernel."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        live = cols < end
        page = tl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0).to(tl.int64)
        slot = cols % PAGE
        if EVEN_D:  # a mask constant along d: the 8-bit code rows load as wide vectors
            kmask = live[None, :]
            vmask = live[:, None]
        else:
            kmask = live[None, :] & mask_d[:, None]
            vmask = live[:, None] & mask_d[None, :]
        kc = tl.load(K_base + (page * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None], mask=kmask, other=0)
        vc = tl.load(V_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :], mask=vmask, other=0)
        k = _codes(kc, FMT, q.dtype, 1 if FAST_CVT > 0 else 0)
        # V's dot contracts over keys, which are 128 bytes apart in the tile: Triton would convert V after reading
        # the 8-bit tile from shared memory in the dot's layout, one byte a load (ld.shared.b8, 128 a thread a
        # tile). A conversion it cannot move (not pure) runs on the loaded rows instead, and the bf16 tile goes
        # to the dot through ldmatrix.trans.
        v = _codes(vc, FMT, q.dtype, 1 if FAST_CVT > 0 else 0, FAST_CVT == 1)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # fp32
        if GRAN == 2:
            s_off = page * stride_sb + slot * stride_ss + kv_head * stride_sh
            sk = tl.load(KS_ptr + s_off, mask=live, other=0.0)
            svj = tl.load(VS_ptr + s_off, mask=live, other=0.0)
            qk = qk * sk[None, :]
        qk = tl.where(live[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p
        if GRAN == 2:
            pv = p * svj[None, :]
        acc = tl.dot(pv.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    return m_i, l_i, acc


@triton.jit
def _kvq_decode_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, BT_ptr, Lens_ptr, O_ptr, Lse_ptr,
    h_kv, group, d, split_keys, sm_scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt_b, stride_bt_p,
    stride_o_split, stride_ob, stride_oh, stride_l_split, stride_lb, stride_lh,
    FMT: tl.constexpr, GRAN: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    FAST_CVT: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    b = pid // h_kv
    kv_head = pid % h_kv
    split = tl.program_id(1)
    L = tl.load(Lens_ptr + b)
    start = tl.minimum(split * split_keys, L)
    end = tl.minimum(start + split_keys, L)

    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < group
    head = kv_head * group + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < d
    q = tl.load(Q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E  # log2-domain logits
    sv = 1.0
    if GRAN == 0:
        qk_scale = qk_scale * tl.load(KS_ptr)
        sv = tl.load(VS_ptr)
    elif GRAN == 1:
        qk_scale = qk_scale * tl.load(KS_ptr + kv_head)
        sv = tl.load(VS_ptr + kv_head)

    K_base = K_ptr + kv_head.to(tl.int64) * stride_kh
    V_base = V_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row = BT_ptr + b.to(tl.int64) * stride_bt_b
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend(q, K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head, start, end, qk_scale, m_i, l_i, acc,
                            offs_d, mask_d, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh,
                            stride_bt_p, FMT, GRAN, PAGE, BLOCK_N, EVEN_D, DOT_PRECISION, FAST_CVT)
    o = acc * (sv / tl.where(l_i > 0.0, l_i, 1.0))[:, None]  # no key: O = 0
    o_ptrs = (O_ptr + split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh, lse,
             mask=mask_m)


def check_cache(op: str, q_layout: str, q, k_cache, v_cache, k_scale, v_scale, max_group: int | None = None,
                **more) -> str:
    """ValueError (one line naming `op` and the argument) unless q (q_layout: its shape's names), the quantized
    cache and its scales are valid, and every tensor of `more` is one on q's device; the scale granularity."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.stride(-1) != 1:
        raise ValueError(f"{op}: q must be {q_layout} fp32 / fp16 / bf16 with last-dim stride 1, "
                         f"got {tuple(q.shape)} {q.dtype} strides {q.stride()}")
    _, h_q, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim d={d} must be in [1, {MAX_HEAD_DIM}]")
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"{op}: k_cache, v_cache must be (num_blocks, page, h_kv, d={d}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in FORMATS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k_cache, v_cache must share one code dtype of int8, float8_e4m3fn, "
                         f"float8_e5m2, got {k_cache.dtype} and {v_cache.dtype}")
    if d > 1 and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(f"{op}: k_cache, v_cache must have last-dim stride 1, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv or (max_group is not None and h_q // h_kv > max_group):
        most = f", at most {max_group} query heads a kv head" if max_group is not None else ""
        raise ValueError(f"{op}: h_q={h_q} must be a multiple of h_kv={h_kv}{most}")
    grans = {(nb, page, h_kv): "token", (h_kv,): "head", (1,): "tensor"}
    gk, gv = grans.get(tuple(k_scale.shape)), grans.get(tuple(v_scale.shape))
    if gk is None or gk != gv or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise ValueError(f"{op}: k_scale, v_scale must be float32 of one shape: (1,), ({h_kv},) or "
                         f"({nb}, {page}, {h_kv}), got {tuple(k_scale.shape)} {k_scale.dtype} and "
                         f"{tuple(v_scale.shape)} {v_scale.dtype}")
    if gk == "token" and k_scale.stride() != v_scale.stride():
        raise ValueError(f"{op}: k_scale, v_scale caches must share strides, got {k_scale.stride()} "
                         f"and {v_scale.stride()}")
    return gk


def check_args(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens) -> str:
    """ValueError (one line naming the argument) unless the arguments are valid; the granularity."""
    gk = check_cache("kvquant.decode_paged", "(b, h_q, d)", q, k_cache, v_cache, k_scale, v_scale, MAX_GROUP,
                     block_table=block_table, seq_lens=seq_lens)
    b = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise ValueError(f"kvquant.decode_paged: block_table must be ({b}, max_pages) int32, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if tuple(seq_lens.shape) != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"kvquant.decode_paged: seq_lens must be ({b},) int32, got {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype}")
    return gk


def outputs(q: torch.Tensor, out: torch.Tensor | None, out_lse: torch.Tensor | None,
            op: str = "kvquant.decode_paged") -> tuple[torch.Tensor, torch.Tensor]:
    """(out, out_lse) of a decode of q (b, h_q, d): allocated where None, else ValueError (one line) unless out is
    (b, h_q, d) q's dtype with last-dim stride 1 and out_lse (b, h_q) float32, both on q's device."""
    b, h_q, d = q.shape
    if out is None:
        out = torch.empty((b, h_q, d), dtype=q.dtype, device=q.device)
    if tuple(out.shape) != (b, h_q, d) or out.dtype != q.dtype or out.device != q.device or \
            (d > 1 and out.stride(-1) != 1):
        raise ValueError(f"{op}: out must be ({b}, {h_q}, {d}) {q.dtype} with last-dim stride 1")
    if out_lse is None:
        out_lse = torch.empty((b, h_q), dtype=torch.float32, device=q.device)
    if tuple(out_lse.shape) != (b, h_q) or out_lse.dtype != torch.float32 or out_lse.device != q.device:
        raise ValueError(f"{op}: out_lse must be ({b}, {h_q}) float32 on {q.device}")
    return out, out_lse


def partials(out: torch.Tensor, out_lse: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a split kernel writes: fp32 partials (splits, b, h_q, d) and (splits, b, h_q) for merge_splits, or
    out / out_lse themselves (a leading axis of 1) with one split."""
    if splits == 1:
        return out.unsqueeze(0), out_lse.unsqueeze(0)
    return (torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device),
            torch.empty((splits, *out_lse.shape), dtype=torch.float32, device=out.device))


def merge_splits(o_dst: torch.Tensor, l_dst: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """The partials of `partials` merged into out / out_lse by lse_combine (nothing to do with one split); through
    a copy where out's rows are not one (b h_q, d) view."""
    splits, (b, h_q, d) = o_dst.shape[0], out.shape
    if splits == 1:
        return
    rows = b * h_q
    try:
        o_rows, l_rows = out.view(rows, d), out_lse.view(rows)
    except RuntimeError:
        o_rows = l_rows = None
    if o_rows is None:
        o2, l2 = lse_combine(o_dst.view(splits, rows, d), l_dst.view(splits, rows),
                             out=torch.empty((rows, d), dtype=out.dtype, device=out.device))
        out.copy_(o2.view(b, h_q, d))
        out_lse.copy_(l2.view(b, h_q))
    else:
        lse_combine(o_dst.view(splits, rows, d), l_dst.view(splits, rows), out=o_rows, out_lse=l_rows)


def _split_keys(q: torch.Tensor, b: int, h_kv: int, max_keys: int, block_n: int) -> int:
    if not q.is_cuda:
        return SPLIT_KEYS_CPU
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = max(1, triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, max(b * h_kv, 1)))
    keys = max(MIN_SPLIT_KEYS, triton.cdiv(max_keys, want))
    return triton.cdiv(keys, block_n) * block_n


def _code_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int8 else t.view(torch.uint8)


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 scale: float | None = None, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 split_keys: int | None = None,
                 config: tuple[int, ...] | None = None,
                 fast_cvt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode of one new token a sequence over a paged quantized cache.

    q: (b, h_q, d) fp32 / fp16 / bf16, d <= 256, last-dim stride 1
    k_cache, v_cache: (num_blocks, page, h_kv, d) int8 | float8_e4m3fn | float8_e5m2, last-dim stride 1
    k_scale, v_scale: float32 (1,) per tensor, (h_kv,) per kv head, or (num_blocks, page, h_kv) per token
    block_table: (b, max_pages) int32; entries past a sequence's last page are never read
    seq_lens: (b,) int32, 0 <= seq_lens[b] <= max_pages * page (the caller's guarantee)
    out: (b, h_q, d) q's dtype, last-dim stride 1; out_lse: (b, h_q) float32 (allocated if None)
    split_keys: keys a split (a multiple of BLOCK_N is used); None: the module docstring's choice
    config: (BLOCK_N, num_warps, num_stages[, maxnreg]) (tuning); None: CONFIGS by the padded head dim
    fast_cvt: 0 Triton's casts; 1 the integer-pipe FP8 -> bf16 conversion; 2 that, V converted before its
        trip through shared memory; None: 2 on a GPU for a bf16 q over an FP8 cache, else 0 (the interpreter
        has no inline assembly; fp16 / fp32 q and int8 codes take the casts)
    returns (out, out_lse): LSE natural log, -inf (and O = 0) for seq_lens[b] = 0
    """
    gran = check_args(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens)
    b, h_q, d = q.shape
    nb, page, h_kv, _ = k_cache.shape
    out, out_lse = outputs(q, out, out_lse)
    if b == 0 or h_q == 0:
        return out, out_lse
    group = h_q // h_kv
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, triton.next_power_of_2(group))
    block_n, num_warps, num_stages, *regs = config or CONFIGS[block_d]
    launch = {"maxnreg": regs[0]} if regs and regs[0] else {}
    max_keys = block_table.shape[1] * page
    keys = _split_keys(q, b, h_kv, max_keys, block_n) if split_keys is None else int(split_keys)
    if keys < 1:
        raise ValueError(f"kvquant.decode_paged: split_keys={split_keys} must be >= 1")
    keys = triton.cdiv(keys, block_n) * block_n
    splits = max(1, triton.cdiv(max_keys, keys))
    if b * h_kv >= 2**31 or splits > 65535:
        raise ValueError(f"kvquant.decode_paged: grid ({b * h_kv}, {splits}) exceeds CUDA's limits")
    o_dst, l_dst = partials(out, out_lse, splits)
    s_strides = k_scale.stride() if gran == "token" else (0, 0, 0)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    interpret = not q.is_cuda  # the interpreter: dots in fp32 (module docstring)
    can_fast = not interpret and q.dtype == torch.bfloat16 and k_cache.dtype != torch.int8
    if fast_cvt is None:
        fast_cvt = 2 if can_fast else 0
    elif fast_cvt not in (0, 1, 2) or (fast_cvt and not can_fast):
        raise ValueError(f"kvquant.decode_paged: fast_cvt={fast_cvt} must be 0, or 1 / 2 on a GPU for a bf16 q over "
                         f"an FP8 cache")
    _kvq_decode_kernel[(b * h_kv, splits)](
        q, _code_view(k_cache), _code_view(v_cache), k_scale, v_scale, block_table, seq_lens, o_dst, l_dst,
        h_kv, group, d, keys, sm_scale,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *s_strides, *block_table.stride(),
        *o_dst.stride()[:3], *l_dst.stride(),
        FMT=FORMATS[k_cache.dtype], GRAN=GRANS.index(gran), PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == d, DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
        DOT_FP32=interpret, FAST_CVT=fast_cvt,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    merge_splits(o_dst, l_dst, out, out_lse)
    return out, out_lse
