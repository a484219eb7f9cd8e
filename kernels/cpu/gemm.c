/* gemm.c — C = A @ W^T (+ bias) with W in a GGML format: the integer path of ggml's CPU backend.
 *
 *   C[m, n] = sum_b blk(n, m, b) (+ bias[n])     A: (M, K) float32, W: (N, K) quantized, C: (M, N)
 *
 * Each activation row is quantized with ggml's reference quantizer of the weight type's vec_dot type
 * (quant.h: Q8_0 for q4_0 q5_0 q8_0 iq4_nl, Q8_1 for q4_1 q5_1, Q8_K for the K-quants). Integer block
 * sums are exact (int32); float32 roundings happen exactly here, identically on every ISA path:
 *
 * 32-blocks (b = block of 32, da/dw/sa/mw fp16 widened, so dw * da and mw * sa are exact):
 *   isum_b = sum_i (cw_i - off) * qa_i                                    exact, |isum| < 2^20
 *   blk_b  = (dw_b * da_b) * float(isum_b)                      q4_0 q5_0 q8_0 iq4_nl: 1 rounding
 *   blk_b  = (dw_b * da_b) * float(isum_b) + mw_b * sa_b        q4_1 q5_1 (sa = fp16(da sum qa)): 2
 *   lane[b % 8] += blk_b in increasing b (8 fp32 lanes, all +0 at the start)
 *   C = ((lane0 + lane4) + (lane2 + lane6)) + ((lane1 + lane5) + (lane3 + lane7))
 * K-quants (b = super-block of 256, s = sub-block of 16, da fp32 from Q8_K, bsum_s = sum of 16 qa):
 *   isum_b = sum_s sc_s * (sum_{i in s} (cw_i - off) * qa_i)              exact int32
 *   msum_b = sum_s mn_s * bsum_s                        the bsums trick for the mins (q2_k q4_k q5_k)
 *   blk_b  = (dw_b * da_b) * float(isum_b) - (dmin_b * da_b) * float(msum_b)
 *            (q3_k q6_k: no min term); roundings: each product, float(isum) when |isum| > 2^24
 *            (float(msum) is exact), the subtraction
 *   C = ((0 + blk_0) + blk_1) + ... in increasing b
 * f32 weights: C = pairwise sum of 16 lanes (lane l = sum over k = l mod 16 of fl(a_k w_k), in order,
 *   for k < K - K % 16; order lane l + 8, + 4, + 2, + 1), then + the tail products in order.
 * bias: one more rounding, C + bias[n].
 * The offsets off (q4_0 8, q5_0 16, q3_k 4, q6_k 32, q8_0 and iq4_nl 128 as unsigned codes) are
 * folded in as off * sum(qa), exact.
 *
 * Layout. The activation rows (all M) and a chunk of weight rows (sized to stay in L2) are unpacked
 * once into panels of one byte per element, in an order that puts whole block sums in SIMD lanes:
 * 32-blocks in groups of 8 blocks, byte 32 q + 4 b + i = element 4 q + i of block b, so a 32-bit lane
 * of a dot-product instruction accumulates one block (lane = b % 8 above, no horizontal sum); a
 * K-quant super-block as byte 64 j + 4 s + i = element 16 s + 4 j + i, so lane s accumulates
 * sub-block s and one multiply applies the 16 scales. A register tile of 2 weight rows x 4
 * activation rows (or 8 x 1 for the single rows left over, and for GEMV) shares the loads.
 * ISA paths: AVX-512 VNNI (vpdpbusd: u8 x s8 summed in int32, no saturation), AVX2 (vpmaddubsw then
 * vpmaddwd; codes <= 63, or the sign trick for the 128-offset formats, keep the int16 pairs exact),
 * and scalar C. Integer sums are exact and the float operations above are the same lane-wise IEEE
 * operations on every path (no FMA: -ffp-contract=off and no fma intrinsics), so results are bitwise
 * identical whichever path runs. Single-threaded.
 */
#include <stdlib.h>

#include "quant.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMM_X86 1
#include <immintrin.h>
#else
#define GEMM_X86 0
#endif

enum { FAM_B32 = 0, FAM_KQ = 1 };
/* 32-block kinds: SUB subtracts off * sum(qa) (q4_0 q5_0 q8_0 iq4_nl); M adds mw * sa (q4_1 q5_1) */
enum { B32_SUB = 0, B32_M = 1 };
/* K-quant kinds: MIN (q2_k q4_k q5_k, off = 0) or OFF (q3_k q6_k, no mins) */
enum { KQ_MIN = 0, KQ_OFF = 1 };
enum { TILE_2x4 = 0, TILE_8x1 = 1 };

typedef struct {
    int type, qk, nbytes, off, fam, kind, act;
} wtraits;

static int wtraits_of(int type, wtraits *t) {
    t->type = type;
    t->qk = qt_block_size(type, &t->nbytes);
    t->off = qt_offset(type);
    switch (type) {
    case QT_Q4_0: case QT_Q5_0: case QT_Q8_0: case QT_IQ4_NL:
        t->fam = FAM_B32; t->kind = B32_SUB; t->act = QT_Q8_0; return KP_OK;
    case QT_Q4_1: case QT_Q5_1:
        t->fam = FAM_B32; t->kind = B32_M; t->act = QT_Q8_1; return KP_OK;
    case QT_Q2_K: case QT_Q4_K: case QT_Q5_K:
        t->fam = FAM_KQ; t->kind = KQ_MIN; t->act = QT_Q8_K; return KP_OK;
    case QT_Q3_K: case QT_Q6_K:
        t->fam = FAM_KQ; t->kind = KQ_OFF; t->act = QT_Q8_K; return KP_OK;
    default: return KP_ERR_DTYPE;
    }
}

/* One weight row / activation row of a panel. Per block b (32-blocks) or super-block b (K-quants):
 * weights: wc codes, dw scale, mw the min (q4_1 q5_1) or dmin (K-quants), sc/mn the 16 sub-block
 * scales and mins (K-quants); activations: qa codes, da scale, sa the Q8_1 sum, oas = off * sum(qa)
 * (per block or per sub-block), asum the Q8_K bsums. mn (<= 63) and asum (|.| <= 2032) are int16, so
 * one vpmaddwd gives the min products in 8 lanes. */
typedef struct {
    const uint8_t *wc;
    const int32_t *sc;
    const int16_t *mn;
    const float *dw, *mw;
    int64_t fs;   /* stride of dw/mw between blocks: 1 (32-blocks), the panel's rows (K-quants) */
} wrow;
typedef struct {
    const int8_t *qa;
    const int32_t *oas;
    const int16_t *asum;
    const float *da, *sa;
    int64_t fs;
} arow;

/* ---- scalar kernels (also the definition the SIMD paths reproduce) ------------------------------- */

static float b32_dot_scalar(int kind, const wrow *w, const arow *a, int64_t ngroups) {
    float lane[8] = {0};
    for (int64_t g = 0; g < ngroups; g++) {
        const uint8_t *wc = w->wc + 256 * g;
        const int8_t *qa = a->qa + 256 * g;
        for (int b = 0; b < 8; b++) {
            const int64_t blk = 8 * g + b;
            int32_t dot = 0;
            for (int q = 0; q < 8; q++)
                for (int i = 0; i < 4; i++) dot += (int32_t)wc[32 * q + 4 * b + i] * qa[32 * q + 4 * b + i];
            if (kind == B32_SUB) dot -= a->oas[blk];
            float r = (w->dw[blk] * a->da[blk]) * (float)dot;
            if (kind == B32_M) r = r + w->mw[blk] * a->sa[blk];
            lane[b] += r;
        }
    }
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

static float kq_dot_scalar(int kind, const wrow *w, const arow *a, int64_t nsb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *wc = w->wc + 256 * b;
        const int8_t *qa = a->qa + 256 * b;
        int32_t isum = 0, msum = 0;
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) dot += (int32_t)wc[64 * j + 4 * s + i] * qa[64 * j + 4 * s + i];
            if (kind == KQ_OFF) dot -= a->oas[16 * b + s];
            isum += w->sc[16 * b + s] * dot;
            if (kind == KQ_MIN) msum += w->mn[16 * b + s] * a->asum[16 * b + s];
        }
        const float dw = w->dw[b * w->fs], dmin = w->mw[b * w->fs], da = a->da[b * a->fs];
        float blk = (dw * da) * (float)isum;
        if (kind == KQ_MIN) blk = blk - (dmin * da) * (float)msum;
        acc = acc + blk;
    }
    return acc;
}

static void tiles_scalar(int fam, int tile, int kind, const wrow *w, const arow *a, int64_t nblk, float *out) {
    const int rn = tile == TILE_2x4 ? 2 : 8, rm = tile == TILE_2x4 ? 4 : 1;
    for (int n = 0; n < rn; n++)
        for (int m = 0; m < rm; m++)
            out[n * rm + m] = fam == FAM_B32 ? b32_dot_scalar(kind, &w[n], &a[m], nblk / 8)
                                             : kq_dot_scalar(kind, &w[n], &a[m], nblk);
}

#if GEMM_X86

/* (lane0 + lane4 + lane2 + lane6) + (...) in the order of b32_dot_scalar */
static inline float hsum8_ordered(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* ---- AVX2 ------------------------------------------------------------------------------------------ */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif

/* sum over 4-byte quads of w (u8) * a (s8), into 8 int32 lanes. SIGNED: w holds c ^ 0x80 with
 * c - 128 in [-128, 127]: |w| * sign(a, w) keeps each int16 pair <= 2 * 128 * 127. */
static inline __m256i dot32_avx2(__m256i w, __m256i a, int SIGNED) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (SIGNED) {
        __m256i v = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(a, v)), ones);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
}

static inline __attribute__((always_inline)) void b32_tile_avx2(const int RN, const int RM, const int kind,
                                                                const int SIGNED, const wrow *w, const arow *a,
                                                                int64_t ngroups, float *out) {
    __m256 acc[8];
    for (int o = 0; o < RN * RM; o++) acc[o] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m256i s[8];
        for (int o = 0; o < RN * RM; o++) s[o] = _mm256_setzero_si256();
        for (int q = 0; q < 8; q++) {
            __m256i wv[8], av[4];
            for (int n = 0; n < RN; n++) wv[n] = _mm256_loadu_si256((const __m256i *)(w[n].wc + 256 * g + 32 * q));
            for (int m = 0; m < RM; m++) av[m] = _mm256_loadu_si256((const __m256i *)(a[m].qa + 256 * g + 32 * q));
            for (int n = 0; n < RN; n++)
                for (int m = 0; m < RM; m++)
                    s[n * RM + m] = _mm256_add_epi32(s[n * RM + m], dot32_avx2(wv[n], av[m], SIGNED));
        }
        for (int n = 0; n < RN; n++)
            for (int m = 0; m < RM; m++) {
                __m256i is = s[n * RM + m];
                if (kind == B32_SUB && !SIGNED)
                    is = _mm256_sub_epi32(is, _mm256_loadu_si256((const __m256i *)(a[m].oas + 8 * g)));
                __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(w[n].dw + 8 * g), _mm256_loadu_ps(a[m].da + 8 * g));
                __m256 blk = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(is));
                if (kind == B32_M)
                    blk = _mm256_add_ps(blk, _mm256_mul_ps(_mm256_loadu_ps(w[n].mw + 8 * g),
                                                           _mm256_loadu_ps(a[m].sa + 8 * g)));
                acc[n * RM + m] = _mm256_add_ps(acc[n * RM + m], blk);
            }
    }
    for (int o = 0; o < RN * RM; o++) {
        float l[8];
        _mm256_storeu_ps(l, acc[o]);
        out[o] = hsum8_ordered(l);
    }
}

/* The scales of a tile's 8 outputs (o = n * RM + m) at super-block b: dw and dmin of its weight row,
 * da of its activation row. The tile's rows are consecutive panel rows and the K-quant scales are
 * stored block-major, so these are vector loads and broadcasts. */
static inline __attribute__((always_inline)) void tile_scales_avx2(const int RN, const wrow *w,
                                                                   const arow *a, int64_t b, __m256 *dw,
                                                                   __m256 *dm, __m256 *da) {
    const float *pw = w[0].dw + b * w[0].fs, *pm = w[0].mw + b * w[0].fs, *pa = a[0].da + b * a[0].fs;
    if (RN == 8) {
        *dw = _mm256_loadu_ps(pw);
        *dm = _mm256_loadu_ps(pm);
        *da = _mm256_set1_ps(pa[0]);
    } else {   /* 2 x 4 */
        *dw = _mm256_set_m128(_mm_set1_ps(pw[1]), _mm_set1_ps(pw[0]));
        *dm = _mm256_set_m128(_mm_set1_ps(pm[1]), _mm_set1_ps(pm[0]));
        __m128 x = _mm_loadu_ps(pa);
        *da = _mm256_set_m128(x, x);
    }
}

/* 8 vectors of 8 int32 -> their 8 sums (exact: any order) */
static inline __m256i hsum8x8_avx2(const __m256i *v) {
    __m256i h0 = _mm256_hadd_epi32(v[0], v[1]), h1 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h2 = _mm256_hadd_epi32(v[4], v[5]), h3 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i g0 = _mm256_hadd_epi32(h0, h1), g1 = _mm256_hadd_epi32(h2, h3);  /* lane half: v0..v3 */
    __m128i r0 = _mm_add_epi32(_mm256_castsi256_si128(g0), _mm256_extracti128_si256(g0, 1));
    __m128i r1 = _mm_add_epi32(_mm256_castsi256_si128(g1), _mm256_extracti128_si256(g1, 1));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
}

static inline __attribute__((always_inline)) void kq_tile_avx2(const int RN, const int RM, const int kind,
                                                               const wrow *w, const arow *a, int64_t nsb,
                                                               float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i vi[8], vm[8];
        for (int n = 0; n < RN; n++)
            for (int m = 0; m < RM; m++) {
                const int o = n * RM + m;
                const uint8_t *wc = w[n].wc + 256 * b;
                const int8_t *qa = a[m].qa + 256 * b;
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {   /* s0: sub-blocks 0..7, s1: 8..15 */
                    s0 = _mm256_add_epi32(s0, dot32_avx2(_mm256_loadu_si256((const __m256i *)(wc + 64 * j)),
                                                         _mm256_loadu_si256((const __m256i *)(qa + 64 * j)), 0));
                    s1 = _mm256_add_epi32(s1, dot32_avx2(_mm256_loadu_si256((const __m256i *)(wc + 64 * j + 32)),
                                                         _mm256_loadu_si256((const __m256i *)(qa + 64 * j + 32)), 0));
                }
                const int32_t *sc = w[n].sc + 16 * b;
                if (kind == KQ_OFF) {
                    s0 = _mm256_sub_epi32(s0, _mm256_loadu_si256((const __m256i *)(a[m].oas + 16 * b)));
                    s1 = _mm256_sub_epi32(s1, _mm256_loadu_si256((const __m256i *)(a[m].oas + 16 * b + 8)));
                }
                vi[o] = _mm256_add_epi32(_mm256_mullo_epi32(s0, _mm256_loadu_si256((const __m256i *)sc)),
                                         _mm256_mullo_epi32(s1, _mm256_loadu_si256((const __m256i *)(sc + 8))));
                if (kind == KQ_MIN)
                    vm[o] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w[n].mn + 16 * b)),
                                              _mm256_loadu_si256((const __m256i *)(a[m].asum + 16 * b)));
            }
        __m256 dwv, dmv, dav;
        tile_scales_avx2(RN, w, a, b, &dwv, &dmv, &dav);
        __m256 blk = _mm256_mul_ps(_mm256_mul_ps(dwv, dav), _mm256_cvtepi32_ps(hsum8x8_avx2(vi)));
        if (kind == KQ_MIN)
            blk = _mm256_sub_ps(blk, _mm256_mul_ps(_mm256_mul_ps(dmv, dav), _mm256_cvtepi32_ps(hsum8x8_avx2(vm))));
        acc = _mm256_add_ps(acc, blk);
    }
    _mm256_storeu_ps(out, acc);
}

/* The 32 codes of one 32-block of `type`, in element order (quant.h's qt_decode, vectorised). */
static inline __attribute__((always_inline)) __m256i b32_codes_avx2(const int type, const uint8_t *b) {
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    if (type == QT_Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    const int qs = type == QT_Q4_0 || type == QT_IQ4_NL ? 2 : type == QT_Q4_1 ? 4 : type == QT_Q5_0 ? 6 : 8;
    __m128i v = _mm_loadu_si128((const __m128i *)(b + qs));
    __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));
    if (type == QT_IQ4_NL) {
        const __m256i table = _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, (char)118, (char)129, (char)141,
                                               (char)153, (char)166, (char)181, (char)197, (char)217, (char)241,
                                               1, 24, 45, 63, 79, 93, 106, (char)118, (char)129, (char)141,
                                               (char)153, (char)166, (char)181, (char)197, (char)217, (char)241);
        return _mm256_shuffle_epi8(table, c);   /* kvalues_iq4nl + 128 */
    }
    if (type == QT_Q5_0 || type == QT_Q5_1) {   /* bit e of qh -> bit 4 of byte e */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qt_rd32(b + qs - 4)), spread), bit);
        c = _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(h, bit), _mm256_set1_epi8(0x10)));
    }
    return c;
}

/* Whole groups of 8 blocks into the 32-block panel layout (byte 32 q + 4 b + i = element 4 q + i of
 * block b): decode each block, then an 8 x 8 transpose of 32-bit quads. */
static inline __attribute__((always_inline)) void pack_b32_groups(const int type, int nbytes, const uint8_t *src,
                                                                   int64_t ngroups, uint8_t *q, float *dw, float *mw) {
    for (int64_t g = 0; g < ngroups; g++, src += 8 * nbytes, q += 256, dw += 8, mw += 8) {
        __m256i r[8], t[8], u[8];
        for (int l = 0; l < 8 * nbytes; l += 64) _mm_prefetch((const char *)src + 32 * nbytes + l, _MM_HINT_T0);
        for (int b = 0; b < 8; b++) {
            r[b] = b32_codes_avx2(type, src + b * nbytes);
            dw[b] = qt_f16(src + b * nbytes);
            mw[b] = type == QT_Q4_1 || type == QT_Q5_1 ? qt_f16(src + b * nbytes + 2) : 0.0f;
        }
        for (int b = 0; b < 8; b += 2) {
            t[b] = _mm256_unpacklo_epi32(r[b], r[b + 1]);
            t[b + 1] = _mm256_unpackhi_epi32(r[b], r[b + 1]);
        }
        for (int b = 0; b < 8; b += 4) {
            u[b] = _mm256_unpacklo_epi64(t[b], t[b + 2]);
            u[b + 1] = _mm256_unpackhi_epi64(t[b], t[b + 2]);
            u[b + 2] = _mm256_unpacklo_epi64(t[b + 1], t[b + 3]);
            u[b + 3] = _mm256_unpackhi_epi64(t[b + 1], t[b + 3]);
        }
        for (int j = 0; j < 4; j++) {   /* u[j]: quads j and j + 4 of blocks 0..3, u[j + 4]: of 4..7 */
            _mm256_storeu_si256((__m256i *)(q + 32 * j), _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(q + 32 * (j + 4)), _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
        }
    }
}

static void pack_b32_avx2(int type, int nbytes, const uint8_t *src, int64_t ngroups, uint8_t *q, float *dw,
                          float *mw) {
    switch (type) {
    case QT_Q4_0: pack_b32_groups(QT_Q4_0, nbytes, src, ngroups, q, dw, mw); break;
    case QT_Q4_1: pack_b32_groups(QT_Q4_1, nbytes, src, ngroups, q, dw, mw); break;
    case QT_Q5_0: pack_b32_groups(QT_Q5_0, nbytes, src, ngroups, q, dw, mw); break;
    case QT_Q5_1: pack_b32_groups(QT_Q5_1, nbytes, src, ngroups, q, dw, mw); break;
    case QT_Q8_0: pack_b32_groups(QT_Q8_0, nbytes, src, ngroups, q, dw, mw); break;
    case QT_IQ4_NL: pack_b32_groups(QT_IQ4_NL, nbytes, src, ngroups, q, dw, mw); break;
    default: break;
    }
}

/* The 256 codes of a K-quant super-block in element order, 32 per vector (quant.h's qt_decode,
 * vectorised; the per-byte shifts are 16-bit shifts with the stray bits masked off). */
static inline __attribute__((always_inline)) void kq_codes_avx2(const int type, const uint8_t *b, __m256i *c) {
    const __m256i m1 = _mm256_set1_epi8(1), m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(0x0F);
    if (type == QT_Q4_K || type == QT_Q5_K) {
        const uint8_t *qs = b + (type == QT_Q4_K ? 16 : 48);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int k = 0; k < 4; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
            c[2 * k] = _mm256_and_si256(v, m15);
            c[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        }
        if (type == QT_Q5_K)
            for (int t = 0; t < 8; t++)
                c[t] = _mm256_or_si256(c[t], _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(t)), m1), 4));
        return;
    }
    if (type == QT_Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i lo[4] = {_mm256_and_si256(l0, m15), _mm256_and_si256(l1, m15),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), _mm256_and_si256(_mm256_srli_epi16(l1, 4), m15)};
            for (int t = 0; t < 4; t++) {
                __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), m3);
                c[4 * h + t] = _mm256_or_si256(lo[t], _mm256_slli_epi16(hi, 4));
            }
        }
        return;
    }
    /* Q2_K, Q3_K: 2-bit fields of qs[32h + l] at bit 2t; Q3_K adds bit (e / 32) of hmask[l] as 4 */
    const uint8_t *qs = b + (type == QT_Q2_K ? 16 : 32);
    __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        for (int t = 0; t < 4; t++) {
            __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * t)), m3);
            if (type == QT_Q3_K)
                q = _mm256_or_si256(q, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * h + t)), m1), 2));
            c[4 * h + t] = q;
        }
    }
}

/* Whole super-blocks into the K-quant panel layout (byte 64 j + 4 s + i = element 16 s + 4 j + i).
 * Vector t holds sub-blocks 2t and 2t + 1 in its two 128-bit lanes, four quads each: a 4 x 4
 * transpose inside the lanes gives quad j of sub-blocks (0 2 4 6 | 1 3 5 7), one permute orders them. */
static inline __attribute__((always_inline)) void pack_kq_blocks(const int type, int nbytes, const uint8_t *src,
                                                                  int64_t nsb, uint8_t *q, int32_t *sc, int16_t *mn,
                                                                  float *dw, float *mw, int64_t fs) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    qt_decoded d;
    for (int64_t b = 0; b < nsb; b++, src += nbytes, q += 256, sc += 16, mn += 16) {
        __m256i c[8];
        for (int l = 0; l < nbytes; l += 64) _mm_prefetch((const char *)src + 16 * nbytes + l, _MM_HINT_T0);
        kq_codes_avx2(type, src, c);
        for (int half = 0; half < 2; half++) {
            const __m256i *r = c + 4 * half;
            __m256i a0 = _mm256_unpacklo_epi32(r[0], r[1]), a1 = _mm256_unpackhi_epi32(r[0], r[1]);
            __m256i a2 = _mm256_unpacklo_epi32(r[2], r[3]), a3 = _mm256_unpackhi_epi32(r[2], r[3]);
            __m256i t[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2),
                            _mm256_unpacklo_epi64(a1, a3), _mm256_unpackhi_epi64(a1, a3)};
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i *)(q + 64 * j + 32 * half), _mm256_permutevar8x32_epi32(t[j], order));
        }
        qt_decode_kscales(type, src, &d);
        memcpy(sc, d.sc, 64);
        for (int s = 0; s < 16; s++) mn[s] = (int16_t)d.mn[s];
        dw[b * fs] = d.d;
        mw[b * fs] = d.m;
    }
}

static void pack_kq_avx2(int type, int nbytes, const uint8_t *src, int64_t nsb, uint8_t *q, int32_t *sc, int16_t *mn,
                         float *dw, float *mw, int64_t fs) {
    switch (type) {
    case QT_Q2_K: pack_kq_blocks(QT_Q2_K, nbytes, src, nsb, q, sc, mn, dw, mw, fs); break;
    case QT_Q3_K: pack_kq_blocks(QT_Q3_K, nbytes, src, nsb, q, sc, mn, dw, mw, fs); break;
    case QT_Q4_K: pack_kq_blocks(QT_Q4_K, nbytes, src, nsb, q, sc, mn, dw, mw, fs); break;
    case QT_Q5_K: pack_kq_blocks(QT_Q5_K, nbytes, src, nsb, q, sc, mn, dw, mw, fs); break;
    case QT_Q6_K: pack_kq_blocks(QT_Q6_K, nbytes, src, nsb, q, sc, mn, dw, mw, fs); break;
    default: break;
    }
}

static void tiles_avx2(int fam, int tile, int kind, int off, const wrow *w, const arow *a, int64_t nblk,
                       float *out) {
    if (fam == FAM_B32) {
        const int64_t ng = nblk / 8;
        const int sign = off == 128;
        if (tile == TILE_2x4) {
            if (kind == B32_M) b32_tile_avx2(2, 4, B32_M, 0, w, a, ng, out);
            else if (sign) b32_tile_avx2(2, 4, B32_SUB, 1, w, a, ng, out);
            else b32_tile_avx2(2, 4, B32_SUB, 0, w, a, ng, out);
        } else {
            if (kind == B32_M) b32_tile_avx2(8, 1, B32_M, 0, w, a, ng, out);
            else if (sign) b32_tile_avx2(8, 1, B32_SUB, 1, w, a, ng, out);
            else b32_tile_avx2(8, 1, B32_SUB, 0, w, a, ng, out);
        }
    } else {
        if (tile == TILE_2x4) {
            if (kind == KQ_MIN) kq_tile_avx2(2, 4, KQ_MIN, w, a, nblk, out);
            else kq_tile_avx2(2, 4, KQ_OFF, w, a, nblk, out);
        } else {
            if (kind == KQ_MIN) kq_tile_avx2(8, 1, KQ_MIN, w, a, nblk, out);
            else kq_tile_avx2(8, 1, KQ_OFF, w, a, nblk, out);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* ---- AVX-512 VNNI --------------------------------------------------------------------------------- */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2")
#endif

static inline __attribute__((always_inline)) void b32_tile_512(const int RN, const int RM, const int kind,
                                                               const wrow *w, const arow *a, int64_t ngroups,
                                                               float *out) {
    __m256 acc[8];
    for (int o = 0; o < RN * RM; o++) acc[o] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m512i s[8];
        for (int o = 0; o < RN * RM; o++) s[o] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i wv[8], av[4];
            for (int n = 0; n < RN; n++) wv[n] = _mm512_loadu_si512(w[n].wc + 256 * g + 64 * j);
            for (int m = 0; m < RM; m++) av[m] = _mm512_loadu_si512(a[m].qa + 256 * g + 64 * j);
            for (int n = 0; n < RN; n++)
                for (int m = 0; m < RM; m++) s[n * RM + m] = _mm512_dpbusd_epi32(s[n * RM + m], wv[n], av[m]);
        }
        for (int n = 0; n < RN; n++)
            for (int m = 0; m < RM; m++) {
                const __m512i v = s[n * RM + m];   /* lanes b and b + 8: quads of block b */
                __m256i is = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
                if (kind == B32_SUB) is = _mm256_sub_epi32(is, _mm256_loadu_si256((const __m256i *)(a[m].oas + 8 * g)));
                __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(w[n].dw + 8 * g), _mm256_loadu_ps(a[m].da + 8 * g));
                __m256 blk = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(is));
                if (kind == B32_M)
                    blk = _mm256_add_ps(blk, _mm256_mul_ps(_mm256_loadu_ps(w[n].mw + 8 * g),
                                                           _mm256_loadu_ps(a[m].sa + 8 * g)));
                acc[n * RM + m] = _mm256_add_ps(acc[n * RM + m], blk);
            }
    }
    for (int o = 0; o < RN * RM; o++) {
        float l[8];
        _mm256_storeu_ps(l, acc[o]);
        out[o] = hsum8_ordered(l);
    }
}

/* 8 vectors of 16 int32 -> their 8 sums (exact: any order) */
static inline __m256i hsum8x16_512(const __m512i *v) {
    __m512i u[4], t[2];
    for (int k = 0; k < 4; k++)   /* 128-bit lanes: v2k (L0+L2, L1+L3), v2k+1 (same) */
        u[k] = _mm512_add_epi32(_mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_i64x2(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++)   /* 128-bit lane l: 4 partial sums of v[4k + l] */
        t[k] = _mm512_add_epi32(_mm512_shuffle_i64x2(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i64x2(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(t[0], t[1]), _mm512_unpackhi_epi32(t[0], t[1]));
    x = _mm512_add_epi32(x, _mm512_shuffle_epi32(x, _MM_PERM_BADC));   /* lane l: v[l], v[4 + l] */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, x));
}

static inline __attribute__((always_inline)) void kq_tile_512(const int RN, const int RM, const int kind,
                                                              const wrow *w, const arow *a, int64_t nsb,
                                                              float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m512i s[8];
        __m256i vm[8];
        for (int o = 0; o < RN * RM; o++) s[o] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i wv[8], av[4];
            for (int n = 0; n < RN; n++) wv[n] = _mm512_loadu_si512(w[n].wc + 256 * b + 64 * j);
            for (int m = 0; m < RM; m++) av[m] = _mm512_loadu_si512(a[m].qa + 256 * b + 64 * j);
            for (int n = 0; n < RN; n++)
                for (int m = 0; m < RM; m++) s[n * RM + m] = _mm512_dpbusd_epi32(s[n * RM + m], wv[n], av[m]);
        }
        for (int n = 0; n < RN; n++)
            for (int m = 0; m < RM; m++) {
                const int o = n * RM + m;
                __m512i t = s[o];   /* lane s: the dot product of sub-block s */
                if (kind == KQ_OFF) t = _mm512_sub_epi32(t, _mm512_loadu_si512(a[m].oas + 16 * b));
                s[o] = _mm512_mullo_epi32(t, _mm512_loadu_si512(w[n].sc + 16 * b));
                if (kind == KQ_MIN)
                    vm[o] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w[n].mn + 16 * b)),
                                              _mm256_loadu_si256((const __m256i *)(a[m].asum + 16 * b)));
            }
        __m256 dwv, dmv, dav;
        tile_scales_avx2(RN, w, a, b, &dwv, &dmv, &dav);
        __m256 blk = _mm256_mul_ps(_mm256_mul_ps(dwv, dav), _mm256_cvtepi32_ps(hsum8x16_512(s)));
        if (kind == KQ_MIN)
            blk = _mm256_sub_ps(blk, _mm256_mul_ps(_mm256_mul_ps(dmv, dav), _mm256_cvtepi32_ps(hsum8x8_avx2(vm))));
        acc = _mm256_add_ps(acc, blk);
    }
    _mm256_storeu_ps(out, acc);
}

static void tiles_512(int fam, int tile, int kind, const wrow *w, const arow *a, int64_t nblk, float *out) {
    if (fam == FAM_B32) {
        const int64_t ng = nblk / 8;
        if (tile == TILE_2x4) {
            if (kind == B32_M) b32_tile_512(2, 4, B32_M, w, a, ng, out);
            else b32_tile_512(2, 4, B32_SUB, w, a, ng, out);
        } else {
            if (kind == B32_M) b32_tile_512(8, 1, B32_M, w, a, ng, out);
            else b32_tile_512(8, 1, B32_SUB, w, a, ng, out);
        }
    } else {
        if (tile == TILE_2x4) {
            if (kind == KQ_MIN) kq_tile_512(2, 4, KQ_MIN, w, a, nblk, out);
            else kq_tile_512(2, 4, KQ_OFF, w, a, nblk, out);
        } else {
            if (kind == KQ_MIN) kq_tile_512(8, 1, KQ_MIN, w, a, nblk, out);
            else kq_tile_512(8, 1, KQ_OFF, w, a, nblk, out);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif /* GEMM_X86 */

/* 2: AVX-512 with VNNI, 1: AVX2, 0: scalar; kp_set_isa_cap (common.h) lowers it for tests. */
KP_EXPORT int gemm_isa(void) {
#if GEMM_X86
    int isa = kp_isa();
    if (isa == 2 && !__builtin_cpu_supports("avx512vnni")) isa = 1;
    return isa;
#else
    return 0;
#endif
}

static void run_tiles(int isa, const wtraits *t, int tile, const wrow *w, const arow *a, int64_t nblk, float *out) {
#if GEMM_X86
    if (isa == 2) { tiles_512(t->fam, tile, t->kind, w, a, nblk, out); return; }
    if (isa == 1) { tiles_avx2(t->fam, tile, t->kind, t->off, w, a, nblk, out); return; }
#endif
    (void)isa;
    tiles_scalar(t->fam, tile, t->kind, w, a, nblk, out);
}

/* ---- panels -------------------------------------------------------------------------------------- */

typedef struct {
    int64_t rows, nblk, stride;   /* nblk: blocks per row (32-blocks: padded to a multiple of 8) */
    uint8_t *q;                   /* codes, stride bytes per row */
    int32_t *i0;                  /* weights: sc; activations: oas (g per block) */
    int16_t *i1;                  /* weights: mn; activations: asum (g per block) */
    float *f0, *f1;               /* weights: dw, mw; activations: da, sa */
    int g;                        /* ints per block: 1 (32-blocks, oas only) or 16 (K-quants) */
    int64_t fs;                   /* float stride between blocks, see fidx */
} panel;

static void *alloc64(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, n ? n : 64) ? NULL : p;
}

static void panel_free(panel *p) {
    free(p->q); free(p->i0); free(p->i1); free(p->f0); free(p->f1);
    p->q = NULL; p->i0 = NULL; p->i1 = NULL; p->f0 = p->f1 = NULL;
}

/* rows is rounded up to a multiple of 8 and everything zeroed, so a tile may read the rows past the
 * last real one (its outputs there are discarded). */
static int panel_alloc(panel *p, int64_t rows, int64_t nblk, int fam) {
    rows = (rows + 7) / 8 * 8;
    p->rows = rows;
    p->nblk = nblk;
    p->g = fam == FAM_KQ ? 16 : 1;
    p->fs = fam == FAM_KQ ? rows : 1;
    p->stride = nblk * (fam == FAM_KQ ? 256 : 32);
    const size_t nb = (size_t)(rows * nblk), sizes[5] = {(size_t)(rows * p->stride), nb * (size_t)p->g * 4,
                                                        nb * (size_t)p->g * 2, nb * 4, nb * 4};
    void **ptrs[5] = {(void **)&p->q, (void **)&p->i0, (void **)&p->i1, (void **)&p->f0, (void **)&p->f1};
    int ok = 1;
    for (int i = 0; i < 5; i++) {
        *ptrs[i] = alloc64(sizes[i]);
        if (*ptrs[i]) memset(*ptrs[i], 0, sizes[i]);
        ok &= *ptrs[i] != NULL;
    }
    if (!ok) {
        panel_free(p);
        return KP_ERR_NOMEM;
    }
    return KP_OK;
}

/* Float scales: [row][block] for 32-blocks (8 blocks fill a vector), [block][row] for K-quants
 * (a tile's rows fill a vector). */
KP_INLINE int64_t fidx(const panel *p, int64_t r, int64_t b) { return p->fs == 1 ? r * p->nblk + b : b * p->rows + r; }

/* 32-blocks: element 4 q + i of block b (of its group of 8) -> byte 32 q + 4 b + i */
KP_INLINE void put_b32(uint8_t *group, int b, const uint8_t *c) {
    for (int q = 0; q < 8; q++) memcpy(group + 32 * q + 4 * b, c + 4 * q, 4);
}

/* K-quants: element 16 s + 4 j + i -> byte 64 j + 4 s + i */
KP_INLINE void put_kq(uint8_t *dst, const uint8_t *c) {
    for (int s = 0; s < 16; s++)
        for (int j = 0; j < 4; j++) memcpy(dst + 64 * j + 4 * s, c + 16 * s + 4 * j, 4);
}

/* Activation row r of the panel from x[0:K]; tmp holds one quantized row. */
KP_INLINE void pack_act_row(const wtraits *t, panel *p, int64_t r, const float *x, int64_t k, uint8_t *tmp) {
    uint8_t *q = p->q + r * p->stride;
    int32_t *oas = p->i0 + r * p->nblk * p->g;
    int16_t *asum = p->i1 + r * p->nblk * p->g;
    float *da = p->f0, *sa = p->f1;
    if (t->fam == FAM_KQ) {
        const int64_t nsb = k / QK_K;
        qt_quantize_q8_k(x, tmp, nsb);
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = tmp + 292 * b;
            memcpy(&da[fidx(p, r, b)], blk, 4);
            put_kq(q + 256 * b, blk + 4);
            for (int s = 0; s < 16; s++) {
                int32_t sum = 0;
                for (int i = 0; i < 16; i++) sum += (int8_t)blk[4 + 16 * s + i];
                asum[16 * b + s] = (int16_t)sum;
                oas[16 * b + s] = t->off * sum;
            }
        }
        return;
    }
    const int64_t nb = k / 32;
    const int bytes = t->act == QT_Q8_1 ? 36 : 34, qs = t->act == QT_Q8_1 ? 4 : 2;
    if (t->act == QT_Q8_1) qt_quantize_q8_1(x, tmp, nb);
    else qt_quantize_q8_0(x, tmp, nb);
    memset(q + nb * 32 - (nb % 8) * 32, 0, (size_t)(p->stride - (nb - nb % 8) * 32));
    for (int64_t b = 0; b < p->nblk; b++) {
        if (b >= nb) {   /* padding: codes 0, scales 0, so the block adds -0.0 (a no-op) */
            da[fidx(p, r, b)] = sa[fidx(p, r, b)] = 0.0f;
            oas[b] = asum[b] = 0;
            continue;
        }
        const uint8_t *blk = tmp + bytes * b;
        da[fidx(p, r, b)] = qt_f16(blk);
        sa[fidx(p, r, b)] = t->act == QT_Q8_1 ? qt_f16(blk + 2) : 0.0f;
        put_b32(q + 256 * (b / 8), (int)(b % 8), blk + qs);
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) sum += (int8_t)blk[qs + i];
        asum[b] = (int16_t)sum;
        oas[b] = t->off * sum;
    }
}

/* Weight row r of the panel from the quantized row src. With AVX2, K-quant super-blocks and the
 * whole groups of 8 blocks of a 32-block format go through pack_kq_avx2 / pack_b32_avx2 (the same
 * bytes; a GEMV spends most of its time here). */
KP_INLINE void pack_w_row(const wtraits *t, panel *p, int64_t r, const uint8_t *src, int64_t k, int isa) {
    uint8_t *q = p->q + r * p->stride;
    int32_t *sc = p->i0 + r * p->nblk * p->g;
    int16_t *mn = p->i1 + r * p->nblk * p->g;
    float *dw = p->f0, *mw = p->f1;
    qt_decoded d;
    if (t->fam == FAM_KQ) {
#if GEMM_X86
        if (isa >= 1) {
            pack_kq_avx2(t->type, t->nbytes, src, k / QK_K, q, sc, mn, dw + fidx(p, r, 0), mw + fidx(p, r, 0), p->fs);
            return;
        }
#endif
        for (int64_t b = 0; b < k / QK_K; b++) {
            qt_decode(t->type, src + t->nbytes * b, &d);
            put_kq(q + 256 * b, d.c);
            memcpy(sc + 16 * b, d.sc, 64);
            for (int s = 0; s < 16; s++) mn[16 * b + s] = (int16_t)d.mn[s];
            dw[fidx(p, r, b)] = d.d;
            mw[fidx(p, r, b)] = d.m;
        }
        return;
    }
    const int64_t nb = k / 32;
    int64_t b0 = 0;
#if GEMM_X86
    if (isa >= 1) {
        b0 = nb - nb % 8;
        pack_b32_avx2(t->type, t->nbytes, src, b0 / 8, q, dw + fidx(p, r, 0), mw + fidx(p, r, 0));
    }
#endif
    (void)isa;
    memset(q + nb * 32 - (nb % 8) * 32, 0, (size_t)(p->stride - (nb - nb % 8) * 32));
    for (int64_t b = b0; b < p->nblk; b++) {
        if (b >= nb) {
            dw[fidx(p, r, b)] = mw[fidx(p, r, b)] = -0.0f;
            continue;
        }
        qt_decode(t->type, src + t->nbytes * b, &d);
        put_b32(q + 256 * (b / 8), (int)(b % 8), d.c);
        dw[fidx(p, r, b)] = d.d;
        mw[fidx(p, r, b)] = d.m;
    }
}

KP_INLINE wrow wrow_of(const panel *p, int64_t r) {
    wrow w = {p->q + r * p->stride, p->i0 + r * p->nblk * p->g, p->i1 + r * p->nblk * p->g,
              p->f0 + fidx(p, r, 0), p->f1 + fidx(p, r, 0), p->fs};
    return w;
}

KP_INLINE arow arow_of(const panel *p, int64_t r) {
    arow a = {(const int8_t *)(p->q + r * p->stride), p->i0 + r * p->nblk * p->g, p->i1 + r * p->nblk * p->g,
              p->f0 + fidx(p, r, 0), p->f1 + fidx(p, r, 0), p->fs};
    return a;
}

/* ---- driver -------------------------------------------------------------------------------------- */

enum { L2_PANEL_BYTES = 384 * 1024 };

KP_INLINE int gemm_q_kernel_impl(int type, const float *A_ptr, int64_t stride_a_row, const uint8_t *W_ptr,
                                 int64_t stride_w_row, const float *bias, float *C_ptr, int64_t stride_c_row,
                                 int64_t M, int64_t N, int64_t K) {
    wtraits t;
    if (wtraits_of(type, &t) != KP_OK) return KP_ERR_DTYPE;
    if (K % t.qk) return KP_ERR_SHAPE;
    if (M <= 0 || N <= 0) return KP_OK;
    const int isa = gemm_isa();
    const int64_t nblk = t.fam == FAM_KQ ? K / QK_K : (K / 32 + 7) / 8 * 8;
    const int64_t row_bytes = nblk * (t.fam == FAM_KQ ? 256 + 2 * 64 + 8 : 32 + 16);
    int64_t nc = L2_PANEL_BYTES / (row_bytes ? row_bytes : 1);
    nc = nc < 8 ? 8 : nc - nc % 8;
    nc = nc > N ? N : nc;
    panel ap, wp;
    uint8_t *tmp = alloc64((size_t)(t.fam == FAM_KQ ? K / QK_K * 292 : K / 32 * 36));   /* one quantized row */
    if (!tmp) return KP_ERR_NOMEM;
    if (panel_alloc(&ap, M, nblk, t.fam) != KP_OK) { free(tmp); return KP_ERR_NOMEM; }
    if (panel_alloc(&wp, nc, nblk, t.fam) != KP_OK) { panel_free(&ap); free(tmp); return KP_ERR_NOMEM; }
    for (int64_t m = 0; m < M; m++) pack_act_row(&t, &ap, m, A_ptr + m * stride_a_row, K, tmp);
    free(tmp);
    for (int64_t n0 = 0; n0 < N; n0 += nc) {
        const int64_t nn = N - n0 < nc ? N - n0 : nc;
        for (int64_t r = 0; r < nn; r++) pack_w_row(&t, &wp, r, W_ptr + (n0 + r) * stride_w_row, K, isa);
        const int64_t m4 = M - M % 4;
        for (int64_t m0 = 0; m0 < M; m0 += (m0 < m4 ? 4 : 1)) {
            const int tile = m0 < m4 ? TILE_2x4 : TILE_8x1;
            const int rn = tile == TILE_2x4 ? 2 : 8, rm = tile == TILE_2x4 ? 4 : 1;
            arow a[4];
            for (int m = 0; m < rm; m++) a[m] = arow_of(&ap, m0 + m);
            for (int64_t r0 = 0; r0 < nn; r0 += rn) {
                wrow w[8];
                float out[8];
                for (int n = 0; n < rn; n++) w[n] = wrow_of(&wp, r0 + n);   /* rows >= nn: padding or stale, outputs discarded */
                run_tiles(isa, &t, tile, w, a, nblk, out);
                for (int n = 0; n < rn && r0 + n < nn; n++) {
                    const float bn = bias ? bias[n0 + r0 + n] : 0.0f;
                    for (int m = 0; m < rm; m++) {
                        float v = out[n * rm + m];
                        C_ptr[(m0 + m) * stride_c_row + n0 + r0 + n] = bias ? v + bn : v;
                    }
                }
            }
        }
    }
    panel_free(&ap);
    panel_free(&wp);
    return KP_OK;
}

KP_MULTIVERSION(gemm_q_kernel,
                (int type, const float *A_ptr, int64_t stride_a_row, const uint8_t *W_ptr, int64_t stride_w_row,
                 const float *bias, float *C_ptr, int64_t stride_c_row, int64_t M, int64_t N, int64_t K),
                (type, A_ptr, stride_a_row, W_ptr, stride_w_row, bias, C_ptr, stride_c_row, M, N, K))

/* ---- float32 weights ----------------------------------------------------------------------------- */

KP_INLINE float f32_finish(const kp_v16 *acc, const float *a, const float *w, int64_t k0, int64_t k) {
    float r = kp_hsum16(*acc);
    for (int64_t i = k0; i < k; i++) r += a[i] * w[i];
    return r;
}

/* A 2 (weights) x 4 (activations) register tile of 16-lane accumulators. */
KP_INLINE void f32_tile(const float *const *w, const float *const *a, int64_t k, float *out) {
    kp_v16 acc[2][4];
    for (int n = 0; n < 2; n++)
        for (int m = 0; m < 4; m++) acc[n][m] = (kp_v16){0};
    const int64_t kv = k - k % KP_LANES;
    for (int64_t i = 0; i < kv; i += KP_LANES) {
        kp_v16 wv0 = kp_ld16(w[0] + i), wv1 = kp_ld16(w[1] + i);
        for (int m = 0; m < 4; m++) {
            kp_v16 av = kp_ld16(a[m] + i);
            acc[0][m] += wv0 * av;
            acc[1][m] += wv1 * av;
        }
    }
    for (int n = 0; n < 2; n++)
        for (int m = 0; m < 4; m++) out[n * 4 + m] = f32_finish(&acc[n][m], a[m], w[n], kv, k);
}

KP_INLINE int gemm_f32_kernel_impl(const float *A_ptr, int64_t stride_a_row, const float *W_ptr,
                                   int64_t stride_w_row, const float *bias, float *C_ptr, int64_t stride_c_row,
                                   int64_t M, int64_t N, int64_t K) {
    enum { NB = 64 };   /* weight rows per pass, so they stay in L2 while every activation row goes by */
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        const int64_t n1 = N - n0 < NB ? N : n0 + NB;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const float *a[4];
            for (int m = 0; m < 4; m++) a[m] = A_ptr + (m0 + m < M ? m0 + m : M - 1) * stride_a_row;
            for (int64_t n = n0; n < n1; n += 2) {
                const float *w[2] = {W_ptr + n * stride_w_row, W_ptr + (n + 1 < n1 ? n + 1 : n) * stride_w_row};
                float out[8];
                f32_tile(w, a, K, out);
                for (int j = 0; j < 2 && n + j < n1; j++)
                    for (int m = 0; m < 4 && m0 + m < M; m++) {
                        float v = out[j * 4 + m];
                        C_ptr[(m0 + m) * stride_c_row + n + j] = bias ? v + bias[n + j] : v;
                    }
            }
        }
    }
    return KP_OK;
}

KP_MULTIVERSION(gemm_f32_kernel,
                (const float *A_ptr, int64_t stride_a_row, const float *W_ptr, int64_t stride_w_row,
                 const float *bias, float *C_ptr, int64_t stride_c_row, int64_t M, int64_t N, int64_t K),
                (A_ptr, stride_a_row, W_ptr, stride_w_row, bias, C_ptr, stride_c_row, M, N, K))
