"""`gluon`: our Gluon kernels (kernels/gluon/*), a backend of its own beside `triton`.

Gluon (`triton.experimental.gluon`) is Triton's lower-level language: explicit layouts, shared
memory, mbarriers, bulk tensor copies, warpgroup MMAs and warp specialisation. It has no
interpreter, so the backend runs on a Hopper GPU (sm_90) only; anywhere else `available()` says
why and every case is a skip with that reason. Each kernel claims the reference the `triton`
kernel of the same op claims, so the gate judges both on the same cases, same limits.

Ops:
- gemm.gemm_nt, FP8 1 x 128 x 128 (`fp8`; gn a multiple of 128): kernels/gluon/gemm_fp8.py, a
  persistent warp-specialised kernel (claims `emulated`); the activations quantized by the Triton
  quantizer, as the `triton` backend does.
- gemm.gemm_nt, Q4_K weights at M = 1: kernels/gluon/gemv.py, the GEMV with the weights streamed by bulk
  tensor copies into a ring of shared-memory stages; triton-q8's arithmetic (the activation quantized to Q8_K
  by the Triton quantizer, integer dots): it claims `emulated`, as triton-q8 does.
- gemm.gemm_nt, Q8_0 weights at M = 1, K a multiple of 256: kernels/gluon/gemv_q8_0.py, the same structure over
  groups of eight 34-byte blocks (272 bytes, 16-byte aligned); the activation quantized to Q8_0 by the Triton
  quantizer, triton-q8's arithmetic (`emulated`).
- attention.prefill, causal (bottom-right, top-left) or none, GQA, d = d_v in 32 / 64 / 128 / 256, bf16 /
  fp16, no window, softcap or sink: kernels/gluon/attention.py (FlashAttention-3's producer / two consumer
  warp groups), the op's own reference, as the `triton` kernel.
- mla.decode, one latent kv head, s_q x h_q a multiple of 64, bf16 / fp16: kernels/gluon/mla.py (FlashMLA's
  seesaw: two consumer warp groups taking 64-key tiles in turn, P handed over through shared memory).
- mla.decode_fused_fp8, dense mode, bf16 / fp16, pages of a multiple of 32: kernels/gluon/mla_fused.py (the
  cached keys' attention in the seesaw at fp32 grade: q and P in two 16-bit parts), the rest of the branch
  (RMSNorm + RoPE, the FP8 bmms, this step's keys) the Triton kernel's; the sparse mode is the `triton` kernel's.
- kvquant.decode_paged, bf16 q over an e4m3 / e5m2 cache, d 64 / 128, GQA groups up to 16, any page, scales per
  tensor / head / token: kernels/gluon/kvquant_decode.py (one warp a program, the codes through a cp.async ring
  straight into mma.sync operands, the FP8 -> bf16 conversion's power of two folded into q and P).
Registered through the `kernel_parity.backends` entry point (pyproject.toml), like triton-q8.
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends import Backend
from kernel_parity.conformance.backends._torch import cuda_available, to_torch

GEMM = "gemm.gemm_nt"
PREFILL = "attention.prefill"
MLA = "mla.decode"
FUSED = "mla.decode_fused_fp8"
KVQ = "kvquant.decode_paged"


def unavailable() -> str | None:
    """None where the gluon kernels can run, else why not (one line)."""
    if not cuda_available():
        return "Gluon kernels run on a CUDA GPU only (Gluon has no interpreter)"
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"the gluon kernels are written for Hopper (sm_90: wgmma, TMA); this GPU is "
                f"sm_{major}{minor}")
    from kernel_parity.kernels.gluon.compat import missing

    gone = missing()
    if gone:
        import triton

        return f"Triton {triton.__version__} lacks the Gluon API the kernels use: {', '.join(gone[:4])}"
    return None


class GluonBackend(Backend):
    def available(self) -> str | None:
        return unavailable()

    def describe(self) -> str:
        import triton

        return f"gluon (Triton {triton.__version__}, Hopper)"


def _gemm_supports(case: Any) -> str | None:
    from kernel_parity.conformance.ops.gemm import granularity

    p = case.p
    if p["wfmt"] == "q4_k":
        return None if p["m"] == 1 else f"the gluon Q4_K kernel is the GEMV (M = 1), not m={p['m']}"
    if p["wfmt"] == "q8_0":
        if p["m"] != 1:
            return f"the gluon Q8_0 kernel is the GEMV (M = 1), not m={p['m']}"
        return None if p["k"] % 256 == 0 else \
            f"the gluon Q8_0 GEMV takes k a multiple of 256 (rows of whole 8-block groups), not k={p['k']}"
    if p["wfmt"] != "fp8":
        return f"the gluon GEMMs are the FP8 1 x 128 x 128 block-scaled kernel and the Q4_K / Q8_0 GEMVs; " \
               f"{p['wfmt']} weights have no path"
    g = granularity(p)
    if case.dtype == "fp32":
        return "the FP8 GEMM accumulates on fp8 tensor cores: it claims a bf16/fp16 output, not fp32"
    if g["gm"] != 1 or g["gk"] != 128 or g["gn"] % 128:
        return f"the gluon FP8 GEMM takes 1 x 128 activation groups and gn x 128 weight blocks (gn a multiple " \
               f"of 128), not {g['gm']} x {g['gk']} / {g['gn']} x {g['gk']}"
    if p["k"] % 16:
        return f"k={p['k']} is not a multiple of 16 (the bulk copies read 16-byte rows)"
    return None


def _gemm(case: Any, inputs: dict, out: Any) -> dict:
    from kernel_parity.conformance.ops.gemm import granularity
    from kernel_parity.kernels.gluon import gemm_fp8

    c = out.torch("c", "cuda")
    bias = to_torch(inputs["bias"], "cuda") if "bias" in inputs else None
    if case.p["wfmt"] in ("q4_k", "q8_0"):
        from kernel_parity.kernels.gluon import gemv, gemv_q8_0

        run = gemv.gemv_q4_k if case.p["wfmt"] == "q4_k" else gemv_q8_0.gemv_q8_0
        run(to_torch(inputs["a"], "cuda"), to_torch(inputs["w"], "cuda"), bias, out=c)
        return {"c": c}
    gemm_fp8.gemm_fp8(to_torch(inputs["a"], "cuda"), to_torch(inputs["w"], "cuda"),
                      to_torch(inputs["w_scale"], "cuda"), bias, out=c, gn=granularity(case.p)["gn"])
    return {"c": c}


def _prefill_supports(case: Any) -> str | None:
    from kernel_parity.conformance.ops.attention import value_dim

    p = case.p
    d, dv = p["d"], value_dim(p)
    if d != dv or d not in (32, 64, 128, 256):
        return f"the gluon prefill takes d = d_v in 32, 64, 128, 256, not d={d}, d_v={dv}"
    if p["cap"] or p["sink"]:
        return "the gluon prefill has no softcap and no sink"
    if p["wl"] != -1 or p["wr"] not in (-1, 0) or (p["wr"] == 0 and p["causal"] == "none"):
        return f"the gluon prefill has no sliding window (wl={p['wl']}, wr={p['wr']})"
    return None


def _prefill(case: Any, inputs: dict, out: Any) -> dict:
    from kernel_parity.kernels.gluon import attention

    o, lse = out.torch("o", "cuda"), out.torch("lse", "cuda")
    attention.prefill(*(to_torch(inputs[n], "cuda") for n in ("q", "k", "v")), causal=case.p["causal"], out=o,
                      out_lse=lse)
    return {"o": o, "lse": lse}


def _mla_supports(case: Any) -> str | None:
    p = case.p
    if p.get("hkv", 1) != 1:
        return f"the gluon MLA decode takes one latent kv head, not hkv={p['hkv']}"
    if (p["sq"] * p["hq"]) % 64:
        return f"the gluon MLA decode takes s_q x h_q a multiple of 64 rows, not {p['sq']} x {p['hq']}"
    return None


def _mla(case: Any, inputs: dict, out: Any) -> dict:
    from kernel_parity.conformance.ops.mla import DV, SCALES
    from kernel_parity.kernels.gluon import mla

    o, lse = out.torch("o", "cuda"), out.torch("lse", "cuda")
    t = {k: to_torch(v, "cuda") for k, v in inputs.items()}
    mla.mla_decode(t["q"], t["kv_cache"], t["block_table"], t["seqlens"], SCALES[case.p["scale"]], d_v=DV,
                   causal=bool(case.p["causal"]), out=o, out_lse=lse)
    return {"o": o, "lse": lse}


def _fused_supports(case: Any) -> str | None:
    from kernel_parity.conformance.backends.mla import triton_supports

    p = case.p
    if p.get("sparse", 0):
        return "the gluon fused MLA attention is the dense mode's cached part; the sparse mode has none (triton runs it)"
    return triton_supports()[FUSED](case)  # its launches 1, 2, 4 and the new keys are the Triton kernel's


def _fused(case: Any, inputs: dict, out: Any) -> dict:
    from kernel_parity.conformance.backends.mla import _fused_args
    from kernel_parity.kernels.gluon import mla_fused

    o = out.torch("out", "cuda")
    t = {k: to_torch(v, "cuda") for k, v in inputs.items()}
    qrope = bool(case.p.get("qrope", 0))  # writes t["kv_cache"], and with qrope t["q"]'s rope part
    mla_fused.mla_decode_fused_fp8(*_fused_args(t, case.p), attn_sink=t.get("attn_sink"), out=o, q_inplace=qrope,
                                   sink_per=case.p.get("sink_shape", "head"))
    return {"out": o, "kv_cache": t["kv_cache"], **({"q": t["q"]} if qrope else {})}


def _kvq_supports(case: Any) -> str | None:
    from kernel_parity.kernels.gluon.kvquant_decode import BLOCK_M, HEAD_DIMS

    p = case.p
    if case.dtype != "bf16":
        return f"the gluon FP8-cache decode takes a bf16 q, not {case.dtype} (the triton kernel runs it)"
    if p["fmt"] not in ("e4m3", "e5m2"):
        return f"the gluon FP8-cache decode takes e4m3 / e5m2 codes, not {p['fmt']} (the triton kernel runs it)"
    if p["d"] not in HEAD_DIMS:
        return f"the gluon FP8-cache decode takes d in {HEAD_DIMS}, not d={p['d']}"
    if p["hq"] // p["hkv"] > BLOCK_M:
        return f"the gluon FP8-cache decode takes a GQA group of at most {BLOCK_M}, not {p['hq'] // p['hkv']}"
    return None


def _kvq(case: Any, inputs: dict, out: Any) -> dict:
    from kernel_parity.conformance.backends.kvquant_decode import ARGS
    from kernel_parity.kernels.gluon import kvquant_decode

    o, lse = out.torch("o", "cuda"), out.torch("lse", "cuda")
    kvquant_decode.decode_paged(*(to_torch(inputs[k], "cuda") for k in ARGS), out=o, out_lse=lse)
    return {"o": o, "lse": lse}


def _ops() -> dict[str, Callable]:
    return {GEMM: _gemm, PREFILL: _prefill, MLA: _mla, FUSED: _fused, KVQ: _kvq}


def make() -> GluonBackend:
    return GluonBackend(name="gluon", device="cuda", dtypes=("bf16", "fp16"), ops=_ops(),
                        claims={GEMM: "emulated"}, support={GEMM: _gemm_supports, PREFILL: _prefill_supports,
                                                            MLA: _mla_supports, FUSED: _fused_supports,
                                                            KVQ: _kvq_supports},
                        deterministic=True,
                        doc="kernels/gluon/*: warp-specialised Gluon kernels (Hopper): FP8 block-scaled GEMM, "
                            "Q4_K / Q8_0 GEMVs, attention prefill, MLA decode, the fused FP8 MLA branch's attention, "
                            "the FP8-cache paged decode")


BACKEND = make
