"""The backward of the fused MoE experts layer over routed tokens, in Triton (grouped GEMMs over sorted token blocks).

    experts_backward(x, ids, weights, w13, w2, dout, *, ws13=None, ws2=None, out=None, block_m=None) -> {name: tensor}

Dense weights (x's dtype); outputs dx (T, D) in x's dtype, dweights (T, k), dw13 (E, 2F, D), dw2 (E, D, F) (and
dws13, dws2 for shared experts) fp32 (refimpl/moe_experts_grad.py). Steps, per weight set (the routed experts; the
shared ones as S more experts with their own layout, slot t S + s, weight 1):
1. Alignment (kernels/triton/moe_align.py, the moe.align op's kernel, as the forward): the T k slots (slot = t k + j)
   sorted by expert (stable), each expert's run padded to a multiple of BLOCK_M with the sentinel T k, one expert
   id a block (-1 past the last segment: skipped); each expert's first block and block count (from the counts, the
   same layout: an empty expert owns no block) for step 4.
2. `_recompute_dact`: a program per (block, BLOCK_N columns of F): over D, three fp32 accumulators: gate and up (the
   block's x rows against w13[e]'s gate and up rows, the forward's GEMM1) and dact0 = dout rows @ W2[e] (W2^T
   dout). Epilogue in fp32: act = silu(g) u rounded to x's dtype (the forward's act_r, stored for dW2), the
   slot's partial dweights sum_f act_r dact0 over the tile (stored per (slot, column tile), summed in step 5 in
   tile order), dact = w dact0 and the SwiGLU backward dh = (dact u silu'(g) | dact silu(g)), stored fp32 (T k, 2F).
3. `_dx`: a program per (block, BLOCK_N columns of D): dh rows @ W13[e] over 2F, stored per slot (T k, D) fp32.
4. `_wgrad`: a program per (expert, BLOCK_N rows, BLOCK_K columns) of dW13 = dh^T @ x and of dW2 = (w dout)^T @
   act_r: the expert's blocks in order, one fp32 accumulator, stored whole (an expert with no block stores zeros).
5. dx[t] = the fp32 sum of its k slot rows then its S shared rows, rounded once (`_sum_slots` of the forward);
   dweights = the sum of its column-tile partials (torch, in tile order). Deterministic: no atomics; every sum in
   a fixed order.
bf16 / fp16: the weights, x, dout and act_r are 16-bit tl.dot operands as stored (exact); the fp32 operands (dh,
w dout) enter a 16-bit dot as two parts, hi = rnd16(a) and lo = rnd16(a - hi) (`_dot_split`): 16 (bf16) or 22
(fp16) bits of a, where the golden keeps them exact (a plain rounding would cost u per term, beyond fp16's 2.05 u
limit at the tails). fp32: "ieee" dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_parity.kernels.cpu.moe_experts_grad import check_backward_args, grad_shapes
from kernel_parity.kernels.triton.moe_align import align
from kernel_parity.kernels.triton.moe_experts import _sum_slots, block_m_for

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 4


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _dot_split(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w for an fp32 a and a stored w: fp32 "ieee", or a's two 16-bit parts (hi + lo) against w."""
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    hi = a.to(w.dtype)
    lo = (a - hi.to(tl.float32)).to(w.dtype)
    return tl.dot(lo, w, tl.dot(hi, w, acc))


@triton.jit
def _recompute_dact(X, DOUT, W13, W2, SID, EID, RW, ACT, DH, DWT, n_slots, TOPK, D, F, n_ft,
                    stride_x, stride_do, stride_we, stride_w2e, stride_a, stride_h,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(EID + pid_m).to(tl.int64)
    if e < 0:  # a block past the last expert's (moe.align's tail)
        return
    slot = tl.load(SID + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slot < n_slots
    tok = slot // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    w_base = W13 + e * stride_we
    w2_base = W2 + e * stride_w2e
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        rows = valid[:, None] & mask_k[None, :]
        a = tl.load(X + tok[:, None] * stride_x + offs_k[None, :], mask=rows, other=0.0)
        dy = tl.load(DOUT + tok[:, None] * stride_do + offs_k[None, :], mask=rows, other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(w_base + offs_n[None, :] * D + offs_k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + F) * D + offs_k[:, None], mask=wmask, other=0.0)
        w2 = tl.load(w2_base + offs_k[:, None] * F + offs_n[None, :], mask=wmask, other=0.0)
        acc_g = _dot(a, wg, acc_g, IEEE)
        acc_u = _dot(a, wu, acc_u, IEEE)
        acc_d = _dot(dy, w2, acc_d, IEEE)
    s = 1.0 / (1.0 + tl.exp(-acc_g))
    sg = acc_g * s
    s1 = s * (1.0 + acc_g * (1.0 - s))
    act = (sg * acc_u).to(ACT.dtype.element_ty)
    out_mask = valid[:, None] & mask_n[None, :]
    tl.store(ACT + slot[:, None] * stride_a + offs_n[None, :], act, mask=out_mask)
    part = tl.sum(act.to(tl.float32) * acc_d, axis=1)
    tl.store(DWT + slot * n_ft + pid_n, part, mask=valid)
    rw = tl.load(RW + slot, mask=valid, other=0.0)
    dact = acc_d * rw[:, None]
    dgate = dact * acc_u * s1
    dup = dact * sg
    tl.store(DH + slot[:, None] * stride_h + offs_n[None, :], dgate, mask=out_mask)
    tl.store(DH + slot[:, None] * stride_h + F + offs_n[None, :], dup, mask=out_mask)


@triton.jit
def _dx(DH, W13, SID, EID, DXS, n_slots, D, F2, stride_h, stride_we, stride_dx,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(EID + pid_m).to(tl.int64)
    if e < 0:  # a block past the last expert's (moe.align's tail)
        return
    slot = tl.load(SID + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slot < n_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    w_base = W13 + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F2, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < F2
        dh = tl.load(DH + slot[:, None] * stride_h + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                     other=0.0)
        w = tl.load(w_base + offs_k[:, None] * D + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot_split(dh, w, acc, IEEE)
    tl.store(DXS + slot[:, None] * stride_dx + offs_n[None, :], acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _wgrad(A, B, SID, BSTART, BCOUNT, RW, OUT, n_slots, TOPK, N, K, stride_a, stride_b, stride_oe,
           A_TOKEN: tl.constexpr, A_WEIGHTED: tl.constexpr, B_TOKEN: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """OUT[e] (N, K) = sum over expert e's slots of a_slot (x) b_slot: a (N,) from A's row (the slot's, or its
    token's: A_TOKEN), times the slot's routing weight (A_WEIGHTED), b (K,) from B's row likewise; fp32."""
    e = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    first = tl.load(BSTART + e)
    count = tl.load(BCOUNT + e)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for b in range(first, first + count):
        slot = tl.load(SID + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = slot < n_slots
        ra = slot // TOPK if A_TOKEN else slot
        rb = slot // TOPK if B_TOKEN else slot
        a = tl.load(A + ra[:, None] * stride_a + offs_n[None, :], mask=valid[:, None] & mask_n[None, :],
                    other=0.0).to(tl.float32)
        if A_WEIGHTED:
            a = a * tl.load(RW + slot, mask=valid, other=0.0)[:, None]
        bt = tl.load(B + rb[:, None] * stride_b + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        acc = _dot_split(tl.trans(a), bt, acc, IEEE)
    tl.store(OUT + e * stride_oe + offs_n[:, None] * K + offs_k[None, :], acc, mask=mask_n[:, None] & mask_k[None, :])


def _routed(x, dout, ids, weights, w13, w2, dw13, dw2, block_m: int):
    """(dxs (T k, D) fp32: each slot's dx partial, dweights (T k,) fp32), dw13 and dw2 written (steps 1-4)."""
    t, d = x.shape
    k = ids.shape[1]
    e = w13.shape[0]
    f = w13.shape[1] // 2
    n = t * k
    dev = x.device
    sorted_ids, expert_ids, _ = align(ids.to(torch.int32), e, block_m)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
    nblk = (counts + block_m - 1) // block_m
    bstart = (torch.cumsum(nblk, 0) - nblk).to(torch.int32)
    nblk = nblk.to(torch.int32)
    nb = expert_ids.numel()
    n_ft = triton.cdiv(f, BLOCK_N)
    act = torch.empty((n, f), dtype=x.dtype, device=dev)
    dh = torch.empty((n, 2 * f), dtype=torch.float32, device=dev)
    dwt = torch.zeros((n, n_ft), dtype=torch.float32, device=dev)
    dxs = torch.zeros((n, d), dtype=torch.float32, device=dev)  # a slot no block wrote reads 0
    ieee = x.dtype == torch.float32
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    if nb:
        _recompute_dact[(nb, n_ft)](
            x, dout, w13, w2, sorted_ids, expert_ids, rw, act, dh, dwt, n, k, d, f, n_ft, x.stride(0), dout.stride(0),
            w13.stride(0), w2.stride(0), act.stride(0), dh.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, IEEE=ieee, num_warps=NUM_WARPS)
        _dx[(nb, triton.cdiv(d, BLOCK_N))](
            dh, w13, sorted_ids, expert_ids, dxs, n, d, 2 * f, dh.stride(0), w13.stride(0), dxs.stride(0),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee, num_warps=NUM_WARPS)
    _wgrad[(e, triton.cdiv(2 * f, BLOCK_N), triton.cdiv(d, BLOCK_K))](
        dh, x, sorted_ids, bstart, nblk, rw, dw13, n, k, 2 * f, d, dh.stride(0), x.stride(0), dw13.stride(0),
        A_TOKEN=False, A_WEIGHTED=False, B_TOKEN=True, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
        num_warps=NUM_WARPS)
    _wgrad[(e, triton.cdiv(d, BLOCK_N), triton.cdiv(f, BLOCK_K))](
        dout, act, sorted_ids, bstart, nblk, rw, dw2, n, k, d, f, dout.stride(0), act.stride(0), dw2.stride(0),
        A_TOKEN=True, A_WEIGHTED=True, B_TOKEN=False, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=ieee,
        num_warps=NUM_WARPS)
    return dxs, dwt.sum(dim=1)


def _check_out(name: str, a, shape, dtype, device):
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(shape) or a.dtype != dtype or a.device != device:
        raise ValueError(f"moe.experts_backward: out[{name!r}] must be a {dtype} tensor of shape {tuple(shape)} on "
                         f"{device}")
    want = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        want[i] = want[i + 1] * shape[i + 1]
    if any(st != w for st, w, n in zip(a.stride(), want, shape) if n > 1):
        raise ValueError(f"moe.experts_backward: out[{name!r}] must be contiguous, got strides {a.stride()}")


def experts_backward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     dout: torch.Tensor, *, ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None,
                     out: dict | None = None, block_m: int | None = None) -> dict[str, torch.Tensor]:
    """{"dx", "dweights", "dw13", "dw2"} (and "dws13", "dws2") for the cotangent dout (module docstring)."""
    t, d, e, f, k, s, fs = check_backward_args(x, ids, weights, w13, w2, dout, ws13, ws2)
    named = {"x": x, "dout": dout, "w13": w13, "w2": w2, **({"ws13": ws13, "ws2": ws2} if s else {})}
    for name, a in named.items():
        if not isinstance(a, torch.Tensor) or a.dtype != x.dtype or not a.is_contiguous():
            raise ValueError(f"moe.experts_backward: {name} must be a contiguous tensor of x's dtype "
                             f"{getattr(x, 'dtype', None)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"moe.experts_backward: x dtype must be one of float32, bfloat16, float16, got {x.dtype}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("moe.experts_backward: ids must be an int32 / int64 tensor")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32:
        raise ValueError("moe.experts_backward: weights must be a float32 tensor")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"moe.experts_backward: ids must be in [0, E={e})")
    if block_m is not None and block_m not in (16, 32, 64, 128):
        raise ValueError(f"moe.experts_backward: block_m={block_m!r} must be one of 16, 32, 64, 128")
    given = dict(out or {})
    res = {}
    for name, shape in grad_shapes(t, d, e, f, k, s, fs).items():
        dtype = x.dtype if name == "dx" else torch.float32
        a = given.pop(name, None)
        if a is None:
            a = torch.empty(shape, dtype=dtype, device=x.device)
        _check_out(name, a, shape, dtype, x.device)
        res[name] = a
    if given:
        raise ValueError(f"moe.experts_backward: no output named {sorted(given)} (outputs: {', '.join(res)})")
    dxs, dwt = _routed(x, dout, ids, weights, w13, w2, res["dw13"], res["dw2"], block_m or block_m_for(t, k, e))
    res["dweights"].copy_(dwt.reshape(t, k))
    dxss = dxs
    if s:
        sid = torch.arange(s, dtype=torch.int32, device=x.device).expand(t, s).contiguous()
        dxss, _ = _routed(x, dout, sid, torch.ones((t, s), dtype=torch.float32, device=x.device), ws13, ws2,
                          res["dws13"], res["dws2"], block_m or block_m_for(t, s, s))
    if t:
        block_d = min(1024, triton.next_power_of_2(d))
        _sum_slots[(t, triton.cdiv(d, block_d))](dxs, dxss, res["dx"], d, k, s, dxs.stride(0), dxss.stride(0),
                                                 res["dx"].stride(0), BLOCK_D=block_d)
    return res
