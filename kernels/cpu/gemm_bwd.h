/* gemm_bwd.h — the backward of a linear layer Y = X W^T (+ b), fp32, shared by gemm_bwd.c (the gemm
 * family's gemm_nt_backward) and blocks_bwd.c (the seed's out-projection, QKV, fc1 and fc2 backward).
 *
 *   dX[m, k] (+)= sum_n dY[m, n] W[n, k]      W float32, or GGML blocks dequantized to float32 (L1)
 *   dW[n, k]   = sum_m dY[m, n] X[m, k]       float32 W only
 *   db[n]      = sum_m dY[m, n]
 *
 * Precision: float32 storage and float32 arithmetic, no FMA (-ffp-contract=off). Every sum runs in its
 * reduction index's order, one fp32 rounding per term: dX[m, k] = ((dX0 + dY[m,0] W[0,k]) + dY[m,1] W[1,k])
 * + ..., dW and db likewise over m. The loops are axpy forms (a scalar times a row added to a row), which
 * vectorise over k without reassociating any sum: the bits do not depend on the ISA path.
 * A quantized weight row is dequantized as ggml's dequantize_row_* (quant.c): d sc (c - off) - dmin mn,
 * every product exact in fp32, one rounding of the exact value (the same bits as quant_dequantize).
 * Layout: row-major with row strides in elements (last-axis stride 1).
 */
#ifndef KERNEL_PARITY_CPU_GEMM_BWD_H
#define KERNEL_PARITY_CPU_GEMM_BWD_H

#include <stdlib.h>

#include "quant.h"

enum { LB_PANEL_FLOATS = 1 << 16 };   /* W rows dequantized at a time: 256 KB of fp32, in L2 */

/* One weight row of k elements to float32: a copy for QT_F32, else ggml's dequantization. */
KP_INLINE int lb_row_f32(int type, const uint8_t *w, int64_t k, float *out) {
    if (type == QT_F32) {
        memcpy(out, w, sizeof(float) * (size_t)k);
        return KP_OK;
    }
    int nbytes, qk = qt_block_size(type, &nbytes);
    if (!qk || type == QT_Q8_1 || type == QT_Q8_K) return KP_ERR_DTYPE;   /* activation formats */
    if (k % qk) return KP_ERR_SHAPE;
    const int off = qt_offset(type);
    qt_decoded r;
    for (int64_t b = 0; b < k / qk; b++, w += nbytes, out += qk) {
        qt_decode(type, w, &r);
        if (qk == 32) {
            if (type == QT_Q4_1 || type == QT_Q5_1)
                for (int j = 0; j < 32; j++) out[j] = (float)r.c[j] * r.d + r.m;
            else
                for (int j = 0; j < 32; j++) out[j] = (float)(r.c[j] - off) * r.d;
            continue;
        }
        const int mins = type == QT_Q2_K || type == QT_Q4_K || type == QT_Q5_K;
        for (int s = 0; s < 16; s++) {
            const float dl = r.d * (float)r.sc[s], ml = r.m * (float)r.mn[s];
            for (int l = 0; l < 16; l++)
                out[16 * s + l] = mins ? dl * (float)(r.c[16 * s + l] - off) - ml : dl * (float)(r.c[16 * s + l] - off);
        }
    }
    return KP_OK;
}

/* Bytes of one stored weight row of k elements (0: unknown type). */
KP_INLINE int64_t lb_row_bytes(int type, int64_t k) {
    if (type == QT_F32) return 4 * k;
    int nbytes, qk = qt_block_size(type, &nbytes);
    return qk ? k / qk * nbytes : 0;
}

/* dX (m, k) = dY (m, n) W (n, k), or dX += that when `accumulate` (the QKV projections summing into one
 * dX). W rows are dequantized into a panel of up to LB_PANEL_FLOATS, then every row of dY walks the panel:
 * each dX element's terms are added in increasing n. */
KP_INLINE int lb_backward_dx(int type, const void *w, int64_t stride_w_bytes, const float *dy, int64_t stride_dy,
                             float *dx, int64_t stride_dx, int64_t m, int64_t n, int64_t k, int accumulate) {
    if (!accumulate)
        for (int64_t i = 0; i < m; i++) memset(dx + i * stride_dx, 0, sizeof(float) * (size_t)k);
    if (n == 0 || k == 0) return KP_OK;
    int64_t rows = LB_PANEL_FLOATS / k;
    rows = rows < 1 ? 1 : rows > n ? n : rows;
    float *panel = malloc(sizeof(float) * (size_t)(rows * k));
    if (!panel) return KP_ERR_NOMEM;
    int st = KP_OK;
    for (int64_t n0 = 0; n0 < n && st == KP_OK; n0 += rows) {
        const int64_t nr = n - n0 < rows ? n - n0 : rows;
        for (int64_t j = 0; j < nr && st == KP_OK; j++)
            st = lb_row_f32(type, (const uint8_t *)w + (n0 + j) * stride_w_bytes, k, panel + j * k);
        for (int64_t i = 0; i < m && st == KP_OK; i++) {
            float *out = dx + i * stride_dx;
            const float *g = dy + i * stride_dy + n0;
            for (int64_t j = 0; j < nr; j++) {
                const float s = g[j], *p = panel + j * k;
                for (int64_t c = 0; c < k; c++) out[c] += s * p[c];
            }
        }
    }
    free(panel);
    return st;
}

/* dW (n, k) = dY^T X, terms added in increasing m; db (n) = the sum of dY's rows in increasing m (NULL: not
 * wanted). dW may be NULL too (a quantized weight has no gradient). dW is built a tile of rows at a time
 * (LB_PANEL_FLOATS, kept in L2 while the rows of X stream past it). */
KP_INLINE void lb_backward_dw(const float *x, int64_t stride_x, const float *dy, int64_t stride_dy, float *dw,
                              int64_t stride_dw, float *db, int64_t m, int64_t n, int64_t k) {
    if (dw && k > 0) {
        int64_t rows = LB_PANEL_FLOATS / k;
        rows = rows < 1 ? 1 : rows;
        for (int64_t j = 0; j < n; j++) memset(dw + j * stride_dw, 0, sizeof(float) * (size_t)k);
        for (int64_t n0 = 0; n0 < n; n0 += rows) {
            const int64_t n1 = n - n0 < rows ? n : n0 + rows;
            for (int64_t i = 0; i < m; i++) {
                const float *xr = x + i * stride_x, *g = dy + i * stride_dy;
                for (int64_t j = n0; j < n1; j++) {
                    const float s = g[j];
                    float *out = dw + j * stride_dw;
                    for (int64_t c = 0; c < k; c++) out[c] += s * xr[c];
                }
            }
        }
    }
    if (db) {
        memset(db, 0, sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) db[j] += dy[i * stride_dy + j];
    }
}

#endif /* KERNEL_PARITY_CPU_GEMM_BWD_H */
