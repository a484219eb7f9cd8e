/* blocks_bwd.c — the whole-layer backward of C-Kernel-Engine's fused blocks on the CPU, fp32: one C stage
 * kernel per forward stage, run in reverse order (the seed's backward set).
 *
 *   mlp:        out = x + down,  down = act W2^T (+ b2),  act = silu(gate) up,  (gate | up) = h = norm W1^T (+ b1),
 *               norm = RMSNorm(x) g;  h and act rows of aI = I + ipad lanes per half, act's padding cleared
 *     bwd_fc2       dact = dout W2 (lanes [I, aI) zero),  dW2 = dout^T act,  d_b2 = sum_t dout
 *     bwd_swiglu    dgate = dact up silu'(gate),      dup = dact silu(gate)  (padding lanes zero)
 *     bwd_fc1       dnorm = dh W1,                    dW1 = dh^T norm,  d_b1 = sum_t dh
 *     bwd_rmsnorm   dx = rstd (g dnorm - x rstd^2 mean(x g dnorm)),  dgamma = sum_t dnorm x rstd
 *     bwd_residual  dx += dout
 *   attention (prefill, T tokens from `start` over a cache with history; the history is a constant):
 *     bwd_residual  dr = dout
 *     bwd_outproj   dattn = dout W_o,  dW_o = dout^T attn,  d_bo = sum_t dout
 *     bwd_attention causal GQA over keys 0 .. start + t with a materialised scores buffer per kv head:
 *                   P = softmax(scale q k^T) recomputed, dP = dO V^T, D = rowsum(P dP) (= rowsum(dO O), from
 *                   the recomputed P: every row of dS sums to zero, as the exact one), dS = P (dP - D),
 *                   dq = scale dS K, dk = scale dS^T Q, dv = P^T dO (the new keys' rows only, summed over
 *                   the group's query heads; lanes [d, a_d) zero: the cache write cleared them)
 *     bwd_rope      dq, dk = the rotary pairs of dq_rope, dk_rope rotated by the negated angle
 *     bwd_qkv       dnorm = dq Wq + dk Wk + dv Wv,  dW = dY^T norm,  d_bq, d_bk, d_bv = sum_t dY (qkv_fused: the
 *                   row sections of one W_qkv, dW_qkv and db_qkv: q heads, then k, then v; otherwise Wq, Wk, Wv
 *                   each in its own format, wqkv_type, wk_type, wv_type: S1)
 *     bwd_rmsnorm   dx, dgamma as above
 *   layer (S9): the MLP's on h1 (its dx is dh1), the attention's for dout = dh1, then dx += dh1; with `scores`
 *               (the forward's P [hq][t][ctx]) bwd_attention reads P instead of recomputing it
 * Saved activations (the forward's, fp32): norm, rstd, h, act (mlp); norm, rstd, q_rope, k_rope, v, attn
 * (attention). Conventions as blocks.c (OPS.md, layers): aligned rows (statistics over the n real lanes,
 * padding lanes of dx and dgamma zero), aligned heads, head-major caches (h_kv, cap, a_d), query head h
 * reading kv head h / (h_q / h_kv), RoPE pairs (i, i + d/2) or (2i, 2i + 1), W1's gate rows first.
 * Weights: fp32, or GGML blocks dequantized to fp32 (their L1 meaning; gemm_bwd.h), which have no gradient.
 *
 * Precision: fp32 storage and fp32 arithmetic throughout (expf for the recomputed softmax), no FMA; every
 * sum in its reduction index's order (tokens for the weight gradients, keys for dq, query rows for dk and
 * dv). The projections' backward is gemm_bwd.h's (one home with the gemm family's gemm_nt_backward).
 * Single-threaded; KP_MULTIVERSION re-vectorises the axpy loops per ISA without changing a bit.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "gemm_bwd.h"

enum { STYLE_HALF = 0, STYLE_INTERLEAVED = 1 };

typedef struct {                   /* mirrored by kernels/cpu/blocks_bwd.py (_Params) */
    int64_t t, e, ae, hq, hkv, d, ad, cap, start, inter, max_seq;
    int64_t style, gemma, wqkv_type, wo_type, w1_type, w2_type;
    int64_t rope_off, qkv_fused;   /* attention: RoPE position - cache slot; wq is W_qkv (dwq dW_qkv, dbq db_qkv) */
    int64_t wo_heads;              /* attention: W_o (and dwo) fp32 per head [hq][aE][a_d] */
    double eps;
    const float *x, *gamma, *dout;                      /* (t, ae), (ae,), (t, ae) */
    const void *wq, *wk, *wv, *wo, *w1, *w2;
    const float *k_cache, *v_cache, *cos, *sin;         /* (hkv, cap, ad) history; (max_seq, d / 2) */
    const float *norm, *rstd, *q_rope, *k_rope, *v, *attn, *h, *act;   /* saved activations */
    float *dattn, *dq_rope, *dk_rope, *dv, *dq, *dk, *dnorm, *dact, *dh;   /* stage gradients */
    float *dx, *dgamma, *dwq, *dwk, *dwv, *dwo, *dw1, *dw2, *dbq, *dbk, *dbv, *dbo, *dr;   /* or NULL */
    float *db1, *db2;              /* the MLP's bias gradients (2 aI,), (ae,), or NULL */
    int64_t ipad;                  /* the MLP's padding lanes per half: aI = inter + ipad */
    int64_t wk_type, wv_type;      /* attention: W_k's and W_v's own formats (S1: wq's is wqkv_type) */
    const float *scores;           /* attention: the forward's P [hq][t][ctx] (S9), read instead of recomputed; or NULL */
    int64_t ctx;                   /* its row length (>= start + t; lanes past the live slots unread) */
} bwd_params;

/* ---- residual, RMSNorm, SwiGLU, RoPE ------------------------------------------------------------------ */

/* dst = dst + src (dst = src when `copy`), n elements. */
static void bwd_residual(float *dst, const float *src, int64_t n, int copy) {
    for (int64_t i = 0; i < n; i++) dst[i] = copy ? src[i] : dst[i] + src[i];
}

/* RMSNorm over the n real lanes of each of t rows of aw lanes: dx = rstd (g dy - x rstd^2 mean(x g dy)),
 * dgamma += dy x rstd (rows in order), padding lanes zero. g = gamma or 1 + gamma. */
static void bwd_rmsnorm(const float *x, const float *gamma, const float *rstd, const float *dy, int64_t t, int64_t n,
                        int64_t aw, int gemma, float *dx, float *dgamma) {
    if (dgamma) memset(dgamma, 0, sizeof(float) * (size_t)aw);
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * aw, *dyr = dy + r * aw;
        const float rs = rstd[r];
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += xr[i] * ((gemma ? 1.0f + gamma[i] : gamma[i]) * dyr[i]);
        const float c = rs * rs * (s / (float)n);
        float *dxr = dx + r * aw;
        for (int64_t i = 0; i < n; i++) dxr[i] = rs * ((gemma ? 1.0f + gamma[i] : gamma[i]) * dyr[i] - xr[i] * c);
        for (int64_t i = n; i < aw; i++) dxr[i] = 0.0f;
        if (dgamma)
            for (int64_t i = 0; i < n; i++) dgamma[i] += dyr[i] * xr[i] * rs;
    }
}

/* SwiGLU of the gate-first h (t, 2 ai), I = inter real lanes per half: dgate = dact up silu'(gate),
 * dup = dact silu(gate); silu'(g) = s (1 + g (1 - s)), s = sigmoid(g) from exp(-|g|) (no overflow); the
 * padding lanes [I, ai) of dh zero (act's were cleared: no gradient reaches them). */
static void bwd_swiglu(const float *h, const float *dact, int64_t t, int64_t inter, int64_t ai, float *dh) {
    for (int64_t r = 0; r < t; r++) {
        for (int64_t i = 0; i < inter; i++) {
            const float g = h[r * 2 * ai + i], u = h[r * 2 * ai + ai + i], da = dact[r * ai + i];
            const float e = expf(-fabsf(g)), s = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            dh[r * 2 * ai + i] = da * u * (s * (1.0f + g * (1.0f - s)));
            dh[r * 2 * ai + ai + i] = da * (g * s);
        }
        for (int64_t i = inter; i < ai; i++) dh[r * 2 * ai + i] = dh[r * 2 * ai + ai + i] = 0.0f;
    }
}

/* RoPE's transpose on the first d lanes of `rows` head rows of ad lanes at position pos: each pair (a, b)
 * -> (a cos + b sin, b cos - a sin); lanes [d, ad) copied. */
static void bwd_rope(const float *dy, int64_t rows, int64_t ad, int64_t d, const float *cos_t, const float *sin_t,
                     int64_t pos, int style, float *dx) {
    const int64_t half = d / 2;
    const float *c = cos_t + pos * half, *s = sin_t + pos * half;
    for (int64_t r = 0; r < rows; r++) {
        const float *in = dy + r * ad;
        float *out = dx + r * ad;
        for (int64_t i = d; i < ad; i++) out[i] = in[i];
        for (int64_t i = 0; i < half; i++) {
            const int64_t ia = style == STYLE_INTERLEAVED ? 2 * i : i, ib = style == STYLE_INTERLEAVED ? 2 * i + 1 : i + half;
            const float a = in[ia], b = in[ib];
            out[ia] = a * c[i] + b * s[i];
            out[ib] = b * c[i] - a * s[i];
        }
    }
}

/* ---- projections: the seed's out-projection / QKV / fc1 / fc2 backward (gemm_bwd.h) --------------------- */

/* dX (+)= dY W;  dW = dY^T X;  db = sum_t dY (dW, db NULL when not wanted). */
KP_INLINE int bwd_linear(int type, const void *w, const float *x, const float *dy, int64_t t, int64_t n, int64_t k,
                         float *dxo, int accumulate, float *dw, float *db) {
    int st = lb_backward_dx(type, w, lb_row_bytes(type, k), dy, n, dxo, k, t, n, k, accumulate);
    if (st == KP_OK) lb_backward_dw(x, k, dy, n, dw, k, db, t, n, k);
    return st;
}

/* ---- attention ------------------------------------------------------------------------------------------- */

KP_INLINE float dot_f(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The causal GQA attention backward of kv head g: rows r = (token r / G, head g G + r % G), keys j < start +
 * token + 1. P and dS of all the group's rows are materialised (two R x L buffers; masked entries 0). */
KP_INLINE void bwd_attention_group(const bwd_params *P, int64_t g, float *kb, float *vb, float *sp, float *sd) {
    const int64_t T = P->t, G = P->hq / P->hkv, R = T * G, L = P->start + T, ad = P->ad, d = P->d;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t j = 0; j < L; j++) {   /* K, V rows: the history from the cache, the chunk's with padding cleared */
        float *kd = kb + j * ad, *vd = vb + j * ad;
        if (j < P->start) {
            memcpy(kd, P->k_cache + (g * P->cap + j) * ad, sizeof(float) * (size_t)ad);
            memcpy(vd, P->v_cache + (g * P->cap + j) * ad, sizeof(float) * (size_t)ad);
        } else {
            const int64_t src = ((j - P->start) * P->hkv + g) * ad;
            for (int64_t i = 0; i < ad; i++) {
                kd[i] = i < d ? P->k_rope[src + i] : 0.0f;
                vd[i] = i < d ? P->v[src + i] : 0.0f;
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {   /* P recomputed (or read), dS = P (dP - D), dq = scale dS K (keys in order) */
        const int64_t tok = r / G, h = g * G + r % G, live = P->start + tok + 1, row = (tok * P->hq + h) * ad;
        const float *q = P->q_rope + row, *dO = P->dattn + row;
        float *p = sp + r * L, *ds = sd + r * L, mx = -INFINITY, sum = 0.0f;
        if (P->scores) {   /* the forward's saved P (S9): row (h, tok) of [hq][t][ctx] */
            const float *saved = P->scores + (h * T + tok) * P->ctx;
            for (int64_t j = 0; j < live; j++) p[j] = saved[j];
        } else {
            for (int64_t j = 0; j < live; j++) {
                p[j] = scale * dot_f(q, kb + j * ad, ad);
                mx = p[j] > mx ? p[j] : mx;
            }
            for (int64_t j = 0; j < live; j++) {
                p[j] = expf(p[j] - mx);
                sum += p[j];
            }
            for (int64_t j = 0; j < live; j++) p[j] /= sum;
        }
        float dd = 0.0f;   /* D = sum_j P dP (= rowsum(dO O)) from this P: each row of dS then sums to 0 */
        for (int64_t j = 0; j < live; j++) {
            ds[j] = dot_f(dO, vb + j * ad, ad);
            dd += p[j] * ds[j];
        }
        for (int64_t j = 0; j < live; j++) ds[j] = p[j] * (ds[j] - dd);
        for (int64_t j = live; j < L; j++) p[j] = ds[j] = 0.0f;
        float *dq = P->dq_rope + row;
        memset(dq, 0, sizeof(float) * (size_t)ad);
        for (int64_t j = 0; j < live; j++)
            for (int64_t i = 0; i < ad; i++) dq[i] += ds[j] * kb[j * ad + i];
        for (int64_t i = 0; i < ad; i++) dq[i] *= scale;
    }
    for (int64_t j = P->start; j < L; j++) {   /* the new keys: dk = scale dS^T Q, dv = P^T dO (rows in order) */
        const int64_t slot = ((j - P->start) * P->hkv + g) * ad;
        float *dk = P->dk_rope + slot, *dv = P->dv + slot;
        memset(dk, 0, sizeof(float) * (size_t)ad);   /* lanes [d, a_d): zero, the write cleared them */
        memset(dv, 0, sizeof(float) * (size_t)ad);
        for (int64_t r = (j - P->start) * G; r < R; r++) {   /* the rows of tokens >= j - start see key j */
            const int64_t row = ((r / G) * P->hq + g * G + r % G) * ad;
            const float ds = sd[r * L + j], pj = sp[r * L + j], *q = P->q_rope + row, *dO = P->dattn + row;
            for (int64_t i = 0; i < d; i++) {
                dk[i] += ds * q[i];
                dv[i] += pj * dO[i];
            }
        }
        for (int64_t i = 0; i < d; i++) dk[i] *= scale;
    }
}

static int bwd_attention(const bwd_params *P) {
    const int64_t L = P->start + P->t, R = P->t * (P->hq / P->hkv), ad = P->ad;
    float *buf = malloc(sizeof(float) * (size_t)(2 * L * ad + 2 * R * L));
    if (!buf) return KP_ERR_NOMEM;
    for (int64_t g = 0; g < P->hkv; g++)
        bwd_attention_group(P, g, buf, buf + L * ad, buf + 2 * L * ad, buf + 2 * L * ad + R * L);
    free(buf);
    return KP_OK;
}

/* ---- the whole layers -------------------------------------------------------------------------------------- */

KP_INLINE int blocks_mlp_backward_impl(const bwd_params *P) {
    const int64_t T = P->t, ae = P->ae, I = P->inter, aI = P->inter + P->ipad;
    int st = bwd_linear((int)P->w2_type, P->w2, P->act, P->dout, T, ae, aI, P->dact, 0, P->dw2, P->db2);   /* fc2 */
    if (st != KP_OK) return st;
    for (int64_t t = 0; t < T; t++)   /* act's padding lanes were cleared: their gradient is zero */
        for (int64_t i = I; i < aI; i++) P->dact[t * aI + i] = 0.0f;
    bwd_swiglu(P->h, P->dact, T, I, aI, P->dh);
    st = bwd_linear((int)P->w1_type, P->w1, P->norm, P->dh, T, 2 * aI, ae, P->dnorm, 0, P->dw1, P->db1);   /* fc1 */
    if (st != KP_OK) return st;
    bwd_rmsnorm(P->x, P->gamma, P->rstd, P->dnorm, T, P->e, ae, (int)P->gemma, P->dx, P->dgamma);
    bwd_residual(P->dx, P->dout, T * ae, 0);
    return KP_OK;
}

KP_MULTIVERSION(blocks_mlp_backward, (const bwd_params *P), (P))

KP_INLINE int blocks_attention_prefill_backward_impl(const bwd_params *P) {
    const int64_t T = P->t, ae = P->ae, hq = P->hq, hkv = P->hkv, ad = P->ad;
    if (P->dr) bwd_residual(P->dr, P->dout, T * ae, 1);
    int st = KP_OK;
    if (P->wo_heads)   /* Wo[h][aE][a_d]: dattn_h = dout Wo[h], dWo[h] = dout^T attn_h, d_bo once */
        for (int64_t h = 0; h < hq && st == KP_OK; h++) {
            st = lb_backward_dx(QT_F32, (const float *)P->wo + h * ae * ad, 4 * ad, P->dout, ae, P->dattn + h * ad,
                                hq * ad, T, ae, ad, 0);
            if (st == KP_OK)
                lb_backward_dw(P->attn + h * ad, hq * ad, P->dout, ae, P->dwo ? P->dwo + h * ae * ad : NULL, ad,
                               h == 0 ? P->dbo : NULL, T, ae, ad);
        }
    else
        st = bwd_linear((int)P->wo_type, P->wo, P->attn, P->dout, T, ae, hq * ad, P->dattn, 0, P->dwo, P->dbo);
    if (st == KP_OK) st = bwd_attention(P);
    if (st != KP_OK) return st;
    for (int64_t t = 0; t < T; t++) {
        const int64_t pos = P->rope_off + P->start + t;   /* the forward's RoPE position; the slot is start + t */
        bwd_rope(P->dq_rope + t * hq * ad, hq, ad, P->d, P->cos, P->sin, pos, (int)P->style, P->dq + t * hq * ad);
        bwd_rope(P->dk_rope + t * hkv * ad, hkv, ad, P->d, P->cos, P->sin, pos, (int)P->style, P->dk + t * hkv * ad);
    }
    const int type = (int)P->wqkv_type;   /* QKV: three projections' dX summed into dnorm */
    const int ty[3] = {type, P->qkv_fused ? type : (int)P->wk_type,   /* each its own format (S1) */
                       P->qkv_fused ? type : (int)P->wv_type};
    const void *w[3] = {P->wq, P->wk, P->wv};
    float *dw[3] = {P->dwq, P->dwk, P->dwv}, *db[3] = {P->dbq, P->dbk, P->dbv};
    if (P->qkv_fused) {   /* the seed's one W_qkv (and dW_qkv, db_qkv): rows of the q heads, then k, then v */
        const int64_t off[3] = {0, hq * ad, (hq + hkv) * ad};
        for (int i = 0; i < 3; i++) {
            w[i] = (const uint8_t *)P->wq + off[i] * lb_row_bytes(type, ae);
            dw[i] = P->dwq ? P->dwq + off[i] * ae : NULL;
            db[i] = P->dbq ? P->dbq + off[i] : NULL;
        }
    }
    st = bwd_linear(ty[0], w[0], P->norm, P->dq, T, hq * ad, ae, P->dnorm, 0, dw[0], db[0]);
    if (st == KP_OK) st = bwd_linear(ty[1], w[1], P->norm, P->dk, T, hkv * ad, ae, P->dnorm, 1, dw[1], db[1]);
    if (st == KP_OK) st = bwd_linear(ty[2], w[2], P->norm, P->dv, T, hkv * ad, ae, P->dnorm, 1, dw[2], db[2]);
    if (st != KP_OK) return st;
    bwd_rmsnorm(P->x, P->gamma, P->rstd, P->dnorm, T, P->e, ae, (int)P->gemma, P->dx, P->dgamma);
    return KP_OK;
}

KP_MULTIVERSION(blocks_attention_prefill_backward, (const bwd_params *P), (P))

/* The whole layer (S9): the MLP block's backward (M: its x is h1, its dx dh1), then the attention block's for
 * A->dout = M->dx (dh1), then the attention's residual: dx += dh1. A has no dr (its residual is x itself). */
KP_EXPORT int blocks_layer_backward(const bwd_params *A, const bwd_params *M) {
    if (A->dout != M->dx || A->dr) return KP_ERR_SHAPE;
    int st = blocks_mlp_backward(M);
    if (st == KP_OK) st = blocks_attention_prefill_backward(A);
    if (st == KP_OK) bwd_residual(A->dx, M->dx, A->t * A->ae, 0);
    return st;
}
