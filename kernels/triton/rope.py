"""Rotary position embeddings (RoPE) in Triton.

    pair i of the rotary part at position p, frequency w_i = theta^(-2i / rot):
    (a, b) -> (a cos(p w_i) - b sin(p w_i),  a sin(p w_i) + b cos(p w_i))

Conventions (OPS.md, layers; golden refimpl/rope.py):
- style "interleaved": pair i is (x[2i], x[2i+1]) of the rotary part (GPT-J, DeepSeek, Meta's
  freqs_cis); "half": (x[i], x[i + rot/2]) (NeoX, HF rotate_half, TensorRT-LLM's "[2, D//2]").
- the rotary part is `rot` dims at the first or the last dims of each head; the other dims are
  copied bit for bit (never converted).
- positions are explicit int32, one per token: the table row read is the token's position.
- angle tables are read as engines store them, with no copy: separate cos / sin [max_seq, rot/2],
  (cos, sin) pairs [max_seq, rot/2, 2] (TensorRT-LLM's fp16 table; Meta's complex64 freqs_cis as
  its torch.view_as_real pairs). Each element is widened to fp32 on load.
- without a table (`theta=`) the kernel builds the angles itself: w_i = theta^(-2i/rot) (and
  Llama-3.1's scaling) in fp64 per pair, rounded once to fp32; the angle p w_i is an fp32
  product, as HF's and Meta's fp32 angle tables are; cos and sin of it come from `_sincos`
  (fp64 reduction by pi/2, fp32 polynomials, ~1 ulp), not tl.cos / tl.sin, whose GPU lowering may
  be the MUFU approximation with an argument reduction that loses accuracy at large positions.
All rotation arithmetic is fp32 whatever the storage dtype; one rounding on store.

Work is organised by pairs, not elements: a program takes BLOCK_T tokens, reads (or builds) their
cos / sin once per rotary pair ([BLOCK_T, BLOCK_P], fp32 registers) and loops over the heads in
steps of BLOCK_H, so the table reads and the angle arithmetic are shared by every head (32 for
Llama-3-8B's q). Half pairs are two contiguous loads (x[lo + i] and x[lo + rot/2 + i]); interleaved
pairs are one contiguous load of the rotary part whose even / odd elements are split in registers
(tl.reshape + tl.split), so every load is a wide vector load; (cos, sin) pair tables are read the
same way. The dims outside the rotary part are a plain copy in the same loop. Memory traffic is
the floor: x read once, y written once, one table row per token. When the token blocks alone are
too few to fill the GPU (MIN_PROGRAMS), the heads are split over programs as well.

TensorRT-LLM's RoPE-fused KV-cache write (`kv_update`) is in rope_kv.py, on the helpers here.

Backward (`rope_backward`): RoPE is orthogonal per pair, so dx = R(-p w) dy: this same kernel run on
the cotangent dy with CONJ set, which negates sin once it is read or built (exact, in registers;
the table is never copied). The pass-through dims of dx are dy's, copied bit for bit.

References: Su et al., "RoFormer" (2021); Meta's llama `apply_rotary_emb` / `apply_scaling`; HF
transformers `apply_rotary_pos_emb`; TensorRT-LLM's Triton attention-with-KV-cache RoPE fusion.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STYLES = ("interleaved", "half")
ENDS = ("first", "last")
SCALINGS = ("none", "llama3")
# Llama-3.1's apply_scaling constants (refimpl.rope.LLAMA3).
L3_FACTOR = tl.constexpr(8.0)
L3_LOW = tl.constexpr(1.0)
L3_HIGH = tl.constexpr(4.0)
L3_ORIG = tl.constexpr(8192.0)
TWO_PI = tl.constexpr(6.283185307179586)
TWO_OVER_PI = tl.constexpr(0.6366197723675814)
PI_OVER_2 = tl.constexpr(1.5707963267948966)
# Elements a program holds: 16 per thread at 8 warps keeps x, its partner, cos, sin and the
# addresses in registers; enough bytes in flight per SM to stream at HBM rate.
TILE = 4096
ELEMS_PER_THREAD = 32  # 4 warps a step: best or within 1% in the H100 sweep (gpu_rope.py --tune)
# Programs that keep every SM streaming (132 SMs on an H100, several programs each): below this
# many token blocks the heads are split over programs too.
MIN_PROGRAMS = 1024


@triton.jit
def _sincos(ang):
    """(cos, sin) of an fp32 angle >= 0, ~1 ulp: k = rint(ang 2/pi) and r = ang - k pi/2 in fp64
    (exact enough for any position: k < 2^24), then Cephes' fp32 minimax polynomials on
    |r| <= pi/4 and the quadrant k mod 4."""
    a = ang.to(tl.float64)
    k = tl.floor(a * TWO_OVER_PI + 0.5)
    r = (a - k * PI_OVER_2).to(tl.float32)
    q = k.to(tl.int32) & 3
    z = r * r
    s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    swap = (q & 1) == 1
    cos = tl.where(swap, s, c)
    sin = tl.where(swap, c, s)
    cos = tl.where((q == 1) | (q == 2), -cos, cos)
    sin = tl.where(q >= 2, -sin, sin)
    return cos, sin


@triton.jit
def _inv_freq(pair, r_hi, r_lo, LLAMA3: tl.constexpr):
    """w_i = r^i, r = theta^(-2/rot) given as fp32 hi + lo words, by binary powering in fp64
    (rounding error ~i eps64, far below fp32), Llama-3.1's scaling in fp64, one fp32 rounding."""
    r = tl.cast(r_hi, tl.float64) + tl.cast(r_lo, tl.float64)
    w = tl.full(pair.shape, 1.0, tl.float64)
    e = tl.maximum(pair, 0)
    for _ in tl.static_range(12):  # rot <= 8192: i < 2^12
        w = tl.where((e & 1) == 1, w * r, w)
        r = r * r
        e = e >> 1
    if LLAMA3:
        wavelen = TWO_PI / w
        smooth = (L3_ORIG / wavelen - L3_LOW) / (L3_HIGH - L3_LOW)
        mid = (1.0 - smooth) * w / L3_FACTOR + smooth * w
        w = tl.where(wavelen < L3_ORIG / L3_HIGH, w, tl.where(wavelen > L3_ORIG / L3_LOW, w / L3_FACTOR, mid))
    return w.to(tl.float32)


@triton.jit
def _rot(a, b, c, s):
    """One rotation of pairs (a, b) by (cos, sin) in fp32: two products and a sum each, as the golden."""
    return a * c - b * s, a * s + b * c


@triton.jit
def _pair_angles(pos, mask_t, offs_p, mask_p, Cos_ptr, Sin_ptr, stride_tab_row, stride_tab_col, r_hi, r_lo,
                 THETA: tl.constexpr, LLAMA3: tl.constexpr, TABLE_PAIRS: tl.constexpr):
    """(cos, sin) [BLOCK_T, BLOCK_P] fp32 of the tokens' positions, one per rotary pair: table rows
    (TABLE_PAIRS: (cos, sin) adjacent in memory, read as one contiguous [BLOCK_P, 2] row and split
    in registers), or built from theta."""
    if THETA:
        w = _inv_freq(offs_p, r_hi, r_lo, LLAMA3)  # BLOCK_P
        ang = pos.to(tl.float32)[:, None] * w[None, :]  # the fp32 angle p w_i
        cos, sin = _sincos(ang)
    else:
        row = pos.to(tl.int64)[:, None] * stride_tab_row
        m = mask_t[:, None] & mask_p[None, :]
        if TABLE_PAIRS:
            k = tl.arange(0, 2)
            cs = tl.load(Cos_ptr + (row + offs_p[None, :] * stride_tab_col)[:, :, None] + k[None, None, :],
                         mask=m[:, :, None], other=0.0)
            cos, sin = tl.split(cs.to(tl.float32))
        else:
            offs = row + (offs_p * stride_tab_col)[None, :]
            cos = tl.load(Cos_ptr + offs, mask=m, other=1.0).to(tl.float32)
            sin = tl.load(Sin_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_rows(X_ptr, x_rows, Y_ptr, y_rows, m_rows, lo, rot, offs_p, mask_p, cos, sin,
               HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rotate the rotary part of BLOCK_T x BLOCK_H rows (element offsets x_rows / y_rows, mask
    m_rows) by cos / sin [BLOCK_T, BLOCK_P], shared by the rows' heads. Half pairs: two contiguous
    loads (x[lo + i], x[lo + rot/2 + i]); interleaved: one contiguous load of the 2 BLOCK_P dims,
    its (even, odd) elements split in registers. fp32 math, one rounding on store."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    if HALF:
        m = m_rows[:, :, None] & mask_p[None, None, :]
        cols = lo + offs_p
        xa = X_ptr + x_rows[:, :, None] + cols[None, None, :]
        a = tl.load(xa, mask=m).to(tl.float32)
        b = tl.load(xa + rot // 2, mask=m).to(tl.float32)
        ya, yb = _rot(a, b, c, s)
        out = Y_ptr + y_rows[:, :, None] + cols[None, None, :]
        tl.store(out, ya.to(Y_ptr.dtype.element_ty), mask=m)
        tl.store(out + rot // 2, yb.to(Y_ptr.dtype.element_ty), mask=m)
    else:
        offs_e = tl.arange(0, 2 * BLOCK_P)
        m = m_rows[:, :, None] & (offs_e < rot)[None, None, :]
        cols = lo + offs_e
        x = tl.load(X_ptr + x_rows[:, :, None] + cols[None, None, :], mask=m).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_P, 2)))
        ya, yb = _rot(a, b, c, s)
        y = tl.reshape(tl.join(ya, yb), (BLOCK_T, BLOCK_H, 2 * BLOCK_P))
        tl.store(Y_ptr + y_rows[:, :, None] + cols[None, None, :], y.to(Y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _copy_rows(X_ptr, x_rows, Y_ptr, y_rows, m_rows, first, n, BLOCK_Q: tl.constexpr):
    """Copy dims [first, first + n) of the rows as they are (no conversion)."""
    offs_q = tl.arange(0, BLOCK_Q)
    m = m_rows[:, :, None] & (offs_q < n)[None, None, :]
    cols = first + offs_q
    v = tl.load(X_ptr + x_rows[:, :, None] + cols[None, None, :], mask=m)
    tl.store(Y_ptr + y_rows[:, :, None] + cols[None, None, :], v, mask=m)


@triton.jit
def _rope_kernel(
    X_ptr, Y_ptr, Pos_ptr, Cos_ptr, Sin_ptr, n_tokens, n_heads, head_dim, lo, rot, heads_per_prog,
    stride_xt, stride_xh, stride_yt, stride_yh, stride_pos, stride_tab_row, stride_tab_col, r_hi, r_lo,
    HALF: tl.constexpr, AT_LAST: tl.constexpr, HAS_PASS: tl.constexpr, THETA: tl.constexpr,
    LLAMA3: tl.constexpr, TABLE_PAIRS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    CONJ: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < rot // 2
    pos = tl.load(Pos_ptr + offs_t.to(tl.int64) * stride_pos, mask=mask_t, other=0)
    # cos / sin of the tokens' pairs: read or built once, used by every head of the loop below
    cos, sin = _pair_angles(pos, mask_t, offs_p, mask_p, Cos_ptr, Sin_ptr, stride_tab_row, stride_tab_col,
                            r_hi, r_lo, THETA, LLAMA3, TABLE_PAIRS)
    if CONJ:  # the backward: R(p w)^T = R(-p w), cos even and sin odd in the angle
        sin = -sin
    rows_x = offs_t.to(tl.int64)[:, None] * stride_xt
    rows_y = offs_t.to(tl.int64)[:, None] * stride_yt
    h_lo = pid_g * heads_per_prog
    h_hi = tl.minimum(h_lo + heads_per_prog, n_heads)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        m_rows = mask_t[:, None] & (offs_h < h_hi)[None, :]
        x_rows = rows_x + (offs_h * stride_xh)[None, :]
        y_rows = rows_y + (offs_h * stride_yh)[None, :]
        _rope_rows(X_ptr, x_rows, Y_ptr, y_rows, m_rows, lo, rot, offs_p, mask_p, cos, sin,
                   HALF, BLOCK_T, BLOCK_H, BLOCK_P)
        if HAS_PASS:  # the other d - rot dims: [0, lo) when the rotary part is last, [rot, d) when first
            _copy_rows(X_ptr, x_rows, Y_ptr, y_rows, m_rows, 0 if AT_LAST else rot, head_dim - rot, BLOCK_Q)


# -- launchers -----------------------------------------------------------------------------------
def _warps(elements: int) -> int:
    return min(8, _floor_pow2(elements // (32 * ELEMS_PER_THREAD)))


def _blocks(n_tokens: int, n_heads: int, per_head: int, one_head: bool = False) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H): rows of a loop step holding about TILE elements (per_head each).

    one_head: one head a step, so that the step's threads all lie along tokens and pairs: the
    [BLOCK_T, BLOCK_P] cos / sin tensor is then held once, not copied along the threads of a head
    axis (theta-built angles cost ~60 flops a pair, and BLOCK_H copies of them made the kernel
    ALU-bound: 28-61% of copy bandwidth at Llama-3-8B's q on an H100)."""
    block_h = 1 if one_head else min(triton.next_power_of_2(n_heads), _floor_pow2(TILE // per_head))
    block_t = min(triton.next_power_of_2(max(1, n_tokens)), _floor_pow2(TILE // (block_h * per_head)))
    return block_t, block_h


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _head_groups(n_tblocks: int, n_heads: int, block_h: int, on_gpu: bool) -> int:
    """Heads a program loops over: all of them (cos / sin reused the most), unless the token blocks
    alone leave the GPU short of programs, then as many groups as fill it (MIN_PROGRAMS)."""
    if not on_gpu or n_tblocks >= MIN_PROGRAMS:
        return n_heads
    groups = min(triton.cdiv(n_heads, block_h), triton.cdiv(MIN_PROGRAMS, n_tblocks))
    return triton.cdiv(triton.cdiv(n_heads, groups), block_h) * block_h


def _tables(cos, sin, table, half: int, device) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """(cos view, sin view, row stride, column stride, whether (cos, sin) are adjacent pairs) of a
    given table, no copies.

    cos, sin: (max_seq, rot/2) each; table: (max_seq, rot/2, 2) (cos, sin) pairs, or complex64
    (max_seq, rot/2) freqs_cis (read through torch.view_as_real)."""
    if table is not None:
        if cos is not None or sin is not None:
            raise ValueError("give either table= or cos= and sin=, not both")
        if not isinstance(table, torch.Tensor):
            raise ValueError(f"table must be a tensor, got {type(table).__name__}")
        if table.dtype == torch.complex64:
            table = torch.view_as_real(table)
        if table.dim() != 3 or table.shape[1] != half or table.shape[2] != 2:
            raise ValueError(f"table must be (max_seq, rot/2 = {half}, 2) (cos, sin) pairs or complex64 "
                             f"(max_seq, {half}), got shape {tuple(table.shape)}")
        if table.dtype not in TABLE_DTYPES:
            raise ValueError(f"table dtype {table.dtype} not supported; expected complex64 or one of {TABLE_DTYPES}")
        if table.device != device:
            raise ValueError(f"table is on {table.device}, x on {device}")
        if table.stride(0) < 0 or table.stride(1) < 0:
            raise ValueError(f"table strides {tuple(table.stride())} must be non-negative")
        return table[..., 0], table[..., 1], table.stride(0), table.stride(1), table.stride(2) == 1
    if cos is None or sin is None:
        raise ValueError("give the angle table: table=, or cos= and sin=, or theta=")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != half:
            raise ValueError(f"{name} must be a (max_seq, rot/2 = {half}) tensor, "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in TABLE_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported; expected one of {TABLE_DTYPES}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, x on {device}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype} strides {cos.stride()} and sin {tuple(sin.shape)} "
                         f"{sin.dtype} strides {sin.stride()} must match")
    return cos, sin, cos.stride(0), cos.stride(1), False


def _theta_words(theta: float, rot: int) -> tuple[float, float]:
    """r = theta^(-2/rot) as fp32 hi + lo words (the kernel rebuilds it in fp64)."""
    r = math.exp(-2.0 * math.log(theta) / rot)
    hi = float(torch.tensor(r, dtype=torch.float32))
    return hi, float(torch.tensor(r - hi, dtype=torch.float32))


def rope(x: torch.Tensor, positions: torch.Tensor, *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
         table: torch.Tensor | None = None, theta: float | None = None, scaling: str = "none", style: str = "half",
         rot: int | None = None, at: str = "first", out: torch.Tensor | None = None, conj: bool = False
         ) -> torch.Tensor:
    """RoPE of every head of every token at its position (conj: at the negated angles, `rope_backward`).

    x: (t, h, d) fp32/fp16/bf16, last-dim stride 1, other strides any
    positions: (t,) int32 on x's device, each in [0, max_seq) of the table (not checked: no sync)
    angles, exactly one of: cos, sin (max_seq, rot/2) | table (max_seq, rot/2, 2) pairs or complex64
        (max_seq, rot/2) freqs_cis | theta (> 0; scaling "none" or "llama3")
    style: "interleaved" or "half"; rot: even rotary dims <= d (default d); at: "first" or "last"
    out: (t, h, d) x's dtype, last-dim stride 1; allocated when None. It may be x itself (in place, the
        backward's dx over dy): a program loads each row's elements before it stores them and no two
        programs share a row; an out that overlaps x otherwise is refused
    returns: out
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor (t, h, d), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    t, h, d = x.shape
    rot = d if rot is None else rot
    if not isinstance(rot, int) or isinstance(rot, bool) or rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"rot={rot!r} must be an even integer in [2, d={d}]")
    if style not in STYLES:
        raise ValueError(f"style={style!r} must be one of {STYLES}")
    if at not in ENDS:
        raise ValueError(f"at={at!r} must be one of {ENDS}")
    if d > 1 and x.stride(2) != 1:
        raise ValueError(f"x must have last-dim stride 1, got strides {tuple(x.stride())}")
    if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (t,) or positions.dtype != torch.int32 \
            or positions.device != x.device:
        raise ValueError(f"positions must be a ({t},) int32 tensor on {x.device}")
    if theta is not None:
        if cos is not None or sin is not None or table is not None:
            raise ValueError("give theta= or a table, not both")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ValueError(f"theta={theta!r} must be a finite number > 1")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} must be one of {SCALINGS}")
        cos_v = sin_v = x  # unused by the THETA variant
        s_row = s_col = 0
        pairs = False
        r_hi, r_lo = _theta_words(float(theta), rot)
    else:
        if scaling != "none":
            raise ValueError(f"scaling={scaling!r} applies to theta= only (a table holds its angles)")
        cos_v, sin_v, s_row, s_col, pairs = _tables(cos, sin, table, rot // 2, x.device)
        r_hi = r_lo = 0.0
    if out is None:
        out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be a {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    elif d > 1 and out.stride(2) != 1:
        raise ValueError(f"out must have last-dim stride 1, got strides {tuple(out.stride())}")
    elif (out.data_ptr() != x.data_ptr() or out.stride() != x.stride()) and _overlap(out, x):
        raise ValueError("out overlaps x without being x itself; pass out=x for in place, or a separate tensor")
    if t == 0 or h == 0:
        return out
    at_last = at == "last"
    block_p = triton.next_power_of_2(rot // 2)
    block_q = triton.next_power_of_2(d - rot) if rot < d else 1
    per_head = 2 * block_p + (block_q if rot < d else 0)
    block_t, block_h = _blocks(t, h, per_head, one_head=theta is not None)
    n_tblocks = triton.cdiv(t, block_t)
    heads_per_prog = _head_groups(n_tblocks, h, block_h, x.is_cuda)
    _rope_kernel[(n_tblocks, triton.cdiv(h, heads_per_prog))](
        x, out, positions, cos_v, sin_v, t, h, d, d - rot if at_last else 0, rot, heads_per_prog,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), positions.stride(0), s_row, s_col, r_hi, r_lo,
        HALF=style == "half", AT_LAST=at_last, HAS_PASS=rot < d, THETA=theta is not None,
        LLAMA3=scaling == "llama3", TABLE_PAIRS=pairs,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_P=block_p, BLOCK_Q=block_q, CONJ=bool(conj),
        num_warps=_warps(block_t * block_h * per_head),
    )
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of a and b intersect (a conservative test: spans, not elements)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    def span(u):
        last = sum((n - 1) * st for n, st in zip(u.shape, u.stride())) * u.element_size()
        return u.data_ptr(), u.data_ptr() + last + u.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def rope_backward(dy: torch.Tensor, positions: torch.Tensor, **kw) -> torch.Tensor:
    """dx = RoPE of the cotangent dy (t, h, d) at the negated angles: the forward kernel with CONJ
    (sin negated in registers); the pass-through dims are dy's bits. Arguments as `rope`'s (cos / sin
    | table | theta, style, rot, at, out); out=dy writes dx over dy (C-Kernel-Engine's rope_backward_qk).
    Returns out."""
    return rope(dy, positions, conj=True, **kw)
