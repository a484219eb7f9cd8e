"""Parameters, constraints and weight handling shared by the `blocks` family's forward specs
(conformance/ops/blocks.py) and their VJPs (conformance/ops/blocks_grad.py): a backward op takes its
forward's Schema, so its case ids mirror the forward's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernel_parity.refimpl.blocks as ref
from kernel_parity.conformance.ops.blocks_inputs import EPS, MLP_WFMTS, QKV_WFMTS, THETAS, WFMTS, block_of
from kernel_parity.conformance.params import Defaults, Int, OneOf, Schema
from kernel_parity.conformance.spec import Diagnosis

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
    wqkv=OneOf(*QKV_WFMTS, doc="Q/K/V weight format (the seed's wq_dt; W_k's and W_v's unless wk / wv); K-quants "
               "(S1) take Q8_K activations and aE a multiple of 256"),
    wo=OneOf(*QKV_WFMTS, doc="W_o format (the seed's wo_dt); K-quants (S1) take Q8_K activations and h_q a_d a "
             "multiple of 256, Q4_1 / Q5_1 Q8_1"),
    bias=OneOf(0, 1, doc="Q/K/V biases bq, bk, bv (Qwen2)"),
    obias=OneOf(0, 1, doc="output projection bias bo"),
    residual=OneOf(0, 1, doc="add the residual r to the output"),
    style=OneOf("half", "interleaved", doc="RoPE pairs (i, i + d/2) or (2i, 2i + 1)"),
    theta=OneOf(*THETAS, doc="RoPE base of the cos/sin tables"),
    eps=OneOf(*EPS, doc="RMSNorm epsilon (inside the square root)"),
    gemma=OneOf(0, 1, doc="RMSNorm weight applied as (1 + gamma) (Gemma)"),
)
# Attention parameters added after the ops' first cases (seed audit S7, S11, S4), with defaults (`Defaults`): a case
# that leaves them at their default has the id and inputs it always had.
ATTN_NEW = dict(
    rope_off=Int(0, 1 << 20, edges=(0, 1, 4096), doc="RoPE's position minus the cache slot (the seed's "
                 "rope_pos_offset beside token_index): token t rotated at rope_off + slot, cached and masked by slot"),
    qkv=OneOf("separate", "fused", doc="Q/K/V weights and biases as wq, wk, wv (bq, bk, bv), or the seed's one "
              "W_qkv / b_qkv (inputs wqkv, bqkv: rows of the q heads, then k, then v)"),
    wo_layout=OneOf("flat", "head_major", doc="W_o (aE, h_q a_d), or (S4) the seed's fp32 per-head Wo[h][aE][a_d] "
                    "summed over heads, the bias once (the backward's dwo per head)"),
    wk=OneOf("", *QKV_WFMTS, doc="W_k's own format (S1: the seed's wk_dt); \"\" = wqkv's"),
    wv=OneOf("", *QKV_WFMTS, doc="W_v's own format (S1: the seed's wv_dt); \"\" = wqkv's"),
)
ATTN_DEFAULTS = {"rope_off": 0, "qkv": "separate", "wo_layout": "flat", "wk": "", "wv": ""}
PROJ_PARAM = {"wq": "wqkv", "wk": "wk", "wv": "wv"}


def proj_fmt(p: dict[str, Any], name: str) -> str:
    """The format of projection wq / wk / wv (S1: wk, wv default to wqkv's)."""
    return p.get(PROJ_PARAM[name]) or p["wqkv"]
MLP = dict(
    i=Int(1, 1 << 16, edges=(256, 14336, 18944), doc="intermediate width I (gate and up each)"),
    w1=OneOf(*MLP_WFMTS, doc="fused gate/up weight format (2I, aE)"),
    w2=OneOf(*MLP_WFMTS, doc="down weight format (aE, I)"),
    eps=OneOf(*EPS, doc="RMSNorm epsilon"),
    gemma=OneOf(0, 1, doc="RMSNorm weight applied as (1 + gamma)"),
    bias=OneOf(0, 1, doc="MLP biases b1 (2aI: b_gate | b_up) and b2 (aE: b_down), the seed's (seed audit S2)"),
    ipad=Int(0, 4096, edges=(0, 8, 32), doc="padding lanes of each of the gate and up halves: aI = i + ipad (the "
                                             "seed's aligned_intermediate_dim; W1's padded rows non-zero, S3)"),
)
MLP_DEFAULTS = {"bias": 0, "ipad": 0}  # older cases keep their ids and inputs


def ai(p: dict[str, Any]) -> int:
    """The aligned intermediate width aI = I + ipad."""
    return p["i"] + p.get("ipad", 0)


def ae(p: dict[str, Any]) -> int:
    return p["e"] + p["epad"]


def ad(p: dict[str, Any]) -> int:
    return p["d"] + p["dpad"]


def check_k(name: str, fmt: str, k: int, what: str) -> str | None:
    b = block_of(fmt)
    if k % b:
        return f"{name}={fmt} needs {what}={k} to be a multiple of its block of {b}"
    return None


def check_heads(p: dict[str, Any]) -> str | None:
    if p["hq"] % p["hkv"]:
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']}"
    if p["d"] % 2:
        return f"d={p['d']} must be even (RoPE pairs)"
    return None


def check_wo(p: dict[str, Any]) -> str | None:
    b = block_of(p["wo"])
    if b == 256 and (p["hq"] * ad(p)) % 256:  # S1: a K-quant W_o's blocks (and Q8_K's) span heads
        return (f"wo={p['wo']} quantizes the attention output row in 256-blocks (Q8_K): h_q a_d = {p['hq']} x "
                f"{ad(p)} = {p['hq'] * ad(p)} must be a multiple of 256")
    if b == 32 and ad(p) % 32:
        return (f"wo={p['wo']} quantizes the attention output per head in 32-blocks: a_d = d + dpad = {ad(p)} "
                f"must be a multiple of 32")
    return None


def check_attention(p: dict[str, Any]) -> str | None:
    last = p["pos"] + 1 if "pos" in p else p["start"] + p["t"]
    if last > p["cap"]:
        return f"the new tokens reach position {last - 1}, past the cache capacity cap={p['cap']}"
    return (check_heads(p) or check_qkv_fmts(p) or check_wo(p) or check_wo_layout(p))


def check_qkv_fmts(p: dict[str, Any]) -> str | None:
    """Each of W_q, W_k, W_v in its own format (S1) over aE columns; one W_qkv has one format."""
    if p.get("qkv") == "fused" and (p.get("wk") or p.get("wv")):
        return "qkv=fused is one W_qkv in the format wqkv: wk and wv (per-projection formats) must be left unset"
    for name in ("wq", "wk", "wv"):
        err = check_k(PROJ_PARAM[name], proj_fmt(p, name), ae(p), "aE = e + epad")
        if err:
            return err
    return None


def check_wo_layout(p: dict[str, Any]) -> str | None:
    if p.get("wo_layout") == "head_major" and p["wo"] != "f32":
        return "wo_layout=head_major is the seed's fp32 per-head W_o: it needs wo=f32"
    return None


def check_mlp(p: dict[str, Any]) -> str | None:
    return check_k("w1", p["w1"], ae(p), "aE = e + epad") or check_k("w2", p["w2"], ai(p), "aI = i + ipad")


def mlp_kw(x: dict[str, np.ndarray], p: dict[str, Any]) -> dict[str, Any]:
    """The MLP's keyword arguments of the goldens: n, the biases given, the real I when padded, gemma."""
    return dict(n=p["e"], b1=x.get("b1"), b2=x.get("b2"), inter=p["i"] if p.get("ipad", 0) else None,
                gemma=bool(p["gemma"]))


OUTPROJ_MLP_DEFAULTS = {**MLP_DEFAULTS, "attn_layout": "token_major"}  # older cases keep their ids and inputs


def attn_layout(p: dict[str, Any]) -> str:
    """outproj_mlp's attention output layout: "token_major" (T, h_q a_d) or "head_major" (h_q, T, a_d) (S5)."""
    return p.get("attn_layout", "token_major")


def check_outproj_mlp(p: dict[str, Any]) -> str | None:
    if p["wo_layout"] == "head_major" and p["wo"] != "f32":
        return "wo_layout=head_major is the seed's fp32 per-head W_o: it needs wo=f32"
    return check_mlp(p) or check_wo(p)


def weights_of(x: dict[str, np.ndarray], p: dict[str, Any], *names: str) -> list[ref.Weight | None]:
    """The named weights; with qkv=fused "wq" is W_qkv (input wqkv), "wk" and "wv" None (ref.qkv_sections)."""
    if p.get("qkv") == "fused":
        x = {**x, "wq": x["wqkv"]}
    fmt = {"wq": p.get("wqkv"), "wk": p.get("wk") or p.get("wqkv"), "wv": p.get("wv") or p.get("wqkv"),
           "wo": p.get("wo"), "w1": p.get("w1"), "w2": p.get("w2")}  # S1: W_k, W_v default to wqkv's format
    if p.get("wo_layout") == "head_major":
        fmt["wo"] = "f32_heads"
    fused = p.get("qkv") == "fused"
    return [None if fused and n in ("wk", "wv") else ref.Weight(fmt[n], x[n]) for n in names]


def attention_kw(x: dict[str, np.ndarray], p: dict[str, Any], reference: str) -> dict[str, Any]:
    return dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], bq=x.get("bq", x.get("bqkv")), bk=x.get("bk"),
                bv=x.get("bv"), bo=x.get("bo"), residual=x.get("r"), style=p["style"], gemma=bool(p["gemma"]),
                reference=reference, rope_off=p.get("rope_off", 0), qkv=p.get("qkv", "separate"))


GEMMA_DIAGNOSES = (Diagnosis("matches (1 + gamma) where gamma was meant, or the reverse: Gemma offset bug",
                    lambda p: {**p, "gemma": 1 - p["gemma"]}),)
ATTENTION_DIAGNOSES = (
    Diagnosis("matches the other RoPE pairing (interleaved vs half): RoPE style bug",
              lambda p: {**p, "style": "half" if p["style"] == "interleaved" else "interleaved"}),
    *GEMMA_DIAGNOSES,
)


PREFILL_PARAMS = Defaults(dict(MODEL, **HEADS, t=Int(1, 1 << 16, edges=(1, 2, 7, 64, 65), doc="new tokens T"),
                               start=Int(0, 1 << 20, edges=(0, 1, 63, 64, 1024), doc="tokens of history (start_pos)"),
                               **ATTN, **ATTN_NEW), ATTN_DEFAULTS)
DECODE_PARAMS = Defaults(dict(MODEL, **HEADS, pos=Int(0, 1 << 20, edges=(0, 1, 63, 64, 65, 1024),
                                                    doc="the token's slot (slots 0 .. pos attended)"), **ATTN,
                              **ATTN_NEW), ATTN_DEFAULTS)
MLP_PARAMS = Defaults(dict(t=Int(1, 1 << 16, edges=(1, 2, 7), doc="tokens"), **MODEL, **MLP), MLP_DEFAULTS)
# The whole layer (seed audit S9): the prefill attention block's parameters (separate Q/K/V, no rope_off: the
# attention ops cover those), the MLP's (no biases or padding), and `scores`. A new op: its defaults are its own.
LAYER_PARAMS = Defaults(dict(MODEL, **HEADS, t=PREFILL_PARAMS.params["t"], start=PREFILL_PARAMS.params["start"],
                             **{k: v for k, v in ATTN.items() if k != "residual"},
                             **{k: MLP[k] for k in ("i", "w1", "w2")},
                             scores=OneOf(0, 1, doc="also output the attention's softmax probabilities (h_q, T, "
                                                    "ctx): the saved scores the seed's backward reads")),
                        {"scores": 0})


def check_layer(p: dict[str, Any]) -> str | None:
    """The attention block's constraints and the MLP's."""
    return check_attention(p) or check_mlp(p)
