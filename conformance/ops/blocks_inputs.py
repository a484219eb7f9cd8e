"""Input builders of the fused transformer blocks (stem `blocks`): aligned rows, projection weights in
their storage formats, head-major caches with history, RoPE tables.

Everything the engine keeps zero is zero: the padding lanes of x, gamma, the residual and the biases,
the weight rows of padded output lanes and the weight columns of padded input lanes, the padded lanes
of the cached history. Every cache slot from the first new token on holds NaN (all lanes), so a kernel
that reads a slot it has not written, or writes a row one slot late, fails structurally.

Distributions separate neighbours (a bug that reads the neighbouring head, block, row or position is
off by far more than rounding):
- `heads`: q / k weight rows of each head scaled by 10^u, u ~ U(-0.5, 0.5) (logits up to ~30), v rows
  and the cached values of each kv head by 10^u, u ~ U(-2, 2): a wrong kv head is off by orders of
  magnitude;
- `blocks`: every 32-lane block of x and every 32-column block of the weights scaled by 10^u,
  u ~ U(-1.5, 1.5) / U(-1, 1): neighbouring Q8_0 / Q5_0 blocks and K-quant sub-blocks carry scales far
  apart (a block dot with its neighbour's scale is far off); the Q/K/V rows are then rescaled to unit
  output variance, so the logits keep the size of the other distributions';
- `tiny`: rows of scale 1e-3 (and, with several rows, an all-zero row): mean(x^2) ~ 1e-6 sits at the
  eps of the small-eps cases, and eps = 1 dominates it;
- `rows`: row t scaled by 10^u, u ~ U(-3, 3) (the residual stream of neighbouring tokens far apart);
- `pads` (attention blocks): `normal`, with values wherever the contract zeroes an output by the kernel's
  own clearing rather than by its inputs (seed audit S6). The golden clears a cached row's lanes [d, a_d)
  "whatever the projection gave there" (refimpl/blocks.py), so the Q/K/V weight rows and bias lanes
  [d, a_d) of every head hold PAD_SCALE N(0, 1) (the q, k, v, q_rope, k_rope stages carry them; a cache
  row, and the keys and values the attention reads, must not); W_o's columns of those lanes and the
  Q/K/V columns of the padded row lanes [E, aE) hold the real weights' scale (they multiply lanes that
  are zero in a correct kernel: the attention output's padding, the norm's). What stays zero is what
  the contract lets a kernel assume: x, gamma, the residual, bo and the history's padding lanes (its
  rows were written by the kernel's own clearing write), W_o's padded output rows (out's padding is
  zero only through them).
Positions are parameters: decode at pos around the 64-key tiles (63, 64, 65) and far out (1024).
`rope_off` (seed audit S7) extends the cos/sin tables to cap + rope_off rows (the other cases' tables are
unchanged); `qkv=fused` (S11) gives the same draws as inputs `wqkv` (and `bqkv`): wq's, wk's, wv's rows
(biases) concatenated, q heads first; `wo_layout=head_major` (S4) the same W_o as (h_q, aE, a_d) float32;
`wk` / `wv` (S1) the same W_k / W_v draws stored in their own formats (W_o's draw in any of them: `wo`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernel_parity import refimpl
import kernel_parity.refimpl.quant  # noqa: F401  (refimpl.quant below)
import kernel_parity.refimpl.rope  # noqa: F401
from kernel_parity.conformance import dtypes as dt

WFMTS = ("f32", "q8_0", "q5_0")  # attention projections (the seed's wq_dt / wo_dt)
# W_q, W_k, W_v and W_o also (S1) in K-quants (Q8_K activations, aE % 256 == 0; W_o's h_q a_d % 256 == 0) and
# Q4_0 / Q4_1 / Q5_1 (Q8_0, Q8_1 activations)
QKV_WFMTS = (*WFMTS, "q4_k", "q6_k", "q4_0", "q4_1", "q5_1")
MLP_WFMTS = ("f32", "q8_0", "q5_0", "q4_k", "q6_k")  # the seed's MLP weight types
EPS = ("1e-6", "1e-5", "1")  # as in case ids; 1 is the large eps
THETAS = (10000, 500000, 1000000)
DISTS = {
    "normal": "x, residual, history ~ N(0, 1); W ~ N(0, 1/E) (unit-scale projections); gamma ~ 1 + N(0, 0.1)",
    "heads": "q/k rows of each head x 10^U(-0.5, 0.5), v rows and cached values of each kv head x 10^U(-2, 2)",
    "blocks": "32-lane blocks of x x 10^U(-1.5, 1.5), 32-column blocks of W x 10^U(-1, 1): block scales far apart",
    "tiny": "rows of scale 1e-3 (and an all-zero row among several): eps decides the norm",
    "rows": "row t of x (and the residual) x 10^U(-3, 3): neighbouring tokens far apart",
    "pads": "normal; Q/K/V weight rows and bias lanes [d, a_d) x 1e3, W_o's padded columns and the Q/K/V "
            "columns [E, aE) non-zero: a cache row's padding is zero only by the kernel's clearing",
}
PAD_SCALE = 1e3  # padding values a kernel must clear: far from anything a correct output holds there
ATTN_DISTS = ("normal", "heads", "blocks", "tiny", "pads")
ROW_DISTS = ("normal", "blocks", "tiny", "rows")


def block_of(fmt: str) -> int:
    return 1 if fmt == "f32" else refimpl.quant.FORMATS[fmt].block


def aligned(x: np.ndarray, width: int) -> np.ndarray:
    """(..., n) values in (..., width) with zero lanes [n, width)."""
    out = np.zeros(x.shape[:-1] + (width,))
    out[..., : x.shape[-1]] = x
    return out


def rows(rng: np.random.Generator, t: int, n: int, aw: int, dist: str) -> np.ndarray:
    """(t, aw) float64 activation rows of the distribution, lanes [n, aw) zero."""
    x = rng.standard_normal((t, n))
    if dist == "blocks":
        x *= np.repeat(10.0 ** rng.uniform(-1.5, 1.5, (t, -(-n // 32))), 32, axis=1)[:, :n]
    elif dist == "tiny":
        x[0::2] *= 1e-3
        if t > 2:
            x[t // 2] = 0.0
    elif dist == "rows":
        x *= 10.0 ** rng.uniform(-3.0, 3.0, (t, 1))
    elif dist not in ("normal", "heads", "pads"):
        raise ValueError(f"unknown distribution {dist!r}")
    return aligned(x, aw)


def gamma(rng: np.random.Generator, n: int, aw: int, gemma: int) -> np.ndarray:
    """RMSNorm weight as stored: w ~ 1 + N(0, 0.1), or Gemma's w ~ N(0, 0.1) applied as (1 + w)."""
    return dt.round_to(aligned(rng.standard_normal(n) * 0.1 + (0.0 if gemma else 1.0), aw), "fp32")


def dense(rng: np.random.Generator, n_out: int, k: int, real_in: np.ndarray, real_out: np.ndarray, dist: str,
          row_scale: np.ndarray | None = None) -> np.ndarray:
    """(n_out, k) float64 weight ~ N(0, 1 / #real inputs): zero outside the real rows and columns."""
    w = rng.standard_normal((n_out, k))
    w /= math.sqrt(max(1, int(real_in.sum())))  # in place: a models-size weight is ~1 GB
    if dist == "blocks":
        w *= np.repeat(10.0 ** rng.uniform(-1.0, 1.0, (1, -(-k // 32))), 32, axis=1)[:, :k]
    if row_scale is not None:
        w *= row_scale[:, None]
    if not real_out.all():
        w *= real_out[:, None]
    if not real_in.all():
        w *= real_in[None, :]
    return w


def _lane_rms(x: np.ndarray, n: int) -> np.ndarray:
    """(aw,) RMS over the rows of the normalised activations' lanes: each row divided by its own RMS over
    its n real lanes (what RMSNorm makes of it; 0 for an all-zero row)."""
    r = np.sqrt(np.mean(x[:, :n] ** 2, axis=1, keepdims=True))
    xn = np.divide(x, r, out=np.zeros_like(x), where=r > 0)
    return np.sqrt(np.mean(xn ** 2, axis=0))


def unit_rows(w: np.ndarray, lanes: np.ndarray, row_scale: np.ndarray, dist: str) -> np.ndarray:
    """`blocks`: each weight row rescaled so that its output over the normalised rows has the variance of
    `row_scale`^2 (the other distributions' 1 or the head's scale): the blocks keep scales orders of
    magnitude apart, the projections (and the attention logits) keep the other distributions' size."""
    if dist != "blocks":
        return w
    norm = np.sqrt(((w * lanes[None, :]) ** 2).sum(axis=1))
    return w * np.divide(row_scale, norm, out=np.zeros_like(norm), where=norm > 0)[:, None]


def padding(rng: np.random.Generator, w: np.ndarray, real_out: np.ndarray, real_in: np.ndarray,
            rows_scale: float = PAD_SCALE) -> None:
    """`pads`: fill, in place, a weight's (n_out, k) padded output rows with rows_scale N(0, 1) and its padded
    input columns (on the real rows) with N(0, 1 / #real inputs), the real columns' scale: a column shares
    its quantization blocks with real ones, whose precision a large value there would crush."""
    pad_out, pad_in = real_out == 0, real_in == 0
    if rows_scale:
        w[pad_out] = rng.standard_normal((int(pad_out.sum()), w.shape[1])) * rows_scale
    if pad_in.any():
        sub = w[~pad_out]
        sub[:, pad_in] = rng.standard_normal((sub.shape[0], int(pad_in.sum()))) / math.sqrt(max(1, int(real_in.sum())))
        w[~pad_out] = sub


def stored(fmt: str, w: np.ndarray) -> np.ndarray:
    """The weight in its storage format: float32, or GGML blocks by the golden quantizers (ggml's)."""
    w32 = w.astype(np.float32)
    return w32 if fmt == "f32" else refimpl.quant.quantize(fmt, w32)


def head_lanes(h: int, d: int, ad: int) -> np.ndarray:
    """(h * ad,) 1.0 on the real lanes [0, d) of every head, 0.0 on the padding."""
    return np.tile((np.arange(ad) < d).astype(np.float64), h)


def head_scales(rng: np.random.Generator, h: int, ad: int, lo: float, hi: float) -> np.ndarray:
    """(h,) per-head factors 10^u, u ~ U(lo, hi), and the same repeated over each head's ad lanes."""
    s = 10.0 ** rng.uniform(lo, hi, h)
    return s, np.repeat(s, ad)


def history(rng: np.random.Generator, h_kv: int, cap: int, d: int, ad: int, start: int,
            scale: np.ndarray) -> np.ndarray:
    """(h_kv, cap, ad) float32 cache: slots < start ~ N(0, 1) x the head's scale on lanes [0, d), zero
    padding lanes; slots >= start NaN."""
    c = np.full((h_kv, cap, ad), np.nan)
    c[:, :start, :] = 0.0
    c[:, :start, :d] = rng.standard_normal((h_kv, start, d)) * scale[:, None, None]
    return dt.round_to(c, "fp32")


def tables(cap: int, d: int, theta: int) -> dict[str, np.ndarray]:
    """cos, sin float32 [cap, d/2] of the angles p w_i (w_i = theta^(-2i/d)), as the seed stores them."""
    cos, sin = refimpl.rope.tables(cap, d, float(theta))
    return {"cos": cos.astype(np.float32), "sin": sin.astype(np.float32)}


def attention_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator, t: int,
                     start: int) -> dict[str, np.ndarray]:
    """Inputs of the attention blocks: T tokens at start .. start + T - 1 (decode: T = 1, squeezed by
    the caller)."""
    e, ae, hq, hkv, d = p["e"], p["e"] + p["epad"], p["hq"], p["hkv"], p["d"]
    ad, cap = d + p["dpad"], p["cap"]
    x = rows(rng, t, e, ae, dist)
    real_e = (np.arange(ae) < e).astype(np.float64)
    q_lanes, kv_lanes = head_lanes(hq, d, ad), head_lanes(hkv, d, ad)
    one_q, one_kv = np.ones(hq * ad), np.ones(hkv * ad)
    qs, ks, vs = one_q, one_kv, one_kv
    k_head, v_head = np.ones(hkv), np.ones(hkv)
    if dist == "heads":
        _, qs = head_scales(rng, hq, ad, -0.5, 0.5)
        k_head, ks = head_scales(rng, hkv, ad, -0.5, 0.5)
        v_head, vs = head_scales(rng, hkv, ad, -2.0, 2.0)
    lanes = _lane_rms(x, e)
    g = gamma(rng, e, ae, p["gemma"])  # drawn first, as before `pads`: the other distributions' inputs unchanged
    wq, wk, wv = (unit_rows(dense(rng, h * ad, ae, real_e, hl, dist, s), lanes, s, dist)
                  for h, hl, s in ((hq, q_lanes, qs), (hkv, kv_lanes, ks), (hkv, kv_lanes, vs)))
    wo = dense(rng, ae, hq * ad, q_lanes, real_e, dist)
    if dist == "pads":
        for w, hl in ((wq, q_lanes), (wk, kv_lanes), (wv, kv_lanes)):
            padding(rng, w, hl, real_e)
        padding(rng, wo, real_e, q_lanes, rows_scale=0.0)  # W_o's padded columns; its padded rows stay zero
    out = {
        "x": dt.round_to(x, dtype),
        "gamma": g,
        "wq": stored(p["wqkv"], wq),
        "wk": stored(p.get("wk") or p["wqkv"], wk),  # S1: each projection in its own format (default wqkv's)
        "wv": stored(p.get("wv") or p["wqkv"], wv),
        "wo": (np.ascontiguousarray(wo.reshape(ae, hq, ad).transpose(1, 0, 2), dtype=np.float32)  # Wo[h][aE][a_d]
               if p.get("wo_layout") == "head_major" else stored(p["wo"], wo)),
        "k_cache": history(rng, hkv, cap, d, ad, start, k_head),
        "v_cache": history(rng, hkv, cap, d, ad, start, v_head),
        **tables(cap + p.get("rope_off", 0), d, p["theta"]),  # RoPE's rows reach rope_off + the last slot
    }
    if p["bias"]:
        for name, lanes, s in (("bq", q_lanes, qs), ("bk", kv_lanes, ks), ("bv", kv_lanes, vs)):
            b = rng.standard_normal(lanes.size) * lanes * s
            if dist == "pads":
                b += rng.standard_normal(lanes.size) * (1.0 - lanes) * PAD_SCALE
            out[name] = dt.round_to(b, "fp32")
    if p.get("qkv") == "fused":  # the seed's one W_qkv / b_qkv: the same draws, the sections concatenated
        for new, names in (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv"))):
            if names[0] in out:
                out[new] = np.concatenate([out.pop(nm) for nm in names], axis=0)
    if p["obias"]:
        out["bo"] = dt.round_to(rng.standard_normal(ae) * real_e, "fp32")
    if p["residual"]:
        r = rows(rng, t, e, ae, "rows" if dist == "rows" else "normal")
        out["r"] = dt.round_to(r, dtype)
    return out


def mlp_weights(p: dict[str, Any], rng: np.random.Generator, dist: str, ae: int) -> dict[str, np.ndarray]:
    """w1 (2aI, aE) gate rows then up rows, w2 (aE, aI), in their storage formats (aI = I + ipad).

    ipad > 0 (seed audit S3): lanes [I, aI) of each half are padding the contract lets a kernel ignore
    (refimpl.blocks.mlp: act's padding is cleared), so they hold what only ignoring them neutralises: W1's
    padded rows PAD_SCALE N(0, 1) (h carries them; an act or a down projection that lets them in is off by
    orders of magnitude), W1's columns [E, aE) and W2's padded columns the real weights' scale (they multiply
    lanes a correct kernel holds at zero: the norm's padding, act's; W2's share quantization blocks with
    real columns). W2's padded output rows stay zero (out's padding is zero only through them)."""
    i, ai = p["i"], p["i"] + p.get("ipad", 0)
    real_e = (np.arange(ae) < p["e"]).astype(np.float64)
    if ai == i:
        ones = np.ones(2 * i)
        return {"w1": stored(p["w1"], dense(rng, 2 * i, ae, real_e, ones, dist)),
                "w2": stored(p["w2"], dense(rng, ae, i, np.ones(i), real_e, dist))}
    real_i = (np.arange(ai) < i).astype(np.float64)
    halves = np.tile(real_i, 2)
    w1, w2 = dense(rng, 2 * ai, ae, real_e, halves, dist), dense(rng, ae, ai, real_i, real_e, dist)
    padding(rng, w1, halves, real_e)
    padding(rng, w2, real_e, real_i, rows_scale=0.0)
    return {"w1": stored(p["w1"], w1), "w2": stored(p["w2"], w2)}


BIAS_SCALE = 2.0  # MLP biases: per lane N(0, 4), as large as the products they are added to, or larger


def mlp_biases(p: dict[str, Any], rng: np.random.Generator, ae: int) -> dict[str, np.ndarray]:
    """`bias` (seed audit S2): b1 (2aI,) = b_gate | b_up and b2 (aE,) = b_down, BIAS_SCALE N(0, 1) per lane
    (gate and up lanes different: a bias dropped, doubled or added to the other half is off by the products'
    size); b1's padded lanes PAD_SCALE N(0, 1) (h carries them, act ignores them), b2's zero."""
    if not p.get("bias", 0):
        return {}
    i, ai = p["i"], p["i"] + p.get("ipad", 0)
    real_i = np.tile((np.arange(ai) < i).astype(np.float64), 2)
    b1 = rng.standard_normal(2 * ai) * BIAS_SCALE * real_i + rng.standard_normal(2 * ai) * (1.0 - real_i) * PAD_SCALE
    b2 = rng.standard_normal(ae) * BIAS_SCALE * (np.arange(ae) < p["e"])
    return {"b1": dt.round_to(b1, "fp32"), "b2": dt.round_to(b2, "fp32")}


def mlp_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ae = p["e"] + p["epad"]
    return {"x": dt.round_to(rows(rng, p["t"], p["e"], ae, dist), dtype), "gamma": gamma(rng, p["e"], ae, p["gemma"]),
            **mlp_weights(p, rng, dist, ae), **mlp_biases(p, rng, ae)}


def head_major_scales(hq: int) -> np.ndarray:
    """(hq,) factors 0.1, 1, 10 (head h: 10^(h mod 3 - 1)) on a head-major attention output (seed audit S5):
    with T != 1 and h_q != 1 a buffer read in the other layout, a head read at another's stride or a token
    read at another's offset takes rows of another head, off by the data and by up to 100x in scale. The draws
    are the token-major case's (the rng is not called): its inputs, scaled per head and transposed."""
    return 10.0 ** (np.arange(hq) % 3 - 1.0)


def outproj_mlp_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    e, ae, hq, d = p["e"], p["e"] + p["epad"], p["hq"], p["d"]
    ad = d + p["dpad"]
    t = p["t"]
    lanes = head_lanes(hq, d, ad)
    attn = rows(rng, t, hq * ad, hq * ad, dist) * lanes  # the attention output: padded lanes zero
    real_e = (np.arange(ae) < e).astype(np.float64)
    wo = dense(rng, ae, hq * ad, lanes, real_e, dist)
    if p.get("attn_layout", "token_major") == "head_major":  # the seed's [h_q, T, a_d] (S5), heads scaled
        attn = attn * np.repeat(head_major_scales(hq), ad)
        attn = np.ascontiguousarray(attn.reshape(t, hq, ad).transpose(1, 0, 2))
    out = {"attn": dt.round_to(attn, dtype), "residual": dt.round_to(rows(rng, t, e, ae, dist), dtype)}
    if p["wo_layout"] == "head_major":  # Wo[h][aE][ad]: the same W, per head
        out["wo"] = wo.reshape(ae, hq, ad).transpose(1, 0, 2).astype(np.float32)
    else:
        out["wo"] = stored(p["wo"], wo)
    if p["obias"]:
        out["bo"] = dt.round_to(rng.standard_normal(ae) * real_e, "fp32")
    out["gamma"] = gamma(rng, e, ae, p["gemma"])
    out.update(mlp_weights(p, rng, dist, ae))
    out.update(mlp_biases(p, rng, ae))
    return out


def layer_inputs(p: dict[str, Any], dtype: str, dist: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The whole layer's (S9): the prefill attention block's inputs (its residual is x: no `r`), then the MLP
    block's gamma2, w1, w2 drawn after them."""
    ae = p["e"] + p["epad"]
    out = attention_inputs({**p, "residual": 0}, dtype, dist, rng, p["t"], p["start"])
    out["gamma2"] = gamma(rng, p["e"], ae, p["gemma"])
    out.update(mlp_weights(p, rng, dist, ae))
    return out
