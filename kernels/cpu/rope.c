/* rope.c — rotary position embeddings (RoPE) and TensorRT-LLM's RoPE-fused KV-cache write.
 *
 *   pair i of the rotary part at position p:
 *   (a, b) -> (a cos(p w_i) - b sin(p w_i),  a sin(p w_i) + b cos(p w_i)),   w_i = theta^(-2i / rot)
 *
 * Conventions (OPS.md, layers; refimpl/rope.py):
 * - style ROPE_INTERLEAVED pairs (x[2i], x[2i+1]) of the rotary part, ROPE_HALF (x[i], x[i + rot/2]).
 * - the rotary part is the `rot` dims from `lo` (0: the first dims, d - rot: the last); the other
 *   dims are copied as bits (memcpy: never converted).
 * - positions are explicit int32, one per token: the table row read is the token's position.
 * - tables: cos and sin read through two pointers with one row stride and one column stride in
 *   elements, of dtype tab_dt (fp32 / fp16 / bf16), so separate (max_seq, rot/2) tables and
 *   interleaved (cos, sin) pairs (max_seq, rot/2, 2) -- TensorRT-LLM's fp16 table, Meta's complex64
 *   freqs_cis as float pairs -- are read where they lie. With COS == NULL the angles are built from
 *   theta: w_i = theta^(-2i/rot) and Llama-3.1's scaling in double, rounded once to float; the
 *   angle float(p) * w_i is an fp32 product (HF's and Meta's fp32 angle tables); its cos and sin
 *   come from double cos / sin of that float, rounded once.
 * - x and y (t, h, d) share a dtype; head and token strides in elements, last axis stride 1. y may
 *   be x (in place): each pair is read before it is written.
 * - conj = 1 rotates by the negated angles (sin negated after it is read or built): RoPE's backward,
 *   dx = R(-p w) dy, is this kernel run on the cotangent dy; the pass-through dims are dy copied.
 *
 * fp32 arithmetic: x widened on load, a c - b s and a s + b c as two fp32 products and one fp32 sum
 * (no FMA: -ffp-contract=off), one RNE rounding on store. Each token's cos / sin row is widened
 * (or built) once into fp32 buffers and used by all its heads.
 *
 * kv update: for sequence i and new token t, p = pos[i] + t; K's row is rotated into the cache slot
 * (contiguous: cache[r, p]; paged: cache[block_table[r, p / page], p % page], r = cache_loc[i] or i
 * without cache_loc) and V's row copied as bits. The wrapper checks that the writes fit and that no two land on one slot.
 * Ragged (SEQLEN_ptr, SEQSTART_ptr; TensorRT-LLM's flattened tokens): sequence i's token t < seq_len[i] is
 * row seq_start[i] + t of k_new / v_new / q (their batch strides 0); V's head dim dv may differ from d.
 */
#include <stdlib.h>

#include "common.h"

enum { ROPE_INTERLEAVED = 0, ROPE_HALF = 1 };
enum { ROPE_SCALE_NONE = 0, ROPE_SCALE_LLAMA3 = 1 };

/* Llama-3.1's apply_scaling: factor 8, low 1, high 4, original context 8192 (refimpl.rope.LLAMA3). */
static double llama3_freq(double f) {
    const double factor = 8.0, low = 1.0, high = 4.0, orig = 8192.0;
    double wavelen = 2.0 * 3.14159265358979323846 / f;
    if (wavelen < orig / high) return f;
    if (wavelen > orig / low) return f / factor;
    double smooth = (orig / wavelen - low) / (high - low);
    return (1.0 - smooth) * f / factor + smooth * f;
}

/* w[i] = theta^(-2i/rot) (scaled), in double, rounded once to float. */
static void theta_freqs(float *w, int64_t rot, double theta, int scaling) {
    for (int64_t i = 0; i < rot / 2; i++) {
        double f = pow(theta, -2.0 * (double)i / (double)rot);
        w[i] = (float)(scaling == ROPE_SCALE_LLAMA3 ? llama3_freq(f) : f);
    }
}

/* The fp32 (cos, sin) row of position p: read from the tables or built from w. */
static void angle_row(float *c, float *s, int64_t half, int64_t p, const void *COS_ptr, const void *SIN_ptr,
                      int tab_dt, int64_t stride_tab_row, int64_t stride_tab_col, const float *w) {
    if (COS_ptr) {
        int64_t row = p * stride_tab_row;
        for (int64_t i = 0; i < half; i++) {
            c[i] = kp_load(COS_ptr, row + i * stride_tab_col, tab_dt);
            s[i] = kp_load(SIN_ptr, row + i * stride_tab_col, tab_dt);
        }
        return;
    }
    float fp = (float)p;
    for (int64_t i = 0; i < half; i++) {
        float ang = fp * w[i];  /* the fp32 angle */
        c[i] = (float)cos((double)ang);
        s[i] = (float)sin((double)ang);
    }
}

/* One head's row: the rot dims from lo rotated by (c, s), the others copied. dt is a constant
 * wherever this is inlined, so the loads and stores fold. */
KP_INLINE void rotate_row(const char *x, char *y, const float *c, const float *s, int64_t lo, int64_t rot,
                          int64_t d, int style, int dt) {
    const int64_t size = kp_itemsize(dt), half = rot / 2;
    if (x != y) {
        memcpy(y, x, (size_t)(lo * size));
        memcpy(y + (lo + rot) * size, x + (lo + rot) * size, (size_t)((d - lo - rot) * size));
    }
    const char *xr = x + lo * size;
    char *yr = y + lo * size;
    if (style == ROPE_HALF) {
        for (int64_t i = 0; i < half; i++) {
            float a = kp_load(xr, i, dt), b = kp_load(xr, i + half, dt);
            kp_store(yr, i, a * c[i] - b * s[i], dt);
            kp_store(yr, i + half, a * s[i] + b * c[i], dt);
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float a = kp_load(xr, 2 * i, dt), b = kp_load(xr, 2 * i + 1, dt);
            kp_store(yr, 2 * i, a * c[i] - b * s[i], dt);
            kp_store(yr, 2 * i + 1, a * s[i] + b * c[i], dt);
        }
    }
}

KP_INLINE int rope_rows(const char *X_ptr, int64_t stride_xt, int64_t stride_xh, char *Y_ptr, int64_t stride_yt,
                        int64_t stride_yh, const int32_t *POS_ptr, int64_t stride_pos, const void *COS_ptr,
                        const void *SIN_ptr, int tab_dt, int64_t stride_tab_row, int64_t stride_tab_col,
                        double theta, int scaling, int conj, int style, int64_t lo, int64_t rot, int64_t t,
                        int64_t h, int64_t d, int dt) {
    const int64_t size = kp_itemsize(dt), half = rot / 2;
    float *buf = malloc((size_t)(3 * half) * sizeof(float));
    if (!buf) return KP_ERR_NOMEM;
    float *c = buf, *s = buf + half, *w = buf + 2 * half;
    if (!COS_ptr) theta_freqs(w, rot, theta, scaling);
    for (int64_t tok = 0; tok < t; tok++) {
        angle_row(c, s, half, POS_ptr[tok * stride_pos], COS_ptr, SIN_ptr, tab_dt, stride_tab_row,
                  stride_tab_col, w);
        if (conj)  /* the transposed rotation: R(p w)^T = R(-p w) */
            for (int64_t i = 0; i < half; i++) s[i] = -s[i];
        for (int64_t head = 0; head < h; head++)
            rotate_row(X_ptr + (tok * stride_xt + head * stride_xh) * size,
                       Y_ptr + (tok * stride_yt + head * stride_yh) * size, c, s, lo, rot, d, style, dt);
    }
    free(buf);
    return KP_OK;
}

KP_INLINE int rope_kernel_impl(int dtype, const void *X_ptr, int64_t stride_xt, int64_t stride_xh, void *Y_ptr,
                               int64_t stride_yt, int64_t stride_yh, const int32_t *POS_ptr, int64_t stride_pos,
                               const void *COS_ptr, const void *SIN_ptr, int tab_dt, int64_t stride_tab_row,
                               int64_t stride_tab_col, double theta, int scaling, int conj, int style,
                               int64_t lo, int64_t rot, int64_t t, int64_t h, int64_t d) {
    /* one instantiation per dtype, so the loads and stores inline as constants */
#define ROPE_ROWS(DT) rope_rows(X_ptr, stride_xt, stride_xh, Y_ptr, stride_yt, stride_yh, POS_ptr, stride_pos, \
                                COS_ptr, SIN_ptr, tab_dt, stride_tab_row, stride_tab_col, theta, scaling, conj, \
                                style, lo, rot, t, h, d, DT)
    switch (dtype) {
    case KP_F32: return ROPE_ROWS(KP_F32);
    case KP_F16: return ROPE_ROWS(KP_F16);
    case KP_BF16: return ROPE_ROWS(KP_BF16);
    default: return KP_ERR_DTYPE;
    }
#undef ROPE_ROWS
}

KP_MULTIVERSION(rope_kernel,
                (int dtype, const void *X_ptr, int64_t stride_xt, int64_t stride_xh, void *Y_ptr,
                 int64_t stride_yt, int64_t stride_yh, const int32_t *POS_ptr, int64_t stride_pos,
                 const void *COS_ptr, const void *SIN_ptr, int tab_dt, int64_t stride_tab_row,
                 int64_t stride_tab_col, double theta, int scaling, int conj, int style, int64_t lo, int64_t rot,
                 int64_t t, int64_t h, int64_t d),
                (dtype, X_ptr, stride_xt, stride_xh, Y_ptr, stride_yt, stride_yh, POS_ptr, stride_pos,
                 COS_ptr, SIN_ptr, tab_dt, stride_tab_row, stride_tab_col, theta, scaling, conj, style, lo, rot,
                 t, h, d))

/* One new token's row of every head into its cache slot: rotated (K) or copied as bits (V). */
KP_INLINE void kv_row(const char *src, int64_t stride_src_h, char *dst, int64_t stride_dst_h, const float *c,
                      const float *s, int64_t h, int64_t d, int style, int dt, int rotate) {
    const int64_t size = kp_itemsize(dt);
    for (int64_t head = 0; head < h; head++) {
        const char *x = src + head * stride_src_h * size;
        char *y = dst + head * stride_dst_h * size;
        if (rotate)
            rotate_row(x, y, c, s, 0, d, d, style, dt);
        else
            memcpy(y, x, (size_t)(d * size));
    }
}

KP_INLINE int kv_rows(char *KC_ptr, int64_t stride_kc_blk, int64_t stride_kc_slot, int64_t stride_kc_h,
                      char *VC_ptr, int64_t stride_vc_blk, int64_t stride_vc_slot, int64_t stride_vc_h,
                      const char *KN_ptr, int64_t stride_kn_b, int64_t stride_kn_t, int64_t stride_kn_h,
                      const char *VN_ptr, int64_t stride_vn_b, int64_t stride_vn_t, int64_t stride_vn_h,
                      const int32_t *POS_ptr, int64_t stride_pos,
                      const int32_t *LOC_ptr, int64_t stride_loc, const int32_t *SEQLEN_ptr,
                      const int32_t *SEQSTART_ptr, const char *Q_ptr, int64_t stride_q_b,
                      int64_t stride_q_t, int64_t stride_q_h, char *QO_ptr, int64_t stride_qo_b,
                      int64_t stride_qo_t, int64_t stride_qo_h, int64_t hq, const void *COS_ptr, const void *SIN_ptr,
                      int tab_dt, int64_t stride_tab_row, int64_t stride_tab_col, int style, const int32_t *BT_ptr,
                      int64_t stride_bt_b, int64_t stride_bt_p, int64_t page, int64_t b, int64_t s_new,
                      int64_t h, int64_t d, int64_t dv, int dt) {
    const int64_t size = kp_itemsize(dt), half = d / 2;
    float *buf = malloc((size_t)(2 * half) * sizeof(float));
    if (!buf) return KP_ERR_NOMEM;
    float *c = buf, *s = buf + half;
    for (int64_t i = 0; i < b; i++) {
        const int64_t r = LOC_ptr ? (int64_t)LOC_ptr[i * stride_loc] : i;   /* the sequence's cache row */
        const int64_t n = SEQLEN_ptr ? (int64_t)SEQLEN_ptr[i] : s_new;       /* its new tokens */
        const int64_t first = SEQSTART_ptr ? (int64_t)SEQSTART_ptr[i] : 0;  /* ragged: its first row of new */
        for (int64_t t = 0; t < n; t++) {
            int64_t p = (int64_t)POS_ptr[i * stride_pos] + t, blk = r, slot = p, row = first + t;
            if (BT_ptr) {
                blk = BT_ptr[r * stride_bt_b + p / page * stride_bt_p];
                slot = p % page;
            }
            angle_row(c, s, half, p, COS_ptr, SIN_ptr, tab_dt, stride_tab_row, stride_tab_col, NULL);
            kv_row(KN_ptr + (i * stride_kn_b + row * stride_kn_t) * size, stride_kn_h,
                   KC_ptr + (blk * stride_kc_blk + slot * stride_kc_slot) * size, stride_kc_h, c, s, h, d, style, dt,
                   1);
            kv_row(VN_ptr + (i * stride_vn_b + row * stride_vn_t) * size, stride_vn_h,
                   VC_ptr + (blk * stride_vc_blk + slot * stride_vc_slot) * size, stride_vc_h, c, s, h, dv, style, dt,
                   0);
            if (Q_ptr)   /* TensorRT-LLM's q rotation: every query head at the token's position p */
                kv_row(Q_ptr + (i * stride_q_b + row * stride_q_t) * size, stride_q_h,
                       QO_ptr + (i * stride_qo_b + row * stride_qo_t) * size, stride_qo_h, c, s, hq, d, style, dt, 1);
        }
    }
    free(buf);
    return KP_OK;
}

KP_INLINE int rope_kv_update_kernel_impl(int dtype, void *KC_ptr, int64_t stride_kc_blk, int64_t stride_kc_slot,
                                         int64_t stride_kc_h, void *VC_ptr, int64_t stride_vc_blk,
                                         int64_t stride_vc_slot, int64_t stride_vc_h, const void *KN_ptr,
                                         int64_t stride_kn_b, int64_t stride_kn_t, int64_t stride_kn_h,
                                         const void *VN_ptr, int64_t stride_vn_b, int64_t stride_vn_t,
                                         int64_t stride_vn_h, const int32_t *POS_ptr, int64_t stride_pos,
                                         const int32_t *LOC_ptr, int64_t stride_loc, const int32_t *SEQLEN_ptr,
                                         const int32_t *SEQSTART_ptr, const void *Q_ptr, int64_t stride_q_b,
                                         int64_t stride_q_t, int64_t stride_q_h, void *QO_ptr, int64_t stride_qo_b, int64_t stride_qo_t,
                                         int64_t stride_qo_h, int64_t hq,
                                         const void *COS_ptr, const void *SIN_ptr, int tab_dt,
                                         int64_t stride_tab_row, int64_t stride_tab_col, int style,
                                         const int32_t *BT_ptr, int64_t stride_bt_b, int64_t stride_bt_p,
                                         int64_t page, int64_t b, int64_t s_new, int64_t h, int64_t d,
                                         int64_t dv) {
#define KV_ROWS(DT) kv_rows(KC_ptr, stride_kc_blk, stride_kc_slot, stride_kc_h, VC_ptr, stride_vc_blk, stride_vc_slot, \
                            stride_vc_h, KN_ptr, stride_kn_b, stride_kn_t, stride_kn_h, VN_ptr, stride_vn_b,         \
                            stride_vn_t, stride_vn_h, POS_ptr, stride_pos, LOC_ptr, stride_loc, SEQLEN_ptr,          \
                            SEQSTART_ptr, Q_ptr, stride_q_b,                                                         \
                            stride_q_t, stride_q_h, QO_ptr, stride_qo_b, stride_qo_t, stride_qo_h, hq,               \
                            COS_ptr, SIN_ptr,                                                                        \
                            tab_dt, stride_tab_row, stride_tab_col, style, BT_ptr, stride_bt_b, stride_bt_p, page, b,  \
                            s_new, h, d, dv, DT)
    switch (dtype) {
    case KP_F32: return KV_ROWS(KP_F32);
    case KP_F16: return KV_ROWS(KP_F16);
    case KP_BF16: return KV_ROWS(KP_BF16);
    default: return KP_ERR_DTYPE;
    }
#undef KV_ROWS
}

KP_MULTIVERSION(rope_kv_update_kernel,
                (int dtype, void *KC_ptr, int64_t stride_kc_blk, int64_t stride_kc_slot, int64_t stride_kc_h,
                 void *VC_ptr, int64_t stride_vc_blk, int64_t stride_vc_slot, int64_t stride_vc_h,
                 const void *KN_ptr, int64_t stride_kn_b, int64_t stride_kn_t, int64_t stride_kn_h,
                 const void *VN_ptr, int64_t stride_vn_b, int64_t stride_vn_t, int64_t stride_vn_h,
                 const int32_t *POS_ptr, int64_t stride_pos, const int32_t *LOC_ptr, int64_t stride_loc,
                 const int32_t *SEQLEN_ptr, const int32_t *SEQSTART_ptr, const void *Q_ptr, int64_t stride_q_b,
                 int64_t stride_q_t, int64_t stride_q_h, void *QO_ptr,
                 int64_t stride_qo_b, int64_t stride_qo_t, int64_t stride_qo_h, int64_t hq,
                 const void *COS_ptr, const void *SIN_ptr, int tab_dt,
                 int64_t stride_tab_row, int64_t stride_tab_col, int style, const int32_t *BT_ptr,
                 int64_t stride_bt_b, int64_t stride_bt_p, int64_t page, int64_t b, int64_t s_new, int64_t h,
                 int64_t d, int64_t dv),
                (dtype, KC_ptr, stride_kc_blk, stride_kc_slot, stride_kc_h, VC_ptr, stride_vc_blk, stride_vc_slot,
                 stride_vc_h, KN_ptr, stride_kn_b, stride_kn_t, stride_kn_h, VN_ptr, stride_vn_b, stride_vn_t,
                 stride_vn_h, POS_ptr, stride_pos, LOC_ptr, stride_loc, SEQLEN_ptr, SEQSTART_ptr, Q_ptr, stride_q_b,
                 stride_q_t, stride_q_h,
                 QO_ptr, stride_qo_b, stride_qo_t, stride_qo_h, hq, COS_ptr, SIN_ptr, tab_dt, stride_tab_row,
                 stride_tab_col, style, BT_ptr, stride_bt_b, stride_bt_p, page, b, s_new, h, d, dv))
