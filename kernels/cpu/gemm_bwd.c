/* gemm_bwd.c — the VJP of C = A W^T (+ bias) on the CPU, fp32 (the gemm family's gemm_nt_backward).
 *
 *   da = dc W      (M, K)   W float32, or GGML blocks dequantized to float32 (the weights' meaning, L1)
 *   dw = dc^T A    (N, K)   float32 W only (a quantized weight has no gradient)
 *   db = sum_m dc  (N,)     float32 W with a bias
 *
 * The arithmetic (gemm_bwd.h, shared with the fused blocks' backward): float32 storage and sums, each in
 * its reduction index's order, no FMA; the same bits on every ISA path (KP_MULTIVERSION only re-vectorises
 * the axpy loops). This is the seed's linear backward (C-Kernel-Engine's out-projection / QKV / fc1 / fc2
 * backward: d_input, d_weight, d_bias) for one weight of any format.
 */
#include "gemm_bwd.h"

KP_INLINE int gemm_nt_backward_impl(int type, const float *a, int64_t stride_a, const void *w, int64_t stride_w_bytes,
                                    const float *dc, int64_t stride_dc, float *da, int64_t stride_da, float *dw,
                                    int64_t stride_dw, float *db, int64_t m, int64_t n, int64_t k) {
    if (type != QT_F32 && (dw != NULL || db != NULL)) return KP_ERR_DTYPE;   /* no gradient of quantized W */
    int st = lb_backward_dx(type, w, stride_w_bytes, dc, stride_dc, da, stride_da, m, n, k, 0);
    if (st == KP_OK) lb_backward_dw(a, stride_a, dc, stride_dc, dw, stride_dw, db, m, n, k);
    return st;
}

KP_MULTIVERSION(gemm_nt_backward,
                (int type, const float *a, int64_t stride_a, const void *w, int64_t stride_w_bytes, const float *dc,
                 int64_t stride_dc, float *da, int64_t stride_da, float *dw, int64_t stride_dw, float *db, int64_t m,
                 int64_t n, int64_t k),
                (type, a, stride_a, w, stride_w_bytes, dc, stride_dc, da, stride_da, dw, stride_dw, db, m, n, k))
