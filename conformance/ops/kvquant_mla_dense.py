"""kvquant.mla_decode and kvquant.mla_pack (issue 34): FlashMLA's dense paged MLA decode over its FP8 KV cache rows
of 656 bytes, and the write path of those rows (goldens: refimpl/kvquant_mla_dense.py; the row format
refimpl/kvquant_mla.py: 512 e4m3 codes, 4 float32 power-of-two scales of 128 latent channels, 64 bf16 RoPE values).

kvquant.mla_decode: q (b, s_q, h_q, 576) bf16, kv_cache (num_blocks, 64, h_kv, 656) uint8, block_table (b,
max_blocks) int32, seqlens (b,) int32; causal bottom-right for s_q = 2 (mla.decode's); O (b, s_q, h_q, 512) bf16,
LSE (b, h_q, s_q) fp32 natural log. What is compared: the kernels' arithmetic on the codes (the golden unpacks
the same codes exactly and runs refimpl.mla.decode), not the quantization error. Limits: mla.decode's production
tier (conformance/ops/attention.py `attention_tolerance` over kv + 576 terms, the error model's magnitudes from
refimpl.mla.decode on the unpacked rows) with bf16 O's cos_diff tightened to 5e-6 (FlashMLA's FP8 test's,
kvquant.mla_sparse's `_O_FLASHMLA`): a dequantized row is a bf16 row exactly, and a kernel that folds the scales
into its dots rounds no more than a bf16-cache kernel does. The eager baseline (unpack, then mla.decode's eager
bf16 math) has attention's baseline tier.

Inputs (kvquant.mla_sparse's layout and row draws, conformance/ops/kvquant_mla.py):
- layout: block 0 a poison page, each request's pages shuffled among the others, one spare poison page; the cache
  a view of a (num_blocks, 65, h_kv, 656) buffer (block stride 65 rows, the 65th row poison), the tail of each
  request's last page poison; block-table entries past a request's last page 2147480000 (FlashMLA's test's);
  poison rows: NaN codes (0x7F), NaN scales, NaN bf16 RoPE;
- rows `normal` / `grid` / `peaked` as kvquant.mla_sparse's (magnitude classes alternating by physical slot,
  128-group and kv head: neighbouring group, token and page scales >= 64x apart; saturated and subnormal codes;
  every finite e4m3 code in `grid`; q ~ N(0, 1) in `peaked`);
- lens: full, ragged (attention_inputs.lengths: 0 and 1 among them), or `edges`: page boundaries +-1 and 0
  (kv, 0, 63, 64, 65, 127, 128, 129, 1, ... each clipped to kv).

kvquant.mla_pack: kv_c (n, 512), k_pe (n, 64) bf16 written at slot_mapping (n,) int64 (distinct slots over the whole
cache, `pad` of them -1) into kv_cache (blocks, page, 1, 656) uint8 holding random bytes (the canaries: every
byte not in a written row must keep its value), a view of a (blocks, page + 1, 1, 656) buffer (block stride page + 1
rows: a kernel ignoring the block stride writes the wrong slots); output the cache after the call, bit-exact, in place
(Output.inplace). Inputs: each (token, group) of kv_c gets a kind: 1 in 8 all zero, 1 in 4 its amax element set
to exactly +-448 2^k, k >= -13 (the scale 2^k, the saturated code; the others clipped to +-448 2^k), 1 in 8 tiny
(amax under 448 x 1e-4: the floored scale 2^-13, subnormal codes and underflow to 0), the rest N(0, 1) at a
level; the levels of neighbouring groups and neighbouring tokens alternate 2^10 apart or more (dist `normal`: 2^-4
/ 2^6; `wide`: 2^-40..2^-30 against 2^30..2^40, bf16's far range; the RoPE values at the token's first group's
level), so a kernel taking the neighbouring group's or token's amax saturates or underflows whole groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.ops.attention_inputs import lengths
from kernel_parity.conformance.ops.kvquant_mla import (DISTS, PEAKED_Q, POISON_ROW, _O_FLASHMLA, _rows_grid,
                                                      _rows_normal)
from kernel_parity.conformance.ops.mla import OUT, SCALES, TABLE_POISON
from kernel_parity.conformance.params import Defaults, Int, OneOf, Schema
from kernel_parity.conformance.spec import OpSpec, Output, Rows
from kernel_parity.conformance.tolerance import Tol
from kernel_parity.refimpl import kvquant_mla_dense as kd

D, DV, DPE, PAGE = kd.D, kd.D_NOPE, kd.D_ROPE, 64
EDGE_LENS = (0, 63, 64, 65, 127, 128, 129, 1)


def _lens(p: dict[str, Any]) -> np.ndarray:
    """(b,) int32 cache lengths, a function of the params."""
    if p["lens"] == "edges":
        pat = [p["kv"]] + [min(x, p["kv"]) for x in EDGE_LENS]
        return np.asarray([pat[i % len(pat)] for i in range(p["b"])], dtype=np.int32)
    return lengths(p["b"], p["kv"], p["lens"])


def _decode_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, sq, hq, hkv = p["b"], p["sq"], p["hq"], p.get("hkv", 1)
    seqlens = _lens(p)
    used = [-(-int(n) // PAGE) for n in seqlens]
    n_used = sum(used)
    n_blocks = n_used + 2  # block 0 and one spare: poison
    perm = 1 + rng.permutation(n_used + 1)
    buf = np.empty((n_blocks, PAGE + 1, hkv, kd.ROW_BYTES), dtype=np.uint8)
    buf[...] = POISON_ROW
    cache = buf[:, :PAGE]
    table = np.full((b, max(1, max(used, default=1))), TABLE_POISON, dtype=np.int32)
    make = _rows_grid if dist == "grid" else _rows_normal
    nxt = 0
    for i in range(b):  # one request's rows at a time (DeepSeek-V3 sizes: 32K tokens x 128 requests)
        blocks = perm[nxt:nxt + used[i]]
        nxt += used[i]
        table[i, :used[i]] = blocks
        tok = np.arange(int(seqlens[i]))
        if tok.size:
            slots = blocks[tok // PAGE].astype(np.int64) * PAGE + tok % PAGE
            cache[slots // PAGE, slots % PAGE] = make(rng, slots, hkv)
    if dist == "peaked":
        q = dt.round_to(rng.standard_normal((b, sq, hq, D)) * PEAKED_Q, dtype)
    else:
        q = dt.round_to(np.clip(rng.standard_normal((b, sq, hq, D)) / 10.0, -1.0, 1.0), dtype)
    return {"q": q, "kv_cache": cache, "block_table": table, "seqlens": seqlens}


def _decode_ref(x, p, absolute=False):
    o, lse = kd.mla_decode(x["q"], x["kv_cache"], x["block_table"], x["seqlens"], SCALES[p["scale"]], d_v=DV,
                           causal=bool(p["causal"]), absolute=absolute)
    return {"o": o, "lse": lse}


def _decode_mag(x, p):
    """mla.decode's error model on the unpacked rows: O's and the LSE's magnitudes, and O's compute term."""
    return {**_decode_ref(x, p, absolute=True), "o@fp32": _decode_ref(x, p, absolute=kd.COMPUTE)["o"]}


def _decode_check(p: dict[str, Any]) -> str | None:
    if p["causal"] and p["sq"] == 1:
        return "causal=1 needs sq=2 (with one new token the mask is empty; use causal=0)"
    if p["hq"] % p.get("hkv", 1):
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']} (query head h reads kv head h // (hq / hkv))"
    return None


def _edge_requests(p: dict[str, Any], x: dict[str, np.ndarray]) -> np.ndarray:
    """Requests always judged when sampled: empty, one token, and lengths at a page edge."""
    n = np.asarray(x["seqlens"])
    return np.flatnonzero((n <= 1) | (n % PAGE <= 1) | (n % PAGE == PAGE - 1))


MLA_DECODE = OpSpec(
    name="kvquant.mla_decode",
    golden=kd.mla_decode,
    reference=_decode_ref,
    magnitude=_decode_mag,
    params=Defaults(dict(
        b=Int(1, 256, edges=(1, 2, 64, 128), doc="requests"),
        sq=OneOf(1, 2, doc="new tokens per request (2: multi-token prediction, causal bottom-right)"),
        hq=Int(1, 128, edges=(16, 64, 128), doc="query heads"),
        hkv=Int(1, 8, edges=(1, 2), doc="latent kv heads (1: DeepSeek-V3, FlashMLA's FP8 cache); query head h "
                                        "reads kv head h // (hq / hkv)"),
        kv=Int(0, 1 << 17, edges=(64, 65, 4096, 32768), doc="longest cached length"),
        lens=OneOf("full", "ragged", "edges", doc="requests at the longest length, ragged (0, 1, ... among them), "
                                                   "or page edges +-1 and 0"),
        causal=OneOf(0, 1, doc="bottom-right causal mask (sq = 2)"),
        scale=OneOf("head", "model", doc="576^-0.5 (FlashMLA's tests) or DeepSeek-V3's 0.1352"),
    ), {"hkv": 1}),
    make_inputs=_decode_inputs,
    output_shapes=lambda p: {"o": (p["b"], p["sq"], p["hq"], DV), "lse": (p["b"], p["hq"], p["sq"])},
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: int(_lens(p).max(initial=0)) + D, *_O_FLASHMLA),
    dtypes=("bf16",),
    dists=DISTS,
    check=_decode_check,
    storage_inputs=frozenset({"kv_cache"}),
    rows=Rows("b", inputs={"q": 0, "block_table": 0, "seqlens": 0}, outputs={"o": 0, "lse": 0},
              always=_edge_requests, size=lambda p: p["b"] * p["sq"] * p["hq"] * p["kv"]),
    flops=lambda p: 2.0 * p["sq"] * p["hq"] * float(_lens(p).sum()) * (D + DV),
    bytes_moved=lambda p: (p["b"] * p["sq"] * p["hq"] * D * 2 + float(_lens(p).sum()) * p.get("hkv", 1)
                           * kd.ROW_BYTES, p["b"] * p["sq"] * p["hq"] * (DV * 2 + 4)),
    doc="FlashMLA dense paged MLA decode over its 656-byte FP8 cache rows (512 e4m3 codes, 4 fp32 scales per 128, "
        "64 bf16 RoPE; is_fp8_kvcache=True): O, LSE as mla.decode on the unpacked rows.",
)


# --------------------------------------------------------------------------- kvquant.mla_pack

PACK_DISTS = {
    "normal": "per (token, 128-group): zero, amax exactly 448 2^k, tiny (floored scale: subnormal codes), or "
              "N(0, 1) at a level; neighbouring groups and tokens 2^10 apart (levels 2^-4 / 2^6)",
    "wide": "as normal at bf16's far range: levels 2^-40 / 2^-30 against 2^30 / 2^40",
}
LEVELS = {"normal": ((-4, -4), (6, 6)), "wide": ((-40, -30), (30, 40))}


def _pack_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n, pad, nb, page = p["n"], p["pad"], p["blocks"], p["page"]
    slots = np.full(n, -1, dtype=np.int64)
    real = rng.permutation(n)[:n - pad]
    slots[np.sort(real)] = rng.choice(nb * page, n - pad, replace=False)
    (lo0, lo1), (hi0, hi1) = LEVELS[dist]
    hi = ((np.arange(n)[:, None] + np.arange(4)[None, :] + int(rng.integers(0, 2))) % 2) == 1
    e = np.where(hi, rng.integers(hi0, hi1 + 1, (n, 4)), rng.integers(lo0, lo1 + 1, (n, 4)))
    g = rng.standard_normal((n, 4, 128)) * np.exp2(e.astype(np.float64))[..., None]
    kind = rng.random((n, 4))
    zero, exact, tiny = kind < 0.125, (kind >= 0.125) & (kind < 0.375), (kind >= 0.375) & (kind < 0.5)
    # tiny: amax under 448 x 1e-4 (the scale floors at 2^-13): codes x / 2^-13 down in the subnormals and below
    g[tiny] = rng.standard_normal((int(tiny.sum()), 128)) * np.exp2(rng.integers(-24, -16, (int(tiny.sum()), 1)))
    g[zero] = 0.0
    g = dt.round_to(g, dtype).astype(np.float64)
    if exact.any():  # the amax element exactly +-448 2^k, the others at most that: the scale 2^k, code +-448
        k = np.clip(e[exact] + int(rng.integers(-2, 3)) - 8, -13, 118)  # 2^-13: FlashMLA's floor
        rows = g[exact]
        top = 448.0 * np.exp2(k.astype(np.float64))
        rows = np.clip(rows, -top[:, None], top[:, None])
        am = np.argmax(np.abs(rows), axis=-1)
        np.put_along_axis(rows, am[:, None], (rng.choice([-1.0, 1.0], am.size) * top)[:, None], -1)
        g[exact] = dt.round_to(rows, dtype).astype(np.float64)
    kv_c = dt.round_to(g.reshape(n, DV), dtype)
    k_pe = dt.round_to(rng.standard_normal((n, DPE)) * np.exp2(e[:, :1].astype(np.float64)), dtype)
    # a view of (nb, page + 1) rows a block (FlashMLA's test's allocation): block stride page + 1 rows, so a kernel
    # that takes the block stride as page rows writes block >= 1's rows one slot a block early
    cache = rng.integers(0, 256, (nb, page + 1, 1, kd.ROW_BYTES), dtype=np.uint8)[:, :page]
    return {"kv_cache": cache, "kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}


def _pack_ref(x, p):
    return {"kv_cache": kd.mla_pack(np.asarray(x["kv_cache"]), x["kv_c"], x["k_pe"], x["slot_mapping"])}


def _pack_check(p: dict[str, Any]) -> str | None:
    if p["pad"] > p["n"]:
        return f"pad={p['pad']} padding tokens exceed n={p['n']} (expected pad <= n)"
    if p["n"] - p["pad"] > p["blocks"] * p["page"]:
        return (f"n - pad = {p['n'] - p['pad']} tokens do not fit blocks x page = {p['blocks'] * p['page']} slots "
                f"(expected more blocks)")
    return None


MLA_PACK = OpSpec(
    name="kvquant.mla_pack",
    golden=kd.mla_pack,
    reference=_pack_ref,
    params=Schema(dict(
        n=Int(1, 1 << 17, edges=(1, 2, 256), doc="new tokens (a decode batch, a prefill chunk)"),
        page=Int(1, 1024, edges=(64,), doc="slots a cache block (page; FlashMLA: 64)"),
        blocks=Int(1, 1 << 20, doc="cache blocks (num_blocks)"),
        pad=Int(0, 1 << 17, edges=(0, 1), doc="tokens of slot -1 (padding, not written)"),
    )),
    make_inputs=_pack_inputs,
    output_shapes=lambda p: {"kv_cache": (p["blocks"], p["page"], 1, kd.ROW_BYTES)},
    outputs={"kv_cache": Output("uint8", exact=True, inplace="kv_cache",
                                doc="the 656-byte rows after the write (every unwritten byte kept)")},
    tolerance=Tol(noise_k=None),
    dtypes=("bf16",),
    dists=PACK_DISTS,
    check=_pack_check,
    baseline=None,
    storage_inputs=frozenset({"kv_cache"}),
    flops=lambda p: 3.0 * p["n"] * D,
    bytes_moved=lambda p: (p["n"] * (D * 2 + 8), p["n"] * kd.ROW_BYTES),
    doc="The write path of FlashMLA's 656-byte FP8 MLA cache rows (concat_and_cache_mla fp8_ds_mla): per 128-group "
        "power-of-two scale >= amax / 448, e4m3 codes RNE, bf16 RoPE bytes; slot -1 skipped; bit-exact.",
)

SPECS = (MLA_DECODE, MLA_PACK)
