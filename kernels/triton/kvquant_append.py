"""One decode step over a quantized paged KV cache in Triton (kvquant.append_decode): the new token's K / V
quantized into the cache and attended over, in ONE kernel launch.

    slot_b  = block_table[b, L_b // page] * page + L_b % page       L_b = seq_lens[b] (before the append)
    codes   = Q(k_new / s), Q(v_new / s)                            kvquant.update's rules (kernels/triton/kvquant.py)
    O, LSE  = flash decoding over keys 0 .. L_b, key L_b the new one AS QUANTIZED (its code x its scale)

Golden: refimpl/kvquant_append.py (kvquant.update's golden, then kvquant.decode_paged's on the updated cache).

Schedule: kernels/triton/kvquant_decode.py's (a program per (sequence, kv head, split), all the kv head's query
heads packed as the M dimension of the dots, splits of C keys merged by kernels.triton.combine.lse_combine), over
L_b + 1 keys. The write has no ordering problem between programs: exactly one program of each (sequence, kv
head) has the new key's position L_b in its split [s C, (s + 1) C); that program (the designated writer)
quantizes the new rows in registers, stores their codes (and, gran token, their scales) at slot_b, and folds the
new key into its online softmax FROM THE REGISTERS, as the codes it stored (the stored bytes converted back with
kvquant_decode's `_codes`), after its cached keys [s C, L_b). No program reads the new slot from memory, so none
can see it before the write lands; the other splits never reach position L_b.

Quantization (kernels/triton/kvquant.py): x / s with tl.math.div_rn (the IEEE division; Triton's `/` on fp32 is
approximate on the GPU), e4m3 / e5m2 clamp to +-FMAX then the fp8 cast (nearest even, saturating), int8 clamp then
round half to even as (v + 1.5 2^23) - 1.5 2^23; s = 0 (a zero row, gran token): codes 0. The dynamic scale
amax_d |x| / FMAX (div_rn) is stored in the scale cache and scales the new key's logit and probability.

Logits: scale * s_k(j) * (q . codes_j) with the codes converted exactly to q's dtype (per tensor / per head s_k
folds into the logit scale and s_v into the final 1 / l; per token the fp32 logits and probabilities take s_k(j),
s_v(j)). The new key's dot is a fp32 row sum of q x its codes (exact products), its probability times its code
row added to the fp32 accumulator.

The cached keys go through kvquant_decode's `_attend` (one loop for both ops; on a GPU with a bf16 q over an FP8
cache, its integer-pipe FP8 -> bf16 conversion, fast_cvt 2). Launches: the write and the attention are one kernel;
with several splits the partials are merged by a second launch (kernels.triton.combine.lse_combine, as
kvquant.decode_paged), which reads no cache. On a GPU (H200): ci, fresh seeds and the models cases pass.

On the interpreter (a CPU tensor) the dots take fp32 operands (as kvquant_decode: Triton 3.9's interpreter
miscomputes a tl.dot of an operand cast to bf16 in the kernel), and the split is SPLIT_KEYS_CPU keys.

Status: checked on the interpreter and on an H200 (ci 48 pass, fresh seeds, the models cases); not timed. The
schedule and CONFIGS are kvquant_decode's (whose d = 128 row was measured on an H200); the write adds one
(BLOCK_D,) row per (sequence, kv head) to the designated program, whose cost should be lost in the 32K-key read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kvquant_decode import _attend, _codes, merge_splits, partials

FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2}
FMT_NAMES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}
GRANS = ("tensor", "head", "token")
FMAX = {0: 448.0, 1: 57344.0, 2: 127.0}
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + M - M rounds v to an integer, half to even, for |v| <= 2^22
MAX_HEAD_DIM = 256
MAX_GROUP = 64
SPLIT_KEYS_CPU = 512
MIN_SPLIT_KEYS = 1024
SPLIT_PROGRAMS_PER_SM = 8
# (BLOCK_N, num_warps, num_stages) by padded head dim: kvquant_decode's measured d = 128 row, the rest guesses
CONFIGS = {16: (128, 4, 2), 32: (128, 4, 2), 64: (128, 4, 2), 128: (128, 4, 2), 256: (64, 4, 2)}


@triton.jit
def _quantize_row(x, s, FMT: tl.constexpr, QMAX: tl.constexpr):
    """uint8 codes of fp32 x (BLOCK_D,) at the fp32 scale s: Q(x / s), s = 0 -> 0 (kernels/triton/kvquant.py)."""
    zero = s == 0.0
    v = tl.math.div_rn(x, tl.where(zero, 1.0, s))
    v = tl.where(zero, 0.0, v)
    if FMT == 2:
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        v = (v + RNE_MAGIC) - RNE_MAGIC
        q = v.to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)  # saturate (__NV_SATFINITE)
        if FMT == 0:
            q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return q


@triton.jit
def _code_values(q8, FMT: tl.constexpr, OUT: tl.constexpr):
    """The values of stored bytes q8 (uint8), as `_codes` reads them from the cache (int8 as its signed view)."""
    if FMT == 2:
        return _codes(q8.to(tl.int8, bitcast=True), FMT, OUT)
    return _codes(q8, FMT, OUT)


@triton.jit
def _kvq_append_kernel(
    Q_ptr, KN_ptr, VN_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, BT_ptr, Lens_ptr, O_ptr, Lse_ptr,
    h_kv, group, d, split_keys, sm_scale,
    stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt_b, stride_bt_p,
    stride_o_split, stride_ob, stride_oh, stride_l_split, stride_lb, stride_lh,
    FMT: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, FAST_CVT: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    b = pid // h_kv
    kv_head = pid % h_kv
    split = tl.program_id(1)
    L = tl.load(Lens_ptr + b)  # cached keys before the append; the new key is key L
    start = tl.minimum(split * split_keys, L + 1)
    end = tl.minimum(start + split_keys, L + 1)
    cache_end = tl.minimum(end, L)  # this split's cached keys: [start, cache_end)

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
    m_i, l_i, acc = _attend(q, K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head, start, cache_end, qk_scale, m_i,
                            l_i, acc, offs_d, mask_d, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb,
                            stride_ss, stride_sh, stride_bt_p, FMT, GRAN, PAGE, BLOCK_N, EVEN_D, DOT_PRECISION,
                            FAST_CVT)

    if (start <= L) & (L < end):  # the designated writer: the new key is in this split
        new_page = tl.load(bt_row + (L // PAGE) * stride_bt_p).to(tl.int64)
        new_slot = L % PAGE
        kx = tl.load(KN_ptr + b.to(tl.int64) * stride_knb + kv_head * stride_knh + offs_d, mask=mask_d,
                     other=0.0).to(tl.float32)
        vx = tl.load(VN_ptr + b.to(tl.int64) * stride_vnb + kv_head * stride_vnh + offs_d, mask=mask_d,
                     other=0.0).to(tl.float32)
        if GRAN == 2:  # dynamic: amax / FMAX, stored beside the codes
            skn = tl.math.div_rn(tl.max(tl.abs(kx), axis=0), QMAX)
            svn = tl.math.div_rn(tl.max(tl.abs(vx), axis=0), QMAX)
            s_off_new = new_page * stride_sb + new_slot * stride_ss + kv_head * stride_sh
            tl.store(KS_ptr + s_off_new, skn)
            tl.store(VS_ptr + s_off_new, svn)
        elif GRAN == 1:
            skn = tl.load(KS_ptr + kv_head)
            svn = tl.load(VS_ptr + kv_head)
        else:
            skn = tl.load(KS_ptr)
            svn = tl.load(VS_ptr)
        kq8 = _quantize_row(kx, skn, FMT, QMAX)
        vq8 = _quantize_row(vx, svn, FMT, QMAX)
        tl.store(K_base + new_page * stride_kb + new_slot * stride_ks + offs_d, kq8.to(K_ptr.dtype.element_ty,
                 bitcast=True), mask=mask_d)
        tl.store(V_base + new_page * stride_vb + new_slot * stride_vs + offs_d, vq8.to(V_ptr.dtype.element_ty,
                 bitcast=True), mask=mask_d)
        # the new key as the cache now holds it: its codes (exact in fp32), times its scale
        kn = _code_values(kq8, FMT, tl.float32)
        vn = _code_values(vq8, FMT, tl.float32)
        qk_n = tl.sum(q.to(tl.float32) * kn[None, :], axis=1) * qk_scale  # (BLOCK_M,) fp32
        if GRAN == 2:
            qk_n = qk_n * skn
        m_new = tl.maximum(m_i, qk_n)
        p_n = tl.exp2(qk_n - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + p_n
        pv_n = p_n
        if GRAN == 2:
            pv_n = p_n * svn
        acc = acc * alpha[:, None] + pv_n[:, None] * vn[None, :]
        m_i = m_new

    o = acc * (sv / tl.where(l_i > 0.0, l_i, 1.0))[:, None]  # an empty split: O = 0
    o_ptrs = (O_ptr + split.to(tl.int64) * stride_o_split + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse_ptr + split.to(tl.int64) * stride_l_split + b.to(tl.int64) * stride_lb + head * stride_lh, lse,
             mask=mask_m)


def _bad(msg: str) -> None:
    raise ValueError(f"kvquant.append_decode: {msg}")


def check_args(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, fmt, gran, k_scale, v_scale,
               k_scale_cache, v_scale_cache) -> None:
    """ValueError (one line naming the argument and what was expected) unless the call is well formed. Values
    (seq_lens + 1 within the table, live table entries in range, distinct new slots) are the caller's guarantee:
    checking them would sync the device."""
    if fmt not in FMT_NAMES:
        _bad(f"fmt={fmt!r} must be one of {', '.join(FMT_NAMES)}")
    if gran not in GRANS:
        _bad(f"gran={gran!r} must be one of {', '.join(GRANS)}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            _bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            _bad(f"{name} is on {t.device}, q on {q.device}")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if q.dim() != 3 or q.dtype not in floats or q.stride(-1) != 1:
        _bad(f"q must be (b, h_q, d) fp32 / fp16 / bf16 with last-dim stride 1, got {tuple(q.shape)} {q.dtype}")
    b, h_q, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        _bad(f"head dim d={d} must be in [1, {MAX_HEAD_DIM}]")
    want = FMT_NAMES[fmt]
    if k_cache.dim() != 4 or k_cache.shape[-1] != d or tuple(v_cache.shape) != tuple(k_cache.shape) \
            or k_cache.dtype != want or v_cache.dtype != want:
        _bad(f"k_cache, v_cache must both be (num_blocks, page, h_kv, d={d}) {want} for fmt {fmt}, got "
             f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if d > 1 and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        _bad("k_cache, v_cache must have last-dim stride 1")
    nb, page, h_kv, _ = k_cache.shape
    if h_kv < 1 or h_q % h_kv or h_q // h_kv > MAX_GROUP:
        _bad(f"h_q={h_q} must be a multiple of h_kv={h_kv}, at most {MAX_GROUP} query heads a kv head")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (b, h_kv, d) or t.dtype not in floats or (d > 1 and t.stride(-1) != 1):
            _bad(f"{name} must be ({b}, {h_kv}, {d}) fp32 / fp16 / bf16 with last-dim stride 1, got "
                 f"{tuple(t.shape)} {t.dtype}")
    if gran == "token":
        if k_scale is not None or v_scale is not None:
            _bad("gran token computes its scales: k_scale, v_scale must be None")
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (nb, page, h_kv) or t.dtype != torch.float32 \
                    or t.device != q.device:
                _bad(f"gran token needs {name}, a ({nb}, {page}, {h_kv}) float32 tensor on {q.device}")
        if k_scale_cache.stride() != v_scale_cache.stride():
            _bad(f"k_scale_cache, v_scale_cache must share strides, got {k_scale_cache.stride()} and "
                 f"{v_scale_cache.stride()}")
    else:
        if k_scale_cache is not None or v_scale_cache is not None:
            _bad(f"gran {gran} has static scales: k_scale_cache, v_scale_cache must be None")
        shape = (1,) if gran == "tensor" else (h_kv,)
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32 \
                    or t.device != q.device or t.stride(0) not in (0, 1) and shape != (1,):
                _bad(f"gran {gran} needs {name}, a {shape} float32 tensor on {q.device} (stride 1)")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        _bad(f"block_table must be ({b}, max_pages) int32, got {tuple(block_table.shape)} {block_table.dtype}")
    if tuple(seq_lens.shape) != (b,) or seq_lens.dtype != torch.int32:
        _bad(f"seq_lens must be ({b},) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")


def _split_keys(q: torch.Tensor, b: int, h_kv: int, max_keys: int, block_n: int) -> int:
    if not q.is_cuda:
        return SPLIT_KEYS_CPU
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = max(1, triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, max(b * h_kv, 1)))
    keys = max(MIN_SPLIT_KEYS, triton.cdiv(max_keys, want))
    return triton.cdiv(keys, block_n) * block_n


def _code_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int8 else t.view(torch.uint8)


def append_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, fmt: str, gran: str, *,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None,
                  scale: float | None = None, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                  split_keys: int | None = None,
                  config: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: quantize (k_new, v_new) into the caches at position seq_lens[b] (in place; gran token also
    writes the scale caches) and attend q over the seq_lens[b] + 1 keys.

    q: (b, h_q, d) fp32 / fp16 / bf16, d <= 256; k_new, v_new: (b, h_kv, d) fp32 / fp16 / bf16 (last-dim stride 1)
    k_cache, v_cache: (num_blocks, page, h_kv, d) of fmt's storage (float8_e4m3fn, float8_e5m2, int8), written
    block_table: (b, max_pages) int32; seq_lens: (b,) int32, seq_lens[b] + 1 <= max_pages * page (the caller's)
    k_scale, v_scale: (1,) (tensor) / (h_kv,) (head) float32; k_scale_cache, v_scale_cache: (num_blocks, page,
        h_kv) float32 (token), written at the new slots
    returns (out (b, h_q, d) q's dtype, out_lse (b, h_q) float32, natural log)
    """
    check_args(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, fmt, gran, k_scale, v_scale,
               k_scale_cache, v_scale_cache)
    b, h_q, d = q.shape
    nb, page, h_kv, _ = k_cache.shape
    if out is None:
        out = torch.empty((b, h_q, d), dtype=q.dtype, device=q.device)
    if tuple(out.shape) != (b, h_q, d) or out.dtype != q.dtype or out.device != q.device or \
            (d > 1 and out.stride(-1) != 1):
        _bad(f"out must be ({b}, {h_q}, {d}) {q.dtype} with last-dim stride 1")
    if out_lse is None:
        out_lse = torch.empty((b, h_q), dtype=torch.float32, device=q.device)
    if tuple(out_lse.shape) != (b, h_q) or out_lse.dtype != torch.float32 or out_lse.device != q.device:
        _bad(f"out_lse must be ({b}, {h_q}) float32 on {q.device}")
    if b == 0 or h_q == 0:
        return out, out_lse
    group = h_q // h_kv
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, triton.next_power_of_2(group))
    block_n, num_warps, num_stages = config or CONFIGS[block_d]
    max_keys = block_table.shape[1] * page
    keys = _split_keys(q, b, h_kv, max_keys, block_n) if split_keys is None else int(split_keys)
    if keys < 1:
        _bad(f"split_keys={split_keys} must be >= 1")
    keys = triton.cdiv(keys, block_n) * block_n
    splits = max(1, triton.cdiv(max_keys, keys))
    if b * h_kv >= 2**31 or splits > 65535:
        _bad(f"grid ({b * h_kv}, {splits}) exceeds CUDA's limits")
    o_dst, l_dst = partials(out, out_lse, splits)
    token = gran == "token"
    ks = k_scale_cache if token else k_scale
    vs = v_scale_cache if token else v_scale
    s_strides = k_scale_cache.stride() if token else (0, 0, 0)
    fcode = FORMATS[k_cache.dtype]
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    interpret = not q.is_cuda
    fast = 2 if not interpret and q.dtype == torch.bfloat16 and k_cache.dtype != torch.int8 else 0  # decode's rule
    _kvq_append_kernel[(b * h_kv, splits)](
        q, k_new, v_new, _code_view(k_cache), _code_view(v_cache), ks, vs, block_table, seq_lens, o_dst, l_dst,
        h_kv, group, d, keys, sm_scale,
        *q.stride()[:2], *k_new.stride()[:2], *v_new.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *s_strides, *block_table.stride(), *o_dst.stride()[:3], *l_dst.stride(),
        FMT=fcode, GRAN=GRANS.index(gran), QMAX=FMAX[fcode], PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=block_d == d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32", DOT_FP32=interpret,
        FAST_CVT=fast, num_warps=num_warps, num_stages=num_stages,
    )
    merge_splits(o_dst, l_dst, out, out_lse)
    return out, out_lse
