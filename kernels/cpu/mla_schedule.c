/* mla_schedule.c — FlashMLA's split-KV tile scheduler (get_mla_metadata), on the host.
 *
 *   num_sm_parts P = sms / h_kv / ceil(s_q h_q / h_kv / 64)          (flash_api.cpp, old API)
 *   blocks_i = ceil(L_i / block), cost_i = blocks_i + F               (F = FIXED_OVERHEAD_NUM_BLOCKS = 5)
 *   payload  = ceil(sum_i cost_i / P) + F, at least 2F when `floor`  (Apr 2025; Feb 2025 had no floor)
 *
 * Part p takes requests greedily in order: the rest of the current request when its remaining payload
 * covers rest + F, else (if more than F is left) the next (payload - F) blocks of it, and is full.
 * Row p of meta: [begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx, 0, 0, 0];
 * num_splits[0] = 0, num_splits[i + 1] = num_splits[i] + splits of request i. Written as FlashMLA's
 * one-thread loop (csrc/kernels/get_mla_metadata.cu), one request at a time.
 * Returns 0, or 3 when the greedy leaves a block unassigned (FlashMLA's device assert; unreachable
 * for payload > F), 4 when the total cost overflows int32.
 */
#include <stdint.h>

#define KP_EXPORT __attribute__((visibility("default")))

KP_EXPORT int64_t mla_num_sm_parts(int64_t sms, int64_t s_q, int64_t h_q, int64_t h_kv) {
    const int64_t heads_per_k = s_q * h_q / h_kv;
    return sms / h_kv / ((heads_per_k + 63) / 64);
}

KP_EXPORT int mla_get_metadata(const int32_t *seqlens, int64_t stride_l, int64_t b, int64_t block,
                               int64_t fixed_overhead, int64_t num_sm_parts, int64_t floor,
                               int32_t *meta, int32_t *num_splits) {
    int64_t total = 0;
    for (int64_t i = 0; i < b; i++) total += (seqlens[i * stride_l] + block - 1) / block + fixed_overhead;
    if (total > INT32_MAX) return 4;
    int64_t payload = (total + num_sm_parts - 1) / num_sm_parts + fixed_overhead;
    if (floor && payload < 2 * fixed_overhead) payload = 2 * fixed_overhead;
    int64_t now_idx = 0, now_block = 0, now_n_split_idx = 0, cum_num_splits = 0;
    num_splits[0] = 0;
    for (int64_t p = 0; p < num_sm_parts; p++) {
        int32_t *row = meta + p * 8;
        row[0] = (int32_t)now_idx;
        row[1] = (int32_t)(now_block * block);
        row[4] = (int32_t)now_n_split_idx;
        row[5] = row[6] = row[7] = 0;
        int64_t remain = payload;
        while (now_idx < b) {
            const int64_t blocks = (seqlens[now_idx * stride_l] + block - 1) / block;
            const int64_t rest = blocks - now_block;
            if (remain >= rest + fixed_overhead) {   /* the rest of the request fits: finish it */
                cum_num_splits += now_n_split_idx + 1;
                num_splits[now_idx + 1] = (int32_t)cum_num_splits;
                remain -= rest + fixed_overhead;
                now_idx++;
                now_block = 0;
                now_n_split_idx = 0;
            } else {                                 /* split it if a block or more fits, and stop */
                if (remain - fixed_overhead > 0) {
                    now_block += remain - fixed_overhead;
                    now_n_split_idx++;
                }
                break;
            }
        }
        row[2] = (int32_t)(now_block > 0 ? now_idx : now_idx - 1);
        row[3] = (int32_t)(now_block > 0 ? now_block * block : seqlens[(now_idx - 1) * stride_l]);
    }
    return (now_idx == b && now_block == 0 && now_n_split_idx == 0) ? 0 : 3;
}
