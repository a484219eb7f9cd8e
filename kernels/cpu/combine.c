/* combine.c — split-KV (flash-decoding) merge of partial attention states.
 *
 *   M   = max_i LSE_i
 *   LSE = M + ln sum_i exp(LSE_i - M)
 *   O   = sum_i w_i O_i,   w_i = exp(LSE_i - M) / sum_k exp(LSE_k - M)   (= exp(LSE_i - LSE))
 *
 * Conventions (OPS.md, combine): O_i is (splits, rows, d_v) with element stride 1 and any split and
 * row strides (in elements); LSE_i is (splits, rows) float32, natural log, any strides; the outputs
 * are O (rows, d_v) in O_i's dtype (KP_F32 / KP_F16 / KP_BF16) and LSE (rows,) float32.
 * An empty split has LSE_i = -inf and an O_i that may hold NaN or garbage: it is skipped, never
 * multiplied by 0, so its O_i is not even read. A row whose splits are all empty (or splits = 0)
 * gives O = 0, LSE = -inf, and -inf - -inf is never formed. A NaN LSE_i makes the row NaN.
 *
 * fp32 accumulation: O is summed in an fp32 row (the output row itself for fp32) and rounded (RNE)
 * once on store; fp16/bf16 O_i are widened on load. The weights are normalised by the sum of
 * exp(LSE_i - M) rather than computed as exp(LSE_i - LSE): LSE rounded to fp32 carries an absolute
 * error of ulp(LSE)/2 (1e-3 at LSE = 1e4) that exp would turn into a relative error of each weight,
 * whereas LSE_i - M is an exact difference of fp32 values (its rounding error recovered by
 * kp_exp_diff). LSE itself is M + ln(sum) evaluated in double and rounded once.
 *
 * Memory traffic: each live O_i row is read once, the output row written once; for fp16/bf16 the
 * fp32 row accumulator (d_v floats) stays in L1. A row reads `splits` short runs (d_v elements)
 * that lie far apart, which the hardware prefetcher follows poorly, so each live split's next row
 * is prefetched while the current one is summed (next_row: byte offset to it, 0 on the last row;
 * measured ~20% faster at splits=16, d_v=128).
 */
#include <stdlib.h>

#include "common.h"

/* acc[0:d] (=|+=) w * o[0:d] */
KP_INLINE void axpy_row(float *acc, const void *o, float w, int64_t d, int first, int dt) {
    if (first)
        for (int64_t j = 0; j < d; j++) acc[j] = w * kp_load(o, j, dt);
    else
        for (int64_t j = 0; j < d; j++) acc[j] += w * kp_load(o, j, dt);
}

KP_INLINE void combine_row(const char *o, int64_t so_split, const float *lse, int64_t sl_split,
                           char *out, float *out_lse, float *w, float *buf, int64_t splits,
                           int64_t d_v, int dt, int64_t next_row) {
    float m = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < splits; i++) {
        float v = lse[i * sl_split];
        m = v > m ? v : m;
        nan |= v != v;
    }
    if (m == -INFINITY) {                           /* every split empty (or NaN only) */
        for (int64_t j = 0; j < d_v; j++) kp_store(out, j, nan ? NAN : 0.0f, dt);
        *out_lse = nan ? NAN : -INFINITY;
        return;
    }
    double s = 0.0;                                 /* a few scalars per row: double is free */
    for (int64_t i = 0; i < splits; i++) {          /* NaN counts as live, so it reaches the sum */
        float v = lse[i * sl_split];
        w[i] = v != -INFINITY ? kp_exp_diff(v, m) : 0.0f;
        s += w[i];
    }
    *out_lse = (float)((double)m + log(s));
    float *acc = dt == KP_F32 ? (float *)out : buf;
    int first = 1;
    for (int64_t i = 0; i < splits; i++) {
        if (lse[i * sl_split] == -INFINITY) continue;   /* empty split: O_i is never read */
        for (int64_t b = 0; b < d_v * kp_itemsize(dt); b += 64)   /* this split, next row */
            __builtin_prefetch(o + i * so_split + next_row + b, 0, 3);
        axpy_row(acc, o + i * so_split, (float)(w[i] / s), d_v, first, dt);
        first = 0;
    }
    if (dt != KP_F32)
        for (int64_t j = 0; j < d_v; j++) kp_store(out, j, acc[j], dt);
}

KP_INLINE int combine_rows(const char *o, int64_t stride_o_split, int64_t stride_o_row,
                           const float *lse, int64_t stride_lse_split, int64_t stride_lse_row,
                           char *out, int64_t stride_out_row, float *out_lse, int64_t stride_out_lse,
                           int64_t splits, int64_t rows, int64_t d_v, int dt) {
    float *w = malloc((size_t)(splits + d_v + 1) * sizeof(float));   /* weights, then fp32 O row */
    if (!w) return KP_ERR_NOMEM;
    const int64_t size = kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++)
        combine_row(o + r * stride_o_row * size, stride_o_split * size, lse + r * stride_lse_row,
                    stride_lse_split, out + r * stride_out_row * size, out_lse + r * stride_out_lse,
                    w, w + splits, splits, d_v, dt, r + 1 < rows ? stride_o_row * size : 0);
    free(w);
    return KP_OK;
}

KP_INLINE int lse_combine_kernel_impl(int dtype, const void *O_ptr, int64_t stride_o_split,
                                      int64_t stride_o_row, const float *LSE_ptr,
                                      int64_t stride_lse_split, int64_t stride_lse_row,
                                      void *OUT_ptr, int64_t stride_out_row, float *OUT_LSE_ptr,
                                      int64_t stride_out_lse, int64_t splits, int64_t rows,
                                      int64_t d_v) {
    /* one instantiation per dtype, so the loads and stores inline as constants */
    switch (dtype) {
    case KP_F32:
        return combine_rows(O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split,
                            stride_lse_row, OUT_ptr, stride_out_row, OUT_LSE_ptr, stride_out_lse,
                            splits, rows, d_v, KP_F32);
    case KP_F16:
        return combine_rows(O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split,
                            stride_lse_row, OUT_ptr, stride_out_row, OUT_LSE_ptr, stride_out_lse,
                            splits, rows, d_v, KP_F16);
    case KP_BF16:
        return combine_rows(O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split,
                            stride_lse_row, OUT_ptr, stride_out_row, OUT_LSE_ptr, stride_out_lse,
                            splits, rows, d_v, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(lse_combine_kernel,
                (int dtype, const void *O_ptr, int64_t stride_o_split, int64_t stride_o_row,
                 const float *LSE_ptr, int64_t stride_lse_split, int64_t stride_lse_row,
                 void *OUT_ptr, int64_t stride_out_row, float *OUT_LSE_ptr, int64_t stride_out_lse,
                 int64_t splits, int64_t rows, int64_t d_v),
                (dtype, O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split,
                 stride_lse_row, OUT_ptr, stride_out_row, OUT_LSE_ptr, stride_out_lse, splits, rows,
                 d_v))

/* ---- backward ------------------------------------------------------------------------------
 *
 *   w_i = exp(LSE_i - M) / sum_k exp(LSE_k - M),   a_i = dO . O_i,   abar = sum_i w_i a_i (= dO . O)
 *   dO_i   = w_i dO
 *   dLSE_i = w_i (a_i - abar + dLSE)                 (= w_i (dO . (O_i - O) + dLSE))
 *
 * The weights are rebuilt from the split LSEs as the forward builds them (not as exp(LSE_i - LSE)
 * from a rounded merged LSE), and dO . O from the split dots, so neither merged output is read.
 * An empty split (LSE_i = -inf) is skipped: its O_i (NaN in the tests) is never read and its
 * gradients are written as exact zeros; a row with every split empty gets zeros throughout.
 * fp32 accumulation: each a_i in 16 fp32 lanes; the weight sum, abar and dLSE_i in double (a few
 * scalars a row); dO_i is rounded to O_i's dtype once, dLSE_i to fp32 once. Memory traffic: each live O_i read
 * once, every dO_i written once, dO read once per split (from L1). */

/* dO . O_i over d_v elements of dtype dt, 16 fp32 lanes summed pairwise. */
KP_INLINE float dot_row(const void *o, const void *d_o, int64_t d, int dt) {
    float acc[KP_LANES] = {0};
    int64_t nv = d - d % KP_LANES, j = 0;
    for (; j < nv; j += KP_LANES)
        KP_FOR_LANES(k) acc[k] += kp_load(o, j + k, dt) * kp_load(d_o, j + k, dt);
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    float s = acc[0];
    for (; j < d; j++) s += kp_load(o, j, dt) * kp_load(d_o, j, dt);
    return s;
}

KP_INLINE void combine_backward_row(const char *o, int64_t so_split, const float *lse, int64_t sl_split,
                                    const char *d_o, float dlse, char *dop, int64_t sdp_split,
                                    float *dlp, int64_t sdl_split, float *w, float *a, int64_t splits,
                                    int64_t d_v, int dt) {
    const int64_t size = kp_itemsize(dt);
    float m = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < splits; i++) {
        float v = lse[i * sl_split];
        m = v > m ? v : m;
        nan |= v != v;
    }
    if (m == -INFINITY) {                           /* every split empty (or NaN only) */
        for (int64_t i = 0; i < splits; i++) {
            for (int64_t j = 0; j < d_v; j++) kp_store(dop + i * sdp_split * size, j, nan ? NAN : 0.0f, dt);
            dlp[i * sdl_split] = nan ? NAN : 0.0f;
        }
        return;
    }
    double s = 0.0;
    for (int64_t i = 0; i < splits; i++) {          /* NaN counts as live, so it reaches the sum */
        float v = lse[i * sl_split];
        w[i] = v != -INFINITY ? kp_exp_diff(v, m) : 0.0f;
        s += w[i];
    }
    /* abar is the weighted mean of the a_i in double, from the unnormalised weights and their own
     * double sum: a_i - abar then cancels exactly where the a_i agree (fp32 weights w_i / s summing to
     * 1 +- eps would leave eps32 |a_i| there, ~1e-6 at d_v = 128). */
    double abar = 0.0;
    for (int64_t i = 0; i < splits; i++) {
        a[i] = lse[i * sl_split] == -INFINITY ? 0.0f : dot_row(o + i * so_split * size, d_o, d_v, dt);
        abar += (double)w[i] * a[i];
    }
    abar /= s;
    for (int64_t i = 0; i < splits; i++) {
        const double wi = w[i] / s;
        char *dst = dop + i * sdp_split * size;
        for (int64_t j = 0; j < d_v; j++) kp_store(dst, j, (float)wi * kp_load(d_o, j, dt), dt);
        dlp[i * sdl_split] = (float)(wi * (((double)a[i] - abar) + dlse));
    }
}

KP_INLINE int combine_backward_rows(const char *o, int64_t stride_o_split, int64_t stride_o_row,
                                    const float *lse, int64_t stride_lse_split, int64_t stride_lse_row,
                                    const char *d_o, int64_t stride_do_row, const float *dlse,
                                    int64_t stride_dlse, char *dop, int64_t stride_dop_split,
                                    int64_t stride_dop_row, float *dlp, int64_t stride_dlp_split,
                                    int64_t stride_dlp_row, int64_t splits, int64_t rows, int64_t d_v,
                                    int dt) {
    float *w = malloc((size_t)(2 * splits + 1) * sizeof(float));   /* weights, then split dots */
    if (!w) return KP_ERR_NOMEM;
    const int64_t size = kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++)
        combine_backward_row(o + r * stride_o_row * size, stride_o_split, lse + r * stride_lse_row,
                             stride_lse_split, d_o + r * stride_do_row * size, dlse[r * stride_dlse],
                             dop + r * stride_dop_row * size, stride_dop_split, dlp + r * stride_dlp_row,
                             stride_dlp_split, w, w + splits, splits, d_v, dt);
    free(w);
    return KP_OK;
}

#define KP_COMBINE_BACKWARD_ARGS(dt)                                                               \
    O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split, stride_lse_row, DO_ptr,        \
        stride_do_row, DLSE_ptr, stride_dlse, DOP_ptr, stride_dop_split, stride_dop_row, DLP_ptr,  \
        stride_dlp_split, stride_dlp_row, splits, rows, d_v, dt

KP_INLINE int lse_combine_backward_kernel_impl(
    int dtype, const void *O_ptr, int64_t stride_o_split, int64_t stride_o_row, const float *LSE_ptr,
    int64_t stride_lse_split, int64_t stride_lse_row, const void *DO_ptr, int64_t stride_do_row,
    const float *DLSE_ptr, int64_t stride_dlse, void *DOP_ptr, int64_t stride_dop_split,
    int64_t stride_dop_row, float *DLP_ptr, int64_t stride_dlp_split, int64_t stride_dlp_row,
    int64_t splits, int64_t rows, int64_t d_v) {
    switch (dtype) {
    case KP_F32: return combine_backward_rows(KP_COMBINE_BACKWARD_ARGS(KP_F32));
    case KP_F16: return combine_backward_rows(KP_COMBINE_BACKWARD_ARGS(KP_F16));
    case KP_BF16: return combine_backward_rows(KP_COMBINE_BACKWARD_ARGS(KP_BF16));
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(lse_combine_backward_kernel,
                (int dtype, const void *O_ptr, int64_t stride_o_split, int64_t stride_o_row,
                 const float *LSE_ptr, int64_t stride_lse_split, int64_t stride_lse_row,
                 const void *DO_ptr, int64_t stride_do_row, const float *DLSE_ptr, int64_t stride_dlse,
                 void *DOP_ptr, int64_t stride_dop_split, int64_t stride_dop_row, float *DLP_ptr,
                 int64_t stride_dlp_split, int64_t stride_dlp_row, int64_t splits, int64_t rows,
                 int64_t d_v),
                (dtype, O_ptr, stride_o_split, stride_o_row, LSE_ptr, stride_lse_split, stride_lse_row,
                 DO_ptr, stride_do_row, DLSE_ptr, stride_dlse, DOP_ptr, stride_dop_split, stride_dop_row,
                 DLP_ptr, stride_dlp_split, stride_dlp_row, splits, rows, d_v))
