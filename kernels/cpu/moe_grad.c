/* moe_grad.c — the backward of MoE routing weights (moe.route_backward), one token at a time.
 *
 *   s       = softmax(logits) | sigmoid(logits)                 (over the E experts)
 *   S       = sum_j s[ids_j],  p_j = s[ids_j] / S                (the k chosen, slot order)
 *   g_s     = c (grad_w_j - sum_m grad_w_m p_m) / S at ids_j  (renormalize; S = 0: 0) | c grad_w_j;
 *             0 elsewhere
 *   grad    = s (g_s - r), r = sum_j g_s[ids_j] s[ids_j]         (softmax)
 *           | g_s s (1 - s)                                      (sigmoid)
 *
 * The choice (ids) is given; the bias and the grouping take no part (refimpl/moe_grad.py, the float64
 * golden, defines the op). logits: (T, E) float32, finite or -inf; ids (T, k) int32, distinct per token
 * and in [0, E) (the wrapper checks); grad_w (T, k) float32; strides in elements (any, both axes of each);
 * grad (T, E) float32, C-contiguous.
 *
 * Arithmetic is float32: softmax as moe.c (the row max subtracted, the exps summed in double and rounded
 * once, one IEEE division each); sigmoid from a = expf(-|x|): 1 / (1 + a) and a / (1 + a) are s and 1 - s
 * (by the sign of x), each a couple of roundings, so 1 - s keeps its relative precision where s is near 1.
 * The k-term sums S, sum grad_w p and r in slot order; (grad_w_j - sum grad_w p) / S rather than
 * grad_w_j / S - D / S^2, which S^2 could underflow, and with k = 1 exactly 0 (p = s / s = 1: the one
 * weight is the constant c). Unchosen experts of a softmax row get -s r (r is 0 up to rounding with
 * renormalize).
 * One thread. Returns KP_OK, or KP_ERR_NOMEM when the per-call scratch (3 E values) is not had.
 */
#include <stdlib.h>

#include "common.h"

enum { MOE_SOFTMAX = 0, MOE_SIGMOID = 1 };

KP_EXPORT int moe_route_backward_kernel(const float *logits, int64_t stride_t, int64_t stride_e,
                                        const int32_t *ids, int64_t stride_it, int64_t stride_ik,
                                        const float *grad_w, int64_t stride_wt, int64_t stride_wk,
                                        int64_t T, int64_t E, int64_t k, int scoring, int renormalize,
                                        float routed_scaling, float *grad) {
    float *s = malloc((size_t)(3 * E) * sizeof(float));
    if (!s) return KP_ERR_NOMEM;
    float *q = s + E, *gs = q + E;                      /* 1 - s (sigmoid), g_s */
    for (int64_t t = 0; t < T; t++) {
        const float *x = logits + t * stride_t;
        const int32_t *id_row = ids + t * stride_it;
        const float *gw_row = grad_w + t * stride_wt;
        float *out = grad + t * E;
        if (scoring == MOE_SIGMOID) {
            for (int64_t j = 0; j < E; j++) {
                float v = x[j * stride_e];
                float a = expf(-fabsf(v));
                float big = 1.0f / (1.0f + a), small = a / (1.0f + a);
                s[j] = v >= 0.0f ? big : small;
                q[j] = v >= 0.0f ? small : big;
            }
        } else {
            float m = -INFINITY;
            for (int64_t j = 0; j < E; j++) {
                float v = x[j * stride_e];
                m = v > m ? v : m;
            }
            if (m == -INFINITY) {
                for (int64_t j = 0; j < E; j++) s[j] = 0.0f;
            } else {
                double l = 0.0;
                for (int64_t j = 0; j < E; j++) {
                    float e = expf(x[j * stride_e] - m);
                    s[j] = e;
                    l += e;
                }
                const float lf = (float)l;
                for (int64_t j = 0; j < E; j++) s[j] /= lf;
            }
        }
#define ID(j) id_row[(j) * stride_ik]
#define GW(j) gw_row[(j) * stride_wk]
        float S = 0.0f;
        for (int64_t j = 0; j < k; j++) S += s[ID(j)];
        const float Sd = S > 0.0f ? S : 1.0f;
        float DS = 0.0f;                                /* sum_m grad_w_m p_m, p = s / S: D / S */
        for (int64_t j = 0; j < k; j++) DS += GW(j) * (s[ID(j)] / Sd);
        for (int64_t j = 0; j < E; j++) gs[j] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            float g = renormalize ? (S > 0.0f ? (GW(j) - DS) / S : 0.0f) : GW(j);
            gs[ID(j)] = routed_scaling * g;
        }
        if (scoring == MOE_SIGMOID) {
            for (int64_t j = 0; j < E; j++) out[j] = gs[j] * s[j] * q[j];
            continue;
        }
        float r = 0.0f;
        for (int64_t j = 0; j < k; j++) r += gs[ID(j)] * s[ID(j)];
#undef ID
#undef GW
        for (int64_t j = 0; j < E; j++) out[j] = s[j] * (gs[j] - r);
    }
    free(s);
    return KP_OK;
}
