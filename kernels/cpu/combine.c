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
