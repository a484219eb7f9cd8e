"""Op specs of the fused transformer blocks (stem `blocks`): C-Kernel-Engine's mega-fused kernels,
verified stage by stage.

- `blocks.attention_decode`   one token at position `pos`: RMSNorm -> Q/K/V projections (+ bias) ->
                              RoPE -> the new k/v row written into head-major caches (in place) ->
                              attention over slots 0 .. pos -> output projection (+ bias, + residual)
- `blocks.attention_prefill`  T tokens from `start` over a cache holding `start` tokens of history
                              (causal bottom-right over history + chunk), the same stages
- `blocks.mlp`                RMSNorm2 -> fused gate/up projection (+ b1) -> SwiGLU -> down projection (+ b2)
                              -> + x; `bias` (seed audit S2), `ipad`: gate and up halves of aI = i + ipad
                              lanes, the padding carried by h, cleared in act (S3)
- `blocks.outproj_mlp`        attention output -> output projection (flat, or fp32 per head) +
                              residual -> the MLP block (the seed's mega_fused_outproj_mlp_prefill);
                              `attn_layout=head_major`: the attention output as the seed's [h_q, T, a_d] (S5)
- `blocks.layer`              a whole layer (S9): the prefill attention block with the residual x, then the
                              MLP block on its output; `scores=1` adds the attention's softmax probabilities
                              (h_q, T, ctx), the buffer the seed's backward reads (padding lanes zero)

Goldens: refimpl/blocks.py, compositions of the family goldens. Two references, both recorded for
every case: `dequant` (L1: every projection a float64 product with the dequantized weights) and
`emulated` (L2: each quantized projection's activations rounded to float32 and quantized to Q8_0 /
Q8_1 / Q8_K as the production path does, the gemm family's integer block sums). A backend claims the one
its kernels compute: the C kernels (integer block dots, ggml's activation quantizers) claim L2, the
Triton and torch paths (weights dequantized, float products) L1. The intermediates are outputs in
pipeline order (`stages`): a failing record names the first stage that diverges. The caches are
in-place outputs: only the new tokens' rows may change.

The attention blocks take parameters added later, with defaults (older ids and inputs unchanged):
`rope_off` (seed audit S7, the seed's rope_pos_offset: RoPE at rope_off + slot, the caches and the mask by
slot), `qkv` (S11: `fused` is the seed's one W_qkv / b_qkv, inputs `wqkv`, `bqkv`, q heads then k then v),
`wo_layout` (S4: `head_major` is the seed's fp32 per-head Wo[h][aE][a_d], as outproj_mlp's; dwo per head) and
`wk`, `wv` (S1: W_k's and W_v's own formats, the seed's wk_dt / wv_dt; "" is wqkv's). W_q, W_k, W_v also take
the K-quants q4_k, q6_k (aE a multiple of 256; Q8_K activations on the L2 path) and q4_0, q4_1, q5_1
(Q8_0, Q8_1). W_o takes the same formats (S1; outproj_mlp's flat W_o too): on the L2 path the attention
output is quantized for W_o's own format, Q8_K over the whole row for a K-quant (h_q a_d a multiple of 256),
Q8_1 for q4_1 / q5_1, Q8_0 per head otherwise (a_d a multiple of 32). The backward takes each projection in
its own format, as the forward does.

The whole-layer backward of the MLP and prefill attention blocks (`blocks.mlp_backward`,
`blocks.attention_prefill_backward`) and of the whole layer (`blocks.layer_backward`, S9: the saved scores
as an optional input) is specified in blocks_grad.py.

Activations are fp32 (the seed's); quantized weight formats are Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q5_1 / Q4_K / Q6_K
for the attention projections (S1), and Q4_K / Q6_K / Q5_0 / Q8_0 for the MLP (K-quants need rows of multiples
of 256).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.blocks as ref
from kernel_parity.conformance.ops.blocks_grad import GRAD_SPECS
from kernel_parity.conformance.ops.blocks_inputs import (ATTN_DISTS, DISTS, QKV_WFMTS, ROW_DISTS, attention_inputs,
                                                         layer_inputs, mlp_inputs, outproj_mlp_inputs)
from kernel_parity.conformance.ops.blocks_params import (ATTENTION_DIAGNOSES, ATTN, DECODE_PARAMS, GEMMA_DIAGNOSES,
                                                         HEADS, LAYER_PARAMS, MLP, MLP_DEFAULTS, MLP_PARAMS, MODEL,
                                                         PREFILL_PARAMS, check_layer,
                                                         OUTPROJ_MLP_DEFAULTS, ad, ae, ai, attention_kw, attn_layout,
                                                         check_attention, check_mlp, check_outproj_mlp, mlp_kw,
                                                         weights_of)
from kernel_parity.conformance.params import Defaults, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output
from kernel_parity.conformance.tolerance import Override, Tol

# -- references ---------------------------------------------------------------------------------
def _attention_ref(reference: str, decode: bool):
    fn = ref.attention_decode if decode else ref.attention_prefill

    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        where = p["pos"] if decode else p["start"]
        return fn(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                  x["v_cache"], x["cos"], x["sin"], where, **attention_kw(x, p, reference))

    return reference_fn


def _mlp_ref(reference: str):
    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        return ref.mlp(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"), **mlp_kw(x, p),
                       reference=reference)

    return reference_fn


def _outproj_mlp_ref(reference: str):
    def reference_fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        (wo,) = weights_of(x, p, "wo")
        return ref.outproj_mlp(x["attn"], x["residual"], wo, x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"),
                               bo=x.get("bo"), **mlp_kw(x, p), reference=reference, attn_layout=attn_layout(p))

    return reference_fn


# -- the error model (refimpl/blocks.py, `absolute`) ------------------------------------------------------
# Each output's magnitude, stage by stage: its own rounding (the RSS of the terms it sums) and what it inherits
# from the computed stages it reads, weighted by the roundings behind each (module docstring of refimpl/blocks.py).
# Computed with the dequantized weights (the `dequant` reference): the C kernels, judged against `emulated`,
# see activations quantized to Q8_0 / Q8_K, whose squares differ from the float ones by < 1% (Q8's half step
# of 1/254 of a block's max), immaterial to a magnitude.
def _attention_mag(decode: bool):
    fn = ref.attention_decode if decode else ref.attention_prefill

    def magnitude(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        where = p["pos"] if decode else p["start"]
        return fn(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                  x["v_cache"], x["cos"], x["sin"], where, **attention_kw(x, p, "dequant"), absolute=True)

    return magnitude


def _mlp_mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    return ref.mlp(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"), **mlp_kw(x, p), absolute=True)


def _outproj_mlp_mag(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
    (wo,) = weights_of(x, p, "wo")
    return ref.outproj_mlp(x["attn"], x["residual"], wo, x["gamma"], float(p["eps"]), *weights_of(x, p, "w1", "w2"),
                           bo=x.get("bo"), **mlp_kw(x, p), absolute=True, attn_layout=attn_layout(p))


# -- shapes -------------------------------------------------------------------------------------
def _attention_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    lead = () if "pos" in p else (p["t"],)
    e, a, cache = ae(p), ad(p), (p["hkv"], p["cap"], ad(p))
    return {"norm": (*lead, e), "q": (*lead, p["hq"], a), "k": (*lead, p["hkv"], a), "v": (*lead, p["hkv"], a),
            "q_rope": (*lead, p["hq"], a), "k_rope": (*lead, p["hkv"], a), "attn": (*lead, p["hq"], a),
            "k_cache": cache, "v_cache": cache, "out": (*lead, e)}


def _mlp_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, e, i = p["t"], ae(p), ai(p)
    return {"norm": (t, e), "h": (t, 2 * i), "act": (t, i), "down": (t, e), "out": (t, e)}


def _outproj_mlp_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    t, e = p["t"], ae(p)
    return {"proj": (t, e), "h1": (t, e), **_mlp_shapes(p)}


# -- outputs and tolerances -------------------------------------------------------------------------
ATTENTION_OUT = {
    "norm": Output("test", doc="RMSNorm(x) * gamma (or 1 + gamma), padding lanes zero"),
    "q": Output("test", doc="norm @ Wq^T (+ bq), per head over a_d lanes (lanes [d, a_d) as the projection gives "
                            "them: non-zero under `pads`)"),
    "k": Output("test", doc="norm @ Wk^T (+ bk)"),
    "v": Output("test", doc="norm @ Wv^T (+ bv)"),
    "q_rope": Output("test", doc="q rotated at its position (the first d lanes)"),
    "k_rope": Output("test", doc="k rotated at its position (padding lanes kept: only the cache write clears them)"),
    "attn": Output("test", doc="attention over the cache (bottom-right causal, scale 1/sqrt(d)), per query head"),
    "k_cache": Output("test", inplace="k_cache", doc="K cache after the call: k_rope written at the new slots, "
                                                    "padding lanes cleared, every other slot untouched"),
    "v_cache": Output("test", inplace="v_cache", doc="V cache after the call: v written at the new slots"),
    "out": Output("test", doc="attn @ Wo^T (+ bo) (+ residual)"),
}
MLP_OUT = {
    "norm": Output("test", doc="RMSNorm2(x), padding lanes zero"),
    "h": Output("test", doc="norm @ W1^T (+ b1): gate (first aI) and up (last aI), padding lanes [I, aI) of each as "
                            "the projection gives them"),
    "act": Output("test", doc="silu(gate) * up over the I real lanes, padding lanes [I, aI) cleared (zero)"),
    "down": Output("test", doc="act @ W2^T (+ b2)"),
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
    n += ae(p)
    if output in ("q", "k", "v", "q_rope", "k_rope", "k_cache", "v_cache"):
        return n
    n += keys + ad(p)
    return n if output == "attn" else n + p["hq"] * ad(p)


def _mlp_acc(p: dict[str, Any], output: str) -> int:
    n = (p["hq"] * ad(p) if "hq" in p else 0)
    if output == "proj":
        return n
    n += p["e"]  # h1, norm: the RMSNorm over E
    if output in ("h1", "norm"):
        return n
    n += ae(p)
    return n if output in ("h", "act") else n + ai(p)


# An output after a projection sums K products of either sign: the error model (`magnitude`) judges each
# element against max(|golden|, M), M the RSS of its terms stage by stage, where an absolute atol of eps32
# sqrt(reduction length) max|out| (atol_acc 1, the gemm family's rule) stood before: an element near 0 by
# cancellation keeps its terms' allowance, every other element a limit relative to its own size. Measured:
# cond <= 1.91 on every output and ci case of cpu (2.3 on decode's k and v of 32 lanes: a ratio of sums of 32
# squares, whose expectation is 1.5); the errors of eager fp32 torch in units of eps32 max(|golden|, M), rms
# 0.4 .. 2.1 where M <= |golden| and 0.8 .. 2.5 where M > 4 |golden| (prefill and outproj_mlp, ci shapes,
# 4 seeds): M is what the rounding scales with. attn and out (rms 3.0 and 2.0 there) also carry P's sensitivity
# to the logits, outside the model (P enters with its value): the agg_acc override below.
_LIMITS = tuple(
    # A kernel that keeps q and k in fp32 (the Triton and torch compositions) hands their rounding (~eps32
    # sqrt(aE) relative) to every logit, |ds| ~ that x |s|, and through the softmax to every element of the
    # attention output and of W_o's sum over it: each element may carry ~eps32 sqrt(reduction length)
    # relative error, which the aggregate limits then allow (agg_acc, as atol_acc does elementwise).
    # Measured over 4,000 fresh-seed ci runs per op (torch): attn cos_diff up to 1.48e-12 (`heads`, logits
    # to ~30) against the fp32 default of 1e-12; the C blocks (double arithmetic) stay under 0.04 of it.
    Override(f"{o}: fp32 q, k rounding reaches every logit (|ds| ~ eps32 |s|): each element may carry eps32 "
             f"sqrt(reduction length) relative error (measured cos_diff 1.48e-12, torch, heads)", output=o, agg_acc=1.0)
    for o in ("attn", "out")) + tuple(
    # The MLP half at model widths: h, act and down carry fp32 sums of n = h_q a_d + E + aE (+ I) terms (12,288
    # .. 37,888), and a correct fp32 sum in index order has cos_diff ~ eps32^2 n / 48 (3.6e-12 at n = 12,288),
    # past the fixed fp32 default of 1e-12: gemm.gemm_nt_backward's and blocks.mlp_backward's rule. Measured on
    # an H100, models suite (t 16, e 4096, I 14336, Q4_K / Q6_K): eager torch (cuBLAS) act 1.63e-12, down 1.77e-12;
    # Triton 6.4e-14 / 1.0e-13 (blocked sums). agg_acc 0.125 = 6x that expectation at each output's length.
    Override(f"{o}: fp32 sums of model-width length, cos_diff ~ eps32^2 n / 48 (H100 models: torch act 1.63e-12 at "
             f"n = 12,288)", output=o, agg_acc=0.125)
    for o in ("proj", "h1", "h", "act", "down"))


def _attention_spec(name: str, decode: bool, params: Schema, doc: str) -> OpSpec:
    return OpSpec(
        name=name,
        golden=ref.attention_decode if decode else ref.attention_prefill,
        reference=_attention_ref("dequant", decode),
        reference_name="dequant",
        references={"emulated": _attention_ref("emulated", decode)},
        params=params,
        make_inputs=(lambda p, dtype, dist, rng: _squeeze(attention_inputs(p, dtype, dist, rng, 1, p["pos"])))
        if decode else (lambda p, dtype, dist, rng: attention_inputs(p, dtype, dist, rng, p["t"], p["start"])),
        output_shapes=_attention_shapes,
        outputs=ATTENTION_OUT,
        magnitude=_attention_mag(decode),
        tolerance=Tol(acc_len=_attention_acc, overrides=_LIMITS),
        dtypes=("fp32",),
        dists={k: DISTS[k] for k in ATTN_DISTS},
        check=check_attention,
        diagnoses=ATTENTION_DIAGNOSES,
        stages=ref.ATTENTION_STAGES,
        doc=doc,
    )


def _squeeze(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Decode's x and residual are one row (aE,)."""
    return {k: (v[0] if k in ("x", "r") else v) for k, v in x.items()}


ATTENTION_DECODE = _attention_spec(
    "blocks.attention_decode", True, DECODE_PARAMS,
    "C-Kernel-Engine's fused decode attention block: RMSNorm, Q/K/V (+bias), RoPE at pos, the k/v row written "
    "into head-major caches, attention over slots 0..pos, W_o (+bias) (+residual).")

ATTENTION_PREFILL = _attention_spec(
    "blocks.attention_prefill", False, PREFILL_PARAMS,
    "The fused attention block over T tokens from start_pos over a cache with history (causal bottom-right), "
    "the attention output quantized to Q8_0 before a quantized W_o (L2).")

BLOCK_MLP = OpSpec(
    name="blocks.mlp",
    golden=ref.mlp,
    reference=_mlp_ref("dequant"),
    reference_name="dequant",
    references={"emulated": _mlp_ref("emulated")},
    params=MLP_PARAMS,
    make_inputs=mlp_inputs,
    output_shapes=_mlp_shapes,
    outputs=MLP_OUT,
    magnitude=_mlp_mag,
    tolerance=Tol(acc_len=_mlp_acc, overrides=_LIMITS),
    dtypes=("fp32",),
    dists={k: DISTS[k] for k in ROW_DISTS},
    check=check_mlp,
    diagnoses=GEMMA_DIAGNOSES,
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
    params=Defaults(dict(t=MLP_PARAMS.params["t"], **MODEL,
                         hq=HEADS["hq"], d=HEADS["d"], dpad=HEADS["dpad"],
                         wo=OneOf(*QKV_WFMTS, doc="W_o format (S1: K-quants need h_q a_d a multiple of 256)"),
                         wo_layout=OneOf("flat", "head_major",
                                         doc="W_o (aE, h_q a_d), or the seed's fp32 per-head Wo[h][aE][a_d]"),
                         obias=ATTN["obias"], **MLP,
                         attn_layout=OneOf("token_major", "head_major",
                                           doc="the attention output (T, h_q a_d), or the seed's head-major "
                                               "[h_q, T, a_d] (seed audit S5)")), OUTPROJ_MLP_DEFAULTS),
    make_inputs=outproj_mlp_inputs,
    output_shapes=_outproj_mlp_shapes,
    outputs=OUTPROJ_MLP_OUT,
    magnitude=_outproj_mlp_mag,
    tolerance=Tol(acc_len=_mlp_acc, overrides=_LIMITS),
    dtypes=("fp32",),
    dists={k: DISTS[k] for k in ROW_DISTS},
    check=check_outproj_mlp,
    diagnoses=GEMMA_DIAGNOSES,
    stages=ref.OUTPROJ_MLP_STAGES,
    doc="The seed's outproj + MLP prefill block: attention output -> W_o (flat or fp32 per head, bias once) + "
        "residual -> RMSNorm2 -> SwiGLU MLP -> + residual.",
)


# -- the whole layer (seed audit S9) -----------------------------------------------------------------------
def _layer(reference: str, absolute: bool = False):
    def fn(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, np.ndarray]:
        return ref.layer(x["x"], x["gamma"], float(p["eps"]), *weights_of(x, p, "wq", "wk", "wv", "wo"), x["k_cache"],
                         x["v_cache"], x["cos"], x["sin"], p["start"], x["gamma2"], *weights_of(x, p, "w1", "w2"),
                         n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x.get("bq"), bk=x.get("bk"),
                         bv=x.get("bv"), bo=x.get("bo"), style=p["style"], gemma=bool(p["gemma"]),
                         reference=reference, absolute=absolute, scores=bool(p.get("scores", 0)))

    return fn


def _layer_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    att = {k: v for k, v in _attention_shapes(p).items() if k != "out"}
    mlp = _mlp_shapes(p)
    shapes = {**att, "h1": mlp["out"], "norm2": mlp["norm"], **{k: mlp[k] for k in ("h", "act", "down", "out")}}
    if p.get("scores", 0):
        shapes["scores"] = (p["hq"], p["t"], ref.context_window(p["start"] + p["t"]))
    return shapes


def _layer_acc(p: dict[str, Any], output: str) -> int:
    """The attention block's lengths (`_attention_acc`; h1 its out, the scores its attention's), then the MLP's
    on top of h1's (`_mlp_acc` without a W_o)."""
    if output in ATTENTION_OUT and output != "out":
        return _attention_acc(p, output)
    if output == "scores":
        return _attention_acc(p, "attn")
    h1 = _attention_acc(p, "out")
    return h1 if output == "h1" else h1 + _mlp_acc(p, "norm" if output == "norm2" else output)


LAYER_OUT = {
    **{k: v for k, v in ATTENTION_OUT.items() if k != "out"},
    "h1": Output("test", doc="the attention block's output: x + attn @ Wo^T (+ bo)"),
    "norm2": Output("test", doc="RMSNorm2(h1) (gamma2), padding lanes zero"),
    **{k: v for k, v in OUTPROJ_MLP_OUT.items() if k in ("h", "act", "down", "out")},
    "scores": Output("test", doc="(scores=1) the attention's softmax probabilities P (h_q, T, ctx), ctx = start + T "
                                 "rounded up to 16: the seed's aligned_context_window buffer; 0 on masked slots "
                                 "and on the padding lanes"),
}

LAYER = OpSpec(
    name="blocks.layer",
    golden=ref.layer,
    reference=_layer("dequant"),
    reference_name="dequant",
    references={"emulated": _layer("emulated")},
    params=LAYER_PARAMS,
    make_inputs=layer_inputs,
    output_shapes=_layer_shapes,
    outputs=LAYER_OUT,
    magnitude=_layer("dequant", absolute=True),
    tolerance=Tol(acc_len=_layer_acc, overrides=_LIMITS),
    dtypes=("fp32",),
    dists={k: DISTS[k] for k in ATTN_DISTS},
    check=check_layer,
    diagnoses=ATTENTION_DIAGNOSES,
    stages=ref.LAYER_STAGES,
    doc="A whole transformer layer (seed audit S9): the prefill attention block (residual x), then the MLP block "
        "on its output; scores=1 adds the saved softmax probabilities (h_q, T, ctx).",
)

SPECS = (ATTENTION_DECODE, ATTENTION_PREFILL, BLOCK_MLP, OUTPROJ_MLP, LAYER, *GRAD_SPECS)
