/* moe_align.c — MoE token alignment (vLLM's moe_align_block_size) as a counting sort, one thread.
 *
 *   count[e]  = the slots s = t k + j (topk_ids in row-major order, n = T k of them) routed to e
 *   start[e]  = sum over e' < e of ceil(count[e'] / B) B           (the padded segments, in expert order)
 *   sorted[start[e] + r] = the r-th slot of expert e, in slot order  (a stable scatter)
 *   every other entry of sorted (segment padding, the tail past num_tokens_post_pad) = n, the sentinel
 *   expert_ids[i] = the expert owning block i, -1 for blocks at or past num_tokens_post_pad
 *   *post_pad = start[E]
 *
 * ids: (T, k) int32, strides in elements, every id in [0, E) (the wrapper checks); sorted (P,),
 * expert_ids (ceil(P / B),) and post_pad (1,) int32, contiguous, P = n + E (B - 1) < 2^31.
 * Conventions: refimpl/moe_align.py (the golden). Scratch: E + 1 int64 (KP_ERR_NOMEM without).
 */
#include <stdlib.h>

#include "common.h"

KP_EXPORT int moe_align_kernel(const int32_t *ids, int64_t stride_t, int64_t stride_k, int64_t T,
                               int64_t k, int64_t E, int64_t B, int32_t *sorted, int32_t *expert_ids,
                               int32_t *post_pad) {
    int64_t *next = calloc((size_t)E + 1, sizeof(int64_t));
    if (!next) return KP_ERR_NOMEM;
    const int64_t n = T * k, P = n + E * (B - 1), nb = (P + B - 1) / B;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) next[ids[t * stride_t + j * stride_k]]++;
    /* next[e]: where expert e's next slot goes; the padding of its segment is written now */
    int64_t at = 0, block = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t c = next[e], padded = (c + B - 1) / B * B;
        next[e] = at;
        for (int64_t p = at + c; p < at + padded; p++) sorted[p] = (int32_t)n;
        for (int64_t i = 0; i < padded / B; i++) expert_ids[block++] = (int32_t)e;
        at += padded;
    }
    for (int64_t p = at; p < P; p++) sorted[p] = (int32_t)n;
    for (int64_t i = block; i < nb; i++) expert_ids[i] = -1;
    *post_pad = (int32_t)at;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) sorted[next[ids[t * stride_t + j * stride_k]]++] = (int32_t)(t * k + j);
    free(next);
    return KP_OK;
}
