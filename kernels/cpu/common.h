/* common.h — helpers shared by the kernels/cpu kernels.
 *
 * Everything here is branch-free (selects, not branches) so that a loop calling it auto-vectorises
 * at -O3 without -ffast-math; -ffast-math is never used because it lets the compiler assume no
 * inf/NaN, which breaks the -inf handling that masking relies on.
 *
 * - dtype codes (KP_F32, KP_F16, KP_BF16) and kp_load / kp_store, which widen to and round from fp32.
 * - fp16/bf16 <-> fp32 by bit manipulation: widening is exact; narrowing rounds to nearest, ties to
 *   even, including into the fp16 subnormals and overflow to inf. NaN bits follow NumPy (fp16: payload
 *   truncated, sign and signalling bit kept, never turned into inf) and ml_dtypes (bf16: quiet NaN
 *   0x7fc0 with the sign). Bit-exact against both: widening for all 65536 patterns, narrowing for
 *   all 2^32 float32 patterns.
 *   No _Float16 / __bf16: those depend on compiler and target support.
 * - kp_expf(x) (max error 0.99 ulp) and kp_exp_diff(a, b) = exp(a - b), with the rounding error of
 *   a - b folded back into the reduced argument (TwoSum), so exp(x - max) keeps ~1 ulp however far x
 *   is below the max (a plain exp of the rounded difference was 64 ulp off in the same test).
 * - KP_LANES: reductions run in 16 independent fp32 lanes. GCC/Clang vectorise that without
 *   -fassociative-math, and the result is bitwise the same whichever ISA path ran (with
 *   -ffp-contract=off no FMA is formed either).
 * - kp_v16 (generic 16-lane vectors) with kp_ld16, kp_ld16_bf16, kp_hsum16 and kp_hsum16x4, for
 *   register tiles.
 * - KP_MULTIVERSION: compiles a kernel body for AVX-512, AVX2 and baseline x86-64 in one object and
 *   picks one at run time with __builtin_cpu_supports; other architectures get the baseline body.
 */
#ifndef KERNEL_PARITY_CPU_COMMON_H
#define KERNEL_PARITY_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define KP_EXPORT __attribute__((visibility("default")))
#define KP_INLINE static inline __attribute__((always_inline))

enum { KP_F32 = 0, KP_F16 = 1, KP_BF16 = 2 };
enum { KP_OK = 0, KP_ERR_DTYPE = 1, KP_ERR_NOMEM = 2 };

enum { KP_LANES = 16 };  /* independent accumulators: one AVX-512 register, two AVX2, four SSE */

/* The loop over the lanes of one group. GCC: left rolled, so its loop vectoriser turns the group
 * into whole vector registers and keeps the accumulators in registers across the outer loop (fully
 * unrolled first, its SLP pass gives up on the selects and the max pass runs scalar). Clang's SLP
 * vectoriser handles the unrolled form. */
#if defined(__clang__)
#define KP_FOR_LANES(k) for (int k = 0; k < KP_LANES; k++)
#else
#define KP_FOR_LANES(k) _Pragma("GCC unroll 1") for (int k = 0; k < KP_LANES; k++)
#endif

KP_INLINE uint32_t kp_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
KP_INLINE float kp_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- fp16 / bf16 <-> fp32 ------------------------------------------------------------------ */

KP_INLINE float kp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;                                  /* exponent and mantissa */
    uint32_t normal = (em << 13) + ((127u - 15u) << 23);        /* rebias the exponent */
    uint32_t infnan = (em << 13) | 0x7f800000u;                 /* payload kept, as NumPy does */
    uint32_t sub = kp_bits((float)(int32_t)em * 0x1p-24f);      /* em * 2^-24 is exact in fp32 */
    uint32_t r = em >= 0x7c00u ? infnan : normal;
    r = em < 0x0400u ? sub : r;
    return kp_float(r | sign);
}

KP_INLINE uint16_t kp_f32_to_f16(float f) {
    uint32_t x = kp_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    /* normal: rebias, then add half an ulp minus one plus the lowest kept bit (ties to even); a carry
     * out of the mantissa bumps the exponent, which is also how 65520 and above become inf */
    uint32_t normal = (a - ((127u - 15u) << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    normal = normal > 0x7c00u ? 0x7c00u : normal;
    /* |f| < 2^-14: adding 0.5 puts the fp16 subnormal grid (2^-24) on fp32's ulp at 0.5, so the FPU's
     * own round-to-nearest-even does the rounding; the mantissa bits are then the fp16 code */
    uint32_t sub = kp_bits(kp_float(a) + 0.5f) - 0x3f000000u;
    uint32_t nan = 0x7c00u | ((a >> 13) & 0x03ffu);
    nan |= nan == 0x7c00u;                                      /* payload only in low bits: stay NaN */
    uint32_t r = a < 0x38800000u ? sub : normal;
    r = a > 0x7f800000u ? nan : r;
    return (uint16_t)(r | sign);
}

KP_INLINE float kp_bf16_to_f32(uint16_t h) { return kp_float((uint32_t)h << 16); }

KP_INLINE uint16_t kp_f32_to_bf16(float f) {
    uint32_t x = kp_bits(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;        /* ties to even; carries reach inf */
    uint32_t nan = ((x >> 16) & 0x8000u) | 0x7fc0u;             /* ml_dtypes: quiet NaN, sign kept */
    r = (x & 0x7fffffffu) > 0x7f800000u ? nan : r;
    return (uint16_t)r;
}

/* Element j of a row of dtype `dt`, widened to fp32. `dt` is a compile-time constant wherever this
 * is inlined, so the switch folds away before the vectoriser runs. */
KP_INLINE float kp_load(const void *p, int64_t j, int dt) {
    switch (dt) {
    case KP_F16: return kp_f16_to_f32(((const uint16_t *)p)[j]);
    case KP_BF16: return kp_bf16_to_f32(((const uint16_t *)p)[j]);
    default: return ((const float *)p)[j];
    }
}

KP_INLINE void kp_store(void *p, int64_t j, float v, int dt) {
    switch (dt) {
    case KP_F16: ((uint16_t *)p)[j] = kp_f32_to_f16(v); break;
    case KP_BF16: ((uint16_t *)p)[j] = kp_f32_to_bf16(v); break;
    default: ((float *)p)[j] = v;
    }
}

KP_INLINE int64_t kp_itemsize(int dt) { return dt == KP_F32 ? 4 : 2; }

/* ---- exp -------------------------------------------------------------------------------------- */

/* exp(hi + lo), |lo| <= ulp(hi)/2 the rounding error of hi. Cody-Waite reduction
 * hi = k ln2 + r, |r| <= ln2/2, Cephes' degree-7 polynomial for exp(r), and 2^k applied as two
 * power-of-two factors so that results in the subnormal range round once and k = 128 overflows
 * to inf. Clamping hi to [-104, 89] gives exactly 0 below exp's underflow threshold
 * (ln 2^-150 = -103.97) and for -inf, and inf above 88.72 and for +inf; NaN passes through.
 * Measured (GCC 12, x86-64; the ISA paths give identical bits): kp_expf max error 0.99 ulp over every float in
 * [-104, 89], subnormal results included, against exp in double (glibc expf: 0.50); exact 0, inf and
 * NaN at the specials. kp_exp_diff: max 1.11 ulp over 2e6 random pairs with a - b in [-110, 0]. */
KP_INLINE float kp_expf2(float hi, float lo) {
    const float shift = 0x1.8p23f;          /* adding 1.5 * 2^23 rounds to an integer in the low bits */
    const float ln2_hi = 0.693359375f;      /* 9 significant bits: k * ln2_hi is exact for |k| <= 150 */
    const float ln2_lo = -2.12194440e-4f;
    int in_range = hi > -104.0f && hi < 89.0f;
    float x = hi < -104.0f ? -104.0f : hi;
    x = x > 89.0f ? 89.0f : x;
    lo = in_range ? lo : 0.0f;
    float kf = x * 1.44269504f + shift;
    uint32_t kk = kp_bits(kf) - (0x4b400000u - 150u);   /* k + 150, in [0, 278] */
    kf -= shift;
    float r = (x - kf * ln2_hi) - kf * ln2_lo + lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    uint32_t k1 = kk >> 1, k2 = kk - k1;                  /* 2^k = 2^(k1-75) * 2^(k2-75) */
    float s1 = kp_float((k1 + 52u) << 23), s2 = kp_float((k2 + 52u) << 23);
    return (p * s1) * s2;
}

KP_INLINE float kp_expf(float x) { return kp_expf2(x, 0.0f); }

/* exp(a - b) with the rounding error of a - b recovered by TwoSum. The error term is computed on
 * operands zeroed where the result does not need it, so it forms no inf - inf of its own (and the
 * callers never pass b = -inf: an all -inf row or split set stops before any exp). */
KP_INLINE float kp_exp_diff(float a, float b) {
    float d = a - b;
    int use = d > -104.0f && d < 89.0f;
    float af = use ? a : 0.0f, bf = use ? -b : 0.0f;
    float s = af + bf, z = s - af;
    float err = (af - (s - z)) + (bf - z);
    return kp_expf2(d, err);
}

/* ---- lane reductions ------------------------------------------------------------------------- */

KP_INLINE float kp_lanes_max(const float *acc) {
    float m = acc[0];
    for (int k = 1; k < KP_LANES; k++) m = acc[k] > m ? acc[k] : m;
    return m;
}

/* ---- 16-lane generic vectors ---------------------------------------------------------------- */

/* KP_LANES fp32 lanes as a GCC/Clang generic vector: one zmm, two ymm or four xmm, each operation
 * lane-wise IEEE, so every ISA path gives the same bits. For register tiles (several dot products
 * or axpys in flight) whose accumulators the auto-vectoriser would keep in memory. */
typedef float kp_v16 __attribute__((vector_size(64)));
typedef float kp_v8 __attribute__((vector_size(32)));
typedef float kp_v4 __attribute__((vector_size(16)));
typedef uint16_t kp_u16x16 __attribute__((vector_size(32)));
typedef uint32_t kp_u32x16 __attribute__((vector_size(64)));
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"   /* the vector ABI note: these never cross a call */
#endif

KP_INLINE kp_v16 kp_ld16(const float *p) { kp_v16 v; memcpy(&v, p, sizeof v); return v; }
KP_INLINE void kp_st16(float *p, kp_v16 v) { memcpy(p, &v, sizeof v); }

/* 16 bf16 values widened to fp32 (exact: a shift). */
KP_INLINE kp_v16 kp_ld16_bf16(const uint16_t *p) {
    kp_u16x16 h;
    memcpy(&h, p, sizeof h);
    kp_u32x16 w = __builtin_convertvector(h, kp_u32x16) << 16;
    kp_v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* Lane sum in the fixed pairwise order of the KP_LANES reductions: lane k + 8, then + 4, + 2, + 1. */
KP_INLINE float kp_hsum16(kp_v16 a) {
    kp_v8 h = {a[0] + a[8], a[1] + a[9], a[2] + a[10], a[3] + a[11], a[4] + a[12], a[5] + a[13],
               a[6] + a[14], a[7] + a[15]};
    kp_v4 x = {h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]};
    return (x[0] + x[2]) + (x[1] + x[3]);
}

/* kp_hsum16 of four vectors at once, in the same order (so the same bits): 15 shuffles and adds
 * instead of four separate reductions' 36. */
KP_INLINE kp_v4 kp_hsum16x4(kp_v16 a0, kp_v16 a1, kp_v16 a2, kp_v16 a3) {
#if defined(__clang__) || __GNUC__ >= 12
#define KP_HALVES(a, b, o) __builtin_shufflevector(a, b, o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7, \
                                                   o + 16, o + 17, o + 18, o + 19, o + 20, o + 21, o + 22, o + 23)
#define KP_QUARTERS(a, b, o) __builtin_shufflevector(a, b, o, o + 1, o + 2, o + 3, o + 8, o + 9, o + 10, o + 11, \
                                                     o + 16, o + 17, o + 18, o + 19, o + 24, o + 25, o + 26, o + 27)
    kp_v16 t01 = KP_HALVES(a0, a1, 0) + KP_HALVES(a0, a1, 8);        /* lanes k + 8: a0 | a1 */
    kp_v16 t23 = KP_HALVES(a2, a3, 0) + KP_HALVES(a2, a3, 8);
    kp_v16 u = KP_QUARTERS(t01, t23, 0) + KP_QUARTERS(t01, t23, 4);  /* + 4: a0 | a1 | a2 | a3 */
    kp_v8 v = __builtin_shufflevector(u, u, 0, 1, 4, 5, 8, 9, 12, 13)
            + __builtin_shufflevector(u, u, 2, 3, 6, 7, 10, 11, 14, 15);
#undef KP_HALVES
#undef KP_QUARTERS
    return __builtin_shufflevector(v, v, 0, 2, 4, 6) + __builtin_shufflevector(v, v, 1, 3, 5, 7);
#else
    return (kp_v4){kp_hsum16(a0), kp_hsum16(a1), kp_hsum16(a2), kp_hsum16(a3)};
#endif
}

/* ---- ISA dispatch ---------------------------------------------------------------------------- */

/* Highest ISA path allowed: 2 AVX-512, 1 AVX2, 0 baseline. Tests lower it to check that every path
 * gives the same bits. Not synchronised: set it before calling kernels from several threads. */
static int kp_isa_cap = 2;

KP_EXPORT int kp_set_isa_cap(int cap) { kp_isa_cap = cap; return cap; }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
KP_EXPORT int kp_isa(void) {
    __builtin_cpu_init();
    if (kp_isa_cap >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl"))
        return 2;
    if (kp_isa_cap >= 1 && __builtin_cpu_supports("avx2")) return 1;
    return 0;
}
#define KP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2"), noinline))
#define KP_TARGET_AVX2 __attribute__((target("avx2"), noinline))
/* KP_MULTIVERSION(name, (params), (args)): defines the exported `name` calling `name##_impl`
 * (an always-inline body) compiled three times. Inlining a generic-target callee into a
 * target("avx2") caller is allowed, so the body is re-vectorised for each ISA. */
#define KP_MULTIVERSION(name, params, args)                                                    \
    KP_TARGET_AVX512 static int name##_avx512 params { return name##_impl args; }              \
    KP_TARGET_AVX2 static int name##_avx2 params { return name##_impl args; }                  \
    __attribute__((noinline)) static int name##_base params { return name##_impl args; }       \
    KP_EXPORT int name params {                                                                \
        switch (kp_isa()) {                                                                    \
        case 2: return name##_avx512 args;                                                     \
        case 1: return name##_avx2 args;                                                       \
        default: return name##_base args;                                                      \
        }                                                                                      \
    }
#else
KP_EXPORT int kp_isa(void) { return 0; }
#define KP_MULTIVERSION(name, params, args) KP_EXPORT int name params { return name##_impl args; }
#endif

#endif /* KERNEL_PARITY_CPU_COMMON_H */
