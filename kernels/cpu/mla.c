/* mla.c — MLA decode (DeepSeek-V2/V3 absorbed form, FlashMLA's dense decode) over a paged cache.
 *
 *   s_ij  = scale * q_i . k_j                      q_i, k_j: d = d_v + rope (576) dims
 *   s_ij  = -inf for j > L - s_q + i               causal (bottom-right); else every j < L
 *   LSE_i = ln sum_j exp(s_ij)                     natural log, -inf for a row with no key
 *   O_i   = sum_j exp(s_ij - LSE_i) k_j[:d_v]      V is the first d_v dims of the same cache row
 *
 * Conventions (refimpl/mla.py decode): q (b, s_q, h_q, d); h_kv latent "kv heads" (DeepSeek: 1):
 * kv_cache (num_blocks, page, h_kv, d), token t of request i at kv_cache[block_table[i, t / page],
 * t % page, g] for query head h of kv head g = h / (h_q / h_kv) (FlashMLA's h_kv); o (b, s_q, h_q,
 * d_v) in the input dtype; lse (b, h_q, s_q) fp32. Strides are in elements, any value except the
 * last axis (1). Cache rows at or past seqlens[i], and pages a request does not use, are never read
 * (they hold NaN in the tests); a causal row's masked keys get weight exactly 0. A row with no key
 * (seqlen 0, or s_q > seqlen under causal) gives O = 0, LSE = -inf. NaN in a live score reaches
 * its row.
 *
 * Algorithm: a work item is one (request, kv head) and a chunk of its s_q * h_q / h_kv query rows,
 * all of which read the same cache rows (MQA within the kv head), so each block of BLOCK_N cache
 * rows is read from memory once, widened to fp32 once (bf16/fp16: exact) into a contiguous buffer,
 * and used for the scores of every row of the item and, its first d_v columns, for P V. Keys stream
 * in blocks at multiples of BLOCK_N with an online softmax: per row a running max m and sum l,
 * rescaled by alpha = exp(m_old - m_new). fp32 accumulation throughout. A score is an fp32 dot product in 16
 * lanes (lane k takes c = k mod 16, in order), summed pairwise (kp_hsum16), then the d % 16 tail,
 * then times scale; exp(s - m) is kp_exp_diff (~1 ulp however far below the max); a block's P V is
 * summed in registers in key order and added once to the rescaled accumulator (two-level
 * summation: the error grows with BLOCK_N + n / BLOCK_N, not n); l adds fp32 block sums in double.
 * O = acc / l and LSE = m + ln l are formed in double and rounded once to fp32 (O then once more to
 * bf16/fp16). These are attention.c's operations in attention.c's order, so the output is bit for
 * bit that of its paged decode with h_kv = 1 and v_cache = kv_cache[..., :d_v] (the tests check it);
 * only the tiles and the memory traffic differ. A row's arithmetic depends only on its own data and
 * the block grid, never on which rows share its item, the tile it falls in, the thread that runs
 * it or the ISA path (kp_v16 lanes, no FMA): the bits are fixed.
 *
 * Register tiles (kp_v16, 16 accumulators): scores for 4 rows x 4 keys (4 q and 4 k loads per 16
 * multiply-adds; the 4 keys' lane sums reduced together by kp_hsum16x4), P V for 4 rows x 64
 * columns (4 V loads and 4 broadcasts per 16). The block buffer (BLOCK_N * d floats, 144 KiB at
 * d = 576) stays in L2 while every 4-row tile of q meets it. Measured on one core of an AMD EPYC VM
 * (AVX-512; b = 4, h_q = 16, 2048 tokens): with the cache hot, 94% of the rate of a loop of independent
 * vmulps + vaddps, the bound once FMA contraction is off; from memory, bf16 loses ~5% to the
 * widening pass. The generic attention.c kernel at the same shape is 1.4x slower.
 * Threads: items go out from an atomic counter; the output does not depend on the thread count.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"

enum { BLOCK_N = 64 };          /* keys per online-softmax step (FlashMLA's page and block) */
enum { ITEM_ROWS = 128 };       /* rows per item: 128 = DeepSeek's h_q reads the cache once */
enum { MAX_THREADS = 64 };
enum { MLA_ERR_HEADS = 3 };     /* h_q not a multiple of h_kv (mla.py refuses it first) */

typedef struct {                /* mirrored by kernels/cpu/mla.py (_Params) */
    int64_t dtype;
    const void *q; int64_t stride_q_b, stride_q_s, stride_q_h;
    const void *kv; int64_t stride_kv_blk, stride_kv_slot, stride_kv_head;
    const int32_t *block_table; int64_t stride_bt_b, stride_bt_p, page;
    const int32_t *seqlens; int64_t stride_sl;
    void *o; int64_t stride_o_b, stride_o_s, stride_o_h;
    float *lse; int64_t stride_lse_b, stride_lse_h, stride_lse_s;
    int64_t b, s_q, h_q, d, d_v, causal, h_kv;
    double scale;
    int64_t threads;
} mla_params;

typedef struct {                /* one thread's buffers, sized for the largest item */
    float *qf, *acc, *s, *kbuf, *m, *alpha;
    double *l;
    int64_t *hi;
    const char *kr[2][BLOCK_N];                     /* cache rows of this block and the next */
} scratch;

typedef struct {
    const mla_params *p;
    int64_t rows, chunks, items;                    /* rows per item, items per (request, kv head) */
    atomic_llong next;
    scratch w[MAX_THREADS];
} shared;

typedef struct { shared *sh; int tid; } worker_arg;

typedef int32_t kp_i32x16 __attribute__((vector_size(64)));

/* m ? a : b per lane, m all ones or all zeros (GCC's C has no vector ?:). */
KP_INLINE kp_v16 sel16(kp_i32x16 m, kp_v16 a, kp_v16 b) {
    return (kp_v16)(((kp_i32x16)a & m) | ((kp_i32x16)b & ~m));
}

/* s[t * BLOCK_N + u] = q_t . k_u for NR rows of q and NK keys (rows d apart), NR * NK <= 16. */
KP_INLINE void dot_tile(const float *q, const float *k, int64_t d, float *s, int NR, int NK) {
    kp_v16 a[16] = {0};
    const int64_t d16 = d - d % 16;
    for (int64_t c = 0; c < d16; c += 16) {
        kp_v16 kv[4];
        for (int u = 0; u < NK; u++) kv[u] = kp_ld16(k + u * d + c);
        for (int t = 0; t < NR; t++) {
            kp_v16 qv = kp_ld16(q + t * d + c);
            for (int u = 0; u < NK; u++) a[t * NK + u] += qv * kv[u];
        }
    }
    for (int t = 0; t < NR; t++) {
        kp_v4 h = {0};
        if (NK == 4) h = kp_hsum16x4(a[t * 4], a[t * 4 + 1], a[t * 4 + 2], a[t * 4 + 3]);
        for (int u = 0; u < NK; u++) {
            float x = NK == 4 ? h[u] : kp_hsum16(a[t * NK + u]);
            for (int64_t c = d16; c < d; c++) x += q[t * d + c] * k[u * d + c];
            s[t * BLOCK_N + u] = x;
        }
    }
}

/* acc_t[c, c + 16 CH) = acc_t * alpha_t + sum_{jj < n} p_t[jj] v_jj for NR rows (p rows BLOCK_N
 * apart, v rows d apart, acc rows dv apart), NR * CH <= 16; rows with alpha < 0 (no key in this
 * block) are left alone. */
KP_INLINE void pv_tile(const float *p, const float *v, int64_t n, int64_t c, int64_t d, int64_t dv,
                       float *acc, const float *alpha, int NR, int CH) {
    kp_v16 a[16] = {0};
    for (int64_t jj = 0; jj < n; jj++) {
        kp_v16 x[4];
        for (int u = 0; u < CH; u++) x[u] = kp_ld16(v + jj * d + c + 16 * u);
        for (int t = 0; t < NR; t++)
            for (int u = 0; u < CH; u++) a[t * CH + u] += p[t * BLOCK_N + jj] * x[u];
    }
    for (int t = 0; t < NR; t++)
        for (int u = 0; alpha[t] >= 0.0f && u < CH; u++) {
            float *o = acc + t * dv + c + 16 * u;
            kp_st16(o, kp_ld16(o) * alpha[t] + a[t * CH + u]);
        }
}

/* P V for NR rows: 64-column tiles, then 16, then single columns (the same order per element). */
KP_INLINE void pv_rows(const float *p, const float *v, int64_t n, int64_t d, int64_t dv, float *acc,
                       const float *alpha, int NR) {
    int64_t c = 0;
    for (; c + 64 <= dv; c += 64) pv_tile(p, v, n, c, d, dv, acc, alpha, NR, 4);
    for (; c + 16 <= dv; c += 16) pv_tile(p, v, n, c, d, dv, acc, alpha, NR, 1);
    for (int t = 0; t < NR; t++)
        for (int64_t cc = c; alpha[t] >= 0.0f && cc < dv; cc++) {
            float x = 0.0f;
            for (int64_t jj = 0; jj < n; jj++) x += p[t * BLOCK_N + jj] * v[jj * d + cc];
            acc[t * dv + cc] = acc[t * dv + cc] * alpha[t] + x;
        }
}

/* Cache rows (bytes) of tokens j0 .. j0 + n - 1 of request bi, in kv head g. */
KP_INLINE void key_rows(const mla_params *p, int64_t bi, int64_t g, int64_t j0, int64_t n, const char **kr,
                        int64_t size) {
    for (int64_t jj = 0; jj < n; jj++) {
        int64_t t = j0 + jj;
        int64_t blk = p->block_table[bi * p->stride_bt_b + t / p->page * p->stride_bt_p];
        kr[jj] = (const char *)p->kv + (blk * p->stride_kv_blk + t % p->page * p->stride_kv_slot
                                        + g * p->stride_kv_head) * size;
    }
}

/* Scores of row r's block (s[0:n] on entry, unscaled) -> p = exp(s - m_new); updates m, l, alpha. */
KP_INLINE void softmax_row(scratch *w, int64_t r, int64_t j0, int64_t n, float scale) {
    float *s = w->s + r * BLOCK_N;
    const int64_t hi = w->hi[r];
    w->alpha[r] = -1.0f;                            /* marks a row with no key in this block */
    if (hi < j0) {
        for (int64_t jj = 0; jj < n; jj++) s[jj] = 0.0f;
        return;
    }
    /* keys [0, lim) are visible; s has BLOCK_N slots, so whole vectors run past n (masked) */
    const int32_t lim = (int32_t)(hi - j0 + 1 < n ? hi - j0 + 1 : n);
    const kp_i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const kp_v16 ninf = (kp_v16){0} - INFINITY;
    kp_v16 mx = ninf;                               /* the max per lane, NaN kept */
    for (int32_t j = 0; j < n; j += KP_LANES) {
        kp_v16 x = sel16(lane + j < lim, kp_ld16(s + j) * scale, ninf);
        kp_st16(s + j, x);
        mx = sel16((x > mx) | (x != x), x, mx);
    }
    float bm = -INFINITY;
    for (int k = 0; k < KP_LANES; k++) bm = mx[k] > bm || mx[k] != mx[k] ? mx[k] : bm;
    float m = w->m[r], m_new = bm > m || bm != bm ? bm : m;
    w->alpha[r] = m_new == m ? 1.0f : kp_exp_diff(m, m_new);      /* m = -inf: 0 */
    float part[KP_LANES] = {0};
    int64_t nv = n - n % KP_LANES, jj = 0;
    for (; jj < nv; jj += KP_LANES)
        KP_FOR_LANES(k) {
            s[jj + k] = kp_exp_diff(s[jj + k], m_new);             /* -inf: exactly 0 */
            part[k] += s[jj + k];
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

/* The block's rows kr[0, n) widened (bf16/fp16: exact) or copied into kbuf, contiguous fp32 that
 * stays in L2 while every row of the item reads it (copying fp32 too measured faster than reading
 * the scattered pages in the tiles). Each row's turn also prefetches a row of the next block
 * (kn[0, n2)), so the cache streams in a block ahead at the pace of the work. */
KP_INLINE void load_block(float *kbuf, const char *const *kr, const char *const *kn, int64_t n,
                          int64_t n2, int64_t d, int dt) {
    const int64_t bytes = d * kp_itemsize(dt);
    for (int64_t jj = 0; jj < n; jj++) {
        for (int64_t b = 0; jj < n2 && b < bytes; b += 64) __builtin_prefetch(kn[jj] + b, 0, 2);
        for (int64_t c = 0; c < d; c++) kbuf[jj * d + c] = kp_load(kr[jj], c, dt);
    }
}

/* Scores of rows [0, R) against keys [0, n) of the block: s[r * BLOCK_N + jj]. */
KP_INLINE void block_scores(const float *qf, const float *k, float *s, int64_t R, int64_t n, int64_t d) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        int64_t jj = 0;
        for (; jj + 4 <= n; jj += 4) dot_tile(qf + r * d, k + jj * d, d, s + r * BLOCK_N + jj, 4, 4);
        for (; jj < n; jj++) dot_tile(qf + r * d, k + jj * d, d, s + r * BLOCK_N + jj, 4, 1);
    }
    for (; r < R; r++) {
        int64_t jj = 0;
        for (; jj + 4 <= n; jj += 4) dot_tile(qf + r * d, k + jj * d, d, s + r * BLOCK_N + jj, 1, 4);
        for (; jj < n; jj++) dot_tile(qf + r * d, k + jj * d, d, s + r * BLOCK_N + jj, 1, 1);
    }
}

/* Query head of row rr of kv head g's s_q * grp rows (row rr is query rr / grp): kv head g serves
 * heads g grp .. g grp + grp - 1, so head h reads kv head h / grp. */
KP_INLINE int64_t row_head(const mla_params *p, int64_t g, int64_t grp, int64_t rr) {
    return g * grp + rr % grp;
}

KP_INLINE void run_item(const mla_params *p, scratch *w, const shared *sh, int64_t item, int dt) {
    const int64_t size = kp_itemsize(dt), d = p->d, dv = p->d_v, grp = p->h_q / p->h_kv;
    const int64_t bi = item / sh->chunks / p->h_kv, g = item / sh->chunks % p->h_kv;
    const int64_t r0 = item % sh->chunks * sh->rows;
    const int64_t R = p->s_q * grp - r0 < sh->rows ? p->s_q * grp - r0 : sh->rows;
    const int64_t L = p->seqlens[bi * p->stride_sl];
    int64_t jhi = -1;
    for (int64_t r = 0; r < R; r++) {               /* row r0 + r of kv head g is query i, head h */
        const int64_t i = (r0 + r) / grp, h = row_head(p, g, grp, r0 + r);
        w->hi[r] = p->causal ? L - p->s_q + i : L - 1;
        jhi = w->hi[r] > jhi ? w->hi[r] : jhi;
        const char *q = (const char *)p->q + (bi * p->stride_q_b + i * p->stride_q_s + h * p->stride_q_h) * size;
        for (int64_t c = 0; c < d; c++) w->qf[r * d + c] = kp_load(q, c, dt);
        for (int64_t c = 0; c < dv; c++) w->acc[r * dv + c] = 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0;
    }
    for (int64_t j0 = 0, cur = 0; j0 <= jhi; j0 += BLOCK_N, cur ^= 1) {       /* the fixed block grid */
        const int64_t n = jhi + 1 - j0 < BLOCK_N ? jhi + 1 - j0 : BLOCK_N;
        const int64_t n2 = jhi + 1 - j0 - BLOCK_N < BLOCK_N ? jhi + 1 - j0 - BLOCK_N : BLOCK_N;
        if (j0 == 0) key_rows(p, bi, g, j0, n, w->kr[cur], size);
        if (n2 > 0) key_rows(p, bi, g, j0 + BLOCK_N, n2, w->kr[cur ^ 1], size);
        load_block(w->kbuf, w->kr[cur], w->kr[cur ^ 1], n, n2, d, dt);
        block_scores(w->qf, w->kbuf, w->s, R, n, d);
        for (int64_t r = 0; r < R; r++) softmax_row(w, r, j0, n, (float)p->scale);
        int64_t r = 0;                              /* V: the first dv columns of the same rows */
        for (; r + 4 <= R; r += 4) pv_rows(w->s + r * BLOCK_N, w->kbuf, n, d, dv, w->acc + r * dv, w->alpha + r, 4);
        for (; r < R; r++) pv_rows(w->s + r * BLOCK_N, w->kbuf, n, d, dv, w->acc + r * dv, w->alpha + r, 1);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = (r0 + r) / grp, h = row_head(p, g, grp, r0 + r);
        char *o = (char *)p->o + (bi * p->stride_o_b + i * p->stride_o_s + h * p->stride_o_h) * size;
        float *lse = p->lse + bi * p->stride_lse_b + h * p->stride_lse_h + i * p->stride_lse_s;
        const double m = w->m[r], l = w->l[r];      /* no key (m = -inf): O = 0, LSE = -inf */
        const double wt = m == -INFINITY ? 0.0 : 1.0 / l;
        *lse = m == -INFINITY ? -INFINITY : (float)(m + log(l));
        for (int64_t c = 0; c < dv; c++) kp_store(o, c, (float)((double)w->acc[r * dv + c] * wt), dt);
    }
}

KP_INLINE void work(worker_arg *a) {
    shared *sh = a->sh;
    const int dt = (int)sh->p->dtype;
    for (int64_t item; (item = atomic_fetch_add(&sh->next, 1)) < sh->items;) {
        /* one instantiation per dtype, so loads and stores inline as constants */
        if (dt == KP_F16) run_item(sh->p, &sh->w[a->tid], sh, item, KP_F16);
        else if (dt == KP_BF16) run_item(sh->p, &sh->w[a->tid], sh, item, KP_BF16);
        else run_item(sh->p, &sh->w[a->tid], sh, item, KP_F32);
    }
}

/* The thread entry compiled per ISA (KP_MULTIVERSION's scheme, for a pthread start routine). */
#ifdef KP_TARGET_AVX512
KP_TARGET_AVX512 static void *work_avx512(void *a) { work(a); return NULL; }
KP_TARGET_AVX2 static void *work_avx2(void *a) { work(a); return NULL; }
#endif
__attribute__((noinline)) static void *work_base(void *a) { work(a); return NULL; }

KP_EXPORT int mla_decode_kernel(const mla_params *p) {
    if (p->dtype != KP_F32 && p->dtype != KP_F16 && p->dtype != KP_BF16) return KP_ERR_DTYPE;
    if (p->b <= 0 || p->s_q <= 0 || p->h_q <= 0) return KP_OK;
    if (p->h_kv <= 0 || p->h_q % p->h_kv) return MLA_ERR_HEADS;
    void *(*fn)(void *) = work_base;
#ifdef KP_TARGET_AVX512
    int isa = kp_isa();
    fn = isa == 2 ? work_avx512 : isa == 1 ? work_avx2 : work_base;
#endif
    shared *sh = calloc(1, sizeof(shared));
    if (!sh) return KP_ERR_NOMEM;
    /* One item per (request, kv head) while its rows fit ITEM_ROWS (the kv head's rows are read
     * once); more rows, or fewer items than threads, split the rows (each chunk reads the cache
     * again). No split changes the bits (see the top). */
    const int64_t rows = p->s_q * (p->h_q / p->h_kv), heads = p->b * p->h_kv;
    int64_t nt = p->threads < 1 ? 1 : p->threads > MAX_THREADS ? MAX_THREADS : p->threads;
    int64_t chunks = (rows + ITEM_ROWS - 1) / ITEM_ROWS;
    if (heads * chunks < nt) chunks = (nt + heads - 1) / heads;
    chunks = chunks > rows ? rows : chunks;
    sh->p = p;
    sh->rows = (rows + chunks - 1) / chunks;
    sh->rows = sh->rows > 4 ? (sh->rows + 3) / 4 * 4 : sh->rows;    /* whole 4-row tiles */
    sh->chunks = (rows + sh->rows - 1) / sh->rows;
    sh->items = heads * sh->chunks;
    atomic_init(&sh->next, 0);
    nt = nt < sh->items ? nt : sh->items;
    const int64_t R = sh->rows, d = p->d, dv = p->d_v;
    const size_t floats = (size_t)(R * d + R * dv + R * BLOCK_N + BLOCK_N * d + 2 * R + 16);
    int status = KP_OK;
    for (int64_t t = 0; t < nt; t++) {              /* every buffer before any work */
        scratch *w = &sh->w[t];
        char *mem = calloc(1, floats * sizeof(float) + (size_t)R * (sizeof(double) + sizeof(int64_t)));
        if (!mem) { status = KP_ERR_NOMEM; break; }
        w->l = (double *)mem;
        w->hi = (int64_t *)(w->l + R);
        w->qf = (float *)(w->hi + R);
        w->acc = w->qf + R * d;
        w->s = w->acc + R * dv;
        w->kbuf = w->s + R * BLOCK_N;
        w->m = w->kbuf + BLOCK_N * d;
        w->alpha = w->m + R;
    }
    if (status == KP_OK) {
        worker_arg args[MAX_THREADS];
        pthread_t tids[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int t = 0; t < nt; t++) args[t] = (worker_arg){sh, t};
        for (int t = 1; t < nt; t++)                /* one that fails to start leaves its share to the rest */
            started[t] = pthread_create(&tids[t], NULL, fn, &args[t]) == 0;
        fn(&args[0]);
        for (int t = 1; t < nt; t++)
            if (started[t]) pthread_join(tids[t], NULL);
    }
    for (int64_t t = 0; t < nt; t++) free(sh->w[t].l);
    free(sh);
    return status;
}
