"""Op specs of the fused transformer blocks (stem `blocks`): C-Kernel-Engine's mega-fused kernels,
verified stage by stage.

- `blocks.attention_decode`   one token at position `pos`: RMSNorm -> Q/K/V projections (+ bias) ->
                              RoPE -> the new k/v row written into head-major caches (in place) ->
                              attention over slots 0 .. pos -> output projection (+ bias, + residual)
- `blocks.attention_prefill`  T tokens from `start` over a cache holding `start` tokens of history
                              (causal bottom-right over history + chunk), the same stages
- `blocks.mlp`                RMSNorm2 -> fused gate/up projection -> SwiGLU -> down projection -> + x
- `blocks.outproj_mlp`        attention output -> output projection (flat, or fp32 per head) +
                              residual -> the MLP block (the seed's mega_fused_outproj_mlp_prefill)

Goldens: refimpl/blocks.py, compositions of the family goldens. Two references, both recorded for
every case: `dequant` (L1: every projection a float64 product with the dequantized weights) and
`emulated` (L2: each quantized projection's activations rounded to float32 and quantized to Q8_0 /
Q8_K as the production path does, the gemm family's integer block sums). A backend claims the one
its kernels compute: the C kernels (integer block dots, ggml's activation quantizers) claim L2, the
Triton and torch paths (weights dequantized, float products) L1. The intermediates are outputs in
pipeline order (`stages`): a failing record names the first stage that diverges. The caches are
in-place outputs: only the new tokens' rows may change.

Activations are fp32 (the seed's); quantized weight formats are Q8_0 / Q5_0 for the attention
projections, and Q4_K / Q6_K / Q5_0 / Q8_0 for the MLP (K-quants need rows of multiples of 256).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.blocks as ref
from kernel_parity.conformance.ops.blocks_inputs import (ATTN_DISTS, DISTS, EPS, MLP_WFMTS, ROW_DISTS, THETAS, WFMTS,
                                                         attention_inputs, block_of, mlp_inputs, outproj_mlp_inputs)
from kernel_parity.conformance.params import Int, OneOf, Schema
from kernel_parity.conformance.spec import Diagnosis, OpSpec, Output
from kernel_parity.conformance.tolerance import Override, Tol

MODEL = dict(
    e=Int(1, 1 << 16, edges=(64, 256, 4096), doc="real embed dim E"),
    epad=Int(0, 256, edges=(0, 32), doc="padding lanes of a row: aE = E + epad (zero in, zero out)"),
)
HEADS = dict(
    hq=Int(1, 128, edges=(1, 8, 32), doc="query heads"),
    hkv=Int(1, 128, edges=(1, 2, 8), doc="kv heads (divides hq)"),
    d=Int(2, 512, edges=(64, 128, 256), doc="real head dim (even: RoPE pairs)"),
    dpad=Int(0, 256, edges=(0, 8, 32), doc="padding lanes of a head: a_d = d + dpad"),
)
ATTN = dict(
    cap=Int(1, 1 << 20, edges=(64, 128, 2048), doc="cache capacity in tokens (and RoPE table rows)"),
    wqkv=OneOf(*WFMTS, doc="Q/K/V weight format (the seed's wq_dt)"),
    wo=OneOf(*WFMTS, doc="W_o format (the seed's wo_dt)"),
    bias=OneOf(0, 1, doc="Q/K/V biases bq, bk, bv (Qwen2)"),
    obias=OneOf(0, 1, doc="output projection bias bo"),
    residual=OneOf(0, 1, doc="add the residual r to the output"),
    style=OneOf("half", "interleaved", doc="RoPE pairs (i, i + d/2) or (2i, 2i + 1)"),
    theta=OneOf(*THETAS, doc="RoPE base of the cos/sin tables"),
    eps=OneOf(*EPS, doc="RMSNorm epsilon (inside the square root)"),
    gemma=OneOf(0, 1, doc="RMSNorm weight applied as (1 + gamma) (Gemma)"),
)
MLP = dict(
    i=Int(1, 1 << 16, edges=(256, 14336, 18944), doc="intermediate width I (gate and up each)"),
    w1=OneOf(*MLP_WFMTS, doc="fused gate/up weight format (2I, aE)"),
    w2=OneOf(*MLP_WFMTS, doc="down weight format (aE, I)"),
    eps=OneOf(*EPS, doc="RMSNorm epsilon"),
    gemma=OneOf(0, 1, doc="RMSNorm weight applied as (1 + gamma)"),
)


def _ae(p: dict[str, Any]) -> int:
    return p["e"] + p["epad"]


def _ad(p: dict[str, Any]) -> int:
    return p["d"] + p["dpad"]


def _check_k(name: str, fmt: str, k: int, what: str) -> str | None:
    b = block_of(fmt)
    if k % b:
        return f"{name}={fmt} needs {what}={k} to be a multiple of its block of {b}"
    return None


def _check_heads(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    if p["d"] % 2:
        return f"d={p['d']} must be even (RoPE pairs)"
    return None


def _check_wo(p: dict[str, Any]) -> str | None:
    if p["wo"] != "f32" and _ad(p) % 32:
        return (f"wo={p['wo']} quantizes the attention output per head in 32-blocks: a_d = d + dpad = {_ad(p)} "
                f"must be a multiple of 32")
    return None


def _check_attention(p: dict[str, Any]) -> str | None:
    last = p["pos"] + 1 if "pos" in p else p["start"] + p["t"]
    if last > p["cap"]:
        return f"the new tokens reach position {last - 1}, past the cache capacity cap={p['cap']}"
    return _check_heads(p) or _check_k("wqkv", p["wqkv"], _ae(p), "aE = e + epad") or _check_wo(p)


def _check_mlp(p: dict[str, Any]) -> str | None:
    return _check_k("w1", p["w1"], _ae(p), "aE = e + epad") or _check_k("w2", p["w2"], p["i"], "i")


def _check_outproj_mlp(p: dict[str, Any]) -> str | None:
    if p["wo_layout"] == "head_major" and p["wo"] != "f32":
        return "wo_layout=head_major is the seed's fp32 per-head W_o: it needs wo=f32"
    return _check_mlp(p) or _check_wo(p)


# -- references ---------------------------------------------------------------------------------
def _weights(x: dict[str, np.ndarray], p: dict[str, Any], *names: str) -> list[ref.Weight]:
    fmt = {"wq": p.get("wqkv"), "wk": p.get("wqkv"), "wv": p.get("wqkv"), "wo": p.get("wo"), "w1": p.get("w1"),
           "w2": p.get("w2")}
    if p.get("wo_layout") == "head_major":
        fmt["wo"] = "f32_heads"
    return [ref.Weight(fmt[n], x[n]) for n in names]


def _attention_kw(x: dict[str, np.ndarray], p: dict[str, Any], reference: str) -> dict[str, Any]:
    return dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x.get("bq"), bk=x.get("bk"), bv=x.get("bv"),
                bo=x.get("bo"), residual=x.get("r"), style=p["style"], gemma=bool(p["gemma"]), reference=reference)


def _attention_ref(reference: str, decode: bool):
    fn = ref.attention_decode if decode else ref.attention_prefill

    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        where = p["pos"] if decode else p["start"]
        return fn(x["x"], x["gamma"], float(p["eps"]), *_weights(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                  x["v_cache"], x["cos"], x["sin"], where, **_attention_kw(x, p, reference))

    return reference_fn


def _mlp_ref(reference: str):
    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        return ref.mlp(x["x"], x["gamma"], float(p["eps"]), *_weights(x, p, "w1", "w2"), n=p["e"],
                       gemma=bool(p["gemma"]), reference=reference)

    return reference_fn


def _outproj_mlp_ref(reference: str):
    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        (wo,) = _weights(x, p, "wo")
        return ref.outproj_mlp(x["attn"], x["residual"], wo, x["gamma"], float(p["eps"]), *_weights(x, p, "w1", "w2"),
                               n=p["e"], bo=x.get("bo"), gemma=bool(p["gemma"]), reference=reference)

    return reference_fn


# -- shapes -------------------------------------------------------------------------------------
def _attention_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    lead = () if "pos" in p else (p["t"],)
    ae, ad, cache = _ae(p), _ad(p), (p["hkv"], p["cap"], _ad(p))
    return {"norm": (*lead, ae), "q": (*lead, p["hq"], ad), "k": (*lead, p["hkv"], ad), "v": (*lead, p["hkv"], ad),
            "q_rope": (*lead, p["hq"], ad), "k_rope": (*lead, p["hkv"], ad), "attn": (*lead, p["hq"], ad),
            "k_cache": cache, "v_cache": cache, "out": (*lead, ae)}


def _mlp_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, ae, i = p["t"], _ae(p), p["i"]
    return {"norm": (t, ae), "h": (t, 2 * i), "act": (t, i), "down": (t, ae), "out": (t, ae)}


def _outproj_mlp_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, ae = p["t"], _ae(p)
    return {"proj": (t, ae), "h1": (t, ae), **_mlp_shapes(p)}


# -- outputs and tolerances -------------------------------------------------------------------------
ATTENTION_OUT = {
    "norm": Output("test", doc="RMSNorm(x) * gamma (or 1 + gamma), padding lanes zero"),
    "q": Output("test", doc="norm @ Wq^T (+ bq), per head over a_d lanes"),
    "k": Output("test", doc="norm @ Wk^T (+ bk)"),
    "v": Output("test", doc="norm @ Wv^T (+ bv)"),
    "q_rope": Output("test", doc="q rotated at its position (the first d lanes)"),
    "k_rope": Output("test", doc="k rotated at its position"),
    "attn": Output("test", doc="attention over the cache (bottom-right causal, scale 1/sqrt(d)), per query head"),
    "k_cache": Output("test", inplace="k_cache", doc="K cache after the call: k_rope written at the new slots, "
                                                    "padding lanes cleared, every other slot untouched"),
    "v_cache": Output("test", inplace="v_cache", doc="V cache after the call: v written at the new slots"),
    "out": Output("test", doc="attn @ Wo^T (+ bo) (+ residual)"),
}
MLP_OUT = {
    "norm": Output("test", doc="RMSNorm2(x), padding lanes zero"),
    "h": Output("test", doc="norm @ W1^T: gate (first I) and up (last I)"),
    "act": Output("test", doc="silu(gate) * up"),
    "down": Output("test", doc="act @ W2^T"),
    "out": Output("test", doc="x + down"),
}
OUTPROJ_MLP_OUT = {
    "proj": Output("test", doc="attn @ Wo^T (+ bo), flat or summed over heads"),
    "h1": Output("test", doc="proj + residual"),
    **{k: Output(v.dtype, doc=v.doc.replace("(x)", "(h1)").replace("x + down", "h1 + down"))
       for k, v in MLP_OUT.items()},
}


def _attention_acc(p: dict[str, Any], output: str) -> int:
    """Reduction lengths along the pipeline: the norm's sum of squares over E, a projection over aE,
    the attention's dot over a_d and sum over the keys, W_o's sum over h_q a_d."""
    keys = p["pos"] + 1 if "pos" in p else p["start"] + p["t"]
    n = p["e"]
    if output == "norm":
        return n
    n += _ae(p)
    if output in ("q", "k", "v", "q_rope", "k_rope", "k_cache", "v_cache"):
        return n
    n += keys + _ad(p)
    return n if output == "attn" else n + p["hq"] * _ad(p)


def _mlp_acc(p: dict[str, Any], output: str) -> int:
    n = (p["hq"] * _ad(p) if "hq" in p else 0)
    if output == "proj":
        return n
    n += p["e"]  # h1, norm: the RMSNorm over E
    if output in ("h1", "norm"):
        return n
    n += _ae(p)
    return n if output in ("h", "act") else n + p["i"]


# Every output after a projection sums K products with cancellation: an element near 0 carries the
# rounding of the larger terms, so its absolute error is measured against the output's scale, as the
# gemm family's C (atol_acc: eps32 sqrt(reduction length) x max|out|).
_SCALED = tuple(Override(f"{o} follows a projection: absolute error ~ eps32 sqrt(reduction length) max|{o}|",
                         output=o, atol_acc=1.0)
                for o in ("q", "k", "v", "q_rope", "k_rope", "attn", "k_cache", "v_cache", "out", "proj", "h1",
                          "h", "act", "down")) + tuple(
    # A kernel that keeps q and k in fp32 (the Triton and torch compositions) hands their rounding (~eps32
    # sqrt(aE) relative) to every logit, |ds| ~ that x |s|, and through the softmax to every element of the
    # attention output and of W_o's sum over it: each element may carry ~eps32 sqrt(reduction length)
    # relative error, which the aggregate limits then allow (agg_acc, as atol_acc does elementwise).
    # Measured over 4,000 fresh-seed ci runs per op (torch): attn cos_diff up to 1.48e-12 (`heads`, logits
    # to ~30) against the fp32 default of 1e-12; the C blocks (double arithmetic) stay under 0.04 of it.
    Override(f"{o}: fp32 q, k rounding reaches every logit (|ds| ~ eps32 |s|): each element may carry eps32 "
             f"sqrt(reduction length) relative error (measured cos_diff 1.48e-12, torch, heads)", output=o, agg_acc=1.0)
    for o in ("attn", "out"))


_GEMMA = (Diagnosis("matches (1 + gamma) where gamma was meant, or the reverse: Gemma offset bug",
                    lambda p: {**p, "gemma": 1 - p["gemma"]}),)
_ATTENTION_DIAGNOSES = (
    Diagnosis("matches the other RoPE pairing (interleaved vs half): RoPE style bug",
              lambda p: {**p, "style": "half" if p["style"] == "interleaved" else "interleaved"}),
    *_GEMMA,
)


def _attention_spec(name: str, decode: bool, where: dict[str, Int], doc: str) -> OpSpec:
    return OpSpec(
        name=name,
        golden=ref.attention_decode if decode else ref.attention_prefill,
        reference=_attention_ref("dequant", decode),
        reference_name="dequant",
        references={"emulated": _attention_ref("emulated", decode)},
        params=Schema(dict(MODEL, **HEADS, **where, **ATTN)),
        make_inputs=(lambda p, dtype, dist, rng: _squeeze(attention_inputs(p, dtype, dist, rng, 1, p["pos"])))
        if decode else (lambda p, dtype, dist, rng: attention_inputs(p, dtype, dist, rng, p["t"], p["start"])),
        output_shapes=_attention_shapes,
        outputs=ATTENTION_OUT,
        tolerance=Tol(acc_len=_attention_acc, overrides=_SCALED),
        dtypes=("fp32",),
        dists={k: DISTS[k] for k in ATTN_DISTS},
        check=_check_attention,
        diagnoses=_ATTENTION_DIAGNOSES,
        stages=ref.ATTENTION_STAGES,
        doc=doc,
    )


def _squeeze(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Decode's x and residual are one row (aE,)."""
    return {k: (v[0] if k in ("x", "r") else v) for k, v in x.items()}


ATTENTION_DECODE = _attention_spec(
    "blocks.attention_decode", True,
    dict(pos=Int(0, 1 << 20, edges=(0, 1, 63, 64, 65, 1024), doc="the token's position (slots 0 .. pos attended)")),
    "C-Kernel-Engine's fused decode attention block: RMSNorm, Q/K/V (+bias), RoPE at pos, the k/v row written "
    "into head-major caches, attention over slots 0..pos, W_o (+bias) (+residual).")

ATTENTION_PREFILL = _attention_spec(
    "blocks.attention_prefill", False,
    dict(t=Int(1, 1 << 16, edges=(1, 2, 7, 64, 65), doc="new tokens T"),
         start=Int(0, 1 << 20, edges=(0, 1, 63, 64, 1024), doc="tokens of history (start_pos)")),
    "The fused attention block over T tokens from start_pos over a cache with history (causal bottom-right), "
    "the attention output quantized to Q8_0 before a quantized W_o (L2).")

BLOCK_MLP = OpSpec(
    name="blocks.mlp",
    golden=ref.mlp,
    reference=_mlp_ref("dequant"),
    reference_name="dequant",
    references={"emulated": _mlp_ref("emulated")},
    params=Schema(dict(t=Int(1, 1 << 16, edges=(1, 2, 7), doc="tokens"), **MODEL, **MLP)),
    make_inputs=mlp_inputs,
    output_shapes=_mlp_shapes,
    outputs=MLP_OUT,
    tolerance=Tol(acc_len=_mlp_acc, overrides=_SCALED),
    dtypes=("fp32",),
    dists={k: DISTS[k] for k in ROW_DISTS},
    check=_check_mlp,
    diagnoses=_GEMMA,
    stages=ref.MLP_STAGES,
    doc="RMSNorm2 -> fused gate/up projection (gate first) -> SwiGLU -> down projection -> + x; Q4_K, Q6_K, "
        "Q5_0, Q8_0 or fp32 weights.",
)

OUTPROJ_MLP = OpSpec(
    name="blocks.outproj_mlp",
    golden=ref.outproj_mlp,
    reference=_outproj_mlp_ref("dequant"),
    reference_name="dequant",
    references={"emulated": _outproj_mlp_ref("emulated")},
    params=Schema(dict(t=Int(1, 1 << 16, edges=(1, 2, 7), doc="tokens"), **MODEL,
                       hq=HEADS["hq"], d=HEADS["d"], dpad=HEADS["dpad"],
                       wo=OneOf(*WFMTS, doc="W_o format"),
                       wo_layout=OneOf("flat", "head_major",
                                       doc="W_o (aE, h_q a_d), or the seed's fp32 per-head Wo[h][aE][a_d]"),
                       obias=ATTN["obias"], **MLP)),
    make_inputs=outproj_mlp_inputs,
    output_shapes=_outproj_mlp_shapes,
    outputs=OUTPROJ_MLP_OUT,
    tolerance=Tol(acc_len=_mlp_acc, overrides=_SCALED),
    dtypes=("fp32",),
    dists={k: DISTS[k] for k in ROW_DISTS},
    check=_check_outproj_mlp,
    diagnoses=_GEMMA,
    stages=ref.OUTPROJ_MLP_STAGES,
    doc="The seed's outproj + MLP prefill block: attention output -> W_o (flat or fp32 per head, bias once) + "
        "residual -> RMSNorm2 -> SwiGLU MLP -> + residual.",
)

SPECS = (ATTENTION_DECODE, ATTENTION_PREFILL, BLOCK_MLP, OUTPROJ_MLP)
