/* blocks.c — C-Kernel-Engine's mega-fused transformer blocks on the CPU.
 *
 *   attention:  norm = RMSNorm(x) g;  q|k|v = norm W^T (+ b);  RoPE(q, k) at o + s + t;  cache[g, s + t] = k|v
 *               (lanes [d, a_d) cleared);  attn = softmax(q k^T / sqrt(d)) v over slots j <= s + t;
 *               out = attn W_o^T (+ b_o) (+ residual)
 *   mlp:        norm = RMSNorm(x) g;  h = norm W1^T (+ b1) (gate | up, aI rows each: w_up at w1 + aI aE, the
 *               seed's aligned_intermediate_dim aI = I + ipad);  act = silu(gate) up over the I real lanes (lanes
 *               [I, aI) cleared);  down = act W2^T (+ b2);  out = x + down
 *   outproj_mlp: proj = attn W_o^T (+ b_o) (flat, or fp32 per head summed);  h1 = proj + residual;  the mlp on h1
 *               (attn token-major (T, h_q a_d), or head-major (h_q, T, a_d): the seed's [h, T, a_d])
 *
 * Conventions (OPS.md, layers; golden refimpl/blocks.py): rows aligned to aE = E + pad lanes (statistics
 * over E, padding zero in and out), heads aligned to a_d = d + pad lanes (dot products over a_d, scale
 * 1/sqrt(d), a cached row's padding cleared when written), head-major caches (h_kv, cap, a_d), query head h
 * reads kv head h / (h_q / h_kv) (= h * h_kv / h_q), RoPE pairs (i, i + d/2) or (2i, 2i + 1) from cos/sin
 * tables (max_seq, d/2), W1's first I rows the gate. Every array is C-contiguous. RoPE's position is the slot
 * plus rope_off (o: the seed's rope_pos_offset beside token_index); the cache write and the causal mask count
 * slots. wq, wk, wv each have their own format (wqkv_type, wk_type, wv_type: the seed's wq_dt, wk_dt, wv_dt, S1),
 * each with its own activation quantization. With qkv_fused, wq / bq are the seed's one W_qkv / b_qkv (rows: q
 * heads, then k, then v); with wo_heads, W_o is fp32 per head [hq][aE][a_d] (the attention blocks and
 * outproj_mlp), the bias added once. W_o takes the same formats (S1), its activation (the attention row) quantized
 * for its own format.
 *
 * Projections: a weight row in fp32, or GGML blocks (quant.h). Quantized weights take the activation row
 * rounded to fp32 and quantized by ggml's reference quantizer of their vec_dot type (Q8_0 for
 * q4_0 q5_0 q8_0 iq4_nl, Q8_1 for q4_1 q5_1, Q8_K for the K-quants), as ggml's CPU dot products and the seed
 * do; each block's integer dot is exact (int32), and (d_w d_a) isum (- (dmin d_a) msum, + m_w s_a) is formed
 * and summed in double.
 * That is the gemm family's L2 (`emulated`) reference. With `quant_acts = 0` the activations are not
 * quantized and every weight is dequantized in double instead (L1, `dequant`: the same kernel without
 * the activation quantization).
 *
 * Precision: storage is fp32 (activations, caches, stage outputs); arithmetic is double. The norm, the
 * projections (block scale products and sums), RoPE, the softmax and P V run in double and each stage
 * output is one rounding of it. Why: every quantized projection quantizes an intermediate (the normalised
 * row, the attention output, the SwiGLU activation) and a Q8_0 code decides |d_a w| ~ 1e-3 of the
 * projection's scale; an intermediate with fp32 accumulation error (~1e-7) crosses a code's rounding
 * boundary on ~1e-5 of the elements, moving a whole projection by ~1e-3 relative, far outside fp32 limits.
 * In double the intermediate equals L2's to ~1e-15, and its fp32 rounding (what the quantizer sees) is
 * L2's except at ~1e-9 of the elements. The new token's key and value are attended from the double copy,
 * not from the fp32 row written into the cache, for the same reason.
 *
 * blocks_attention_decode is the fused one-pass kernel (T = 1): RMSNorm and the activation quantization
 * once, then per kv head g: its k and v rows (projection, bias, RoPE, the cache write), its query heads'
 * q rows, their attention over the cache in KV_TILE-key tiles (online softmax, scores for all the group's
 * heads per key row, so each cached K/V row is read once per call), the group's attention output
 * quantized and folded into out through W_o's columns of the group (a K-quant W_o, whose 256-blocks may span
 * groups: after the last group, over the whole row). Each weight byte and each cached row
 * is read once; the intermediates (a few KB) stay in L1/L2 and are also written to the stage outputs
 * (the seed's debug mode does the same).
 * blocks_attention_prefill, blocks_mlp and blocks_outproj_mlp run the same stages one after the other over
 * T rows (Q_TILE query rows x KV_TILE keys per attention tile). Single-threaded.
 *
 * Bits: the Q8_0 dots have AVX-512 VNNI, AVX2 and scalar paths (dot_q8_0_*, one summation order) and every
 * other stage is compiled for each path by KP_MULTIVERSION with explicit lanes and no FMA contraction:
 * the outputs do not depend on the path (tests/test_blocks_c.py).
 * Cost (benchmarks/test_bench_cpu_blocks.py): a decode token streams every weight byte once, 45 MB of
 * Q8_0 at Llama-3-8B's shapes, against ~50 KB of intermediates; fusion saves the intermediates' trips
 * and the calls, not the weight stream.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "quant.h"

enum { Q_TILE = 64, KV_TILE = 64 };   /* MEGA_FUSE_Q_TILE, MEGA_FUSE_KV_TILE */
enum { STYLE_HALF = 0, STYLE_INTERLEAVED = 1 };

typedef struct {                   /* mirrored by kernels/cpu/blocks.py (_Params) */
    int64_t t, e, ae, hq, hkv, d, ad, cap, start, inter, max_seq;
    int64_t style, gemma, wo_heads, quant_acts;
    int64_t wqkv_type, wo_type, w1_type, w2_type;
    int64_t rope_off, qkv_fused;   /* attention: RoPE position - cache slot (rope_pos_offset); wq is W_qkv */
    double eps;
    const float *x;                /* (t, ae); outproj_mlp: the attention output (t, hq ad) */
    const float *gamma;            /* (ae,) */
    const void *wq, *wk, *wv, *wo, *w1, *w2;
    const float *bq, *bk, *bv, *bo, *res;   /* or NULL */
    float *k_cache, *v_cache;      /* (hkv, cap, ad), written in place */
    const float *cos, *sin;        /* (max_seq, d / 2) */
    float *norm, *q, *k, *v, *q_rope, *k_rope, *attn, *out;   /* stage outputs (or NULL where unused) */
    float *proj, *h1, *h, *act, *down;
    const float *b1, *b2;          /* the MLP's biases (2 aI,) = b_gate | b_up and (ae,) = b_down, or NULL */
    int64_t ipad;                  /* the MLP's padding lanes per half: aI = inter + ipad */
    int64_t attn_heads;            /* outproj_mlp: x head-major (hq, t, ad), the seed's [h, T, a_d] (S5) */
    int64_t wk_type, wv_type;      /* attention: W_k's and W_v's own formats (S1: wq's is wqkv_type) */
    const float *gamma2;           /* layer: the MLP block's RMSNorm weight (ae,) */
    float *norm2;                  /* layer: the MLP block's normalised rows (t, ae) */
    float *scores;                 /* attention (prefill, layer): P (hq, t, ctx) or NULL (S9) */
    int64_t ctx;                   /* the scores' row length: start + t rounded up (aligned_context_window) */
} blk_params;

/* ---- weights and activations ----------------------------------------------------------------------- */

/* Q8_0 x Q8_0 dots of `rows` (1..4) weight rows `stride` bytes apart against one activation row. */
typedef void (*q8_dot_fn)(const uint8_t *w, int64_t stride, int rows, const int8_t *qc, const float *da,
                          int64_t nb, double *out);

typedef struct {
    int type, act, qk, nbytes;     /* act: the activation format its dot takes (QT_F32: none) */
    int64_t k, row_bytes;
    q8_dot_fn q8;                  /* the Q8_0 x Q8_0 dot of this CPU's path */
} wfmt;

static q8_dot_fn q8_dot_for_cpu(void);

static int wfmt_of(int64_t type, int64_t k, int quant_acts, wfmt *f) {
    f->type = (int)type;
    f->k = k;
    switch (type) {
    case QT_F32: f->act = QT_F32; f->qk = 1; f->nbytes = 4; break;
    case QT_Q4_0: case QT_Q5_0: case QT_Q8_0: case QT_IQ4_NL: f->act = QT_Q8_0; break;
    case QT_Q4_1: case QT_Q5_1: f->act = QT_Q8_1; break;   /* ggml's vec_dot_type (S1: the attention's Q/K/V) */
    case QT_Q2_K: case QT_Q3_K: case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: f->act = QT_Q8_K; break;
    default: return KP_ERR_DTYPE;
    }
    if (type != QT_F32) f->qk = qt_block_size((int)type, &f->nbytes);
    if (k % f->qk) return KP_ERR_SHAPE;
    if (!quant_acts) f->act = QT_F32;
    f->row_bytes = k / f->qk * f->nbytes;
    f->q8 = q8_dot_for_cpu();
    return KP_OK;
}

/* One activation row as the dots read it: the double values, and for a quantized format its blocks
 * (Q8_0: 34 bytes per 32; Q8_K: 292 per 256), for Q8_0 also its codes in one contiguous run, each block's
 * scale widened to fp32 and its code sum (the weight offsets). */
typedef struct {
    int act;
    const double *x;
    uint8_t *qb;
    int8_t *qc;
    float *da;
    int32_t *qsum;
    void *mem;
} arow;

static void *alloc_zero(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64)) return NULL;
    memset(p, 0, n ? n : 64);
    return p;
}

/* Buffers for activation rows of up to k elements (NULL fields when out of memory: arow_ok). */
static arow arow_alloc(int64_t k) {
    const size_t nb = (size_t)(k / 32 + 1), qb = (size_t)(k / 32 * 36 > k / 256 * 292 ? k / 32 * 36 : k / 256 * 292);
    const size_t qb_a = (qb + 63) / 64 * 64, qc_a = ((size_t)k + 63) / 64 * 64;
    arow a = {QT_F32, NULL, NULL, NULL, NULL, NULL, NULL};
    uint8_t *m = alloc_zero(qb_a + qc_a + nb * 8 + 64);
    if (!m) return a;
    a.mem = m;
    a.qb = m;
    a.qc = (int8_t *)(m + qb_a);
    a.da = (float *)(m + qb_a + qc_a);
    a.qsum = (int32_t *)(m + qb_a + qc_a + nb * 4);
    return a;
}

/* The activation row x[0:k] prepared for `act`: rounded to fp32 (tmp) and quantized by ggml's reference
 * quantizer (quant.h), as the production path and the L2 golden do. */
static void act_prepare(int act, const double *x, int64_t k, float *tmp, arow *a) {
    a->act = act;
    a->x = x;
    if (act == QT_F32) return;
    for (int64_t i = 0; i < k; i++) tmp[i] = (float)x[i];
    if (act == QT_Q8_0) {
        qt_quantize_q8_0(tmp, a->qb, k / 32);
        for (int64_t b = 0; b < k / 32; b++) {
            int32_t s = 0;
            for (int j = 0; j < 32; j++) s += (int8_t)a->qb[34 * b + 2 + j];
            a->qsum[b] = s;
            a->da[b] = qt_f16(a->qb + 34 * b);
            memcpy(a->qc + 32 * b, a->qb + 34 * b + 2, 32);
        }
    } else if (act == QT_Q8_1) {
        qt_quantize_q8_1(tmp, a->qb, k / 32);
    } else {
        qt_quantize_q8_k(tmp, a->qb, k / 256);
    }
}

/* fp32 weights: sum_i w_i x_i in double (each product exact): lane l = i mod 8 over whole groups of 8, in
 * order, the lanes summed pairwise, then the tail. Generic 8-lane vectors (one zmm, two ymm or four xmm:
 * the same lane-wise operations on every ISA path); 4 rows at a time share the activation loads and keep
 * 4 accumulation chains in flight. */
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

KP_INLINE void dot_f32_rows(const float *w, int64_t stride, int rows, const double *x, int64_t k, double *out) {
    v8d acc[4] = {{0}, {0}, {0}, {0}};
    const int64_t kv = k - k % 8;
    for (int64_t i = 0; i < kv; i += 8) {
        v8d xv;
        memcpy(&xv, x + i, sizeof xv);
        for (int r = 0; r < rows; r++) {
            v8f wv;
            memcpy(&wv, w + r * stride + i, sizeof wv);
            acc[r] += __builtin_convertvector(wv, v8d) * xv;
        }
    }
    for (int r = 0; r < rows; r++) {
        double l[8];
        memcpy(l, &acc[r], sizeof l);
        double v = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        for (int64_t i = kv; i < k; i++) v += (double)w[r * stride + i] * x[i];
        out[r] = v;
    }
}

KP_INLINE double dot_f32(const float *w, const double *x, int64_t k) {
    double r;
    dot_f32_rows(w, 0, 1, x, k, &r);
    return r;
}

/* Q8_0 x Q8_0 in 8 lanes: lane l of block b is sum_{i<4} c_w[4l + i] c_a[4l + i] (exact int32), its term
 * (d_w d_a) lane (d_w d_a exact in fp32: two fp16 values; the term exact in double) added to double lane l
 * in block order, the 8 lanes summed pairwise at the end. The SIMD paths below form the same integers
 * (vpmaddubsw + vpmaddwd, or vpdpbusd, on |c_w| and sign(c_a, c_w)) and add the same doubles in the same
 * order: the bits do not depend on the path. They take 4 weight rows at a time (4 independent
 * accumulation chains; the activation block loaded once) and prefetch each row's stream. */
KP_INLINE double lanes8_sum(const double *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static void dot_q8_0_scalar(const uint8_t *w, int64_t stride, int rows, const int8_t *qc0, const float *da,
                            int64_t nb, double *out) {
    for (int r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * stride;
        const int8_t *qc = qc0;
        double acc[8] = {0};
        for (int64_t b = 0; b < nb; b++, wr += 34, qc += 32) {
            const int8_t *cw = (const int8_t *)(wr + 2);
            const double s = (double)(qt_f16(wr) * da[b]);
            for (int l = 0; l < 8; l++) {
                int32_t lane = 0;
                for (int i = 0; i < 4; i++) lane += (int32_t)cw[4 * l + i] * qc[4 * l + i];
                acc[l] += s * (double)lane;
            }
        }
        out[r] = lanes8_sum(acc);
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

enum { Q8_PREFETCH = 2048 };   /* bytes ahead in each weight row's stream: with the hardware prefetcher
                                * alone the loop waited on memory (measured ~2x slower) */

__attribute__((target("avx2,f16c"))) static void dot_q8_0_avx2(const uint8_t *w, int64_t stride, int rows,
                                                                const int8_t *qc, const float *da, int64_t nb,
                                                                double *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256d lo[4], hi[4];
    for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_pd();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i va = _mm256_loadu_si256((const __m256i *)(qc + 32 * b));
        for (int r = 0; r < rows; r++) {
            const uint8_t *wb = w + r * stride + 34 * b;
            _mm_prefetch((const char *)wb + Q8_PREFETCH, _MM_HINT_T0);
            const __m256i vw = _mm256_loadu_si256((const __m256i *)(wb + 2));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(va, vw)),
                                                ones);
            const __m256d s = _mm256_set1_pd((double)(_cvtsh_ss(qt_rd16(wb)) * da[b]));
            lo[r] = _mm256_add_pd(lo[r], _mm256_mul_pd(s, _mm256_cvtepi32_pd(_mm256_castsi256_si128(p))));
            hi[r] = _mm256_add_pd(hi[r], _mm256_mul_pd(s, _mm256_cvtepi32_pd(_mm256_extracti128_si256(p, 1))));
        }
    }
    for (int r = 0; r < rows; r++) {
        double l[8];
        _mm256_storeu_pd(l, lo[r]);
        _mm256_storeu_pd(l + 4, hi[r]);
        out[r] = lanes8_sum(l);
    }
}

__attribute__((target("avx512f,avx512vl,avx512vnni,avx2,f16c"))) static void dot_q8_0_vnni(
    const uint8_t *w, int64_t stride, int rows, const int8_t *qc, const float *da, int64_t nb, double *out) {
    __m512d acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_pd();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i va = _mm256_loadu_si256((const __m256i *)(qc + 32 * b));
        for (int r = 0; r < rows; r++) {
            const uint8_t *wb = w + r * stride + 34 * b;
            _mm_prefetch((const char *)wb + Q8_PREFETCH, _MM_HINT_T0);
            const __m256i vw = _mm256_loadu_si256((const __m256i *)(wb + 2));
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(vw, vw),
                                                  _mm256_sign_epi8(va, vw));
            const __m512d s = _mm512_set1_pd((double)(_cvtsh_ss(qt_rd16(wb)) * da[b]));
            acc[r] = _mm512_add_pd(acc[r], _mm512_mul_pd(s, _mm512_cvtepi32_pd(p)));
        }
    }
    for (int r = 0; r < rows; r++) {
        double l[8];
        _mm512_storeu_pd(l, acc[r]);
        out[r] = lanes8_sum(l);
    }
}

/* The Q8_0 dot of the best path the CPU runs (kp_isa, capped by kp_set_isa_cap): 2 AVX-512 VNNI, 1 AVX2. */
static q8_dot_fn q8_dot_for_cpu(void) {
    __builtin_cpu_init();
    const int isa = kp_isa(), f16c = __builtin_cpu_supports("f16c");
    if (isa == 2 && f16c && __builtin_cpu_supports("avx512vnni")) return dot_q8_0_vnni;
    if (isa >= 1 && f16c) return dot_q8_0_avx2;
    return dot_q8_0_scalar;
}
#else
static q8_dot_fn q8_dot_for_cpu(void) { return dot_q8_0_scalar; }
#endif

KP_EXPORT int blocks_q8_path(void) {
    q8_dot_fn f = q8_dot_for_cpu();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (f == dot_q8_0_vnni) return 2;
    if (f == dot_q8_0_avx2) return 1;
#endif
    return f == dot_q8_0_scalar ? 0 : -1;
}

/* Other 32-blocks (q4_0 q5_0 iq4_nl) x Q8_0: codes decoded (quant.h), isum = sum c_w c_a - off sum c_a. */
static double dot_b32(int type, const uint8_t *w, int nbytes, const uint8_t *a, const int32_t *qsum, int64_t nb) {
    const int off = qt_offset(type);
    qt_decoded dw;
    double acc = 0.0;
    for (int64_t b = 0; b < nb; b++, w += nbytes, a += 34) {
        qt_decode(type, w, &dw);
        const int8_t *ca = (const int8_t *)(a + 2);
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += (int32_t)dw.c[j] * ca[j];
        s -= off * qsum[b];
        acc += (double)(dw.d * qt_f16(a)) * (double)s;
    }
    return acc;
}

/* Q4_1 / Q5_1 x Q8_1 (36-byte blocks: fp16 d, fp16 s = fp16(d sum c), 32 codes): term (d_w d_a) isum + m_w s_a,
 * in double, as ggml's vec_dot_q4_1_q8_1 (and the golden: refimpl/gemm.py). */
static double dot_b32m(int type, const uint8_t *w, int nbytes, const uint8_t *a, int64_t nb) {
    qt_decoded dw;
    double acc = 0.0;
    for (int64_t b = 0; b < nb; b++, w += nbytes, a += 36) {
        qt_decode(type, w, &dw);
        const int8_t *ca = (const int8_t *)(a + 4);
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += (int32_t)dw.c[j] * ca[j];
        acc += (double)(dw.d * qt_f16(a)) * (double)s + (double)dw.m * (double)qt_f16(a + 2);
    }
    return acc;
}

/* K-quants x Q8_K: isum = sum_s sc_s sum_{i in s} (c_i - off) q_i, msum = sum_s mn_s bsum_s (ggml's bsums),
 * term (d_w d_a) isum - (dmin d_a) msum in double (d_a is Q8_K's fp32 d: d_w d_a exact in double). */
static double dot_kq(int type, const uint8_t *w, int nbytes, const uint8_t *a, int64_t nsb) {
    const int off = qt_offset(type);
    qt_decoded dw;
    double acc = 0.0;
    for (int64_t b = 0; b < nsb; b++, w += nbytes, a += 292) {
        qt_decode(type, w, &dw);
        const int8_t *qa = (const int8_t *)(a + 4);
        int64_t isum = 0, msum = 0;
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int i = 0; i < 16; i++) dot += ((int32_t)dw.c[16 * s + i] - off) * qa[16 * s + i];
            isum += (int64_t)dw.sc[s] * dot;
            msum += (int64_t)dw.mn[s] * (int16_t)qt_rd16(a + 260 + 2 * s);
        }
        float da;
        memcpy(&da, a, 4);
        acc += ((double)dw.d * da) * (double)isum - ((double)dw.m * da) * (double)msum;
    }
    return acc;
}

/* A quantized weight row dequantized in double (exact) times the unquantized row (L1 arithmetic). */
static double dot_dequant(int type, const uint8_t *w, int nbytes, int qk, const double *x, int64_t nb) {
    const int off = qt_offset(type);
    qt_decoded dw;
    double acc = 0.0;
    for (int64_t b = 0; b < nb; b++, w += nbytes, x += qk) {
        qt_decode(type, w, &dw);
        for (int i = 0; i < qk; i++) {
            double c = (double)((int32_t)dw.c[i] - off);
            double val = qk == 32 ? (double)dw.d * c + (double)dw.m   /* m: Q4_1 / Q5_1's min, else 0 */
                                  : (double)dw.d * dw.sc[i / 16] * c - (double)dw.m * dw.mn[i / 16];
            acc += val * x[i];
        }
    }
    return acc;
}

/* One weight row (at wr) times the prepared activation, in double. */
KP_INLINE double dot_at(const wfmt *f, const uint8_t *wr, const arow *a) {
    if (f->type == QT_F32) return dot_f32((const float *)wr, a->x, f->k);
    if (a->act == QT_F32) return dot_dequant(f->type, wr, f->nbytes, f->qk, a->x, f->k / f->qk);
    if (f->type == QT_Q8_0) {
        double r;
        f->q8(wr, 0, 1, a->qc, a->da, f->k / 32, &r);
        return r;
    }
    if (f->act == QT_Q8_0) return dot_b32(f->type, wr, f->nbytes, a->qb, a->qsum, f->k / 32);
    if (f->act == QT_Q8_1) return dot_b32m(f->type, wr, f->nbytes, a->qb, f->k / 32);
    return dot_kq(f->type, wr, f->nbytes, a->qb, f->k / 256);
}

/* ---- stages ------------------------------------------------------------------------------------------ */

/* RMSNorm of one row: y = x / sqrt(mean(x[0:n]^2) + eps) * (g or 1 + g), lanes [n, aw) zero. */
static void rmsnorm_row(const double *x, const float *g, int64_t n, int64_t aw, double eps, int gemma, double *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const double rstd = 1.0 / sqrt(ss / (double)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * rstd * (gemma ? 1.0 + (double)g[i] : (double)g[i]);
    for (int64_t i = n; i < aw; i++) y[i] = 0.0;
}

/* y[j] = W[row0 + j] . a (+ bias[row0 + j]) for j < rows. */
KP_INLINE void project_rows(const wfmt *f, const void *w, int64_t row0, int64_t rows, const arow *a, const float *bias,
                         double *y) {
    int64_t j = 0;
    if (f->type == QT_Q8_0 && a->act == QT_Q8_0)   /* 4 rows at a time (the SIMD tile) */
        for (; j < rows; j += 4)
            f->q8((const uint8_t *)w + (row0 + j) * f->row_bytes, f->row_bytes, rows - j < 4 ? (int)(rows - j) : 4,
                  a->qc, a->da, f->k / 32, y + j);
    if (f->type == QT_F32)
        for (; j < rows; j += 4)
            dot_f32_rows((const float *)((const uint8_t *)w + (row0 + j) * f->row_bytes), f->row_bytes / 4,
                         rows - j < 4 ? (int)(rows - j) : 4, a->x, f->k, y + j);
    for (; j < rows; j++) y[j] = dot_at(f, (const uint8_t *)w + (row0 + j) * f->row_bytes, a);
    if (bias)
        for (j = 0; j < rows; j++) y[j] += (double)bias[row0 + j];
}

/* The Q, K, V weights and biases: P's wq, wk, wv (bq, bk, bv), or with qkv_fused the seed's one W_qkv (wq) and
 * b_qkv (bq): (hq + 2 hkv) ad rows, the q heads' rows, then the k heads', then the v heads'. */
typedef struct {
    const void *w[3];
    const float *b[3];
} qkv_ptrs;

static qkv_ptrs qkv_sections(const blk_params *P, const wfmt *f) {
    qkv_ptrs s = {{P->wq, P->wk, P->wv}, {P->bq, P->bk, P->bv}};
    if (P->qkv_fused) {
        const int64_t off[3] = {0, P->hq * P->ad, (P->hq + P->hkv) * P->ad};   /* rows before each section */
        for (int i = 0; i < 3; i++) {
            s.w[i] = (const uint8_t *)P->wq + off[i] * f->row_bytes;
            s.b[i] = P->bq ? P->bq + off[i] : NULL;
        }
    }
    return s;
}

/* The formats of W_q, W_k, W_v (S1: each its own, the seed's wq_dt / wk_dt / wv_dt; with qkv_fused one W_qkv,
 * wq's type), each over aE columns with its own activation format. */
static int qkv_fmts(const blk_params *P, int qa, wfmt f[3]) {
    const int64_t ty[3] = {P->wqkv_type, P->qkv_fused ? P->wqkv_type : P->wk_type,
                           P->qkv_fused ? P->wqkv_type : P->wv_type};
    int st = KP_OK;
    for (int i = 0; i < 3 && st == KP_OK; i++) st = wfmt_of(ty[i], P->ae, qa, &f[i]);
    return st;
}

/* RoPE of the first d lanes of one head row at position pos (tables of d / 2 columns), in place. */
static void rope_row(double *x, const float *cos_t, const float *sin_t, int64_t pos, int64_t d, int style) {
    const int64_t half = d / 2;
    const float *c = cos_t + pos * half, *s = sin_t + pos * half;
    for (int64_t i = 0; i < half; i++) {
        const int64_t ia = style == STYLE_INTERLEAVED ? 2 * i : i, ib = style == STYLE_INTERLEAVED ? 2 * i + 1 : i + half;
        const double a = x[ia], b = x[ib], ci = (double)c[i], si = (double)s[i];
        x[ia] = a * ci - b * si;
        x[ib] = a * si + b * ci;
    }
}

/* A new k or v row: lanes [d, a_d) cleared in the double copy, then stored into its cache slot (fp32). */
static void write_row(double *row, float *cache_row, int64_t d, int64_t ad) {
    for (int64_t i = d; i < ad; i++) row[i] = 0.0;
    for (int64_t i = 0; i < ad; i++) cache_row[i] = (float)row[i];
}

static void store(float *dst, const double *src, int64_t n) {
    if (dst)
        for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

KP_INLINE double dot_d(const double *a, const double *b, int64_t n) {
    double acc[8] = {0};
    const int64_t nv = n - n % 8;
    int64_t i = 0;
    for (; i < nv; i += 8)
        _Pragma("GCC unroll 1") for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    double r = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* o = o alpha + sum_j p_j v_j over `live` value rows of ad lanes (vb, row-major), each element's terms
 * added in key order. PV_CHUNK lanes are kept in registers across the keys (instead of a load and a
 * store of o per key). */
enum { PV_CHUNK = 32 };

KP_INLINE void pv_rows(double *o, double alpha, const double *p, const double *vb, int64_t live, int64_t ad) {
    int64_t c0 = 0;
    for (; c0 + PV_CHUNK <= ad; c0 += PV_CHUNK) {
        double t[PV_CHUNK];
        for (int i = 0; i < PV_CHUNK; i++) t[i] = o[c0 + i] * alpha;
        for (int64_t jj = 0; jj < live; jj++) {
            const double pj = p[jj], *v = vb + jj * ad + c0;
            for (int i = 0; i < PV_CHUNK; i++) t[i] += pj * v[i];
        }
        for (int i = 0; i < PV_CHUNK; i++) o[c0 + i] = t[i];
    }
    for (int64_t i = c0; i < ad; i++) {
        double t = o[i] * alpha;
        for (int64_t jj = 0; jj < live; jj++) t += p[jj] * vb[jj * ad + i];
        o[i] = t;
    }
}

/* Attention of the query rows of kv head g over its keys: R = T x G rows, row r = (token r / G, head
 * g G + r % G), the row of token t seeing slots j < start + t + 1 (bottom-right causal). Slots < start come
 * from the cache (fp32), slots start .. start + T - 1 from the double rows kn / vn (T, h_kv, a_d). Q_TILE
 * rows x KV_TILE keys at a time, online softmax in double; each K/V row widened once per tile. */
typedef struct {
    int64_t t, hq, hkv, ad, cap, start;
    double scale;
    float *scores;                 /* P (hq, t, ctx) written when not NULL: the kernel's own logits, m and l */
    int64_t ctx;
} attn_dims;

KP_INLINE int attend_group(const attn_dims *A, int64_t g, const double *qr, const float *kc, const float *vc,
                        const double *kn, const double *vn, double *ao) {
    const int64_t G = A->hq / A->hkv, R = A->t * G, ad = A->ad;
    double *kb = alloc_zero(sizeof(double) * (size_t)(KV_TILE * ad * 2 + Q_TILE * (KV_TILE + ad + 2)));
    if (!kb) return KP_ERR_NOMEM;
    double *vb = kb + KV_TILE * ad, *s = vb + KV_TILE * ad, *acc = s + Q_TILE * KV_TILE, *m = acc + Q_TILE * ad,
           *l = m + Q_TILE;
    const int64_t nkeys = A->start + A->t;   /* the logits of a tile's rows, kept for the scores (S9) */
    double *lg = A->scores ? alloc_zero(sizeof(double) * (size_t)(Q_TILE * nkeys)) : NULL;
    if (A->scores && !lg) { free(kb); return KP_ERR_NOMEM; }
    for (int64_t r0 = 0; r0 < R; r0 += Q_TILE) {
        const int64_t rn = R - r0 < Q_TILE ? R - r0 : Q_TILE;
        const int64_t nk = A->start + (r0 + rn - 1) / G + 1;   /* keys of the tile's last token */
        for (int64_t r = 0; r < rn; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0;
            for (int64_t i = 0; i < ad; i++) acc[r * ad + i] = 0.0;
        }
        for (int64_t j0 = 0; j0 < nk; j0 += KV_TILE) {
            const int64_t jn = nk - j0 < KV_TILE ? nk - j0 : KV_TILE;
            for (int64_t jj = 0; jj < jn; jj++) {
                const int64_t j = j0 + jj;
                double *kd = kb + jj * ad, *vd = vb + jj * ad;
                if (j < A->start) {
                    const float *ks = kc + (g * A->cap + j) * ad, *vs = vc + (g * A->cap + j) * ad;
                    for (int64_t i = 0; i < ad; i++) { kd[i] = ks[i]; vd[i] = vs[i]; }
                } else {
                    memcpy(kd, kn + ((j - A->start) * A->hkv + g) * ad, sizeof(double) * (size_t)ad);
                    memcpy(vd, vn + ((j - A->start) * A->hkv + g) * ad, sizeof(double) * (size_t)ad);
                }
            }
            for (int64_t r = 0; r < rn; r++) {
                const int64_t tok = (r0 + r) / G, h = g * G + (r0 + r) % G;   /* query head h reads kv head h / G */
                const int64_t lim = A->start + tok + 1 - j0;                  /* keys of this tile the row sees */
                const int64_t live = lim < jn ? lim : jn;
                if (live <= 0) continue;
                const double *qv = qr + (tok * A->hq + h) * ad;
                double *sr = s + r * KV_TILE, mt = -INFINITY;
                for (int64_t jj = 0; jj < live; jj++) {
                    sr[jj] = A->scale * dot_d(qv, kb + jj * ad, ad);
                    mt = sr[jj] > mt ? sr[jj] : mt;
                }
                if (lg) memcpy(lg + r * nkeys + j0, sr, sizeof(double) * (size_t)live);
                const double mn = m[r] > mt ? m[r] : mt, alpha = exp(m[r] - mn);
                double lt = 0.0;
                for (int64_t jj = 0; jj < live; jj++) {
                    sr[jj] = exp(sr[jj] - mn);
                    lt += sr[jj];
                }
                pv_rows(acc + r * ad, alpha, sr, vb, live, ad);
                l[r] = l[r] * alpha + lt;
                m[r] = mn;
            }
        }
        for (int64_t r = 0; r < rn; r++) {
            const int64_t tok = (r0 + r) / G, h = g * G + (r0 + r) % G;
            double *dst = ao + (tok * A->hq + h) * ad;
            for (int64_t i = 0; i < ad; i++) dst[i] = acc[r * ad + i] / l[r];
            if (lg) {   /* P = exp(s - m) / l with the row's final max and sum; masked slots and padding 0 */
                float *sc = A->scores + (h * A->t + tok) * A->ctx;
                const int64_t seen = A->start + tok + 1;
                for (int64_t j = 0; j < seen; j++) sc[j] = (float)(exp(lg[r * nkeys + j] - m[r]) / l[r]);
                for (int64_t j = seen; j < A->ctx; j++) sc[j] = 0.0f;
            }
        }
    }
    free(kb); free(lg);
    return KP_OK;
}

/* The seed's fp32 per-head W_o [hq][aE][a_d] over heads h0 .. h0 + nh - 1 of T attention rows a (T, hq a_d):
 * y[t][n] = sum_h Wo[h][n] . a[t][h] (+ bias[n], once), the heads in order. */
static void wo_heads_rows(const float *w, const double *a, int64_t T, int64_t hq, int64_t ae, int64_t ad, int64_t h0,
                          int64_t nh, const float *bias, double *y) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < ae; n++) {
            double s = 0.0;
            for (int64_t h = h0; h < h0 + nh; h++) s += dot_f32(w + (h * ae + n) * ad, a + (t * hq + h) * ad, ad);
            y[t * ae + n] = bias ? s + (double)bias[n] : s;
        }
}

/* ---- the fused decode block --------------------------------------------------------------------------- */

KP_INLINE int blocks_attention_decode_impl(const blk_params *P) {
    const int64_t ae = P->ae, hq = P->hq, hkv = P->hkv, ad = P->ad, d = P->d, G = hq / hkv, pos = P->start;
    const int qa = (int)P->quant_acts;
    wfmt fw[3], fo;   /* W_q, W_k, W_v (S1: each its own format and activation format) */
    int st = qkv_fmts(P, qa, fw);
    if (st == KP_OK) st = wfmt_of(P->wo_type, hq * ad, qa, &fo);
    if (st != KP_OK) return st;
    const int64_t gk = G * ad, K = hq * ad;   /* W_o columns of one kv group: whole blocks when a_d is */
    /* W_o folded in per group when the group's columns are whole blocks of its format (32-blocks: a_d a multiple
     * of 32); otherwise (a K-quant's 256-blocks spanning groups, S1) after every group, over the whole row */
    const int grouped = !P->wo_heads && gk % fo.qk == 0;
    wfmt fg = fo;                /* W_o restricted to a group's columns: gk of them, rows row_bytes apart */
    fg.k = gk;
    double *buf = alloc_zero(sizeof(double) * (size_t)(4 * ae + 3 * hq * ad + 2 * hkv * ad));
    float *tmp = alloc_zero(sizeof(float) * (size_t)(ae > K ? ae : K));
    arow an[3] = {arow_alloc(ae), arow_alloc(ae), arow_alloc(ae)}, aa = arow_alloc(K);
    st = (buf && tmp && an[0].mem && an[1].mem && an[2].mem && aa.mem) ? KP_OK : KP_ERR_NOMEM;
    if (st == KP_OK) {
        double *xd = buf, *nrm = xd + ae, *oacc = nrm + ae, *q = oacc + ae, *qr = q + hq * ad, *ao = qr + hq * ad,
               *kr = ao + hq * ad, *vr = kr + hkv * ad, *part = vr + hkv * ad;
        for (int64_t i = 0; i < ae; i++) xd[i] = (double)P->x[i];
        rmsnorm_row(xd, P->gamma, P->e, ae, P->eps, (int)P->gemma, nrm);
        store(P->norm, nrm, ae);
        for (int i = 0; i < 3; i++) act_prepare(fw[i].act, nrm, ae, tmp, &an[i]);   /* once per projection's format */
        const attn_dims A = {1, hq, hkv, ad, P->cap, pos, 1.0 / sqrt((double)d), NULL, 0};
        const qkv_ptrs W = qkv_sections(P, &fw[0]);
        const int64_t rpos = pos + P->rope_off;   /* RoPE's position; the slot is pos */
        for (int64_t g = 0; g < hkv && st == KP_OK; g++) {
            /* kv head g: its k and v rows, RoPE on k, both written at slot pos (padding cleared) */
            double *kg = kr + g * ad, *vg = vr + g * ad;
            project_rows(&fw[1], W.w[1], g * ad, ad, &an[1], W.b[1], kg);
            project_rows(&fw[2], W.w[2], g * ad, ad, &an[2], W.b[2], vg);
            store(P->k + g * ad, kg, ad);
            store(P->v + g * ad, vg, ad);
            rope_row(kg, P->cos, P->sin, rpos, d, (int)P->style);
            store(P->k_rope + g * ad, kg, ad);   /* the stage keeps the projection's padding; the cache not */
            write_row(kg, P->k_cache + (g * P->cap + pos) * ad, d, ad);
            write_row(vg, P->v_cache + (g * P->cap + pos) * ad, d, ad);
            /* its G query heads: q rows, RoPE */
            for (int64_t hh = 0; hh < G; hh++) {
                const int64_t h = g * G + hh;   /* query head h reads kv head h / G */
                double *qh = q + h * ad, *qrh = qr + h * ad;
                project_rows(&fw[0], W.w[0], h * ad, ad, &an[0], W.b[0], qh);
                memcpy(qrh, qh, sizeof(double) * (size_t)ad);
                rope_row(qrh, P->cos, P->sin, rpos, d, (int)P->style);
                store(P->q + h * ad, qh, ad);
                store(P->q_rope + h * ad, qrh, ad);
            }
            /* the group's attention over slots 0 .. pos (KV_TILE-key tiles, each cached row read once) */
            st = attend_group(&A, g, qr, P->k_cache, P->v_cache, kr, vr, ao);
            if (st != KP_OK) break;
            store(P->attn + g * gk, ao + g * gk, gk);
            /* W_o: out += W_o[:, the group's columns] . attn_group, the group's output quantized first */
            if (P->wo_heads) {   /* fp32 Wo[h][aE][a_d] (S4): the group's heads' rows */
                wo_heads_rows((const float *)P->wo, ao, 1, hq, ae, ad, g * G, G, NULL, part);
            } else if (grouped) {
                act_prepare(fo.act, ao + g * gk, gk, tmp, &aa);
                project_rows(&fg, (const uint8_t *)P->wo + g * (gk / fo.qk * fo.nbytes), 0, ae, &aa, NULL, part);
            } else {
                continue;
            }
            for (int64_t n = 0; n < ae; n++) oacc[n] += part[n];
        }
        if (st == KP_OK && !P->wo_heads && !grouped) {   /* W_o over the whole attention row (its format's act) */
            act_prepare(fo.act, ao, K, tmp, &aa);
            project_rows(&fo, P->wo, 0, ae, &aa, NULL, oacc);
        }
        if (st == KP_OK)
            for (int64_t n = 0; n < ae; n++) {
                double o = oacc[n];
                if (P->bo) o += (double)P->bo[n];
                if (P->res) o += (double)P->res[n];
                P->out[n] = (float)o;
            }
    }
    free(buf); free(tmp); free(an[0].mem); free(an[1].mem); free(an[2].mem); free(aa.mem);
    return st;
}

KP_MULTIVERSION(blocks_attention_decode, (const blk_params *P), (P))

/* ---- stage-by-stage blocks ------------------------------------------------------------------------------ */

/* Y (rows, n_out) = act(X) W^T (+ bias), each row prepared for the weight's activation format. */
KP_INLINE int project_all(const wfmt *f, const void *w, const float *bias, const double *x, int64_t rows, int64_t n_out,
                       double *y) {
    float *tmp = alloc_zero(sizeof(float) * (size_t)f->k);
    arow a = arow_alloc(f->k);
    int st = tmp && a.mem ? KP_OK : KP_ERR_NOMEM;
    for (int64_t r = 0; r < rows && st == KP_OK; r++) {
        act_prepare(f->act, x + r * f->k, f->k, tmp, &a);
        project_rows(f, w, 0, n_out, &a, bias, y + r * n_out);
    }
    free(tmp); free(a.mem);
    return st;
}

/* The prefill attention block; od (T, aE), when not NULL, receives attn W_o^T (+ b_o) in double, before the
 * residual (the layer's h1 is built from it). */
KP_INLINE int attention_prefill_rows(const blk_params *P, double *od) {
    const int64_t T = P->t, ae = P->ae, hq = P->hq, hkv = P->hkv, ad = P->ad, d = P->d;
    const int qa = (int)P->quant_acts;
    wfmt fw[3], fo;   /* W_q, W_k, W_v (S1: each its own format) */
    int st = qkv_fmts(P, qa, fw);
    if (st == KP_OK) st = wfmt_of(P->wo_type, hq * ad, qa, &fo);
    if (st != KP_OK) return st;
    const int64_t nq = T * hq * ad, nkv = T * hkv * ad;
    double *buf = alloc_zero(sizeof(double) * (size_t)(2 * T * ae + 3 * nq + 3 * nkv + T * ae));
    if (!buf) return KP_ERR_NOMEM;
    double *xd = buf, *nrm = xd + T * ae, *q = nrm + T * ae, *qr = q + nq, *ao = qr + nq, *k = ao + nq,
           *kr = k + nkv, *v = kr + nkv, *o = v + nkv;
    for (int64_t i = 0; i < T * ae; i++) xd[i] = (double)P->x[i];
    for (int64_t t = 0; t < T; t++) rmsnorm_row(xd + t * ae, P->gamma, P->e, ae, P->eps, (int)P->gemma, nrm + t * ae);
    store(P->norm, nrm, T * ae);
    const qkv_ptrs W = qkv_sections(P, &fw[0]);
    st = project_all(&fw[0], W.w[0], W.b[0], nrm, T, hq * ad, q);
    if (st == KP_OK) st = project_all(&fw[1], W.w[1], W.b[1], nrm, T, hkv * ad, k);
    if (st == KP_OK) st = project_all(&fw[2], W.w[2], W.b[2], nrm, T, hkv * ad, v);
    if (st == KP_OK) {
        store(P->q, q, nq); store(P->k, k, nkv); store(P->v, v, nkv);
        memcpy(qr, q, sizeof(double) * (size_t)nq);
        memcpy(kr, k, sizeof(double) * (size_t)nkv);
        for (int64_t t = 0; t < T; t++) {
            const int64_t pos = P->rope_off + P->start + t;   /* RoPE's position; the slot is start + t */
            for (int64_t h = 0; h < hq; h++) rope_row(qr + (t * hq + h) * ad, P->cos, P->sin, pos, d, (int)P->style);
            for (int64_t g = 0; g < hkv; g++) rope_row(kr + (t * hkv + g) * ad, P->cos, P->sin, pos, d, (int)P->style);
        }
        /* the stages keep the projection's padding lanes; the cache write clears them (in kr and v too,
         * which the attention then reads as the new keys and values) */
        store(P->q_rope, qr, nq); store(P->k_rope, kr, nkv);
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < hkv; g++) {
                const int64_t pos = P->start + t;
                write_row(kr + (t * hkv + g) * ad, P->k_cache + (g * P->cap + pos) * ad, d, ad);
                write_row(v + (t * hkv + g) * ad, P->v_cache + (g * P->cap + pos) * ad, d, ad);
            }
        const attn_dims A = {T, hq, hkv, ad, P->cap, P->start, 1.0 / sqrt((double)d), P->scores, P->ctx};
        for (int64_t g = 0; g < hkv && st == KP_OK; g++)
            st = attend_group(&A, g, qr, P->k_cache, P->v_cache, kr, v, ao);
    }
    if (st == KP_OK) {
        store(P->attn, ao, nq);
        /* the attention output quantized for a quantized W_o (Q8_0: the seed's quantize_attn_out_head_major_q8_0;
         * Q8_1 for q4_1 q5_1, Q8_K for the K-quants: S1), then the output projection (fp32 per head: wo_heads) */
        if (P->wo_heads) wo_heads_rows((const float *)P->wo, ao, T, hq, ae, ad, 0, hq, P->bo, o);
        else st = project_all(&fo, P->wo, P->bo, ao, T, ae, o);
    }
    if (st == KP_OK)
        for (int64_t i = 0; i < T * ae; i++) P->out[i] = (float)(P->res ? o[i] + (double)P->res[i] : o[i]);
    if (st == KP_OK && od) memcpy(od, o, sizeof(double) * (size_t)(T * ae));
    free(buf);
    return st;
}

KP_INLINE int blocks_attention_prefill_impl(const blk_params *P) { return attention_prefill_rows(P, NULL); }

KP_MULTIVERSION(blocks_attention_prefill, (const blk_params *P), (P))

/* norm -> h (+ b1) -> act -> down (+ b2) -> out = x + down, over T rows of x (double). h and act rows are
 * aI = I + ipad lanes per half; act's lanes [I, aI) stay zero (cleared), so W2's padded columns add nothing. */
KP_INLINE int mlp_rows(const blk_params *P, const double *x) {
    const int64_t T = P->t, ae = P->ae, I = P->inter, aI = P->inter + P->ipad;
    const int qa = (int)P->quant_acts;
    wfmt f1, f2;
    int st = wfmt_of(P->w1_type, ae, qa, &f1);
    if (st == KP_OK) st = wfmt_of(P->w2_type, aI, qa, &f2);
    if (st != KP_OK) return st;
    double *buf = alloc_zero(sizeof(double) * (size_t)(T * ae + 3 * T * aI + T * ae));
    if (!buf) return KP_ERR_NOMEM;
    double *nrm = buf, *h = nrm + T * ae, *act = h + 2 * T * aI, *down = act + T * aI;
    for (int64_t t = 0; t < T; t++) rmsnorm_row(x + t * ae, P->gamma, P->e, ae, P->eps, (int)P->gemma, nrm + t * ae);
    store(P->norm, nrm, T * ae);
    st = project_all(&f1, P->w1, P->b1, nrm, T, 2 * aI, h);
    if (st == KP_OK) {
        store(P->h, h, 2 * T * aI);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < I; i++) {
                const double gate = h[t * 2 * aI + i], up = h[t * 2 * aI + aI + i];   /* gate first, up at aI */
                const double e = exp(-fabs(gate)), sig = gate >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
                act[t * aI + i] = gate * sig * up;
            }
        store(P->act, act, T * aI);
        st = project_all(&f2, P->w2, P->b2, act, T, ae, down);
    }
    if (st == KP_OK) {
        store(P->down, down, T * ae);
        for (int64_t i = 0; i < T * ae; i++) P->out[i] = (float)(x[i] + down[i]);
    }
    free(buf);
    return st;
}

KP_INLINE int blocks_mlp_impl(const blk_params *P) {
    double *x = alloc_zero(sizeof(double) * (size_t)(P->t * P->ae));
    if (!x) return KP_ERR_NOMEM;
    for (int64_t i = 0; i < P->t * P->ae; i++) x[i] = (double)P->x[i];
    int st = mlp_rows(P, x);
    free(x);
    return st;
}

KP_MULTIVERSION(blocks_mlp, (const blk_params *P), (P))

KP_INLINE int blocks_outproj_mlp_impl(const blk_params *P) {
    const int64_t T = P->t, ae = P->ae, hq = P->hq, ad = P->ad, K = hq * ad;
    wfmt fo;
    int st = wfmt_of(P->wo_heads ? QT_F32 : P->wo_type, K, (int)P->quant_acts, &fo);
    if (st != KP_OK) return st;
    double *buf = alloc_zero(sizeof(double) * (size_t)(T * K + 2 * T * ae));
    if (!buf) return KP_ERR_NOMEM;
    double *a = buf, *proj = a + T * K, *h1 = proj + T * ae;
    if (P->attn_heads)   /* head-major [h][T][a_d]: token t's row is its heads' rows in order */
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < hq; h++)
                for (int64_t j = 0; j < ad; j++) a[t * K + h * ad + j] = (double)P->x[(h * T + t) * ad + j];
    else
        for (int64_t i = 0; i < T * K; i++) a[i] = (double)P->x[i];
    if (P->wo_heads) {   /* Wo[h][aE][a_d]: sum over heads of attn_h . Wo[h][n], the bias once */
        const float *w = (const float *)P->wo;
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < ae; n++) {
                double s = 0.0;
                for (int64_t h = 0; h < hq; h++) s += dot_f32(w + (h * ae + n) * ad, a + t * K + h * ad, ad);
                proj[t * ae + n] = P->bo ? s + (double)P->bo[n] : s;
            }
    } else {
        st = project_all(&fo, P->wo, P->bo, a, T, ae, proj);
    }
    if (st == KP_OK) {
        for (int64_t i = 0; i < T * ae; i++) h1[i] = proj[i] + (double)P->res[i];
        store(P->proj, proj, T * ae);
        store(P->h1, h1, T * ae);
        st = mlp_rows(P, h1);
    }
    free(buf);
    return st;
}

KP_MULTIVERSION(blocks_outproj_mlp, (const blk_params *P), (P))

/* ---- the whole layer (seed audit S9) -------------------------------------------------------------------- */

/* The prefill attention block (its stages; `out` the pre-residual output in h1's buffer), then h1 = that + x
 * (double) and the MLP block on h1 (gamma2, norm2; the mlp's h, act, down, out): the two blocks above,
 * composed, h1 handed over in double. */
KP_INLINE int blocks_layer_impl(const blk_params *P) {
    const int64_t n = P->t * P->ae;
    double *pre = alloc_zero(sizeof(double) * (size_t)(2 * n));
    if (!pre) return KP_ERR_NOMEM;
    double *h1 = pre + n;
    blk_params A = *P;
    A.res = NULL;
    A.out = P->h1;
    int st = attention_prefill_rows(&A, pre);
    if (st == KP_OK) {
        for (int64_t i = 0; i < n; i++) h1[i] = pre[i] + (double)P->x[i];
        store(P->h1, h1, n);
        blk_params M = *P;
        M.gamma = P->gamma2;
        M.norm = P->norm2;
        st = mlp_rows(&M, h1);
    }
    free(pre);
    return st;
}

KP_MULTIVERSION(blocks_layer, (const blk_params *P), (P))
