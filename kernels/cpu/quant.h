/* quant.h — GGML block formats, shared by quant.c (quantize / dequantize) and gemm.c (integer GEMM).
 *
 * One home for each fact about a format:
 * - the type ids (ggml's, ggml.h) and the block table (elements, bytes): qt_block_size;
 * - the activation quantizers of the CPU dot products (Q8_0, Q8_1, Q8_K), byte-exact with ggml's
 *   quantize_row_q8_{0,1,K}_ref: qt_quantize_q8_0 / _q8_1 / _q8_k;
 * - the bit layout of every format, as a decoder to one uniform record (qt_decode): unsigned codes c
 *   in element order with a per-format offset (value = c - off), the integer sub-block scale and min
 *   of every 16 elements, and the fp32 block scales. dequantize and the GEMM weight panels both read
 *   the bits through it, so the layout is written once.
 *
 * Layouts (little-endian, packed; research/quant-formats.md §1.2-1.3). Nibble order of the 32-blocks:
 * low nibble of qs[j] is element j, high nibble element j + 16.
 *
 * Rounding primitives of ggml reproduced here:
 * - qt_nearest_int: ggml's nearest_int, fval + 1.5 * 2^23 and the low mantissa bits, i.e. round half
 *   to even for |fval| <= 2^22 (the same bit recipe outside that range, so results match there too);
 * - qt_roundf: C roundf (half away from zero), exact for |x| < 2^31 without calling libm;
 * - qt_f32_to_f16: round to nearest even, overflow to inf, NaN -> 0x7e00 with the sign, as
 *   ggml_compute_fp32_to_fp16 (common.h's kp_f32_to_f16 plus ggml's NaN code).
 * All arithmetic is float32 with FMA contraction off (loader flags), in ggml's operation order, which
 * is what makes the quantizers byte-exact: ggml-base is built without FMA as well.
 */
#ifndef KERNEL_PARITY_CPU_QUANT_H
#define KERNEL_PARITY_CPU_QUANT_H

#include <stdint.h>
#include <string.h>

#include "common.h"

/* ggml type ids (ggml.h) */
enum {
    QT_F32 = 0, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q8_1 = 9,
    QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_Q8_K = 15, QT_IQ4_NL = 20,
};
enum { QK_K = 256, QK32 = 32 };
enum { KP_ERR_SHAPE = 3 };   /* k is not a whole number of blocks */

static const int8_t qt_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1, 13, 25, 38, 53, 69, 89, 113};

/* Elements and bytes of one block of type t; 0 for a type this file does not know. */
static inline int qt_block_size(int t, int *nbytes) {
    int qk = 0, nb = 0;
    switch (t) {
    case QT_Q4_0: qk = 32; nb = 18; break;
    case QT_Q4_1: qk = 32; nb = 20; break;
    case QT_Q5_0: qk = 32; nb = 22; break;
    case QT_Q5_1: qk = 32; nb = 24; break;
    case QT_Q8_0: qk = 32; nb = 34; break;
    case QT_Q8_1: qk = 32; nb = 36; break;
    case QT_IQ4_NL: qk = 32; nb = 18; break;
    case QT_Q2_K: qk = 256; nb = 84; break;
    case QT_Q3_K: qk = 256; nb = 110; break;
    case QT_Q4_K: qk = 256; nb = 144; break;
    case QT_Q5_K: qk = 256; nb = 176; break;
    case QT_Q6_K: qk = 256; nb = 210; break;
    case QT_Q8_K: qk = 256; nb = 292; break;
    default: break;
    }
    if (nbytes) *nbytes = nb;
    return qk;
}

/* The offset of the decoded codes: value = c - off. Offsets are 0 or a power of two. */
static inline int qt_offset(int t) {
    switch (t) {
    case QT_Q4_0: return 8;
    case QT_Q5_0: return 16;
    case QT_Q3_K: return 4;
    case QT_Q6_K: return 32;
    case QT_Q8_0: case QT_Q8_1: case QT_Q8_K: case QT_IQ4_NL: return 128;   /* signed int8 as c ^ 0x80 */
    default: return 0;
    }
}

/* ---- bytes and rounding ----------------------------------------------------------------------- */

KP_INLINE uint16_t qt_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
KP_INLINE uint32_t qt_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
KP_INLINE void qt_wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
KP_INLINE float qt_f16(const uint8_t *p) { return kp_f16_to_f32(qt_rd16(p)); }

KP_INLINE uint16_t qt_f32_to_f16(float f) {
    uint32_t x = kp_bits(f);
    uint16_t nan = (uint16_t)(((x >> 16) & 0x8000u) | 0x7e00u);
    return (x & 0x7fffffffu) > 0x7f800000u ? nan : kp_f32_to_f16(f);
}

KP_INLINE int qt_nearest_int(float fval) {
    float val = fval + 12582912.f;
    int32_t i;
    memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* (int)roundf(x): truncate, then step away from zero when the dropped part is >= 1/2 (x - t is exact
 * for |x| < 2^31). Outside that range, inf and NaN (an fp32 d so small that 1/d overflows) it is the
 * plain conversion, which on x86 is what ggml's (int8_t)roundf(x) compiles to: INT_MIN, low byte 0. */
KP_INLINE int qt_roundf(float x) {
    int t = (int)x;
    float r = x - (float)t;
    int big = !(fabsf(x) < 2147483648.f);
    return big ? t : t + (r >= 0.5f) - (r <= -0.5f);
}

/* ---- activation quantizers (ggml's _ref, byte-exact) --------------------------------------------- */

/* Q8_0: d = amax / 127 (stored fp16), q = roundf(x * (1/d)) with the unrounded fp32 d. */
static inline void qt_quantize_q8_0(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(x[j]);
            amax = amax > a ? amax : a;   /* ggml's MAX(amax, a), NaN handling included */
        }
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)qt_roundf(x[j] * id);
    }
}

/* Q8_1: as Q8_0, plus s = fp16(float(sum q) * d) with the unrounded d. */
static inline void qt_quantize_q8_1(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 36) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(x[j]);
            amax = amax > a ? amax : a;
        }
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int8_t q = (int8_t)qt_roundf(x[j] * id);
            y[4 + j] = (uint8_t)q;
            sum += q;
        }
        qt_wr16(y + 2, qt_f32_to_f16((float)sum * d));
    }
}

/* Q8_K: max = signed value of the largest |x| (first on ties), iscale = -127 / max,
 * q = min(127, nearest_int(iscale * x)), d = 1 / iscale in fp32, bsums = sums of 16 codes.
 * An all-zero block gets d = 0 and zero codes; ggml leaves its bsums unwritten, we write 0. */
static inline void qt_quantize_q8_k(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 292) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {
            memset(y, 0, 292);
            continue;
        }
        const float iscale = -127.f / max;
        int8_t *q = (int8_t *)(y + 4);
        for (int j = 0; j < QK_K; j++) {
            int v = qt_nearest_int(iscale * x[j]);
            q[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += q[16 * j + l];
            qt_wr16(y + 260 + 2 * j, (uint16_t)(int16_t)sum);
        }
        const float d = 1 / iscale;
        memcpy(y, &d, 4);
    }
}

/* ---- decoding ----------------------------------------------------------------------------------- */

/* One decoded block. For a 32-block only c[0:32], d and m are set (sc/mn unused). */
typedef struct {
    uint8_t c[QK_K];    /* codes in element order, value = c - qt_offset(t) */
    int32_t sc[16];     /* K-quants: signed integer scale of each 16-element sub-block */
    int32_t mn[16];     /* K-quants: integer min of each sub-block (Q2_K, Q4_K, Q5_K), else 0 */
    float d;            /* block scale: fp16 widened (exact), Q8_K fp32 */
    float m;            /* Q4_1/Q5_1: the min m; Q2_K/Q4_K/Q5_K: dmin; Q8_1: s; else 0 */
} qt_decoded;

/* get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of Q4_K/Q5_K. */
KP_INLINE void qt_scale_min_k4(int j, const uint8_t *q, int32_t *sc, int32_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Nibble order of the 32-blocks: low of qs[j] -> j, high -> j + 16. Eight bytes at a time in
 * 64-bit words (byte loops here compile to byte inserts that dominate a GEMV). */
KP_INLINE void qt_nibbles32(const uint8_t *qs, uint8_t *c) {
    const uint64_t lo4 = 0x0F0F0F0F0F0F0F0Full;
    for (int h = 0; h < 2; h++) {
        uint64_t v, lo, hi;
        memcpy(&v, qs + 8 * h, 8);
        lo = v & lo4;
        hi = (v >> 4) & lo4;
        memcpy(c + 8 * h, &lo, 8);
        memcpy(c + 16 + 8 * h, &hi, 8);
    }
}

/* Q5_0/Q5_1 fifth bits: bit e of the little-endian u32 qh belongs to element e. Each 8 bits are
 * spread to 8 bytes: b * 0x0101.. copies b into every byte, the mask keeps bit i in byte i, and
 * + 0x7f carries a set bit into bit 7 of its byte. */
KP_INLINE void qt_high_bits32(uint32_t qh, uint8_t *c) {
    for (int g = 0; g < 4; g++) {
        uint64_t x = (uint64_t)((qh >> (8 * g)) & 0xFFu) * 0x0101010101010101ull & 0x8040201008040201ull;
        uint64_t bits = ((x + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull, v;
        memcpy(&v, c + 8 * g, 8);
        v |= bits << 4;
        memcpy(c + 8 * g, &v, 8);
    }
}

/* The scale fields of a K-quant super-block (d, m = dmin, sc, mn; codes untouched). */
KP_INLINE void qt_decode_kscales(int t, const uint8_t *b, qt_decoded *r) {
    r->m = 0.0f;
    switch (t) {
    case QT_Q2_K:
        r->d = qt_f16(b + 80);
        r->m = qt_f16(b + 82);
        for (int s = 0; s < 16; s++) {
            r->sc[s] = b[s] & 0xF;
            r->mn[s] = b[s] >> 4;
        }
        return;
    case QT_Q3_K: {
        const uint8_t *sc = b + 96;
        r->d = qt_f16(b + 108);
        for (int s = 0; s < 16; s++) {
            int lo4 = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
            int hi2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            r->sc[s] = (lo4 | (hi2 << 4)) - 32;
            r->mn[s] = 0;
        }
        return;
    }
    case QT_Q4_K: case QT_Q5_K:
        r->d = qt_f16(b);
        r->m = qt_f16(b + 2);
        for (int j = 0; j < 8; j++) {
            int32_t sc, mn;
            qt_scale_min_k4(j, b + 4, &sc, &mn);
            r->sc[2 * j] = r->sc[2 * j + 1] = sc;
            r->mn[2 * j] = r->mn[2 * j + 1] = mn;
        }
        return;
    case QT_Q6_K:
        r->d = qt_f16(b + 208);
        for (int s = 0; s < 16; s++) {
            r->sc[s] = (int8_t)b[192 + s];
            r->mn[s] = 0;
        }
        return;
    default: return;
    }
}

/* Decode one block of type t at b into r. Returns 0, or KP_ERR_DTYPE for an unknown type. */
KP_INLINE int qt_decode(int t, const uint8_t *b, qt_decoded *r) {
    r->m = 0.0f;
    switch (t) {
    case QT_Q4_0:
        r->d = qt_f16(b);
        qt_nibbles32(b + 2, r->c);
        return KP_OK;
    case QT_Q4_1:
        r->d = qt_f16(b);
        r->m = qt_f16(b + 2);
        qt_nibbles32(b + 4, r->c);
        return KP_OK;
    case QT_Q5_0:
        r->d = qt_f16(b);
        qt_nibbles32(b + 6, r->c);
        qt_high_bits32(qt_rd32(b + 2), r->c);
        return KP_OK;
    case QT_Q5_1:
        r->d = qt_f16(b);
        r->m = qt_f16(b + 2);
        qt_nibbles32(b + 8, r->c);
        qt_high_bits32(qt_rd32(b + 4), r->c);
        return KP_OK;
    case QT_Q8_0:
        r->d = qt_f16(b);
        for (int j = 0; j < 32; j++) r->c[j] = b[2 + j] ^ 0x80;
        return KP_OK;
    case QT_Q8_1:
        r->d = qt_f16(b);
        r->m = qt_f16(b + 2);
        for (int j = 0; j < 32; j++) r->c[j] = b[4 + j] ^ 0x80;
        return KP_OK;
    case QT_IQ4_NL:
        r->d = qt_f16(b);
        for (int j = 0; j < 16; j++) {
            r->c[j] = (uint8_t)(qt_kvalues_iq4nl[b[2 + j] & 0xF] + 128);
            r->c[j + 16] = (uint8_t)(qt_kvalues_iq4nl[b[2 + j] >> 4] + 128);
        }
        return KP_OK;
    case QT_Q2_K: {   /* scales[16] | qs[64] | d | dmin; element 128h + 32t + l: (qs[32h + l] >> 2t) & 3 */
        const uint8_t *qs = b + 16;
        qt_decode_kscales(t, b, r);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++) r->c[128 * h + 32 * t + l] = (qs[32 * h + l] >> (2 * t)) & 3;
        return KP_OK;
    }
    case QT_Q3_K: {   /* hmask[32] | qs[64] | scales[12] | d; c = low2 + 4 * hbit, value c - 4 */
        const uint8_t *hm = b, *qs = b + 32;
        qt_decode_kscales(t, b, r);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++) {
                    int e = 128 * h + 32 * t + l;
                    r->c[e] = (uint8_t)(((qs[32 * h + l] >> (2 * t)) & 3) | (((hm[l] >> (e / 32)) & 1) << 2));
                }
        return KP_OK;
    }
    case QT_Q4_K:     /* d | dmin | scales[12] | qs[128]; 64-element chunk k: low nibbles then high */
    case QT_Q5_K: {   /* d | dmin | scales[12] | qh[32] | qs[128]; fifth bit (qh[e % 32] >> (e / 32)) & 1 */
        const uint8_t *qs = b + (t == QT_Q4_K ? 16 : 48), *qh = b + 16;
        qt_decode_kscales(t, b, r);
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                r->c[64 * k + l] = qs[32 * k + l] & 0xF;
                r->c[64 * k + 32 + l] = qs[32 * k + l] >> 4;
            }
        if (t == QT_Q5_K)
            for (int h = 0; h < 8; h++)
                for (int l = 0; l < 32; l++) r->c[32 * h + l] |= (uint8_t)(((qh[l] >> h) & 1) << 4);
        return KP_OK;
    }
    case QT_Q6_K: {   /* ql[128] | qh[64] | scales[16] int8 | d; value c - 32 */
        const uint8_t *ql = b, *qh = b + 128;
        qt_decode_kscales(t, b, r);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++) {
                    uint8_t lo = ql[64 * h + l + 32 * (t & 1)];
                    lo = t < 2 ? lo & 0xF : lo >> 4;
                    r->c[128 * h + 32 * t + l] = (uint8_t)(lo | (((qh[32 * h + l] >> (2 * t)) & 3) << 4));
                }
        return KP_OK;
    }
    case QT_Q8_K: {   /* d fp32 | qs[256] | bsums[16] */
        memcpy(&r->d, b, 4);
        for (int e = 0; e < QK_K; e++) r->c[e] = b[4 + e] ^ 0x80;
        for (int s = 0; s < 16; s++) {
            r->sc[s] = 1;
            r->mn[s] = 0;
        }
        return KP_OK;
    }
    default: return KP_ERR_DTYPE;
    }
}

#endif /* KERNEL_PARITY_CPU_QUANT_H */
