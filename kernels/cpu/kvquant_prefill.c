/* kvquant_prefill.c — chunked prefill over a quantized paged KV cache (kvquant.chunked_prefill), fp32 loops.
 *
 *   logit_ij = scale * s_k(j) * sum_c q_ic kc_jc         kc_j: key j's codes widened exactly to fp32
 *   m = max_{j <= hist_b + i} logit_ij;  l = sum_{j <= hist_b + i} exp(logit_ij - m);  LSE_i = m + ln l
 *   O_ic = (1 / l) sum_{j <= hist_b + i} exp(logit_ij - m) s_v(j) vc_jc
 *
 * Golden: refimpl/kvquant_prefill.py (float64 code x scale, then attention.chunked_prefill's math). The cache
 * holds sequence b's history and its chunk's own K / V as codes: tokens 0 .. hist_b + L_q,b - 1, token t at page
 * block_table[b, t / page], slot t % page. Queries packed by cu_seqlens_q (sequence b's are rows cu[b] ..
 * cu[b + 1] - 1); query i of sequence b sits at position hist_b + i and sees keys j <= hist_b + i (causal
 * bottom-right); an empty chunk writes nothing. Slots past a sequence's last token may hold NaN codes and
 * scales: never read.
 * Codes: fmt 0 float8_e4m3fn, 1 float8_e5m2 (a 256-entry table of their exact values), 2 int8. Scales: gran 0 one
 * (k_scale[0], v_scale[0]), 1 one a kv head, 2 one a (slot, kv head) through the block table like the codes
 * (strides in elements, shared by k_scale and v_scale). GQA: query head h reads kv head h / (h_q / h_kv).
 * q and o: dtype code dt (KP_F32 / KP_F16 / KP_BF16), strides in elements; lse fp32 (h_q, total_q).
 * Two passes a (query, query head), as kvquant_decode.c: the logits into a scratch row (fp32 dots over d), then
 * the exps and the weighted sum of V, fp32 terms summed over the keys in double and rounded once (a plain fp32 sum
 * over 1,500 keys drifted past the fp32 cos_diff limit in the decode kernel). One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the scratch (max_keys + d floats, d doubles) is not had.
 */
#include <stdlib.h>

#include "common.h"
#include "kvq_codes.h"

KP_EXPORT int kvq_chunked_prefill_kernel(
    const void *q, int dt, int64_t sq_t, int64_t sq_h,
    const void *kc, int64_t sk_b, int64_t sk_s, int64_t sk_h,
    const void *vc, int64_t sv_b, int64_t sv_s, int64_t sv_h, int fmt,
    const float *ks, const float *vs, int gran, int64_t ss_b, int64_t ss_s, int64_t ss_h,
    const int32_t *bt, int64_t sbt_b, int64_t sbt_p, const int32_t *cu, const int32_t *hist,
    int64_t b, int64_t h_q, int64_t h_kv, int64_t d, int64_t page, int64_t max_keys, float scale,
    void *o, int64_t so_t, int64_t so_h, float *lse, int64_t sl_h, int64_t sl_t) {
    if (!tables_ready) build_tables();
    const float *lut = fmt == 0 ? E4M3 : fmt == 1 ? E5M2 : NULL;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(max_keys + d + 1));
    double *acc = (double *)malloc(sizeof(double) * (size_t)(d + 1));
    if (!buf || !acc) {
        free(buf);
        free(acc);
        return KP_ERR_NOMEM;
    }
    float *logit = buf, *qf = buf + max_keys;
    const int64_t group = h_q / h_kv;
    const int64_t item = kp_itemsize(dt);
    for (int64_t bi = 0; bi < b; bi++) {
        const int64_t q0 = cu[bi], lq = (int64_t)cu[bi + 1] - q0, H = hist[bi];
        if (lq == 0) continue;  /* an empty chunk: no rows */
        const int32_t *bt_row = bt + bi * sbt_b;
        for (int64_t h = 0; h < h_q; h++) {
            const int64_t kh = h / group;
            for (int64_t i = 0; i < lq; i++) {
                const int64_t row = q0 + i, L = H + i + 1;  /* keys 0 .. hist + i */
                char *orow = (char *)o + (row * so_t + h * so_h) * item;
                const char *qrow = (const char *)q + (row * sq_t + h * sq_h) * item;
                for (int64_t c = 0; c < d; c++) { qf[c] = kp_load(qrow, c, dt); acc[c] = 0.0; }
                float m = -INFINITY;
                for (int64_t t = 0; t < L; t++) {
                    const int64_t pg = bt_row[(t / page) * sbt_p], slot = t % page;
                    const void *krow = (const char *)kc + pg * sk_b + slot * sk_s + kh * sk_h;
                    float s = 0.0f;
                    for (int64_t c = 0; c < d; c++) s += qf[c] * code(krow, c, lut);
                    const float sk = gran == 2 ? ks[pg * ss_b + slot * ss_s + kh * ss_h] : ks[gran == 1 ? kh : 0];
                    logit[t] = s * sk * scale;
                    m = logit[t] > m ? logit[t] : m;
                }
                double l = 0.0;
                for (int64_t t = 0; t < L; t++) {
                    const int64_t pg = bt_row[(t / page) * sbt_p], slot = t % page;
                    const void *vrow = (const char *)vc + pg * sv_b + slot * sv_s + kh * sv_h;
                    const float p = expf(logit[t] - m);
                    l += p;
                    const float w = gran == 2 ? p * vs[pg * ss_b + slot * ss_s + kh * ss_h] : p;
                    for (int64_t c = 0; c < d; c++) acc[c] += (double)(w * code(vrow, c, lut));
                }
                const float sv = gran == 2 ? 1.0f : vs[gran == 1 ? kh : 0];
                const double r = sv / l;  /* l >= 1: the row's max key contributes exp(0) */
                for (int64_t c = 0; c < d; c++) kp_store(orow, c, (float)(acc[c] * r), dt);
                lse[h * sl_h + row * sl_t] = (float)((double)m + log(l));
            }
        }
    }
    free(buf);
    free(acc);
    return KP_OK;
}
