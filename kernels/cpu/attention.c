/* attention.c — attention over dense keys (prefill) and over a KV cache (decode, paged decode).
 *
 *   s_ij  = scale * q_i . k_j
 *   s_ij  = cap * tanh(s_ij / cap)                 when cap > 0, before the mask
 *   s_ij  = -inf outside [lo_i, hi_i]              causal / window / sequence length (key_range)
 *   LSE_i = ln sum_j exp(s_ij)                     natural log, -inf for a fully masked row
 *   O_i   = sum_j exp(s_ij - LSE'_i) v_j           LSE' = ln(exp(LSE) + exp(S_h)) with a sink
 *
 * Conventions (OPS.md, attention; refimpl/attention.py): q (b, s_q, h_q, d), keys/values per
 * sequence (b, s_k, h_kv, d) or through a page table (num_blocks, page, h_kv, d) + block_table,
 * o (b, s_q, h_q, d_v), lse (b, h_q, s_q) fp32 excluding the sink. Every stride is in elements and
 * may be anything except the last axis (stride 1). Query h reads kv head h / (h_q / h_kv). Causal
 * alignment is per sequence: diag = i + L - s_q (bottom_right, and the window's diagonal without
 * causal) or i (top_left), L the sequence's key count; the window (left, right) keeps
 * diag - left <= j <= diag + right, -1 unbounded, causal forces right = 0. Keys outside the union
 * of a work item's ranges are never read (caches hold NaN there); a masked key inside it gets no
 * dot product and no weight. A fully masked row gives O = 0, LSE = -inf.
 *
 * Algorithm: one work item = one sequence, one kv head, a block of query rows; its R rows (queries
 * x the G = h_q / h_kv heads of the group) share every K/V row, so each is loaded once per group.
 * Keys stream in blocks of BLOCK_N with an online softmax: per row a running max m and sum l,
 * rescaled by alpha = exp(m_old - m_new) when a block raises the max.
 * fp32 accumulation: scores are fp32 dot products in 16 lanes summed pairwise (the common.h lane
 * convention, so every ISA path gives the same bits); exp(s - m) is kp_exp_diff (~1 ulp however
 * far below the max); each block's P V is summed into a fresh fp32 row and added to the rescaled
 * accumulator (two-level summation, so the error grows with BLOCK_N + n / BLOCK_N, not n); l sums
 * fp32 block sums in double. The final O = acc / l (or acc * exp(m - M) / (l exp(m - M) +
 * exp(S - M)) with a sink, M = max(m, S)) and LSE = m + ln l are formed in double and rounded once.
 *
 * Memory traffic: a (b, s, h_kv, d) cache puts one head's consecutive tokens h_kv * d elements
 * apart, each in its own 4 KiB page, where the hardware prefetcher does not follow; the rows of the
 * next key block are prefetched (one line per K or V row element group) while the current block is
 * scored and summed, so a decode streams the cache at close to the core's bandwidth.
 *
 * Threads: items are handed out by an atomic counter; each is computed start to end by one thread
 * with the same code, so the output bits do not depend on the thread count or the schedule.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"

enum { BLOCK_N = 64 };          /* keys per online-softmax step */
enum { PREFILL_ROWS = 64 };     /* rows per prefill item: K/V block reuse vs scratch in L1/L2 */
enum { MAX_THREADS = 64 };

typedef struct {                /* mirrored by kernels/cpu/attention.py (_Params) */
    int64_t dtype;
    const void *q; int64_t stride_q_b, stride_q_s, stride_q_h;
    const void *k; int64_t stride_k_b, stride_k_s, stride_k_h;   /* paged: b = block, s = slot */
    const void *v; int64_t stride_v_b, stride_v_s, stride_v_h;
    const int32_t *block_table; int64_t stride_bt_b, stride_bt_p, page;   /* page 0: not paged */
    const int32_t *seqlens; int64_t stride_sl;                    /* NULL: every sequence s_k */
    const float *sinks; int64_t stride_sinks;                     /* NULL: no sink */
    void *o; int64_t stride_o_b, stride_o_s, stride_o_h;
    float *lse; int64_t stride_lse_b, stride_lse_h, stride_lse_s;
    int64_t b, s_q, s_k, h_q, h_kv, d, d_v;
    int64_t causal, left, right;                                  /* causal: 0 none, 1 br, 2 tl */
    double scale, softcap;
    int64_t threads;
} attn_params;

typedef struct {                /* one thread's buffers, sized for the largest item */
    float *qf, *acc, *pv, *s, *kbuf, *vbuf, *m, *alpha;
    double *l;
    int64_t *lo, *hi;
    const char *kr[2][BLOCK_N], *vr[2][BLOCK_N];
} scratch;

typedef struct {
    const attn_params *p;
    int64_t bm, items;
    atomic_llong next;
    scratch w[MAX_THREADS];
} shared;

typedef struct { shared *sh; int tid; } worker_arg;

/* Keys query i may attend: [lo, hi], empty when lo > hi (refimpl.attention.mask). */
KP_INLINE void key_range(const attn_params *p, int64_t i, int64_t L, int64_t *lo, int64_t *hi) {
    int64_t diag = p->causal == 2 ? i : i + L - p->s_q;
    int64_t right = p->causal ? 0 : p->right, left = p->left;
    int64_t l = 0, h = L - 1;
    if (right >= 0 && right <= L + p->s_q && diag + right < h) h = diag + right;  /* larger: unbounded */
    if (left >= 0 && left <= L + p->s_q && diag - left > l) l = diag - left;
    *lo = l;
    *hi = h;
}

/* cap * tanh(x / cap) via Cephes' tanhf: odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above
 * (kp_expf, overflow to inf gives exactly 1); ~2 ulp, branch-free so the block loop vectorises. */
KP_INLINE float softcap_logit(float s, float cap) {
    float x = s / cap, z = fabsf(x), zz = x * x;
    float small = ((((-5.70498872745e-3f * zz + 2.06390887954e-2f) * zz - 5.37397155531e-2f) * zz
                    + 1.33314422036e-1f) * zz - 3.33332819422e-1f) * zz * x + x;
    float large = copysignf(1.0f - 2.0f / (kp_expf(2.0f * z) + 1.0f), x);
    return cap * (z < 0.625f ? small : large);
}

/* a . b over d elements: 16 lanes (lane k takes c = k mod 16 in order), pairwise lane sum, then
 * the tail in order. Bitwise the same on every ISA path (no FMA, fixed order). */
KP_INLINE float dot(const float *a, const float *b, int64_t d) {
    float acc[KP_LANES] = {0};
    int64_t dv = d - d % KP_LANES, c = 0;
    for (; c < dv; c += KP_LANES)
        KP_FOR_LANES(k) acc[k] += a[c + k] * b[c + k];
    for (int w = KP_LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];
    float s = acc[0];
    for (; c < d; c++) s += a[c] * b[c];
    return s;
}

/* Row pointers (bytes) of keys j0 .. j0 + n - 1 of sequence bi, kv head g. */
KP_INLINE void key_rows(const attn_params *p, int64_t bi, int64_t g, int64_t j0, int64_t n,
                        const char **kr, const char **vr, int64_t size) {
    for (int64_t jj = 0; jj < n; jj++) {
        int64_t t = j0 + jj, blk = bi, slot = t;
        if (p->page) {
            blk = p->block_table[bi * p->stride_bt_b + t / p->page * p->stride_bt_p];
            slot = t % p->page;
        }
        kr[jj] = (const char *)p->k + (blk * p->stride_k_b + slot * p->stride_k_s + g * p->stride_k_h) * size;
        vr[jj] = (const char *)p->v + (blk * p->stride_v_b + slot * p->stride_v_s + g * p->stride_v_h) * size;
    }
}

KP_INLINE void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

/* fp32 view of a row: fp32 rows are used in place, fp16/bf16 are widened into buf. */
KP_INLINE const float *widen(const char *row, float *buf, int64_t n, int dt) {
    if (dt == KP_F32) return (const float *)row;
    for (int64_t c = 0; c < n; c++) buf[c] = kp_load(row, c, dt);
    return buf;
}

/* One key block [j0, j0 + n) for the R rows of an item; (kn, vn, nn): the next block, prefetched. */
KP_INLINE void attend_block(const attn_params *p, scratch *w, int64_t R, int64_t j0, int64_t n,
                            const char **kr, const char **vr, const char **kn, const char **vn,
                            int64_t nn, int dt) {
    const int64_t d = p->d, dv = p->d_v, size = kp_itemsize(dt);
    const float scale = (float)p->scale, cap = (float)p->softcap;
    for (int64_t jj = 0; jj < n; jj++) {            /* scores: each K row loaded once, R dots */
        if (jj < nn) prefetch_row(kn[jj], d * size);
        const float *kf = widen(kr[jj], w->kbuf, d, dt);
        for (int64_t r = 0; r < R; r++) {
            int64_t j = j0 + jj;
            w->s[r * BLOCK_N + jj] = j < w->lo[r] || j > w->hi[r] ? -INFINITY : dot(w->qf + r * d, kf, d);
        }
    }
    for (int64_t r = 0; r < R; r++) {               /* online softmax, per row */
        float *s = w->s + r * BLOCK_N;
        const int64_t lo = w->lo[r], hi = w->hi[r];
        w->alpha[r] = -1.0f;                        /* marks a row with no key in this block */
        if (hi < j0 || lo >= j0 + n || lo > hi) continue;
        float bm = -INFINITY;
        for (int64_t jj = 0; jj < n; jj++) {
            float x = s[jj] * scale;
            if (cap > 0.0f) x = softcap_logit(x, cap);
            x = j0 + jj >= lo && j0 + jj <= hi ? x : -INFINITY;
            s[jj] = x;
            bm = x > bm || x != x ? x : bm;         /* NaN propagates to the row, as in the golden */
        }
        float m = w->m[r], m_new = bm > m || bm != bm ? bm : m;
        w->alpha[r] = m_new == m ? 1.0f : kp_exp_diff(m, m_new);   /* m = -inf: 0 */
        float part[KP_LANES] = {0};
        int64_t nv = n - n % KP_LANES, jj = 0;
        for (; jj < nv; jj += KP_LANES)
            KP_FOR_LANES(k) {
                float e = kp_exp_diff(s[jj + k], m_new);            /* -inf: exactly 0 */
                s[jj + k] = e;
                part[k] += e;
            }
        double bs = 0.0;
        for (; jj < n; jj++) {
            s[jj] = kp_exp_diff(s[jj], m_new);
            bs += s[jj];
        }
        for (int k = 0; k < KP_LANES; k++) bs += part[k];
        w->l[r] = w->l[r] * w->alpha[r] + bs;
        w->m[r] = m_new;
        for (int64_t c = 0; c < dv; c++) w->pv[r * dv + c] = 0.0f;
    }
    for (int64_t jj = 0; jj < n; jj++) {            /* P V: each V row loaded once */
        if (jj < nn) prefetch_row(vn[jj], dv * size);
        const float *vf = widen(vr[jj], w->vbuf, dv, dt);
        for (int64_t r = 0; r < R; r++) {
            float pj = w->s[r * BLOCK_N + jj];
            if (w->alpha[r] < 0.0f || pj == 0.0f) continue;   /* masked or underflowed: no term */
            float *pv = w->pv + r * dv;
            for (int64_t c = 0; c < dv; c++) pv[c] += pj * vf[c];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float a = w->alpha[r], *acc = w->acc + r * dv;
        const float *pv = w->pv + r * dv;
        if (a < 0.0f) continue;
        if (a == 1.0f)
            for (int64_t c = 0; c < dv; c++) acc[c] += pv[c];
        else
            for (int64_t c = 0; c < dv; c++) acc[c] = acc[c] * a + pv[c];
    }
}

KP_INLINE void run_item(const attn_params *p, scratch *w, int64_t bm, int64_t item, int dt) {
    const int64_t G = p->h_q / p->h_kv, nqb = (p->s_q + bm - 1) / bm, size = kp_itemsize(dt);
    const int64_t bi = item / (p->h_kv * nqb), g = item / nqb % p->h_kv, i0 = item % nqb * bm;
    const int64_t nq = p->s_q - i0 < bm ? p->s_q - i0 : bm, R = nq * G, d = p->d, dv = p->d_v;
    const int64_t L = p->seqlens ? p->seqlens[bi * p->stride_sl] : p->s_k;
    int64_t jlo = INT64_MAX, jhi = -1;
    for (int64_t r = 0; r < R; r++) {
        int64_t i = i0 + r / G, h = g * G + r % G;
        key_range(p, i, L, &w->lo[r], &w->hi[r]);
        if (w->lo[r] <= w->hi[r]) {
            jlo = w->lo[r] < jlo ? w->lo[r] : jlo;
            jhi = w->hi[r] > jhi ? w->hi[r] : jhi;
        }
        const char *qrow = (const char *)p->q + (bi * p->stride_q_b + i * p->stride_q_s + h * p->stride_q_h) * size;
        for (int64_t c = 0; c < d; c++) w->qf[r * d + c] = kp_load(qrow, c, dt);
        for (int64_t c = 0; c < dv; c++) w->acc[r * dv + c] = 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0;
    }
    int cur = 0;
    if (jlo <= jhi) key_rows(p, bi, g, jlo, jhi - jlo + 1 < BLOCK_N ? jhi - jlo + 1 : BLOCK_N,
                             w->kr[0], w->vr[0], size);
    for (int64_t j0 = jlo; j0 <= jhi; j0 += BLOCK_N, cur ^= 1) {
        int64_t n = jhi + 1 - j0 < BLOCK_N ? jhi + 1 - j0 : BLOCK_N;
        int64_t j1 = j0 + n, nn = jhi + 1 - j1 < BLOCK_N ? jhi + 1 - j1 : BLOCK_N;
        nn = nn > 0 ? nn : 0;
        key_rows(p, bi, g, j1, nn, w->kr[cur ^ 1], w->vr[cur ^ 1], size);
        attend_block(p, w, R, j0, n, w->kr[cur], w->vr[cur], w->kr[cur ^ 1], w->vr[cur ^ 1], nn, dt);
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t i = i0 + r / G, h = g * G + r % G;
        char *orow = (char *)p->o + (bi * p->stride_o_b + i * p->stride_o_s + h * p->stride_o_h) * size;
        float *lse = p->lse + bi * p->stride_lse_b + h * p->stride_lse_h + i * p->stride_lse_s;
        const float *acc = w->acc + r * dv;
        double m = w->m[r], l = w->l[r], wt;
        if (m == -INFINITY) {                       /* no key: O = 0, LSE = -inf */
            for (int64_t c = 0; c < dv; c++) kp_store(orow, c, 0.0f, dt);
            *lse = -INFINITY;
            continue;
        }
        *lse = (float)(m + log(l));
        if (p->sinks) {                             /* the sink joins the denominator only */
            double S = p->sinks[h * p->stride_sinks], M = S > m ? S : m, e = exp(m - M);
            wt = e / (l * e + exp(S - M));
        } else {
            wt = 1.0 / l;
        }
        for (int64_t c = 0; c < dv; c++) kp_store(orow, c, (float)((double)acc[c] * wt), dt);
    }
}

KP_INLINE void work(worker_arg *a) {
    shared *sh = a->sh;
    scratch *w = &sh->w[a->tid];
    const int dt = (int)sh->p->dtype;
    for (;;) {
        int64_t item = atomic_fetch_add(&sh->next, 1);
        if (item >= sh->items) return;
        /* one instantiation per dtype, so loads and stores inline as constants */
        if (dt == KP_F16) run_item(sh->p, w, sh->bm, item, KP_F16);
        else if (dt == KP_BF16) run_item(sh->p, w, sh->bm, item, KP_BF16);
        else run_item(sh->p, w, sh->bm, item, KP_F32);
    }
}

/* The thread entry compiled per ISA (KP_MULTIVERSION's scheme, for a pthread start routine). */
#ifdef KP_TARGET_AVX512
KP_TARGET_AVX512 static void *work_avx512(void *a) { work(a); return NULL; }
KP_TARGET_AVX2 static void *work_avx2(void *a) { work(a); return NULL; }
#endif
__attribute__((noinline)) static void *work_base(void *a) { work(a); return NULL; }

KP_EXPORT int attention_kernel(const attn_params *p) {
    if (p->dtype != KP_F32 && p->dtype != KP_F16 && p->dtype != KP_BF16) return KP_ERR_DTYPE;
    if (p->b <= 0 || p->s_q <= 0 || p->h_q <= 0) return KP_OK;
    void *(*fn)(void *) = work_base;
#ifdef KP_TARGET_AVX512
    int isa = kp_isa();
    fn = isa == 2 ? work_avx512 : isa == 1 ? work_avx2 : work_base;
#endif
    shared *sh = calloc(1, sizeof(shared));
    if (!sh) return KP_ERR_NOMEM;
    const int64_t G = p->h_q / p->h_kv;
    sh->p = p;
    sh->bm = p->seqlens ? p->s_q : (PREFILL_ROWS / G > 1 ? PREFILL_ROWS / G : 1);
    sh->bm = sh->bm < p->s_q ? sh->bm : p->s_q;
    sh->items = p->b * p->h_kv * ((p->s_q + sh->bm - 1) / sh->bm);
    atomic_init(&sh->next, 0);
    int64_t nt = p->threads < 1 ? 1 : p->threads;
    nt = nt < MAX_THREADS ? nt : MAX_THREADS;
    nt = nt < sh->items ? nt : sh->items;
    const int64_t R = sh->bm * G, d = p->d, dv = p->d_v;
    const size_t floats = (size_t)(R * d + 2 * R * dv + R * BLOCK_N + d + dv + 2 * R);
    int status = KP_OK;
    for (int64_t t = 0; t < nt && status == KP_OK; t++) {   /* all buffers before any work */
        scratch *w = &sh->w[t];
        char *mem = malloc(floats * sizeof(float) + (size_t)R * (sizeof(double) + 2 * sizeof(int64_t)));
        if (!mem) { status = KP_ERR_NOMEM; break; }
        w->l = (double *)mem;
        w->lo = (int64_t *)(w->l + R);
        w->hi = w->lo + R;
        w->qf = (float *)(w->hi + R);
        w->acc = w->qf + R * d;
        w->pv = w->acc + R * dv;
        w->s = w->pv + R * dv;
        w->kbuf = w->s + R * BLOCK_N;
        w->vbuf = w->kbuf + d;
        w->m = w->vbuf + dv;
        w->alpha = w->m + R;
    }
    if (status == KP_OK) {
        worker_arg args[MAX_THREADS];
        pthread_t tids[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int t = 0; t < nt; t++) args[t] = (worker_arg){sh, t};
        for (int t = 1; t < nt; t++)                /* a thread that fails to start leaves its items to the rest */
            started[t] = pthread_create(&tids[t], NULL, fn, &args[t]) == 0;
        fn(&args[0]);
        for (int t = 1; t < nt; t++)
            if (started[t]) pthread_join(tids[t], NULL);
    }
    for (int64_t t = 0; t < nt; t++) free(sh->w[t].l);
    free(sh);
    return status;
}
