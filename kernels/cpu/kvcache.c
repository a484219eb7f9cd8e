/* kvcache.c — append new keys or values to a KV cache, contiguous or paged. A copy of bits.
 *
 *   contiguous: cache[r, pos[i] + t] = new[i, t]                             t < s_new
 *   paged:      cache[block_table[r, p / page], p % page] = new[i, t]        p = pos[i] + t
 *   r = cache_loc[i] (TensorRT-LLM's row indirection; NULL: r = i)
 *   ragged (SEQLEN_ptr, SEQSTART_ptr): new[i, t] is new[seq_start[i] + t] (stride_n_b 0), t < seq_len[i]
 *
 * Conventions (OPS.md, kvcache.update; refimpl/kvcache.py): cache (b, s_max, h_kv, d) or
 * (num_blocks, page, h_kv, d), new (b, s_new, h_kv, d) or ragged (total, h_kv, d) (TensorRT-LLM's
 * flattened tokens; s_new is then the longest seq_len, d each array's own), any element strides except the last axis
 * (stride 1), elements of 1, 2 or 4 bytes copied as bits (NaN payloads, -0 and fp8 codes kept;
 * nothing is converted). Every other slot keeps its bits. The wrapper checks that the writes fit
 * and that no two land on the same slot, so the order of the copies does not matter.
 *
 * Memory traffic: one memcpy per (token, head) row of d elements, or per token when both arrays
 * keep a token's heads contiguous (the usual layout), which lets memcpy move h_kv * d at once.
 */
#include "common.h"

KP_EXPORT int kvcache_update_kernel(int64_t itemsize, void *CACHE_ptr, int64_t stride_c_blk,
                                    int64_t stride_c_slot, int64_t stride_c_h, const void *NEW_ptr,
                                    int64_t stride_n_b, int64_t stride_n_s, int64_t stride_n_h,
                                    const int32_t *POS_ptr, int64_t stride_pos,
                                    const int32_t *LOC_ptr, int64_t stride_loc,
                                    const int32_t *SEQLEN_ptr, const int32_t *SEQSTART_ptr,
                                    const int32_t *BT_ptr, int64_t stride_bt_b, int64_t stride_bt_p,
                                    int64_t page, int64_t b, int64_t s_new, int64_t h_kv, int64_t d) {
    if (itemsize != 1 && itemsize != 2 && itemsize != 4) return KP_ERR_DTYPE;
    const int whole = (h_kv == 1 || (stride_c_h == d && stride_n_h == d));   /* heads back to back */
    const int64_t heads = whole ? 1 : h_kv, row = (whole ? h_kv * d : d) * itemsize;
    for (int64_t i = 0; i < b; i++) {
        const int64_t r = LOC_ptr ? (int64_t)LOC_ptr[i * stride_loc] : i;   /* the sequence's cache row */
        const int64_t n = SEQLEN_ptr ? (int64_t)SEQLEN_ptr[i] : s_new;       /* its new tokens */
        const int64_t first = SEQSTART_ptr ? (int64_t)SEQSTART_ptr[i] : 0;  /* ragged: its first row of new */
        for (int64_t t = 0; t < n; t++) {
            int64_t p = (int64_t)POS_ptr[i * stride_pos] + t, blk = r, slot = p;
            if (BT_ptr) {
                blk = BT_ptr[r * stride_bt_b + p / page * stride_bt_p];
                slot = p % page;
            }
            char *dst = (char *)CACHE_ptr + (blk * stride_c_blk + slot * stride_c_slot) * itemsize;
            const char *src = (const char *)NEW_ptr + (i * stride_n_b + (first + t) * stride_n_s) * itemsize;
            for (int64_t h = 0; h < heads; h++)
                memcpy(dst + h * stride_c_h * itemsize, src + h * stride_n_h * itemsize, (size_t)row);
        }
    }
    return KP_OK;
}

/* TensorRT-LLM's host metadata (prepare_fused_mha_metadata): b = 1 + the last i with seq_len[i] > 0
 * (trailing zeros are the buffers' padding); rows i < b copied, rows b <= i < m (CUDA-graph padding)
 * seq_len 0 with row b - 1's input_pos and cache_loc (0 when b = 0); seq_start the exclusive cumsum.
 * Buffers (max_batch,) int32, outputs (m,) int32; the wrapper checks m >= b before the call. */
KP_EXPORT int kvcache_metadata_kernel(const int32_t *SEQLEN_ptr, const int32_t *POS_ptr, const int32_t *LOC_ptr,
                                      int64_t max_batch, int32_t *OUT_len, int32_t *OUT_pos, int32_t *OUT_loc,
                                      int32_t *OUT_start, int64_t m) {
    int64_t b = 0;
    for (int64_t i = 0; i < max_batch; i++)
        if (SEQLEN_ptr[i] > 0) b = i + 1;
    int64_t total = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t src = i < b ? i : b - 1;      /* padding rows repeat the last real row */
        OUT_len[i] = i < b ? SEQLEN_ptr[i] : 0;
        OUT_pos[i] = b ? POS_ptr[src] : 0;
        OUT_loc[i] = b ? LOC_ptr[src] : 0;
        OUT_start[i] = (int32_t)total;             /* exclusive: the tokens before row i */
        total += OUT_len[i];
    }
    return KP_OK;
}
