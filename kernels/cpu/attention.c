/* attention.c — attention over dense keys (prefill) and over a KV cache (decode, paged decode).
 *
 *   s_ij  = scale * q_i . k_j
 *   s_ij  = cap * tanh(s_ij / cap)                 when cap > 0, before the mask
 *   s_ij  = -inf outside [lo_i, hi_i]              causal / window / sequence length (key_range)
 *   LSE_i = ln sum_j exp(s_ij)                     natural log, -inf for a fully masked row
 *   O_i   = sum_j exp(s_ij - LSE'_i) v_j           LSE' = ln(exp(LSE) + exp(S_h)) with a sink
 *
 * Conventions (OPS.md, attention; refimpl/attention.py): q (b, s_q, h_q, d); keys and values
 * (b, s_k, h_kv, d) per sequence, or pages (num_blocks, page, h_kv, d) through block_table;
 * with cache_loc (TensorRT-LLM), sequence b's cache row / block-table row is cache_loc[b];
 * o (b, s_q, h_q, d_v); lse (b, h_q, s_q) fp32, excluding the sink. Strides are in elements, any
 * value except the last axis (1). Query head h reads kv head h / (h_q / h_kv). Alignment is per
 * sequence: diag = i + L - s_q (bottom_right, and the window's diagonal without causal) or i
 * (top_left), L the sequence's key count; the window keeps diag - left <= j <= diag + right, -1
 * unbounded, causal forces right = 0. Keys outside the union of an item's ranges are never read
 * (caches hold NaN there); inside it a masked key gets weight exactly 0. A fully masked row gives
 * O = 0, LSE = -inf. NaN in a live score reaches its row, as in the golden.
 *
 * Algorithm: a work item is one sequence, a block of query rows and a chunk of kv heads; the rows
 * of one kv head (its G = h_q / h_kv query heads x the item's queries) share every K/V row, so a
 * K/V row is loaded once per group. Keys stream in blocks of BLOCK_N at multiples of BLOCK_N with an
 * online softmax: per row a running max m and sum l, rescaled by alpha = exp(m_old - m_new).
 * fp32 accumulation. A score is an fp32 dot product in 16 lanes (lane k takes c = k mod 16, in
 * order), summed pairwise (kp_hsum16), then the tail; exp(s - m) is kp_exp_diff (~1 ulp however far
 * below the max); a block's P V is summed in registers in key order and added once to the rescaled
 * accumulator (two-level summation: error grows with BLOCK_N + n / BLOCK_N, not n); l adds fp32
 * block sums in double. O = acc / l, or acc e / (l e + exp(S - M)) with a sink (M = max(m, S),
 * e = exp(m - M)), and LSE = m + ln l are formed in double and rounded once. A row's arithmetic
 * depends only on its own data and the block grid, never on which rows share its item, the tile it
 * falls in, the thread that runs it or the ISA path (kp_v16 lanes, no FMA): the bits are fixed.
 *
 * Register tiles (kp_v16): scores for 2 rows x 4 keys (4 x 1 at a block's tail; the 4 keys' lane
 * sums reduced together, kp_hsum16x4), P V for 4 rows x 32 columns (2 x 64, 1 x 64 for the rest):
 * 8 independent accumulators hide the add latency. bf16 K/V are widened in registers (a shift)
 * when a group has few rows, else (and fp16 always) into an fp32 buffer once per row.
 * Memory traffic: a decode item holds every kv head of its sequence when they fit in ITEM_ROWS
 * rows, so it reads each token's K row (h_kv * d elements, contiguous in a (b, s, h_kv, d) cache)
 * in one sequential stream the hardware prefetcher follows (one head's rows alone sit h_kv * d
 * elements apart, 4 KiB at h_kv = 8, d = 128, fp32: a page each, which streamed at about half the
 * bandwidth on a 2-core Xeon VM); V rows are prefetched in the same token order while K is scored,
 * so P V reads them from L2.
 * Threads: items go out from an atomic counter; the output does not depend on the thread count.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"

enum { BLOCK_N = 64 };          /* keys per online-softmax step */
enum { ITEM_ROWS = 64 };        /* rows per work item: K/V reuse vs running state in L1/L2 */
enum { MAX_QROWS = 256 };       /* a decode up to this many rows per kv head reads K/V once */
enum { MAX_THREADS = 64 };

typedef struct {                /* mirrored by kernels/cpu/attention.py (_Params) */
    int64_t dtype;
    const void *q; int64_t stride_q_b, stride_q_s, stride_q_h;
    const void *k; int64_t stride_k_b, stride_k_s, stride_k_h;   /* paged: b = block, s = slot */
    const void *v; int64_t stride_v_b, stride_v_s, stride_v_h;
    const int32_t *block_table; int64_t stride_bt_b, stride_bt_p, page;   /* page 0: not paged */
    const int32_t *seqlens; int64_t stride_sl;                    /* NULL: every sequence s_k */
    const int32_t *cache_loc; int64_t stride_cl;                  /* NULL: sequence b reads row b */
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
    const char *kr[BLOCK_N], *vr[BLOCK_N];         /* token rows of the block, kv head 0 */
    const void *vp[BLOCK_N];                        /* V rows of one kv head, as ldw reads them */
} scratch;

typedef struct {
    const attn_params *p;
    int64_t bm, nqb, chunks, items;     /* queries per item, query blocks, kv-head chunks */
    atomic_llong next;
    scratch w[MAX_THREADS];
} shared;

typedef struct { shared *sh; int tid; } worker_arg;

/* Rows of an item: r = (h - h0) * nq + (i - i0), so the rows of one kv head are contiguous. */
typedef struct { int64_t bi, i0, nq, h0, g0, g1, R, RG; } item_rows;

/* Keys query i may attend: [lo, hi], empty when lo > hi (refimpl.attention.mask). */
KP_INLINE void key_range(const attn_params *p, int64_t i, int64_t L, int64_t *lo, int64_t *hi) {
    int64_t diag = p->causal == 2 ? i : i + L - p->s_q;
    int64_t right = p->causal ? 0 : p->right, left = p->left;
    *lo = 0;
    *hi = L - 1;
    if (right >= 0 && right <= L + p->s_q && diag + right < *hi) *hi = diag + right;  /* larger: unbounded */
    if (left >= 0 && left <= L + p->s_q && diag - left > *lo) *lo = diag - left;
}

/* cap * tanh(s / cap) via Cephes' tanhf: odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above
 * (kp_expf; its overflow to inf gives exactly 1); ~2 ulp, branch-free so the row loop vectorises. */
KP_INLINE float softcap_logit(float s, float cap) {
    float x = s / cap, z = fabsf(x), zz = x * x;
    float small = ((((-5.70498872745e-3f * zz + 2.06390887954e-2f) * zz - 5.37397155531e-2f) * zz
                    + 1.33314422036e-1f) * zz - 3.33332819422e-1f) * zz * x + x;
    float large = copysignf(1.0f - 2.0f / (kp_expf(2.0f * z) + 1.0f), x);
    return cap * (z < 0.625f ? small : large);
}

/* Elements c .. c + 15 of a K or V row as the tiles read it: bf16 widened in registers, else fp32. */
KP_INLINE kp_v16 ldw(const void *row, int64_t c, int dt) {
    return dt == KP_BF16 ? kp_ld16_bf16((const uint16_t *)row + c) : kp_ld16((const float *)row + c);
}

/* s[t * BLOCK_N + u] = q_t . k_u for NR rows of q (d apart) and NK keys, NR * NK <= 8. */
KP_INLINE void dot_tile(const float *q, const void *const *k, int64_t d, float *s, int NR, int NK,
                        int dt) {
    kp_v16 a[8] = {0};
    int64_t d16 = d - d % 16;
    for (int64_t c = 0; c < d16; c += 16) {
        kp_v16 kv[4];
        for (int u = 0; u < NK; u++) kv[u] = ldw(k[u], c, dt);
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
            for (int64_t c = d16; c < d; c++) x += q[t * d + c] * kp_load(k[u], c, dt);
            s[t * BLOCK_N + u] = x;
        }
    }
}

/* acc_t[c, c + 16 CH) = acc_t * alpha_t + sum_{ja <= jj < n} p_t[jj] v_jj for NR rows (p rows
 * BLOCK_N apart, acc rows dv apart), NR * CH <= 8; rows with alpha < 0 (no key here) are left. */
KP_INLINE void pv_tile(const float *p, const void *const *v, int64_t ja, int64_t n, int64_t c,
                       int64_t dv, float *acc, const float *alpha, int NR, int CH, int dt) {
    kp_v16 a[8] = {0};
    for (int64_t jj = ja; jj < n; jj++) {
        kp_v16 x[4];
        for (int u = 0; u < CH; u++) x[u] = ldw(v[jj], c + 16 * u, dt);
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
KP_INLINE void pv_rows(const float *p, const void *const *v, int64_t ja, int64_t n, int64_t dv,
                       float *acc, const float *alpha, int NR, int dt) {
    const int CH = 8 / NR > 4 ? 4 : 8 / NR;
    int64_t c = 0;
    for (; c + 16 * CH <= dv; c += 16 * CH) pv_tile(p, v, ja, n, c, dv, acc, alpha, NR, CH, dt);
    for (; c + 16 <= dv; c += 16) pv_tile(p, v, ja, n, c, dv, acc, alpha, NR, 1, dt);
    for (int t = 0; t < NR; t++)
        for (int64_t cc = c; alpha[t] >= 0.0f && cc < dv; cc++) {
            float x = 0.0f;
            for (int64_t jj = ja; jj < n; jj++) x += p[t * BLOCK_N + jj] * kp_load(v[jj], cc, dt);
            acc[t * dv + cc] = acc[t * dv + cc] * alpha[t] + x;
        }
}

/* Token rows (bytes, kv head 0) of keys j0 .. j0 + n - 1 of sequence bi, whose cache row (or
 * block-table row) is cache_loc[bi] (TensorRT-LLM), else bi. */
KP_INLINE void key_rows(const attn_params *p, int64_t bi, int64_t j0, int64_t n, const char **kr,
                        const char **vr, int64_t size) {
    const int64_t row = p->cache_loc ? p->cache_loc[bi * p->stride_cl] : bi;
    for (int64_t jj = 0; jj < n; jj++) {
        int64_t t = j0 + jj, blk = row, slot = t;
        if (p->page) {
            blk = p->block_table[row * p->stride_bt_b + t / p->page * p->stride_bt_p];
            slot = t % p->page;
        }
        kr[jj] = (const char *)p->k + (blk * p->stride_k_b + slot * p->stride_k_s) * size;
        vr[jj] = (const char *)p->v + (blk * p->stride_v_b + slot * p->stride_v_s) * size;
    }
}

/* A K or V row as the tiles read it (ldw with type rt): in place, or widened into buf. */
KP_INLINE const void *widen(const char *row, float *buf, int64_t n, int dt, int rt) {
    if (dt == rt) return row;
    for (int64_t c = 0; c < n; c++) buf[c] = kp_load(row, c, dt);
    return buf;
}

/* Scores of row r's block (s[0:n] on entry) -> p = exp(s - m_new), updating m, l and alpha. */
KP_INLINE void softmax_row(scratch *w, int64_t r, int64_t j0, int64_t n, float scale, float cap) {
    float *s = w->s + r * BLOCK_N;
    const int64_t lo = w->lo[r], hi = w->hi[r];
    w->alpha[r] = -1.0f;                            /* marks a row with no key in this block */
    if (hi < j0 || lo >= j0 + n || lo > hi) {
        for (int64_t jj = 0; jj < n; jj++) s[jj] = 0.0f;
        return;
    }
    float mx[KP_LANES], bm = -INFINITY;             /* the max in lanes, NaN kept, so it vectorises */
    for (int k = 0; k < KP_LANES; k++) mx[k] = -INFINITY;
    for (int64_t j = 0; j < n; j += KP_LANES)       /* s has BLOCK_N slots: a partial tail is masked */
        KP_FOR_LANES(k) {                           /* keys before the item's first are masked too */
            float x = s[j + k] * scale;
            if (cap > 0.0f) x = softcap_logit(x, cap);
            x = j + k < n && j0 + j + k >= lo && j0 + j + k <= hi ? x : -INFINITY;
            s[j + k] = x;
            mx[k] = x > mx[k] || x != x ? x : mx[k];
        }
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

/* One key block [j0, j0 + n) for the rows of an item, which reads keys ja .. n - 1 of it. */
KP_INLINE void attend_block(const attn_params *p, scratch *w, const item_rows *it, int64_t j0,
                            int64_t ja, int64_t n, int dt) {
    const int64_t d = p->d, dv = p->d_v, size = kp_itemsize(dt), RG = it->RG;
    /* the rows' type as the tiles read them: bf16 widened in registers while few row tiles share
     * a K/V row, else once into an fp32 buffer (fp16 always: its conversion is long) */
    const int rt = dt == KP_BF16 && RG <= 8 ? KP_BF16 : KP_F32;
    for (int64_t jj = ja, nk; jj < n; jj += nk) {  /* scores, in token order */
        nk = n - jj >= 4 ? 4 : 1;
        for (int64_t g = it->g0, r = 0; g < it->g1; g++) {
            const void *kf[4];
            for (int64_t u = 0; u < nk; u++) {
                const char *vrow = w->vr[jj + u] + g * p->stride_v_h * size;
                for (int64_t b = 0; b < dv * size; b += 64) __builtin_prefetch(vrow + b, 0, 2);
                kf[u] = widen(w->kr[jj + u] + g * p->stride_k_h * size, w->kbuf + u * d, d, dt, rt);
            }
            float *s = w->s + jj;
            const int64_t r1 = r + RG;
            if (nk == 4) {
                for (; r + 2 <= r1; r += 2) dot_tile(w->qf + r * d, kf, d, s + r * BLOCK_N, 2, 4, rt);
                for (; r < r1; r++) dot_tile(w->qf + r * d, kf, d, s + r * BLOCK_N, 1, 4, rt);
            } else {
                for (; r + 4 <= r1; r += 4) dot_tile(w->qf + r * d, kf, d, s + r * BLOCK_N, 4, 1, rt);
                for (; r < r1; r++) dot_tile(w->qf + r * d, kf, d, s + r * BLOCK_N, 1, 1, rt);
            }
        }
    }
    for (int64_t r = 0; r < it->R; r++) softmax_row(w, r, j0, n, (float)p->scale, (float)p->softcap);
    for (int64_t g = it->g0, r = 0; g < it->g1; g++) {   /* P V, one kv head at a time */
        for (int64_t jj = ja; jj < n; jj++)
            w->vp[jj] = widen(w->vr[jj] + g * p->stride_v_h * size, w->vblk + jj * dv, dv, dt, rt);
        for (int64_t r1 = r + RG, nr; r < r1; r += nr) {
            nr = r1 - r >= 4 ? 4 : r1 - r >= 2 ? 2 : 1;
            float *s = w->s + r * BLOCK_N, *acc = w->acc + r * dv, *alpha = w->alpha + r;
            if (nr == 4) pv_rows(s, w->vp, ja, n, dv, acc, alpha, 4, rt);
            else if (nr == 2) pv_rows(s, w->vp, ja, n, dv, acc, alpha, 2, rt);
            else pv_rows(s, w->vp, ja, n, dv, acc, alpha, 1, rt);
        }
    }
}

KP_INLINE void run_item(const attn_params *p, scratch *w, const shared *sh, int64_t item, int dt) {
    const int64_t G = p->h_q / p->h_kv, size = kp_itemsize(dt), d = p->d, dv = p->d_v;
    const int64_t gpc = (p->h_kv + sh->chunks - 1) / sh->chunks;     /* kv heads per chunk */
    item_rows it = {.bi = item / (sh->nqb * sh->chunks), .i0 = item / sh->chunks % sh->nqb * sh->bm,
                    .g0 = item % sh->chunks * gpc};
    it.g1 = it.g0 + gpc < p->h_kv ? it.g0 + gpc : p->h_kv;
    it.nq = p->s_q - it.i0 < sh->bm ? p->s_q - it.i0 : sh->bm;
    it.h0 = it.g0 * G;
    it.RG = G * it.nq;
    it.R = (it.g1 - it.g0) * it.RG;
    const int64_t L = p->seqlens ? p->seqlens[it.bi * p->stride_sl] : p->s_k;
    int64_t jlo = INT64_MAX, jhi = -1;
    for (int64_t r = 0; r < it.R; r++) {
        int64_t i = it.i0 + r % it.nq, h = it.h0 + r / it.nq;
        key_range(p, i, L, &w->lo[r], &w->hi[r]);
        if (w->lo[r] <= w->hi[r]) {
            jlo = w->lo[r] < jlo ? w->lo[r] : jlo;
            jhi = w->hi[r] > jhi ? w->hi[r] : jhi;
        }
        const char *q = (const char *)p->q
                        + (it.bi * p->stride_q_b + i * p->stride_q_s + h * p->stride_q_h) * size;
        for (int64_t c = 0; c < d; c++) w->qf[r * d + c] = kp_load(q, c, dt);
        for (int64_t c = 0; c < dv; c++) w->acc[r * dv + c] = 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0;
    }
    for (int64_t j0 = jlo - jlo % BLOCK_N; j0 <= jhi; j0 += BLOCK_N) {    /* the fixed block grid */
        int64_t ja = j0 > jlo ? 0 : jlo - j0, n = jhi + 1 - j0 < BLOCK_N ? jhi + 1 - j0 : BLOCK_N;
        key_rows(p, it.bi, j0 + ja, n - ja, w->kr + ja, w->vr + ja, size);
        attend_block(p, w, &it, j0, ja, n, dt);
    }
    for (int64_t r = 0; r < it.R; r++) {
        int64_t i = it.i0 + r % it.nq, h = it.h0 + r / it.nq;
        char *o = (char *)p->o + (it.bi * p->stride_o_b + i * p->stride_o_s + h * p->stride_o_h) * size;
        float *lse = p->lse + it.bi * p->stride_lse_b + h * p->stride_lse_h + i * p->stride_lse_s;
        double m = w->m[r], l = w->l[r], wt = 0.0;  /* no key (m = -inf): O = 0, LSE = -inf */
        if (m != -INFINITY && p->sinks) {           /* the sink joins the denominator only */
            double S = p->sinks[h * p->stride_sinks], M = S > m ? S : m, e = exp(m - M);
            wt = e / (l * e + exp(S - M));
        } else if (m != -INFINITY) {
            wt = 1.0 / l;
        }
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
    /* Items of about ITEM_ROWS rows keep the running state in L1/L2. A decode (up to MAX_QROWS
     * rows per kv head) keeps all its queries in one item, so K/V are read once; heads are split
     * further only to give every thread an item. No split changes the bits (see the top). */
    const int64_t G = p->h_q / p->h_kv;
    int64_t nt = p->threads < 1 ? 1 : p->threads > MAX_THREADS ? MAX_THREADS : p->threads;
    int64_t bm = p->s_q * G <= MAX_QROWS ? p->s_q : (ITEM_ROWS / G > 1 ? ITEM_ROWS / G : 1);
    const int64_t nqb = (p->s_q + bm - 1) / bm, base = p->b * nqb;
    int64_t gpc = ITEM_ROWS / (G * bm) < 1 ? 1 : ITEM_ROWS / (G * bm);
    gpc = gpc > p->h_kv ? p->h_kv : gpc;
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
    const size_t floats = (size_t)(R * d + R * dv + R * BLOCK_N + 4 * d + BLOCK_N * dv + 2 * R);
    int status = KP_OK;
    for (int64_t t = 0; t < nt; t++) {              /* every buffer before any work */
        scratch *w = &sh->w[t];
        char *mem = calloc(1, floats * sizeof(float) + (size_t)R * (sizeof(double) + 2 * sizeof(int64_t)));
        if (!mem) { status = KP_ERR_NOMEM; break; }
        w->l = (double *)mem;
        w->lo = (int64_t *)(w->l + R);
        w->hi = w->lo + R;
        w->qf = (float *)(w->hi + R);
        w->acc = w->qf + R * d;
        w->s = w->acc + R * dv;
        w->kbuf = w->s + R * BLOCK_N;
        w->vblk = w->kbuf + 4 * d;
        w->m = w->vblk + BLOCK_N * dv;
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
