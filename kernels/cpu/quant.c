/* quant.c — GGML block quantizers and dequantizers, byte-exact with ggml.
 *
 * quant_quantize: ggml's reference quantizers (quantize_row_<t>_ref), the ones llama-quantize runs
 * without an imatrix. Per block, in ggml's float32 operation order:
 *   Q4_0/Q5_0  d = max / -8 (-16), q = min(15 (31), trunc(x * (1/d) + 8.5 (16.5)))
 *   Q4_1/Q5_1  d = (max - min) / 15 (31), m = min, q = trunc((x - min) * (1/d) + 0.5)
 *   Q8_0/Q8_1  d = amax / 127, q = roundf(x / d) (half away from zero); Q8_1 s = fp16(d * sum q)
 *   Q8_K       iscale = -127 / max, q = nearest_int(iscale * x), d = 1 / iscale (fp32), bsums
 *   Q2_K/Q4_K/Q5_K  make_qkx2_quants per sub-block (weighted least-squares scale and min over a
 *              grid of trial inverse scales), 4/6-bit sub-scales, then the codes recomputed from
 *              the fp16-rounded d and dmin
 *   Q3_K       make_q3_quants (iterative weighted refit), 6-bit signed sub-scales, codes recomputed
 *   Q6_K       make_qx_quants (19 trial scales, weights x^2), int8 sub-scales, codes recomputed
 *   IQ4_NL     quantize_row_iq4_nl_ref (ntry = -1: no scale search; d = sum w q x / sum w q^2 with
 *              w = x^2, indices by nearest table value, exact ties to the higher index)
 * nearest_int is round half to even, fp16 stores round to nearest even.
 * Where ggml writes memory it never initialised, zeros are written here (as the golden refimpl/quant.py
 * does): the bsums of an all-zero Q8_K block, and the indices of an IQ4_NL block with max |x| < 1e-15
 * (d = 0; ggml leaves the previous block's indices, or stack contents in a row's first block).
 *
 * quant_dequantize: ggml's dequantize_row_<t> (float32): y = d * sc * (c - off) - dmin * mn in
 * which every product is exact in float32, so each output is one rounding of the exact value
 * (Q8_K: d * q, one rounding of an fp32 d). Q8_1 (no ggml dequantizer) gives d * q.
 *
 * Non-finite inputs give ggml's codes only where ggml's own arithmetic is defined; the float -> int
 * conversions ggml leaves undefined for NaN give unspecified codes here too.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant.h"

#define GROUP_MAX_EPS 1e-15f

KP_INLINE int imin(int a, int b) { return a < b ? a : b; }
KP_INLINE int imax(int a, int b) { return a > b ? a : b; }

/* ---- legacy 32-blocks ------------------------------------------------------------------------- */

/* amax and the signed value with the largest |x| (the first one on ties). */
KP_INLINE float signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        float a = fabsf(x[j]);
        if (amax < a) { amax = a; max = x[j]; }
    }
    return max;
}

static void quantize_q4_0(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 18) {
        const float d = signed_absmax(x, 32) / -8;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        for (int j = 0; j < 16; j++) {
            int q0 = imin(15, (int8_t)(x[j] * id + 8.5f));
            int q1 = imin(15, (int8_t)(x[j + 16] * id + 8.5f));
            y[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

KP_INLINE void min_max(const float *x, int n, float *mn, float *mx) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < n; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

static void quantize_q4_1(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 20) {
        float min, max;
        min_max(x, 32, &min, &max);
        const float d = (max - min) / 15;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        qt_wr16(y + 2, qt_f32_to_f16(min));
        for (int j = 0; j < 16; j++) {
            int q0 = imin(15, (int8_t)((x[j] - min) * id + 0.5f));
            int q1 = imin(15, (int8_t)((x[j + 16] - min) * id + 0.5f));
            y[4 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void quantize_q5_0(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 22) {
        const float d = signed_absmax(x, 32) / -16;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int q0 = imin(31, (int8_t)(x[j] * id + 16.5f));
            int q1 = imin(31, (int8_t)(x[j + 16] * id + 16.5f));
            y[6 + j] = (uint8_t)((q0 & 0xF) | ((q1 & 0xF) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + 16);
        }
        memcpy(y + 2, &qh, 4);
    }
}

static void quantize_q5_1(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 24) {
        float min, max;
        min_max(x, 32, &min, &max);
        const float d = (max - min) / 31;
        const float id = d ? 1.0f / d : 0.0f;
        qt_wr16(y, qt_f32_to_f16(d));
        qt_wr16(y + 2, qt_f32_to_f16(min));
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int q0 = (uint8_t)((x[j] - min) * id + 0.5f);
            int q1 = (uint8_t)((x[j + 16] - min) * id + 0.5f);
            y[8 + j] = (uint8_t)((q0 & 0xF) | ((q1 & 0xF) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + 16);
        }
        memcpy(y + 4, &qh, 4);
    }
}

/* ---- IQ4_NL ------------------------------------------------------------------------------------ */

/* Index of the table value nearest to x; exact ties go to the higher index. */
KP_INLINE int best_index_iq4nl(float x) {
    const int8_t *val = qt_kvalues_iq4nl;
    if (x <= val[0]) return 0;
    if (x >= val[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        int mav = (ml + mu) / 2;
        if (x < val[mav]) mu = mav; else ml = mav;
    }
    return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

static void quantize_iq4_nl(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 18) {
        uint8_t L[32] = {0};
        float weight[32], amax = 0.0f, max = 0.0f, d = 0.0f;
        for (int j = 0; j < 32; j++) weight[j] = x[j] * x[j];
        for (int j = 0; j < 32; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!(amax < GROUP_MAX_EPS)) {
            d = max / qt_kvalues_iq4nl[0];
            const float id = 1 / d;
            float sumqx = 0, sumq2 = 0;
            for (int j = 0; j < 32; j++) {
                int l = best_index_iq4nl(id * x[j]);
                L[j] = (uint8_t)l;
                float q = qt_kvalues_iq4nl[l], w = weight[j];
                sumqx += w * q * x[j];
                sumq2 += w * q * q;
            }
            d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        }
        qt_wr16(y, qt_f32_to_f16(d));
        for (int j = 0; j < 16; j++) y[2 + j] = (uint8_t)(L[j] | (L[16 + j] << 4));
    }
}

/* ---- K-quant searches (ggml-quants.c) ------------------------------------------------------------ */

/* make_qkx2_quants: x ~ scale * L - the_min, L in [0, nmax], weighted error (squared or absolute),
 * the_min >= 0; trial inverse scales (rmin + rdelta * is + nmax) / (max - min), is = 0..nstep. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              int use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = qt_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)imax(0, imin(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = qt_nearest_int(iscale * (x[i] - min));
            l = imax(0, imin(nmax, l));
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* make_q3_quants with do_rmse: L in [-nmax, nmax) refit coordinate-wise with weights x^2 (at most 5
 * sweeps); returns the least-squares scale, L shifted to [0, 2 nmax). */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = qt_nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = qt_nearest_int(x[i] * sl2 / slx);
                new_l = imax(-nmax, imin(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* make_qx_quants with rmse_type = 1 (weights x^2) and no imatrix: the best of 19 trial scales
 * -(nmax + 0.1 is) / max, is = -9..9; L shifted to [0, 2 nmax). */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = qt_nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = qt_nearest_int(iscale * x[i]);
            l = imax(-nmax, imin(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = qt_nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + imax(-nmax, imin(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* ---- K-quants ----------------------------------------------------------------------------------- */

static void quantize_q2_k(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 84) {
        uint8_t L[QK_K], Laux[16], *scales = y, *qs = y + 16;
        float weights[16], mins[16], sc[16], max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; ++j) {
            for (int l = 0; l < 16; ++l) weights[l] = fabsf(x[16 * j + l]);
            sc[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f,
                                     15, 1);
            if (sc[j] > max_scale) max_scale = sc[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; ++j) scales[j] = (uint8_t)qt_nearest_int(iscale * sc[j]);
            qt_wr16(y + 80, qt_f32_to_f16(max_scale / 15.f));
        } else {
            memset(scales, 0, 16);
            qt_wr16(y + 80, qt_f32_to_f16(0.f));
        }
        if (max_min > 0) {
            float iscale = 15.f / max_min;
            for (int j = 0; j < 16; ++j) scales[j] |= (uint8_t)(qt_nearest_int(iscale * mins[j]) << 4);
            qt_wr16(y + 82, qt_f32_to_f16(max_min / 15.f));
        } else {
            qt_wr16(y + 82, qt_f32_to_f16(0.f));
        }
        for (int j = 0; j < 16; ++j) {
            const float d = qt_f16(y + 80) * (scales[j] & 0xF);
            if (!d) continue;
            const float dm = qt_f16(y + 82) * (scales[j] >> 4);
            for (int ii = 0; ii < 16; ++ii) {
                int l = qt_nearest_int((x[16 * j + ii] + dm) / d);
                L[16 * j + ii] = (uint8_t)imax(0, imin(3, l));
            }
        }
        for (int j = 0; j < QK_K; j += 128)
            for (int l = 0; l < 32; ++l)
                qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4)
                                          | (L[j + l + 96] << 6));
    }
}

static void quantize_q3_k(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 110) {
        int8_t L[QK_K];
        uint8_t *hmask = y, *qs = y + 32, *scales = y + 96;
        float sc[16], max_scale = 0, amax = 0;
        for (int j = 0; j < 16; ++j) {
            sc[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
            float scale = fabsf(sc[j]);
            if (scale > amax) { amax = scale; max_scale = sc[j]; }
        }
        memset(scales, 0, 12);
        if (max_scale) {
            float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; ++j) {
                int8_t l = (int8_t)qt_nearest_int(iscale * sc[j]);
                l = (int8_t)(imax(-32, imin(31, l)) + 32);
                if (j < 8) scales[j] = l & 0xF;
                else scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                l >>= 4;
                scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
            }
            qt_wr16(y + 108, qt_f32_to_f16(1 / iscale));
        } else {
            qt_wr16(y + 108, qt_f32_to_f16(0.f));
        }
        for (int j = 0; j < 16; ++j) {
            int lo4 = j < 8 ? scales[j] & 0xF : scales[j - 8] >> 4;
            int s = (lo4 | (((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
            float d = qt_f16(y + 108) * s;
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = qt_nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(imax(-4, imin(3, l)) + 4);
            }
        }
        memset(hmask, 0, 32);
        for (int j = 0; j < QK_K; ++j)
            if (L[j] > 3) {
                hmask[j % 32] |= (uint8_t)(1 << (j / 32));
                L[j] -= 4;
            }
        for (int j = 0; j < QK_K; j += 128)
            for (int l = 0; l < 32; ++l)
                qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4)
                                          | (L[j + l + 96] << 6));
    }
}

/* Q4_K and Q5_K: identical but for nmax, the search grid and the fifth bit. */
KP_INLINE void quantize_q45_k(const float *x, uint8_t *y, int64_t nb, int five) {
    const int nmax = five ? 31 : 15, nstep = five ? 15 : 20, bytes = five ? 176 : 144;
    const float rmin = five ? -0.5f : -1.f;
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += bytes) {
        uint8_t L[QK_K], Laux[32], *scales = y + 4;
        float weights[32], mins[8], sc[8], max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
            float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
            sc[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f,
                                     nstep, 0);
            if (sc[j] > max_scale) max_scale = sc[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        for (int j = 0; j < 8; ++j) {
            uint8_t ls = (uint8_t)qt_nearest_int(inv_scale * sc[j]);
            uint8_t lm = (uint8_t)qt_nearest_int(inv_min * mins[j]);
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
            if (j < 4) {
                scales[j] = ls;
                scales[j + 4] = lm;
            } else {
                scales[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
                scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
                scales[j] |= (uint8_t)((lm >> 4) << 6);
            }
        }
        qt_wr16(y, qt_f32_to_f16(max_scale / 63.f));
        qt_wr16(y + 2, qt_f32_to_f16(max_min / 63.f));
        for (int j = 0; j < 8; ++j) {
            int32_t s, m;
            qt_scale_min_k4(j, scales, &s, &m);
            const float d = qt_f16(y) * s;
            if (!d) continue;
            const float dm = qt_f16(y + 2) * m;
            for (int ii = 0; ii < 32; ++ii) {
                int l = qt_nearest_int((x[32 * j + ii] + dm) / d);
                L[32 * j + ii] = (uint8_t)imax(0, imin(nmax, l));
            }
        }
        uint8_t *qh = y + 16, *q = y + (five ? 48 : 16);
        if (five) memset(qh, 0, 32);
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; ++l) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (five) {
                    qh[l] |= (uint8_t)(((l1 >> 4) << (j / 32)) | ((l2 >> 4) << (j / 32 + 1)));
                    l1 &= 0xF;
                    l2 &= 0xF;
                }
                q[l] = (uint8_t)(l1 | (l2 << 4));
            }
    }
}

static void quantize_q6_k(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 210) {
        int8_t L[QK_K], *scales = (int8_t *)(y + 192);
        float sc[16], max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ++ib) {
            sc[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
            float abs_scale = fabsf(sc[ib]);
            if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = sc[ib]; }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(y, 0, 210);
            continue;
        }
        float iscale = -128.f / max_scale;
        qt_wr16(y + 208, qt_f32_to_f16(1 / iscale));
        for (int ib = 0; ib < 16; ++ib) scales[ib] = (int8_t)imin(127, qt_nearest_int(iscale * sc[ib]));
        for (int j = 0; j < 16; ++j) {
            float d = qt_f16(y + 208) * scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = qt_nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(imax(-32, imin(31, l)) + 32);
            }
        }
        uint8_t *ql = y, *qh = y + 128;
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = (uint8_t)(q1 | (q3 << 4));
                ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                                  | ((L[j + l + 96] >> 4) << 6));
            }
    }
}

/* ---- entry points ------------------------------------------------------------------------------ */

KP_EXPORT int quant_block_size(int type, int *nbytes) { return qt_block_size(type, nbytes); }

/* Y[r] = quantize(X[r, 0:k]) for r < rows; strides: X in floats, Y in bytes. */
KP_EXPORT int quant_quantize(int type, const float *X_ptr, int64_t stride_x_row, uint8_t *Y_ptr,
                             int64_t stride_y_row, int64_t rows, int64_t k) {
    int nbytes, qk = qt_block_size(type, &nbytes);
    if (!qk) return KP_ERR_DTYPE;
    if (k % qk) return KP_ERR_SHAPE;
    const int64_t nb = k / qk;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = X_ptr + r * stride_x_row;
        uint8_t *y = Y_ptr + r * stride_y_row;
        switch (type) {
        case QT_Q4_0: quantize_q4_0(x, y, nb); break;
        case QT_Q4_1: quantize_q4_1(x, y, nb); break;
        case QT_Q5_0: quantize_q5_0(x, y, nb); break;
        case QT_Q5_1: quantize_q5_1(x, y, nb); break;
        case QT_Q8_0: qt_quantize_q8_0(x, y, nb); break;
        case QT_Q8_1: qt_quantize_q8_1(x, y, nb); break;
        case QT_IQ4_NL: quantize_iq4_nl(x, y, nb); break;
        case QT_Q2_K: quantize_q2_k(x, y, nb); break;
        case QT_Q3_K: quantize_q3_k(x, y, nb); break;
        case QT_Q4_K: quantize_q45_k(x, y, nb, 0); break;
        case QT_Q5_K: quantize_q45_k(x, y, nb, 1); break;
        case QT_Q6_K: quantize_q6_k(x, y, nb); break;
        case QT_Q8_K: qt_quantize_q8_k(x, y, nb); break;
        default: return KP_ERR_DTYPE;
        }
    }
    return KP_OK;
}

/* One block to float32: every product below is exact in fp32, the last operation rounds once. */
KP_INLINE void dequantize_block(int type, const qt_decoded *r, int qk, float *y) {
    const int off = qt_offset(type);
    if (qk == 32) {
        if (type == QT_Q4_1 || type == QT_Q5_1)
            for (int j = 0; j < 32; j++) y[j] = (float)r->c[j] * r->d + r->m;
        else
            for (int j = 0; j < 32; j++) y[j] = (float)(r->c[j] - off) * r->d;
        return;
    }
    if (type == QT_Q8_K) {
        for (int j = 0; j < QK_K; j++) y[j] = r->d * (float)(r->c[j] - off);
        return;
    }
    const int mins = type == QT_Q2_K || type == QT_Q4_K || type == QT_Q5_K;
    for (int s = 0; s < 16; s++) {
        const float dl = r->d * (float)r->sc[s];
        const float ml = r->m * (float)r->mn[s];
        const uint8_t *c = r->c + 16 * s;
        float *ys = y + 16 * s;
        if (mins)
            for (int l = 0; l < 16; l++) ys[l] = dl * (float)(c[l] - off) - ml;
        else   /* no "- 0": it would turn a -0 result into +0 where ggml keeps -0 */
            for (int l = 0; l < 16; l++) ys[l] = dl * (float)(c[l] - off);
    }
}

KP_INLINE int quant_dequantize_impl(int type, const uint8_t *Y_ptr, int64_t stride_y_row, float *X_ptr,
                                    int64_t stride_x_row, int64_t rows, int64_t k) {
    int nbytes, qk = qt_block_size(type, &nbytes);
    if (!qk) return KP_ERR_DTYPE;
    if (k % qk) return KP_ERR_SHAPE;
    const int64_t nb = k / qk;
    qt_decoded r;
    for (int64_t row = 0; row < rows; row++) {
        const uint8_t *y = Y_ptr + row * stride_y_row;
        float *x = X_ptr + row * stride_x_row;
        for (int64_t i = 0; i < nb; i++) {
            qt_decode(type, y + i * nbytes, &r);
            dequantize_block(type, &r, qk, x + i * qk);
        }
    }
    return KP_OK;
}

KP_MULTIVERSION(quant_dequantize,
                (int type, const uint8_t *Y_ptr, int64_t stride_y_row, float *X_ptr, int64_t stride_x_row,
                 int64_t rows, int64_t k),
                (type, Y_ptr, stride_y_row, X_ptr, stride_x_row, rows, k))
