/* kvquant_split.c — decode and flash decoding over a quantized KV cache (kvquant.decode, kvquant.decode_split),
 * fp32 loops.
 *
 *   logit_j = scale * s_k(j) * sum_i q_i kc_ji          kc_j: key j's codes widened exactly to fp32
 *   split s (keys [start_s, end_s) seen by the query):  m_s = max_j logit_j;  l_s = sum_j exp(logit_j - m_s)
 *   LSE_s = m_s + ln l_s;  O_s = (1 / l_s) sum_j exp(logit_j - m_s) s_v(j) vc_j
 *   merge: LSE = M + ln sum_s exp(LSE_s - M) (M = max_s LSE_s);  O = sum_s exp(LSE_s - LSE) O_s
 *
 * Golden: refimpl/kvquant_split.py (float64 code x scale, then refimpl.attention's decode / decode_split).
 * Codes (kvq_codes.h): fmt 0 float8_e4m3fn, 1 float8_e5m2, 2 int8. Scales: gran 0 one (k_scale[0], v_scale[0]),
 * 1 one a kv head, 2 one a (token, kv head), laid out like the codes (strides in elements, shared by k_scale and
 * v_scale). Token t of sequence b: with bt (pages) page bt[b, t / page], slot t % page; without (a contiguous
 * cache) row b, slot t. t < seqlens[b] only (slots past it may hold NaN codes and scales: never read).
 * Queries: q (b, s_q, h_q, d), query i the token at L_b - s_q + i: it sees keys j <= L_b - s_q + i (causal
 * bottom-right); one that sees none has O = 0, LSE = -inf. GQA: query head h reads kv head h / (h_q / h_kv).
 * Splits: split s of sequence b covers keys [s C_b, min((s + 1) C_b, L_b)), C_b = ceil(L_b / splits), or with bnd
 * (b, splits + 1) int64 (fixed blocks, explicit boundaries) [bnd[b, s], bnd[b, s + 1]) cut to [0, L_b); op / lp
 * (may be NULL) receive each split's O_s (fp32, 0 for an empty split) and LSE_s (-inf for an empty split).
 * q and o: dtype code dt (KP_F32 / KP_F16 / KP_BF16), strides in elements; lse fp32.
 * Per (sequence, query, head, split): the logits into a scratch row (fp32 dots over d), then fp32 terms
 * w = exp(logit - m) s_v and w x code summed over the keys in double (kvquant_decode.c's reason), O_s and the
 * merge in double, rounded once. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the scratch is not had.
 */
#include <stdlib.h>

#include "common.h"
#include "kvq_codes.h"

static inline int64_t kvq_at(const int32_t *bt, int64_t sbt_b, int64_t sbt_p, int64_t page, int64_t bi, int64_t t,
                             int64_t s_b, int64_t s_s) {
    if (!bt) return bi * s_b + t * s_s;
    return (int64_t)bt[bi * sbt_b + (t / page) * sbt_p] * s_b + (t % page) * s_s;
}

KP_EXPORT int kvq_split_kernel(
    const void *q, int dt, int64_t sq_b, int64_t sq_s, int64_t sq_h,
    const void *kc, int64_t sk_b, int64_t sk_s, int64_t sk_h,
    const void *vc, int64_t sv_b, int64_t sv_s, int64_t sv_h, int fmt,
    const float *ks, const float *vs, int gran, int64_t ss_b, int64_t ss_s, int64_t ss_h,
    const int32_t *bt, int64_t sbt_b, int64_t sbt_p, int64_t page, const int32_t *lens,
    int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv, int64_t d, int64_t splits, const int64_t *bnd,
    int64_t max_keys, float scale,
    void *o, int64_t so_b, int64_t so_s, int64_t so_h, float *lse, int64_t sl_b, int64_t sl_h, int64_t sl_s,
    float *op, int64_t sop_p, int64_t sop_b, int64_t sop_s, int64_t sop_h,
    float *lp, int64_t slp_p, int64_t slp_b, int64_t slp_h, int64_t slp_s) {
    if (!tables_ready) build_tables();
    const float *lut = fmt == 0 ? E4M3 : fmt == 1 ? E5M2 : NULL;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(max_keys + d + 1));
    double *acc = (double *)malloc(sizeof(double) * (size_t)((splits + 1) * (d + 1)));
    if (!buf || !acc) {
        free(buf);
        free(acc);
        return KP_ERR_NOMEM;
    }
    float *logit = buf, *qf = buf + max_keys;
    double *o_s = acc + d, *lse_s = o_s + splits * d;  /* each split's O and LSE, double */
    const int64_t group = h_q / h_kv;
    const int64_t item = kp_itemsize(dt);
    for (int64_t bi = 0; bi < b; bi++) {
        const int64_t L = lens[bi];
        const int64_t c = (L + splits - 1) / splits;
        for (int64_t qi = 0; qi < s_q; qi++) {
            const int64_t lim = L - s_q + qi + 1;  /* keys j < lim */
            for (int64_t h = 0; h < h_q; h++) {
                const int64_t kh = h / group;
                const char *qrow = (const char *)q + (bi * sq_b + qi * sq_s + h * sq_h) * item;
                for (int64_t i = 0; i < d; i++) qf[i] = kp_load(qrow, i, dt);
                double top = -INFINITY;
                for (int64_t sp = 0; sp < splits; sp++) {
                    int64_t start, end;
                    if (bnd) {  /* fixed blocks or explicit boundaries: [bnd[sp], bnd[sp + 1]) cut to L */
                        start = bnd[bi * (splits + 1) + sp];
                        end = bnd[bi * (splits + 1) + sp + 1];
                        start = start < L ? start : L;
                        end = end < L ? end : L;
                    } else {
                        start = sp * c < L ? sp * c : L;
                        end = start + c < L ? start + c : L;
                    }
                    if (end > lim) end = lim;
                    double *os = o_s + sp * d;
                    for (int64_t i = 0; i < d; i++) acc[i] = 0.0;
                    float m = -INFINITY;
                    for (int64_t t = start; t < end; t++) {
                        const void *krow =
                            (const char *)kc + kvq_at(bt, sbt_b, sbt_p, page, bi, t, sk_b, sk_s) + kh * sk_h;
                        float s = 0.0f;
                        for (int64_t i = 0; i < d; i++) s += qf[i] * code(krow, i, lut);
                        const float sk = gran == 2 ? ks[kvq_at(bt, sbt_b, sbt_p, page, bi, t, ss_b, ss_s) + kh * ss_h]
                                                   : ks[gran == 1 ? kh : 0];
                        logit[t - start] = s * sk * scale;
                        m = logit[t - start] > m ? logit[t - start] : m;
                    }
                    double l = 0.0;
                    for (int64_t t = start; t < end; t++) {
                        const void *vrow =
                            (const char *)vc + kvq_at(bt, sbt_b, sbt_p, page, bi, t, sv_b, sv_s) + kh * sv_h;
                        const float p = expf(logit[t - start] - m);
                        l += p;
                        const float w =
                            gran == 2 ? p * vs[kvq_at(bt, sbt_b, sbt_p, page, bi, t, ss_b, ss_s) + kh * ss_h] : p;
                        for (int64_t i = 0; i < d; i++) acc[i] += (double)(w * code(vrow, i, lut));
                    }
                    const double sv = gran == 2 ? 1.0 : vs[gran == 1 ? kh : 0];
                    const double r = end > start ? sv / l : 0.0;
                    for (int64_t i = 0; i < d; i++) os[i] = acc[i] * r;
                    lse_s[sp] = end > start ? (double)m + log(l) : -INFINITY;
                    top = lse_s[sp] > top ? lse_s[sp] : top;
                    if (op) {
                        float *orow_p = op + sp * sop_p + bi * sop_b + qi * sop_s + h * sop_h;
                        for (int64_t i = 0; i < d; i++) orow_p[i] = (float)os[i];
                    }
                    if (lp) lp[sp * slp_p + bi * slp_b + h * slp_h + qi * slp_s] = (float)lse_s[sp];
                }
                double den = 0.0;
                for (int64_t i = 0; i < d; i++) acc[i] = 0.0;
                if (top > -INFINITY) {
                    for (int64_t sp = 0; sp < splits; sp++) {
                        if (lse_s[sp] == -INFINITY) continue;
                        const double w = exp(lse_s[sp] - top);
                        den += w;
                        for (int64_t i = 0; i < d; i++) acc[i] += w * o_s[sp * d + i];
                    }
                }
                char *orow = (char *)o + (bi * so_b + qi * so_s + h * so_h) * item;
                for (int64_t i = 0; i < d; i++) kp_store(orow, i, den > 0.0 ? (float)(acc[i] / den) : 0.0f, dt);
                lse[bi * sl_b + h * sl_h + qi * sl_s] = den > 0.0 ? (float)(top + log(den)) : -INFINITY;
            }
        }
    }
    free(buf);
    free(acc);
    return KP_OK;
}
