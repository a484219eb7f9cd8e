"""Gated-MLP activations in Triton: SwiGLU and GeGLU (tanh or erf GELU), fused or split inputs.

    swiglu: y = silu(g) u = g sigmoid(g) u
    geglu:  y = gelu(g) u,  gelu(g) = g Phi(g)  (erf)  or  0.5 g (1 + tanh(k (g + 0.044715 g^3)))

Conventions (OPS.md, layers; golden in refimpl/mlp.py): the gate g and the up projection u are
either the two halves of one fused projection h (t, 2i), gate first (`swiglu_fused`), or two
tensors (t, i) (`swiglu`); any row strides, unit column stride. All arithmetic is fp32 whatever
the storage dtype; y is rounded once, on store.

Numerics (each form is exact algebra on the textbook one, chosen so that nothing overflows and
nothing cancels):
- sigmoid(z) from e = exp(-|z|) in (0, 1]: 1 / (1 + e) for z >= 0, e / (1 + e) below. exp never
  sees a positive argument, so it never overflows (1 / (1 + exp(-z)) is fine in fp32 but its
  mirror exp(z) / (1 + exp(z)) is inf / inf = NaN past z = 88, and any form evaluated in fp16
  overflows past |z| = 11).
- tanh GELU as g sigmoid(2 k (g + 0.044715 g^3)), since (1 + tanh(x)) / 2 = sigmoid(2x): the
  textbook 1 + tanh(x) cancels for g < -2 (1 + tanh(-8.5) = 8e-8 is all rounding error in fp32),
  the sigmoid form keeps full relative precision in the lower tail.
- erf GELU as g Phi(g) with Phi(g) = erfc(-g / sqrt 2) / 2 (1 - erfc(g / sqrt 2) / 2 for g >= 0),
  never 1 + erf(...), which cancels the same way. erfc(a), a >= 0, is t exp(-a^2 + P(t)),
  t = 1 / (1 + a / 2) (the form of Numerical Recipes' erfcc, with our own fit): P is a degree-9
  polynomial least-squares fitted in float64 (against mpmath) to ln(erfc(a) e^(a^2) / t) over
  a in [0, 10.5], max error 5.1e-8; a^2 = g^2 / 2 is carried as hi + lo (an fma gives the rounding
  error of g * g), so no rounding of g / sqrt 2 is squared. Phi is within ~5 fp32 ulp for
  |g| < 3 and within 1e-5 relative wherever it is a normal fp32 number; erfc(10.5) underflows fp32,
  so t is clamped there (P is not evaluated outside its fit), and g to +-16. No libdevice call: the same code runs
  in the interpreter and on the GPU.

Backward (`glu_backward`, `glu_backward_fused`; OPS.md "backward"): one elementwise pass,
dgate = dy u act'(g) and dup = dy act(g), fp32, each rounded once; on the fused layout the two are
written into the halves of dh (t, 2i), gate first. act' is silu' = s(g) + g s(g) s(-g), tanh
gelu' = s(z) + g s(z) s(-z) z' and erf gelu' = Phi(g) + g phi(g). The sigmoid's derivative is
s(z) s(-z) = e / (1 + e)^2 from e = exp(-|z|) (`_sigmoid_grad`): 1 - s(z) is all rounding once s(z)
rounds to 1 (z > 17 in fp32) and g (1 - s) then carries |g| eps32 of error, ~1e-4 of dgate at the
`large` gates. phi(g) = exp(-g^2 / 2) / sqrt(2 pi) with g^2 as hi + lo (an fma), as Phi's exponent.
The backward moves 3 reads and 2 writes an element, so it is memory-bound like the forward.

Performance: the kernel is memory-bound (read 2 t i, write t i elements; ~30 flops and two MUFU ops
an element at most, against ~60 fp32 FMA and ~8 MUFU a 16-bit element that Hopper's bandwidth
leaves room for). Each program moves one tile of BLOCK_M rows x BLOCK_N columns (16 KB of input
and 8 KB of output for 16-bit data), loads are 16-byte vectors whenever the row strides and i are
multiples of 8 (16-bit) or 4 (fp32) elements; programs walk column blocks of a row first, so
consecutive programs stream consecutive memory. Measured on an H100 (benchmarks/gpu_mlp.py,
reports/baselines/mlp-bench-h100.json): 95-101% of the device copy rate at 16K tokens x 14336 /
18944 in every dtype and activation, 88-97% at 4K tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ACT_SILU = tl.constexpr(0)
ACT_GELU_TANH = tl.constexpr(1)
ACT_GELU_ERF = tl.constexpr(2)
ACTIVATIONS = {("swiglu", None): 0, ("geglu", "tanh"): 1, ("geglu", "erf"): 2}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# tanh GELU: sigmoid(z), z = 2 sqrt(2 / pi) (g + 0.044715 g^3) = g (GELU_K0 + GELU_K1 g^2)
GELU_K0 = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
GELU_K1 = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi) * 0.044715)
RSQRT2 = tl.constexpr(1.0 / math.sqrt(2.0))
# erfc(a) = t exp(-a^2 + P(t)), t = 1 / (1 + ERFC_P a); P's coefficients, constant term first.
ERFC_P = tl.constexpr(0.5)
CDF_CLAMP = tl.constexpr(16.0)
RSQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
ERFC_T_MIN = tl.constexpr(1.0 / (1.0 + 0.5 * 10.5))  # a = 10.5: erfc underflows fp32 beyond
C0 = tl.constexpr(-1.2654595234870583)
C1 = tl.constexpr(0.998868406666354)
C2 = tl.constexpr(0.38460636771813217)
C3 = tl.constexpr(0.0443623435504635)
C4 = tl.constexpr(-0.02751209170696793)
C5 = tl.constexpr(-0.025994682841872035)
C6 = tl.constexpr(-0.7619841921205215)
C7 = tl.constexpr(1.206169534811215)
C8 = tl.constexpr(-0.7018472679782412)
C9 = tl.constexpr(0.14879115527827563)

# Elements a program handles: 16 KB of input for 16-bit data (8 KB of output), the same element
# count for fp32; columns per program at most BLOCK_N_MAX, then rows to fill the tile; 16 elements a
# thread. Swept on an H100 (benchmarks/gpu_mlp.py --tune; % of the 3.0 TB/s copy rate, bf16
# t = 16384 / 4096 tokens, i = 14336): 4 warps (32 elements a thread) held silu at 100 / 95% but
# erf, the longest activation, at 95 / 90%; 8 warps give 101 / 97% (silu) and 100 / 95% (erf),
# fp32 100-101%. Tiles of 16K elements fell to 72-80% (too few programs in flight per SM).
TILE = 4096
BLOCK_N_MAX = 1024
NUM_WARPS = 8


@triton.jit
def _sigmoid(z):
    """sigmoid(z) in fp32 without overflow: exp only ever sees -|z| <= 0."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    return tl.where(z >= 0, r, e * r)


@triton.jit
def _std_normal_cdf(g):
    """Phi(g) = erfc(-g / sqrt 2) / 2 in fp32, without 1 + erf cancelling in the lower tail."""
    # Phi is 0 or 1 in fp32 beyond |g| = 14; the clamp keeps g * g finite (bf16 and fp32 reach
    # 3e38), where the fma below would form inf - inf.
    g = tl.minimum(tl.maximum(g, -CDF_CLAMP), CDF_CLAMP)
    a = tl.abs(g) * RSQRT2
    t = 1.0 / (1.0 + ERFC_P * a)
    tc = tl.maximum(t, ERFC_T_MIN)
    p = C9
    p = p * tc + C8
    p = p * tc + C7
    p = p * tc + C6
    p = p * tc + C5
    p = p * tc + C4
    p = p * tc + C3
    p = p * tc + C2
    p = p * tc + C1
    p = p * tc + C0
    hi = g * g
    lo = tl.fma(g, g, -hi)  # g^2 = hi + lo exactly; a^2 = g^2 / 2
    half_erfc = 0.5 * t * tl.exp((p - 0.5 * hi) - 0.5 * lo)
    return tl.where(g < 0, half_erfc, 1.0 - half_erfc)


@triton.jit
def _activation(g, ACT: tl.constexpr):
    if ACT == ACT_SILU:
        return g * _sigmoid(g)
    elif ACT == ACT_GELU_TANH:
        return g * _sigmoid(g * (GELU_K0 + GELU_K1 * g * g))
    else:
        return g * _std_normal_cdf(g)


@triton.jit
def _glu_kernel(
    G_ptr, U_ptr, Y_ptr, n_rows, n_cols, n_col_blocks, stride_g_row, stride_u_row, stride_y_row,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid // n_col_blocks  # column blocks of a row block first: consecutive programs stream
    pid_n = pid % n_col_blocks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < n_rows)[:, None] & (offs_n < n_cols)[None, :]
    rows = offs_m.to(tl.int64)  # rows * stride can pass 2^31 elements
    g = tl.load(G_ptr + rows[:, None] * stride_g_row + offs_n[None, :], mask=mask, other=0.0)
    u = tl.load(U_ptr + rows[:, None] * stride_u_row + offs_n[None, :], mask=mask, other=0.0)
    y = _activation(g.to(tl.float32), ACT) * u.to(tl.float32)  # fp32; one rounding, on store
    tl.store(Y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_grad(z):
    """s(z) (1 - s(z)) as s(z) s(-z) = e / (1 + e)^2, e = exp(-|z|): nothing cancels or overflows."""
    e = tl.exp(-tl.abs(z))
    q = 1.0 / (1.0 + e)
    return e * q * q


@triton.jit
def _activation_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32, from one sigmoid or one Phi."""
    if ACT == ACT_SILU:
        s = _sigmoid(g)
        return g * s, s + g * _sigmoid_grad(g)
    elif ACT == ACT_GELU_TANH:
        z = g * (GELU_K0 + GELU_K1 * g * g)
        s = _sigmoid(z)
        return g * s, s + g * _sigmoid_grad(z) * (GELU_K0 + 3.0 * GELU_K1 * g * g)
    else:
        p = _std_normal_cdf(g)
        gc = tl.minimum(tl.maximum(g, -CDF_CLAMP), CDF_CLAMP)  # phi(16) = 0 in fp32; keeps g^2 finite
        hi = gc * gc
        lo = tl.fma(gc, gc, -hi)
        return g * p, p + g * (tl.exp(-0.5 * hi - 0.5 * lo) * RSQRT_2PI)


@triton.jit
def _glu_bwd_kernel(
    G_ptr, U_ptr, DY_ptr, DG_ptr, DU_ptr, n_rows, n_cols, n_col_blocks, stride_g_row, stride_u_row,
    stride_dy_row, stride_dg_row, stride_du_row,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid // n_col_blocks
    pid_n = pid % n_col_blocks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < n_rows)[:, None] & (offs_n < n_cols)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    g = tl.load(G_ptr + rows * stride_g_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + rows * stride_u_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY_ptr + rows * stride_dy_row + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _activation_grad(g, ACT)
    tl.store(DG_ptr + rows * stride_dg_row + offs_n[None, :], (dy * u * da).to(DG_ptr.dtype.element_ty), mask=mask)
    tl.store(DU_ptr + rows * stride_du_row + offs_n[None, :], (dy * a).to(DU_ptr.dtype.element_ty), mask=mask)


def _check_2d(name: str, a: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"{name} must be a 2-D tensor, got shape {shape}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {a.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if a.shape[1] > 1 and a.stride(1) != 1:
        raise ValueError(f"{name} must have last-dim stride 1, got strides {a.stride()}")


def _activation_code(op: str, approx: str | None) -> int:
    key = (op, approx if op == "geglu" else None)
    if key not in ACTIVATIONS:
        raise ValueError(f"unknown gelu approximation {approx!r} (tanh, erf)")
    return ACTIVATIONS[key]


def _launch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None, act: int) -> torch.Tensor:
    _check_2d("gate", gate)
    _check_2d("up", up)
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up must match gate: gate {tuple(gate.shape)} {gate.dtype} {gate.device}, "
                         f"up {tuple(up.shape)} {up.dtype} {up.device}")
    t, i = gate.shape
    if out is None:
        out = torch.empty((t, i), dtype=gate.dtype, device=gate.device)
    if tuple(out.shape) != (t, i) or out.dtype != gate.dtype or out.device != gate.device:
        raise ValueError(f"out must be ({t}, {i}) {gate.dtype} on {gate.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if i > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have last-dim stride 1, got strides {out.stride()}")
    if t > 1 and out.stride(0) < i:
        raise ValueError(f"out row stride {out.stride(0)} < i={i}: rows would overlap")
    if t == 0 or i == 0:
        return out
    block_n = min(BLOCK_N_MAX, max(16, triton.next_power_of_2(i)))
    block_m = min(max(1, TILE // block_n), triton.next_power_of_2(t))
    n_col_blocks = triton.cdiv(i, block_n)
    grid = (triton.cdiv(t, block_m) * n_col_blocks,)
    _glu_kernel[grid](
        gate, up, out, t, i, n_col_blocks, gate.stride(0), up.stride(0), out.stride(0),
        ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS,
    )
    return out


def _halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of a fused gate-first projection h (t, 2i): no copy."""
    _check_2d("h", h)
    if h.shape[1] % 2:
        raise ValueError(f"a fused gate/up projection h has an even width 2i, got shape {tuple(h.shape)}")
    i = h.shape[1] // 2
    return h[:, :i], h[:, i:]


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up. gate, up: (t, i) fp32/fp16/bf16, last-dim stride 1, any row strides;
    out: (t, i) in their dtype (allocated if None). Returns out."""
    return _launch(gate, up, out, _activation_code("swiglu", None))


def swiglu_fused(h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(h[:, :i]) * h[:, i:] of a fused gate-first projection h (t, 2i). Returns out (t, i)."""
    gate, up = _halves(h)
    return _launch(gate, up, out, _activation_code("swiglu", None))


def geglu(gate: torch.Tensor, up: torch.Tensor, approx: str = "tanh", *,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate) * up, GELU "tanh" (the approximation) or "erf" (exact). Shapes as `swiglu`."""
    return _launch(gate, up, out, _activation_code("geglu", approx))


def geglu_fused(h: torch.Tensor, approx: str = "tanh", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(h[:, :i]) * h[:, i:] of a fused gate-first projection h (t, 2i). Returns out (t, i)."""
    gate, up = _halves(h)
    return _launch(gate, up, out, _activation_code("geglu", approx))


def _glu_backward(act: int, gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, dgate: torch.Tensor,
                  dup: torch.Tensor) -> None:
    for name, a in (("up", up), ("dy", dy), ("dgate", dgate), ("dup", dup)):
        _check_2d(name, a)
        if a.shape != gate.shape or a.dtype != gate.dtype or a.device != gate.device:
            raise ValueError(f"{name} must match gate: gate {tuple(gate.shape)} {gate.dtype} {gate.device}, "
                             f"{name} {tuple(a.shape)} {a.dtype} {a.device}")
    t, i = gate.shape
    for name, a in (("dgate", dgate), ("dup", dup)):
        if t > 1 and a.stride(0) < i:
            raise ValueError(f"{name} row stride {a.stride(0)} < i={i}: rows would overlap")
    if t == 0 or i == 0:
        return
    block_n = min(BLOCK_N_MAX, max(16, triton.next_power_of_2(i)))
    block_m = min(max(1, TILE // block_n), triton.next_power_of_2(t))
    n_col_blocks = triton.cdiv(i, block_n)
    _glu_bwd_kernel[(triton.cdiv(t, block_m) * n_col_blocks,)](
        gate, up, dy, dgate, dup, t, i, n_col_blocks, gate.stride(0), up.stride(0), dy.stride(0), dgate.stride(0),
        dup.stride(0), ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS,
    )


def _op_code(op: str, approx: str) -> int:
    if op not in ("swiglu", "geglu"):
        raise ValueError(f"unknown gated activation {op!r} (swiglu, geglu)")
    return _activation_code(op, approx)


def glu_backward(op: str, gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, approx: str = "tanh", *,
                 out_dgate: torch.Tensor | None = None, out_dup: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) = (dy up act'(gate), dy act(gate)) of swiglu / geglu (`op`, GELU `approx`).
    gate, up, dy: (t, i), one dtype, last-dim stride 1; outputs allocated when None."""
    _check_2d("gate", gate)
    dgate = torch.empty_like(gate) if out_dgate is None else out_dgate
    dup = torch.empty_like(gate) if out_dup is None else out_dup
    _glu_backward(_op_code(op, approx), gate, up, dy, dgate, dup)
    return dgate, dup


def glu_backward_fused(op: str, h: torch.Tensor, dy: torch.Tensor, approx: str = "tanh", *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """dh (t, 2i) = [dgate, dup] of a fused gate-first projection h (t, 2i); dy: (t, i). Returns out."""
    gate, up = _halves(h)
    if out is None:
        out = torch.empty_like(h)
    if not isinstance(out, torch.Tensor) or out.shape != h.shape or out.dtype != h.dtype or out.device != h.device:
        raise ValueError(f"out must be a {tuple(h.shape)} {h.dtype} tensor on {h.device}")
    i = h.shape[1] // 2
    _glu_backward(_op_code(op, approx), gate, up, dy, out[:, :i], out[:, i:])
    return out
