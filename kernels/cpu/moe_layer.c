/* moe_layer.c — the MoE layer's router GEMM: logits (T, E) fp32 = x (T, D) @ Wg (E, D)^T.
 *
 * x and Wg are C-contiguous arrays of dtype `dt` (KP_F32 / KP_F16 / KP_BF16), widened exactly on load; each
 * logit is a float32 sum of the D products in index order (bf16 / fp16 products are exact in float32), stored
 * as float32: the layer's declared path keeps the logits in fp32 (refimpl/moe_layer.py), never rounded to the
 * model dtype. One thread. The routing and the experts are moe.c's and moe_experts.c's kernels
 * (kernels/cpu/moe_layer.py calls them after this one). Returns KP_OK.
 */
#include "common.h"

KP_EXPORT int moe_router_gemm_kernel(const void *x, const void *wg, int64_t T, int64_t D, int64_t E, int dt,
                                     float *logits) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t e = 0; e < E; e++) {
            const int64_t row = e * D;
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++) acc += kp_load(x, t * D + d, dt) * kp_load(wg, row + d, dt);
            logits[t * E + e] = acc;
        }
    }
    return KP_OK;
}
