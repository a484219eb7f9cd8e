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
 * W[n][i] = s[i / g][n] (q(i, n) - z(i / g, n)), exact in float32: 11 + 5 bits).
 * Arithmetic is float32: each dot product a float32 sum in index order, the routed weight multiplied into the
 * slot's output, the slots and shared experts summed into a float32 row accumulator in order (j = 0 .. k - 1,
 * then s = 0 .. S - 1), out rounded once. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the per-call scratch (max(F, Fs) + D floats) is not had.
 */
#include <stdlib.h>

#include "common.h"

typedef struct {
    const void *dense;      /* (E, N, K) of dtype dt, or NULL for int4 */
    const int32_t *qw, *qz; /* int4: (E, K/8, N), (E, K/g, N/8) */
    const uint16_t *sc;     /* int4: (E, K/g, N) fp16 */
    int64_t n, kdim, g, ne; /* N rows (outputs), K columns (inputs), the group, the experts */
} wmat;

/* W[e][row][col] widened to float32 */
KP_INLINE float wget(const wmat *m, int64_t e, int64_t row, int64_t col, int dt) {
    if (m->dense) return kp_load(m->dense, (e * m->n + row) * m->kdim + col, dt);
    const int64_t n = m->n, grp = col / m->g, ng = m->kdim / m->g;
    const int32_t word = m->qw[(e * (m->kdim / 8) + col / 8) * n + row];
    const int32_t q = (word >> (4 * (col % 8))) & 15;
    const int32_t zw = m->qz[(e * ng + grp) * (n / 8) + row / 8];
    const int32_t z = ((zw >> (4 * (row % 8))) & 15) + 1;   /* v1 stores zero - 1 */
    const float s = kp_f16_to_f32(m->sc[(e * ng + grp) * n + row]);
    return s * (float)(q - z);
}

/* acc[0:D] += wt * W2[e] @ act(x), W13[e] (2F, D), W2[e] (D, F); act scratch of F floats */
static void expert_mlp(const void *x, const wmat *w13, const wmat *w2, int64_t e, int64_t D, int64_t F, int dt,
                       float wt, float *act, float *acc) {
    for (int64_t f = 0; f < F; f++) {
        float g = 0.0f, u = 0.0f;
        for (int64_t i = 0; i < D; i++) {
            const float xi = kp_load(x, i, dt);
            g += xi * wget(w13, e, f, i, dt);
            u += xi * wget(w13, e, F + f, i, dt);
        }
        const float a = g / (1.0f + expf(-g)) * u;
        uint16_t h;
        act[f] = dt == KP_F32 ? a : (kp_store(&h, 0, a, dt), kp_load(&h, 0, dt));
    }
    for (int64_t d = 0; d < D; d++) {
        float y = 0.0f;
        for (int64_t f = 0; f < F; f++) y += wget(w2, e, d, f, dt) * act[f];
        acc[d] += wt * y;
    }
}

static wmat make(const void *dense, const int32_t *qw, const int32_t *qz, const uint16_t *sc, int64_t n, int64_t kdim,
                 int64_t g, int64_t ne) {
    wmat m = {dense, qw, qz, sc, n, kdim, g, ne};
    return m;
}

/* w13 / w2 / ws13 / ws2: dense pointer (or NULL) then qweight, qzeros, scales (int4, or NULL); g the int4 group */
KP_EXPORT int moe_experts_kernel(const void *x, const int32_t *ids, const float *weights,
                                 const void *w13, const int32_t *w13_qw, const int32_t *w13_qz, const uint16_t *w13_sc,
                                 const void *w2, const int32_t *w2_qw, const int32_t *w2_qz, const uint16_t *w2_sc,
                                 const void *ws13, const int32_t *ws13_qw, const int32_t *ws13_qz,
                                 const uint16_t *ws13_sc, const void *ws2, const int32_t *ws2_qw,
                                 const int32_t *ws2_qz, const uint16_t *ws2_sc, int64_t g,
                                 int64_t T, int64_t D, int64_t E, int64_t F, int64_t k, int64_t S, int64_t Fs, int dt,
                                 void *out) {
    const int64_t fmax = F > Fs ? F : Fs;
    float *act = malloc((size_t)(fmax + D) * sizeof(float));
    if (!act) return KP_ERR_NOMEM;
    float *acc = act + fmax;
    const int64_t sz = kp_itemsize(dt);
    const wmat m13 = make(w13, w13_qw, w13_qz, w13_sc, 2 * F, D, g, E), m2 = make(w2, w2_qw, w2_qz, w2_sc, D, F, g, E);
    const wmat s13 = make(ws13, ws13_qw, ws13_qz, ws13_sc, 2 * Fs, D, g, S);
    const wmat s2 = make(ws2, ws2_qw, ws2_qz, ws2_sc, D, Fs, g, S);
    for (int64_t t = 0; t < T; t++) {
        const char *xt = (const char *)x + t * D * sz;
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
