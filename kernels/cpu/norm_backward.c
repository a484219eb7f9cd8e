/* norm_backward.c — the backward of RMSNorm (with d_gamma, the fused residual and Gemma's 1 + w) and of
 * LayerNorm over the real lanes of aligned rows (C-Kernel-Engine's rmsnorm backward with d_gamma).
 *
 *   rms_norm:    dx = rstd (g dy - h rstd^2 mean(h g dy)) (+ dh),   dw = sum over rows of dy h rstd
 *                h = x (+ r), g = w or 1 + w (Gemma: g scales dy; dw has the same formula)
 *   layer_norm:  dx = rstd (d - mean(d) - xhat mean(d xhat)),       d = w dy, xhat = (x - mean) rstd
 *                dw = sum over rows of dy xhat,                     db = sum over rows of dy
 *
 * Conventions (OPS.md "backward"; goldens refimpl/norm.py): rows are (rows, aw) with element stride 1
 * and row strides in elements; lanes [0, n) are the row, [n, aw) padding: never read (in x, r, dy or
 * dh) and written as +0 in dx. dw and db get lanes [0, n) (the wrapper zeros the rest of w's length). rstd (and LayerNorm's mean) are the forward's fp32 values,
 * one per row with its own stride. With the residual, dx is also r's gradient and includes dh. dtype
 * KP_F32 / KP_F16 / KP_BF16 for every row tensor and for w, dw and db.
 *
 * Precision: fp16 / bf16 widened on load, fp32 arithmetic, one RNE rounding on store. The row sums
 * (mean(h g dy); LayerNorm's sum(d), sum(d xhat) and the centring correction) run in 16 fp32 lanes
 * within blocks of KP_BLOCK elements whose block sums are added in double. LayerNorm's saved mean is
 * the fp32 rounding of the true mean: x - mean is exact near the mean (Sterbenz), and the mean of
 * those differences, lo, is the rounding the saved mean dropped (up to half an ulp of 1000 on
 * `shifted` rows, 3x fp32's atol); xhat = ((x - mean) - lo) rstd takes it back out. dw and db: fp32
 * per-lane partial sums over blocks of KP_ROW_BLOCK rows, added in double once per block (the
 * two-step reduction of the Triton kernel's per-program partials), rounded once at the end.
 */
#include <stdlib.h>

#include "common.h"

enum { KP_BLOCK = 256, KP_ROW_BLOCK = 64 };

/* sum_j a_j b_j (fp32 products) over [0, n): fp32 lanes within blocks, block sums in double. */
KP_INLINE double span_dot(const float *a, const float *b, int64_t n) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t s = 0; s < nv; s += KP_BLOCK) {
        int64_t se = nv - s < KP_BLOCK ? nv : s + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = s; j < se; j += KP_LANES)
            KP_FOR_LANES(k) part[k] += a[j + k] * b[j + k];
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) tail += a[j] * b[j];
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* sum_j a_j over [0, n), accumulated like span_dot. */
KP_INLINE double span_sum(const float *a, int64_t n) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t s = 0; s < nv; s += KP_BLOCK) {
        int64_t se = nv - s < KP_BLOCK ? nv : s + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = s; j < se; j += KP_LANES)
            KP_FOR_LANES(k) part[k] += a[j + k];
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) tail += a[j];
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* The lanes of a weight-gradient partial folded into its double total, then cleared. */
KP_INLINE void fold(double *total, float *part, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        total[j] += part[j];
        part[j] = 0.0f;
    }
}

/* Lanes [0, n) of a weight gradient (the wrapper zeros the rest of the weight's length). */
KP_INLINE void store_grad(void *out, const double *total, int64_t n, int dt) {
    for (int64_t j = 0; j < n; j++) kp_store(out, j, (float)total[j], dt);
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

KP_INLINE void rms_bwd_row(const char *x, const char *r, const void *w, float rstd, const char *dy,
                           const char *dh, char *dx, float *dw_part, float *h, float *gdy, int64_t n,
                           int64_t aw, int gemma, int dt) {
    for (int64_t j = 0; j < n; j++) {
        h[j] = r ? kp_load(x, j, dt) + kp_load(r, j, dt) : kp_load(x, j, dt);  /* h = x + r in fp32 */
        float g = w ? kp_load(w, j, dt) : 1.0f;
        gdy[j] = (gemma ? 1.0f + g : g) * kp_load(dy, j, dt);
    }
    const float c = rstd * rstd * (float)(span_dot(h, gdy, n) / (double)n);  /* rstd^2 mean(h g dy) */
    for (int64_t j = 0; j < n; j++) {
        float v = rstd * (gdy[j] - h[j] * c);
        if (dh) v += kp_load(dh, j, dt);
        kp_store(dx, j, v, dt);
        dw_part[j] += kp_load(dy, j, dt) * (h[j] * rstd);
    }
    for (int64_t j = n; j < aw; j++) kp_store(dx, j, 0.0f, dt);  /* the padding lanes */
}

KP_INLINE int rms_bwd_rows(const char *x, int64_t sx, const char *r, int64_t sr, const void *w, const float *rstd,
                           int64_t srstd, const char *dy, int64_t sdy, const char *dh, int64_t sdh, char *dx,
                           int64_t sdx, void *dw, int64_t rows, int64_t n, int64_t aw, int gemma, int dt) {
    float *buf = malloc((size_t)(3 * n) * sizeof(float));
    double *total = calloc((size_t)n, sizeof(double));
    if (!buf || !total) {
        free(buf);
        free(total);
        return KP_ERR_NOMEM;
    }
    float *h = buf, *gdy = buf + n, *part = buf + 2 * n;
    memset(part, 0, (size_t)n * sizeof(float));
    const int64_t size = kp_itemsize(dt);
    for (int64_t i = 0; i < rows; i++) {
        rms_bwd_row(x + i * sx * size, r ? r + i * sr * size : NULL, w, rstd[i * srstd], dy + i * sdy * size,
                    dh ? dh + i * sdh * size : NULL, dx + i * sdx * size, part, h, gdy, n, aw, gemma, dt);
        if ((i + 1) % KP_ROW_BLOCK == 0 || i + 1 == rows) fold(total, part, n);
    }
    if (dw) store_grad(dw, total, n, dt);
    free(buf);
    free(total);
    return KP_OK;
}

KP_INLINE int rms_norm_backward_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row, const void *R_ptr,
                                            int64_t stride_r_row, const void *W_ptr, const float *Rstd_ptr,
                                            int64_t stride_rstd, const void *DY_ptr, int64_t stride_dy_row,
                                            const void *DH_ptr, int64_t stride_dh_row, void *DX_ptr,
                                            int64_t stride_dx_row, void *DW_ptr, int64_t rows, int64_t n, int64_t aw,
                                            int gemma) {
#define RMS_BWD(DT) rms_bwd_rows(X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Rstd_ptr, stride_rstd, DY_ptr, \
                                 stride_dy_row, DH_ptr, stride_dh_row, DX_ptr, stride_dx_row, DW_ptr, rows, n, aw, \
                                 gemma, DT)
    switch (dtype) {  /* one instantiation per dtype: the loads and stores inline as constants */
    case KP_F32: return RMS_BWD(KP_F32);
    case KP_F16: return RMS_BWD(KP_F16);
    case KP_BF16: return RMS_BWD(KP_BF16);
    default: return KP_ERR_DTYPE;
    }
#undef RMS_BWD
}

KP_MULTIVERSION(rms_norm_backward_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, const void *R_ptr, int64_t stride_r_row,
                 const void *W_ptr, const float *Rstd_ptr, int64_t stride_rstd, const void *DY_ptr,
                 int64_t stride_dy_row, const void *DH_ptr, int64_t stride_dh_row, void *DX_ptr,
                 int64_t stride_dx_row, void *DW_ptr, int64_t rows, int64_t n, int64_t aw, int gemma),
                (dtype, X_ptr, stride_x_row, R_ptr, stride_r_row, W_ptr, Rstd_ptr, stride_rstd, DY_ptr,
                 stride_dy_row, DH_ptr, stride_dh_row, DX_ptr, stride_dx_row, DW_ptr, rows, n, aw, gemma))

/* ---- LayerNorm -------------------------------------------------------------------------------- */

KP_INLINE void ln_bwd_row(const char *x, const void *w, float mean, float rstd, const char *dy, char *dx,
                          float *dw_part, float *db_part, float *xhat, float *d, int64_t n, int64_t aw, int dt) {
    for (int64_t j = 0; j < n; j++) xhat[j] = kp_load(x, j, dt) - mean;  /* exact near the mean */
    const float lo = (float)(span_sum(xhat, n) / (double)n);  /* the rounding the fp32 mean dropped */
    for (int64_t j = 0; j < n; j++) {
        xhat[j] = (xhat[j] - lo) * rstd;
        d[j] = w ? kp_load(w, j, dt) * kp_load(dy, j, dt) : kp_load(dy, j, dt);
    }
    const float m1 = (float)(span_sum(d, n) / (double)n);         /* mean(d) */
    const float m2 = (float)(span_dot(d, xhat, n) / (double)n);   /* mean(d xhat) */
    for (int64_t j = 0; j < n; j++) {
        kp_store(dx, j, rstd * ((d[j] - m1) - xhat[j] * m2), dt);
        float g = kp_load(dy, j, dt);
        dw_part[j] += g * xhat[j];
        db_part[j] += g;
    }
    for (int64_t j = n; j < aw; j++) kp_store(dx, j, 0.0f, dt);  /* the padding lanes */
}

KP_INLINE int ln_bwd_rows(const char *x, int64_t sx, const void *w, const float *mean, int64_t smean,
                          const float *rstd, int64_t srstd, const char *dy, int64_t sdy, char *dx, int64_t sdx,
                          void *dw, void *db, int64_t rows, int64_t n, int64_t aw, int dt) {
    float *buf = malloc((size_t)(4 * n) * sizeof(float));
    double *total = calloc((size_t)(2 * n), sizeof(double));
    if (!buf || !total) {
        free(buf);
        free(total);
        return KP_ERR_NOMEM;
    }
    float *xhat = buf, *d = buf + n, *dw_part = buf + 2 * n, *db_part = buf + 3 * n;
    memset(dw_part, 0, (size_t)(2 * n) * sizeof(float));
    const int64_t size = kp_itemsize(dt);
    for (int64_t i = 0; i < rows; i++) {
        ln_bwd_row(x + i * sx * size, w, mean[i * smean], rstd[i * srstd], dy + i * sdy * size, dx + i * sdx * size,
                   dw_part, db_part, xhat, d, n, aw, dt);
        if ((i + 1) % KP_ROW_BLOCK == 0 || i + 1 == rows) {
            fold(total, dw_part, n);
            fold(total + n, db_part, n);
        }
    }
    if (dw) store_grad(dw, total, n, dt);
    if (db) store_grad(db, total + n, n, dt);
    free(buf);
    free(total);
    return KP_OK;
}

KP_INLINE int layer_norm_backward_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row, const void *W_ptr,
                                              const float *Mean_ptr, int64_t stride_mean, const float *Rstd_ptr,
                                              int64_t stride_rstd, const void *DY_ptr, int64_t stride_dy_row,
                                              void *DX_ptr, int64_t stride_dx_row, void *DW_ptr, void *DB_ptr,
                                              int64_t rows, int64_t n, int64_t aw) {
#define LN_BWD(DT) ln_bwd_rows(X_ptr, stride_x_row, W_ptr, Mean_ptr, stride_mean, Rstd_ptr, stride_rstd, DY_ptr, \
                               stride_dy_row, DX_ptr, stride_dx_row, DW_ptr, DB_ptr, rows, n, aw, DT)
    switch (dtype) {
    case KP_F32: return LN_BWD(KP_F32);
    case KP_F16: return LN_BWD(KP_F16);
    case KP_BF16: return LN_BWD(KP_BF16);
    default: return KP_ERR_DTYPE;
    }
#undef LN_BWD
}

KP_MULTIVERSION(layer_norm_backward_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, const void *W_ptr, const float *Mean_ptr,
                 int64_t stride_mean, const float *Rstd_ptr, int64_t stride_rstd, const void *DY_ptr,
                 int64_t stride_dy_row, void *DX_ptr, int64_t stride_dx_row, void *DW_ptr, void *DB_ptr, int64_t rows,
                 int64_t n, int64_t aw),
                (dtype, X_ptr, stride_x_row, W_ptr, Mean_ptr, stride_mean, Rstd_ptr, stride_rstd, DY_ptr,
                 stride_dy_row, DX_ptr, stride_dx_row, DW_ptr, DB_ptr, rows, n, aw))
