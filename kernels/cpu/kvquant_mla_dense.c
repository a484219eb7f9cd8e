/* kvquant_mla_dense.c — FlashMLA's dense paged MLA decode over its FP8 KV cache rows of 656 bytes
 * (kvquant.mla_decode), and the rows' write path (kvquant.mla_pack).
 *
 *   row   = [512 e4m3fn codes | 4 float32 scales, one per 128 codes | 64 bf16 RoPE values]   (little-endian)
 *   s_j   = scale (sum_g sc_jg (q_g . codes_jg) + q_pe . k_pe,j)          g = 0..3, 128 latent channels each
 *   LSE   = m + ln sum_j exp(s_j - m);  O_g = sum_j exp(s_j - m) sc_jg codes_jg / sum_j exp(s_j - m)
 *
 * The row helpers are kvquant_mla.c's (its e4m3 table and decode_row, included below with its sparse kernel) and
 * the float8 encoder kvquant.c's (kvq_fp8: saturating, round to nearest even, exact in software).
 *
 * Decode (conventions refimpl/kvquant_mla_dense.py): token t of request b is the row at block
 * block_table[b, t / page], slot t % page, kv head kh (any block / slot / head strides, in bytes); query row i of
 * s_q sees tokens t < L_b, and with `causal` t <= L_b - s_q + i (bottom-right); nothing at or past L_b is read;
 * a row with no visible token gives O = 0, LSE = -inf. Arithmetic as kvquant_mla.c's sparse kernel: fp32, the
 * scales folded in per group, the row max subtracted before expf, the probabilities' sum in double, O rounded to
 * bf16 once. One (request, kv head) at a time: its L_b rows decoded once for all its query heads and rows.
 *
 * Pack: for each token with slot != -1: per 128-group amax of the bf16 values, float32 amax / 448 clamped below at
 * float32(1e-4), rounded up to a power of two (frexpf / ldexpf: exact), codes kvq_fp8(x / scale) (an exact
 * division by a power of two), the scales' and the RoPE values' bytes copied. Slots (range, distinctness) are
 * checked by the wrapper.
 * Returns KP_OK, or KP_ERR_NOMEM when the per-request scratch (L x 580 floats) is not had.
 */
#include "kvquant_mla.c"
#include "kvquant.c"

typedef struct {
    const uint16_t *q; int64_t stride_q_b, stride_q_s, stride_q_h;          /* bf16, elements */
    const uint8_t *kv; int64_t stride_kv_blk, stride_kv_slot, stride_kv_head, page;  /* bytes */
    const int32_t *bt; int64_t stride_bt_b, stride_bt_p;
    const int32_t *seqlens;
    uint16_t *o; int64_t stride_o_b, stride_o_s, stride_o_h;                  /* bf16, elements */
    float *lse; int64_t stride_l_b, stride_l_h, stride_l_s;
    int64_t b, s_q, h_q, h_kv, causal;
    double scale;
} kvq_mla_dense_params;

KP_EXPORT int kvq_mla_decode_kernel(const kvq_mla_dense_params *p) {
    e4m3_init();
    const int64_t grp = p->h_q / p->h_kv;
    int64_t lmax = 1;
    for (int64_t b = 0; b < p->b; b++) if (p->seqlens[b] > lmax) lmax = p->seqlens[b];
    float *keys = (float *)malloc(sizeof(float) * (size_t)lmax * (D_ALL + N_TILES));
    float *s = (float *)malloc(sizeof(float) * (size_t)lmax);
    float *acc = (float *)malloc(sizeof(float) * D_NOPE);
    if (!keys || !s || !acc) { free(keys); free(s); free(acc); return KP_ERR_NOMEM; }
    for (int64_t b = 0; b < p->b; b++) {
        const int64_t L = p->seqlens[b] < 0 ? 0 : p->seqlens[b];
        for (int64_t kh = 0; kh < p->h_kv; kh++) {
            for (int64_t t = 0; t < L; t++) {
                const int64_t blk = p->bt[b * p->stride_bt_b + (t / p->page) * p->stride_bt_p];
                const uint8_t *row = p->kv + blk * p->stride_kv_blk + (t % p->page) * p->stride_kv_slot
                                     + kh * p->stride_kv_head;
                float *k = keys + t * (D_ALL + N_TILES);
                decode_row(row, k, k + D_ALL);
            }
            for (int64_t i = 0; i < p->s_q; i++) {
                int64_t n = L;  /* tokens row i sees */
                if (p->causal && p->s_q > 1) {
                    int64_t last = L - p->s_q + i + 1;
                    n = last < 0 ? 0 : (last < L ? last : L);
                }
                for (int64_t hh = 0; hh < grp; hh++) {
                    const int64_t h = kh * grp + hh;
                    attend_keys(keys, n, p->q + b * p->stride_q_b + i * p->stride_q_s + h * p->stride_q_h, p->scale,
                                s, acc, p->o + b * p->stride_o_b + i * p->stride_o_s + h * p->stride_o_h,
                                p->lse + b * p->stride_l_b + h * p->stride_l_h + i * p->stride_l_s);
                }
            }
        }
    }
    free(keys); free(s); free(acc);
    return KP_OK;
}

KP_EXPORT int kvq_mla_pack_kernel(uint8_t *kv, int64_t stride_kv_blk, int64_t stride_kv_slot, int64_t page,
                                  const uint16_t *kv_c, int64_t stride_c, const uint16_t *k_pe, int64_t stride_pe,
                                  const int64_t *slots, int64_t n) {
    const kvq_format *f = &KVQ_FORMATS[KVQ_E4M3];
    const float floor_ = 1e-4f;
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;  /* padding */
        uint8_t *row = kv + (slot / page) * stride_kv_blk + (slot % page) * stride_kv_slot;
        const uint16_t *x = kv_c + t * stride_c;
        for (int g = 0; g < N_TILES; g++) {
            float amax = 0.0f;
            for (int c = g * TILE; c < (g + 1) * TILE; c++) amax = fmaxf(amax, fabsf(kp_bf16_to_f32(x[c])));
            float v = amax / 448.0f;
            if (v < floor_) v = floor_;
            int e;
            const float m = frexpf(v, &e);  /* v = m 2^e, m in [0.5, 1) */
            const float sc = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
            for (int c = g * TILE; c < (g + 1) * TILE; c++) row[c] = kvq_fp8(kp_bf16_to_f32(x[c]) / sc, f);
            memcpy(row + SCALE_OFF + 4 * g, &sc, 4);
        }
        memcpy(row + ROPE_OFF, k_pe + t * stride_pe, 2 * D_ROPE);
    }
    return KP_OK;
}
