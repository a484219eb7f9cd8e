"""GPU run of the gluon backend's kernels (kernels/gluon/*) on Hopper: the API they rely on, their parity
with the Triton kernels on the same quantized operands, and their speed beside the peers and the
hardware's matmul rate measured in the same run.

    python benchmarks/gpu_gluon.py [--sections api,parity,bench,attn_parity,attn_bench,mla,fused,gemv] [--out PATH]
                                   [--configs all|default]

- api: Triton's version, the signatures of the Gluon calls the kernels make (kernels/gluon/compat.py).
- parity: gemm_fp8 (gluon) vs kernels/triton/gemm_fp8.py on the same qa / sa / w / w_scale (the Triton
  quantizer's output), bits equal or not, max |diff|, and both against an fp32 emulation of the blocks
  (torch: per 128-wide K block a float32 matmul of the e4m3 values, promoted with sa * sw), at edge shapes
  (M 1, 3, 33; N 48, 130; K 256 .. 8192) and each config; the compiled kernel's registers and spills.
- bench: M = N = K = 8192 and DeepSeek-V3 shapes, 1 x 128 x 128 scales: gluon (each config; with and
  without the activation quantizer), triton, torch._scaled_mm blockwise (cuBLASLt), the quantizer alone,
  and the bf16 matmul rate of this GPU in this run. do_bench medians (L2 flushed by do_bench); `graph`: the
  first config, _scaled_mm and the quantizer replayed from CUDA graphs (GPU time, no Python launch gaps; L2 not
  flushed between replays).
- attn_parity: attention.prefill (gluon) vs the Triton kernel and an fp32 SDPA (math) at multi-tile shapes.
- attn_bench: causal prefill bf16, 32 / 8 heads, s 4096, d 64 / 128 / 256: gluon, triton, SDPA cuDNN and flash
  (each `do_bench`), TFLOP/s of the causal half, and the run's bf16 matmul rate.
- mla: kernels/gluon/mla.py against the Triton mla_decode, TFLOP/s beside the run's matmul rate.
- fused: the fused FP8 MLA branch (kernels/gluon/mla_fused.py) against the Triton branch (out at edge lengths) and
  the eager branch (kernels/torch/mla.py), b 128, one new token, h_q 128 / 16, 4K / 16K cached keys.
- gemv: kernels/gluon/gemv.py (Q4_K x Q8_K) and gemv_q8_0.py (Q8_0 x Q8_0), M = 1, each at its configs, against
  triton-q8's GEMV and a pure read of the same bytes, CUDA-graph replays over rotated weights (L2 cold), alone and
  with the activation quantizer.
Every item runs in its own try: an error is recorded with its message and the run goes on. JSON to --out
(default $OUT/gluon.json), rewritten after each item.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = ((128, 4, 8, 232, 40), (128, 5, 8, 232, 40), (128, 6, 8, 232, 40), (128, 4, 16, 232, 40),
           (128, 4, 8, 232, 40, 0))  # the last without the skew (one dot at a time per warp group)
# per d: extra gluon prefill configs timed beside the default (BLOCK_N, STAGES, PIPE)
ATTN_CONFIGS = {64: ((128, 3, 0), (64, 3, 1), (128, 3, 2), (64, 3, 2)), 128: ((128, 2, 0), (128, 2, 1), (128, 2, 2),
                                                                        (64, 3, 2)),
                256: ((64, 2, 1), (64, 2, 2))}  # PIPE 2: the ping-pong (work in progress)
PARITY_SHAPES = ((1, 256, 256), (3, 48, 256), (33, 130, 512), (128, 256, 1024), (200, 384, 2048),
                 (1000, 1000, 4096), (4096, 4096, 8192))
BENCH_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048), (4096, 24576, 1536), (4096, 2112, 7168),
                (4096, 4096, 4096))


def _record(doc: dict, out: Path) -> None:
    out.write_text(json.dumps(doc, indent=1, default=str))


def _err(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-3000:]


def section_api() -> dict:
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from kernel_parity.kernels.gluon.compat import missing, ws_list

    def sig(f):
        try:
            return str(inspect.signature(f))
        except Exception as e:  # noqa: BLE001
            return f"? {e}"

    return {"triton": triton.__version__, "missing": list(missing()), "ws_list": ws_list(),
            "warp_specialize": sig(gl.warp_specialize), "warpgroup_mma": sig(hopper.warpgroup_mma),
            "warpgroup_mma_wait": sig(hopper.warpgroup_mma_wait),
            "tma": {n: sig(getattr(tma, n)) for n in dir(tma) if not n.startswith("_") and callable(getattr(tma, n))},
            "mbarrier": {n: sig(getattr(mbarrier, n)) for n in dir(mbarrier) if not n.startswith("_")
                         and callable(getattr(mbarrier, n))},
            "gl": sorted(n for n in dir(gl) if not n.startswith("_")),
            "hopper": sorted(n for n in dir(hopper) if not n.startswith("_"))}


def _operands(m, n, k, seed=0):
    import torch

    from kernel_parity.kernels.triton.gemm_fp8 import act_quant_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w32 = torch.randn(n, k, device="cuda", generator=g)
    nb, kb = (n + 127) // 128, (k + 127) // 128
    # weight blocks whose scales differ by orders of magnitude (neighbouring blocks told apart)
    mag = 10.0 ** torch.randint(-3, 3, (nb, kb), device="cuda", generator=g).float()
    w32 = w32 * mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    padded = w32.new_zeros(nb * 128, kb * 128)
    padded[:n, :k] = w32
    amax = padded.abs().reshape(nb, 128, kb, 128).amax(dim=(1, 3))
    sw = (amax.clamp_min(1e-4) / 448.0).float()
    w = (w32 / sw.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(torch.float8_e4m3fn)
    qa, sa = act_quant_fp8(a, 1, 128)
    bias = torch.randn(n, device="cuda", generator=g)
    return a, qa, sa, w, sw, bias


def _emulated(qa, sa, w, sw, bias):
    import torch

    m, k = qa.shape
    n = w.shape[0]
    out = torch.zeros(m, n, device="cuda", dtype=torch.float64)
    for kb in range((k + 127) // 128):
        sl = slice(kb * 128, (kb + 1) * 128)
        d = qa[:, sl].double() @ w[:, sl].double().T
        out += d * sa[:, kb].double()[:, None] * sw[:, kb].double().repeat_interleave(128)[:n][None, :]
    return out + bias.double()[None, :]


def section_parity(configs) -> list[dict]:
    import torch

    from kernel_parity.kernels.gluon import gemm_fp8 as G
    from kernel_parity.kernels.triton import gemm_fp8 as T

    rows = []
    for (m, n, k) in PARITY_SHAPES:
        a, qa, sa, w, sw, bias = _operands(m, n, k)
        ref = _emulated(qa, sa, w, sw, bias)
        tri = T.gemm_fp8_scaled(qa, sa, w, sw, bias, gm=1, gn=128, gk=128)
        row = {"shape": [m, n, k], "triton_rel": float(((tri.double() - ref).norm() / ref.norm()).item())}
        for cfg in configs:
            key = "-".join(map(str, cfg))
            try:
                out = G.gemm_fp8_scaled(qa, sa, w, sw, bias, gn=128, config=cfg)
                torch.cuda.synchronize()
                d = (out.float() - tri.float()).abs()
                row[key] = {"bits_equal": bool(torch.equal(out, tri)), "frac_equal": float((d == 0).float().mean()),
                            "max_abs_vs_triton": float(d.max()), "rel_vs_emulated":
                            float(((out.double() - ref).norm() / ref.norm()).item()),
                            "nan": bool(torch.isnan(out).any())}
            except Exception as e:  # noqa: BLE001
                row[key] = {"error": _err(e)}
        rows.append(row)
    return rows


def _compiled_info(cfg) -> dict:
    from kernel_parity.kernels.gluon import gemm_fp8 as G

    info = {}
    for k_, v in G._gemm_fp8_kernel.device_caches.items() if hasattr(G._gemm_fp8_kernel, "device_caches") else []:
        try:
            cache = v[0]
            for key, ck in cache.items():
                info[str(key)[-200:]] = {"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
                                         "shared": getattr(getattr(ck, "metadata", None), "shared", None)}
        except Exception as e:  # noqa: BLE001
            info["error"] = _err(e)
    return info


# (QUANT_ROWS, QUANT_GROUPS) of the activation quantizer, the first the default (work in progress)
QUANT_VARIANTS = ((8, 1), (8, 4), (8, 8), (4, 8), (16, 4), (2, 16), (1, 32))


def _ms(fn) -> float:
    """do_bench's median in ms (L2 flushed before every call)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _run_header() -> dict:
    """A section's result: the device and the bf16 8192^3 matmul rate measured now, its ceiling: the best of
    three do_bench medians (one median moved 672-814 TFLOP/s between calls on one H200; the best of three is
    the stricter denominator), the three beside it."""
    import torch

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rates = [2 * 8192 ** 3 / _ms(lambda: x @ x) / 1e9 for _ in range(3)]
    return {"device": torch.cuda.get_device_name(), "matmul_bf16_tflops": max(rates), "matmul_bf16_runs": rates,
            "shapes": []}


def section_bench(configs) -> dict:
    import torch

    from kernel_parity.kernels.gluon import gemm_fp8 as G
    from kernel_parity.kernels.triton import gemm_fp8 as T

    ms = _ms
    res = _run_header()
    for (m, n, k) in BENCH_SHAPES:
        a, qa, sa, w, sw, bias = _operands(m, n, k)
        fl = 2 * m * n * k
        row = {"shape": [m, n, k]}
        tf = lambda t: fl / t / 1e9  # noqa: E731
        try:
            t = ms(lambda: T.act_quant_fp8(a, 1, 128))
            row["quantizer_ms"] = t
            row["quantizer_gbs"] = (a.numel() * (a.element_size() + 1) + 4 * sa.numel()) / t / 1e6
            q0, s0 = T.act_quant_fp8(a, 1, 128)
            sweep = {}
            for rows_, groups in QUANT_VARIANTS:  # work in progress: rows x K groups a program, same bits
                T.QUANT_ROWS, T.QUANT_GROUPS = rows_, groups
                try:
                    q1, s1 = T.act_quant_fp8(a, 1, 128)
                    same = bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1))
                    sweep[f"{rows_}x{groups}"] = {"ms": ms(lambda: T.act_quant_fp8(a, 1, 128)), "same_bits": same}
                except Exception as e:  # noqa: BLE001
                    sweep[f"{rows_}x{groups}"] = _err(e)
            T.QUANT_ROWS, T.QUANT_GROUPS = QUANT_VARIANTS[0]
            row["quantizer_sweep"] = sweep
        except Exception as e:  # noqa: BLE001
            row["quantizer"] = _err(e)
        try:
            t = ms(lambda: T.gemm_fp8_scaled(qa, sa, w, sw, gm=1, gn=128, gk=128))
            row["triton"] = {"ms": t, "tflops": tf(t)}
        except Exception as e:  # noqa: BLE001
            row["triton"] = _err(e)
        try:
            sb = sw.t()
            sa_cm = sa.t().contiguous().t()
            t = ms(lambda: torch._scaled_mm(qa, w.t(), scale_a=sa_cm, scale_b=sb, out_dtype=torch.bfloat16))
            row["scaled_mm"] = {"ms": t, "tflops": tf(t)}
        except Exception as e:  # noqa: BLE001
            row["scaled_mm"] = _err(e)
        for cfg in configs:
            key = "-".join(map(str, cfg))
            try:
                t = ms(lambda: G.gemm_fp8_scaled(qa, sa, w, sw, gn=128, config=cfg))
                tq = ms(lambda: G.gemm_fp8(a, w, sw, config=cfg))
                row[key] = {"ms": t, "tflops": tf(t), "with_quant_ms": tq, "with_quant_tflops": tf(tq)}
            except Exception as e:  # noqa: BLE001
                row[key] = _err(e)
        try:  # the same calls replayed from a CUDA graph: GPU time without the Python launches between them
            from triton.testing import do_bench_cudagraph

            def gms(fn):
                return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))

            sa_cm = sa.t().contiguous().t()
            g = {"scaled_mm_ms": gms(lambda: torch._scaled_mm(qa, w.t(), scale_a=sa_cm, scale_b=sw.t(),
                                                             out_dtype=torch.bfloat16)),
                 "quantizer_ms": gms(lambda: T.act_quant_fp8(a, 1, 128)),
                 "gluon_ms": gms(lambda: G.gemm_fp8_scaled(qa, sa, w, sw, gn=128, config=configs[0])),
                 "gluon_with_quant_ms": gms(lambda: G.gemm_fp8(a, w, sw, config=configs[0]))}
            g["x_scaled_mm"] = g["scaled_mm_ms"] / g["gluon_ms"]
            g["x_scaled_mm_with_quant"] = g["scaled_mm_ms"] / g["gluon_with_quant_ms"]
            row["graph"] = g
        except Exception as e:  # noqa: BLE001
            row["graph"] = _err(e)
        if isinstance(row.get("scaled_mm"), dict):
            for cfg in configs:
                r = row.get("-".join(map(str, cfg)))
                if isinstance(r, dict):
                    r["x_scaled_mm"] = row["scaled_mm"]["ms"] / r["ms"]
                    r["x_scaled_mm_with_quant"] = row["scaled_mm"]["ms"] / r["with_quant_ms"]
                    r["of_matmul"] = r["tflops"] / res["matmul_bf16_tflops"]
        res["shapes"].append(row)
    return res


ATTN_PARITY = ((2, 300, 300, 4, 2, 128, "bottom_right"), (1, 200, 457, 4, 1, 64, "top_left"),
               (2, 150, 70, 2, 2, 256, "bottom_right"), (2, 257, 200, 2, 1, 32, "none"),
               (1, 1024, 1024, 8, 2, 128, "bottom_right"))
ATTN_BENCH = ((4, 4096, 32, 8, 64), (4, 4096, 32, 8, 128), (4, 4096, 32, 8, 256), (16, 4096, 32, 8, 128))


def _attn_inputs(b, sq, sk, hq, hkv, d, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _sdpa(q, k, v, causal, backend=None):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vt = v.repeat_interleave(group, dim=2).transpose(1, 2)
    mask = None
    if causal != "none":
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + (sk - sq if causal == "bottom_right" else 0)
    be = {"math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    if backend in ("cudnn", "flash"):
        def call():
            with sdpa_kernel(be[backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal != "none")
        return call
    with sdpa_kernel(be["math"]):
        o = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), attn_mask=mask)
    return o.transpose(1, 2)


def _fa4(q, k, v):
    """flash-attn-4's causal forward (CuTe DSL; research/peers-measured.md), or a call that raises why it is
    missing: the bench records the reason in place of a time."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 (a third-party import)
        err = e

        def missing():
            raise RuntimeError(f"flash-attn-4 does not import: {err!r}")
        return missing
    scale = q.shape[-1] ** -0.5
    return lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True)


def section_attn_parity() -> list[dict]:
    import torch

    from kernel_parity.kernels.gluon import attention as G
    from kernel_parity.kernels.triton import attention as T

    rows = []
    for (b, sq, sk, hq, hkv, d, causal) in ATTN_PARITY:
        row = {"shape": [b, sq, sk, hq, hkv, d, causal]}
        try:
            q, k, v = _attn_inputs(b, sq, sk, hq, hkv, d)
            ref = _sdpa(q, k, v, causal)
            o, lse = G.prefill(q, k, v, causal=causal)
            op_, lsep = G.prefill(q, k, v, causal=causal, config=G.CONFIGS[d][:2] + (1,))
            ot, lset = T.prefill(q, k, v, causal=causal)
            row["pipe_max_abs_vs_triton"] = float((op_.float() - ot.float()).abs().max())
            row["pipe_lse_inf_agree"] = bool(torch.equal(torch.isinf(lsep), torch.isinf(lset)))
            for cfg in ATTN_CONFIGS.get(d, ()):  # every benchmarked config computes the same
                oc, lsec = G.prefill(q, k, v, causal=causal, config=cfg)
                row["gluon-" + "-".join(map(str, cfg))] = {
                    "max_abs_vs_triton": float((oc.float() - ot.float()).abs().max()),
                    "lse_inf_agree": bool(torch.equal(torch.isinf(lsec), torch.isinf(lset)))}
            torch.cuda.synchronize()
            seen = torch.isfinite(lset)
            row.update(nan=bool(torch.isnan(o).any()), max_abs_vs_sdpa_fp32=float((o.float() - ref.nan_to_num()).abs().max()),
                       triton_max_abs_vs_sdpa_fp32=float((ot.float() - ref.nan_to_num()).abs().max()),
                       max_abs_vs_triton=float((o.float() - ot.float()).abs().max()),
                       lse_max_abs_vs_triton=float((lse[seen] - lset[seen]).abs().max()) if seen.any() else 0.0,
                       lse_inf_agree=bool(torch.equal(torch.isinf(lse), torch.isinf(lset))))
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rows.append(row)
    return rows


def section_attn_bench() -> dict:
    from kernel_parity.kernels.gluon import attention as G
    from kernel_parity.kernels.triton import attention as T

    ms = _ms
    res = _run_header()
    for (b, s, hq, hkv, d) in ATTN_BENCH:
        q, k, v = _attn_inputs(b, s, s, hq, hkv, d)
        fl = 4 * b * hq * s * s * d / 2  # the causal half
        row = {"shape": [b, s, hq, hkv, d]}
        for cfg in ATTN_CONFIGS.get(d, ()):
            key = "gluon-" + "-".join(map(str, cfg))
            try:
                t = ms(lambda: G.prefill(q, k, v, causal="bottom_right", config=cfg))
                row[key] = {"ms": t, "tflops": fl / t / 1e9}
            except Exception as e:  # noqa: BLE001
                row[key] = _err(e)
        for name, fn in (("gluon", lambda: G.prefill(q, k, v, causal="bottom_right")),
                         ("triton", lambda: T.prefill(q, k, v, causal="bottom_right")),
                         ("cudnn", _sdpa(q, k, v, "bottom_right", "cudnn")),
                         ("fa4", _fa4(q, k, v)),
                         ("flash", _sdpa(q, k, v, "bottom_right", "flash"))):
            try:
                t = ms(fn)
                row[name] = {"ms": t, "tflops": fl / t / 1e9}
            except Exception as e:  # noqa: BLE001
                row[name] = _err(e)
        for peer in ("cudnn", "fa4", "flash", "triton"):
            for key in [k_ for k_ in row if k_.startswith("gluon")]:
                if isinstance(row.get(key), dict) and isinstance(row.get(peer), dict):
                    row[key]["x_" + peer] = row[peer]["ms"] / row[key]["ms"]
        res["shapes"].append(row)
    return res


MLA_BENCH = ((128, 1, 128, 4096), (128, 2, 64, 4096), (128, 1, 128, 16384))  # (b, s_q, h_q, L)


def _mla_inputs(b, s_q, h_q, L, page=64, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = (L + page - 1) // page
    q = torch.randn(b, s_q, h_q, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(b * blocks, page, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(b * blocks, device="cuda", generator=g).to(torch.int32).view(b, blocks)
    seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    return q, cache, table, seqlens


def section_mla() -> dict:
    """kernels/gluon/mla.py against the Triton mla_decode (one split and its own choice),
    parity and TFLOP/s (4 b h_q s_q L (576 + 512) / 2, both dots) beside the bf16 matmul rate of this run."""
    import torch

    from kernel_parity.kernels.gluon import mla as G
    from kernel_parity.kernels.triton import mla as T

    ms = _ms
    res = _run_header()
    for (b, s_q, h_q, L) in MLA_BENCH:
        row = {"shape": [b, s_q, h_q, L]}
        try:
            q, cache, table, seqlens = _mla_inputs(b, s_q, h_q, L)
            fl = 2 * b * h_q * s_q * L * (576 + 512)
            o, lse = G.mla_decode(q, cache, table, seqlens, 576 ** -0.5, causal=True)
            ot, lset = T.mla_decode(q, cache, table, seqlens, 576 ** -0.5, causal=True)
            torch.cuda.synchronize()
            row["max_abs_vs_triton"] = float((o.float() - ot.float()).abs().max())
            row["lse_max_abs_vs_triton"] = float((lse - lset).abs().max())
            for name, fn in (("gluon", lambda: G.mla_decode(q, cache, table, seqlens, 576 ** -0.5, causal=True)),
                             ("triton", lambda: T.mla_decode(q, cache, table, seqlens, 576 ** -0.5, causal=True))):
                try:
                    t = ms(fn)
                    tf = fl / t / 1e9
                    row[name] = {"ms": t, "tflops": tf, "pct_matmul": 100 * tf / res["matmul_bf16_tflops"]}
                except Exception as e:  # noqa: BLE001
                    row[name] = _err(e)
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        res["shapes"].append(row)
    return res


FUSED_BENCH = ((128, 128, 4096), (128, 128, 16384), (128, 16, 4096), (128, 16, 16384))  # (b, h_q, L)
FUSED_REGS = ((240, 32), (232, 40))  # REGS variants timed beside the default at h_q 128
FUSED_PARITY = ((3, 16, 1, (0, 1, 31)), (4, 64, 2, (33, 64, 95, 700)), (2, 128, 1, (1000, 64)),
                (5, 17, 3, (0, 130, 257, 32, 513)))  # (b, h_q, new tokens, cached lengths): edges of 32 / 64


def _fused_inputs(b, h_q, cached, new=1, seed=0, page=64):
    """mla_decode_fused_fp8's positional arguments at DeepSeek-V3's shapes (dn 128, d_r 64, d_c 512, v 128; as
    benchmarks/gpu_mla_tune.py's fused_inputs): `new` tokens a request after `cached` (one length, or one a
    request) cached ones; every cache slot past a request's rows NaN."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    cl = torch.tensor(list(cached) if isinstance(cached, (tuple, list)) else [cached] * b, dtype=torch.int32,
                      device=dev)
    L = int(cl.max()) + new
    blocks = (L + page - 1) // page
    cache = torch.full((b * blocks, page, 1, 576), float("nan"), device=dev, dtype=torch.bfloat16)
    table = torch.randperm(b * blocks, device=dev, generator=g).to(torch.int32).view(b, blocks)
    for r in range(b):
        n = int(cl[r]) + new
        rows = torch.randn(n, 576, device=dev, generator=g).to(torch.bfloat16)
        for j in range((n + page - 1) // page):
            m = min(page, n - j * page)
            cache[int(table[r, j]), :m, 0] = rows[j * page:j * page + m]
    dn, d_r, d_c, dv = 128, 64, 512, 128
    ang = torch.arange(L, device=dev, dtype=torch.float64)[:, None] * \
        10000.0 ** (-torch.arange(0, d_r, 2, device=dev, dtype=torch.float64) / d_r)
    fp8 = lambda *s: (0.05 * torch.randn(s, device=dev, generator=g) * 448).to(torch.float8_e4m3fn)  # noqa: E731
    return [torch.randn(b * new, h_q, dn + d_r, device=dev, generator=g).to(torch.bfloat16),
            torch.arange(0, b * new + 1, new, device=dev, dtype=torch.int32),
            torch.stack([ang.cos(), ang.sin()], -1).reshape(L, d_r).float(),
            1 + 0.1 * torch.randn(d_c, device=dev, generator=g), 1e-6,
            fp8(h_q, d_c, dn), torch.full((h_q, d_c // 128, dn // 128), 1 / 448, device=dev),
            fp8(h_q, dv, d_c), torch.full((h_q, dv // 128, d_c // 128), 1 / 448, device=dev),
            cache, table, cl, 192 ** -0.5]


def _copies(args):
    import torch

    return [x.clone() if isinstance(x, torch.Tensor) else x for x in args]


def section_fused() -> dict:
    """The fused FP8 MLA branch (mla.decode_fused_fp8): kernels/gluon/mla_fused.py (the cached keys' attention in
    Gluon, the rest Triton's) against kernels/triton/mla_fused.py and the eager branch (kernels/torch/mla.py): out
    against the Triton kernel's at edge lengths (parity), then ms at b 128, one new token, and the attention's
    TFLOP/s (2 b h_q L (576 + 512), one part) beside this run's bf16 matmul rate."""
    import torch

    from kernel_parity.kernels.gluon import mla_fused as G
    from kernel_parity.kernels.torch import mla as E
    from kernel_parity.kernels.triton import mla_fused as T

    ms = _ms
    res = _run_header()
    res["parity"] = []
    for (b, h_q, new, cached) in FUSED_PARITY:
        row = {"shape": [b, h_q, new, list(cached)]}
        try:
            args = _fused_inputs(b, h_q, cached, new)
            outs = {}
            for name, fn in (("gluon", G.mla_decode_fused_fp8), ("triton", T.mla_decode_fused_fp8)):
                outs[name] = fn(*_copies(args), attn_sink=torch.linspace(-1, 1, h_q, device="cuda"), max_new_tokens=new).float()
            d = (outs["gluon"] - outs["triton"]).abs()
            row.update(max_abs=float(d.max()), frac_diff=float((d > 0).float().mean()),
                       max_abs_triton=float(outs["triton"].abs().max()),
                       nan=int(outs["gluon"].isnan().sum()),
                       cos=float(torch.nn.functional.cosine_similarity(outs["gluon"].flatten(),
                                                                       outs["triton"].flatten(), dim=0)))
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        res["parity"].append(row)
        print("fused parity", row, flush=True)
    for (b, h_q, L) in FUSED_BENCH:
        row = {"shape": [b, h_q, L]}
        try:
            args = _fused_inputs(b, h_q, L - 1)
            fl = 2 * b * h_q * L * (576 + 512)
            out = torch.empty((b, h_q, 128), dtype=torch.bfloat16, device="cuda")
            # each on fresh copies: a call normalises and ropes the new rows in place (a second call on the
            # same cache sees them rotated twice)
            o_g = G.mla_decode_fused_fp8(*_copies(args), max_new_tokens=1).float()
            o_t = T.mla_decode_fused_fp8(*_copies(args), max_new_tokens=1).float()
            torch.cuda.empty_cache()
            row["max_abs_vs_triton"] = float((o_g - o_t).abs().max())
            row["frac_diff_vs_triton"] = float(((o_g - o_t).abs() > 0).float().mean())
            for name, fn in (("gluon", lambda: G.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1)),
                             ("triton", lambda: T.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1)),
                             ("eager", lambda: E.decode_fused_fp8(*args, inplace=True))):
                try:
                    t = ms(fn)
                    tf = fl / t / 1e9
                    row[name] = {"ms": t, "tflops": tf, "pct_matmul": 100 * tf / res["matmul_bf16_tflops"]}
                except Exception as e:  # noqa: BLE001
                    row[name] = _err(e)
                torch.cuda.empty_cache()
            if h_q == 128:  # the consumer groups' register budget (ptxas spills less at 240)
                for regs in FUSED_REGS:
                    saved = G.REGS
                    G.REGS = regs
                    try:
                        row[f"gluon_regs_{regs[0]}_{regs[1]}"] = ms(
                            lambda: G.mla_decode_fused_fp8(*args, out=out, max_new_tokens=1))
                    except Exception as e:  # noqa: BLE001
                        row[f"gluon_regs_{regs[0]}_{regs[1]}"] = _err(e)
                    finally:
                        G.REGS = saved
            if isinstance(row.get("gluon"), dict) and isinstance(row.get("eager"), dict):
                row["speedup_vs_eager"] = row["eager"]["ms"] / row["gluon"]["ms"]
            del args, out
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        res["shapes"].append(row)
        print("fused bench", row, flush=True)
        torch.cuda.empty_cache()
    return res


GEMV_SHAPES = ((14336, 4096), (4096, 14336))  # (N, K) at M = 1
GEMV_CONFIGS = {  # the first of each is the kernel's default (gemv.GEMV_CONFIG, gemv_q8_0.GEMV_Q8_0_CONFIG)
    "q4_k": ((2, 2, 2, 8), (4, 2, 2, 4), (4, 4, 2, 6), (4, 2, 2, 6), (8, 2, 2, 3), (4, 4, 3, 4), (2, 4, 4, 6),
             (4, 2, 4, 4), (8, 2, 3, 2), (2, 2, 6, 8), (8, 4, 2, 2), (8, 2, 2, 2), (4, 2, 3, 4), (2, 2, 3, 8),
             (2, 2, 4, 8), (2, 4, 2, 8)),  # (WARPS, KB, STAGES, CTAS_PER_SM[, SPLITS]); the last three not yet
    # measured (68 registers at KB 2: deeper rings fit)
    "q8_0": ((4, 1, 2, 3), (2, 4, 2, 6), (4, 4, 2, 3), (2, 2, 4, 3), (4, 1, 3, 2), (2, 1, 2, 6), (2, 1, 3, 4),
             (4, 2, 2, 3), (8, 1, 2, 1), (4, 1, 2, 3, 1), (4, 1, 2, 3, 4), (4, 1, 2, 4), (2, 2, 2, 6), (1, 1, 2, 8),
             (1, 1, 3, 8)),  # (WARPS, G, STAGES, CTAS_PER_SM[, SPLITS]); the last three not yet measured
}


def section_gemv(shapes=GEMV_SHAPES, default_only: bool = False) -> dict:
    """kernels/gluon/gemv.py (Q4_K x Q8_K) and gemv_q8_0.py (Q8_0 x Q8_0), M = 1, against triton-q8's GEMV
    (kernels/triton/gemm_q8.py) and a pure read of the same bytes (gpu_gemm_tune's read stream, best of its four
    tiles), all replayed from CUDA graphs over rotated copies of the weights (more than 3x L2), as
    benchmarks/gpu_gemm.py --sections q8 times them; each gluon config's output against triton-q8's (the same
    integer sums: differences are fp32 summation order). shapes: (N, K) pairs; default_only: each kernel's default
    config alone (--configs default), for a size sweep that separates a per-launch cost from a per-byte one."""
    from types import SimpleNamespace

    import torch
    import triton
    from triton.testing import do_bench

    from kernel_parity.kernels.gluon import gemv as GV
    from kernel_parity.kernels.gluon import gemv_q8_0 as GV8
    from kernel_parity.kernels.triton import gemm_q8 as Q
    from gpu_gemm_tune import _read_kernel_jit, ggml_random, graph_ms

    read_kernel = _read_kernel_jit()
    g = torch.Generator(device="cuda").manual_seed(0)
    ctx = SimpleNamespace(torch=torch, dev="cuda", gen=g, cuda=True,
                          bench=lambda fn: float(do_bench(fn, warmup=25, rep=200, return_mode="median")))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = {"device": torch.cuda.get_device_name(), "shapes": []}
    ours = {"q4_k": (GV.gemv_q4_k, Q.quantize_q8_k), "q8_0": (GV8.gemv_q8_0, Q.quantize_q8_0)}
    for fmt, (n, k) in [(f, s) for f in ("q4_k", "q8_0") for s in shapes]:
        row = {"fmt": fmt, "shape": [1, n, k]}
        gemv, quantize = ours[fmt]
        try:
            a = torch.randn((1, k), device="cuda", dtype=torch.bfloat16, generator=g)
            w0 = ggml_random(ctx, fmt, n, k)
            nbytes = w0.numel()
            rot = [w0] + [ggml_random(ctx, fmt, n, k) for _ in range(max(1, -(-3 * l2 // nbytes) - 1))]
            row.update(bytes=nbytes, rotations=len(rot))
            qz = quantize(a)
            outs = [torch.empty((1, n), dtype=a.dtype, device="cuda") for _ in rot]
            words = [w.view(-1).view(torch.int32) for w in rot]
            best = None
            for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16)):
                ro = [torch.empty(triton.cdiv(x.numel(), block), dtype=torch.int32, device="cuda") for x in words]
                t = graph_ms(ctx, [lambda x=x, o=o, b=block, nw=warps:
                                   read_kernel[(o.numel(),)](x, o, x.numel(), BLOCK=b, num_warps=nw)
                                   for x, o in zip(words, ro)])
                row[f"read_{block}_{warps}_us"] = 1e3 * t
                best = t if best is None else min(best, t)
            row["read_us"] = 1e3 * best
            cfg_t = Q.default_config(fmt, 1, n)
            ref = Q.gemm_nt_q8(a, fmt, w0)
            t = graph_ms(ctx, [lambda w=w, o=o: Q.launch_gemv(fmt, qz, w, None, o, cfg_t) for w, o in zip(rot, outs)])
            row["triton_q8"] = {"config": cfg_t, "us": 1e3 * t, "pct_read": 100 * best / t}
            t = graph_ms(ctx, [lambda w=w, o=o: Q.gemm_nt_q8(a, fmt, w, out=o) for w, o in zip(rot, outs)])
            row["triton_q8"].update(with_quant_us=1e3 * t, with_quant_pct_read=100 * best / t)
            scale = float(ref.float().abs().max())
            for cfg in GEMV_CONFIGS[fmt][:1] if default_only else GEMV_CONFIGS[fmt]:
                name = "gluon-" + "-".join(map(str, cfg))
                try:
                    got = gemv(a, w0, config=cfg)
                    torch.cuda.synchronize()
                    r = {"max_abs_vs_triton_q8": float((got.float() - ref.float()).abs().max()), "ref_max_abs": scale}
                    t = graph_ms(ctx, [lambda w=w, o=o, c=cfg: gemv(a, w, out=o, config=c, quantized=qz)
                                       for w, o in zip(rot, outs)])
                    r.update(us=1e3 * t, pct_read=100 * best / t)
                    t = graph_ms(ctx, [lambda w=w, o=o, c=cfg: gemv(a, w, out=o, config=c) for w, o in zip(rot, outs)])
                    r.update(with_quant_us=1e3 * t, with_quant_pct_read=100 * best / t)
                    row[name] = r
                except Exception as e:  # noqa: BLE001
                    row[name] = _err(e)
            del rot, words, outs
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e) + "\n" + traceback.format_exc()[-1500:]
        res["shapes"].append(row)
        torch.cuda.empty_cache()
    return res


def _gemv_shapes(text: str) -> tuple:
    """--gemv-shapes: 'NxK,NxK' -> ((N, K), ...), each N >= 1 and K a positive multiple of 256."""
    try:
        shapes = tuple(tuple(int(x) for x in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or s[0] < 1 or s[1] < 256 or s[1] % 256 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxK pairs joined by commas, N >= 1 and K a positive "
                                         f"multiple of 256 (e.g. 14336x4096,28672x4096)")
    return shapes


def main(argv=None) -> int:
    from bench_cases import OneLineParser

    ap = OneLineParser(description=__doc__.split("\n")[0])  # a bad argument: one line, exit 2
    ap.add_argument("--sections", default="api,parity,bench")
    ap.add_argument("--configs", default="all", choices=("all", "default"),
                    help="default: the FP8 GEMM's and the GEMVs' default configs only (the prefill's extra configs always run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gemv-shapes", default=None, type=_gemv_shapes, metavar="NxK[,NxK...]",
                    help="the gemv section's (N, K) at M = 1 (K a multiple of 256), instead of Llama-3-8B's two")
    args = ap.parse_args(argv)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gluon.json")
    from kernel_parity.kernels.gluon.gemm_fp8 import GEMM_CONFIG

    configs = CONFIGS if args.configs == "all" else (GEMM_CONFIG,)
    from kernel_parity.conformance.env import git_state

    commit, tree = git_state()  # the tree id names the code that ran where a device copy's .git lags its files
    doc: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": commit, "git_tree": tree}
    for sec in args.sections.split(","):
        t0 = time.time()
        try:
            if sec == "api":
                doc["api"] = section_api()
            elif sec == "parity":
                doc["parity"] = section_parity(configs)
                doc["compiled"] = _compiled_info(None)
            elif sec == "bench":
                doc["bench"] = section_bench(configs)
            elif sec == "attn_parity":
                doc["attn_parity"] = section_attn_parity()
            elif sec == "attn_bench":
                doc["attn_bench"] = section_attn_bench()
            elif sec == "mla":
                doc["mla"] = section_mla()
            elif sec == "fused":
                doc["fused"] = section_fused()
            elif sec == "gemv":
                doc["gemv"] = section_gemv(args.gemv_shapes or GEMV_SHAPES, args.configs == "default")
            else:
                doc[sec] = f"unknown section {sec!r}"
        except Exception as e:  # noqa: BLE001
            doc[sec + "_error"] = _err(e) + "\n" + traceback.format_exc()[-3000:]
        doc[sec + "_s"] = round(time.time() - t0, 1)
        _record(doc, out)
        print(f"{sec}: {doc[sec + '_s']} s", flush=True)
    print(json.dumps(doc, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
