/* moe_experts_grad.c — the backward of the fused mixture-of-experts layer over routed tokens, an expert at a time.
 *
 *   forward: out[t] = sum_j w[t, j] W2[e] act_r + the shared experts,  act_r = rnd(silu(G x_t) * (U x_t))
 *   dact0 = W2[e]^T dout_t;  dweights[t, j] = act_r . dact0;  dh = w (dact0 u silu'(g) | dact0 silu(g))
 *   dx[t] = sum_j W13[e]^T dh (+ the shared experts');  dW13[e] += dh (x) x_t;  dW2[e] += w dout_t (x) act_r
 *
 * rnd: act rounded to the activation dtype `dt` (the forward's production cast; fp32: none); the chain rule passes
 * through it as the identity (refimpl/moe_experts_grad.py). x, dout, dx: C-contiguous (T, D) of dtype `dt`
 * (KP_F32 / KP_F16 / KP_BF16), widened exactly on load; w13 (E, 2F, D), w2 (E, D, F), ws13 (S, 2Fs, D), ws2
 * (S, D, Fs) C-contiguous in `dt`; ids (T, k) int32 in [0, E) (the wrapper checks); weights (T, k) float32.
 * Outputs dweights (T, k), dw13, dw2, dws13, dws2 float32. Arithmetic float32: each dot product a float32 sum in
 * index order; each expert's weight gradients zeroed, then its slots (in slot order) summed into them; dx summed
 * in a float32 (T, D) buffer, expert by expert then the shared experts, rounded once. One thread.
 * Returns KP_OK, or KP_ERR_NOMEM when the scratch (T D + 3 max(F, Fs) + D floats) is not had.
 */
#include <stdlib.h>

#include "common.h"

/* One slot's backward: x row xt and dout row dy (dtype dt), routing weight wt, expert weights W13 (2F, D) and W2
 * (D, F) (dtype dt). Writes the slot's dx partial to dxs (D), adds its terms to g13 (2F, D) and g2 (D, F) (fp32),
 * returns dweights. scratch: 3F floats. */
static float slot_backward(const void *xt, const void *dy, float wt, const void *w13, const void *w2, int64_t D,
                           int64_t F, int dt, float *scratch, float *dxs, float *g13, float *g2) {
    float *act = scratch, *dh = scratch + F;
    float dwt = 0.0f;
    for (int64_t f = 0; f < F; f++) {
        float g = 0.0f, u = 0.0f, d0 = 0.0f;
        for (int64_t i = 0; i < D; i++) {
            const float xi = kp_load(xt, i, dt);
            g += xi * kp_load(w13, f * D + i, dt);
            u += xi * kp_load(w13, (F + f) * D + i, dt);
        }
        for (int64_t i = 0; i < D; i++) d0 += kp_load(dy, i, dt) * kp_load(w2, i * F + f, dt);
        const float s = 1.0f / (1.0f + expf(-g));
        const float sg = g * s;
        const float s1 = s * (1.0f + g * (1.0f - s));
        const float a = sg * u;
        uint16_t h;
        act[f] = dt == KP_F32 ? a : (kp_store(&h, 0, a, dt), kp_load(&h, 0, dt));
        dwt += act[f] * d0;
        const float dact = wt * d0;
        dh[f] = dact * u * s1; dh[F + f] = dact * sg;
    }
    for (int64_t i = 0; i < D; i++) {
        float acc = 0.0f;
        for (int64_t r = 0; r < 2 * F; r++) acc += dh[r] * kp_load(w13, r * D + i, dt);
        dxs[i] = acc;
    }
    for (int64_t r = 0; r < 2 * F; r++)
        for (int64_t i = 0; i < D; i++) g13[r * D + i] += dh[r] * kp_load(xt, i, dt);
    for (int64_t i = 0; i < D; i++) {
        const float wd = wt * kp_load(dy, i, dt);
        for (int64_t f = 0; f < F; f++) g2[i * F + f] += wd * act[f];
    }
    return dwt;
}

KP_EXPORT int moe_experts_grad_kernel(const void *x, const int32_t *ids, const float *weights, const void *w13,
                                      const void *w2, const void *ws13, const void *ws2, const void *dout, int64_t T,
                                      int64_t D, int64_t E, int64_t F, int64_t k, int64_t S, int64_t Fs, int dt,
                                      void *dx, float *dweights, float *dw13, float *dw2, float *dws13, float *dws2) {
    const int64_t fmax = F > Fs ? F : Fs, sz = kp_itemsize(dt);
    float *dxacc = malloc((size_t)(T * D + 3 * fmax + D) * sizeof(float));
    if (!dxacc) return KP_ERR_NOMEM;
    float *scratch = dxacc + T * D, *dxs = scratch + 3 * fmax;
    for (int64_t i = 0; i < T * D; i++) dxacc[i] = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        float *g13 = dw13 + e * 2 * F * D, *g2 = dw2 + e * D * F;
        int64_t n_e = 0;
        for (int64_t slot = 0; slot < T * k; slot++) n_e += ids[slot] == e;
        for (int64_t i = 0; i < 2 * F * D; i++) g13[i] = 0.0f;
        for (int64_t i = 0; i < D * F; i++) g2[i] = 0.0f;
        if (n_e == 0) continue;
        const char *we13 = (const char *)w13 + e * 2 * F * D * sz, *we2 = (const char *)w2 + e * D * F * sz;
        for (int64_t slot = 0; slot < T * k; slot++) {
            if (ids[slot] != e) continue;
            const int64_t t = slot / k;
            dweights[slot] = slot_backward((const char *)x + t * D * sz, (const char *)dout + t * D * sz,
                                           weights[slot], we13, we2, D, F, dt, scratch, dxs, g13, g2);
            for (int64_t i = 0; i < D; i++) dxacc[t * D + i] += dxs[i];
        }
    }
    for (int64_t s = 0; s < S; s++) {
        float *g13 = dws13 + s * 2 * Fs * D, *g2 = dws2 + s * D * Fs;
        for (int64_t i = 0; i < 2 * Fs * D; i++) g13[i] = 0.0f;
        for (int64_t i = 0; i < D * Fs; i++) g2[i] = 0.0f;
        const char *we13 = (const char *)ws13 + s * 2 * Fs * D * sz, *we2 = (const char *)ws2 + s * D * Fs * sz;
        for (int64_t t = 0; t < T; t++) {
            slot_backward((const char *)x + t * D * sz, (const char *)dout + t * D * sz, 1.0f, we13, we2, D, Fs, dt,
                          scratch, dxs, g13, g2);
            for (int64_t i = 0; i < D; i++) dxacc[t * D + i] += dxs[i];  /* the shared expert's */
        }
    }
    for (int64_t i = 0; i < T * D; i++) kp_store(dx, i, dxacc[i], dt);
    free(dxacc);
    return KP_OK;
}
