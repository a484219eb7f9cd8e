/* kvquant_mla.c — FlashMLA's sparse MLA decode over its FP8 KV cache rows of 656 bytes (kvquant.mla_sparse).
 *
 *   row   = [512 e4m3fn codes | 4 float32 scales, one per 128 codes | 64 bf16 RoPE values]   (little-endian)
 *   s_j   = scale (sum_g sc_jg (q_g . codes_jg) + q_pe . k_pe,j)          g = 0..3, 128 latent channels each
 *   LSE   = m + ln sum_j exp(s_j - m);  O_g = sum_j exp(s_j - m) sc_jg codes_jg / sum_j exp(s_j - m)
 *
 * Conventions (refimpl/kvquant_mla.py, the float64 golden): indices are flat slots block * page + offset into
 * the cache (num_blocks, page, h_kv, 656) (any block / slot / head strides, in bytes), -1 padding, entries at
 * or past topk_length[b] (clamped to [0, topk]) unused; query head h reads kv head h / (h_q / h_kv)'s list and
 * rows; a slot listed twice counts twice; a row with no used entry gives O = 0, LSE = -inf. The wrapper
 * (kvquant_mla.py) refuses used entries outside the cache.
 *
 * The bytes are decoded in software: an e4m3 code through a 256-entry table (sign, 4-bit exponent bias 7,
 * 3-bit mantissa; exponent 0: m 2^-9; 0x7F / 0xFF NaN) of exact fp32 values, a scale and a RoPE value copied
 * out of the row (memcpy: no alignment assumed) and a bf16 widened by a shift. Arithmetic is fp32: the scales
 * are folded in per group (the 128-term dot of q with the codes times the group's scale; each probability
 * times its key's group scale, then times the code), the logits' row max subtracted before expf, the
 * probabilities' sum in double, O rounded to bf16 once. One (request, query row, kv head) at a time: its used
 * rows decoded once for all its query heads. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the per-item scratch (n keys x 580 floats) is not had.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { D_NOPE = 512, D_ROPE = 64, TILE = 128, N_TILES = 4, SCALE_OFF = 512, ROPE_OFF = 528, D_ALL = 576 };

typedef struct {
    const uint16_t *q; int64_t stride_q_b, stride_q_s, stride_q_h;          /* bf16, elements */
    const uint8_t *kv; int64_t stride_kv_blk, stride_kv_slot, stride_kv_head, page;  /* bytes */
    const int32_t *idx; int64_t stride_i_b, stride_i_s, stride_i_h, stride_i_k;
    const int32_t *topk_len;                                                   /* NULL: topk */
    uint16_t *o; int64_t stride_o_b, stride_o_s, stride_o_h;                  /* bf16, elements */
    float *lse; int64_t stride_l_b, stride_l_h, stride_l_s;
    int64_t b, s_q, h_q, h_kv, topk;
    double scale;
} kvq_mla_params;

static float E4M3[256];
static int e4m3_ready = 0;

static float e4m3_value(unsigned c) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    if ((c & 127) == 127) v = NAN;
    return (c & 128) ? -v : v;
}

static void e4m3_init(void) {
    if (e4m3_ready) return;
    for (unsigned c = 0; c < 256; c++) E4M3[c] = e4m3_value(c);
    e4m3_ready = 1;
}

/* Row j's decoded parts into k (576 floats: the 512 codes' values, unscaled, then the 64 RoPE values) and sc. */
static void decode_row(const uint8_t *row, float *k, float *sc) {
    for (int c = 0; c < D_NOPE; c++) k[c] = E4M3[row[c]];
    for (int g = 0; g < N_TILES; g++) memcpy(&sc[g], row + SCALE_OFF + 4 * g, 4);
    for (int c = 0; c < D_ROPE; c++) {
        uint16_t h;
        memcpy(&h, row + ROPE_OFF + 2 * c, 2);
        k[D_NOPE + c] = kp_bf16_to_f32(h);
    }
}

/* One query head's row qr (576 bf16 values) over the n decoded keys (keys: n x (576 values, 4 group scales), as
 * decode_row writes them): O (512 bf16) into orow and its LSE into *lse; s (n floats) and acc (512) are scratch.
 * kvquant.mla_sparse's and kvquant.mla_decode's (kvquant_mla_dense.c) arithmetic. */
static void attend_keys(const float *keys, int64_t n, const uint16_t *qr, double scale, float *s, float *acc,
                        uint16_t *orow, float *lse) {
    float qf[D_ALL];
    for (int c = 0; c < D_ALL; c++) qf[c] = kp_bf16_to_f32(qr[c]);
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *k = keys + j * (D_ALL + N_TILES), *sc = k + D_ALL;
        float tot = 0.0f;
        for (int g = 0; g < N_TILES; g++) {
            float d = 0.0f;
            for (int c = g * TILE; c < (g + 1) * TILE; c++) d += qf[c] * k[c];
            tot += sc[g] * d;
        }
        float r = 0.0f;
        for (int c = D_NOPE; c < D_ALL; c++) r += qf[c] * k[c];
        s[j] = (float)scale * (tot + r);
        if (s[j] > m) m = s[j];
    }
    if (n == 0) {
        for (int c = 0; c < D_NOPE; c++) orow[c] = kp_f32_to_bf16(0.0f);
        *lse = -INFINITY;
        return;
    }
    double l = 0.0;
    for (int c = 0; c < D_NOPE; c++) acc[c] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float *k = keys + j * (D_ALL + N_TILES), *sc = k + D_ALL;
        float pj = expf(s[j] - m);
        l += pj;
        for (int g = 0; g < N_TILES; g++) {
            float w = pj * sc[g];
            for (int c = g * TILE; c < (g + 1) * TILE; c++) acc[c] += w * k[c];
        }
    }
    float inv = (float)(1.0 / l);
    for (int c = 0; c < D_NOPE; c++) orow[c] = kp_f32_to_bf16(acc[c] * inv);
    *lse = (float)((double)m + log(l));
}

KP_EXPORT int kvq_mla_sparse_kernel(const kvq_mla_params *p) {
    e4m3_init();
    const int64_t grp = p->h_q / p->h_kv;
    float *keys = (float *)malloc(sizeof(float) * (size_t)(p->topk > 0 ? p->topk : 1) * (D_ALL + N_TILES));
    float *s = (float *)malloc(sizeof(float) * (size_t)(p->topk > 0 ? p->topk : 1));
    float *acc = (float *)malloc(sizeof(float) * D_NOPE);
    if (!keys || !s || !acc) { free(keys); free(s); free(acc); return KP_ERR_NOMEM; }
    for (int64_t b = 0; b < p->b; b++) {
        int64_t T = p->topk;
        if (p->topk_len) {
            int64_t t = p->topk_len[b];
            T = t < 0 ? 0 : (t > p->topk ? p->topk : t);
        }
        for (int64_t i = 0; i < p->s_q; i++) {
            for (int64_t kh = 0; kh < p->h_kv; kh++) {
                const int32_t *list = p->idx + b * p->stride_i_b + i * p->stride_i_s + kh * p->stride_i_h;
                int64_t n = 0;
                for (int64_t j = 0; j < T; j++) {
                    int64_t slot = list[j * p->stride_i_k];
                    if (slot < 0) continue;  /* -1 padding */
                    const uint8_t *row = p->kv + (slot / p->page) * p->stride_kv_blk
                                         + (slot % p->page) * p->stride_kv_slot + kh * p->stride_kv_head;
                    float *k = keys + n * (D_ALL + N_TILES);
                    decode_row(row, k, k + D_ALL);
                    n++;
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
