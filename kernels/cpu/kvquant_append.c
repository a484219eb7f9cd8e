/* kvquant_append.c — one decode step over a quantized paged KV cache (kvquant.append_decode): the new token's
 * K / V quantized into the cache, then the attention over the sequence's L + 1 keys, fp32 loops.
 *
 * For each sequence b (L = lens[b], the length before the append; the new token is key L):
 *   slot   = page bt[b, L / page], offset L % page
 *   write  (each kv head, K then V): s = the static scale (scale[0] / scale[h]) or amax_d |x| / FMAX (IEEE fp32,
 *          stored in the scale cache at the slot); code = Q(x / s) (IEEE fp32 division; e4m3 / e5m2 saturated
 *          and rounded to nearest even by an exact software encoder, int8 nearbyintf then clamped; s = 0: code 0),
 *          stored at the slot; the code's value (exact in fp32) kept for the read
 *   read   (each query head h, kv head h / (h_q / h_kv)): kvquant_decode.c's two passes over keys 0 .. L,
 *          keys t < L from the cache through the block table, key L from the codes just written (the same
 *          bits the cache now holds, read back as quantized):
 *            logit_t = scale * s_k(t) * sum_i q_i code_ti;  m = max; l = sum exp(logit - m)
 *            O_i = (1 / l) sum_t exp(logit_t - m) s_v(t) vcode_ti   (fp32 terms summed in double; static s_v
 *            applied once at the end), LSE = m + ln l
 * Golden: refimpl/kvquant_append.py (kvquant.update's golden, then kvquant.decode_paged's).
 * Codes: fmt 0 float8_e4m3fn, 1 float8_e5m2 (decoded through tables of their exact values), 2 int8. Scales:
 * gran 0 (one a tensor), 1 (one a kv head, contiguous), 2 (scale caches, strides in elements, shared by K and V).
 * q, k_new, v_new: dtype codes (KP_F32 / KP_F16 / KP_BF16), strides in elements; o q's dtype; lse fp32.
 * Slots the step does not write are never touched; cached slots at or past L are never read. One thread.
 * Returns KP_OK, KP_ERR_DTYPE, or KP_ERR_NOMEM when the scratch is not had.
 */
#include <stdlib.h>

#include "common.h"
#include "kvq_codes.h"

enum { KVQ_E4M3 = 0, KVQ_E5M2 = 1, KVQ_INT8 = 2 };

typedef struct {
    int man;          /* mantissa bits */
    int emin;         /* exponent of the smallest normal */
    float fmax;       /* largest finite value */
    uint8_t code_max; /* its code (the saturated code) */
} kvq_format;

static const kvq_format KVQ_FORMATS[2] = {
    {3, -6, 448.0f, 0x7e},     /* e4m3fn: bias 7, no inf, 0x7f NaN */
    {2, -14, 57344.0f, 0x7b},  /* e5m2: bias 15, 0x7c inf */
};

/* The float8 code of finite v: |v| saturated to fmax, then rounded to nearest even on the grid (kvquant.c). */
static uint8_t kvq_fp8(float v, const kvq_format *f) {
    const uint8_t sign = signbit(v) ? 0x80 : 0x00;
    float a = fabsf(v);
    if (a > f->fmax) return (uint8_t)(sign | f->code_max);   /* __NV_SATFINITE */
    int e2;
    frexpf(a, &e2);
    int e = a == 0.0f ? f->emin : e2 - 1;
    if (e < f->emin) e = f->emin;                            /* subnormal: the smallest normal's quantum */
    const float k = nearbyintf(ldexpf(a, f->man - e));       /* a / quantum, exact; rounded half to even */
    const float r = ldexpf(k, e - f->man);
    if (r == 0.0f) return sign;
    frexpf(r, &e2);
    int er = e2 - 1;
    if (er < f->emin) return (uint8_t)(sign | (uint8_t)ldexpf(r, f->man - f->emin));
    const int mant = (int)ldexpf(r, f->man - er) - (1 << f->man);
    return (uint8_t)(sign | ((er - f->emin + 1) << f->man) | mant);
}

KP_EXPORT int kvq_append_decode_kernel(
    const void *q, int dt, int64_t sq_b, int64_t sq_h,
    const void *kn, const void *vn, int dtn, int64_t skn_b, int64_t skn_h, int64_t svn_b, int64_t svn_h,
    uint8_t *kc, int64_t sk_b, int64_t sk_s, int64_t sk_h,
    uint8_t *vc, int64_t sv_b, int64_t sv_s, int64_t sv_h, int fmt,
    float *ks, float *vs, int gran, int64_t ss_b, int64_t ss_s, int64_t ss_h,
    const int32_t *bt, int64_t sbt_b, int64_t sbt_p, const int32_t *lens,
    int64_t b, int64_t h_q, int64_t h_kv, int64_t d, int64_t page, int64_t max_keys, float scale,
    void *o, int64_t so_b, int64_t so_h, float *lse, int64_t sl_b, int64_t sl_h) {
    if (dt != KP_F32 && dt != KP_F16 && dt != KP_BF16) return KP_ERR_DTYPE;
    if (dtn != KP_F32 && dtn != KP_F16 && dtn != KP_BF16) return KP_ERR_DTYPE;
    if (fmt < 0 || fmt > KVQ_INT8 || gran < 0 || gran > 2) return KP_ERR_DTYPE;
    if (!tables_ready) build_tables();
    const float *lut = fmt == KVQ_E4M3 ? E4M3 : fmt == KVQ_E5M2 ? E5M2 : NULL;
    const kvq_format *f = fmt == KVQ_INT8 ? 0 : &KVQ_FORMATS[fmt];
    const float fmax = fmt == KVQ_INT8 ? 127.0f : f->fmax;
    const int64_t max_pages = max_keys / page;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(max_keys + 1 + d + 2 * h_kv * (d + 1)));
    double *acc = (double *)malloc(sizeof(double) * (size_t)(d + 1));
    if (!buf || !acc) {
        free(buf);
        free(acc);
        return KP_ERR_NOMEM;
    }
    float *logit = buf, *qf = buf + max_keys + 1;
    float *newv = qf + d;              /* (2, h_kv, d): the new rows' code values (K, then V) */
    float *news = newv + 2 * h_kv * d; /* (2, h_kv): their scales */
    const int64_t group = h_q / h_kv;
    const int64_t item = kp_itemsize(dt), itemn = kp_itemsize(dtn);
    for (int64_t bi = 0; bi < b; bi++) {
        const int64_t L = lens[bi];
        const int64_t pg_new = bt[bi * sbt_b + (L / page) * sbt_p];
        const int64_t slot_new = L % page;
        (void)max_pages;
        /* the write: K (w = 0) and V (w = 1) of every kv head */
        for (int w = 0; w < 2; w++) {
            const char *src = (const char *)(w == 0 ? kn : vn) + bi * (w == 0 ? skn_b : svn_b) * itemn;
            uint8_t *cache = w == 0 ? kc : vc;
            float *sc = w == 0 ? ks : vs;
            const int64_t cb = w == 0 ? sk_b : sv_b, cs = w == 0 ? sk_s : sv_s, ch = w == 0 ? sk_h : sv_h;
            for (int64_t kh = 0; kh < h_kv; kh++) {
                const void *x = src + kh * (w == 0 ? skn_h : svn_h) * itemn;
                float s;
                if (gran == 2) {                             /* dynamic: amax / FMAX, stored beside the codes */
                    float amax = 0.0f;
                    for (int64_t j = 0; j < d; j++) amax = fmaxf(amax, fabsf(kp_load(x, j, dtn)));
                    s = amax / fmax;
                    sc[pg_new * ss_b + slot_new * ss_s + kh * ss_h] = s;
                } else {
                    s = sc[gran == 1 ? kh : 0];
                }
                news[w * h_kv + kh] = s;
                uint8_t *dst = cache + pg_new * cb + slot_new * cs + kh * ch;
                float *nv = newv + (w * h_kv + kh) * d;
                for (int64_t j = 0; j < d; j++) {
                    const float v = s == 0.0f ? 0.0f : kp_load(x, j, dtn) / s;
                    uint8_t c;
                    if (fmt == KVQ_INT8) {
                        float r = nearbyintf(v);
                        r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
                        c = (uint8_t)(int8_t)r;
                    } else {
                        c = kvq_fp8(v, f);
                    }
                    dst[j] = c;
                    nv[j] = code(&c, 0, lut); /* the value the cache now holds, as the read path reads it */
                }
            }
        }
        /* the read: keys 0 .. L, the last one the new token */
        const int64_t n_keys = L + 1;
        for (int64_t h = 0; h < h_q; h++) {
            const int64_t kh = h / group;
            const float *knew = newv + kh * d, *vnew = newv + (h_kv + kh) * d;
            const float skn = news[kh], svn = news[h_kv + kh];
            char *orow = (char *)o + (bi * so_b + h * so_h) * item;
            const char *qrow = (const char *)q + (bi * sq_b + h * sq_h) * item;
            for (int64_t i = 0; i < d; i++) { qf[i] = kp_load(qrow, i, dt); acc[i] = 0.0; }
            float m = -INFINITY;
            for (int64_t t = 0; t < n_keys; t++) {
                float s = 0.0f, sk;
                if (t < L) {
                    const int64_t pg = bt[bi * sbt_b + (t / page) * sbt_p], slot = t % page;
                    const void *krow = kc + pg * sk_b + slot * sk_s + kh * sk_h;
                    for (int64_t i = 0; i < d; i++) s += qf[i] * code(krow, i, lut);
                    sk = gran == 2 ? ks[pg * ss_b + slot * ss_s + kh * ss_h] : ks[gran == 1 ? kh : 0];
                } else {
                    for (int64_t i = 0; i < d; i++) s += qf[i] * knew[i];
                    sk = skn;
                }
                logit[t] = s * sk * scale;
                m = logit[t] > m ? logit[t] : m;
            }
            double l = 0.0;
            for (int64_t t = 0; t < n_keys; t++) {
                const float p = expf(logit[t] - m);
                l += p;
                if (t < L) {
                    const int64_t pg = bt[bi * sbt_b + (t / page) * sbt_p], slot = t % page;
                    const void *vrow = vc + pg * sv_b + slot * sv_s + kh * sv_h;
                    const float w = gran == 2 ? p * vs[pg * ss_b + slot * ss_s + kh * ss_h] : p;
                    for (int64_t i = 0; i < d; i++) acc[i] += (double)(w * code(vrow, i, lut));
                } else {
                    const float w = gran == 2 ? p * svn : p;
                    for (int64_t i = 0; i < d; i++) acc[i] += (double)(w * vnew[i]);
                }
            }
            const float sv = gran == 2 ? 1.0f : vs[gran == 1 ? kh : 0];
            const double r = n_keys > 0 ? sv / l : 0.0;
            for (int64_t i = 0; i < d; i++) kp_store(orow, i, (float)(acc[i] * r), dt);
            lse[bi * sl_b + h * sl_h] = n_keys > 0 ? (float)((double)m + log(l)) : -INFINITY;
        }
    }
    free(buf);
    free(acc);
    return KP_OK;
}
