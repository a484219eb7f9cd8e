/* moe.c — mixture-of-experts top-k expert routing, one token (row of logits) at a time.
 *
 *   scores  = softmax(logits) | sigmoid(logits) = 1 / (1 + exp(-x))      (over the E experts)
 *   select  = scores + bias                         (bias NULL: select = scores)
 *   groups  : n_group contiguous groups of E / n_group experts; group score = the sum of its two
 *             largest `select` values with a bias (the largest alone for groups of one), its largest
 *             without; the topk_group best groups stay, every other expert's `select` becomes
 *             `fill` (-inf or 0). n_group 1: no grouping.
 *   ids     = the k experts of largest `select`, in rank order
 *   weights = scores[ids] (never the bias), / their sum when renormalize (sum 0: weights 0),
 *             times routed_scaling
 *
 * Conventions (refimpl/moe.py, the float64 golden): ties go to the lower index, for experts and
 * for groups; a NaN (only a NaN bias can make one) ranks below -inf, as the golden's stable sort
 * of -x puts it last. Selection is a repeated arg-max, first index among equal values.
 * logits: (T, E) float32, finite or -inf (the wrapper refuses NaN and +inf), strides in elements
 * (any, both axes); bias: (E,) float32, stride in elements; weights (T, k) float32 and ids (T, k)
 * int32, C-contiguous.
 *
 * Arithmetic is float32: softmax subtracts the row max and divides each expf(x - m) by their sum
 * (the exps summed in double and rounded once, so the sum's error does not grow with E); a row of
 * all -inf gets scores 0. select = score + bias and the group scores are float32 additions. The
 * renormaliser is the float32 sum of the k chosen scores in rank order, then one IEEE division
 * each, then a float32 multiply by routed_scaling. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the per-call scratch (2 E + 2 n_group values) is not had.
 */
#include <stdlib.h>

#include "common.h"

enum { MOE_SOFTMAX = 0, MOE_SIGMOID = 1 };

/* a ranks strictly above b: larger, or a number where b is NaN (NaN ranks last). */
KP_INLINE int ranks_above(float a, float b) {
    return a > b || (b != b && a == a);
}

KP_INLINE void row_scores(const float *x, int64_t stride_e, int64_t E, int scoring, float *scores) {
    if (scoring == MOE_SIGMOID) {
        for (int64_t j = 0; j < E; j++) scores[j] = 1.0f / (1.0f + expf(-x[j * stride_e]));
        return;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < E; j++) {
        float v = x[j * stride_e];
        m = v > m ? v : m;
    }
    if (m == -INFINITY) {                           /* all -inf: scores 0, no -inf - -inf */
        for (int64_t j = 0; j < E; j++) scores[j] = 0.0f;
        return;
    }
    double l = 0.0;
    for (int64_t j = 0; j < E; j++) {
        float e = expf(x[j * stride_e] - m);
        scores[j] = e;
        l += e;
    }
    const float lf = (float)l;                      /* >= 1: the max's own exp is 1 */
    for (int64_t j = 0; j < E; j++) scores[j] /= lf;
}

/* The n_group group scores of select[0:E], groups of gsize; top2: the sum of the two largest (by
 * rank, so the first of a tie), else the largest. */
KP_INLINE void group_scores(const float *select, int64_t n_group, int64_t gsize, int top2,
                            float *gscore) {
    for (int64_t g = 0; g < n_group; g++) {
        const float *s = select + g * gsize;
        int64_t i1 = 0;
        for (int64_t j = 1; j < gsize; j++)
            if (ranks_above(s[j], s[i1])) i1 = j;
        if (!top2 || gsize < 2) {
            gscore[g] = s[i1];
            continue;
        }
        int64_t i2 = -1;
        for (int64_t j = 0; j < gsize; j++)
            if (j != i1 && (i2 < 0 || ranks_above(s[j], s[i2]))) i2 = j;
        gscore[g] = s[i1] + s[i2];
    }
}

/* Index of the best not-yet-taken value of v[0:n] (first among equals), and marks it taken. */
KP_INLINE int64_t take_best(const float *v, unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t j = 0; j < n; j++)
        if (!taken[j] && (best < 0 || ranks_above(v[j], v[best]))) best = j;
    taken[best] = 1;
    return best;
}

KP_EXPORT int moe_route_kernel(const float *logits, int64_t stride_t, int64_t stride_e,
                               const float *bias, int64_t stride_bias, int64_t T, int64_t E,
                               int64_t k, int scoring, int renormalize, int64_t n_group,
                               int64_t topk_group, float fill, float routed_scaling,
                               float *weights, int32_t *ids) {
    float *scores = malloc((size_t)(2 * E + n_group) * sizeof(float));
    unsigned char *taken = malloc((size_t)(E + n_group));
    if (!scores || !taken) {
        free(scores);
        free(taken);
        return KP_ERR_NOMEM;
    }
    float *select = scores + E, *gscore = select + E;
    unsigned char *gtaken = taken + E;
    const int64_t gsize = E / n_group;
    for (int64_t t = 0; t < T; t++) {
        row_scores(logits + t * stride_t, stride_e, E, scoring, scores);
        for (int64_t j = 0; j < E; j++) select[j] = bias ? scores[j] + bias[j * stride_bias] : scores[j];
        if (n_group > 1) {
            group_scores(select, n_group, gsize, bias != NULL, gscore);
            memset(gtaken, 0, (size_t)n_group);
            for (int64_t g = 0; g < topk_group; g++) take_best(gscore, gtaken, n_group);
            for (int64_t g = 0; g < n_group; g++)
                if (!gtaken[g])
                    for (int64_t j = g * gsize; j < (g + 1) * gsize; j++) select[j] = fill;
        }
        memset(taken, 0, (size_t)E);
        float *w = weights + t * k;
        int32_t *id = ids + t * k;
        for (int64_t r = 0; r < k; r++) {
            int64_t j = take_best(select, taken, E);
            id[r] = (int32_t)j;
            w[r] = scores[j];
        }
        if (renormalize) {
            float sum = 0.0f;
            for (int64_t r = 0; r < k; r++) sum += w[r];
            for (int64_t r = 0; r < k; r++) w[r] = sum > 0.0f ? w[r] / sum : 0.0f;
        }
        for (int64_t r = 0; r < k; r++) w[r] *= routed_scaling;
    }
    free(scores);
    free(taken);
    return KP_OK;
}
