/* kvquant_decode.c — paged decode attention over a quantized KV cache (kvquant.decode_paged), fp32 loops.
 *
 *   logit_j = scale * s_k(j) * sum_i q_i kc_ji          kc_j: key j's codes widened exactly to fp32
 *   m = max_j logit_j;  l = sum_j exp(logit_j - m);  LSE = m + ln l
 *   O_i = (1 / l) sum_j exp(logit_j - m) s_v(j) vc_ji
 *
 * Golden: refimpl/kvquant_decode.py (float64 code x scale, then attention.decode_paged's math).
 * Codes: fmt 0 float8_e4m3fn, 1 float8_e5m2 (decoded through a 256-entry table of their exact values),
 * 2 int8. Scales: gran 0 one (k_scale[0], v_scale[0]), 1 one a kv head, 2 one a (slot, kv head) through
 * the block table like the codes (strides in elements, shared by k_scale and v_scale).
 * Token t of sequence b: page block_table[b, t / page], slot t % page; t < seq_lens[b] only (slots past
 * it may hold NaN codes and scales: never read). GQA: query head h reads kv head h / (h_q / h_kv).
 * q and o: dtype code dt (KP_F32 / KP_F16 / KP_BF16), strides in elements; lse fp32. A sequence with no
 * key: O = 0, LSE = -inf. Two passes a (sequence, query head): the logits into a scratch row (fp32 dots over
 * d), then the exps and the weighted sum of V: fp32 terms w = exp(logit - m) s_v and w x code, summed over the
 * keys in double and rounded once (a plain fp32 sum over 1,500 keys drifted past the fp32 cos_diff limit,
 * 1.1e-12, on one seed of three sweeps). One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the scratch (max_keys floats, 2 d doubles) is not had.
 */
#include <stdlib.h>

#include "common.h"
#include "kvq_codes.h"

KP_EXPORT int kvq_decode_paged_kernel(
    const void *q, int dt, int64_t sq_b, int64_t sq_h,
    const void *kc, int64_t sk_b, int64_t sk_s, int64_t sk_h,
    const void *vc, int64_t sv_b, int64_t sv_s, int64_t sv_h, int fmt,
    const float *ks, const float *vs, int gran, int64_t ss_b, int64_t ss_s, int64_t ss_h,
    const int32_t *bt, int64_t sbt_b, int64_t sbt_p, const int32_t *lens,
    int64_t b, int64_t h_q, int64_t h_kv, int64_t d, int64_t page, int64_t max_keys, float scale,
    void *o, int64_t so_b, int64_t so_h, float *lse, int64_t sl_b, int64_t sl_h) {
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
        const int64_t L = lens[bi];
        for (int64_t h = 0; h < h_q; h++) {
            const int64_t kh = h / group;
            char *orow = (char *)o + (bi * so_b + h * so_h) * item;
            const char *qrow = (const char *)q + (bi * sq_b + h * sq_h) * item;
            for (int64_t i = 0; i < d; i++) { qf[i] = kp_load(qrow, i, dt); acc[i] = 0.0; }
            float m = -INFINITY;
            for (int64_t t = 0; t < L; t++) {
                const int64_t pg = bt[bi * sbt_b + (t / page) * sbt_p], slot = t % page;
                const void *krow = (const char *)kc + pg * sk_b + slot * sk_s + kh * sk_h;
                float s = 0.0f;
                for (int64_t i = 0; i < d; i++) s += qf[i] * code(krow, i, lut);
                const float sk = gran == 2 ? ks[pg * ss_b + slot * ss_s + kh * ss_h] : ks[gran == 1 ? kh : 0];
                logit[t] = s * sk * scale;
                m = logit[t] > m ? logit[t] : m;
            }
            double l = 0.0;
            for (int64_t t = 0; t < L; t++) {
                const int64_t pg = bt[bi * sbt_b + (t / page) * sbt_p], slot = t % page;
                const void *vrow = (const char *)vc + pg * sv_b + slot * sv_s + kh * sv_h;
                const float p = expf(logit[t] - m);
                l += p;
                const float w = gran == 2 ? p * vs[pg * ss_b + slot * ss_s + kh * ss_h] : p;
                for (int64_t i = 0; i < d; i++) acc[i] += (double)(w * code(vrow, i, lut));
            }
            const float sv = gran == 2 ? 1.0f : vs[gran == 1 ? kh : 0];
            const double r = L > 0 ? sv / l : 0.0;
            for (int64_t i = 0; i < d; i++) kp_store(orow, i, (float)(acc[i] * r), dt);
            lse[bi * sl_b + h * sl_h] = L > 0 ? (float)((double)m + log(l)) : -INFINITY;
        }
    }
    free(buf);
    free(acc);
    return KP_OK;
}
