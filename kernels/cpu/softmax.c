/* softmax.c — row-wise softmax and online (streaming) softmax over the last axis.
 *
 *   softmax:  y_j = exp(x_j - m) / l,   m = max_k x_k,   l = sum_k exp(x_k - m)
 *   online:   per tile T of `tile` elements, in order:
 *                 m' = max(m, max_T x),   l' = l * exp(m - m') + sum_T exp(x - m')
 *             then y_j = exp(x_j - m) / l and lse = m + ln l (natural log)
 *
 * Conventions (OPS.md, softmax): x and y are (rows, n), element stride 1, row strides in elements
 * (padding between rows is never read or written). dtype KP_F32 / KP_F16 / KP_BF16, the same for x
 * and y. A row of all -inf gives y = 0 and lse = -inf without forming -inf - -inf (such rows stop
 * after the max pass; the online pass skips tiles while m' = -inf). A NaN anywhere in a row makes
 * the whole row (and its lse) NaN, as the textbook formula does; +inf gives NaN the same way.
 *
 * fp32 accumulation: fp16/bf16 are widened on load and rounded (RNE) once on store. The max and
 * the exps are fp32. l is summed in 16 fp32 lanes within blocks of KP_BLOCK elements and the block
 * sums are added in double (once per block, so free), so its error does not grow with n; the online
 * form carries l across tiles in double for the same reason (tile sums are fp32). exp(x - m) uses
 * kp_exp_diff, which recovers the rounding error of x - m (far below the max that error would
 * otherwise dominate: |x - m| * 2^-24 relative), and y = e / l is a division, wherever the result
 * is fp32 (y in fp32; l, which feeds the fp32 lse); fp16/bf16 y use exp(x - m) and e * (1/l), whose
 * extra error is far below their own rounding (see exp_shifted and scale).
 *
 * Memory traffic per row (softmax), three passes: the max; e = exp(x - m) while summing l; y = e / l.
 * fp32: e is y itself (passes 2-3 hit L2 for rows up to ~256K elements) and pass 2 prefetches the
 * next row into L2, so pass 1 does not wait on DRAM. fp16/bf16: pass 1 widens x into an fp32 row
 * buffer (n floats, allocated once per call) which passes 2-3 use, so each element is widened once
 * and exp runs on full-width fp32 vectors; pass 3 rounds into y.
 * The online form recomputes exp in its second pass: that is the algorithm under test.
 */
#include <stdlib.h>

#include "common.h"

enum { KP_BLOCK = 256 };  /* elements per fp32 partial sum: 16 per lane */

/* exp(x - m). EXACT: kp_exp_diff, which recovers the rounding error of x - m (up to |x - m| 2^-24
 * relative in the result). Used where the result is fp32 (y in fp32, and l, which feeds the fp32
 * lse); for fp16/bf16 y that error is below 2^-17 of the result wherever it is not 0, far under
 * their rounding, so the cheaper kp_expf(x - m) does. */
KP_INLINE float exp_shifted(float x, float m, int EXACT) {
    return EXACT ? kp_exp_diff(x, m) : kp_expf(x - m);
}

/* Max of x[0:n] (dtype dt); with WIDEN also copies x, widened to fp32, into buf[0:n]. NaN is
 * skipped here; it reaches the result through the exp sum. */
KP_INLINE float span_max(const void *x, float *buf, int64_t n, int dt, int WIDEN) {
    float acc[KP_LANES];
    for (int k = 0; k < KP_LANES; k++) acc[k] = -INFINITY;
    int64_t nv = n - n % KP_LANES, j = 0;
    for (; j < nv; j += KP_LANES)
        KP_FOR_LANES(k) {
            float v = kp_load(x, j + k, dt);
            if (WIDEN) buf[j + k] = v;
            acc[k] = v > acc[k] ? v : acc[k];
        }
    float m = kp_lanes_max(acc);
    for (; j < n; j++) {
        float v = kp_load(x, j, dt);
        if (WIDEN) buf[j] = v;
        m = v > m ? v : m;
    }
    return m;
}

/* 1 if x[0:n] holds a NaN. Only called on rows whose max is -inf, to tell NaN rows from empty ones. */
KP_INLINE int span_has_nan(const void *x, int64_t n, int dt) {
    int nan = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = kp_load(x, j, dt);
        nan |= v != v;
    }
    return nan;
}

/* sum_j exp(x_j - m) over x[0:n]; with STORE also writes the exps to e[0:n] (fp32). The exps are
 * summed in 16 fp32 lanes over blocks of KP_BLOCK elements; each block's lanes are then added into
 * 16 double lanes (once per block, so free), which keeps the error of the sum near that of one
 * block instead of growing with n. Prefetches row `prefetch` into L2 as it goes (one line per
 * group), so the next row's max pass does not wait on DRAM. */
KP_INLINE double span_exp_sum(const void *x, float *e, int64_t n, float m, int dt, int STORE,
                              int EXACT, const char *prefetch, int64_t prefetch_size) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t b = 0; b < nv; b += KP_BLOCK) {
        int64_t be = nv - b < KP_BLOCK ? nv : b + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = b; j < be; j += KP_LANES) {
            __builtin_prefetch(prefetch + j * prefetch_size, 0, 2);
            KP_FOR_LANES(k) {
                float v = exp_shifted(kp_load(x, j + k, dt), m, EXACT);
                if (STORE) e[j + k] = v;
                part[k] += v;
            }
        }
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) {
        float v = exp_shifted(kp_load(x, j, dt), m, EXACT);
        if (STORE) e[j] = v;
        tail += v;
    }
    for (int w = KP_LANES / 2; w > 0; w /= 2)       /* pairwise, fixed order */
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* e / l for an output of dtype dt: fp32 divides (one rounding, for ~10% of the fp32 time);
 * fp16/bf16 multiply by 1/l, whose extra fp32 rounding is 2^-13 of theirs or less. */
KP_INLINE float scale(float e, float l, float inv_l, int dt) {
    return dt == KP_F32 ? e / l : e * inv_l;
}

/* y[0:n] = e[0:n] / l, rounded to dt. */
KP_INLINE void span_scale_store(const float *e, void *y, int64_t n, float l, int dt) {
    const float inv_l = 1.0f / l;
    for (int64_t j = 0; j < n; j++) kp_store(y, j, scale(e[j], l, inv_l, dt), dt);
}

/* y[0:n] = exp(x - m) / l, rounded to dt (the online form's second pass); prefetches the next row
 * into L2 like span_exp_sum. */
KP_INLINE void span_exp_scale_store(const void *x, void *y, int64_t n, float m, float l, int dt,
                                    const char *prefetch) {
    const float inv_l = 1.0f / l;
    const int64_t line = 64 / kp_itemsize(dt);
    for (int64_t j0 = 0; j0 < n; j0 += line) {
        __builtin_prefetch(prefetch + j0 * kp_itemsize(dt), 0, 2);
        int64_t j1 = n - j0 < line ? n : j0 + line;
        for (int64_t j = j0; j < j1; j++)
            kp_store(y, j, scale(exp_shifted(kp_load(x, j, dt), m, dt == KP_F32), l, inv_l, dt), dt);
    }
}

KP_INLINE void span_fill(void *y, int64_t n, float v, int dt) {
    for (int64_t j = 0; j < n; j++) kp_store(y, j, v, dt);
}

KP_INLINE void softmax_row(const void *x, void *y, float *buf, int64_t n, int dt,
                           const char *x_next) {
    /* fp32: e = y, scaled in place. fp16/bf16: x is widened into buf once, and the exp pass runs
     * on fp32 data (one widening per element, and the vectoriser keeps to full fp32 vectors) */
    const float *src = x;
    float *e = (float *)y, m;
    if (dt == KP_F32) {
        m = span_max(x, NULL, n, dt, 0);
    } else {
        m = span_max(x, buf, n, dt, 1);
        src = e = buf;
    }
    if (m == -INFINITY) {                           /* empty row, or -inf and NaN only */
        span_fill(y, n, span_has_nan(x, n, dt) ? NAN : 0.0f, dt);
        return;
    }
    float l = (float)span_exp_sum(src, e, n, m, KP_F32, 1, dt == KP_F32, x_next, kp_itemsize(dt));
    span_scale_store(e, y, n, l, dt);
}

KP_INLINE int softmax_rows(const char *x, int64_t stride_x_row, char *y, int64_t stride_y_row,
                           int64_t rows, int64_t n, int dt) {
    float *buf = NULL;
    if (dt != KP_F32 && rows > 0 && n > 0 && !(buf = malloc((size_t)n * sizeof(float))))
        return KP_ERR_NOMEM;
    int64_t sx = stride_x_row * kp_itemsize(dt), sy = stride_y_row * kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++)
        softmax_row(x + r * sx, y + r * sy, buf, n, dt, x + (r + 1 < rows ? r + 1 : r) * sx);
    free(buf);
    return KP_OK;
}

KP_INLINE int softmax_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row, void *Y_ptr,
                                  int64_t stride_y_row, int64_t rows, int64_t n) {
    /* one instantiation per dtype, so the loads and stores inline as constants */
    switch (dtype) {
    case KP_F32: return softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, rows, n, KP_F32);
    case KP_F16: return softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, rows, n, KP_F16);
    case KP_BF16: return softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, rows, n, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(softmax_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, void *Y_ptr,
                 int64_t stride_y_row, int64_t rows, int64_t n),
                (dtype, X_ptr, stride_x_row, Y_ptr, stride_y_row, rows, n))

/* ---- online softmax ------------------------------------------------------------------------ */

KP_INLINE void online_softmax_row(const char *x, char *y, float *lse, int64_t n, int64_t tile,
                                  int dt, const char *x_next) {
    const int64_t size = kp_itemsize(dt);
    float m = -INFINITY;
    double l = 0.0;   /* carried in double: in fp32 its error would grow with n / tile additions */
    for (int64_t t0 = 0; t0 < n; t0 += tile) {     /* pass 1: one tile at a time, in order */
        int64_t len = n - t0 < tile ? n - t0 : tile;
        const char *xt = x + t0 * size;
        float tm = span_max(xt, NULL, len, dt, 0);
        float m_new = tm > m ? tm : m;
        if (m_new == -INFINITY) continue;           /* nothing live yet: l stays 0 */
        float alpha = kp_exp_diff(m, m_new);        /* exp(-inf - finite) = 0 on the first live tile */
        l = l * alpha + span_exp_sum(xt, NULL, len, m_new, dt, 0, 1, xt, 0);
        m = m_new;
    }
    if (m == -INFINITY) {                           /* pass 2 */
        int nan = span_has_nan(x, n, dt);
        span_fill(y, n, nan ? NAN : 0.0f, dt);
        *lse = nan ? NAN : -INFINITY;
        return;
    }
    span_exp_scale_store(x, y, n, m, (float)l, dt, x_next);
    *lse = (float)((double)m + log(l));             /* one rounding: m may be large, l is in [1, n] */
}

KP_INLINE int online_softmax_rows(const char *x, int64_t stride_x_row, char *y, int64_t stride_y_row,
                                  float *lse, int64_t stride_lse, int64_t rows, int64_t n,
                                  int64_t tile, int dt) {
    int64_t sx = stride_x_row * kp_itemsize(dt), sy = stride_y_row * kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++)
        online_softmax_row(x + r * sx, y + r * sy, lse + r * stride_lse, n, tile, dt,
                           x + (r + 1 < rows ? r + 1 : r) * sx);
    return KP_OK;
}

KP_INLINE int online_softmax_kernel_impl(int dtype, const void *X_ptr, int64_t stride_x_row,
                                         void *Y_ptr, int64_t stride_y_row, float *LSE_ptr,
                                         int64_t stride_lse, int64_t rows, int64_t n, int64_t tile) {
    if (tile < 1) tile = 1;
    switch (dtype) {
    case KP_F32:
        return online_softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, LSE_ptr, stride_lse,
                                   rows, n, tile, KP_F32);
    case KP_F16:
        return online_softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, LSE_ptr, stride_lse,
                                   rows, n, tile, KP_F16);
    case KP_BF16:
        return online_softmax_rows(X_ptr, stride_x_row, Y_ptr, stride_y_row, LSE_ptr, stride_lse,
                                   rows, n, tile, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

KP_MULTIVERSION(online_softmax_kernel,
                (int dtype, const void *X_ptr, int64_t stride_x_row, void *Y_ptr,
                 int64_t stride_y_row, float *LSE_ptr, int64_t stride_lse, int64_t rows, int64_t n,
                 int64_t tile),
                (dtype, X_ptr, stride_x_row, Y_ptr, stride_y_row, LSE_ptr, stride_lse, rows, n, tile))

/* ---- backward ------------------------------------------------------------------------------
 *
 *   D = sum_j dy_j y_j,   dx_j = y_j (dy_j - D + dlse)      (dlse = 0 without an LSE cotangent)
 *
 * y is the forward's output (x is not needed). One kernel serves softmax and online softmax: the
 * gradient of the streaming form is the same function (the online form's LSE adds dlse y). A -inf
 * logit has y = 0 and gets dx = 0; an all -inf row (y = 0) gets D = 0 and dx = 0, with no branch.
 * fp32 accumulation: D is summed like l in the forward (16 fp32 lanes within KP_BLOCK blocks,
 * block sums in double), rounded to fp32 once; dx = y ((dy - D) + dlse) in fp32, one rounding on
 * store. Two passes over the row (D, then dx): the second finds y and dy in L1/L2. */

/* sum_j y_j dy_j over [0:n] (dtype dt), fp32 lanes per block, block sums in double. */
KP_INLINE double span_dot(const void *y, const void *dy, int64_t n, int dt) {
    double acc[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES;
    for (int64_t b = 0; b < nv; b += KP_BLOCK) {
        int64_t be = nv - b < KP_BLOCK ? nv : b + KP_BLOCK;
        float part[KP_LANES] = {0};
        for (int64_t j = b; j < be; j += KP_LANES)
            KP_FOR_LANES(k) part[k] += kp_load(y, j + k, dt) * kp_load(dy, j + k, dt);
        for (int k = 0; k < KP_LANES; k++) acc[k] += part[k];
    }
    double tail = 0.0;
    for (int64_t j = nv; j < n; j++) tail += kp_load(y, j, dt) * kp_load(dy, j, dt);
    for (int w = KP_LANES / 2; w > 0; w /= 2)       /* pairwise, fixed order */
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    return acc[0] + tail;
}

/* dx = y (dy - D + dlse), evaluated as ((dy - D) + dlse): dy - D is where the cancellation is, so it
 * is formed first (with dlse small against a large D, dy + (dlse - D) would lose dlse's low bits). */
KP_INLINE void softmax_backward_row(const void *y, const void *dy, void *dx, int64_t n, float dlse,
                                    float d, int dt) {
    for (int64_t j = 0; j < n; j++)
        kp_store(dx, j, kp_load(y, j, dt) * ((kp_load(dy, j, dt) - d) + dlse), dt);
}

KP_INLINE int softmax_backward_rows(const char *y, int64_t stride_y_row, const char *dy,
                                    int64_t stride_dy_row, const float *dlse, int64_t stride_dlse,
                                    char *dx, int64_t stride_dx_row, int64_t rows, int64_t n, int dt) {
    const int64_t size = kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++) {
        const char *yr = y + r * stride_y_row * size, *dyr = dy + r * stride_dy_row * size;
        float d = (float)span_dot(yr, dyr, n, dt);
        softmax_backward_row(yr, dyr, dx + r * stride_dx_row * size, n,
                             dlse ? dlse[r * stride_dlse] : 0.0f, d, dt);
    }
    return KP_OK;
}

KP_INLINE int softmax_backward_kernel_impl(int dtype, const void *Y_ptr, int64_t stride_y_row,
                                           const void *DY_ptr, int64_t stride_dy_row,
                                           const float *DLSE_ptr, int64_t stride_dlse, void *DX_ptr,
                                           int64_t stride_dx_row, int64_t rows, int64_t n) {
    switch (dtype) {
    case KP_F32:
        return softmax_backward_rows(Y_ptr, stride_y_row, DY_ptr, stride_dy_row, DLSE_ptr,
                                     stride_dlse, DX_ptr, stride_dx_row, rows, n, KP_F32);
    case KP_F16:
        return softmax_backward_rows(Y_ptr, stride_y_row, DY_ptr, stride_dy_row, DLSE_ptr,
                                     stride_dlse, DX_ptr, stride_dx_row, rows, n, KP_F16);
    case KP_BF16:
        return softmax_backward_rows(Y_ptr, stride_y_row, DY_ptr, stride_dy_row, DLSE_ptr,
                                     stride_dlse, DX_ptr, stride_dx_row, rows, n, KP_BF16);
    default: return KP_ERR_DTYPE;
    }
}

/* DLSE_ptr may be NULL: no LSE cotangent (softmax); else one float per row (online softmax). */
KP_MULTIVERSION(softmax_backward_kernel,
                (int dtype, const void *Y_ptr, int64_t stride_y_row, const void *DY_ptr,
                 int64_t stride_dy_row, const float *DLSE_ptr, int64_t stride_dlse, void *DX_ptr,
                 int64_t stride_dx_row, int64_t rows, int64_t n),
                (dtype, Y_ptr, stride_y_row, DY_ptr, stride_dy_row, DLSE_ptr, stride_dlse, DX_ptr,
                 stride_dx_row, rows, n))
