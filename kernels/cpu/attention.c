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
enum { ITEM_ROWS = 64 };        /* rows per work item: K/V reuse vs running state in L1/L2 */
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
    float *qf, *acc, *s, *kbuf, *vblk, *m, *alpha;
    double *l;
    int64_t *lo, *hi;
    const char *kr[BLOCK_N], *vr[BLOCK_N];
    const float *vp[BLOCK_N];                       /* fp32 V rows of one kv head */
} scratch;

typedef struct {
    const attn_params *p;
    int64_t bm, nqb, chunks, items;     /* query rows per item, query blocks, kv-head chunks */
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

/* 16 fp32 lanes as a GCC/Clang generic vector: one zmm, two ymm or four xmm, so each ISA path
 * runs the same lane-wise IEEE operations (no FMA under -ffp-contract=off) and gives the same
 * bits; written out because the auto-vectoriser spills the lane sums of a dot product to the
 * stack and reloads P V accumulators through memory on every key. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

KP_INLINE v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* Lane sum in a fixed pairwise order: lane k + 8, then + 4, + 2, + 1. */
KP_INLINE float hsum(v16 a) {
    v8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 x = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (x[0] + x[2]) + (x[1] + x[3]);
}

/* s[t * BLOCK_N] = q_t . k for NR rows of q (d apart) sharing one load of k: lane k of 16 takes
 * c = k mod 16 in order, then hsum, then the tail c >= d - d % 16 in order. */
KP_INLINE void dot_tile(const float *q, const float *k, int64_t d, float *s, int NR) {
    v16 a[4] = {0};
    int64_t d16 = d - d % 16, c = 0;
    for (; c < d16; c += 16) {
        v16 kv = ld16(k + c);
        for (int t = 0; t < NR; t++) a[t] += ld16(q + t * d + c) * kv;
    }
    for (int t = 0; t < NR; t++) {
        float x = hsum(a[t]);
        for (int64_t cc = d16; cc < d; cc++) x += q[t * d + cc] * k[cc];
        s[t * BLOCK_N] = x;
    }
}

/* acc_t = acc_t * alpha_t + sum_{jj in [ja, n)} p_t[jj] v_jj for NR rows (p rows BLOCK_N apart,
 * acc rows dv apart): the block's sum is formed in registers, in key order, then added once. */
KP_INLINE void pv_tile(const float *p, const float *const *v, int64_t ja, int64_t n, int64_t dv,
                       float *acc, const float *alpha, int NR) {
    int64_t d16 = dv - dv % 16;
    for (int64_t c = 0; c < d16; c += 16) {
        v16 a[4] = {0};
        for (int64_t jj = ja; jj < n; jj++) {
            v16 x = ld16(v[jj] + c);
            for (int t = 0; t < NR; t++) a[t] += p[t * BLOCK_N + jj] * x;
        }
        for (int t = 0; t < NR; t++) {
            if (alpha[t] < 0.0f) continue;          /* no key of this row in the block */
            v16 o = ld16(acc + t * dv + c) * alpha[t] + a[t];
            memcpy(acc + t * dv + c, &o, sizeof o);
        }
    }
    for (int t = 0; t < NR; t++) {
        if (alpha[t] < 0.0f) continue;
        for (int64_t c = d16; c < dv; c++) {
            float x = 0.0f;
            for (int64_t jj = ja; jj < n; jj++) x += p[t * BLOCK_N + jj] * v[jj][c];
            acc[t * dv + c] = acc[t * dv + c] * alpha[t] + x;
        }
    }
}

/* Token rows (bytes, kv head 0) of keys j0 .. j0 + n - 1 of sequence bi. */
KP_INLINE void key_rows(const attn_params *p, int64_t bi, int64_t j0, int64_t n, const char **kr,
                        const char **vr, int64_t size) {
    for (int64_t jj = 0; jj < n; jj++) {
        int64_t t = j0 + jj, blk = bi, slot = t;
        if (p->page) {
            blk = p->block_table[bi * p->stride_bt_b + t / p->page * p->stride_bt_p];
            slot = t % p->page;
        }
        kr[jj] = (const char *)p->k + (blk * p->stride_k_b + slot * p->stride_k_s) * size;
        vr[jj] = (const char *)p->v + (blk * p->stride_v_b + slot * p->stride_v_s) * size;
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

/* Rows of an item: r = (h - h0) * nq + (i - i0), so the rows of one kv head are contiguous. */
typedef struct { int64_t bi, i0, nq, h0, g0, g1, R, RG; } item_rows;

/* One key block [j0, j0 + n) for the rows of an item, which reads keys ja .. n - 1 of it. */
KP_INLINE void attend_block(const attn_params *p, scratch *w, const item_rows *it, int64_t j0,
                            int64_t ja, int64_t n, const char **kr, const char **vr, int dt) {
    const int64_t d = p->d, dv = p->d_v, size = kp_itemsize(dt), R = it->R, RG = it->RG;
    const float scale = (float)p->scale, cap = (float)p->softcap;
    for (int64_t jj = ja; jj < n; jj++) {           /* scores: each K row loaded once per group */
        for (int64_t g = it->g0, r0 = 0; g < it->g1; g++, r0 += RG) {
            prefetch_row(vr[jj] + g * p->stride_v_h * size, dv * size);   /* token order, for P V */
            const float *kf = widen(kr[jj] + g * p->stride_k_h * size, w->kbuf, d, dt);
            int64_t r = r0;
            for (; r + 4 <= r0 + RG; r += 4) dot_tile(w->qf + r * d, kf, d, w->s + r * BLOCK_N + jj, 4);
            for (; r < r0 + RG; r++) dot_tile(w->qf + r * d, kf, d, w->s + r * BLOCK_N + jj, 1);
        }
    }
    for (int64_t r = 0; r < R; r++) {               /* online softmax, per row; s becomes p */
        float *s = w->s + r * BLOCK_N;
        const int64_t lo = w->lo[r], hi = w->hi[r];
        w->alpha[r] = -1.0f;                        /* marks a row with no key in this block */
        if (hi < j0 || lo >= j0 + n || lo > hi) {
            for (int64_t jj = 0; jj < n; jj++) s[jj] = 0.0f;
            continue;
        }
        float bm = -INFINITY;
        for (int64_t jj = 0; jj < n; jj++) {       /* keys before ja are masked for every row */
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
    }
    for (int64_t g = it->g0, r0 = 0; g < it->g1; g++, r0 += RG) {   /* P V, one kv head at a time */
        for (int64_t jj = ja; jj < n; jj++) {
            const char *row = vr[jj] + g * p->stride_v_h * size;
            w->vp[jj] = dt == KP_F32 ? (const float *)row : widen(row, w->vblk + jj * dv, dv, dt);
        }
        int64_t r = r0;
        for (; r + 4 <= r0 + RG; r += 4)
            pv_tile(w->s + r * BLOCK_N, w->vp, ja, n, dv, w->acc + r * dv, w->alpha + r, 4);
        for (; r < r0 + RG; r++)
            pv_tile(w->s + r * BLOCK_N, w->vp, ja, n, dv, w->acc + r * dv, w->alpha + r, 1);
    }
}

KP_INLINE void run_item(const attn_params *p, scratch *w, const shared *sh, int64_t item, int dt) {
    const int64_t G = p->h_q / p->h_kv, size = kp_itemsize(dt), d = p->d, dv = p->d_v;
    const int64_t gpc = (p->h_kv + sh->chunks - 1) / sh->chunks;     /* kv heads per chunk */
    item_rows it;
    it.bi = item / (sh->nqb * sh->chunks);
    it.i0 = item / sh->chunks % sh->nqb * sh->bm;
    it.g0 = item % sh->chunks * gpc;
    it.g1 = it.g0 + gpc < p->h_kv ? it.g0 + gpc : p->h_kv;
    it.nq = p->s_q - it.i0 < sh->bm ? p->s_q - it.i0 : sh->bm;
    it.h0 = it.g0 * G;
    it.RG = G * it.nq;
    it.R = (it.g1 - it.g0) * it.RG;
    if (it.R <= 0) return;
    const int64_t L = p->seqlens ? p->seqlens[it.bi * p->stride_sl] : p->s_k;
    int64_t jlo = INT64_MAX, jhi = -1;
    for (int64_t r = 0; r < it.R; r++) {
        int64_t i = it.i0 + r % it.nq, h = it.h0 + r / it.nq;
        key_range(p, i, L, &w->lo[r], &w->hi[r]);
        if (w->lo[r] <= w->hi[r]) {
            jlo = w->lo[r] < jlo ? w->lo[r] : jlo;
            jhi = w->hi[r] > jhi ? w->hi[r] : jhi;
        }
        const char *qrow = (const char *)p->q + (it.bi * p->stride_q_b + i * p->stride_q_s + h * p->stride_q_h) * size;
        for (int64_t c = 0; c < d; c++) w->qf[r * d + c] = kp_load(qrow, c, dt);
        for (int64_t c = 0; c < dv; c++) w->acc[r * dv + c] = 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0;
    }
    /* blocks sit at multiples of BLOCK_N, so a row's arithmetic does not depend on which rows
     * share its item: the bits are the same however items are split */
    for (int64_t j0 = jlo - jlo % BLOCK_N; j0 <= jhi; j0 += BLOCK_N) {
        int64_t a = j0 > jlo ? j0 : jlo, n = jhi + 1 - j0 < BLOCK_N ? jhi + 1 - j0 : BLOCK_N;
        key_rows(p, it.bi, a, j0 + n - a, w->kr + (a - j0), w->vr + (a - j0), size);
        attend_block(p, w, &it, j0, a - j0, n, w->kr, w->vr, dt);
    }
    for (int64_t r = 0; r < it.R; r++) {
        int64_t i = it.i0 + r % it.nq, h = it.h0 + r / it.nq;
        char *orow = (char *)p->o + (it.bi * p->stride_o_b + i * p->stride_o_s + h * p->stride_o_h) * size;
        float *lse = p->lse + it.bi * p->stride_lse_b + h * p->stride_lse_h + i * p->stride_lse_s;
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
        if (dt == KP_F16) run_item(sh->p, w, sh, item, KP_F16);
        else if (dt == KP_BF16) run_item(sh->p, w, sh, item, KP_BF16);
        else run_item(sh->p, w, sh, item, KP_F32);
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
    /* Items: (sequence, query block, chunk of kv heads), about ITEM_ROWS rows each, so the
     * running state stays in L1/L2; a decode keeps all of a sequence's heads in one item when
     * they fit, reading each token's K/V row (h_kv * d elements) in one sequential stream, and
     * splits heads only to give every thread an item. Any split gives the same bits (run_item). */
    const int64_t G = p->h_q / p->h_kv;
    int64_t nt = p->threads < 1 ? 1 : p->threads, bm = p->s_q, gpc;
    nt = nt < MAX_THREADS ? nt : MAX_THREADS;
    if (!p->seqlens) bm = ITEM_ROWS / G > 1 ? (ITEM_ROWS / G < bm ? ITEM_ROWS / G : bm) : 1;
    const int64_t nqb = (p->s_q + bm - 1) / bm, base = p->b * nqb;
    gpc = ITEM_ROWS / (G * bm);
    gpc = gpc < 1 ? 1 : gpc > p->h_kv ? p->h_kv : gpc;
    if (base * ((p->h_kv + gpc - 1) / gpc) < nt) {
        int64_t want = (nt + base - 1) / base;
        gpc = p->h_kv / want > 1 ? p->h_kv / want : 1;
    }
    sh->p = p;
    sh->bm = bm;
    sh->nqb = nqb;
    sh->chunks = (p->h_kv + gpc - 1) / gpc;
    sh->items = base * sh->chunks;
    atomic_init(&sh->next, 0);
    nt = nt < sh->items ? nt : sh->items;
    const int64_t R = bm * G * gpc, d = p->d, dv = p->d_v;
    const size_t floats = (size_t)(R * d + R * dv + R * BLOCK_N + d + BLOCK_N * dv + 2 * R);
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
        w->s = w->acc + R * dv;
        w->kbuf = w->s + R * BLOCK_N;
        w->vblk = w->kbuf + d;
        w->m = w->vblk + BLOCK_N * dv;
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
