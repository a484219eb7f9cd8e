/* attention_bwd.c — attention backward (prefill, packed varlen) with a materialised score buffer, fp32.
 *
 *   t_ij   = scale q_i . k_j, or cap tanh(scale q_i . k_j / cap)      -inf outside [lo_i, hi_i]
 *   P_ij   = exp(t_ij - L_i)                  L: the forward's LSE with the sink folded in (input)
 *   Delta_i = sum_c dO_ic O_ic - dL_i          O: the forward's output (input); dL: LSE cotangent or 0
 *   dS_ij  = P_ij (dO_i . v_j - Delta_i) (1 - (t_ij / cap)^2)            the last factor with a softcap
 *   dq_i   = scale sum_j dS_ij k_j;  dk_j = scale sum_i dS_ij q_i;  dv_j = sum_i P_ij dO_i
 *   dsinks_h = -sum_{b, i} exp(S_h - L_i) Delta_i                          rows with L = -inf give 0
 *
 * Conventions (OPS.md, backward; refimpl/attention_grad.py): q (b, s_q, h_q, d), k (b, s_k, h_kv, d),
 * v (b, s_k, h_kv, d_v), o and do like q with d_v, lse and dlse (b, h_q, s_q) fp32; packed varlen
 * (cu_q, cu_k given): rows cu[i] .. cu[i + 1] of (total, h, d) tensors, lse (h_q, total_q), batch
 * strides 0. Masks as attention.c: diag = i + L_k - L_q (bottom_right and no causal) or i (top_left),
 * keep diag - left <= j <= diag + right, -1 unbounded, causal forces right = 0, per sequence. Query
 * head h reads kv head h / (h_q / h_kv). Gradients are written in the inputs' dtype, rounded once;
 * keys no query sees get dk = dv = 0, a row with no key dq = 0, never NaN; keys outside a sequence
 * are never read.
 *
 * Algorithm (C-Kernel-Engine's causal GQA backward, generalised): a work item is one sequence and
 * one kv head. Its K and V rows are widened to fp32 once; then for each of the group's G query
 * heads the whole score matrix of the sequence is materialised (T: t_ij, P: P_ij, s_q x s_k fp32),
 * dv accumulates P^T dO, T is overwritten with dS, dq = dS K row by row, and dk accumulates dS^T Q.
 * dk and dv of the kv head sum the G query heads in fp32 buffers and are rounded once at the end
 * (the GQA reduction, no atomics). Dot products run in 16 fp32 lanes summed pairwise; the row sums
 * Delta likewise. dsinks: each item adds its rows in double into its own slot (sequence, head),
 * summed over sequences in order after the threads join: the bits do not depend on the thread count.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"

enum { MAX_THREADS = 64 };

typedef struct {                /* mirrored by kernels/cpu/attention_bwd.py (_Params) */
    int64_t dtype;
    const void *q; int64_t stride_q_b, stride_q_s, stride_q_h;
    const void *k; int64_t stride_k_b, stride_k_s, stride_k_h;
    const void *v; int64_t stride_v_b, stride_v_s, stride_v_h;
    const void *o; int64_t stride_o_b, stride_o_s, stride_o_h;
    const void *dout; int64_t stride_do_b, stride_do_s, stride_do_h;
    const float *lse; int64_t stride_lse_b, stride_lse_h, stride_lse_s;
    const float *dlse; int64_t stride_dlse_b, stride_dlse_h, stride_dlse_s;   /* NULL: no LSE cotangent */
    const float *sinks; int64_t stride_sinks;                                 /* NULL: no sink */
    const int32_t *cu_q, *cu_k;                                               /* NULL: dense (b, s, h, d) */
    void *dq; int64_t stride_dq_b, stride_dq_s, stride_dq_h;
    void *dk; int64_t stride_dk_b, stride_dk_s, stride_dk_h;
    void *dv; int64_t stride_dv_b, stride_dv_s, stride_dv_h;
    float *dsinks; int64_t stride_dsinks;
    int64_t b, s_q, s_k, h_q, h_kv, d, d_v;                                   /* varlen: s_q, s_k the longest */
    int64_t causal, left, right;                                              /* causal: 0 none, 1 br, 2 tl */
    double scale, softcap;
    int64_t threads;
} bwd_params;

typedef struct {                /* one thread's buffers, sized for the longest sequence */
    float *kf, *vf, *qf, *dof, *t, *p, *delta, *lrow, *dk, *dv, *row;
    int64_t *lo, *hi;
} scratch;

typedef struct {
    const bwd_params *p;
    double *sink_part;          /* (b, h_q): each sequence's rows, summed over sequences at the end */
    atomic_llong next;
    scratch w[MAX_THREADS];
} shared;

typedef struct { shared *sh; int tid; } worker_arg;

/* sum_c a[c] b[c] in 16 fp32 lanes, summed pairwise (the order is fixed: the bits too). */
KP_INLINE float dot(const float *a, const float *b, int64_t n) {
    float acc[KP_LANES] = {0};
    int64_t n16 = n - n % KP_LANES;
    for (int64_t c = 0; c < n16; c += KP_LANES)
        KP_FOR_LANES(k) acc[k] += a[c + k] * b[c + k];
    for (int w = KP_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    float s = acc[0];
    for (int64_t c = n16; c < n; c++) s += a[c] * b[c];
    return s;
}

/* y[0:n] += a x[0:n] */
KP_INLINE void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t c = 0; c < n; c++) y[c] += a * x[c];
}

/* Keys query i of a sequence with L_q queries and L_k keys may attend: [lo, hi], empty when lo > hi. */
KP_INLINE void key_range(const bwd_params *p, int64_t i, int64_t L_q, int64_t L_k, int64_t *lo, int64_t *hi) {
    int64_t diag = p->causal == 2 ? i : i + L_k - L_q;
    int64_t right = p->causal ? 0 : p->right, left = p->left;
    *lo = 0;
    *hi = L_k - 1;
    if (right >= 0 && right <= L_k + L_q && diag + right < *hi) *hi = diag + right;  /* larger: unbounded */
    if (left >= 0 && left <= L_k + L_q && diag - left > *lo) *lo = diag - left;
}

/* cap tanh(x / cap) and tanh(x / cap) (the derivative's factor), Cephes' tanhf as attention.c. */
KP_INLINE float tanh_cap(float x, float cap) {
    float y = x / cap, z = fabsf(y), zz = y * y;
    float small = ((((-5.70498872745e-3f * zz + 2.06390887954e-2f) * zz - 5.37397155531e-2f) * zz
                    + 1.33314422036e-1f) * zz - 3.33332819422e-1f) * zz * y + y;
    float large = copysignf(1.0f - 2.0f / (kp_expf(2.0f * z) + 1.0f), y);
    return z < 0.625f ? small : large;
}

/* Widen rows r0 .. r0 + n - 1 (stride `rs` elements, head offset `off`) of width w into dst. */
KP_INLINE void widen_rows(float *dst, const void *src, int64_t off, int64_t r0, int64_t n, int64_t rs, int64_t w,
                          int dt) {
    const int64_t size = kp_itemsize(dt);
    for (int64_t r = 0; r < n; r++) {
        const char *row = (const char *)src + (off + (r0 + r) * rs) * size;
        for (int64_t c = 0; c < w; c++) dst[r * w + c] = kp_load(row, c, dt);
    }
}

KP_INLINE void run_item(const bwd_params *p, scratch *w, double *sink_part, int64_t item, int dt) {
    const int64_t G = p->h_q / p->h_kv, d = p->d, dv = p->d_v, size = kp_itemsize(dt);
    const int64_t bi = item / p->h_kv, g = item % p->h_kv;
    int64_t q0 = 0, k0 = 0, L_q = p->s_q, L_k = p->s_k;
    if (p->cu_q) {
        q0 = p->cu_q[bi];
        k0 = p->cu_k[bi];
        L_q = p->cu_q[bi + 1] - q0;
        L_k = p->cu_k[bi + 1] - k0;
    }
    const float scale = (float)p->scale, cap = (float)p->softcap;
    widen_rows(w->kf, p->k, bi * p->stride_k_b + g * p->stride_k_h, k0, L_k, p->stride_k_s, d, dt);
    widen_rows(w->vf, p->v, bi * p->stride_v_b + g * p->stride_v_h, k0, L_k, p->stride_v_s, dv, dt);
    for (int64_t c = 0; c < L_k * d; c++) w->dk[c] = 0.0f;
    for (int64_t c = 0; c < L_k * dv; c++) w->dv[c] = 0.0f;
    for (int64_t i = 0; i < L_q; i++) key_range(p, i, L_q, L_k, &w->lo[i], &w->hi[i]);
    for (int64_t h = g * G; h < (g + 1) * G; h++) {
        widen_rows(w->qf, p->q, bi * p->stride_q_b + h * p->stride_q_h, q0, L_q, p->stride_q_s, d, dt);
        widen_rows(w->dof, p->dout, bi * p->stride_do_b + h * p->stride_do_h, q0, L_q, p->stride_do_s, dv, dt);
        widen_rows(w->row, p->o, bi * p->stride_o_b + h * p->stride_o_h, q0, L_q, p->stride_o_s, dv, dt);
        double sink_sum = 0.0;
        for (int64_t i = 0; i < L_q; i++) {         /* Delta, the LSE, the sink's share */
            const int64_t r = q0 + i;
            float L = p->lse[bi * p->stride_lse_b + h * p->stride_lse_h + r * p->stride_lse_s];
            float dl = p->dlse ? p->dlse[bi * p->stride_dlse_b + h * p->stride_dlse_h + r * p->stride_dlse_s] : 0.0f;
            w->delta[i] = dot(w->dof + i * dv, w->row + i * dv, dv) - (L == -INFINITY ? 0.0f : dl);
            w->lrow[i] = L;
            if (p->sinks && L != -INFINITY)
                sink_sum -= (double)kp_exp_diff(p->sinks[h * p->stride_sinks], L) * w->delta[i];
        }
        if (p->sinks) sink_part[bi * p->h_q + h] = sink_sum;
        /* the score matrix: T = t_ij (tanh for a softcap), P = exp(t - L), 0 outside each row's range */
        for (int64_t i = 0; i < L_q; i++) {
            float *t = w->t + i * L_k, *pr = w->p + i * L_k;
            const int64_t lo = w->lo[i], hi = w->hi[i];
            const float L = w->lrow[i];
            for (int64_t j = 0; j < L_k; j++) t[j] = pr[j] = 0.0f;
            if (L == -INFINITY) continue;            /* no key, no sink: P = 0 */
            for (int64_t j = lo; j <= hi; j++) {
                float s = scale * dot(w->qf + i * d, w->kf + j * d, d);
                if (cap > 0.0f) {
                    t[j] = tanh_cap(s, cap);
                    s = cap * t[j];
                }
                pr[j] = kp_exp_diff(s, L);
            }
        }
        for (int64_t i = 0; i < L_q; i++)            /* dv_j += P_ij dO_i */
            for (int64_t j = w->lo[i]; j <= w->hi[i]; j++) axpy(w->dv + j * dv, w->p[i * L_k + j], w->dof + i * dv, dv);
        for (int64_t i = 0; i < L_q; i++) {          /* dS in place of T; dq_i; dk_j += dS_ij q_i */
            float *t = w->t + i * L_k;
            const float *pr = w->p + i * L_k;
            for (int64_t c = 0; c < d; c++) w->row[c] = 0.0f;
            for (int64_t j = w->lo[i]; j <= w->hi[i]; j++) {
                float ds = pr[j] * (dot(w->dof + i * dv, w->vf + j * dv, dv) - w->delta[i]);
                if (cap > 0.0f) ds *= 1.0f - t[j] * t[j];
                axpy(w->row, ds, w->kf + j * d, d);
                axpy(w->dk + j * d, ds, w->qf + i * d, d);
            }
            char *out = (char *)p->dq + (bi * p->stride_dq_b + (q0 + i) * p->stride_dq_s + h * p->stride_dq_h) * size;
            for (int64_t c = 0; c < d; c++) kp_store(out, c, scale * w->row[c], dt);
        }
    }
    for (int64_t j = 0; j < L_k; j++) {              /* every key of the sequence, zeros included */
        char *ok = (char *)p->dk + (bi * p->stride_dk_b + (k0 + j) * p->stride_dk_s + g * p->stride_dk_h) * size;
        char *ov = (char *)p->dv + (bi * p->stride_dv_b + (k0 + j) * p->stride_dv_s + g * p->stride_dv_h) * size;
        for (int64_t c = 0; c < d; c++) kp_store(ok, c, scale * w->dk[j * d + c], dt);
        for (int64_t c = 0; c < dv; c++) kp_store(ov, c, w->dv[j * dv + c], dt);
    }
}

KP_INLINE void work(worker_arg *a) {
    shared *sh = a->sh;
    const bwd_params *p = sh->p;
    const int64_t items = p->b * p->h_kv;
    for (int64_t item; (item = atomic_fetch_add(&sh->next, 1)) < items;) {
        if (p->dtype == KP_F16) run_item(p, &sh->w[a->tid], sh->sink_part, item, KP_F16);
        else if (p->dtype == KP_BF16) run_item(p, &sh->w[a->tid], sh->sink_part, item, KP_BF16);
        else run_item(p, &sh->w[a->tid], sh->sink_part, item, KP_F32);
    }
}

#ifdef KP_TARGET_AVX512
KP_TARGET_AVX512 static void *work_avx512(void *a) { work(a); return NULL; }
KP_TARGET_AVX2 static void *work_avx2(void *a) { work(a); return NULL; }
#endif
__attribute__((noinline)) static void *work_base(void *a) { work(a); return NULL; }

KP_EXPORT int attention_backward_kernel(const bwd_params *p) {
    if (p->dtype != KP_F32 && p->dtype != KP_F16 && p->dtype != KP_BF16) return KP_ERR_DTYPE;
    if (p->b <= 0 || p->h_q <= 0) {                 /* no rows: a sink's gradient is 0 */
        if (p->sinks)
            for (int64_t h = 0; h < p->h_q; h++) p->dsinks[h * p->stride_dsinks] = 0.0f;
        return KP_OK;
    }
    void *(*fn)(void *) = work_base;
#ifdef KP_TARGET_AVX512
    int isa = kp_isa();
    fn = isa == 2 ? work_avx512 : isa == 1 ? work_avx2 : work_base;
#endif
    shared *sh = calloc(1, sizeof(shared));
    if (!sh) return KP_ERR_NOMEM;
    sh->p = p;
    sh->sink_part = calloc((size_t)(p->b * p->h_q), sizeof(double));
    const int64_t items = p->b * p->h_kv, sq = p->s_q, sk = p->s_k, d = p->d, dv = p->d_v;
    int64_t nt = p->threads < 1 ? 1 : p->threads > MAX_THREADS ? MAX_THREADS : p->threads;
    nt = nt < items ? nt : items;
    int status = sh->sink_part ? KP_OK : KP_ERR_NOMEM;
    const size_t floats = (size_t)(sk * (d + dv) * 2 + sq * (d + dv) + 2 * sq * sk + 2 * sq + sq * dv + d);
    for (int64_t t = 0; t < nt && status == KP_OK; t++) {   /* every buffer before any work */
        scratch *w = &sh->w[t];
        float *mem = calloc(floats * sizeof(float) + (size_t)(2 * sq) * sizeof(int64_t), 1);
        if (!mem) { status = KP_ERR_NOMEM; break; }
        w->kf = mem;
        w->vf = w->kf + sk * d;
        w->dk = w->vf + sk * dv;
        w->dv = w->dk + sk * d;
        w->qf = w->dv + sk * dv;
        w->dof = w->qf + sq * d;
        w->t = w->dof + sq * dv;
        w->p = w->t + sq * sk;
        w->delta = w->p + sq * sk;
        w->lrow = w->delta + sq;
        w->row = w->lrow + sq;                      /* O rows (sq x dv), then dq's row (d) */
        w->lo = (int64_t *)(mem + floats);
        w->hi = w->lo + sq;
    }
    if (status == KP_OK) {
        atomic_init(&sh->next, 0);
        worker_arg args[MAX_THREADS];
        pthread_t tids[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int t = 0; t < nt; t++) args[t] = (worker_arg){sh, t};
        for (int t = 1; t < nt; t++)                /* one that fails to start leaves its share to the rest */
            started[t] = pthread_create(&tids[t], NULL, fn, &args[t]) == 0;
        fn(&args[0]);
        for (int t = 1; t < nt; t++)
            if (started[t]) pthread_join(tids[t], NULL);
        if (p->sinks)                               /* over the batch, in order */
            for (int64_t h = 0; h < p->h_q; h++) {
                double s = 0.0;
                for (int64_t bi = 0; bi < p->b; bi++) s += sh->sink_part[bi * p->h_q + h];
                p->dsinks[h * p->stride_dsinks] = (float)s;
            }
    }
    for (int64_t t = 0; t < nt; t++) free(sh->w[t].kf);
    free(sh->sink_part);
    free(sh);
    return status;
}
