"""Paged decode attention over an FP8 KV cache (kvquant.decode_paged) in Gluon (Hopper): one warp a program, the
codes through a ring of asynchronous copies straight into the tensor-core operands' registers.

The arithmetic of kernels/triton/kvquant_decode.py (its docstring states the conventions): S = q K^T over the
codes converted exactly to bf16, the scales outside the dots, an online softmax in base 2, P rounded to bf16
for the P V dot, fp32 accumulation; splits merged by kernels.triton.combine.lse_combine. What differs is where
the bytes go and how the conversion is paid for. The Triton kernel (four warps, 128-key tiles, 8-bit tiles
through shared memory in the dots' layouts) stayed latency-bound on the H200 at 65% of the read ceiling. Here:
- a program is one warp: (sequence x kv head, split), keys [s C, min((s + 1) C, L_b)), 16 keys a step. Its
  steps' codes go to a ring of STAGES shared-memory stages by cp.async (16 bytes a lane, swizzled: no bank
  conflicts), STAGES - 1 steps in flight; each lane copies exactly the chunks it reads back, and no data
  crosses lanes between the ring and the dots;
- the S dot (mma.sync m16n8k16: M the GQA group padded to 16, N 16 keys, K d) takes K^T as its B operand, where
  a lane holds 4 of each 16 dims of its two keys. The dims are relabelled (the same permutation for q and K: a
  dot does not care which dims it pairs, only that both operands agree) so that a lane's dims of a key are d / 4
  adjacent bytes: 16-byte reads, converted in place;
- the O dot is transposed, O^T = V^T P^T (M d, N the group padded to 8 or 16, K 16 keys): the accumulator is
  d x 8, not 16 x d (half the registers of P V for groups up to 8), and P^T's B operand is P's first rows where
  the S accumulator left them (no data movement). V^T is the A operand: a lane holds 4 keys of d / 8 output rows;
  the rows are relabelled (row t of the dot is byte (d / 8)(t % 8) + t // 8 of a key) so that they are d / 8
  adjacent bytes, and O is stored through the inverse relabelling;
- the conversion (FP8 -> bf16 on the integer pipes, kernels/triton/kvquant_decode.py `_FP8_BF16_ASM`) drops its
  multiply: the bit moves alone give code x 2^-POW exactly (POW = 120 for e4m3, 112 for e5m2; subnormal codes
  become bf16 subnormals, which the tensor cores take as they are). The 2^POW goes into q (a power of two a row,
  as large as bf16 keeps the row finite; the rest joins the row's logit scale) and into P (times 2^POW before its
  rounding to bf16), exactly. V's conversion also pairs its two keys of a register (the A operand's k pairs) in
  the same instructions (_PAIR_ASM), where Triton's layout change took a PRMT a register;
- rows 8-15 of q repeat rows 0-7 (groups up to 8): with zeros there, ptxas rebuilt q's fragments around its zero
  register at every step.
On the H200 (Llama-3-8B heads, 32,768 tokens, e4m3 per tensor, CUDA-graph timing; reports/baselines/
issue34f-h200/) this runs 471 SASS instructions a 16-key step in a warp of 144 registers (12 warps an SM): b 32
566 us, 90.4% of the read ceiling and 2.35x the bf16-cache decode (87-88% on the machines of earlier calls);
the same kernel with the arithmetic removed (`probe`) reads at 97% of the ceiling, so the rest is the
arithmetic's latency (Nsight Compute: 2.7 active and 0.9 eligible warps a scheduler, the ALU pipe 64% busy).

Scope: a bf16 q, e4m3 / e5m2 codes, d 64 or 128, a GQA group of at most 16, any page size, scales per tensor,
per kv head or per token, codes readable as 32-bit words. Other cases are the Triton kernel's (`supports`).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_N = 16  # keys a step (one k-tile of the O dot)
BLOCK_M = 16  # the GQA group, padded to mma.sync's M
HEAD_DIMS = (64, 128)
STAGES = 4  # the ring's steps (3 in flight); 3, 5, 6 measured no faster at b 32 (6: 5% slower, shared memory)
MAXNREG = 144  # registers a thread for groups <= 8 (ptxas's own choice: 142-162; 12 warps an SM either way)
SPLIT_PROGRAMS_PER_SM = 8  # the default split: about this many programs an SM ...
MIN_SPLIT_KEYS = 256  # ... of MIN_SPLIT_KEYS to MAX_SPLIT_KEYS keys each
MAX_SPLIT_KEYS = 2048
POW = {0: 120, 1: 112}  # 127 - the format's exponent bias: the converted code is its value times 2^-POW
_BN = gl.constexpr(BLOCK_N)
_BM = gl.constexpr(BLOCK_M)
_LN2 = gl.constexpr(LN2)
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # 3.9 / 3.6 name

# Four codes of a word -> four bf16 (two registers), code x 2^-POW: each byte moved to the top of a 16-bit lane,
# its exponent and mantissa shifted under bf16's, its sign kept (exact for every finite code)
_RAW_ASM = """{
.reg .b32 lo, hi, slo, shi;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
and.b32 slo, lo, 0x80008000;
and.b32 shi, hi, 0x80008000;
shr.b32 lo, lo, SHIFT;
shr.b32 hi, hi, SHIFT;
and.b32 lo, lo, MASK;
and.b32 hi, hi, MASK;
or.b32 $0, lo, slo;
or.b32 $1, hi, shi;
}"""
# Words a (key 2r, inputs $4-$7: four copies) and b (key 2r + 1, $8-$11) of the same four dims -> four registers,
# register j = (a's code j, b's code j): V^T's A operand pairs keys in a register. Each PRMT's spare bytes (0 and
# 2) fall under the mask.
_PAIR_ASM = """{
.reg .b32 x, s;
""" + "".join(f"""prmt.b32 x, $4, $8, {(4 + j) * 0x1100 + j * 0x11:#06x};
and.b32 s, x, 0x80008000;
shr.b32 x, x, SHIFT;
and.b32 x, x, MASK;
or.b32 ${j}, x, s;
""" for j in range(4)) + "}"
_E4M3_RAW: gl.constexpr = gl.constexpr(_RAW_ASM.replace("SHIFT", "4").replace("MASK", "0x07F007F0"))
_E5M2_RAW: gl.constexpr = gl.constexpr(_RAW_ASM.replace("SHIFT", "3").replace("MASK", "0x0FE00FE0"))
_E4M3_PAIR: gl.constexpr = gl.constexpr(_PAIR_ASM.replace("SHIFT", "4").replace("MASK", "0x07F007F0"))
_E5M2_PAIR: gl.constexpr = gl.constexpr(_PAIR_ASM.replace("SHIFT", "3").replace("MASK", "0x0FE00FE0"))


@gluon.constexpr_function
def _mma():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _k_layout(d):
    """K code words [16 keys, d / 4, 4] (int32, the last dim a broadcast: _k_operand): lane (q, c) = (lane // 4,
    lane % 4) holds keys q, q + 8 and words [c d / 16, (c + 1) d / 16) of each."""
    d = int(getattr(d, "value", d))
    return gl.BlockedLayout([1, d // 16, 4], [8, 4, 1], [1, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _v_layout(d):
    """V code words as [8 key pairs r, d / 4 words, 2 (key 2r + kbit), 4 copies]: lane (q, c) holds key pairs c,
    c + 4 (keys 2c, 2c + 1, 2c + 8, 2c + 9: the A operand's k of lane c) and words [q d / 32, (q + 1) d / 32);
    the copies and kbit are the fastest registers (one _PAIR_ASM call takes those 8)."""
    d = int(getattr(d, "value", d))
    w = d // 32
    regs = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0]] + [[0, 1 << i, 0, 0] for i in range(w.bit_length() - 1)] + \
        [[4, 0, 0, 0]]
    lanes = [[1, 0, 0, 0], [2, 0, 0, 0]] + [[0, w << i, 0, 0] for i in range(3)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[8, d // 4, 2, 4])


@gluon.constexpr_function
def _v_copy_layout(d):
    """V code words [16 keys, d / 4] as the lanes of _v_layout hold them (the copies into the ring)."""
    d = int(getattr(d, "value", d))
    w = d // 32
    regs = [[0, 1 << i] for i in range(w.bit_length() - 1)] + [[1, 0], [8, 0]]
    lanes = [[2, 0], [4, 0]] + [[0, w << i] for i in range(3)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[16, d // 4])


@gluon.jit
def _k_operand(kw, FMT: gl.constexpr, D: gl.constexpr):
    """K code words [16, D / 4, 4] (each word 4 times along the last dim) in _k_layout -> K^T [D, 16] bf16 (code x
    2^-POW) as the S dot's B operand, dims relabelled: lane c's byte (D / 4) c + 4 i + 2 h + e is dim
    16 i + 8 h + 2 c + e (the B operand's dims of lane c in k-tile i). Words, not 8-bit elements: Triton keeps
    8-bit tensors a byte a register and repacks them for the assembly (7 PRMT a word); the assembly reads the
    first of a word's four copies."""
    if FMT == 0:
        k = gl.inline_asm_elementwise(_E4M3_RAW, "=r,=r,r,r,r,r", [kw], dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        k = gl.inline_asm_elementwise(_E5M2_RAW, "=r,=r,r,r,r,r", [kw], dtype=gl.bfloat16, is_pure=True, pack=4)
    k = k.reshape([_BN, 4, D // 16, 2, 2]).permute([0, 2, 3, 1, 4]).reshape([_BN, D])
    return gl.convert_layout(k.permute([1, 0]), gl.DotOperandLayout(operand_index=1, parent=_mma(), k_width=2))


@gluon.jit
def _vt_operand(vp, FMT: gl.constexpr, D: gl.constexpr):
    """V code words [8, D / 4, 2, 4] in _v_layout -> V^T [D, 16] bf16 (code x 2^-POW) as O^T's A operand, rows
    relabelled: lane q's byte (D / 8) q + j is row q + 8 j (the A operand's rows of lane q). Element (r, w, kbit,
    c) of the assembly's output is register j = 2 kbit + c // 2's half c % 2: the code of key 2r + c % 2 at
    byte 4w + 2 kbit + c // 2."""
    if FMT == 0:
        y = gl.inline_asm_elementwise(_E4M3_PAIR, "=r,=r,=r,=r" + ",r" * 8, [vp], dtype=gl.bfloat16, is_pure=True,
                                      pack=8)
    else:
        y = gl.inline_asm_elementwise(_E5M2_PAIR, "=r,=r,=r,=r" + ",r" * 8, [vp], dtype=gl.bfloat16, is_pure=True,
                                      pack=8)
    v = y.reshape([8, D // 4, 2, 2, 2]).permute([0, 4, 1, 2, 3]).reshape([_BN, D])
    v = v.reshape([_BN, 8, D // 8]).permute([0, 2, 1]).reshape([_BN, D])
    return gl.convert_layout(v.permute([1, 0]), gl.DotOperandLayout(operand_index=0, parent=_mma(), k_width=2))


@gluon.jit
def _top8(x):
    """Rows 0-7 of x [16, N]."""
    lo, hi = gl.split(x.reshape([2, 8, x.shape[1]]).permute([1, 2, 0]))
    return lo


@gluon.jit
def _top8_1d(x):
    """x[0:8] of x [16]."""
    lo, hi = gl.split(x.reshape([2, 8]).permute([1, 0]))
    return lo


@gluon.jit
def _pow2(e):
    """2^e (fp32, exact) for an int32 tensor e in [-126, 127]."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _rows(bt_row, start_n, end, stride_bt_p, stride_b, stride_s, offs, PAGE: gl.constexpr):
    """(row offsets in a cache plane, live) of keys start_n + offs: one page lookup a step where a step is 16
    slots of one page (start_n is a multiple of 16), else one a key."""
    cols = start_n + offs
    live = cols < end
    if PAGE % _BN == 0:
        pg = gl.load(bt_row + (start_n // PAGE) * stride_bt_p, mask=start_n < end, other=0)
        rows = (pg.to(gl.int64) * stride_b + (start_n % PAGE) * stride_s) + (offs * stride_s).to(gl.int64)
    else:
        page = gl.load(bt_row + (cols // PAGE) * stride_bt_p, mask=live, other=0).to(gl.int64)
        rows = page * stride_b + (cols % PAGE) * stride_s
    return rows, live


@gluon.jit
def _step_copies(ks_ring, vs_ring, sks_ring, svs_ring, st, K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head, start_n,
                 end, stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh, stride_bt_p,
                 GRAN: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr):
    """Keys [start_n, start_n + 16)'s code words (and per-token scales) copied asynchronously into ring stage st,
    one commit group; keys past `end` are zero-filled (their slots may hold anything: NaN poison included)."""
    LK: gl.constexpr = gl.SliceLayout(2, _k_layout(D))
    LV: gl.constexpr = _v_copy_layout(D)
    kn = gl.arange(0, _BN, layout=gl.SliceLayout(1, LK))
    krows, klive = _rows(bt_row, start_n, end, stride_bt_p, stride_kb, stride_ks, kn, PAGE)
    kw = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LK))
    _cp_async(ks_ring.index(st), K_base + krows[:, None] + kw[None, :], mask=klive[:, None])
    vn = gl.arange(0, _BN, layout=gl.SliceLayout(1, LV))
    vrows, vlive = _rows(bt_row, start_n, end, stride_bt_p, stride_vb, stride_vs, vn, PAGE)
    vw = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LV))
    _cp_async(vs_ring.index(st), V_base + vrows[:, None] + vw[None, :], mask=vlive[:, None])
    if GRAN == 2:
        sn = gl.arange(0, _BN, layout=gl.SliceLayout(0, _mma()))
        srows, slive = _rows(bt_row, start_n, end, stride_bt_p, stride_sb, stride_ss, sn, PAGE)
        s_off = srows + kv_head * stride_sh
        _cp_async(sks_ring.index(st), KS_ptr + s_off, mask=slive)
        _cp_async(svs_ring.index(st), VS_ptr + s_off, mask=slive)
    async_copy.commit_group()


@gluon.jit
def _ring_read(ks_ring, vs_ring, sks_ring, svs_ring, st, GRAN: gl.constexpr, D: gl.constexpr):
    """Ring stage st into registers: K's words [16, D / 4, 4] (_k_layout), V's [8, D / 4, 2, 4] (_v_layout), each
    word broadcast to the 4 copies the conversions' assembly takes; per token, the stage's scales (else zeros)."""
    LK: gl.constexpr = _k_layout(D)
    LV: gl.constexpr = _v_layout(D)
    LS: gl.constexpr = gl.SliceLayout(0, _mma())
    kc = ks_ring.index(st).load(gl.SliceLayout(2, LK))
    kc, _ = gl.broadcast(kc[:, :, None], gl.zeros([_BN, D // 4, 4], gl.int32, LK))
    vc = vs_ring.index(st).reshape([8, 2, D // 4]).permute([0, 2, 1]).load(gl.SliceLayout(3, LV))
    vc, _ = gl.broadcast(vc[:, :, :, None], gl.zeros([8, D // 4, 2, 4], gl.int32, LV))
    if GRAN == 2:
        sk = sks_ring.index(st).load(LS)
        sv = svs_ring.index(st).load(LS)
    else:
        sk = gl.zeros([_BN], gl.float32, LS)
        sv = gl.zeros([_BN], gl.float32, LS)
    return kc, vc, sk, sv


@gluon.jit
def _step(q, kc, vc, sk, sv, start_n, end, rs, m_i, l_i, acc, FMT: gl.constexpr, GRAN: gl.constexpr,
          D: gl.constexpr, NH: gl.constexpr, PMUL: gl.constexpr):
    """Keys [start_n, start_n + 16) (code words kc, vc; per token, scales sk, sv) into the online softmax (m_i,
    l_i: log2 domain, the 16 rows of S; rs: each row's logit scale) and O^T (acc [D, NH]): S = q K^T, then
    O^T = V^T P^T with P^T's B operand P's first NH rows where they lie; P enters the dot times PMUL (2^POW)."""
    MMA: gl.constexpr = _mma()
    LCOL: gl.constexpr = gl.SliceLayout(0, MMA)
    s = mma_v2(q, _k_operand(kc, FMT, D), gl.zeros([_BM, _BN], gl.float32, MMA))
    s = s * rs[:, None]
    if GRAN == 2:
        s = s * sk[None, :]
    offs_n = gl.arange(0, _BN, layout=LCOL)
    s = gl.where((start_n + offs_n < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if GRAN == 2:
        p = p * sv[None, :]
    if NH == 8:
        p = _top8(p)
        alpha = _top8_1d(alpha)
    pt = gl.convert_layout((p * PMUL).to(gl.bfloat16).permute([1, 0]),
                           gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
    acc = mma_v2(_vt_operand(vc, FMT, D), pt, acc * gl.convert_layout(alpha, LCOL)[None, :])
    return m_new, l_i, acc


@gluon.jit
def _kvq_decode_gluon_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, BT_ptr, Lens_ptr, O_ptr, Lse_ptr,
    h_kv, split_keys, qk_scale, zero,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_bt_b, stride_bt_p,
    stride_o_split, stride_ob, stride_oh, stride_l_split, stride_lb, stride_lh,
    FMT: gl.constexpr, GRAN: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr, GROUP: gl.constexpr,
    POWC: gl.constexpr, PMUL: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr = 0,
):
    MMA: gl.constexpr = _mma()
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LROW: gl.constexpr = gl.SliceLayout(1, MMA)
    LCOL: gl.constexpr = gl.SliceLayout(0, MMA)
    NH: gl.constexpr = 8 if GROUP <= 8 else 16  # O^T's columns
    pid = gl.program_id(0)
    b = pid // h_kv
    kv_head = pid % h_kv
    split = gl.program_id(1)
    L = gl.load(Lens_ptr + b)
    start = gl.minimum(split * split_keys, L)
    end = gl.minimum(start + split_keys, L)

    # q in the S dot's A operand, its dims relabelled as K's (_k_operand): dim t = 16 i + 8 h + 2 c + e is byte
    # (D / 4) c + 4 i + 2 h + e of the row. Groups up to 8: rows 8-15 (S rows no O^T column reads) repeat rows
    # 0-7 from loads the compiler cannot merge (`zero` is 0 at run time), so that they are registers of their own
    qm = gl.arange(0, _BM, layout=gl.SliceLayout(1, LA))
    qt = gl.arange(0, D, layout=gl.SliceLayout(0, LA))
    q_byte = (D // 4) * ((qt % 8) // 2) + 4 * (qt // 16) + 2 * ((qt // 8) % 2) + qt % 2
    if GROUP <= 8:
        qr = qm % 8 + (qm // 8) * zero
        qlive = qm % 8 < GROUP
    else:
        qr = qm
        qlive = qm < GROUP
    q = gl.load(Q_ptr + b.to(gl.int64) * stride_qb + (kv_head * GROUP + qr)[:, None] * stride_qh + q_byte[None, :],
                mask=qlive[:, None], other=0.0)
    if GRAN == 0:
        qk_scale = qk_scale * gl.load(KS_ptr)
        s_v = gl.load(VS_ptr)
    elif GRAN == 1:
        qk_scale = qk_scale * gl.load(KS_ptr + kv_head)
        s_v = gl.load(VS_ptr + kv_head)
    else:
        s_v = 1.0
    # the codes enter the dots as value x 2^-POW: q's rows are moved up by 2^e (e <= POW, a power of two a row,
    # as large as bf16 keeps the row finite) and 2^(POW - e) joins the row's logit scale
    qf = q.to(gl.float32)
    ebits = (gl.max(gl.abs(qf), axis=1).to(gl.int32, bitcast=True) >> 23) & 255  # max |q| < 2^(ebits - 126)
    e = gl.minimum(253 - ebits, POWC)
    q = (qf * _pow2(e)[:, None]).to(gl.bfloat16)
    rs = gl.convert_layout(qk_scale * _pow2(POWC - e), LROW)

    K_base = K_ptr + kv_head.to(gl.int64) * stride_kh
    V_base = V_ptr + kv_head.to(gl.int64) * stride_vh
    bt_row = BT_ptr + b.to(gl.int64) * stride_bt_b
    m_i = gl.full([_BM], float("-inf"), gl.float32, LROW)
    l_i = gl.zeros([_BM], gl.float32, LROW)
    acc = gl.zeros([D, NH], gl.float32, MMA)
    LD = (K_base, V_base, KS_ptr, VS_ptr, bt_row, kv_head)
    ST = (stride_kb, stride_ks, stride_vb, stride_vs, stride_sb, stride_ss, stride_sh, stride_bt_p)
    SW: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=min(D // 16, 8), order=[1, 0])
    SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    RG = (gl.allocate_shared_memory(gl.int32, [STAGES, _BN, D // 4], SW),
          gl.allocate_shared_memory(gl.int32, [STAGES, _BN, D // 4], SW),
          gl.allocate_shared_memory(gl.float32, [STAGES, _BN], SS),
          gl.allocate_shared_memory(gl.float32, [STAGES, _BN], SS))
    for j in gl.static_range(STAGES - 1):
        _step_copies(*RG, j, *LD, start + j * _BN, end, *ST, GRAN, PAGE, D)
    i = 0
    for start_n in range(start, end, _BN):
        async_copy.wait_group(STAGES - 2)  # step i's copies landed
        kc, vc, sk, sv = _ring_read(*RG, i % STAGES, GRAN, D)
        _step_copies(*RG, (i + STAGES - 1) % STAGES, *LD, start_n + (STAGES - 1) * _BN, end, *ST, GRAN, PAGE, D)
        if PROBE == 0:
            m_i, l_i, acc = _step(q, kc, vc, sk, sv, start_n, end, rs, m_i, l_i, acc, FMT, GRAN, D, NH, PMUL)
        else:  # the copies and reads alone (the access pattern's own read rate): the words summed into l
            l_i += (gl.sum(gl.sum(gl.sum(kc, axis=2), axis=1), axis=0) +
                    gl.sum(gl.sum(gl.sum(gl.sum(vc, axis=3), axis=2), axis=1), axis=0)).to(gl.float32)
        i += 1
    async_copy.wait_group(0)

    inv = s_v / gl.where(l_i > 0.0, l_i, 1.0)  # no key: O = 0
    if NH == 8:
        inv = _top8_1d(inv)
    o = acc * gl.convert_layout(inv, LCOL)[None, :]
    od = gl.arange(0, D, layout=LROW)
    oh = gl.arange(0, NH, layout=LCOL)
    o_byte = (D // 8) * (od % 8) + od // 8  # row t of O^T (_vt_operand)
    o_ptrs = (O_ptr + split.to(gl.int64) * stride_o_split + b.to(gl.int64) * stride_ob
              + (kv_head * GROUP + oh)[None, :] * stride_oh + o_byte[:, None])
    gl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=(oh < GROUP)[None, :])
    om = gl.arange(0, _BM, layout=LROW)
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0))) * _LN2, float("-inf"))
    gl.store(Lse_ptr + split.to(gl.int64) * stride_l_split + b.to(gl.int64) * stride_lb
             + (kv_head * GROUP + om) * stride_lh, lse, mask=om < GROUP)


def _words(cache: torch.Tensor) -> torch.Tensor:
    """The codes seen as int32 words (num_blocks, page, h_kv, d / 4); strides in words."""
    return cache.view(torch.uint8).view(torch.int32)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> str | None:
    """None where this kernel runs the case, else why not (one line): the module docstring's scope."""
    if q.dtype != torch.bfloat16:
        return f"the gluon FP8-cache decode takes a bf16 q, not {q.dtype}"
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"the gluon FP8-cache decode takes e4m3 / e5m2 codes, not {k_cache.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the gluon FP8-cache decode takes d in {HEAD_DIMS}, not d={q.shape[-1]}"
    h_kv = k_cache.shape[2]
    if h_kv and q.shape[1] // h_kv > BLOCK_M:
        return f"the gluon FP8-cache decode takes a GQA group of at most {BLOCK_M}, not {q.shape[1] // h_kv}"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c is not None and (c.stride(-1) != 1 or any(st % 4 for st in c.stride()[:3]) or c.storage_offset() % 4
                              or c.data_ptr() % 16):
            return (f"the gluon FP8-cache decode reads {name} as 32-bit words: strides {c.stride()} must be multiples "
                    f"of 4 (last 1) from a 16-byte aligned start")
    return None


def register_cap(group: int) -> int | None:
    """maxnreg for a GQA group: MAXNREG up to 8 heads (O^T's 8 columns), none past (16 columns: ptxas's ~190-226)."""
    return MAXNREG if group <= 8 else None


def split_keys_for(q: torch.Tensor, b: int, h_kv: int, max_keys: int) -> int:
    """Keys a split: about SPLIT_PROGRAMS_PER_SM programs an SM (never more), each of MIN_SPLIT_KEYS to
    MAX_SPLIT_KEYS keys, a multiple of 16. H200, Llama-3-8B heads at 32K tokens: b 1 256 keys (1,024 programs),
    b 8 2,048 (1,024), b 32 2,048 (4,096); at b 8, 1,936 keys (1,088 programs: nine on some SMs) took 15% longer."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = max(1, SPLIT_PROGRAMS_PER_SM * sms // max(b * h_kv, 1))
    keys = min(MAX_SPLIT_KEYS, max(MIN_SPLIT_KEYS, triton.cdiv(max_keys, want)))
    return triton.cdiv(keys, BLOCK_N) * BLOCK_N


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 scale: float | None = None, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
                 split_keys: int | None = None, stages: int = STAGES, maxnreg: int | None = -1,
                 probe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/triton/kvquant_decode.py's decode_paged (same arguments, same results) for the cases `supports`
    accepts; ValueError (one line) for the others. split_keys: keys a split (rounded up to 16; None:
    split_keys_for); stages, maxnreg (-1: register_cap): tuning; probe: the copies and reads without the
    arithmetic (a measurement of the access pattern: the outputs are not attention)."""
    # the Triton modules at call time, not import time: importing them jit's their kernels for the mode of the
    # moment (a gluon import before the interpreter's set-up left the Triton kernels compiled-mode)
    from kernel_parity.kernels.triton.kvquant_decode import FORMATS, GRANS, check_args, merge_splits, outputs, partials

    gran = check_args(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens)
    why = supports(q, k_cache, v_cache)
    if why:
        raise ValueError(f"kvquant.decode_paged (gluon): {why}")
    if not 2 <= int(stages) <= 8:
        raise ValueError(f"kvquant.decode_paged (gluon): stages={stages} must be in [2, 8]")
    b, h_q, d = q.shape
    nb, page, h_kv, _ = k_cache.shape
    out, out_lse = outputs(q, out, out_lse)
    if b == 0 or h_q == 0:
        return out, out_lse
    group = h_q // h_kv
    max_keys = block_table.shape[1] * page
    keys = split_keys_for(q, b, h_kv, max_keys) if split_keys is None else int(split_keys)
    if keys < 1:
        raise ValueError(f"kvquant.decode_paged: split_keys={split_keys} must be >= 1")
    keys = triton.cdiv(keys, BLOCK_N) * BLOCK_N
    splits = max(1, triton.cdiv(max_keys, keys))
    if b * h_kv >= 2**31 or splits > 65535:
        raise ValueError(f"kvquant.decode_paged: grid ({b * h_kv}, {splits}) exceeds CUDA's limits")
    o_dst, l_dst = partials(out, out_lse, splits)
    s_strides = k_scale.stride() if gran == "token" else (0, 0, 0)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    fmt = FORMATS[k_cache.dtype]
    kw, vw = _words(k_cache), _words(v_cache)
    cap = register_cap(group) if maxnreg == -1 else maxnreg
    _kvq_decode_gluon_kernel[(b * h_kv, splits)](
        q, kw, vw, k_scale, v_scale, block_table, seq_lens, o_dst, l_dst, h_kv, keys, sm_scale * LOG2E, 0,
        *q.stride()[:2], *kw.stride()[:3], *vw.stride()[:3], *s_strides, *block_table.stride(),
        *o_dst.stride()[:3], *l_dst.stride(),
        FMT=fmt, GRAN=GRANS.index(gran), PAGE=page, D=d, GROUP=group, POWC=POW[fmt], PMUL=2.0 ** POW[fmt],
        STAGES=int(stages), PROBE=int(bool(probe)), num_warps=1, **({"maxnreg": cap} if cap else {}))
    merge_splits(o_dst, l_dst, out, out_lse)
    return out, out_lse
