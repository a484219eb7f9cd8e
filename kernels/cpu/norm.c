/* norm.c — RMSNorm (weight w or Gemma's 1 + w, fused residual add) and LayerNorm over the real
 * lanes of aligned rows.
 *
 *   rms_norm:    y = h * rstd * g,               rstd = 1 / sqrt(sum(h^2) / n + eps),  h = x (+ r)
 *                g = w, or 1 + w (Gemma), or 1 (w NULL)
 *   layer_norm:  y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(sum((x - mean)^2) / n + eps)
 *
 * Conventions (OPS.md, layers; goldens in refimpl/norm.py): x, r, y, h are (rows, aw) with element
 * stride 1 and row strides in elements; lanes [0, n) are the row, lanes [n, aw) padding (C-Kernel-
 * Engine's aligned_embed_dim): never read, written as +0 in y and h. eps is inside the square root.
 * w and b have at least n lanes (NULL: none). dtype KP_F32 / KP_F16 / KP_BF16, the same for every
 * row tensor and for w and b; rstd and mean are fp32 with their own strides (NULL: not written).
 *
 * Precision: fp16/bf16 are widened on load and rounded (RNE) once on store; h = x + r is summed in
 * fp32 and normalised unrounded (it is rounded once, as the new residual stream). Sums of squares
 * run in 16 fp32 lanes within blocks of KP_BLOCK elements whose block sums are added in double
 * (once per block, so free), so their error does not grow with n. LayerNorm's mean is summed in
 * double lanes: the mean of zero-mean rows cancels, and its fp32 error would be eps * mean|x|
 * rather than eps * |mean|. The double mean is split into hi = (float)mean and lo = mean - hi:
 * x - hi is exact near the mean (Sterbenz), so (x - hi) - lo keeps the centred value to one fp32
 * rounding even at |mean| / spread = 1000 (an fp32 mean alone is off by half an ulp of the mean,
 * 3e-5 there). The variance is the two-pass sum of the centred squares; rstd is computed in double
 * and rounded once.
 *
 * Memory traffic per row: fp32 without a residual reads x twice (the statistics, then the write;
 * the second read hits L2 for rows up to ~256K elements, and the write pass prefetches the next row
 * into L2). Otherwise the statistics pass widens x (+ r) into an fp32 row buffer (n floats,
 * allocated once per call) that the write pass reads, so each element is widened once.
 */
#include <stdlib.h>

#include "common.h"

enum { KP_BLOCK = 256 };  /* elements per fp32 partial sum: 16 per lane */

/* sum_j v_j^2 over v[0:n] (fp32), fp32 lanes within blocks, block sums in double. */
KP_INLINE double span_sum_sq(const float *v, int64_t n) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t b = 0; b < nv; b += KP_BLOCK) {
        int64_t be = nv - b < KP_BLOCK ? nv : b + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = b; j < be; j += KP_LANES)
            KP_FOR_LANES(k) part[k] += v[j + k] * v[j + k];
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) tail += v[j] * v[j];
    for (int w = KP_LANES / 2; w > 0; w /= 2)       /* pairwise, fixed order */
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* sum_j ((v_j - hi) - lo)^2 over v[0:n]: the centred squares, accumulated like span_sum_sq. */
KP_INLINE double span_sum_sq_centred(const float *v, int64_t n, float hi, float lo) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t b = 0; b < nv; b += KP_BLOCK) {
        int64_t be = nv - b < KP_BLOCK ? nv : b + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = b; j < be; j += KP_LANES)
            KP_FOR_LANES(k) {
                float c = (v[j + k] - hi) - lo;
                part[k] += c * c;
            }
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) {
        float c = (v[j] - hi) - lo;
        tail += c * c;
    }
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* sum_j v_j over v[0:n] in 16 double lanes (each fp32 value is exact in double). */
KP_INLINE double span_sum_f64(const float *v, int64_t n) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t j = 0; j < nv; j += KP_LANES)
        KP_FOR_LANES(k) acc[k] += (double)v[j + k];
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) tail += (double)v[j];
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* The fp32 row the statistics run over: x itself (fp32, no residual) or buf[0:n] = x (+ r)
 * widened and summed in fp32. */
KP_INLINE const float *row_f32(const void *x, const void *r, float *buf, int64_t n, int dt) {
    if (dt == KP_F32 && r == NULL) return (const float *)x;
    if (r == NULL)
        for (int64_t j = 0; j < n; j++) buf[j] = kp_load(x, j, dt);
    else
        for (int64_t j = 0; j < n; j++) buf[j] = kp_load(x, j, dt) + kp_load(r, j, dt);
    return buf;
}

KP_INLINE void span_zero(void *y, int64_t from, int64_t to, int dt) {
    for (int64_t j = from; j < to; j++) kp_store(y, j, 0.0f, dt);
}

KP_INLINE void prefetch_row(const char *p, int64_t n, int dt) {
    const int64_t line = 64 / kp_itemsize(dt);
    for (int64_t j = 0; j < n; j += line) __builtin_prefetch(p + j * kp_itemsize(dt), 0, 2);
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

KP_INLINE void rms_norm_row(const char *x, const char *r, const void *w, char *y, char *h, float *rstd_out,
                            float *buf, int64_t n, int64_t aw, double eps, int gemma, int dt,
                            const char *x_next) {
    const float *hs = row_f32(x, r, buf, n, dt);
    const float rstd = (float)(1.0 / sqrt(span_sum_sq(hs, n) / (double)n + eps));
    if (rstd_out) *rstd_out = rstd;
    prefetch_row(x_next, n, dt);
    if (w == NULL) {
        for (int64_t j = 0; j < n; j++) kp_store(y, j, hs[j] * rstd, dt);
    } else if (gemma) {
        for (int64_t j = 0; j < n; j++) kp_store(y, j, (hs[j] * rstd) * (1.0f + kp_load(w, j, dt)), dt);
    } else {
        for (int64_t j = 0; j < n; j++) kp_store(y, j, (hs[j] * rstd) * kp_load(w, j, dt), dt);
    }
    span_zero(y, n, aw, dt);                        /* the padding lanes */
    if (h) {
        for (int64_t j = 0; j < n; j++) kp_store(h, j, hs[j], dt);
        span_zero(h, n, aw, dt);
    }
}

KP_INLINE int rms_norm_rows(const char *x, int64_t sx, const char *r, int64_t sr, const void *w,
                            char *y, int64_t sy, char *h, int64_t sh, float *rstd, int64_t srstd,
                            int64_t rows, int64_t n, int64_t aw, double eps, int gemma, int dt) {
    float *buf = NULL;
    if ((dt != KP_F32 || r != NULL) && rows > 0 && !(buf = malloc((size_t)n * sizeof(float))))
        return KP_ERR_NOMEM;
    const int64_t size = kp_itemsize(dt);
    for (int64_t i = 0; i < rows; i++) {
        const char *x_next = x + (i + 1 < rows ? i + 1 : i) * sx * size;
        rms_norm_row(x + i * sx * size, r ? r + i * sr * size : NULL, w, y + i * sy * size,
                     h ? h + i * sh * size : NULL, rstd ? rstd + i * srstd : NULL, buf, n, aw, eps, gemma,
                     dt, x_next);
    }
    free(buf);
    return KP_OK;
}

KP_INLINE int rms_norm_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row, const void *R_ptr,
                                   int64_t stride_r_row, const void *W_ptr, void *Y_ptr, int64_t stride_y_row,
                                   void *H_ptr, int64_t stride_h_row, float *Rstd_ptr, int64_t stride_rstd,
                                   int64_t rows, int64_t n, int64_t aw, double eps, int gemma) {
    /* one instantiation per dtype, so the loads and stores inline as constants */
    switch (dtype) {
    case KP_F32:
        return rms_norm_rows(X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Y_ptr, stride_y_row, H_ptr,
                             stride_h_row, Rstd_ptr, stride_rstd, rows, n, aw, eps, gemma, KP_F32);
    case KP_F16:
        return rms_norm_rows(X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Y_ptr, stride_y_row, H_ptr,
                             stride_h_row, Rstd_ptr, stride_rstd, rows, n, aw, eps, gemma, KP_F16);
    case KP_BF16:
        return rms_norm_rows(X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Y_ptr, stride_y_row, H_ptr,
                             stride_h_row, Rstd_ptr, stride_rstd, rows, n, aw, eps, gemma, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(rms_norm_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, const void *R_ptr, int64_t stride_r_row,
                 const void *W_ptr, void *Y_ptr, int64_t stride_y_row, void *H_ptr, int64_t stride_h_row,
                 float *Rstd_ptr, int64_t stride_rstd, int64_t rows, int64_t n, int64_t aw, double eps,
                 int gemma),
                (dtype, X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Y_ptr, stride_y_row, H_ptr,
                 stride_h_row, Rstd_ptr, stride_rstd, rows, n, aw, eps, gemma))

/* ---- LayerNorm -------------------------------------------------------------------------------- */

KP_INLINE void layer_norm_row(const char *x, const void *w, const void *b, char *y, float *mean_out,
                              float *rstd_out, float *buf, int64_t n, int64_t aw, double eps, int dt,
                              const char *x_next) {
    const float *xs = row_f32(x, NULL, buf, n, dt);
    const double mean = span_sum_f64(xs, n) / (double)n;
    const float hi = (float)mean, lo = (float)(mean - (double)hi);
    const double m2 = span_sum_sq_centred(xs, n, hi, lo);
    const float rstd = (float)(1.0 / sqrt(m2 / (double)n + eps));
    if (mean_out) *mean_out = hi;
    if (rstd_out) *rstd_out = rstd;
    prefetch_row(x_next, n, dt);
    for (int64_t j = 0; j < n; j++) {
        float v = ((xs[j] - hi) - lo) * rstd;
        if (w) v *= kp_load(w, j, dt);
        if (b) v += kp_load(b, j, dt);
        kp_store(y, j, v, dt);
    }
    span_zero(y, n, aw, dt);                        /* the padding lanes */
}

KP_INLINE int layer_norm_rows(const char *x, int64_t sx, const void *w, const void *b, char *y, int64_t sy,
                              float *mean, int64_t smean, float *rstd, int64_t srstd, int64_t rows, int64_t n,
                              int64_t aw, double eps, int dt) {
    float *buf = NULL;
    if (dt != KP_F32 && rows > 0 && !(buf = malloc((size_t)n * sizeof(float))))
        return KP_ERR_NOMEM;
    const int64_t size = kp_itemsize(dt);
    for (int64_t i = 0; i < rows; i++) {
        const char *x_next = x + (i + 1 < rows ? i + 1 : i) * sx * size;
        layer_norm_row(x + i * sx * size, w, b, y + i * sy * size, mean ? mean + i * smean : NULL,
                       rstd ? rstd + i * srstd : NULL, buf, n, aw, eps, dt, x_next);
    }
    free(buf);
    return KP_OK;
}

KP_INLINE int layer_norm_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row, const void *W_ptr,
                                     const void *B_ptr, void *Y_ptr, int64_t stride_y_row, float *Mean_ptr,
                                     int64_t stride_mean, float *Rstd_ptr, int64_t stride_rstd, int64_t rows,
                                     int64_t n, int64_t aw, double eps) {
    switch (dtype) {
    case KP_F32:
        return layer_norm_rows(X_ptr, stride_x_row, W_ptr, B_ptr, Y_ptr, stride_y_row, Mean_ptr, stride_mean,
                               Rstd_ptr, stride_rstd, rows, n, aw, eps, KP_F32);
    case KP_F16:
        return layer_norm_rows(X_ptr, stride_x_row, W_ptr, B_ptr, Y_ptr, stride_y_row, Mean_ptr, stride_mean,
                               Rstd_ptr, stride_rstd, rows, n, aw, eps, KP_F16);
    case KP_BF16:
        return layer_norm_rows(X_ptr, stride_x_row, W_ptr, B_ptr, Y_ptr, stride_y_row, Mean_ptr, stride_mean,
                               Rstd_ptr, stride_rstd, rows, n, aw, eps, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(layer_norm_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, const void *W_ptr, const void *B_ptr,
                 void *Y_ptr, int64_t stride_y_row, float *Mean_ptr, int64_t stride_mean, float *Rstd_ptr,
                 int64_t stride_rstd, int64_t rows, int64_t n, int64_t aw, double eps),
                (dtype, X_ptr, stride_x_row, W_ptr, B_ptr, Y_ptr, stride_y_row, Mean_ptr, stride_mean,
                 Rstd_ptr, stride_rstd, rows, n, aw, eps))
