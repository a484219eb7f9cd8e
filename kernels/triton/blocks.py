"""Fused transformer blocks composed of our Triton kernels, stage by stage.

    attention: norm (norm.rms_norm) -> q, k, v (+ bias) (gemm.gemm_nt / _linear_f32_kernel) -> RoPE
               (rope.rope) -> cache write (_cache_write_kernel) -> attention (attention_decode.decode,
               attention_chunked.chunked_prefill) -> W_o (+ bias) -> + residual (_add_kernel)
    mlp:       norm -> h = norm W1^T (+ b1) -> act = silu(gate) up (mlp.swiglu_fused; mlp.swiglu over the I real
               lanes of aI-lane halves, act's padding zeroed) -> down (+ b2) -> out = x + down
    outproj_mlp: proj = attn W_o^T (+ bias) (flat, or fp32 per head) -> h1 = proj + residual -> the mlp on h1

Conventions as refimpl/blocks.py (OPS.md, layers): aligned rows (RMSNorm over the n real lanes),
aligned heads (RoPE on the first d lanes, dot products over a_d, scale 1/sqrt(d), a cached row's lanes
[d, a_d) cleared when written), head-major caches (h_kv, cap, a_d) written in place at start .. start + T - 1
and read through (1, cap, h_kv, a_d) views (no copy), bottom-right causal attention over history +
chunk. GGML weights are dequantized in registers by the gemm kernels (fp32 products of the exact
dequantization, no activation quantization: the `dequant`, L1, reference); fp32 weights, flat (N, K) or
per head (h_q, N, a_d), go through `_linear_f32_kernel`: fp32 "ieee" dots (no tf32), fp32 accumulation.
A weight is a (format, tensor) pair: "f32", "f32_heads" or one of gemm.FORMATS.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import attention_chunked, gemm
from . import attention_decode as tdecode
from . import mlp as tmlp
from . import norm as tnorm
from . import rope as trope

Weight = tuple[str, torch.Tensor]
FORMATS = ("f32", "f32_heads", *gemm.FORMATS)
LINEAR_TILE = (16, 32, 32)  # BLOCK_M, BLOCK_N, BLOCK_K of the fp32 linear kernel (tl.dot's minimum is 16)


@triton.jit
def _linear_f32_kernel(A_ptr, W_ptr, Bias_ptr, C_ptr, M, N, K, AD, stride_am, stride_wn, stride_wh, stride_cm,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A W^T (+ bias), W[n, k] at W_ptr + n stride_wn + (k // AD) stride_wh + k % AD (a flat (N, K)
    weight: AD = K; per head (h, N, a_d): AD = a_d, stride_wh = N a_d). fp32 ieee dots."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(A_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(W_ptr + offs_n[None, :] * stride_wn + (offs_k // AD)[:, None] * stride_wh + (offs_k % AD)[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # BLOCK_K, BLOCK_N
        acc += tl.dot(a, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(C_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _cache_write_kernel(New_ptr, Cache_ptr, start, D, AD, stride_nt, stride_nh, stride_ch, stride_cs,
                        BLOCK_AD: tl.constexpr):
    """cache[h, start + t, :] = new[t, h, :] with lanes [D, AD) cleared: one program per (t, h)."""
    pid_t, pid_h = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_AD)
    row = tl.load(New_ptr + pid_t * stride_nt + pid_h * stride_nh + offs, mask=offs < D, other=0.0)
    tl.store(Cache_ptr + pid_h * stride_ch + (start + pid_t) * stride_cs + offs, row, mask=offs < AD)


@triton.jit
def _add_kernel(A_ptr, B_ptr, Out_ptr, n, BLOCK: tl.constexpr):
    """out = a + b over n contiguous elements (out may be a)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Out_ptr + offs, tl.load(A_ptr + offs, mask=mask) + tl.load(B_ptr + offs, mask=mask), mask=mask)


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}; no copy is made")


def linear(a: torch.Tensor, w: Weight, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = a (M, K) @ W^T (+ bias): GGML formats through gemm.gemm_nt, fp32 through
    _linear_f32_kernel."""
    fmt, data = w
    if fmt in gemm.FORMATS:
        return gemm.gemm_nt(a, fmt, data, bias, out=out)
    if fmt not in ("f32", "f32_heads"):
        raise ValueError(f"weight format {fmt!r} has no Triton path here; supported: {', '.join(FORMATS)}")
    m, k = a.shape
    if fmt == "f32":
        n, ad, stride_wh = data.shape[0], k, 0
        ok = data.dim() == 2 and data.shape[1] == k
    else:
        h, n, ad = data.shape
        stride_wh = n * ad
        ok = h * ad == k
    if not ok or data.dtype != torch.float32 or a.dtype != torch.float32:
        raise ValueError(f"{fmt} weight {tuple(data.shape)} {data.dtype} does not fit a {tuple(a.shape)} {a.dtype} input")
    for name, t in (("a", a), ("w", data), ("out", out)):
        _contiguous(name, t)
    bm, bn, bk = LINEAR_TILE
    _linear_f32_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        a, data, bias if bias is not None else out, out, m, n, k, ad, a.stride(0), ad if fmt == "f32_heads" else k,
        stride_wh, out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a + b (same shape, contiguous; out may be a)."""
    for name, t in (("a", a), ("b", b), ("out", out)):
        _contiguous(name, t)
    n = out.numel()
    _add_kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024, num_warps=4)
    return out


def write_cache(cache: torch.Tensor, rows: torch.Tensor, start: int, d: int) -> None:
    """cache (h_kv, cap, a_d)[:, start + t] = rows (T, h_kv, a_d)[t], lanes [d, a_d) cleared."""
    t, h, ad = rows.shape
    _cache_write_kernel[(t, h)](rows, cache, start, d, ad, rows.stride(0), rows.stride(1), cache.stride(0),
                                cache.stride(1), BLOCK_AD=triton.next_power_of_2(ad), num_warps=1)


def _outputs(out: dict | None, shapes: dict[str, tuple[int, ...]], like: torch.Tensor) -> dict[str, torch.Tensor]:
    out = dict(out or {})
    for name, shape in shapes.items():
        if name not in out:
            out[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        elif tuple(out[name].shape) != shape or not out[name].is_contiguous():
            raise ValueError(f"out[{name!r}] must be a contiguous {shape} tensor, got {tuple(out[name].shape)}")
    return out


def qkv_sections(wq: Weight, bq: torch.Tensor | None, h_q: int, h_kv: int, ad: int) -> tuple:
    """(wq, wk, wv, bq, bk, bv): the row sections of the seed's one W_qkv ((h_q + 2 h_kv) a_d rows: q heads, then
    k, then v) and of b_qkv, as views into them (contiguous: whole rows)."""
    fmt, data = wq
    off, rows = (0, h_q * ad, (h_q + h_kv) * ad), (h_q * ad, h_kv * ad, h_kv * ad)  # each section's first row, rows
    if data.shape[0] != sum(rows):
        raise ValueError(f"W_qkv must have (h_q + 2 h_kv) a_d = {sum(rows)} rows, got {tuple(data.shape)}")
    ws = tuple((fmt, data[o:o + r]) for o, r in zip(off, rows))
    bs = (None,) * 3 if bq is None else tuple(bq[o:o + r] for o, r in zip(off, rows))
    return (*ws, *bs)


def attention_prefill(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight,
                      wo: Weight, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      start: int, *, n: int, h_q: int, h_kv: int, d: int, bq=None, bk=None, bv=None, bo=None,
                      residual: torch.Tensor | None = None, style: str = "half", gemma: bool = False,
                      out: dict | None = None, decode: bool = False, rope_off: int = 0,
                      qkv: str = "separate") -> dict[str, torch.Tensor]:
    """x (T, aE) in cache slots start .. start + T - 1, rotated at positions rope_off + slot; the caches
    (h_kv, cap, a_d) are written in place. qkv="fused": wq is the seed's W_qkv, bq b_qkv (wk, wv, bk, bv None).
    decode: the attention is the decode kernel's (T = 1) instead of chunked prefill's. Returns the stage
    outputs (refimpl.blocks.attention_prefill's names and shapes, the caches excepted)."""
    t, ae = x.shape
    cap, ad = k_cache.shape[1:]
    if qkv == "fused":
        wq, wk, wv, bq, bk, bv = qkv_sections(wq, bq, h_q, h_kv, ad)
    o = _outputs(out, {"norm": (t, ae), "q": (t, h_q, ad), "k": (t, h_kv, ad), "v": (t, h_kv, ad),
                       "q_rope": (t, h_q, ad), "k_rope": (t, h_kv, ad), "attn": (t, h_q, ad), "out": (t, ae)}, x)
    tnorm.rms_norm(x, gamma, eps, n=n, gemma=gemma, out=o["norm"])
    for name, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        linear(o["norm"], w, b, o[name].view(t, -1))
    pos = torch.arange(start, start + t, dtype=torch.int32, device=x.device)
    rpos = {"q": pos + rope_off, "k": pos + rope_off}  # RoPE's positions; the cache slots are pos
    for src, dst in (("q", "q_rope"), ("k", "k_rope")):
        trope.rope(o[src], rpos[src], cos=cos, sin=sin, style=style, rot=d, at="first", out=o[dst])
    write_cache(k_cache, o["k_rope"], start, d)
    write_cache(v_cache, o["v"], start, d)
    kc, vc = k_cache.permute(1, 0, 2)[None], v_cache.permute(1, 0, 2)[None]  # (1, cap, h_kv, a_d) views
    scale = 1.0 / math.sqrt(d)
    if decode:
        seqlens = torch.tensor([start + t], dtype=torch.int32, device=x.device)
        tdecode.decode(o["q_rope"][None], kc, vc, seqlens, scale=scale, causal="bottom_right",
                                out=o["attn"][None])
    else:
        cu = torch.tensor([0, t], dtype=torch.int32, device=x.device)
        hist = torch.tensor([start], dtype=torch.int32, device=x.device)
        attention_chunked.chunked_prefill(o["q_rope"], kc, vc, cu, hist, t, scale=scale, causal="bottom_right",
                                          out=o["attn"])
    linear(o["attn"].view(t, h_q * ad), wo, bo, o["out"])
    if residual is not None:
        add(o["out"], residual, o["out"])
    return o


def attention_decode(x: torch.Tensor, *args, residual: torch.Tensor | None = None, out: dict | None = None,
                     **kw) -> dict[str, torch.Tensor]:
    """One token x (aE,) at position `start` (the 12th positional argument): the stages of
    `attention_prefill` with T = 1 and the decode attention kernel."""
    rows = {k: v[None] for k, v in (out or {}).items()}
    res = attention_prefill(x[None], *args, residual=None if residual is None else residual[None], out=rows,
                            decode=True, **kw)
    return {k: v[0] for k, v in res.items()}


def mlp(x: torch.Tensor, gamma: torch.Tensor, eps: float, w1: Weight, w2: Weight, *, n: int,
        b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, inter: int | None = None, gemma: bool = False,
        out: dict | None = None) -> dict[str, torch.Tensor]:
    """x (T, aE) -> {"norm", "h" (T, 2aI), "act" (T, aI), "down", "out" = x + down}; w1's gate rows first (aI each),
    I = inter real lanes per half (None: aI), act's lanes [I, aI) zero."""
    t, ae = x.shape
    ai = w1[1].shape[0] // 2
    i = ai if inter is None else inter
    o = _outputs(out, {"norm": (t, ae), "h": (t, 2 * ai), "act": (t, ai), "down": (t, ae), "out": (t, ae)}, x)
    tnorm.rms_norm(x, gamma, eps, n=n, gemma=gemma, out=o["norm"])
    linear(o["norm"], w1, b1, o["h"])
    if i == ai:
        tmlp.swiglu_fused(o["h"], out=o["act"])
    else:  # the I real lanes of each half; act's padding cleared, so W2's padded columns add nothing
        tmlp.swiglu(o["h"][:, :i], o["h"][:, ai:ai + i], out=o["act"][:, :i])
        o["act"][:, i:].zero_()
    linear(o["act"], w2, b2, o["down"])
    add(x, o["down"], o["out"])
    return o


@triton.jit
def _heads_to_rows_kernel(Attn_ptr, Rows_ptr, T, AD, BLOCK_AD: tl.constexpr):
    """rows[t, h AD : (h + 1) AD] = attn[h, t, :]: a head-major (h, T, AD) attention output as token rows
    (T, h AD), one program per (t, h) (seed audit S5)."""
    pid_t, pid_h = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_AD)
    row = tl.load(Attn_ptr + (pid_h * T + pid_t) * AD + offs, mask=offs < AD, other=0.0)
    tl.store(Rows_ptr + (pid_t * tl.num_programs(1) + pid_h) * AD + offs, row, mask=offs < AD)


def attn_rows(attn: torch.Tensor, attn_layout: str) -> torch.Tensor:
    """The attention output as token rows (T, h_q a_d): attn itself when token-major, a head-major
    (h_q, T, a_d) one gathered per head by _heads_to_rows_kernel."""
    if attn_layout == "token_major":
        return attn
    if attn_layout != "head_major":
        raise ValueError(f"attn_layout={attn_layout!r}: expected 'token_major' or 'head_major'")
    if attn.dim() != 3:
        raise ValueError(f"a head-major attention output is (h_q, T, a_d), got {tuple(attn.shape)}")
    _contiguous("attn", attn)
    h, t, ad = attn.shape
    rows = torch.empty((t, h * ad), dtype=attn.dtype, device=attn.device)
    _heads_to_rows_kernel[(t, h)](attn, rows, t, ad, BLOCK_AD=triton.next_power_of_2(ad), num_warps=1)
    return rows


def outproj_mlp(attn: torch.Tensor, residual: torch.Tensor, wo: Weight, gamma: torch.Tensor, eps: float, w1: Weight,
                w2: Weight, *, n: int, bo: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, inter: int | None = None, gemma: bool = False,
                out: dict | None = None, attn_layout: str = "token_major") -> dict[str, torch.Tensor]:
    """attn (T, h_q a_d), or (h_q, T, a_d) with attn_layout="head_major" (the seed's [h, T, a_d]), residual
    (T, aE) -> {"proj", "h1" = proj + residual, then `mlp` on h1}."""
    t, ae = residual.shape
    o = _outputs(out, {"proj": (t, ae), "h1": (t, ae)}, residual)
    linear(attn_rows(attn, attn_layout), wo, bo, o["proj"])
    add(o["proj"], residual, o["h1"])
    rest = mlp(o["h1"], gamma, eps, w1, w2, n=n, b1=b1, b2=b2, inter=inter, gemma=gemma,
               out={k: v for k, v in o.items() if k not in ("proj", "h1")})
    return {"proj": o["proj"], "h1": o["h1"], **rest}


def layer(x: torch.Tensor, gamma: torch.Tensor, eps: float, wq: Weight, wk: Weight, wv: Weight, wo: Weight,
          k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
          gamma2: torch.Tensor, w1: Weight, w2: Weight, *, n: int, h_q: int, h_kv: int, d: int, bq=None, bk=None,
          bv=None, bo=None, style: str = "half", gemma: bool = False,
          out: dict | None = None) -> dict[str, torch.Tensor]:
    """A whole layer (seed audit S9) of the Triton blocks: `attention_prefill` (its W_o output pre, before the
    residual), h1 = pre + x (_add_kernel), then `mlp` on h1 (gamma2). Returns the attention's stages ("out" left
    out), "h1", "norm2", "h", "act", "down", "out". No saved scores: the attention is chunked_prefill's online
    softmax, which never materialises P."""
    t, ae = x.shape
    o = dict(out or {})
    names = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn")
    pre = torch.empty_like(x)
    a = attention_prefill(x, gamma, eps, wq, wk, wv, wo, k_cache, v_cache, cos, sin, start, n=n, h_q=h_q, h_kv=h_kv,
                          d=d, bq=bq, bk=bk, bv=bv, bo=bo, style=style, gemma=gemma,
                          out={**{k: o[k] for k in names if k in o}, "out": pre})
    h1 = _outputs(o, {"h1": (t, ae)}, x)["h1"]
    add(pre, x, h1)
    m = mlp(h1, gamma2, eps, w1, w2, n=n, gemma=gemma,
            out={**{k: o[k] for k in ("h", "act", "down", "out") if k in o}, **({"norm": o["norm2"]} if "norm2" in o
                                                                                  else {})})
    return {**{k: a[k] for k in names}, "h1": h1, "norm2": m["norm"], **{k: m[k] for k in ("h", "act", "down", "out")}}
