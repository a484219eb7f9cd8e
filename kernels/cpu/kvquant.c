/* kvquant.c — quantized KV cache write (quantize on append), kvquant.update: vLLM's reshape_and_cache_flash
 * with an fp8 (e4m3 / e5m2) or int8 cache and static (per tensor, per kv head) or dynamic per-token scales.
 *
 * For each token t with slot = slots[t] != -1 (-1: a padding token, nothing written) and each kv head h:
 *   s    = scale[h * stride_s]                       static (stride 0: one scale for the tensor)
 *        = float32(amax_d |x|) / FMAX                 dynamic (IEEE float32 division), stored in
 *                                                     scale_cache[slot / page, slot % page, h]
 *   v    = x / s  (IEEE float32 division; s = 0, a row of zeros: v = 0)
 *   code = e4m3 / e5m2: |v| clamped to FMAX (__NV_SATFINITE), rounded to nearest even on the format's grid
 *          (kvq_fp8: exact, in software); int8: nearest even (nearbyintf), clamped to [-128, 127]
 * written at cache[slot / page, slot % page, h, :] (bytes: float8 bit patterns, two's complement int8).
 * Conventions: refimpl/kvquant_update.py (golden), refimpl/kvquant.py (formats). The wrapper (kvquant.py)
 * checks shapes, dtypes and slots before the call.
 */
#include "common.h"

enum { KVQ_E4M3 = 0, KVQ_E5M2 = 1, KVQ_INT8 = 2 };

typedef struct {
    int man;          /* mantissa bits */
    int emin;         /* exponent of the smallest normal */
    float fmax;       /* largest finite value */
    uint8_t code_max; /* its code (the saturated code) */
    uint8_t code_inf; /* the overflow code of a non-saturating cast: e4m3fn NaN, e5m2 inf */
} kvq_format;

static const kvq_format KVQ_FORMATS[2] = {
    {3, -6, 448.0f, 0x7e, 0x7f},      /* e4m3fn: bias 7, no inf, 0x7f NaN */
    {2, -14, 57344.0f, 0x7b, 0x7c},   /* e5m2: bias 15, 0x7c inf */
};

/* Round to nearest, ties to even (the default rounding mode). */
static inline float kvq_rne(float v) { return nearbyintf(v); }

/* The float8 code of v (finite): |v| saturated to fmax, then rounded to nearest even on the grid
 * (quantum 2^(e - man) for |v| in [2^e, 2^(e+1)), e >= emin; the subnormal quantum 2^(emin - man) below). */
static uint8_t kvq_fp8(float v, const kvq_format *f) {
    const uint8_t sign = signbit(v) ? 0x80 : 0x00;
    float a = fabsf(v);
    if (a > f->fmax) return (uint8_t)(sign | f->code_max);   /* __NV_SATFINITE */
    int e2;
    frexpf(a, &e2);                                          /* a = m 2^e2, m in [0.5, 1): e = e2 - 1 */
    int e = a == 0.0f ? f->emin : e2 - 1;
    if (e < f->emin) e = f->emin;                            /* subnormal: the smallest normal's quantum */
    const float k = kvq_rne(ldexpf(a, f->man - e));          /* a / quantum, exact; rounded */
    const float r = ldexpf(k, e - f->man);                   /* the rounded value: exact on the grid */
    if (r == 0.0f) return sign;
    frexpf(r, &e2);
    int er = e2 - 1;
    if (er < f->emin) /* subnormal code: r / 2^(emin - man) */
        return (uint8_t)(sign | (uint8_t)ldexpf(r, f->man - f->emin));
    const int mant = (int)ldexpf(r, f->man - er) - (1 << f->man);
    return (uint8_t)(sign | ((er - f->emin + 1) << f->man) | mant);
}

static float kvq_row_amax(const void *x, int64_t len, int dt) {
    float m = 0.0f;
    for (int64_t j = 0; j < len; j++) m = fmaxf(m, fabsf(kp_load(x, j, dt)));
    return m;
}

KP_EXPORT int kvquant_update_kernel(const void *NEW_ptr, int dt, int64_t stride_nt, int64_t stride_nh,
                                    const int64_t *SLOT_ptr, int64_t n, int64_t h_kv, int64_t d,
                                    uint8_t *CACHE_ptr, int64_t stride_cb, int64_t stride_cp, int64_t stride_ch,
                                    int64_t page, int64_t nslots, int fmt, const float *SCALE_ptr,
                                    int64_t stride_s, float *SC_ptr, int64_t stride_scb, int64_t stride_scp,
                                    int64_t stride_sch) {
    if (dt != KP_F32 && dt != KP_F16 && dt != KP_BF16) return KP_ERR_DTYPE;
    if (fmt < 0 || fmt > KVQ_INT8) return KP_ERR_DTYPE;
    const int64_t isz = kp_itemsize(dt);
    const kvq_format *f = fmt == KVQ_INT8 ? 0 : &KVQ_FORMATS[fmt];
    const float fmax = fmt == KVQ_INT8 ? 127.0f : f->fmax;
    for (int64_t t = 0; t < n; t++) {
        int64_t slot = SLOT_ptr[t];
        if (slot < 0) continue;                              /* padding token */
        (void)nslots;
        const int64_t blk = slot / page, off = slot % page;
        const char *src = (const char *)NEW_ptr + t * stride_nt * isz;
        for (int64_t h = 0; h < h_kv; h++) {
            const void *x = src + h * stride_nh * isz;
            float s;
            if (SC_ptr) {                                    /* dynamic: one scale a (token, head) */
                s = kvq_row_amax(x, d, dt) / fmax;
                SC_ptr[blk * stride_scb + off * stride_scp + h * stride_sch] = s;
            } else {
                s = SCALE_ptr[h * stride_s];
            }
            uint8_t *dst = CACHE_ptr + blk * stride_cb + off * stride_cp + h * stride_ch;
            for (int64_t j = 0; j < d; j++) {
                const float v = s == 0.0f ? 0.0f : kp_load(x, j, dt) / s;
                if (fmt == KVQ_INT8) {
                    float r = kvq_rne(v);
                    r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
                    dst[j] = (uint8_t)(int8_t)r;
                } else {
                    dst[j] = kvq_fp8(v, f);
                }
            }
        }
    }
    return KP_OK;
}
