"""kvquant.mla_sparse (issue 34): FlashMLA's sparse MLA decode over its FP8 KV cache rows of 656 bytes.

The kernels read the bytes: each cache row (token, kv head) holds 512 float8_e4m3fn codes of the latent part, 4
float32 scales (one per 128 latent channels) and 64 bf16 RoPE values (refimpl/kvquant_mla.py, FlashMLA's README
"FP8 KV cache" and tests/quant.py). q (b, s_q, h_q, 576) bf16 (FlashMLA's sparse decode computes in bf16);
indices (b, s_q, h_kv, topk) int32 flat slots block * 64 + offset, -1 padding; topk_length (b,) int32 or left
out. O (b, s_q, h_q, 512) bf16 and LSE (b, h_q, s_q) fp32 natural log, as mla.decode_sparse
(conformance/ops/mla.py).

What is compared: the kernel's arithmetic on the codes, not the cache's quantization error (the golden unpacks the
same codes exactly, float64 code x scale, and runs refimpl.mla.decode_sparse). So the limits are
mla.decode_sparse's own production tier (conformance/ops/attention.py `attention_tolerance` over topk + 576 terms:
O's absolute error against 4 eps max|O|, the calibrated fp32 LSE, the error model's magnitudes from
refimpl.mla.decode_sparse on the unpacked rows), with bf16 O's cos_diff tightened from 1e-5 to 5e-6: FlashMLA's
own FP8 sparse decode test's (_O_FLASHMLA below). A dequantized row is a bf16 row exactly (an e4m3 code times a
power-of-two scale), and a kernel that folds the scales into its dots (logits sum_g s_g (q_g . codes_g),
O_g = sum_j (p_j s_jg) codes_jg) rounds no more than a bf16-cache kernel does.
Never widened for a kernel. The eager baseline (kernels/torch/kvquant_mla.py: unpack, then mla.decode_sparse's
eager bf16 math) has attention's baseline tier.

Inputs (make_inputs):
- layout: block 0 is a poison page (so a kernel reading -1 as slot 0 reads NaN), every request's pages shuffled
  among the other blocks, one spare poison page; the cache is a view of a (num_blocks, 65, h_kv, 656) buffer
  (FlashMLA's test allocates page + 1 rows a block): block stride 65 rows, the 65th row poison. Poison rows:
  NaN codes (0x7F), NaN scales, NaN bf16 RoPE (0x7FC0);
- neighbour separation: the magnitude class of (physical slot + 128-group + kv head) alternates: lo 2^U(-3, -2),
  hi 2^U(4, 5) (scales 2^-13..2^-12 against 2^-6..2^-5: 64x apart or more, but for a lo group whose amax is a
  4.4-sigma draw, ~1e-3 of them, at 32x), so the neighbouring 128-group, the neighbouring token (slot +- 1 in its
  page) and the neighbouring kv head of every group have scales far off;
- `normal`: latent ~ N(0, 1) / 10 clamped to [-1, 1] (FlashMLA's test) x the class factor, RoPE ~ the same
  without factor; a quarter of the groups get their amax element set to +-448 x their scale (saturated codes);
  every group gets 3 elements at +-m 2^-9 x its scale (m in 1..7: e4m3 subnormal codes) and one 0; packed by the
  golden's pack (FlashMLA's power-of-two scales);
- `grid`: codes uniform over every finite e4m3 code (subnormals, +-0, +-448), scales powers of two 2^[-10, -8]
  (hi) or 2^[-18, -16] (lo) by the same classes; RoPE as `normal`;
- `peaked`: the cache as `normal`, q ~ N(0, 1) (not clamped): logits of std ~5 at DeepSeek's scale (with `normal`'s
  q, std ~0.5 and a flat softmax), so one or two keys lead and the running max moves between tiles;
- lists: each (request, query, kv head) lists a random subset of its request's live tokens (all of them in random
  order when fewer than topk, then -1), about 1 in 8 entries -1, about 1 in 16 a repeat of another entry of the
  list (a slot listed twice counts twice); topk_len=ragged: topk_length ~ U[0, topk], request 0 at topk and
  request 1 (b > 2) at 0; entries past topk_length name poison rows; topk_len=none: no topk_length input (FlashMLA's
  default), every entry used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt
from kernel_parity.conformance.ops.attention import attention_tolerance
from kernel_parity.conformance.ops.attention_inputs import lengths
from kernel_parity.conformance.ops.mla import OUT, SCALES
from kernel_parity.conformance.params import Defaults, Int, OneOf
from kernel_parity.conformance.spec import OpSpec, Rows
from kernel_parity.conformance.tolerance import Override
from kernel_parity.refimpl import kvquant_mla as km

D, DV, PAGE = km.D, km.D_NOPE, 64
POISON_ROW = np.concatenate([np.full(km.SCALE_OFF, 0x7F, np.uint8),
                             np.full(km.N_TILES, np.nan, "<f4").view(np.uint8),
                             np.full(km.D_ROPE, 0x7FC0, "<u2").view(np.uint8)])
# log2 ranges of the magnitude classes: amax / 448 of a lo group lands at or under FlashMLA's 1e-4 floor (scale
# 2^-13 or 2^-12), a hi group's at 2^-6 or 2^-5: neighbouring scales >= 64x apart
LO, HI = (-3.0, -2.0), (4.0, 5.0)
GRID_LO, GRID_HI = (-18, -16), (-10, -8)  # grid: log2 of the power-of-two scales
DISTS = {
    "normal": "latent ~ N(0, 1) / 10 clamped x alternating magnitude classes (64x+ apart by slot, group, kv head), "
              "saturated and subnormal codes injected, packed with FlashMLA's power-of-two scales",
    "grid": "codes uniform over every finite e4m3 code, power-of-two scales in alternating classes",
    "peaked": "the cache as normal, q ~ N(0, 1): logits of std ~5, a softmax led by one or two keys, its running max "
              "moving from tile to tile",
}
PEAKED_Q = 1.0


def _classes(slots: np.ndarray, hkv: int) -> np.ndarray:
    """(n, hkv, 4) bool: the hi class of each (row, kv head, group), alternating with slot, group and head."""
    return ((slots[:, None, None] + np.arange(hkv)[None, :, None] + np.arange(km.N_TILES)[None, None, :]) % 2) == 1


def _rows_normal(rng: np.random.Generator, slots: np.ndarray, hkv: int) -> np.ndarray:
    n = slots.size
    x = np.clip(rng.standard_normal((n, hkv, D)) / 10.0, -1.0, 1.0)
    hi = _classes(slots, hkv)
    f = np.where(hi, 2.0 ** rng.uniform(*HI, hi.shape), 2.0 ** rng.uniform(*LO, hi.shape))
    g = x[..., :DV].reshape(n, hkv, km.N_TILES, km.TILE) * f[..., None]
    s = km.row_scales(g.reshape(n, hkv, DV)).astype(np.float64)  # n, hkv, 4
    sat = rng.random(s.shape) < 0.25  # the amax element -> +-448 x its scale: a saturated code
    am = np.argmax(np.abs(g), axis=-1)
    a = np.take_along_axis(g, am[..., None], -1)[..., 0]
    np.put_along_axis(g, am[..., None], np.where(sat, np.sign(a) * 448.0 * s, a)[..., None], -1)
    for _ in range(3):  # subnormal codes m 2^-9 (m 1..7); never the amax element
        pos = (am + 1 + rng.integers(0, km.TILE - 1, s.shape)) % km.TILE
        v = rng.choice([-1.0, 1.0], s.shape) * rng.integers(1, 8, s.shape) * 2.0 ** -9 * s
        np.put_along_axis(g, pos[..., None], v[..., None], -1)
    np.put_along_axis(g, ((am + km.TILE // 2) % km.TILE)[..., None], 0.0, -1)
    x[..., :DV] = g.reshape(n, hkv, DV)
    x[..., DV:] = dt.round_to(x[..., DV:], "bf16")
    return km.pack(x)


def _rows_grid(rng: np.random.Generator, slots: np.ndarray, hkv: int) -> np.ndarray:
    n = slots.size
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    out = np.empty((n, hkv, km.ROW_BYTES), dtype=np.uint8)
    out[..., :km.SCALE_OFF] = rng.choice(finite, (n, hkv, km.SCALE_OFF))
    hi = _classes(slots, hkv)
    e = np.where(hi, rng.integers(GRID_HI[0], GRID_HI[1] + 1, hi.shape), rng.integers(GRID_LO[0], GRID_LO[1] + 1,
                                                                                       hi.shape))
    out[..., km.SCALE_OFF:km.ROPE_OFF] = np.ascontiguousarray(np.ldexp(1.0, e).astype("<f4")).view(np.uint8)
    rope = dt.round_to(np.clip(rng.standard_normal((n, hkv, km.D_ROPE)) / 10.0, -1.0, 1.0), "bf16")
    out[..., km.ROPE_OFF:] = np.ascontiguousarray(rope.astype(km.BF16)).view(np.uint8)
    return out


def _inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, sq, hq, hkv, k = p["b"], p["sq"], p["hq"], p.get("hkv", 1), p["topk"]
    seqlens = lengths(b, p["kv"], p["lens"])
    used = [-(-int(n) // PAGE) for n in seqlens]
    n_used = sum(used)
    n_blocks = n_used + 2  # block 0 and one spare: poison
    perm = 1 + rng.permutation(n_used + 1)
    buf = np.empty((n_blocks, PAGE + 1, hkv, km.ROW_BYTES), dtype=np.uint8)
    buf[...] = POISON_ROW
    cache = buf[:, :PAGE]
    table, nxt = [], 0
    make = _rows_grid if dist == "grid" else _rows_normal
    for i in range(b):  # one request's rows at a time (DeepSeek-V3.2 sizes: 8K+ tokens x 64 requests)
        blocks = perm[nxt:nxt + used[i]]
        nxt += used[i]
        tok = np.arange(int(seqlens[i]))
        slots = blocks[tok // PAGE].astype(np.int64) * PAGE + tok % PAGE
        table.append(slots)
        if slots.size:
            cache[slots // PAGE, slots % PAGE] = make(rng, slots, hkv)
    poison = np.concatenate([np.arange(PAGE), perm[n_used] * PAGE + np.arange(PAGE)])  # block 0 and the spare
    idx = np.full((b, sq, hkv, k), -1, dtype=np.int64)
    for i in range(b):
        for r in range(sq):
            for h in range(hkv):
                pick = rng.permutation(table[i])[:k]
                idx[i, r, h, :pick.size] = pick
    live = idx != -1
    rep = live & (rng.random(idx.shape) < 1 / 16)  # a repeat of another entry of the same list
    if rep.any():
        src = rng.integers(0, k, idx.shape)
        idx = np.where(rep & np.take_along_axis(live, src, -1), np.take_along_axis(idx, src, -1), idx)
    idx[rng.random(idx.shape) < 0.125] = -1
    if p["topk_len"] == "ragged":
        tlen = rng.integers(0, k + 1, b)
        tlen[0] = k
        if b > 2:
            tlen[1] = 0
        past = np.broadcast_to(np.arange(k)[None, None, None, :] >= tlen[:, None, None, None], idx.shape)
        idx[past] = rng.choice(poison, int(past.sum()))
    else:
        tlen = np.full(b, k)
    if dist == "peaked":
        q = dt.round_to(rng.standard_normal((b, sq, hq, D)) * PEAKED_Q, dtype)
    else:
        q = dt.round_to(np.clip(rng.standard_normal((b, sq, hq, D)) / 10.0, -1.0, 1.0), dtype)
    x = {"q": q, "kv_cache": cache, "indices": idx.astype(np.int32), "topk_length": tlen.astype(np.int32)}
    if p["topk_len"] == "none":  # FlashMLA's topk_length=None: every entry of the lists is used
        del x["topk_length"]
    return x


def _ref(x, p, absolute=False):
    o, lse = km.mla_sparse(x["q"], x["kv_cache"], x["indices"], x.get("topk_length"), SCALES[p["scale"]], d_v=DV,
                           absolute=absolute)
    return {"o": o, "lse": lse}


def _mag(x, p):
    """mla.decode_sparse's error model on the unpacked rows: O's and the LSE's magnitudes, and O's compute term."""
    return {**_ref(x, p, absolute=True), "o@fp32": _ref(x, p, absolute=km.COMPUTE)["o"]}


def _check(p: dict[str, Any]) -> str | None:
    if p["hq"] % p.get("hkv", 1):
        return f"hq={p['hq']} must be a multiple of hkv={p['hkv']} (query head h reads kv head h // (hq / hkv))"
    return None


def _edge(p: dict[str, Any], x: dict[str, np.ndarray]) -> np.ndarray:
    """Requests always judged when sampled: topk_length 0 or 1."""
    if "topk_length" not in x:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.asarray(x["topk_length"]) <= 1)


# FlashMLA's own test of this op (tests/test_flash_mla_sparse_decoding.py, FP8 rows) holds out to cos_diff < 5e-6
# (abs 1e-3, rel 2.01 / 128 elementwise) and lse to rel 8.01 / 65536: stricter than attention's bf16 1e-5, so the
# production tier takes 5e-6 (nmse 2x, as attention's pair); the elementwise and LSE limits stay attention's (its
# fp32 LSE limits are far stricter than 1.2e-4). The baseline tier (attention's, after this) is unchanged.
_O_FLASHMLA = (Override("FlashMLA's FP8 sparse decode test holds bf16 out to cos_diff < 5e-6", output="o",
                        dtype="bf16", cos_diff=5e-6, nmse=1e-5),)


MLA_SPARSE = OpSpec(
    name="kvquant.mla_sparse",
    golden=km.mla_sparse,
    reference=_ref,
    magnitude=_mag,
    params=Defaults(dict(
        b=Int(1, 256, edges=(1, 2, 64), doc="requests"),
        sq=OneOf(1, 2, doc="query rows per request (2: MTP), each with its own lists, no causal mask"),
        hq=Int(1, 128, edges=(16, 64, 128), doc="query heads"),
        hkv=Int(1, 8, edges=(1, 2), doc="latent kv heads (1: DeepSeek-V3.2, FlashMLA's FP8 sparse decode); query "
                                        "head h reads kv head h // (hq / hkv)'s list and rows"),
        kv=Int(0, 1 << 17, edges=(64, 65, 8192), doc="longest cached length"),
        lens=OneOf("full", "ragged", doc="requests at the longest length, or ragged (0, 1, ... among them)"),
        topk=Int(1, 2048, edges=(64, 2048), doc="slots listed per query row"),
        topk_len=OneOf("full", "ragged", "none", doc="topk_length: all topk, U[0, topk] (request 0 topk, 1 zero), or "
                                                      "none (FlashMLA's topk_length=None: the input left out)"),
        scale=OneOf("head", "model", doc="576^-0.5 (FlashMLA's tests) or DeepSeek-V3's 0.1352"),
    ), {"hkv": 1}),
    make_inputs=_inputs,
    output_shapes=lambda p: {"o": (p["b"], p["sq"], p["hq"], DV), "lse": (p["b"], p["hq"], p["sq"])},
    outputs=OUT,
    tolerance=attention_tolerance(lambda p, o: p["topk"] + D, *_O_FLASHMLA),
    dtypes=("bf16",),
    dists=DISTS,
    check=_check,
    storage_inputs=frozenset({"kv_cache"}),
    rows=Rows("b", inputs={"q": 0, "indices": 0, "topk_length": 0}, outputs={"o": 0, "lse": 0}, always=_edge,
              size=lambda p: p["b"] * p["sq"] * p["hq"] * p["topk"] * D),
    flops=lambda p: 2.0 * p["b"] * p["sq"] * p["hq"] * p["topk"] * (D + DV),
    bytes_moved=lambda p: (p["b"] * p["sq"] * (p["hq"] * D * 2 + p.get("hkv", 1) * p["topk"] * (km.ROW_BYTES + 4)),
                           p["b"] * p["sq"] * p["hq"] * (DV * 2 + 4)),
    doc="FlashMLA sparse MLA decode over its 656-byte FP8 cache rows (512 e4m3 codes, 4 fp32 scales per 128, 64 "
        "bf16 RoPE): each query row attends to its top-k slots; O, LSE as mla.decode_sparse on the unpacked rows.",
)

SPECS = (MLA_SPARSE,)
