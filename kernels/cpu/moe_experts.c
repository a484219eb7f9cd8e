/* moe_experts.c — the fused mixture-of-experts layer over routed tokens, one token at a time.
 *
 *   out[t] = sum_j weights[t, j] W2[e] act_e(x[t])  +  sum_s Ws2[s] act_s(x[t]),   e = ids[t, j]
 *   act(x)  = rnd(silu(G x) * (U x)),  G = W13[e][0:F], U = W13[e][F:2F]   (silu(g) = g / (1 + exp(-g)))
 *
 * rnd: act rounded to the activation dtype `dt` before the down projection (the production cast the golden
 * declares, refimpl/moe_experts.py); fp32: no rounding. x and out are C-contiguous (T, D) arrays of dtype `dt`
 * (KP_F32 / KP_F16 / KP_BF16), widened exactly on load; ids (T, k) int32 in [0, E) (the wrapper checks),
 * weights (T, k) float32. Each weight set (w13 (E, 2F, D), w2 (E, D, F), ws13, ws2) is a `wmat`: dense, C-contiguous
 * in `dt`, or GPTQ v1 int4 (refimpl/quant_fp.py int4_quantize per expert: qweight (E, K/8, N) int32 packed along
 * K, qzeros (E, K/g, N/8) int32 packed along N holding zero - 1, scales (E, K/g, N) fp16;
 * W[n][i] = s[i / g][n] (q(i, n) - z(i / g, n)), exact in float32: 11 + 5 bits), or block FP8 (DeepSeek-V3:
 * codes (E, N, K) float8_e4m3fn, scales (E, ceil(N/128), ceil(K/128)) fp32; W[n][i] = code x its 128 x 128 block's
 * scale, dequantized in float32, one rounding), or GGML blocks (llama.cpp's MoE GGUFs: q8_0 / q4_0 / q4_k / q6_k, ggml
 * type id `gt`; (E, N, K / QK * nbytes) uint8, each row K / QK consecutive blocks): each weight row dequantized to
 * float32 when it is read, by gemm_bwd.h's lb_row_f32 (quant.h's decoder: ggml's dequantize_row_*, one rounding of
 * the exact value), w-only: x and act stay in the activation dtype.
 * a8 (w8a8, block FP8 only): x and act quantized per token per 128 columns before each GEMM (refimpl/moe_experts.py):
 * s = amax / 448.0f (IEEE float32 division), code = e4m3(RNE(saturate(v / s))) (the division, as the golden), read
 * back as code x s in float32; act is rounded to `dt` first, then quantized.
 * Arithmetic is float32: each dot product a float32 sum in index order, the routed weight multiplied into the
 * slot's output, the slots and shared experts summed into a float32 row accumulator in order (j = 0 .. k - 1,
 * then s = 0 .. S - 1), out rounded once. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the per-call scratch (max(F, Fs) + 2 D + 2 max(D, F, Fs) floats) is not had.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "gemm_bwd.h"   /* lb_row_f32, lb_row_bytes: a GGML row to float32 (quant.h's decoder) */

#define FP8_BLOCK 128

typedef struct {
    const void *dense;      /* (E, N, K) of dtype dt, or NULL for int4 / fp8 */
    const int32_t *qw, *qz; /* int4: (E, K/8, N), (E, K/g, N/8) */
    const uint16_t *sc;     /* int4: (E, K/g, N) fp16 */
    const uint8_t *f8;      /* fp8: codes (E, N, K) e4m3fn, or NULL */
    const float *bs;        /* fp8: block scales (E, ceil(N/128), ceil(K/128)) */
    int64_t n, kdim, g, ne; /* N rows (outputs), K columns (inputs), the group, the experts */
    int a8;                 /* w8a8: this matrix's input (act, for W2) quantized per 128 columns first */
    const uint8_t *gq;      /* GGML blocks (E, N, K / QK * nbytes), or NULL */
    int gt;                 /* their ggml type id */
    float *rows;            /* GGML: row scratch of 2 max(D, F, Fs) floats (the call's) */
} wmat;

/* Row `row` of expert e of a GGML weight, dequantized to float32 into buf (kdim floats) */
KP_INLINE const float *grow(const wmat *m, int64_t e, int64_t row, float *buf) {
    const int64_t rb = lb_row_bytes(m->gt, m->kdim);
    lb_row_f32(m->gt, m->gq + (e * m->n + row) * rb, m->kdim, buf);
    return buf;
}

static float E4M3[256];
static int e4m3_ready = 0;

static void e4m3_table(void) {
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 0xF, m = c & 7;  /* e4m3fn: bias 7, no inf, 0x7F / 0xFF NaN */
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        if ((c & 0x7F) == 0x7F) v = NAN;
        E4M3[c] = (c >> 7) ? -v : v;
    }
    e4m3_ready = 1;
}

/* v rounded to nearest even on the e4m3fn grid, |v| saturated to 448 first (__NV_SATFINITE) */
static float e4m3_round(float v) {
    float a = fabsf(v);
    if (a > 448.0f) a = 448.0f;
    int e2;
    frexpf(a, &e2);
    int e = a == 0.0f ? -6 : e2 - 1;
    if (e < -6) e = -6;                       /* subnormal: the smallest normal's quantum 2^-9 */
    return copysignf(ldexpf(nearbyintf(ldexpf(a, 3 - e)), e - 3), v);
}

/* v[0:len] replaced by its per-128 group e4m3 quantization, read back as code x s in float32 */
static void group_quant(float *v, int64_t len) {
    for (int64_t g0 = 0; g0 < len; g0 += FP8_BLOCK) {
        const int64_t g1 = g0 + FP8_BLOCK < len ? g0 + FP8_BLOCK : len;
        float amax = 0.0f;
        for (int64_t i = g0; i < g1; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float s = amax / 448.0f;
        for (int64_t i = g0; i < g1; i++) v[i] = s == 0.0f ? 0.0f : e4m3_round(v[i] / s) * s;
    }
}

/* W[e][row][col] widened to float32 */
KP_INLINE float wget(const wmat *m, int64_t e, int64_t row, int64_t col, int dt) {
    if (m->dense) return kp_load(m->dense, (e * m->n + row) * m->kdim + col, dt);
    if (m->f8) {
        const int64_t nbn = (m->n + FP8_BLOCK - 1) / FP8_BLOCK, nbk = (m->kdim + FP8_BLOCK - 1) / FP8_BLOCK;
        const float s = m->bs[(e * nbn + row / FP8_BLOCK) * nbk + col / FP8_BLOCK];
        return E4M3[m->f8[(e * m->n + row) * m->kdim + col]] * s;
    }
    const int64_t n = m->n, grp = col / m->g, ng = m->kdim / m->g;
    const int32_t word = m->qw[(e * (m->kdim / 8) + col / 8) * n + row];
    const int32_t q = (word >> (4 * (col % 8))) & 15;
    const int32_t zw = m->qz[(e * ng + grp) * (n / 8) + row / 8];
    const int32_t z = ((zw >> (4 * (row % 8))) & 15) + 1;   /* v1 stores zero - 1 */
    const float s = kp_f16_to_f32(m->sc[(e * ng + grp) * n + row]);
    return s * (float)(q - z);
}

/* acc[0:D] += wt * W2[e] @ act(x), W13[e] (2F, D), W2[e] (D, F); x widened (and under a8 quantized) to float32;
 * act scratch of F floats (GGML weights' rows dequantized into their `rows` scratch) */
static void expert_mlp(const float *x, const wmat *w13, const wmat *w2, int64_t e, int64_t D, int64_t F, int dt,
                       float wt, float *act, float *acc) {
    for (int64_t f = 0; f < F; f++) {
        float g = 0.0f, u = 0.0f;
        if (w13->gq) {
            const float *rg = grow(w13, e, f, w13->rows), *ru = grow(w13, e, F + f, w13->rows + D);
            for (int64_t i = 0; i < D; i++) {
                g += x[i] * rg[i];
                u += x[i] * ru[i];
            }
        } else {
            for (int64_t i = 0; i < D; i++) {
                const float xi = x[i];
                g += xi * wget(w13, e, f, i, dt);
                u += xi * wget(w13, e, F + f, i, dt);
            }
        }
        const float a = g / (1.0f + expf(-g)) * u;
        uint16_t h;
        act[f] = dt == KP_F32 ? a : (kp_store(&h, 0, a, dt), kp_load(&h, 0, dt));
    }
    if (w2->a8) group_quant(act, F);
    for (int64_t d = 0; d < D; d++) {
        float y = 0.0f;
        if (w2->gq) {
            const float *r = grow(w2, e, d, w2->rows);
            for (int64_t f = 0; f < F; f++) y += r[f] * act[f];
        } else {
            for (int64_t f = 0; f < F; f++) y += wget(w2, e, d, f, dt) * act[f];
        }
        acc[d] += wt * y;
    }
}

static wmat make(const void *dense, const int32_t *qw, const int32_t *qz, const uint16_t *sc, const uint8_t *f8,
                 const float *bs, int64_t n, int64_t kdim, int64_t g, int64_t ne, int a8, const uint8_t *gq, int gt,
                 float *rows) {
    wmat m = {dense, qw, qz, sc, f8, bs, n, kdim, g, ne, a8, gq, gt, rows};
    return m;
}

/* w13 / w2 / ws13 / ws2: dense pointer (or NULL) then qweight, qzeros, scales (int4, or NULL); g the int4 group;
 * f8 / bs: each weight's fp8 codes and block scales (or NULL); a8: w8a8; gq: each weight's GGML blocks (or NULL),
 * gt their ggml type id (the wrapper checks it is one of q8_0, q4_0, q4_k, q6_k and D, F whole blocks) */
KP_EXPORT int moe_experts_kernel(const void *x, const int32_t *ids, const float *weights,
                                 const void *w13, const int32_t *w13_qw, const int32_t *w13_qz, const uint16_t *w13_sc,
                                 const void *w2, const int32_t *w2_qw, const int32_t *w2_qz, const uint16_t *w2_sc,
                                 const void *ws13, const int32_t *ws13_qw, const int32_t *ws13_qz,
                                 const uint16_t *ws13_sc, const void *ws2, const int32_t *ws2_qw,
                                 const int32_t *ws2_qz, const uint16_t *ws2_sc, int64_t g,
                                 const uint8_t *w13_f8, const float *w13_bs, const uint8_t *w2_f8, const float *w2_bs,
                                 const uint8_t *ws13_f8, const float *ws13_bs, const uint8_t *ws2_f8,
                                 const float *ws2_bs, int a8,
                                 const uint8_t *w13_gq, const uint8_t *w2_gq, const uint8_t *ws13_gq,
                                 const uint8_t *ws2_gq, int gt,
                                 int64_t T, int64_t D, int64_t E, int64_t F, int64_t k, int64_t S, int64_t Fs, int dt,
                                 void *out) {
    if (!e4m3_ready) e4m3_table();
    const int64_t fmax = F > Fs ? F : Fs;
    const int64_t rmax = D > fmax ? D : fmax;
    float *act = malloc((size_t)(fmax + 2 * D + 2 * rmax) * sizeof(float));
    if (!act) return KP_ERR_NOMEM;
    float *acc = act + fmax, *xf = acc + D, *rows = xf + D;
    const int64_t sz = kp_itemsize(dt);
    const wmat m13 = make(w13, w13_qw, w13_qz, w13_sc, w13_f8, w13_bs, 2 * F, D, g, E, a8, w13_gq, gt, rows);
    const wmat m2 = make(w2, w2_qw, w2_qz, w2_sc, w2_f8, w2_bs, D, F, g, E, a8, w2_gq, gt, rows);
    const wmat s13 = make(ws13, ws13_qw, ws13_qz, ws13_sc, ws13_f8, ws13_bs, 2 * Fs, D, g, S, a8, ws13_gq, gt, rows);
    const wmat s2 = make(ws2, ws2_qw, ws2_qz, ws2_sc, ws2_f8, ws2_bs, D, Fs, g, S, a8, ws2_gq, gt, rows);
    for (int64_t t = 0; t < T; t++) {
        const char *xrow = (const char *)x + t * D * sz;
        for (int64_t d = 0; d < D; d++) xf[d] = kp_load(xrow, d, dt);
        if (a8) group_quant(xf, D);  /* w8a8: x's codes, read back as code x s */
        const float *xt = xf;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = ids[t * k + j];
            expert_mlp(xt, &m13, &m2, e, D, F, dt, weights[t * k + j], act, acc);
        }
        for (int64_t s = 0; s < S; s++)
            expert_mlp(xt, &s13, &s2, s, D, Fs, dt, 1.0f, act, acc);
        for (int64_t d = 0; d < D; d++) kp_store((char *)out + t * D * sz, d, acc[d], dt);
    }
    free(act);
    return KP_OK;
}
